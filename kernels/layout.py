"""Routing layout: where each token goes and where each (token, expert) pair lands.

Equivalent PyTorch for this rank (``R`` ranks, ``L`` local experts per rank)::

    bad = ((topk_idx < -1) | (topk_idx >= E)).any(1) | repeated_expert_in_row(topk_idx)
    topk_idx = where(bad[:, None], -1, topk_idx)           # a bad row goes nowhere
    topk_idx = where(excluded[topk_idx // L] | excluded[me], -1, topk_idx)  # fault tolerance
    dest = topk_idx // L                                   # [T, K], -1 rows stay negative
    goes = [(dest == d).any(1) for d in range(R)]          # token t is sent to rank d once
    slot_of[:, d] = where(goes[d], goes[d].cumsum(0) - 1, -1)
    counts[d, :L] = bincount(topk_idx[dest == d] - d * L, minlength=L)
    counts[d, L] = goes[d].sum() | descriptor << SLOT_BITS   # the call's (comm.SLOT_BITS)
    pair_pos[t, k] = #{t' < t : expert topk_idx[t, k] in topk_idx[t']}   # valid pairs only

The first bad row is recorded in the error record (code, token, offending id), which the host
raises as ValueError without reading ``topk_idx`` itself (no host synchronisation).

Slots and positions follow token order, which makes the receiver's output order (source rank,
then source token) fall out without any sort.

Two launches over chunks of ``CHUNK`` tokens, one program per chunk, no atomics, no program
waiting for another:

1. **count** (:func:`layout_count_kernel`): checks the chunk's ids once (bad rows and, with
   fault tolerance, the choices of excluded ranks become -1) and writes them as int32 into
   ``pair_pos``; counts the chunk's pairs per expert and its tokens per rank
   (``chunk_counts[c] = [E expert counts, R rank counts]``) and notes its first bad row.
2. **place** (:func:`layout_place_kernel`): each program sums the counts of the chunks before
   its own (the prefixes, a ``[c, E + R]`` read), then numbers its chunk's pairs and tokens in
   token order: ``pair_pos`` (overwriting the ids it read) and ``slot_of``. The last chunk's
   program also writes the totals (``counts``) and records the first bad row of all chunks.

Bytes: count reads ``T*K*8`` and writes ``T*K*4 + C*(E + R)*4``; place reads ``T*K*4`` and, per
program, ``c*(E + R)*4`` of prefixes, and writes ``T*(R + K)*4 + R*(L + 1)*4``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bound import BoundLaunches, call_bound, launch
from .comm import BAD_EXPERT_ID, INPUT_RECORD, REPEATED_EXPERT, SLOT_BITS, Flavour, record_error
from .numerics import column
from .tiles import tiles


@triton.jit
def load_ids(topk_idx, t, tm, K, BLOCK_K: tl.constexpr):
    """The raw expert ids of tokens ``t`` [BLOCK_T, BLOCK_K] int64 (-1 where not ``tm`` or
    ``k >= K``): the load of :func:`checked_ids` alone, to issue it early."""
    kk = tl.arange(0, BLOCK_K)
    m2 = tm[:, None] & (kk < K)[None, :]
    return tl.load(topk_idx + t.to(tl.int64)[:, None] * K + kk[None, :], mask=m2, other=-1)


@triton.jit
def check_ids(ids, E, BLOCK_K: tl.constexpr):
    """:func:`checked_ids` of ids already loaded (:func:`load_ids`). The first bad choice of a
    row decides what is recorded: an id out of range before a repeat, an earlier choice
    first; the choices are compared column by column (reductions along a row, unrolled)."""
    kk = tl.arange(0, BLOCK_K)
    again = tl.zeros(ids.shape, tl.int32)  # choice k's expert comes back at a later choice
    for k in tl.static_range(BLOCK_K):
        e_k = column(ids, k)
        later = tl.max(((ids == e_k[:, None]) & (kk[None, :] > k)).to(tl.int32), axis=1)
        again = tl.where(kk[None, :] == k, later[:, None], again)
    out_of_range = (ids < -1) | (ids >= E)
    key = tl.where(out_of_range, kk[None, :],
                   tl.where((again > 0) & (ids >= 0), BLOCK_K + kk[None, :], 2 * BLOCK_K))
    first = tl.min(key, axis=1)
    value = tl.sum(tl.where(kk[None, :] == first[:, None] % BLOCK_K, ids, 0), axis=1)
    bad = first < 2 * BLOCK_K
    code = tl.where(first < BLOCK_K, BAD_EXPERT_ID, REPEATED_EXPERT)
    value = tl.where(bad, value, -1)
    ids = tl.where(bad[:, None], -1, ids).to(tl.int32)
    return ids, bad, code, value


@triton.jit
def checked_ids(topk_idx, t, tm, K, E, BLOCK_K: tl.constexpr):
    """``(ids [BLOCK_T, BLOCK_K] int32, bad [BLOCK_T], code [BLOCK_T], value [BLOCK_T])``:
    the expert ids of tokens ``t`` (-1 where unused or ``k >= K``); a row with an id outside
    ``[-1, E)`` or an expert twice is bad: all its ids become -1, ``code`` says why and
    ``value`` is the offending id."""
    return check_ids(load_ids(topk_idx, t, tm, K, BLOCK_K), E, BLOCK_K)


@triton.jit
def record_first_bad(errors, t, bad, code, value, T):
    """Records the first bad row of this tile (if any) in the input part of the error record."""
    first = tl.min(tl.where(bad, t, T), axis=0)
    if first < T:  # gate: cold
        c = tl.sum(tl.where(t == first, code, 0), axis=0)
        v = tl.sum(tl.where(t == first, value, 0), axis=0)
        record_error(errors, INPUT_RECORD, c, first, v)


@triton.jit(do_not_specialize=["local_base", "T", "me"])
def layout_count_kernel(
    topk_idx,  # [T, K] int64: expert ids, -1 for an unused choice
    ids_out,  # [T, K] int32 out: the checked ids (-1: unused, a bad row, an excluded rank's)
    chunk_counts,  # [C, E + R] int32 out: chunk c's pairs per expert, then tokens per rank
    chunk_bad,  # [C, 3] int64 out: chunk c's first bad token (T if none), its code and id
    mask_off: tl.int64, local_base: tl.int64,  # FT: the mask words in this rank's segment
    T: tl.int32, K: tl.int32, R: tl.int32, L: tl.int32, E: tl.int32, me: tl.int32,
    FT: tl.constexpr,  # fault tolerance: nothing goes to an excluded rank, or from one
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr,
):
    c = tl.program_id(0)
    t = c * CHUNK + tl.arange(0, CHUNK)
    tm = t < T
    kk = tl.arange(0, BLOCK_K)
    m2 = tm[:, None] & (kk < K)[None, :]
    ids, bad, code, value = checked_ids(topk_idx, t, tm, K, E, BLOCK_K)
    dest = tl.where(ids >= 0, ids // L, -1)
    if FT:  # an excluded destination, or this rank excluded itself: the choice goes nowhere
        mask = (local_base + mask_off).to(tl.pointer_type(tl.int64))
        out = tl.load(mask + tl.maximum(dest, 0), mask=dest >= 0, other=0) != 0
        out = out | (tl.load(mask + me + tl.zeros_like(dest)) != 0)
        ids = tl.where(out, -1, ids)
        dest = tl.where(out, -1, dest)
    tl.store(ids_out + t.to(tl.int64)[:, None] * K + kk[None, :], ids, mask=m2)
    flat = tl.reshape(ids, [CHUNK * BLOCK_K])
    per_expert = tl.histogram(flat, BLOCK_E, mask=flat >= 0)
    # a token counts once per rank: at its first choice of that rank
    earlier = (dest[:, :, None] == dest[:, None, :]) & (kk[None, None, :] < kk[None, :, None])
    first = (dest >= 0) & (tl.max(earlier.to(tl.int32), axis=2) == 0)
    flat_dest = tl.reshape(dest, [CHUNK * BLOCK_K])
    per_rank = tl.histogram(flat_dest, BLOCK_R, mask=tl.reshape(first, [CHUNK * BLOCK_K]))
    row = chunk_counts + c.to(tl.int64) * (E + R)
    e = tl.arange(0, BLOCK_E)
    r = tl.arange(0, BLOCK_R)
    tl.store(row + e, per_expert, mask=e < E)
    tl.store(row + E + r, per_rank, mask=r < R)
    first_bad = tl.min(tl.where(bad, t, T), axis=0)
    lane = tl.arange(0, 4)
    noted = tl.where(lane == 0, first_bad,
                     tl.where(lane == 1, tl.sum(tl.where(t == first_bad, code, 0), axis=0),
                              tl.sum(tl.where(t == first_bad, value, 0), axis=0)))
    tl.store(chunk_bad + c.to(tl.int64) * 3 + lane, noted.to(tl.int64), mask=lane < 3)


@triton.jit
def _sum_rows_before(chunk_counts, c, W, col, cm, BLOCK_C: tl.constexpr,
                     BLOCK: tl.constexpr):
    """``chunk_counts[:c, col].sum(0)`` ([BLOCK] int32; ``cm``: the columns that exist)."""
    acc = tl.zeros([BLOCK], tl.int32)
    for c0 in range(0, c, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        acc += tl.sum(tl.load(chunk_counts + cc.to(tl.int64)[:, None] * W + col[None, :],
                              mask=(cc < c)[:, None] & cm[None, :], other=0), axis=0)
    return acc


@triton.jit(do_not_specialize=["errors_addr", "descriptor", "T"])
def layout_place_kernel(
    pair_pos,  # [T, K] int32: in the checked ids (count), out each pair's position
    chunk_counts,  # [C, E + R] int32 from count
    chunk_bad,  # [C, 3] int64 from count
    slot_of,  # [T, R] int32 out: slot of token t in rank d's staging, -1 if not sent to d
    counts,  # [R, L + 1] int32 out: tokens per expert of rank d, then slots used on d (with
             # the call descriptor above SLOT_BITS)
    errors_addr: tl.int64,  # error record: the first bad row of topk_idx
    descriptor: tl.int32,  # this call's descriptor (moe_comm.call_descriptor), 0: none
    T: tl.int32, K: tl.int32, R: tl.int32, L: tl.int32, E: tl.int32,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_R: tl.constexpr,  # ranks per trip of the slot loop
    BLOCK_CE: tl.constexpr, BLOCK_CR: tl.constexpr,  # chunks per trip of the expert and the rank
                                                     # prefix sums (and of the bad-row scan)
):
    c = tl.program_id(0)
    last = c == tl.num_programs(0) - 1
    W = E + R
    t = c * CHUNK + tl.arange(0, CHUNK)
    tm = t < T
    t64 = t.to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    m2 = tm[:, None] & (kk < K)[None, :]
    ids = tl.load(pair_pos + t64[:, None] * K + kk[None, :], mask=m2, other=-1)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    before = _sum_rows_before(chunk_counts, c, W, e, em, BLOCK_CE, BLOCK_E)  # pairs per expert
    # a pair's position: the pairs of its expert in earlier chunks, then in earlier tokens of
    # this chunk (a token holds an expert at most once)
    flat = tl.reshape(ids, [CHUNK * BLOCK_K])
    local = tl.arange(0, CHUNK)
    flat_token = tl.reshape(tl.broadcast_to(local[:, None], [CHUNK, BLOCK_K]), [CHUNK * BLOCK_K])
    for k in tl.static_range(BLOCK_K):
        e_k = column(ids, k)
        same = (flat[None, :] == e_k[:, None]) & (flat_token[None, :] < local[:, None])
        pos = tl.gather(before, tl.maximum(e_k, 0), 0) + tl.sum(same.to(tl.int32), axis=1)
        k_valid = tl.zeros_like(t) + k < K  # a vector: the interpreter mis-broadcasts scalars
        tl.store(pair_pos + t64 * K + k, tl.where(e_k >= 0, pos, -1), mask=tm & k_valid)
    if last:  # totals per expert: counts[d, l] for expert d * L + l
        total = before + tl.load(chunk_counts + c.to(tl.int64) * W + e, mask=em, other=0)
        tl.store(counts + (e // L) * (L + 1) + e % L, total, mask=em)
    dest = tl.where(ids >= 0, ids // L, -1)
    for d0 in range(0, R, BLOCK_R):  # slots: tokens for rank d in earlier chunks, then here
        d = d0 + tl.arange(0, BLOCK_R)
        dm = d < R
        goes = tl.zeros([CHUNK, BLOCK_R], tl.int32)
        for k in tl.static_range(BLOCK_K):
            d_k = column(dest, k)
            goes = goes | (d_k[:, None] == d[None, :]).to(tl.int32)
        sent = _sum_rows_before(chunk_counts, c, W, E + d, dm, BLOCK_CR, BLOCK_R)
        slot = sent[None, :] + tl.cumsum(goes, axis=0) - goes
        tl.store(slot_of + t64[:, None] * R + d[None, :], tl.where(goes > 0, slot, -1),
                 mask=tm[:, None] & dm[None, :])
        if last:
            tl.store(counts + d * (L + 1) + L,
                     (sent + tl.sum(goes, axis=0)) | (descriptor << SLOT_BITS), mask=dm)
    if last:  # the first bad row of all chunks (chunks are in token order)
        first = tl.zeros([], tl.int64) + T
        code = tl.zeros([], tl.int64)
        value = tl.zeros([], tl.int64)
        for c0 in range(0, tl.num_programs(0), BLOCK_CR):
            cc = c0 + tl.arange(0, BLOCK_CR)
            noted = chunk_bad + cc.to(tl.int64) * 3
            cm = cc < tl.num_programs(0)
            tok = tl.load(noted, mask=cm, other=T)
            here = tl.min(tok, axis=0)
            if (first == T) & (here < T):
                first = here
                code = tl.sum(tl.load(noted + 1, mask=cm & (tok == here), other=0), axis=0)
                value = tl.sum(tl.load(noted + 2, mask=cm & (tok == here), other=0), axis=0)
        if first < T:  # gate: cold
            record_error(errors_addr.to(tl.pointer_type(tl.int64)), INPUT_RECORD, code, first,
                         value)


def layout_chunks(max_tokens: int, flavour: Flavour) -> int:
    """Chunks of the layout at most (``max_tokens`` tokens): the rows of its scratch."""
    return max(1, triton.cdiv(max_tokens, tiles("routing_layout", flavour.compiled, 0).block_t))


def layout_scratch(max_tokens: int, world_size: int, num_experts: int, flavour: Flavour,
                   device, max_topk: int) -> tuple[torch.Tensor, ...]:
    """``(chunk_counts [C, E + R] int32, chunk_bad [C, 3] int64, pair_pos [max_tokens *
    max_topk] int32, counts [R, L + 1] int32)`` for :func:`routing_layout` of up to
    ``max_tokens`` tokens of up to ``max_topk`` choices (a Buffer keeps one: its launches are
    stream-ordered, and what a call's layout writes is read by that call's sends alone)."""
    C = layout_chunks(max_tokens, flavour)
    L = num_experts // world_size
    return (torch.empty((C, num_experts + world_size), dtype=torch.int32, device=device),
            torch.empty((C, 3), dtype=torch.int64, device=device),
            torch.empty(max_tokens * max_topk, dtype=torch.int32, device=device),
            torch.empty((world_size, L + 1), dtype=torch.int32, device=device))


def routing_layout(topk_idx: torch.Tensor, world_size: int, num_local_experts: int,
                   flavour: Flavour, rank: int = 0, scratch=None,
                   bound: BoundLaunches | None = None, descriptor: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launches the two layout kernels: ``(slot_of [T, R], pair_pos [T, K], counts [R, L+1])``
    (int32); bad rows of ``topk_idx`` go nowhere and the first is recorded at
    ``flavour.errors_addr``; with ``flavour.fault_tolerant`` nothing goes to a rank excluded
    in the mask words (read on the device: as if its experts' ids were -1), nor anywhere once
    ``rank`` itself is excluded (the fence against its late writes on GPUs, where the host
    does not read the mask). ``scratch``: :func:`layout_scratch` for at least T tokens (made
    here if None); ``pair_pos`` and ``counts`` are its memory, rewritten by the next layout
    on it. ``bound``: the owner's bound launches (``kernels.bound``). ``descriptor``
    (< 2**13): the call's, in ``counts[:, L]`` above the slots (``counts[d, L] = slots |
    descriptor << SLOT_BITS``)."""
    T, K = topk_idx.shape
    R, L = world_size, num_local_experts
    E = R * L
    tile = tiles("routing_layout", flavour.compiled, 0)
    chunks = max(1, triton.cdiv(T, tile.block_t))
    if scratch is None or scratch[0].shape[0] < chunks or scratch[2].numel() < T * K:
        scratch = layout_scratch(T, R, E, flavour, topk_idx.device, K)
    chunk_counts, chunk_bad, pair_memory, counts = scratch
    slot_of = torch.empty((T, R), dtype=torch.int32, device=topk_idx.device)
    pair_pos = pair_memory[:T * K].view(T, K)
    key = ("layout", chunks, K, id(chunk_counts),
           id(chunk_bad), R, L, rank, id(flavour), descriptor)
    count_values = (topk_idx, pair_pos, T)
    place_values = (pair_pos, slot_of, counts, T)
    if not call_bound(bound, ("count",) + key, count_values, (("place",) + key, place_values)):
        block_k = triton.next_power_of_2(max(K, 1))
        block_e = triton.next_power_of_2(E)
        launch(bound, ("count",) + key, layout_count_kernel, (chunks,),
               (topk_idx, pair_pos, chunk_counts, chunk_bad, flavour.mask_off,
                flavour.local_base, T, K, R, L, E, rank),
               dict(FT=flavour.fault_tolerant, CHUNK=tile.block_t, BLOCK_K=block_k,
                    BLOCK_E=block_e, BLOCK_R=triton.next_power_of_2(R),
                    **tile.launch_options()),
               ("topk_idx", "ids_out", "T"))
        block_r = min(triton.next_power_of_2(R), 128)
        launch(bound, ("place",) + key, layout_place_kernel, (chunks,),
               (pair_pos, chunk_counts, chunk_bad, slot_of, counts, flavour.errors_addr,
                descriptor, T, K, R, L, E),
               dict(CHUNK=tile.block_t, BLOCK_K=block_k, BLOCK_E=block_e, BLOCK_R=block_r,
                    BLOCK_CE=prefix_rows(block_e), BLOCK_CR=prefix_rows(block_r),
                    **tile.launch_options()),
               ("pair_pos", "slot_of", "counts", "T"))
    return slot_of, pair_pos, counts


