"""A dispatch in rounds after its first send as one launch: round 0's expand, then each later
round's send, wait and expand in a loop; and the cached dispatch (the backward of combine) in
rounds as one launch, every round's send, wait and expand.

A dispatch in rounds (``moe_comm.normal_mode``) sends round 0, waits for it and computes the
received layout (round 0 fixes every row's place: every round publishes the call's per-expert
counts; where this launch follows, round 0's send does that in its last program,
``kernels.dispatch.dispatch_send``'s ``lay_out``, but hierarchical) and sizes the outputs.
Where every rank drives its Buffer from a process of its own, with waits in the kernels, the
rest is one launch instead of an expand, and a send, a received layout, a torch
add and an expand per later round. Equivalent PyTorch (``S``: ``OFFSETS_STRIDE``)::

    expand round 0's rows, as dispatch_expand_kernel, with the padding rows and slot_rows -1
    for i in range(1, rounds):                 # the tokens of window [i * W, (i + 1) * W)
        send round i's tokens, as dispatch_send_kernel   # parity (epoch0 + i) % 2
        the last program to finish: publish round i's counts and epoch0 + i to every rank
        wait until every rank published epoch0 + i       # bounded, names the rank
        n[s] = rows source s sent this rank in round i    # the counts' last column
        slot_offsets[i * S:i * S + R + 1] = end + cat([0], n.cumsum(0))  # end: earlier rounds'
        expand round i's rows, every source's tiles dealt round-robin over the programs

The cached form (``CACHED``) needs no layout: the earlier dispatch's handle gives every
round's slot offsets and ``slot_rows``. The host takes every round's epoch and launches once::

    zero the padding rows of out
    for i in range(rounds):
        send round i's rows (no metadata, no counts), publish epoch0 + i, wait for every rank
        expand round i's rows by slot_rows, slot_offsets[i * S:i * S + R + 1] the handle's

It cannot deadlock for the reasons of ``kernels.combine_rounds``: a wait of round ``i`` needs
every rank's send of round ``i``, issued before any rank's wait of round ``i``; the send of
round ``i + 1`` writes the parity its destination last read in round ``i - 1``, which every
program of the destination expanded before it sent round ``i`` (the round the sender waited
for, published by the destination's last program); the cached form's round 0 (epoch ``E``)
writes what every destination read in epoch ``E - 2`` before it published ``E - 1``, which the
sender's earlier op waited for, as any call's first send does. Every program waits for its own
rank's epoch, published by the launch's last program: on GPUs the grid is ``num_sms`` programs
(one per SM, resident together, as DeepEP's persistent kernels), in the interpreter one
program. The launch draws from a ticket word of its own (``ROUNDS_TICKET``), so its grid need
not be the send's. Each program keeps the running end of the slot offsets in registers: program
0 writes each round's offsets, which no program reads back. The -1 rows of ``slot_rows`` past
round 0's slots are stored by each program before its first send, so before any later round's
rows there (they wait for that send); the cached form writes neither (they are the handle's).

Over NVSHMEM (``TRANSPORT`` 1, across hosts): each round sends as ``dispatch_send_kernel``
does there, each token's row once into the outbox of the round's parity and a put per
destination without a pointer, the counts by a put and the epoch by ``signal_set`` after them.
Every program's puts are complete (``quiet``) before it draws its ticket, so the outbox of a
parity, written again two rounds later, was read by its puts before the round between began.

Through the proxy (``TRANSPORT`` 2: flat, fault-tolerant too), each round's send stores
the rows and metadata for ranks on other nodes into this rank's outboxes of the round's parity
(``kernels.dispatch.send_tokens``' ``PROXY_BOX``) and its last program, after the counts and
epoch to the ranks of its node, posts one descriptor per rank on another node (its counts,
then its rows and metadata; the cached form: its rows, ``counts`` giving their number; the
proxy raises the epoch there after them, ``kernels.internode.post_dispatch_flat``). The outbox
of a parity is written again two rounds later, after this rank's wait of the round between:
that needs the epoch of every rank on another node, which each publishes only after its own
wait of the earlier round, which needed this rank's transfer of that round to have landed. So
the argument above holds with the proxy as one more link, as in ``kernels.combine_rounds``.

Hierarchical through the proxy (``HIER``, without fault tolerance; the cached form too): each
round's send stores the window's rows for the ranks of this node (``send_tokens``, stores
only), then every program stores its token tiles' rows for other nodes into this rank's
outboxes of the round's parity, each row once per node at its row in that node's message
(``kernels.internode.outbox_rows``, by ``node_ring``); the round's last program, after the
counts and epoch to the ranks of its node, posts one descriptor per other node to its
forwarder (the rank there with this local index: ``kernels.internode.post_node_messages``,
``node_counts`` rows; the proxy raises ``node_signals`` there after them). Then every program
runs the round's forwarder pass: a bounded wait for the message of the round from every other
node (a timeout names the rank that sends it), the row tiles of all the messages dealt over
the programs together and stored into the staging of every rank of this node that gets them
(``kernels.internode.forward_messages``, writing the round's ``fwd_slots`` and ``fwd_n``; the
cached form reads the handle's), and the pass's last program, on a ticket word of its own
(``FORWARD_TICKET``), copies those sources' counts and publishes their epochs on every rank of
this node (``kernels.internode.publish_forwarded``). The round's wait and expand follow.
Equivalent PyTorch, for round ``i`` of forwarder ``f`` and each other node ``a`` (``s``: the
rank of node ``a`` with ``f``'s local index)::

    send round i to the ranks of this node; px_rows[parity, b][node_ring[t, b]] = x[t]
    the last program: counts and epoch to this node's ranks; a descriptor per node b
    wait until node_signals[a] >= epoch for every other node a    # bounded, names s
    for d in this node: staging_d[parity, s][fwd_slot[a, j, d]] = fwd_rows[parity, a, j]
    the last program of the pass: counts and epoch of s on every rank of this node

It adds no wait that can close a cycle: the pass of round ``i`` waits only for the messages of
round ``i``, each posted by its sender's last program of the round's send, before that sender
waits for anything in the round; a rank's wait of round ``i`` needs the epochs its node's
forwarders publish after their own passes of round ``i``, which need only sends. The regions
of a parity are written again two rounds later only after they were read: this rank's outboxes
after its wait of the round between, which needs the epoch of every rank of the other nodes,
relayed by this node's forwarders after their passes of it, whose messages their senders post
only after their own waits of the round before, which needed this rank's transfer of that
round, posted after its outboxes were filled and read by the proxy before it raised the
signal; a forwarder's ``fwd_*`` by the sender's message two rounds later, posted after the
sender's wait of the round between, which needs the forwarder's own epoch of that round: the
sender relays it (they share a local index) after the forwarder's message of it, which the
forwarder posts only after every one of its programs has finished its pass (its reads of
``fwd_*``) of the round before; the staging of this node as the one-node argument above, the
forwarder storing for the source.
Round 0 (not cached) is not in the launch: its send, outbox, forwarder pass and received layout
are launches of their own before it (a send that laid round 0 out itself would wait for sources
this rank forwards only after it).

Fault tolerance (``FT``; ``moe_comm.fault``, "In rounds"): each program first writes every
output row as a padding row (zero, source -1, weight 0; ``slot_rows`` -1 past round 0's
slots), then waits for every program of the launch (``kernels.comm.after_every_program``: the
last to draw a ticket publishes the call's epoch in a word of the Buffer, the others wait for
it), so that no fill lands on a row another program expanded; a source that stops between
rounds leaves its later rows so. Each round's wait is ``kernels.comm.wait_or_exclude_once``:
program 0 waits, excludes a source silent until the deadline and writes who arrived into row
``i`` of ``live``; every program expands the round's rows of the sources in that row and in
row 0 (round 0's, written by the laying-out send; the cached form decides round 0 here too and
takes each round's row alone). Program 0 waits only for sources and the others for program 0
or for programs that have drawn their ticket: the argument above holds::

    live[i] = the sources whose epoch base + i arrived (program 0; the others read it)
    n[s] = n[s] if live[i][s] and live[0][s] else 0      # the cached form: live[i][s]
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bound import BoundLaunches, call_bound, launch
from .comm import (
    CPU_RANKS,
    INPUT_RECORD,
    TOO_MANY_ROWS,
    Flavour,
    after_every_program,
    check_round_words,
    draw_last_of,
    record_error,
    slots_in,
    timed_out,
    uniform_now_ns,
    wait_relayed,
    wait_round,
)
from .dispatch import expand_padding, expand_rows, publish_counts, send_tokens
from .internode import (
    forward_messages,
    forward_tiles,
    outbox_rows,
    post_dispatch_flat,
    post_node_messages,
    publish_forwarded,
)
from .quant import NVFP4, scale_group
from .rows import row_payload, sent_elem_bytes
from .tiles import MAX_TRIPS, ZERO_TILES, dispatch_round_trips, even, tiles

ROUNDS_TICKET = 5  # the word of ``tickets`` this kernel draws from (kernels.internode: 2-4)
FORWARD_TICKET = 9  # and the word its forwarder's pass draws from (HIER; combine_rounds: 8)
_PER_CALL = ["rows_off", "meta_off", "counts_off", "signal_off", "local_base", "errors_addr",
             "timeout_ns", "T", "max_rows", "me", "mask_off"]


@triton.jit
def _expand_round(pid, programs, ends, n, parity, src, staging, staging_f32, meta, row_base,
                  slot_rows, out, out_scales, out_global, out_weights, out_src_rank,
                  out_src_token, STAGING_PARITY, META_PARITY, max_rows, W, OUT_H, K, L, me, G,
                  SCALES, ROW_ELEMS, SCALE_ROW_STRIDE, SCALE_GROUP_STRIDE,
                  META_STRIDE: tl.constexpr, KMAX: tl.constexpr, CACHED: tl.constexpr,
                  HAS_WEIGHTS: tl.constexpr, FP8: tl.constexpr, UE8M0: tl.constexpr,
                  GLOBAL: tl.constexpr, EVEN_H: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
    """Program ``pid``'s tiles of a round's rows (``n`` [BLOCK_R] slots per source, ending at
    ``ends`` in slot_rows; staged in parity ``parity``): the tiles of every source's slots in
    turn, dealt round-robin; tile t of source s is ``expand_rows``' program t of as many as s
    has tiles."""
    src_tiles = (n + BLOCK_T - 1) // BLOCK_T
    tiles_end = tl.cumsum(src_tiles, axis=0)
    rows_parity_off = parity * STAGING_PARITY
    for w in range(pid, tl.sum(src_tiles, axis=0), programs):
        s = tl.sum((tiles_end <= w).to(tl.int32), axis=0)
        at_s = src == s
        expand_rows(s, tl.sum(tl.where(at_s, ends - n, 0), axis=0),
                    tl.sum(tl.where(at_s, n, 0), axis=0).to(tl.int32),
                    (w - tl.sum(tl.where(at_s, tiles_end - src_tiles, 0), axis=0)).to(tl.int32),
                    tl.sum(tl.where(at_s, src_tiles, 0), axis=0).to(tl.int32),
                    staging + rows_parity_off,
                    staging_f32 + rows_parity_off
                    * staging.dtype.element_ty.primitive_bitwidth // 32,
                    meta + parity * META_PARITY, row_base, slot_rows, out, out_scales,
                    out_global, out_weights, out_src_rank, out_src_token, max_rows, W, OUT_H, K,
                    L, me, G, SCALES, ROW_ELEMS, SCALE_ROW_STRIDE, SCALE_GROUP_STRIDE,
                    META_STRIDE, KMAX, CACHED, HAS_WEIGHTS, FP8, UE8M0, GLOBAL, EVEN_H, False,
                    BLOCK_T, BLOCK_H, BLOCK_K, BLOCK_G)


@triton.jit
def _forward_round(pid, programs, epoch, parity, plan, peer_ptrs, fwd_slots, fwd_n,
                   node_signals, fwd_tickets, xstats, local_base, errors, timeout_ns, W, L, R,
                   N, me, ROW_BYTES, PAYLOAD, META_STRIDE: tl.constexpr,
                   NODE_META: tl.constexpr, CACHED: tl.constexpr, ALIGN: tl.constexpr,
                   FWD_T: tl.constexpr, FWD_B: tl.constexpr, FWD_M: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, NUM_THREADS: tl.constexpr):
    """The forwarder's pass of a hierarchical round (module docstring, "Hierarchical"): a
    bounded wait for the message of ``epoch`` from every other node (a timeout names its
    source, the rank of that node with this local index), the row tiles of all the messages
    dealt over the programs (``kernels.internode.forward_messages``), and the pass's last
    program, on a ticket
    word of its own, publishes the sources' counts and epochs on this node
    (``kernels.internode.publish_forwarded``). Returns whether the wait was met."""
    ok = wait_relayed(node_signals, R // N, epoch, uniform_now_ns(NUM_THREADS) + timeout_ns,
                      errors, me % N, N, BLOCK_R, NUM_THREADS)
    forwarded = tl.zeros([1], tl.int64)
    if ok:
        forwarded = forward_messages(pid, programs, parity, plan, peer_ptrs, fwd_slots, fwd_n,
                                     local_base, W, L, R, N, me, ROW_BYTES, PAYLOAD, META_STRIDE,
                                     NODE_META, CACHED, ALIGN, FWD_T, FWD_B, FWD_M, BLOCK_R)
    tl.atomic_add(xstats + 2 + tl.arange(0, 1), forwarded, sem="relaxed")
    if draw_last_of(fwd_tickets, programs):
        if ok and not timed_out(errors, NUM_THREADS):
            publish_forwarded(plan, peer_ptrs, parity, epoch, local_base, R, L, N, me, CACHED,
                              BLOCK_C)
    return ok


@triton.jit(do_not_specialize=_PER_CALL)
def dispatch_rounds_kernel(
    # the send: the call's tensors, round i's window at token i * W
    x,  # [T, X_ROW] rows (FP8 == 2: uint8 codes), as dispatch_send_kernel's
    x_scales,  # as dispatch_send_kernel's; per token (SCALE_ROW elements a token) or global
    topk_idx, topk_weights, pair_pos,  # [T, K]
    ring,  # [T, R] int32: the ring position of token t on rank d in its round, -1 if none
    counts,  # int32: round i's [R, L + 1] counts at i * COUNTS_STRIDE (the cached form with
             # PROXY_BOX: round i's [R] rows to each rank)
    peer_ptrs, stats,  # as dispatch_send_kernel's
    tickets,  # [1] int64 local: this kernel's own ticket word (ROUNDS_TICKET)
    epochs,  # [1] int64 local: the dispatch channel's epoch (round 0's at the launch)
    signals,  # [R] int64 local: the dispatch channel's signal words
    # the receive
    staging, staging_f32,  # the whole dispatch_rows region (FP8: uint8) and its float32 view
    meta,  # the whole dispatch_meta region [2, R, W, META_STRIDE] int32
    dcounts,  # the whole dispatch_counts region [2, R, L + 1] int32
    row_base, tokens_per_expert, expert_offsets,  # round 0's received layout
    slot_rows,  # [SLOTS, K] int32 out: as the expand's
    slot_offsets,  # int64: round i's [R + 1] at i * OFFSETS_STRIDE (round 0's given, the rest
                   # and the gaps between them written here)
    out, out_scales, out_global, out_weights, out_src_rank, out_src_token,  # as the expand's
    live,  # FT: [ROUNDS, R] int32, row i: the sources that arrived in round i (row 0 written by
           # round 0's send, the cached form here), the rest written here by program 0
    ft_words,  # FT: [2] int64 local, only growing: [0] each round's decision (2 * epoch + ok,
               # kernels.comm.wait_or_exclude_once), [1] the epoch whose outputs are filled
    mask_off: tl.int64,  # FT: the mask words in this rank's segment
    rows_off: tl.int64, meta_off: tl.int64, counts_off: tl.int64, signal_off: tl.int64,
    rows_parity: tl.int64, meta_parity: tl.int64, counts_parity: tl.int64,  # bytes
    box_rows_off: tl.int64, box_meta_off: tl.int64, box_counts_off: tl.int64,  # TRANSPORT 1:
    box_rows_parity: tl.int64, box_meta_parity: tl.int64,  # the outboxes, as the send's
    box_counts_parity: tl.int64,  # (PROXY_BOX: px_rows, px_meta, px_counts, target 0)
    plan,  # PROXY_BOX, HIER: [PLAN_FIELDS] int64 byte offsets (kernels.internode)
    xstats,  # PROXY_BOX, HIER: [4] int64 local, outbox bytes at [0] (HIER: forwarded at [2])
    node_ring,  # HIER: [T, M] int32, the row of token t in node b's message of its round, or -1
    node_counts,  # HIER: int32, round i's [M] (the rows of each node's message) at i * M
    fwd_slots,  # HIER: int32 out, round i's [M, W, N] (each forwarded row's slot on each rank
                # of this node) at i * M * W * N
    fwd_n,  # HIER: int32 out, round i's [M] (the rows of each node's message) at i * FWD_N_STRIDE
    node_signals,  # HIER: [M] int64 local, the epoch of node a's message to this forwarder
    fwd_tickets,  # HIER: [1] int64 local, the ticket word of the forwarder's pass
    ring_addr: tl.int64, RING_SLOTS: tl.int32,  # PROXY_BOX: the proxy's ring
    STAGING_PARITY: tl.int64, META_PARITY: tl.int64, COUNT_PARITY: tl.int64,  # elements
    local_base: tl.int64, errors_addr: tl.int64, timeout_ns: tl.int64,
    T: tl.int32, W: tl.int32, ROUNDS: tl.int32, N: tl.int32, FWD_N_STRIDE: tl.int32,
    X_ROW: tl.int64, SCALE_ROW: tl.int64, COUNTS_STRIDE: tl.int64, OFFSETS_STRIDE: tl.int32,
    max_rows: tl.int64, SLOTS: tl.int64, H: tl.int32, OUT_H: tl.int32, K: tl.int32,
    R: tl.int32, L: tl.int32, me: tl.int32, ROW_BYTES: tl.int64, G: tl.int32,
    SCALES: tl.int32, ROW_ELEMS: tl.int64, SCALE_ROW_STRIDE: tl.int64,
    SCALE_GROUP_STRIDE: tl.int64,
    META_STRIDE: tl.constexpr, KMAX: tl.constexpr,
    CACHED: tl.constexpr,  # the cached form (module docstring): rows only, round 0 here too
    FT: tl.constexpr,  # fault tolerance (module docstring)
    TRANSPORT: tl.constexpr,  # 0: every peer by stores; 1: NVSHMEM where a pointer is 0;
                              # 2: the proxy (flat: PROXY_BOX)
    PROXY_BOX: tl.constexpr,  # kernels.dispatch.send_tokens' (module docstring)
    HIER: tl.constexpr,  # hierarchical through the proxy (module docstring)
    NODE_META: tl.constexpr,  # HIER: int32 words of a node message's row
    HAS_WEIGHTS: tl.constexpr,
    FP8: tl.constexpr, UE8M0: tl.constexpr, GS: tl.constexpr, GLOBAL: tl.constexpr,
    ALIGN: tl.constexpr, EVEN_H: tl.constexpr, EXPAND_EVEN_H: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,  # the send's tiles
    EXPAND_T: tl.constexpr, EXPAND_H: tl.constexpr,  # the expand's tiles
    BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_Z: tl.constexpr, NUM_THREADS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,  # HIER: N's and N * (L + 1) + 1's powers of 2
    FWD_T: tl.constexpr, FWD_B: tl.constexpr, FWD_M: tl.constexpr,  # HIER: the pass's tiles
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    errors = errors_addr.to(tl.pointer_type(tl.int64))
    # round 0's epoch (the cached form: the epoch before it), read before any program draws
    # a ticket
    base = tl.load(epochs) + CACHED
    src = tl.arange(0, BLOCK_R)
    sm = src < R
    end = tl.load(slot_offsets + R)
    total = tl.load(expert_offsets + L)
    if pid == 0:
        if total > max_rows:
            record_error(errors, INPUT_RECORD, TOO_MANY_ROWS, total, max_rows)
    ok = ~timed_out(errors, NUM_THREADS)  # read once, outside the rounds (host memory)
    # every row no slot fills, each program before its first send (later rounds' slots are
    # stored after every program's -1 past round 0's, which they wait for; rows no slot of
    # round 0 fills, disjoint from what its expand writes); FT: every output row a padding
    # row first (as from row 0: total := 0), then every program of the launch, then the rows
    padded_from = total
    if FT:
        padded_from = 0
    expand_padding(pid, programs, expert_offsets, tokens_per_expert, padded_from, end,
                   slot_rows, out, out_scales, out_global, out_weights, out_src_rank,
                   out_src_token, max_rows, SLOTS, OUT_H, K, L, G, SCALE_ROW_STRIDE,
                   SCALE_GROUP_STRIDE, CACHED, HAS_WEIGHTS, FP8 != 0, UE8M0, GLOBAL,
                   EXPAND_EVEN_H, False, EXPAND_H, BLOCK_K, BLOCK_G, BLOCK_Z)
    if FT:
        ok = ok & after_every_program(tickets, programs, ft_words + 1, base,
                                      uniform_now_ns(NUM_THREADS) + timeout_ns, errors, me,
                                      BLOCK_R, NUM_THREADS)
    if not CACHED:
        ends = tl.load(slot_offsets + src + 1, mask=sm, other=0)  # round 0's (received layout)
        n = ends - tl.load(slot_offsets + src, mask=sm, other=0)
        _expand_round(pid, programs, ends, n, base % 2, src, staging, staging_f32, meta,
                      row_base, slot_rows, out, out_scales, out_global, out_weights,
                      out_src_rank, out_src_token, STAGING_PARITY, META_PARITY, max_rows, W,
                      OUT_H, K, L, me, G, SCALES, ROW_ELEMS, SCALE_ROW_STRIDE,
                      SCALE_GROUP_STRIDE, META_STRIDE, KMAX, False, HAS_WEIGHTS, FP8 != 0,
                      UE8M0, GLOBAL, EXPAND_EVEN_H, EXPAND_T, EXPAND_H, BLOCK_K, BLOCK_G)
    first_live = sm
    if FT and not CACHED:  # a later round places rows by round 0's layout: its sources only
        first_live = tl.load(live + src, mask=sm, other=0) != 0
    for i in range(1 - CACHED, ROUNDS):
        if ok:
            epoch = base + i
            parity = epoch % 2
            first = tl.cast(i, tl.int64) * W
            send_tokens(pid, programs, x + first * X_ROW, x_scales + first * SCALE_ROW,
                        topk_idx + first * K, topk_weights + first * K, ring + first * R,
                        pair_pos + first * K, peer_ptrs, stats, rows_off + parity * rows_parity,
                        meta_off + parity * meta_parity, box_rows_off + parity * box_rows_parity,
                        box_meta_off + parity * box_meta_parity, local_base,
                        tl.minimum(T - first, W).to(tl.int32), (first + 0).to(tl.int32), H, K,
                        R, me, ROW_BYTES, plan, xstats, META_STRIDE, KMAX, not CACHED,
                        HAS_WEIGHTS, FP8, UE8M0, GS, TRANSPORT, PROXY_BOX, ALIGN, EVEN_H,
                        BLOCK_T, BLOCK_H, BLOCK_K)
            if HIER:  # the window's rows for other nodes, once per node, into the outboxes
                outbox_rows(pid, programs, x + first * X_ROW, x_scales + first * SCALE_ROW,
                            topk_idx + first * K, topk_weights + first * K,
                            pair_pos + first * K, ring + first * R,
                            node_ring + first * (R // N), plan, xstats, parity, local_base,
                            tl.minimum(T - first, W).to(tl.int32), (first + 0).to(tl.int32), H,
                            K, R, N, me, ROW_BYTES, META_STRIDE, NODE_META, KMAX, not CACHED,
                            HAS_WEIGHTS, FP8, UE8M0, GS, ALIGN, EVEN_H, BLOCK_T, BLOCK_H,
                            BLOCK_K, BLOCK_N)
            if draw_last_of(tickets, programs):
                publish_counts(counts + i * COUNTS_STRIDE, peer_ptrs, stats,
                               counts_off + parity * counts_parity, signal_off,
                               box_counts_off + parity * box_counts_parity, local_base, epoch,
                               R, L, not CACHED, TRANSPORT, BLOCK_L)
                if PROXY_BOX:
                    post_dispatch_flat(plan, counts + i * COUNTS_STRIDE, peer_ptrs, parity,
                                       epoch, R, L, row_payload(x, H, FP8, UE8M0, GS),
                                       ROW_BYTES, META_STRIDE, local_base, ring_addr,
                                       RING_SLOTS, errors_addr, timeout_ns, not CACHED,
                                       BLOCK_L)
                if HIER:  # one descriptor per node, to its forwarder
                    post_node_messages(plan, counts + i * COUNTS_STRIDE,
                                       node_counts + i * (R // N), parity, epoch,
                                       row_payload(x, H, FP8, UE8M0, GS), L, N, R, me,
                                       ROW_BYTES, NODE_META, not CACHED, local_base, ring_addr,
                                       RING_SLOTS, errors_addr, timeout_ns, BLOCK_C)
                tl.store(epochs + tl.arange(0, 1), epoch + tl.zeros([1], tl.int64))
            relayed = True
            if HIER:  # the forwarder's pass: every other node's message into this node
                relayed = _forward_round(pid, programs, epoch, parity, plan, peer_ptrs,
                                         fwd_slots + i * (R // N) * W * N,
                                         fwd_n + i * FWD_N_STRIDE, node_signals, fwd_tickets,
                                         xstats, local_base, errors, timeout_ns, W, L, R, N,
                                         me, ROW_BYTES, row_payload(x, H, FP8, UE8M0, GS),
                                         META_STRIDE, NODE_META, CACHED, ALIGN, FWD_T, FWD_B,
                                         FWD_M, BLOCK_R, BLOCK_C, NUM_THREADS)
            # (FT: program 0 decides who arrived, for every program)
            ok = wait_round(pid, epoch, signals, errors, timeout_ns, live + i * R, ft_words,
                            mask_off, local_base, peer_ptrs, R, me, FT, TRANSPORT, BLOCK_R,
                            NUM_THREADS) & relayed
            if ok:  # the round's slots of every source, after the earlier rounds'
                view = slot_offsets + i * OFFSETS_STRIDE
                arrived = first_live
                if FT:
                    arrived = arrived & (tl.load(live + i * R + src, mask=sm, other=0) != 0)
                if CACHED:  # the dispatch's (the handle's)
                    ends = tl.load(view + src + 1, mask=sm, other=0)
                    n = tl.where(arrived, ends - tl.load(view + src, mask=sm, other=0), 0)
                else:
                    n = slots_in(tl.load(dcounts + parity * COUNT_PARITY + src * (L + 1) + L,
                                         mask=arrived, other=0).to(tl.int64))
                    ends = end + tl.cumsum(n, axis=0)
                    if pid == 0:  # (and zeros between the earlier round's offsets and these)
                        tl.store(view + src + 1, ends, mask=sm)
                        tl.store(view + tl.arange(0, 1), end + tl.zeros([1], tl.int64))
                        tl.store(view - OFFSETS_STRIDE + R + 1 + src, tl.zeros_like(ends),
                                 mask=src < OFFSETS_STRIDE - R - 1)
                _expand_round(pid, programs, ends, n, parity, src, staging, staging_f32, meta,
                              row_base, slot_rows, out, out_scales, out_global, out_weights,
                              out_src_rank, out_src_token, STAGING_PARITY, META_PARITY,
                              max_rows, W, OUT_H, K, L, me, G, SCALES, ROW_ELEMS,
                              SCALE_ROW_STRIDE, SCALE_GROUP_STRIDE, META_STRIDE, KMAX, CACHED,
                              HAS_WEIGHTS, FP8 != 0, UE8M0, GLOBAL, EXPAND_EVEN_H, EXPAND_T,
                              EXPAND_H, BLOCK_K, BLOCK_G)
                end = end + tl.sum(n, axis=0)


def rounds_grid(num_sms: int | None, flavour: Flavour) -> int:
    """Programs of :func:`dispatch_rounds`: ``num_sms`` on GPUs (one per SM, resident
    together), one in the interpreter (its programs run one after another)."""
    return num_sms if flavour.compiled and num_sms else 1


def round_tiles(flavour: Flavour, hidden: int, fp8: int, ue8m0: int, x_elem_bytes: int,
                out_elem_bytes: float):
    """``(send, expand)`` tiles of :func:`dispatch_rounds_kernel` for a send of format
    ``(fp8, ue8m0)`` of rows of ``x_elem_bytes``: one program per SM with the expand's warps
    (``kernels.tiles``); a send that quantizes to NVFP4, or any that quantizes over NVSHMEM
    or hierarchical through the proxy (beside an outbox), in tiles of its own."""
    send = "dispatch_rounds_send"
    if fp8 == 1 and flavour.transport == 1:
        send = "dispatch_rounds_send_nvshmem_quantizing"
    elif fp8 == 1 and flavour.transport == 2 and flavour.hierarchical:
        send = "dispatch_rounds_send_hier_quantizing"
    elif fp8 == 1 and ue8m0 == NVFP4:
        send = "dispatch_rounds_send_nvfp4"
    return (tiles(send, flavour.compiled, hidden, sent_elem_bytes(fp8, ue8m0, x_elem_bytes)),
            tiles("dispatch_rounds_expand", flavour.compiled, hidden, out_elem_bytes))


def fits_one_launch(world_size: int, ring_slots: int, hidden: int, topk: int,
                    num_sms: int | None, flavour: Flavour, fp8: int, ue8m0: int,
                    x_elem_bytes: int) -> bool:
    """Whether a dispatch's rounds after its first send run as one launch (``fp8``, ``ue8m0``:
    the send's format, ``x_elem_bytes`` the caller's rows'): always in the interpreter; on GPUs
    where a round's serial trips on :func:`rounds_grid`'s programs stay within ``MAX_TRIPS``
    (``kernels.tiles.dispatch_round_trips``; a send that quantizes to NVFP4 in tiles of half
    the tokens; over NVSHMEM every send that quantizes, in tiles of a quarter, NVFP4 half).
    At DeepSeek-V3 sizes on 20 programs, in multiples of 16: rings of up to 864 slots at EP 8,
    560 at EP 64, 336 at EP 256 and 64 at EP 1024 (quantizing to NVFP4: 800, 512, 320, 64);
    the default budget gives 128 at EP 256 and 32 at EP 1024 (one launch), 544 at EP 64 and
    1088 at EP 32 (which a Buffer on GPUs cuts to 512 and 576 so that every format fits,
    ``moe_comm.rings``). Larger rings launch per round: an expand of their window on
    ``num_sms`` programs would be a serial kernel."""
    if not flavour.compiled:
        return True
    elem = sent_elem_bytes(fp8, ue8m0, x_elem_bytes)
    send, expand = round_tiles(flavour, hidden, fp8, ue8m0, x_elem_bytes, elem)
    programs = rounds_grid(num_sms, flavour)
    hier = flavour.transport == 2 and flavour.hierarchical
    return dispatch_round_trips(world_size, ring_slots, topk, programs, send.block_t,
                                expand.block_t,
                                hier and world_size // flavour.ranks_per_node - 1,
                                forward_tiles(flavour)[0].block_t) <= MAX_TRIPS


_VARYING = ("x", "x_scales", "topk_idx", "topk_weights", "pair_pos", "ring", "counts",
            "row_base", "tokens_per_expert", "expert_offsets", "slot_rows", "slot_offsets",
            "out", "out_scales", "out_global", "out_weights", "out_src_rank", "out_src_token",
            "T", "COUNTS_STRIDE", "max_rows", "node_ring", "node_counts", "fwd_slots", "fwd_n")


def dispatch_rounds(x, x_scales, topk_idx, topk_weights, pair_pos, ring, counts, row_base,
                    tokens_per_expert, expert_offsets, slot_rows, slot_offsets, out,
                    out_weights, out_src_rank, out_src_token,
                    staging, meta, dcounts, peer_ptrs, stats, tickets, epochs, signals, *,
                    offsets: dict, rank: int, num_local_experts: int, meta_stride: int,
                    max_topk: int, ring_slots: int, rounds: int, offsets_stride: int,
                    row_bytes: int, fp8: int = 0, ue8m0: int = 0, out_scales=None,
                    scale_strides=(0, 0), out_global=None, num_sms: int | None = None,
                    flavour: Flavour = CPU_RANKS, bound: BoundLaunches | None = None,
                    live: torch.Tensor | None = None,
                    ft_words: torch.Tensor | None = None, box_offsets=((0, 0),) * 3,
                    plan: torch.Tensor | None = None,
                    xstats: torch.Tensor | None = None, node: tuple | None = None,
                    node_meta_stride: int = 0) -> bool:
    """Launches :func:`dispatch_rounds_kernel` (module docstring): rounds ``1..rounds - 1`` of
    a dispatch whose round 0 was sent, laid out and expanded. The send's arguments are
    ``dispatch_send``'s for the whole call (``counts`` [rounds, R, L + 1], ``ring`` the ring
    positions), the receive's ``dispatch_expand``'s (``row_base``: round 0's;
    ``slot_offsets`` every round's, round ``i``'s at ``i * offsets_stride``, written here past
    round 0's); ``staging`` / ``meta`` / ``dcounts`` the whole dispatch_rows / dispatch_meta /
    dispatch_counts regions; ``offsets`` the send's (``kernels.dispatch.dispatch_send``).

    With ``topk_idx=None`` the cached form (the backward of combine): every round, round 0
    too, sends ``x``'s rows alone to ``ring`` and expands them into ``out`` by the earlier
    dispatch's ``slot_rows`` and ``slot_offsets`` (zero in padding); ``x_scales``,
    ``topk_weights``, ``pair_pos``, ``row_base`` and the source outputs are None, and
    ``counts`` too but through the proxy, flat: there [rounds, R] int32, the rows each round
    sends each rank.

    With ``flavour.fault_tolerant``: ``live`` [rounds, R] int32 (row 0 round 0's sources, as
    its laying-out send wrote them; the cached form writes it here) gets each later round's
    sources, ``ft_words`` [2] int64 are the Buffer's words of the decisions (module
    docstring).

    Across nodes over NVSHMEM (``flavour.transport == 1``) ``box_offsets`` are the send's
    (offset, parity stride) of the rdma_rows / rdma_meta / rdma_counts outboxes: each round
    sends as ``dispatch_send_kernel`` does there (module docstring, "Over NVSHMEM"); through
    the proxy, flat (``flavour.transport == 2``), those of px_rows / px_meta / px_counts, with
    ``plan`` and ``xstats`` (module docstring, "Through the proxy"); hierarchical, ``plan``,
    ``xstats`` and ``node`` = ``(node_ring [T, M], node_counts [rounds, M], fwd_slots
    [rounds * M, W, N], fwd_n [rounds * S], node_signals [M] int64, forwarder ticket [1])``
    (``kernels.layout.ring_positions``' node outputs, ``NormalMode._forward_slots``' tensors,
    this rank's node_signals of the dispatch, its ticket word; module docstring,
    "Hierarchical") with ``node_meta_stride`` the words of a node message's row."""
    cached = topk_idx is None
    hier = flavour.transport == 2 and flavour.hierarchical
    if flavour.transport not in (0, 1, 2) or (flavour.transport == 1
                                              and flavour.fault_tolerant) \
            or (hier and flavour.fault_tolerant):
        raise ValueError("a dispatch's rounds in one launch reach every peer by stores,"
                         " NVSHMEM puts (without fault tolerance), or the proxy's flat or"
                         " hierarchical transfers (hierarchical: without fault tolerance)")
    box = flavour.proxy_box
    if box and (plan is None or xstats is None or counts is None):
        raise ValueError("rounds through the proxy take plan, xstats and counts")
    if hier != (node is not None) or hier and (plan is None or xstats is None
                                                or len(node) != 6 or not node_meta_stride):
        raise ValueError("hierarchical rounds take plan, xstats, node (node_ring, node_counts,"
                         " fwd_slots, fwd_n, node_signals, tickets) and node_meta_stride;"
                         " other rounds no node")
    ft = flavour.fault_tolerant
    check_round_words(ft, live, ft_words, rounds, peer_ptrs.numel(), "dispatch")
    T, H = x.shape
    if fp8 == 2 and ue8m0 == NVFP4:  # x: two e2m1 codes per byte
        H *= 2
    has_weights = topk_weights is not None
    quantized = out_scales is not None
    nvfp4 = quantized and ue8m0 == NVFP4
    if fp8 == 2:
        x = x.view(torch.uint8)
        x_scales = x_scales.view(torch.uint8) if ue8m0 else x_scales
    dummy = slot_offsets
    out8 = out.view(torch.uint8) if quantized else out
    scales8 = (out_scales.view(torch.uint8) if ue8m0 else out_scales) if quantized else dummy
    per_token = (dummy,) * 3 if cached else (topk_idx, topk_weights if has_weights else dummy,
                                             pair_pos)
    layout = (counts if box else dummy, dummy) if cached else (counts, row_base)
    sources = (dummy,) * 3 if cached else (out_weights if has_weights else dummy, out_src_rank,
                                           out_src_token)
    values = (x, dummy if x_scales is None else x_scales, *per_token, ring,
              *layout, tokens_per_expert, expert_offsets, slot_rows, slot_offsets, out8,
              scales8, out_global if nvfp4 else dummy, *sources, T,
              0 if counts is None else counts.stride(0), out.shape[0],
              *(node[:4] if hier else (dummy,) * 4))
    key = ("dispatch_rounds", H, out.shape[1], slot_rows.shape[1], x_scales is None, has_weights,
           quantized, id(peer_ptrs), id(stats), id(tickets), id(epochs), id(signals), id(staging),
           id(meta), id(dcounts), id(offsets), rank, num_local_experts, meta_stride, max_topk,
           ring_slots, rounds, offsets_stride, row_bytes, fp8, ue8m0, scale_strides, num_sms,
           id(flavour), cached, id(live) if ft else None, id(ft_words) if ft else None, box_offsets,
           id(plan) if box or hier else None, id(xstats) if box or hier else None,
           id(node[4]) if hier else None, id(node[5]) if hier else None, node_meta_stride)
    if call_bound(bound, key, values):
        return True
    R, L, K = peer_ptrs.numel(), num_local_experts, slot_rows.shape[1]
    N = flavour.ranks_per_node if hier else 1
    fwd_tile, fwd_b = forward_tiles(flavour)
    send_tile, expand_tile = round_tiles(flavour, H, fp8, ue8m0, x.element_size(),
                                         out.element_size())
    programs = rounds_grid(num_sms, flavour)
    stg = staging.view(torch.uint8) if quantized else staging
    groups = (2 * out.shape[1] if nvfp4 else out.shape[1]) // scale_group(ue8m0) \
        if quantized else 0
    per_row = 4 * triton.cdiv(groups, 4) if quantized and ue8m0 else groups
    scale_row = x_scales.stride(0) if fp8 == 2 else 0  # per token, or one global scale
    args = (
        *values[:7], peer_ptrs, stats, tickets, epochs, signals, stg,
        stg.view(torch.float32) if quantized else dummy, meta, dcounts, *values[7:18],
        live if ft else dummy, ft_words if ft else dummy, flavour.mask_off if ft else 0,
        offsets["rows"][0], offsets["meta"][0],
        offsets["counts"][0], offsets["signal"], offsets["rows"][1], offsets["meta"][1],
        offsets["counts"][1], *(off for off, _ in box_offsets),
        *(stride for _, stride in box_offsets), plan if box or hier else dummy,
        xstats if box or hier else dummy, *(node if hier else (dummy,) * 6),
        flavour.ring_addr if box or hier else 0,
        flavour.ring_slots if box or hier else 0, stg.stride(0), meta.stride(0),
        dcounts.stride(0),
        flavour.local_base, flavour.errors_addr, flavour.timeout_ns, T, ring_slots, rounds,
        N, node[3].numel() // rounds if hier else 0,
        x.stride(0), scale_row, values[19], offsets_stride, values[20], slot_rows.shape[0], H,
        out.shape[1], K, R, L, rank, row_bytes, per_row, groups, stg.stride(2),
        scale_strides[0], scale_strides[1])
    kwargs = dict(
        META_STRIDE=meta_stride, KMAX=max_topk, CACHED=cached, FT=ft,
        TRANSPORT=flavour.transport, PROXY_BOX=box, HIER=hier, NODE_META=node_meta_stride,
        HAS_WEIGHTS=has_weights,
        FP8=fp8,
        UE8M0=bool(ue8m0), GS=scale_group(ue8m0), GLOBAL=nvfp4, ALIGN=flavour.row_align,
        EVEN_H=even(H, send_tile.block_h), EXPAND_EVEN_H=even(out.shape[1], expand_tile.block_h),
        BLOCK_T=send_tile.block_t, BLOCK_H=send_tile.block_h, EXPAND_T=expand_tile.block_t,
        EXPAND_H=expand_tile.block_h, BLOCK_K=triton.next_power_of_2(max(K, 1)),
        BLOCK_G=triton.next_power_of_2(max(per_row, 1)),
        BLOCK_L=triton.next_power_of_2(L + 1), BLOCK_R=triton.next_power_of_2(R),
        BLOCK_Z=ZERO_TILES * expand_tile.block_t,
        NUM_THREADS=expand_tile.num_threads, BLOCK_N=triton.next_power_of_2(N),
        BLOCK_C=triton.next_power_of_2(N * (L + 1) + 1), FWD_T=fwd_tile.block_t, FWD_B=fwd_b,
        FWD_M=triton.next_power_of_2(meta_stride), **flavour.launch_options(send_tile))
    launch(bound, key, dispatch_rounds_kernel, (programs,), args, kwargs, _VARYING)
    return True
