"""A combine in rounds as one launch: every round's send, wait and reduce in one persistent kernel.

Where the staging holds ``W`` slots per source, a combine runs in ``rounds`` (``moe_comm.
normal_mode``). Launched per round, that is a send, a wait and a reduce per round. Where every
rank drives its Buffer from a process of its own (one process per GPU, or CPU ranks as
processes) and peers are reached by stores (one node; or other nodes through the proxy, below),
one launch runs all rounds. Equivalent
PyTorch, for every round ``i`` (the tokens of window ``[i * W, (i + 1) * W)``)::

    send round i's partials home, as combine_send_kernel       # parity (epoch + i) % 2
    the last program to finish: publish epoch + i to every rank
    wait until every rank published epoch + i                   # bounded, names the rank
    out[window i] = reduce of window i, as combine_reduce_kernel

Why it cannot deadlock: a wait of round ``i`` needs every rank's send of round ``i``, which
every rank issues before its own wait of round ``i`` (ranks in other processes run at the same
time); the send of round ``i + 1`` writes the parity its home last read in the reduce of round
``i - 1``, and the home published round ``i`` (which the sender waited for) only after every
one of its programs had finished that reduce (each program reduces round ``i - 1`` before it
sends round ``i``, and only the last program of round ``i`` publishes). Inside the launch a
program waits for its own rank's epoch, which the last program of the launch publishes: so
every program must be running at once. On GPUs the grid is ``num_sms`` programs (one per SM,
resident together, as DeepEP's persistent kernels); the interpreter runs the programs of a
launch one after another, so on CPU ranks the grid is one program. Virtual ranks
of one process cannot use it (a rank's launch would wait for a peer not yet launched): they
launch per round.

Across hosts over NVSHMEM (``TRANSPORT`` 1, without fault tolerance) each round sends as
``combine_send_kernel`` does there: the partials for a home without a pointer into this
rank's outbox, a put each, the epoch by ``signal_set`` after them. A program's puts are
complete (``quiet``) before it draws its ticket, so an outbox parity written again two rounds
later was read by its puts long before.

Across nodes through the proxy (``TRANSPORT`` 2: flat, fault-tolerant too) the partials
for homes on other nodes go into this rank's outbox and the round's last program posts one
transfer per such home (``kernels.combine.publish_partials``, as ``combine_send_kernel``'s last
program does); the proxy raises the epoch there after the partials. The outbox of a parity is
written again two rounds later, after this rank's wait of the round between: that wait needs
every home's epoch of it, which a home on another node sends with its own partials, posted
only after its wait of the round before, which needed this rank's transfer out of that outbox
to have landed. So the argument above holds with the proxy as one more link.

Hierarchical through the proxy (``HIER``, without fault tolerance): each round's send stores the
partials for homes on other nodes into the forwarder of this node with the home's local index
(``hc_rows``) and its last program raises this rank's word there (``hc_signals``); then every
program runs the round's forwarder pass (``kernels.internode.forward_round``: a bounded wait for
every rank of this node, each other node's rows summed in local-rank order into the outbox,
row tiles dealt over the programs, and the pass's last program, on a ticket word of its own,
posts one transfer per node to the home with this local index there, whose epoch the proxy
raises after it); the wait and the reduce (this node's partials one by one, each other node's
sum as one, ``combine_reduce_kernel`` with HIER) follow. Equivalent PyTorch of the pass, for
forwarder ``f`` of node ``b`` and every other node ``a`` (``rows``: node ``a``'s rows of the
round, the dispatch's ``fwd_n``; ``slot``: its ``fwd_slots``)::

    wait until hc_signals[l] >= epoch + i for every local rank l     # bounded, names the rank
    box[a, j] = sum(hc_rows[a, l, slot[a, j, l]] for l in range(N) if slot[a, j, l] >= 0)
    the last program of the pass: transfer box[a, :rows] to rank a * N + f % N, then its epoch

It adds no wait that can close a cycle: the pass of round ``i`` waits only for the sends of
round ``i`` of this node's ranks, each issued before that rank's own pass. The regions of a
parity are written again two rounds later only after they were read: a rank's partials into
``hc_rows`` after its wait of the round between, which needs the epoch of the forwarder (a
rank of its node), published in the forwarder's send, after its pass of the round before; the
forwarder's outbox after its wait of the round between, which needs the node sum of the home
it sent to (that home is the forwarder of its own node for this local index), sent after the
home's own wait of the round before, which needed this outbox's transfer to have landed; a
home's ``hcomb_rows`` by a transfer whose pass waited for the partials of the round between
from every rank of the sending node, each sent after that rank's wait of that round, which
needed this home's partials of it (relayed by a forwarder of the home's node), sent after the
home's reduce of the round before.

Fault tolerance (``FT``): each round, program 0 waits for every source not excluded, excludes
those silent until the deadline (on every rank, as the per-round wait kernel does), writes who
arrived into row ``i`` of ``live`` and publishes that decision in a local word; every other
program waits for the word (bounded) and reads the same row, so every token of the round sums
the same sources (``kernels.comm.wait_or_exclude_once``). Program 0 waits only for sources,
never for another program of its launch, so the argument above holds unchanged; a round where
this rank finds itself excluded ends every program's rounds. Through the proxy an exclusion
reaches the ranks of this node (by stores, ``kernels.comm.publish_to_all``); a rank on another
node waits for the same silent source and excludes it at its own deadline.

Bytes and signals are those of the launches per round: each round's partial rows and its epoch
(8 bytes) to every rank, counted in ``stats`` as ``combine_send_kernel`` counts them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bound import BoundLaunches, call_bound, launch
from .combine import (
    SEND_STAGES,
    _scratch,
    gathers_in_flight,
    publish_partials,
    reduce_tile,
    send_partials,
)
from .comm import (
    CPU_RANKS,
    Flavour,
    check_round_words,
    draw_last_of,
    signal_word,
    timed_out,
    wait_round,
)
from .internode import forward_round
from .tiles import MAX_TRIPS, combine_round_trips, even, tiles

ROUNDS_TICKET = 6  # the word of ``tickets`` this kernel draws from (kernels.dispatch_rounds: 5)
FORWARD_TICKET = 8  # and the word its forwarder's pass draws from (HIER)
_PER_CALL = ["rows_off", "meta_off", "signal_off", "local_base", "errors_addr", "timeout_ns",
             "T", "me", "mask_off", "ring_addr", "descriptor"]


@triton.jit(do_not_specialize=_PER_CALL)
def combine_rounds_kernel(
    y,  # [rows, H] expert outputs
    weights,  # [rows] float32 (HAS_WEIGHTS)
    pair_values,  # [rows] float32 (HAS_PAIR)
    slot_rows,  # [S, K] int32: rows of each received slot, -1 where unused
    slot_offsets,  # int64: round i's [R + 1] offsets at i * OFFSETS_STRIDE (the dispatch's)
    compact,  # [programs * BLOCK_T * BLOCK_K] int32 scratch (combine_send_kernel's)
    peer_ptrs,  # [R] int64
    stats,  # [4] int64 local: bytes stored (to peers, to itself) at [2], [3]
    tickets,  # [1] int64 local: this kernel's own ticket word (ROUNDS_TICKET)
    epochs,  # [1] int64 local: the channel's epoch; each round's last program advances it
    signals,  # [R] int64 local: the combine channel's signal words, one per source
    staging,  # [2, R, W, H] local combine_rows (FP8: uint8 rows ROW_BYTES apart)
    meta,  # [2, R, W, KMAX] float32 local combine_meta (HAS_PAIR)
    ring,  # [T, R] int32: the ring position of token t on rank d in its round, -1 if none
    out,  # [T, H]
    pair_out,  # [T, K] float32 (HAS_PAIR)
    live,  # [ROUNDS, R] int32 out (FT): round i's sources that arrived, at row i
    decided,  # [1] int64 local (FT): wait_or_exclude_once's word, grows with the epochs
    xstats,  # [4] int64 local (TRANSPORT 2): bytes for other nodes, the outbox's at [1]
    plan,  # TRANSPORT 2: [PLAN_FIELDS] int64 byte offsets (kernels.internode)
    ring_addr: tl.int64, RING_SLOTS: tl.int32,  # TRANSPORT 2: the proxy's ring
    N: tl.int32,  # ranks per node (TRANSPORT 2)
    # HIER (through the proxy, hierarchical; module docstring): the forwarder's regions and
    # the dispatch's node rows
    node_rows,  # [2, M, W, H] local hcomb_rows: the other nodes' sums for this home
    node_meta,  # [2, M, W, KMAX] float32 local hcomb_meta (HAS_PAIR)
    node_ring,  # [T, M] int32: row of token t in node b's message of its round, -1 if none
    hc_rows,  # [2, M, N, W, H] local: this node's partials for other nodes' tokens
    hc_meta,  # [2, M, N, W, KMAX] float32 local (HAS_PAIR)
    hc_box_rows,  # [2, M, W, H] local outbox px_combine_rows (FP8: its bytes)
    hc_box_meta,  # [2, M, W, KMAX] float32 local outbox px_combine_meta (HAS_PAIR)
    fwd_slots,  # [ROUNDS * M, W, N] int32 (the dispatch's): round i's at rows i * M
    fwd_n,  # int32 (the dispatch's): round i's [M] at i * FWD_N_STRIDE
    fwd_tickets,  # [1] int64 local: the ticket word of the forwarder's pass
    FWD_N_STRIDE: tl.int32,
    NODE_PARITY: tl.int64, NODE_META_PARITY: tl.int64,  # elements between parities
    HC_PARITY: tl.int64, HC_META_PARITY: tl.int64,
    BOX_PARITY: tl.int64, BOX_META_PARITY: tl.int64,
    rows_off: tl.int64, meta_off: tl.int64, signal_off: tl.int64,  # this rank's regions
    rows_parity: tl.int64, meta_parity: tl.int64,  # (parity 0) and bytes per parity
    box_rows_off: tl.int64, box_meta_off: tl.int64,  # TRANSPORT 1: the outboxes, as the send's
    box_rows_parity: tl.int64, box_meta_parity: tl.int64,
    STAGING_PARITY: tl.int64, META_PARITY: tl.int64,  # elements between the two parities
    ROW_BYTES: tl.int64,
    local_base: tl.int64,  # address of this rank's segment (no outbox is read from it)
    errors_addr: tl.int64, timeout_ns: tl.int64,
    mask_off: tl.int64,  # FT: byte offset of the mask words (every segment)
    T: tl.int32, H: tl.int32, K: tl.int32, R: tl.int32, me: tl.int32,
    W: tl.int32,  # ring slots per source: the tokens of a round
    ROUNDS: tl.int32, OFFSETS_STRIDE: tl.int32,
    descriptor: tl.int32,  # the call's (moe_comm.call_descriptor), in every round's signal word
    FT: tl.constexpr,  # fault tolerance: a silent source is excluded, each round sums the rest
    TRANSPORT: tl.constexpr,  # 0: every peer by stores; 1: NVSHMEM where a pointer is 0;
                              # 2: other nodes through the proxy (flat, or HIER)
    HIER: tl.constexpr,  # through the proxy, hierarchical: the forwarder's pass each round
    KMAX: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_PAIR: tl.constexpr,
    ACC_FP64: tl.constexpr, FP8: tl.constexpr, ALIGN: tl.constexpr, EVEN_H: tl.constexpr,
    REDUCE_EVEN_H: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,  # the send's tiles
    REDUCE_T: tl.constexpr, REDUCE_H: tl.constexpr,  # the reduce's tiles
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, NUM_THREADS: tl.constexpr,
    IN_FLIGHT: tl.constexpr, BLOCK_M: tl.constexpr,  # BLOCK_M: M's power of 2 (HIER)
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    errors = errors_addr.to(tl.pointer_type(tl.int64))
    base = tl.load(epochs)  # read by every program before any draws its first ticket
    channel_tiles = tl.cdiv(H, REDUCE_H)
    # after a timeout (of an earlier launch) nothing is sent; a wait of this launch that times
    # out ends its program's rounds, and a round whose programs did not all draw a ticket has
    # no last program: nothing is published after it (the error record, host memory, is read
    # once, outside the rounds)
    ok = ~timed_out(errors, NUM_THREADS)
    for i in range(ROUNDS):
        if ok:
            epoch = base + 1 + i
            parity = epoch % 2
            offsets = slot_offsets + i * OFFSETS_STRIDE
            send_partials(pid, programs, parity, y, weights, pair_values, slot_rows, offsets,
                          compact, peer_ptrs, stats, xstats, rows_off + parity * rows_parity,
                          meta_off + parity * meta_parity, box_rows_off + parity
                          * box_rows_parity, box_meta_off + parity * box_meta_parity,
                          local_base, plan, H, K, R,
                          me, W, N, KMAX, HAS_WEIGHTS, HAS_PAIR, ACC_FP64, FP8, TRANSPORT, HIER,
                          ALIGN, EVEN_H, BLOCK_T, BLOCK_H, BLOCK_K, BLOCK_R, IN_FLIGHT,
                          1 if FT and TRANSPORT == 2 else SEND_STAGES,  # (8 bytes spilled)
                          False)  # a fuller tile's rows not all held (8 to 24 bytes spilled)
            if draw_last_of(tickets, programs):  # the round's epoch, as combine_send_kernel's
                publish_partials(peer_ptrs, signal_off, signal_word(epoch, descriptor), parity,
                                 stats, plan, offsets, local_base, ring_addr, RING_SLOTS,
                                 errors_addr, timeout_ns,
                                 H * y.dtype.element_ty.primitive_bitwidth // 8, H, K, R, N, me,
                                 KMAX, HAS_PAIR, FP8, TRANSPORT, HIER)
                tl.store(epochs + tl.arange(0, 1), epoch + tl.zeros([1], tl.int64))
            if HIER:  # the forwarder's pass: this node's partials for other nodes, summed
                ok = forward_round(pid, programs, epoch, parity, plan, hc_rows, hc_meta,
                                   hc_box_rows, hc_box_meta, fwd_slots + i * (R // N) * W * N,
                                   fwd_n + i * FWD_N_STRIDE, xstats, fwd_tickets, local_base,
                                   ring_addr, RING_SLOTS, errors, timeout_ns, W, H, K, R, N,
                                   me, HC_PARITY, HC_META_PARITY, BOX_PARITY, BOX_META_PARITY,
                                   KMAX, HAS_PAIR, ACC_FP64, EVEN_H, FP8, BLOCK_T, BLOCK_H,
                                   BLOCK_K, BLOCK_R, NUM_THREADS)
            waited = wait_round(pid, epoch, signals, errors, timeout_ns, live + i * R, decided,
                                mask_off, local_base, peer_ptrs, R, me, FT, TRANSPORT, BLOCK_R,
                                NUM_THREADS, True)
            if HIER:  # (a pass whose wait timed out ends the program's rounds too)
                waited = waited & ok
            ok = waited
            if ok:  # the tokens of window i, each in rank order (combine_reduce_kernel's sum)
                first = tl.cast(i, tl.int64) * W
                n = tl.minimum(T - first, W).to(tl.int32)
                for q in range(pid, tl.cdiv(n, REDUCE_T) * channel_tiles, programs):
                    reduce_tile(q // channel_tiles, q % channel_tiles,
                                staging + parity * STAGING_PARITY, meta + parity * META_PARITY,
                                node_rows + parity * NODE_PARITY,
                                node_meta + parity * NODE_META_PARITY, ring + first * R,
                                node_ring + first * (R // N), out + first * H,
                                pair_out + first * K, live + i * R, n, H, K, R, W, N, me, KMAX,
                                HAS_PAIR, ACC_FP64, REDUCE_EVEN_H, HIER, FT, FP8, ROW_BYTES,
                                REDUCE_T, REDUCE_H, BLOCK_K, BLOCK_R, BLOCK_M)


def rounds_grid(num_sms: int | None, flavour: Flavour) -> int:
    """Programs of :func:`combine_rounds`: ``num_sms`` on GPUs (one per SM, resident together),
    one in the interpreter (its programs run one after another). The launch draws from a
    ticket word of its own (``ROUNDS_TICKET``), so its grid need not be the send's."""
    return num_sms if flavour.compiled and num_sms else 1


