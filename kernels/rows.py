"""A token row as it travels (staging, outboxes), per link format, and the send kernels' code
that loads, quantizes and stores it.

Byte layout of one row (``H`` channels; every layout starts 16-byte aligned)::

    rows as they are    [H elements of x]
    FP8 per 128         [H e4m3 bytes][H/128 float32 scales]    (``ue8m0``: [H/128 exponent bytes])
    MXFP8               [H e4m3 bytes][H/32 E8M0 bytes]
    NVFP4               [H/2 bytes, two e2m1 codes each, low nibble first][float32 global scale]
                        [H/16 e4m3 bytes]

The formats are told apart by ``GS``, the channels per scale: 128 (FP8), 32 (MXFP8, with
``UE8M0``), 16 (NVFP4). NVFP4's global scale travels with every row, so a receiver holds each
row's own (sources compute theirs independently).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .microscale import e4m3_value, nvfp4_quantize_tile
from .quant import MXFP8, NVFP4, quantize_tile, scale_group

NVFP4_GS: tl.constexpr = tl.constexpr(16)


def sent_elem_bytes(fp8: int, ue8m0: int, elem_bytes: int) -> float:
    """Bytes of row data per channel a send stores (its tiles are sized by it): 0.5 for NVFP4,
    1 for FP8 and MXFP8, else the element size."""
    if not fp8:
        return elem_bytes
    return 0.5 if ue8m0 == NVFP4 else 1


def payload_bytes(hidden: int, elem_bytes: int, fp8: int, ue8m0: int) -> int:
    """Bytes of one row's data as sent (:func:`row_payload` on the host)."""
    if not fp8:
        return hidden * elem_bytes
    groups = hidden // scale_group(ue8m0)
    if ue8m0 == NVFP4:
        return hidden // 2 + 4 + groups
    return hidden + groups * (1 if ue8m0 in (1, MXFP8) else 4)


