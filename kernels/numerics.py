"""Rounding that is the same bit for bit in the interpreter, on the GPU and in PyTorch; tiles;
the column of a small tile held in registers.

The interpreter narrows fp32 to bf16 by truncation, the GPU and PyTorch round to nearest even.
``cast_rne`` rounds bf16 by hand (add half an ulp, ties to even, keep the top 16 bits), so
results agree everywhere; other types use ``.to``, which already rounds to nearest even.

The sum must not touch NaN: a GPU's canonical NaN is 0x7FFFFFFF, and adding half an ulp to it
carries into the sign bit (0x8000, -0.0), so a NaN would vanish. NaN becomes bf16's quiet NaN
0x7FC0 instead (infinities round to themselves: their low bits are 0).
"""
import triton
import triton.language as tl


@triton.jit
def cast_rne(x, dtype: tl.constexpr):
    """``x.to(dtype)`` with round-to-nearest-even, also under the interpreter."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)
        out = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = x.to(dtype)
    return out


@triton.jit
def channel_tile(h0, H, BLOCK_H: tl.constexpr, EVEN_H: tl.constexpr):
    """Channels ``h0 .. h0 + BLOCK_H`` of a row and their mask ``h < H``; where BLOCK_H divides
    H (EVEN_H) the mask is a constant, so it never varies along a row (16-byte stores)."""
    h = h0 + tl.arange(0, BLOCK_H)
    if EVEN_H:
        hm = tl.full([BLOCK_H], True, tl.int1)
    else:
        hm = h < H
    return h, hm


@triton.jit
def acc_zeros(BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, FP64: tl.constexpr):
    """Accumulator tile: fp64 for fp64 data, fp32 for everything else."""
    if FP64:
        acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float64)
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    return acc


@triton.jit
def column(tile, k):
    """Column ``k`` of an int tile [rows, columns] held in registers (no memory access): a
    token's k-th choice, a slot's k-th row, a token's slot on rank k."""
    return tl.sum(tl.where(tl.arange(0, tile.shape[1])[None, :] == k, tile, 0), axis=1)
