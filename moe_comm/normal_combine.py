"""The combine phases of the normal mode: the send (each token's partial home, or every
(slot, choice) row home for the EP-invariant combine; a call of several rounds in one launch
where it can) and the receive (the wait and the sum). Semantics: ``moe_comm.normal_mode``."""
from __future__ import annotations

import dataclasses
import functools

import torch

from ._guard import poisons_buffer_on_error, run_steps
from .call_descriptor import combine_descriptor
from .kernels import combine as combine_kernels
from .kernels import combine_rounds as combine_rounds_kernels
from .kernels import invariant as invariant_kernels
from .kernels import invariant_rounds as invariant_rounds_kernels
from .pending import PendingSend
from .workspace import COMBINE


class CombinePhases:
    """Part of :class:`moe_comm.normal_mode.NormalEngine`, whose state, waits and shared
    helpers it uses (one class in four files, as ``kernels/`` splits its kernels): the combine
    phases and a combine's rounds."""

    @poisons_buffer_on_error("combine")
    def combine_send(self, y, weights, pair_values, slot_rows, slot_offsets, fwd_slots=None,
                     fwd_n=None, fp8: bool = False, src_token=None) -> PendingSend:
        """Send phase of combine: reduce each received token's rows, put the partial home
        (hierarchical: partials for other nodes to this node's forwarders, which sum and send
        them; ``fwd_slots`` / ``fwd_n`` from the dispatch). ``fp8``: partials travel as FP8
        per 128 channels (``kernels.combine``). An EP-invariant Buffer puts every (slot,
        choice) row home on its own instead (``kernels.invariant``; ``src_token``: the
        dispatch's, each row's token on its home rank)."""
        epoch = self._start(COMBINE, checked=True)
        topk = slot_rows.shape[1]
        y = y.contiguous()
        if self.plan.combine_in_one_launch[fp8, pair_values is not None]:  # in the receive
            self._start(COMBINE, self.layout.rounds - 1)
            all_rounds = (functools.partial(self._invariant_rounds, src_token)
                          if self.ep_invariant else
                          functools.partial(self._combine_rounds, fp8, fwd_slots, fwd_n))
            return PendingSend(COMBINE, epoch, topk=topk, has_weights=weights is not None,
                               fp8=int(fp8), all_rounds=functools.partial(
                                   all_rounds, y, weights, pair_values, slot_rows,
                                   slot_offsets))
        round_send = self._invariant_round if self.ep_invariant else self._combine_round
        send = functools.partial(round_send, y, weights, pair_values, slot_rows,
                                 slot_offsets, fwd_slots, fwd_n, fp8, src_token)
        send(0)
        return PendingSend(COMBINE, epoch, topk=topk, has_weights=weights is not None,
                           fp8=int(fp8), send_round=send if self.layout.rounds > 1 else None)

    def _invariant_round(self, y, weights, pair_values, slot_rows, slot_offsets, fwd_slots,
                         fwd_n, fp8: bool, src_token, i: int) -> None:
        """Round ``i`` of an EP-invariant combine send: every row of the slots that arrived in
        round ``i`` of the dispatch to its home's ``inv_rows`` (``kernels.invariant``)."""
        self.launches["combine_send"] += invariant_kernels.invariant_send(
            y, weights, pair_values, slot_rows,
            slot_offsets if self.layout.rounds == 1 else self._round_view(slot_offsets, i),
            src_token, self.heap.peer_ptrs, self._stats, *self.channels.words[COMBINE],
            offsets=self._invariant_offsets(), rank=self.rank, topk=slot_rows.shape[1],
            max_topk=self.max_topk, ring_slots=self.layout.ring_slots, num_sms=self.num_sms,
            flavour=self.flavour, bound=self._bound,
            xstats=self._xstats if self.proxy is not None else None,
            descriptor=self.combine_refusal or combine_descriptor(fp8))

    def _invariant_offsets(self) -> dict:
        """``kernels.invariant.invariant_send``'s offsets, made once."""
        offsets = self._offsets.get(("inv", COMBINE))
        if offsets is None:
            lay = self.layout
            offsets = self._offsets[("inv", COMBINE)] = {
                name: (lay.offset(region, 0), lay.parity_stride(region))
                for name, region in (("rows", "inv_rows"), ("meta", "inv_meta"),
                                     ("box_rows", "inv_box_rows"), ("box_meta", "inv_box_meta"))
                if region in lay.regions}
            offsets["signal"] = lay.offset("signals", COMBINE, self.rank)
        return offsets

    def _combine_round(self, y, weights, pair_values, slot_rows, slot_offsets, fwd_slots, fwd_n,
                       fp8: bool, src_token, i: int) -> None:
        """Round ``i`` of a combine send (its epoch is the channel's latest): the partials of
        the slots that arrived in round ``i`` of the dispatch, to the ring positions they had
        there (``kernels.combine``); hierarchical, then the forwarder's sums of this node's
        partials for round ``i``'s rows of other nodes (:meth:`_forward_combine`)."""
        words, offsets, boxes = (self._offsets.get(("fixed", COMBINE))
                                 or self._send_fixed(COMBINE))
        self.launches["combine_send"] += combine_kernels.combine_send(
            y, weights, pair_values, slot_rows,
            slot_offsets if self.layout.rounds == 1 else self._round_view(slot_offsets, i),
            self.heap.peer_ptrs, self._stats, *words, offsets=offsets, rank=self.rank,
            topk=slot_rows.shape[1], max_topk=self.max_topk, max_tokens=self.layout.ring_slots,
            num_sms=self.num_sms, flavour=self.flavour, box_offsets=boxes, xstats=self._xstats,
            plan=self._plan, fp8=fp8, bound=self._bound, scratch=self._scratch,
            descriptor=self.combine_refusal or combine_descriptor(fp8))
        if self.hierarchical:
            self._forward_combine(self.channels.epochs[COMBINE],
                                  *self._round_nodes(fwd_slots, fwd_n, i),
                                  slot_rows.shape[1], pair_values is not None, fp8)

    def _combine_rounds(self, fp8: bool, fwd_slots, fwd_n, y, weights, pair_values, slot_rows,
                        slot_offsets, ring, out, pair_out, topk_idx=None,
                        node_slot_of=None) -> torch.Tensor | None:
        """A whole combine of several rounds in one launch (``kernels.combine_rounds``): into
        ``out`` [T, H] and ``pair_out`` (None without pair values), ``ring``: the dispatch's
        ring positions (``topk_idx``: the EP-invariant combine's, not read here); hierarchical,
        the dispatch's ``fwd_slots``, ``fwd_n`` and ``node_slot_of`` (its node rows) for each
        round's forwarder pass and node sums. Returns what the rounds heard
        (``_rounds_live``'s form): fault-tolerant, ``[rounds, R]`` int32 written by the launch;
        else None."""
        fixed = self._offsets.get(("rounds", COMBINE))
        if fixed is None:  # made once: the bound launch is found by these tensors' ids
            (_, epochs), offsets, _ = self._send_fixed(COMBINE)
            ticket = combine_rounds_kernels.ROUNDS_TICKET  # its own: not the send grid
            fixed = self._offsets[("rounds", COMBINE)] = (
                *self.channels.staging_of[COMBINE], self.channels.tickets[ticket:ticket + 1],
                epochs, self.channels.signals_of[COMBINE], offsets, self._rdma_offsets(COMBINE))
        staging, meta, tickets, epochs, signals, offsets, boxes = fixed
        live = self._rounds_live_words()
        self.launches["combine_rounds"] += combine_rounds_kernels.combine_rounds(
            y, weights, pair_values, slot_rows, slot_offsets, ring, out, pair_out, staging, meta,
            self.heap.peer_ptrs, self._stats, tickets, epochs, signals, offsets=offsets,
            rank=self.rank, topk=slot_rows.shape[1], max_topk=self.max_topk,
            rounds=self.layout.rounds, offsets_stride=self._round_stride,
            num_sms=self.num_sms, flavour=self.flavour, fp8=fp8, bound=self._bound,
            scratch=self._scratch, live=live, decided=self._ft_decided,
            xstats=self._xstats if self.proxy is not None else None, plan=self._plan,
            box_offsets=boxes, node=self._forwarder_tensors(node_slot_of, fwd_slots, fwd_n)
            if self.hierarchical else None,
            descriptor=self.combine_refusal or combine_descriptor(fp8))
        return live

    def _rounds_live_words(self) -> torch.Tensor | None:
        """Fault tolerance: ``[rounds, R]`` int32 for a combine's rounds in one launch to write
        who each round heard (``kernels.comm.wait_or_exclude_once``); else None."""
        if not self.fault_tolerant:
            return None
        return torch.empty((self.layout.rounds, self.world_size), dtype=torch.int32,
                           device=self.device)

    def _invariant_rounds(self, src_token, y, weights, pair_values, slot_rows, slot_offsets,
                          ring, out, pair_out, topk_idx, node_slot_of=None) -> torch.Tensor | None:
        """A whole EP-invariant combine of several rounds in one launch
        (``kernels.invariant_rounds``): as :meth:`_combine_rounds`, with the dispatch's
        ``src_token`` and ``topk_idx`` (no forwarder takes part: ``node_slot_of`` unused)."""
        fixed = self._offsets.get(("rounds", "inv"))
        if fixed is None:  # made once: the bound launch is found by these tensors' ids
            ticket = invariant_rounds_kernels.ROUNDS_TICKET  # its own: not the send grid
            fixed = self._offsets[("rounds", "inv")] = (
                self.channels.region("inv_rows"), self.channels.region("inv_meta"),
                self.heap.peer_ptrs, self._stats, self.channels.tickets[ticket:ticket + 1],
                self.channels.words[COMBINE][1], self.channels.signals_of[COMBINE])
        live = self._rounds_live_words()
        self.launches["combine_rounds"] += invariant_rounds_kernels.invariant_rounds(
            y, weights, pair_values, slot_rows, slot_offsets, src_token, topk_idx, ring, out,
            pair_out, *fixed, offsets=self._invariant_offsets(), rank=self.rank,
            num_experts=self.num_experts, max_topk=self.max_topk,
            ring_slots=self.layout.ring_slots, rounds=self.layout.rounds,
            offsets_stride=self._round_stride, num_sms=self.num_sms, flavour=self.flavour,
            bound=self._bound, live=live, decided=self._ft_decided,
            xstats=self._xstats if self.proxy is not None else None,
            descriptor=self.combine_refusal or combine_descriptor(False))
        return live

    def combine_recv(self, pending: PendingSend, slot_of, want_pair: bool, node_slot_of=None,
                     topk_idx=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Receive phase of combine (with the later rounds' sends): ``(out [T, H], pair_out
        [T, K] float32 or empty)``; ``topk_idx``: the dispatch's (EP-invariant Buffers)."""
        return run_steps(self.combine_recv_steps(pending, slot_of, want_pair, node_slot_of,
                                                 topk_idx))

    @poisons_buffer_on_error("combine")
    def combine_recv_steps(self, pending: PendingSend, slot_of, want_pair: bool,
                           node_slot_of=None, topk_idx=None):
        """:meth:`combine_recv` as steps (as :meth:`dispatch_recv_steps`): round i sums the
        tokens ``[i * W, (i + 1) * W)``, each in rank order as one round does (EP-invariant:
        in choice order, ``kernels.invariant``)."""
        T, dev = slot_of.shape[0], self.device
        out = torch.empty((T, self.hidden), dtype=self.dtype, device=dev)
        pair_out = torch.empty((T, pending.topk) if want_pair else (0,), dtype=torch.float32,
                               device=dev)
        if pending.all_rounds is not None:  # (slot_of: the dispatch's ring positions)
            self.combine_live = pending.all_rounds(slot_of, out, pair_out if want_pair else None,
                                                    topk_idx, node_slot_of)
            self._check_usable("combine")  # its waits ran in the kernel: a timeout shows now
            return out, pair_out
        self._wait(pending)
        # partials of ranks that did not arrive are left out, each round by its own wait
        live, lives = pending.live, [pending.live]
        staging, meta = self.channels.staging_of[COMBINE]
        rounds, W = self.layout.rounds, self.layout.ring_slots
        ring = slot_of  # with several rounds the dispatch's ring positions (the handle's)
        for i in range(rounds):
            if i:
                epoch = self._start(COMBINE)
                pending.send_round(i)
                yield
                round_pending = dataclasses.replace(pending, epoch=epoch, live=None)
                self._wait(round_pending)
                live = round_pending.live
                lives.append(live)
            slots, sums, pair_sums, node_slots, ids = ring, out, pair_out, node_slot_of, topk_idx
            if rounds > 1:
                window = slice(i * W, (i + 1) * W)
                slots, sums, pair_sums = ring[window], out[window], pair_out[window]
                node_slots = None if node_slot_of is None else node_slot_of[window]
                ids = None if topk_idx is None else topk_idx[window]
            if self.ep_invariant:
                self.launches["combine_reduce"] += invariant_kernels.invariant_reduce(
                    self.channels.region("inv_rows"), self.channels.region("inv_meta"),
                    self.channels.words[COMBINE][1], ids, slots, sums,
                    pair_sums if want_pair else None, num_experts=self.num_experts,
                    max_topk=self.max_topk, has_weights=pending.has_weights, live=live,
                    flavour=self.flavour, bound=self._bound)
                continue
            self.launches["combine_reduce"] += combine_kernels.combine_reduce(
                staging, meta, self.channels.words[COMBINE][1], slots, sums,
                pair_sums if want_pair else None, topk=pending.topk, max_topk=self.max_topk,
                flavour=self.flavour, rank=self.rank,
                node_rows=self.channels.region("hcomb_rows") if self.hierarchical else None,
                node_meta=self.channels.region("hcomb_meta") if self.hierarchical else None,
                node_slot_of=node_slots, live=live, fp8=pending.fp8 != 0, bound=self._bound)
        self.combine_live = live if rounds == 1 else self._rounds_live(lives)
        return out, pair_out

    def _rounds_live(self, lives: list) -> torch.Tensor | None:
        """What the combine's rounds heard, for ``renormalize``: None (every rank, every
        round), ``[R]`` int32 (one round) or ``[rounds, R]`` int32 (round i's sources
        at row i)."""
        if all(live is None for live in lives):
            return None
        if len(lives) == 1:
            return lives[0]
        every = torch.ones(self.world_size, dtype=torch.int32, device=self.device)
        return torch.stack([every if live is None else live for live in lives])
