"""FP8 block and MXFP4 (de)quantization against hand-computed values."""
import pytest
import torch

from kernels.quant import (dequant_fp8_block, dequant_mxfp4, fp8_to_fnuz, quant_fp8_block, quant_mxfp4,
                           scale_to_float, unpack_e2m1)


def test_e8m0_scales():
    raw = torch.tensor([127, 130, 120], dtype=torch.uint8)
    assert scale_to_float(raw).tolist() == [1.0, 8.0, 2.0 ** -7]
    assert scale_to_float(raw.view(torch.float8_e8m0fnu)).tolist() == [1.0, 8.0, 2.0 ** -7]


def test_fp8_block_dequant_hand_values():
    # 130 x 260 weight: a 2 x 3 grid of 128x128 blocks (the last row/column of blocks partial)
    q = torch.zeros(130, 260, dtype=torch.float8_e4m3fn)
    q[0, 0], q[5, 127], q[127, 128], q[129, 259], q[128, 0] = 1.0, -2.0, 0.5, 3.0, -0.25
    scale = torch.tensor([[8.0, 0.5, 1.0], [2.0 ** -3, 4.0, 16.0]]).to(torch.float8_e8m0fnu)
    w = dequant_fp8_block(q, scale)
    assert w.shape == (130, 260)
    assert w[0, 0] == 8.0 and w[5, 127] == -16.0      # block (0, 0), scale 8
    assert w[127, 128] == 0.25                          # block (0, 1), scale 0.5
    assert w[129, 259] == 48.0                          # block (1, 2), scale 16
    assert w[128, 0] == -2.0 ** -5                      # block (1, 0), scale 1/8
    assert w.count_nonzero() == 5
    # fp32 weight_scale_inv (DeepSeek-V3 style) reads the same
    assert torch.equal(dequant_fp8_block(q, scale.float()), w)
    with pytest.raises(ValueError, match="scale grid"):
        dequant_fp8_block(q, torch.ones(1, 3))


def test_mxfp4_hand_values():
    # byte 0x21: low nibble 1 (+0.5) first, high nibble 2 (+1.0); 0xF8: 8 (-0.0), 15 (-6.0); 0x7B: 11 (-1.5), 7 (6.0)
    packed = torch.tensor([[0x21, 0xF8, 0x7B] + [0] * 13], dtype=torch.uint8).view(torch.int8)
    assert unpack_e2m1(packed)[0, :6].tolist() == [0.5, 1.0, -0.0, -6.0, -1.5, 6.0]
    scale = torch.tensor([[2.0 ** -1]]).to(torch.float8_e8m0fnu)  # one scale per 32 values
    w = dequant_mxfp4(packed, scale)
    assert w.shape == (1, 32)
    assert w[0, :6].tolist() == [0.25, 0.5, -0.0, -3.0, -0.75, 3.0]
    with pytest.raises(ValueError, match="MXFP4 scale"):
        dequant_mxfp4(packed, torch.ones(1, 2))


def test_mxfp4_round_trip_is_exact_on_the_grid():
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    vals = grid[torch.randint(0, 8, (4, 64), generator=g)] * torch.where(torch.rand(4, 64, generator=g) < 0.5, -1, 1)
    vals[:, ::32] = 6.0  # every block reaches the top of the grid, so its scale is exactly 1
    w = vals * 2.0 ** torch.randint(-4, 4, (4, 1), generator=g)
    packed, scale = quant_mxfp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (4, 32) and scale.shape == (4, 2)
    assert torch.equal(dequant_mxfp4(packed, scale), w)


@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
def test_fp8_quant_error_within_format(fmt):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 200, generator=g) * torch.logspace(-3, 1, 200)  # mixed magnitudes across columns
    q, s = quant_fp8_block(w, torch.float8_e4m3fn, scale_fmt=fmt)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    back = dequant_fp8_block(q, s)
    step = scale_to_float(s).repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormals step 2^-9 * scale
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + step * 2 ** -10).all()
    assert (back - w).norm() / w.norm() < 0.03


def test_fnuz_reinterpretation_keeps_values():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(128, 256, generator=g)
    q, s = quant_fp8_block(w, torch.float8_e4m3fn)
    qz, sz = fp8_to_fnuz(q, s)
    assert qz.dtype == torch.float8_e4m3fnuz
    assert torch.equal(dequant_fp8_block(qz, sz), dequant_fp8_block(q, s))
