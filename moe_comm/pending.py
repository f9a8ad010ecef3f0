"""What a normal-mode send phase leaves for its receive phase (``PendingSend``), what the
rounds of a dispatch send take from its call (``Stream``), and the scales output of an FP8
receive (``fp8_scales_out``): the types the phases of ``moe_comm.normal_mode`` share."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .kernels.quant import MXFP8


@dataclass
class PendingSend:
    """What a send phase leaves for its receive phase."""

    channel: int
    epoch: int
    slot_of: torch.Tensor | None = None  # [T, R] int32 (dispatch)
    topk: int = 0
    has_weights: bool = False
    fp8: int = 0  # 0 rows as they are, 1 quantized by the send, 2 sent quantized
    ue8m0: int = 0  # 1 power-of-two scales as exponent bytes per 128, 2 MXFP8, 3 NVFP4
    node_slot_of: torch.Tensor | None = None  # [T, M] int32 (hierarchical): row per node
    # fault tolerance (``moe_comm.fault``): which sources' epochs arrived ([R] int32; None:
    # all, or a dispatch whose received layout waited itself)
    live: torch.Tensor | None = None
    # a Buffer of several rounds: ``send_round(i)`` sends round i (round 0 is sent)
    send_round: Callable[[int], None] | None = None
    # a dispatch of several rounds (not cached): what its rounds send
    stream: Stream | None = None
    # a combine whose rounds run in one launch (kernels.combine_rounds, kernels.invariant_rounds),
    # nothing sent yet: ``all_rounds(ring, out, pair_out, topk_idx, node_slot_of)`` launches it
    # (the dispatch's ``topk_idx``, which the EP-invariant combine reads, and node rows, which a
    # hierarchical combine's node sums are found by); a cached dispatch likewise
    # (kernels.dispatch_rounds): ``all_rounds(slot_rows, slot_offsets, tokens_per_expert,
    # expert_offsets, out)``
    all_rounds: Callable | None = None
    # a dispatch whose rounds after the first run in one launch: the received layout its
    # round 0's send wrote, ``(row_base, tokens_per_expert, expert_offsets, every round's
    # slot_offsets, expert_alignment)`` (``_received_layout``'s, round 0's slot offsets first)
    received: tuple | None = None


@dataclass
class Stream:
    """What the rounds of a dispatch send take from its call: the per-token tensors (each
    round sends the window ``[i * W, (i + 1) * W)`` of them), ``ring`` [T, R] int32 (the slot
    of token t on rank d, less the slots of d's earlier rounds: its position in d's ring; -1
    where t does not go), the counts each round publishes ([R, L + 1] int32; several
    rounds: [rounds, R, L + 1], the call's per-expert counts and the round's own rows) and, in
    hierarchical mode, ``node_ring`` [T, M] int32 (the row of token t in node b's message of
    its round, -1 where none) with ``node_counts`` [rounds, M] int32 (the rows of each
    round's message to node b; None where ``node_ring`` came from a handle)."""

    x: torch.Tensor
    x_scales: torch.Tensor | None
    topk_idx: torch.Tensor | None
    topk_weights: torch.Tensor | None
    pair_pos: torch.Tensor | None
    ring: torch.Tensor
    counts: torch.Tensor | None
    node_ring: torch.Tensor | None = None
    topk: int = 1
    fp8: int = 0
    ue8m0: int = 0
    node_counts: torch.Tensor | None = None


def fp8_scales_out(rows: int, groups: int, ue8m0: int, col_major: bool, device,
                   alloc=torch.zeros):
    """Scales output from ``alloc`` (``torch.empty`` where the expand writes every row, the
    spare bytes of packed words too): ``(public tensor [rows, G or ceil(G/4)], contiguous
    memory, (row stride, group stride))``; column-major means the rows index is the fast one.
    MXFP8 (``ue8m0 == 2``): E8M0 bytes [rows, G] (float8_e8m0fnu), NVFP4 (3): e4m3 bytes
    [rows, G] (float8_e4m3fn), row-major, written as the bytes of int32 words (byte g % 4 of
    word g // 4 is byte g of the row)."""
    width = (groups + 3) // 4 if ue8m0 else groups
    dtype = torch.int32 if ue8m0 else torch.float32
    if col_major and ue8m0 < MXFP8:
        memory = alloc((width, rows), dtype=dtype, device=device)
        return memory.t(), memory, (1, rows)
    memory = alloc((rows, width), dtype=dtype, device=device)
    if ue8m0 >= MXFP8:
        byte_dtype = torch.float8_e8m0fnu if ue8m0 == MXFP8 else torch.float8_e4m3fn
        public = memory.view(torch.uint8)[:, :groups].view(byte_dtype)
        return public, memory, (width, 1)
    return memory, memory, (width, 1)