def reduce_tiles(compiled: bool, hidden: int, elem_bytes: int, fp8: bool, hier: bool = False):
    """The reduce's tiles in :func:`combine_rounds_kernel`: fp32 sums (fp64 for fp64 rows);
    FP8 partials, dequantized on the way, in tiles of half the channels (at DeepSeek-V3 sizes
    a full tile's sums and codes spill beside what the send holds); ``hier`` (hierarchical,
    not FP8): in tiles of fewer tokens (``kernels.tiles``)."""
    kernel = "combine_rounds_reduce_hier" if hier and not fp8 else "combine_rounds_reduce"
    return tiles(kernel, compiled, hidden, 8 if fp8 else max(4, elem_bytes))


def send_tiles(flavour: Flavour, hidden: int, elem_bytes: int, pair: bool):
    """The send's tiles of :func:`combine_rounds_kernel` (``combine_send``'s, in fp32 sums;
    over NVSHMEM with values per row, ``pair``, tiles of half the slots: ``kernels.tiles``)."""
    kernel = "combine_rounds_send_nvshmem_pair" if flavour.transport == 1 and pair \
        else "combine_send"
    return tiles(kernel, flavour.compiled, hidden, max(4, elem_bytes))


def fits_one_launch(world_size: int, ring_slots: int, hidden: int, topk: int,
                    num_sms: int | None, flavour: Flavour, elem_bytes: int, fp8: bool,
                    pair: bool = False) -> bool:
    """Whether a combine in rounds (``fp8``: of FP8 partials) runs as one launch: always in the
    interpreter; on GPUs where a round's serial trips on :func:`rounds_grid`'s programs stay
    within the gate's ``MAX_TRIPS`` (``kernels.tiles.combine_round_trips``: at DeepSeek-V3
    sizes on 20 programs, rings of up to about 1100 slots, 640 for FP8; the default budget
    gives 1088 at EP 32, 544 at EP 64, 128 at EP 256; a Buffer on GPUs cuts larger rings to
    fit, ``moe_comm.rings``). Larger rings launch per round: a reduce of their window on
    ``num_sms`` programs would be a serial kernel, a full-wave one is not. Over NVSHMEM
    (``flavour.transport == 1``) a combine with values per row (``pair``) sends in tiles of
    its own (:func:`send_tiles`)."""
    if not flavour.compiled:
        return True
    send_tile = send_tiles(flavour, hidden, elem_bytes, pair)
    reduce_tile_ = reduce_tiles(True, hidden, elem_bytes, fp8, flavour.hierarchical)
    programs = rounds_grid(num_sms, flavour)
    forwarded = world_size // flavour.ranks_per_node - 1 if flavour.hierarchical else 0
    return combine_round_trips(world_size, ring_slots, topk, hidden, programs,
                               send_tile.block_t, reduce_tile_.block_t,
                               reduce_tile_.block_h, forwarded) <= MAX_TRIPS


