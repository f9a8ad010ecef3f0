"""Across nodes through the proxy transport: outboxes, forwarding, node sums.

Ranks ``r`` of node ``r // N`` reach each other by stores; a peer on another node gets its data
from this rank's outboxes by the proxy (``moe_comm.kernels.proxy``, one descriptor per peer and
call). Two algorithms (``HIER``):

* **flat**: a token goes once to each destination *rank* on another node, straight into its
  staging (``px_rows[p, d]`` -> ``dispatch_rows[p, me]`` on ``d``; the send kernel fills the
  outbox and posts, ``kernels.dispatch``, with :func:`post_dispatch_flat`); combine partials
  come back the same way.
* **hierarchical** (DeepEP's internode normal mode): a token crosses to each destination *node*
  once, to the forwarder there (the rank with this rank's local index), with the slot it takes
  on each rank of that node. The forwarder stores the row into those ranks' staging as if the
  source had (``forward_dispatch_kernel``) and publishes the source's epoch on them, so the
  receive side is the one-node receive. Combine reverses it: each expert rank stores its
  partial for a remote token into the forwarder on its own node, the forwarder sums the node's
  partials in local-rank order in fp32, rounds once and sends one row per token per node home
  (``forward_combine_kernel``), and the home sums its own node's partials and the other nodes'
  sums in node order (``combine_reduce_kernel`` with HIER).

Equivalent PyTorch of the hierarchical dispatch for source ``s`` and node ``b`` (``f`` its
forwarder)::

    rows = [t for t in tokens(s) if any(slot_of[t, d] >= 0 for d in node(b))]   # node rows
    fwd_rows_f[p, node(s)][:len(rows)] = x[rows]             # one transfer s -> f
    for d in node(b):                                       # stores on node b, by f
        staging_d[p, s][slot_of[rows, d]] = fwd_rows_f[p, node(s)]   # where slot >= 0

All byte offsets the kernels need beyond their tensors come from one ``plan`` tensor (int64,
fields :data:`PLAN_FIELDS`, built by ``WorkspaceLayout.internode_plan``), so per-rank offsets are
data, not compile-time facts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .comm import (
    CALL_DIFFERS,
    EPOCH_SHIFT,
    INPUT_RECORD,
    MIXED,
    REFUSED_BIT,
    SLOT_BITS,
    Flavour,
    draw_last_of,
    local_ptr,
    one_thread,
    peer_ptr,
    publish_epoch,
    record_error,
    signal_word,
    slots_in,
    timed_out,
    uniform_now_ns,
    wait_relayed,
)
from .numerics import acc_zeros, cast_rne, channel_tile
from .proxy import post_transfer
from .quant import NVFP4, scale_group
from .rows import (
    load_send_tile,
    row_payload,
    sent_elem_bytes,
    store_fp8_partials,
    store_rows,
)
from .tiles import even, persistent_programs, tiles

PLAN_FIELDS = (
    # outboxes of the dispatch (offset of [parity 0, target 0], bytes per parity, per target)
    "px_rows", "px_rows_par", "px_rows_tgt", "px_meta", "px_meta_par", "px_meta_tgt",
    "px_counts", "px_counts_par", "px_counts_tgt",
    # where a dispatch message lands on the target (flat: dispatch_*[0, me] on the rank;
    # hierarchical: fwd_*[0, my node] on the forwarder), and the signal raised after it
    "dst_rows", "dst_rows_par", "dst_meta", "dst_meta_par", "dst_counts", "dst_counts_par",
    "dst_signal",
    # outboxes of the combine
    "pxc_rows", "pxc_rows_par", "pxc_rows_tgt", "pxc_meta", "pxc_meta_par", "pxc_meta_tgt",
    # hierarchical combine on the forwarder: hc_*[0, 0, 0], per parity, per node, per local rank
    "hc_rows", "hc_rows_par", "hc_rows_node", "hc_rows_local",
    "hc_meta", "hc_meta_par", "hc_meta_node", "hc_meta_local", "hc_signals",
    # where a node sum lands on the home rank (hcomb_*[0, my node]) and its signal
    "hcomb_rows", "hcomb_rows_par", "hcomb_meta", "hcomb_meta_par", "comb_signal",
    # the one-node staging the forwarder stores into (dispatch_*[0, 0]: per parity, per source)
    "d_rows", "d_rows_par", "d_rows_src", "d_meta", "d_meta_par", "d_meta_src",
    "d_counts", "d_counts_par", "d_counts_src", "d_signals",
    # the forwarder's receive side (fwd_*[0, 0]: per parity, per source node)
    "fwd_rows", "fwd_rows_par", "fwd_rows_src", "fwd_meta", "fwd_meta_par", "fwd_meta_src",
    "fwd_counts", "fwd_counts_par", "fwd_counts_src",
    # flat combine: where partials land on the home rank (combine_*[0, me])
    "comb_rows", "comb_rows_par", "comb_meta", "comb_meta_par",
)
_I = {name: tl.constexpr(i) for i, name in enumerate(PLAN_FIELDS)}
PX_ROWS, PX_ROWS_PAR, PX_ROWS_TGT = _I["px_rows"], _I["px_rows_par"], _I["px_rows_tgt"]
PX_META, PX_META_PAR, PX_META_TGT = _I["px_meta"], _I["px_meta_par"], _I["px_meta_tgt"]
PX_COUNTS, PX_COUNTS_PAR, PX_COUNTS_TGT = (_I["px_counts"], _I["px_counts_par"],
                                           _I["px_counts_tgt"])
DST_ROWS, DST_ROWS_PAR, DST_META, DST_META_PAR = (_I["dst_rows"], _I["dst_rows_par"],
                                                  _I["dst_meta"], _I["dst_meta_par"])
DST_COUNTS, DST_COUNTS_PAR, DST_SIGNAL = (_I["dst_counts"], _I["dst_counts_par"],
                                          _I["dst_signal"])
PXC_ROWS, PXC_ROWS_PAR, PXC_ROWS_TGT = _I["pxc_rows"], _I["pxc_rows_par"], _I["pxc_rows_tgt"]
PXC_META, PXC_META_PAR, PXC_META_TGT = _I["pxc_meta"], _I["pxc_meta_par"], _I["pxc_meta_tgt"]
HC_ROWS, HC_ROWS_PAR, HC_ROWS_NODE, HC_ROWS_LOCAL = (_I["hc_rows"], _I["hc_rows_par"],
                                                     _I["hc_rows_node"], _I["hc_rows_local"])
HC_META, HC_META_PAR, HC_META_NODE, HC_META_LOCAL = (_I["hc_meta"], _I["hc_meta_par"],
                                                     _I["hc_meta_node"], _I["hc_meta_local"])
HC_SIGNALS = _I["hc_signals"]
HCOMB_ROWS, HCOMB_ROWS_PAR, HCOMB_META, HCOMB_META_PAR = (
    _I["hcomb_rows"], _I["hcomb_rows_par"], _I["hcomb_meta"], _I["hcomb_meta_par"])
COMB_SIGNAL = _I["comb_signal"]
D_ROWS, D_ROWS_PAR, D_ROWS_SRC = _I["d_rows"], _I["d_rows_par"], _I["d_rows_src"]
D_META, D_META_PAR, D_META_SRC = _I["d_meta"], _I["d_meta_par"], _I["d_meta_src"]
D_COUNTS, D_COUNTS_PAR, D_COUNTS_SRC = _I["d_counts"], _I["d_counts_par"], _I["d_counts_src"]
D_SIGNALS = _I["d_signals"]
FWD_ROWS, FWD_ROWS_PAR, FWD_ROWS_SRC = _I["fwd_rows"], _I["fwd_rows_par"], _I["fwd_rows_src"]
FWD_META, FWD_META_PAR, FWD_META_SRC = _I["fwd_meta"], _I["fwd_meta_par"], _I["fwd_meta_src"]
FWD_COUNTS, FWD_COUNTS_PAR, FWD_COUNTS_SRC = (_I["fwd_counts"], _I["fwd_counts_par"],
                                              _I["fwd_counts_src"])
COMB_ROWS, COMB_ROWS_PAR, COMB_META, COMB_META_PAR = (_I["comb_rows"], _I["comb_rows_par"],
                                                      _I["comb_meta"], _I["comb_meta_par"])
# ticket words (``tickets`` region): 0/1 the dispatch/combine sends, then these
OUTBOX_TICKET, FORWARD_DISPATCH_TICKET, FORWARD_COMBINE_TICKET = 2, 3, 4


@triton.jit
def _at(plan, field):
    return tl.load(plan + field)


@triton.jit
def _off(plan, field, parity, index):
    """Byte offset of ``region[parity, index]`` for a plan triple (offset, per parity, per
    index) starting at ``field``."""
    return tl.load(plan + field) + parity * tl.load(plan + field + 1) \
        + index * tl.load(plan + field + 2)


@triton.jit
def _node_slot(node_slot_of, t, b, tm, M):
    """[BLOCK_T] row of each token in node ``b``'s message, -1 where it does not go there."""
    return tl.load(node_slot_of + t * M + b, mask=tm, other=-1).to(tl.int64)