def prefix_rows(block: int) -> int:
    """Chunks per trip of the place kernel's prefix sums over ``block`` columns: a
    ``[rows, block]`` int32 tile of at most 4096 values."""
    return max(1, min(1024, 4096 // block))


@triton.jit(do_not_specialize=["errors_addr", "T"])
def checked_topk_idx_kernel(
    topk_idx,  # [T, K] int64: expert ids, -1 for an unused choice
    out,  # [T, K] int64 out: topk_idx with every bad row all -1
    errors_addr: tl.int64,  # error record: the first bad row of topk_idx
    T: tl.int32, K: tl.int32, E: tl.int32,
    RECORD: tl.constexpr,  # record the first bad row (dispatch), or only clear rows (combine)
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program walks the rows in order, so the row it records is the first bad one."""
    kk = tl.arange(0, BLOCK_K)
    errors = errors_addr.to(tl.pointer_type(tl.int64))
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < T
        ids, bad, code, value = checked_ids(topk_idx, t, tm, K, E, BLOCK_K)
        if RECORD:
            record_first_bad(errors, t, bad, code, value, T)
        tl.store(out + t.to(tl.int64)[:, None] * K + kk[None, :], ids.to(tl.int64),
                 mask=tm[:, None] & (kk < K)[None, :])


def checked_topk_idx(topk_idx: torch.Tensor, num_experts: int, flavour: Flavour,
                     record: bool = True) -> torch.Tensor:
    """``topk_idx`` [T, K] int64 with every bad row set to -1; with ``record`` the first bad
    row is recorded at ``flavour.errors_addr`` (raised by the host at its next check; no host
    synchronisation). For kernels that do not check ids themselves (csrc/): a dispatch records,
    its combine only clears (as the Triton kernels do). Equivalent PyTorch::

        bad = ((topk_idx < -1) | (topk_idx >= E)).any(1) | repeated_expert_in_row(topk_idx)
        out = torch.where(bad[:, None], -1, topk_idx)
    """
    T, K = topk_idx.shape
    tile = tiles("checked_topk_idx", flavour.compiled, 0)
    out = torch.empty_like(topk_idx)
    checked_topk_idx_kernel[(1,)](topk_idx, out, flavour.errors_addr, T, K, num_experts,
                                  RECORD=record, BLOCK_T=tile.block_t,
                                  BLOCK_K=triton.next_power_of_2(max(K, 1)),
                                  **tile.launch_options())
    return out


@triton.jit(do_not_specialize=["T"])
def ring_positions_kernel(
    slot_of,  # [T, R] int32: slot of token t on rank d (the layout's), -1 where t does not go
    counts,  # [R, C] int32: the call's counts per rank (the layout's; C = L + 1)
    ring,  # [T, R] int32 out: slot_of less rank d's slots of the earlier rounds, -1 where none
    words,  # [rounds, WORDS] int32 out: round i's [R, C] counts from i * WORDS
    node_ring,  # NODES: [T, M] int32 out: row of token t in node b's message of its round
    node_counts,  # NODES: [rounds, M] int32 out: the rows of each round's message to node b
    T: tl.int32, R: tl.int32, C: tl.int32, W: tl.int32, ROUNDS: tl.int32, WORDS: tl.int32,
    N: tl.int32,  # NODES: ranks per node
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
    NODES: tl.constexpr,
):
    """Program d < R walks rank d's column round by round: each window's tokens and their
    count; with NODES, program R + b walks node b's N columns likewise: the tokens that go to
    any rank of node b, numbered in each window."""
    d = tl.program_id(0)
    if d < R:
        c = tl.arange(0, BLOCK_C)
        mine = tl.load(counts + d * C + c, mask=c < C, other=0)
        descriptor = (mine >> SLOT_BITS) << SLOT_BITS  # (the last word's; 0 elsewhere)
        before = T * 0  # rank d's slots in the earlier rounds
        for i in range(ROUNDS):
            hits = tl.zeros([BLOCK_T], tl.int32)
            for t0 in range(i * W, i * W + W, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                tm = (t < T) & (t < i * W + W)
                slot = tl.load(slot_of + t.to(tl.int64) * R + d, mask=tm, other=-1)
                tl.store(ring + t.to(tl.int64) * R + d, tl.where(slot >= 0, slot - before, -1),
                         mask=tm)
                hits += (slot >= 0).to(tl.int32)
            rows = tl.sum(hits, axis=0)
            tl.store(words + i * WORDS + d * C + c,
                     tl.where(c == C - 1, rows | descriptor, mine), mask=c < C)
            before += rows
    elif NODES:
        b = d - R
        M = R // N
        n = tl.arange(0, BLOCK_N)
        seen = T * 0  # rows of node b's messages so far
        for i in range(ROUNDS):
            before = seen  # those of the earlier rounds
            for t0 in range(i * W, i * W + W, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                tm = (t < T) & (t < i * W + W)
                slots = tl.load(slot_of + t.to(tl.int64)[:, None] * R + b * N + n[None, :],
                                mask=tm[:, None] & (n < N)[None, :], other=-1)
                hit = (tl.max(slots, axis=1) >= 0).to(tl.int32)
                tl.store(node_ring + t.to(tl.int64) * M + b,
                         tl.where(hit > 0, seen - before + tl.cumsum(hit, axis=0) - 1, -1),
                         mask=tm)
                seen += tl.sum(hit, axis=0)
            tl.store(node_counts + i * M + b + tl.arange(0, 1),
                     seen - before + tl.zeros([1], tl.int32))


def ring_positions(slot_of: torch.Tensor, counts: torch.Tensor, ring_slots: int, rounds: int,
                   flavour: Flavour, bound: BoundLaunches | None = None,
                   ranks_per_node: int | None = None) -> tuple:
    """A call in ``rounds`` rounds of ``W = ring_slots`` tokens, in one launch: ``(ring [T, R]
    int32, words [rounds, WORDS] int32)``, ``WORDS`` = R * C rounded up to 4 (each round's counts
    16-byte aligned); with ``ranks_per_node`` N (hierarchical, ``M = R // N`` nodes) also
    ``(node_ring [T, M], node_counts [rounds, M])`` int32 in the same launch. Equivalent
    PyTorch::

        hits = torch.zeros((rounds * W, R), dtype=torch.int32); hits[:T] = slot_of >= 0
        rows = hits.view(rounds, W, R).sum(1)                 # each round's rows per rank
        first = rows.cumsum(0) - rows
        ring = torch.where(slot_of >= 0, slot_of - first[torch.arange(T) // W], -1)
        words[i, :R * C].view(R, C) = counts, its last column rows[i] | the descriptor bits
                                                    # (counts[:, -1] >> SLOT_BITS << SLOT_BITS)
        hit = hits.view(rounds, W, M, N).amax(-1)            # token t goes to node b
        seen = hit.cumsum(1)
        node_ring = torch.where(hit > 0, seen - 1, -1).view(-1, M)[:T]
        node_counts = seen[:, -1]
    """
    T, R = slot_of.shape
    C = counts.shape[1]
    dev = slot_of.device
    nodes = ranks_per_node is not None
    N = ranks_per_node if nodes else 1
    M = R // N if nodes else 0
    ring = torch.empty((T, R), dtype=torch.int32, device=dev)
    words = torch.empty((rounds, -(-R * C // 4) * 4), dtype=torch.int32, device=dev)
    node_ring = torch.empty((T, M), dtype=torch.int32, device=dev) if nodes else ring
    node_counts = torch.empty((rounds, M), dtype=torch.int32, device=dev) if nodes else words
    key = ("ring_positions", R, C, ring_slots, rounds, N if nodes else None,
           id(flavour))
    values = (slot_of, counts, ring, words, node_ring, node_counts, T)
    if not call_bound(bound, key, values):
        tile = tiles("ring_positions", flavour.compiled, 0)
        launch(bound, key, ring_positions_kernel, (R + M,),
               (slot_of, counts, ring, words, node_ring, node_counts, T, R, C, ring_slots,
                rounds, words.shape[1], N),
               dict(BLOCK_T=tile.block_t, BLOCK_C=triton.next_power_of_2(C),
                    BLOCK_N=triton.next_power_of_2(N), NODES=nodes, **tile.launch_options()),
               ("slot_of", "counts", "ring", "words", "node_ring", "node_counts", "T"))
    return (ring, words, node_ring, node_counts) if nodes else (ring, words)
