"""Combine: reduce each token's expert rows where they are, send one partial row home, sum there.

Equivalent PyTorch::

    # on expert rank d, for every slot j that source s filled:
    partial_d[s, j] = sum(w[r] * y[r] for r in slot_rows[j] if r >= 0)   # fp32, then y.dtype
    # on home rank s, in fixed rank order:
    out[t] = sum(partial_d[s, slot_of[t, d]] for d in range(R) if slot_of[t, d] >= 0)  # fp32

**Send** (``combine_send_kernel``, on the expert rank): a persistent grid of at most
``num_sms`` programs deals the tiles of every source's slots (their counts are read on the
device) round-robin; for each tile the rows of every slot's choices are compacted once (valid
rows first, in choice order) and the first ``gathers_in_flight`` of them (1, 2 or 4, as many as
registers hold) and their weights loaded once into registers; then every channel tile issues
those rows' gathers together, in a software-pipelined loop (the next channel tile's gathers in
flight while one is summed and stored; a tile whose fullest slot has more rows takes them
``gathers_in_flight`` at a time after them), reduces them in fp32 in choice order (fp64 for
fp64 data) and stores one partial row into rank ``s``'s
``combine_rows[p, me, slot]``; optionally one float per (slot, choice) goes along into
``combine_meta`` (the gradient of the router weights). The last program publishes the epoch to
every rank. Bytes stored into rank ``s``: ``n_s * (H * elem [+ 4K]) + 8``: the mirror image of
dispatch.

**Reduce** (``combine_reduce_kernel``, on the home rank, after every epoch arrived): program
``(i, c)`` sums channel tile ``c`` of token tile ``i`` over ranks ``0..R-1`` in that order
(bit-reproducible), each token's slots on every rank loaded once. A full-wave grid, not bounded
by ``num_sms``: it waits for nothing (a wait kernel runs before it) and its output is what the
next layer waits for, so it takes the whole GPU.

**FP8** (``FP8``): the fp32 partial is quantized per 128 channels as a dispatch quantizes
(``quant.quantize_tile``: e4m3 codes, one float32 scale per 128 channels) and travels as
``[H codes][H/128 scales]`` in the row's slot (its stride stays ``H * elem``); the reduce
dequantizes each partial (``code * scale`` in fp32) before it adds it::

    out[t] = sum(dequantize_fp8(*quantize_fp8(partial_d[s, slot_of[t, d]])) for d in order)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bound import BoundLaunches, call_bound, launch
from .comm import (
    CPU_RANKS,
    Flavour,
    draw_last_of,
    local_ptr,
    one_thread,
    peer_ptr,
    publish_epoch,
    publish_epoch_to,
    signal_word,
    timed_out,
)
from .internode import (
    HC_META,
    HC_META_LOCAL,
    HC_META_NODE,
    HC_META_PAR,
    HC_ROWS,
    HC_ROWS_LOCAL,
    HC_ROWS_NODE,
    HC_ROWS_PAR,
    HC_SIGNALS,
    PXC_META,
    PXC_ROWS,
    _at,
    _off,
    post_combine_flat,
)
from .numerics import acc_zeros, cast_rne, channel_tile, column
from .nvshmem import put_bytes, quiet
from .rows import load_fp8_partials, store_fp8_partials
from .tiles import even, persistent_programs, tiles

# a combine send's channel loop: the gathers of the next channel tile in flight while one is
# summed and stored (2 x IN_FLIGHT x 16 KB of shared memory at bf16 64 x 128 tiles)
SEND_STAGES = tl.constexpr(3)
_SEND_PER_CALL = ["rows_off", "meta_off", "signal_off", "local_base", "errors_addr", "me",
                  "descriptor"]


@triton.jit
def _store_partials(dst, box, acc, j64, staged, jm, via_stores, h, hm, H,
                    TRANSPORT: tl.constexpr):
    """Partial rows ``j64`` (channels ``h``) in ``dst``'s dtype, rounded once; those for an
    NVSHMEM-only home (TRANSPORT 1) into the outbox ``box`` at ``staged``."""
    partial = cast_rne(acc, dst.dtype.element_ty)
    tl.store(dst + j64[:, None] * H + h[None, :], partial,  # gate: row
             mask=via_stores[:, None] & hm[None, :])
    if TRANSPORT == 1:
        tl.store(box + staged[:, None] * H + h[None, :], partial,  # gate: row
                 mask=(jm & ~via_stores)[:, None] & hm[None, :])


@triton.jit
def _partial_destination(peer_ptrs, s, me, N, parity, plan, local_base, rows_off, meta_off,
                         stride, H, elem_ty: tl.constexpr, FP8: tl.constexpr,
                         TRANSPORT: tl.constexpr, HIER: tl.constexpr, ALIGN: tl.constexpr):
    """Where this rank's partials for home rank ``s`` go: ``(rows, meta, remote, fp8_rows,
    payload)``: the row and pair-value pointers (``s``'s combine staging; through the proxy
    for a home on another node the forwarder's (HIER) or this rank's outbox), whether ``s``
    has no pointer, whether its rows travel as FP8, and the bytes of one partial row."""
    remote = tl.load(peer_ptrs + s) == 0
    payload = stride
    fp8_rows = False
    if FP8:
        payload = H + 4 * (H // 128)
        fp8_rows = True
        if HIER:  # FP8 only for homes on this node (the forwarders sum the others' as they are)
            fp8_rows = not remote
            payload = tl.where(fp8_rows, payload, stride)
    dst = peer_ptr(peer_ptrs, s, rows_off, elem_ty, ALIGN)
    dst_meta = peer_ptr(peer_ptrs, s, meta_off, tl.float32, 4)
    if TRANSPORT == 2:
        if remote:  # home s on another node (N ranks per node)
            if HIER:  # into the forwarder of this node with s's local index
                at = parity * _at(plan, HC_ROWS_PAR) + (s // N) * _at(plan, HC_ROWS_NODE) \
                    + (me % N) * _at(plan, HC_ROWS_LOCAL)
                dst = peer_ptr(peer_ptrs, (me // N) * N + s % N, _at(plan, HC_ROWS) + at,
                               elem_ty, ALIGN)
                at = parity * _at(plan, HC_META_PAR) + (s // N) * _at(plan, HC_META_NODE) \
                    + (me % N) * _at(plan, HC_META_LOCAL)
                dst_meta = peer_ptr(peer_ptrs, (me // N) * N + s % N, _at(plan, HC_META) + at,
                                    tl.float32, 4)
            else:  # into the outbox slice for s
                dst = local_ptr(local_base, _off(plan, PXC_ROWS, parity, s), elem_ty, ALIGN)
                dst_meta = local_ptr(local_base, _off(plan, PXC_META, parity, s), tl.float32, 4)
    return dst, dst_meta, remote, fp8_rows, payload


@triton.jit
def _weight(weights, row, HAS_WEIGHTS: tl.constexpr):
    """``weights[row]`` where ``row >= 0``, else 0 (0 everywhere without weights)."""
    if HAS_WEIGHTS:
        return tl.load(weights + row, mask=row >= 0, other=0.0)
    return row.to(tl.float32) * 0.0


@triton.jit
def _choice(slots, c, jm, weights, HAS_WEIGHTS: tl.constexpr):
    """Row ``c`` of every slot of the tile (``slots`` points at each slot's compacted rows: -1
    past its count) and its weight: ``(rows [BLOCK_T] int32, weights [BLOCK_T])``."""
    row = tl.load(slots + c, mask=jm, other=-1)
    return row, _weight(weights, row, HAS_WEIGHTS)


@triton.jit
def _add_row(acc, y, row, wk, h, hm, H, HAS_WEIGHTS: tl.constexpr):
    """``acc + w * y[row]`` (channels ``h``; ``row`` -1 adds +0.0, which changes no sum)."""
    rm = row >= 0
    v = tl.load(y + row.to(tl.int64)[:, None] * H + h[None, :],  # gate: live
                mask=rm[:, None] & hm[None, :],
                other=0.0).to(acc.dtype)
    if HAS_WEIGHTS:
        v = v * wk.to(acc.dtype)[:, None]
    return acc + v


@triton.jit
def _store_tile(acc, dst, box, j64, staged, jm, via_stores, fp8_rows, stride, h0, h, hm, H,
                FP8: tl.constexpr, TRANSPORT: tl.constexpr, EVEN_H: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """Channel tile ``h`` of the tile's partial rows ``acc`` stored as :func:`send_partials`
    says (FP8 codes and scales where ``fp8_rows``)."""
    if FP8:  # (fp8_rows: a runtime flag with HIER)
        if fp8_rows:
            store_fp8_partials(acc, dst.to(tl.pointer_type(tl.uint8), bitcast=True)
                               + j64 * stride, via_stores,
                               box.to(tl.pointer_type(tl.uint8), bitcast=True)
                               + staged * stride, jm & ~via_stores, h0, h, hm, H,
                               TRANSPORT == 1, EVEN_H, BLOCK_T, BLOCK_H)
        else:
            _store_partials(dst, box, acc, j64, staged, jm, via_stores, h, hm, H, TRANSPORT)
    else:
        _store_partials(dst, box, acc, j64, staged, jm, via_stores, h, hm, H, TRANSPORT)


@triton.jit
def _first_rows(y, rs, ws, h, hm, H, HAS_WEIGHTS: tl.constexpr, ACC_FP64: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, IN_FLIGHT: tl.constexpr):
    """``sum(ws[i] * y[rs[i]] for i < IN_FLIGHT)`` over channels ``h`` (the rows gathered
    together, added in order), in the accumulator's dtype."""
    acc = acc_zeros(BLOCK_T, BLOCK_H, ACC_FP64)
    for i in tl.static_range(IN_FLIGHT):
        acc = _add_row(acc, y, rs[i], ws[i], h, hm, H, HAS_WEIGHTS)
    return acc


