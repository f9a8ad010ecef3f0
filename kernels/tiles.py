"""Tiles, warps and grids of every kernel, per flavour, in one place.

The interpreter's cost is per program and per operation, not per element, so on CPU ranks the
kernels move wide tiles (64 tokens x up to 2048 channels). A GPU wants the opposite: tiles that
fit in registers (a tile that does not fit spills to local memory, and the driver reserves that
stack for every resident thread), enough programs to cover the SMs, and 16-byte stores. The
launchers in this package take their tiles from :func:`tiles` and their grids from the
functions below, and the static gate (``python -m moe_comm.testing.gate``) compiles exactly what
they
pick, so the two can never drift apart.

Each GPU choice is sized so that a thread holds at most 64 bytes of a row tile (``block_h``,
then ``block_t``, shrink for 4- and 8-byte elements; the combine send, one program per SM, 128)
and at least 16 bytes of the row data the kernel stores (a 16-byte store needs them:
``block_t`` grows for FP8 bytes where ``block_h`` is small). The schedules below declare, per
kernel, what the gate holds its grid and loops to.
``maxnreg`` caps registers at what the intended occupancy allows: left alone, ptxas picks a
lower target for 512-thread programs and spills.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

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
# the others 8; the rest two programs per SM (4 or 8 warps).
_GPU = {
    "routing_layout": (16, 0, 4, 2),
    "checked_topk_idx": (16, 0, 4, 2),
    "ring_positions": (256, 0, 4, 2),  # one program per rank: its column, window by window
    "quantize": (4, 1024, 8, 2),
    # 16 tokens a tile: the persistent send waits for its tile's loads once per channel tile,
    # so the tile is what is in flight (32 KB of bf16 rows; at 8 tokens it moved 26% of the copy
    # ceiling at 20 SMs on an H200, docs/PERF.md)
    "dispatch_send": (16, 1024, 16, 1),
    # a send over NVSHMEM that quantizes (FP8 1) and lays out (round 0's, before the rounds'
    # one launch) holds its codes and scales beside the outbox, the peers' stores and the
    # layout: 64 bytes spilled at 128 registers under Triton 3.6 in tiles of 16 tokens, none
    # in tiles of 8
    "dispatch_send_nvshmem_quantizing": (8, 1024, 16, 1),
    # one program an SM: each choice's output rows held in registers across the channel loop
    # (kernels.dispatch.expand_rows) spilled 8 to 24 bytes at 128 registers in tiles of 8
    # slots; 16 slots a tile (32 KB of bf16 rows in flight) take 242-248, no spill
    "dispatch_expand": (16, 1024, 8, 1),
    # the hierarchical forwarders' passes over a node's rows (kernels.internode.forward_tiles):
    # the expand's tiles before it held its choices' rows
    "forward_dispatch": (8, 1024, 8, 2),
    # a dispatch's rounds after its first send as one launch (kernels.dispatch_rounds): the
    # send's and the expand's tiles with 8 warps, one program per SM
    "dispatch_rounds_send": (16, 1024, 8, 1),
    "dispatch_rounds_expand": (8, 1024, 8, 1),
    # a send there that quantizes to NVFP4 holds the caller's rows and their 16-channel groups:
    # 16 tokens a tile spilled (248 registers and 8 bytes of stack on sm_90), 8 do not
    "dispatch_rounds_send_nvfp4": (8, 1024, 8, 1),
    # and over NVSHMEM every send that quantizes: 16 tokens spilled 16 to 24 bytes at 248
    # registers under Triton 3.6, 8 still 56 to 88; 4 (NVFP4: 8, for 16-byte stores of its
    # packed codes) do not, under 3.6 and 3.9
    "dispatch_rounds_send_nvshmem_quantizing": (4, 1024, 8, 1),
    # and hierarchical through the proxy every send that quantizes (the window quantized
    # again for the node outboxes): 16 tokens spilled 120 to 160 bytes under Triton 3.9, 8 do
    # not (223 to 231 registers)
    "dispatch_rounds_send_hier_quantizing": (8, 1024, 8, 1),
    # persistent: 64 slots a tile (at most 32 trips of a program over the slots of uniform
    # routing at DeepSeek-V3 prefill sizes with 20 programs), several choices' gathers in
    # flight (combine.gathers_in_flight); one program per SM, so a 128-byte accumulator a
    # thread (_TILE_BYTES)
    "combine_send": (64, 1024, 8, 1),
    "combine_reduce": (8, 1024, 8, 2),
    # a combine in rounds as one launch (kernels.combine_rounds): its reduce runs on the send's
    # programs (one per SM, up to 248 registers), so a round's tokens in fat tiles of 64 fp32
    # sums a thread (128 spill beside what the send holds across the rounds)
    "combine_rounds_reduce": (16, 1024, 8, 1),
    # its send over NVSHMEM with values per row: 64 slots a tile spilled 8 bytes under Triton
    # 3.6, 32 (at 64 bytes of a row tile a thread) do not
    "combine_rounds_send_nvshmem_pair": (32, 1024, 8, 1),
    # hierarchical (with the forwarder's pass in the launch, kernels.internode.forward_round),
    # its reduce of this node's partials and the other nodes' sums in tiles of 8 tokens: 16
    # spilled 32 to 40 bytes at 248 registers under Triton 3.6
    "combine_rounds_reduce_hier": (8, 1024, 8, 1),
    # the EP-invariant combine (kernels.invariant): persistent over slot tiles, one row of a
    # (slot, choice) at a time; the reduce as the default one's
    "invariant_send": (64, 1024, 8, 1),
    "invariant_reduce": (8, 1024, 8, 2),
    # the EP-invariant combine in rounds as one launch (kernels.invariant_rounds): its reduce
    # on the send's programs in tiles of 32 fp32 sums a thread (64 spilled under Triton 3.6)
    "invariant_rounds_reduce": (8, 1024, 8, 1),
    # persistent (at most num_sms programs, one per SM: up to 255 registers for the tile's
    # pair counts and its quantized rows); NVFP4: 16-byte stores of packed codes need 32
    # values a thread
    "ll_dispatch_send": (4, 1024, 8, 1),
    "ll_dispatch_send_nvfp4": (4, 1024, 8, 1),
    # persistent over their (expert, source) blocks or token tiles, at most num_sms programs:
    # one per SM
    "ll_dispatch_recv": (8, 1024, 8, 1),
    "ll_combine_send": (8, 1024, 8, 1),
    "ll_combine_recv": (4, 1024, 8, 1),
    "wait_epochs": (1, 0, 4, 2),
    "received_layout": (1, 0, 4, 2),
}
_INTERPRETER_ROWS = {"ll_dispatch_recv": 16, "ll_combine_send": 16}
_TILE_BYTES = {"combine_send": 2 * TILE_BYTES_PER_THREAD,  # bytes of a row tile a thread holds
               "dispatch_expand": 2 * TILE_BYTES_PER_THREAD,
               "combine_rounds_reduce": 4 * TILE_BYTES_PER_THREAD,
               "combine_rounds_reduce_hier": 2 * TILE_BYTES_PER_THREAD,
               "invariant_rounds_reduce": 2 * TILE_BYTES_PER_THREAD}


@functools.cache
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
    budget = _TILE_BYTES.get(kernel, TILE_BYTES_PER_THREAD) * threads  # bytes of a row tile
    if cap:  # at most 64 bytes of a row tile per thread (fp32: 16 values; fp64 accumulates)
        cap = min(cap, max(GROUP, int(budget // (block_t * elem_bytes))))
    block_h = block_h_for(hidden, cap) if cap else 0
    if block_h:  # 16 bytes of row data per thread, for 16-byte stores; rows within the budget
        block_t = max(block_t, math.ceil(16 * threads / (block_h * elem_bytes)))
        fits = int(budget // (block_h * elem_bytes))  # rows of the budget: a power of two
        block_t = min(block_t, max(1, triton.next_power_of_2(fits + 1) // 2))
    maxnreg = min(128 if per_sm > 1 else 255, REGISTERS_PER_SM // (threads * per_sm)) // 8 * 8
    return Tiles(block_t, block_h, num_warps, maxnreg)


# The low-latency kernels move whole rows: a program holds the rows of its work (a tile of
# tokens, or of one (expert, source) block's rows) at every channel at once, padded to a power
# of two, so it loads them all before it stores any and walks no channel loop. The grids cover
# the work, not num_sms (the normal mode's budget: this mode overlaps nothing while it runs,
# its hooks free the SMs between send and receive). Per kernel on a GPU: (rows a program holds
# at most, bytes of rows it holds at most, warps, programs an SM holds at once).
_LL_GPU = {
    "ll_dispatch_send": (2, 32 * 1024, 8, 1),  # 64 programs at DeepSeek-V3 decode sizes
    # NVFP4: two rows spilled 8 to 56 bytes at 248 registers under Triton 3.6 (fault
    # tolerant, and through NVSHMEM or the proxy)
    "ll_dispatch_send_nvfp4": (1, 32 * 1024, 8, 1),
    "ll_dispatch_recv": (8, 64 * 1024, 8, 2),  # an (expert, source) block: 256 programs
    "ll_combine_send": (8, 64 * 1024, 8, 2),  # the same blocks
    # a combine that sends FP8 quantizes its rows in fp32: two of them spilled 16 bytes at
    # 128 registers, one 8 bytes through the proxy
    "ll_combine_send_fp8": (1, 32 * 1024, 8, 1),
    # a token's slots, every choice at once (bytes of one channel of a token: K rows' worth),
    # its row split in channel tiles where one program cannot hold them: 4096 channels of 8
    # bf16 choices at DeepSeek-V3 decode sizes, 2 x 128 programs
    "ll_combine_recv": (1, 64 * 1024, 8, 2),
    # FP8 slots: one group of 128 channels (one scale per row and choice) of 16 tokens, so no
    # reshape spreads the scales over their channels (under Triton 3.6 a reshape per choice
    # went through shared memory: 34 steps and a spill)
    "ll_combine_recv_fp8": (2, 64 * 1024, 1, 12),
}
_LL_INTERPRETER_ROWS = 64


@functools.cache
def ll_tiles(kernel: str, compiled: bool, hidden: int, elem_bytes: float,
             max_rows: int) -> Tiles:
    """Tiles of a low-latency kernel: ``block_h`` the whole row (the next power of two of
    ``hidden``; on a GPU halved until one row of ``elem_bytes`` per channel fits the kernel's
    budget), ``block_t`` rows as many as fit the budget (at least 1, at most ``max_rows``
    rounded up to a power of two); the interpreter takes 64 rows (its cost is per program and
    operation)."""
    block_h = triton.next_power_of_2(hidden)
    rows = triton.next_power_of_2(max(1, max_rows))
    if not compiled:
        return Tiles(min(_LL_INTERPRETER_ROWS, rows), block_h, 4)
    most, budget, num_warps, per_sm = _LL_GPU[kernel]
    if elem_bytes >= 8:  # fp64 rows: a channel takes two registers (spills at 128)
        per_sm = 1
    while block_h > GROUP and block_h * elem_bytes > budget:  # a row split into channel tiles
        block_h //= 2
    fits = max(1, int(budget // (block_h * elem_bytes)))
    block_t = min(most, rows, max(1, triton.next_power_of_2(fits + 1) // 2))
    maxnreg = min(255, REGISTERS_PER_SM // (32 * num_warps * per_sm)) // 8 * 8
    return Tiles(block_t, block_h, num_warps, maxnreg)


def persistent_programs(work_tiles: int, num_sms: int | None) -> int:
    """Programs of a persistent send grid: one per tile of work, at most ``num_sms``."""
    work_tiles = max(1, work_tiles)
    return min(work_tiles, num_sms) if num_sms else work_tiles


def per_source_programs(world_size: int, compiled: bool) -> int:
    """Programs per source rank of the grids ``(R, P)`` that walk every source's rows (their
    counts live on the device, so the grid is sized by the Buffer): the interpreter takes one
    program per source (each loops over its tiles); a GPU ``GPU_PROGRAMS`` in all, so that
    the grid covers the SMs whatever the counts (the padding of the output is shared by every
    program too)."""
    return 1 if not compiled else max(1, triton.cdiv(GPU_PROGRAMS, world_size))


# ------------------------------------------------------------------------------ schedules
# What the static gate (``moe_comm.testing.gate``) holds each kernel to, beside its tiles: its kind
# and the serial trips of its busiest program. A *trip* is one pass of a loop over rows,
# tokens, slots, chunks or (expert, source) blocks: the loops whose length grows with the
# work. Loops over the channels of a row, the choices of a token or the ranks a row goes to
# are the width of one trip, not trips. Where a loop's length is counted on the device
# (rows received, slots filled), the declaration takes it at uniform routing (every expert
# equally likely): the load a well-balanced model gives.
PERSISTENT = "persistent"  # a send, or a receive that waits: at most num_sms programs
WAVE = "wave"  # a row mover that waits for nothing: at least one wave of the GPU
CONTROL = "control"  # bookkeeping and waits: no rows, as many programs as it needs
WHOLE_GPU = "whole-gpu"  # the low-latency pair: a program per block of its work, up to every SM
WAVE_PROGRAMS = 132  # one wave: a program per SM of an H100 / H200
MAX_TRIPS = 32  # serial trips of a program at DeepSeek-V3 sizes, at most
ZERO_TILES = 4  # the expand's padding tiles: ZERO_TILES * BLOCK_T rows (stores of constants)


def uniform_slots(tokens: int, world_size: int, topk: int) -> float:
    """Tokens of one source sent to one rank at uniform routing: each goes there when one of
    its ``topk`` experts lives there."""
    return tokens * (1 - (1 - 1 / world_size) ** topk)


def _cdiv(a: float, b: float) -> int:
    return max(0, math.ceil(a / b))


def _layout_place_trips(a: dict) -> int:
    chunks = a["programs"]
    return (_cdiv(chunks - 1, a["BLOCK_CE"])  # the experts' prefix
            + _cdiv(a["R"], a["BLOCK_R"]) * _cdiv(chunks - 1, a["BLOCK_CR"])  # the ranks'
            + _cdiv(chunks, a["BLOCK_CR"]))  # the last program's bad-row scan


def _expand_slot_tiles(a: dict) -> int:
    """The tiles of one source's slots a program of an expand takes (grid (R, P))."""
    return _cdiv(uniform_slots(a["TMAX"], a["grid0"], a["K"]), a["BLOCK_T"] * a["grid1"])


