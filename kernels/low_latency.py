"""Low-latency (decode) dispatch and combine: one put per (token, expert) pair, fixed slots.

Receiver-side staging has a fixed slot for every (local expert ``e``, source ``s``, position
``j < T_max``), so no counts are exchanged before the data: the sender knows every slot from
its own routing. Equivalent PyTorch, for source ``s`` and global expert ``g`` on rank ``d``::

    pairs = [(t, k) for t in range(T) for k in range(K) if topk_idx[t, k] == g]  # token order
    staging_d[p, g % L, s, j] = quantize(x[t]), meta_d[p, g % L, s, j] = t * 32 + k  # j-th pair
    signal_d[p, g % L, s] = epoch << 32 | descriptor << SLOT_BITS | len(pairs)  # the call's

Epochs and tickets live in device memory (``state``: [0] dispatch sent, [1] dispatch received,
[2] combine sent, [3] combine received, [4..7] the four kernels' tickets), grids depend only on
the Buffer's sizes, and no kernel takes a per-call scalar: a captured CUDA graph can replay the
pair. Call ``n`` uses parity ``n % 2``; the receive kernels acknowledge each parity to every
source (``acks``), and a sender writes parity ``p`` again only after every destination
acknowledged the call before (checked by the host before the launch on CPU ranks).

Kernels (launches per op: dispatch 2, combine 2). Their grids cover the work, up to the whole
GPU (``kernels.tiles.ll_tiles``; ``num_sms`` is the normal mode's budget): each program holds
whole rows, loads them before it stores any, and waits once.

* ``ll_dispatch_send_kernel`` (grid ``cdiv(T_max, BLOCK_T)``: a program per tile of tokens,
  2 at DeepSeek-V3 sizes, 1 for NVFP4): the tile's rows, the ids of its pass of ``BLOCK_P``
  tokens and its peers' bases are loaded before the wait; each pair's position is the pairs
  of earlier tokens that chose its expert (one histogram of the pass, one trip at decode
  sizes: positions are deterministic and no program waits for another); the tile is
  quantized once (FP8) and each choice's row and meta go straight into the expert's slot
  (stores unrolled over the choices). The last program publishes ``epoch << 32 | count`` for
  every expert. Bytes into rank ``d``: pairs(d) * (row + 4) + 8 * L.
* ``ll_dispatch_recv_kernel`` (grid ``L * R``: a program per (expert, source) block): after
  one wait for its block's word, the block is copied to the compact, expert-major output
  (sources in rank order, tokens in order) with where each row came from, and the last
  program acknowledges the parity to every source.
* ``ll_combine_send_kernel`` (grid ``L * R``, the same blocks): each received row goes back to
  its home rank's slot ``[token, choice]``; the last program publishes ``epoch << 32 |
  descriptor << SLOT_BITS`` (the call's format, or a refusal and no rows:
  ``moe_comm.call_descriptor``) to every rank.
* ``ll_combine_recv_kernel`` (grid ``cdiv(T_max, BLOCK_T) x cdiv(H, BLOCK_H)``: token tiles
  by channel tiles, a group of 128 channels for FP8 slots): every choice's slot of the tile
  is loaded at once, then ``out[t] = sum_k w[t, k] * slot[t, k]`` in fp32 (choice order, each
  product and each sum rounded to fp32: compiled without fused multiply-adds), rounded to
  nearest even; the last program acknowledges. That is the EP-invariant combine's formula
  (``kernels.invariant``): the low-latency combine's result depends on no placement of
  experts.

With in-kernel waits (GPUs), every wait polls all its sources' words at once (device memory
only; the clock every ``comm.SPIN_BUDGET`` polls), a wait that times out records the peer in
the error record (host memory) and sets ``ll_state[8]`` (device memory), and from then on the
kernels write and publish nothing: a send does not overwrite a parity a peer may still read, a
receive neither copies nor acknowledges. The kernels check the device flag, read by one lane,
before they wait; the error record is read once per launch, by the program that publishes.
Bad rows of ``topk_idx`` (an id outside ``[-1, E)``, an expert twice) are sent nowhere and
recorded (``layout.checked_ids``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bound import BoundLaunches, call_bound, launch
from .comm import (
    CPU_RANKS,
    EPOCH_SHIFT,
    REFUSED_BIT,
    SLOT_BITS,
    Flavour,
    acquire_word,
    aligned_ptr,
    by_stores,
    check_descriptors,
    check_signal_words,
    draw_last_of,
    local_ptr,
    one_thread,
    peer_ptr,
    publish_to_all,
    signal_word,
    slots_in,
    timed_out,
    uniform_load,
    uniform_now_ns,
    wait_all_at_least,
    wait_all_or_exclude,
)
from .layout import check_ids, checked_ids, load_ids, record_first_bad
from .microscale import e4m3_value
from .numerics import cast_rne, channel_tile, column
from .nvshmem import int_p, put_bytes, quiet, signal_set
from .proxy import post_signal, post_signal_to_remote, post_transfer
from .quant import NVFP4, scale_group
from .rows import (
    NVFP4_GS,
    quantize_row_tile,
    row_payload,
    store_fp8_partials,
    store_rows,
)
from .tiles import even, ll_tiles

META_K_BITS = 32  # meta word = token * 32 + choice
TIMED_OUT = 8  # ll_state[8]: 1 once a low-latency wait of this rank timed out (device memory)
TIMED_OUT_WORD = tl.constexpr(TIMED_OUT)
_GPU_PER_RANK = ["local_base", "errors_addr", "timeout_ns", "me", "ring_addr"]


@triton.jit
def _pairs_before(before, tp, ids, t, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    """[BLOCK_T, BLOCK_K] int32: for each pair (``t``, k) of ``ids``, the pairs of the tokens
    ``tp`` before the tile's first token (checked ids ``before`` [BLOCK_P, BLOCK_K]) that chose
    the same expert: their counts per expert (one histogram), picked by each pair's expert."""
    flat = tl.reshape(before, [BLOCK_P * BLOCK_K])
    flat_t = tl.reshape(tl.broadcast_to(tp[:, None], [BLOCK_P, BLOCK_K]), [BLOCK_P * BLOCK_K])
    counts = tl.histogram(flat, BLOCK_E, mask=(flat >= 0) & (flat_t < tl.min(t, axis=0)))
    lane = tl.arange(0, BLOCK_E)
    return tl.sum(tl.where(lane[None, None, :] == ids[:, :, None], counts[None, None, :], 0),
                  axis=2)