_OUTBOX_PER_CALL = ["local_base", "ring_addr", "errors_addr", "timeout_ns", "T", "t_base",
                    "me",
                    "target_counts"]  # (one word a target: no alignment fact; a round's row)


@triton.jit
def outbox_rows(pid, programs, x, x_scales, topk_idx, topk_weights, pair_pos, slot_of,
                node_slot_of, plan, xstats, parity, local_base, T, t_base, H, K, R, N, me,
                ROW_BYTES, META_STRIDE: tl.constexpr, NODE_META: tl.constexpr,
                KMAX: tl.constexpr, SEND_META: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                FP8: tl.constexpr, UE8M0: tl.constexpr, GS: tl.constexpr, ALIGN: tl.constexpr,
                EVEN_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program ``pid`` of ``programs``: its token tiles (every ``programs``-th) of the rows for
    other nodes, each once per node at its row in that node's message, into this rank's
    outboxes of ``parity``, with their node metadata (``SEND_META``: the token, its choices and
    the slot it takes on each rank of the node); the bytes go to ``xstats[0]``
    (:func:`outbox_dispatch_kernel`'s arguments). Equivalent, for every other node ``b``::

        rows = node_slot_of[:, b] >= 0
        px_rows[parity, b][node_slot_of[rows, b]] = x[rows]
        px_meta[parity, b][node_slot_of[rows, b]] = (t_base + t, topk_idx, pair_pos,
                                                     topk_weights, slot_of[t, node(b)])
    """
    M = R // N
    my_node = me // N
    rows_base = local_base + _off(plan, PX_ROWS, parity, 0)
    meta_base = local_base + _off(plan, PX_META, parity, 0)
    payload = row_payload(x, H, FP8, UE8M0, GS)
    message_row = payload + SEND_META * 4 * NODE_META
    stored = tl.zeros([1], tl.int64)
    for t0 in range(pid * BLOCK_T, T, programs * BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < T
        t64 = t.to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            h, hm = channel_tile(h0, H, BLOCK_H, EVEN_H)
            g = h0 // GS + tl.arange(0, BLOCK_H // GS)
            tile, codes, scales, exps = load_send_tile(x, x_scales, t64, tm, h0, h, hm, g, H,
                                                       BLOCK_T, BLOCK_H, FP8, UE8M0, GS,
                                                       EVEN_H)
            for tgt in range(M):
                if tgt != my_node:
                    slot = _node_slot(node_slot_of, t, tgt, tm, M)
                    row8 = local_ptr(rows_base, tgt * _at(plan, PX_ROWS_TGT), tl.uint8, ALIGN) \
                        + slot * ROW_BYTES
                    if FP8 == 0:
                        rowx = row8.to(tl.pointer_type(x.dtype.element_ty), bitcast=True)
                        tl.store(rowx[:, None] + h[None, :], tile,  # gate: row
                                 mask=(slot >= 0)[:, None] & hm[None, :])
                    else:
                        store_rows(row8, h0, h, g, H, codes, scales, exps, slot >= 0, hm,
                                   UE8M0, GS, EVEN_H)
        if SEND_META:
            kk = tl.arange(0, BLOCK_K)
            m2 = tm[:, None] & (kk < K)[None, :]
            e = tl.load(topk_idx + t64[:, None] * K + kk[None, :], mask=m2, other=-1)
            pos = tl.load(pair_pos + t64[:, None] * K + kk[None, :], mask=m2, other=-1)
            if HAS_WEIGHTS:
                w = tl.load(topk_weights + t64[:, None] * K + kk[None, :], mask=m2, other=0.0)
            else:
                w = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
            nn = tl.arange(0, BLOCK_N)
            for tgt in range(M):
                if tgt != my_node:
                    slot = _node_slot(node_slot_of, t, tgt, tm, M)
                    sm = slot >= 0
                    meta = local_ptr(meta_base, tgt * _at(plan, PX_META_TGT), tl.int32, 4) \
                        + slot * NODE_META
                    tl.store(meta, t + t_base, mask=sm)
                    sm2 = sm[:, None] & m2
                    tl.store(meta[:, None] + 1 + kk[None, :], e.to(tl.int32), mask=sm2)
                    tl.store(meta[:, None] + 1 + KMAX + kk[None, :], pos, mask=sm2)
                    tl.store(meta[:, None] + 1 + 2 * KMAX + kk[None, :],
                             w.to(tl.int32, bitcast=True), mask=sm2)
                    # the slot the token takes on each rank of the node
                    nm = sm[:, None] & (nn < N)[None, :]
                    node_slots = tl.load(slot_of + t[:, None] * R + tgt * N + nn[None, :],
                                         mask=nm, other=-1)
                    tl.store(meta[:, None] + META_STRIDE + nn[None, :], node_slots, mask=nm)
        for tgt in range(M):
            if tgt != my_node:
                slot = _node_slot(node_slot_of, t, tgt, tm, M)
                stored += tl.sum((slot >= 0).to(tl.int64), axis=0) * message_row
    tl.atomic_add(xstats + tl.arange(0, 1), stored, sem="relaxed")


@triton.jit
def post_node_messages(plan, counts, target_counts, parity, epoch, payload, L, N, R, me,
                       ROW_BYTES, NODE_META: tl.constexpr, SEND_META: tl.constexpr,
                       local_base, ring_addr, RING_SLOTS, errors_addr, timeout_ns,
                       BLOCK_C: tl.constexpr):
    """After every program's :func:`outbox_rows` (the last program of the launch): to the
    forwarder of every other node ``b`` (its rank with this local index) one descriptor of
    ``target_counts[b]`` rows (:func:`post_dispatch_message`), with ``SEND_META`` the counts of
    each rank of node ``b`` (``counts`` [R, L + 1] rows ``b * N ..``) and the row count after
    them in the counts outbox first."""
    my_node = me // N
    cc = tl.arange(0, BLOCK_C)
    for tgt in range(R // N):
        if tgt != my_node:
            n = tl.load(target_counts + tgt).to(tl.int64)
            count_words = 0
            if SEND_META:  # the counts of each rank of node tgt, then its rows
                count_words = N * (L + 1) + 1
                c = tl.load(counts + tgt * N * (L + 1) + cc, mask=cc < N * (L + 1))
                c = tl.where(cc == N * (L + 1), n.to(tl.int32), c)
                box = local_ptr(local_base, _off(plan, PX_COUNTS, parity, tgt), tl.int32, 4)
                tl.store(box + cc, c, mask=cc < count_words)
            tl.debug_barrier()
            if one_thread():  # to the forwarder of node tgt: its rank tgt * N + me % N
                post_dispatch_message(plan, parity, tgt, tgt * N + me % N, epoch, n, payload,
                                      ROW_BYTES, NODE_META, count_words, SEND_META, ring_addr,
                                      RING_SLOTS, errors_addr, timeout_ns)


@triton.jit(do_not_specialize=_OUTBOX_PER_CALL)
def outbox_dispatch_kernel(
    x,  # [T, H] rows (FP8 == 2: uint8 view of float8_e4m3fn rows)
    x_scales,  # [T, H // 128] float32 (FP8 == 2)
    topk_idx, topk_weights, pair_pos,  # [T, K] (SEND_META; weights with HAS_WEIGHTS)
    slot_of,  # [T, R] int32: slot on rank d, -1 if not sent there
    node_slot_of,  # [T, M] int32: row of the token in node b's message, -1 if none
    counts,  # [R, L + 1] int32 (SEND_META): what each rank's dispatch_counts[p, me] gets
    target_counts,  # [M] int32: rows of each node's message
    plan,  # [PLAN_FIELDS] int64 byte offsets
    xstats,  # [4] int64 local: outbox bytes at [0]
    tickets,  # [1] int64 ticket word of this kernel
    epochs,  # [1] int64: the dispatch epoch (the send kernel advanced it already)
    local_base: tl.int64, ring_addr: tl.int64, errors_addr: tl.int64, timeout_ns: tl.int64,
    T: tl.int32,
    t_base: tl.int32,  # index of x's first token in the call (sent as each slot's token)
    H: tl.int32, K: tl.int32, R: tl.int32, L: tl.int32, N: tl.int32,
    me: tl.int32, RING_SLOTS: tl.int32,
    ROW_BYTES: tl.int64,  # bytes between staging (and outbox) rows
    META_STRIDE: tl.constexpr, NODE_META: tl.constexpr, KMAX: tl.constexpr,
    SEND_META: tl.constexpr, HAS_WEIGHTS: tl.constexpr, FP8: tl.constexpr,
    UE8M0: tl.constexpr, GS: tl.constexpr, ALIGN: tl.constexpr,
    EVEN_H: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, NUM_THREADS: tl.constexpr,
):
    """Hierarchical: rows for other nodes into this rank's outboxes, each once per node
    (:func:`outbox_rows`), then one descriptor per node to its forwarder (the last program,
    :func:`post_node_messages`): its rows, metadata and counts, and the signal to raise. (A
    flat send fills its outboxes itself, ``kernels.dispatch.send_tokens``.)"""
    epoch = tl.load(epochs)
    parity = epoch % 2
    outbox_rows(tl.program_id(0), tl.num_programs(0), x, x_scales, topk_idx, topk_weights,
                pair_pos, slot_of, node_slot_of, plan, xstats, parity, local_base, T, t_base, H,
                K, R, N, me, ROW_BYTES, META_STRIDE, NODE_META, KMAX, SEND_META, HAS_WEIGHTS,
                FP8, UE8M0, GS, ALIGN, EVEN_H, BLOCK_T, BLOCK_H, BLOCK_K, BLOCK_N)
    if draw_last_of(tickets, tl.num_programs(0)):
        if not timed_out(errors_addr.to(tl.pointer_type(tl.int64)), NUM_THREADS):
            post_node_messages(plan, counts, target_counts, parity, epoch,
                               row_payload(x, H, FP8, UE8M0, GS), L, N, R, me, ROW_BYTES,
                               NODE_META, SEND_META, local_base, ring_addr, RING_SLOTS,
                               errors_addr, timeout_ns, BLOCK_C)


@triton.jit
def post_dispatch_message(plan, parity, tgt, peer, epoch, n, payload, ROW_BYTES, NODE_META,
                          count_words, SEND_META: tl.constexpr, ring_addr, RING_SLOTS,
                          errors_addr, timeout_ns):
    """The descriptor of this rank's dispatch message of ``epoch`` to target ``tgt`` (call
    from one thread): from the outboxes of ``parity`` for ``tgt`` (a rank, flat, or a node,
    ``peer`` its forwarder), ``n`` rows of ``payload`` bytes ``ROW_BYTES`` apart, with
    ``SEND_META`` their metadata (``NODE_META`` words a row) and ``count_words`` counts; the
    proxy raises the dispatch signal on ``peer`` to ``epoch`` after them."""
    post_transfer(
        ring_addr, RING_SLOTS, peer, _at(plan, DST_SIGNAL), epoch, 1 + 2 * SEND_META,
        _off(plan, PX_ROWS, parity, tgt), _at(plan, DST_ROWS) + parity * _at(plan, DST_ROWS_PAR),
        payload, ROW_BYTES, n,
        _off(plan, PX_META, parity, tgt), _at(plan, DST_META) + parity * _at(plan, DST_META_PAR),
        4 * NODE_META, 4 * NODE_META, n,
        _off(plan, PX_COUNTS, parity, tgt),
        _at(plan, DST_COUNTS) + parity * _at(plan, DST_COUNTS_PAR),
        4 * count_words, 4 * count_words, 1, errors_addr.to(tl.pointer_type(tl.int64)),
        timeout_ns)


@triton.jit
def post_dispatch_flat(plan, counts, peer_ptrs, parity, epoch, R, L, payload, ROW_BYTES,
                       META_STRIDE, local_base, ring_addr, RING_SLOTS, errors_addr, timeout_ns,
                       SEND_META: tl.constexpr, BLOCK_L: tl.constexpr):
    """Flat (the last program of a send that filled the outboxes itself,
    ``kernels.dispatch.send_tokens``): to every rank ``d`` without a pointer (another node), one
    descriptor (:func:`post_dispatch_message`) of ``n_d`` rows. ``SEND_META``: ``counts`` [R,
    L + 1] as the send publishes them, ``n_d = counts[d, L]``, and ``counts[d]`` go into the
    counts outbox first; the cached form (rows only): ``counts`` [R], ``n_d = counts[d]``."""
    lane = tl.arange(0, BLOCK_L)
    for d in range(R):
        if tl.load(peer_ptrs + d) == 0:
            if SEND_META:
                c = tl.load(counts + d * (L + 1) + lane, mask=lane < L + 1)
                box = local_ptr(local_base, _off(plan, PX_COUNTS, parity, d), tl.int32, 4)
                tl.store(box + lane, c, mask=lane < L + 1)
                n = slots_in(tl.load(counts + d * (L + 1) + L).to(tl.int64))
            else:
                n = tl.load(counts + d).to(tl.int64)
            tl.debug_barrier()
            if one_thread():
                post_dispatch_message(plan, parity, d, d, epoch, n, payload, ROW_BYTES,
                                      META_STRIDE, L + 1, SEND_META, ring_addr, RING_SLOTS,
                                      errors_addr, timeout_ns)


_FORWARD_PER_CALL = ["local_base", "errors_addr", "me"]


@triton.jit
def forward_rows(a, p, P, parity, plan, peer_ptrs, fwd_slots, fwd_n, local_base, TMAX, L, N,
                 me, ROW_BYTES, PAYLOAD, META_STRIDE: tl.constexpr, NODE_META: tl.constexpr,
                 CACHED: tl.constexpr, ALIGN: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program ``p`` of ``P`` on the message of node ``a`` (another node) of ``parity``: its
    row tiles (every ``P``-th) stored into the staging of every rank of this node that gets
    them (slot >= 0), with their metadata (:func:`forward_dispatch_kernel`'s arguments; program
    0 writes ``fwd_n[a]``). Returns the bytes it stored ([1] int64). Equivalent (``s = a * N +
    me % N``, the message's source)::

        for j in range(fwd_counts[parity, a][N * (L + 1)]):     # the message's rows
            for dl in range(N):                                  # rank d = my_node * N + dl
                slot = fwd_meta[parity, a, j, META_STRIDE + dl]  # (CACHED: fwd_slots[a, j, dl])
                fwd_slots[a, j, dl] = slot
                if slot >= 0:
                    dispatch_rows_d[parity, s, slot] = fwd_rows[parity, a, j]
                    dispatch_meta_d[parity, s, slot] = fwd_meta[parity, a, j, :META_STRIDE]
    """
    my_node = me // N
    src = a * N + me % N
    forwarded = tl.zeros([1], tl.int64)
    fwd_counts = local_ptr(local_base, _off(plan, FWD_COUNTS, parity, a), tl.int32, 4)
    if CACHED:
        n = tl.load(fwd_n + a)
    else:
        n = tl.load(fwd_counts + N * (L + 1))
        if p == 0:
            tl.store(fwd_n + a, n)
    rows = local_ptr(local_base, _off(plan, FWD_ROWS, parity, a), tl.uint8, ALIGN)
    meta = local_ptr(local_base, _off(plan, FWD_META, parity, a), tl.int32, 4)
    d_rows_off = _off(plan, D_ROWS, parity, src)
    d_meta_off = _off(plan, D_META, parity, src)
    for j0 in range(p * BLOCK_T, n, P * BLOCK_T):
        j = j0 + tl.arange(0, BLOCK_T)
        jm = j < n
        j64 = j.to(tl.int64)
        slots_at = fwd_slots + (a * TMAX + j64) * N
        for dl in range(N):
            if CACHED:
                slot = tl.load(slots_at + dl, mask=jm, other=-1).to(tl.int64)
            else:
                slot = tl.load(meta + j64 * NODE_META + META_STRIDE + dl, mask=jm,
                               other=-1).to(tl.int64)
                tl.store(slots_at + dl, slot.to(tl.int32), mask=jm)
            sm = slot >= 0
            d = my_node * N + dl
            dst = peer_ptr(peer_ptrs, d, d_rows_off, tl.uint8, ALIGN) + slot * ROW_BYTES
            body = tl.multiple_of(PAYLOAD // 16 * 16, 16)  # 16-byte stores; then the
            for b0 in range(0, body, BLOCK_B):  # tail (UE8M0 exponents) byte by byte
                b = b0 + tl.arange(0, BLOCK_B)
                bm = b < body
                tile = tl.load(rows + j64[:, None] * ROW_BYTES + b[None, :],
                               mask=jm[:, None] & bm[None, :])
                tl.store(dst[:, None] + b[None, :], tile,  # gate: row
                         mask=sm[:, None] & bm[None, :])
            if body < PAYLOAD:
                b = body + tl.arange(0, 16)
                bm = b < PAYLOAD
                tile = tl.load(rows + j64[:, None] * ROW_BYTES + b[None, :],
                               mask=jm[:, None] & bm[None, :])
                tl.store(dst[:, None] + b[None, :], tile,  # gate: tail
                         mask=sm[:, None] & bm[None, :])
            if not CACHED:
                mm = tl.arange(0, BLOCK_M)
                mk = sm[:, None] & (mm < META_STRIDE)[None, :]
                words = tl.load(meta + j64[:, None] * NODE_META + mm[None, :], mask=mk)
                dst_meta = peer_ptr(peer_ptrs, d, d_meta_off, tl.int32, 4) \
                    + slot * META_STRIDE
                tl.store(dst_meta[:, None] + mm[None, :], words, mask=mk)
            forwarded += tl.sum(sm.to(tl.int64), axis=0) \
                * (PAYLOAD + (1 - CACHED) * 4 * META_STRIDE)
    return forwarded


@triton.jit
def forward_messages(pid, programs, parity, plan, peer_ptrs, fwd_slots, fwd_n, local_base, TMAX,
                     L, R, N, me, ROW_BYTES, PAYLOAD, META_STRIDE: tl.constexpr,
                     NODE_META: tl.constexpr, CACHED: tl.constexpr, ALIGN: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_A: tl.constexpr):
    """Program ``pid`` of ``programs`` on the messages of every other node of ``parity``: the
    row tiles of all of them dealt round-robin (tile ``t`` of node ``a``'s message is
    :func:`forward_rows`' program ``t`` of as many as it has tiles), so a program takes
    ``ceil(sum of the tiles / programs)`` of them however many nodes there are; program 0
    writes ``fwd_n`` (not ``CACHED``). Returns the bytes this program stored ([1] int64)."""
    a = tl.arange(0, BLOCK_A)
    am = (a < R // N) & (a != me // N)
    if CACHED:
        n = tl.load(fwd_n + a, mask=am, other=0)
    else:  # each message's rows, after its counts of each rank of this node
        counts = local_base + _at(plan, FWD_COUNTS) + parity * _at(plan, FWD_COUNTS_PAR) \
            + a.to(tl.int64) * _at(plan, FWD_COUNTS_SRC)
        n = tl.load(counts.to(tl.pointer_type(tl.int32)) + N * (L + 1), mask=am, other=0)
        if pid == 0:
            tl.store(fwd_n + a, n, mask=am)
    node_tiles = (n + BLOCK_T - 1) // BLOCK_T
    tiles_end = tl.cumsum(node_tiles, axis=0)
    forwarded = tl.zeros([1], tl.int64)
    for w in range(pid, tl.sum(node_tiles, axis=0), programs):
        b = tl.sum((tiles_end <= w).to(tl.int32), axis=0)
        at_b = a == b
        forwarded += forward_rows(b, w - tl.sum(tl.where(at_b, tiles_end - node_tiles, 0), axis=0),
                                  tl.sum(tl.where(at_b, node_tiles, 0), axis=0), parity, plan,
                                  peer_ptrs, fwd_slots, fwd_n, local_base, TMAX, L, N, me,
                                  ROW_BYTES, PAYLOAD, META_STRIDE, NODE_META, CACHED, ALIGN,
                                  BLOCK_T, BLOCK_B, BLOCK_M)
    return forwarded


@triton.jit
def publish_forwarded(plan, peer_ptrs, parity, epoch, local_base, R, L, N, me,
                      CACHED: tl.constexpr, BLOCK_C: tl.constexpr):
    """After every program's :func:`forward_rows` (the last program): for every other node's
    source with this local index, its counts for each rank of this node (``fwd_counts`` ->
    ``dispatch_counts``; not ``CACHED``) and then ``epoch`` into its signal word there (a
    release store), as if the source had sent them itself."""
    my_node = me // N
    cc = tl.arange(0, BLOCK_C)
    for a2 in range(R // N):
        if a2 != my_node:
            src2 = a2 * N + me % N
            for dl in range(N):
                d = my_node * N + dl
                if not CACHED:
                    fc = local_ptr(local_base, _off(plan, FWD_COUNTS, parity, a2), tl.int32, 4)
                    c = tl.load(fc + dl * (L + 1) + cc, mask=cc < L + 1)
                    dst_counts = peer_ptr(peer_ptrs, d, _off(plan, D_COUNTS, parity, src2),
                                          tl.int32, 4)
                    tl.store(dst_counts + cc, c, mask=cc < L + 1)
                tl.debug_barrier()
                publish_epoch(peer_ptrs, d, _at(plan, D_SIGNALS) + src2 * 8, epoch)


@triton.jit
def other_node(i, me, N):
    """The ``i``-th node other than this rank's (``me // N``): the forwarders' grids run
    ``(M - 1, P)`` programs, so that none of them idles on this rank's own node."""
    return i + (i >= me // N).to(tl.int32)


def forward_grid(num_nodes: int, rows: int, block_t: int, num_sms: int | None,
                 compiled: bool) -> tuple[int, int]:
    """Grid ``(M - 1, P)`` of the forwarders (at least one program for one node): ``P``
    programs per other node, one per tile of ``rows`` (at most 32), ``(M - 1) * P`` at most
    ``num_sms`` (one program per node in the interpreter)."""
    nodes = max(num_nodes - 1, 1)
    if not compiled:
        return nodes, 1
    per_node = min(triton.cdiv(rows, block_t), 32)
    if num_sms:
        per_node = min(per_node, num_sms // nodes)
    return nodes, max(1, per_node)


@triton.jit(do_not_specialize=_FORWARD_PER_CALL)
def forward_dispatch_kernel(
    plan,  # [PLAN_FIELDS] int64
    peer_ptrs,  # [R] int64
    fwd_slots,  # [M, TMAX, N] int32: slot of each node row on each local rank (written, or
                # read when CACHED)
    fwd_n,  # [M] int32: node rows from each node (written, or read when CACHED)
    xstats,  # [4] int64 local: bytes forwarded at [2]
    tickets,  # [1] int64 ticket word of this kernel
    epochs,  # [1] int64: the dispatch epoch (this call's)
    local_base: tl.int64, errors_addr: tl.int64,
    TMAX: tl.int32, R: tl.int32, L: tl.int32, N: tl.int32, me: tl.int32,
    ROW_BYTES: tl.int64, PAYLOAD: tl.int64,  # bytes between rows; bytes of a row that travel
    META_STRIDE: tl.constexpr, NODE_META: tl.constexpr, CACHED: tl.constexpr,
    ALIGN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, NUM_THREADS: tl.constexpr,
):
    """Program ``(i, p)``: the rows node ``a`` (the ``i``-th other node, :func:`other_node`)'s
    source with this local index sent here, stored
    into the staging of every rank of this node that gets them (:func:`forward_rows`); the last
    program copies the counts and publishes the sources' epochs (:func:`publish_forwarded`)."""
    a = other_node(tl.program_id(0), me, N)
    p = tl.program_id(1)
    epoch = tl.load(epochs)
    parity = epoch % 2
    forwarded = tl.zeros([1], tl.int64)
    if a < R // N:
        forwarded = forward_rows(a, p, tl.num_programs(1), parity, plan, peer_ptrs, fwd_slots,
                                 fwd_n, local_base, TMAX, L, N, me, ROW_BYTES, PAYLOAD,
                                 META_STRIDE, NODE_META, CACHED, ALIGN, BLOCK_T, BLOCK_B,
                                 BLOCK_M)
    tl.atomic_add(xstats + 2 + tl.arange(0, 1), forwarded, sem="relaxed")
    if draw_last_of(tickets, tl.num_programs(0) * tl.num_programs(1)):
        if not timed_out(errors_addr.to(tl.pointer_type(tl.int64)), NUM_THREADS):
            publish_forwarded(plan, peer_ptrs, parity, epoch, local_base, R, L, N, me, CACHED,
                              BLOCK_C)


_FORWARD_COMBINE_PER_CALL = ["local_base", "ring_addr", "errors_addr", "timeout_ns", "me"]


@triton.jit(do_not_specialize=_FORWARD_COMBINE_PER_CALL)
def forward_combine_kernel(
    hc_rows,  # [P, M, N, TMAX, H] local: partials of each local rank for remote sources
    hc_meta,  # [P, M, N, TMAX, KMAX] float32 local (HAS_PAIR)
    box_rows,  # [P, M, TMAX, H] local outbox px_combine_rows
    box_meta,  # [P, M, TMAX, KMAX] float32 local outbox px_combine_meta (HAS_PAIR)
    fwd_slots,  # [M, TMAX, N] int32 (from the dispatch's handle)
    fwd_n,  # [M] int32
    plan, xstats, tickets,
    epochs,  # [1] int64: the combine epoch (this call's)
    local_base: tl.int64, ring_addr: tl.int64, errors_addr: tl.int64, timeout_ns: tl.int64,
    TMAX: tl.int32, H: tl.int32, K: tl.int32, R: tl.int32, N: tl.int32, me: tl.int32,
    RING_SLOTS: tl.int32,
    HC_PARITY: tl.int64, HC_META_PARITY: tl.int64,  # elements between parities
    BOX_PARITY: tl.int64, BOX_META_PARITY: tl.int64,
    KMAX: tl.constexpr, HAS_PAIR: tl.constexpr, ACC_FP64: tl.constexpr, EVEN_H: tl.constexpr,
    FP8: tl.constexpr,  # the sums travel as FP8 per 128 channels (kernels.rows layout)
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_THREADS: tl.constexpr,
):
    """Program ``(i, p)``: for each node row from node ``a`` (the ``i``-th other node,
    :func:`other_node`), the sum in local-rank order of
    this node's partials (fp32, rounded once; with FP8 quantized from fp32) into the outbox;
    the last program posts one transfer per source node to the source (this local index
    there)."""
    a = other_node(tl.program_id(0), me, N)
    epoch = tl.load(epochs)
    parity = epoch % 2
    summed = tl.zeros([1], tl.int64)
    if a < R // N:
        summed += forward_node_sums(a, tl.program_id(1), tl.num_programs(1), parity, hc_rows,
                                    hc_meta, box_rows, box_meta, fwd_slots, fwd_n, TMAX, H, K,
                                    N, HC_PARITY, HC_META_PARITY, BOX_PARITY, BOX_META_PARITY,
                                    KMAX, HAS_PAIR, ACC_FP64, EVEN_H, FP8, BLOCK_T, BLOCK_H,
                                    BLOCK_K)
    post_node_sums(summed, True, tickets, tl.num_programs(0) * tl.num_programs(1), plan, fwd_n,
                   xstats, box_rows, epoch, parity, H, R, N, me, K, KMAX, HAS_PAIR, FP8,
                   ring_addr, RING_SLOTS, errors_addr.to(tl.pointer_type(tl.int64)), timeout_ns,
                   local_base, NUM_THREADS)


@triton.jit
def node_sum_bytes(box_rows, H, FP8: tl.constexpr):
    """``(bytes of a node sum on the link, bytes between outbox rows)``: a row of the outbox's
    dtype, or with FP8 its codes and scales (``kernels.rows`` layout)."""
    stride = H * box_rows.dtype.element_ty.primitive_bitwidth // 8
    row_bytes = stride
    if FP8:
        row_bytes = H + 4 * (H // 128)
    return row_bytes, stride


@triton.jit
def forward_node_sums(a, p, P, parity, hc_rows, hc_meta, box_rows, box_meta, fwd_slots, fwd_n,
                      TMAX, H, K, N, HC_PARITY, HC_META_PARITY, BOX_PARITY, BOX_META_PARITY,
                      KMAX: tl.constexpr, HAS_PAIR: tl.constexpr, ACC_FP64: tl.constexpr,
                      EVEN_H: tl.constexpr, FP8: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``p`` of ``P`` on node ``a``'s rows (another node; ``fwd_slots`` [M, TMAX, N]
    and ``fwd_n`` [M] of the round): each node row's sum of this node's partials in local-rank
    order (``hc_rows`` of ``parity``) into the outbox slice for node ``a``, with the summed
    pair values (``HAS_PAIR``); :func:`forward_combine_kernel`'s arguments. Returns the rows
    this program summed ([1] int64). Equivalent::

        for j in range(p * BLOCK_T, fwd_n[a]) (tiles of BLOCK_T, every P-th):
            box[parity, a, j] = sum(hc[parity, a, dl, fwd_slots[a, j, dl]] for dl in range(N)
                                    if fwd_slots[a, j, dl] >= 0)   # fp32, rounded once
    """
    summed = tl.zeros([1], tl.int64)
    _, stride = node_sum_bytes(box_rows, H, FP8)  # (bytes between outbox rows)
    n = tl.load(fwd_n + a)
    hc = hc_rows + parity * HC_PARITY + tl.cast(a, tl.int64) * N * TMAX * H
    box = box_rows + parity * BOX_PARITY + tl.cast(a, tl.int64) * TMAX * H
    for j0 in range(p * BLOCK_T, n, P * BLOCK_T):
        j = j0 + tl.arange(0, BLOCK_T)
        jm = j < n
        j64 = j.to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            h, hm = channel_tile(h0, H, BLOCK_H, EVEN_H)
            acc = acc_zeros(BLOCK_T, BLOCK_H, ACC_FP64)
            for dl in range(N):
                slot = tl.load(fwd_slots + (a * TMAX + j64) * N + dl, mask=jm,
                               other=-1).to(tl.int64)
                v = tl.load(hc + (dl * TMAX + slot)[:, None] * H + h[None, :],
                            mask=(slot >= 0)[:, None] & hm[None, :], other=0.0)
                acc += v.to(acc.dtype)
            if FP8:
                box8 = box.to(tl.pointer_type(tl.uint8), bitcast=True) + j64 * stride
                store_fp8_partials(acc, box8, jm, box8, jm, h0, h, hm, H, False, EVEN_H,
                                   BLOCK_T, BLOCK_H)
            else:
                tl.store(box + j64[:, None] * H + h[None, :],  # gate: row
                         cast_rne(acc, box_rows.dtype.element_ty),
                         mask=jm[:, None] & hm[None, :])
        if HAS_PAIR:
            kk = tl.arange(0, BLOCK_K)
            m2 = jm[:, None] & (kk < K)[None, :]
            pacc = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
            hm_ = hc_meta + parity * HC_META_PARITY + tl.cast(a, tl.int64) * N * TMAX * KMAX
            for dl in range(N):
                slot = tl.load(fwd_slots + (a * TMAX + j64) * N + dl, mask=jm,
                               other=-1).to(tl.int64)
                pacc += tl.load(hm_ + (dl * TMAX + slot)[:, None] * KMAX + kk[None, :],
                                mask=m2 & (slot >= 0)[:, None], other=0.0)
            bm_ = box_meta + parity * BOX_META_PARITY + tl.cast(a, tl.int64) * TMAX * KMAX
            tl.store(bm_ + j64[:, None] * KMAX + kk[None, :], pacc, mask=m2)
        summed += tl.sum(jm.to(tl.int64), axis=0)
    return summed


@triton.jit
def relayed_descriptor(plan, local_base, epoch, me, N, errors):
    """What a hierarchical forwarder passes on to the homes of other nodes, from the signal
    words of its node's partials of ``epoch`` (``hc_signals``, ``epoch << 32 | descriptor <<
    SLOT_BITS``): its own descriptor where every rank of its node sent the same; else the first
    refusal among them, or failing one the first descriptor that differs from its own with
    MIXED_BIT set, which no rank's own descriptor has (so every home raises). The first that
    differs from its own is recorded too (as ``kernels.comm.check_descriptors``). Call from one
    thread."""
    words = local_ptr(local_base, _at(plan, HC_SIGNALS), tl.int64, 8)
    mine = (tl.load(words + me % N, volatile=True) & 0xFFFFFFFF) >> SLOT_BITS
    first = mine
    refused = mine
    for j in range(N):
        word = tl.load(words + j, volatile=True)
        theirs = (word & 0xFFFFFFFF) >> SLOT_BITS
        current = (word >> EPOCH_SHIFT) == epoch
        if current & (theirs != mine) & (first == mine):  # gate: cold
            record_error(errors, INPUT_RECORD, CALL_DIFFERS, (me // N) * N + j,
                         theirs | (mine << 16) | (epoch.to(tl.int64) << 32))
            first = theirs
        if current & (((theirs >> REFUSED_BIT) & 1) == 1) & (((refused >> REFUSED_BIT) & 1)
                                                             == 0):
            refused = theirs
    relay = mine
    if ((refused >> REFUSED_BIT) & 1) == 1:
        relay = refused
    elif first != mine:
        relay = first | MIXED
    return relay


@triton.jit
def post_node_sums(summed, ok, tickets, programs, plan, fwd_n, xstats, box_rows, epoch, parity,
                   H, R, N, me, K, KMAX: tl.constexpr, HAS_PAIR: tl.constexpr,
                   FP8: tl.constexpr, ring_addr, RING_SLOTS, errors, timeout_ns, local_base,
                   NUM_THREADS: tl.constexpr):
    """After a program's :func:`forward_node_sums` (``summed`` rows): counts their bytes in
    ``xstats``; the last of ``programs`` to draw from ``tickets`` (every program's sums are in
    the outbox of ``parity``), if ``ok`` and no wait timed out, posts to the home with this
    rank's local index on every other node ``a2`` one transfer of its ``fwd_n[a2]`` node sums
    (:func:`node_sum_bytes` each, and their pair values), after which the proxy raises the
    combine signal there to ``epoch`` and the :func:`relayed_descriptor`."""
    row_bytes, row_stride = node_sum_bytes(box_rows, H, FP8)
    tl.atomic_add(xstats + 1 + tl.arange(0, 1), summed * (row_bytes + HAS_PAIR * 4 * K),
                  sem="relaxed")
    if draw_last_of(tickets, programs):
        if ok and not timed_out(errors, NUM_THREADS):
            if one_thread():
                word = signal_word(epoch, relayed_descriptor(plan, local_base, epoch, me, N,
                                                             errors))
                for a2 in range(R // N):
                    if a2 != me // N:
                        n2 = tl.load(fwd_n + a2).to(tl.int64)
                        post_transfer(
                            ring_addr, RING_SLOTS, a2 * N + me % N, _at(plan, COMB_SIGNAL),
                            word, 1 + HAS_PAIR,
                            _off(plan, PXC_ROWS, parity, a2),
                            _at(plan, HCOMB_ROWS) + parity * _at(plan, HCOMB_ROWS_PAR),
                            row_bytes, row_stride, n2,
                            _off(plan, PXC_META, parity, a2),
                            _at(plan, HCOMB_META) + parity * _at(plan, HCOMB_META_PAR),
                            4 * K, 4 * KMAX, n2,
                            0, 0, 0, 0, 0, errors, timeout_ns)


@triton.jit
def forward_round(pid, programs, epoch, parity, plan, hc_rows, hc_meta, box_rows, box_meta,
                  fwd_slots, fwd_n, xstats, tickets, local_base, ring_addr, RING_SLOTS, errors,
                  timeout_ns, TMAX, H, K, R, N, me, HC_PARITY, HC_META_PARITY, BOX_PARITY,
                  BOX_META_PARITY, KMAX: tl.constexpr, HAS_PAIR: tl.constexpr,
                  ACC_FP64: tl.constexpr, EVEN_H: tl.constexpr, FP8: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_R: tl.constexpr, NUM_THREADS: tl.constexpr):
    """The forwarder's pass of a hierarchical combine round in a launch of every round
    (``kernels.combine_rounds``; program ``pid`` of ``programs``, ``fwd_slots`` / ``fwd_n`` the
    round's): waits, bounded, for the partials of ``epoch`` from every rank of this node
    (``hc_signals``; a timeout names the rank), sums every other node's rows
    (:func:`forward_node_sums`, row tiles dealt over the programs) and, in the last program to
    draw from ``tickets``, posts one transfer per other node (:func:`post_node_sums`), as
    :func:`forward_combine_kernel` after the host's wait. Returns whether the wait was met."""
    my_node = me // N
    words = local_ptr(local_base, _at(plan, HC_SIGNALS), tl.int64, 8)
    ok = wait_relayed(words, N, epoch, uniform_now_ns(NUM_THREADS) + timeout_ns, errors,
                      my_node * N, 1, BLOCK_R, NUM_THREADS, EPOCH_SHIFT)
    summed = tl.zeros([1], tl.int64)
    if ok:
        for a in range(R // N):
            if a != my_node:
                summed += forward_node_sums(a, pid, programs, parity, hc_rows, hc_meta,
                                            box_rows, box_meta, fwd_slots, fwd_n, TMAX, H, K, N,
                                            HC_PARITY, HC_META_PARITY, BOX_PARITY,
                                            BOX_META_PARITY, KMAX, HAS_PAIR, ACC_FP64, EVEN_H,
                                            FP8, BLOCK_T, BLOCK_H, BLOCK_K)
    post_node_sums(summed, ok, tickets, programs, plan, fwd_n, xstats, box_rows, epoch, parity,
                   H, R, N, me, K, KMAX, HAS_PAIR, FP8, ring_addr, RING_SLOTS, errors,
                   timeout_ns, local_base, NUM_THREADS)
    return ok


@triton.jit
def post_combine_flat(plan, slot_offsets, R, N, me, word, parity, row_bytes, row_stride, K,
                      KMAX: tl.constexpr, HAS_PAIR: tl.constexpr, ring_addr, RING_SLOTS,
                      errors_addr, timeout_ns):
    """Flat combine: one transfer per home rank on another node, from the outbox slice the
    combine send filled (call from one thread of the last program): ``row_bytes`` of each
    partial row (FP8 partials fill part of theirs), rows ``row_stride`` bytes apart;
    ``slot_offsets`` [R + 1] int64: the slots of each home rank (the diff); ``word``: the
    signal word the proxy raises there after them (``kernels.comm.signal_word``)."""
    for s in range(R):
        if s // N != me // N:
            n = tl.load(slot_offsets + s + 1) - tl.load(slot_offsets + s)
            post_transfer(
                ring_addr, RING_SLOTS, s, _at(plan, COMB_SIGNAL), word, 1 + HAS_PAIR,
                _off(plan, PXC_ROWS, parity, s),
                _at(plan, COMB_ROWS) + parity * _at(plan, COMB_ROWS_PAR), row_bytes, row_stride,
                n,
                _off(plan, PXC_META, parity, s),
                _at(plan, COMB_META) + parity * _at(plan, COMB_META_PAR), 4 * K, 4 * KMAX, n,
                0, 0, 0, 0, 0, errors_addr.to(tl.pointer_type(tl.int64)), timeout_ns)


# ------------------------------------------------------------------------------- launchers
def outbox_grid(max_tokens: int, hidden: int, num_sms: int | None, flavour: Flavour,
                elem_bytes: int) -> int:
    tile = tiles("dispatch_send", flavour.compiled, hidden, elem_bytes)
    return persistent_programs(triton.cdiv(max_tokens, tile.block_t), num_sms)


def outbox_dispatch(x, x_scales, topk_idx, topk_weights, pair_pos, slot_of, node_slot_of,
                    counts, target_counts, plan, xstats, tickets, epochs, *, rank: int,
                    world_size: int, num_local_experts: int, meta_stride: int,
                    node_meta_stride: int, max_topk: int, grid: int, topk: int,
                    row_bytes: int, fp8: int = 0, ue8m0: int = 0, flavour: Flavour,
                    t_base: int = 0) -> bool:
    """Launches :func:`outbox_dispatch_kernel` (hierarchical; ``topk_idx=None``: the cached
    form, rows only). ``x`` (and the per-token tensors) may be one round's window of a call's
    tokens, ``t_base`` the call's index of its first token. ``target_counts``: the rows of each
    node's message. (A flat send fills its outboxes and posts itself,
    ``kernels.dispatch.dispatch_send``.)"""
    if not flavour.hierarchical:
        raise ValueError("a flat dispatch send fills its outboxes itself")
    T, H = x.shape
    if fp8 == 2 and ue8m0 == NVFP4:  # x: two e2m1 codes per byte
        H *= 2
    tile = tiles("dispatch_send", flavour.compiled, H,
                 sent_elem_bytes(fp8, ue8m0, x.element_size()))
    send_meta = topk_idx is not None
    dummy = slot_of
    N = flavour.ranks_per_node
    if fp8 == 2:
        x = x.view(torch.uint8)
        x_scales = x_scales.view(torch.uint8) if ue8m0 else x_scales
    outbox_dispatch_kernel[(grid,)](
        x, dummy if x_scales is None else x_scales, topk_idx if send_meta else dummy,
        topk_weights if topk_weights is not None else dummy, pair_pos if send_meta else dummy,
        slot_of, node_slot_of, counts if send_meta else dummy, target_counts,
        plan, xstats, tickets, epochs,
        flavour.local_base, flavour.ring_addr, flavour.errors_addr, flavour.timeout_ns,
        T, t_base, H, topk, world_size, num_local_experts, N, rank, flavour.ring_slots,
        row_bytes,
        META_STRIDE=meta_stride, NODE_META=node_meta_stride, KMAX=max_topk,
        SEND_META=send_meta, HAS_WEIGHTS=topk_weights is not None, FP8=fp8, UE8M0=bool(ue8m0),
        GS=scale_group(ue8m0), ALIGN=flavour.row_align,
        EVEN_H=even(H, tile.block_h),
        BLOCK_T=tile.block_t, BLOCK_H=tile.block_h,
        BLOCK_K=triton.next_power_of_2(max(topk, 1)),
        BLOCK_C=triton.next_power_of_2(N * (num_local_experts + 1) + 1),
        BLOCK_N=triton.next_power_of_2(N), NUM_THREADS=tile.num_threads,
        **tile.launch_options())
    return True


def forward_tiles(flavour: Flavour):
    """``(tile, bytes a row tile spans)`` of :func:`forward_rows`: row tiles of 8 rows, 16
    bytes of a row tile per thread on a GPU."""
    tile = tiles("forward_dispatch", flavour.compiled, 1024, 1)
    return tile, (max(16, 16 * tile.num_threads // tile.block_t) if flavour.compiled else 2048)


def forward_dispatch(plan, peer_ptrs, fwd_slots, fwd_n, xstats, tickets, epochs, *, rank: int,
                     num_local_experts: int, max_tokens: int, row_bytes: int, payload: int,
                     meta_stride: int, node_meta_stride: int, cached: bool,
                     num_sms: int | None, flavour: Flavour) -> bool:
    """Launches :func:`forward_dispatch_kernel` on :func:`forward_grid`."""
    R, N = peer_ptrs.numel(), flavour.ranks_per_node
    tile, block_b = forward_tiles(flavour)
    forward_dispatch_kernel[forward_grid(R // N, max_tokens, tile.block_t, num_sms,
                                         flavour.compiled)](
        plan, peer_ptrs, fwd_slots, fwd_n, xstats, tickets, epochs, flavour.local_base,
        flavour.errors_addr, max_tokens, R, num_local_experts, N, rank, row_bytes, payload,
        META_STRIDE=meta_stride, NODE_META=node_meta_stride, CACHED=cached,
        ALIGN=flavour.row_align, BLOCK_T=tile.block_t, BLOCK_B=block_b,
        BLOCK_M=triton.next_power_of_2(meta_stride),
        BLOCK_C=triton.next_power_of_2(num_local_experts + 1), NUM_THREADS=tile.num_threads,
        **tile.launch_options())
    return True


def forward_combine(hc_rows, hc_meta, box_rows, box_meta, fwd_slots, fwd_n, plan, xstats,
                    tickets, epochs, *, rank: int, world_size: int, topk: int, max_topk: int,
                    has_pair: bool, num_sms: int | None, flavour: Flavour,
                    fp8: bool = False) -> bool:
    """Launches :func:`forward_combine_kernel` on :func:`forward_grid` (``fp8``: FP8 sums)."""
    P_, M, N, TMAX, H = hc_rows.shape
    tile = tiles("combine_send", flavour.compiled, H, max(4, hc_rows.element_size()))
    forward_combine_kernel[forward_grid(M, TMAX, tile.block_t, num_sms, flavour.compiled)](
        hc_rows, hc_meta, box_rows, box_meta, fwd_slots, fwd_n, plan, xstats, tickets, epochs,
        flavour.local_base, flavour.ring_addr, flavour.errors_addr, flavour.timeout_ns,
        TMAX, H, topk, world_size, N, rank, flavour.ring_slots, hc_rows.stride(0),
        hc_meta.stride(0), box_rows.stride(0), box_meta.stride(0), KMAX=max_topk,
        HAS_PAIR=has_pair, ACC_FP64=hc_rows.dtype == torch.float64, FP8=fp8,
        EVEN_H=even(H, tile.block_h), BLOCK_T=tile.block_t, BLOCK_H=tile.block_h,
        BLOCK_K=triton.next_power_of_2(max(topk, 1)), NUM_THREADS=tile.num_threads,
        **tile.launch_options())
    return True