def _expand_tail_tiles(a: dict) -> int:
    """Zero tiles of the output rows past the last group, per program."""
    rows = a["TMAX"] * a["K"]  # rows a rank receives at uniform routing (R sources x TMAX*K/R)
    return _cdiv(a["max_rows"] - rows, ZERO_TILES * a["BLOCK_T"] * a["grid0"] * a["grid1"])


def _expand_slot_row_tiles(a: dict) -> int:
    """Tiles of slot_rows past the last slot a program fills with -1 (not CACHED)."""
    slots = a["grid0"] * uniform_slots(a["TMAX"], a["grid0"], a["K"])
    return 0 if a["CACHED"] else _cdiv(a["SLOTS"] - slots, ZERO_TILES * a["BLOCK_T"]
                                       * a["grid0"] * a["grid1"])


def _expand_trips(a: dict) -> int:
    return (_expand_slot_tiles(a)  # the slots of one source
            + _cdiv(a["L"], a["grid0"] * a["grid1"])  # each expert's padding (one zero tile)
            + _expand_tail_tiles(a) + _expand_slot_row_tiles(a))


def _slot_rows(world_size: int, num_experts: int, topk: int) -> list:
    """P(a slot holds c rows), c = 0..topk, at uniform routing: a token's choices among one
    rank's ``num_experts / world_size`` experts, given it chose one there (hypergeometric)."""
    local = num_experts // world_size
    p = [math.comb(local, c) * math.comb(num_experts - local, topk - c)
         / math.comb(num_experts, topk) for c in range(topk + 1)]
    return [0.0] + [q / (1 - p[0]) for q in p[1:]]


