"""Routing layout: where each token goes and where each (token, expert) pair lands.

Equivalent PyTorch for this rank (``R`` ranks, ``L`` local experts per rank)::

    bad = ((topk_idx < -1) | (topk_idx >= E)).any(1) | repeated_expert_in_row(topk_idx)
    topk_idx = where(bad[:, None], -1, topk_idx)           # a bad row goes nowhere
    topk_idx = where(excluded[topk_idx // L] | excluded[me], -1, topk_idx)  # fault tolerance
    dest = topk_idx // L                                   # [T, K], -1 rows stay negative
    goes = [(dest == d).any(1) for d in range(R)]          # token t is sent to rank d once
    slot_of[:, d] = where(goes[d], goes[d].cumsum(0) - 1, -1)
    counts[d, :L] = bincount(topk_idx[dest == d] - d * L, minlength=L)
    counts[d, L] = goes[d].sum()
    pair_pos[t, k] = #{t' < t : expert topk_idx[t, k] in topk_idx[t']}   # valid pairs only

The first bad row is recorded in the error record (code, token, offending id), which the host
raises as ValueError without reading ``topk_idx`` itself (no host synchronisation).

Slots and positions follow token order, which makes the receiver's output order (source rank,
then source token) fall out without any sort.

One program per destination rank scans the tokens in tiles of ``BLOCK_T`` carrying running
counts, so no program depends on another. Reads ``T*K*8`` bytes per program; writes
``T*(R + K)*4 + R*(L+1)*4`` bytes in all.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .comm import BAD_EXPERT_ID, INPUT_RECORD, REPEATED_EXPERT, Flavour, record_error
from .tiles import tiles


@triton.jit
def checked_ids(topk_idx, t, tm, K, E, BLOCK_K: tl.constexpr):
    """``(ids [BLOCK_T, BLOCK_K] int32, bad [BLOCK_T], code [BLOCK_T], value [BLOCK_T])``:
    the expert ids of tokens ``t`` (-1 where unused or ``k >= K``); a row with an id outside
    ``[-1, E)`` or an expert twice is bad: all its ids become -1, ``code`` says why and
    ``value`` is the offending id."""
    kk = tl.arange(0, BLOCK_K)
    m2 = tm[:, None] & (kk < K)[None, :]
    ids = tl.load(topk_idx + t.to(tl.int64)[:, None] * K + kk[None, :], mask=m2, other=-1)
    out_of_range = m2 & ((ids < -1) | (ids >= E))
    first_k = tl.min(tl.where(out_of_range, kk[None, :], BLOCK_K), axis=1)
    range_value = tl.sum(tl.where(kk[None, :] == first_k[:, None], ids, 0), axis=1)
    repeated_value = tl.full(t.shape, -1, tl.int64)
    for k in range(K):
        e_k = tl.sum(tl.where(kk[None, :] == k, ids, 0), axis=1)
        again = tl.max(((ids == e_k[:, None]) & (kk[None, :] > k) & m2).to(tl.int32), axis=1)
        repeated_value = tl.where((again > 0) & (e_k >= 0) & (repeated_value < 0), e_k,
                                  repeated_value)
    bad_range = first_k < BLOCK_K
    bad = bad_range | (repeated_value >= 0)
    code = tl.where(bad_range, BAD_EXPERT_ID, REPEATED_EXPERT)
    value = tl.where(bad_range, range_value, repeated_value)
    ids = tl.where(bad[:, None], -1, ids).to(tl.int32)
    return ids, bad, code, value


@triton.jit
def record_first_bad(errors, t, bad, code, value, T):
    """Records the first bad row of this tile (if any) in the input part of the error record."""
    first = tl.min(tl.where(bad, t, T), axis=0)
    if first < T:
        c = tl.sum(tl.where(t == first, code, 0), axis=0)
        v = tl.sum(tl.where(t == first, value, 0), axis=0)
        record_error(errors, INPUT_RECORD, c, first, v)


@triton.jit(do_not_specialize=["errors_addr", "local_base", "T", "me"])
def routing_layout_kernel(
    topk_idx,  # [T, K] int64: expert ids, -1 for an unused choice
    slot_of,  # [T, R] int32 out: slot of token t in rank d's staging, -1 if not sent to d
    pair_pos,  # [T, K] int32 out: rank of token t among this rank's tokens for that expert
    counts,  # [R, L + 1] int32 out: tokens per expert of rank d, then slots used on d
    errors_addr: tl.int64,  # error record: the first bad row of topk_idx
    mask_off: tl.int64, local_base: tl.int64,  # FT: the mask words in this rank's segment
    T: tl.int32, K: tl.int32, R: tl.int32, L: tl.int32, E: tl.int32, me: tl.int32,
    FT: tl.constexpr,  # fault tolerance: nothing goes to an excluded rank, or from one
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr,
):
    d = tl.program_id(0)
    first = d * L
    live = tl.full([BLOCK_T], 1, tl.int32)  # a vector: the interpreter mis-broadcasts a scalar
    if FT:
        mask = (local_base + mask_off).to(tl.pointer_type(tl.int64))
        lanes = tl.zeros([BLOCK_T], tl.int32)
        live = ((tl.load(mask + d + lanes) == 0) & (tl.load(mask + me + lanes) == 0)).to(tl.int32)
    lane = tl.arange(0, BLOCK_L)
    kk = tl.arange(0, BLOCK_K)
    carry_slots = tl.zeros([1], tl.int32)
    carry_pairs = tl.zeros([BLOCK_L], tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < T
        ids, bad, code, value = checked_ids(topk_idx, t, tm, K, E, BLOCK_K)
        if d == 0:
            record_first_bad(errors_addr.to(tl.pointer_type(tl.int64)), t, bad, code, value, T)
        onehot = tl.zeros([BLOCK_T, BLOCK_L], tl.int32)
        for k in range(K):
            e = tl.sum(tl.where(kk[None, :] == k, ids, 0), axis=1)
            hit = (e >= first) & (e < first + L) & (live != 0)
            onehot += ((e - first)[:, None] == lane[None, :]) & hit[:, None]
        goes = tl.max(onehot, axis=1)
        slot = tl.cumsum(goes, axis=0) + carry_slots - 1
        tl.store(slot_of + t * R + d, tl.where(goes > 0, slot, -1), mask=tm)
        carry_slots += tl.sum(goes, axis=0)
        pos_table = tl.cumsum(onehot, axis=0) + carry_pairs[None, :] - 1
        for k in range(K):
            e = tl.sum(tl.where(kk[None, :] == k, ids, 0), axis=1)
            hit = (e >= first) & (e < first + L) & (live != 0)
            pos = tl.sum(tl.where((e - first)[:, None] == lane[None, :], pos_table, 0), axis=1)
            tl.store(pair_pos + t * K + k, pos, mask=tm & hit)
        carry_pairs += tl.sum(onehot, axis=0)
    tl.store(counts + d * (L + 1) + lane, carry_pairs, mask=lane < L)
    tl.store(counts + d * (L + 1) + L + tl.arange(0, 1), carry_slots)


def routing_layout(topk_idx: torch.Tensor, world_size: int, num_local_experts: int,
                   flavour: Flavour, rank: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launches the layout kernel: ``(slot_of [T, R], pair_pos [T, K], counts [R, L+1])``;
    bad rows of ``topk_idx`` go nowhere and the first is recorded at ``flavour.errors_addr``;
    with ``flavour.fault_tolerant`` nothing goes to a rank excluded in the mask words (read on
    the device: as if its experts' ids were -1), nor anywhere once ``rank`` itself is excluded
    (the fence against its late writes on GPUs, where the host does not read the mask)."""
    T, K = topk_idx.shape
    R, L = world_size, num_local_experts
    tile = tiles("routing_layout", flavour.compiled, 0)
    dev = topk_idx.device
    slot_of = torch.empty((T, R), dtype=torch.int32, device=dev)
    pair_pos = torch.full((T, K), -1, dtype=torch.int32, device=dev)
    counts = torch.empty((R, L + 1), dtype=torch.int32, device=dev)
    routing_layout_kernel[(R,)](topk_idx, slot_of, pair_pos, counts, flavour.errors_addr,
                                flavour.mask_off, flavour.local_base, T, K, R, L, R * L, rank,
                                FT=flavour.fault_tolerant, BLOCK_T=tile.block_t,
                                BLOCK_K=triton.next_power_of_2(max(K, 1)),
                                BLOCK_L=triton.next_power_of_2(L), **tile.launch_options())
    return slot_of, pair_pos, counts


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
