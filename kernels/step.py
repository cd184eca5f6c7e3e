"""A decode step's per-row inputs in one launch: the gathers and index arithmetic that open each step.

    ids, x, ropes, wrows, tabs = step_inputs(inp, tok, emb, hc, main, comp, offsets, windows, tables)
        inp (7, n) int64: the step's input rows (rollout_server.Runner._decode_eager: 0 ids, 1 positions,
            2 slots, 6 the row of tok whose token a row feeds, -1: its id in row 0); tok (m,) int64
        emb (V, D): the embedding; hc: the hyper-connection streams
        main, comp (2, P, half) fp32: RoPE tables (cos, sin) of positions [0, P) (model.Rope.precompute)
        offsets: ints r >= 1; windows: ints W >= 1; tables: block tables (slots, cols), integer
        -> ids (n,) int64: the fed tokens
           x (1, n, hc, D): each id's embedding row once a stream
           ropes (1 + len(offsets), 2, n, half) fp32: [0] main at pos, [1 + j] comp at max(pos + 1 - r_j, 0)
           wrows (len(windows), n) int64: slot * W + pos % W
           tabs: each block table's rows of the slots (n, cols)

step_inputs_ref is its torch twin (the ~20 index, gather and elementwise kernels it replaces: on an H200
each took 1-2 us of a batch-1 step); the values are copies either way, so the bits are the same.
"""
from __future__ import annotations

import torch

from .fp8_gemm import pdl, pdl_wait, pow2, triton, use_triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _table_rows(T, O, slot, i, C: tl.constexpr, BC: tl.constexpr):
        c = tl.arange(0, BC)
        for c0 in range(0, C, BC):
            m = c0 + c < C
            tl.store(O + i * C + c0 + c, tl.load(T + slot * C + c0 + c, mask=m), mask=m)

    @triton.jit
    def _step_inputs_kernel(INP, TOK, EMB, stride_e, X, IDS, MAIN, COMP, P, OFFS, ROPES, WINS, WROWS, T0, O0, T1, O1,
                            n, C0: tl.constexpr, C1: tl.constexpr, D: tl.constexpr, HC: tl.constexpr,
                            HALF: tl.constexpr, HP: tl.constexpr, NJ: tl.constexpr, NW: tl.constexpr,
                            BD: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr = False):
        """Programs (i, part): row i of the ids and streams (part 0), of the RoPE and window rows (1), of the block
        tables (2; T1 None: one table). Each part's loads wait on each other, not on the other parts'."""
        pdl_wait(PDL)
        i, part = tl.program_id(0), tl.program_id(1)
        if part == 0:
            src = tl.load(INP + 6 * n + i)
            t = tl.where(src >= 0, tl.load(TOK + tl.maximum(src, 0)), tl.load(INP + i))
            tl.store(IDS + i, t)
            d = tl.arange(0, BD)
            for d0 in range(0, D, BD):
                m = d0 + d < D
                row = tl.load(EMB + t * stride_e + d0 + d, mask=m)
                for h in tl.static_range(HC):
                    tl.store(X + (i * HC + h) * D + d0 + d, row, mask=m)
        elif part == 1:
            pos = tl.load(INP + n + i)
            c = tl.arange(0, HP)
            mc = c < HALF
            for s in tl.static_range(2):  # cos, sin
                tl.store(ROPES + (s * n + i) * HALF + c, tl.load(MAIN + (s * P + pos) * HALF + c, mask=mc), mask=mc)
            for j in range(NJ - 1):
                p = tl.maximum(pos + 1 - tl.load(OFFS + j), 0)
                for s in tl.static_range(2):
                    tl.store(ROPES + (((j + 1) * 2 + s) * n + i) * HALF + c,
                             tl.load(COMP + (s * P + p) * HALF + c, mask=mc), mask=mc)
            if NW > 0:
                slot = tl.load(INP + 2 * n + i)
                for w in range(NW):
                    win = tl.load(WINS + w)
                    tl.store(WROWS + w * n + i, slot * win + pos % win)
        else:
            slot = tl.load(INP + 2 * n + i)
            if T0 is not None:
                _table_rows(T0, O0, slot, i, C0, BC)
            if T1 is not None:
                _table_rows(T1, O1, slot, i, C1, BC)


