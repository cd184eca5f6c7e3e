"""The floor a CUDA graph puts under a chain of dependent kernels, on one GPU: microseconds a kernel for a chain of
N tiny Triton kernels, each reading what the one before it wrote, with and without programmatic dependent launch
(PDL, as the engine's kernels launch), at a few grid sizes; against it, one persistent kernel whose programs meet
at a grid barrier instead of a kernel boundary. With --weights-mb each link (kernel or phase) also streams its
share of that many MB of weights, as a decode step's GEMVs do: a kernel loads its slab before its PDL wait, the
persistent kernel the next phases' slabs before each barrier (--ahead). --async-ahead: the same persistent kernel
written in Gluon (Triton's lower-level dialect, NVIDIA sm80+), its slabs copied into shared memory by asynchronous
copies (cp.async) issued that many phases early, so they stay in flight while the program waits at the barriers,
which loads into registers do not.

    python bench/launch_floor.py [--kernels 320] [--grids 1,132,1056] [--persistent 132,264] [--weights-mb 1360]
                                 [--ahead 1,2] [--async-ahead 2,3,4]

The engine's decode step is one such chain (plus a side stream): `bench/rollout.py --profile 1:fp8` prints its
kernels a step. Kernels a step times this floor is the part of the step that no kernel's own work can remove;
only fewer kernels (fusion, a persistent kernel) can.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.fp8_linear import graph_us  # noqa: E402
from kernels.fp8_gemm import pdl, pdl_wait  # noqa: E402

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # a Triton without Gluon: --async-ahead is then refused
    gluon = None

BLOCK = 128  # fp32 values a program moves


@triton.jit
def _slab(W, link, pid, G, SLAB: tl.constexpr):
    """A program's SLAB weight bytes for one link (a kernel or a phase), as loaded (uint8)."""
    return tl.load(W + (link * G + pid).to(tl.int64) * SLAB + tl.arange(0, SLAB))


@triton.jit
def _link(X, Y, W, n, zero, BLOCK: tl.constexpr, SLAB: tl.constexpr, PDL: tl.constexpr = False):
    """Y = X + 1 over n values, BLOCK a program (under PDL after the kernel before has finished); the program's
    SLAB bytes of W are loaded first (they need nothing from the kernel before) and their sum added times `zero`,
    so they must be read."""
    pid = tl.program_id(0)
    w = tl.sum(_slab(W, 0, pid, 0, SLAB).to(tl.float32), 0)
    pdl_wait(PDL)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(Y + i, tl.load(X + i, mask=m) + 1.0 + w * zero, mask=m)


# polls a grid barrier waits at most: past them (seconds) a program gives up, sets CNT[1] (the host's check then
# names the grid as not all resident at once) and waits at no later barrier, so the run ends instead of hanging
SPIN = tl.constexpr(1 << 21)


@triton.jit
def _arrive_wait(CNT, target, stuck):
    """A grid barrier: arrive (release add on CNT[0]), then poll (acquire) until CNT[0] reaches target, at most SPIN
    times; returns stuck, 1 once a wait gave up (CNT[1] set to 1), and a stuck program no longer waits."""
    tl.atomic_add(CNT, 1, sem="release")
    got = tl.atomic_add(CNT, 0, sem="acquire")
    tries = 0
    while (got < target) & (tries < SPIN) & (stuck == 0):
        got = tl.atomic_add(CNT, 0, sem="acquire")
        tries += 1
    if got < target:
        tl.store(CNT + 1, 1)
        stuck = 1
    return stuck