def reaches_rank(world_size: int, num_experts: int, topk: int) -> float:
    """P(a token has a choice among one rank's experts) at uniform routing: the share of a
    send's per-destination row stores that store."""
    local = num_experts // world_size
    return 1 - math.comb(num_experts - local, topk) / math.comb(num_experts, topk)


def fuller_tiles(world_size: int, num_experts: int, topk: int, slots: int,
                 in_flight: int) -> float:
    """The share of a combine send's tiles of ``slots`` slots that hold a slot of more than
    ``in_flight`` rows at uniform routing."""
    return 1 - sum(_slot_rows(world_size, num_experts, topk)[:in_flight + 1]) ** slots


def further_rows(world_size: int, num_experts: int, topk: int, slots: int,
                 in_flight: int) -> float:
    """Expected rows past the first ``in_flight`` of the fullest of a tile's ``slots`` slots at
    uniform routing (the trips of a combine send's loop over them, one at a time)."""
    p = _slot_rows(world_size, num_experts, topk)
    return sum(1 - sum(p[:c]) ** slots for c in range(in_flight + 1, topk + 1))


def fullest_slot(world_size: int, num_experts: int, topk: int, slots: int) -> float:
    """Expected rows of the fullest of ``slots`` slots at uniform routing (the passes of the
    EP-invariant send over a tile's c-th rows): :func:`further_rows` past none."""
    return further_rows(world_size, num_experts, topk, slots, 0)


