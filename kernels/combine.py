"""Combine: reduce each token's expert rows where they are, send one partial row home, sum there.

Equivalent PyTorch::

    # on expert rank d, for every slot j that source s filled:
    partial_d[s, j] = sum(w[r] * y[r] for r in slot_rows[j] if r >= 0)   # fp32, then y.dtype
    # on home rank s, in fixed rank order:
    out[t] = sum(partial_d[s, slot_of[t, d]] for d in range(R) if slot_of[t, d] >= 0)  # fp32

**Send** (``combine_send_kernel``, on the expert rank): grid ``(R, P)``; program ``(s, p)``
walks the tiles of source ``s``'s slots (their count is read on the device), reduces the up to
K rows of each slot in fp32 (fp64 for fp64 data) and stores one partial row into rank ``s``'s
``combine_rows[p, me, slot]``; optionally one float per (slot, choice) goes along into
``combine_meta`` (the gradient of the router weights). The last program publishes the epoch to
every rank. Bytes stored into rank ``s``: ``n_s * (H * elem [+ 4K]) + 8``: the mirror image of
dispatch.

**Reduce** (``combine_reduce_kernel``, on the home rank, after every epoch arrived): one program
per token tile sums the partials of ranks ``0..R-1`` in that order (bit-reproducible).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .comm import (
    CPU_RANKS,
    Flavour,
    draw_last_of,
    local_ptr,
    one_thread,
    peer_ptr,
    publish_epoch_to,
    timed_out,
)
from .numerics import acc_zeros, cast_rne, channel_tile
from .nvshmem import put_bytes, quiet
from .tiles import even, per_source_programs, tiles

_SEND_PER_CALL = ["rows_off", "meta_off", "signal_off", "local_base", "errors_addr", "me"]


@triton.jit(do_not_specialize=_SEND_PER_CALL)
def combine_send_kernel(
    y,  # [rows, H] expert outputs
    weights,  # [rows] float32 (HAS_WEIGHTS)
    pair_values,  # [rows] float32 (HAS_PAIR): one value per row, sent back per (token, choice)
    slot_rows,  # [S, K] int32: rows of each received slot, -1 where unused
    slot_counts,  # [R] int32: slots received from each source
    slot_offsets,  # [R + 1] int64: first row of each source in slot_rows
    peer_ptrs,  # [R] int64
    stats,  # [4] int64 local: bytes stored (to peers, to itself) at [2], [3]
    tickets,  # [1] int64 local ticket counter of this channel
    epochs,  # [1] int64 local: this channel's latest epoch; the last program advances it
    rows_off: tl.int64, meta_off: tl.int64, signal_off: tl.int64,  # this rank's regions
    rows_parity: tl.int64, meta_parity: tl.int64,  # (parity 0) and bytes per parity
    box_rows_off: tl.int64, box_meta_off: tl.int64,  # TRANSPORT 1: rdma_combine_rows, _meta
    box_rows_parity: tl.int64, box_meta_parity: tl.int64,
    local_base: tl.int64,  # TRANSPORT 1: address of this rank's segment (symmetric addresses)
    errors_addr: tl.int64,  # the error record: nothing is published after a timeout
    H: tl.int32, K: tl.int32, R: tl.int32, me: tl.int32, TMAX: tl.int32,
    KMAX: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_PAIR: tl.constexpr,
    ACC_FP64: tl.constexpr,
    TRANSPORT: tl.constexpr,  # 0: stores through peer pointers; 1: NVSHMEM where pointer is 0
    ALIGN: tl.constexpr, EVEN_H: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_THREADS: tl.constexpr,
):
    s = tl.program_id(0)
    p = tl.program_id(1)
    P = tl.num_programs(1)
    epoch = tl.load(epochs) + 1  # device epochs and a fixed grid: no per-call scalar (graphs)
    parity = epoch % 2
    rows_off += parity * rows_parity
    meta_off += parity * meta_parity
    box_rows_off += parity * box_rows_parity
    box_meta_off += parity * box_meta_parity
    n = tl.load(slot_counts + s)
    remote = tl.load(peer_ptrs + s) == 0  # home rank s reached only by NVSHMEM (TRANSPORT 1)
    payload = H * y.dtype.element_ty.primitive_bitwidth // 8
    row_bytes = payload + HAS_PAIR * 4 * K
    dst = peer_ptr(peer_ptrs, s, rows_off, y.dtype.element_ty, ALIGN)
    if TRANSPORT == 1:
        box = local_ptr(local_base, box_rows_off, y.dtype.element_ty, ALIGN)
    rows_done = tl.zeros([1], tl.int64)
    for j0 in range(p * BLOCK_T, n, P * BLOCK_T):
        j = j0 + tl.arange(0, BLOCK_T)
        jm = j < n
        first_row = tl.load(slot_offsets + s) + j.to(tl.int64)
        j64 = j.to(tl.int64)
        staged = s.to(tl.int64) * TMAX + j64
        via_stores = jm
        if TRANSPORT == 1:  # partials for an NVSHMEM-only home go to the outbox first
            via_stores = jm & (tl.load(peer_ptrs + s + tl.zeros([BLOCK_T], tl.int32)) != 0)
        for h0 in range(0, H, BLOCK_H):
            h, hm = channel_tile(h0, H, BLOCK_H, EVEN_H)
            acc = acc_zeros(BLOCK_T, BLOCK_H, ACC_FP64)
            for k in range(K):
                row = tl.load(slot_rows + first_row * K + k, mask=jm, other=-1).to(tl.int64)
                rm = row >= 0
                v = tl.load(y + row[:, None] * H + h[None, :], mask=rm[:, None] & hm[None, :],
                            other=0.0).to(acc.dtype)
                if HAS_WEIGHTS:
                    v = v * tl.load(weights + row, mask=rm, other=0.0).to(acc.dtype)[:, None]
                acc += v
            partial = cast_rne(acc, y.dtype.element_ty)
            tl.store(dst + j64[:, None] * H + h[None, :], partial,  # gate: row
                     mask=via_stores[:, None] & hm[None, :])
            if TRANSPORT == 1:
                tl.store(box + staged[:, None] * H + h[None, :], partial,  # gate: row
                         mask=(jm & ~via_stores)[:, None] & hm[None, :])
        if HAS_PAIR:
            kk = tl.arange(0, BLOCK_K)
            m2 = jm[:, None] & (kk < K)[None, :]
            rows = tl.load(slot_rows + first_row[:, None] * K + kk[None, :], mask=m2, other=-1)
            vals = tl.load(pair_values + rows, mask=rows >= 0, other=0.0)
            dst_meta = peer_ptr(peer_ptrs, s, meta_off, tl.float32, 4)
            tl.store(dst_meta + j64[:, None] * KMAX + kk[None, :], vals,
                     mask=m2 & via_stores[:, None])
            if TRANSPORT == 1:
                box_meta = local_ptr(local_base, box_meta_off, tl.float32, 4)
                tl.store(box_meta + staged[:, None] * KMAX + kk[None, :], vals,
                         mask=m2 & ~via_stores[:, None])
        if TRANSPORT == 1:
            if remote:  # one block put per partial row (and its pair values)
                tl.debug_barrier()
                for i in range(BLOCK_T):
                    if j0 + i < n:
                        jj = (j0 + i).to(tl.int64)
                        put_bytes(local_base, rows_off + jj * payload,
                                  box_rows_off + (s.to(tl.int64) * TMAX + jj) * payload, payload,
                                  s)
                        if HAS_PAIR:
                            put_bytes(local_base, meta_off + jj * (4 * KMAX),
                                      box_meta_off + (s.to(tl.int64) * TMAX + jj) * (4 * KMAX),
                                      4 * KMAX, s)
        rows_done += tl.sum(jm.to(tl.int64), axis=0)
    if TRANSPORT == 1:  # this program's puts complete before its ticket
        tl.debug_barrier()
        if one_thread():
            quiet()
    nbytes = rows_done * row_bytes
    tl.atomic_add(stats + 2 + tl.arange(0, 1), tl.where(s != me, nbytes, 0), sem="relaxed")
    tl.atomic_add(stats + 3 + tl.arange(0, 1), tl.where(s == me, nbytes, 0), sem="relaxed")
    if draw_last_of(tickets, tl.num_programs(0) * P):
        if not timed_out(errors_addr.to(tl.pointer_type(tl.int64)), NUM_THREADS):
            for d in range(R):
                publish_epoch_to(peer_ptrs, d, signal_off, epoch, local_base, TRANSPORT)
            signal_bytes = 8 + tl.zeros([1], tl.int64)
            tl.atomic_add(stats + 2 + tl.arange(0, 1), (R - 1) * signal_bytes, sem="relaxed")
            tl.atomic_add(stats + 3 + tl.arange(0, 1), signal_bytes, sem="relaxed")
        tl.store(epochs + tl.arange(0, 1), epoch + tl.zeros([1], tl.int64))


@triton.jit(do_not_specialize=["T"])
def combine_reduce_kernel(
    staging,  # [P, R, TMAX, H] local combine_rows
    meta,  # [P, R, TMAX, KMAX] float32 local combine_meta (HAS_PAIR)
    epochs,  # [1] int64 local: the combine epoch (this call's: its parity is read here)
    slot_of,  # [T, R] int32: slot of token t on rank d, -1 if not sent there
    out,  # [T, H]
    pair_out,  # [T, K] float32 (HAS_PAIR)
    T: tl.int32, H: tl.int32, K: tl.int32, R: tl.int32, TMAX: tl.int32,
    STAGING_PARITY: tl.int64, META_PARITY: tl.int64,  # elements between the two parities
    KMAX: tl.constexpr, HAS_PAIR: tl.constexpr, ACC_FP64: tl.constexpr, EVEN_H: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    parity = tl.load(epochs) % 2
    staging += parity * STAGING_PARITY
    meta += parity * META_PARITY
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    t64 = t.to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        h, hm = channel_tile(h0, H, BLOCK_H, EVEN_H)
        acc = acc_zeros(BLOCK_T, BLOCK_H, ACC_FP64)
        for d in range(R):
            slot = tl.load(slot_of + t * R + d, mask=tm, other=-1).to(tl.int64)
            staged = d * TMAX + slot
            v = tl.load(staging + staged[:, None] * H + h[None, :],
                        mask=(slot >= 0)[:, None] & hm[None, :], other=0.0)
            acc += v.to(acc.dtype)
        result = cast_rne(acc, out.dtype.element_ty)
        tl.store(out + t64[:, None] * H + h[None, :], result,  # gate: row
                 mask=tm[:, None] & hm[None, :])
    if HAS_PAIR:
        kk = tl.arange(0, BLOCK_K)
        m2 = tm[:, None] & (kk < K)[None, :]
        pacc = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
        for d in range(R):
            slot = tl.load(slot_of + t * R + d, mask=tm, other=-1).to(tl.int64)
            staged = d * TMAX + slot
            pacc += tl.load(meta + staged[:, None] * KMAX + kk[None, :],
                            mask=m2 & (slot >= 0)[:, None], other=0.0)
        tl.store(pair_out + t64[:, None] * K + kk[None, :], pacc, mask=m2)


def send_grid(world_size: int, max_tokens: int, hidden: int, flavour: Flavour,
              elem_bytes: int) -> tuple[int, int]:
    """``(R, P)``: the combine send grid, fixed by the Buffer's sizes and dtype."""
    tile = tiles("combine_send", flavour.compiled, hidden, max(4, elem_bytes))  # fp32 sums
    return world_size, per_source_programs(world_size, max_tokens, tile.block_t, flavour.compiled)