@triton.jit
def _phases(X, CNT, W, phases, zero, BLOCK: tl.constexpr, SLAB: tl.constexpr, AHEAD: tl.constexpr):
    """One persistent kernel of G programs, `phases` steps: in step p each program adds 1 to what the next program
    (pid + 1 mod G) wrote in step p - 1 (double-buffered), plus its step-p weight slab's sum times `zero`, then
    all G programs meet at a grid barrier (a release add on one counter, acquire polls until it reaches G (p +
    1)). Each program's slabs are loaded AHEAD (1-3) steps before they are summed, so up to AHEAD steps' weight
    loads are in flight across the barriers (W holds AHEAD slabs past the last step). The grid must be resident."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    i = tl.arange(0, BLOCK)
    stuck = 0
    r0 = _slab(W, 0, pid, G, SLAB)
    if AHEAD >= 2:
        r1 = _slab(W, 1, pid, G, SLAB)
    if AHEAD >= 3:
        r2 = _slab(W, 2, pid, G, SLAB)
    for p in range(phases):
        w = tl.sum(r0.to(tl.float32), 0)
        src = X + (p % 2) * G * BLOCK + ((pid + 1) % G) * BLOCK
        dst = X + ((p + 1) % 2) * G * BLOCK + pid * BLOCK
        tl.store(dst + i, tl.load(src + i) + 1.0 + w * zero)
        if AHEAD == 1:
            r0 = _slab(W, p + 1, pid, G, SLAB)
        elif AHEAD == 2:
            r0 = r1
            r1 = _slab(W, p + 2, pid, G, SLAB)
        else:
            r0 = r1
            r1 = r2
            r2 = _slab(W, p + 3, pid, G, SLAB)
        tl.debug_barrier()  # the program's stores issued before its arrival
        stuck = _arrive_wait(CNT, G * (p + 1), stuck)


if gluon is not None:
    @gluon.jit
    def _copy_slab(bufs, W, link, pid, G, offs, SLAB: gl.constexpr, STAGES: gl.constexpr):
        """Start the asynchronous copy of a program's slab of `link` into shared buffer link % STAGES, as one
        commit group."""
        async_copy.async_copy_global_to_shared(bufs.index(link % STAGES),
                                               W + (link * G + pid).to(gl.int64) * SLAB + offs)
        async_copy.commit_group()

    @gluon.jit
    def _phases_async(X, CNT, W, phases, zero, BLOCK: gl.constexpr, SLAB: gl.constexpr, STAGES: gl.constexpr):
        """_phases with each program's slabs in STAGES shared-memory buffers filled by cp.async, STAGES phases
        before they are summed: a phase waits for its own copy group only (the later ones stay in flight through
        the barrier), sums the slab, and starts the copy of phase p + STAGES into the buffer it has just read."""
        pid = gl.program_id(0)
        G = gl.num_programs(0)
        NW: gl.constexpr = gl.num_warps()
        lay: gl.constexpr = gl.BlockedLayout([16], [32], [NW], [0])  # 16 bytes a thread a copy
        xl: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        bufs = gl.allocate_shared_memory(gl.uint8, [STAGES, SLAB], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        offs = gl.arange(0, SLAB, layout=lay)
        i = gl.arange(0, BLOCK, layout=xl)
        stuck = 0
        for s in gl.static_range(STAGES):
            _copy_slab(bufs, W, s, pid, G, offs, SLAB, STAGES)
        for p in range(phases):
            async_copy.wait_group(STAGES - 1)  # this thread's copies of phase p have landed
            gl.thread_barrier()  # ... and every other thread's
            w = gl.sum(bufs.index(p % STAGES).load(lay).to(gl.float32), 0)
            gl.thread_barrier()  # every thread has read the buffer before it is refilled
            _copy_slab(bufs, W, p + STAGES, pid, G, offs, SLAB, STAGES)
            src = X + (p % 2) * G * BLOCK + ((pid + 1) % G) * BLOCK
            dst = X + ((p + 1) % 2) * G * BLOCK + pid * BLOCK
            gl.store(dst + i, gl.load(src + i) + 1.0 + w * zero)
            gl.thread_barrier()  # the program's stores issued before its arrival
            stuck = _arrive_wait(CNT, G * (p + 1), stuck)
        async_copy.wait_group(0)


def _warps(slab: int) -> int:
    return 8 if slab >= 16384 else 4


def _weights(grid: int, links: int, slab: int) -> torch.Tensor:
    return torch.randint(0, 256, (links * grid * slab,), dtype=torch.uint8, device="cuda")


def chain_us(grid: int, kernels: int, use_pdl: bool, slab: int, iters: int = 20) -> float:
    """Microseconds a kernel of a CUDA graph holding `kernels` dependent _link launches of `grid` programs each
    (graph_us: captured, replayed iters times), each program also reading `slab` weight bytes of its own; first
    checks, eagerly, that every launch ran, in order."""
    n = grid * BLOCK
    bufs = [torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")]
    w = _weights(grid, kernels, slab)
    meta = pdl(bufs[0]) if use_pdl else {"PDL": False}

    def run():
        for i in range(kernels):
            _link[(grid,)](bufs[i % 2], bufs[(i + 1) % 2], w[i * grid * slab:], n, 0.0, BLOCK=BLOCK, SLAB=slab,
                           num_warps=_warps(slab), **meta)
    run()
    got = bufs[kernels % 2]
    if not bool((got == kernels).all()):  # each link adds 1 to what the one before wrote
        raise RuntimeError(f"grid {grid}: the chain of {kernels} kernels gave {got.min().item()}..{got.max().item()}")
    return graph_us([run], iters) / kernels


def persistent_us(grid: int, phases: int, slab: int, ahead: int = 1, iters: int = 20, copies: bool = False) -> float:
    """Microseconds a phase of one _phases kernel (`grid` programs, `phases` grid barriers, `slab` weight bytes a
    program a phase, loaded `ahead` phases early; copies: _phases_async, the slabs copied into shared memory) under
    a CUDA graph, the counter zeroed before each launch; first checks, eagerly, that every phase saw the one
    before."""
    x = torch.zeros(2 * grid * BLOCK, device="cuda")
    cnt = torch.zeros(2, dtype=torch.int32, device="cuda")  # the barrier's count, the gave-up flag
    w = _weights(grid, phases + ahead, slab)

    def run():
        cnt.zero_()
        if copies:
            _phases_async[(grid,)](x, cnt, w, phases, 0.0, BLOCK=BLOCK, SLAB=slab, STAGES=ahead, num_warps=8)
        else:
            _phases[(grid,)](x, cnt, w, phases, 0.0, BLOCK=BLOCK, SLAB=slab, AHEAD=ahead, num_warps=_warps(slab))
    run()
    if cnt[1].item():
        raise RuntimeError(f"grid {grid}: a grid barrier did not open within {SPIN.value:,} polls: not all {grid} programs "
                           "were resident at once")
    got = x[(phases % 2) * grid * BLOCK:][:grid * BLOCK]
    if not bool((got == phases).all()):
        raise RuntimeError(f"grid {grid}: {phases} barrier phases gave {got.min().item()}..{got.max().item()}")
    return graph_us([run], iters) / phases


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=320, help="kernels a chain (the engine's batch-1 step: ~310)")
    ap.add_argument("--grids", default="1,132,1056", help="programs a kernel, comma-separated")
    ap.add_argument("--persistent", default="132,264", help="programs of the persistent kernel (one grid barrier a "
                    "phase, --kernels phases), comma-separated; at most 2 a SM (they must all be resident)")
    ap.add_argument("--weights-mb", type=float, default=0.0, help="MB of weights the whole chain streams (the "
                    "batch-1 FP8 step: ~1,360), shared evenly by its links and programs, a power of two each")
    ap.add_argument("--ahead", default="1,2", help="the persistent kernel's weight slabs loaded this many phases "
                    "before they are used (1-3), comma-separated")
    ap.add_argument("--async-ahead", default="", help="also the Gluon persistent kernel, its slabs copied into "
                    "shared memory this many phases early (1-8; at most 192 KB of buffers a program), "
                    "comma-separated (NVIDIA sm80+)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/launch_floor.py needs a GPU")
    try:
        grids = [int(g) for g in args.grids.split(",") if g]
        pgrids = [int(g) for g in args.persistent.split(",") if g]
        aheads = [int(a) for a in args.ahead.split(",") if a]
        copy_aheads = [int(a) for a in args.async_ahead.split(",") if a]
    except ValueError as e:
        ap.error(f"--grids / --persistent / --ahead / --async-ahead: comma-separated integers ({e})")
    if pgrids and (not aheads or not set(aheads) <= {1, 2, 3}):
        ap.error("--ahead: 1, 2 or 3 phases, comma-separated")
    if copy_aheads and not set(copy_aheads) <= set(range(1, 9)):
        ap.error("--async-ahead: 1 to 8 phases, comma-separated")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if args.kernels < 1 or not grids + pgrids or min(grids + pgrids) < 1 or args.weights_mb < 0:
        ap.error("--kernels and every --grids / --persistent entry must be >= 1, --weights-mb >= 0")
    if copy_aheads and (gluon is None or torch.version.hip or torch.cuda.get_device_capability()[0] < 8):
        ap.error("--async-ahead: needs Triton's Gluon and an NVIDIA GPU of compute capability 8.0 or later")
    if pgrids and max(pgrids) > 2 * sms:
        ap.error(f"--persistent: at most {2 * sms} programs (2 a SM), or they may not all be resident")
    has_pdl = pdl(torch.empty(1, device="cuda"))["PDL"]
    copy = None
    if args.weights_mb:
        from bench.rollout import copy_bandwidth
        copy = copy_bandwidth() / 1e9
    print(f"device {torch.cuda.get_device_name()}, {sms} SMs; a CUDA graph of {args.kernels} dependent links, "
          f"{BLOCK} fp32 values a program; PDL {'available' if has_pdl else 'not available (measured without it only)'}"
          + (f"; weights {args.weights_mb:,.0f} MB a chain; copy {copy:,.0f} GB/s" if copy else ""))

    def slab_of(grid: int) -> int:  # 16 B .. 64 KB a program (registers); the MB printed are what was read
        share = args.weights_mb * 1e6 / args.kernels / grid
        return 1 << min(16, max(4, round(math.log2(share)))) if share else 16

    def cell(name: str, us: float, grid: int, slab: int) -> str:
        if not args.weights_mb:
            return f"{name} {us:.2f}"
        mb = args.kernels * grid * slab / 1e6
        gbs = mb * 1e3 / (us * args.kernels)
        return f"{name} {us:.2f} ({mb:,.0f} MB, {gbs:,.0f} GB/s = {100 * gbs / copy:.0f}% of copy)"

    for grid in grids:
        slab = slab_of(grid)
        cells = [cell("PDL" if p else "no PDL", chain_us(grid, args.kernels, p, slab), grid, slab)
                 for p in ((False, True) if has_pdl else (False,))]
        print(f"grid {grid:5d} programs, {slab} B a program: us a kernel  " + "  ".join(cells), flush=True)
    for grid in pgrids:  # (at most 64 KB of slabs a program in flight: past that registers spill, and fewer
        # programs fit an SM than the grid barrier needs resident)
        slab = slab_of(grid)
        cells = [cell(f"{a} ahead", persistent_us(grid, args.kernels, slab, a), grid, slab) if slab * a <= 65536
                 else f"{a} ahead skipped ({a} x {slab} B in flight)" for a in aheads]
        # (one program an SM: two may not both get their shared memory, and the barrier would then never open)
        cells += [cell(f"{a} copies ahead", persistent_us(grid, args.kernels, slab, a, copies=True), grid, slab)
                  if grid <= sms and slab * a <= 196608
                  else f"{a} copies ahead skipped ({grid} programs, {a} x {slab} B of shared memory)"
                  for a in copy_aheads]
        print(f"persistent {grid:5d} programs, {slab} B a program: us a phase  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
