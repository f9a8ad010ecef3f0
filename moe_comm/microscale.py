"""Block-scaled formats in plain PyTorch: MXFP8 and NVFP4, the reference the kernels match.

MXFP8 (OCP MX v1.0 element and scale types): e4m3 values, one UE8M0 (power-of-two) scale per
32 elements. The scale is the smallest power of two >= amax / 448 of the block (as this
package's FP8 with ``ue8m0``), so no value saturates::

    g = x.float().view(T, H // 32, 32)
    scale = 2 ** ceil(log2(max(amax(|g|), 1e-4) / 448))      # exactly representable in E8M0
    q = (g / scale).to(torch.float8_e4m3fn)                    # round to nearest even

NVFP4: e2m1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) packed two per byte (low
nibble first), one e4m3 scale per 16 elements, and one float32 global scale per tensor::

    global = max(amax over the finite |x|, 1e-4) / (448 * 6)   # or given by the caller
    s = e4m3(amax16 / (global * 6))                            # block scale, RNE, saturating
    q = e2m1(x / (s * global)) if s else 0                     # RNE, saturating at +-6
    x ~ q * s * global

Every division is an IEEE division of fp32 tensors (not by a Python scalar: on CUDA that
becomes a multiplication by a rounded reciprocal). NaN and infinity: a block holding a NaN has
a NaN scale (MXFP8: E8M0 code 255; NVFP4: e4m3 code 0x7F), so it dequantizes to NaN; e2m1 has
no NaN, and a NaN element encodes as a signed zero (its block's scale carries the NaN). An
infinite element saturates (MXFP8: its block scale is infinite, code 255 as well).

Scales come row-major ([T, H/32] or [T, H/16]) or in the 128x4 swizzled layout block-scaled
GEMMs (cuBLAS, CUTLASS) read: `swizzle_128x4`.
"""
from __future__ import annotations

import torch

FP8_GROUP = 128  # this package's FP8: e4m3 codes, one float32 scale per 128 channels
MX_GROUP = 32
NVFP4_GROUP = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
AMAX_FLOOR = 1e-4
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # code & 7 -> magnitude


def _div(a: torch.Tensor, b) -> torch.Tensor:
    """IEEE fp32 division by a tensor (see the module docstring)."""
    return a / (b if isinstance(b, torch.Tensor) else torch.full_like(a, float(b)))


def _check(x: torch.Tensor, group: int, what: str) -> None:
    if x.dim() != 2 or x.shape[1] % group:
        raise ValueError(f"{what} needs [T, H] input with H % {group} == 0, got "
                         f"{tuple(x.shape)}")


