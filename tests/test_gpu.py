"""GPU checks (skipped without CUDA): every Triton kernel against its torch reference at the mini / release
shapes, and the paged engine's CUDA-graph decode against its eager decode and the simple engine."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

from kernels.attention import (decode_attention, decode_attention_ref, index_scores, index_scores_ref,  # noqa: E402
                               unrope_ref)
from kernels.fp8_gemm import act_quant, act_quant_ref, block_quant, fp8_gemm, fp8_gemm_ref, tickets, tickets_left  # noqa: E402
from kernels.moe import (MOE_GEMV_TOKENS, _moe_gemv, _moe_tiles, fused_moe, fused_moe_ref, moe_block_m,  # noqa: E402
                         moe_gemv_early, moe_swap, moe_up_regs)
from kernels.quant import fp8_dtype, quant_fp8_block  # noqa: E402


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("M", [1, 16, 100, 512])
@pytest.mark.parametrize("K", [384, 2048, 8192])
def test_act_quant_bit_exact(M, K):
    """Every row's tiles, ACT_TILES a program (K 384: one program's block past the row's 3 tiles, masked). The
    kernel divides as the other quantizing kernels do (approximate `/`); torch's reference multiplies amax by
    1/fmax and divides x exactly, so over millions of values a rare one lands on the neighbouring fp8 value
    (one at 512 x 8192 on an H200): bytes equal but for at most 1 in 10^5, those one fp8 step apart."""
    f8 = fp8_dtype("cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * 3
    q, s = act_quant(x, f8)
    qr, sr = act_quant_ref(x, f8)
    assert torch.allclose(s, sr, rtol=1e-6, atol=0)
    diff = q.view(torch.uint8) != qr.view(torch.uint8)
    assert int(diff.sum()) <= q.numel() // 100000
    a, b = q[diff].float(), qr[diff].float()
    assert ((a - b).abs() <= b.abs() / 8 + 2 ** -9).all()  # e4m3: 3 mantissa bits (subnormal step 2^-9)


@pytest.mark.parametrize("shape", [(2048, 7168), (300, 200), (4, 1536, 512), (8, 130, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_quant_bit_exact(shape, dtype):
    f8 = fp8_dtype("cuda")
    w = torch.randn(shape, device="cuda", dtype=dtype) * torch.rand(shape[-1], device="cuda", dtype=dtype) * 0.1
    w[..., :3, :5] = 0  # an all-zero corner in a block does not change its scale
    q, s = block_quant(w, f8)
    qr, sr = quant_fp8_block(w.cpu(), f8, scale_fmt="fp32")  # on CPU: IEEE division, like the kernel's div_rn
    assert torch.equal(q.view(torch.uint8).cpu(), qr.view(torch.uint8)) and torch.equal(s.cpu(), sr)


@pytest.mark.parametrize("M", [1, 16, 24, 40, 64, 100, 256, 300])
@pytest.mark.parametrize("N,K", [(2048, 2048), (8192, 512), (512, 2048), (4096, 8192), (300, 1024)])
def test_fp8_gemm(M, N, K):
    """fp8_gemm's tiles and K ranges at each size (split over programs up to 256 rows, none past) against the
    reference; repeated launches give the same bits and leave the ticket counters at 0."""
    f8 = fp8_dtype("cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    wq, ws = quant_fp8_block(torch.randn(N, K, device="cuda") * 0.02, f8, scale_fmt="fp32")
    xq, sx = act_quant(x, f8)
    got = fp8_gemm(xq, sx, wq, ws, torch.float32)
    # Hopper's FP8 tensor cores accumulate a 128-wide K block at reduced precision (hence the per-block fp32
    # promotion in the kernel); the reference accumulates in full fp32
    assert rel(got, fp8_gemm_ref(xq, sx, wq, ws)) < 1e-3
    again = torch.stack([fp8_gemm(xq, sx, wq, ws, torch.float32) for _ in range(20)])
    assert torch.equal(again, got.expand_as(again))
    assert tickets_left(x.device) == 0


@pytest.mark.parametrize("M", [1, 5, 300, 1030, 2050])
@pytest.mark.parametrize("N,K", [(2048, 2048), (8192, 512), (512, 2048)])
def test_scaled_mm(M, N, K):
    """torch._scaled_mm's block recipe (fp8_gemm's path where scaled_mm_takes and the probe finds it) against
    the reference and the Triton GEMM, rows not a multiple of 4 included (a misread layout or scale is off by
    about 100%)."""
    from kernels.fp8_gemm import _gemm_blocks, scaled_mm, scaled_mm_ok, scaled_mm_takes
    f8 = fp8_dtype("cuda")
    if not scaled_mm_ok(torch.device("cuda", torch.cuda.current_device()), f8):
        pytest.skip("torch._scaled_mm has no block-scaled recipe on this GPU / build")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    wq, ws = quant_fp8_block(torch.randn(N, K, device="cuda") * 0.02, f8, scale_fmt="fp32")
    xq, sx = act_quant(x, f8)
    got = scaled_mm(xq, sx, wq, ws, torch.float32)
    want = fp8_gemm_ref(xq, sx, wq, ws)
    triton_ = fp8_gemm(xq, sx, wq, ws, torch.float32, blocks=_gemm_blocks(M, N, K, 1))  # blocks: the Triton GEMM
    assert got.shape == (M, N) and rel(got, want) < 1e-2 and rel(got, triton_) < 1e-2, (rel(got, want),
                                                                                       rel(triton_, want))
    if scaled_mm_takes(M, N, K, 1):  # fp8_gemm's own choice, in BF16 too
        assert torch.equal(fp8_gemm(xq, sx, wq, ws, torch.float32), got)
        assert torch.equal(fp8_gemm(xq, sx, wq, ws), scaled_mm(xq, sx, wq, ws))


@pytest.mark.parametrize("M", [1, 5, 16, 40, 64, 100, 256])
@pytest.mark.parametrize("N,K,G", [(2048, 2048, 1), (8192, 512, 1), (300, 1024, 1), (2048, 2048, 4),
                                   (4096, 8192, 1), (8192, 32768, 8)])  # the last two past GEMM_BIG_WEIGHT
def test_fp8_linear_fused(M, N, K, G):
    """The one-launch kernel (activation tiles quantized in the GEMM, K ranges added by each tile's last program)
    against act_quant + fp8_gemm, at each tile shape and K range it may take (None: _fused_blocks', the release's
    _big_tiles for the last two shapes up to 16 rows); repeated launches give the same bits (the ranges are added
    in order whichever program finishes last) and leave the ticket counters at 0."""
    from kernels.fp8_gemm import fp8_linear_fused
    f8 = fp8_dtype("cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * 3
    wq, ws = quant_fp8_block(torch.randn(N, K // G, device="cuda") * 0.02, f8, scale_fmt="fp32")
    want = fp8_gemm(*act_quant(x, f8), wq, ws, torch.float32, groups=G)
    for blocks in (None, (16, 32, 1), (32, 64, 2), (64, 16, 4), (16, 32, 3), (64, 64, 16), (16, 128, 1)):
        got = fp8_linear_fused(x.float(), wq, ws, groups=G, blocks=blocks)
        # Hopper's FP8 MMA accumulates a K block at reduced precision; tile shapes differ in how
        assert rel(got, want) < 1e-3, blocks
        again = torch.stack([fp8_linear_fused(x.float(), wq, ws, groups=G, blocks=blocks) for _ in range(50)])
        assert torch.equal(again, got.expand_as(again)), blocks
    assert tickets_left(x.device) == 0


@pytest.mark.parametrize("M", [1, 2, 3])
@pytest.mark.parametrize("N,K,G", [(2048, 2048, 1), (8192, 512, 1), (300, 1024, 1), (2048, 2048, 4), (384, 640, 1)])
def test_gemv(M, N, K, G):
    """The GEMV kernel (the decode step's linears at 1-2 rows) against act_quant + fp8_gemm (fp32 x: only the
    order of the fp32 sums differs), from a weight view whose rows are longer than K, and with a BF16 weight
    against an fp32 product."""
    from kernels.fp8_gemm import gemv
    f8 = fp8_dtype("cuda")
    g = torch.Generator("cuda").manual_seed(M)
    x = torch.randn(M, K, device="cuda", generator=g) * 3
    wq, ws = quant_fp8_block(torch.randn(N, K // G + 128, device="cuda", generator=g) * 0.02, f8, scale_fmt="fp32")
    wq, ws = wq[:, :K // G], ws[:, :K // G // 128]
    want = fp8_gemm(*act_quant(x, f8), wq.contiguous(), ws.contiguous(), torch.float32, groups=G)
    assert rel(gemv(x, wq, ws, groups=G), want) < 1e-6
    xb = x.bfloat16()  # bf16 rows: quantized from their own values, the result rounded to bf16
    want = fp8_gemm(*act_quant(xb, f8), wq.contiguous(), ws.contiguous(), torch.float32, groups=G)
    assert rel(gemv(xb, wq, ws, groups=G), want) < 4e-3
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16()
    assert rel(gemv(xb, w, None), xb.float() @ w.float().T) < 4e-3
    if G == 1 and M <= 2:  # the RMSNorm of the rows first (Prenorm's), rows read in place from a column slice
        from model.model import RMSNorm
        nrm = RMSNorm(K, 1e-6).cuda()
        nrm.weight.data = torch.rand(K, device="cuda", generator=g) + 0.5
        xs = torch.randn(M, K + 256, device="cuda", generator=g).bfloat16()[:, 128:K + 128]
        normed = nrm(xs.contiguous())
        got = gemv(xs, wq, ws, norm=nrm)
        assert rel(got, gemv(normed, wq, ws)) < 4e-3 and rel(got, fp8_gemm(*act_quant(normed, f8), wq.contiguous(),
                                                                              ws.contiguous(), torch.bfloat16)) < 4e-3


@pytest.mark.parametrize("M", [1, 2, 5, 16, 17])
@pytest.mark.parametrize("N,K", [(2592, 2048), (1024, 2048), (4096, 512), (300, 1024)])
def test_small_linear(M, N, K):
    """The one-launch kernel with a BF16 weight (the engine's BF16 input GEMMs at decode sizes) against fp32,
    and small_linear (the kernel or cuBLAS, by its rule)."""
    from kernels.fp8_gemm import fp8_linear_fused, small_linear
    g = torch.Generator("cuda").manual_seed(M)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16()
    want = x.float() @ w.float().T
    for got in (small_linear(x, w),) + ((fp8_linear_fused(x, w, None),) if M <= 16 else ()):
        assert got.dtype == torch.bfloat16 and rel(got, want) < 4e-3
    assert tickets_left(x.device) == 0


@pytest.mark.parametrize("M", [1, 16, 100, 256])
@pytest.mark.parametrize("N,K,G", [(2048, 2048, 4), (1024, 512, 2)])
def test_fp8_linear_grouped(M, N, K, G):
    """wo_a's block-diagonal FP8 product in one grouped launch against one fp8_linear per group."""
    from kernels.fp8_gemm import fp8_linear_grouped
    f8 = fp8_dtype("cuda")
    x = torch.randn(M, G, K // G, device="cuda", dtype=torch.bfloat16) * 2
    wq, ws = quant_fp8_block(torch.randn(N, K // G, device="cuda") * 0.02, f8, scale_fmt="fp32")
    got, want = fp8_linear_grouped(x, wq, ws), fp8_linear_grouped(x, wq, ws, fused=False)
    assert got.shape == want.shape and rel(got, want) < 1e-3


@pytest.mark.parametrize("T", [1, 2, 16, 64, 128, 256])
@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("n_shared,absent", [(0, 0.0), (1, 0.0), (0, 0.3)])
def test_fused_moe(T, fp8, n_shared, absent):
    """The grouped kernels against the per-expert loop: plain, with the last expert shared (every token, weight 1),
    with slots on another rank (id E, skipped). 1-2 tokens: the GEMV kernels, against the tiled ones below too.
    FP8 up to 16 tokens and at 65-128 the tiled kernels' products are weights-first (wgmma), checked as the 64-row
    blocks are."""
    E, k, D, I = 32, 6, 2048, 1024
    g = torch.Generator("cuda").manual_seed(T)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.rand(T, E - n_shared, device="cuda", generator=g).argsort(-1)[:, :k]
    ids = torch.where(torch.rand(T, k, device="cuda", generator=g) < absent, torch.full_like(ids, E), ids)
    wt = torch.rand(T, k, device="cuda", generator=g)
    w = [torch.randn(E, I, D, device="cuda", generator=g) * 0.02, torch.randn(E, D, I, device="cuda", generator=g) * 0.02,
         torch.randn(E, I, D, device="cuda", generator=g) * 0.02]
    if fp8:
        q = [quant_fp8_block(t, fp8_dtype("cuda"), scale_fmt="fp32") for t in w]
        args = (q[0][0], q[1][0], q[2][0], q[0][1], q[1][1], q[2][1])
    else:
        args = tuple(t.to(torch.bfloat16) for t in w)
    got, want = fused_moe(x, ids, wt, *args, n_shared=n_shared), fused_moe_ref(x, ids, wt, *args, n_shared=n_shared)
    assert rel(got, want) < 1e-2
    # FP8 at 65-128 tokens the up kernel runs held to 128 registers (moe_up_regs): checked here, at 128
    capped = moe_up_regs(x, moe_block_m(T, fp8), _moe_tiles(T, fp8)[0][1], moe_swap(T, fp8), fp8)
    assert capped == ({"maxnreg": 128} if fp8 and 64 < T <= 128 else {}), capped
    # the down programs waiting each for its row block's up tiles (moe_overlap), or for the whole up launch: the
    # same bits, every count put back; repeated, so a count left behind would show
    for _ in range(3):
        for overlap in (False, True):
            assert torch.equal(got, fused_moe(x, ids, wt, *args, n_shared=n_shared, overlap=overlap)), overlap
        if T > 2:  # the overlapped down programs' first weight tile loaded before their wait, or after
            for early in (False, True):
                assert torch.equal(got, fused_moe(x, ids, wt, *args, n_shared=n_shared, overlap=True,
                                                  early=early)), early
    assert tickets_left(x.device) == 0
    # the slot rows unsummed (the engine's run_layers), summed by the next mHC post with its mix partials (4
    # streams; a program a token up to POST_MIX_TOKENS, a 16-token block past them): the bits of summing first
    from kernels import fused
    rows = fused_moe(x, ids, wt, *args, n_shared=n_shared, summed=False)
    assert torch.equal(rows.summed(), got)
    # up to 2 tokens the buffers can be made before the routing (the engine's, before the router), the shared
    # expert's slots then first in the up launch, not waiting: the same bits; none past the GEMV path
    pre = moe_gemv_early(x, k, args[0], n_shared)
    assert (pre is None) == (n_shared == 0 or T > MOE_GEMV_TOKENS)
    if pre is not None:
        assert torch.equal(fused_moe(x, ids, wt, *args, n_shared=n_shared, summed=False, rows=pre).summed(), got)
    if T <= MOE_GEMV_TOKENS:  # the GEMV up programs' slabs, one or four (default MOE_GEMV_REPS): the same bits
        for reps in (1, 4):
            assert torch.equal(_moe_gemv(x, ids, wt, *(*args, None, None, None)[:6], 10.0, n_shared,
                                         reps=reps).summed(), got), reps
    xs = torch.randn(T, 4, D, device="cuda", dtype=torch.bfloat16, generator=g)
    post, comb = torch.rand(T, 4, device="cuda", generator=g), torch.rand(T, 4, 4, device="cuda", generator=g)
    fn = torch.randn(24, 4 * D, device="cuda", generator=g) * 0.02
    for a, b in zip(fused.hc_post(rows, xs, post, comb, fn), fused.hc_post(got, xs, post, comb, fn)):
        assert torch.equal(a, b)
    # FP8 on wgmma (64-row blocks, or weights-first products: a 128-wide K block's products summed at reduced
    # precision) differs from 16-row x-first blocks by far less than FP8 itself differs from the BF16 weights;
    # the GEMV kernels and x-first 16-row blocks agree to 1e-3
    if fp8:
        bf16 = fused_moe_ref(x, ids, wt, *(t.to(torch.bfloat16) for t in w), n_shared=n_shared)
        exact = fused_moe(x, ids, wt, *args, n_shared=n_shared, block_m=16, swap=False, gemv=False)
        wgmma = 0.2 * rel(exact, bf16)
        for bm, swap in ((16, True), (32, True), (64, False)):
            y = fused_moe(x, ids, wt, *args, n_shared=n_shared, block_m=bm, swap=swap, gemv=False)
            assert rel(y, exact) < wgmma, (bm, swap, rel(y, exact), rel(exact, bf16))
        precise = T <= MOE_GEMV_TOKENS or not (moe_swap(T, True) or moe_block_m(T, True) == 64)
        assert rel(got, exact) < (1e-3 if precise else wgmma), rel(got, exact)
        got = exact
    # the up kernel's K split over programs, the ranges added by each tile's last program; 16-64-row blocks
    for bm in (16, 32, 64):
        for tiles in (((128 if fp8 else 64, 4, 3, 4), (64, 4, 3)), ((64, 8, 3, 16), (128, 4, 3))):
            y = fused_moe(x, ids, wt, *args, n_shared=n_shared, tiles=tiles, block_m=bm, swap=False)
            assert rel(y, got) < (1e-3 if bm < 64 or not fp8 else 1e-2), (bm, tiles)
    if fp8:  # the up kernel's own quantization of h (the default, 128 wide) and act_quant's: the same bits
        up, down = _moe_tiles(T, True)
        assert torch.equal(*(fused_moe(x, ids, wt, *args, n_shared=n_shared, tiles=((bn, *up[1:]), down), block_m=16,
                                       swap=False) for bn in (128, 64)))


@pytest.mark.parametrize("mode", ["window", "csa", "csa_count", "hca"])
def test_decode_attention(mode):
    B, H, d, W, BE, nb = 40, 16, 512, 128, 64, 200
    g = torch.Generator("cuda").manual_seed(1)
    q = torch.randn(B, H, d, device="cuda", dtype=torch.bfloat16, generator=g)
    win = torch.randn(B + 1, W, d, device="cuda", dtype=torch.bfloat16, generator=g)
    pool = torch.randn(nb, BE, d, device="cuda", dtype=torch.bfloat16, generator=g)
    sink = torch.randn(H, device="cuda", generator=g)
    slots = torch.randperm(B, device="cuda", generator=g)
    pos = torch.randint(0, 16384, (B,), device="cuda", generator=g)
    pos[0] = 3  # a window that is not full yet
    table = torch.randint(1, nb, (B, 70), device="cuda", generator=g)
    kw = {}
    if mode.startswith("csa"):
        sel = torch.rand(B, 70 * BE, device="cuda", generator=g).argsort(-1)[:, :512]
        sel[1, 100:] = -1
        kw = dict(pool=pool, table=table, sel=sel)
        if mode == "csa_count":  # only sel's first count[b] positions count (ids past them too)
            kw["count"] = torch.randint(0, 700, (B,), device="cuda", generator=g)
    elif mode == "hca":
        kw = dict(pool=pool, table=table, count=torch.randint(0, 70 * BE, (B,), device="cuda", generator=g))
    want = decode_attention_ref(q, win, slots, pos, sink, d ** -0.5, **kw)
    # the default (40 rows: merged in the kernel), none, uneven, more splits than some rows have keys; each merged
    # by the last split and by the combine kernel
    for splits in (None, 1, 5, 40):
        for merge in (None, True, False):
            a = decode_attention(q, win, slots, pos, sink, d ** -0.5, splits=splits, merge=merge, **kw)
            assert rel(a, want) < 1e-2, (splits, merge)
    for B1 in (1, 3):  # few rows: the default splits the key range wider, the combine kernel merges
        a = decode_attention(q[:B1], win, slots[:B1], pos[:B1], sink, d ** -0.5,
                             **{k: v[:B1] if k != "pool" else v for k, v in kw.items()})
        assert rel(a, want[:B1]) < 1e-2, B1
    # more rows than SMs (the 4-warp plan): the rows again five times over, reading the same cache rows
    rep = {k: v.repeat(5, *[1] * (v.dim() - 1)) if k != "pool" else v for k, v in kw.items()}
    a = decode_attention(q.repeat(5, 1, 1), win, slots.repeat(5), pos.repeat(5), sink, d ** -0.5, **rep)
    assert rel(a, want.repeat(5, 1, 1)) < 1e-2
    # the output rotated back in the kernel's store (the engine's project_out then skips its inverse RoPE), at
    # every merge: the same rotation of the same rounded output (the compiler may fuse its products into FMAs, so
    # an ulp here and there)
    from model.model import Rope
    cs = Rope(64, 10000.0, None).cuda()(pos)
    for splits, merge in ((None, None), (1, None), (5, True), (5, False)):
        for B1 in (B, 1):
            kw1 = {k: v[:B1] if k != "pool" else v for k, v in kw.items()}
            a = decode_attention(q[:B1], win, slots[:B1], pos[:B1], sink, d ** -0.5, splits=splits, merge=merge, **kw1)
            b = decode_attention(q[:B1], win, slots[:B1], pos[:B1], sink, d ** -0.5, splits=splits, merge=merge,
                                 unrope=(cs[0][:B1], cs[1][:B1]), **kw1)
            c = unrope_ref(a, cs[0][:B1], cs[1][:B1])
            assert torch.equal(b[..., :-64], a[..., :-64]) and rel(b[..., -64:], c[..., -64:]) < 1e-3, (splits, B1)
            # the output also stored quantized (the FP8 engine's wo_a input): act_quant's bytes of that output
            o, (oq, osc) = decode_attention(q[:B1], win, slots[:B1], pos[:B1], sink, d ** -0.5, splits=splits,
                                            merge=merge, unrope=(cs[0][:B1], cs[1][:B1]), fp8=fp8_dtype("cuda"),
                                            **kw1)
            q2, s2 = act_quant(o.reshape(B1, -1), fp8_dtype("cuda"))
            assert torch.equal(o, b) and torch.equal(osc, s2), (splits, B1)
            assert torch.equal(oq.view(torch.uint8), q2.view(torch.uint8)), (splits, B1)
    assert int(tickets(q.device, 1).abs().sum()) == 0  # the merges put every ticket back


def test_index_scores():
    B, h, d, BE, nb, S = 16, 32, 128, 64, 300, 4096
    g = torch.Generator("cuda").manual_seed(2)
    qi, wi = torch.randn(B, h, d, device="cuda", generator=g), torch.randn(B, h, device="cuda", generator=g)
    pool = torch.randn(nb, BE, d, device="cuda", generator=g)
    table = torch.randint(1, nb, (B, S // BE), device="cuda", generator=g)
    count = torch.randint(0, S, (B,), device="cuda", generator=g)
    a, b = index_scores(qi, wi, pool, table, count, S), index_scores_ref(qi, wi, pool, table, count, S)
    fin = ~torch.isinf(b)
    assert torch.equal(torch.isinf(a), torch.isinf(b)) and rel(a[fin], b[fin]) < 1e-5
    # the decode step's raw indexer outputs: bf16 q, head weights a strided bf16 column slice scaled in the kernel
    wide = torch.randn(B, 3 * h, device="cuda", generator=g).bfloat16()
    a = index_scores(qi.bfloat16(), wide[:, h:2 * h], pool, table, count, S, h ** -0.5)
    b = index_scores_ref(qi.bfloat16().float(), wide[:, h:2 * h].float() * h ** -0.5, pool, table, count, S)
    assert torch.equal(torch.isinf(a), torch.isinf(b)) and rel(a[fin], b[fin]) < 1e-5


def test_prefill_index():
    """prefill_index (scores in one kernel, then index_topk a row a query row) against prefill_index_ref at mini's
    indexer shapes (32 heads of 128, top 512): a chunk of 2 sequences with entries past the top-k, one long row
    block, and rows past 1,024 entries (index_topk's radix select: rows in chunks, and rows held whole past 3/4
    of S)."""
    from tests.kernel_cases import prefill_index_case
    assert prefill_index_case("cuda", 2, 600, 160, 32, 128, 64)
    assert prefill_index_case("cuda", 1, 2500, 625, 32, 128, 512, seed=1)
    assert prefill_index_case("cuda", 1, 6000, 1500, 32, 128, 512, seed=2)


@pytest.mark.parametrize("n", [2, 4])
def test_fused_hc_and_norms(n, monkeypatch):
    from kernels import fp8_gemm, fused
    from model.model import RMSNorm, hc_post, hc_pre, rms_unweighted
    g = torch.Generator("cuda").manual_seed(n)
    x = torch.randn(64, n, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    fn = torch.randn((2 + n) * n, n * 2048, device="cuda", generator=g) * 0.02
    base, sc = torch.randn((2 + n) * n, device="cuda", generator=g), torch.rand(3, device="cuda", generator=g) + 0.5
    for rows in (1, 7):  # one token and a few: the mix GEMV split over many column ranges
        got = fused.hc_pre(x[:rows], fn, base, sc, 20, 1e-6, 1e-6)
        for a, b in zip(got, hc_pre(x[:rows], fn, base, sc, 20, 1e-6, 1e-6)):
            assert rel(a, b) < 1e-3, rows
    got, want = fused.hc_pre(x, fn, base, sc, 20, 1e-6, 1e-6), hc_pre(x, fn, base, sc, 20, 1e-6, 1e-6)
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-3
    # the site's RMSNorm in the same kernel, and the head's collapse + norm (Transformer.hc_head's formula)
    nm = RMSNorm(2048, 1e-6).cuda()
    nm.weight.data.normal_(generator=g)
    for rows in (1, 64):
        normed = fused.hc_pre(x[:rows], fn, base, sc, 20, 1e-6, 1e-6, (nm.weight, nm.eps))
        assert rel(normed[0], nm(got[0][:rows])) < 1e-2
        assert all(torch.equal(a, b[:rows]) for a, b in zip(normed[1:], got[1:]))  # batch-invariant
        # the FP8 engine's: the normed rows also quantized per 1x128 tile, act_quant's bytes and scales
        f8 = fp8_dtype("cuda")
        h, _, _, (q, s) = fused.hc_pre(x[:rows], fn, base, sc, 20, 1e-6, 1e-6, (nm.weight, nm.eps), None, f8)
        q2, s2 = fp8_gemm.act_quant(h, f8)
        assert torch.equal(h, normed[0]) and torch.equal(s, s2)
        assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
        # post and comb made on a second stream (the decode step's): the same bits, joined before they are read
        side, part = torch.cuda.Stream(), fused._mix_partials(x[:rows].flatten(-2), fn, ssq=True)
        apart = fused.hc_pre(x[:rows], fn, base, sc, 20, 1e-6, 1e-6, (nm.weight, nm.eps), part, f8, side)
        torch.cuda.current_stream().wait_stream(side)
        assert all(torch.equal(a, b) for a, b in zip(apart[:3], (h, *normed[1:])))
        assert torch.equal(apart[3][0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(apart[3][1], s)
        pre = torch.sigmoid(rms_unweighted(x[:rows].flatten(-2).float(), 1e-6) @ fn[:n].T * sc[0] + base[:n]) + 1e-6
        want_head = nm((pre.unsqueeze(-1) * x[:rows].float()).sum(-2).bfloat16())
        assert rel(fused.hc_head(x[:rows], fn[:n], base[:n], sc[:1], 1e-6, 1e-6, (nm.weight, nm.eps)), want_head) < 1e-2
    out = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    assert rel(fused.hc_post(out, x, want[1], want[2]), hc_post(out, x, want[1], want[2])) < 1e-2
    # hc_post with the next mHC's mix partials (the engine's run_layers; a program a token up to POST_MIX_TOKENS):
    # hc_post's result (the same formula; the compiler may contract it into FMAs in another order, so not always
    # the same bits), the partials against the mix kernel's, each row's the same alone and in a batch
    few = fused.POST_MIX_TOKENS
    yf = fused.hc_post(out[:few], x[:few], want[1][:few], want[2][:few])
    y, part = fused.hc_post(out[:few], x[:few], want[1][:few], want[2][:few], fn)
    assert rel(y, yf) < 1e-3 and rel(part, fused._mix_partials(y.flatten(-2), fn, ssq=True)) < 1e-5
    for a, b in zip(fused.hc_pre(y, fn, base, sc, 20, 1e-6, 1e-6, None, part), fused.hc_pre(y, fn, base, sc, 20, 1e-6, 1e-6)):
        assert rel(a, b) < 1e-3
    for rows in (1, few - 1):
        assert torch.equal(fused.hc_post(out[:rows], x[:rows], want[1][:rows], want[2][:rows], fn)[1], part[:rows])
    # the mix products in the device's fp32 dot passes (tf32x3 on NVIDIA) and in ROCm's (bf16x6), and in float64
    xf = x.flatten(-2)
    exact = xf.double() @ fn.double().T
    a = fused._mix_partials(xf, fn).sum(1)[:, :fn.shape[0]]
    monkeypatch.setattr(fp8_gemm, "F32_DOT", "bf16x6")
    b = fused._mix_partials(xf, fn).sum(1)[:, :fn.shape[0]]
    assert rel(a.double(), exact) < 1e-6 and rel(b.double(), exact) < 1e-6 and rel(a, b) < 1e-6
    # past that a program a 16-token block: the mix kernel's own partials over the streams it stored, and each
    # row's the same in any batch of that size (16 rows and fewer: 4 warps, past them 2, as the mix kernel)
    for rows in (few + 1, 16, 17, 64):
        y, part = fused.hc_post(out[:rows], x[:rows], want[1][:rows], want[2][:rows], fn)
        assert rel(y, fused.hc_post(out[:rows], x[:rows], want[1][:rows], want[2][:rows])) < 1e-3
        assert torch.equal(part, fused._mix_partials(y.flatten(-2), fn, ssq=True)), rows
        r0 = few + 1 if rows <= 16 else 17
        assert torch.equal(part[:r0], fused.hc_post(out[:r0], x[:r0], want[1][:r0], want[2][:r0], fn)[1]), rows
    xb = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    assert torch.equal(fused.rms_norm(xb, None, 1e-6), rms_unweighted(xb, 1e-6))
    norm = RMSNorm(512, 1e-6).cuda()
    norm.weight.data.normal_(generator=g)
    assert rel(fused.rms_norm(xb, norm.weight, 1e-6), norm(xb)) < 1e-2
    # the q norm quantizing its rows for the FP8 wq_b: the norm's bits, act_quant's bytes (1 and 64 rows)
    for rows in (1, 64):
        y, (q8, s8) = fused.rms_norm_quant(xb[:rows], norm.weight.detach(), 1e-6, fp8_dtype("cuda"))
        q2, s2 = fp8_gemm.act_quant(y, fp8_dtype("cuda"))
        assert torch.equal(y, fused.rms_norm(xb[:rows], norm.weight, 1e-6)) and torch.equal(s8, s2)
        assert torch.equal(q8.view(torch.uint8), q2.view(torch.uint8))
    # RMSNorm + rope in one kernel (the decode step's q heads and kv; kv rows strided, also stored to a cache)
    from model.model import _rms, _rms_unweighted, _rope
    ang = torch.randn(64, 32, device="cuda", generator=g) * 3
    q = torch.randn(1, 64, 16, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    want = _rope(_rms_unweighted(q, 1e-6), ang.cos()[:, None], ang.sin()[:, None])
    assert rel(fused.norm_rope(q, None, 1e-6, ang.cos()[:, None], ang.sin()[:, None]), want) < 1e-2
    kv = torch.randn(1, 64, 1536, device="cuda", dtype=torch.bfloat16, generator=g)[..., 512:1024]
    wn = torch.rand(512, device="cuda", generator=g) + 0.5
    buf = torch.zeros(300, 512, device="cuda", dtype=torch.bfloat16)
    rows = torch.randperm(300, device="cuda", generator=g)[:64]
    got = fused.norm_rope(kv, wn, 1e-6, ang.cos(), ang.sin(), (buf, rows))
    assert rel(got, _rope(_rms(kv, wn, 1e-6), ang.cos(), ang.sin())) < 1e-2 and torch.equal(buf[rows], got[0])
    buf2 = torch.zeros_like(buf)  # both in one launch (Attention.q_and_kv): the two launches' bits
    qa, kb = fused.norm_rope(kv, wn, 1e-6, ang.cos(), ang.sin(), (buf2, rows),
                             first=(q, None, 1e-6, ang.cos()[:, None], ang.sin()[:, None]))
    assert torch.equal(qa, fused.norm_rope(q, None, 1e-6, ang.cos()[:, None], ang.sin()[:, None]))
    assert torch.equal(kb, got) and torch.equal(buf2, buf)
    from model.model import _swiglu
    gs, us = [(torch.randn(2, 64, 1024, device="cuda", generator=g) * 6).bfloat16() for _ in range(2)]
    # the same bf16 roundings as torch: at most one ulp apart
    assert rel(fused.swiglu(gs, us, 10.0), _swiglu(gs, us, 10.0)) < 1e-2


@pytest.mark.parametrize("ov,B,T", [
    (["model.num_hidden_layers=4", "model.compress_ratios=[0,4,128,4]"], 1, 2048),
    (["model.num_hidden_layers=2", "model.num_hash_layers=1", "model.compress_ratios=[4,128]", "model.hidden_size=1024",
      "model.hc_mult=2", "model.num_attention_heads=8", "model.moe_intermediate_size=512",
      "model.num_experts_per_tok=4", "model.q_lora_rank=256", "model.o_lora_rank=256", "model.o_groups=2"], 2, 1000),
])
def test_planned_activations_bound_the_kernels_saved_tensors(ov, B, T):
    """model.plan's activations (the GPU kernels' path) against what autograd keeps on this GPU: never below, at
    most 1.1x, with and without activation checkpointing (mini.yaml's dims in four layers of every type, and a
    narrower variant at a length attention pads to whole query blocks)."""
    from model import ModelConfig, build_model
    from model.config import load_yaml
    from model.plan import activations
    from tests.conftest import saved_activation_bytes
    cfg = ModelConfig.from_dict(load_yaml("configs/mini.yaml", ov)["model"])
    m = build_model(cfg, device="cuda", dtype=torch.bfloat16, seed=0).train()
    for ckpt in (False, True):
        m.activation_checkpointing = ckpt
        ratio = activations(cfg, B * T, 2, ckpt, seq=T)["kept"] / saved_activation_bytes(m, B, T)
        assert 1.0 <= ratio <= 1.1, (ckpt, ratio)


def test_training_kernels_forward_and_backward():
    """rope, RMSNorm (weighted and not) and SwiGLU with their backward kernels, and the grouped output projection,
    at the training shapes in bf16, against the torch twins computed in fp32 from the same bf16 inputs: within bf16
    rounding."""
    from kernels import fused
    from model.model import _rms, _rms_unweighted, _rope, _swiglu
    from tests.kernel_cases import grad_case
    g = torch.Generator("cuda").manual_seed(0)

    def rnd(*shape, s=1.0):
        return (torch.randn(shape, device="cuda", generator=g) * s).bfloat16()
    ang = torch.randn(2048, 1, 32, device="cuda", generator=g) * 3
    for inv in (False, True):
        assert grad_case(lambda x: fused.rope(x, ang.cos(), ang.sin(), inv),
                         lambda x: _rope(x.float(), ang.cos(), -ang.sin() if inv else ang.sin()),
                         [rnd(2, 2048, 16, 512)]) < 1e-2
    x, w = rnd(4, 2048, 2048), torch.rand(2048, device="cuda", generator=g) + 0.5
    assert grad_case(lambda x, w: fused.rms_norm(x, w, 1e-6), lambda x, w: _rms(x.float(), w, 1e-6), [x, w]) < 1e-2
    assert grad_case(lambda x: fused.rms_norm(x, None, 1e-6), lambda x: _rms_unweighted(x.float(), 1e-6),
                     [rnd(2, 512, 16, 512)]) < 1e-2
    assert grad_case(lambda a, b: fused.swiglu(a, b, 10.0), lambda a, b: _swiglu(a.float(), b.float(), 10.0),
                     [rnd(4096, 1024, s=6), rnd(4096, 1024, s=6)]) < 1e-2
    from model.model import _GroupedLinear, _grouped_linear  # the output projection's strided batched GEMMs
    assert grad_case(_GroupedLinear.apply, lambda x, w: _grouped_linear(x.float(), w.float()),
                     [rnd(2, 2048, 4, 2048), rnd(4, 512, 2048, s=2048 ** -0.5)]) < 1e-2


@pytest.mark.parametrize("n,D,N", [(4, 2048, 4096), (2, 512, 1000), (3, 256, 77)])
@pytest.mark.parametrize("prec", ["tf32x3", "bf16x6"])  # NVIDIA's fp32 dot passes, and ROCm's
def test_training_hyper_connections(n, D, N, prec, monkeypatch):
    """kernels.mhc (hc_pre, hc_post with backward kernels) in bf16 at mini's width, against the fp32 torch twins."""
    from kernels import fp8_gemm
    from tests.kernel_cases import hc_cases
    monkeypatch.setattr(fp8_gemm, "F32_DOT", prec)
    res = hc_cases("cuda", n, D, N, 20, torch.bfloat16)
    assert max(res.values()) < 2e-2, res


@pytest.mark.parametrize("S,cb", [(512, 4), (16, 1), (0, 1), (700, 2)])
def test_training_block_attention(S, cb):
    """The blocked attention with the fused softmax (forward and backward) in bf16 at mini's shapes (16 heads of
    512, window 128, blocks of 128; S compressed entries: CSA, HCA, none, and a length that is no multiple of the
    kernel's tile) against the fp32 torch twin."""
    from tests.kernel_cases import block_attention_case
    assert block_attention_case("cuda", cb if cb > 1 else 2, 4, 128, 128, 16, 512, S, cb, torch.bfloat16) < 2e-2


@pytest.mark.parametrize("n,t,chunk", [(3000, 1.0, 1024), (37, 0.6, 1024)])
def test_training_token_logprobs(n, t, chunk):
    """The head's GEMMs with the log-probs and entropy kernel (forward and backward, to the hidden states and the
    head's weight) in bf16 at mini's width over the release vocabulary, in chunks (3000 rows: two whole and a
    partial one), against the fp32 torch twin."""
    from tests.kernel_cases import logprob_case
    assert logprob_case("cuda", n, 2048, 129280, t, chunk, torch.bfloat16) < 1e-2


@pytest.mark.parametrize("N,k", [(16384, 6), (33, 1)])
def test_training_moe_combine(N, k):
    """The MoE combine kernel (weighted k-sum back to tokens, forward and backward) in bf16 at mini's width
    against the fp32 torch twin."""
    from tests.kernel_cases import combine_case
    assert combine_case("cuda", N, k, 2048, torch.bfloat16) < 1e-2


@pytest.mark.parametrize("ratio,overlap,hd,rd,dtype", [
    (4, True, 512, 64, torch.bfloat16), (4, True, 128, 64, torch.float32), (128, False, 512, 64, torch.bfloat16),
    (3, True, 64, 16, torch.float32), (10, False, 64, 64, torch.float32)])
def test_compress_decode(ratio, overlap, hd, rd, dtype):
    from tests.kernel_cases import compress_decode_case
    d = compress_decode_case("cuda", ratio, overlap, hd, rd, dtype, in_dtype=torch.bfloat16)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert d.pop("count") == 0 and d.pop("pool") <= tol * d.pop("pool_ref_scale") and max(d.values()) == 0, d


@pytest.mark.parametrize("T,k,E,absent,n_shared", [(1, 6, 32, 0, 0), (64, 6, 32, 0, 0), (256, 6, 32, 0.25, 0),
                                                   (512, 8, 256, 0.5, 0), (3000, 6, 32, 0, 0), (6000, 6, 32, 0, 0),
                                                   (0, 6, 32, 0, 0),
                                                   (1, 6, 33, 0, 1), (256, 6, 33, 0, 1), (100, 2, 7, 0.2, 2)])
def test_moe_align_kernel(T, k, E, absent, n_shared):
    from tests.kernel_cases import moe_align_case
    assert moe_align_case("cuda", T, k, E, absent, n_shared=n_shared)


@pytest.mark.parametrize("B,S,k", [(1, 1024, 512), (64, 1024, 512), (16, 4096, 512), (5, 300, 64), (3, 8, 8),
                                   (3, 1025, 512), (16, 4160, 512), (8, 8192, 512), (4, 9000, 300),
                                   (4, 16384, 2048), (2, 2000, 2000)])
@pytest.mark.parametrize("ties", [False, True])
def test_index_topk_kernel(B, S, k, ties):
    from tests.kernel_cases import index_topk_case
    assert index_topk_case("cuda", B, S, k, ties=ties)


@pytest.mark.parametrize("M,D,E,k,func,hashed", [(1, 2048, 32, 6, "sqrtsoftplus", False),
                                                (64, 2048, 32, 6, "sqrtsoftplus", True),
                                                (256, 4096, 256, 6, "sqrtsoftplus", False),
                                                (3000, 2048, 32, 6, "sigmoid", False), (17, 512, 8, 2, "softmax", False)])
def test_route_kernel(M, D, E, k, func, hashed):
    """The inference router (two kernels) picks the torch Gate's experts with its weights."""
    from tests.kernel_cases import route_case
    bad, dw = route_case("cuda", M, D, E, k, func, hashed)
    assert bad == 0 and dw < 1e-5, (bad, dw)


@pytest.mark.parametrize("B,dtype", [(1, torch.float32), (64, torch.float32), (256, torch.float32),
                                     (64, torch.bfloat16)])
def test_gumbel_sample_kernel(B, dtype):
    """One pass over the vocabulary gives the torch sampler's tokens exactly (same hash, division and log), from
    fp32 logits and from the decode step's bf16 ones; with top-k / top-p rows too (the kernel given the
    thresholds of the radix search, the torch path its twin's from torch.topk or the sort)."""
    from tests.kernel_cases import sample_case
    for filters in ("plain", "top_k", "top_p"):
        bad, dlp = sample_case("cuda", B, 129280, dtype=dtype, filters=filters)
        assert bad == 0 and dlp < 1e-4, (filters, bad, dlp)
    # also=: the tokens written a second time, into the first B elements of a longer buffer (the engine's feed)
    from kernels.sample import gumbel_sample
    logits = torch.randn(B, 1000, device="cuda").to(dtype)
    also = torch.full((B + 3,), -1, dtype=torch.int64, device="cuda")
    args = (torch.ones(B, device="cuda"), torch.arange(B, device="cuda"), torch.zeros(B, dtype=torch.int64,
                                                                                      device="cuda"))
    tok, lp = gumbel_sample(logits, *args, also=also)
    assert torch.equal(also[:B], tok) and (also[B:] == -1).all()
    assert torch.equal(gumbel_sample(logits, *args)[0], tok)


@pytest.mark.parametrize("B,dtype", [(1, torch.bfloat16), (16, torch.float32), (64, torch.bfloat16),
                                     (256, torch.bfloat16), (64, torch.float16)])
def test_threshold_kernel(B, dtype):
    """The top-k / top-p thresholds of one launch a row (kernels.sample.threshold: a radix search, no sort) against
    filter_threshold's torch twin (the sort), at mini's vocabulary."""
    from tests.kernel_cases import threshold_case
    assert threshold_case("cuda", B, 129280, dtype) == 0


def test_to_host_kernel():
    """The decode step's outputs written by the device into pinned host rows it alternates (kernels.sample.to_host:
    three calls, a 15 KB source over several programs, the ticket back to 0)."""
    from tests.kernel_cases import to_host_case
    assert to_host_case("cuda")


def test_step_inputs_kernel():
    """The decode step's opening gathers in one launch (kernels.step.step_inputs) against their torch twin."""
    from tests.kernel_cases import STEP_INPUTS_CASES, step_inputs_case
    for case in STEP_INPUTS_CASES + ((256, 2048, 32, (1, 4, 128), (128,), (129, 5)),):
        assert step_inputs_case("cuda", *case), case


def test_engine_on_small_dims_turns_graphs_off():
    """configs/tiny.yaml's dims (hidden 64, experts 32 wide) on a GPU: the experts run on fused_moe's torch twin,
    which a CUDA graph cannot capture (it read which experts were hit on the host: the capture failed with
    cudaErrorStreamCaptureUnsupported); the engine warns, runs eager, and gives the eager engine's tokens."""
    from model import ModelConfig, build_model
    from model.config import load_yaml
    from rollout_server import Engine, SamplingParams
    m = build_model(ModelConfig.from_dict(load_yaml("configs/tiny.yaml", ["model.vocab_size=32"])["model"]), "cuda",
                    torch.float32, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32, (n,), generator=g).tolist() for n in (1, 5, 17, 33)]
    sp = SamplingParams(temperature=1.0, max_tokens=30, seed=1, ignore_eos=True)
    with pytest.warns(UserWarning, match="CUDA graphs off"):
        eng = Engine(m, fp8=True, dtype=torch.bfloat16, max_model_len=128)
    assert not eng.runner.use_graphs
    eager = Engine(m, fp8=True, dtype=torch.bfloat16, max_model_len=128, cuda_graphs=False)
    for a, b in zip(eng.generate(prompts, sp), eager.generate(prompts, sp)):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def _engine_model():
    """tiny.yaml at dims the engine's kernels and graphs take (fp32 weights on the GPU)."""
    from model import ModelConfig, build_model
    from model.config import load_yaml
    ov = ["model.vocab_size=1024", "model.hidden_size=256", "model.head_dim=128", "model.qk_rope_head_dim=32",
          "model.q_lora_rank=128", "model.o_lora_rank=128", "model.moe_intermediate_size=128",
          "model.index_head_dim=128", "model.num_attention_heads=4", "model.sliding_window=32"]
    cfg = ModelConfig.from_dict(load_yaml("configs/tiny.yaml", ov)["model"])
    return build_model(cfg, "cuda", torch.float32, seed=0)


def _logprobs_close(outs_a, outs_b, fp8: bool):
    """Two engines' greedy outputs whose numerics differ: log-probs of the shared prefix, and where a sequence
    parts, of the two picks (see test_engine_graphs_match_eager_and_simple)."""
    diffs, parts = [], []
    for a, b in zip(outs_a, outs_b):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        diffs += [abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n])]
        parts += [abs(a.logprobs[n] - b.logprobs[n])] if n < len(a.token_ids) else []
    bound = (0.05, 0.3) if fp8 else (0.1, 0.1)
    assert len(diffs) >= len(outs_a) and sum(diffs) / len(diffs) < bound[0] and max(diffs + parts) < bound[1], \
        (fp8, len(diffs), sum(diffs) / len(diffs), max(diffs), parts)


def test_fp32_weights_on_the_gpu():
    """FP32 weights on a GPU (Engine(dtype=torch.float32), fused_moe on FP32 stacks). Their tiles take twice
    BF16's shared memory: at 64-row blocks (past 128 tokens: a prefill chunk) the up kernel's 3 stages needed 288
    KiB (256 with the products below), against 227 KiB on an H100 / H200, and the launch raised OutOfResources
    (kernels.fp8_gemm.launch_fitting now drops stages until they fit). And their products at about FP32 accuracy
    (kernels.fp8_gemm.dot32: tl.dot's own default for FP32 operands is one TF32 pass, 1e-3 relative): the FP32
    engine's greedy tokens had parted from the model's own argmax (random odd-width configs, an H100), its
    log-probs off by 3e-3 to 2e-2."""
    from rollout_server import Engine, SamplingParams
    E, k, D, I = 8, 2, 256, 256
    g = torch.Generator("cuda").manual_seed(0)
    w = [torch.randn(E, I, D, device="cuda", generator=g) * 0.05, torch.randn(E, D, I, device="cuda", generator=g)
         * 0.05, torch.randn(E, I, D, device="cuda", generator=g) * 0.05]
    for T in (1, 64, 200):  # the GEMV kernels, 16-row blocks, 64-row blocks
        x = torch.randn(T, D, device="cuda", generator=g)
        ids = torch.rand(T, E, device="cuda", generator=g).argsort(-1)[:, :k]
        wt = torch.rand(T, k, device="cuda", generator=g)
        got, want = fused_moe(x, ids, wt, *w), fused_moe_ref(x, ids, wt, *w)
        assert got.dtype == torch.float32 and rel(got, want) < 1e-5, (T, rel(got, want))
    m = _engine_model()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (3, 40, 200, 11)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng = Engine(m, fp8=False, dtype=torch.float32, max_model_len=512)
    assert eng.runner.use_graphs
    for o in eng.generate(prompts, sp):
        with torch.no_grad():
            logits = m(torch.tensor([o.prompt_token_ids + o.token_ids], device="cuda"))[0].float()
        logits = logits[len(o.prompt_token_ids) - 1:-1]
        picked = logits.gather(1, torch.tensor(o.token_ids, device="cuda")[:, None])[:, 0]
        assert (logits.max(-1).values - picked).max().item() < 1e-4  # each token the argmax (up to a near-tie)
        lp = logits.log_softmax(-1).gather(1, torch.tensor(o.token_ids, device="cuda")[:, None])[:, 0].cpu()
        assert (lp - torch.tensor(o.logprobs)).abs().max().item() < 1e-4


def test_engine_from_a_model_on_the_gpu_makes_no_second_copy():
    """Engine(model) with the model on the GPU (prepare_inference_model, what Engine builds its model with): the
    device gets the engine's held tensors and a tensor in flight, not a copy of the whole model beside the
    caller's (stream=False, the twin, makes one); both hold the same bytes."""
    from rollout_server import prepare_inference_model
    from tests.conftest import same_bytes
    m = _engine_model()
    model_bytes = sum(t.nbytes for t in m.stored_state().values())
    biggest = max(t.nbytes for t in m.stored_state().values())
    held, peaks = {}, {}
    for stream in (True, False):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        eng = prepare_inference_model(m, True, torch.bfloat16, torch.device("cuda"), stream=stream)
        peaks[stream] = torch.cuda.max_memory_allocated() - base
        held[stream] = eng.state_dict()
        del eng
    assert held[True].keys() == held[False].keys()
    assert all(same_bytes(held[True][k], held[False][k]) for k in held[True])
    size = sum(t.nbytes for t in held[True].values())
    assert peaks[False] > model_bytes and peaks[True] < size + 2 * biggest + (8 << 20), (peaks, size, model_bytes)


def test_engine_counts_its_weights_and_refuses_too_many_before_taking_any(monkeypatch):
    """The engine's count of the bytes it will hold (its meta model's holders) is what it then takes on the GPU;
    with less free than that, Engine stops with the count before taking any memory (no out-of-memory error
    midway through a load)."""
    import gc
    import re
    import rollout_server
    m = _engine_model()
    counted = []
    check = rollout_server.check_weights_fit
    monkeypatch.setattr(rollout_server, "check_weights_fit", lambda model, device:
                        counted.append(rollout_server.held_bytes(model)[0]) or check(model, device))
    for fp8 in (True, False):
        gc.collect()  # (earlier engines' models hold reference cycles: freed now, not inside the measured call)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        eng = rollout_server.prepare_inference_model(m, fp8, torch.bfloat16, torch.device("cuda"))
        held = torch.cuda.memory_allocated() - base
        del eng
        assert abs(counted[-1] - held) <= 0.01 * held, (fp8, counted[-1], held)
    gc.collect()  # (as above: not during Engine below)
    torch.cuda.empty_cache()
    filler = torch.empty(torch.cuda.mem_get_info()[0] - counted[0] // 2, dtype=torch.uint8, device="cuda")
    try:
        before = torch.cuda.memory_allocated()
        with pytest.raises(ValueError, match="the weights do not fit: this rank would hold") as e:
            rollout_server.Engine(m, device="cuda")
        assert torch.cuda.memory_allocated() == before
        gib = float(re.search(r"would hold ([0-9.e+-]+) GiB", str(e.value)).group(1))
        assert abs(gib * 2 ** 30 - counted[0]) <= 0.005 * counted[0]
    finally:
        del filler
        torch.cuda.empty_cache()  # (the next tests' engines size their pools from the free memory)


def test_fixed_cache_pools_that_do_not_fit_are_refused_before_any_is_made():
    """num_blocks= fixes the cache pools' blocks (rollout.num_blocks): pools that fit are made at that size, counted
    by footprint() and serve; pools larger than the GPU's free memory after the weights stop Engine with their size
    before any is made (not an out-of-memory error midway)."""
    import gc
    import re
    import rollout_server
    from rollout_server import PagedCache, SamplingParams
    m = _engine_model()
    gc.collect()
    eng = rollout_server.Engine(m, device="cuda", max_model_len=512, max_seqs=4, num_blocks=40)
    kinds = list(eng.cache.alloc)
    assert {k: len(a.ref) for k, a in eng.cache.alloc.items()} == dict.fromkeys(kinds, 40)
    size = {n: PagedCache.nbytes(eng.model, 4, dict.fromkeys(kinds, n), eng.cache.BE, eng.dtype) for n in (0, 1, 40)}
    assert eng.footprint()["cache"] == size[40]
    out = eng.generate([[5, 6, 7], [9] * 200], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [40, 40]
    per_block, state = size[1] - size[0], size[0]
    del eng, out
    gc.collect()
    torch.cuda.empty_cache()
    n = torch.cuda.mem_get_info()[0] // per_block + 1  # (more than all the free memory, before the weights load)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with pytest.raises(ValueError, match=rf"invalid engine arguments: the cache does not fit: num_blocks={n} for "
                       rf"max_seqs=4 sequences take ([0-9.]+) GiB against the ([0-9.]+) GiB free after the weights"
                       ) as e:
        rollout_server.Engine(m, device="cuda", max_model_len=512, max_seqs=4, num_blocks=n)
    took, free = map(float, re.search(r"take ([0-9.]+) GiB against the ([0-9.]+) GiB", str(e.value)).groups())
    assert abs(took - (state + n * per_block) / 2 ** 30) <= 0.01 and free < took
    assert torch.cuda.max_memory_allocated() - base < (1 << 30)  # (the weights, a few MB: no pool was made)


def test_engine_graphs_match_eager_and_simple():
    from kernels import fp8_gemm
    from rollout_server import Engine, SamplingParams, SimpleEngine
    m = _engine_model()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (3, 40, 97, 200, 11)]
    # staggered lengths: the batch shrinks from 5 rows (an 8-row graph) to 4, 3 and 2 (graphs captured mid-run,
    # with a step in flight whose tokens the next one feeds on the device)
    sp = [SamplingParams(temperature=0, max_tokens=t, ignore_eos=True) for t in (80, 20, 40, 60, 80)]
    for fp8 in (False, True):
        outs = {}
        rec = dict(record_index=True)  # the indexer's choices too (Output.index_entries)
        for name, eng in [("graphs", Engine(m, fp8=fp8, dtype=torch.bfloat16, max_model_len=512, **rec)),
                          ("eager", Engine(m, fp8=fp8, dtype=torch.bfloat16, max_model_len=512, cuda_graphs=False,
                                           **rec)),
                          ("simple", SimpleEngine(m, fp8=fp8, dtype=torch.bfloat16))]:
            outs[name] = eng.generate(prompts, sp)
        # and the graphs without programmatic dependent launch (kernels.fp8_gemm.pdl): the kernels that start
        # before the one before them ends must wait for it, or they race
        pdl = dict(fp8_gemm._PDL)
        fp8_gemm._PDL[torch.device("cuda", torch.cuda.current_device())] = False
        try:
            outs["no pdl"] = Engine(m, fp8=fp8, dtype=torch.bfloat16, max_model_len=512, **rec).generate(prompts, sp)
        finally:
            fp8_gemm._PDL.clear()
            fp8_gemm._PDL.update(pdl)
        # and on one stream (the decode step runs the compressors, the indexer and the mHC pre's post / comb on a
        # second one): the same kernels
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("ENGINE_SIDE_STREAM", "0")
            outs["one stream"] = Engine(m, fp8=fp8, dtype=torch.bfloat16, max_model_len=512, **rec).generate(prompts,
                                                                                                          sp)
        # and with the step's outputs copied to the host after it (they are the step's own writes to pinned
        # memory by default: Runner.zero_copy)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("ENGINE_ZERO_COPY", "0")
            eng = Engine(m, fp8=fp8, dtype=torch.bfloat16, max_model_len=512, **rec)
            assert not eng.runner.zero_copy
            outs["copies"] = eng.generate(prompts, sp)
        for other in ("eager", "no pdl", "one stream", "copies"):  # the same kernels: bit-identical
            for a, b in zip(outs["graphs"], outs[other]):
                assert a.token_ids == b.token_ids and a.logprobs == b.logprobs, other
                assert torch.equal(a.index_entries, b.index_entries), other
        # the simple engine (torch attention, its own batching) vs the paged one's kernels: log-probs of the
        # shared prefix. BF16 weights: within bf16 accuracy (0.091 nats at worst over 4 prompt seeds on an H200).
        # FP8: the engines' row batches differ (so do their GEMM tiles), and a last-bit difference re-rounds a
        # 1x128 activation tile downstream, so the bound is the FP8 tolerance test_paged_engine states against
        # the fp32 model (mean < 0.05, max < 0.3).
        # Greedy decoding of this random model flips near-ties (its top log-probs are about -6), and both engines'
        # numerics move with every fused kernel: over 4 prompt seeds the sequences parted after 1 to 80 tokens,
        # before and after this check was written. Where two sequences part, each engine took its own argmax, so
        # the two picks' log-probs must be as close as the shared tokens' (a near-tie, not an error: 0.088 nats
        # at most in those runs).
        _logprobs_close(outs["graphs"], outs["simple"], fp8)
        # prefill's attention: prompts in chunks of at most 64 tokens (the later chunks one sequence at a time over
        # the cached window and entries), and torch's attention instead of the kernel (ENGINE_PREFILL_KERNEL=0)
        chunked = Engine(m, fp8=fp8, dtype=torch.bfloat16, max_model_len=512, max_batch_tokens=64, **rec)
        _logprobs_close(chunked.generate(prompts, sp), outs["simple"], fp8)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("ENGINE_PREFILL_KERNEL", "0")
            eng = Engine(m, fp8=fp8, dtype=torch.bfloat16, max_model_len=512, **rec)
            assert not eng.runner.prefill_kernel
            _logprobs_close(eng.generate(prompts, sp), outs["graphs"], fp8)


def test_two_engines_replay_their_graphs_at_once():
    """Two FP8 engines in one process, each generating in a thread of its own on a stream of its own, so their
    decode graphs replay at the same time: each gives the tokens and log-probs it gave alone, and every ticket is
    back at 0. Each Runner captures on a stream of its own, so its graphs' split-K / overlap ticket counters
    (kernels.fp8_gemm.tickets, keyed by the capturing stream) are its own: on torch.cuda.graph's one default
    capture stream the two engines' graphs shared them (a scratch run of two Runners' graphs hung)."""
    import threading
    from kernels import fp8_gemm
    from rollout_server import Engine, SamplingParams
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (50, 130, 7, 90)]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    engines = [Engine(_engine_model(), fp8=True, dtype=torch.bfloat16, max_model_len=512) for _ in range(2)]
    alone = [e.generate(prompts, sp) for e in engines]  # (captures every graph the runs below replay)
    assert engines[0].runner.capture_stream != engines[1].runner.capture_stream
    together, errors = [[], []], []

    def work(i):
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                for _ in range(4):
                    together[i].append(engines[i].generate(prompts, sp))
        except BaseException as e:  # (re-raised by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "the two engines' runs did not finish within 300 s"
    if errors:
        raise errors[0]
    torch.cuda.synchronize()
    for i in range(2):
        for run in together[i]:
            for a, b in zip(alone[i], run):
                assert a.token_ids == b.token_ids and a.logprobs == b.logprobs, i
    assert fp8_gemm.tickets_left(torch.device("cuda", torch.cuda.current_device())) == 0


def test_decode_graphs_replay_no_fill():
    """No captured decode step replays a fill. The capture stream's split-K / overlap ticket counters must exist
    before the capture, under the key its kernels ask with: made inside it, their zero fill is a graph node that
    every replay runs, a launch on the step's path (once a step in the H200's batch-64 profile). Two causes, both
    fixed: the warm-up step runs on another stream, so the capture stream's were first asked for inside the
    capture; and the engine's device "cuda" and its kernels' "cuda:0" were two keys. 40 rows: the FP8 experts'
    overlapped kernels take tickets (from 17 tokens) and their 48-row graph is the engine's first."""
    from torch.profiler import ProfilerActivity, profile
    from rollout_server import Engine, SamplingParams
    here = torch.cuda.current_device()
    assert tickets(torch.device("cuda"), 1) is tickets(torch.device("cuda", here), 1)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in range(20, 60)]
    eng = Engine(_engine_model(), fp8=True, dtype=torch.bfloat16, max_model_len=512)
    eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert any(k[0] == 48 for k in eng.runner.graphs), list(eng.runner.graphs)
    for key, gr in eng.runner.graphs.items():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            gr["graph"].replay()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        assert any("_moe_up_kernel" in n for n in names), (key, names)
        assert not [n for n in names if "FillFunctor" in n or "Memset" in n], (key, names)


def test_tickets_made_during_capture_warn():
    """kernels.fp8_gemm.tickets warns when a stream's counters are first made inside a graph capture (their zero
    fill is then a node that every replay runs) and stays silent for counters made on that stream before it; both
    give zeroed counters after a replay."""
    import warnings
    from kernels import fp8_gemm
    dev = torch.device("cuda", torch.cuda.current_device())
    for premade in (False, True):
        s = torch.cuda.Stream()  # (from torch's pool: an id an earlier test's counters may be kept under)
        old = fp8_gemm._COUNTERS.pop((dev, s.stream_id), None)
        if old is not None:  # a graph captured before may still read it: retired, not freed
            fp8_gemm._RETIRED.append(old)
        s.wait_stream(torch.cuda.current_stream())
        made = None
        if premade:
            with torch.cuda.stream(s):
                made = tickets(dev, 64)
        g = torch.cuda.CUDAGraph()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with torch.cuda.graph(g, stream=s):
                got = tickets(dev, 64)
        hits = [w for w in seen if "during CUDA graph capture" in str(w.message)]
        assert len(hits) == (0 if premade else 1), [str(w.message) for w in seen]
        assert premade == (got is made)
        g.replay()
        torch.cuda.synchronize()
        assert got.numel() >= 64 and int(got.abs().sum()) == 0


@pytest.mark.parametrize("mode", ["window", "csa", "hca"])
def test_prefill_attention(mode):
    """prefill_attention (the decode kernel over linear buffers) against its reference at mini's head shapes: a
    chunk of one sequence after 500 positions (its window's 127 earlier keys first in the buffer) and a new
    prompt's rows, 1 to 600 rows (split and merged by the combine kernel, merged in the kernel, one split on 4
    warps past the SMs)."""
    from kernels.attention import prefill_attention, prefill_attention_ref
    H, d, W, T = 16, 512, 128, 600
    g = torch.Generator("cuda").manual_seed(2)
    q = torch.randn(T, H, d, device="cuda", dtype=torch.bfloat16, generator=g)
    keys = torch.randn(W - 1 + T, d, device="cuda", dtype=torch.bfloat16, generator=g)
    sink = torch.randn(H, device="cuda", generator=g)
    pos = 500 + torch.arange(T, device="cuda")
    pos[:40] = torch.arange(40, device="cuda")  # 40 rows of a new prompt whose keys start at row 0
    base = torch.where(pos >= 500, W - 1 - 500, 0)
    entries = torch.randn(300, d, device="cuda", dtype=torch.bfloat16, generator=g)
    first = torch.where(pos >= 500, 20, 0)
    count = torch.minimum((pos + 1) // 4, torch.where(pos >= 500, 280, 20))
    kw = {}
    if mode == "csa":
        sel = torch.rand(T, 512, device="cuda", generator=g).argsort(-1)[:, :64]
        kw = dict(entries=entries, first=first, sel=torch.where(sel < count[:, None], sel, -1))
    elif mode == "hca":
        kw = dict(entries=entries, first=first, count=count)
    for n in (1, 20, 100, 600):
        want = prefill_attention_ref(q[-n:], keys, base[-n:], pos[-n:], sink, d ** -0.5, W,
                                     **{k: v[-n:] if k != "entries" else v for k, v in kw.items()})
        got = prefill_attention(q[-n:], keys, base[-n:], pos[-n:], sink, d ** -0.5, W,
                                **{k: v[-n:] if k != "entries" else v for k, v in kw.items()})
        assert rel(got, want) < 1e-2, n
    mixed = prefill_attention(q, keys, base, pos, sink, d ** -0.5, W, **kw)
    assert rel(mixed[:40], prefill_attention_ref(q[:40], keys, base[:40], pos[:40], sink, d ** -0.5, W,
                                                 **{k: v[:40] if k != "entries" else v for k, v in kw.items()})) < 1e-2


def test_engine_top_k_top_p_steps_stay_pipelined():
    """Top-k / top-p rows beside plain sampled and greedy ones: the decode steps draw them inside themselves, in
    graphs of their own ((bucket, every, True)), no step runs alone, and graphs and eager steps give the same
    bits, with and without the step's zero-copy outputs."""
    from rollout_server import Engine, SamplingParams
    m = _engine_model()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (5, 33, 70, 12)]
    sp = [SamplingParams(temperature=0.9, top_k=20, max_tokens=40, seed=1, ignore_eos=True),
          SamplingParams(temperature=1.0, max_tokens=50, seed=2, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.7, max_tokens=30, seed=3, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=45, ignore_eos=True)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "_decode_alone", lambda *a: pytest.fail("a step ran alone"))
        outs = {}
        for name, kw, env in [("graphs", {}, "1"), ("eager", dict(cuda_graphs=False), "1"), ("copies", {}, "0")]:
            mp.setenv("ENGINE_ZERO_COPY", env)
            eng = Engine(m, fp8=True, dtype=torch.bfloat16, max_model_len=512, **kw)
            outs[name] = eng.generate(prompts, sp)
            assert name == "eager" or {f for *_, f in eng.runner.graphs} == {True, False}  # (the last steps: plain)
    for other in ("eager", "copies"):
        for a, b in zip(outs["graphs"], outs[other]):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs, other
    assert all(len(o.token_ids) == p.max_tokens for o, p in zip(outs["graphs"], sp))


def test_engine_steps_that_skip_the_indexer():
    """Decode steps whose positions all lie within Runner.every_upto (18 here: no CSA layer past the indexer's
    top-k of 4 entries) read every entry without the indexer's query, scores and top-k, in graphs of their own
    ((bucket, True)); later steps in the same run take the indexer's graphs. Against the engine that always runs
    the indexer (record_index): log-probs as close as test_engine_graphs_match_eager_and_simple's bounds; eager
    and graphed steps of the same choice bit-identical."""
    from rollout_server import Engine, SamplingParams
    m = _engine_model()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (3, 9, 14)]
    sp = [SamplingParams(temperature=0, max_tokens=t, ignore_eos=True) for t in (40, 25, 30)]
    for fp8 in (False, True):
        eng = Engine(m, fp8=fp8, dtype=torch.bfloat16, max_model_len=512)
        assert eng.runner.every_upto == 18
        outs = eng.generate(prompts, sp)
        assert {every for _, every, _ in eng.runner.graphs} == {True, False}
        eager = Engine(m, fp8=fp8, dtype=torch.bfloat16, max_model_len=512, cuda_graphs=False).generate(prompts, sp)
        for a, b in zip(outs, eager):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        ref = Engine(m, fp8=fp8, dtype=torch.bfloat16, max_model_len=512, record_index=True).generate(prompts, sp)
        _logprobs_close(ref, outs, fp8)


def test_sync_graph_packer_matches_eager_packing():
    """The sender's CUDA-graph packing (GraphPacker) writes the same bucket bytes as the eager packing, for a
    producer shaped like Actor.full_weights (FP8 quantization and casts written in place, an FP8 tensor and its
    scales split across two buckets), and sees in-place updates of the source tensors made after the capture."""
    from rollout_server import GraphPacker, bucket_layout, bucket_plan, pack_bucket
    f8 = fp8_dtype("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(384, 256), (64,), (4, 256, 128), (1000, 130), (7,), (256, 512)]
    params = [(f"t{i}", torch.randn(s, device="cuda", generator=g)) for i, s in enumerate(shapes)]
    held = {"t0", "t2", "t3", "t5"}  # sent as FP8 bytes followed by their 128x128 block scales
    spec = []
    for name, w in params:
        if name in held:
            spec += [[name, str(f8), list(w.shape)],
                     [name + ".s", "torch.float32", [*w.shape[:-2], -(-w.shape[-2] // 128), -(-w.shape[-1] // 128)]]]
        else:
            spec.append([name, "torch.bfloat16", list(w.shape)])

    def producer(dst, sums):
        j = 0
        for name, w in params:
            if name in held:
                into = (dst(j), dst(j + 1)) if dst is not None else None
                q, s = block_quant(w, f8, into if into and None not in into else None)
                j += 2
                yield q
                yield s
            else:
                d = dst(j) if dst is not None else None
                j += 1
                yield d.copy_(w) if d is not None else w.to(torch.bfloat16)

    bucket = 130016  # t3's FP8 bytes (130000) fill one bucket, its scales start the next
    plans = bucket_plan(spec, bucket)
    assert any(spec[p[0]][0] == "t3.s" for p in plans)
    packer = GraphPacker(spec, bucket, producer, torch.device("cuda"))
    for step in range(2):
        views = {}
        it = iter(producer(views.get, None))
        for k, idx in enumerate(plans):
            offs, sizes, size = bucket_layout(spec, idx)
            ref = torch.zeros(size, dtype=torch.uint8, device="cuda")
            pack_bucket(spec, idx, ref, it, views)
            got = packer.pack(k)
            for o, nb in zip(offs, sizes):  # the padding between slots is never read
                assert torch.equal(got[o:o + nb], ref[o:o + nb]), (step, k)
        for _, w in params:  # an optimizer step: in place, after the capture
            w.mul_(-1.5).add_(0.25)


@pytest.mark.parametrize("extra", [[], ["train.dtype=bf16", "rollout.dtype=bf16"]], ids=["fp32", "bf16"])
def test_sync_graph_replay_passes_verification(extra):
    """tests/sync_graph_check.py on one GPU: a one-rank actor's weights packed by GraphPacker's replayed graphs,
    applied to an engine as the rollout applies a broadcast, hold exactly the checksums the verification pass after
    a replayed sync computes (rollout.sync_verify's path with CUDA graphs), in FP8 syncs and syncs in the rollout's
    dtype, and still after an in-place update of the actor's weights."""
    from tests import sync_graph_check
    r = sync_graph_check.launch("--device", "cuda", *extra)
    assert r.returncode == 0 and r.stdout.count("(CUDA graphs)") == 4, (r.stdout + r.stderr)[-4000:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("ep, extra", [(1, []), (2, ["--no-reshard"])], ids=["fsdp2", "ep2-no-reshard"])
def test_sharded_actor_nccl(ep, extra):
    """tests/parallel_check.py on 2 GPUs over NCCL (the CPU tests run it over gloo): the sharded actor's loss,
    gradients, AdamW step and full_state (gather_rows' all-gather, rows split unevenly) against the
    single-process model."""
    from tests import parallel_check
    r = parallel_check.launch(2, ep, "--device", "cuda", *extra, timeout=300, NCCL_NVLS_ENABLE="0")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
