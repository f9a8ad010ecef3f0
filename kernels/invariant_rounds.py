"""The EP-invariant combine in rounds as one launch: every round's send, wait and reduce in one
persistent kernel, as ``kernels.combine_rounds`` does for the default combine.

Where the staging holds ``W`` slots per source, an EP-invariant combine runs in ``rounds``
(``moe_comm.normal_mode``): each round sends every (slot, choice) row of the slots that arrived
in that round of the dispatch to its home's ``inv_rows`` at ``(t % W) * K + k``, and the home
sums the tokens of window ``i`` in choice order (``kernels.invariant``). Where every rank drives
its Buffer from a process of its own and peers are reached by stores (one node; or other nodes
through the proxy, below), one launch runs all rounds. Equivalent PyTorch, for every round
``i`` (the tokens of window ``[i * W, (i + 1) * W)``)::

    send round i's (slot, choice) rows and pairs home, as invariant_send_kernel  # parity
    the last program to finish: publish epoch + i to every rank                 # (epoch+i)%2
    wait until every rank published epoch + i                   # bounded, names the rank
    out[window i] = sum over k in order, as invariant_reduce_kernel

It cannot deadlock, and a send never overwrites rows its home has not summed, for the reasons
``kernels.combine_rounds`` gives: a wait of round ``i`` needs only every rank's send of round
``i``; the send of round ``i + 1`` writes the parity its home last read in round ``i - 1``, and
the home published round ``i`` only after every one of its programs had reduced round ``i - 1``.
Every program waits for its own rank's epoch: the grid is ``num_sms`` programs on GPUs (one per
SM), one in the interpreter. The launch is compiled without FP fusion, as the reduce launched
alone (the send only moves rows), so the sums have the bits of the launches per round.

Across nodes through the proxy (``TRANSPORT`` 2; flat, fault-tolerant too, or hierarchical:
no forwarder takes part in this combine) a home on another node gets its rows and
pairs from this rank's outbox of the round's parity, one descriptor per (slot, choice), as
``invariant_send_kernel`` posts them, and the round's last program posts the epoch to every
such home after them (``kernels.invariant.publish_pairs``; the proxy keeps the order). The
outbox of a parity is written again two rounds later, after this rank's wait of the round
between: that wait needs the epoch of every home on another node, which a home posts only
after its own wait of the round before, which needed this rank's transfers out of that outbox
to have landed (the epoch follows them). So the argument above holds with the proxy as one
more link, as in ``kernels.combine_rounds``.

Fault tolerance (``FT``, ``moe_comm.fault``, "In rounds"): each round's wait is
``kernels.comm.wait_or_exclude_once`` (program 0 waits, excludes a source silent until the
deadline and writes who arrived into row ``i`` of ``live``; the other programs take its word),
and the round's sums leave out the choices of the sources not in that row, as
``invariant_reduce_kernel`` with ``live`` does (through the proxy the exclusion reaches the
ranks of this node, as in ``kernels.combine_rounds``).

Bytes and signals are those of the launches per round: each round's rows, their two floats and
its epoch (8 bytes) to every rank, counted in ``stats`` as ``invariant_send_kernel`` counts them.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .bound import BoundLaunches, call_bound, launch
from .combine_rounds import rounds_grid
from .comm import (
    CPU_RANKS,
    Flavour,
    check_round_words,
    draw_last_of,
    signal_word,
    timed_out,
    wait_round,
)
from .invariant import COPY_STAGES, publish_pairs, reduce_tokens, send_pairs
from .tiles import MAX_TRIPS, combine_round_trips, even, tiles

ROUNDS_TICKET = 7  # the word of ``tickets`` this kernel draws from (combine_rounds: 6)
_PER_CALL = ["rows_off", "meta_off", "signal_off", "local_base", "errors_addr", "timeout_ns",
             "T", "me", "mask_off", "ring_addr", "descriptor"]


@triton.jit(do_not_specialize=_PER_CALL)
def invariant_rounds_kernel(
    y,  # [rows, H] expert outputs
    weights,  # [rows] float32 (HAS_WEIGHTS)
    pair_values,  # [rows] float32 (HAS_PAIR)
    slot_rows,  # [S, K] int32: rows of each received slot, -1 where unused
    slot_offsets,  # int64: round i's [R + 1] offsets at i * OFFSETS_STRIDE (the dispatch's)
    src_token,  # [rows] int64: each row's token on its home rank (the dispatch's)
    peer_ptrs,  # [R] int64
    stats,  # [4] int64 local: bytes stored (to peers, to itself) at [2], [3]
    tickets,  # [1] int64 local: this kernel's own ticket word (ROUNDS_TICKET)
    epochs,  # [1] int64 local: the channel's epoch; each round's last program advances it
    signals,  # [R] int64 local: the combine channel's signal words, one per source
    stage,  # [2, W * KMAX, H] local inv_rows
    meta,  # [2, W * KMAX, 2] float32 local inv_meta
    topk_idx,  # [T, K] int64: the dispatch's expert ids of this rank's tokens
    ring,  # [T, R] int32: the ring position of token t on rank d in its round, -1 if none
    out,  # [T, H]
    pair_out,  # [T, K] float32 (HAS_PAIR)
    live,  # FT: [ROUNDS, R] int32 out: row i, the sources round i heard
    decided,  # FT: [1] int64 local: each round's decision (kernels.comm.wait_or_exclude_once)
    mask_off: tl.int64,  # FT: the mask words in this rank's segment
    xstats,  # [4] int64 local (TRANSPORT 2): bytes into the outboxes at [1]
    box_rows_off: tl.int64, box_meta_off: tl.int64,  # TRANSPORT 2: inv_box_rows, _meta (p 0)
    box_rows_parity: tl.int64, box_meta_parity: tl.int64,
    ring_addr: tl.int64, RING_SLOTS: tl.int64,  # TRANSPORT 2: the proxy's ring
    rows_off: tl.int64, meta_off: tl.int64, signal_off: tl.int64,  # inv_rows, inv_meta (p 0)
    rows_parity: tl.int64, meta_parity: tl.int64,  # bytes per parity
    STAGE_PARITY: tl.int64, META_PARITY: tl.int64,  # elements between the two parities
    local_base: tl.int64,  # address of this rank's segment (no outbox is read from it)
    errors_addr: tl.int64, timeout_ns: tl.int64,
    T: tl.int32, H: tl.int32, K: tl.int32, R: tl.int32, E: tl.int32, me: tl.int32,
    W: tl.int32,  # ring slots per source: the tokens of a round
    ROUNDS: tl.int32, OFFSETS_STRIDE: tl.int32,
    descriptor: tl.int32,  # the call's (moe_comm.call_descriptor), in every round's signal word
    KMAX: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_PAIR: tl.constexpr,
    FT: tl.constexpr,  # fault tolerance: each round sums the sources program 0 heard
    TRANSPORT: tl.constexpr,  # 0: every peer by stores; 2: the proxy where no pointer
    ALIGN: tl.constexpr, EVEN_H: tl.constexpr, REDUCE_EVEN_H: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,  # the send's tiles
    REDUCE_T: tl.constexpr, REDUCE_H: tl.constexpr,  # the reduce's tiles
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, NUM_THREADS: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    errors = errors_addr.to(tl.pointer_type(tl.int64))
    base = tl.load(epochs)  # read by every program before any draws its first ticket
    channel_tiles = tl.cdiv(H, REDUCE_H)
    # as combine_rounds_kernel: nothing is sent after a timeout, and a wait that times out ends
    # its program's rounds (the error record is read once, outside the rounds)
    ok = ~timed_out(errors, NUM_THREADS)
    for i in range(ROUNDS):
        if ok:
            epoch = base + 1 + i
            parity = epoch % 2
            send_pairs(pid, programs, y, weights, pair_values, slot_rows,
                       slot_offsets + i * OFFSETS_STRIDE, src_token, peer_ptrs, stats, xstats,
                       rows_off + parity * rows_parity, meta_off + parity * meta_parity,
                       signal_off, box_rows_off + parity * box_rows_parity,
                       box_meta_off + parity * box_meta_parity, local_base, errors, ring_addr,
                       RING_SLOTS, timeout_ns, H, K, R, me, W, KMAX, HAS_WEIGHTS, HAS_PAIR,
                       TRANSPORT, ALIGN, EVEN_H, BLOCK_T, BLOCK_H, BLOCK_K, BLOCK_R,
                       not FT, 1 if FT else COPY_STAGES)  # (with FT: 8-16 bytes spilled)
            if draw_last_of(tickets, programs):  # the round's epoch to every rank
                publish_pairs(peer_ptrs, signal_off, signal_word(epoch, descriptor), stats,
                              local_base, ring_addr, RING_SLOTS, errors, timeout_ns, R, me,
                              TRANSPORT)
                tl.store(epochs + tl.arange(0, 1), epoch + tl.zeros([1], tl.int64))
            ok = wait_round(pid, epoch, signals, errors, timeout_ns, live + i * R, decided,
                            mask_off, local_base, peer_ptrs, R, me, FT, TRANSPORT, BLOCK_R,
                            NUM_THREADS, True)
            if ok:  # the tokens of window i, each in choice order
                first = tl.cast(i, tl.int64) * W
                n = tl.minimum(T - first, W).to(tl.int32)
                for q in range(pid, tl.cdiv(n, REDUCE_T) * channel_tiles, programs):
                    reduce_tokens(q // channel_tiles, q % channel_tiles,
                                  stage + parity * STAGE_PARITY, meta + parity * META_PARITY,
                                  topk_idx + first * K, ring + first * R, out + first * H,
                                  pair_out + first * K, live + i * R, n, H, K, R, E, KMAX,
                                  HAS_WEIGHTS, HAS_PAIR, FT, REDUCE_EVEN_H, REDUCE_T, REDUCE_H,
                                  BLOCK_K)


def fits_one_launch(world_size: int, ring_slots: int, hidden: int, topk: int,
                    num_sms: int | None, flavour: Flavour, elem_bytes: int) -> bool:
    """Whether an EP-invariant combine in rounds runs as one launch: always in the interpreter;
    on GPUs where a round's serial trips on ``rounds_grid``'s programs stay within the gate's
    ``MAX_TRIPS`` (the default combine's count, ``kernels.tiles.combine_round_trips``: the
    send's slot tiles and the reduce's (token, channel) tiles of a window)."""
    if not flavour.compiled:
        return True
    send_tile = tiles("invariant_send", True, hidden, elem_bytes)
    reduce_tile = tiles("invariant_rounds_reduce", True, hidden, 4)  # fp32 sums
    return combine_round_trips(world_size, ring_slots, topk, hidden,
                               rounds_grid(num_sms, flavour), send_tile.block_t,
                               reduce_tile.block_t, reduce_tile.block_h) <= MAX_TRIPS


def invariant_rounds(y, weights, pair_values, slot_rows, slot_offsets, src_token, topk_idx,
                     ring, out, pair_out, stage, meta, peer_ptrs, stats, tickets, epochs,
                     signals, *, offsets: dict, rank: int, num_experts: int, max_topk: int,
                     ring_slots: int, rounds: int, offsets_stride: int,
                     num_sms: int | None = None, flavour: Flavour = CPU_RANKS,
                     bound: BoundLaunches | None = None, live=None, decided=None,
                     xstats=None, descriptor: int = 0) -> bool:
    """Launches :func:`invariant_rounds_kernel` (module docstring): the whole EP-invariant
    combine of ``rounds`` rounds. ``offsets``: ``invariant_send``'s (one node: rows / meta /
    signal); ``stage`` / ``meta`` the whole inv_rows / inv_meta regions; ``slot_offsets``
    (round i's at ``i * offsets_stride``), ``src_token``, ``topk_idx`` and ``ring`` [T, R]
    from the dispatch; ``out`` [T, H] and ``pair_out`` [T, K] (None without pair values) are
    written. ``flavour.fault_tolerant``: ``live`` [rounds, R] int32 gets who each round
    heard, ``decided`` is the Buffer's word of the decisions (``kernels.combine_rounds``).
    Through the proxy (``flavour.transport`` 2): ``offsets`` has the outboxes' (box_rows /
    box_meta) and ``xstats`` counts their bytes. ``descriptor``: the call's, in every round's
    signal word (``moe_comm.call_descriptor``; each round's wait compares them)."""
    if flavour.transport == 1 or (flavour.transport == 2 and (
            xstats is None or "box_rows" not in offsets)):
        raise ValueError("an EP-invariant combine in one launch reaches its peers by stores, "
                         "and through the proxy by its outboxes too")
    ft = flavour.fault_tolerant
    T, H = out.shape
    K = slot_rows.shape[1]
    has_pair = pair_out is not None
    values = (y, weights if weights is not None else y,
              pair_values if pair_values is not None else y, slot_rows, slot_offsets,
              src_token, topk_idx, ring, out, pair_out if has_pair else out,
              live if ft else ring, T)
    key = ("invariant_rounds", H, K, weights is None, pair_values is None,
           has_pair, id(peer_ptrs), id(stats), id(tickets), id(epochs), id(signals), id(stage),
           id(meta), id(offsets), rank, num_experts, max_topk, ring_slots, rounds,
           offsets_stride, num_sms, id(flavour), id(decided) if ft else None, id(xstats),
           descriptor)
    if call_bound(bound, key, values):
        return True
    R = peer_ptrs.numel()
    check_round_words(ft, live, decided, rounds, R, "EP-invariant combine")  # (once: bound)
    send_tile = tiles("invariant_send", flavour.compiled, H, y.element_size())
    reduce_tile = tiles("invariant_rounds_reduce", flavour.compiled, H, 4)  # fp32 sums
    box_rows, box_meta = offsets.get("box_rows", (0, 0)), offsets.get("box_meta", (0, 0))
    args = (
        *values[:6], peer_ptrs, stats, tickets, epochs, signals, stage, meta, *values[6:11],
        decided if ft else ring, flavour.mask_off if ft else 0,
        stats if xstats is None else xstats, box_rows[0], box_meta[0], box_rows[1],
        box_meta[1], flavour.ring_addr, flavour.ring_slots, offsets["rows"][0],
        offsets["meta"][0], offsets["signal"], offsets["rows"][1], offsets["meta"][1],
        stage.stride(0), meta.stride(0), flavour.local_base,
        flavour.errors_addr, flavour.timeout_ns, T, H, K, R, num_experts, rank, ring_slots,
        rounds, offsets_stride, descriptor)
    kwargs = dict(
        KMAX=max_topk, HAS_WEIGHTS=weights is not None, HAS_PAIR=pair_values is not None,
        FT=ft, TRANSPORT=flavour.transport, ALIGN=flavour.row_align,
        EVEN_H=even(H, send_tile.block_h), REDUCE_EVEN_H=even(H, reduce_tile.block_h),
        BLOCK_T=send_tile.block_t,
        BLOCK_H=send_tile.block_h, REDUCE_T=reduce_tile.block_t, REDUCE_H=reduce_tile.block_h,
        BLOCK_K=triton.next_power_of_2(max(K, 1)), BLOCK_R=triton.next_power_of_2(R),
        NUM_THREADS=send_tile.num_threads, enable_fp_fusion=False,
        **flavour.launch_options(send_tile))
    launch(bound, key, invariant_rounds_kernel, (rounds_grid(num_sms, flavour),), args, kwargs,
           ("y", "weights", "pair_values", "slot_rows", "slot_offsets", "src_token", "topk_idx",
            "ring", "out", "pair_out", "live", "T"))
    return True
