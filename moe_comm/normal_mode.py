"""Normal mode (training, prefill): the send and receive phases of dispatch and combine.

``NormalEngine``, a component of ``Buffer`` (``buf.normal_engine``): each phase is a method,
called with validated inputs by the custom ops (``moe_comm.ops``) and by the loopback driver
(``moe_comm.testing.lockstep``). Launch counts go to
``self.launches``: dispatch = layout (2: count, place) + send + received layout + expand,
combine = send + reduce (reduce skipped for T = 0); the cached dispatch (combine's backward) is
send + expand; with waits in kernels the received layout waits itself (no launch of its own)
and every other receive adds one ``wait`` launch (a fault-tolerant Buffer's dispatch too). No
torch op launches a kernel on this path: outputs are allocated, never filled (the expand
writes every row, padding included; a fault-tolerant dispatch in rounds fills them first, for
the rows of a source that stops between rounds: torch fills where it launches per round, its
one launch itself). Through the proxy across nodes a flat dispatch's send fills the
outboxes and posts their descriptors itself (``Flavour.proxy_box``; a cached one
counts the rows it sends each rank by torch ops); a hierarchical dispatch adds
``dispatch_outbox`` and ``dispatch_forward`` (with torch ops for the node slots), a
hierarchical combine ``combine_forward``; the forwarders' waits for their
inputs are host reads of numpy views of the signal words (host waits), or with the waits in the
kernels a ``wait`` launch before each forwarder's (``kernels.comm.wait_relayed_epochs_kernel``).

Rounds (``Buffer(..., staging_bytes=...)``, ``moe_comm.workspace``): the staging holds ``W``
slots per source and parity. Where ``W < max_tokens_per_rank`` every call runs in ``rounds =
ceil(max_tokens_per_rank / W)`` rounds, the same number on every rank; round ``i`` is a whole
epoch of the channel for the source tokens ``[i * W, (i + 1) * W)``::

    for i in range(rounds):
        send(tokens of window i -> position slot - (slots of rank d in rounds < i) on rank d)
        publish epoch (dispatch: with the call's per-expert counts and the round's rows)
        wait for every rank's epoch of round i; expand (dispatch) or sum (combine) its rows

Each round launches what a call of one round does (without the layout), but on one node,
across nodes through the proxy (flat or hierarchical; below) or across hosts over
NVSHMEM, where every rank runs in a process of its own with waits in the kernels (GPUs, or CPU
ranks with ``MOE_COMM_WAIT=kernel``): there one launch runs a combine's rounds
(``kernels.combine_rounds``:
each round's send, wait and reduce; fault-tolerant too, each round's sources decided once for
every program of the launch; across nodes through the proxy too, flat (fault-tolerant too),
its last program posting each round's transfers, or hierarchical, each round's forwarder pass
in the launch, ``kernels.internode.forward_round``; EP-invariant:
``kernels.invariant_rounds``, through the proxy flat or hierarchical)
and one launch a dispatch's after its round 0 is sent and laid out (``kernels.dispatch_rounds``:
round 0's expand, then each later round's send, wait and expand; fault-tolerant too, where
round 0's send laid it out; across nodes through the proxy too, flat (fault-tolerant too),
each round's last program posting its transfers, or hierarchical, each round's node messages
and forwarder pass in the launch, round 0 laid out by a launch of its own after its forwarder's),
and one launch every round of a cached dispatch (the same kernel, through the proxy too); each
says why it cannot deadlock, and on GPUs they run where a round fits the launch's ``num_sms``
programs (``fits_one_launch``; a Buffer on GPUs cuts its ring to fit, ``moe_comm.rings``).
There round 0's send lays out what arrived too: its last program, after it has published, waits
for every source's round 0 and writes the received layout (what ``received_layout`` launches
otherwise). Every other program of that send has finished, and every rank's last program
publishes before it waits, so no rank waits for one that is waiting; the host read that sizes
the outputs follows.
A dispatch in rounds is then five launches: the layout's two, the ring positions, round 0's send
and the one launch (through the proxy, flat, too); hierarchical, nine: round 0's send, outbox,
the forwarder's wait and pass and the received layout in place of the send, as a call of one
round has them, whatever the number of rounds. Across nodes through the proxy each round's send
fills the outboxes with the window's rows for other nodes and posts one descriptor per peer
(flat: the send itself) or per node (hierarchical: ``_send_other_nodes``, where a dispatch
launches per round); hierarchical, each round adds the forwarder's pass (``_forward_dispatch``
after the round's send, ``_forward_combine`` after the round's combine send, where they launch
per round), which waits for the round's messages from other nodes (the dispatch; the combine:
this node's partials) and stores their rows into its node's staging (the combine: sums them and
sends one row per token home). The ring positions and the rounds' counts are one launch
(``kernels.layout.ring_positions``; hierarchical, each token's row in each node's message of
its round and those messages' rows too), the rounds' slot offsets torch ops (written by the
one launch where there is one).
A window holds at most ``W`` tokens, so at most ``W`` rows for any rank and at most ``W`` rows in
any node's message. The order that makes it safe, in each place the kernels run: a rank's send of
round ``i`` needs nothing but its own inputs (the parity it writes was last read in round ``i - 2``,
by the two-parity argument of ``moe_comm.buffer`` applied per round), and its wait for round ``i``
needs only every rank's send of round ``i``, which every rank issues before its own wait: so on GPUs
(the send and the wait in stream order, each rank on its own GPU) and on CPU ranks (one process per
rank, host or in-kernel waits) no rank waits for one that is waiting; virtual ranks
(``moe_comm.testing.lockstep``) run every rank's send of a round before any rank's receive of it
(the
receive phases are generators that yield between a round's send and its receive). Hierarchical adds
one link to the chain and the same argument holds for it: the forwarder's pass of round ``i`` waits
only for sends of round ``i`` (issued before any wait of round ``i``), and every write of parity
``i % 2`` in round ``i`` (a sender's outboxes, and through the proxy the forwarder's ``fwd_*``,
``hc_*`` and ``hcomb_*`` regions; the forwarder's stores into its node's staging) comes after the
writer's own wait of round ``i - 1``. That wait needs every rank's epoch of round ``i - 1``, and
each rank publishes round ``i - 1`` only after it has read round ``i - 2``, which it read only after
the forwarder had read the messages of round ``i - 2`` that carried its rows. The dispatch's receive
writes each round's rows straight into the expert-major output (the received layout of round 0 fixes
every row's place; every round publishes the same per-expert counts) and records each round's slot
offsets (``recv_slot_offsets``: round ``i``'s ``[R + 1]`` at ``i * S``, ``S`` = ``R + 1`` rounded up
to even); the combine sends back each round's slots to the ring positions they had, and the home
rank sums the tokens of window ``i`` in round ``i``, each in rank order: the same bits as one round.
Fault tolerance: each round's wait excludes a silent source on its own and nothing waits
for an excluded one, so a rank that stops between rounds holds up no one (a combine or a
dispatch in one launch: program 0 of each round waits, excludes and writes who arrived, the
others take its word, ``kernels.comm.wait_or_exclude_once``, so every token of the round sums
the same sources, and ``[rounds, R]`` of them reach ``renormalize``); a later round of a
dispatch takes only sources that arrived in round 0 as well (rows are placed by round 0's layout),
and its outputs start as padding rows (``moe_comm.fault``, "In rounds").

EP-invariant Buffers (``ep_invariant=True``; one node, or through the proxy, where each row
for another node goes by a descriptor of its own and the epoch follows them, flat or
hierarchical alike: no forwarder takes part in this combine): the combine's send is
``kernels.invariant.invariant_send`` (every (slot, choice) row to its home's ``inv_rows`` at
``(t % W) * K + k``) and its receive ``invariant_reduce`` (choice order); they run on the combine
channel's epochs, signals and parities, each round a whole epoch, so the ordering argument above
holds for them unchanged (a round's rows land in the parity of its epoch, read by the home's
reduce of that round before the home publishes the next round's epoch); with a process per
rank and waits in the kernels, one launch runs them all (``kernels.invariant_rounds``): on one
node, and through the proxy, flat (fault-tolerant too) or hierarchical.

Host reads of device data (``self.host_syncs``): dispatch reads the received-row count once to
size its output (``rows``), none with ``max_recv_rows``; combine and the cached dispatch read
nothing. Every grid is fixed by the Buffer's sizes (the persistent programs read the counts
they need on the device), but the layout's and the reduce's, which follow the call's tokens.
"""
from __future__ import annotations

