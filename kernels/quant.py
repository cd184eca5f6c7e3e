"""FP8 (e4m3, 128x128 blocks) and MXFP4 (e2m1, 1x32 blocks) quantization: pure-torch references.

Scale conventions follow the DeepSeek releases: a stored scale multiplies the stored value
(`w = q * s`), either as an E8M0 power of two (`<name>.scale`) or fp32 (`<name>.weight_scale_inv`).
"""
from __future__ import annotations

import torch

BLOCK = 128
MX_BLOCK = 32

# e2m1 code -> value; low nibble holds the even element, high nibble the odd one.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def fp8_dtype(device=None) -> torch.dtype:
    """float8_e4m3fnuz on AMD gfx942 (MI300X/MI308X), float8_e4m3fn elsewhere (NVIDIA, CPU, newer AMD)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and getattr(torch.version, "hip", None):
        arch = torch.cuda.get_device_properties(device).gcnArchName
        if "gfx942" in arch:
            return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 (float8_e8m0fnu or raw uint8 exponent bytes) or float scales -> float32."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    pr, pc = rows - x.shape[-2], cols - x.shape[-1]
    return torch.nn.functional.pad(x, (0, pc, 0, pr)) if pr or pc else x


def dequant_fp8_block(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32, block: int = BLOCK) -> torch.Tensor:
    """q: (..., N, K) fp8; scale: (..., ceil(N/block), ceil(K/block)) -> (..., N, K) in `dtype`."""
    N, K = q.shape[-2:]
    sr, sc = scale.shape[-2:]
    if sr != -(-N // block) or sc != -(-K // block):
        raise ValueError(f"scale grid {tuple(scale.shape)} does not match weight {tuple(q.shape)} "
                         f"with {block}x{block} blocks")
    s = scale_to_float(scale).repeat_interleave(block, -2).repeat_interleave(block, -1)[..., :N, :K]
    return (q.float() * s).to(dtype)


def quant_fp8_block(w: torch.Tensor, fp8: torch.dtype = torch.float8_e4m3fn, block: int = BLOCK,
                    scale_fmt: str = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """w: (..., N, K) -> (q fp8 (..., N, K), scale (..., ceil(N/b), ceil(K/b))).

    scale_fmt "ue8m0": power-of-two scales stored as float8_e8m0fnu (rounded up, so nothing clips);
    "fp32": exact amax / fp8_max scales in float32.
    """
    N, K = w.shape[-2:]
    R, C = -(-N // block), -(-K // block)
    x = _pad_to(w.float(), R * block, C * block)
    x = x.reshape(*w.shape[:-2], R, block, C, block)
    amax = x.abs().amax(dim=(-3, -1)).clamp(min=1e-12)
    s = amax / fp8_max(fp8)
    if scale_fmt == "ue8m0":
        s = torch.exp2(torch.ceil(torch.log2(s)))
    elif scale_fmt != "fp32":
        raise ValueError(f"scale_fmt must be 'ue8m0' or 'fp32', got {scale_fmt!r}")
    q = (x / s[..., :, None, :, None]).clamp(-fp8_max(fp8), fp8_max(fp8)).to(fp8)
    q = q.reshape(*w.shape[:-2], R * block, C * block)[..., :N, :K].contiguous()
    return q, (s.to(torch.float8_e8m0fnu) if scale_fmt == "ue8m0" else s)


def fp8_to_fnuz(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reinterpret e4m3fn bytes as e4m3fnuz: the same bits read half as large, so the scale doubles.

    -0 (0x80) is NaN in fnuz and becomes +0.
    """
    b = q.view(torch.uint8).clone()
    b[b == 0x80] = 0
    return b.view(torch.float8_e4m3fnuz), scale_to_float(scale) * 2.0


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """(..., K/2) int8/uint8 (two e2m1 codes per byte) -> (..., K) float32."""
    u = packed.view(torch.uint8) if packed.dtype in (torch.int8, torch.uint8) else packed.view(torch.uint8)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    lo, hi = lut[(u & 0xF).long()], lut[(u >> 4).long()]
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32, block: int = MX_BLOCK):
    """packed: (..., N, K/2) e2m1 pairs; scale: (..., N, K/block) E8M0 -> (..., N, K)."""
    vals = unpack_e2m1(packed)
    K = vals.shape[-1]
    if scale.shape[-1] * block != K or scale.shape[-2] != vals.shape[-2]:
        raise ValueError(f"MXFP4 scale {tuple(scale.shape)} does not match packed weight {tuple(packed.shape)} "
                         f"({block} values per scale)")
    s = scale_to_float(scale).repeat_interleave(block, -1)
    return (vals * s).to(dtype)


def quant_mxfp4(w: torch.Tensor, block: int = MX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., N, K) -> (packed int8 (..., N, K/2), E8M0 scale (..., N, K/block)); round to nearest e2m1."""
    N, K = w.shape[-2:]
    if K % block:
        raise ValueError(f"MXFP4 needs K % {block} == 0, got K={K}")
    x = w.float().reshape(*w.shape[:-1], K // block, block)
    amax = x.abs().amax(-1).clamp(min=1e-12)
    s = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))
    y = x / s[..., None]
    lut = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    mag = (y.abs()[..., None] - lut).abs().argmin(-1)
    code = (mag | ((y < 0).long() << 3)).to(torch.uint8).reshape(*w.shape[:-1], K)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).view(torch.int8)
    return packed, s.to(torch.float8_e8m0fnu)
