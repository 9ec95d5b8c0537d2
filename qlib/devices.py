"""Devices: everywhere in qlib a device is a string ("cpu", "cuda", "mps") or a torch.device."""

from __future__ import annotations

import torch

DeviceLike = str | torch.device


def as_device(device: DeviceLike | None) -> torch.device:
    """Normalize a device argument; raises a clear error for one that is not available."""
    if device is None:
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but CUDA is not available here")
    if dev.type == "mps" and not (
        getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()
    ):
        raise RuntimeError(f"device {device!r} requested but MPS is not available here")
    return dev


def gpu_device() -> str | None:
    """The first GPU device available ("cuda" or "mps"), or None on a CPU-only machine."""
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return None


def synchronize(device: DeviceLike) -> None:
    """Wait for queued work on ``device`` (no-op on CPU)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()