def slot_rows_mean(world_size: int, num_experts: int, topk: int) -> float:
    """Expected rows of a slot at uniform routing."""
    return sum(c * q for c, q in enumerate(_slot_rows(world_size, num_experts, topk)))


def live_choices(world_size: int, num_experts: int, topk: int, in_flight: int) -> float:
    """The share of a combine send's gathers of the first ``in_flight`` rows of its slots that
    load at uniform routing: a slot's rows, at most ``in_flight`` of them, over ``in_flight``."""
    p = _slot_rows(world_size, num_experts, topk)
    return sum(min(c, in_flight) * p[c] for c in range(topk + 1)) / in_flight


def _combine_send_trips(a: dict) -> int:
    return _cdiv(a["R"] * uniform_slots(a["TMAX"], a["R"], a["K"]), a["BLOCK_T"] * a["programs"])


def combine_round_trips(R: int, W: int, K: int, H: int, programs: int, send_block_t: int,
                        reduce_t: int, reduce_h: int, forwarded_nodes: int = 0) -> int:
    """Serial trips of one round of ``kernels.combine_rounds`` on ``programs`` programs: the
    send's tiles of the slots a rank holds (at uniform routing) and the reduce's (token,
    channel) tiles of the round's ``W`` tokens; hierarchical, the forwarder's tiles of the
    send's rows of ``forwarded_nodes`` other nodes' messages (at most ``W`` rows each).
    Counted per round: the rounds are the ring's passes, which launches per round also run one
    after another."""
    return (_cdiv(R * uniform_slots(W, R, K), send_block_t * programs)
            + _cdiv(_cdiv(W, reduce_t) * _cdiv(H, reduce_h), programs)
            + _cdiv(forwarded_nodes * _cdiv(W, send_block_t), programs))


