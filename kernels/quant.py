"""FP8 (e4m3fn) quantization per token and per group of 128 channels, fused into the sends.

Equivalent PyTorch (``moe_comm.reference.quantize_fp8``)::

    g = x.float().view(T, H // 128, 128)
    amax = g.abs().amax(-1).clamp(min=1e-4)
    scale = amax / 448                         # or, with ue8m0, 2 ** ceil(log2(amax / 448))
    q = (g / scale[..., None]).view(T, H).to(torch.float8_e4m3fn)   # round to nearest even
    # dequantized: q.float() * scale (per group)

The e4m3 byte is built by hand (``e4m3_bits``): the interpreter's own float-to-fp8 conversion
does not round to nearest even, and the hand-made one gives the same bits in the interpreter,
on the GPU and in PyTorch. ``amax / 448`` and ``x / scale`` use ``div_rn`` (IEEE division).

Error bound (documented in docs/FORMATS.md, "FP8 dispatch"): a value whose quantized magnitude
is a normal e4m3 number is off by at most 2**-4 of itself; one in the subnormal range (below
``2**-6 * scale``) by at most ``2**-10 * scale``. ``amax`` is clamped at 1e-4, so an all-zero
group quantizes to zeros with scale ``1e-4 / 448``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import GROUP, tiles

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
MXFP8 = 2  # the ``ue8m0`` value of MXFP8: exponent bytes per 32 channels
NVFP4 = 3  # the ``ue8m0`` value of NVFP4: packed e2m1 values, e4m3 bytes per 16 channels


def scale_group(ue8m0: int) -> int:
    """Channels per scale: 32 for MXFP8 (``ue8m0 == 2``), 16 for NVFP4 (3), else 128."""
    return {MXFP8: 32, NVFP4: 16}.get(ue8m0, 128)


@triton.jit
def e4m3_bits(v):
    """fp32 -> e4m3fn byte (uint8), round to nearest even, saturating at +-448 (as PyTorch
    does, infinities too); NaN -> 0x7F with its sign (e4m3fn's only NaN)."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 31).to(tl.uint8)
    a = tl.minimum(tl.abs(v), 448.0)
    abits = a.to(tl.uint32, bitcast=True)
    r = abits + 0x7FFFF + ((abits >> 20) & 1)  # keep 3 mantissa bits, ties to even
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)  # e4m3 exponent bias 7 = 127 - 120
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)  # multiples of 2**-9, RNE
    code = tl.where(a >= 0.015625, normal, sub)
    code = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7F, code)  # min() dropped the NaN
    return (code.to(tl.uint8) | (sign << 7)).to(tl.uint8)


@triton.jit
def ue8m0_scale(amax_over_max):
    """Smallest power of two >= the (positive) fp32 argument, and its biased exponent; NaN and
    infinity give exponent 255 (E8M0's NaN code) and an infinite scale."""
    bits = amax_over_max.to(tl.uint32, bitcast=True)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.uint32)
    exponent = tl.minimum(exponent, 255)
    return (exponent << 23).to(tl.float32, bitcast=True), exponent.to(tl.uint8)


@triton.jit
def quantize_tile(v, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, UE8M0: tl.constexpr,
                  GS: tl.constexpr = 128):
    """``v`` [BLOCK_T, BLOCK_H] fp32 (BLOCK_H a multiple of GS) -> (codes [BLOCK_T, BLOCK_H]
    uint8, scales [BLOCK_T, BLOCK_H // GS] fp32, exponent bytes [BLOCK_T, BLOCK_H // GS]), one
    scale per ``GS`` channels (128; MXFP8: 32 with UE8M0). A NaN in a group makes its amax and
    scale NaN, so the whole group dequantizes to NaN, as ``reference.quantize_fp8`` (PyTorch's
    amax propagates NaN; Triton's max would drop it)."""
    v3 = tl.reshape(v, [BLOCK_T, BLOCK_H // GS, GS])
    has_nan = tl.max((v3 != v3).to(tl.int32), axis=2) > 0  # tl.max skips NaN; torch's keeps it
    amax = tl.where(has_nan, float("nan"), tl.maximum(tl.max(tl.abs(v3), axis=2), 1e-4))
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    exps = tl.zeros(amax.shape, tl.uint8)
    if UE8M0:
        scale, exps = ue8m0_scale(scale)
    q = tl.math.div_rn(v3, tl.broadcast_to(scale[:, :, None], v3.shape))
    codes = e4m3_bits(tl.reshape(q, [BLOCK_T, BLOCK_H]))
    return codes, scale, exps


@triton.jit(do_not_specialize=["T"])
def quantize_kernel(
    x,  # [T, H] bf16/fp16/fp32
    codes,  # [T, H] uint8 out (view of float8_e4m3fn)
    scales,  # [T, H // 128] float32 out
    exps,  # [T, H // 128] uint8 out: biased exponents (UE8M0)
    T: tl.int32, H: tl.int32,
    UE8M0: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Program (i, c): channel tile c (BLOCK_H divides H: tiles.block_h_for) of token tile i."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    t64 = t.to(tl.int64)
    G = H // 128
    h0 = tl.program_id(1) * BLOCK_H
    h = h0 + tl.arange(0, BLOCK_H)
    v = tl.load(x + t64[:, None] * H + h[None, :], mask=tm[:, None], other=0.0)
    c, s, e = quantize_tile(v.to(tl.float32), BLOCK_T, BLOCK_H, UE8M0)
    tl.store(codes + t64[:, None] * H + h[None, :], c, mask=tm[:, None])  # gate: row
    g = h0 // 128 + tl.arange(0, BLOCK_H // 128)
    tl.store(scales + t64[:, None] * G + g[None, :], s, mask=tm[:, None])
    tl.store(exps + t64[:, None] * G + g[None, :], e, mask=tm[:, None])


def quantize_fp8(x: torch.Tensor, ue8m0: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [T, H] float8_e4m3fn, scales [T, H/128] float32, exponents [T, H/128] uint8)``.

    The kernels' quantization as a launch of its own (tests compare it with the reference).
    """
    T, H = x.shape
    if H % GROUP:
        raise ValueError(f"FP8 needs hidden % {GROUP} == 0, got {H}")
    x = x.contiguous()
    codes = torch.empty((T, H), dtype=torch.uint8, device=x.device)
    scales = torch.empty((T, H // GROUP), dtype=torch.float32, device=x.device)
    exps = torch.empty((T, H // GROUP), dtype=torch.uint8, device=x.device)
    tile = tiles("quantize", x.device.type != "cpu", H, 1)
    if T:
        quantize_kernel[(triton.cdiv(T, tile.block_t), triton.cdiv(H, tile.block_h))](
            x, codes, scales, exps, T, H, UE8M0=ue8m0, BLOCK_T=tile.block_t,
            BLOCK_H=tile.block_h, **tile.launch_options())
    return codes.view(torch.float8_e4m3fn), scales, exps