def ue8m0_ceil(v: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= v (v > 0, fp32); NaN and infinity give an infinite value
    whose E8M0 code is 255."""
    bits = v.contiguous().view(torch.int32)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent.clamp(max=255) << 23).view(torch.float32)


def e8m0_codes(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales -> their E8M0 bytes (the biased exponent; 255 for NaN/inf)."""
    return (scales.contiguous().view(torch.int32) >> 23).to(torch.uint8)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [T, H] float8_e4m3fn, scales [T, H/32] float8_e8m0fnu)``."""
    _check(x, MX_GROUP, "MXFP8")
    T, H = x.shape
    g = x.float().reshape(T, H // MX_GROUP, MX_GROUP)
    amax = g.abs().amax(-1).clamp(min=AMAX_FLOOR)          # NaN propagates
    scale = ue8m0_ceil(_div(amax, E4M3_MAX))
    q = _div(g, scale[..., None].expand_as(g).contiguous()).reshape(T, H)
    return q.to(torch.float8_e4m3fn), e8m0_codes(scale).view(torch.float8_e8m0fnu)


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """This package's FP8 rows back to float32: ``q.float() * scale`` per group of 128
    channels ([T, H] codes, [T, H / 128] float32 scales)."""
    T, H = q.shape
    return (q.float().reshape(T, H // FP8_GROUP, FP8_GROUP) * scales[..., None]).reshape(T, H)


def dequantize_mxfp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    T, H = q.shape
    # (bytes first: compilers without an e8m0 type, inductor's CPU backend, read them as such)
    s = (scales.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
    return (q.float().reshape(T, H // MX_GROUP, MX_GROUP) * s[..., None]).reshape(T, H)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 codes (uint8, 0..15: sign in bit 3), nearest representable value, ties
    to the even code, saturating at +-6; NaN -> a signed zero. A table lookup, independent of
    the kernels' arithmetic."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=v.device)
    a = v.abs().nan_to_num(nan=0.0, posinf=E2M1_MAX).clamp(max=E2M1_MAX)
    dist = (a[..., None] - table).abs()
    best = dist.min(-1, keepdim=True).values
    ties = dist == best
    # among the nearest, the even code (codes 0..7: even = mantissa bit 0)
    even = ties & (torch.arange(8, device=v.device) % 2 == 0)
    code = torch.where(even.any(-1), even.float().argmax(-1), ties.float().argmax(-1))
    sign = (v.contiguous().view(torch.int32) < 0).to(torch.uint8)
    return code.to(torch.uint8) | (sign << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[T, H] codes -> [T, H/2] bytes, element 2i in the low nibble (float4_e2m1fn_x2)."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    p = packed.contiguous().view(torch.uint8)
    return torch.stack((p & 15, p >> 4), dim=-1).reshape(p.shape[0], 2 * p.shape[1])


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """[1] float32: max(amax of the finite |x|, 1e-4) / (448 * 6), on x's device, no sync."""
    a = x.float().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    amax = a.amax().reshape(1) if a.numel() else torch.zeros(1, device=x.device)
    return _div(amax.clamp(min=AMAX_FLOOR), E4M3_MAX * E2M1_MAX)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [T, H/2] uint8 (two e2m1 codes per byte), scales [T, H/16] float8_e4m3fn,
    global_scale [1] float32)``; ``global_scale`` given or computed (module docstring)."""
    _check(x, NVFP4_GROUP, "NVFP4")
    T, H = x.shape
    gs = nvfp4_global_scale(x) if global_scale is None else \
        global_scale.reshape(1).to(torch.float32)
    g = x.float().reshape(T, H // NVFP4_GROUP, NVFP4_GROUP)
    amax = g.abs().amax(-1)                                 # NaN propagates
    denom = (gs * E2M1_MAX).expand_as(amax).contiguous()
    s = _div(amax, denom).to(torch.float8_e4m3fn)
    sq = s.float()
    step = (sq * gs)[..., None].expand_as(g).contiguous()
    v = torch.where(step != 0, _div(g, step), torch.zeros_like(g))
    codes = e2m1_codes(v.reshape(T, H))
    return pack_e2m1(codes), s, gs


def dequantize_nvfp4(q: torch.Tensor, scales: torch.Tensor, global_scale) -> torch.Tensor:
    codes = unpack_e2m1(q)
    T, H = codes.shape
    v = e2m1_values(codes).reshape(T, H // NVFP4_GROUP, NVFP4_GROUP)
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=q.device)
    gs = gs.reshape(-1, 1, 1)  # [T], [1] or a scalar (no branch on the size: traceable)
    return (v * scales.float()[..., None] * gs).reshape(T, H)


def swizzle_128x4(scales: torch.Tensor) -> torch.Tensor:
    """Row-major block scales [rows, cols] (one byte each) -> the 128x4 tiled layout of
    block-scaled GEMMs, flat [ceil(rows/128) * ceil(cols/4) * 512] bytes, zero-padded:
    tile (rt, ct) at (rt * ceil(cols/4) + ct) * 512, element (r, c) of a tile at
    (r % 32) * 16 + (r // 32) * 4 + c."""
    b = scales.contiguous().view(torch.uint8)
    rows, cols = b.shape
    R, C = -(-rows // 128), -(-cols // 4)
    padded = torch.zeros((R * 128, C * 4), dtype=torch.uint8, device=b.device)
    padded[:rows, :cols] = b
    tiles = padded.view(R, 4, 32, C, 4).permute(0, 3, 2, 1, 4)   # rt, ct, r%32, r//32, c
    return tiles.reshape(-1).view(scales.dtype) if scales.element_size() == 1 else \
        tiles.reshape(-1)


def unswizzle_128x4(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `swizzle_128x4`: [rows, cols] bytes (as flat's dtype when one byte)."""
    b = flat.contiguous().view(torch.uint8)
    R, C = -(-rows // 128), -(-cols // 4)
    tiles = b.view(R, C, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(R * 128, C * 4)
    out = tiles[:rows, :cols].contiguous()
    return out.view(flat.dtype) if flat.element_size() == 1 else out