def dispatch_round_trips(R: int, W: int, K: int, programs: int, send_block_t: int,
                         expand_block_t: int, forwarded_nodes: int = 0,
                         forward_block_t: int = 1) -> int:
    """Serial trips of one round of ``kernels.dispatch_rounds`` on ``programs`` programs: the
    send's token tiles of the round's ``W`` tokens, and the expand's tiles of every source's
    slots, all sources' dealt round-robin: at uniform routing ``R * u`` slots in all, in at
    most ``R * u / tile`` full tiles and a partial one per source that sent any (at most
    ``min(R, R * u)`` of them); hierarchical, the outbox's token tiles of the ``W`` tokens
    again and the forwarder's row tiles of ``forwarded_nodes`` other nodes' messages (at most
    ``W`` rows each, the tiles of all of them dealt over the programs together)."""
    slots = R * uniform_slots(W, R, K)
    return ((1 + bool(forwarded_nodes)) * _cdiv(W, send_block_t * programs)
            + _cdiv(slots / expand_block_t + min(R, slots), programs)
            + _cdiv(forwarded_nodes * _cdiv(W, forward_block_t), programs))


def _round_send_tiles(a: dict) -> int:
    """Slot tiles of one round's send a program of a launch of a call's rounds takes."""
    return _cdiv(a["R"] * uniform_slots(a["W"], a["R"], a["K"]), a["BLOCK_T"] * a["programs"])


