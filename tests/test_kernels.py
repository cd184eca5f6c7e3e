"""Kernels: torch references against the model's own math (CPU, always); Triton kernels against the references
under Triton's interpreter (CPU, when triton is installed) and on a GPU (when one is present)."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from kernels.attention import decode_attention_ref, index_scores_ref, window_positions
from kernels.fp8_gemm import act_quant_ref, fp8_gemm_ref, fp8_linear
from kernels.moe import fused_moe_ref, moe_align
from kernels.quant import dequant_fp8_block, quant_fp8_block
from model.model import attend

G = torch.Generator().manual_seed(0)


def test_fp8_linear_reference_is_blockwise_w8a8():
    x, w = torch.randn(5, 256, generator=G), torch.randn(384, 256, generator=G) * 0.05
    wq, ws = quant_fp8_block(w, torch.float8_e4m3fn, scale_fmt="fp32")
    xq, sx = act_quant_ref(x, torch.float8_e4m3fn)
    assert sx.shape == (5, 2) and torch.allclose(sx, x.view(5, 2, 128).abs().amax(-1) / 448)
    want = (xq.float() * sx.repeat_interleave(128, 1)) @ dequant_fp8_block(wq, ws).T
    assert torch.allclose(fp8_gemm_ref(xq, sx, wq, ws), want, atol=1e-5)
    y = fp8_linear(x, wq, ws)
    assert ((y - x @ w.T).norm() / (x @ w.T).norm()) < 0.06


def test_decode_attention_reference_matches_attend():
    B, H, d, W, BE = 3, 4, 32, 8, 4
    q, win = torch.randn(B, H, d, generator=G), torch.randn(6, W, d, generator=G)
    pool, sink = torch.randn(9, BE, d, generator=G), torch.randn(H, generator=G)
    slots, pos = torch.tensor([5, 0, 2]), torch.tensor([3, 20, 9])
    table = torch.tensor([[4, 1, 8], [2, 0, 0], [7, 3, 6]])
    sel = torch.tensor([[0, 5, -1], [2, -1, -1], [9, 1, 4]])
    out = decode_attention_ref(q, win, slots, pos, sink, 0.2, pool, table, sel=sel)
    for b in range(B):
        kp = window_positions(pos[b:b + 1], W)[0]
        ok = sel[b] >= 0
        ent = sel[b][ok]
        comp = pool[table[b][ent // BE], ent % BE]
        ref = attend(q[b][None, None], win[slots[b]][None], (kp >= 0)[None, None], comp[None],
                     torch.ones(1, 1, comp.shape[0], dtype=torch.bool), sink, 0.2)
        assert torch.allclose(out[b], ref[0, 0], atol=1e-5)


def test_prefill_attention_reference_matches_attend():
    """prefill_attention's function is model.attend's (the engine's prefill path on the CPU) row by row: the window's
    keys (pos - W, pos] and the picked entries (CSA) or the first count (HCA)."""
    from kernels.attention import prefill_attention, prefill_attention_ref
    from tests.kernel_cases import prefill_attention_case
    q, keys, base, pos, sink, entries, first, sel, count = prefill_attention_case("cpu")
    W = 8
    for kw in ({}, dict(sel=sel), dict(count=count)):
        ent = dict(entries=entries, first=first, **kw) if kw else {}
        out = prefill_attention_ref(q, keys, base, pos, sink, 0.3, W, **ent)
        assert torch.equal(out, prefill_attention(q, keys, base, pos, sink, 0.3, W, **ent))  # (the CPU's path)
        for n in range(len(pos)):
            kp = torch.arange(max(0, int(pos[n]) - W + 1), int(pos[n]) + 1)
            comp, cmask = None, None
            if kw:
                ids = sel[n][sel[n] >= 0] if "sel" in kw else torch.arange(int(count[n]))
                comp, cmask = entries[first[n] + ids][None], torch.ones(1, 1, len(ids), dtype=torch.bool)
            ref = attend(q[n][None, None], keys[base[n] + kp][None], torch.ones(1, 1, len(kp), dtype=torch.bool),
                         comp, cmask, sink, 0.3)
            assert torch.allclose(out[n], ref[0, 0], atol=1e-5), (kw.keys(), n)


def test_prefill_index_reference_matches_the_decode_references():
    """prefill_index_ref's picks (prefill's indexer; the engine's path on the CPU and its slow twin on GPUs) are the
    decode path's for each query row: index_scores_ref over the row's entries in a paged pool, index_topk_ref at the
    row's count (-1 past it, all -1 before the first entry)."""
    from kernels.attention import index_scores_ref, index_topk_ref, prefill_index, prefill_index_ref
    from tests.kernel_cases import prefill_index_case
    g = torch.Generator().manual_seed(0)
    B, T, S, h, d, k, BE = 2, 30, 7, 4, 16, 4, 4
    qi, wi = torch.randn(B * T, h, d, generator=g), torch.randn(B * T, h, generator=g)
    rows = torch.arange(B * T).view(B, T).flip(1)
    keys = torch.randn(B, S, d, generator=g)
    count = ((torch.arange(T) + 1) // 4).clamp(max=S)
    got = prefill_index_ref(qi, wi, rows, keys, count, k, 0.5)
    assert torch.equal(got, prefill_index(qi, wi, rows, keys, count, k, 0.5))  # (the CPU's path)
    nb = -(-S // BE)
    pool = torch.zeros(1 + B * nb, BE, d)
    pool[1:].view(B, nb * BE, d)[:, :S] = keys
    table = 1 + torch.arange(B * nb).view(B, nb)
    for b in range(B):
        sc = index_scores_ref(qi[rows[b]], wi[rows[b]], pool, table[b].expand(T, -1), count, S, 0.5)
        assert torch.equal(got[b], index_topk_ref(sc, k, count)), b
    assert bool((got[:, :3] == -1).all()) and bool((got[:, -1] >= 0).all())
    assert prefill_index_case("cpu", 2, 40, 12, 4, 16, 5)


def test_gemm_tiles_by_weight_size():
    """The FP8 linears' tiles at decode sizes: mini's linears (at most 4 MiB of FP8 weights) keep the tiles fitted on
    them; the release's take _big_tiles (the sweeps in _gemm_blocks' and _fused_blocks' notes): fp8_gemm 64-wide
    tiles and the longest K range that leaves >= 96 programs at 17-64 rows, >= 192 up to 16; the one-launch kernel
    up to 16 rows the 64- or 128-wide tiles with the fewest programs >= 192. BF16 weights keep the small tiles."""
    from kernels.fp8_gemm import _big_tiles, _fused_blocks, _gemm_blocks
    for N, K, G in ((1024, 2048, 1), (8192, 512, 1), (4096, 512, 1), (512, 2048, 4), (2048, 2048, 1)):  # mini
        for M, bm in ((64, 64), (32, 32), (16, 16)):
            assert _gemm_blocks(M, N, K, G) == (bm, 32, 4, 5), (M, N, K, G)
        assert _fused_blocks(16, N, K, G) == (16, (64 if N >= 1024 else 32), (2 if K > 512 else K // 128))
    # (N, K, groups): K blocks of fp8_gemm at 17-64 rows and up to 16, the one-launch kernel's (BLOCK_N, K blocks)
    release = {(1536, 4096, 1): (8, 4, (64, 4)), (32768, 1024, 1): (8, 8, (128, 8)), (8192, 1024, 1): (8, 4, (64, 4)),
               (1024, 4096, 8): (16, 16, (64, 16)), (4096, 8192, 1): (16, 16, (64, 16))}
    for (N, K, G), (ks, ks16, fused) in release.items():
        for M, bm, k in ((64, 64, ks), (40, 64, ks), (32, 32, ks), (17, 32, ks), (16, 16, ks16), (5, 16, ks16)):
            assert _gemm_blocks(M, N, K, G) == (bm, 64, k, 3 if k <= 8 else 5), (M, N, K, G)
        assert _fused_blocks(16, N, K, G) == _fused_blocks(5, N, K, G) == (16, *fused), (N, K, G)
        assert _fused_blocks(16, N, K, G, scaled=False) == (16, 64, 2)
    # fewer programs than asked for even at 1-block ranges: the most there are
    assert _big_tiles(128, 256, 1, 192, (64, 128)) == (64, 1) and _big_tiles(512, 4096, 2, 96, (64,)) == (64, 4)


def test_launch_fitting_drops_stages_that_do_not_fit():
    """kernels.fp8_gemm.launch_fitting: a launch Triton refuses with OutOfResources (raised before the kernel
    runs: its stages' tiles exceed the GPU's shared memory) is made again on one stage fewer until one fits; the
    stages that fitted are where the next launch of those tiles starts; if one stage does not fit, the error."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources
    from kernels.fp8_gemm import launch_fitting
    tried = []

    class Kernel:  # a launch fits up to `most` stages, as Triton's check at the launch decides
        def __init__(self, most):
            self.most = most

        def __getitem__(self, grid):
            def launch(*args, num_stages, **kwargs):
                tried.append(num_stages)
                if num_stages > self.most:
                    raise OutOfResources(num_stages * 96 << 10, self.most * 96 << 10, "shared memory")
                return args, kwargs, num_stages
            return launch

    x, k = torch.zeros(2), Kernel(2)
    assert launch_fitting(k, (1,), (x, 3), dict(BLOCK=64), 4, ("tiles",)) == ((x, 3), dict(BLOCK=64), 2)
    assert tried == [4, 3, 2]
    assert launch_fitting(k, (1,), (x,), {}, 4, ("tiles",))[2] == 2 and tried[3:] == [2]
    assert launch_fitting(k, (1,), (x,), {}, 4, ("other tiles",))[2] == 2 and tried[4:] == [4, 3, 2]
    assert launch_fitting(k, (1,), (x,), {}, 1, ("tiles",))[2] == 1
    with pytest.raises(OutOfResources):
        launch_fitting(Kernel(0), (1,), (x,), {}, 3, ("tiles",))


def test_moe_align_and_reference():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    slots, be = moe_align(ids, 4, block_m=2)
    blocks = slots.view(-1, 2).tolist()
    # expert 0 <- slots 1, 4; expert 1 <- slot 3 (+ pad 6); expert 2 <- slots 0, 2, 5 (+ pad)
    assert be.tolist()[:4] == [0, 1, 2, 2] and set(be.tolist()[4:]) == {-1}
    assert blocks[:4] == [[1, 4], [3, 6], [0, 2], [5, 6]]
    x = torch.randn(3, 16, generator=G)
    w1, w3, w2 = torch.randn(4, 8, 16, generator=G), torch.randn(4, 8, 16, generator=G), torch.randn(4, 16, 8, generator=G)
    wt = torch.rand(3, 2, generator=G)
    want = torch.zeros(3, 16)
    for t in range(3):
        for j in range(2):
            e = ids[t, j]
            h = torch.nn.functional.silu((x[t] @ w1[e].T).clamp(max=10)) * (x[t] @ w3[e].T).clamp(-10, 10)
            want[t] += wt[t, j] * (h @ w2[e].T)
    assert torch.allclose(fused_moe_ref(x, ids, wt, w1, w2, w3), want, atol=1e-5)


def test_index_scores_reference_matches_indexer_formula():
    B, h, d, BE = 2, 8, 16, 4
    qi, wi = torch.randn(B, h, d, generator=G), torch.randn(B, h, generator=G)
    pool, table, count = torch.randn(5, BE, d, generator=G), torch.tensor([[3, 1], [4, 0]]), torch.tensor([6, 2])
    s = index_scores_ref(qi, wi, pool, table, count, 8)
    keys = pool[table[0].repeat_interleave(BE), torch.arange(8) % BE]
    want = ((qi[0] @ keys.T).relu() * d ** -0.5 * wi[0][:, None]).sum(0)
    assert torch.allclose(s[0, :6], want[:6], atol=1e-5) and torch.isinf(s[0, 6:]).all() and torch.isinf(s[1, 2:]).all()



def test_indexer_topk_ties_in_entry_order():
    """Tied index scores (0.0 and -0.0 among them) are picked in entry order, as the GPU kernel sorts them, by the
    torch paths too (topk_first): torch.topk's order among equals changes with the row's length, so the full
    forward, the prefill and the decode step could pick different entries."""
    from kernels.attention import topk_first
    from tests.kernel_cases import index_topk_case
    sc = torch.tensor([[0.0, 0.5, -0.0, 0.5, float("-inf"), -1.0, 0.0, 2.0]])
    assert topk_first(sc, 8).tolist() == [[7, 1, 3, 0, 2, 6, 5, 4]]
    x = torch.randn(3, 5, 300, generator=G)  # distinct scores: torch.topk's entries
    assert torch.equal(topk_first(x, 40), x.topk(40).indices)
    for B, S, k in ((3, 64, 16), (2, 20, 20), (4, 1024, 512)):
        assert index_topk_case("cpu", B, S, k, ties=True), (B, S, k)

INTERPRETED = textwrap.dedent("""
    import itertools
    import torch
    import kernels.moe as km
    from kernels.attention import decode_attention, decode_attention_ref, index_scores, index_scores_ref, unrope_ref
    from kernels.fp8_gemm import act_quant_ref, fp8_gemm, fp8_gemm_ref
    from kernels.quant import quant_fp8_block
    g = torch.Generator().manual_seed(1)
    # the interpreter's own fp8 casts mis-round near powers of two, so both sides get torch's quantization
    km.act_quant = act_quant_ref
    x, w = torch.randn(9, 256, generator=g), torch.randn(200, 256, generator=g) * 0.05
    xq, sx = act_quant_ref(x, torch.float8_e4m3fn)
    wq, ws = quant_fp8_block(w, torch.float8_e4m3fn, scale_fmt="fp32")
    assert (fp8_gemm(xq, sx, wq, ws, torch.float32) - fp8_gemm_ref(xq, sx, wq, ws)).abs().max() < 1e-4
    # two groups in one launch (wo_a's block-diagonal product) against one GEMM per group
    w2q, w2s = quant_fp8_block(torch.randn(256, 128, generator=g) * 0.05, torch.float8_e4m3fn, scale_fmt="fp32")
    y2 = torch.cat([fp8_gemm_ref(xq[:, 128 * i:128 * (i + 1)], sx[:, i:i + 1], w2q[128 * i:128 * (i + 1)],
                                 w2s[i:i + 1]) for i in range(2)], 1)
    assert (fp8_gemm(xq, sx, w2q, w2s, torch.float32, groups=2) - y2).abs().max() < 1e-4
    # K split over programs (one block a range), one launch per group pair too
    from kernels.fp8_gemm import tickets_left
    assert (fp8_gemm(xq, sx, wq, ws, torch.float32, blocks=(16, 32, 1)) - fp8_gemm_ref(xq, sx, wq, ws)).abs().max() < 1e-4
    assert (fp8_gemm(xq, sx, w2q, w2s, torch.float32, blocks=(16, 32, 1), groups=2) - y2).abs().max() < 1e-4
    # blocks with their pipeline depth (_gemm_blocks' 4-tuples): 64-wide tiles, one block a range
    y64 = fp8_gemm(xq, sx, wq, ws, torch.float32, blocks=(64, 64, 1, 3))
    assert (y64 - fp8_gemm_ref(xq, sx, wq, ws)).abs().max() < 1e-4
    assert tickets_left(x.device) == 0
    # act_quant: 3 tiles a row (the program's 4-tile block masked past them); the scales exactly, the bytes where
    # the interpreter's fp8 cast rounds as torch's (see block_quant below)
    from kernels.fp8_gemm import act_quant
    x3 = torch.randn(5, 384, generator=g) * 3
    (q3, s3), (q3r, s3r) = act_quant(x3, torch.float8_e4m3fn), act_quant_ref(x3, torch.float8_e4m3fn)
    assert torch.equal(s3, s3r) and (q3.view(torch.uint8) == q3r.view(torch.uint8)).float().mean() > 0.95
    # the one-launch kernel quantizes in the kernel, as the act_quant kernel does (the interpreter's fp8 casts
    # differ from torch's, so the comparison is with the two-launch kernel path): K ranges added by the last
    # program of a tile (split > 1), or stored directly; several row tiles; two groups
    from kernels.fp8_gemm import act_quant, fp8_linear_fused, tickets_left
    for xx_, blocks in ((x, (16, 64, 2)), (x, (64, 128, 1)), (torch.randn(40, 256, generator=g), (16, 32, 1))):
        want = fp8_gemm(*act_quant(xx_, torch.float8_e4m3fn), wq, ws, torch.float32)
        got = fp8_linear_fused(xx_, wq, ws, blocks=blocks)
        assert (got - want).abs().max() < 1e-5 * want.abs().max(), blocks
    assert tickets_left(x.device) == 0  # every ticket counter is back at 0
    # unscaled (a plain weight, the BF16 input GEMMs' path): the same split and ordered sum, no quantization
    for blocks in ((16, 64, 1), (16, 32, 2)):
        assert (fp8_linear_fused(x, w, None, blocks=blocks) - x @ w.T).abs().max() < 1e-5 * (x @ w.T).abs().max()
    want = fp8_gemm(*act_quant(x, torch.float8_e4m3fn), w2q, w2s, torch.float32, groups=2)
    assert (fp8_linear_fused(x, w2q, w2s, groups=2, blocks=(16, 32, 1)) - want).abs().max() < 1e-5 * want.abs().max()
    # the GEMV kernel (a few rows): one or two rows, two groups, 3 blocks of K (a masked power-of-two block),
    # a weight with a row stride past K (a view), a plain weight
    from kernels.fp8_gemm import gemv
    w3q, w3s = quant_fp8_block(torch.randn(256, 512, generator=g) * 0.05, torch.float8_e4m3fn, scale_fmt="fp32")
    for xx_, wq_, ws_, G in ((x[:1], wq, ws, 1), (x[:2], wq, ws, 1), (x[:2], w2q, w2s, 2),
                             (x3[:1], w3q[:, :384], w3s[:, :3], 1)):
        want = fp8_gemm(*act_quant(xx_, torch.float8_e4m3fn), wq_.contiguous(), ws_.contiguous(), torch.float32,
                        groups=G)
        assert (gemv(xx_, wq_, ws_, groups=G) - want).abs().max() < 1e-5 * want.abs().max(), (xx_.shape, G)
    for xx_ in (x[:1], x[:2]):
        assert (gemv(xx_, w, None) - xx_ @ w.T).abs().max() < 1e-5 * (xx_ @ w.T).abs().max()
    # with the RMSNorm of its rows first (Prenorm): rows read in place from a column slice, fp32 and bf16 rows
    # (the normed row rounded to bf16 as the norm kernel stores it), against the norm then the GEMV
    from model.model import RMSNorm
    nrm = RMSNorm(256, 1e-6)
    nrm.weight.data = torch.rand(256, generator=g) + 0.5
    wide = torch.randn(2, 384, generator=g) * 4
    for xx_ in (wide[:1, 64:320], wide[:, 64:320], wide[:, 64:320].bfloat16()):
        want = gemv(nrm(xx_.contiguous()), wq, ws)
        assert (gemv(xx_, wq, ws, norm=nrm) - want).abs().max() <= 1e-5 * want.abs().max(), xx_.shape
    from kernels.fp8_gemm import block_quant
    for wb in (torch.randn(300, 200, generator=g) * 0.1, torch.randn(3, 130, 256, generator=g)):
        q, s = block_quant(wb, torch.float8_e4m3fn)
        qr, sr = quant_fp8_block(wb, torch.float8_e4m3fn, scale_fmt="fp32")
        # exact scales; the bytes agree but where the interpreter's fp8 cast mis-rounds (about 2.5% of them; the
        # GPU test checks every byte)
        assert torch.equal(s, sr) and (q.view(torch.uint8) == qr.view(torch.uint8)).float().mean() > 0.95
    T, k, E, D, I = 5, 2, 4, 128, 256
    xx = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wt = torch.rand(T, k, generator=g)
    ws_ = [torch.randn(E, I, D, generator=g) * 0.05, torch.randn(E, D, I, generator=g) * 0.05, torch.randn(E, I, D, generator=g) * 0.05]
    q = [quant_fp8_block(t, torch.float8_e4m3fn, scale_fmt="fp32") for t in ws_]
    args = (xx, ids, wt, q[0][0], q[1][0], q[2][0], q[0][1], q[1][1], q[2][1])
    t64 = ((64, 4, 3), (64, 4, 3))  # h through act_quant (FP8's own default: the up kernel quantizes h itself)
    assert (km.fused_moe(*args, tiles=t64) - km.fused_moe_ref(*args)).abs().max() < 1e-4
    for swap in (False, True):  # products x-first and weights-first (FP8's default up to 16 tokens)
        assert (km.fused_moe(*args, tiles=t64, swap=swap) - km.fused_moe_ref(*args)).abs().max() < 1e-4, swap
    assert (km.fused_moe(xx, ids, wt, *ws_) - km.fused_moe_ref(xx, ids, wt, *ws_)).abs().max() < 1e-4
    # the last expert as a shared one (every token, weight 1) and slots on another rank (id E: skipped)
    ids_sh = torch.where(torch.rand(T, k, generator=g) < 0.3, torch.full_like(ids, E), ids.clamp(max=E - 2))
    for n_sh in (0, 1):
        for w_ in (args[3:], ws_):  # FP8, then plain weights
            got = km.fused_moe(xx, ids_sh, wt, *w_, n_shared=n_sh, tiles=t64)
            want = km.fused_moe_ref(xx, ids_sh, wt, *w_, n_shared=n_sh)
            assert (got - want).abs().max() < 1e-4 * want.abs().max(), n_sh
    # h quantized by the up kernel: the same bits as the act_quant kernel's (both in the interpreter's fp8 casts);
    # only the up tiles' width differs (the down kernel's too would sum its products through another numpy matmul)
    from kernels.fp8_gemm import act_quant as act_quant_kernel
    km.act_quant = act_quant_kernel
    up, down = km._moe_tiles(T, True)
    for n_sh in (0, 1):
        for swap in (False, True):
            assert torch.equal(km.fused_moe(xx, ids_sh, wt, *args[3:], n_shared=n_sh, swap=swap),
                               km.fused_moe(xx, ids_sh, wt, *args[3:], n_shared=n_sh, tiles=((64, *up[1:]), down),
                                            swap=swap)), n_sh
            # the down programs waiting each for its row block's up tiles, or for the whole up launch: the same
            # (and its first weight tile loaded before that wait, or after)
            for w_, early in itertools.product((args[3:], ws_), (False, True)):
                assert torch.equal(km.fused_moe(xx, ids_sh, wt, *w_, n_shared=n_sh, swap=swap, gemv=False,
                                                overlap=True, early=early),
                                   km.fused_moe(xx, ids_sh, wt, *w_, n_shared=n_sh, swap=swap, gemv=False,
                                                overlap=False)), (n_sh, swap, early)
    km.act_quant = act_quant_ref
    # the up kernel's K split over programs (K 256 here: two ranges), FP8 and plain weights
    xs, ws2 = torch.randn(T, 256, generator=g), [torch.randn(E, I, 256, generator=g) * 0.05,
                                                 torch.randn(E, 256, I, generator=g) * 0.05,
                                                 torch.randn(E, I, 256, generator=g) * 0.05]
    q2 = [quant_fp8_block(t, torch.float8_e4m3fn, scale_fmt="fp32") for t in ws2]
    for w_ in ((q2[0][0], q2[1][0], q2[2][0], q2[0][1], q2[1][1], q2[2][1]), ws2):
        want = km.fused_moe_ref(xs, ids_sh, wt, *w_, n_shared=1)
        got = km.fused_moe(xs, ids_sh, wt, *w_, n_shared=1, tiles=((64, 4, 3, 2), (64, 4, 3)))
        assert (got - want).abs().max() < 1e-4 * want.abs().max()
    assert tickets_left(x.device) == 0
    # the GEMV kernels of a few tokens (K 256 over 2 blocks, 128 over 1; I 256), FP8 and plain weights, a shared
    # expert and slots on another rank, against the tiled kernels' result (x quantized by the act_quant kernel,
    # in the interpreter's fp8 casts as the GEMV kernels' own quantization)
    km.act_quant = act_quant_kernel
    for n_sh in (0, 1):
        for T_ in (1, 2):
            for w_ in ((q2[0][0], q2[1][0], q2[2][0], q2[0][1], q2[1][1], q2[2][1]), ws2):
                want = km.fused_moe(xs[:T_], ids_sh[:T_], wt[:T_], *w_, n_shared=n_sh, gemv=False)
                got = km.fused_moe(xs[:T_], ids_sh[:T_], wt[:T_], *w_, n_shared=n_sh)
                assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (n_sh, T_)
                # other slab sizes (programs of fewer / more weight rows) and up programs of one / four slabs
                # (the default two): the same products, the same bits
                ws_ = (*w_, None, None, None)[:6]
                for slab, reps in ((1024, 1), (65536, 4)):
                    assert torch.equal(got, km._moe_gemv(xs[:T_], ids_sh[:T_], wt[:T_], *ws_, 10.0, n_sh, slab=slab,
                                                         warps=4, reps=reps).summed()), (n_sh, T_, slab)
                # the buffers made before the routing (the engine's, before the router): the shared expert's slots
                # first in the up launch, not waiting under PDL, the same bits
                rows = km.moe_gemv_early(xs[:T_], ids_sh.shape[1], ws_[0], n_sh)
                assert (rows is None) == (n_sh == 0), n_sh
                if rows is not None:
                    assert torch.equal(got, km.fused_moe(xs[:T_], ids_sh[:T_], wt[:T_], *w_, n_shared=n_sh,
                                                         summed=False, rows=rows).summed()), (n_sh, T_)
    km.act_quant = act_quant_ref
    B, H, d, W, BE = 3, 4, 32, 16, 8
    qq, win = torch.randn(B, H, d, generator=g), torch.randn(5, W, d, generator=g)
    pool, sink = torch.randn(10, BE, d, generator=g), torch.randn(H, generator=g)
    slots, pos = torch.tensor([3, 0, 4]), torch.tensor([5, 40, 15])
    table = torch.tensor([[2, 5, 7], [1, 0, 0], [9, 3, 0]])
    sel = torch.tensor([[0, 3, 9, -1, 12], [1, 2, -1, -1, -1], [-1, -1, -1, -1, -1]])
    count = torch.tensor([20, 5, 0])
    # sel with count: only the first count[b] positions (row 0's 12 and row 1's 2 are past them)
    nsel = torch.tensor([3, 1, 0])
    cut = torch.where(torch.arange(5) < nsel[:, None], sel, -1)
    assert torch.equal(decode_attention_ref(qq, win, slots, pos, sink, 0.3, pool, table, sel, nsel),
                       decode_attention_ref(qq, win, slots, pos, sink, 0.3, pool, table, cut))
    for kw in ({}, dict(pool=pool, table=table, sel=sel), dict(pool=pool, table=table, count=count),
               dict(pool=pool, table=table, sel=sel, count=nsel)):
        for splits, merge in ((None, None), (1, None), (3, False), (3, True)):  # 3: one split sees no valid key
            a = decode_attention(qq, win, slots, pos, sink, 0.3, splits=splits, merge=merge, **kw)
            assert (a - decode_attention_ref(qq, win, slots, pos, sink, 0.3, **kw)).abs().max() < 1e-5, splits
            # the output rotated back in the kernel (the engine's project_out then skips its inverse RoPE)
            cs = (torch.randn(B, 4, generator=g), torch.randn(B, 4, generator=g))
            b = decode_attention(qq, win, slots, pos, sink, 0.3, splits=splits, merge=merge, unrope=cs, **kw)
            assert (b - unrope_ref(a, *cs)).abs().max() < 1e-5 and torch.equal(b[..., :-8], a[..., :-8]), splits
    # the output also stored quantized per 1x128 tile (the FP8 engine's wo_a input): act_quant's bytes of the
    # stored (rotated) output, at one split, merged in the kernel and by the combine kernel; 3 heads of a
    # 16-head block (the rest masked); d 64: none
    q3, win3 = torch.randn(B, 3, 256, generator=g), torch.randn(5, W, 256, generator=g)
    pool3 = torch.randn(10, BE, 256, generator=g)
    cs = (torch.randn(B, 8, generator=g), torch.randn(B, 8, generator=g))
    for splits, merge in ((1, None), (3, True), (3, False)):
        o, (oq, osc) = decode_attention(q3, win3, slots, pos, sink[:3], 0.1, pool3, table, sel, nsel, splits=splits,
                                        merge=merge, unrope=cs, fp8=torch.float8_e4m3fn)
        assert torch.equal(o, decode_attention(q3, win3, slots, pos, sink[:3], 0.1, pool3, table, sel, nsel,
                                               splits=splits, merge=merge, unrope=cs))
        q2_, s2_ = act_quant_kernel(o.reshape(B, -1), torch.float8_e4m3fn)
        assert torch.equal(osc, s2_) and torch.equal(oq.view(torch.uint8), q2_.view(torch.uint8)), (splits, merge)
    assert decode_attention(qq, win, slots, pos, sink, 0.3, fp8=torch.float8_e4m3fn)[1] is None
    assert tickets_left(x.device) == 0
    # prefill's rows over linear buffers (the same kernel, LINEAR): the window alone, CSA picks, HCA counts; one
    # split, splits merged in the kernel and by the combine kernel
    from kernels.attention import prefill_attention, prefill_attention_ref
    from tests.kernel_cases import prefill_attention_case
    pq, pkeys, pbase, ppos, psink, pent, pfirst, psel, pcount = prefill_attention_case("cpu")
    for kw in ({}, dict(entries=pent, first=pfirst, sel=psel), dict(entries=pent, first=pfirst, count=pcount)):
        want = prefill_attention_ref(pq, pkeys, pbase, ppos, psink, 0.3, 8, **kw)
        for splits, merge in ((1, None), (3, True), (3, False)):
            a = prefill_attention(pq, pkeys, pbase, ppos, psink, 0.3, 8, splits=splits, merge=merge, **kw)
            assert (a - want).abs().max() < 1e-5, (kw.keys(), splits, merge)
    assert tickets_left(x.device) == 0
    # prefill's indexer: tiles partly past T and S, blocks past every row's count; 16-row tiles: several
    from kernels import attention
    from tests.kernel_cases import prefill_index_case
    assert prefill_index_case("cpu", 2, 40, 12, 4, 16, 5) and prefill_index_case("cpu", 3, 70, 20, 4, 32, 8, seed=1)
    tiles, attention.PREFILL_INDEX_TILES = attention.PREFILL_INDEX_TILES, (16, 16, 2)
    try:
        assert prefill_index_case("cpu", 2, 70, 40, 3, 16, 8, seed=2)
    finally:
        attention.PREFILL_INDEX_TILES = tiles
    qi, wi = torch.randn(B, 8, d, generator=g), torch.randn(B, 8, generator=g)
    a, b = index_scores(qi, wi, pool, table, count, 24), index_scores_ref(qi, wi, pool, table, count, 24)
    assert torch.equal(torch.isinf(a), torch.isinf(b)) and (a[~torch.isinf(b)] - b[~torch.isinf(b)]).abs().max() < 1e-5
    # head weights as a strided column slice, scaled in the kernel (the decode step's raw indexer outputs)
    a = index_scores(qi, torch.cat([wi, wi], 1)[:, 8:], pool, table, count, 24, 0.25)
    b = index_scores_ref(qi, wi * 0.25, pool, table, count, 24)
    assert torch.equal(torch.isinf(a), torch.isinf(b)) and (a[~torch.isinf(b)] - b[~torch.isinf(b)]).abs().max() < 1e-5
    from kernels import fused
    from model.model import hc_pre, hc_post, rms_unweighted, RMSNorm
    from model.model import _hc_pre
    for n, D in ((2, 96), (3, 96), (4, 96)):
        xs = torch.randn(5, n, D, generator=g)
        fn, base, sc = torch.randn((2 + n) * n, n * D, generator=g) * 0.1, torch.randn((2 + n) * n, generator=g), torch.rand(3, generator=g) + 0.5
        norm = RMSNorm(D, 1e-6)
        norm.weight.data.normal_(generator=g)
        want = _hc_pre(xs, fn, base, sc, 20, 1e-6, 1e-6)
        plain = fused.hc_pre(xs, fn, base, sc, 20, 1e-6, 1e-6)
        for got, w in zip(plain, want):
            assert (got - w).abs().max() < 1e-5, n
        # the site's norm inside the kernel (Block.hc in inference), and the head's collapse + norm
        got = fused.hc_pre(xs, fn, base, sc, 20, 1e-6, 1e-6, (norm.weight, norm.eps))
        assert (got[0] - norm(want[0])).abs().max() < 1e-5
        assert all(torch.equal(a, b) for a, b in zip(got[1:], plain[1:]))
        hfn, hb, hs = fn[:n], base[:n], sc[:1]
        pre = torch.sigmoid(rms_unweighted(xs.flatten(-2), 1e-6) @ hfn.T * hs + hb) + 1e-6
        want_head = norm((pre.unsqueeze(-1) * xs).sum(-2))
        got_head = fused.hc_head(xs, hfn, hb, hs, 1e-6, 1e-6, (norm.weight, norm.eps))
        assert (got_head - want_head).abs().max() < 1e-5 * want_head.abs().max(), n
        out = torch.randn(5, D, generator=g)
        assert (fused.hc_post(out, xs, want[1], want[2]) - hc_post(out, xs, want[1], want[2])).abs().max() < 1e-5
    # hc_post with the next mHC's mix partials (the engine's path: D a multiple of 64; a program a token up to
    # POST_MIX_TOKENS, a program a 16-token block past them)
    for n, D, N in ((4, 128, 3), (3, 192, 9), (4, 128, 21)):
        xs, out = torch.randn(N, n, D, generator=g), torch.randn(N, D, generator=g)
        fn, base, sc = torch.randn((2 + n) * n, n * D, generator=g) * 0.1, torch.randn((2 + n) * n, generator=g), torch.rand(3, generator=g) + 0.5
        _, post, comb = _hc_pre(xs, fn, base, sc, 20, 1e-6, 1e-6)
        y, part = fused.hc_post(out, xs, post, comb, fn)
        assert (y - hc_post(out, xs, post, comb)).abs().max() < 1e-5 and part.shape[0] == N
        assert (part - fused._mix_partials(y.flatten(-2), fn, ssq=True)).abs().max() < 1e-4
        for a, b in zip(fused.hc_pre(y, fn, base, sc, 20, 1e-6, 1e-6, None, part), _hc_pre(y, fn, base, sc, 20, 1e-6, 1e-6)):
            assert (a - b).abs().max() < 1e-5, (n, D)
        y2, hpart = fused.hc_post(out, xs, post, comb, fn[:n])
        assert torch.equal(y2, y)
        assert (fused.hc_head(y, fn[:n], base[:n], sc[:1], 1e-6, 1e-6, None, hpart) - fused.hc_head(y, fn[:n], base[:n], sc[:1], 1e-6, 1e-6)).abs().max() < 1e-5
        # an MoE's slot rows unsummed (the engine's run_layers): summed in the kernel (a program a token up to
        # POST_MIX_TOKENS, a 16-token block past them), the bits of summing first; routed slots of another rank's
        # expert (id E) never written (NaN here) and skipped; fp32 and bf16 sums
        E, k, kt = 5, 3, 4
        ids = torch.randint(0, E + 1, (N, k), generator=g)
        sy = torch.randn(N, kt, D, generator=g)
        sy[:, :k][ids == E] = float("nan")
        for dt in (torch.float32, torch.bfloat16):
            sr = km.SlotRows(sy.view(N * kt, D), ids, E, k, kt, dt)
            for f in (fn, fn[:n]):
                a, b = fused.hc_post(sr, xs.to(dt), post, comb, f), fused.hc_post(sr.summed(), xs.to(dt), post, comb, f)
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not a[0].isnan().any(), (N, dt)
    y, part = fused.hc_post(out[:0], xs[:0], post[:0], comb[:0], fn)
    assert y.shape == (0, n, D) and part.shape[:2] == (0, n * D // 64)
    xs, out, fn = torch.randn(2, 4, 96, generator=g), torch.randn(2, 96, generator=g), torch.randn(24, 384, generator=g)
    _, post, comb = _hc_pre(xs, fn, torch.zeros(24), torch.ones(3), 3, 1e-6, 1e-6)
    y, part = fused.hc_post(out, xs, post, comb, fn)  # D not a multiple of the chunk: no partials
    assert part is None and torch.equal(y, fused.hc_post(out, xs, post, comb))
    xs, out, fn = torch.randn(17, 4, 64, generator=g), torch.randn(17, 64, generator=g), torch.randn(24, 256, generator=g)
    _, post, comb = _hc_pre(xs, fn, torch.zeros(24), torch.ones(3), 3, 1e-6, 1e-6)
    y, part = fused.hc_post(out, xs, post, comb, fn)  # past 16 tokens: 16-token blocks, the mix kernel's partials
    assert (y - fused.hc_post(out, xs, post, comb)).abs().max() < 1e-5
    assert torch.equal(part, fused._mix_partials(y.flatten(-2), fn, ssq=True))
    # the normed rows also quantized per 1x128 tile (the FP8 engine's run_layers): act_quant's bytes and scales
    # (both in the interpreter's fp8 casts); D 384 in a 512 block (a masked tile); no norm, D % 128: none
    xs = torch.randn(5, 4, 384, generator=g).bfloat16()
    fn, base = torch.randn(24, 4 * 384, generator=g) * 0.1, torch.randn(24, generator=g)
    nw = torch.randn(384, generator=g).bfloat16()
    h, post, comb, hq = fused.hc_pre(xs, fn, base, sc, 3, 1e-6, 1e-6, (nw, 1e-6), None, torch.float8_e4m3fn)
    q2, s2 = act_quant_kernel(h, torch.float8_e4m3fn)
    assert torch.equal(hq[1], s2) and torch.equal(hq[0].view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(h, fused.hc_pre(xs, fn, base, sc, 3, 1e-6, 1e-6, (nw, 1e-6))[0])
    assert fused.hc_pre(xs, fn, base, sc, 3, 1e-6, 1e-6, None, None, torch.float8_e4m3fn)[3] is None
    assert fused.hc_pre(xs[..., :96], fn[:, :384], base, sc, 3, 1e-6, 1e-6, (nw[:96], 1e-6), None,
                        torch.float8_e4m3fn)[3] is None
    assert hc_pre(xs.float(), fn, base, sc, 3, 1e-6, 1e-6, None, None, torch.float8_e4m3fn)[3] is None
    # the q norm's kernel quantizing its rows for wq_b (Attention.q_lora's fp8): act_quant's bytes, the norm
    # rms_norm's; strided rows (a column slice of the input GEMM), D 384 in a 512 block; D % 128: none
    a = torch.randn(3, 640, generator=g).bfloat16()[:, 128:512]
    y, (q, s) = fused.rms_norm_quant(a, nw.float(), 1e-6, torch.float8_e4m3fn)
    q2, s2 = act_quant_kernel(y, torch.float8_e4m3fn)
    assert torch.equal(y, fused.rms_norm(a, nw.float(), 1e-6)) and torch.equal(s, s2)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    y, none = fused.rms_norm_quant(a[:, :96], nw[:96].float(), 1e-6, torch.float8_e4m3fn)
    assert none is None and torch.equal(y, fused.rms_norm(a[:, :96], nw[:96].float(), 1e-6))
    xs = torch.randn(1, 1, 4100, generator=g)  # D > 4096: the norm as a second pass over the stored row
    fn, base = torch.randn(3, 4100, generator=g) * 0.1, torch.randn(3, generator=g)
    norm = RMSNorm(4100, 1e-6)
    norm.weight.data.normal_(generator=g)
    got = fused.hc_pre(xs, fn, base, sc, 3, 1e-6, 1e-6, (norm.weight, norm.eps))[0]
    want = norm(_hc_pre(xs, fn, base, sc, 3, 1e-6, 1e-6)[0])
    assert (got - want).abs().max() < 1e-5 * want.abs().max(), float((got - want).abs().max())
    from tests.kernel_cases import index_topk_case
    for B, S, k in ((3, 64, 16), (2, 300, 200), (4, 1024, 512), (2, 20, 20), (3, 1500, 100), (2, 1100, 1100),
                     (3, 9000, 200)):
        for ties in (False, True):
            assert index_topk_case("cpu", B, S, k, ties=ties), (B, S, k, ties)
    from tests.kernel_cases import route_case
    for M, D, E, k, func, hashed in ((1, 300, 32, 6, "sqrtsoftplus", False), (7, 256, 6, 2, "softmax", False),
                                     (130, 64, 32, 6, "sigmoid", False), (5, 128, 16, 3, "sqrtsoftplus", True),
                                     (0, 128, 16, 3, "softmax", False)):
        bad, dw = route_case("cpu", M, D, E, k, func, hashed)
        assert bad == 0 and dw < 1e-5, (M, D, E, k, func, hashed, bad, dw)
    from model.model import _rms, _rms_unweighted, _rope
    from tests.kernel_cases import grad_case
    # rope: the engines' layouts and the training ones (a batch before the positions), forward and backward
    for shape, cshape in (((1, 6, 4, 48), (6, 1, 8)), ((1, 6, 48), (6, 8)), ((3, 1, 32), (3, 1, 8)),
                          ((2, 6, 3, 48), (6, 1, 8)), ((2, 5, 40), (5, 8)), ((2, 5, 40), (2, 5, 8))):
        ang = torch.randn(cshape, generator=g)
        for inv in (False, True):
            err = grad_case(lambda x: fused.rope(x, ang.cos(), ang.sin(), inv),
                            lambda x: _rope(x, ang.cos(), -ang.sin() if inv else ang.sin()), [torch.randn(shape, generator=g)])
            assert err < 1e-5, (shape, cshape, inv, err)
    assert fused.rope(torch.randn(2, 6, 48), torch.ones(3, 8), torch.ones(3, 8)) is None  # no such broadcast
    # norm + rope in one pass (inference): the q heads unweighted; kv weighted, rows strided, stored to a buffer
    ang = torch.randn(3, 8, generator=g)
    q4 = torch.randn(1, 3, 4, 48, generator=g)
    got = fused.norm_rope(q4, None, 1e-6, ang.cos()[:, None], ang.sin()[:, None])
    assert (got - _rope(_rms_unweighted(q4, 1e-6), ang.cos()[:, None], ang.sin()[:, None])).abs().max() < 1e-5
    kv, wn = torch.randn(1, 3, 144, generator=g)[..., 48:96], torch.rand(48, generator=g) + 0.5
    buf = torch.zeros(10, 48)
    got = fused.norm_rope(kv, wn, 1e-6, ang.cos(), ang.sin(), (buf, torch.tensor([7, 2, 5])))
    want = _rope(_rms(kv, wn, 1e-6), ang.cos(), ang.sin())
    assert (got - want).abs().max() < 1e-5 and torch.equal(buf[[7, 2, 5]], got[0])
    assert int(buf.abs().sum(1).gt(0).sum()) == 3  # no other row written
    # both in one launch (Attention.q_and_kv): the bits of the two launches above, the same store
    buf2 = torch.zeros(10, 48)
    qa, kb = fused.norm_rope(kv, wn, 1e-6, ang.cos(), ang.sin(), (buf2, torch.tensor([7, 2, 5])),
                             first=(q4, None, 1e-6, ang.cos()[:, None], ang.sin()[:, None]))
    assert torch.equal(qa, fused.norm_rope(q4, None, 1e-6, ang.cos()[:, None], ang.sin()[:, None]))
    assert torch.equal(kb, got) and torch.equal(buf2, buf)
    assert fused.norm_rope(kv, wn, 1e-6, ang.cos(), ang.sin(), first=(q4, None, 1e-6, ang.cos(), ang.sin())) is None
    # fp32: the interpreter truncates bf16 casts (the GPU test checks bf16)
    xb, wb = torch.randn(7, 200, generator=g), torch.randn(200, generator=g)
    assert grad_case(lambda x: fused.rms_norm(x, None, 1e-6), lambda x: _rms_unweighted(x, 1e-6), [xb]) < 1e-5
    assert grad_case(lambda x, w: fused.rms_norm(x, w, 1e-6), lambda x, w: _rms(x, w, 1e-6), [xb, wb]) < 1e-5
    xr = torch.randn(300, 64, generator=g)  # more rows than one program takes: partial weight gradients summed
    assert grad_case(lambda x, w: fused.rms_norm(x, w, 1e-6), lambda x, w: _rms(x, w, 1e-6), [xr, wb[:64]]) < 1e-5
    from tests.kernel_cases import block_attention_case
    for B, nb, bq, W, H, d, S, cb in ((2, 3, 8, 4, 4, 16, 10, 2), (1, 2, 4, 4, 2, 8, 0, 1), (2, 1, 8, 8, 3, 16, 70, 1)):
        err = block_attention_case("cpu", B, nb, bq, W, H, d, S, cb)
        assert err < 1e-5, (B, nb, bq, W, H, d, S, cb, err)
    from tests.kernel_cases import combine_case
    for N, k, D in ((7, 3, 40), (1, 1, 16), (0, 2, 8), (20, 6, 130)):
        assert combine_case("cpu", N, k, D) < 1e-5, (N, k, D)
    from tests.kernel_cases import logprob_case
    for n, D, V, t, chunk in ((5, 16, 3000, 1.0, 2), (3, 8, 100, 0.7, 1024), (0, 8, 64, 1.0, 4)):
        assert logprob_case("cpu", n, D, V, t, chunk) < 1e-5, (n, D, V, t, chunk)
    from tests.kernel_cases import hc_cases
    for n, D, N, iters in ((4, 96, 70, 20), (2, 64, 5, 3), (3, 40, 33, 1)):  # training's hyper-connections
        res = hc_cases("cpu", n, D, N, iters)
        assert max(res.values()) < 1e-5, (n, D, N, iters, res)
    from model.model import _swiglu
    gs, us = torch.randn(6, 300, generator=g) * 6, torch.randn(6, 300, generator=g) * 6
    assert grad_case(lambda a, b: fused.swiglu(a, b, 10.0), lambda a, b: _swiglu(a, b, 10.0), [gs, us]) < 1e-4
    from tests.kernel_cases import compress_decode_case
    for ratio, overlap, hd, rd in ((4, True, 32, 8), (3, True, 16, 4), (9, True, 16, 8), (8, False, 32, 8),
                                   (20, False, 16, 16)):
        d = compress_decode_case("cpu", ratio, overlap, hd, rd, in_dtype=torch.bfloat16 if ratio % 2 else torch.float32)
        assert d.pop("count") == 0 and d.pop("pool") < 1e-5 * d.pop("pool_ref_scale") and max(d.values()) == 0, d
    from tests.kernel_cases import moe_align_case
    # one program an expert (interpreted one after another: small cases; the GPU test takes up to 256 experts)
    for T, k, E, absent, n_sh in ((5, 2, 4, 0, 0), (40, 6, 32, 0.3, 0), (3, 8, 16, 0.5, 0), (60, 6, 4, 0, 0),
                                  (0, 2, 4, 0, 0), (1, 6, 33, 0, 1), (20, 6, 33, 0, 1), (9, 2, 6, 0.2, 2)):
        assert moe_align_case("cpu", T, k, E, absent, n_shared=n_sh), (T, k, E, absent, n_sh)
    chunk, blocks = km.ALIGN_CHUNK, km.ALIGN_BLOCKS
    km.ALIGN_CHUNK, km.ALIGN_BLOCKS = 32, 2  # several slot chunks and block rounds a program (GPU: past 2,048 slots)
    try:
        for T, k, E, absent, n_sh in ((60, 6, 4, 0, 0), (40, 6, 33, 0.3, 1)):
            assert moe_align_case("cpu", T, k, E, absent, n_shared=n_sh), (T, k, E, absent, n_sh)
    finally:
        km.ALIGN_CHUNK, km.ALIGN_BLOCKS = chunk, blocks
    from tests.kernel_cases import sample_case
    for B, V, dt in ((5, 1000, torch.float32), (3, 5000, torch.float32), (2, 50, torch.float32),
                     (4, 3000, torch.bfloat16)):
        for filters in ("plain", "top_k", "top_p"):
            bad, dlp = sample_case("cpu", B, V, dtype=dt, filters=filters)
            assert bad == 0 and dlp < 1e-4, (B, V, dt, filters, bad, dlp)
    from tests.kernel_cases import threshold_case
    for B, V, dt in ((12, 3000, torch.float32), (13, 5000, torch.bfloat16), (7, 700, torch.float16)):
        assert threshold_case("cpu", B, V, dt) == 0, (B, V, dt)
    # rows over several programs (a GPU's default past a few rows), and 1, 2 and 4 key bits a pass
    for B, V, dt, kw in ((12, 3000, torch.float32, dict(split=4, block=256, rbits=4)),
                         (6, 1000, torch.bfloat16, dict(split=4, block=128, rbits=1)),
                         (5, 900, torch.bfloat16, dict(split=2, block=512, rbits=4))):
        assert threshold_case("cpu", B, V, dt, **kw) == 0, (B, V, dt, kw)
    from tests.kernel_cases import to_host_case
    assert to_host_case("cpu")
    from tests.kernel_cases import STEP_INPUTS_CASES, step_inputs_case
    for case in STEP_INPUTS_CASES:
        assert step_inputs_case("cpu", *case), case
    print("ok")
""")


def test_to_host_alternates_rows_and_counts():
    """The decode step's zero-copy outputs (kernels.sample.to_host) through the torch path: rows alternate by the
    count, the count advances (the kernel: under the interpreter below and on GPUs)."""
    from tests.kernel_cases import to_host_case
    assert to_host_case("cpu")


def _interpreted(code: str, tmp_path, timeout: int) -> list[dict]:
    """Run code (which prints "ok") under Triton's interpreter in a subprocess, its launches recorded
    (tests.launches.record) -> the records."""
    rec = tmp_path / "launches.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.getcwd())
    pre = f"from tests.launches import record\nrecord({str(rec)!r})\n"
    r = subprocess.run([sys.executable, "-c", pre + code], capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
    return json.loads(rec.read_text())


def _compiles_for_the_gpus(records: list[dict]):
    """Each recorded kernel (two launches of each set of argument types and flags) compiles for NVIDIA sm90 and AMD
    gfx942 (float8_e4m3fnuz), with Triton's compilers on the CPU."""
    from tests.launches import TARGETS, compile_all, representatives
    for target in TARGETS:
        bad = compile_all(representatives(records), target)
        assert not bad, f"{target}: {len(bad)} failed\n" + "\n".join(f"{w}\n  {e}" for w, e in bad)


def test_triton_kernels_under_the_interpreter(tmp_path):
    """The kernels against their torch twins under Triton's interpreter; then every kernel the run launched,
    compiled for sm90 and gfx942 (tests.launches). CPU, a few minutes (skipped without Triton, as on CI)."""
    pytest.importorskip("triton")
    records = _interpreted(INTERPRETED, tmp_path, 600)
    _compiles_for_the_gpus(records)


def test_record_notes_compiled_launches_too(tmp_path):
    """tests.launches.record on a GPU run: JITFunction launches are noted (each specialization once, warm-ups not)
    and still launched. The GPU's launch is stood in for, so this runs on the CPU."""
    pytest.importorskip("triton")
    rec = tmp_path / "launches.json"
    code = textwrap.dedent(f"""
        import torch
        from triton.runtime.jit import JITFunction
        launched = []
        JITFunction.run = lambda self, *a, grid, warmup, **k: launched.append((self.fn.__name__, grid, warmup))
        from tests.launches import record
        record({str(rec)!r})
        from kernels.fused import _swiglu_kernel
        x = torch.zeros(8)
        for _ in range(2):
            _swiglu_kernel[(1,)](x, x, x, 8, 7.0, BLOCK=16)
        _swiglu_kernel[(1,)](x, x, x.bfloat16(), 8, 7.0, BLOCK=32)
        _swiglu_kernel.warmup(x, x, x, 8, 7.0, BLOCK=64, grid=(1,))
        y = torch.zeros(40)
        _swiglu_kernel[(1,)](y, y[1:], y, 32, 7.0, BLOCK=32)  # (U 4 bytes off 16-byte alignment; n a multiple of 16)
        _swiglu_kernel[(1,)](y, y, y, 1, 7.0, BLOCK=32)  # (n 1: a constant, as a GPU launch specializes it)
        assert [w for _, _, w in launched] == [False, False, False, True, False, False], launched
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": os.getcwd()}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
    got = json.loads(rec.read_text())
    assert [(s["kernel"], s["signature"]["Y"], s["constexprs"]) for s in got] == [
        ("kernels.fused:_swiglu_kernel", "*fp32", {"BLOCK": 16}),
        ("kernels.fused:_swiglu_kernel", "*bf16", {"BLOCK": 32}),
        ("kernels.fused:_swiglu_kernel", "*fp32", {"BLOCK": 32}),
        ("kernels.fused:_swiglu_kernel", "*fp32", {"n": 1, "BLOCK": 32})]
    assert got[0]["signature"] == {"G": "*fp32", "U": "*fp32", "Y": "*fp32", "n": "i32", "limit": "fp32",
                                   "BLOCK": "constexpr"}
    # as the JIT specializes: aligned tensors "D", integers that are multiples of 16 "D", storage under 2 GB "S"
    assert got[0]["attrs"] == {"G": "DS", "U": "DS", "Y": "DS"}
    assert got[2]["attrs"] == {"G": "DS", "U": "S", "Y": "DS", "n": "D"}
    assert got[3]["signature"]["n"] == "constexpr" and "n" not in got[3]["attrs"]


def test_launch_records_compile_for_each_target():
    """tests.launches: a recorded launch as each target gets it (PDL on sm90 only; the fp32 products' passes and
    the FP8 type of the target), and a compile failure is reported, not passed over."""
    pytest.importorskip("triton")
    from tests.launches import _compile, for_target
    mix = {"kernel": "kernels.fused:_hc_mix_kernel",
           "signature": {"X": "*fp32", "FN": "*fp32", "PART": "*fp32", "M": "i32", **{n: "constexpr" for n in (
               "F", "MIX", "MIXP", "SPLIT", "CHUNK", "BM", "BK", "SSQ", "PREC", "PDL")}},
           "constexprs": {"F": 192, "MIX": 8, "MIXP": 16, "SPLIT": 3, "CHUNK": 64, "BM": 16, "BK": 64, "SSQ": True,
                          "PREC": "tf32x3", "PDL": False}, "options": {"num_warps": 4}}
    nv, amd = for_target(mix, "sm90"), for_target(mix, "gfx942")
    assert (nv["constexprs"]["PDL"], nv["options"]["launch_pdl"], nv["constexprs"]["PREC"]) == (True, True, "tf32x3")
    assert (amd["constexprs"]["PDL"], amd["options"]["launch_pdl"], amd["constexprs"]["PREC"]) == \
        (False, False, "bf16x6")
    (e_nv, r_nv), (e_amd, r_amd) = _compile(nv, "sm90", True), _compile(amd, "gfx942", True)
    assert e_nv is None and e_amd is None and _compile(nv, "sm90") == (None, None)
    assert 0 < r_nv["registers"] <= 255 and 0 < r_amd["registers"] <= 512 and r_amd["spilled"] >= 0
    assert r_nv["scratch_bytes"] >= 0 and r_amd["scratch_bytes"] >= 0
    assert "input_precision" in _compile(mix, "gfx942")[0]  # CUDA's tf32x3 on AMD: refused, and said
    # the recorded attrs reach the compilers: 16-byte aligned pointers and n give vector loads (sm90 4-wide; gfx942
    # 2 a thread of its 64-wide waves, and through buffer loads for storage under 2 GB)
    from tests.launches import compiled
    sw = {"kernel": "kernels.fused:_swiglu_kernel", "signature": {"G": "*fp32", "U": "*fp32", "Y": "*fp32",
                                                                   "n": "i32", "limit": "fp32", "BLOCK": "constexpr"},
          "constexprs": {"BLOCK": 512}, "options": {"num_warps": 4}}
    aligned = {**sw, "attrs": {"G": "DS", "U": "DS", "Y": "DS", "n": "D"}}
    assert "ld.global.v4" not in compiled(sw, "sm90").asm["ptx"]
    assert "ld.global.v4" in compiled(aligned, "sm90").asm["ptx"]
    amd = [compiled(for_target(x, "gfx942"), "gfx942").asm["amdgcn"] for x in (sw, aligned)]
    vector = r"\s(global|buffer)_load_dwordx\d"  # (not the kernel arguments' scalar s_load_dwordx)
    assert not re.search(vector, amd[0]) and re.search(r"\sbuffer_load_dwordx2", amd[1])
    up = {"kernel": "kernels.moe:_moe_up_kernel", "signature": {"X": "*fp8e4nv", "W1": "*fp8e4nv"},
          "constexprs": {}, "options": {"maxnreg": 128}}
    amd = for_target(up, "gfx942")
    assert amd["signature"] == {"X": "*fp8e4b8", "W1": "*fp8e4b8"} and "maxnreg" not in amd["options"]


AMD_ATTENTION = textwrap.dedent("""
import torch
from kernels import attention, fp8_gemm
from kernels.attention import decode_attention, decode_attention_ref
attention._hip = lambda t: True  # ROCm's plan (_attn_plan's hip) for the interpreter's CPU tensors
g = torch.Generator().manual_seed(0)
H, d, W, BE, nb = 16, 512, 16, 8, 4
for (B, sms), dt in zip(((1, 1), (4, 1), (40, 64), (40, 16)) * 2, [torch.float32] * 4 + [torch.bfloat16] * 4):
    # one tile; under 32 tiles; up to the SMs; past them: over fp32 caches, then the engine's bf16 (launched for
    # their compile below, values unchecked: Triton 3.6's interpreter multiplies a bf16 tl.dot's raw bits,
    # triton-lang/triton#11584)
    fp8_gemm._SMS[torch.device("cpu")] = sms
    q, win = torch.randn(B, H, d, generator=g).to(dt), torch.randn(B + 1, W, d, generator=g).to(dt)
    pool, sink = torch.randn(B * nb + 1, BE, d, generator=g).to(dt), torch.randn(H, generator=g)
    slots, pos = torch.randperm(B + 1, generator=g)[:B], torch.randint(0, 3 * W, (B,), generator=g)
    table = torch.randperm(B * nb + 1, generator=g)[:B * nb].view(B, nb)
    count = torch.randint(0, nb * BE + 1, (B,), generator=g)
    sel = torch.stack([torch.randperm(nb * BE, generator=g)[:12] for _ in range(B)])
    sel = torch.where(torch.arange(12) < count[:, None].clamp(max=12), sel.clamp(max=int(count.max()) - 1), -1)
    cs = (torch.randn(B, 32, generator=g), torch.randn(B, 32, generator=g))
    for kw in ({}, dict(pool=pool, table=table, sel=sel, count=count.clamp(max=12)),
               dict(pool=pool, table=table, count=count)):
        o, oq = decode_attention(q, win, slots, pos, sink, d ** -0.5, unrope=cs, fp8=torch.float8_e4m3fn, **kw)
        want = decode_attention_ref(q, win, slots, pos, sink, d ** -0.5, unrope=cs, **kw)
        assert oq is not None and (dt != torch.float32 or (o - want).abs().max() < 1e-4), (B, sms, dt, list(kw))
print("ok")
""")


def test_amd_decode_attention_plans_do_not_spill(tmp_path):
    """ROCm's decode-attention plans (_attn_plan's hip) at the release's head_dim 512: one (token, head block)
    tile, under 32, up to the SMs and past them, over the window, CSA picks and HCA entries, the output rotated
    back and quantized, under Triton's interpreter against the reference (fp32 caches; bf16 ones launched only);
    then compiled for AMD gfx942, where none may spill to scratch memory (the CUDA plan's 32- and 64-key steps
    spill up to 407 VGPRs a thread there). CPU, about a minute (skipped without Triton, as on CI)."""
    pytest.importorskip("triton")
    from tests.launches import compile_all
    records = [r for r in _interpreted(AMD_ATTENTION, tmp_path, 600) if r["kernel"].endswith("_decode_attn_kernel")]
    res = []
    assert not compile_all(records, "gfx942", resources=res)
    assert len(res) >= 8 and {r["constexprs"]["BLOCK_K"] for r in records} == {16}
    spill = [(w, r) for w, r in res if r["scratch_bytes"] or r["spilled"]]
    assert not spill, spill


ENGINE_INTERPRETED = textwrap.dedent("""
import torch
from model import ModelConfig, build_model
from model.config import load_yaml
from kernels import fused
from rollout_server import Engine, SamplingParams, SimpleEngine
# widths in 128s, so the FP8 linears and experts take the Triton kernels (not tiny's dequantized weights) and the
# quantized rows of the mHC pre and q-norm kernels feed them; spies count the rows those kernels quantized
dims = ["model.vocab_size=32", "model.hidden_size=128", "model.q_lora_rank=128", "model.head_dim=64",
        "model.o_lora_rank=128", "model.moe_intermediate_size=128"]
cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml", dims)["model"])
m = build_model(cfg, seed=0).eval()
quantized = {"hc_pre": 0, "rms_norm_quant": 0}
def spy(name, i):
    f = getattr(fused, name)
    def run(*a, **k):
        out = f(*a, **k)
        quantized[name] += len(out) > i and out[i] is not None
        return out
    setattr(fused, name, run)
spy("hc_pre", 3)
spy("rms_norm_quant", 1)
from kernels import fp8_gemm
gemv = fp8_gemm.gemv
def gemv_spy(*a, **k):  # the one-row steps' wq_b GEMVs that take the q norm (Prenorm)
    quantized["gemv_norm"] = quantized.get("gemv_norm", 0) + (k.get("norm") is not None)
    return gemv(*a, **k)
fp8_gemm.gemv = gemv_spy
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 32, (n,), generator=g).tolist() for n in (5, 30, 41)]
# the last prompt's one more token: a one-row decode step (the GEMV paths, the norm in wq_b's)
sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 5, 6)]
kw = dict(fp8=True, dtype=torch.float32, device="cpu", record_index=True)
a = Engine(m, max_model_len=128, **kw).generate(prompts, sp)
b = SimpleEngine(m, **kw).generate(prompts, sp)
# prompts in chunks of at most 24 tokens: the later chunks one sequence at a time (prefill's attention kernel over
# the cached window and entries)
c = Engine(m, max_model_len=128, max_batch_tokens=24, **kw).generate(prompts, sp)
for x, y, z in zip(a, b, c):
    assert x.token_ids == y.token_ids == z.token_ids and torch.equal(x.routed_experts, y.routed_experts)
    assert torch.equal(x.index_entries, y.index_entries) and torch.equal(z.index_entries, y.index_entries)
    assert torch.equal(z.routed_experts, y.routed_experts)
assert int(a[-1].index_entries.max()) >= 4  # past 4 entries the indexer chooses among them
assert quantized["hc_pre"] > 0 and quantized["rms_norm_quant"] > 0 and quantized["gemv_norm"] > 0, quantized
print("ok")
""")


def test_fp8_paged_engine_under_the_interpreter(tmp_path):
    """The paged FP8 engine on the decode path's Triton kernels (3 rows a step, widths in 128s: the mHC pre and
    q-norm kernels' quantized rows feed the FP8 linears and the experts; the index_topk kernel's choices
    recorded; then a one-row step: the GEMV kernels, wq_b's taking the q norm) and prefill's attention kernel
    (whole prompts, and prompts in chunks) against the simple engine: tokens, routing and the indexer's choices;
    then its kernels compiled for sm90 and gfx942 (tests.launches). CPU, a few minutes (skipped without Triton, as
    on CI)."""
    pytest.importorskip("triton")
    _compiles_for_the_gpus(_interpreted(ENGINE_INTERPRETED, tmp_path, 900))


def test_meta_tensors_take_the_torch_twins_even_under_the_interpreter(monkeypatch):
    """A model built on meta (the engine's streamed load) gets its FP8 holders' shapes from the torch twins, which
    run on meta: under TRITON_INTERPRET=1 a kernel would be handed tensors without data."""
    pytest.importorskip("triton")
    from kernels.fp8_gemm import block_quant, use_triton
    from kernels.quant import fp8_dtype
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(torch.zeros(2)) and not use_triton(torch.empty(2, device="meta"))
    q, s = block_quant(torch.empty(256, 384, device="meta", dtype=torch.bfloat16), fp8_dtype(torch.device("cpu")))
    assert q.is_meta and q.shape == (256, 384) and s.shape == (2, 3)


def test_tickets_grow_without_freeing_the_old_counters():
    """A larger request replaces the ticket counters but keeps the old buffer alive: CUDA graphs captured with it
    still read and reset it, so its memory must never go to another tensor."""
    import gc
    import weakref
    from kernels import fp8_gemm
    dev = torch.device("meta")  # a device of its own: the CPU's counters stay as the other tests left them
    try:
        old = fp8_gemm.tickets(dev, 10)
        ref = weakref.ref(old)
        del old
        new = fp8_gemm.tickets(dev, 10_000)
        gc.collect()
        assert new.numel() >= 10_000 and ref() is not None and ref() is not new
        assert fp8_gemm.tickets(dev, 5) is new  # smaller requests take the current buffer
    finally:
        fp8_gemm._COUNTERS.pop((dev, 0), None)
        fp8_gemm._RETIRED[:] = [t for t in fp8_gemm._RETIRED if t.device != dev]
