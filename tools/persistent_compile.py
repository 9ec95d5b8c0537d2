"""Build the persistent decode kernel with nvcc on any machine, no GPU needed: whether it
compiles, and its registers, stack frame and spills, for a model's macros and A/B variants.

    python tools/persistent_compile.py [--model F] [--variants V [V ...]] [--arch sm_90]
        [--sms 132] [--optin 232448] [--max-seq N]

The macros are ``persistent.kernel_macros``' for the model (default: the embedded one) on a GPU
of ``--sms`` SMs and ``--optin`` bytes of shared memory a block (the H200's); a variant is a
comma-separated list of macros that override them (``OUT_Q8X=0,Q41_WIDE=0``; ``default``: none).
The GPU machine builds the same source with NVRTC at first use: this catches a kernel that
does not compile, or that spills, before a device call is spent on it. Exits 1 when a build
fails or spills.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from qlib import models
from qlib.gguf import Content
from qlib.llama.checks import context_length
from qlib.llama.config import LlamaConfig
from qlib.quants.cuda import persistent


def model_macros(path: Path, args: argparse.Namespace) -> dict[str, object]:
    """The kernel's macros for the GGUF file at ``path`` (its shapes and types only)."""
    with open(path, "rb") as f:
        content = Content.read(f)
    config = LlamaConfig.from_metadata(content.metadata)
    infos = content.tensor_infos
    layers = [{n: infos[f"blk.{i}.{n}.weight"] for n in persistent.MATRICES}
              for i in range(config.block_count)]  # fmt: skip
    output = infos.get("output.weight", infos["token_embd.weight"])
    max_seq = args.max_seq or context_length(content.metadata)  # (the fast engine's default)
    macros, _ = persistent.kernel_macros(config, layers, output, max_seq, blocks=args.sms,
                                         optin=args.optin, major=int(args.arch[3:-1]))  # fmt: skip
    return macros


def build(macros: dict[str, object], arch: str) -> tuple[bool, str]:
    """nvcc's build of persistent.cu with ``macros``: (ok: built without spills, ptxas' summary)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["nvcc", f"-arch={arch}", "-std=c++17", "--expt-relaxed-constexpr", "-cubin",
               "-Xptxas", "-v", "-o", str(Path(tmp) / "k.cubin"), "-x", "cu",
               *[f"-D{k}={v}" for k, v in macros.items()], str(persistent.SOURCE)]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode:
        errors = [line for line in log.splitlines() if "error" in line]
        return False, "does not compile: " + "; ".join(errors[:3])
    regs = re.search(r"Used (\d+) registers", log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill", log)
    if not (regs and frame):
        return False, "no ptxas summary in nvcc's output"
    stack, spills = int(frame.group(1)), int(frame.group(2)) + int(frame.group(3))
    summary = f"{regs.group(1)} registers, {stack} bytes stack, {spills} bytes spilled"
    return stack == 0 and spills == 0, summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="GGUF file (default: the embedded model)")
    ap.add_argument("--variants", nargs="+", default=["default"])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--optin", type=int, default=232448, help="shared memory a block, bytes")
    ap.add_argument("--max-seq", type=int,
                    help="positions of the KV cache (default: the file's llama.context_length, "
                    "as the fast engine holds)")  # fmt: skip
    args = ap.parse_args()
    if not shutil.which("nvcc"):
        print("nvcc is not on PATH: nothing to build", file=sys.stderr)
        return 2
    base = model_macros(args.model or models.path(), args)
    failed = 0
    for variant in args.variants:
        given = persistent.env_macros("" if variant == "default" else variant)
        ok, summary = build({**base, **given}, args.arch)
        failed += not ok
        print(f"{variant:32s} {'ok' if ok else 'FAILED'}: {summary}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
