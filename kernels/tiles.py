"""Tiles, warps and grids of every kernel, per flavour, in one place.

The interpreter's cost is per program and per operation, not per element, so on CPU ranks the
kernels move wide tiles (64 tokens x up to 2048 channels). A GPU wants the opposite: tiles that
fit in registers (a tile that does not fit spills to local memory, and the driver reserves that
stack for every resident thread), enough programs to cover the SMs, and 16-byte stores. The
launchers in this package take their tiles from :func:`tiles` and their grids from the
functions below, and the static gate (``python -m moe_comm.gate``) compiles exactly what they
pick, so the two can never drift apart.

Each GPU choice is sized so that a thread holds at most 64 bytes of a row tile (``block_h``
shrinks for 4- and 8-byte elements) and at least 16 bytes of the row data the kernel stores (a
16-byte store needs them: ``block_t`` grows for FP8 bytes where ``block_h`` is small).
``maxnreg`` caps registers at what the intended occupancy allows: left alone, ptxas picks a
lower target for 512-thread programs and spills.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import triton

GROUP = 128  # FP8 channels per scale; channel tiles are multiples of it
GPU_PROGRAMS = 264  # target programs of the grids that are not persistent (2 per SM on H100/H200)


REGISTERS_PER_SM = 65536
TILE_BYTES_PER_THREAD = 64


@dataclass(frozen=True)
class Tiles:
    block_t: int  # tokens (or rows) per tile
    block_h: int  # channels per tile (a multiple of 128 where FP8 groups are cut)
    num_warps: int
    maxnreg: int | None = None  # registers per thread at most (GPUs)

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    def launch_options(self) -> dict:
        """The launch keywords of these tiles (``num_warps``, and ``maxnreg`` on GPUs)."""
        options = {"num_warps": self.num_warps}
        if self.maxnreg:
            options["maxnreg"] = self.maxnreg
        return options


def block_h_for(hidden: int, cap: int = 2048) -> int:
    """Channels per tile: a power of two <= ``cap``, at least 128. Where ``hidden % 128 == 0``
    the widest such tile that divides ``hidden`` (7168 -> 1024), so no tile needs a channel
    mask (masks that vary along a row stop 16-byte stores) and FP8 groups never straddle
    tiles; otherwise the next power of two (the last tile is masked)."""
    if hidden % GROUP == 0:
        block = GROUP
        while block * 2 <= cap and hidden % (block * 2) == 0:
            block *= 2
        return block
    return max(GROUP, min(triton.next_power_of_2(hidden), cap))


def even(hidden: int, block_h: int) -> bool:
    """Every channel tile is full (the kernels' EVEN_H): no channel mask is needed."""
    return hidden % block_h == 0


# (block_t, block_h cap, num_warps, programs per SM) per kernel on a GPU. The persistent
# kernels run one program per SM they are given (num_sms): the dispatch send with 16 warps;
# the others 4 or 8, two programs per SM where not persistent.
_GPU = {
    "routing_layout": (16, 0, 4, 2),
    "checked_topk_idx": (16, 0, 4, 2),
    "quantize": (8, 1024, 8, 2),
    "dispatch_send": (8, 1024, 16, 1),
    "dispatch_expand": (8, 1024, 8, 2),
    "combine_send": (8, 1024, 8, 2),
    "combine_reduce": (8, 1024, 8, 2),
    "ll_dispatch_send": (4, 1024, 8, 2),
    # NVFP4: 16-byte stores of packed codes need 32 values a thread; one program per SM (the
    # grid is persistent) lets it keep them in registers
    "ll_dispatch_send_nvfp4": (4, 1024, 8, 1),
    # persistent over their (expert, source) blocks or token tiles, at most num_sms programs:
    # one per SM
    "ll_dispatch_recv": (8, 1024, 8, 1),
    "ll_combine_send": (8, 1024, 8, 1),
    "ll_combine_recv": (4, 1024, 8, 1),
    "wait_epochs": (1, 0, 4, 2),
}
_INTERPRETER_ROWS = {"ll_dispatch_recv": 16, "ll_combine_send": 16}


def tiles(kernel: str, compiled: bool, hidden: int, elem_bytes: float = 2) -> Tiles:
    """The tiles ``kernel`` is launched with: ``compiled`` for GPUs, else for the interpreter.
    ``elem_bytes``: the row element the launch holds per channel (1 for FP8 bytes, 0.5 for
    NVFP4's packed codes, 8 for fp64; 4 where it sums in fp32)."""
    if kernel not in _GPU:
        raise KeyError(f"no tiles for kernel {kernel!r}; known: {sorted(_GPU)}")
    if not compiled:
        return Tiles(_INTERPRETER_ROWS.get(kernel, 64), block_h_for(hidden), 4)
    block_t, cap, num_warps, per_sm = _GPU[kernel]
    threads = 32 * num_warps
    if cap:  # at most 64 bytes of a row tile per thread (fp32: 16 values; fp64 accumulates)
        cap = min(cap, max(GROUP, int(TILE_BYTES_PER_THREAD * threads // (block_t * elem_bytes))))
    block_h = block_h_for(hidden, cap) if cap else 0
    if block_h:  # 16 bytes of row data per thread, for 16-byte stores
        block_t = max(block_t, math.ceil(16 * threads / (block_h * elem_bytes)))
    maxnreg = min(128 if per_sm > 1 else 255, REGISTERS_PER_SM // (threads * per_sm)) // 8 * 8
    return Tiles(block_t, block_h, num_warps, maxnreg)


def persistent_programs(work_tiles: int, num_sms: int | None) -> int:
    """Programs of a persistent send grid: one per tile of work, at most ``num_sms``."""
    work_tiles = max(1, work_tiles)
    return min(work_tiles, num_sms) if num_sms else work_tiles


def per_source_programs(world_size: int, max_tokens: int, block_t: int, compiled: bool) -> int:
    """Programs per source rank of the grids ``(R, P)`` that walk every source's rows (their
    counts live on the device, so the grid is sized by the Buffer: ``max_tokens`` rows per
    source at most). The interpreter takes one program per source (each loops over its tiles);
    a GPU takes enough to cover the SMs."""
    if not compiled:
        return 1
    tiles_per_source = max(1, triton.cdiv(max_tokens, block_t))
    return max(1, min(tiles_per_source, triton.cdiv(GPU_PROGRAMS, world_size)))
