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
outboxes and posts their descriptors itself (``kernels.dispatch.proxy_box``; a cached one
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

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from ._guard import poisons_buffer_on_error, run_steps
from .call_descriptor import combine_descriptor, dispatch_descriptor
from .channels import CHANNEL_NAMES
from .host_sync import read_int
from .kernels import combine as combine_kernels
from .kernels import combine_rounds as combine_rounds_kernels
from .kernels import dispatch as dispatch_kernels
from .kernels import dispatch_rounds as dispatch_rounds_kernels
from .kernels import internode
from .kernels import invariant as invariant_kernels
from .kernels import invariant_rounds as invariant_rounds_kernels
from .kernels.bound import call_bound, launch, specs
from .kernels.comm import (
    EPOCH_SHIFT,
    PeerTimeoutError,
    epochs_of,
    ft_wait_epochs_kernel,
    wait_epochs_kernel,
    wait_for_epochs,
    wait_relayed_epochs_kernel,
)
from .kernels.layout import layout_scratch, ring_positions, routing_layout
from .kernels.quant import MXFP8, NVFP4, scale_group
from .kernels.rows import payload_bytes, sent_elem_bytes
from .kernels.tiles import tiles
from .nodes import plan_values, relay_of
from .transport.errors import TransportError
from .types import DispatchOutputs
from .workspace import COMBINE, DISPATCH


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


class NormalEngine:
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
    def _open(self, channel: int) -> int:
        """The epoch of a send phase's first round (its guard has just checked the Buffer)."""
        if self.fault_tolerant:
            self.fault.check_self()
        epochs = self.channels.epochs  # (inline: every phase of every op starts here)
        epochs[channel] += 1
        return epochs[channel]

    def _start(self, channel: int) -> int:
        """The epoch of a later round: ``_open`` after the Buffer is checked again."""
        if self.fault_tolerant:
            self.fault.check_self()
        self._check_usable()
        epochs = self.channels.epochs  # (inline: every round starts here)
        epochs[channel] += 1
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
        key = ("wait_epochs", pending.channel, specs((signals,)))
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
        key = ("ft_wait_epochs", pending.channel, specs((signals, pending.live)))
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
        key = ("wait_relayed", channel, specs((words,)))
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


    # ----------------------------------------------------------------- phases
    def _rdma_offsets(self, channel: int) -> tuple:
        """(byte offset of parity 0, bytes per parity) of the outboxes NVSHMEM puts read, or
        through the proxy, flat, those a dispatch send fills (target 0's; zeros without
        either)."""
        offsets = self._offsets.get(("rdma", channel))
        if offsets is None:
            names = (("rdma_rows", "rdma_meta", "rdma_counts") if channel == DISPATCH
                     else ("rdma_combine_rows", "rdma_combine_meta"))
            boxes = channel == DISPATCH and dispatch_kernels.proxy_box(self.flavour)
            if boxes:
                names = ("px_rows", "px_meta", "px_counts")
            offsets = (((0, 0),) * len(names) if not (self.layout.rdma or boxes) else
                       tuple((self.layout.offset(n, 0), self.layout.parity_stride(n))
                             for n in names))
            self._offsets[("rdma", channel)] = offsets
        return offsets

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
        epoch = self._open(DISPATCH)
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
            node_slot_of = self._send_other_nodes(x, x_scales, topk_idx, topk_weights, pair_pos,
                                                  slot_of, counts, fp8, ue8m0)
        else:  # (across nodes each round sends its window's outboxes)
            stream = self._stream(x, x_scales, topk_idx, topk_weights, pair_pos, slot_of, counts,
                                  K, fp8, ue8m0)
            later = functools.partial(self._send_round, stream)
            if expert_alignment is not None and not self.hierarchical and \
                    self.plan.dispatch_in_one_launch[fp8, ue8m0, x.element_size()]:
                received = (*dispatch_kernels.received_layout_outputs(
                    self.world_size, self.num_local_experts, self.device,
                    torch.empty(self.slot_offsets_size(), dtype=torch.int64,
                                device=self.device), self._row_base), expert_alignment)
            later(0, received)
            node_slot_of = (self._no_node_tensors[0] if stream.node_ring is None
                            else stream.node_ring)
            positions = stream.ring  # the handle's slot_of: the combine reads the rings by it
        return PendingSend(DISPATCH, epoch, positions, K, topk_weights is not None, fp8, ue8m0,
                           node_slot_of, send_round=later, stream=stream, received=received)

    # ----------------------------------------------------------------- rounds
    def _round_windows(self, hit: torch.Tensor) -> torch.Tensor:
        """``hit`` [T, C] as [rounds, W, C] int32, row t in round t // W's window at t % W,
        zero past T."""
        (T, C), n, W = hit.shape, self.layout.rounds, self.layout.ring_slots
        windows = torch.zeros((n * W, C), dtype=torch.int32, device=self.device)
        windows[:T] = hit
        return windows.view(n, W, C)

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
                       self._round_view(every_round, 0), alignment)
        self._send_window(x, scales, idx, weights, pos, ring, counts, stream.topk, stream.fp8,
                          stream.ue8m0, t_base, lay_out)
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

    def _send_fixed(self, channel: int) -> tuple:
        """(ticket and epoch words, send offsets, outbox offsets) of ``channel``'s send, made
        once (one lookup per send)."""
        fixed = self._offsets[("fixed", channel)] = (
            self.channels.words[channel], self.channels.send_offsets(channel),
            self._rdma_offsets(channel))
        return fixed

    def slot_offsets_size(self) -> int:
        """Length of a dispatch's ``recv_slot_offsets`` (every round's ``[R + 1]`` offsets)."""
        return (self.layout.rounds - 1) * self._round_stride + self.world_size + 1

    def _start_later_rounds(self, channel: int) -> None:
        """Takes the epochs of rounds ``1..rounds - 1`` of the call just started on
        ``channel``, which one launch sends (``kernels.combine_rounds``,
        ``kernels.invariant_rounds``, ``kernels.dispatch_rounds``)."""
        if self.fault_tolerant:  # (_start of every later round, at once: one check)
            self.fault.check_self()
        self._check_usable()
        self.channels.epochs[channel] += self.layout.rounds - 1

    def _round_view(self, slot_offsets: torch.Tensor, i: int) -> torch.Tensor:
        """Round ``i``'s ``[R + 1]`` view of a dispatch's ``recv_slot_offsets`` (several
        rounds)."""
        start = i * self._round_stride
        return slot_offsets[start:start + self.world_size + 1]

    def _send_other_nodes(self, x, x_scales, topk_idx, topk_weights, pair_pos, slot_of, counts,
                          fp8: int = 0, ue8m0: int = 0, node_slot_of=None, t_base: int = 0,
                          node_counts=None) -> torch.Tensor:
        """Through the proxy, hierarchical: rows for other nodes into the outboxes, one
        descriptor per node (``kernels.internode``; rounds: ``x`` and the per-token tensors are
        the window of tokens ``t_base + [0, len(x))``, ``slot_of`` their ring positions; flat,
        the send did this itself, ``kernels.dispatch.proxy_box``). Returns ``node_slot_of`` [T,
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

    def _forward_slot_shapes(self) -> tuple[tuple[int, int, int], tuple[int]]:
        """Hierarchical: the shapes of :meth:`_forward_slots`, ``([rounds * M, W, N],
        [rounds * S])`` with ``S`` = ``M`` rounded up to a multiple of 4, so that every round's
        ``fwd_n`` starts 16-byte aligned (the forwarders' kernels specialise once)."""
        n, M = self.layout.rounds, self.num_nodes
        return (n * M, self.layout.ring_slots, self.ranks_per_node), (n * -(-M // 4) * 4,)

    def _forward_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Hierarchical: ``(fwd_slots, fwd_n)`` int32 (:meth:`_forward_slot_shapes`) for a
        dispatch to fill, round ``i``'s at rows ``[i * M, (i + 1) * M)`` and
        ``[i * S, i * S + M)`` (:meth:`_round_nodes`)."""
        slots, counts = self._forward_slot_shapes()
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
            slot_offsets = self._round_view(every_round, 0)
        else:
            every_round = (torch.empty(self.slot_offsets_size(), dtype=torch.int64, device=dev)
                           if one_launch else None)
            row_base, tokens_per_expert, expert_offsets, slot_offsets = self._received_layout(
                expert_alignment, pending,
                slot_offsets=None if every_round is None else self._round_view(every_round, 0),
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
            self._start_later_rounds(DISPATCH)
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
                slot_offsets = torch.zeros(self.slot_offsets_size(), dtype=torch.int64,
                                           device=dev)
                first = self._round_view(slot_offsets, 0).copy_(first)
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
        self.launches["dispatch_rounds"] += dispatch_rounds_kernels.dispatch_rounds(
            stream.x, stream.x_scales, stream.topk_idx, stream.topk_weights, stream.pair_pos,
            stream.ring, stream.counts, row_base, tokens_per_expert, expert_offsets, slot_rows,
            slot_offsets, out, out_weights, src_rank, src_token, *self._rounds_fixed(),
            fp8=stream.fp8, ue8m0=stream.ue8m0, out_scales=scale_memory,
            scale_strides=scale_strides, out_global=global_scale,
            node=self._rounds_node(stream.node_ring, stream.node_counts, fwd_slots, fwd_n),
            **self._rounds_options())

    def _rounds_node(self, node_ring, node_counts, fwd_slots, fwd_n) -> tuple | None:
        """Hierarchical: ``kernels.dispatch_rounds.dispatch_rounds``' ``node`` (the call's node
        rows and each round's message rows, the dispatch's ``fwd_slots`` / ``fwd_n``, this
        rank's node signals of the dispatch, the forwarder pass's ticket word); else None."""
        if not self.hierarchical:
            return None
        ticket = dispatch_rounds_kernels.FORWARD_TICKET
        return (node_ring, node_counts, fwd_slots, fwd_n, self.channels.region("node_signals")[0],
                self.channels.tickets[ticket:ticket + 1])

    def _rounds_fixed(self) -> tuple:
        """The Buffer's tensors ``kernels.dispatch_rounds.dispatch_rounds`` takes, made once
        (the bound launch is found by their ids)."""
        fixed = self._offsets.get(("rounds", DISPATCH))
        if fixed is None:
            ticket = dispatch_rounds_kernels.ROUNDS_TICKET  # its own: not the send grid
            fixed = self._offsets[("rounds", DISPATCH)] = (
                *self.channels.staging_of[DISPATCH], self.channels.dispatch_counts,
                self.heap.peer_ptrs, self._stats, self.channels.tickets[ticket:ticket + 1],
                self.channels.words[DISPATCH][1], self.channels.signals_of[DISPATCH])
        return fixed

    def _rounds_options(self) -> dict:
        """The keywords of ``kernels.dispatch_rounds.dispatch_rounds`` fixed by the Buffer."""
        options = self._offsets.get(("rounds options", DISPATCH))
        if options is None:
            options = self._offsets[("rounds options", DISPATCH)] = dict(
                offsets=self.channels.send_offsets(DISPATCH), rank=self.rank,
                num_local_experts=self.num_local_experts, meta_stride=self.layout.meta_stride,
                max_topk=self.max_topk, ring_slots=self.layout.ring_slots,
                rounds=self.layout.rounds, offsets_stride=self._round_stride,
                row_bytes=self._row_bytes, num_sms=self.num_sms, flavour=self.flavour,
                bound=self._bound, live=self._ft_dispatch_live,
                ft_words=self._ft_dispatch_words, box_offsets=self._rdma_offsets(DISPATCH),
                plan=self._plan, xstats=self._xstats,
                node_meta_stride=self.layout.node_meta_stride if self.hierarchical else 0)
        return options

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
        self.launches["dispatch_rounds"] += dispatch_rounds_kernels.dispatch_rounds(
            x, None, None, None, None, ring, counts, None, tokens_per_expert, expert_offsets,
            slot_rows, slot_offsets, out, None, None, None, *self._rounds_fixed(),
            node=node, **self._rounds_options())

    @poisons_buffer_on_error("dispatch")
    def dispatch_cached_send(self, x, slot_of, node_slot_of=None) -> PendingSend:
        """Send phase of a dispatch that reuses an earlier layout (the backward of combine).
        Where its rounds run in one launch (``kernels.dispatch_rounds``, cached) nothing is
        sent here: the receive launches every round."""
        epoch = self._open(DISPATCH)
        x = x.contiguous()
        later = None
        counts = self._cached_target_counts(slot_of)
        if self.layout.rounds > 1 and self.plan.dispatch_in_one_launch.get(
                (0, 0, x.element_size()), False):  # the launch in the receive (slot_of: the
            self._start_later_rounds(DISPATCH)  # ring positions)
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
        them (``kernels.dispatch.proxy_box``): [R] int32, or with rounds [rounds, R] (round i:
        the tokens of its window); else None. Equivalent::

            counts[i, d] = (ring[i * W:(i + 1) * W, d] >= 0).sum()
        """
        if not dispatch_kernels.proxy_box(self.flavour):
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

    @poisons_buffer_on_error("combine")
    def combine_send(self, y, weights, pair_values, slot_rows, slot_offsets, fwd_slots=None,
                     fwd_n=None, fp8: bool = False, src_token=None) -> PendingSend:
        """Send phase of combine: reduce each received token's rows, put the partial home
        (hierarchical: partials for other nodes to this node's forwarders, which sum and send
        them; ``fwd_slots`` / ``fwd_n`` from the dispatch). ``fp8``: partials travel as FP8
        per 128 channels (``kernels.combine``). An EP-invariant Buffer puts every (slot,
        choice) row home on its own instead (``kernels.invariant``; ``src_token``: the
        dispatch's, each row's token on its home rank)."""
        epoch = self._open(COMBINE)
        topk = slot_rows.shape[1]
        y = y.contiguous()
        if self.plan.combine_in_one_launch[fp8, pair_values is not None]:  # in the receive
            self._start_later_rounds(COMBINE)
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
