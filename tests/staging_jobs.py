"""Jobs on CPU ranks for a normal mode whose staging is bounded (``staging_bytes``): every call
runs in rounds through rings of a few slots per source."""
from __future__ import annotations

import random
import time

import torch.distributed as dist

import moe_comm
from cases import Case, expert_fn, make_inputs
from moe_comm.workspace import staging_slot_bytes
from rank_jobs import _digest, check_against_oracle, kernel_waits


def slots_budget(case: Case, slots: int, outboxes: bool = False,
                 ranks_per_node: int | None = None) -> int:
    """The ``staging_bytes`` that pays for ``slots`` slots per source of ``case`` (``outboxes``:
    of a Buffer across nodes through the proxy; with ``ranks_per_node``, hierarchical)."""
    return slots * staging_slot_bytes(case.world_size, case.hidden, case.topk, case.dtype,
                                      outboxes, ranks_per_node)


def streamed_case(rank, world_size, case: Case, slots: int | None, iterations: int = 1,
                  straggle_s: float = 0.0, in_kernels: bool = False) -> dict:
    """Dispatch + combine ``iterations`` times (new routing each time, random per-rank delays
    around each op), each result checked against the all-ranks oracle; ``slots`` None stages
    the whole batch. Returns the rounds, one digest per iteration and the byte counters."""
    delay = random.Random(1000 * case.seed + rank)
    digests = []
    budget = None if slots is None else slots_budget(case, slots)
    with kernel_waits(in_kernels), moe_comm.Buffer(
            dist.group.WORLD, hidden=case.hidden, num_experts=case.num_experts,
            max_tokens_per_rank=case.max_tokens, dtype=case.dtype, max_topk=case.topk,
            staging_bytes=budget) as buf:
        for it in range(iterations):
            xs, idxs, ws = make_inputs(case, it)
            w = ws[rank] if ws is not None else None
            time.sleep(delay.uniform(0, straggle_s))
            res = buf.dispatch(xs[rank], idxs[rank], w, expert_alignment=case.alignment)
            time.sleep(delay.uniform(0, straggle_s))
            out = buf.combine(expert_fn(res.x, res.expert_offsets), res.handle,
                              weights=res.weights)
            check_against_oracle(rank, case, it, res, out, xs, idxs, ws)
            digests.append(_digest(res.x, res.weights, res.src_rank, res.src_token, out))
        return {"rounds": buf.rounds, "ring_slots": buf.ring_slots, "digests": digests,
                "stats": buf.stats(), "launches": dict(buf.launches),
                "staging_bytes": buf.staging_bytes, "workspace_bytes": buf.workspace_bytes}