import torch
import triton

from .channels import CHANNEL_NAMES
from .forwarders import Forwarders
from .kernels.bound import call_bound, launch
from .kernels.comm import (
    EPOCH_SHIFT,
    PeerTimeoutError,
    epochs_of,
    ft_wait_epochs_kernel,
    wait_epochs_kernel,
    wait_for_epochs,
    wait_relayed_epochs_kernel,
)
from .kernels.layout import layout_scratch
from .kernels.tiles import tiles
from .nodes import plan_values, relay_of
from .normal_combine import CombinePhases
from .normal_dispatch import DispatchPhases
from .pending import PendingSend
from .transport.errors import TransportError
from .workspace import COMBINE, DISPATCH


class NormalEngine(DispatchPhases, CombinePhases, Forwarders):
    """The normal mode of one Buffer (``buf.normal_engine``): its phases, its waits for the
    peers' epochs, its per-channel launch offsets, its scratch and fault-tolerance words, and
    the serial of the latest dispatch. The custom ops (``moe_comm.ops``) and the loopback
    driver (``moe_comm.testing.lockstep``) call its phases.

    It reads the Buffer once, when the Buffer is set up: the configuration, the components it
    shares (heap, layout, plan, channels, error record, fault policy, launch and host-sync
    counts, bound launches, the byte counters) and three of the Buffer's checks, which it calls
    afterwards: ``check_usable`` (an earlier failure or a recorded timeout raises),
    ``checking_transport`` (a host wait sees the proxy fail) and ``mark_failed`` (a failed
    phase makes the Buffer unusable, ``moe_comm._guard``). Nothing else of the Buffer is read
    or written here.
    """

    _READS = ("id", "rank", "world_size", "hidden", "dtype", "device", "num_experts",
              "num_local_experts", "max_tokens_per_rank", "max_topk", "num_sms", "timeout_s",
              "flavour", "fault_tolerant", "ep_invariant", "heap", "layout", "plan", "proxy",
              "channels", "errors", "fault", "launches", "host_syncs", "hierarchical",
              "ranks_per_node", "num_nodes")

    def __init__(self, buffer, *, stats: torch.Tensor, xstats: torch.Tensor, bound,
                 check_usable, checking_transport, mark_failed):
        for name in self._READS:
            setattr(self, name, getattr(buffer, name))
        self._stats, self._xstats, self._bound = stats, xstats, bound
        self._check_usable, self._checking_transport = check_usable, checking_transport
        self._mark_failed = mark_failed
        layout, device = self.layout, self.device
        R, L = self.world_size, self.num_local_experts
        self._row_bytes = self.hidden * self.dtype.itemsize
        self._offsets: dict = {}  # per-channel launch offsets, made once
        # where round i's [R + 1] offsets start in recv_slot_offsets, divided by i: R + 1
        # rounded up to an even count, so that every round's view has the first one's 16-byte
        # alignment (one compiled variant)
        self._round_stride = R + 1 + (R + 1) % 2
        self._round0 = slice(0, R + 1)  # round 0's offsets: _round_view(x, 0), as a slice
        # the length of a dispatch's recv_slot_offsets: every round's [R + 1] offsets
        self.slot_offsets_size = (layout.rounds - 1) * self._round_stride + R + 1
        self._scratch: dict = {}  # kernels' scratch tensors, made once (kernels.combine)
        self._layout_scratch = layout_scratch(layout.max_tokens, R, self.num_experts,
                                              self.flavour, device, layout.max_topk)
        # a dispatch's row_base (round 0's: read by that call's expands alone), and its empty
        # outputs (no scales, global scales or node tensors), one each: never written
        self._row_base = torch.empty((R, L), dtype=torch.int64, device=device)
        self._no_scales, self._no_global_scale = (
            torch.empty(0, dtype=torch.float32, device=device) for _ in range(2))
        self._no_node_tensors = tuple(torch.empty(0, dtype=torch.int32, device=device)
                                      for _ in range(3))
        # the proxy's plan words (moe_comm.nodes.plan_values), read by the internode kernels
        self._plan = (None if self.proxy is None else torch.tensor(
            plan_values(layout, self.rank), dtype=torch.int64, device=device))
        self.dispatch_serial = 0  # forward dispatches completed (a handle's validity)
        self.combine_refusal = 0  # a refused combine's descriptor while it takes part (else 0)
        self.combine_live = None  # the last combine's arrived sources (None: all)
        # fault tolerance: the word in which that program publishes each round's decision;
        # a dispatch's one launch: its own two (its decisions, the epoch whose outputs it
        # filled) and the [rounds, R] sources of its rounds (row 0: round 0's send writes it);
        # calls in rounds: each round waits apart and knows its sources
        ft = self.fault_tolerant
        self._ft_rounds = ft and layout.rounds > 1
        self._ft_decided = torch.zeros(1, dtype=torch.int64, device=device) if ft else None
        self._ft_dispatch_words = (torch.zeros(2, dtype=torch.int64, device=device)
                                   if ft else None)
        self._ft_dispatch_live = (torch.zeros((layout.rounds, R), dtype=torch.int32,
                                              device=device) if ft else None)
        self._ft_dispatch_live0 = (None if self._ft_dispatch_live is None
                                   else self._ft_dispatch_live[0])

    # ----------------------------------------------------------------- waits
    def _start(self, channel: int, rounds: int = 1, checked: bool = False) -> int:
        """Takes the next ``rounds`` epochs of ``channel`` and returns the last: a round's
        (a send phase's first round: its guard has just checked the Buffer, ``checked``), or
        at once those of the later rounds of a call that one launch sends. The Buffer is
        checked first unless ``checked``; a fault-tolerant one, whether this rank is cut off."""
        if self.fault_tolerant:
            self.fault.check_self()
        if not checked:
            self._check_usable()
        epochs = self.channels.epochs  # (inline: every phase of every op starts here)
        epochs[channel] += rounds
        return epochs[channel]

    def _wait(self, pending: PendingSend, fusable: bool = False) -> bool:
        """Every source published ``pending.epoch`` on its channel (bounded). CPU ranks poll
        from the host and raise naming the missing peer; otherwise a one-program wait kernel
        runs ahead of the receive on the stream (no synchronisation) and records a timeout,
        after which no kernel of this rank publishes and the next check raises. ``fusable``:
        the caller's next kernel can wait itself (``kernels.comm.wait_all_at_least``, or
        ``wait_all_or_exclude`` for a fault-tolerant Buffer): where the wait would be a kernel
        nothing is launched here and True is returned."""
        channel = CHANNEL_NAMES[pending.channel]
        combine = pending.channel == COMBINE  # (its words: epoch << 32 | descriptor << 18)
        shift = EPOCH_SHIFT.value if combine else 0
        if fusable and self.flavour.device_wait:
            return True
        if not self.flavour.device_wait:
            words = self.channels.signal_words[pending.channel]
            if self.fault_tolerant:  # sources that stay silent are excluded, the call goes on
                seconds = self.fault.wait(epochs_of(words, shift), pending.epoch, channel)
                if None in seconds:
                    pending.live = torch.tensor([t is not None for t in seconds],
                                                dtype=torch.int32, device=self.device)
            else:
                self._wait_words(words, pending.epoch, list(range(self.world_size)), channel,
                                 shift)
            if combine:  # a source with another descriptor (the kernels' check, on the host)
                self.errors.check_signal_words(words, pending.epoch, self.rank)
            return False
        if self.fault_tolerant:
            self._ft_wait_kernel(pending)
            self._check_usable(channel)
            return False
        signals = self.channels.signals_of[pending.channel]
        key = ("wait_epochs", pending.channel)
        if not call_bound(self._bound, key, (signals,)):
            tile = tiles("wait_epochs", self.flavour.compiled, self.hidden)
            launch(self._bound, key, wait_epochs_kernel, (1,),
                   (signals, self.channels.words[pending.channel][1], self.flavour.errors_addr,
                    self.flavour.timeout_ns, self.world_size, self.rank),
                   dict(BLOCK_R=triton.next_power_of_2(self.world_size),
                        NUM_THREADS=tile.num_threads, COMBINE=combine,
                        **tile.launch_options()), ("signals",))
        self.launches["wait"] += 1
        self._check_usable(channel)
        return False

    def _ft_wait_kernel(self, pending: PendingSend) -> None:
        """The in-kernel wait of a fault-tolerant Buffer: ``pending.live`` [R] int32 (1 where
        the source arrived), written on the device (no synchronisation)."""
        R = self.world_size
        pending.live = torch.empty(R, dtype=torch.int32, device=self.device)
        signals = self.channels.signals_of[pending.channel]
        key = ("ft_wait_epochs", pending.channel)
        if not call_bound(self._bound, key, (signals, pending.live)):
            tile = tiles("wait_epochs", self.flavour.compiled, self.hidden)
            launch(self._bound, key, ft_wait_epochs_kernel, (1,),
                   (signals, self.channels.words[pending.channel][1], pending.live,
                    self.heap.peer_ptrs, self.flavour.mask_off, *self.flavour.args(), R,
                    self.rank),
                   dict(TRANSPORT=self.flavour.transport, BLOCK_R=triton.next_power_of_2(R),
                        NUM_THREADS=tile.num_threads, COMBINE=pending.channel == COMBINE,
                        **tile.launch_options()),
                   ("signals", "live"))
        self.launches["wait"] += 1

    def _wait_words(self, words, expected: int, peers: list[int], channel: str,
                    shift: int = 0) -> None:
        """Host wait until ``words[i] >= expected`` for all i (``words``: local signal words, a
        tensor or a numpy view; word i is published for rank ``peers[i]``; ``shift``: the
        epoch's place, EPOCH_SHIFT in a combine's). Through the proxy a transport failure raises
        at once; a timeout names the rank, and in hierarchical mode the rank of this node that
        forwards it."""
        if isinstance(words, torch.Tensor):
            words = words.numpy()
        try:
            wait_for_epochs(self._checking_transport(epochs_of(words, shift)), expected,
                            timeout_s=self.timeout_s, rank=self.rank, channel=channel)
        except PeerTimeoutError as exc:
            if isinstance(exc, TransportError) or peers == list(range(len(peers))) \
                    and not self.hierarchical:
                raise
            peer = peers[exc.peer]
            raise PeerTimeoutError(self.rank, peer, channel, exc.expected, exc.observed,
                                   self.timeout_s, via=relay_of(
                self.rank, peer, channel, self.ranks_per_node, self.hierarchical)) from None

    def _wait_relayed(self, words: torch.Tensor, epoch: int, peers: list[int],
                      channel: int) -> None:
        """A hierarchical forwarder's inputs of ``channel``'s epoch ``epoch``: ``words[i] >=
        epoch``, word i published for rank ``peers[i]`` (equally spaced ranks). A host wait, or
        with the waits in the kernels a one-program wait kernel ahead of the forwarder's launch
        (``kernels.comm.wait_relayed_epochs_kernel``: it reads the epoch on the device, and a
        timeout names the rank)."""
        name = CHANNEL_NAMES[channel]
        if not self.flavour.device_wait:
            self._wait_words(words, epoch, peers, name,
                             EPOCH_SHIFT.value if channel == COMBINE else 0)
            return
        key = ("wait_relayed", channel)
        if not call_bound(self._bound, key, (words,)):
            tile = tiles("wait_epochs", self.flavour.compiled, self.hidden)
            step = peers[1] - peers[0] if len(peers) > 1 else 1
            launch(self._bound, key, wait_relayed_epochs_kernel, (1,),
                   (words, self.channels.words[channel][1], self.flavour.errors_addr,
                    self.flavour.timeout_ns, len(peers), peers[0], step),
                   dict(BLOCK_R=triton.next_power_of_2(len(peers)),
                        NUM_THREADS=tile.num_threads,
                        SHIFT=EPOCH_SHIFT.value if channel == COMBINE else 0,
                        **tile.launch_options()), ("words",))
        self.launches["wait"] += 1
        self._check_usable(name)

    # ----------------------------------------------------------------- shared by the phases
    def _rdma_offsets(self, channel: int) -> tuple:
        """(byte offset of parity 0, bytes per parity) of the outboxes NVSHMEM puts read, or
        through the proxy, flat, those a dispatch send fills (target 0's; zeros without
        either)."""
        offsets = self._offsets.get(("rdma", channel))
        if offsets is None:
            names = (("rdma_rows", "rdma_meta", "rdma_counts") if channel == DISPATCH
                     else ("rdma_combine_rows", "rdma_combine_meta"))
            boxes = channel == DISPATCH and self.flavour.proxy_box
            if boxes:
                names = ("px_rows", "px_meta", "px_counts")
            offsets = (((0, 0),) * len(names) if not (self.layout.rdma or boxes) else
                       tuple((self.layout.offset(n, 0), self.layout.parity_stride(n))
                             for n in names))
            self._offsets[("rdma", channel)] = offsets
        return offsets

    def _round_windows(self, hit: torch.Tensor) -> torch.Tensor:
        """``hit`` [T, C] as [rounds, W, C] int32, row t in round t // W's window at t % W,
        zero past T."""
        (T, C), n, W = hit.shape, self.layout.rounds, self.layout.ring_slots
        windows = torch.zeros((n * W, C), dtype=torch.int32, device=self.device)
        windows[:T] = hit
        return windows.view(n, W, C)

    def _send_fixed(self, channel: int) -> tuple:
        """(ticket and epoch words, send offsets, outbox offsets) of ``channel``'s send, made
        once (one lookup per send)."""
        fixed = self._offsets[("fixed", channel)] = (
            self.channels.words[channel], self.channels.send_offsets(channel),
            self._rdma_offsets(channel))
        return fixed

    def _round_view(self, slot_offsets: torch.Tensor, i: int) -> torch.Tensor:
        """Round ``i``'s ``[R + 1]`` view of a dispatch's ``recv_slot_offsets`` (several
        rounds)."""
        start = i * self._round_stride
        return slot_offsets[start:start + self.world_size + 1]
