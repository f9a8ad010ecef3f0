"""Dispatch: send each token once to every rank that holds one of its experts, then expand.

Equivalent PyTorch, for one (source ``s``, destination ``d``) pair::

    sent = slot_of[:, d] >= 0                                        # tokens of s for d
    staging_d[p, s, slot_of[sent, d]] = x[sent]                       # one row per token
    rows_d = expand(staging_d[p, s])    # one row per (token, local expert), expert-major

**Send** (``dispatch_send_kernel``, on the source): a persistent grid whose programs walk tiles of
``BLOCK_T`` tokens; each ``[BLOCK_T, BLOCK_H]`` tile of ``x`` is loaded once and stored through
the peer-pointer table into the staging of every destination that token goes to, with its
metadata (token index, per top-k choice the global expert id, the pair's position and the
weight: the same for every destination). The last program to finish publishes, for every rank
``d`` (also those that receive nothing): the per-expert counts, then the epoch. Bytes stored
into rank ``d``: ``n_d * (H * elem + 4 * (1 + 3K)) + 4 * (L + 1) + 8``, where ``n_d`` is the
number of tokens sent to ``d``. Across nodes through the proxy, flat (``PROXY_BOX``), a rank
on another node gets the same rows and metadata in this rank's outboxes for it, at the same
slots (the same tile, another address), and the last program posts one descriptor per such
rank after its counts (``kernels.internode.post_dispatch_flat``): the proxy moves them there and
raises the epoch after them.

**Received layout** (``received_layout_kernel``, on the destination, one program): with
waits in kernels it first waits for every source's epoch (all at once), then turns the counts
the sources published into the receive's offsets (``row_base``, ``tokens_per_expert``,
``expert_offsets``, ``slot_offsets``): no host read, no torch op. Where every rank runs its own
send at once (a process per rank, waits in the kernels, every peer reached by stores or the
proxy's flat transfers, posted before the wait) the send's last program does this itself,
after it has published (``LAY_OUT``: round 0 of a dispatch in rounds, ``moe_comm.normal_mode``):
every other program has finished by then and every rank publishes before it waits, so none
waits for a rank that is waiting.

**Expand** (``dispatch_expand_kernel``, on the destination, after every source's epoch
arrived): grid ``(R, P)`` of ``GPU_PROGRAMS`` programs on a GPU (a full wave whatever the counts:
it waits for nothing and what it writes is what the experts wait for, so it is not bounded by
``num_sms``); program ``(s, p)`` walks the tiles of source ``s``'s slots (their count is read on
the device), copies each staging row to output row ``row_base[s, e] + position`` for each local
expert ``e`` the token chose, and records that row in ``slot_rows`` so that combine can find it.
Every output is written, so none needs a fill launch: the padding rows (fewer than
``expert_alignment`` per expert, by program; and when the output was sized by
``max_recv_rows``, the rows past the last group, spread over every program) get zeros, source
-1 and weight 0, and ``slot_rows`` -1 past the last slot. In the *cached* form (the backward of
combine) the rows come from an earlier ``slot_rows`` and only the data moves.

Every store of row data is 16 bytes wide where rows are 16-byte aligned (the gate checks the
compiled code: lines marked ``# gate: row``).
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
    aligned_ptr,
    by_stores,
    check_descriptors,
    draw_last_of,
    local_ptr,
    one_thread,
    peer_ptr,
    publish_epoch_to,
    record_error,
    slots_in,
    timed_out,
    uniform_now_ns,
    wait_all_at_least,
    wait_all_or_exclude,
)
from .internode import PX_META_TGT, PX_ROWS_TGT, post_dispatch_flat
from .numerics import channel_tile, column
from .nvshmem import put_bytes, quiet
from .quant import NVFP4, scale_group
from .rows import load_send_tile, row_payload, sent_elem_bytes, store_rows
from .tiles import ZERO_TILES, even, per_source_programs, persistent_programs, tiles

_SEND_PER_CALL = ["rows_off", "meta_off", "counts_off", "signal_off", "local_base",
                  "errors_addr", "T", "t_base", "me", "timeout_ns", "alignment",
                  "mask_off"]


@triton.jit
def _destination(peer_ptrs, d, byte_offset, local_base, box_off, box_per_target,
                 dtype: tl.constexpr, ALIGN: tl.constexpr, PROXY_BOX: tl.constexpr):
    """Typed pointer to ``byte_offset`` in rank ``d``'s segment; with ``PROXY_BOX``, where
    ``d`` has no pointer (another node), to this rank's outbox for ``d`` instead
    (``box_off + d * box_per_target`` in its own segment)."""
    base = tl.load(peer_ptrs + d)
    addr = base + byte_offset
    if PROXY_BOX:
        addr = tl.where(base == 0, local_base + box_off + d * box_per_target, addr)
    return aligned_ptr(addr, dtype, ALIGN)


@triton.jit
def send_tokens(pid, programs, x, x_scales, topk_idx, topk_weights, slot_of, pair_pos,
                peer_ptrs, stats, rows_off, meta_off, box_rows_off, box_meta_off, local_base, T,
                t_base, H, K, R, me, ROW_BYTES, plan, xstats, META_STRIDE: tl.constexpr,
                KMAX: tl.constexpr, SEND_META: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                FP8: tl.constexpr, UE8M0: tl.constexpr, GS: tl.constexpr,
                TRANSPORT: tl.constexpr, PROXY_BOX: tl.constexpr, ALIGN: tl.constexpr,
                EVEN_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """Program ``pid`` of ``programs``: its token tiles of the send (every ``programs``-th)
    stored into every destination's staging at the offsets given (those of the epoch's
    parity), and its bytes added to ``stats`` (``dispatch_send_kernel``'s arguments).
    ``PROXY_BOX`` (``TRANSPORT`` 2, flat): a rank on another node gets its rows (and
    metadata) in this rank's outboxes for it instead, as ``kernels.internode``'s outbox
    kernel writes them (``box_rows_off`` / ``box_meta_off``: those of the parity, target 0;
    ``plan`` gives the bytes per target), their bytes added to ``xstats[0]``."""
    payload = row_payload(x, H, FP8, UE8M0, GS)
    row_bytes = payload
    if SEND_META:
        row_bytes += 4 * (1 + 3 * K)
    rows_per_target = 0
    meta_per_target = 0
    if PROXY_BOX:
        rows_per_target = tl.load(plan + PX_ROWS_TGT)
        meta_per_target = tl.load(plan + PX_META_TGT)
    to_peers = tl.zeros([1], tl.int64)
    to_self = tl.zeros([1], tl.int64)
    boxed = tl.zeros([1], tl.int64)
    for t0 in range(pid * BLOCK_T, T, programs * BLOCK_T):  # persistent
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < T
        t64 = t.to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            h, hm = channel_tile(h0, H, BLOCK_H, EVEN_H)
            m = tm[:, None] & hm[None, :]
            g = h0 // GS + tl.arange(0, BLOCK_H // GS)
            tile, codes, scales, exps = load_send_tile(x, x_scales, t64, tm, h0, h, hm, g, H,
                                                       BLOCK_T, BLOCK_H, FP8, UE8M0, GS,
                                                       EVEN_H)
            if TRANSPORT == 1:  # each token's row once into the outbox, for the NVSHMEM puts
                box8 = local_ptr(local_base, box_rows_off, tl.uint8, ALIGN) + t64 * ROW_BYTES
                if FP8 == 0:
                    boxx = box8.to(tl.pointer_type(x.dtype.element_ty), bitcast=True)
                    tl.store(boxx[:, None] + h[None, :], tile, mask=m)  # gate: row
                else:
                    store_rows(box8, h0, h, g, H, codes, scales, exps, tm, hm, UE8M0, GS,
                               EVEN_H)
            for d in range(R):
                slot = tl.load(slot_of + t * R + d, mask=tm, other=-1).to(tl.int64)
                sm = slot >= 0
                if not PROXY_BOX:
                    sm = by_stores(peer_ptrs, d + tl.zeros([BLOCK_T], tl.int32), sm, TRANSPORT)
                row8 = _destination(peer_ptrs, d, rows_off, local_base, box_rows_off,
                                    rows_per_target, tl.uint8, ALIGN, PROXY_BOX) \
                    + slot * ROW_BYTES
                if FP8 == 0:
                    rowx = row8.to(tl.pointer_type(x.dtype.element_ty), bitcast=True)
                    tl.store(rowx[:, None] + h[None, :], tile,  # gate: row live
                             mask=sm[:, None] & hm[None, :])
                else:
                    store_rows(row8, h0, h, g, H, codes, scales, exps, sm, hm, UE8M0, GS,
                               EVEN_H)
        if SEND_META:
            kk = tl.arange(0, BLOCK_K)
            m2 = tm[:, None] & (kk < K)[None, :]
            e = tl.load(topk_idx + t64[:, None] * K + kk[None, :], mask=m2, other=-1)
            pos = tl.load(pair_pos + t64[:, None] * K + kk[None, :], mask=m2, other=-1)
            if HAS_WEIGHTS:
                w = tl.load(topk_weights + t64[:, None] * K + kk[None, :], mask=m2, other=0.0)
            else:  # zeros travel too, so no receiver ever reads a stale weight
                w = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
            if TRANSPORT == 1:
                box_meta = local_ptr(local_base, box_meta_off, tl.int32, 4) + t64 * META_STRIDE
                tl.store(box_meta, t + t_base, mask=tm)
                tl.store(box_meta[:, None] + 1 + kk[None, :], e.to(tl.int32), mask=m2)
                tl.store(box_meta[:, None] + 1 + KMAX + kk[None, :], pos, mask=m2)
                tl.store(box_meta[:, None] + 1 + 2 * KMAX + kk[None, :],
                         w.to(tl.int32, bitcast=True), mask=m2)
            for d in range(R):
                slot = tl.load(slot_of + t * R + d, mask=tm, other=-1).to(tl.int64)
                sm = slot >= 0
                if not PROXY_BOX:
                    sm = by_stores(peer_ptrs, d + tl.zeros([BLOCK_T], tl.int32), sm, TRANSPORT)
                meta = _destination(peer_ptrs, d, meta_off, local_base, box_meta_off,
                                    meta_per_target, tl.int32, 4, PROXY_BOX) + slot * META_STRIDE
                tl.store(meta, t + t_base, mask=sm)
                sm2 = sm[:, None] & m2  # the same meta for every destination: global expert ids
                tl.store(meta[:, None] + 1 + kk[None, :], e.to(tl.int32), mask=sm2)
                tl.store(meta[:, None] + 1 + KMAX + kk[None, :], pos, mask=sm2)
                tl.store(meta[:, None] + 1 + 2 * KMAX + kk[None, :], w.to(tl.int32, bitcast=True),
                         mask=sm2)
        if TRANSPORT == 1:  # rows for NVSHMEM-only ranks: one block put per (token, rank)
            tl.debug_barrier()
            for i in range(BLOCK_T):
                ti = t0 + i
                for d in range(R):
                    slot = tl.load(slot_of + ti * R + d, mask=ti < T, other=-1).to(tl.int64)
                    if (slot >= 0) & (tl.load(peer_ptrs + d) == 0):
                        put_bytes(local_base, rows_off + slot * ROW_BYTES,
                                  box_rows_off + ti.to(tl.int64) * ROW_BYTES,
                                  row_bytes - SEND_META * 4 * (1 + 3 * K), d)
                        if SEND_META:
                            put_bytes(local_base, meta_off + slot * (4 * META_STRIDE),
                                      box_meta_off + ti.to(tl.int64) * (4 * META_STRIDE),
                                      4 * META_STRIDE, d)
        for d in range(R):
            slot = tl.load(slot_of + t * R + d, mask=tm, other=-1)
            sent = slot >= 0
            if TRANSPORT == 2:  # rows for other nodes go through the proxy (kernels.internode)
                remote = tl.load(peer_ptrs + d) == 0
                if PROXY_BOX:  # counted as the outbox kernel counts its own
                    boxed += tl.where(remote, tl.sum(sent.to(tl.int64), axis=0)
                                      * (payload + SEND_META * 4 * META_STRIDE), 0)
                sent = sent & ~remote
            nbytes = tl.sum(sent.to(tl.int64), axis=0) * row_bytes
            to_peers += tl.where(d != me, nbytes, 0)
            to_self += tl.where(d == me, nbytes, 0)
    if TRANSPORT == 1:  # this program's puts complete before its ticket (one thread, after all)
        tl.debug_barrier()
        if one_thread():
            quiet()
    tl.atomic_add(stats + tl.arange(0, 1), to_peers, sem="relaxed")
    tl.atomic_add(stats + 1 + tl.arange(0, 1), to_self, sem="relaxed")
    if PROXY_BOX:
        tl.atomic_add(xstats + tl.arange(0, 1), boxed, sem="relaxed")


@triton.jit
def publish_counts(counts, peer_ptrs, stats, counts_off, signal_off, box_counts_off, local_base,
                   epoch, R, L, SEND_META: tl.constexpr, TRANSPORT: tl.constexpr,
                   BLOCK_L: tl.constexpr):
    """The last program of a send: to every rank ``d``, its per-expert counts (``SEND_META``:
    ``counts[d]``, [L + 1]) and then ``epoch``; their bytes added to ``stats``."""
    lane = tl.arange(0, BLOCK_L)
    for d in range(R):
        if SEND_META:
            c = tl.load(counts + d * (L + 1) + lane, mask=lane < L + 1)
            dst_counts = peer_ptr(peer_ptrs, d, counts_off, tl.int32, 4)
            tl.store(dst_counts + lane, c,
                     mask=by_stores(peer_ptrs, d + lane * 0, lane < L + 1, TRANSPORT))
            if TRANSPORT == 1:
                if tl.load(peer_ptrs + d) == 0:  # counts travel from the outbox
                    box_counts = local_ptr(local_base, box_counts_off, tl.int32, 4)
                    tl.store(box_counts + d * (L + 1) + lane, c, mask=lane < L + 1)
                    tl.debug_barrier()
                    put_bytes(local_base, counts_off,
                              box_counts_off + d * (L + 1) * 4, 4 * (L + 1), d)
                    tl.debug_barrier()
                    if one_thread():
                        quiet()
        tl.debug_barrier()
        publish_epoch_to(peer_ptrs, d, signal_off, epoch, local_base, TRANSPORT)
    signal_bytes = 8 + SEND_META * 4 * (L + 1) + tl.zeros([1], tl.int64)
    reached = R
    if TRANSPORT == 2:
        reached = 0
        for d in range(R):
            reached += (tl.load(peer_ptrs + d) != 0).to(tl.int32)
    tl.atomic_add(stats + tl.arange(0, 1), (reached - 1) * signal_bytes, sem="relaxed")
    tl.atomic_add(stats + 1 + tl.arange(0, 1), signal_bytes, sem="relaxed")


@triton.jit(do_not_specialize=_SEND_PER_CALL)
def dispatch_send_kernel(
    x,  # [T, H] rows to send (FP8 == 2: uint8 view of float8_e4m3fn rows)
    x_scales,  # FP8 == 2: [T, H // GS] scales (NVFP4: bytes, rows.load_send_tile); NVFP4 and
               # FP8 == 1: [1] float32, the global scale
    topk_idx,  # [T, K] int64 (SEND_META)
    topk_weights,  # [T, K] float32 (SEND_META and HAS_WEIGHTS)
    slot_of,  # [T, R] int32: slot on rank d, -1 if not sent there
    pair_pos,  # [T, K] int32 (SEND_META): position among this rank's tokens for that expert
    counts,  # [R, L + 1] int32 (SEND_META): published to each rank d as dispatch_counts[p, me];
             # the cached form with PROXY_BOX: [R] int32, the rows sent to each rank
    peer_ptrs,  # [R] int64
    stats,  # [4] int64 local: bytes stored (to peers, to itself) at [0], [1]
    tickets,  # [1] int64 local ticket counter of this channel
    epochs,  # [1] int64 local: this channel's latest epoch; the last program advances it
    rows_off: tl.int64, meta_off: tl.int64, counts_off: tl.int64,  # this source's regions
    signal_off: tl.int64,  # (parity 0; the parity's offset is added here)
    rows_parity: tl.int64, meta_parity: tl.int64, counts_parity: tl.int64,  # bytes per parity
    box_rows_off: tl.int64, box_meta_off: tl.int64,  # TRANSPORT 1: the outboxes (parity 0)
    box_counts_off: tl.int64,
    box_rows_parity: tl.int64, box_meta_parity: tl.int64, box_counts_parity: tl.int64,
    local_base: tl.int64,  # TRANSPORT 1: address of this rank's segment (symmetric addresses)
    errors_addr: tl.int64,  # the error record: nothing is published after a timeout
    T: tl.int32,  # tokens of this round (rows of x)
    t_base: tl.int32,  # index of x's first token in the call (sent as each slot's token)
    H: tl.int32, K: tl.int32, R: tl.int32, L: tl.int32, me: tl.int32,
    ROW_BYTES: tl.int64,  # bytes between staging rows
    # LAY_OUT: received_layout_kernel's counts, signals and outputs, its timeout and alignment
    recv_counts, signals, row_base, tokens_per_expert, expert_offsets, slot_offsets,
    timeout_ns: tl.int64, alignment: tl.int32, COUNT_PARITY: tl.int64,
    live,  # LAY_OUT and FT: [R] int32 out, the sources that arrived (1) or did not (0)
    mask_off: tl.int64,  # LAY_OUT and FT: the mask words in this rank's segment
    plan,  # PROXY_BOX: [PLAN_FIELDS] int64 byte offsets (kernels.internode)
    xstats,  # PROXY_BOX: [4] int64 local, outbox bytes at [0]
    ring_addr: tl.int64, RING_SLOTS: tl.int32,  # PROXY_BOX: the proxy's ring
    META_STRIDE: tl.constexpr, KMAX: tl.constexpr,
    SEND_META: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    LAY_OUT: tl.constexpr,  # the last program then waits for every source and lays them out
    FT: tl.constexpr,  # (with LAY_OUT) that wait excludes a silent source (fault tolerance)
    FP8: tl.constexpr,  # 0: copy rows as they are; 1: quantize here; 2: rows come quantized
    UE8M0: tl.constexpr,  # power-of-two scales, sent as exponent bytes
    GS: tl.constexpr,  # channels per scale: 128, 32 (MXFP8, with UE8M0) or 16 (NVFP4)
    TRANSPORT: tl.constexpr,  # 0: stores through peer pointers; where the pointer is 0,
                              # 1: NVSHMEM; 2: the proxy (kernels.internode)
    PROXY_BOX: tl.constexpr,  # TRANSPORT 2, flat: rows for other nodes into the outboxes
                              # (box_*: px_rows, px_meta), one descriptor per rank there by
                              # the last program (hierarchical: kernels.internode's kernel)
    ALIGN: tl.constexpr,  # bytes every staging row address is a multiple of
    EVEN_H: tl.constexpr,  # BLOCK_H divides H: no channel masks
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, NUM_THREADS: tl.constexpr,
):
    epoch = tl.load(epochs) + 1  # device epochs and a fixed grid: no per-call scalar (graphs)
    parity = epoch % 2
    rows_off += parity * rows_parity
    meta_off += parity * meta_parity
    counts_off += parity * counts_parity
    box_rows_off += parity * box_rows_parity
    box_meta_off += parity * box_meta_parity
    box_counts_off += parity * box_counts_parity
    send_tokens(tl.program_id(0), tl.num_programs(0), x, x_scales, topk_idx, topk_weights,
                slot_of, pair_pos, peer_ptrs, stats, rows_off, meta_off, box_rows_off,
                box_meta_off, local_base, T, t_base, H, K, R, me, ROW_BYTES, plan, xstats,
                META_STRIDE, KMAX, SEND_META, HAS_WEIGHTS, FP8, UE8M0, GS, TRANSPORT, PROXY_BOX,
                ALIGN, EVEN_H, BLOCK_T, BLOCK_H, BLOCK_K)
    if draw_last_of(tickets, tl.num_programs(0)):
        if not timed_out(errors_addr.to(tl.pointer_type(tl.int64)), NUM_THREADS):
            publish_counts(counts, peer_ptrs, stats, counts_off, signal_off, box_counts_off,
                           local_base, epoch, R, L, SEND_META, TRANSPORT, BLOCK_L)
            if PROXY_BOX:  # (before LAY_OUT's wait: the other nodes wait for these)
                post_dispatch_flat(plan, counts, peer_ptrs, parity, epoch, R, L,
                                   row_payload(x, H, FP8, UE8M0, GS), ROW_BYTES, META_STRIDE,
                                   local_base, ring_addr, RING_SLOTS, errors_addr, timeout_ns,
                                   SEND_META, BLOCK_L)
        tl.store(epochs + tl.arange(0, 1), epoch + tl.zeros([1], tl.int64))
        if LAY_OUT:  # every program of this send has stored: waiting holds up no peer
            arrived = lay_out_received(recv_counts, signals, epoch, signals, row_base,
                                       tokens_per_expert, expert_offsets, slot_offsets,
                                       peer_ptrs, errors_addr, timeout_ns, mask_off, local_base,
                                       R, L, alignment, me, COUNT_PARITY, True, False, FT, 0,
                                       BLOCK_R, BLOCK_L, NUM_THREADS)
            if FT:
                src = tl.arange(0, BLOCK_R)
                tl.store(live + src, arrived.to(tl.int32), mask=src < R)


_EXPAND_PER_CALL = ["errors_addr", "max_rows", "me"]


@triton.jit
def expand_rows(s, first_slot, n, p, P, staging, staging_f32, meta, row_base, slot_rows, out,
                out_scales, out_global, out_weights, out_src_rank, out_src_token, max_rows, TMAX,
                H, K, L, me, G, SCALES, ROW_ELEMS, SCALE_ROW_STRIDE, SCALE_GROUP_STRIDE,
                META_STRIDE: tl.constexpr, KMAX: tl.constexpr, CACHED: tl.constexpr,
                HAS_WEIGHTS: tl.constexpr, FP8: tl.constexpr, UE8M0: tl.constexpr,
                GLOBAL: tl.constexpr, EVEN_H: tl.constexpr, SLOT_MAJOR: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_G: tl.constexpr):
    """Program ``p`` of ``P`` of source ``s``: every ``P``-th tile of its ``n`` slots, the
    first at ``first_slot`` of ``slot_rows``, copied from the staging (``staging`` and
    ``meta`` at the parity to read) to the output rows (``dispatch_expand_kernel``'s
    arguments)."""
    kk = tl.arange(0, BLOCK_K)
    for j0 in range(p * BLOCK_T, n, P * BLOCK_T):
        j = j0 + tl.arange(0, BLOCK_T)
        jm = j < n
        first_row = first_slot + j.to(tl.int64)  # rows of slot_rows
        staged = s.to(tl.int64) * TMAX + j
        m2 = jm[:, None] & (kk < K)[None, :]
        if CACHED:  # the output row of every (slot, choice), loaded once per tile
            row = tl.load(slot_rows + first_row[:, None] * K + kk[None, :], mask=m2, other=-1)
        else:
            mrow = meta + staged * META_STRIDE
            e = tl.load(mrow[:, None] + 1 + kk[None, :], mask=m2, other=-1) - me * L
            pos = tl.load(mrow[:, None] + 1 + KMAX + kk[None, :], mask=m2, other=-1)
            valid = m2 & (e >= 0) & (e < L)  # choices of this rank's experts
            base = tl.load(row_base + s * L + e, mask=valid, other=0)
            row = tl.where(valid, base + pos, -1)
            row = tl.where(row < max_rows, row, -1)  # beyond `out`: recorded above
            valid = row >= 0
            tl.store(slot_rows + first_row[:, None] * K + kk[None, :], row.to(tl.int32), mask=m2)
            token = tl.load(mrow, mask=jm, other=0).to(tl.int64)
            tl.store(out_src_rank + row, s.to(tl.int64) + tl.zeros_like(row), mask=valid)
            tl.store(out_src_token + row, token[:, None] + tl.zeros_like(row), mask=valid)
            if HAS_WEIGHTS:
                w = tl.load(mrow[:, None] + 1 + 2 * KMAX + kk[None, :], mask=valid, other=0)
                tl.store(out_weights + row, w.to(tl.float32, bitcast=True), mask=valid)
        dsts = ()  # each choice's output rows (-1: none; int32 as in slot_rows), taken out of
        if not SLOT_MAJOR:  # the tile once, here: the channel loop's stores then wait on no
            row = row.to(tl.int32)  # reduction across warps
            for k in tl.static_range(BLOCK_K):  # (columns from K on are -1)
                dsts = dsts + (column(row, k),)
        for h0 in range(0, H, BLOCK_H):
            h, hm = channel_tile(h0, H, BLOCK_H, EVEN_H)
            tile = tl.load(staging + staged[:, None] * ROW_ELEMS + h[None, :],
                           mask=jm[:, None] & hm[None, :])
            if SLOT_MAJOR:  # the slot's row once, at the slot
                tl.store(out + first_row[:, None] * H + h[None, :], tile,  # gate: row
                         mask=jm[:, None] & hm[None, :])
            else:
                for k in tl.static_range(BLOCK_K):  # each choice's rows from registers
                    dst_row = dsts[k].to(tl.int64)
                    tl.store(out + dst_row[:, None] * H + h[None, :], tile,  # gate: row live
                             mask=(dst_row >= 0)[:, None] & hm[None, :])
        if FP8:  # the scales follow the H code bytes of each staging row (kernels.rows)
            g = tl.arange(0, BLOCK_G)
            gm = jm[:, None] & (g < G)[None, :]
            codes_end = staged * ROW_ELEMS + H
            if UE8M0:
                sc = tl.load(staging + codes_end[:, None] + 4 * GLOBAL + g[None, :],
                             mask=gm & (g < SCALES)[None, :], other=0)
            else:
                sc = tl.load(staging_f32 + codes_end[:, None] // 4 + g[None, :], mask=gm)
            if GLOBAL:
                glob = tl.load(staging_f32 + codes_end // 4, mask=jm)
            if SLOT_MAJOR:
                if GLOBAL:
                    tl.store(out_global + first_row, glob, mask=jm)
                _store_scales(out_scales, first_row, g, sc, gm, SCALE_ROW_STRIDE,
                              SCALE_GROUP_STRIDE, UE8M0)
            else:
                for k in tl.static_range(BLOCK_K):
                    dst_row = dsts[k].to(tl.int64)
                    if GLOBAL:
                        tl.store(out_global + dst_row, glob, mask=dst_row >= 0)
                    _store_scales(out_scales, dst_row, g, sc, gm & (dst_row >= 0)[:, None],
                                  SCALE_ROW_STRIDE, SCALE_GROUP_STRIDE, UE8M0)


@triton.jit(do_not_specialize=_EXPAND_PER_CALL)
def dispatch_expand_kernel(
    staging,  # [P, R, TMAX, ROW_BYTES / elem] local dispatch_rows (FP8: uint8)
    staging_f32,  # the same memory as float32 (FP8 scales)
    meta,  # [P, R, TMAX, META_STRIDE] int32 local dispatch_meta (not CACHED)
    epochs,  # [1] int64 local: the dispatch epoch (this call's: its parity is read here)
    slot_offsets,  # [R + 1] int64: first row of each source in slot_rows (its slots: the diff)
    live,  # [R] int32 (LIVE): 0 for a source whose rows did not arrive (none are read)
    row_base,  # [R, L] int64: first output row of (source, local expert) (not CACHED)
    tokens_per_expert,  # [L] int64: rows of each local expert, without padding
    expert_offsets,  # [L + 1] int64: first row of each local expert's padded group
    slot_rows,  # [R * TMAX, K] int32: output row of (slot, choice) or -1; written, or read
    out,  # [max_rows, H] (FP8: uint8 view of float8_e4m3fn; NVFP4: H is half the channels);
    # SLOT_MAJOR: [slots, H], the row of slot i at i (each received token once)
    out_scales,  # FP8: [rows, G] float32, or UE8M0: uint8 view of packed int32 [rows, G/4]
    out_global,  # NVFP4 (GLOBAL): [rows] float32, each row's global scale (SLOT_MAJOR: slots)
    out_weights,  # [rows] float32 (not CACHED, HAS_WEIGHTS)
    out_src_rank, out_src_token,  # [rows] int64 (not CACHED)
    errors_addr: tl.int64,  # input record: more rows arrived than `out` holds
    max_rows: tl.int64,  # rows of `out` (SLOT_MAJOR: of out_weights / out_src_*)
    TMAX: tl.int32,  # staging slots per source (the ring's)
    SLOTS: tl.int64,  # rows of slot_rows (R * max_tokens)
    H: tl.int32, K: tl.int32, L: tl.int32, me: tl.int32,
    G: tl.int32,  # FP8: scales per output row (UE8M0: bytes of its int32 words)
    SCALES: tl.int32,  # FP8: scales per staging row (UE8M0: the first SCALES of the G bytes)
    ROW_ELEMS: tl.int64,  # staging row stride in elements of `staging`
    STAGING_PARITY: tl.int64, META_PARITY: tl.int64,  # elements between the two parities
    SCALE_ROW_STRIDE: tl.int64, SCALE_GROUP_STRIDE: tl.int64,  # out_scales strides (elements;
                                                               # int32 words for UE8M0)
    META_STRIDE: tl.constexpr, KMAX: tl.constexpr,
    CACHED: tl.constexpr, HAS_WEIGHTS: tl.constexpr, FP8: tl.constexpr,
    UE8M0: tl.constexpr,  # byte scales: exponents, MXFP8's E8M0 or NVFP4's e4m3 (G counts the
                          # bytes of a row's int32 words: the last word's spare bytes are zeros)
    GLOBAL: tl.constexpr,  # NVFP4: a float32 global scale between the codes and the scales
    LIVE: tl.constexpr, EVEN_H: tl.constexpr,
    SLOT_MAJOR: tl.constexpr,  # rows (and scales) by slot, once each; the rest by output row
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_Z: tl.constexpr,  # rows per padding tile (stores of constants: wider than BLOCK_T)
):
    s = tl.program_id(0)
    p = tl.program_id(1)
    P = tl.num_programs(1)
    R = tl.num_programs(0)
    parity = tl.load(epochs) % 2
    staging += parity * STAGING_PARITY
    staging_f32 += parity * STAGING_PARITY * staging.dtype.element_ty.primitive_bitwidth // 32
    if not CACHED:
        meta += parity * META_PARITY
    first_slot = tl.load(slot_offsets + s)
    n = (tl.load(slot_offsets + s + 1) - first_slot).to(tl.int32)
    if LIVE:
        n = tl.where(tl.load(live + s) != 0, n, 0)
    total = tl.load(expert_offsets + L)
    if (s == 0) & (p == 0):
        if total > max_rows:
            record_error(errors_addr.to(tl.pointer_type(tl.int64)), INPUT_RECORD, TOO_MANY_ROWS,
                         total, max_rows)
    expand_rows(s, first_slot, n, p, P, staging, staging_f32, meta, row_base, slot_rows, out,
                out_scales, out_global, out_weights, out_src_rank, out_src_token, max_rows, TMAX,
                H, K, L, me, G, SCALES, ROW_ELEMS, SCALE_ROW_STRIDE, SCALE_GROUP_STRIDE,
                META_STRIDE, KMAX, CACHED, HAS_WEIGHTS, FP8, UE8M0, GLOBAL, EVEN_H, SLOT_MAJOR,
                BLOCK_T, BLOCK_H, BLOCK_K, BLOCK_G)
    expand_padding(s * P + p, R * P, expert_offsets, tokens_per_expert, total,
                   tl.load(slot_offsets + R), slot_rows, out, out_scales, out_global,
                   out_weights, out_src_rank, out_src_token, max_rows, SLOTS, H, K, L, G,
                   SCALE_ROW_STRIDE, SCALE_GROUP_STRIDE, CACHED, HAS_WEIGHTS, FP8, UE8M0,
                   GLOBAL, EVEN_H, SLOT_MAJOR, BLOCK_H, BLOCK_K, BLOCK_G, BLOCK_Z)


@triton.jit
def expand_padding(q, Q, expert_offsets, tokens_per_expert, total, slots_end, slot_rows, out,
                   out_scales, out_global, out_weights, out_src_rank, out_src_token, max_rows,
                   SLOTS, H, K, L, G, SCALE_ROW_STRIDE, SCALE_GROUP_STRIDE,
                   CACHED: tl.constexpr, HAS_WEIGHTS: tl.constexpr, FP8: tl.constexpr,
                   UE8M0: tl.constexpr, GLOBAL: tl.constexpr, EVEN_H: tl.constexpr,
                   SLOT_MAJOR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_Z: tl.constexpr):
    """Program ``q`` of ``Q``: its share of the rows of an expand that no slot fills. The
    padding rows are the only rows zeroed (with src_rank/src_token -1, weight and scales 0):
    fewer than expert_alignment per expert, by program e; and the rows of ``out`` past the
    last group (from ``total`` = expert_offsets[L] to max_rows), in tiles spread over every
    program; and (not CACHED) the rows of ``slot_rows`` from ``slots_end`` on, -1."""
    kk = tl.arange(0, BLOCK_K)
    for e in range(q, L, Q):
        start = tl.load(expert_offsets + e) + tl.load(tokens_per_expert + e)
        end = tl.minimum(tl.load(expert_offsets + e + 1), max_rows)
        for pad0 in range(start, end, BLOCK_Z):
            _zero_rows(out, out_scales, out_global, out_weights, out_src_rank, out_src_token,
                       pad0 + tl.arange(0, BLOCK_Z), end, H, G, SCALE_ROW_STRIDE,
                       SCALE_GROUP_STRIDE, CACHED, HAS_WEIGHTS, FP8, UE8M0, GLOBAL, EVEN_H,
                       not SLOT_MAJOR, BLOCK_Z, BLOCK_H, BLOCK_G)
    for tail0 in range(total + q * BLOCK_Z, max_rows, Q * BLOCK_Z):
        _zero_rows(out, out_scales, out_global, out_weights, out_src_rank, out_src_token,
                   tail0 + tl.arange(0, BLOCK_Z), max_rows, H, G, SCALE_ROW_STRIDE,
                   SCALE_GROUP_STRIDE, CACHED, HAS_WEIGHTS, FP8, UE8M0, GLOBAL, EVEN_H,
                   not SLOT_MAJOR, BLOCK_Z, BLOCK_H, BLOCK_G)
    if not CACHED:  # slot_rows past the last slot: -1 (every row of it is written)
        for slot0 in range(slots_end + q * BLOCK_Z, SLOTS, Q * BLOCK_Z):
            r = (slot0 + tl.arange(0, BLOCK_Z)).to(tl.int64)
            tl.store(slot_rows + r[:, None] * K + kk[None, :],
                     tl.full([BLOCK_Z, BLOCK_K], -1, tl.int32),
                     mask=(r < SLOTS)[:, None] & (kk < K)[None, :])


@triton.jit
def _store_scales(out_scales, dst_row, g, sc, mask, SCALE_ROW_STRIDE, SCALE_GROUP_STRIDE,
                  UE8M0: tl.constexpr):
    """Scales ``sc`` [rows, BLOCK_G] of output rows ``dst_row`` (float32 per group, or with
    UE8M0 byte g % 4 of int32 word g // 4)."""
    if UE8M0:
        word = (g // 4)[None, :] * SCALE_GROUP_STRIDE + dst_row[:, None] * SCALE_ROW_STRIDE
        tl.store(out_scales + word * 4 + (g % 4)[None, :], sc, mask=mask)
    else:
        tl.store(out_scales + g[None, :] * SCALE_GROUP_STRIDE
                 + dst_row[:, None] * SCALE_ROW_STRIDE, sc, mask=mask)


@triton.jit
def _zero_rows(out, out_scales, out_global, out_weights, out_src_rank, out_src_token, r, end, H,
               G, SCALE_ROW_STRIDE, SCALE_GROUP_STRIDE, CACHED: tl.constexpr,
               HAS_WEIGHTS: tl.constexpr, FP8: tl.constexpr, UE8M0: tl.constexpr,
               GLOBAL: tl.constexpr, EVEN_H: tl.constexpr, DATA: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr):
    """Output rows ``r`` (those below ``end``) as padding: zero data, scales and weight, source
    -1 (without ``DATA``, whose rows and scales are by slot: weight and source only)."""
    rm = r < end
    r64 = r.to(tl.int64)
    if not CACHED:
        tl.store(out_src_rank + r64, tl.full([BLOCK_T], -1, tl.int64), mask=rm)
        tl.store(out_src_token + r64, tl.full([BLOCK_T], -1, tl.int64), mask=rm)
        if HAS_WEIGHTS:
            tl.store(out_weights + r64, tl.zeros([BLOCK_T], tl.float32), mask=rm)
        if FP8 and DATA:
            g = tl.arange(0, BLOCK_G)
            zeros = tl.zeros([BLOCK_T, BLOCK_G], out_scales.dtype.element_ty)
            _store_scales(out_scales, r64, g, zeros, rm[:, None] & (g < G)[None, :],
                          SCALE_ROW_STRIDE, SCALE_GROUP_STRIDE, UE8M0)
            if GLOBAL:
                tl.store(out_global + r64, tl.zeros([BLOCK_T], tl.float32), mask=rm)
    if DATA:
        for h0 in range(0, H, BLOCK_H):
            h, hm = channel_tile(h0, H, BLOCK_H, EVEN_H)
            tl.store(out + r64[:, None] * H + h[None, :],  # gate: row
                     tl.zeros([BLOCK_T, BLOCK_H], out.dtype.element_ty),
                     mask=rm[:, None] & hm[None, :])


def dispatch_send(x, topk_idx, topk_weights, slot_of, pair_pos, counts, peer_ptrs, stats,
                  tickets, epochs, *, offsets: dict, rank: int, num_local_experts: int,
                  meta_stride: int, max_topk: int, grid: int, topk: int, row_bytes: int,
                  fp8: int = 0, x_scales=None, ue8m0: int = 0,
                  flavour: Flavour = CPU_RANKS, box_offsets: tuple = ((0, 0),) * 3,
                  bound: BoundLaunches | None = None, t_base: int = 0,
                  lay_out: tuple | None = None, live: torch.Tensor | None = None,
                  plan: torch.Tensor | None = None, xstats: torch.Tensor | None = None) -> bool:
    """Launches ``grid`` persistent send programs (:func:`send_grid`, fixed by the Buffer).

    ``x`` (and the per-token tensors) may be one round's window of a call's tokens, ``t_base``
    the index of its first token (``moe_comm.normal_mode``: each slot's metadata names the
    token by its index in the call); ``slot_of`` then gives ring positions.

    ``offsets``: rows / meta / counts -> (byte offset of this source's slice of parity 0, bytes
    per parity), signal -> byte offset; the kernel takes the call's epoch from ``epochs`` (the
    channel's device word) and its parity from the epoch, so nothing here changes per call.
    With ``topk_idx=None`` (the cached form) only rows and the epoch are sent. ``fp8``: 0 sends
    rows as they are, 1 quantizes them, 2 sends the given float8 rows (``x``) and ``x_scales``
    (float32; E8M0 bytes for MXFP8; NVFP4: ``x`` [T, H/2] packed, ``x_scales`` [T, H/16 + 4]
    bytes as ``rows.load_send_tile`` reads them). NVFP4 with ``fp8 == 1``: ``x_scales`` is
    the global scale [1] float32. ``ue8m0``: 0 float32 scales per 128 channels, 1
    power-of-two scales per 128 sent as exponent bytes, 2 MXFP8 (the same per 32 channels),
    3 NVFP4 (``kernels.rows``).
    ``row_bytes``: staging row stride.
    Across nodes (``flavour.transport == 1``) ``box_offsets`` are (offset, parity stride) of
    the rdma_rows / rdma_meta / rdma_counts outboxes; through the proxy, flat
    (``Flavour.proxy_box``), those of px_rows / px_meta / px_counts (target 0), ``plan`` and
    ``xstats`` ``kernels.internode``'s: the send fills them and posts one descriptor per rank
    on another node (no outbox launch; the cached form takes ``counts`` [R] int32, the rows
    it sends each rank). ``bound``: the owner's bound launches
    (``kernels.bound``; the caller's tensors, the layout's and the token count vary).

    ``lay_out`` (waits in the kernel; every peer reached by stores, or through the proxy
    flat, its descriptors posted before the wait):
    ``(counts, signals, row_base, tokens_per_expert, expert_offsets, slot_offsets,
    alignment)``, :func:`received_layout`'s. The send's last program then also does what
    that launch would: it waits for every source's epoch and writes the receive's layout.
    Only where every rank runs its own launch at once (processes of their own): a send that
    waits would hold up a virtual rank sending after it. With ``flavour.fault_tolerant`` that
    wait excludes a source silent until the deadline (it counts zero) and writes who arrived
    into ``live`` ([R] int32).
    """
    T, H = x.shape
    if fp8 == 2 and ue8m0 == NVFP4:  # x: two e2m1 codes per byte
        H *= 2
    send_meta = topk_idx is not None
    has_weights = topk_weights is not None
    dummy = slot_of
    if fp8 == 2:
        x = x.view(torch.uint8)
        x_scales = x_scales.view(torch.uint8) if ue8m0 else x_scales
    recv_counts, signals, *outs, alignment = lay_out or (*(epochs,) * 6, 1)  # (the Buffer's)
    ft = lay_out is not None and flavour.fault_tolerant
    if ft and live is None:
        raise ValueError("a fault-tolerant send that lays out what arrived writes it to live")
    box = flavour.proxy_box
    if box and (plan is None or xstats is None or counts is None):
        raise ValueError("a flat send through the proxy takes plan, xstats and counts")
    values = (x, dummy if x_scales is None else x_scales, topk_idx if send_meta else dummy,
              topk_weights if has_weights else dummy, slot_of, pair_pos if send_meta else dummy,
              counts if send_meta or box else dummy, T, t_base, *outs)
    key = ("dispatch_send", H, topk, x_scales is None,
           send_meta, has_weights, id(peer_ptrs), id(stats), id(tickets), id(epochs),
           id(offsets), rank, num_local_experts, meta_stride, max_topk, grid, row_bytes, fp8,
           ue8m0, id(flavour), box_offsets, id(recv_counts), id(signals), alignment,
           id(live) if ft else None, id(plan) if box else None, id(xstats) if box else None)
    if call_bound(bound, key, values):
        return True
    R = peer_ptrs.numel()
    tile = send_tiles(flavour, H, fp8, ue8m0, x.element_size(), lay_out is not None)
    args = (
        *values[:7], peer_ptrs, stats, tickets, epochs, offsets["rows"][0],
        offsets["meta"][0], offsets["counts"][0], offsets["signal"], offsets["rows"][1],
        offsets["meta"][1], offsets["counts"][1], *(off for off, _ in box_offsets),
        *(stride for _, stride in box_offsets), flavour.local_base, flavour.errors_addr, T,
        t_base, H, topk, R, num_local_experts, rank, row_bytes, recv_counts, signals, *outs,
        flavour.timeout_ns, alignment, recv_counts.stride(0) if lay_out else 0,
        live if ft else epochs, flavour.mask_off if ft else 0, plan if box else epochs,
        xstats if box else epochs, flavour.ring_addr if box else 0,
        flavour.ring_slots if box else 0)
    kwargs = dict(
        META_STRIDE=meta_stride, KMAX=max_topk,
        SEND_META=send_meta, HAS_WEIGHTS=has_weights, LAY_OUT=lay_out is not None, FT=ft,
        FP8=fp8,
        UE8M0=bool(ue8m0),
        GS=scale_group(ue8m0), TRANSPORT=flavour.transport, PROXY_BOX=box,
        ALIGN=flavour.row_align,
        EVEN_H=even(H, tile.block_h),
        BLOCK_T=tile.block_t, BLOCK_H=tile.block_h, BLOCK_K=triton.next_power_of_2(max(topk, 1)),
        BLOCK_L=triton.next_power_of_2(num_local_experts + 1),
        BLOCK_R=triton.next_power_of_2(R) if lay_out else 1,
        NUM_THREADS=tile.num_threads, **flavour.launch_options(tile))
    launch(bound, key, dispatch_send_kernel, (grid,), args, kwargs,
           ("x", "x_scales", "topk_idx", "topk_weights", "slot_of", "pair_pos", "counts", "T",
            "t_base", "row_base", "tokens_per_expert", "expert_offsets", "slot_offsets"))
    return True


def send_tiles(flavour: Flavour, hidden: int, fp8: int, ue8m0: int, x_elem_bytes: int,
               lay_out: bool = False):
    """The tiles of :func:`dispatch_send_kernel` for a send of format ``(fp8, ue8m0)`` of rows
    of ``x_elem_bytes`` (``lay_out``: its last program lays out what arrived): over NVSHMEM
    one that quantizes and lays out takes tiles of its own (``kernels.tiles``: fewer tokens,
    no spills)."""
    kernel = ("dispatch_send_nvshmem_quantizing"
              if flavour.transport == 1 and fp8 == 1 and lay_out else "dispatch_send")
    return tiles(kernel, flavour.compiled, hidden, sent_elem_bytes(fp8, ue8m0, x_elem_bytes))


def send_grid(max_tokens: int, hidden: int, num_sms: int | None, flavour: Flavour,
              elem_bytes: int) -> int:
    """Programs of a dispatch send: one per tile of ``max_tokens`` (the Buffer's: the grid
    never changes, which the last-program ticket needs), at most ``num_sms`` (persistent);
    ``elem_bytes``: bytes per element of the rows sent (1 for FP8)."""
    tile = tiles("dispatch_send", flavour.compiled, hidden, elem_bytes)
    return persistent_programs(triton.cdiv(max_tokens, tile.block_t), num_sms)


def expand_grid(world_size: int, flavour: Flavour) -> tuple[int, int]:
    """``(R, P)``: the expand grid, fixed by the world size (``tiles.per_source_programs``)."""
    return world_size, per_source_programs(world_size, flavour.compiled)


_EXPAND_VARYING = ("staging", "staging_f32", "meta", "slot_offsets", "live", "row_base",
                   "tokens_per_expert", "expert_offsets", "slot_rows", "out", "out_scales",
                   "out_global", "out_weights", "out_src_rank", "out_src_token", "max_rows")


def dispatch_expand(staging, meta, epochs, slot_offsets, row_base, tokens_per_expert,
                    expert_offsets, slot_rows, out, out_weights, out_src_rank, out_src_token, *,
                    rank: int, topk: int, num_local_experts: int, meta_stride: int,
                    max_topk: int, flavour: Flavour = CPU_RANKS, out_scales=None,
                    scale_strides=(0, 0), ue8m0: int = 0, out_global=None, live=None,
                    bound: BoundLaunches | None = None, slot_major: bool = False) -> bool:
    """Launches the ``(R, P)`` expand programs of :func:`expand_grid`.

    ``staging`` / ``meta``: the whole dispatch_rows / dispatch_meta regions [P, R, TMAX, ...];
    the kernel reads the parity from ``epochs`` (the dispatch channel's device epoch).
    ``slot_offsets`` [R + 1] int64 (:func:`received_layout`): where each source's slots start
    in ``slot_rows``, the diff being their count. The outputs may be uninitialised memory:
    every row of ``out`` is written (padding as zeros, ``src_rank`` / ``src_token`` -1 and
    weight 0 there), and every row of ``slot_rows`` (-1 past ``slot_offsets[-1]``).
    With ``meta=None`` (the cached form) rows are placed by the given ``slot_rows`` alone;
    ``live`` [R] int32 (fault tolerance): the sources whose rows arrived (the others' rows are
    not read: ``out`` must be zeros there). ``slot_major`` (not cached): ``out``, its scales
    and global scales are [slots, ...]: received slot ``i`` (``slot_offsets`` order) once at
    ``i`` (DeepEP's order within a round); weights and sources stay by output row
    (``out_src_rank``'s rows, padding included)::

        out[i] = staged row of slot i        (instead of out[slot_rows[i, k]] for each k)
    Quantized rows (``out_scales`` given; ``out`` float8, or uint8 [rows, H/2] for NVFP4):
    ``staging`` is the uint8 view, ``out_scales`` the contiguous memory of the scales
    (float32, or int32 words of byte scales with ``ue8m0``: exponents per 128 channels, E8M0
    per 32 for MXFP8 (``ue8m0 == 2``), e4m3 per 16 for NVFP4 (3), whose rows' global scales
    go to ``out_global`` [rows] float32) and ``scale_strides`` its (row, group) strides in
    elements. Rows that would land past ``out``'s end are dropped and recorded in the error
    record (TOO_MANY_ROWS). ``bound``: the owner's bound launches (the layout's tensors and
    the outputs vary).
    """
    R, TMAX = staging.shape[1:3]
    H = out.shape[1]
    fp8 = out_scales is not None
    nvfp4 = fp8 and ue8m0 == NVFP4
    elem_bytes = out.element_size()
    cached = meta is None
    if slot_major and cached:
        raise ValueError("slot_major is a first dispatch's (meta given)")
    has_weights = out_weights is not None
    dummy = slot_offsets
    if fp8:
        out = out.view(torch.uint8)
        out_scales = out_scales.view(torch.uint8) if ue8m0 else out_scales
    values = (staging, staging.view(torch.float32) if fp8 else dummy,
              dummy if cached else meta, slot_offsets,
              dummy if live is None else live, dummy if cached else row_base, tokens_per_expert,
              expert_offsets, slot_rows, out, out_scales if fp8 else dummy,
              out_global if nvfp4 else dummy, out_weights if has_weights else dummy,
              dummy if cached else out_src_rank, dummy if cached else out_src_token,
              out.shape[0] if cached else out_src_rank.shape[0])
    key = ("dispatch_expand", staging.shape, staging.stride(), slot_rows.shape, H, elem_bytes,
           live is None, cached, has_weights,
           None if cached else meta.stride(0), id(epochs), rank, topk, num_local_experts,
           meta_stride, max_topk, id(flavour), scale_strides, ue8m0, slot_major)
    if call_bound(bound, key, values):
        return True
    groups = (2 * H if nvfp4 else H) // scale_group(ue8m0) if fp8 else 0
    per_row = 4 * triton.cdiv(groups, 4) if fp8 and ue8m0 else groups  # bytes of int32 words
    tile = tiles("dispatch_expand", flavour.compiled, H, elem_bytes)
    args = (
        *values[:3], epochs, *values[3:15],
        flavour.errors_addr, values[15],
        TMAX, slot_rows.shape[0], H, topk, num_local_experts, rank, per_row, groups,
        staging.stride(2),
        staging.stride(0), 0 if cached else meta.stride(0), scale_strides[0], scale_strides[1])
    kwargs = dict(
        META_STRIDE=meta_stride, KMAX=max_topk, CACHED=cached, HAS_WEIGHTS=has_weights,
        FP8=fp8, UE8M0=bool(fp8 and ue8m0), GLOBAL=nvfp4, LIVE=live is not None,
        EVEN_H=even(H, tile.block_h), SLOT_MAJOR=slot_major, BLOCK_T=tile.block_t,
        BLOCK_H=tile.block_h,
        BLOCK_K=triton.next_power_of_2(max(topk, 1)),
        BLOCK_G=triton.next_power_of_2(max(per_row, 1)), BLOCK_Z=ZERO_TILES * tile.block_t,
        **tile.launch_options())
    launch(bound, key, dispatch_expand_kernel, expand_grid(R, flavour), args, kwargs,
           _EXPAND_VARYING)
    return True


_RECV_LAYOUT_PER_CALL = ["errors_addr", "timeout_ns", "alignment", "local_base", "me"]


@triton.jit
def lay_out_received(counts, signals, expected, live, row_base, tokens_per_expert,
                     expert_offsets, slot_offsets, peer_ptrs, errors_addr, timeout_ns, mask_off,
                     local_base, R, L, alignment, me, COUNT_PARITY, WAIT: tl.constexpr,
                     LIVE: tl.constexpr, FT: tl.constexpr, TRANSPORT: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr, NUM_THREADS: tl.constexpr):
    """One program, the dispatch epoch ``expected``: with WAIT it first waits for every
    source's epoch (all at once, bounded; a timeout leaves every count zero; FT: a source that
    stays silent is excluded and counts zero, and a rank that finds itself excluded counts
    nothing), then turns the counts the sources published into the receive's layout (no host
    read; the arguments are :func:`received_layout_kernel`'s); a source whose call descriptor
    differs from this rank's is recorded (``comm.check_descriptors``). Returns the sources
    laid out ([BLOCK_R] bool)."""
    src = tl.arange(0, BLOCK_R)
    sm = src < R
    arrived = sm
    if WAIT:
        deadline = uniform_now_ns(NUM_THREADS) + timeout_ns
        errors = errors_addr.to(tl.pointer_type(tl.int64))
        if FT:
            mask = (local_base + mask_off).to(tl.pointer_type(tl.int64))
            arrived, ok = wait_all_or_exclude(signals, 1, R, expected, 0, deadline, errors,
                                              signals, mask, me, peer_ptrs, mask_off, R,
                                              local_base, BLOCK_R, NUM_THREADS, TRANSPORT, False)
            arrived = arrived & ok
        else:
            arrived = sm & wait_all_at_least(signals, 1, R, expected, 0, deadline, errors,
                                             signals, BLOCK_R, NUM_THREADS, False)
    e = tl.arange(0, BLOCK_L)
    em = e < L
    counts += (expected % 2) * COUNT_PARITY
    per_source = tl.load(counts + src[:, None] * (L + 1) + e[None, :],
                         mask=sm[:, None] & em[None, :], other=0).to(tl.int64)
    words = tl.load(counts + src * (L + 1) + L, mask=sm, other=0).to(tl.int64)
    keep = sm & arrived
    if LIVE:
        keep = keep & (tl.load(live + src, mask=sm, other=0) != 0)
    check_descriptors(words, keep, src, me, expected, errors_addr)
    slots = slots_in(words)
    per_source = tl.where(keep[:, None], per_source, 0)
    slots = tl.where(keep, slots, 0)
    per_expert = tl.sum(per_source, axis=0)
    padded = (per_expert + alignment - 1) // alignment * alignment
    expert_end = tl.cumsum(padded, axis=0)
    first_rows = (expert_end - padded)[None, :] + tl.cumsum(per_source, axis=0) - per_source
    tl.store(row_base + src[:, None] * L + e[None, :], first_rows,
             mask=sm[:, None] & em[None, :])
    tl.store(tokens_per_expert + e, per_expert, mask=em)
    zero = tl.zeros([1], tl.int64)
    tl.store(expert_offsets + e + 1, expert_end, mask=em)
    tl.store(expert_offsets + tl.arange(0, 1), zero)
    tl.store(slot_offsets + src + 1, tl.cumsum(slots, axis=0), mask=sm)
    tl.store(slot_offsets + tl.arange(0, 1), zero)
    return keep


@triton.jit(do_not_specialize=_RECV_LAYOUT_PER_CALL)
def received_layout_kernel(
    counts,  # [P, R, L + 1] int32 local dispatch_counts
    signals,  # [R] int64 local signal words of the dispatch channel (WAIT)
    epochs,  # [1] int64 local: the dispatch epoch (this call's)
    live,  # [R] int32 (LIVE): 0 for a source that did not arrive (fault tolerance)
    row_base,  # [R, L] int64 out: first output row of (source, local expert)
    tokens_per_expert,  # [L] int64 out: rows of each local expert, without padding
    expert_offsets,  # [L + 1] int64 out: first row of each local expert's padded group
    slot_offsets,  # [R + 1] int64 out: first row of each source in slot_rows
    peer_ptrs,  # [R] int64 (FT: the exclusions go to every rank)
    errors_addr: tl.int64, timeout_ns: tl.int64,
    mask_off: tl.int64, local_base: tl.int64,  # FT: the mask words in this rank's segment
    R: tl.int32, L: tl.int32, alignment: tl.int32, me: tl.int32,
    COUNT_PARITY: tl.int64,  # elements between the two parities of counts
    WAIT: tl.constexpr, LIVE: tl.constexpr,
    FT: tl.constexpr,  # (with WAIT) a source silent until the deadline is excluded, counts 0
    TRANSPORT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr, NUM_THREADS: tl.constexpr,
):
    """One program: :func:`lay_out_received` of this call's epoch."""
    lay_out_received(counts, signals, tl.load(epochs), live, row_base, tokens_per_expert,
                     expert_offsets, slot_offsets, peer_ptrs, errors_addr, timeout_ns, mask_off,
                     local_base, R, L, alignment, me, COUNT_PARITY, WAIT, LIVE, FT, TRANSPORT,
                     BLOCK_R, BLOCK_L, NUM_THREADS)


def received_layout_outputs(world_size: int, num_local_experts: int, device,
                            slot_offsets: torch.Tensor | None = None,
                            row_base: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Uninitialised ``(row_base [R, L], tokens_per_expert [L], expert_offsets [L + 1],
    slot_offsets [R + 1])`` int64 for :func:`received_layout` (``slot_offsets``, ``row_base``
    given: they)."""
    R, L, i64 = world_size, num_local_experts, torch.int64
    return (torch.empty((R, L), dtype=i64, device=device) if row_base is None else row_base,
            torch.empty(L, dtype=i64, device=device), torch.empty(L + 1, dtype=i64, device=device),
            torch.empty(R + 1, dtype=i64, device=device) if slot_offsets is None
            else slot_offsets)


def received_layout(counts, signals, epochs, live, *, world_size: int, num_local_experts: int,
                    alignment: int, wait: bool, flavour: Flavour = CPU_RANKS, peer_ptrs=None,
                    rank: int = 0, bound: BoundLaunches | None = None,
                    slot_offsets: torch.Tensor | None = None,
                    row_base: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Launches :func:`received_layout_kernel`; returns fresh int64 tensors
    ``(row_base [R, L], tokens_per_expert [L], expert_offsets [L + 1], slot_offsets [R + 1])``
    (``slot_offsets``, ``row_base`` given: written there, the caller's memory).
    Equivalent PyTorch (``counts`` [R, L + 1] of this call's parity, zero for the sources not
    ``live``)::

        per_source, slots = counts[:, :L], counts[:, L] & (2**SLOT_BITS - 1)
        # (and the first source whose counts[:, L] >> SLOT_BITS differs from this rank's is
        # recorded: comm.check_descriptors)
        tokens_per_expert = per_source.sum(0)
        padded = (tokens_per_expert + alignment - 1) // alignment * alignment
        expert_offsets = cat([[0], padded.cumsum(0)])
        row_base = expert_offsets[:-1] + per_source.cumsum(0) - per_source
        slot_offsets = cat([[0], slots.cumsum(0)])

    ``counts``: the whole dispatch_counts region [P, R, L + 1] (the parity is the epoch's, read
    on the device); ``live`` [R] int32 or None: the sources a host wait heard; ``wait``: the
    kernel first
    waits for every source's epoch in ``signals`` (GPUs, in place of a wait launch; with
    ``flavour.fault_tolerant`` it excludes the silent ones, reaching every rank through
    ``peer_ptrs``, and ``rank`` is this rank); ``bound``: the owner's bound launches."""
    R, L = world_size, num_local_experts
    outs = received_layout_outputs(R, L, epochs.device, slot_offsets, row_base)
    values = (signals, epochs, epochs if live is None else live, *outs)
    key = ("received_layout", id(counts), id(peer_ptrs), R, L,
           alignment, wait, live is None, rank, id(flavour))
    if call_bound(bound, key, values):
        return outs
    tile = tiles("received_layout", flavour.compiled, 0)
    args = (counts, *values, epochs if peer_ptrs is None else peer_ptrs, flavour.errors_addr,
            flavour.timeout_ns, flavour.mask_off, flavour.local_base, R, L, alignment, rank,
            counts.stride(0))
    kwargs = dict(
        WAIT=wait, LIVE=live is not None,
        FT=wait and flavour.fault_tolerant,
        TRANSPORT=flavour.transport if wait and flavour.fault_tolerant else 0,  # (FT's publish)
        BLOCK_R=triton.next_power_of_2(R), BLOCK_L=triton.next_power_of_2(L),
        NUM_THREADS=tile.num_threads, **tile.launch_options())
    launch(bound, key, received_layout_kernel, (1,), args, kwargs,
           ("signals", "epochs", "live", "row_base", "tokens_per_expert", "expert_offsets",
            "slot_offsets"))
    return outs
