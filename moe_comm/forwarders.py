"""Across nodes through the proxy: the outboxes a dispatch fills for other nodes, and in
hierarchical mode the forwarders (this node's rank with a source's local index relays its
rows to the node's ranks, and sums a node's partials before they cross). Semantics:
``moe_comm.normal_mode``."""
from __future__ import annotations

import torch

from .kernels import combine_rounds as combine_rounds_kernels
from .kernels import internode
from .kernels.rows import sent_elem_bytes
from .workspace import COMBINE, DISPATCH


class Forwarders:
    """Part of :class:`moe_comm.normal_mode.NormalEngine`, whose state, waits and shared
    helpers it uses (one class in four files, as ``kernels/`` splits its kernels): the outboxes
    for other nodes and the hierarchical forwarders."""

    def _send_other_nodes(self, x, x_scales, topk_idx, topk_weights, pair_pos, slot_of, counts,
                          fp8: int = 0, ue8m0: int = 0, node_slot_of=None, t_base: int = 0,
                          node_counts=None) -> torch.Tensor:
        """Through the proxy, hierarchical: rows for other nodes into the outboxes, one
        descriptor per node (``kernels.internode``; rounds: ``x`` and the per-token tensors are
        the window of tokens ``t_base + [0, len(x))``, ``slot_of`` their ring positions; flat,
        the send did this itself, ``Flavour.proxy_box``). Returns ``node_slot_of`` [T,
        M] int32 (the row of each token in each node's message, -1 where none; computed here
        unless given, with ``node_counts`` [M] its rows per node where known), else an empty
        tensor. No host read."""
        if not self.hierarchical:
            return self._no_node_tensors[0]
        T, R, N, M = slot_of.shape[0], self.world_size, self.ranks_per_node, self.num_nodes
        target_counts = node_counts
        if node_slot_of is None:
            hit = (slot_of.view(T, M, N) >= 0).any(-1)
            seen = hit.cumsum(0, dtype=torch.int32)  # its last row: the rows per node
            node_slot_of = torch.where(hit, seen - 1, -1)
            target_counts = seen[-1] if T else None
        if target_counts is None:
            target_counts = (node_slot_of >= 0).sum(0, dtype=torch.int32)
        grid = internode.outbox_grid(self.layout.ring_slots, self.hidden, self.num_sms,
                                     self.flavour,
                                     sent_elem_bytes(fp8, ue8m0, x.element_size()))
        self.launches["dispatch_outbox"] += internode.outbox_dispatch(
            x, None if x_scales is None else x_scales.contiguous(), topk_idx, topk_weights,
            pair_pos, slot_of, node_slot_of, counts, target_counts, self._plan, self._xstats,
            self.channels.tickets[internode.OUTBOX_TICKET:internode.OUTBOX_TICKET + 1],
            self.channels.words[DISPATCH][1], rank=self.rank, world_size=R,
            num_local_experts=self.num_local_experts, meta_stride=self.layout.meta_stride,
            node_meta_stride=self.layout.node_meta_stride, max_topk=self.max_topk, grid=grid,
            topk=1 if topk_idx is None else topk_idx.shape[1], row_bytes=self._row_bytes,
            fp8=fp8, ue8m0=ue8m0, flavour=self.flavour, t_base=t_base)
        return node_slot_of

    def forward_slot_shapes(self) -> tuple[tuple[int, int, int], tuple[int]]:
        """Hierarchical: the shapes of :meth:`_forward_slots`, ``([rounds * M, W, N],
        [rounds * S])`` with ``S`` = ``M`` rounded up to a multiple of 4, so that every round's
        ``fwd_n`` starts 16-byte aligned (the forwarders' kernels specialise once)."""
        n, M = self.layout.rounds, self.num_nodes
        return (n * M, self.layout.ring_slots, self.ranks_per_node), (n * -(-M // 4) * 4,)

    def _forward_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Hierarchical: ``(fwd_slots, fwd_n)`` int32 (:meth:`forward_slot_shapes`) for a
        dispatch to fill, round ``i``'s at rows ``[i * M, (i + 1) * M)`` and
        ``[i * S, i * S + M)`` (:meth:`_round_nodes`)."""
        slots, counts = self.forward_slot_shapes()
        return (torch.full(slots, -1, dtype=torch.int32, device=self.device),
                torch.zeros(counts, dtype=torch.int32, device=self.device))

    def _round_nodes(self, fwd_slots, fwd_n, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Round ``i``'s ``([M, W, N], [M])`` of a dispatch's ``fwd_slots`` and ``fwd_n``."""
        M = self.num_nodes
        S = fwd_n.numel() // self.layout.rounds
        return fwd_slots[i * M:(i + 1) * M], fwd_n[i * S:i * S + M]

    def _forward_dispatch(self, epoch: int, payload: int, fwd_slots, fwd_n, cached: bool):
        """Hierarchical: waits for every other node's message of ``epoch`` to this rank
        (bounded, naming the source), then stores its rows into this node's staging and
        publishes the sources' epochs there. ``fwd_slots`` / ``fwd_n`` (``[M, W, N]``, ``[M]``
        int32, a round's of :meth:`_forward_slots`): written with the slot each row took on each
        rank of this node, or with ``cached`` read (rows only, placed as that dispatch placed
        them)."""
        N, M = self.ranks_per_node, self.num_nodes
        self._wait_relayed(self.channels.region("node_signals")[0], epoch,
                           [a * N + self.rank % N for a in range(M)], DISPATCH)
        self.launches["dispatch_forward"] += internode.forward_dispatch(
            self._plan, self.heap.peer_ptrs, fwd_slots, fwd_n, self._xstats,
            self.channels.tickets[internode.FORWARD_DISPATCH_TICKET:
                                  internode.FORWARD_DISPATCH_TICKET + 1],
            self.channels.words[DISPATCH][1], rank=self.rank,
            num_local_experts=self.num_local_experts, max_tokens=self.layout.ring_slots,
            row_bytes=self._row_bytes, payload=payload, meta_stride=self.layout.meta_stride,
            node_meta_stride=self.layout.node_meta_stride, cached=cached, num_sms=self.num_sms,
            flavour=self.flavour)

    def _forward_combine(self, epoch: int, fwd_slots, fwd_n, topk: int, has_pair: bool,
                         fp8: bool = False) -> None:
        """Hierarchical: waits for this node's partials for other nodes' tokens, sums them per
        node row and sends one row per token home (``kernels.internode``; ``fp8``: as FP8)."""
        N = self.ranks_per_node
        node = self.rank // N
        self._wait_relayed(self.channels.region("hc_signals"), epoch,
                           [node * N + j for j in range(N)], COMBINE)
        view = self.channels.region
        self.launches["combine_forward"] += internode.forward_combine(
            view("hc_rows"), view("hc_meta"), view("px_combine_rows"), view("px_combine_meta"),
            fwd_slots, fwd_n, self._plan, self._xstats,
            self.channels.tickets[internode.FORWARD_COMBINE_TICKET:
                                  internode.FORWARD_COMBINE_TICKET + 1],
            self.channels.words[COMBINE][1], rank=self.rank, world_size=self.world_size,
            topk=topk, max_topk=self.max_topk, has_pair=has_pair, num_sms=self.num_sms,
            flavour=self.flavour, fp8=fp8)

    def _forwarder_tensors(self, node_slot_of, fwd_slots, fwd_n) -> tuple:
        """Hierarchical: ``kernels.combine_rounds``' ``node`` (the hcomb, hc and combine
        outbox regions, the dispatch's node rows, ``fwd_slots`` and ``fwd_n``, the forwarder
        pass's ticket word)."""
        fixed = self._offsets.get(("forwarder", COMBINE))
        if fixed is None:  # made once: the bound launch is found by these tensors' ids
            view, ticket = self.channels.region, combine_rounds_kernels.FORWARD_TICKET
            fixed = self._offsets[("forwarder", COMBINE)] = (
                view("hcomb_rows"), view("hcomb_meta"), view("hc_rows"), view("hc_meta"),
                view("px_combine_rows"), view("px_combine_meta"),
                self.channels.tickets[ticket:ticket + 1])
        node_rows, node_meta, hc_rows, hc_meta, box_rows, box_meta, tickets = fixed
        return (node_rows, node_meta, node_slot_of, hc_rows, hc_meta, box_rows, box_meta,
                fwd_slots, fwd_n, tickets)