def _invariant_send_trips(a: dict) -> int:
    """Slot tiles a program takes (each stores its slots' rows choice by choice)."""
    return _cdiv(a["R"] * uniform_slots(a["W"], a["R"], a["K"]), a["BLOCK_T"] * a["programs"])


def _combine_live(a: dict) -> float:
    return live_choices(a["R"], a["ROUTED_EXPERTS"], a["K"], a["IN_FLIGHT"])


def _combine_fuller(a: dict) -> float:
    return fuller_tiles(a["R"], a["ROUTED_EXPERTS"], a["K"], a["BLOCK_T"], a["IN_FLIGHT"])


def _combine_further_rows(a: dict) -> float:
    """A combine send's loop over a tile's further rows (where it is not pipelined)."""
    return further_rows(a["R"], a["ROUTED_EXPERTS"], a["K"], a["BLOCK_T"], a["IN_FLIGHT"])


def _invariant_passes(a: dict) -> float:
    """The EP-invariant send's passes over a tile: its fullest slot's rows, or (with fault
    tolerance in rounds) one per choice (kernels.invariant.send_pairs, COMPACT)."""
    if a.get("FT"):
        return a["K"]
    return fullest_slot(a["R"], a["ROUTED_EXPERTS"], a["K"], a["BLOCK_T"])


def _invariant_live(a: dict) -> float:
    """The share of its passes' gathers that load: a slot's rows over the passes."""
    return slot_rows_mean(a["R"], a["ROUTED_EXPERTS"], a["K"]) / _invariant_passes(a)


def ll_block_rows(a: dict) -> float:
    """Rows of one (expert, source) block of the low-latency mode at uniform routing: a source's
    ``tokens * topk`` pairs spread over its ``L * R`` experts (the gate's config gives the
    routing: ``ROUTED_TOKENS``, ``ROUTED_TOPK``)."""
    return a["ROUTED_TOKENS"] * a["ROUTED_TOPK"] / (a["L"] * a["R"])


@dataclass(frozen=True)
class Schedule:
    kind: str  # PERSISTENT, WAVE, CONTROL or WHOLE_GPU
    trips: object  # launch arguments (scalars, constexprs, grid0..2, programs) -> serial trips
    gpu: bool = True  # runs on GPUs today (the proxy's kernels run on CPU ranks only so far)
    decode: bool = False  # a low-latency kernel: held to the rules at decode sizes only
    # the trips at uniform routing of the loops whose bounds the device counts (rows received,
    # slots filled), by loop variable: what kernels.critical_path cannot read off the bounds
    loops: dict = field(default_factory=dict)
    blocks: object = None  # WHOLE_GPU: launch arguments -> the blocks of work a launch has
    # launch arguments -> the share of a ``# gate: live`` gather's lanes that load at uniform
    # routing (kernels.critical_path.LIVE), and how often an ``if`` marked ``# gate: rare`` is
    # taken there (kernels.critical_path.RARE)
    live: object = None
    rare: object = None


def _per_token_tiles(a: dict) -> int:
    return _cdiv(a["T"], a["BLOCK_T"] * a["programs"])


def _send_live(a: dict) -> float:
    """The share of the send's per-destination row stores that store (``# gate: row live``)."""
    return reaches_rank(a["R"], a["ROUTED_EXPERTS"], a["K"])


