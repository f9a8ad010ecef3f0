"""Low-latency (decode) dispatch and combine: one put per (token, expert) pair, fixed slots.

Receiver-side staging has a fixed slot for every (local expert ``e``, source ``s``, position
``j < T_max``), so no counts are exchanged before the data: the sender knows every slot from
its own routing. Equivalent PyTorch, for source ``s`` and global expert ``g`` on rank ``d``::

    pairs = [(t, k) for t in range(T) for k in range(K) if topk_idx[t, k] == g]  # token order
    staging_d[p, g % L, s, j] = quantize(x[t]), meta_d[p, g % L, s, j] = t * 32 + k  # j-th pair
    signal_d[p, g % L, s] = epoch << 32 | len(pairs)

Epochs and tickets live in device memory (``state``: [0] dispatch sent, [1] dispatch received,
[2] combine sent, [3] combine received, [4..7] the four kernels' tickets), grids depend only on
the Buffer's sizes, and no kernel takes a per-call scalar: a captured CUDA graph can replay the
pair. Call ``n`` uses parity ``n % 2``; the receive kernels acknowledge each parity to every
source (``acks``), and a sender writes parity ``p`` again only after every destination
acknowledged the call before (checked by the host before the launch on CPU ranks).

Kernels (launches per op: dispatch 2, combine 2):

* ``ll_dispatch_send_kernel`` (grid ``cdiv(T_max, BLOCK_T)``): program ``i`` counts the pairs
  of the tokens before its tile per expert (a rescan, so positions are deterministic and no
  program waits for another), quantizes its tile once (FP8) and puts each pair's row and meta
  straight into the expert's slot. The last program publishes ``epoch << 32 | count`` for
  every expert. Bytes into rank ``d``: pairs(d) * (row + 4) + 8 * L.
* ``ll_dispatch_recv_kernel`` (grid ``[L, R]``): after the wait, program ``(e, s)`` copies its
  block to the compact, expert-major output (sources in rank order, tokens in order), records
  where each row came from, and the last program acknowledges the parity to every source.
* ``ll_combine_send_kernel`` (grid ``[L, R]``): each received row goes back to its home rank's
  slot ``[token, choice]``; the last program publishes the epoch to every rank.
* ``ll_combine_recv_kernel`` (grid ``cdiv(T_max, BLOCK_T)``): ``out[t] = sum_k w[t, k] *
  slot[t, k]`` in fp32 (choice order), rounded to nearest even; the last program acknowledges.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .comm import peer_ptr
from .numerics import cast_rne
from .quant import quantize_tile

META_K_BITS = 32  # meta word = token * 32 + choice


@triton.jit
def _pairs_per_expert(topk_idx, t0, T, K, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """[BLOCK_T, BLOCK_E] int32 one-hot of the experts picked by tokens t0..t0+BLOCK_T-1."""
    t = t0 + tl.arange(0, BLOCK_T)
    lane = tl.arange(0, BLOCK_E)
    onehot = tl.zeros([BLOCK_T, BLOCK_E], tl.int32)
    for k in range(K):
        e = tl.load(topk_idx + t * K + k, mask=t < T, other=-1)
        onehot += (e[:, None] == lane[None, :]).to(tl.int32)
    return onehot


@triton.jit
def ll_dispatch_send_kernel(
    x,  # [T, H] bf16/fp16/fp32
    topk_idx,  # [T, K] int64
    peer_ptrs,  # [R] int64
    state,  # [8] int64 local: epochs and tickets
    stats,  # [4] int64 local: bytes stored (to peers, to itself) at [0], [1]
    rows_off, rows_parity_stride,  # byte offset of ll_dispatch_rows[0] and of one parity
    meta_off, meta_parity_stride,  # the same for ll_dispatch_meta
    signals_off, signals_parity_stride,  # the same for ll_dispatch_signals
    T, H, K, R, L, E, me, TMAX, SLOT_BYTES,
    FP8: tl.constexpr, UE8M0: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    epoch = tl.load(state) + 1
    parity = epoch % 2
    t0 = pid * BLOCK_T
    before = tl.zeros([BLOCK_E], tl.int32)
    for s0 in range(0, t0, BLOCK_T):
        before += tl.sum(_pairs_per_expert(topk_idx, s0, T, K, BLOCK_T, BLOCK_E), axis=0)
    onehot = _pairs_per_expert(topk_idx, t0, T, K, BLOCK_T, BLOCK_E)
    position = tl.cumsum(onehot, axis=0) - onehot + before[None, :]  # [BLOCK_T, BLOCK_E]
    lane = tl.arange(0, BLOCK_E)
    t = t0 + tl.arange(0, BLOCK_T)
    tm = t < T
    t64 = t.to(tl.int64)
    rows_base = rows_off + parity * rows_parity_stride
    meta_base = meta_off + parity * meta_parity_stride
    G = H // 128
    to_peers = tl.zeros([1], tl.int64)
    to_self = tl.zeros([1], tl.int64)
    if FP8:
        payload = H + G * (4 - 3 * UE8M0)
    else:
        payload = H * x.dtype.element_ty.primitive_bitwidth // 8
    for k in range(K):  # metadata, and the slot of every pair
        e = tl.load(topk_idx + t64 * K + k, mask=tm, other=-1)
        valid = tm & (e >= 0)
        d = tl.where(valid, e // L, 0)
        j = tl.sum(tl.where(e[:, None] == lane[None, :], position, 0), axis=1)
        block = ((e - d * L) * R + me) * TMAX + j
        meta = peer_ptr(peer_ptrs, d, meta_base, tl.int32) + block
        tl.store(meta, t * 32 + k, mask=valid)
        nbytes = tl.where(valid, payload + 4, 0).to(tl.int64)
        to_peers += tl.sum(tl.where(d != me, nbytes, 0), axis=0)
        to_self += tl.sum(tl.where(d == me, nbytes, 0), axis=0)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < H
        m = tm[:, None] & hm[None, :]
        v = tl.load(x + t64[:, None] * H + h[None, :], mask=m, other=0.0)
        if FP8:
            codes, scales, exps = quantize_tile(v.to(tl.float32), BLOCK_T, BLOCK_H, UE8M0)
            g = h0 // 128 + tl.arange(0, BLOCK_H // 128)
        for k in range(K):
            e = tl.load(topk_idx + t64 * K + k, mask=tm, other=-1)
            valid = tm & (e >= 0)
            d = tl.where(valid, e // L, 0)
            j = tl.sum(tl.where(e[:, None] == lane[None, :], position, 0), axis=1)
            block = (((e - d * L) * R + me) * TMAX + j).to(tl.int64)
            row8 = peer_ptr(peer_ptrs, d, rows_base, tl.uint8) + block * SLOT_BYTES
            if FP8:
                tl.store(row8[:, None] + h[None, :], codes, mask=valid[:, None] & hm[None, :])
                gm = valid[:, None] & (g < G)[None, :]
                if UE8M0:
                    tl.store(row8[:, None] + H + g[None, :], exps, mask=gm)
                else:
                    rowf = peer_ptr(peer_ptrs, d, rows_base, tl.float32) \
                        + (block * SLOT_BYTES + H) // 4
                    tl.store(rowf[:, None] + g[None, :], scales, mask=gm)
            else:
                rowx = peer_ptr(peer_ptrs, d, rows_base, x.dtype.element_ty) \
                    + block * (SLOT_BYTES // (x.dtype.element_ty.primitive_bitwidth // 8))
                tl.store(rowx[:, None] + h[None, :], v, mask=valid[:, None] & hm[None, :])
    tl.atomic_add(stats + tl.arange(0, 1), to_peers, sem="relaxed")
    tl.atomic_add(stats + 1 + tl.arange(0, 1), to_self, sem="relaxed")
    tl.debug_barrier()
    ticket = tl.atomic_add(state + 4, 1, sem="acq_rel", scope="sys")
    if ticket % tl.num_programs(0) == tl.num_programs(0) - 1:  # the last program publishes
        total = tl.zeros([BLOCK_E], tl.int32)
        for s0 in range(0, T, BLOCK_T):
            total += tl.sum(_pairs_per_expert(topk_idx, s0, T, K, BLOCK_T, BLOCK_E), axis=0)
        em = lane < E
        d = tl.where(em, lane // L, 0)
        word = peer_ptr(peer_ptrs, d, signals_off + parity * signals_parity_stride, tl.int64) \
            + (lane - d * L) * R + me
        tl.atomic_xchg(word, (epoch << 32) | total.to(tl.int64), mask=em, sem="release",
                       scope="sys")
        tl.store(state + tl.arange(0, 1), epoch + tl.zeros([1], tl.int64))
        remote = tl.sum(tl.where(em & (d != me), 8, 0).to(tl.int64), axis=0)
        tl.atomic_add(stats + tl.arange(0, 1), remote + tl.zeros([1], tl.int64), sem="relaxed")
        tl.atomic_add(stats + 1 + tl.arange(0, 1), 8 * L + tl.zeros([1], tl.int64),
                      sem="relaxed")


@triton.jit
def ll_dispatch_recv_kernel(
    staging,  # [P, L, R, TMAX, SLOT_BYTES] uint8 local ll_dispatch_rows (FP8) or typed rows
    staging_f32,  # the same memory as float32 (FP8 scales)
    meta,  # [P, L, R, TMAX] int32 local ll_dispatch_meta
    signals,  # [P, L, R] int64 local ll_dispatch_signals
    peer_ptrs,  # [R] int64
    state,  # [8] int64 local
    out,  # [L, R * TMAX, H] (FP8: uint8 view)
    out_scales,  # FP8: float32 memory, or uint8 view of packed int32 words (UE8M0)
    count,  # [L] int32 out
    src_info,  # [L, R * TMAX] int32 out: source rank * TMAX + source token
    src_k,  # [L, R * TMAX] int32 out: top-k choice of the pair at its home
    layout,  # [L, R, 2] int32 out: (first row, rows) of each source's block
    recv_stats,  # [L] int32/int64, added to (HAS_STATS)
    acks_off, acks_parity_stride,  # byte offset of ll_acks[DISPATCH, 0] and of one parity
    H, R, L, me, TMAX, SLOT_ELEMS,  # SLOT_ELEMS: staging slot stride in elements of `staging`
    SCALE_ROW_STRIDE, SCALE_GROUP_STRIDE, SCALE_EXPERT_STRIDE,
    FP8: tl.constexpr, UE8M0: tl.constexpr, HAS_STATS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
):
    e = tl.program_id(0)
    s = tl.program_id(1)
    epoch = tl.load(state + 1) + 1
    parity = epoch % 2
    sources = tl.arange(0, BLOCK_R)
    words = tl.load(signals + (parity * L + e) * R + sources, mask=sources < R, other=0)
    counts = (words & 0xFFFFFFFF).to(tl.int32)
    n = tl.sum(tl.where(sources == s, counts, 0), axis=0)
    first = tl.sum(tl.where(sources < s, counts, 0), axis=0)
    tl.store(layout + (e * R + s) * 2 + tl.arange(0, 2),
             tl.where(tl.arange(0, 2) == 0, first, n))
    if s == 0:
        total = tl.sum(counts, axis=0)
        tl.store(count + e + tl.arange(0, 1), total + tl.zeros([1], tl.int32))
        if HAS_STATS:
            old = tl.load(recv_stats + e + tl.arange(0, 1))
            tl.store(recv_stats + e + tl.arange(0, 1), old + total)
    block0 = ((parity * L + e) * R + s).to(tl.int64) * TMAX
    G = H // 128
    for j0 in range(0, n, BLOCK_T):
        j = j0 + tl.arange(0, BLOCK_T)
        jm = j < n
        slot = block0 + j
        dst = (e * R * TMAX + first + j).to(tl.int64)
        word = tl.load(meta + slot, mask=jm, other=0)
        tl.store(src_info + dst, s * TMAX + word // 32, mask=jm)
        tl.store(src_k + dst, word % 32, mask=jm)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            m = jm[:, None] & (h < H)[None, :]
            tile = tl.load(staging + slot[:, None] * SLOT_ELEMS + h[None, :], mask=m)
            tl.store(out + dst[:, None] * H + h[None, :], tile, mask=m)
        if FP8:
            g = tl.arange(0, BLOCK_G)
            gm = jm[:, None] & (g < G)[None, :]
            out_row = (first + j).to(tl.int64)
            if UE8M0:
                sc = tl.load(staging + slot[:, None] * SLOT_ELEMS + H + g[None, :], mask=gm)
                word4 = e * SCALE_EXPERT_STRIDE + (g // 4)[None, :] * SCALE_GROUP_STRIDE \
                    + out_row[:, None] * SCALE_ROW_STRIDE
                tl.store(out_scales + word4 * 4 + (g % 4)[None, :], sc, mask=gm)
            else:
                sc = tl.load(staging_f32 + (slot[:, None] * SLOT_ELEMS + H) // 4 + g[None, :],
                             mask=gm)
                tl.store(out_scales + e * SCALE_EXPERT_STRIDE + g[None, :] * SCALE_GROUP_STRIDE
                         + out_row[:, None] * SCALE_ROW_STRIDE, sc, mask=gm)
    tl.debug_barrier()
    ticket = tl.atomic_add(state + 5, 1, sem="acq_rel", scope="sys")
    if ticket % (L * R) == L * R - 1:  # every block is out: acknowledge the parity
        src = tl.where(sources < R, sources, 0)
        ack = peer_ptr(peer_ptrs, src, acks_off + parity * acks_parity_stride, tl.int64) + me
        tl.atomic_xchg(ack, epoch + tl.zeros([BLOCK_R], tl.int64), mask=sources < R,
                       sem="release", scope="sys")
        tl.store(state + 1 + tl.arange(0, 1), epoch + tl.zeros([1], tl.int64))


@triton.jit
def ll_combine_send_kernel(
    y,  # [L, R * TMAX, H] expert outputs, rows as in the dispatch's output
    layout,  # [L, R, 2] int32: (first row, rows) of each source's block
    src_info,  # [L, R * TMAX] int32: source rank * TMAX + source token
    src_k,  # [L, R * TMAX] int32: top-k choice at the home rank
    peer_ptrs,  # [R] int64
    state,  # [8] int64 local
    stats,  # [4] int64 local: bytes stored (to peers, to itself) at [2], [3]
    rows_off, rows_parity_stride,  # byte offset of ll_combine_rows[0] and of one parity
    signals_off, signals_parity_stride,  # ll_combine_signals
    H, R, L, me, TMAX, KMAX,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
):
    e = tl.program_id(0)
    s = tl.program_id(1)
    epoch = tl.load(state + 2) + 1
    parity = epoch % 2
    first = tl.load(layout + (e * R + s) * 2)
    n = tl.load(layout + (e * R + s) * 2 + 1)
    dst_base = peer_ptr(peer_ptrs, s, rows_off + parity * rows_parity_stride, y.dtype.element_ty)
    for j0 in range(0, n, BLOCK_T):
        j = j0 + tl.arange(0, BLOCK_T)
        jm = j < n
        row = (e * R * TMAX + first + j).to(tl.int64)
        token = tl.load(src_info + row, mask=jm, other=0) - s * TMAX
        k = tl.load(src_k + row, mask=jm, other=0)
        slot = (token * KMAX + k).to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            m = jm[:, None] & (h < H)[None, :]
            tile = tl.load(y + row[:, None] * H + h[None, :], mask=m)
            tl.store(dst_base + slot[:, None] * H + h[None, :], tile, mask=m)
    nbytes = n.to(tl.int64) * (H * y.dtype.element_ty.primitive_bitwidth // 8) \
        + tl.zeros([1], tl.int64)
    tl.atomic_add(stats + 2 + tl.arange(0, 1), tl.where(s != me, nbytes, 0), sem="relaxed")
    tl.atomic_add(stats + 3 + tl.arange(0, 1), tl.where(s == me, nbytes, 0), sem="relaxed")
    tl.debug_barrier()
    ticket = tl.atomic_add(state + 6, 1, sem="acq_rel", scope="sys")
    if ticket % (L * R) == L * R - 1:  # every row is out: tell every rank
        ranks = tl.arange(0, BLOCK_R)
        d = tl.where(ranks < R, ranks, 0)
        word = peer_ptr(peer_ptrs, d, signals_off + parity * signals_parity_stride, tl.int64) + me
        tl.atomic_xchg(word, epoch + tl.zeros([BLOCK_R], tl.int64), mask=ranks < R,
                       sem="release", scope="sys")
        tl.store(state + 2 + tl.arange(0, 1), epoch + tl.zeros([1], tl.int64))
        signal_bytes = 8 + tl.zeros([1], tl.int64)
        tl.atomic_add(stats + 2 + tl.arange(0, 1), (R - 1) * signal_bytes, sem="relaxed")
        tl.atomic_add(stats + 3 + tl.arange(0, 1), signal_bytes, sem="relaxed")


@triton.jit
def ll_combine_recv_kernel(
    staging,  # [P, TMAX, KMAX, H] local ll_combine_rows
    topk_idx,  # [T, K] int64
    topk_weights,  # [T, K] float32 (HAS_WEIGHTS)
    out,  # [T, H]
    peer_ptrs,  # [R] int64
    state,  # [8] int64 local
    acks_off, acks_parity_stride,  # byte offset of ll_acks[COMBINE, 0] and of one parity
    T, H, K, R, me, TMAX, KMAX,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
):
    epoch = tl.load(state + 3) + 1
    parity = epoch % 2
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    t64 = t.to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < H
        acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
        for k in range(K):
            e = tl.load(topk_idx + t64 * K + k, mask=tm, other=-1)
            valid = tm & (e >= 0)
            slot = (parity * TMAX + t64) * KMAX + k
            v = tl.load(staging + slot[:, None] * H + h[None, :],
                        mask=valid[:, None] & hm[None, :], other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                v = v * tl.load(topk_weights + t64 * K + k, mask=valid, other=0.0)[:, None]
            acc += v
        tl.store(out + t64[:, None] * H + h[None, :], cast_rne(acc, out.dtype.element_ty),
                 mask=tm[:, None] & hm[None, :])
    tl.debug_barrier()
    ticket = tl.atomic_add(state + 7, 1, sem="acq_rel", scope="sys")
    if ticket % tl.num_programs(0) == tl.num_programs(0) - 1:  # slots read: acknowledge
        ranks = tl.arange(0, BLOCK_R)
        d = tl.where(ranks < R, ranks, 0)
        ack = peer_ptr(peer_ptrs, d, acks_off + parity * acks_parity_stride, tl.int64) + me
        tl.atomic_xchg(ack, epoch + tl.zeros([BLOCK_R], tl.int64), mask=ranks < R,
                       sem="release", scope="sys")
        tl.store(state + 3 + tl.arange(0, 1), epoch + tl.zeros([1], tl.int64))


def ll_dispatch_send(x, topk_idx, peer_ptrs, state, stats, *, offsets: dict, rank: int,
                     num_local_experts: int, num_experts: int, max_tokens: int,
                     slot_bytes: int, fp8: bool, ue8m0: bool, block_t: int, block_h: int) -> bool:
    """Launches ``cdiv(max_tokens, block_t)`` send programs. ``offsets``: rows / meta /
    signals -> (byte offset of parity 0, bytes per parity)."""
    T, H = x.shape
    K = topk_idx.shape[1]
    R = peer_ptrs.numel()
    ll_dispatch_send_kernel[(triton.cdiv(max_tokens, block_t),)](
        x, topk_idx, peer_ptrs, state, stats, *offsets["rows"], *offsets["meta"],
        *offsets["signals"], T, H, K, R, num_local_experts, num_experts, rank, max_tokens,
        slot_bytes, FP8=fp8, UE8M0=ue8m0, BLOCK_T=block_t, BLOCK_H=block_h,
        BLOCK_E=triton.next_power_of_2(num_experts))
    return True


def ll_dispatch_recv(staging, meta, signals, peer_ptrs, state, out, out_scales, count,
                     src_info, src_k, layout, recv_stats, *, acks: tuple, rank: int,
                     scale_strides: tuple, ue8m0: bool, block_t: int, block_h: int) -> bool:
    """Launches ``L x R`` receive programs. ``staging``: the ll_dispatch_rows region viewed as
    uint8 (FP8) or as ``out``'s dtype, [P, L, R, TMAX, slot]; ``out_scales``: contiguous scale
    memory with (expert, row, group) strides ``scale_strides``; ``acks``: (offset, parity
    stride) of ll_acks[DISPATCH]."""
    P, L, R, TMAX, slot = staging.shape
    H = out.shape[2]
    fp8 = out.dtype == torch.float8_e4m3fn
    if fp8:
        out = out.view(torch.uint8)
        out_scales = out_scales.view(torch.uint8) if ue8m0 else out_scales
    dummy = count
    ll_dispatch_recv_kernel[(L, R)](
        staging, staging.view(torch.float32) if fp8 else dummy, meta, signals, peer_ptrs, state,
        out, out_scales if fp8 else dummy, count, src_info, src_k, layout,
        recv_stats if recv_stats is not None else dummy, *acks, H, R, L, rank, TMAX, slot,
        scale_strides[1], scale_strides[2], scale_strides[0],
        FP8=fp8, UE8M0=fp8 and ue8m0, HAS_STATS=recv_stats is not None, BLOCK_T=block_t,
        BLOCK_H=block_h, BLOCK_R=triton.next_power_of_2(R),
        BLOCK_G=triton.next_power_of_2(max(H // 128, 1)))
    return True


def ll_combine_send(y, layout, src_info, src_k, peer_ptrs, state, stats, *, offsets: dict,
                    rank: int, max_tokens: int, max_topk: int, block_t: int, block_h: int) -> bool:
    """Launches ``L x R`` send programs; ``offsets``: rows / signals -> (offset, parity stride)."""
    L, _, H = y.shape
    R = peer_ptrs.numel()
    ll_combine_send_kernel[(L, R)](
        y, layout, src_info, src_k, peer_ptrs, state, stats, *offsets["rows"],
        *offsets["signals"], H, R, L, rank, max_tokens, max_topk, BLOCK_T=block_t,
        BLOCK_H=block_h, BLOCK_R=triton.next_power_of_2(R))
    return True


def ll_combine_recv(staging, topk_idx, topk_weights, out, peer_ptrs, state, *, acks: tuple,
                    rank: int, block_t: int, block_h: int) -> bool:
    """Launches ``cdiv(TMAX, block_t)`` receive programs; ``staging`` [P, TMAX, KMAX, H]."""
    P, TMAX, KMAX, H = staging.shape
    T, K = topk_idx.shape
    R = peer_ptrs.numel()
    ll_combine_recv_kernel[(triton.cdiv(TMAX, block_t),)](
        staging, topk_idx, topk_weights if topk_weights is not None else topk_idx, out,
        peer_ptrs, state, *acks, T, H, K, R, rank, TMAX, KMAX,
        HAS_WEIGHTS=topk_weights is not None, BLOCK_T=block_t, BLOCK_H=block_h,
        BLOCK_R=triton.next_power_of_2(R))
    return True


_OFFSETS = {"rows_off": "i64", "rows_parity_stride": "i64"}
COMPILE_VARIANTS = [
    (ll_dispatch_send_kernel,
     {"x": "*bf16", "topk_idx": "*i64", "peer_ptrs": "*i64", "state": "*i64", "stats": "*i64",
      **_OFFSETS, "meta_off": "i64", "meta_parity_stride": "i64", "signals_off": "i64",
      "signals_parity_stride": "i64", "T": "i32", "H": "i32", "K": "i32", "R": "i32",
      "L": "i32", "E": "i32", "me": "i32", "TMAX": "i32", "SLOT_BYTES": "i64"},
     dict(FP8=fp8, UE8M0=ue8m0, BLOCK_T=16, BLOCK_H=1024, BLOCK_E=256))
    for fp8, ue8m0 in ((False, False), (True, False), (True, True))
] + [
    (ll_dispatch_recv_kernel,
     {"staging": f"*{dtype}", "staging_f32": "*fp32", "meta": "*i32", "signals": "*i64",
      "peer_ptrs": "*i64", "state": "*i64", "out": f"*{dtype}", "out_scales": f"*{scales}",
      "count": "*i32", "src_info": "*i32", "src_k": "*i32", "layout": "*i32",
      "recv_stats": "*i64", "acks_off": "i64", "acks_parity_stride": "i64", "H": "i32",
      "R": "i32", "L": "i32", "me": "i32", "TMAX": "i32", "SLOT_ELEMS": "i64",
      "SCALE_ROW_STRIDE": "i64", "SCALE_GROUP_STRIDE": "i64", "SCALE_EXPERT_STRIDE": "i64"},
     dict(FP8=fp8, UE8M0=ue8m0, HAS_STATS=True, BLOCK_T=16, BLOCK_H=1024, BLOCK_R=8,
          BLOCK_G=64))
    for dtype, scales, fp8, ue8m0 in (("bf16", "fp32", False, False), ("u8", "fp32", True, False),
                                      ("u8", "u8", True, True))
] + [
    (ll_combine_send_kernel,
     {"y": "*bf16", "layout": "*i32", "src_info": "*i32", "src_k": "*i32", "peer_ptrs": "*i64",
      "state": "*i64", "stats": "*i64", **_OFFSETS, "signals_off": "i64",
      "signals_parity_stride": "i64", "H": "i32", "R": "i32", "L": "i32", "me": "i32",
      "TMAX": "i32", "KMAX": "i32"},
     dict(BLOCK_T=16, BLOCK_H=1024, BLOCK_R=8)),
    (ll_combine_recv_kernel,
     {"staging": "*bf16", "topk_idx": "*i64", "topk_weights": "*fp32", "out": "*bf16",
      "peer_ptrs": "*i64", "state": "*i64", "acks_off": "i64", "acks_parity_stride": "i64",
      "T": "i32", "H": "i32", "K": "i32", "R": "i32", "me": "i32", "TMAX": "i32",
      "KMAX": "i32"},
     dict(HAS_WEIGHTS=True, BLOCK_T=16, BLOCK_H=1024, BLOCK_R=8)),
]