def step_inputs_ref(inp, tok, emb, hc: int, main, comp, offsets, windows, tables):
    """step_inputs in torch ops (CPU, and the twin its test compares)."""
    pos, slots = inp[1], inp[2]
    ids = torch.where(inp[6] >= 0, tok[inp[6].clamp(min=0)], inp[0])
    x = emb[ids][None].unsqueeze(2).expand(-1, -1, hc, -1).contiguous()
    rows = [pos] + [(pos + 1 - r).clamp(min=0) for r in offsets]
    ropes = torch.stack([(main if j == 0 else comp)[:, p] for j, p in enumerate(rows)])
    wrows = torch.stack([slots * w + pos % w for w in windows]) if windows else \
        torch.empty(0, len(pos), dtype=torch.int64, device=inp.device)
    return ids, x, ropes, wrows, [t[slots] for t in tables]


_CONSTS = {}


def _consts(vals, dev) -> torch.Tensor:
    """vals as an int64 device tensor, made once (a CUDA graph's capture cannot copy from the host; the eager
    warm-up step before it makes them)."""
    key = (tuple(vals), dev)
    if key not in _CONSTS:
        _CONSTS[key] = torch.tensor(list(vals) or [0], dtype=torch.int64, device=dev)
    return _CONSTS[key]


def step_inputs(inp, tok, emb, hc: int, main, comp, offsets, windows, tables):
    """See the module docstring: one launch on GPUs (and under the interpreter), step_inputs_ref elsewhere. At
    most two block tables."""
    assert main.shape == comp.shape and main.shape[0] == 2 and inp.shape[0] == 7 and len(tables) <= 2, \
        f"step_inputs: inp {tuple(inp.shape)}, RoPE tables {tuple(main.shape)} / {tuple(comp.shape)}, " \
        f"{len(tables)} block tables"
    if not use_triton(inp):
        return step_inputs_ref(inp, tok, emb, hc, main, comp, offsets, windows, tables)
    n, dev = inp.shape[1], inp.device
    D = emb.shape[1]
    assert emb.stride(1) == 1, f"step_inputs: embedding strides {emb.stride()}"
    _, P, half = main.shape
    inp, main, comp = inp.contiguous(), main.contiguous(), comp.contiguous()
    ids = torch.empty(n, dtype=torch.int64, device=dev)
    x = torch.empty(1, n, hc, D, dtype=emb.dtype, device=dev)
    ropes = torch.empty(1 + len(offsets), 2, n, half, dtype=main.dtype, device=dev)
    wrows = torch.empty(len(windows), n, dtype=torch.int64, device=dev)
    offs, wins = _consts(offsets, dev), _consts(windows, dev)
    tabs = [torch.empty(n, t.shape[1], dtype=t.dtype, device=dev) for t in tables]
    targs, cols = [], []
    for k in range(2):
        targs += [tables[k].contiguous(), tabs[k]] if k < len(tables) else [None, None]
        cols.append(tables[k].shape[1] if k < len(tables) else 0)
    if n:
        _step_inputs_kernel[(n, 3 if tables else 2)](
            inp, tok, emb, emb.stride(0), x, ids, main, comp, P, offs, ropes, wins, wrows, *targs, n, C0=cols[0],
            C1=cols[1], D=D, HC=hc, HALF=half, HP=pow2(half), NJ=1 + len(offsets), NW=len(windows),
            BD=min(pow2(D), 1024), BC=256, num_warps=4, **pdl(inp))
    return ids, x, ropes, wrows, tabs