def _expand_live(a: dict) -> float:
    """The share of the expand's per-choice row stores that store (``# gate: row live``): a
    received token's choices on this rank over the ``BLOCK_K`` columns (grid (R, P))."""
    return slot_rows_mean(a["grid0"], a["ROUTED_EXPERTS"], a["K"]) / a["BLOCK_K"]


SCHEDULES = {
    "layout_count_kernel": Schedule(CONTROL, lambda a: 1),
    "layout_place_kernel": Schedule(CONTROL, _layout_place_trips),
    "checked_topk_idx_kernel": Schedule(CONTROL, lambda a: _cdiv(a["T"], a["BLOCK_T"])),
    "ring_positions_kernel": Schedule(CONTROL, lambda a: a["ROUNDS"] * _cdiv(a["W"],
                                                                             a["BLOCK_T"])),
    "received_layout_kernel": Schedule(CONTROL, lambda a: 1),
    "wait_epochs_kernel": Schedule(CONTROL, lambda a: 1),
    "wait_relayed_epochs_kernel": Schedule(CONTROL, lambda a: 1),
    "ft_wait_epochs_kernel": Schedule(CONTROL, lambda a: 1),
    "set_word_on_all_kernel": Schedule(CONTROL, lambda a: 1),
    "quantize_kernel": Schedule(WAVE, lambda a: 1),
    "dispatch_send_kernel": Schedule(PERSISTENT, _per_token_tiles, live=_send_live),
    "dispatch_expand_kernel": Schedule(WAVE, _expand_trips, loops={
        "j0": _expand_slot_tiles, "pad0": lambda a: 1, "tail0": _expand_tail_tiles,
        "slot0": _expand_slot_row_tiles}, live=_expand_live),
    "combine_send_kernel": Schedule(PERSISTENT, _combine_send_trips, loops={
        "w": _combine_send_trips, "c": _combine_further_rows},
        live=_combine_live, rare=_combine_fuller),
    "combine_reduce_kernel": Schedule(WAVE, lambda a: 1),
    "dispatch_rounds_kernel": Schedule(PERSISTENT, lambda a: dispatch_round_trips(
        a["R"], a["W"], a["K"], a["programs"], a["BLOCK_T"], a["EXPAND_T"],
        a["HIER"] and a["R"] // a["N"] - 1, a["FWD_T"]), loops={
        # a round's expand: every source's tiles of its slots dealt over the programs, one
        # tile a call of the expand's body; the padding before the rounds
        "w": lambda a: _cdiv(a["R"] * uniform_slots(a["W"], a["R"], a["K"]) / a["EXPAND_T"]
                             + min(a["R"], a["R"] * uniform_slots(a["W"], a["R"], a["K"])),
                             a["programs"]),
        "j0": lambda a: 1, "pad0": lambda a: 1,
        "tail0": lambda a: _cdiv(a["max_rows"] - a["T"] * a["K"], a["BLOCK_Z"] * a["programs"]),
        "slot0": lambda a: 0 if a["CACHED"] else _cdiv(
            a["SLOTS"] - a["R"] * uniform_slots(a["T"], a["R"], a["K"]),
            a["BLOCK_Z"] * a["programs"])}),
    "combine_rounds_kernel": Schedule(PERSISTENT, lambda a: combine_round_trips(
        a["R"], a["W"], a["K"], a["H"], a["programs"], a["BLOCK_T"], a["REDUCE_T"],
        a["REDUCE_H"], a["HIER"] and a["R"] // a["N"] - 1), loops={  # a round's send
        "w": _round_send_tiles, "c": _combine_further_rows},
        live=_combine_live, rare=_combine_fuller),
    "invariant_rounds_kernel": Schedule(PERSISTENT, lambda a: combine_round_trips(
        a["R"], a["W"], a["K"], a["H"], a["programs"], a["BLOCK_T"], a["REDUCE_T"],
        a["REDUCE_H"]), loops={"w": _round_send_tiles, "c": _invariant_passes},
        live=_invariant_live),
    "invariant_send_kernel": Schedule(PERSISTENT, _invariant_send_trips,
                                      loops={"w": _invariant_send_trips, "c": _invariant_passes},
                                      live=_invariant_live),
    "invariant_reduce_kernel": Schedule(WAVE, lambda a: 1),
    # the low-latency pair: a program per tile of tokens or per (expert, source) block, whole
    # rows (one pass of a block's rows at uniform routing); the send's earlier passes of
    # BLOCK_P tokens (none at decode sizes)
    "ll_dispatch_send_kernel": Schedule(
        WHOLE_GPU, lambda a: _cdiv(a["T"], a["BLOCK_P"]), decode=True,
        blocks=lambda a: _cdiv(a["TMAX"], a["BLOCK_T"])),
    "ll_dispatch_recv_kernel": Schedule(
        WHOLE_GPU, lambda a: _cdiv(ll_block_rows(a), a["BLOCK_T"]), decode=True,
        loops={"j0": lambda a: _cdiv(ll_block_rows(a), a["BLOCK_T"])},
        blocks=lambda a: a["L"] * a["R"]),
    "ll_combine_send_kernel": Schedule(
        WHOLE_GPU, lambda a: _cdiv(ll_block_rows(a), a["BLOCK_T"]), decode=True,
        loops={"j0": lambda a: _cdiv(ll_block_rows(a), a["BLOCK_T"])},
        blocks=lambda a: a["L"] * a["R"]),
    "ll_combine_recv_kernel": Schedule(
        WHOLE_GPU, lambda a: 1, decode=True,
        blocks=lambda a: _cdiv(a["TMAX"], a["BLOCK_T"]) * _cdiv(a["H"], a["BLOCK_H"])),
    # through the proxy (CPU ranks so far: its GPU half is not built)
    "outbox_dispatch_kernel": Schedule(PERSISTENT, _per_token_tiles, gpu=False),
    "forward_dispatch_kernel": Schedule(PERSISTENT, lambda a: _cdiv(
        a["TMAX"], a["BLOCK_T"] * a["grid1"]), gpu=False),
    "forward_combine_kernel": Schedule(PERSISTENT, lambda a: _cdiv(
        a["TMAX"], a["BLOCK_T"] * a["grid1"]), gpu=False),
}


