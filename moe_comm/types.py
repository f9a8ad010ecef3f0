"""What dispatch returns: the received rows and the handle that combine needs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True, eq=False)
class DispatchHandle:
    """Where every token went and where every received row came from; owned by the caller.

    Home side (the rank that sent the tokens):
      ``slot_of`` [T, R] int32: slot of token t in rank d's staging, -1 if t did not go to d
      (with bounded staging, its position in d's ring in its round ``t // ring_slots``).
    Expert side (the rank that received the rows):
      ``slot_rows`` [R * T_max, K] int32: output row of each received (slot, top-k choice), -1
      if the choice is not on this rank (rows past the last slot are unused);
      ``recv_slot_offsets`` [R + 1] int64: first slot of each source;
      ``tokens_per_expert`` [L], ``expert_offsets`` [L + 1] int64: the output's groups.
    Hierarchical mode (empty int32 tensors otherwise):
      ``node_slot_of`` [T, M] int32 (home side): row of token t in node b's message (of its
      round), -1 if none; ``fwd_slots`` [rounds * M, W, N] int32, ``fwd_n`` [rounds * S] int32
      (``S``: M rounded up to 4; forwarder side): for the rows this rank forwarded from node a in
      round i (at ``i * M + a`` and ``i * S + a``), the slot each took on each rank of this node,
      and how many.
    ``buffer_id`` and ``serial`` tie the handle to the Buffer call that made it.
    Fault-tolerant Buffers keep the dispatch's ``topk_idx`` and ``topk_weights`` (home side) for
    ``combine(..., renormalize=True)``; EP-invariant Buffers keep ``topk_idx`` (home side: the
    order of the sum) and ``src_token`` [rows] int64 (expert side: where each row goes home).
    """

    buffer_id: str
    serial: int
    slot_of: torch.Tensor
    slot_rows: torch.Tensor
    recv_slot_offsets: torch.Tensor
    num_rows: int
    topk: int
    tokens_per_expert: torch.Tensor
    expert_offsets: torch.Tensor
    node_slot_of: torch.Tensor | None = None
    fwd_slots: torch.Tensor | None = None
    fwd_n: torch.Tensor | None = None
    topk_idx: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    src_token: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.slot_of.shape[0]

    def node_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(node_slot_of, fwd_slots, fwd_n), empty int32 tensors where unset."""
        node_slot_of, fwd_slots, fwd_n = self.node_slot_of, self.fwd_slots, self.fwd_n
        if node_slot_of is None or fwd_slots is None or fwd_n is None:  # (no generator: per op)
            empty = self.slot_of.new_empty((0,))
            node_slot_of = empty if node_slot_of is None else node_slot_of
            fwd_slots = empty if fwd_slots is None else fwd_slots
            fwd_n = empty if fwd_n is None else fwd_n
        return node_slot_of, fwd_slots, fwd_n


@dataclass(frozen=True, eq=False)
class DispatchResult:
    """Rows received by this rank, grouped by local expert (see ``Buffer.dispatch``).

    ``x`` [rows, H] (float8_e4m3fn after an FP8 dispatch; NVFP4: [rows, H/2] uint8, two
    e2m1 codes per byte); ``x_scales``: its scales (see ``Buffer.dispatch``) or None;
    ``x_global_scale``: NVFP4's float32 global scale of each row [rows] (0 in padding), else
    None; ``weights`` [rows] float32 or None;
    ``src_rank``, ``src_token`` [rows] int64 (-1 in padding); ``tokens_per_expert`` [L] int64
    without padding; ``expert_offsets`` [L + 1] int64, start of each padded group, last = the
    rows received (= rows, unless ``max_recv_rows`` sized the output: the rows past it are zero
    padding).
    """

    x: torch.Tensor
    x_scales: torch.Tensor | None
    weights: torch.Tensor | None
    src_rank: torch.Tensor
    src_token: torch.Tensor
    tokens_per_expert: torch.Tensor
    expert_offsets: torch.Tensor
    handle: DispatchHandle
    x_global_scale: torch.Tensor | None = None


class DispatchOutputs(NamedTuple):
    """The tensors of ``moe_comm::dispatch``, in the op's order (written here only: the op,
    its fake, its autograd and ``wrap_dispatch_outputs`` name them). Unused ones are empty:
    ``scales`` without a quantized format, ``weights`` without weights, ``global_scale``
    unless NVFP4, the three node tensors unless hierarchical. ``x`` .. ``expert_offsets`` as
    in :class:`DispatchResult`; ``slot_of`` .. ``fwd_n`` as in :class:`DispatchHandle`."""

    x: torch.Tensor
    scales: torch.Tensor
    weights: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    tokens_per_expert: torch.Tensor
    expert_offsets: torch.Tensor
    slot_of: torch.Tensor
    slot_rows: torch.Tensor
    slot_offsets: torch.Tensor
    node_slot_of: torch.Tensor
    fwd_slots: torch.Tensor
    fwd_n: torch.Tensor
    global_scale: torch.Tensor