@triton.jit
def row_payload(x, H, FP8: tl.constexpr, UE8M0: tl.constexpr, GS: tl.constexpr = 128):
    """Bytes of one token row as sent (module docstring): ``H`` elements of ``x``, or with FP8
    (``FP8`` 1: quantized here, 2: given) the codes and scales of its format."""
    if FP8 == 0:
        payload = H * x.dtype.element_ty.primitive_bitwidth // 8
    elif GS == NVFP4_GS:
        payload = H // 2 + 4 + H // 16
    else:
        payload = H + (H // GS) * (4 - 3 * UE8M0)
    return payload


@triton.jit
def quantize_row_tile(v, gs, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                      UE8M0: tl.constexpr, GS: tl.constexpr):
    """``v`` [BLOCK_T, BLOCK_H] fp32 -> ``(codes, scales, exps)`` as :func:`store_rows`
    takes them. FP8 / MXFP8: ``quant.quantize_tile``; NVFP4 (``gs``: the global scale):
    packed codes [BLOCK_T, BLOCK_H / 2], the global per row [BLOCK_T] and e4m3 scale bytes
    [BLOCK_T, BLOCK_H / 16]."""
    if GS == NVFP4_GS:
        codes, exps = nvfp4_quantize_tile(v, gs, BLOCK_T, BLOCK_H)
        scales = gs + tl.zeros([BLOCK_T], tl.float32)
    else:
        codes, scales, exps = quantize_tile(v, BLOCK_T, BLOCK_H, UE8M0, GS)
    return codes, scales, exps


@triton.jit
def _bytes_to_f32(p, mask):
    """The float32 whose four little-endian bytes start at uint8 pointers ``p``."""
    word = tl.zeros(p.shape, tl.uint32)
    for i in range(4):
        word |= tl.load(p + i, mask=mask, other=0).to(tl.uint32) << (8 * i)
    return word.to(tl.float32, bitcast=True)


@triton.jit
def _packed_tile(h0, H, BLOCK_V: tl.constexpr, EVEN_H: tl.constexpr, H32: tl.constexpr = False):
    """Bytes ``h0 / 2 ..`` of an NVFP4 row's packed codes and their mask; with ``EVEN_H`` the
    mask is a constant (a mask that varies along a row stops 16-byte stores); with ``H32``
    (``H % 32 == 0``) the row's end is written as a multiple of 16 bytes, so the mask holds
    still over every 16 bytes (``H // 2`` alone is known to be a multiple of 8)."""
    hv = tl.multiple_of(h0 // 2, BLOCK_V) + tl.arange(0, BLOCK_V)  # h0: a multiple of 2 BLOCK_V
    if EVEN_H:
        hvm = tl.full([BLOCK_V], True, tl.int1)
    elif H32:
        hvm = hv < (H // 32) * 16
    else:
        hvm = hv < H // 2
    return hv, hvm


@triton.jit
def load_send_tile(x, x_scales, t64, tm, h0, h, hm, g, H, BLOCK_T: tl.constexpr,
                   BLOCK_H: tl.constexpr, FP8: tl.constexpr, UE8M0: tl.constexpr,
                   GS: tl.constexpr = 128, EVEN_H: tl.constexpr = False):
    """A send kernel's tile of tokens ``t64`` and channels ``h = h0 + arange(BLOCK_H)``
    (groups ``g`` of ``GS``) as it is stored: ``(tile, codes, scales, exps)``. ``FP8`` 0:
    ``tile`` holds the rows (the rest alias it); 1: ``x`` quantized here (NVFP4: ``x_scales``
    is the float32 global scale); 2: a quantized input: ``x`` holds e4m3 codes and
    ``x_scales`` [T, H/GS] their float32 scales, or with UE8M0 their exponent bytes; NVFP4:
    ``x`` [T, H/2] packed bytes and ``x_scales`` [T, H/16 + 4] bytes (the e4m3 scales, then
    each row's float32 global scale). Where FP8 is on, ``tile`` aliases the codes."""
    m = tm[:, None] & hm[None, :]
    if FP8 == 0:
        tile = tl.load(x + t64[:, None] * H + h[None, :], mask=m)
        codes, scales, exps = tile, tile, tile
    elif FP8 == 1:
        v = tl.load(x + t64[:, None] * H + h[None, :], mask=m, other=0.0).to(tl.float32)
        gs = 0.0
        if GS == NVFP4_GS:
            gs = tl.load(x_scales)
        codes, scales, exps = quantize_row_tile(v, gs, BLOCK_T, BLOCK_H, UE8M0, GS)
        tile = codes
    elif GS == NVFP4_GS:
        hv, hvm = _packed_tile(h0, H, BLOCK_H // 2, EVEN_H)
        vm = tm[:, None] & hvm[None, :]
        codes = tl.load(x + t64[:, None] * (H // 2) + hv[None, :], mask=vm, other=0)
        gm = tm[:, None] & (g < H // 16)[None, :]
        row_scales = x_scales + t64 * (H // 16 + 4)
        exps = tl.load(row_scales[:, None] + g[None, :], mask=gm, other=0)
        scales = _bytes_to_f32(row_scales + H // 16, tm)
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


@triton.jit
def store_rows(row8, h0, h, g, H, codes, scales, exps, rows, hm, UE8M0: tl.constexpr,
               GS: tl.constexpr = 128, EVEN_H: tl.constexpr = False, H32: tl.constexpr = False):
    """Stores a channel tile (from ``h0``; channels ``h``, groups ``g``) of quantized token
    rows in the layout of the module docstring: ``row8`` [BLOCK_T] uint8 pointers to each
    row's start, ``rows`` [BLOCK_T] masks tokens, ``hm`` channels (all of them with
    ``EVEN_H``; ``H32``: H % 32 == 0, :func:`_packed_tile`); groups past H // GS are not stored
    (FP8 per 128 needs H % 128 == 0, MXFP8 H % 32, NVFP4 H % 16)."""
    if GS == NVFP4_GS:  # codes [BLOCK_T, BLOCK_H / 2] packed, scales the global per row
        hv, hvm = _packed_tile(h0, H, codes.shape[1], EVEN_H, H32)
        tl.store(row8[:, None] + hv[None, :], codes, mask=rows[:, None] & hvm[None, :])  # gate: row
        glob = (row8 + H // 2).to(tl.pointer_type(tl.float32), bitcast=True)
        tl.store(glob, scales, mask=rows & (h0 == 0))  # gate: scales
        gm = rows[:, None] & (g < H // 16)[None, :]
        tl.store(row8[:, None] + (H // 2 + 4) + g[None, :], exps, mask=gm)  # gate: scalebytes
    else:
        tl.store(row8[:, None] + h[None, :], codes, mask=rows[:, None] & hm[None, :])  # gate: row
        if UE8M0:
            gm = rows[:, None] & (g < H // GS)[None, :]
            tl.store(row8[:, None] + H + g[None, :], exps, mask=gm)  # gate: exponents
        else:
            scales8 = row8.to(tl.pointer_type(tl.float32), bitcast=True) + H // 4
            tl.store(scales8[:, None] + g[None, :], scales, mask=rows[:, None])  # gate: scales


# ---------------------------------------------------------------------- FP8 combine partials
@triton.jit
def store_fp8_partials(v, row8, rows, box8, box_rows, h0, h, hm, H, BOX: tl.constexpr,
                       EVEN_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """Partial sums ``v`` [BLOCK_T, BLOCK_H] fp32 (channels ``h = h0 + arange(BLOCK_H)``)
    quantized to FP8 per 128 channels and stored in the FP8 row layout (module docstring) at
    uint8 row pointers ``row8`` [BLOCK_T] where ``rows``, and with ``BOX`` the same codes at
    ``box8`` where ``box_rows``. Equivalent to::

        codes, scales = quantize_per_128(v)  # quant.quantize_tile
        for t in rows: row8[t][h] = codes[t]; row8[t][H + 4 * g : ...] = scales[t][g]
    """
    codes, scales, _ = quantize_tile(v, BLOCK_T, BLOCK_H, False)
    g = h0 // 128 + tl.arange(0, BLOCK_H // 128)
    store_rows(row8, h0, h, g, H, codes, scales, codes, rows, hm, False, 128, EVEN_H)
    if BOX:
        store_rows(box8, h0, h, g, H, codes, scales, codes, box_rows, hm, False, 128, EVEN_H)


@triton.jit
def load_fp8_partials(row8, rows, h0, h, hm, H, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """The fp32 values of FP8 partial rows at uint8 row pointers ``row8`` [BLOCK_T], channels
    ``h = h0 + arange(BLOCK_H)``; 0 where not ``rows``. Equivalent to::

        e4m3_to_float(row8[t][h]) * float32(row8[t][H + 4 * (h // 128)])
    """
    g = h0 // 128 + tl.arange(0, BLOCK_H // 128)
    codes = tl.load(row8[:, None] + h[None, :], mask=rows[:, None] & hm[None, :], other=0)
    scales8 = (row8 + H).to(tl.pointer_type(tl.float32), bitcast=True)
    sc = tl.load(scales8[:, None] + g[None, :], mask=rows[:, None] & (g < H // 128)[None, :],
                 other=0.0)
    v = tl.reshape(e4m3_value(codes), [BLOCK_T, BLOCK_H // 128, 128]) * sc[:, :, None]
    return tl.reshape(v, [BLOCK_T, BLOCK_H])
