"""How much of the decode step a part holds: bench/rollout.py's run with that part taken out of the step.

    python bench/ablate.py --without moe,linears --batches 1,64 --bf16-batches 64 --long-batch 0 --hf-batch 0

--without names the parts to take out; the other arguments go to bench/rollout.py. `linears`: the FP8 engine's
block-scaled linears (`fp8_linear`, `fp8_gemm`, `fp8_linear_grouped`, with the activation quantization inside
them; the BF16 engine's linears stay). `moe`: the routed and shared experts (`fused_moe`, both engines). Each is
replaced by a function that returns a cached zero tensor of its output's shape, so its kernels never run. The
tokens are then meaningless and only the step times count: the full step's time minus the step's time without a
part is what that part costs on the step's critical path, overlap and programmatic dependent launch included
(a profile with KERNELS_PDL=0 gives each kernel's own time instead).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import rollout  # noqa: E402
import rollout_server  # noqa: E402

PARTS = ("linears", "moe")
_ZEROS: dict = {}


def zeros(shape, dtype, device) -> torch.Tensor:
    """One zero tensor per (shape, dtype, device), made once and handed out again (no kernel per call)."""
    key = (tuple(shape), dtype, str(device))
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(shape, dtype=dtype, device=device)
    return _ZEROS[key]


def take_out(parts) -> None:
    """Replace the engine's functions of the named parts (rollout_server's module names, which Engine calls)."""
    if "linears" in parts:
        rollout_server.fp8_linear = lambda x, wq, sw: zeros((*x.shape[:-1], wq.shape[0]), x.dtype, x.device)
        rollout_server.fp8_gemm = lambda xq, sx, wq, sw, out_dtype=torch.bfloat16, **kw: zeros(
            (xq.shape[0], wq.shape[0]), out_dtype, xq.device)
        rollout_server.fp8_linear_grouped = lambda x, wq, sw, fused=True: zeros(
            (*x.shape[:-1], wq.shape[0] // x.shape[-2]), x.dtype, x.device)
    if "moe" in parts:
        rollout_server.fused_moe = lambda x, *args, **kw: zeros(tuple(x.shape), x.dtype, x.device)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--without", default="", help=f"parts to take out, comma-separated, of {', '.join(PARTS)} "
                    "('' for none: the plain run)")
    args, rest = ap.parse_known_args(argv)
    parts = [p.strip() for p in args.without.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--without {args.without!r}: unknown part(s) {', '.join(bad)}; the parts are {', '.join(PARTS)}")
    take_out(parts)
    print(f"without: {', '.join(parts) or 'nothing'}", flush=True)
    rollout.main(rest)


if __name__ == "__main__":
    main()
