"""Routing layout: where each token goes and where each (token, expert) pair lands.

Equivalent PyTorch for this rank (``R`` ranks, ``L`` local experts per rank)::

    dest = topk_idx // L                                   # [T, K], -1 rows stay negative
    goes = [(dest == d).any(1) for d in range(R)]          # token t is sent to rank d once
    slot_of[:, d] = where(goes[d], goes[d].cumsum(0) - 1, -1)
    counts[d, :L] = bincount(topk_idx[dest == d] - d * L, minlength=L)
    counts[d, L] = goes[d].sum()
    pair_pos[t, k] = #{t' < t : expert topk_idx[t, k] in topk_idx[t']}   # valid pairs only

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


@triton.jit
def routing_layout_kernel(
    topk_idx,  # [T, K] int64: expert ids, -1 for an unused choice
    slot_of,  # [T, R] int32 out: slot of token t in rank d's staging, -1 if not sent to d
    pair_pos,  # [T, K] int32 out: rank of token t among this rank's tokens for that expert
    counts,  # [R, L + 1] int32 out: tokens per expert of rank d, then slots used on d
    T, K, R, L,
    BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr,
):
    d = tl.program_id(0)
    first = d * L
    lane = tl.arange(0, BLOCK_L)
    carry_slots = tl.zeros([1], tl.int32)
    carry_pairs = tl.zeros([BLOCK_L], tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tm = t < T
        onehot = tl.zeros([BLOCK_T, BLOCK_L], tl.int32)
        for k in range(K):
            e = tl.load(topk_idx + t * K + k, mask=tm, other=-1)
            hit = (e >= first) & (e < first + L)
            onehot += ((e - first)[:, None] == lane[None, :]) & hit[:, None]
        goes = tl.max(onehot, axis=1)
        slot = tl.cumsum(goes, axis=0) + carry_slots - 1
        tl.store(slot_of + t * R + d, tl.where(goes > 0, slot, -1), mask=tm)
        carry_slots += tl.sum(goes, axis=0)
        pos_table = tl.cumsum(onehot, axis=0) + carry_pairs[None, :] - 1
        for k in range(K):
            e = tl.load(topk_idx + t * K + k, mask=tm, other=-1)
            hit = (e >= first) & (e < first + L)
            pos = tl.sum(tl.where((e - first)[:, None] == lane[None, :], pos_table, 0), axis=1)
            tl.store(pair_pos + t * K + k, pos, mask=tm & hit)
        carry_pairs += tl.sum(onehot, axis=0)
    tl.store(counts + d * (L + 1) + lane, carry_pairs, mask=lane < L)
    tl.store(counts + d * (L + 1) + L + tl.arange(0, 1), carry_slots)


def routing_layout(topk_idx: torch.Tensor, world_size: int, num_local_experts: int,
                   block_t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launches the layout kernel: ``(slot_of [T, R], pair_pos [T, K], counts [R, L+1])``."""
    T, K = topk_idx.shape
    R, L = world_size, num_local_experts
    dev = topk_idx.device
    slot_of = torch.empty((T, R), dtype=torch.int32, device=dev)
    pair_pos = torch.full((T, K), -1, dtype=torch.int32, device=dev)
    counts = torch.empty((R, L + 1), dtype=torch.int32, device=dev)
    routing_layout_kernel[(R,)](topk_idx, slot_of, pair_pos, counts, T, K, R, L,
                                BLOCK_T=block_t, BLOCK_L=triton.next_power_of_2(L))
    return slot_of, pair_pos, counts


# Specializations compiled for GPU targets by ``moe_comm.kernels.aot`` (CI proves they build).
COMPILE_VARIANTS = [
    (routing_layout_kernel,
     {"topk_idx": "*i64", "slot_of": "*i32", "pair_pos": "*i32", "counts": "*i32",
      "T": "i32", "K": "i32", "R": "i32", "L": "i32"},
     {"BLOCK_T": 64, "BLOCK_L": 32}),
]
