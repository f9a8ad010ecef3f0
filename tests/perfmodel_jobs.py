"""Jobs for the performance model's byte check: ``job(rank, world_size, ...)`` on CPU ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist

import moe_comm


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def _peer_delta(after: dict, before: dict) -> dict:
    return {c: [a - b for a, b in zip(v, before.get(c, [0] * len(v)), strict=True)]
            for c, v in after.items()}


def link_bytes(rank, world_size, ids: torch.Tensor, hidden: int, num_experts: int,
               ranks_per_node: int, hierarchical: bool, low_latency: bool, fp8: bool,
               dispatch_dtype: str | None = None, combine_dtype: str | None = None,
               staging_bytes: int | None = None) -> dict:
    """One dispatch and one combine of this rank's rows of the global routing ``ids``
    [world_size * T, K] (``staging_bytes``: the Buffer's, so a call may run in rounds); what
    the kernels and the transport counted in each phase:
    {"dispatch": {...}, "combine": {...}}, each the stats() delta plus ``per_peer`` (the
    transport's data bytes per destination rank, across nodes)."""
    T, K = ids.shape[0] // world_size, ids.shape[1]
    idx = ids[rank * T:(rank + 1) * T].clone()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn((T, hidden), generator=g).to(torch.bfloat16)
    w = torch.rand((T, K), generator=g)
    nodes = world_size // ranks_per_node
    kwargs = dict(hidden=hidden, num_experts=num_experts, max_tokens_per_rank=max(T, 1),
                  dtype=torch.bfloat16, max_topk=K, low_latency=low_latency,
                  staging_bytes=staging_bytes)
    if nodes > 1:
        kwargs.update(ranks_per_node=ranks_per_node, transport="nixl",
                      hierarchical=hierarchical)
    with moe_comm.Buffer(dist.group.WORLD, **kwargs) as buf:
        s0, p0 = buf.stats(), buf.internode_bytes()
        if low_latency:
            recv, hook = buf.low_latency_dispatch(x, idx, fp8=fp8, return_hook=True,
                                                  dispatch_dtype=dispatch_dtype)
            hook()
        else:
            res = buf.dispatch(x, idx, w, fp8=fp8 or None, dispatch_dtype=dispatch_dtype)
        s1, p1 = buf.stats(), buf.internode_bytes()
        if low_latency:
            y = torch.zeros((*recv.x.shape[:2], hidden), dtype=torch.bfloat16)
            buf.low_latency_combine(y, idx, w, recv.handle, combine_dtype=combine_dtype)
        else:
            buf.combine(torch.zeros((res.x.shape[0], hidden), dtype=torch.bfloat16),
                        res.handle, res.weights, combine_dtype=combine_dtype)
        s2, p2 = buf.stats(), buf.internode_bytes()
        dist.barrier()
    return {"dispatch": {**_delta(s1, s0), "per_peer": _peer_delta(p1, p0)},
            "combine": {**_delta(s2, s1), "per_peer": _peer_delta(p2, p1)}}