def combine_rounds(y, weights, pair_values, slot_rows, slot_offsets, ring, out, pair_out,
                   staging, meta, peer_ptrs, stats, tickets, epochs, signals, *, offsets: dict,
                   rank: int, topk: int, max_topk: int, rounds: int, offsets_stride: int,
                   num_sms: int | None = None, flavour: Flavour = CPU_RANKS, fp8: bool = False,
                   bound: BoundLaunches | None = None, scratch: dict | None = None,
                   live=None, decided=None, xstats=None, plan=None,
                   box_offsets: tuple = ((0, 0),) * 2, node: tuple | None = None,
                   descriptor: int = 0) -> bool:
    """Launches :func:`combine_rounds_kernel` (module docstring): the whole combine of
    ``rounds`` rounds. ``offsets``: rows / meta -> (byte offset of this rank's slice of parity
    0, bytes per parity), signal -> byte offset (``combine_send``'s); ``staging`` / ``meta``
    the whole combine_rows / combine_meta regions; ``ring`` [T, R] int32 and ``slot_offsets``
    (round i's at ``i * offsets_stride``) from the dispatch's handle; ``out`` [T, H] and
    ``pair_out`` [T, K] (None without pair values) are written. A fault-tolerant ``flavour``
    takes ``live`` [rounds, R] int32 (written: the sources each round summed) and ``decided``
    [1] int64 (the Buffer's own word, ``kernels.comm.wait_or_exclude_once``). Across nodes
    through the proxy (flat, ``flavour.transport == 2``): ``xstats`` and ``plan``
    (``kernels.internode``) say where partials for other nodes go, as ``combine_send``'s;
    across hosts over NVSHMEM (``flavour.transport == 1``) ``box_offsets`` are
    ``combine_send``'s outboxes. Hierarchical (``flavour.hierarchical``), ``node`` holds the
    home's and the forwarder's tensors: the whole hcomb_rows / hcomb_meta, hc_rows / hc_meta
    and px_combine_rows / px_combine_meta regions, the dispatch's ``node_slot_of`` (its ring
    rows per node), ``fwd_slots`` and ``fwd_n``, and the forwarder pass's ticket word
    (``FORWARD_TICKET``). ``descriptor``: the call's, in every round's signal word
    (``moe_comm.call_descriptor``; each round's wait compares them)."""
    T, H = out.shape
    R, W = staging.shape[1:3]
    row_bytes = staging.stride(2) * staging.element_size()
    if fp8:
        staging = staging.view(torch.uint8)
    has_pair = pair_out is not None
    hier = node is not None
    node_rows, node_meta, node_ring, hc_rows, hc_meta, box_rows, box_meta, fwd_slots, fwd_n, \
        fwd_tickets = node if hier else (ring,) * 10
    if fp8 and hier:
        node_rows = node_rows.view(torch.uint8)
    values = (y, weights if weights is not None else y,
              pair_values if pair_values is not None else y, slot_rows, slot_offsets, ring, out,
              pair_out if has_pair else out, ring if live is None else live, node_ring,
              fwd_slots, fwd_n, T)
    key = ("combine_rounds", H, topk, weights is None, pair_values is None,
           has_pair, id(peer_ptrs), id(stats), id(tickets), id(epochs), id(signals),
           id(staging), id(meta), staging.shape, row_bytes, id(offsets), rank,
           max_topk, rounds, offsets_stride, num_sms, id(flavour), fp8, id(scratch), id(decided),
           id(xstats), id(plan), box_offsets, hier and tuple(id(t) for t in node[:6]),
           hier and id(node[9]), descriptor)
    if call_bound(bound, key, values):
        return True
    check_one_launch(flavour, live, decided, rounds, R, plan, node)  # (once: bound)
    send_tile = send_tiles(flavour, H, y.element_size(), pair_values is not None)
    reduce_tile_ = reduce_tiles(flavour.compiled, H, y.element_size(), fp8, hier)
    grid = (rounds_grid(num_sms, flavour),)
    block_k = triton.next_power_of_2(max(topk, 1))
    compact = _scratch(scratch, y.device, grid[0] * send_tile.block_t * block_k)
    args = (
        *values[:5], compact, peer_ptrs, stats, tickets, epochs, signals, staging, meta,
        *values[5:9], ring if decided is None else decided, ring if xstats is None else xstats,
        ring if plan is None else plan, flavour.ring_addr, flavour.ring_slots,
        flavour.ranks_per_node or R, node_rows, node_meta, values[9], hc_rows, hc_meta,
        box_rows, box_meta, *values[10:12], fwd_tickets,
        fwd_n.numel() // rounds if hier else 0,
        *((node_rows.stride(0), node_meta.stride(0), hc_rows.stride(0), hc_meta.stride(0),
           box_rows.stride(0), box_meta.stride(0)) if hier else (0,) * 6),
        offsets["rows"][0],
        offsets["meta"][0], offsets["signal"], offsets["rows"][1], offsets["meta"][1],
        *(off for off, _ in box_offsets), *(stride for _, stride in box_offsets),
        staging.stride(0), meta.stride(0), row_bytes, flavour.local_base, flavour.errors_addr,
        flavour.timeout_ns, flavour.mask_off, values[12], H, topk, R, rank, W, rounds,
        offsets_stride, descriptor)
    M = R // (flavour.ranks_per_node or R)
    kwargs = dict(
        FT=flavour.fault_tolerant, TRANSPORT=flavour.transport, HIER=hier, KMAX=max_topk,
        HAS_WEIGHTS=weights is not None,
        HAS_PAIR=pair_values is not None,
        ACC_FP64=y.dtype == torch.float64, FP8=fp8, ALIGN=flavour.row_align,
        EVEN_H=even(H, send_tile.block_h), REDUCE_EVEN_H=even(H, reduce_tile_.block_h),
        BLOCK_T=send_tile.block_t, BLOCK_H=send_tile.block_h, REDUCE_T=reduce_tile_.block_t,
        REDUCE_H=reduce_tile_.block_h, BLOCK_K=block_k, BLOCK_R=triton.next_power_of_2(R),
        NUM_THREADS=send_tile.num_threads,
        IN_FLIGHT=gathers_in_flight(topk, y.element_size(), flavour.compiled),
        BLOCK_M=triton.next_power_of_2(M) if hier else 1, **flavour.launch_options(send_tile))
    launch(bound, key, combine_rounds_kernel, grid, args, kwargs,
           ("y", "weights", "pair_values", "slot_rows", "slot_offsets", "ring", "out",
            "pair_out", "live", "node_ring", "fwd_slots", "fwd_n", "T"))
    return True


def check_one_launch(flavour: Flavour, live, decided, rounds: int, world_size: int,
                     plan=None, node=None) -> None:
    """A combine's rounds in one launch reach every peer by stores, or other nodes by NVSHMEM
    puts (without fault tolerance) or through the proxy (with the Buffer's ``plan``; flat, or
    hierarchical without fault tolerance and with the forwarder's tensors ``node``);
    fault-tolerant, they take ``live`` [rounds, R] int32 and ``decided`` [1] int64, and only
    then."""
    hier = flavour.hierarchical
    if (flavour.transport == 1 and flavour.fault_tolerant) or (
            flavour.transport == 2 and plan is None) or (hier and (
                flavour.transport != 2 or flavour.fault_tolerant)) or (hier != (node is not None)):
        raise ValueError("a combine in one launch reaches every peer by stores, or other "
                         "nodes by NVSHMEM puts (without fault tolerance) or through the "
                         "proxy (hierarchical: without fault tolerance, with the forwarder's "
                         "tensors, and only then)")
    check_round_words(flavour.fault_tolerant, live, decided, rounds, world_size, "combine")