@triton.jit
def _pairs_in_tile(ids, t, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_T, BLOCK_K] int32: for each pair of ``ids``, the tile's earlier tokens that chose
    the same expert (a token chooses an expert once)."""
    mine = tl.reshape(ids, [BLOCK_T * BLOCK_K])
    mine_t = tl.reshape(tl.broadcast_to(t[:, None], [BLOCK_T, BLOCK_K]), [BLOCK_T * BLOCK_K])
    in_tile = (mine[None, None, :] == ids[:, :, None]) & (mine_t[None, None, :] < t[:, None, None])
    return tl.sum(in_tile.to(tl.int32), axis=2)


@triton.jit
def _pass_counts(topk_idx, s0, T, K, E, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_E: tl.constexpr):
    """[BLOCK_E] int32: the pairs of tokens ``s0 .. s0 + BLOCK_P - 1`` per expert."""
    tp = s0 + tl.arange(0, BLOCK_P)
    flat = tl.reshape(checked_ids(topk_idx, tp, tp < T, K, E, BLOCK_K)[0], [BLOCK_P * BLOCK_K])
    return tl.histogram(flat, BLOCK_E, mask=flat >= 0)


@triton.jit
def _timed_out(state, NUM_THREADS: tl.constexpr):
    """Whether a low-latency wait of this rank has timed out: the device flag ``state[8]``,
    read by one lane (device memory: never the host's error record)."""
    return uniform_load(state + TIMED_OUT_WORD, NUM_THREADS) != 0


@triton.jit
def _wait_all(words, stride, expected, SHIFT: tl.constexpr, R, errors_addr, timeout_ns, state,
              peer_ptrs, mask_off, local_base, me, BLOCK_R: tl.constexpr,
              NUM_THREADS: tl.constexpr, TRANSPORT: tl.constexpr, FT: tl.constexpr):
    """Waits until ``words[i * stride] >> SHIFT >= expected`` for every i < R, all at once
    (``comm.wait_all_at_least``); True (uniformly) if the call may go on. Does not wait at all
    once a wait of this rank has timed out (the device flag: the call is lost anyway); a
    timeout sets it. ``FT`` (fault tolerance): excluded ranks are not waited for, those that
    stay silent are excluded (``comm.wait_all_or_exclude``) and the call goes on; only a rank
    that finds itself excluded stops."""
    errors = errors_addr.to(tl.pointer_type(tl.int64))
    ok = not _timed_out(state, NUM_THREADS)
    if ok:
        deadline = uniform_now_ns(NUM_THREADS) + timeout_ns
        if FT:
            mask = local_ptr(local_base, mask_off, tl.int64, 8)
            arrived, ok = wait_all_or_exclude(words, stride, R, expected, SHIFT, deadline,
                                              errors, state + TIMED_OUT_WORD, mask, me,
                                              peer_ptrs, mask_off, R, local_base, BLOCK_R,
                                              NUM_THREADS, TRANSPORT, True)
        else:
            ok = wait_all_at_least(words, stride, R, expected, SHIFT, deadline, errors,
                                   state + TIMED_OUT_WORD, BLOCK_R, NUM_THREADS, True)
    return ok


@triton.jit
def _wait_parity(words, parity_stride, parity, stride, expected, SHIFT: tl.constexpr, R,
                 errors_addr, timeout_ns, state, peer_ptrs, mask_off, local_base, me,
                 BLOCK_R: tl.constexpr, NUM_THREADS: tl.constexpr, TRANSPORT: tl.constexpr,
                 FT: tl.constexpr):
    """:func:`_wait_all` of the words of parity ``parity`` (``words + parity *
    parity_stride``) in one round trip where they are all there: the words of both parities are
    read at once, with acquire ordering, beside the device flag (and, FT, this rank's own mask
    word), so the read does not wait for the epoch that picks the parity; every thread takes
    part in the decision (one reduction across the warps: uniform, and a barrier after the
    acquires). Only where a word is missing, the flag is set or this rank is excluded does
    :func:`_wait_all` run (it spins, bounded)."""
    lanes = tl.arange(0, 2 * NUM_THREADS)
    i = lanes % BLOCK_R
    p = (lanes // BLOCK_R) % 2
    im = i < R
    code = 2 * (tl.load(state + TIMED_OUT_WORD + lanes * 0, mask=lanes == 0, other=0,
                        volatile=True) != 0).to(tl.int32)
    if FT:
        mask = local_ptr(local_base, mask_off, tl.int64, 8)
        code |= 4 * (tl.load(mask + me + lanes * 0, mask=lanes == 0, other=0,
                             volatile=True) != 0).to(tl.int32)
    seen = acquire_word(words + p * parity_stride + i * stride, im) >> SHIFT
    code |= (im & (p == parity) & (seen < expected)).to(tl.int32)
    ok = tl.max(code, axis=0) == 0
    if not ok:  # gate: cold
        ok = _wait_all(words + parity * parity_stride, stride, expected, SHIFT, R, errors_addr,
                       timeout_ns, state, peer_ptrs, mask_off, local_base, me, BLOCK_R,
                       NUM_THREADS, TRANSPORT, FT)
    return ok


@triton.jit
def _excluded(peer, valid, mask_off, local_base, FT: tl.constexpr):
    """Where ``valid``, whether rank ``peer`` is excluded (FT; always False otherwise)."""
    if FT:
        mask = local_ptr(local_base, mask_off, tl.int64, 8)
        out = tl.load(mask + peer, mask=valid, other=0) != 0
    else:
        out = peer < 0
    return out


@triton.jit
def _store_row_tile(row8, h, g, H, codes, scales, exps, rows, hm, FP8: tl.constexpr,
                    UE8M0: tl.constexpr, GS: tl.constexpr, EVEN_H: tl.constexpr,
                    H32: tl.constexpr):
    """Whole rows (channels ``h``, groups ``g``) at uint8 row pointers ``row8`` [BLOCK_T]
    where ``rows``: quantized (``kernels.rows.store_rows``) or, without FP8, ``codes`` as
    they are."""
    if FP8:  # (channel 0 as a tensor: NVFP4's packed tile takes an alignment fact of it)
        store_rows(row8, tl.zeros([1], tl.int32), h, g, H, codes, scales, exps, rows, hm, UE8M0,
                   GS, EVEN_H, H32)
    else:
        rowx = row8.to(tl.pointer_type(codes.dtype), bitcast=True)
        tl.store(rowx[:, None] + h[None, :], codes, mask=rows[:, None] & hm[None, :])  # gate: row


@triton.jit(do_not_specialize=_GPU_PER_RANK + ["descriptor", "T"])
def ll_dispatch_send_kernel(
    x,  # [T, H] bf16/fp16/fp32
    global_scale,  # [1] float32: NVFP4's global scale (GS == 16)
    topk_idx,  # [T, K] int64
    peer_ptrs,  # [R] int64
    state,  # [8] int64 local: epochs and tickets
    stats,  # [4] int64 local: bytes stored (to peers, to itself) at [0], [1]
    rows_off: tl.int64, rows_parity_stride: tl.int64,  # ll_dispatch_rows[0], bytes per parity
    meta_off: tl.int64, meta_parity_stride: tl.int64,  # the same for ll_dispatch_meta
    signals_off: tl.int64, signals_parity_stride: tl.int64,  # ll_dispatch_signals
    acks_off: tl.int64, acks_parity_stride: tl.int64,  # ll_acks[DISPATCH] (local)
    outbox_off: tl.int64, outbox_parity_stride: tl.int64,  # ll_outbox (TRANSPORT 1, 2)
    meta_table_off: tl.int64,  # ll_meta_table [TMAX, KMAX] int32 (TRANSPORT 2)
    ring_addr: tl.int64, RING_SLOTS: tl.int64,  # the proxy's ring (TRANSPORT 2)
    mask_off: tl.int64,  # the mask words (FT)
    local_base: tl.int64, errors_addr: tl.int64, timeout_ns: tl.int64,
    descriptor: tl.int32,  # the call's (moe_comm.call_descriptor), above each count's slots
    T: tl.int32, H: tl.int32, K: tl.int32, R: tl.int32, L: tl.int32, E: tl.int32,
    me: tl.int32, TMAX: tl.int32, KMAX: tl.int32, SLOT_BYTES: tl.int64,
    FP8: tl.constexpr, UE8M0: tl.constexpr,
    GS: tl.constexpr,  # channels per scale: 128, 32 (MXFP8, with UE8M0) or 16 (NVFP4)
    FT: tl.constexpr,  # fault tolerance: no pair goes to an excluded rank
    TRANSPORT: tl.constexpr,  # 0: stores through peer pointers; where a pointer is 0:
    # 1 NVSHMEM puts, 2 the proxy (one descriptor per pair, then one fenced signal per expert)
    DEVICE_WAIT: tl.constexpr,  # wait for the acknowledgements here (else the host waited)
    EVEN_H: tl.constexpr,  # BLOCK_H == H
    H32: tl.constexpr,  # H % 32 == 0 (NVFP4's packed codes end on a 16-byte boundary)
    BLOCK_T: tl.constexpr,  # tokens of a program (the grid covers TMAX)
    BLOCK_H: tl.constexpr,  # channels: the whole row (a power of two >= H)
    BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr,
    NUM_THREADS: tl.constexpr,
    BLOCK_P: tl.constexpr,  # tokens of a pass of the pair positions (the batch at decode sizes)
):
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    t64 = t.to(tl.int64)
    # What depends on no epoch is read first, in the round trip of the epoch and of the
    # acknowledgements: this tile's rows, the ids of the pass of BLOCK_P tokens that holds its
    # tokens (the whole batch at decode sizes), and the peers of its pairs
    h, hm = channel_tile(0, H, BLOCK_H, EVEN_H)
    v = tl.load(x + t64[:, None] * H + h[None, :], mask=tm[:, None] & hm[None, :], other=0.0)
    c0 = (pid * BLOCK_T) // BLOCK_P * BLOCK_P
    tp = c0 + tl.arange(0, BLOCK_P)
    raw = load_ids(topk_idx, tp, tp < T, K, BLOCK_K)
    gs = 0.0
    if GS == NVFP4_GS:
        gs = tl.load(global_scale)
    raw_mine = load_ids(topk_idx, t, tm, K, BLOCK_K)
    base = tl.load(peer_ptrs + tl.minimum(tl.maximum(raw_mine, 0), E - 1) // L)  # (0: none)
    epoch = tl.load(state) + 1
    parity = epoch % 2
    errors = errors_addr.to(tl.pointer_type(tl.int64))
    ok = True
    if DEVICE_WAIT:  # parity p is free once every destination acknowledged call epoch - 2
        acks = local_ptr(local_base, acks_off, tl.int64, 8)
        ok = _wait_parity(acks, acks_parity_stride // 8, parity, 1, epoch - 2, 0, R,
                          errors_addr, timeout_ns, state, peer_ptrs, mask_off, local_base, me,
                          BLOCK_R, NUM_THREADS, TRANSPORT, FT)
    rows_base = rows_off + parity * rows_parity_stride
    meta_base = meta_off + parity * meta_parity_stride
    payload = row_payload(x, H, FP8, UE8M0, GS)
    # every pair's destination, once: its expert's rank, its position among the expert's pairs
    # (those of earlier tokens: no program waits for another), its slot's address there
    pass_ids, pass_bad, pass_code, pass_value = check_ids(raw, E, BLOCK_K)
    ids = tl.sum(tl.where(tp[None, :, None] == t[:, None, None], pass_ids[None, :, :], 0),
                 axis=1)  # this tile's rows of the pass, checked there (bad rows -1)
    j = _pairs_before(pass_ids, tp, ids, t, BLOCK_P, BLOCK_K, BLOCK_E) \
        + _pairs_in_tile(ids, t, BLOCK_T, BLOCK_K)
    for s0 in range(0, c0, BLOCK_P):  # earlier passes (none at decode sizes)
        before = s0 + tl.arange(0, BLOCK_P)
        j += _pairs_before(checked_ids(topk_idx, before, before < T, K, E, BLOCK_K)[0],
                           before, ids, t, BLOCK_P, BLOCK_K, BLOCK_E)
    valid = tm[:, None] & (ids >= 0)
    d = tl.where(valid, ids // L, 0)
    valid = valid & ~_excluded(d, valid, mask_off, local_base, FT)
    block = (((ids - d * L) * R + me) * TMAX + j).to(tl.int64)
    stored = valid & (base != 0)  # the pairs this program stores itself
    row_at = base + rows_base + block * SLOT_BYTES
    meta_at = base + meta_base + block * 4
    nbytes = tl.where(valid, payload + 4, 0).to(tl.int64)
    to_peers = tl.sum(tl.sum(tl.where(d != me, nbytes, 0), axis=1), axis=0)
    to_self = tl.sum(tl.sum(tl.where(d == me, nbytes, 0), axis=1), axis=0)
    if FP8:  # quantized once per token (groups past H // GS are not stored)
        codes, scales, exps = quantize_row_tile(v.to(tl.float32), gs, BLOCK_T, BLOCK_H, UE8M0,
                                                GS)
        g = tl.arange(0, BLOCK_H // GS)
    else:
        codes, scales, exps = v, v, v
        g = h
    kk = tl.arange(0, BLOCK_K)
    to_peers = tl.where(ok, to_peers, 0)
    to_self = tl.where(ok, to_self, 0)
    if ok:  # after a failed wait nothing is written: a peer may still read this parity
        if TRANSPORT != 0:  # each token's row once into the outbox, for the puts
            box = local_ptr(local_base, outbox_off + parity * outbox_parity_stride,
                            tl.uint8, 16) + t64 * SLOT_BYTES
            _store_row_tile(box, h, g, H, codes, scales, exps, tm, hm, FP8, UE8M0, GS, EVEN_H,
                            H32)
        for k in tl.static_range(BLOCK_K):  # every choice's row and meta word
            mk = column(stored.to(tl.int32), k) != 0
            _store_row_tile(aligned_ptr(column(row_at, k), tl.uint8, 16), h, g, H, codes,
                            scales, exps, mk, hm, FP8, UE8M0, GS, EVEN_H, H32)
            tl.store(aligned_ptr(column(meta_at, k), tl.int32, 4), t * 32 + k, mask=mk)
        if TRANSPORT != 0:  # pairs whose expert's rank has no pointer
            tl.debug_barrier()
            remote = valid & (base == 0)
            rows_in_tile = tl.arange(0, BLOCK_T)
            for i in range(BLOCK_T):
                ti = pid * BLOCK_T + i
                row_remote = tl.sum(tl.where(rows_in_tile[:, None] == i, remote.to(tl.int32), 0),
                                    axis=0)
                row_ids = tl.sum(tl.where(rows_in_tile[:, None] == i, ids, 0), axis=0)
                row_block = tl.sum(tl.where(rows_in_tile[:, None] == i, block, 0), axis=0)
                for kq in range(K):
                    at_k = kk == kq
                    if tl.sum(tl.where(at_k, row_remote, 0)) != 0:
                        e = tl.sum(tl.where(at_k, row_ids, 0))
                        dk = e // L
                        bk = tl.sum(tl.where(at_k, row_block, 0))
                        box_row = (outbox_off + parity * outbox_parity_stride
                                   + ti.to(tl.int64) * SLOT_BYTES)
                        if TRANSPORT == 1:
                            put_bytes(local_base, rows_base + bk * SLOT_BYTES, box_row,
                                      payload, dk)
                            if one_thread():
                                int_p(local_base + meta_base + bk * 4, ti * 32 + kq,
                                      dk.to(tl.int32))
                        elif one_thread():  # the row and its meta word; a no-op signal
                            post_transfer(ring_addr, RING_SLOTS, dk, signals_off + parity
                                          * signals_parity_stride
                                          + ((e - dk * L) * R + me) * 8, 0, 2,
                                          box_row, rows_base + bk * SLOT_BYTES, payload,
                                          payload, 1,
                                          meta_table_off + (ti * KMAX + kq).to(tl.int64) * 4,
                                          meta_base + bk * 4, 4, 4, 1,
                                          0, 0, 0, 0, 0, errors, timeout_ns)
        if TRANSPORT == 1:  # this program's puts complete before its ticket
            tl.debug_barrier()
            if one_thread():
                quiet()
        record_first_bad(errors, tp, pass_bad, pass_code, pass_value, T)  # (its pass's first)
    tl.atomic_add(stats + tl.arange(0, 1), to_peers + tl.zeros([1], tl.int64), sem="relaxed")
    tl.atomic_add(stats + 1 + tl.arange(0, 1), to_self + tl.zeros([1], tl.int64), sem="relaxed")
    if draw_last_of(state + 4, tl.num_programs(0)):  # the last program publishes
        # (every program's wait is over: the device flag holds still, a plain load agrees)
        if tl.load(state + TIMED_OUT_WORD) == 0:
            lane = tl.arange(0, BLOCK_E)
            total = tl.zeros([BLOCK_E], tl.int32)
            for s0 in range(0, T, BLOCK_P):  # every pass (one at decode sizes)
                total += _pass_counts(topk_idx, s0, T, K, E, BLOCK_P, BLOCK_K, BLOCK_E)
            em = lane < E
            de = tl.where(em, lane // L, 0)
            word = peer_ptr(peer_ptrs, de, signals_off + parity * signals_parity_stride,
                            tl.int64, 8) + (lane - de * L) * R + me
            described = descriptor.to(tl.int64) << SLOT_BITS
            tl.atomic_xchg(word, (epoch << 32) | described | total.to(tl.int64),  # gate: publish
                           mask=by_stores(peer_ptrs, de, em, TRANSPORT), sem="release",
                           scope="sys")
            if TRANSPORT != 0:
                for ge in range(E):
                    dg = ge // L
                    if (tl.load(peer_ptrs + dg) == 0) \
                            & ~_excluded(dg, True, mask_off, local_base, FT):
                        # a reduction: every thread of the program takes part
                        n = tl.sum(tl.where(lane == ge, total, 0)).to(tl.int64)
                        signal_off = (signals_off + parity * signals_parity_stride
                                      + ((ge - dg * L) * R + me) * 8)
                        if one_thread():
                            if TRANSPORT == 1:
                                signal_set(local_base, signal_off,
                                           (epoch << 32) | described | n, dg)
                            else:  # after this rank's pair transfers to dg (a fence)
                                post_signal(ring_addr, RING_SLOTS, dg, signal_off,
                                            (epoch << 32) | described | n, errors, timeout_ns)
            remote = tl.sum(tl.where(em & (de != me), 8, 0).to(tl.int64), axis=0)
            tl.atomic_add(stats + tl.arange(0, 1), remote + tl.zeros([1], tl.int64),
                          sem="relaxed")
            tl.atomic_add(stats + 1 + tl.arange(0, 1), 8 * L + tl.zeros([1], tl.int64),
                          sem="relaxed")
        tl.store(state + tl.arange(0, 1), epoch + tl.zeros([1], tl.int64))


@triton.jit(do_not_specialize=_GPU_PER_RANK)
def ll_dispatch_recv_kernel(
    staging,  # [P, L, R, TMAX, SLOT_BYTES] uint8 local ll_dispatch_rows (FP8) or typed rows
    staging_f32,  # the same memory as float32 (FP8 scales)
    meta,  # [P, L, R, TMAX] int32 local ll_dispatch_meta
    signals,  # [P, L, R] int64 local ll_dispatch_signals
    peer_ptrs,  # [R] int64
    state,  # [8] int64 local
    out,  # [L, R * TMAX, H] (FP8: uint8 view; NVFP4: H is half the channels)
    out_scales,  # FP8: float32 memory, or uint8 view of packed int32 words (UE8M0)
    out_global,  # NVFP4 (GLOBAL): [L, R * TMAX] float32, each row's global scale
    count,  # [L] int32 out
    src_info,  # [L, R * TMAX] int32 out: source rank * TMAX + source token
    src_k,  # [L, R * TMAX] int32 out: top-k choice of the pair at its home
    layout,  # [L, R, 2] int32 out: (first row, rows) of each source's block
    recv_stats,  # [L] int32/int64, added to (HAS_STATS)
    acks_off: tl.int64, acks_parity_stride: tl.int64,  # ll_acks[DISPATCH, 0], one parity
    ring_addr: tl.int64, RING_SLOTS: tl.int64,  # the proxy's ring (TRANSPORT 2)
    mask_off: tl.int64,  # the mask words (FT)
    local_base: tl.int64, errors_addr: tl.int64, timeout_ns: tl.int64,
    H: tl.int32, R: tl.int32, L: tl.int32, me: tl.int32, TMAX: tl.int32,
    G: tl.int32,  # FP8: scales per row
    SLOT_ELEMS: tl.int64,  # staging slot stride in elements of `staging`
    SCALE_ROW_STRIDE: tl.int64,
    SCALE_GROUP_STRIDE: tl.constexpr,  # 1 (row-major scales: stored as wide as loaded) or rows
    SCALE_EXPERT_STRIDE: tl.int64,
    FP8: tl.constexpr,
    UE8M0: tl.constexpr,  # byte scales: exponents, MXFP8's E8M0 or NVFP4's e4m3
    GLOBAL: tl.constexpr,  # NVFP4: a float32 global scale between the codes and the scales
    HAS_STATS: tl.constexpr,
    TRANSPORT: tl.constexpr, DEVICE_WAIT: tl.constexpr, FT: tl.constexpr, EVEN_H: tl.constexpr,
    BLOCK_T: tl.constexpr,  # rows of a pass over the block (its rows at uniform routing)
    BLOCK_H: tl.constexpr,  # channels: the whole row (a power of two >= H)
    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, NUM_THREADS: tl.constexpr,
):
    """One program per (expert ``e``, source ``s``) block: after the wait for every source of
    ``e`` (the block's first output row needs their counts), its rows go whole to the compact,
    expert-major output, ``BLOCK_T`` at a time."""
    pid = tl.program_id(0)
    e = pid // R
    s = pid % R
    epoch = tl.load(state + 1) + 1
    parity = epoch % 2
    errors = errors_addr.to(tl.pointer_type(tl.int64))
    ok = True
    if DEVICE_WAIT:  # the block's offset needs the counts of every source of expert e
        ok = _wait_parity(signals + e * R, L * R, parity, 1, epoch, 32, R, errors_addr,
                          timeout_ns, state, peer_ptrs, mask_off, local_base, me, BLOCK_R,
                          NUM_THREADS, TRANSPORT, FT)
    if ok:  # after a failed wait nothing is copied and nothing acknowledged
        sources = tl.arange(0, BLOCK_R)
        words = tl.load(signals + (parity * L + e) * R + sources, mask=sources < R, other=0)
        # a source counts only with this call's epoch (one excluded, or late, counts 0)
        current = (sources < R) & ((words >> 32) >= epoch)
        counts = tl.where(current, slots_in(words & 0xFFFFFFFF), 0).to(tl.int32)
        if s == 0:  # a source with another call descriptor is recorded (once per expert)
            check_descriptors(words & 0xFFFFFFFF, current, sources, me, epoch, errors_addr)
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
        h, hm = channel_tile(0, H, BLOCK_H, EVEN_H)
        g = tl.arange(0, BLOCK_G)
        for j0 in range(0, n, BLOCK_T):  # one pass at uniform routing
            j = j0 + tl.arange(0, BLOCK_T)
            jm = j < n
            slot = block0 + j
            dst = (e * R * TMAX + first + j).to(tl.int64)
            out_row = (first + j).to(tl.int64)
            codes_end = slot * SLOT_ELEMS + H
            # the pass's rows, meta words and scales, loaded before any is stored
            word = tl.load(meta + slot, mask=jm, other=0)
            m = jm[:, None] & hm[None, :]
            tile = tl.load(staging + slot[:, None] * SLOT_ELEMS + h[None, :], mask=m)
            gm = jm[:, None] & (g < G)[None, :]
            if FP8:
                if GLOBAL:
                    glob = tl.load(staging_f32 + codes_end // 4, mask=jm)
                if UE8M0:
                    sc = tl.load(staging + codes_end[:, None] + 4 * GLOBAL + g[None, :],
                                 mask=gm)
                else:
                    sc = tl.load(staging_f32 + codes_end[:, None] // 4 + g[None, :], mask=gm)
            tl.store(src_info + dst, s * TMAX + word // 32, mask=jm)
            tl.store(src_k + dst, word % 32, mask=jm)
            tl.store(out + dst[:, None] * H + h[None, :], tile, mask=m)  # gate: row
            if FP8:
                if GLOBAL:
                    tl.store(out_global + e * R * TMAX + out_row, glob, mask=jm)
                if UE8M0:
                    word4 = e * SCALE_EXPERT_STRIDE \
                        + (g // 4)[None, :] * SCALE_GROUP_STRIDE \
                        + out_row[:, None] * SCALE_ROW_STRIDE
                    tl.store(out_scales + word4 * 4 + (g % 4)[None, :], sc, mask=gm)
                else:
                    tl.store(out_scales + e * SCALE_EXPERT_STRIDE
                             + g[None, :] * SCALE_GROUP_STRIDE
                             + out_row[:, None] * SCALE_ROW_STRIDE, sc, mask=gm)
    if draw_last_of(state + 5, tl.num_programs(0)):  # every block is out: acknowledge
        if not timed_out(errors, NUM_THREADS):
            publish_to_all(peer_ptrs, acks_off + parity * acks_parity_stride, me, epoch, R,
                           local_base, BLOCK_R, TRANSPORT)
            if TRANSPORT == 2:
                if one_thread():
                    post_signal_to_remote(peer_ptrs, acks_off + parity * acks_parity_stride,
                                          me, epoch, R, ring_addr, RING_SLOTS, errors,
                                          timeout_ns)
        tl.store(state + 1 + tl.arange(0, 1), epoch + tl.zeros([1], tl.int64))


@triton.jit(do_not_specialize=_GPU_PER_RANK + ["y_box_off", "descriptor"])
def ll_combine_send_kernel(
    y,  # [L, R * TMAX, H] expert outputs, rows as in the dispatch's output
    layout,  # [L, R, 2] int32: (first row, rows) of each source's block
    src_info,  # [L, R * TMAX] int32: source rank * TMAX + source token
    src_k,  # [L, R * TMAX] int32: top-k choice at the home rank
    peer_ptrs,  # [R] int64
    state,  # [8] int64 local
    stats,  # [4] int64 local: bytes stored (to peers, to itself) at [2], [3]
    rows_off: tl.int64, rows_parity_stride: tl.int64,  # ll_combine_rows[0], one parity
    signals_off: tl.int64, signals_parity_stride: tl.int64,  # ll_combine_signals
    acks_off: tl.int64, acks_parity_stride: tl.int64,  # ll_acks[COMBINE] (local)
    outbox_off: tl.int64, outbox_parity_stride: tl.int64,  # ll_combine_outbox (TRANSPORT 1, 2)
    y_box_off: tl.int64,  # ZERO_COPY: byte offset of y itself in this segment (puts read it)
    ring_addr: tl.int64, RING_SLOTS: tl.int64,  # the proxy's ring (TRANSPORT 2)
    mask_off: tl.int64,  # the mask words (FT)
    local_base: tl.int64, errors_addr: tl.int64, timeout_ns: tl.int64,
    H: tl.int32, R: tl.int32, L: tl.int32, me: tl.int32, TMAX: tl.int32, KMAX: tl.int32,
    descriptor: tl.int32,  # the call's (moe_comm.call_descriptor), published above the epoch's
    TRANSPORT: tl.constexpr, DEVICE_WAIT: tl.constexpr,
    FT: tl.constexpr,  # fault tolerance: no row goes to an excluded home rank
    ZERO_COPY: tl.constexpr,  # y lies in symmetric memory already: put from there, no copy
    FP8: tl.constexpr,  # rows travel as FP8 per 128 channels (kernels.rows; not ZERO_COPY)
    ALIGN: tl.constexpr, EVEN_H: tl.constexpr,
    BLOCK_T: tl.constexpr,  # rows of a pass over the block (its rows at uniform routing)
    BLOCK_H: tl.constexpr,  # channels: the whole row (a power of two >= H)
    BLOCK_R: tl.constexpr, NUM_THREADS: tl.constexpr,
):
    """One program per (expert ``e``, source ``s``) block of the dispatch's output: its rows
    go whole, ``BLOCK_T`` at a time, to their slots ``[token, choice]`` on their home rank
    ``s``."""
    pid = tl.program_id(0)
    e = pid // R
    s = pid % R
    # what depends on no epoch is read in the round trip of the epoch and acknowledgements
    first_n = tl.load(layout + (e * R + s) * 2 + tl.arange(0, 2))
    first = tl.sum(tl.where(tl.arange(0, 2) == 0, first_n, 0), axis=0)
    n = tl.sum(tl.where(tl.arange(0, 2) == 1, first_n, 0), axis=0)
    if _excluded(s, True, mask_off, local_base, FT):
        n = 0
    if (descriptor >> REFUSED_BIT) & 1:  # a refused call sends no rows
        n = 0
    epoch = tl.load(state + 2) + 1
    parity = epoch % 2
    errors = errors_addr.to(tl.pointer_type(tl.int64))
    ok = True
    if DEVICE_WAIT:  # parity p is free once every home rank acknowledged call epoch - 2
        acks = local_ptr(local_base, acks_off, tl.int64, 8)
        ok = _wait_parity(acks, acks_parity_stride // 8, parity, 1, epoch - 2, 0, R,
                          errors_addr, timeout_ns, state, peer_ptrs, mask_off, local_base, me,
                          BLOCK_R, NUM_THREADS, TRANSPORT, FT)
    stride = H * y.dtype.element_ty.primitive_bitwidth // 8  # bytes between staging rows
    row_bytes = stride
    if FP8:
        row_bytes = H + 4 * (H // 128)
    to_peers = tl.zeros([1], tl.int64)
    to_self = tl.zeros([1], tl.int64)
    if ok:  # after a failed wait nothing is written: the home rank may still read it
        dst_base = peer_ptr(peer_ptrs, s, rows_off + parity * rows_parity_stride,
                            y.dtype.element_ty, ALIGN)
        via = tl.load(peer_ptrs + s + tl.zeros([BLOCK_T], tl.int32)) != 0
        if ZERO_COPY:  # the puts read y where it lies (its offset does not follow the parity)
            src_off = y_box_off
        else:
            src_off = outbox_off + parity * outbox_parity_stride
        box = local_ptr(local_base, src_off, y.dtype.element_ty, ALIGN)
        h, hm = channel_tile(0, H, BLOCK_H, EVEN_H)
        for j0 in range(0, n, BLOCK_T):  # one pass at uniform routing
            j = j0 + tl.arange(0, BLOCK_T)
            jm = j < n
            row = (e * R * TMAX + first + j).to(tl.int64)
            m = jm[:, None] & hm[None, :]
            # the pass's rows and where they go, loaded before any is stored
            token = tl.load(src_info + row, mask=jm, other=0) - s * TMAX
            k = tl.load(src_k + row, mask=jm, other=0)
            tile = tl.load(y + row[:, None] * H + h[None, :], mask=m)
            slot = (token * KMAX + k).to(tl.int64)
            if FP8:
                store_fp8_partials(tile.to(tl.float32), dst_base.to(tl.pointer_type(
                                       tl.uint8), bitcast=True) + slot * stride, jm & via,
                                   box.to(tl.pointer_type(tl.uint8), bitcast=True)
                                   + row * stride, jm & ~via, 0, h, hm, H, TRANSPORT != 0,
                                   EVEN_H, BLOCK_T, BLOCK_H)
            else:
                tl.store(dst_base + slot[:, None] * H + h[None, :], tile,  # gate: row
                         mask=m & via[:, None])
                if TRANSPORT != 0:
                    if not ZERO_COPY:
                        tl.store(box + row[:, None] * H + h[None, :], tile,  # gate: row
                                 mask=m & ~via[:, None])
            if TRANSPORT != 0:
                if tl.load(peer_ptrs + s) == 0:  # one put (or descriptor) per row
                    tl.debug_barrier()
                    for i in range(BLOCK_T):
                        if j0 + i < n:
                            r = (e * R * TMAX + first + j0 + i).to(tl.int64)
                            tok = tl.load(src_info + r) - s * TMAX
                            dst = (rows_off + parity * rows_parity_stride
                                   + (tok * KMAX + tl.load(src_k + r)).to(tl.int64) * stride)
                            if TRANSPORT == 1:
                                put_bytes(local_base, dst, src_off + r * stride, row_bytes, s)
                            elif one_thread():  # a no-op signal: the epoch follows, fenced
                                post_transfer(ring_addr, RING_SLOTS, s, signals_off + parity
                                              * signals_parity_stride + me * 8, 0, 1,
                                              src_off + r * stride, dst, row_bytes,
                                              row_bytes, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                              errors, timeout_ns)
        nbytes = n.to(tl.int64) * row_bytes + tl.zeros([1], tl.int64)
        to_peers += tl.where(s != me, nbytes, 0)
        to_self += tl.where(s == me, nbytes, 0)
        if TRANSPORT == 1:  # this program's puts complete before its ticket
            tl.debug_barrier()
            if one_thread():
                quiet()
    tl.atomic_add(stats + 2 + tl.arange(0, 1), to_peers, sem="relaxed")
    tl.atomic_add(stats + 3 + tl.arange(0, 1), to_self, sem="relaxed")
    if draw_last_of(state + 6, tl.num_programs(0)):  # every row is out: tell every rank
        if not timed_out(errors, NUM_THREADS):
            word = signal_word(epoch, descriptor)
            publish_to_all(peer_ptrs, signals_off + parity * signals_parity_stride, me, word, R,
                           local_base, BLOCK_R, TRANSPORT)
            if TRANSPORT == 2:  # after this rank's row transfers to each (fenced)
                if one_thread():
                    post_signal_to_remote(peer_ptrs, signals_off + parity
                                          * signals_parity_stride, me, word, R, ring_addr,
                                          RING_SLOTS, errors, timeout_ns)
            signal_bytes = 8 + tl.zeros([1], tl.int64)
            tl.atomic_add(stats + 2 + tl.arange(0, 1), (R - 1) * signal_bytes, sem="relaxed")
            tl.atomic_add(stats + 3 + tl.arange(0, 1), signal_bytes, sem="relaxed")
        tl.store(state + 2 + tl.arange(0, 1), epoch + tl.zeros([1], tl.int64))


@triton.jit(do_not_specialize=_GPU_PER_RANK + ["T"])
def ll_combine_recv_kernel(
    staging,  # [P, TMAX, KMAX, H] local ll_combine_rows
    topk_idx,  # [T, K] int64
    topk_weights,  # [T, K] float32 (HAS_WEIGHTS)
    out,  # [T, H]
    peer_ptrs,  # [R] int64
    state,  # [8] int64 local
    acks_off: tl.int64, acks_parity_stride: tl.int64,  # ll_acks[COMBINE, 0], one parity
    signals,  # [P, R] int64 local ll_combine_signals (DEVICE_WAIT)
    ring_addr: tl.int64, RING_SLOTS: tl.int64,  # the proxy's ring (TRANSPORT 2)
    mask_off: tl.int64,  # the mask words (FT)
    local_base: tl.int64, errors_addr: tl.int64, timeout_ns: tl.int64,
    T: tl.int32, H: tl.int32, K: tl.int32, R: tl.int32, E: tl.int32, me: tl.int32,
    TMAX: tl.int32, KMAX: tl.int32,
    HAS_WEIGHTS: tl.constexpr, TRANSPORT: tl.constexpr, DEVICE_WAIT: tl.constexpr,
    FT: tl.constexpr,
    FP8: tl.constexpr,  # staging (uint8) holds FP8 rows, ROW_BYTES apart: dequantized here
    ROW_BYTES: tl.int64,  # (a runtime value: no variant per Buffer size)
    EVEN_H: tl.constexpr,  # every channel tile is full
    BLOCK_T: tl.constexpr,  # tokens of a program
    BLOCK_H: tl.constexpr,  # channels of a program (grid axis 1 splits the row)
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, NUM_THREADS: tl.constexpr,
):
    """Program (i, c) sums channel tile c of token tile i: every choice's slot of the tile is
    loaded at once, then added in choice order."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    t64 = t.to(tl.int64)
    # what depends on no epoch is read in the round trip of the epoch and the signals
    raw = load_ids(topk_idx, t, tm, K, BLOCK_K)
    kk = tl.arange(0, BLOCK_K)
    w = tl.full([BLOCK_T, BLOCK_K], 1.0, tl.float32)
    if HAS_WEIGHTS:
        w = tl.load(topk_weights + t64[:, None] * K + kk[None, :],
                    mask=tm[:, None] & (kk < K)[None, :], other=0.0)
    epoch = tl.load(state + 3) + 1
    parity = epoch % 2
    errors = errors_addr.to(tl.pointer_type(tl.int64))
    ok = True
    if DEVICE_WAIT:  # every expert rank has put its rows
        ok = _wait_parity(signals, R, parity, 1, epoch, EPOCH_SHIFT, R, errors_addr, timeout_ns,
                          state, peer_ptrs, mask_off, local_base, me, BLOCK_R, NUM_THREADS,
                          TRANSPORT, FT)
    if ok:  # after a failed wait nothing is read and nothing acknowledged
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):  # gate: cold
            # an expert rank with another call descriptor (one that arrived) is recorded
            sources = tl.arange(0, BLOCK_R)
            check_signal_words(tl.load(signals + parity * R + sources, mask=sources < R,
                                       other=0), sources, sources < R, me, epoch, errors_addr)
        ids = check_ids(raw, E, BLOCK_K)[0]
        valid = tm[:, None] & (ids >= 0)
        if FT:  # a choice counts only if its expert rank's rows of this call arrived
            d = tl.where(valid, ids // (E // R), 0)
            valid = valid & ((tl.load(signals + parity * R + d, mask=valid, other=0)
                              >> EPOCH_SHIFT) >= epoch)
        h0 = tl.program_id(1) * BLOCK_H
        h, hm = channel_tile(h0, H, BLOCK_H, EVEN_H)
        acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
        for k in tl.static_range(BLOCK_K):  # unrolled: every choice's load issued at once
            vk = column(valid.to(tl.int32), k) != 0
            slot = (parity * TMAX + t64) * KMAX + k
            if FP8:  # codes times their row's scale of this group (kernels.rows layout): a
                # tile is one group of 128 channels, so no reshape spreads the scales
                tl.static_assert(BLOCK_H == 128)
                row8 = staging + slot * ROW_BYTES
                codes = tl.load(row8[:, None] + h[None, :], mask=vk[:, None] & hm[None, :],
                                other=0)
                sc = tl.load((row8 + H).to(tl.pointer_type(tl.float32), bitcast=True)
                             + h0 // 128, mask=vk, other=0.0)
                v = e4m3_value(codes) * sc[:, None]
            else:
                v = tl.load(staging + slot[:, None] * H + h[None, :],
                            mask=vk[:, None] & hm[None, :], other=0.0).to(tl.float32)
            # in choice order, each product and each sum rounded to fp32
            acc += v * tl.sum(tl.where(kk[None, :] == k, w, 0.0), axis=1)[:, None]
        result = cast_rne(acc, out.dtype.element_ty)
        tl.store(out + t64[:, None] * H + h[None, :], result,  # gate: row
                 mask=tm[:, None] & hm[None, :])
    if draw_last_of(state + 7, tl.num_programs(0) * tl.num_programs(1)):  # slots read
        if not timed_out(errors, NUM_THREADS):
            publish_to_all(peer_ptrs, acks_off + parity * acks_parity_stride, me, epoch, R,
                           local_base, BLOCK_R, TRANSPORT)
            if TRANSPORT == 2:
                if one_thread():
                    post_signal_to_remote(peer_ptrs, acks_off + parity * acks_parity_stride,
                                          me, epoch, R, ring_addr, RING_SLOTS, errors,
                                          timeout_ns)
        tl.store(state + 3 + tl.arange(0, 1), epoch + tl.zeros([1], tl.int64))


def ll_dispatch_send(x, topk_idx, peer_ptrs, state, stats, *, offsets: dict, rank: int,
                     num_local_experts: int, num_experts: int, max_tokens: int, max_topk: int,
                     slot_bytes: int, fp8: bool, ue8m0: int, num_sms: int | None = None,
                     flavour: Flavour = CPU_RANKS, global_scale=None,
                     bound: BoundLaunches | None = None, descriptor: int = 0) -> bool:
    """Launches one program per tile of ``max_tokens`` (``kernels.tiles.ll_tiles``: the grid
    depends on the Buffer alone and covers the GPU in one wave; ``num_sms`` is the normal
    mode's budget, not this mode's). ``offsets``: rows / meta / signals / acks / outbox ->
    (byte offset of parity 0, bytes per parity); ``meta_table`` -> byte offset (the proxy).
    NVFP4 (``ue8m0 == 3``): ``global_scale`` [1] float32. ``bound``: the owner's bound
    launches (``kernels.bound``; the caller's tensors and the token count vary).
    ``descriptor``: the call's, published above each expert's count (``signal = epoch << 32 |
    descriptor << SLOT_BITS | pairs``); fixed by the call's format, so a captured graph keeps
    it."""
    T, H = x.shape
    K = topk_idx.shape[1]
    scales = stats if global_scale is None else global_scale
    key = ("ll_dispatch_send", H, K, id(peer_ptrs), id(state), id(stats), id(offsets), rank,
           num_local_experts, num_experts, max_tokens, max_topk, slot_bytes, fp8, ue8m0,
           id(flavour), descriptor)
    if call_bound(bound, key, (x, scales, topk_idx, T)):
        return True
    R = peer_ptrs.numel()
    # NVFP4 quantizes a row in fp32 with its scales (more registers): a row a program
    tile = ll_tiles("ll_dispatch_send_nvfp4" if fp8 and ue8m0 == 3 else "ll_dispatch_send",
                    flavour.compiled, H, x.element_size(), max_tokens)
    args = (x, scales, topk_idx, peer_ptrs, state, stats,
            *offsets["rows"], *offsets["meta"],
            *offsets["signals"], *offsets["acks"], *offsets.get("outbox", (0, 0)),
            offsets.get("meta_table", 0), flavour.ring_addr, flavour.ring_slots,
            flavour.mask_off, *flavour.args(), descriptor,
            T, H, K, R, num_local_experts, num_experts, rank, max_tokens, max_topk, slot_bytes)
    kwargs = dict(
        FP8=fp8, UE8M0=bool(ue8m0), GS=scale_group(ue8m0), FT=flavour.fault_tolerant,
        TRANSPORT=flavour.transport,
        DEVICE_WAIT=flavour.device_wait,
        EVEN_H=tile.block_h == H, H32=H % 32 == 0, BLOCK_T=tile.block_t,
        BLOCK_H=tile.block_h, BLOCK_K=triton.next_power_of_2(max(K, 1)),
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_R=triton.next_power_of_2(R),
        NUM_THREADS=tile.num_threads, BLOCK_P=min(triton.next_power_of_2(max_tokens), 128),
        **flavour.launch_options(tile))
    launch(bound, key, ll_dispatch_send_kernel, (triton.cdiv(max_tokens, tile.block_t),), args,
           kwargs, ("x", "global_scale", "topk_idx", "T"))
    return True


_RECV_VARYING = ("staging", "staging_f32", "out", "out_scales", "out_global", "count", "src_info",
                 "src_k", "layout", "recv_stats")  # ll_dispatch_recv's tensors made per call


def ll_dispatch_recv(staging, meta, signals, peer_ptrs, state, out, out_scales, count,
                     src_info, src_k, layout, recv_stats, *, acks: tuple, rank: int,
                     scale_strides: tuple, ue8m0: int, flavour: Flavour = CPU_RANKS,
                     out_global=None, num_sms: int | None = None,
                     bound: BoundLaunches | None = None) -> bool:
    """Launches one receive program per (expert, source) block, ``L * R`` (the grid depends on
    the Buffer alone; ``num_sms`` is the normal mode's budget, not this mode's). ``staging``:
    the ll_dispatch_rows region viewed as uint8 (quantized) or as ``out``'s dtype, [P, L, R,
    TMAX, slot]; ``out_scales`` (given for quantized rows): contiguous scale memory with
    (expert, row, group) strides ``scale_strides``; NVFP4 (``ue8m0 == 3``): ``out`` [L, R *
    TMAX, H/2] uint8 and ``out_global`` [L, R * TMAX] float32; ``acks``: (offset, parity stride) of
    ll_acks[DISPATCH]; ``bound``: the owner's bound launches (the outputs vary)."""
    P, L, R, TMAX, slot = staging.shape
    H = out.shape[2]
    fp8 = out_scales is not None
    nvfp4 = fp8 and ue8m0 == NVFP4
    if fp8:
        out = out.view(torch.uint8)
        out_scales = out_scales.view(torch.uint8) if ue8m0 else out_scales
    dummy = count
    values = (staging, staging.view(torch.float32) if fp8 else dummy, out,
              out_scales if fp8 else dummy, out_global if nvfp4 else dummy, count, src_info,
              src_k, layout, recv_stats if recv_stats is not None else dummy)
    key = ("ll_dispatch_recv", staging.shape, out.shape, recv_stats is None, id(meta), id(signals),
           id(peer_ptrs), id(state), acks, rank, scale_strides, ue8m0, num_sms, id(flavour))
    if call_bound(bound, key, values):
        return True
    groups = (2 * H if nvfp4 else H) // scale_group(ue8m0) if fp8 else 0
    tile = ll_tiles("ll_dispatch_recv", flavour.compiled, H, out.element_size(), TMAX)
    args = (values[0], values[1], meta, signals, peer_ptrs, state, *values[2:], *acks,
            flavour.ring_addr, flavour.ring_slots, flavour.mask_off, *flavour.args(), H, R, L,
            rank, TMAX, groups, slot, scale_strides[1], scale_strides[2], scale_strides[0])
    kwargs = dict(
        FP8=fp8, UE8M0=bool(fp8 and ue8m0), GLOBAL=nvfp4,
        HAS_STATS=recv_stats is not None,
        TRANSPORT=flavour.transport, DEVICE_WAIT=flavour.device_wait, FT=flavour.fault_tolerant,
        EVEN_H=tile.block_h == H, BLOCK_T=tile.block_t, BLOCK_H=tile.block_h,
        BLOCK_R=triton.next_power_of_2(R),
        BLOCK_G=triton.next_power_of_2(max(groups, 1)),
        NUM_THREADS=tile.num_threads, **flavour.launch_options(tile))
    launch(bound, key, ll_dispatch_recv_kernel, (L * R,), args, kwargs, _RECV_VARYING)
    return True


def ll_combine_send(y, layout, src_info, src_k, peer_ptrs, state, stats, *, offsets: dict,
                    rank: int, max_tokens: int, max_topk: int, flavour: Flavour = CPU_RANKS,
                    y_box_offset: int | None = None, fp8: bool = False,
                    num_sms: int | None = None, bound: BoundLaunches | None = None,
                    descriptor: int = 0) -> bool:
    """Launches one send program per (expert, source) block, ``L * R`` (``num_sms`` is the
    normal mode's budget, not this mode's); ``offsets``: rows / signals / acks / outbox ->
    (offset, parity stride). ``y_box_offset``: where ``y`` lies in this rank's segment when it
    is symmetric memory already (the NVSHMEM puts read it there: no copy; not with ``fp8``,
    whose rows are quantized into the outbox). ``bound``: the owner's bound launches (the
    dispatch's handle and ``y`` vary). ``descriptor``: the call's, published above the epoch
    (``signal = epoch << 32 | descriptor << SLOT_BITS``); a refusal sends no rows."""
    zero_copy = y_box_offset is not None and not fp8
    values = (y, layout, src_info, src_k, y_box_offset if zero_copy else 0)
    key = ("ll_combine_send", y.shape, values[4], id(peer_ptrs), id(state), id(stats), id(offsets),
           rank, max_tokens, max_topk, fp8, num_sms, id(flavour), descriptor)
    if call_bound(bound, key, values):
        return True
    L, _, H = y.shape
    R = peer_ptrs.numel()
    tile = ll_tiles("ll_combine_send_fp8" if fp8 else "ll_combine_send", flavour.compiled, H,
                    4 if fp8 else y.element_size(), max_tokens)
    args = (*values[:4], peer_ptrs, state, stats, *offsets["rows"],
            *offsets["signals"], *offsets["acks"], *offsets.get("outbox", (0, 0)),
            values[4], flavour.ring_addr, flavour.ring_slots,
            flavour.mask_off, *flavour.args(), H, R, L, rank, max_tokens, max_topk, descriptor)
    kwargs = dict(
        TRANSPORT=flavour.transport, DEVICE_WAIT=flavour.device_wait, FT=flavour.fault_tolerant,
        ZERO_COPY=zero_copy, FP8=fp8,
        ALIGN=flavour.row_align, EVEN_H=tile.block_h == H, BLOCK_T=tile.block_t,
        BLOCK_H=tile.block_h, BLOCK_R=triton.next_power_of_2(R), NUM_THREADS=tile.num_threads,
        **flavour.launch_options(tile))
    launch(bound, key, ll_combine_send_kernel, (L * R,), args, kwargs,
           ("y", "layout", "src_info", "src_k", "y_box_off"))
    return True


def ll_combine_recv(staging, topk_idx, topk_weights, out, peer_ptrs, state, signals, *,
                    acks: tuple, rank: int, num_experts: int,
                    flavour: Flavour = CPU_RANKS, fp8: bool = False,
                    num_sms: int | None = None, bound: BoundLaunches | None = None) -> bool:
    """Launches one receive program per (token tile, channel tile) of ``TMAX`` tokens (the grid
    depends on the Buffer alone; ``num_sms`` is the normal mode's budget, not this mode's);
    ``staging`` [P, TMAX, KMAX, H];
    ``signals``: the local ll_combine_signals [P, R]; ``fp8``: the rows arrived as FP8;
    ``bound``: the owner's bound launches (the caller's tensors and the token count vary)."""
    P, TMAX, KMAX, H = staging.shape
    row_bytes = staging.stride(2) * staging.element_size()
    if fp8:
        staging = staging.view(torch.uint8)
    T, K = topk_idx.shape
    weights = topk_weights if topk_weights is not None else topk_idx
    values = (staging, topk_idx, weights, out, T)
    key = ("ll_combine_recv", staging.shape, K, out.shape[1], topk_weights is None, id(peer_ptrs),
           id(state), id(signals), acks, rank, num_experts, fp8, num_sms, id(flavour))
    if call_bound(bound, key, values):
        return True
    R = peer_ptrs.numel()
    # FP8 codes are dequantized to fp32 in registers (tiles as for 4-byte slots), a group of
    # 128 channels a program (one scale per row and choice)
    if fp8:
        tile = ll_tiles("ll_combine_recv_fp8", flavour.compiled, 128, KMAX * 4, TMAX)
    else:
        tile = ll_tiles("ll_combine_recv", flavour.compiled, H, KMAX * staging.element_size(),
                        TMAX)
    grid = (triton.cdiv(TMAX, tile.block_t), triton.cdiv(H, tile.block_h))
    args = (*values[:4], peer_ptrs, state, *acks, signals, flavour.ring_addr,
            flavour.ring_slots, flavour.mask_off, *flavour.args(), T, H, K, R, num_experts,
            rank, TMAX, KMAX)
    kwargs = dict(
        HAS_WEIGHTS=topk_weights is not None, TRANSPORT=flavour.transport,
        DEVICE_WAIT=flavour.device_wait, FT=flavour.fault_tolerant, FP8=fp8,
        ROW_BYTES=row_bytes, EVEN_H=even(H, tile.block_h), BLOCK_T=tile.block_t,
        BLOCK_H=tile.block_h, BLOCK_K=triton.next_power_of_2(max(K, 1)),
        BLOCK_R=triton.next_power_of_2(R), NUM_THREADS=tile.num_threads,
        enable_fp_fusion=False,  # each product and sum rounded: the EP-invariant combine's bits
        **flavour.launch_options(tile))
    launch(bound, key, ll_combine_recv_kernel, grid, args, kwargs,
           ("staging", "topk_idx", "topk_weights", "out", "T"))
    return True