def combine_send(y, weights, pair_values, slot_rows, slot_counts, slot_offsets, peer_ptrs, stats,
                 tickets, epochs, *, offsets: dict, rank: int, topk: int, max_topk: int,
                 max_tokens: int, flavour: Flavour = CPU_RANKS,
                 box_offsets: tuple = ((0, 0),) * 2) -> bool:
    """Launches the ``(R, P)`` send programs of :func:`send_grid` (every rank is signalled).

    ``offsets``: rows / meta -> (byte offset of this rank's slice of parity 0, bytes per
    parity), signal -> byte offset; the epoch and parity come from ``epochs`` on the device.
    Across nodes (``flavour.transport == 1``) ``box_offsets`` are (offset, parity stride) of the
    rdma_combine_rows / rdma_combine_meta outboxes."""
    H = y.shape[1]
    R = peer_ptrs.numel()
    tile = tiles("combine_send", flavour.compiled, H, max(4, y.element_size()))
    dummy = slot_counts
    combine_send_kernel[send_grid(R, max_tokens, H, flavour, y.element_size())](
        y, weights if weights is not None else dummy,
        pair_values if pair_values is not None else dummy, slot_rows, slot_counts, slot_offsets,
        peer_ptrs, stats, tickets, epochs, offsets["rows"][0], offsets["meta"][0],
        offsets["signal"], offsets["rows"][1], offsets["meta"][1],
        *(off for off, _ in box_offsets), *(stride for _, stride in box_offsets),
        flavour.local_base, flavour.errors_addr, H, topk, R, rank, max_tokens, KMAX=max_topk,
        HAS_WEIGHTS=weights is not None, HAS_PAIR=pair_values is not None,
        ACC_FP64=y.dtype == torch.float64, TRANSPORT=flavour.transport,
        ALIGN=flavour.row_align, EVEN_H=even(H, tile.block_h), BLOCK_T=tile.block_t,
        BLOCK_H=tile.block_h, BLOCK_K=triton.next_power_of_2(max(topk, 1)),
        NUM_THREADS=tile.num_threads, **flavour.launch_options(tile))
    return True


def combine_reduce(staging, meta, epochs, slot_of, out, pair_out, *, topk: int, max_topk: int,
                   flavour: Flavour = CPU_RANKS) -> bool:
    """Launches ``cdiv(T, block_t)`` reduce programs (none for ``T == 0``); ``staging`` /
    ``meta``: the whole combine_rows / combine_meta regions, the parity read from ``epochs``."""
    T, H = out.shape
    R, TMAX = staging.shape[1:3]
    if T == 0:
        return False
    tile = tiles("combine_reduce", flavour.compiled, H, max(4, out.element_size()))
    has_pair = pair_out is not None
    combine_reduce_kernel[(triton.cdiv(T, tile.block_t),)](
        staging, meta, epochs, slot_of, out, pair_out if has_pair else out, T, H, topk, R, TMAX,
        staging.stride(0), meta.stride(0), KMAX=max_topk, HAS_PAIR=has_pair,
        ACC_FP64=out.dtype == torch.float64, EVEN_H=even(H, tile.block_h), BLOCK_T=tile.block_t,
        BLOCK_H=tile.block_h, BLOCK_K=triton.next_power_of_2(max(topk, 1)), **tile.launch_options())
    return True