@triton.jit
def _rows_in_turn(y, weights, slots, jm, kmax, rs, ws, dst, box, j64, staged, via_stores,
                  fp8_rows, stride, H, HAS_WEIGHTS: tl.constexpr, ACC_FP64: tl.constexpr,
                  FP8: tl.constexpr, TRANSPORT: tl.constexpr, EVEN_H: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, IN_FLIGHT: tl.constexpr):
    """:func:`_partial_rows` in one loop, not pipelined: the held first rows, then each further
    row of every slot in turn, its index and weight loaded in the loop (fewer registers)."""
    for h0 in range(0, H, BLOCK_H):
        h, hm = channel_tile(h0, H, BLOCK_H, EVEN_H)
        acc = _first_rows(y, rs, ws, h, hm, H, HAS_WEIGHTS, ACC_FP64, BLOCK_T, BLOCK_H,
                          IN_FLIGHT)
        for c in range(IN_FLIGHT, kmax):
            rc, wc = _choice(slots, c, jm, weights, HAS_WEIGHTS)
            acc = _add_row(acc, y, rc, wc, h, hm, H, HAS_WEIGHTS)
        _store_tile(acc, dst, box, j64, staged, jm, via_stores, fp8_rows, stride, h0, h, hm, H,
                    FP8, TRANSPORT, EVEN_H, BLOCK_T, BLOCK_H)


