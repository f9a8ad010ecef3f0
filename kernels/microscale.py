"""MXFP8 and NVFP4 encoders for the send kernels; the same bits as ``moe_comm.microscale``.

MXFP8: ``quant.quantize_tile`` with 32-channel groups and UE8M0 scales (e4m3 codes, per 32
channels the smallest power of two >= amax / 448 as an E8M0 byte), as the send kernels do.
NVFP4: e2m1 codes packed two per byte (low nibble first), per 16 channels an e4m3 scale of
``amax / (global * 6)``, values ``x / (scale * global)``; ``global`` is one float32 per call,
read from device memory.

``e2m1_code`` rounds to nearest even with the magic-number trick on three ranges of the
magnitude (steps 0.5 below 2, 1 below 4, 2 up to 6), saturating at 6; every quotient is
``div_rn`` (IEEE), as PyTorch's division of fp32 tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant import e4m3_bits, quantize_tile

MX_GROUP = 32
NVFP4_GROUP = 16


@triton.jit
def _rne(v):
    """Round a non-negative fp32 below 2**22 to the nearest integer, ties to even."""
    return (v + 8388608.0) - 8388608.0


@triton.jit
def e2m1_code(v):
    """fp32 -> e2m1 code (uint8 0..15, sign in bit 3); NaN -> a signed zero."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 31).to(tl.uint8)
    a = tl.minimum(tl.abs(v), 6.0)
    a = tl.where(v != v, 0.0, a)                               # NaN: zero (min kept NaN out)
    low = _rne(a * 2.0)                                        # 0, 0.5, ..., 2 -> codes 0..4
    mid = _rne(a) + 2.0                                        # 2, 3, 4 -> codes 4..6
    high = _rne(a * 0.5) + 4.0                                 # 4, 6 -> codes 6, 7
    code = tl.where(a < 2.0, low, tl.where(a < 4.0, mid, high))
    return code.to(tl.uint8) | (sign << 3)


@triton.jit
def e4m3_value(code):
    """e4m3fn byte -> fp32 (exact; 0x7F/0xFF -> NaN)."""
    c = code.to(tl.uint32)
    sign = (c >> 7) << 31
    e = (c >> 3) & 15
    m = c & 7
    normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125                       # m * 2**-9
    sub = tl.where(sign != 0, -sub, sub)
    v = tl.where(e == 0, sub, normal)
    return tl.where((c & 127) == 127, float("nan"), v)


@triton.jit
def nvfp4_quantize_tile(v, gs, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """``v`` [BLOCK_T, BLOCK_H] fp32 (BLOCK_H a multiple of 16), ``gs`` the global scale ->
    (packed e2m1 bytes [BLOCK_T, BLOCK_H // 2], e4m3 scale bytes [BLOCK_T, BLOCK_H // 16])."""
    v3 = tl.reshape(v, [BLOCK_T, BLOCK_H // 16, 16])
    has_nan = tl.max((v3 != v3).to(tl.int32), axis=2) > 0
    amax = tl.where(has_nan, float("nan"), tl.max(tl.abs(v3), axis=2))
    denom = gs * 6.0
    s_code = e4m3_bits(tl.math.div_rn(amax, tl.full(amax.shape, 1.0, tl.float32) * denom))
    step = e4m3_value(s_code) * gs
    step3 = tl.broadcast_to(step[:, :, None], v3.shape)
    q = tl.where(step3 != 0.0, tl.math.div_rn(v3, tl.where(step3 != 0.0, step3, 1.0)), 0.0)
    codes = e2m1_code(tl.reshape(q, [BLOCK_T, BLOCK_H]))
    pairs = tl.reshape(codes.to(tl.int32), [BLOCK_T, BLOCK_H // 2, 2])
    nibble = tl.arange(0, 2)
    packed = tl.sum(pairs << (4 * nibble)[None, None, :], axis=2)
    return packed.to(tl.uint8), s_code


@triton.jit(do_not_specialize=["T"])
def microscale_quantize_kernel(
    x,  # [T, H] bf16/fp16/fp32
    values,  # MXFP8: [T, H] uint8 e4m3 codes; NVFP4: [T, H / 2] packed e2m1
    scales,  # MXFP8: [T, H / 32] E8M0 bytes; NVFP4: [T, H / 16] e4m3 bytes
    global_scale,  # NVFP4: [1] float32
    T: tl.int32, H: tl.int32,
    NVFP4: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    t64 = t.to(tl.int64)
    for h0 in range(0, H, BLOCK_H):  # BLOCK_H divides H
        h = h0 + tl.arange(0, BLOCK_H)
        v = tl.load(x + t64[:, None] * H + h[None, :], mask=tm[:, None], other=0.0)
        v = v.to(tl.float32)
        if NVFP4:
            packed, s = nvfp4_quantize_tile(v, tl.load(global_scale), BLOCK_T, BLOCK_H)
            hv = h0 // 2 + tl.arange(0, BLOCK_H // 2)
            tl.store(values + t64[:, None] * (H // 2) + hv[None, :], packed, mask=tm[:, None])
            gi = h0 // 16 + tl.arange(0, BLOCK_H // 16)
            tl.store(scales + t64[:, None] * (H // 16) + gi[None, :], s, mask=tm[:, None])
        else:
            codes, _, exps = quantize_tile(v, BLOCK_T, BLOCK_H, True, 32)
            tl.store(values + t64[:, None] * H + h[None, :], codes, mask=tm[:, None])
            gi = h0 // 32 + tl.arange(0, BLOCK_H // 32)
            tl.store(scales + t64[:, None] * (H // 32) + gi[None, :], exps, mask=tm[:, None])


def _block_h(H: int, group: int) -> int:
    """The largest power of two <= 128 that divides H and holds whole groups."""
    b = 128
    while b > group and H % b:
        b //= 2
    if H % b:
        raise ValueError(f"hidden {H} is not a multiple of {group}")
    return b


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' MXFP8 as a launch of its own: ``(q [T, H] float8_e4m3fn, scales
    [T, H/32] float8_e8m0fnu)`` (tests compare it with ``moe_comm.microscale``)."""
    T, H = x.shape
    x = x.contiguous()
    values = torch.empty((T, H), dtype=torch.uint8, device=x.device)
    scales = torch.empty((T, H // MX_GROUP), dtype=torch.uint8, device=x.device)
    if T:
        block_t = 16
        microscale_quantize_kernel[(triton.cdiv(T, block_t),)](
            x, values, scales, scales, T, H, NVFP4=False, BLOCK_T=block_t,
            BLOCK_H=_block_h(H, MX_GROUP))
    return values.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' NVFP4 as a launch of its own: ``(q [T, H/2] uint8, scales [T, H/16]
    float8_e4m3fn)`` for a given ``global_scale`` [1] float32."""
    T, H = x.shape
    x = x.contiguous()
    values = torch.empty((T, H // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((T, H // NVFP4_GROUP), dtype=torch.uint8, device=x.device)
    if T:
        block_t = 16
        microscale_quantize_kernel[(triton.cdiv(T, block_t),)](
            x, values, scales, global_scale.reshape(1).float().contiguous(), T, H, NVFP4=True,
            BLOCK_T=block_t, BLOCK_H=_block_h(H, NVFP4_GROUP))
    return values, scales.view(torch.float8_e4m3fn)
