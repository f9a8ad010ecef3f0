"""The dispatch phases of the normal mode: the send (routing layout, rows into every
destination's staging or ring, each round of a call of several), the receive (the wait, the
received layout, the expand, or every later round in one launch) and the cached dispatch
(combine's backward). Semantics: ``moe_comm.normal_mode``."""
from __future__ import annotations

import dataclasses
import functools

import torch

from ._guard import poisons_buffer_on_error, run_steps
from .call_descriptor import dispatch_descriptor
from .host_sync import read_int
from .kernels import dispatch as dispatch_kernels
from .kernels import dispatch_rounds as dispatch_rounds_kernels
from .kernels.layout import ring_positions, routing_layout
from .kernels.quant import MXFP8, NVFP4, scale_group
from .kernels.rows import payload_bytes, sent_elem_bytes
from .pending import PendingSend, Stream, fp8_scales_out
from .types import DispatchOutputs
from .workspace import DISPATCH


class DispatchPhases:
    """Part of :class:`moe_comm.normal_mode.NormalEngine`, whose state, waits and shared
    helpers it uses (one class in four files, as ``kernels/`` splits its kernels): the dispatch
    phases, the cached dispatch and a dispatch's rounds."""

    @poisons_buffer_on_error("dispatch")
    def dispatch_send(self, x, topk_idx, topk_weights, x_scales=None, fp8: int = 0,
                      ue8m0: int = 0, expert_alignment: int | None = None,
                      refusal: int = 0) -> PendingSend:
        """Send phase of dispatch: layout + put rows and metadata (``fp8`` as in PendingSend).
        Bad rows of ``topk_idx`` are sent nowhere and recorded (raised after the call).
        ``expert_alignment`` (the receive's, given where the receive follows at once): a
        dispatch whose later rounds run in one launch has its round 0's send wait for every
        source and lay them out (``kernels.dispatch.dispatch_send``, ``lay_out``): a launch
        less. The counts carry the call's descriptor (``moe_comm.call_descriptor``), or
        ``refusal`` (a refused call's: no rows)."""
        epoch = self._start(DISPATCH, checked=True)
        x = x.contiguous()
        topk_idx = topk_idx.contiguous()  # (the layout drops the choices of excluded ranks)
        topk_weights = None if topk_weights is None else topk_weights.contiguous()
        slot_of, pair_pos, counts = routing_layout(topk_idx, self.world_size,
                                                   self.num_local_experts, self.flavour,
                                                   self.rank, self._layout_scratch,
                                                   self._bound, refusal or dispatch_descriptor(
                                                       fp8, ue8m0, topk_weights is not None,
                                                       topk_idx.shape[1]))
        self.launches["layout"] += 2
        if x_scales is not None:
            x_scales = x_scales.contiguous()
        K, later, positions, stream, received = topk_idx.shape[1], None, slot_of, None, None
        if self.layout.rounds == 1:
            self._send_window(x, x_scales, topk_idx, topk_weights, pair_pos, slot_of, counts, K,
                              fp8, ue8m0)
            node_slot_of = self._no_node_tensors[0]  # (flat: the send did it)
            if self.hierarchical:
                node_slot_of = self._send_other_nodes(x, x_scales, topk_idx, topk_weights,
                                                      pair_pos, slot_of, counts, fp8, ue8m0)
        else:  # (across nodes each round sends its window's outboxes)
            stream = self._stream(x, x_scales, topk_idx, topk_weights, pair_pos, slot_of, counts,
                                  K, fp8, ue8m0)
            later = functools.partial(self._send_round, stream)
            if expert_alignment is not None and not self.hierarchical and \
                    self.plan.dispatch_in_one_launch[fp8, ue8m0, x.element_size()]:
                received = (*dispatch_kernels.received_layout_outputs(
                    self.world_size, self.num_local_experts, self.device,
                    torch.empty(self.slot_offsets_size, dtype=torch.int64,
                                device=self.device), self._row_base), expert_alignment)
            later(0, received)
            node_slot_of = (self._no_node_tensors[0] if stream.node_ring is None
                            else stream.node_ring)
            positions = stream.ring  # the handle's slot_of: the combine reads the rings by it
        return PendingSend(DISPATCH, epoch, positions, K, topk_weights is not None, fp8, ue8m0,
                           node_slot_of, send_round=later, stream=stream, received=received)

    def _stream(self, x, x_scales, topk_idx, topk_weights, pair_pos, slot_of, counts,
                topk: int, fp8: int = 0, ue8m0: int = 0, ring=None, node_ring=None) -> Stream:
        """Several rounds: the :class:`Stream` of a dispatch send (``_send_round`` sends its
        round i). The cached dispatch passes a handle's ring positions as ``ring`` (then
        ``slot_of`` is unused) and, hierarchical, its node rows as ``node_ring``."""
        node_counts = None
        if ring is None:  # every round: the call's per-expert counts, its own rows (and,
            n, (R, C) = self.layout.rounds, counts.shape  # hierarchical, its node rows)
            ring, words, *nodes = ring_positions(
                slot_of, counts, self.layout.ring_slots, n, self.flavour, self._bound,
                ranks_per_node=self.ranks_per_node if self.hierarchical else None)
            self.launches["ring_positions"] += 1
            counts = words[:, :R * C].view(n, R, C)  # each round's counts 16-byte aligned
            if nodes:
                node_ring, node_counts = nodes
        return Stream(x, x_scales, topk_idx, topk_weights, pair_pos, ring, counts, node_ring, topk,
                      fp8, ue8m0, node_counts)

    def _send_round(self, stream: Stream, i: int, received: tuple | None = None) -> None:
        """Round ``i`` of a dispatch send of several rounds (its epoch is the channel's latest:
        ``_start``): the window's tokens into their ring positions on every destination, then
        the round's counts and epoch to every rank (across nodes: the window's rows for other
        nodes into the outboxes, one descriptor per peer (flat) or node (hierarchical: each
        row once per node, at its row in the node's message of the round), as a call of one
        round). ``received`` (round 0): the layout outputs its send writes (:class:`PendingSend`:
        round 0's slot offsets at the front of every round's)."""
        t_base = i * self.layout.ring_slots
        window = slice(t_base, t_base + self.layout.ring_slots)
        x, ring = stream.x[window], stream.ring[window]  # (no generator: one call per item)
        idx = None if stream.topk_idx is None else stream.topk_idx[window]
        weights = None if stream.topk_weights is None else stream.topk_weights[window]
        pos = None if stream.pair_pos is None else stream.pair_pos[window]
        scales = stream.x_scales  # none, one global scale, or per token (sent quantized)
        if stream.fp8 == 2:
            scales = scales[window]
        counts = None if stream.counts is None else stream.counts[i]
        lay_out = None
        if received is not None:  # the last program waits for every source and lays them out
            *outs, every_round, alignment = received
            channels = self.channels
            lay_out = (channels.dispatch_counts, channels.signals_of[DISPATCH], *outs,
                       every_round[self._round0], alignment)
        self._send_window(x, scales, idx, weights, pos, ring, counts, stream.topk, stream.fp8,
                          stream.ue8m0, t_base, lay_out)
        if self.hierarchical:  # rows for other nodes (flat: the send did it)
            node_ring = None if stream.node_ring is None else stream.node_ring[window]
            self._send_other_nodes(x, scales, idx, weights, pos, ring, counts, stream.fp8,
                                   stream.ue8m0, node_ring, t_base,
                                   None if stream.node_counts is None else stream.node_counts[i])

    def _send_window(self, x, x_scales, topk_idx, topk_weights, pair_pos, ring, counts,
                     topk: int, fp8: int = 0, ue8m0: int = 0, t_base: int = 0,
                     lay_out: tuple | None = None) -> None:
        """The dispatch send of tokens ``t_base + [0, len(x))`` to their positions ``ring`` in
        every destination's staging, then the counts and epoch to every rank
        (``kernels.dispatch``; ``lay_out``: its)."""
        words, offsets, boxes = (self._offsets.get(("fixed", DISPATCH))
                                 or self._send_fixed(DISPATCH))
        grid = self._offsets.get(("send_grid", fp8, ue8m0, x.dtype))  # per format, made once
        if grid is None:
            grid = self._offsets[("send_grid", fp8, ue8m0, x.dtype)] = dispatch_kernels.send_grid(
                self.layout.ring_slots, self.hidden, self.num_sms, self.flavour,
                sent_elem_bytes(fp8, ue8m0, x.element_size()))
        self.launches["dispatch_send"] += dispatch_kernels.dispatch_send(
            x, topk_idx, topk_weights, ring, pair_pos, counts, self.heap.peer_ptrs,
            self._stats, *words, offsets=offsets, rank=self.rank,
            num_local_experts=self.num_local_experts, meta_stride=self.layout.meta_stride,
            max_topk=self.max_topk, grid=grid, topk=topk, row_bytes=self._row_bytes, fp8=fp8,
            x_scales=x_scales, ue8m0=ue8m0, flavour=self.flavour, box_offsets=boxes,
            bound=self._bound, t_base=t_base, lay_out=lay_out, live=self._ft_dispatch_live0,
            plan=self._plan, xstats=self._xstats)

    def _received_layout(self, expert_alignment: int, pending: PendingSend,
                         within: torch.Tensor | None = None, slot_offsets=None, row_base=None):
        """Waits for every source (in the kernel on GPUs, fault-tolerant ones too, else on the
        host before it) and turns the counts every source published into ``(row_base [R, L],
        tokens_per_expert [L], expert_offsets [L + 1], slot_offsets [R + 1])`` int64
        (``kernels.dispatch.received_layout``: one launch, no host read). The parity is the
        dispatch epoch's, selected on the device (a captured CUDA graph replays it right).
        With fault tolerance a source that did not arrive counts zero. A fault-tolerant call of
        several rounds waits apart from the layout, so that ``pending.live`` holds who arrived,
        and ``within`` ([R] int32, round 0's ``live``; None: every source) leaves out the
        sources that did not arrive in round 0 (a later round places rows by round 0's
        layout). ``slot_offsets``, ``row_base``: where to write them ([R + 1] int64 view; round
        0's row_base: the Buffer's, which every round of the call reads)."""
        fused = self._wait(pending, fusable=not self._ft_rounds)
        if within is not None:
            pending.live = within if pending.live is None else pending.live * within
        self.launches["received_layout"] += 1
        layout = dispatch_kernels.received_layout(
            self.channels.dispatch_counts, self.channels.signals_of[DISPATCH],
            self.channels.words[DISPATCH][1], pending.live,
            world_size=self.world_size, num_local_experts=self.num_local_experts,
            alignment=expert_alignment, wait=fused, flavour=self.flavour,
            peer_ptrs=self.heap.peer_ptrs, rank=self.rank, bound=self._bound,
            slot_offsets=slot_offsets, row_base=row_base)
        if fused:
            self._check_usable("dispatch")  # a timeout (or this rank excluded) shows here
        return layout

    def dispatch_recv(self, pending: PendingSend, expert_alignment: int,
                      col_major_scales: bool = False, max_recv_rows: int | None = None,
                      slot_major: bool = False) -> tuple:
        """Receive phase of dispatch (with the later rounds' sends); returns the tensors of
        ``moe_comm::dispatch``. ``slot_major`` (one round): the rows, scales and global scales
        are by received slot, each (source, token) once in ``slot_offsets`` order
        (``kernels.dispatch.dispatch_expand``), the rest as without; with ``max_recv_rows``
        they have a row for every slot a source may fill, zero past the count."""
        return run_steps(self.dispatch_recv_steps(pending, expert_alignment, col_major_scales,
                                                  max_recv_rows, slot_major))

    @poisons_buffer_on_error("dispatch")
    def dispatch_recv_steps(self, pending: PendingSend, expert_alignment: int,
                            col_major_scales: bool = False, max_recv_rows: int | None = None,
                            slot_major: bool = False):
        """:meth:`dispatch_recv` as steps: it yields after the send of each round past the
        first, before that round's receive (``moe_comm.testing.lockstep`` runs every virtual rank's
        step before any rank receives), and returns the tensors of ``moe_comm::dispatch``.

        ``max_recv_rows`` (an upper bound of the rows this rank receives, padding included)
        sizes the output without reading the count back: the one host synchronisation of a
        dispatch goes away (CUDA-graph capturable); rows past the count are zero padding.
        Every output is written by the expand kernel (padding included): no fill launches."""
        _, fwd_slots, fwd_n = self._no_node_tensors
        if self.hierarchical:
            payload = (payload_bytes(self.hidden, 1, pending.fp8, pending.ue8m0)
                       if pending.fp8 else self._row_bytes)
            fwd_slots, fwd_n = self._forward_slots()
            self._forward_dispatch(pending.epoch, payload,
                                   *self._round_nodes(fwd_slots, fwd_n, 0), cached=False)
        L, dev = self.num_local_experts, self.device
        stream = pending.stream  # later rounds in one launch: every round's offsets in one
        received = pending.received
        laid_out = received is not None and received[-1] == expert_alignment  # by round 0's
        one_launch = stream is not None and self.plan.dispatch_in_one_launch[  # send; every
            stream.fp8, stream.ue8m0, stream.x.element_size()] and (  # round's offsets in one
                laid_out or not self.fault_tolerant)  # tensor (fault tolerance: who arrived too)
        if laid_out:
            row_base, tokens_per_expert, expert_offsets, every_round, _ = received
            slot_offsets = every_round[self._round0]
        else:
            every_round = (torch.empty(self.slot_offsets_size, dtype=torch.int64, device=dev)
                           if one_launch else None)
            row_base, tokens_per_expert, expert_offsets, slot_offsets = self._received_layout(
                expert_alignment, pending,
                slot_offsets=None if every_round is None else every_round[self._round0],
                row_base=self._row_base)
        data_rows = None  # rows of the data outputs, where not `rows` (slot_major: the slots)
        if slot_major and self.layout.rounds > 1:
            raise ValueError("slot_major needs one round")
        if slot_major and max_recv_rows is None:  # both counts in one read
            self.host_syncs["rows"] += 1
            rows, data_rows = torch.stack((expert_offsets[-1], slot_offsets[-1])).tolist()
            self._check_usable("dispatch")
        elif slot_major:  # every slot a source may fill; those past the count stay zero
            rows, data_rows = max_recv_rows, self.world_size * self.max_tokens_per_rank
        elif max_recv_rows is None:
            rows = read_int(self.host_syncs, "rows", expert_offsets[-1])
            self._check_usable("dispatch")  # the wait kernel has run: a timeout shows now
        else:
            rows = max_recv_rows
        if data_rows is None:
            data_rows = rows
        fp8 = pending.fp8 != 0
        nvfp4 = fp8 and pending.ue8m0 == NVFP4
        # fault tolerance in rounds: the rows of a source that stops after round 0 stay as
        # padding rows are (zero, src_rank / src_token -1; in one launch the kernel fills them
        # first); otherwise the expand writes them all
        fill = self._ft_rounds and not one_launch
        alloc = torch.zeros if fill or (slot_major and (
            pending.live is not None or max_recv_rows is not None)) else torch.empty
        out = (alloc((data_rows, self.hidden // 2), device=dev, dtype=torch.uint8) if nvfp4
               else alloc((data_rows, self.hidden), device=dev,
                          dtype=torch.float8_e4m3fn if fp8 else self.dtype))
        global_scale = (alloc(data_rows, dtype=torch.float32, device=dev) if nvfp4
                        else self._no_global_scale)
        scales, scale_memory, scale_strides = (self._no_scales, None, (0, 0))
        if fp8:
            scales, scale_memory, scale_strides = fp8_scales_out(
                data_rows, self.hidden // scale_group(pending.ue8m0), pending.ue8m0,
                col_major_scales, dev, alloc)
        out_weights = alloc(rows if pending.has_weights else 0, dtype=torch.float32, device=dev)
        src_rank = torch.empty(rows, dtype=torch.int64, device=dev)
        src_token = torch.empty(rows, dtype=torch.int64, device=dev)
        if fill:
            src_rank.fill_(-1)
            src_token.fill_(-1)
        slot_rows = torch.empty((self.world_size * self.max_tokens_per_rank, pending.topk),
                                dtype=torch.int32, device=dev)  # 4 bytes per (slot, choice)
        outputs = (slot_rows, out, out_weights if pending.has_weights else None, src_rank,
                   src_token)
        if one_launch:  # round 0's expand, then the later rounds' sends, waits and expands
            self._start(DISPATCH, self.layout.rounds - 1)
            slot_offsets = every_round  # (the launch writes the later rounds' and the gaps)
            self._dispatch_rounds(stream, row_base, tokens_per_expert, expert_offsets,
                                  slot_offsets, outputs, scale_memory, scale_strides,
                                  global_scale, fwd_slots, fwd_n)
            self._check_usable("dispatch")  # its waits ran in the kernel: a timeout shows now
        else:
            staging, meta = self.channels.staging_of[DISPATCH]
            expand = functools.partial(
                dispatch_kernels.dispatch_expand, staging.view(torch.uint8) if fp8 else staging,
                meta, self.channels.words[DISPATCH][1])
            options = dict(
                rank=self.rank, topk=pending.topk, num_local_experts=L,
                meta_stride=self.layout.meta_stride, max_topk=self.max_topk,
                flavour=self.flavour, out_scales=scale_memory, scale_strides=scale_strides,
                ue8m0=pending.ue8m0, out_global=global_scale, bound=self._bound,
                slot_major=slot_major)
            first = slot_offsets
            if self.layout.rounds > 1:  # every round's offsets, each after the earlier rounds'
                slot_offsets = torch.zeros(self.slot_offsets_size, dtype=torch.int64,
                                           device=dev)
                first = slot_offsets[self._round0].copy_(first)
            self.launches["dispatch_expand"] += expand(
                first, row_base, tokens_per_expert, expert_offsets, *outputs, **options)
            for i in range(1, self.layout.rounds):
                epoch = self._start(DISPATCH)
                pending.send_round(i)
                yield
                if self.hierarchical:
                    self._forward_dispatch(epoch, payload,
                                           *self._round_nodes(fwd_slots, fwd_n, i), cached=False)
                # every round publishes the call's per-expert counts: round 0's row_base places
                # every round's rows (with fault tolerance, of the sources that arrived in
                # round 0)
                _, _, _, offsets = self._received_layout(
                    expert_alignment, dataclasses.replace(pending, epoch=epoch, live=None),
                    within=pending.live)
                view = self._round_view(slot_offsets, i)
                end = self._round_view(slot_offsets, i - 1)[-1]
                torch.add(offsets, end, out=view)
                self.launches["dispatch_expand"] += expand(
                    view, row_base, tokens_per_expert, expert_offsets, *outputs, **options)
        if pending.ue8m0 >= MXFP8:  # rows of G bytes (contiguous unless G % 4)
            scales = scales.contiguous()
        self.dispatch_serial += 1
        node_slot_of = pending.node_slot_of if pending.node_slot_of is not None \
            else self._no_node_tensors[0]
        return DispatchOutputs(
            x=out, scales=scales, weights=out_weights, src_rank=src_rank, src_token=src_token,
            tokens_per_expert=tokens_per_expert, expert_offsets=expert_offsets,
            slot_of=pending.slot_of, slot_rows=slot_rows, slot_offsets=slot_offsets,
            node_slot_of=node_slot_of, fwd_slots=fwd_slots, fwd_n=fwd_n,
            global_scale=global_scale)

    def _dispatch_rounds(self, stream: Stream, row_base, tokens_per_expert, expert_offsets,
                         slot_offsets, outputs: tuple, scale_memory, scale_strides,
                         global_scale, fwd_slots, fwd_n) -> None:
        """Round 0's expand and rounds ``1..rounds - 1`` of a dispatch in one launch
        (``kernels.dispatch_rounds``): ``stream``'s sends, and into ``outputs``
        (``(slot_rows, out, out_weights, src_rank, src_token)``, as an expand gets them) and
        ``slot_offsets`` (every round's; round 0's given) the rows of every round;
        hierarchical, each later round's node messages and forwarder pass too, into
        ``fwd_slots`` / ``fwd_n`` (:meth:`_forward_slots`)."""
        slot_rows, out, out_weights, src_rank, src_token = outputs
        fixed, options = self._offsets.get(("rounds", DISPATCH)) or self._rounds_arguments()
        self.launches["dispatch_rounds"] += dispatch_rounds_kernels.dispatch_rounds(
            stream.x, stream.x_scales, stream.topk_idx, stream.topk_weights, stream.pair_pos,
            stream.ring, stream.counts, row_base, tokens_per_expert, expert_offsets, slot_rows,
            slot_offsets, out, out_weights, src_rank, src_token, *fixed,
            fp8=stream.fp8, ue8m0=stream.ue8m0, out_scales=scale_memory,
            scale_strides=scale_strides, out_global=global_scale,
            node=self._rounds_node(stream.node_ring, stream.node_counts, fwd_slots, fwd_n)
            if self.hierarchical else None, **options)

    def _rounds_node(self, node_ring, node_counts, fwd_slots, fwd_n) -> tuple:
        """Hierarchical: ``kernels.dispatch_rounds.dispatch_rounds``' ``node`` (the call's node
        rows and each round's message rows, the dispatch's ``fwd_slots`` / ``fwd_n``, this
        rank's node signals of the dispatch, the forwarder pass's ticket word)."""
        ticket = dispatch_rounds_kernels.FORWARD_TICKET
        return (node_ring, node_counts, fwd_slots, fwd_n, self.channels.region("node_signals")[0],
                self.channels.tickets[ticket:ticket + 1])

    def _rounds_arguments(self) -> tuple[tuple, dict]:
        """What ``kernels.dispatch_rounds.dispatch_rounds`` takes of the Buffer, made once (the
        bound launch is found by the tensors' ids): the tensors, then the keywords."""
        ticket = dispatch_rounds_kernels.ROUNDS_TICKET  # its own: not the send grid
        fixed = (*self.channels.staging_of[DISPATCH], self.channels.dispatch_counts,
                 self.heap.peer_ptrs, self._stats, self.channels.tickets[ticket:ticket + 1],
                 self.channels.words[DISPATCH][1], self.channels.signals_of[DISPATCH])
        options = dict(
            offsets=self.channels.send_offsets(DISPATCH), rank=self.rank,
            num_local_experts=self.num_local_experts, meta_stride=self.layout.meta_stride,
            max_topk=self.max_topk, ring_slots=self.layout.ring_slots,
            rounds=self.layout.rounds, offsets_stride=self._round_stride,
            row_bytes=self._row_bytes, num_sms=self.num_sms, flavour=self.flavour,
            bound=self._bound, live=self._ft_dispatch_live,
            ft_words=self._ft_dispatch_words, box_offsets=self._rdma_offsets(DISPATCH),
            plan=self._plan, xstats=self._xstats,
            node_meta_stride=self.layout.node_meta_stride if self.hierarchical else 0)
        arguments = self._offsets[("rounds", DISPATCH)] = (fixed, options)
        return arguments

    def _cached_dispatch_rounds(self, x, ring, counts, node_ring, slot_rows, slot_offsets,
                                tokens_per_expert, expert_offsets, out, fwd_slots,
                                fwd_n) -> None:
        """A whole cached dispatch of several rounds in one launch
        (``kernels.dispatch_rounds``, its cached form): ``x``'s rows to their ring positions
        ``ring`` (``counts``: :meth:`_cached_target_counts`), into ``out`` by the handle's
        ``slot_rows`` and every round's ``slot_offsets``; hierarchical, each round's rows for
        another node at the handle's ``node_ring``, forwarded as the handle's ``fwd_slots`` /
        ``fwd_n`` place them."""
        node = None
        if self.hierarchical:  # the rows of each round's message to each node
            node = self._rounds_node(node_ring, self._rows_per_round(node_ring), fwd_slots,
                                     fwd_n)
        fixed, options = self._offsets.get(("rounds", DISPATCH)) or self._rounds_arguments()
        self.launches["dispatch_rounds"] += dispatch_rounds_kernels.dispatch_rounds(
            x, None, None, None, None, ring, counts, None, tokens_per_expert, expert_offsets,
            slot_rows, slot_offsets, out, None, None, None, *fixed, node=node, **options)

    @poisons_buffer_on_error("dispatch")
    def dispatch_cached_send(self, x, slot_of, node_slot_of=None) -> PendingSend:
        """Send phase of a dispatch that reuses an earlier layout (the backward of combine).
        Where its rounds run in one launch (``kernels.dispatch_rounds``, cached) nothing is
        sent here: the receive launches every round."""
        epoch = self._start(DISPATCH, checked=True)
        x = x.contiguous()
        later = None
        counts = self._cached_target_counts(slot_of)
        if self.layout.rounds > 1 and self.plan.dispatch_in_one_launch.get(
                (0, 0, x.element_size()), False):  # the launch in the receive (slot_of: the
            self._start(DISPATCH, self.layout.rounds - 1)  # ring positions)
            return PendingSend(DISPATCH, epoch, all_rounds=functools.partial(
                self._cached_dispatch_rounds, x, slot_of, counts, node_slot_of))
        if self.layout.rounds == 1:
            self._send_window(x, None, None, None, None, slot_of, counts, 1)
            self._send_other_nodes(x, None, None, None, None, slot_of, None,
                                   node_slot_of=node_slot_of)
        else:
            later = functools.partial(self._send_round, self._stream(
                x, None, None, None, None, None, counts, 1, ring=slot_of,
                node_ring=node_slot_of if self.hierarchical else None))
            later(0)
        return PendingSend(DISPATCH, epoch, send_round=later)

    def _cached_target_counts(self, ring: torch.Tensor) -> torch.Tensor | None:
        """Through the proxy, flat: the rows a cached dispatch sends each rank, whose send posts
        them (``Flavour.proxy_box``): [R] int32, or with rounds [rounds, R] (round i:
        the tokens of its window); else None. Equivalent::

            counts[i, d] = (ring[i * W:(i + 1) * W, d] >= 0).sum()
        """
        if not self.flavour.proxy_box:
            return None
        if self.layout.rounds == 1:
            return (ring >= 0).sum(0, dtype=torch.int32)
        return self._rows_per_round(ring)

    def _rows_per_round(self, ring: torch.Tensor) -> torch.Tensor:
        """``ring`` [T, C] (a row per token, -1 where none) as [rounds, C] int32: the rows of
        each round's window in each column."""
        return self._round_windows(ring >= 0).sum(1, dtype=torch.int32)

    def dispatch_cached_recv(self, pending: PendingSend, slot_rows, slot_offsets,
                             tokens_per_expert, expert_offsets, num_rows: int, fwd_slots=None,
                             fwd_n=None) -> torch.Tensor:
        """Receive phase of a cached dispatch: rows [num_rows, H], zero in padding."""
        return run_steps(self.dispatch_cached_recv_steps(
            pending, slot_rows, slot_offsets, tokens_per_expert, expert_offsets, num_rows,
            fwd_slots, fwd_n))

    @poisons_buffer_on_error("dispatch")
    def dispatch_cached_recv_steps(self, pending: PendingSend, slot_rows, slot_offsets,
                                   tokens_per_expert, expert_offsets, num_rows: int,
                                   fwd_slots=None, fwd_n=None):
        """:meth:`dispatch_cached_recv` as steps (as :meth:`dispatch_recv_steps`)."""
        if pending.all_rounds is not None:  # every round in one launch, from here
            out = torch.empty((num_rows, self.hidden), dtype=self.dtype, device=self.device)
            pending.all_rounds(slot_rows, slot_offsets, tokens_per_expert, expert_offsets, out,
                               fwd_slots, fwd_n)
            self._check_usable("dispatch")  # its waits ran in the kernel: a timeout shows now
            return out
        if self.hierarchical:
            self._forward_dispatch(pending.epoch, self._row_bytes,
                                   *self._round_nodes(fwd_slots, fwd_n, 0), cached=True)
        self._wait(pending)
        # the rows of sources that did not arrive (in some round) stay zero
        alloc = torch.empty if pending.live is None and not self._ft_rounds else torch.zeros
        live = pending.live
        out = alloc((num_rows, self.hidden), dtype=self.dtype, device=self.device)
        staging, _ = self.channels.staging_of[DISPATCH]
        for i in range(self.layout.rounds):
            if i:
                epoch = self._start(DISPATCH)
                pending.send_round(i)
                yield
                if self.hierarchical:
                    self._forward_dispatch(epoch, self._row_bytes,
                                           *self._round_nodes(fwd_slots, fwd_n, i), cached=True)
                round_pending = dataclasses.replace(pending, epoch=epoch, live=None)
                self._wait(round_pending)
                live = round_pending.live
            self.launches["dispatch_expand"] += dispatch_kernels.dispatch_expand(
                staging, None, self.channels.words[DISPATCH][1],
                slot_offsets if self.layout.rounds == 1 else self._round_view(slot_offsets, i),
                None, tokens_per_expert, expert_offsets,
                slot_rows, out, None, None, None, rank=self.rank, topk=slot_rows.shape[1],
                num_local_experts=self.num_local_experts, meta_stride=self.layout.meta_stride,
                max_topk=self.max_topk, flavour=self.flavour, live=live, bound=self._bound)
        return out
