"""Mixtral-style mixtures of experts (a llama file with ``llama.expert_count`` > 1), as
candle's quantized_llama runs them (``MlpOrMoe::MoE``), for every engine that does: the
routing of each token and the weighted sum of its experts' outputs; the engines bring the
experts' own matmuls."""

from __future__ import annotations

from collections.abc import Callable, Container

import torch


def route(router_logits: torch.Tensor, n_used: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (row of ``router_logits``, ``(rows, n_expert)``): the softmax over the
    experts, the ``n_used`` largest weights (the lower index first on ties: candle's stable
    descending sort) and each over their sum (a running float32 sum in that order). Returns
    ``(chosen, weights)``, both ``(rows, n_used)``."""
    routing = torch.softmax(router_logits.float(), dim=-1)
    chosen = torch.sort(routing, dim=-1, descending=True, stable=True).indices[:, :n_used]
    weights = routing.gather(1, chosen)
    total = torch.zeros_like(weights[:, 0])
    for j in range(n_used):
        total = total + weights[:, j]
    return chosen, weights / total[:, None]


def combine(xs: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
            experts: list[Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:  # fmt: skip
    """``sum`` over each row's chosen experts of weight x the expert's output, built expert by
    expert as candle does (``index_add`` of the rows that chose it, in row order)."""
    ys = torch.zeros_like(xs)
    if xs.shape[0] == 1:  # one token (a decode step): its chosen experts only, in index order
        for slot in torch.argsort(chosen[0]).tolist():
            e = int(chosen[0, slot])
            ys = ys + (experts[e](xs) * weights[0, slot]).to(ys.dtype)
        return ys
    for e, expert in enumerate(experts):
        rows, slot = torch.nonzero(chosen == e, as_tuple=True)
        if rows.numel() == 0:
            continue
        out = expert(xs.index_select(0, rows)) * weights[rows, slot][:, None]
        ys = ys.index_add(0, rows, out.to(ys.dtype))
    return ys


Rows = Callable[[torch.Tensor], torch.Tensor]  # rows in, rows out (a matmul, an expert)


def ffn(a: torch.Tensor, router: Rows, experts: list[Rows], n_used: int) -> torch.Tensor:
    """The FFN of the normed rows ``a``: each row's ``n_used`` experts by the router's output
    (``route``), their weighted sum (``combine``)."""
    chosen, weights = route(router(a), n_used)
    return combine(a, chosen, weights, experts)


def expert_matrices(get: Callable[[str], object], p: str, n_expert: int,
                    names: Container[str]) -> list[tuple[object, object, object]]:  # fmt: skip
    """Each expert's (gate, up, down) matrices of layer ``p`` as ``get`` gives tensors:
    llama.cpp's stacked ``ffn_*_exps`` (one 3-D tensor each, ``unstack``-ed: views) where
    ``names`` holds them, else the older files' one tensor an expert (``ffn_gate.{i}``)."""
    if f"{p}.ffn_gate_exps.weight" in names:
        gate, up, down = (get(f"{p}.ffn_{n}_exps.weight").unstack() for n in ("gate", "up", "down"))
    else:
        gate, up, down = ([get(f"{p}.ffn_{n}.{e}.weight") for e in range(n_expert)]
                          for n in ("gate", "up", "down"))  # fmt: skip
    return list(zip(gate, up, down, strict=True))
