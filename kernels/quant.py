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

Error bound (documented in the README): a value whose quantized magnitude is a normal e4m3
number is off by at most 2**-4 of itself; one in the subnormal range (below ``2**-6 * scale``)
by at most ``2**-10 * scale``. ``amax`` is clamped at 1e-4, so an all-zero group quantizes to
zeros with scale ``1e-4 / 448``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import GROUP, tiles

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
MXFP8 = 2  # the ``ue8m0`` value of MXFP8: exponent bytes per 32 channels


def scale_group(ue8m0: int) -> int:
    """Channels per scale: 32 for MXFP8 (``ue8m0 == 2``), else 128."""
    return 32 if ue8m0 == MXFP8 else 128


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


@triton.jit
def store_fp8_rows(row8, h, g, H, codes, scales, exps, rows, hm, UE8M0: tl.constexpr,
                   GS: tl.constexpr = 128):
    """Stores a channel tile of FP8 token rows laid out as [H code bytes][scales]: ``row8``
    [BLOCK_T] uint8 pointers to each row's start, ``codes`` at bytes ``h``, fp32 ``scales`` at
    byte ``H + 4 g`` or, with UE8M0, exponent bytes ``exps`` at ``H + g`` (``g``: groups of
    ``GS`` channels); ``rows`` [BLOCK_T] masks tokens, ``hm`` channels, groups past H // GS
    are not stored (FP8 per 128 needs H % 128 == 0, MXFP8 H % 32 == 0)."""
    tl.store(row8[:, None] + h[None, :], codes, mask=rows[:, None] & hm[None, :])  # gate: row
    if UE8M0:
        gm = rows[:, None] & (g < H // GS)[None, :]
        tl.store(row8[:, None] + H + g[None, :], exps, mask=gm)  # gate: exponents
    else:
        scales8 = row8.to(tl.pointer_type(tl.float32), bitcast=True) + H // 4
        tl.store(scales8[:, None] + g[None, :], scales, mask=rows[:, None])  # gate: scales


@triton.jit
def row_payload(x, H, FP8: tl.constexpr, UE8M0: tl.constexpr, GS: tl.constexpr = 128):
    """Bytes of one token row as sent: ``H`` elements of ``x``, or with FP8 (``FP8`` 1:
    quantized here, 2: given) ``H`` codes and per ``GS`` channels a float scale (UE8M0: one
    exponent byte)."""
    if FP8 == 0:
        payload = H * x.dtype.element_ty.primitive_bitwidth // 8
    else:
        payload = H + (H // GS) * (4 - 3 * UE8M0)
    return payload


@triton.jit
def load_send_tile(x, x_scales, t64, tm, h, hm, g, H, BLOCK_T: tl.constexpr,
                   BLOCK_H: tl.constexpr, FP8: tl.constexpr, UE8M0: tl.constexpr,
                   GS: tl.constexpr = 128):
    """A send kernel's tile of tokens ``t64`` and channels ``h`` (groups ``g`` of ``GS``) as
    it is stored: ``(tile, codes, scales, exps)``. ``FP8`` 0: ``tile`` holds the rows (the
    rest alias it); 1: ``x`` quantized here; 2: ``x`` holds e4m3 codes and ``x_scales``
    [T, H/GS] their float32 scales, or with UE8M0 their exponent bytes (a quantized pair).
    Where FP8 is on, ``tile`` aliases the codes."""
    m = tm[:, None] & hm[None, :]
    if FP8 == 0:
        tile = tl.load(x + t64[:, None] * H + h[None, :], mask=m)
        codes, scales, exps = tile, tile, tile
    elif FP8 == 1:
        v = tl.load(x + t64[:, None] * H + h[None, :], mask=m, other=0.0).to(tl.float32)
        codes, scales, exps = quantize_tile(v, BLOCK_T, BLOCK_H, UE8M0, GS)
        tile = codes
    else:
        codes = tl.load(x + t64[:, None] * H + h[None, :], mask=m)
        gm = tm[:, None] & (g < H // GS)[None, :]
        if UE8M0:
            exps = tl.load(x_scales + t64[:, None] * (H // GS) + g[None, :], mask=gm, other=0)
            scales = exps
        else:
            scales = tl.load(x_scales + t64[:, None] * (H // GS) + g[None, :], mask=gm,
                             other=0.0)
            exps = codes
        tile = codes
    return tile, codes, scales, exps


@triton.jit(do_not_specialize=["T"])
def quantize_kernel(
    x,  # [T, H] bf16/fp16/fp32
    codes,  # [T, H] uint8 out (view of float8_e4m3fn)
    scales,  # [T, H // 128] float32 out
    exps,  # [T, H // 128] uint8 out: biased exponents (UE8M0)
    T: tl.int32, H: tl.int32,
    UE8M0: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    t64 = t.to(tl.int64)
    G = H // 128
    for h0 in range(0, H, BLOCK_H):  # BLOCK_H divides H (tiles.block_h_for)
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
        quantize_kernel[(triton.cdiv(T, tile.block_t),)](
            x, codes, scales, exps, T, H, UE8M0=ue8m0, BLOCK_T=tile.block_t,
            BLOCK_H=tile.block_h, **tile.launch_options())
    return codes.view(torch.float8_e4m3fn), scales, exps
