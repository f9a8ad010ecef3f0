"""The EP-invariant combine: every (token, choice) row goes home on its own, the home rank sums
them in choice order, so the result does not depend on where the experts are.

Equivalent PyTorch (``reference.invariant_combine``), for token ``t`` of home rank ``s``::

    acc = torch.zeros(H, dtype=torch.float32)
    for k in range(K):                       # skipping choices that went nowhere
        acc = acc + w[t, k].float() * y_row(t, k).float()   # each op rounded to fp32, no FMA
    out[t] = acc.to(dtype)

``y_row(t, k)`` is the expert output row of choice ``k`` (on whichever rank holds its expert) and
``w[t, k]`` the weight that row was given (the combine's ``weights`` of that row; 1 without).

**Send** (``invariant_send_kernel``, on the expert rank): a persistent grid of at most
``num_sms`` programs deals the tiles of every source's received slots round-robin (as the
default combine's send); for each slot, each choice ``k`` with a row ``r`` on this rank (a tile
takes its slots' c-th rows together, up to its fullest slot's count) stores
``y[r]`` unchanged (the Buffer's dtype) into home ``s``'s ``inv_rows[p, (t % W) * K + k]`` (``t``
the slot's source token, ``W`` the ring slots: a round's window) and the pair
``(weights[r], pair_values[r])`` as two floats into ``inv_meta[p, (t % W) * K + k]``. The last
program publishes the combine epoch to every rank. Bytes stored into rank ``s``:
``pairs_s * (H * elem + 8) + 8``: one row per (token, choice) instead of one partial per
(token, rank). Across nodes through the proxy (flat, ``TRANSPORT`` 2) a home on another node has
no pointer: its rows and pairs go to the outbox ``inv_box_rows[p, s]`` / ``inv_box_meta[p, s]``
at the same index, one descriptor per (token, choice) moves both to the home (its no-op signal
keeps them ahead of the epoch), and the last program posts the epoch to every such home after
them.

**Reduce** (``invariant_reduce_kernel``, on the home rank, after every epoch arrived): program
``(i, c)`` sums channel tile ``c`` of token tile ``i`` over ``k = 0 .. K-1`` in that order; a
choice counts where its expert id is in ``[0, E)``, its rank got the token (``slot_of >= 0``)
and, with fault tolerance, that rank's rows of this call arrived (``live``). Launched with
``enable_fp_fusion=False``: a product and the following addition are each rounded (on GPUs the
compiler would otherwise fuse them; the interpreter never does). The per-choice values come
back as they were sent (``pair_out[t, k]``, 0 where the choice counts not).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .bound import BoundLaunches, call_bound, launch
from .combine import source_tile, source_tiles
from .comm import (
    CPU_RANKS,
    Flavour,
    draw_last_of,
    local_ptr,
    one_thread,
    peer_ptr,
    publish_epoch_to,
    signal_word,
    timed_out,
)
from .numerics import cast_rne, channel_tile, column
from .proxy import post_signal_to_remote, post_transfer
from .tiles import even, persistent_programs, tiles

META_WORDS = tl.constexpr(2)  # floats per (token, choice) in inv_meta: its weight, its value
# the send's row copy: the next channel tile's loads in flight (through shared memory) while
# one is stored
COPY_STAGES = tl.constexpr(3)


@triton.jit
def send_pairs(pid, programs, y, weights, pair_values, slot_rows, slot_offsets, src_token,
               peer_ptrs, stats, xstats, rows_off, meta_off, signal_off, box_rows_off,
               box_meta_off, local_base, errors, ring_addr, RING_SLOTS, timeout_ns, H, K, R, me,
               W, KMAX: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_PAIR: tl.constexpr,
               TRANSPORT: tl.constexpr, ALIGN: tl.constexpr, EVEN_H: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_R: tl.constexpr, COMPACT: tl.constexpr, STAGES: tl.constexpr):
    """Program ``pid`` of ``programs``: its tiles of every source's slots (``slot_offsets``
    [R + 1], a round's), each (slot, choice) row and its two floats to the home's
    ``inv_rows`` / ``inv_meta`` (``rows_off`` / ``meta_off`` of the parity to write; through the
    proxy the outboxes and a descriptor each), their bytes added to ``stats`` (``xstats``: the
    outbox's); :func:`invariant_send_kernel`'s arguments. ``COMPACT``: a tile's passes take
    the c-th rows of its slots (up to its fullest slot's count), else choice c (K passes);
    ``STAGES`` > 1: the row copy is software pipelined, the next ``STAGES - 1`` channel tiles'
    loads in flight while one is stored (through shared memory)."""
    stride = H * y.dtype.element_ty.primitive_bitwidth // 8  # bytes of a row
    first_slots, src_tiles, tiles_end = source_tiles(slot_offsets, R, BLOCK_T, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    two = tl.arange(0, META_WORDS)
    to_peers = tl.zeros([1], tl.int64)
    to_self = tl.zeros([1], tl.int64)
    other_node = tl.zeros([1], tl.int64)
    for w in range(pid, tl.sum(src_tiles, axis=0), programs):
        s, first_slot, n, j0 = source_tile(w, slot_offsets, first_slots, src_tiles, tiles_end,
                                           BLOCK_T, BLOCK_R)
        dst = peer_ptr(peer_ptrs, s, rows_off, y.dtype.element_ty, ALIGN)
        dst_meta = peer_ptr(peer_ptrs, s, meta_off, tl.float32, 8)
        remote = False
        box_rows = box_rows_off + s.to(tl.int64) * (W * KMAX) * stride  # (TRANSPORT 2)
        box_meta = box_meta_off + s.to(tl.int64) * (W * KMAX) * (4 * META_WORDS)
        if TRANSPORT == 2:
            remote = tl.load(peer_ptrs + s) == 0
            if remote:  # home s on another node: into its outbox slice, the proxy moves it
                dst = local_ptr(local_base, box_rows, y.dtype.element_ty, ALIGN)
                dst_meta = local_ptr(local_base, box_meta, tl.float32, 8)
        j = j0 + tl.arange(0, BLOCK_T)
        jm = j < n
        slots = (first_slot + j).to(tl.int64)
        rows = tl.load(slot_rows + slots[:, None] * K + kk[None, :],
                       mask=jm[:, None] & (kk < K)[None, :], other=-1)
        # the slot's home token: every row of a slot came from the same one
        token = tl.max(tl.load(src_token + rows.to(tl.int64), mask=rows >= 0, other=-1), axis=1)
        base = (token % W) * KMAX  # the token's rows in its round's window
        # COMPACT: pass c takes the c-th valid row of every slot (and its choice k), so that it
        # fills the lanes of every slot that has one (about 1.5 rows of top-8 a slot at EP 8):
        # passes up to the tile's fullest slot, not K; else pass c takes choice c
        valid = rows >= 0
        place = tl.where(valid, tl.cumsum(valid.to(tl.int32), axis=1) - 1, -1)
        passes = K
        if COMPACT:
            passes = tl.max(tl.max(place, axis=1), axis=0) + 1
        pairs = tl.zeros([1], tl.int64)
        for c in range(passes):
            if COMPACT:  # (row + 1 summed: -1 where a slot has no c-th row)
                mine = place == c
                row = tl.sum(tl.where(mine, rows + 1, 0), axis=1).to(tl.int64) - 1
                at = base + tl.sum(tl.where(mine, kk[None, :], 0), axis=1)
            else:
                row = column(rows, c).to(tl.int64)
                at = base + c
            rm = jm & (row >= 0)
            for h0 in tl.range(0, H, BLOCK_H, num_stages=STAGES):
                h, hm = channel_tile(h0, H, BLOCK_H, EVEN_H)
                m = rm[:, None] & hm[None, :]
                v = tl.load(y + row[:, None] * H + h[None, :], mask=m)  # gate: live
                tl.store(dst + at[:, None] * H + h[None, :], v, mask=m)  # gate: row live
            wv = tl.zeros([BLOCK_T], tl.float32)
            pv = tl.zeros([BLOCK_T], tl.float32)
            if HAS_WEIGHTS:
                wv = tl.load(weights + row, mask=rm, other=0.0)
            if HAS_PAIR:
                pv = tl.load(pair_values + row, mask=rm, other=0.0)
            both = tl.where(two[None, :] == 0, wv[:, None], pv[:, None])
            tl.store(dst_meta + at[:, None] * META_WORDS + two[None, :], both, mask=rm[:, None])
            pairs += tl.sum(rm.to(tl.int64), axis=0)
        if TRANSPORT == 2:
            if remote:  # one descriptor per (slot, choice): the row and its two floats
                tl.debug_barrier()
                for i in range(BLOCK_T):
                    if j0 + i < n:
                        _post_slot(slot_rows, src_token, (first_slot + j0 + i).to(tl.int64), s,
                                   K, W, KMAX, stride, rows_off, meta_off, box_rows, box_meta,
                                   signal_off, ring_addr, RING_SLOTS, errors, timeout_ns)
        nbytes = pairs * (stride + 4 * META_WORDS)
        if TRANSPORT == 2:  # kept apart: the outbox's
            other_node += tl.where(remote, nbytes, 0)
            nbytes = tl.where(remote, 0, nbytes)
        to_peers += tl.where(s != me, nbytes, 0)
        to_self += tl.where(s == me, nbytes, 0)
    if TRANSPORT == 2:
        tl.atomic_add(xstats + 1 + tl.arange(0, 1), other_node, sem="relaxed")
    tl.atomic_add(stats + 2 + tl.arange(0, 1), to_peers, sem="relaxed")
    tl.atomic_add(stats + 3 + tl.arange(0, 1), to_self, sem="relaxed")


@triton.jit(do_not_specialize=["signal_off", "local_base", "errors_addr", "me", "descriptor"])
def invariant_send_kernel(
    y,  # [rows, H] expert outputs
    weights,  # [rows] float32 (HAS_WEIGHTS)
    pair_values,  # [rows] float32 (HAS_PAIR)
    slot_rows,  # [S, K] int32: rows of each received slot, -1 where unused
    slot_offsets,  # [R + 1] int64: first slot of each source (its slots: the diff)
    src_token,  # [rows] int64: each row's token on its home rank
    peer_ptrs,  # [R] int64
    stats,  # [4] int64 local: bytes stored (to peers, to itself) at [2], [3]
    tickets,  # [1] int64 local ticket counter of the combine channel
    epochs,  # [1] int64 local: the combine's latest epoch; the last program advances it
    rows_off: tl.int64, meta_off: tl.int64, signal_off: tl.int64,  # inv_rows, inv_meta (p 0)
    rows_parity: tl.int64, meta_parity: tl.int64,  # bytes per parity
    local_base: tl.int64, errors_addr: tl.int64,
    xstats,  # [4] int64 local (TRANSPORT 2): bytes into the outbox at [1]
    box_rows_off: tl.int64, box_meta_off: tl.int64,  # TRANSPORT 2: inv_box_rows, _meta (p 0)
    box_rows_parity: tl.int64, box_meta_parity: tl.int64,
    ring_addr: tl.int64, RING_SLOTS: tl.int64, timeout_ns: tl.int64,  # TRANSPORT 2: the proxy
    H: tl.int32, K: tl.int32, R: tl.int32, me: tl.int32, W: tl.int32,
    descriptor: tl.int32,  # the call's (moe_comm.call_descriptor), in its signal word
    KMAX: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_PAIR: tl.constexpr,
    TRANSPORT: tl.constexpr,  # 0: stores through peer pointers; 2: the proxy where none (flat)
    ALIGN: tl.constexpr, EVEN_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, NUM_THREADS: tl.constexpr,
):
    epoch = tl.load(epochs) + 1  # device epochs and a fixed grid (graphs)
    parity = epoch % 2
    rows_off += parity * rows_parity
    meta_off += parity * meta_parity
    box_rows_off += parity * box_rows_parity
    box_meta_off += parity * box_meta_parity
    errors = errors_addr.to(tl.pointer_type(tl.int64))
    send_pairs(tl.program_id(0), tl.num_programs(0), y, weights, pair_values, slot_rows,
               slot_offsets, src_token, peer_ptrs, stats, xstats, rows_off, meta_off,
               signal_off, box_rows_off, box_meta_off, local_base, errors, ring_addr,
               RING_SLOTS, timeout_ns, H, K, R, me, W, KMAX, HAS_WEIGHTS, HAS_PAIR, TRANSPORT,
               ALIGN, EVEN_H, BLOCK_T, BLOCK_H, BLOCK_K, BLOCK_R, True, COPY_STAGES)
    if draw_last_of(tickets, tl.num_programs(0)):
        if not timed_out(errors, NUM_THREADS):
            publish_pairs(peer_ptrs, signal_off, signal_word(epoch, descriptor), stats,
                          local_base, ring_addr, RING_SLOTS, errors, timeout_ns, R, me,
                          TRANSPORT)
        tl.store(epochs + tl.arange(0, 1), epoch + tl.zeros([1], tl.int64))


@triton.jit
def publish_pairs(peer_ptrs, signal_off, word, stats, local_base, ring_addr, RING_SLOTS,
                  errors, timeout_ns, R, me, TRANSPORT: tl.constexpr):
    """The end of an invariant send (its last program, after every program's pairs): its
    signal word (``kernels.comm.signal_word``) to every rank it reaches by stores; through the
    proxy (``TRANSPORT`` 2) one signal per rank on another node, posted after this rank's
    descriptors to it (the proxy keeps their order). 8 bytes a rank reached by stores, in
    ``stats``."""
    for d in range(R):
        publish_epoch_to(peer_ptrs, d, signal_off, word, local_base, TRANSPORT)
    reached = R
    if TRANSPORT == 2:
        if one_thread():
            post_signal_to_remote(peer_ptrs, signal_off - me * 8, me, word, R, ring_addr,
                                  RING_SLOTS, errors, timeout_ns)
        reached = 0
        for d in range(R):
            reached += (tl.load(peer_ptrs + d) != 0).to(tl.int32)
    signal_bytes = 8 + tl.zeros([1], tl.int64)
    tl.atomic_add(stats + 2 + tl.arange(0, 1), (reached - 1) * signal_bytes, sem="relaxed")
    tl.atomic_add(stats + 3 + tl.arange(0, 1), signal_bytes, sem="relaxed")


@triton.jit
def _post_slot(slot_rows, src_token, slot, s, K, W, KMAX: tl.constexpr, stride, rows_off,
               meta_off, box_rows, box_meta, signal_off, ring_addr, RING_SLOTS, errors,
               timeout_ns):
    """Through the proxy: one descriptor for each choice of ``slot`` on this rank, moving its
    row and its two floats from the outbox to home ``s`` at the same index; a no-op signal (0)
    keeps it ahead of the epoch (call after the tile's stores, from every thread: one posts)."""
    for k in range(K):
        row = tl.load(slot_rows + slot * K + k)
        if row >= 0:
            at = (tl.load(src_token + row) % W) * KMAX + k
            if one_thread():
                post_transfer(ring_addr, RING_SLOTS, s, signal_off, 0, 2,
                              box_rows + at * stride, rows_off + at * stride, stride, stride, 1,
                              box_meta + at * (4 * META_WORDS), meta_off + at * (4 * META_WORDS),
                              4 * META_WORDS, 4 * META_WORDS, 1, 0, 0, 0, 0, 0, errors,
                              timeout_ns)


@triton.jit(do_not_specialize=["T"])
def invariant_reduce_kernel(
    stage,  # [P, W * KMAX, H] local inv_rows
    meta,  # [P, W * KMAX, 2] float32 local inv_meta
    epochs,  # [1] int64 local: the combine epoch (this call's: its parity is read here)
    topk_idx,  # [T, K] int64: the dispatch's expert ids of these tokens
    slot_of,  # [T, R] int32: slot (ring position) of token t on rank d, -1 if not sent there
    out,  # [T, H]
    pair_out,  # [T, K] float32 (HAS_PAIR)
    live,  # [R] int32 (LIVE): 0 where the rank's rows did not arrive (fault tolerance)
    T: tl.int32, H: tl.int32, K: tl.int32, R: tl.int32, E: tl.int32,
    STAGE_PARITY: tl.int64, META_PARITY: tl.int64,  # elements between the two parities
    KMAX: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_PAIR: tl.constexpr,
    LIVE: tl.constexpr, EVEN_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (i, c): :func:`reduce_tokens` of this call's parity."""
    parity = tl.load(epochs) % 2
    reduce_tokens(tl.program_id(0), tl.program_id(1), stage + parity * STAGE_PARITY,
                  meta + parity * META_PARITY, topk_idx, slot_of, out, pair_out, live, T, H, K,
                  R, E, KMAX, HAS_WEIGHTS, HAS_PAIR, LIVE, EVEN_H, BLOCK_T, BLOCK_H, BLOCK_K)


@triton.jit
def reduce_tokens(i, c, stage, meta, topk_idx, slot_of, out, pair_out, live, T, H, K, R, E,
                  KMAX: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_PAIR: tl.constexpr,
                  LIVE: tl.constexpr, EVEN_H: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """Channel tile ``c`` of token tile ``i``, choices in order (``stage`` / ``meta`` at the
    parity to read; :func:`invariant_reduce_kernel`'s other arguments); channel tile 0 also
    returns the pair values."""
    t = i * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    t64 = t.to(tl.int64)
    L = E // R
    kk = tl.arange(0, BLOCK_K)
    ids = tl.load(topk_idx + t64[:, None] * K + kk[None, :],
                  mask=tm[:, None] & (kk < K)[None, :], other=-1)
    valid = (ids >= 0) & (ids < E)
    rank = tl.where(valid, ids // L, 0)
    valid = valid & (tl.load(slot_of + t64[:, None] * R + rank, mask=valid, other=-1) >= 0)
    if LIVE and HAS_PAIR:  # the choices of ranks that arrived, for the sums and the pairs
        valid = valid & (tl.load(live + rank, mask=valid, other=0) != 0)
    h0 = c * BLOCK_H
    h, hm = channel_tile(h0, H, BLOCK_H, EVEN_H)
    acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    counted = tl.where(valid, ids, -1)  # (a column of ids, not of flags: no local memory)
    for k in range(K):
        ids_k = column(counted, k)
        vk = ids_k >= 0
        if LIVE and not HAS_PAIR:  # (for the sums alone a column at a time: fewer
            vk = vk & (tl.load(live + ids_k // L, mask=vk, other=0) != 0)  # registers)
        at = t64 * KMAX + k
        v = tl.load(stage + at[:, None] * H + h[None, :], mask=vk[:, None] & hm[None, :],
                    other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            v = v * tl.load(meta + at * 2, mask=vk, other=0.0)[:, None]
        acc = acc + v
    tl.store(out + t64[:, None] * H + h[None, :], cast_rne(acc, out.dtype.element_ty),  # gate: row
             mask=tm[:, None] & hm[None, :])
    if HAS_PAIR:
        if c == 0:
            values = tl.load(meta + (t64[:, None] * KMAX + kk[None, :]) * 2 + 1, mask=valid,
                             other=0.0)
            tl.store(pair_out + t64[:, None] * K + kk[None, :], values,
                     mask=tm[:, None] & (kk < K)[None, :])


def send_grid(world_size: int, max_tokens: int, hidden: int, num_sms: int | None,
              flavour: Flavour, elem_bytes: int) -> int:
    """Programs of an invariant send: one per tile of the most slots a rank can receive, at most
    ``num_sms`` (fixed across calls, as the last-program ticket needs)."""
    tile = tiles("invariant_send", flavour.compiled, hidden, elem_bytes)
    return persistent_programs(triton.cdiv(world_size * max_tokens, tile.block_t), num_sms)


def invariant_send(y, weights, pair_values, slot_rows, slot_offsets, src_token, peer_ptrs,
                   stats, tickets, epochs, *, offsets: dict, rank: int, topk: int,
                   max_topk: int, ring_slots: int, num_sms: int | None = None,
                   flavour: Flavour = CPU_RANKS, bound: BoundLaunches | None = None,
                   xstats=None, descriptor: int = 0) -> bool:
    """Launches the :func:`send_grid` programs (every rank is signalled). ``offsets``: rows /
    meta -> (byte offset of parity 0 of ``inv_rows`` / ``inv_meta``, bytes per parity),
    signal -> byte offset of this rank's combine signal word, and through the proxy box_rows /
    box_meta -> the outboxes' (``inv_box_rows`` / ``inv_box_meta``); ``slot_offsets`` [R + 1]
    int64 (a round's); ``ring_slots``: ``W``; ``xstats``: the outbox byte counters (proxy);
    ``descriptor``: the call's, in its signal word (``moe_comm.call_descriptor``)."""
    H = y.shape[1]
    dummy = slot_offsets
    values = (y, weights if weights is not None else dummy,
              pair_values if pair_values is not None else dummy, slot_rows, slot_offsets,
              src_token)
    key = ("invariant_send", H, topk, weights is None, pair_values is None,
           id(peer_ptrs), id(stats), id(tickets), id(epochs), id(offsets), rank, max_topk,
           ring_slots, num_sms, id(flavour), descriptor)
    if call_bound(bound, key, values):
        return True
    R = peer_ptrs.numel()
    tile = tiles("invariant_send", flavour.compiled, H, y.element_size())
    grid = (send_grid(R, ring_slots, H, num_sms, flavour, y.element_size()),)
    box_rows, box_meta = offsets.get("box_rows", (0, 0)), offsets.get("box_meta", (0, 0))
    args = (*values, peer_ptrs, stats, tickets, epochs, offsets["rows"][0], offsets["meta"][0],
            offsets["signal"], offsets["rows"][1], offsets["meta"][1], flavour.local_base,
            flavour.errors_addr, stats if xstats is None else xstats, box_rows[0], box_meta[0],
            box_rows[1], box_meta[1], flavour.ring_addr, flavour.ring_slots, flavour.timeout_ns,
            H, topk, R, rank, ring_slots, descriptor)
    kwargs = dict(
        KMAX=max_topk, HAS_WEIGHTS=weights is not None, HAS_PAIR=pair_values is not None,
        TRANSPORT=flavour.transport,
        ALIGN=flavour.row_align, EVEN_H=even(H, tile.block_h), BLOCK_T=tile.block_t,
        BLOCK_H=tile.block_h, BLOCK_K=triton.next_power_of_2(max(topk, 1)),
        BLOCK_R=triton.next_power_of_2(R), NUM_THREADS=tile.num_threads,
        **flavour.launch_options(tile))
    launch(bound, key, invariant_send_kernel, grid, args, kwargs,
           ("y", "weights", "pair_values", "slot_rows", "slot_offsets", "src_token"))
    return True


def reduce_grid(tokens: int, hidden: int, flavour: Flavour) -> tuple[int, int]:
    """``(token tiles, channel tiles)`` of an invariant reduce of ``tokens`` tokens."""
    tile = tiles("invariant_reduce", flavour.compiled, hidden, 4)  # fp32 sums
    return triton.cdiv(tokens, tile.block_t), triton.cdiv(hidden, tile.block_h)


def invariant_reduce(stage, meta, epochs, topk_idx, slot_of, out, pair_out, *,
                     num_experts: int, max_topk: int, has_weights: bool, live=None,
                     flavour: Flavour = CPU_RANKS, bound: BoundLaunches | None = None) -> bool:
    """Launches the :func:`reduce_grid` programs (none for ``T == 0``); ``stage`` / ``meta``:
    the whole ``inv_rows`` / ``inv_meta`` regions (the parity read from ``epochs``);
    ``topk_idx`` [T, K], ``slot_of`` [T, R] and ``out`` [T, H] a round's window; ``live`` [R]
    int32 (fault tolerance)."""
    T, H = out.shape
    if T == 0:
        return False
    K = topk_idx.shape[1]
    has_pair = pair_out is not None
    grid = reduce_grid(T, H, flavour)
    values = (topk_idx, slot_of, out, pair_out if has_pair else out,
              slot_of if live is None else live, T)
    key = ("invariant_reduce", grid, stage.shape, H, has_weights, has_pair,
           live is None, id(epochs), num_experts, max_topk, id(flavour))
    if call_bound(bound, key, values):
        return True
    R = slot_of.shape[1]
    tile = tiles("invariant_reduce", flavour.compiled, H, 4)
    args = (stage, meta, epochs, *values, H, K, R, num_experts, stage.stride(0),
            meta.stride(0))
    kwargs = dict(
        KMAX=max_topk, HAS_WEIGHTS=has_weights,
        HAS_PAIR=has_pair, LIVE=live is not None, EVEN_H=even(H, tile.block_h),
        BLOCK_T=tile.block_t, BLOCK_H=tile.block_h, BLOCK_K=triton.next_power_of_2(max(K, 1)),
        enable_fp_fusion=False, **tile.launch_options())
    launch(bound, key, invariant_reduce_kernel, grid, args, kwargs,
           ("topk_idx", "slot_of", "out", "pair_out", "live", "T"))
    return True