@triton.jit
def _partial_rows(y, weights, slots, jm, kmax, dst, box, j64, staged, via_stores, fp8_rows,
                  stride, H, HAS_WEIGHTS: tl.constexpr, ACC_FP64: tl.constexpr,
                  FP8: tl.constexpr, TRANSPORT: tl.constexpr, EVEN_H: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                  IN_FLIGHT: tl.constexpr, STAGES: tl.constexpr, HOLD: tl.constexpr):
    """The tile's partial rows, channel tile by channel tile: the first ``IN_FLIGHT`` rows of
    every slot gathered together, then, in a tile whose fullest slot has more (``kmax``), the
    next ``IN_FLIGHT`` of each slot at a time, summed in choice order and stored as
    :func:`send_partials` says. The first rows of every slot and their weights are read from
    ``slots`` once, before the channel loop, and held in registers. ``STAGES`` > 1: a tile
    whose slots hold at most ``IN_FLIGHT`` rows (about 9 in 10 at DeepSeek-V3 sizes) runs a
    software-pipelined loop, the gathers of the next ``STAGES - 1`` channel tiles in flight
    while one is summed; a fuller tile runs a loop of its own, not pipelined, which with
    ``HOLD`` holds all ``BLOCK_K`` rows of every slot (neither loop then waits on an index),
    else loads each further row's index in turn (:func:`_rows_in_turn`, as every tile does
    where ``STAGES`` is 1: fewer registers)."""
    rs = ()  # rows of every slot by choice (-1: none) and their weights, the first IN_FLIGHT
    ws = ()
    for k in tl.static_range(IN_FLIGHT):
        rk, wk = _choice(slots, k, jm, weights, HAS_WEIGHTS)
        rs = rs + (rk,)
        ws = ws + (wk,)
    if STAGES > 1:
        if kmax > IN_FLIGHT:  # gate: rare
            if HOLD:
                further = rs  # every row of every slot, in registers
                for k in tl.static_range(IN_FLIGHT, BLOCK_K):
                    further = further + (tl.load(slots + k, mask=jm, other=-1),)
                for h0 in range(0, H, BLOCK_H):
                    h, hm = channel_tile(h0, H, BLOCK_H, EVEN_H)
                    acc = _first_rows(y, rs, ws, h, hm, H, HAS_WEIGHTS, ACC_FP64, BLOCK_T,
                                      BLOCK_H, IN_FLIGHT)
                    for g in tl.static_range(1, BLOCK_K // IN_FLIGHT):  # IN_FLIGHT at a time
                        if kmax > g * IN_FLIGHT:
                            for k in tl.static_range(g * IN_FLIGHT, (g + 1) * IN_FLIGHT):
                                acc = _add_row(acc, y, further[k],
                                               _weight(weights, further[k], HAS_WEIGHTS), h,
                                               hm, H, HAS_WEIGHTS)
                    _store_tile(acc, dst, box, j64, staged, jm, via_stores, fp8_rows, stride,
                                h0, h, hm, H, FP8, TRANSPORT, EVEN_H, BLOCK_T, BLOCK_H)
            else:
                _rows_in_turn(y, weights, slots, jm, kmax, rs, ws, dst, box, j64, staged,
                              via_stores, fp8_rows, stride, H, HAS_WEIGHTS, ACC_FP64, FP8,
                              TRANSPORT, EVEN_H, BLOCK_T, BLOCK_H, IN_FLIGHT)
        else:
            for h0 in tl.range(0, H, BLOCK_H, num_stages=STAGES):
                h, hm = channel_tile(h0, H, BLOCK_H, EVEN_H)
                acc = _first_rows(y, rs, ws, h, hm, H, HAS_WEIGHTS, ACC_FP64, BLOCK_T, BLOCK_H,
                                  IN_FLIGHT)
                _store_tile(acc, dst, box, j64, staged, jm, via_stores, fp8_rows, stride, h0, h,
                            hm, H, FP8, TRANSPORT, EVEN_H, BLOCK_T, BLOCK_H)
    else:
        _rows_in_turn(y, weights, slots, jm, kmax, rs, ws, dst, box, j64, staged, via_stores,
                      fp8_rows, stride, H, HAS_WEIGHTS, ACC_FP64, FP8, TRANSPORT, EVEN_H,
                      BLOCK_T, BLOCK_H, IN_FLIGHT)


@triton.jit
def source_tiles(slot_offsets, R, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    """The tiles of ``BLOCK_T`` slots of every source in turn (``slot_offsets`` [R + 1]):
    ``(first slot of each source, its tiles, cumulative tiles)``, each [BLOCK_R]."""
    src = tl.arange(0, BLOCK_R)
    first_slots = tl.load(slot_offsets + src, mask=src < R, other=0)
    src_tiles = (tl.load(slot_offsets + src + 1, mask=src < R, other=0) - first_slots
                 + BLOCK_T - 1) // BLOCK_T
    return first_slots, src_tiles, tl.cumsum(src_tiles, axis=0)


@triton.jit
def source_tile(w, slot_offsets, first_slots, src_tiles, tiles_end, BLOCK_T: tl.constexpr,
                BLOCK_R: tl.constexpr):
    """Tile ``w`` of :func:`source_tiles`: ``(source s, its first slot, its slots n, the tile's
    first slot j0 among them)``."""
    src = tl.arange(0, BLOCK_R)
    s = tl.sum((tiles_end <= w).to(tl.int32), axis=0)
    at_s = src == s
    first_slot = tl.sum(tl.where(at_s, first_slots, 0), axis=0)
    n = (tl.load(slot_offsets + s + 1) - first_slot).to(tl.int32)
    j0 = (w - tl.sum(tl.where(at_s, tiles_end - src_tiles, 0), axis=0)) * BLOCK_T
    return s, first_slot, n, j0


@triton.jit
def send_partials(pid, programs, parity, y, weights, pair_values, slot_rows, slot_offsets,
                  compact, peer_ptrs, stats, xstats, rows_off, meta_off, box_rows_off,
                  box_meta_off, local_base, plan, H, K, R, me, TMAX, N, KMAX: tl.constexpr,
                  HAS_WEIGHTS: tl.constexpr, HAS_PAIR: tl.constexpr, ACC_FP64: tl.constexpr,
                  FP8: tl.constexpr, TRANSPORT: tl.constexpr, HIER: tl.constexpr,
                  ALIGN: tl.constexpr, EVEN_H: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                  IN_FLIGHT: tl.constexpr, STAGES: tl.constexpr, HOLD: tl.constexpr):
    """Program ``pid`` of ``programs``: its tiles of the send (the slots of ``slot_offsets``,
    dealt round-robin) reduced and stored into parity ``parity`` (the offsets are that
    parity's), and its bytes added to ``stats`` (``combine_send_kernel``'s arguments;
    ``HOLD``: a fuller tile holds all its rows, :func:`_partial_rows`)."""
    stride = H * y.dtype.element_ty.primitive_bitwidth // 8  # bytes between partial rows
    box = local_ptr(local_base, box_rows_off, y.dtype.element_ty, ALIGN)  # (TRANSPORT 1)
    # the work: tiles of BLOCK_T slots of every source in turn, dealt round-robin
    first_slots, src_tiles, tiles_end = source_tiles(slot_offsets, R, BLOCK_T, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    to_peers = tl.zeros([1], tl.int64)
    to_self = tl.zeros([1], tl.int64)
    other_node = tl.zeros([1], tl.int64)
    for w in range(pid, tl.sum(src_tiles, axis=0), programs):
        s, first_slot, n, j0 = source_tile(w, slot_offsets, first_slots, src_tiles, tiles_end,
                                           BLOCK_T, BLOCK_R)
        dst, dst_meta, remote, fp8_rows, payload = _partial_destination(
            peer_ptrs, s, me, N, parity, plan, local_base, rows_off, meta_off, stride, H,
            y.dtype.element_ty, FP8, TRANSPORT, HIER, ALIGN)
        j = j0 + tl.arange(0, BLOCK_T)
        jm = j < n
        j64 = j.to(tl.int64)
        staged = s.to(tl.int64) * TMAX + j64
        via_stores = jm
        if TRANSPORT == 1:  # partials for an NVSHMEM-only home go to the outbox first
            via_stores = jm & (tl.load(peer_ptrs + s + tl.zeros([BLOCK_T], tl.int32)) != 0)
        # Each slot's rows compacted, once per tile: compacted[t, c] = the c-th valid row of
        # slot t in choice order, -1 past its count. A slot holds the choices of one token
        # that picked this rank's experts (about 1.5 of top-8 at EP 8), so gathering choice k
        # of every slot would leave most lanes masked; the c-th rows fill them. The sum keeps
        # the choice order (a masked choice added +0.0, which changes no sum). The tile goes
        # through the program's scratch and each column is loaded from there as a vector (a
        # column of a register tile is a layout conversion with a barrier).
        cc = tl.arange(0, BLOCK_K)
        rows = tl.load(slot_rows + (first_slot + j64)[:, None] * K + kk[None, :],
                       mask=jm[:, None] & (kk < K)[None, :], other=-1)
        valid = (rows >= 0).to(tl.int32)
        count = tl.sum(valid, axis=1)
        place = tl.cumsum(valid, axis=1) - 1
        picked = (valid[:, None, :] != 0) & (place[:, None, :] == cc[None, :, None])
        compacted = tl.sum(tl.where(picked, rows[:, None, :], 0), axis=2)
        compacted = tl.where(cc[None, :] < count[:, None], compacted, -1)
        if HAS_PAIR:  # per (slot, choice), in choice order (before the rows: `rows` dies)
            m2 = jm[:, None] & (kk < K)[None, :]
            vals = tl.load(pair_values + rows.to(tl.int64), mask=rows >= 0, other=0.0)
            tl.store(dst_meta + j64[:, None] * KMAX + kk[None, :], vals,
                     mask=m2 & via_stores[:, None])
            if TRANSPORT == 1:
                box_meta = local_ptr(local_base, box_meta_off, tl.float32, 4)
                tl.store(box_meta + staged[:, None] * KMAX + kk[None, :], vals,
                         mask=m2 & ~via_stores[:, None])
        mine = compact + pid.to(tl.int64) * (BLOCK_T * BLOCK_K)
        tl.debug_barrier()  # every thread's loads of the previous tile are done
        tl.store(mine + tl.arange(0, BLOCK_T)[:, None] * BLOCK_K + cc[None, :], compacted)
        tl.debug_barrier()  # the tile is visible to every thread of the program
        slots = mine + tl.arange(0, BLOCK_T) * BLOCK_K
        kmax = tl.max(count, axis=0)  # the most rows of any slot of the tile
        # the channel loop is software pipelined (the next tile's gathers in flight while one
        # is summed and stored), but not over NVSHMEM, nor where FP8 rows and plain ones share
        # the loop: 8 to 16 bytes spilled at 248 registers under Triton 3.6 or 3.9
        _partial_rows(y, weights, slots, jm, kmax, dst, box, j64, staged, via_stores, fp8_rows,
                      stride, H, HAS_WEIGHTS, ACC_FP64, FP8, TRANSPORT, EVEN_H, BLOCK_T, BLOCK_H,
                      BLOCK_K, IN_FLIGHT, 1 if TRANSPORT == 1 or (FP8 and HIER) else STAGES,
                      HOLD)
        if TRANSPORT == 1:
            if remote:  # one block put per partial row (and its pair values)
                tl.debug_barrier()
                for i in range(BLOCK_T):
                    if j0 + i < n:
                        jj = (j0 + i).to(tl.int64)
                        put_bytes(local_base, rows_off + jj * stride,
                                  box_rows_off + (s.to(tl.int64) * TMAX + jj) * stride, payload,
                                  s)
                        if HAS_PAIR:
                            put_bytes(local_base, meta_off + jj * (4 * KMAX),
                                      box_meta_off + (s.to(tl.int64) * TMAX + jj) * (4 * KMAX),
                                      4 * KMAX, s)
        nbytes = tl.sum(jm.to(tl.int64), axis=0) * (payload + HAS_PAIR * 4 * K)
        if TRANSPORT == 2:  # for another node: an outbox (flat) or the forwarder (HIER)
            other_node += tl.where(remote, nbytes, 0)
            nbytes = tl.where(remote, 0, nbytes)
        to_peers += tl.where(s != me, nbytes, 0)
        to_self += tl.where(s == me, nbytes, 0)
    if TRANSPORT == 1:  # this program's puts complete before its ticket
        tl.debug_barrier()
        if one_thread():
            quiet()
    if TRANSPORT == 2:  # kept apart: outbox [1] (flat) or forwarders [3] (HIER)
        tl.atomic_add(xstats + 1 + 2 * HIER + tl.arange(0, 1), other_node, sem="relaxed")
    tl.atomic_add(stats + 2 + tl.arange(0, 1), to_peers, sem="relaxed")
    tl.atomic_add(stats + 3 + tl.arange(0, 1), to_self, sem="relaxed")


@triton.jit(do_not_specialize=_SEND_PER_CALL)
def combine_send_kernel(
    y,  # [rows, H] expert outputs
    weights,  # [rows] float32 (HAS_WEIGHTS)
    pair_values,  # [rows] float32 (HAS_PAIR): one value per row, sent back per (token, choice)
    slot_rows,  # [S, K] int32: rows of each received slot, -1 where unused
    slot_offsets,  # [R + 1] int64: first row of each source in slot_rows (its slots: the diff)
    compact,  # [programs * BLOCK_T * BLOCK_K] int32 scratch: each program's tile of slots' rows,
              # valid ones first in choice order (see the loop)
    peer_ptrs,  # [R] int64
    stats,  # [4] int64 local: bytes stored (to peers, to itself) at [2], [3]
    xstats,  # [4] int64 local (TRANSPORT 2): bytes for other nodes, outbox [1] or forwarder [3]
    tickets,  # [1] int64 local ticket counter of this channel
    epochs,  # [1] int64 local: this channel's latest epoch; the last program advances it
    rows_off: tl.int64, meta_off: tl.int64, signal_off: tl.int64,  # this rank's regions
    rows_parity: tl.int64, meta_parity: tl.int64,  # (parity 0) and bytes per parity
    box_rows_off: tl.int64, box_meta_off: tl.int64,  # TRANSPORT 1: rdma_combine_rows, _meta
    box_rows_parity: tl.int64, box_meta_parity: tl.int64,
    local_base: tl.int64,  # TRANSPORT 1: address of this rank's segment (symmetric addresses)
    errors_addr: tl.int64,  # the error record: nothing is published after a timeout
    plan,  # TRANSPORT 2: [PLAN_FIELDS] int64 byte offsets (kernels.internode)
    ring_addr: tl.int64, timeout_ns: tl.int64,  # TRANSPORT 2: the proxy's ring (flat)
    H: tl.int32, K: tl.int32, R: tl.int32, me: tl.int32, TMAX: tl.int32,
    N: tl.int32, RING_SLOTS: tl.int32,  # TRANSPORT 2: ranks per node, ring slots
    descriptor: tl.int32,  # the call's (moe_comm.call_descriptor), in every signal word
    KMAX: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_PAIR: tl.constexpr,
    ACC_FP64: tl.constexpr,
    FP8: tl.constexpr,  # partials travel as FP8 per 128 channels (not with ACC_FP64; with HIER
                        # those for other nodes go to the forwarder as they are, it sends FP8)
    TRANSPORT: tl.constexpr,  # 0: stores through peer pointers; where the pointer is 0,
                              # 1: NVSHMEM; 2: the proxy (flat: an outbox; HIER: the forwarder)
    HIER: tl.constexpr,
    ALIGN: tl.constexpr, EVEN_H: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    NUM_THREADS: tl.constexpr,
    IN_FLIGHT: tl.constexpr,  # rows gathered at once (a slot's compacted rows, -1 past its count)
    STAGES: tl.constexpr,  # channel tiles of gathers in flight + 1 (software pipelining)
):
    epoch = tl.load(epochs) + 1  # device epochs and a fixed grid: no per-call scalar (graphs)
    parity = epoch % 2
    rows_off += parity * rows_parity
    meta_off += parity * meta_parity
    box_rows_off += parity * box_rows_parity
    box_meta_off += parity * box_meta_parity
    send_partials(tl.program_id(0), tl.num_programs(0), parity, y, weights, pair_values,
                  slot_rows, slot_offsets, compact, peer_ptrs, stats, xstats, rows_off,
                  meta_off, box_rows_off, box_meta_off, local_base, plan, H, K, R, me, TMAX, N,
                  KMAX, HAS_WEIGHTS, HAS_PAIR, ACC_FP64, FP8, TRANSPORT, HIER, ALIGN, EVEN_H,
                  BLOCK_T, BLOCK_H, BLOCK_K, BLOCK_R, IN_FLIGHT, STAGES,
                  # all rows held: bf16 rows (fp16 ones spill 8 to 16 bytes under Triton 3.6,
                  # 32- and 64-bit ones 120 to 616 bytes)
                  IN_FLIGHT == 4 and y.dtype.element_ty == tl.bfloat16)
    if draw_last_of(tickets, tl.num_programs(0)):
        if not timed_out(errors_addr.to(tl.pointer_type(tl.int64)), NUM_THREADS):
            publish_partials(peer_ptrs, signal_off, signal_word(epoch, descriptor), parity,
                             stats, plan, slot_offsets, local_base, ring_addr, RING_SLOTS,
                             errors_addr, timeout_ns,
                             H * y.dtype.element_ty.primitive_bitwidth // 8, H, K, R, N, me,
                             KMAX, HAS_PAIR, FP8, TRANSPORT, HIER)
        tl.store(epochs + tl.arange(0, 1), epoch + tl.zeros([1], tl.int64))


@triton.jit
def publish_partials(peer_ptrs, signal_off, word, parity, stats, plan, slot_offsets,
                     local_base, ring_addr, RING_SLOTS, errors_addr, timeout_ns, stride, H, K, R,
                     N, me, KMAX: tl.constexpr, HAS_PAIR: tl.constexpr, FP8: tl.constexpr,
                     TRANSPORT: tl.constexpr, HIER: tl.constexpr):
    """The end of a combine send's partials (in its last program, ``combine_send_kernel``'s
    arguments; ``word``: the call's signal word, ``kernels.comm.signal_word``; ``stride``: bytes
    of a partial row): the word to every rank it reaches by stores (or NVSHMEM, TRANSPORT 1);
    through the proxy (TRANSPORT 2) to every forwarder of this node (HIER) or, flat, one
    transfer per home on another node, which raises the word there after the partials. 8
    bytes a rank reached, in ``stats``."""
    for d in range(R):
        publish_epoch_to(peer_ptrs, d, signal_off, word, local_base, TRANSPORT)
    reached = R
    if TRANSPORT == 2:
        reached = N
        if HIER:  # every forwarder of this node: this rank's partials are there
            for f in range(N):
                publish_epoch(peer_ptrs, (me // N) * N + f,
                              _at(plan, HC_SIGNALS) + (me % N) * 8, word)
        elif one_thread():
            flat_payload = stride
            if FP8:
                flat_payload = H + 4 * (H // 128)
            post_combine_flat(plan, slot_offsets, R, N, me, word, parity, flat_payload,
                              stride, K, KMAX, HAS_PAIR, ring_addr, RING_SLOTS, errors_addr,
                              timeout_ns)
    signal_bytes = 8 + tl.zeros([1], tl.int64)
    tl.atomic_add(stats + 2 + tl.arange(0, 1), (reached - 1) * signal_bytes, sem="relaxed")
    tl.atomic_add(stats + 3 + tl.arange(0, 1), signal_bytes, sem="relaxed")


@triton.jit
def _add_partials(acc, staging, slots, d0, d1, TMAX, cols, cm, ROW: tl.constexpr,
                  live, LIVE: tl.constexpr):
    """``acc += staging[d, slots[:, d]]`` (columns ``cols``) for ranks ``d0 <= d < d1``, in
    that order (``slots`` [rows, ranks] int32 in registers, -1 where none; with ``LIVE`` only
    the ranks with ``live[d] != 0``: fault tolerance)."""
    for d in range(d0, d1):
        slot = column(slots, d).to(tl.int64)
        if LIVE:
            slot = tl.where(tl.load(live + d) != 0, slot, -1)
        staged = d * TMAX + slot
        acc += tl.load(staging + staged[:, None] * ROW + cols[None, :],
                       mask=(slot >= 0)[:, None] & cm[None, :], other=0.0).to(acc.dtype)
    return acc


@triton.jit
def _add_fp8_partials(acc, staging8, slots, d0, d1, TMAX, h0, h, hm, H,
                      ROW_BYTES: tl.int64, live, LIVE: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_H: tl.constexpr):
    """:func:`_add_partials` for FP8 partials (ranks ``d0 <= d < d1`` in order): each row's
    codes ``h`` dequantized with their scales (``rows.load_fp8_partials``) before they are
    added."""
    for d in range(d0, d1):
        slot = column(slots, d).to(tl.int64)
        if LIVE:
            slot = tl.where(tl.load(live + d) != 0, slot, -1)
        acc += load_fp8_partials(staging8 + (d * TMAX + slot) * ROW_BYTES, slot >= 0, h0, h, hm,
                                 H, BLOCK_T, BLOCK_H)
    return acc


@triton.jit
def _sum_in_order(acc, staging, node_staging, slots, node_slots, me, R, N,
                  TMAX, cols, cm, ROW: tl.constexpr, HIER: tl.constexpr, live,
                  LIVE: tl.constexpr):
    """:func:`_add_partials` over every rank in rank order; with HIER in node order: this
    node's ranks one by one from ``staging``, every other node's sum as one row from
    ``node_staging`` (fault tolerance, ``LIVE``, is flat only)."""
    if HIER:
        M = R // N
        for b in range(M):
            if b == me // N:
                acc = _add_partials(acc, staging, slots, b * N, b * N + N, TMAX, cols,
                                    cm, ROW, live, False)
            else:
                acc = _add_partials(acc, node_staging, node_slots, b, b + 1, TMAX,
                                    cols, cm, ROW, live, False)
    else:
        acc = _add_partials(acc, staging, slots, 0, R, TMAX, cols, cm, ROW, live, LIVE)
    return acc


@triton.jit
def reduce_tile(i, c, staging, meta, node_rows, node_meta, slot_of, node_slot_of, out, pair_out,
                live, T, H, K, R, TMAX, N, me, KMAX: tl.constexpr, HAS_PAIR: tl.constexpr,
                ACC_FP64: tl.constexpr, EVEN_H: tl.constexpr, HIER: tl.constexpr,
                LIVE: tl.constexpr, FP8: tl.constexpr, ROW_BYTES, BLOCK_T: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """Channel tile ``c`` of token tile ``i`` of ``combine_reduce_kernel`` (its arguments;
    ``staging``, ``meta``, ``node_rows`` and ``node_meta`` at the parity to read)."""
    t = i * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    t64 = t.to(tl.int64)
    lanes = tl.arange(0, BLOCK_R)  # every token's slot on every rank, loaded once
    slots = tl.load(slot_of + t64[:, None] * R + lanes[None, :],
                    mask=tm[:, None] & (lanes < R)[None, :], other=-1)
    node_lanes = tl.arange(0, BLOCK_M)
    node_slots = slots
    if HIER:
        node_slots = tl.load(node_slot_of + t64[:, None] * (R // N) + node_lanes[None, :],
                             mask=tm[:, None] & (node_lanes < R // N)[None, :], other=-1)
    h0 = c * BLOCK_H
    h, hm = channel_tile(h0, H, BLOCK_H, EVEN_H)
    if FP8 and HIER:  # this node's partials one by one, every other node's sum as one
        acc = acc_zeros(BLOCK_T, BLOCK_H, False)
        for b in range(R // N):
            if b == me // N:
                acc = _add_fp8_partials(acc, staging, slots, b * N, b * N + N, TMAX, h0,
                                        h, hm, H, ROW_BYTES, live, False, BLOCK_T, BLOCK_H)
            else:
                acc = _add_fp8_partials(acc, node_rows, node_slots, b, b + 1, TMAX,
                                        h0, h, hm, H, ROW_BYTES, live, False, BLOCK_T, BLOCK_H)
    elif FP8:
        acc = _add_fp8_partials(acc_zeros(BLOCK_T, BLOCK_H, False), staging, slots, 0, R,
                                TMAX, h0, h, hm, H, ROW_BYTES, live, LIVE, BLOCK_T, BLOCK_H)
    else:
        acc = _sum_in_order(acc_zeros(BLOCK_T, BLOCK_H, ACC_FP64), staging, node_rows, slots,
                            node_slots, me, R, N, TMAX, h, hm, H, HIER, live,
                            LIVE)
    result = cast_rne(acc, out.dtype.element_ty)
    tl.store(out + t64[:, None] * H + h[None, :], result,  # gate: row
             mask=tm[:, None] & hm[None, :])
    if HAS_PAIR:
        if c == 0:
            kk = tl.arange(0, BLOCK_K)
            km = kk < K
            pacc = _sum_in_order(tl.zeros([BLOCK_T, BLOCK_K], tl.float32), meta, node_meta,
                                 slots, node_slots, me, R, N, TMAX, kk, km,
                                 KMAX, HIER, live, LIVE)
            tl.store(pair_out + t64[:, None] * K + kk[None, :], pacc,
                     mask=tm[:, None] & km[None, :])


@triton.jit(do_not_specialize=["T", "me"])
def combine_reduce_kernel(
    staging,  # [P, R, TMAX, H] local combine_rows
    meta,  # [P, R, TMAX, KMAX] float32 local combine_meta (HAS_PAIR)
    node_rows,  # [P, M, TMAX, H] local hcomb_rows (HIER): one sum per (node, node row)
    node_meta,  # [P, M, TMAX, KMAX] float32 local hcomb_meta (HIER and HAS_PAIR)
    epochs,  # [1] int64 local: the combine epoch (this call's: its parity is read here)
    slot_of,  # [T, R] int32: slot of token t on rank d, -1 if not sent there
    node_slot_of,  # [T, M] int32 (HIER): row of token t in node b's message, -1 if none
    out,  # [T, H]
    pair_out,  # [T, K] float32 (HAS_PAIR)
    live,  # [R] int32 (LIVE): 0 where the rank's partials did not arrive (fault tolerance)
    T: tl.int32, H: tl.int32, K: tl.int32, R: tl.int32, TMAX: tl.int32, N: tl.int32,
    me: tl.int32,
    STAGING_PARITY: tl.int64, META_PARITY: tl.int64,  # elements between the two parities
    NODE_PARITY: tl.int64, NODE_META_PARITY: tl.int64,
    KMAX: tl.constexpr, HAS_PAIR: tl.constexpr, ACC_FP64: tl.constexpr, EVEN_H: tl.constexpr,
    HIER: tl.constexpr, LIVE: tl.constexpr,
    FP8: tl.constexpr,  # staging (and node_rows) hold FP8 partials (uint8), ROW_BYTES apart
    ROW_BYTES: tl.int64,  # (a runtime value: no variant per Buffer size)
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Program (i, c) sums channel tile c of token tile i in rank order; with HIER in node
    order: this node's ranks one by one, every other node's sum as one row. Channel tile 0
    also sums the pair values (HAS_PAIR)."""
    parity = tl.load(epochs) % 2
    staging += parity * STAGING_PARITY
    meta += parity * META_PARITY
    node_rows += parity * NODE_PARITY
    node_meta += parity * NODE_META_PARITY
    reduce_tile(tl.program_id(0), tl.program_id(1), staging, meta, node_rows, node_meta, slot_of,
                node_slot_of, out, pair_out, live, T, H, K, R, TMAX, N, me, KMAX, HAS_PAIR,
                ACC_FP64, EVEN_H, HIER, LIVE, FP8, ROW_BYTES, BLOCK_T, BLOCK_H, BLOCK_K, BLOCK_R,
                BLOCK_M)


def send_grid(world_size: int, max_tokens: int, hidden: int, num_sms: int | None,
              flavour: Flavour, elem_bytes: int) -> int:
    """Programs of a combine send: one per tile of the most slots a rank can receive
    (``world_size * max_tokens``: the grid never changes, which the last-program ticket needs),
    at most ``num_sms`` (persistent)."""
    tile = tiles("combine_send", flavour.compiled, hidden, max(4, elem_bytes))  # fp32 sums
    return persistent_programs(triton.cdiv(world_size * max_tokens, tile.block_t), num_sms)


def combine_send(y, weights, pair_values, slot_rows, slot_offsets, peer_ptrs, stats, tickets,
                 epochs, *, offsets: dict, rank: int, topk: int, max_topk: int, max_tokens: int,
                 num_sms: int | None = None, flavour: Flavour = CPU_RANKS,
                 box_offsets: tuple = ((0, 0),) * 2, xstats=None, plan=None,
                 fp8: bool = False, bound: BoundLaunches | None = None,
                 scratch: dict | None = None, descriptor: int = 0) -> bool:
    """Launches the persistent send programs of :func:`send_grid` (every rank is signalled):
    they deal the tiles of every source's slots (``slot_offsets`` [R + 1] int64, the diff being
    each source's slots) round-robin among themselves.

    ``offsets``: rows / meta -> (byte offset of this rank's slice of parity 0, bytes per
    parity), signal -> byte offset; the epoch and parity come from ``epochs`` on the device.
    Across nodes (``flavour.transport == 1``) ``box_offsets`` are (offset, parity stride) of the
    rdma_combine_rows / rdma_combine_meta outboxes; through the proxy (``transport == 2``)
    ``xstats`` and ``plan`` (``kernels.internode``) say where partials for other nodes go.
    ``fp8``: the partials travel quantized (module docstring; not fp64); hierarchical: those
    for other nodes go to the forwarders unquantized, which send FP8 sums. ``bound``: the
    owner's bound launches (``kernels.bound``; ``y`` and the dispatch's tensors vary);
    ``scratch``: the owner's scratch tensors (:func:`_scratch`), else one per call;
    ``descriptor``: the call's, in every signal word (``moe_comm.call_descriptor``)."""
    H = y.shape[1]
    dummy = slot_offsets
    values = (y, weights if weights is not None else dummy,
              pair_values if pair_values is not None else dummy, slot_rows, slot_offsets,
              dummy if xstats is None else xstats, dummy if plan is None else plan)
    key = ("combine_send", H, topk, weights is None,
           pair_values is None, xstats is None, plan is None, id(peer_ptrs), id(stats),
           id(tickets), id(epochs), id(offsets), rank, max_topk, max_tokens, num_sms,
           id(flavour), box_offsets, fp8, id(scratch), descriptor)
    if call_bound(bound, key, values):
        return True
    R = peer_ptrs.numel()
    tile = tiles("combine_send", flavour.compiled, H, max(4, y.element_size()))
    grid = (send_grid(R, max_tokens, H, num_sms, flavour, y.element_size()),)
    block_k = triton.next_power_of_2(max(topk, 1))
    # fixed across calls (the bound launch keeps it): the owner's, or this call's
    compact = _scratch(scratch, y.device, grid[0] * tile.block_t * block_k)
    args = (
        *values[:5], compact, peer_ptrs, stats, values[5], tickets, epochs,
        offsets["rows"][0], offsets["meta"][0],
        offsets["signal"], offsets["rows"][1], offsets["meta"][1],
        *(off for off, _ in box_offsets), *(stride for _, stride in box_offsets),
        flavour.local_base, flavour.errors_addr, values[6],
        flavour.ring_addr, flavour.timeout_ns, H, topk, R, rank, max_tokens,
        flavour.ranks_per_node or R, flavour.ring_slots, descriptor)
    kwargs = dict(
        KMAX=max_topk,
        HAS_WEIGHTS=weights is not None, HAS_PAIR=pair_values is not None,
        ACC_FP64=y.dtype == torch.float64, FP8=fp8, TRANSPORT=flavour.transport,
        HIER=flavour.hierarchical,
        ALIGN=flavour.row_align, EVEN_H=even(H, tile.block_h), BLOCK_T=tile.block_t,
        BLOCK_H=tile.block_h, BLOCK_K=block_k,
        BLOCK_R=triton.next_power_of_2(R), NUM_THREADS=tile.num_threads,
        IN_FLIGHT=gathers_in_flight(topk, y.element_size(), flavour.compiled),
        STAGES=SEND_STAGES.value, **flavour.launch_options(tile))
    launch(bound, key, combine_send_kernel, grid, args, kwargs,
           ("y", "weights", "pair_values", "slot_rows", "slot_offsets", "xstats", "plan"))
    return True


def _scratch(pool: dict | None, device, numel: int) -> torch.Tensor:
    """An int32 scratch of ``numel`` words on ``device``: the owner's (``pool``, kept across
    calls: its kernels run in stream order, so one scratch serves them all), or a new one."""
    if pool is None:
        return torch.empty(numel, dtype=torch.int32, device=device)
    key = (str(device), numel)
    if key not in pool:
        pool[key] = torch.empty(numel, dtype=torch.int32, device=device)
    return pool[key]


def gathers_in_flight(topk: int, elem_bytes: int, compiled: bool) -> int:
    """Rows of a slot (its compacted choices) a combine send gathers at once, their indices and
    weights held across the channel tiles: 1, 2 or 4, never more than the choices' block; on a
    GPU as many as registers hold beside the fp32 accumulator (4 rows of 16-bit data, 2 of
    32-bit, 1 of 64-bit), 4 in the interpreter (the 16-bit path, whatever the dtype)."""
    block_k = triton.next_power_of_2(max(topk, 1))
    return min(block_k, 8 // elem_bytes if compiled else 4)


def reduce_grid(tokens: int, hidden: int, flavour: Flavour, elem_bytes: int) -> tuple[int, int]:
    """``(token tiles, channel tiles)`` of a combine reduce of ``tokens`` tokens."""
    tile = tiles("combine_reduce", flavour.compiled, hidden, max(4, elem_bytes))
    return triton.cdiv(tokens, tile.block_t), triton.cdiv(hidden, tile.block_h)


def combine_reduce(staging, meta, epochs, slot_of, out, pair_out, *, topk: int, max_topk: int,
                   flavour: Flavour = CPU_RANKS, rank: int = 0, node_rows=None, node_meta=None,
                   node_slot_of=None, live=None, fp8: bool = False,
                   bound: BoundLaunches | None = None) -> bool:
    """Launches the :func:`reduce_grid` programs (none for ``T == 0``); ``staging`` /
    ``meta``: the whole combine_rows / combine_meta regions, the parity read from ``epochs``;
    hierarchical (``flavour.hierarchical``): ``node_rows`` / ``node_meta`` the whole hcomb
    regions and ``node_slot_of`` [T, M] from the dispatch; ``live`` [R] int32 (fault
    tolerance): the ranks whose partials arrived (the others' are left out); ``fp8``: the
    partials (and the node sums) are FP8; ``bound``: the owner's bound launches (the
    dispatch's tensors, the outputs and the token count vary)."""
    T, H = out.shape
    R, TMAX = staging.shape[1:3]
    if T == 0:
        return False
    has_pair = pair_out is not None
    hier = flavour.hierarchical
    row_bytes = staging.stride(2) * staging.element_size()
    if fp8:
        staging = staging.view(torch.uint8)
        node_rows = node_rows.view(torch.uint8) if hier else None
    grid = reduce_grid(T, H, flavour, out.element_size())
    values = (staging, meta, node_rows if hier else staging, node_meta if hier else meta,
              slot_of, node_slot_of if hier else slot_of, out, pair_out if has_pair else out,
              slot_of if live is None else live, T)
    key = ("combine_reduce", grid, staging.shape, staging.stride(0), meta.stride(0),
           node_rows.stride(0) if hier else 0, node_meta.stride(0) if hier else 0, row_bytes,
           H, has_pair, live is None, id(epochs), topk,
           max_topk, id(flavour), rank, fp8)
    if call_bound(bound, key, values):
        return True
    tile = tiles("combine_reduce", flavour.compiled, H, max(4, out.element_size()))
    args = (
        *values[:4], epochs, *values[4:], H,
        topk, R, TMAX, flavour.ranks_per_node or R, rank, staging.stride(0), meta.stride(0),
        node_rows.stride(0) if hier else 0, node_meta.stride(0) if hier else 0)
    kwargs = dict(
        KMAX=max_topk, HAS_PAIR=has_pair, HIER=hier, LIVE=live is not None, FP8=fp8,
        ROW_BYTES=row_bytes,
        ACC_FP64=out.dtype == torch.float64, EVEN_H=even(H, tile.block_h), BLOCK_T=tile.block_t,
        BLOCK_H=tile.block_h, BLOCK_K=triton.next_power_of_2(max(topk, 1)),
        BLOCK_R=triton.next_power_of_2(R),
        BLOCK_M=triton.next_power_of_2(R // (flavour.ranks_per_node or R)),
        **tile.launch_options())
    launch(bound, key, combine_reduce_kernel, grid, args, kwargs,
           ("staging", "meta", "node_rows", "node_meta", "slot_of", "node_slot_of", "out",
            "pair_out", "live", "T"))
    return True
