"""The floor a CUDA graph puts under a chain of dependent kernels, on one GPU: microseconds a kernel for a chain of
N tiny Triton kernels, each reading what the one before it wrote, with and without programmatic dependent launch
(PDL, as the engine's kernels launch), at a few grid sizes.

    python bench/launch_floor.py [--kernels 320] [--grids 1,132,1056]

The engine's decode step is one such chain (plus a side stream): `bench/rollout.py --profile 1:fp8` prints its
kernels a step. Kernels a step times this floor is the part of the step that no kernel's own work can remove;
only fewer kernels (fusion, a persistent kernel) can.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.fp8_linear import graph_us  # noqa: E402
from kernels.fp8_gemm import pdl, pdl_wait  # noqa: E402

BLOCK = 128  # fp32 values a program moves


@triton.jit
def _link(X, Y, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Y = X + 1 over n values, BLOCK a program (under PDL after the kernel before has finished)."""
    pdl_wait(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(Y + i, tl.load(X + i, mask=m) + 1.0, mask=m)


def chain_us(grid: int, kernels: int, use_pdl: bool, iters: int = 20) -> float:
    """Microseconds a kernel of a CUDA graph holding `kernels` dependent _link launches of `grid` programs each
    (graph_us: captured, replayed iters times); first checks, eagerly, that every launch ran, in order."""
    n = grid * BLOCK
    bufs = [torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")]
    meta = pdl(bufs[0]) if use_pdl else {"PDL": False}

    def run():
        for i in range(kernels):
            _link[(grid,)](bufs[i % 2], bufs[(i + 1) % 2], n, BLOCK=BLOCK, **meta)
    run()
    got = bufs[kernels % 2]
    if not bool((got == kernels).all()):  # each link adds 1 to what the one before wrote
        raise RuntimeError(f"grid {grid}: the chain of {kernels} kernels gave {got.min().item()}..{got.max().item()}")
    return graph_us([run], iters) / kernels


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=320, help="kernels a chain (the engine's batch-1 step: ~310)")
    ap.add_argument("--grids", default="1,132,1056", help="programs a kernel, comma-separated")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/launch_floor.py needs a GPU")
    grids = [int(g) for g in args.grids.split(",") if g]
    if args.kernels < 1 or not grids or min(grids) < 1:
        ap.error("--kernels and every --grids entry must be >= 1")
    has_pdl = pdl(torch.empty(1, device="cuda"))["PDL"]
    print(f"device {torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs;"
          f" a CUDA graph of {args.kernels} dependent kernels, {BLOCK} fp32 values a program; PDL "
          f"{'available' if has_pdl else 'not available (measured without it only)'}")
    for grid in grids:
        cells = [f"{'PDL' if p else 'no PDL'} {chain_us(grid, args.kernels, p):.2f}" for p in
                 ((False, True) if has_pdl else (False,))]
        print(f"grid {grid:5d} programs: us a kernel  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