def schedule_facts(name: str, grid: tuple, args: dict) -> tuple[str, int, int]:
    """``(kind, programs, serial trips)`` of a launch of kernel ``name`` with ``grid`` and
    arguments ``args`` (scalars and constexprs by name)."""
    if name not in SCHEDULES:
        raise KeyError(f"kernel {name!r} declares no schedule in kernels/tiles.py")
    programs = 1
    for g in grid:
        programs *= g
    a = dict(args, programs=programs, grid0=grid[0], grid1=grid[1], grid2=grid[2])
    return SCHEDULES[name].kind, programs, int(SCHEDULES[name].trips(a))


def schedule_blocks(name: str, grid: tuple, args: dict) -> int:
    """The blocks of work of a WHOLE_GPU launch (0 for the other kinds)."""
    blocks = SCHEDULES[name].blocks
    return int(blocks(dict(args, grid0=grid[0], grid1=grid[1], grid2=grid[2]))) if blocks else 0


def schedule_problems(name: str, kind: str, programs: int, trips: int,
                      num_sms: int, blocks: int = 0) -> list[str]:
    """The gate's grid and serial-trip rules for one launch at DeepSeek-V3 sizes."""
    problems = []
    if kind == WHOLE_GPU and programs < min(blocks, WAVE_PROGRAMS):
        problems.append(f"{programs} programs for {blocks} blocks of work (a low-latency "
                        f"kernel takes at least min(blocks, {WAVE_PROGRAMS} SMs))")
    if trips > MAX_TRIPS:
        problems.append(f"a program runs {trips} serial trips (at most {MAX_TRIPS})")
    if kind == PERSISTENT and programs > num_sms:
        problems.append(f"{programs} programs for a kernel that waits or may overlap compute "
                        f"(at most num_sms = {num_sms})")
    if kind == WAVE and programs < WAVE_PROGRAMS:
        problems.append(f"{programs} programs for a row-moving grid (fills less than one "
                        f"wave of {WAVE_PROGRAMS} SMs)")
    return problems
