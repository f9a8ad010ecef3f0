"""What the EP-invariant tests run: their data and experts, and the jobs of CPU ranks in
processes (``tests/test_invariant.py``)."""
import random
import time

import torch
import torch.distributed as dist

import moe_comm

H, E, K, N = 128, 8, 4, 32  # hidden, experts, top-k, tokens in all
SCALE = (torch.arange(E, dtype=torch.float32) + 1) / 3


def expert(rows: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Expert ``e[i]`` applied to row i, row by row (no row depends on another)."""
    return (rows.float() * SCALE[e][:, None] + 0.25).to(rows.dtype)


def data(seed: int = 0, dtype=torch.bfloat16):
    """The global batch: rows [N, H], expert ids [N, K] (a choice and a whole token to -1),
    gate weights [N, K]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((N, H), generator=gen).to(dtype)
    w, idx = torch.randn((N, E), generator=gen).softmax(-1).topk(K, -1)
    idx[3, 1] = -1  # a choice that goes nowhere
    idx[5] = -1  # a token that goes nowhere
    return x, idx, w


def experts_of(res, rank: int, L: int) -> torch.Tensor:
    """The global expert of every received row of ``res`` (normal mode)."""
    e = torch.zeros(res.x.shape[0], dtype=torch.long)
    bounds = res.expert_offsets.tolist()
    for lo in range(L):
        e[bounds[lo]:bounds[lo + 1]] = rank * L + lo
    return e


def train_calls(rank, world_size, calls: int, straggle_s: float = 0.0,
                **buffer_kwargs) -> list:
    """``calls`` forward and backward passes through an EP-invariant Buffer (rank r: tokens
    ``r * N/R ...`` of the global batch, new data each call, random delays before each op with
    ``straggle_s``; ``buffer_kwargs``: more of the Buffer's arguments): per call this rank's
    ``(out, grad of x, grad of the gate weights)``."""
    T, L = N // world_size, E // world_size
    delay = random.Random(rank)
    buf = moe_comm.Buffer(dist.group.WORLD, H, E, T, torch.bfloat16, max_topk=K,
                          ep_invariant=True, **buffer_kwargs)
    assert buf.transport == buffer_kwargs.get("transport", buf.transport)
    got = []
    try:
        for it in range(calls):
            x, idx, w = data(100 + it)
            mine = slice(rank * T, (rank + 1) * T)
            x, idx = x[mine].clone().requires_grad_(), idx[mine]
            w = w[mine].clone().requires_grad_()
            time.sleep(delay.uniform(0, straggle_s))
            res = buf.dispatch(x, idx, w)
            time.sleep(delay.uniform(0, straggle_s))
            out = buf.combine(expert(res.x, experts_of(res, rank, L)), res.handle,
                              weights=res.weights)
            (out.float() ** 2).sum().backward()  # d/d out[t]: 2 * out[t], per token
            got.append((out.detach(), x.grad, w.grad))
    finally:
        buf.close()
    return got


def low_latency_across_nodes(rank, world_size, ranks_per_node: int, calls: int) -> list:
    """An EP-invariant low-latency Buffer across nodes through the proxy: per call this rank's
    combined rows."""
    T, L = N // world_size, E // world_size
    buf = moe_comm.Buffer(dist.group.WORLD, H, E, T, torch.bfloat16, max_topk=K,
                          low_latency=True, ranks_per_node=ranks_per_node, transport="nixl",
                          ep_invariant=True)
    got = []
    mine = slice(rank * T, (rank + 1) * T)
    try:
        for it in range(calls):
            x, idx, w = data(200 + it)
            recv, hook = buf.low_latency_dispatch(x[mine], idx[mine], fp8=False,
                                                  return_hook=True)
            hook()
            e = torch.arange(rank * L, (rank + 1) * L)[:, None].expand(L, world_size * T)
            y = expert(recv.x.reshape(-1, H), e.reshape(-1)).view(recv.x.shape)
            out, hook = buf.low_latency_combine(y, idx[mine], w[mine], recv.handle,
                                                return_hook=True)
            hook()
            got.append(out)
    finally:
        buf.close()
    return got


def bytes_across_nodes(rank, world_size, ranks_per_node: int) -> dict:
    """One call of an EP-invariant Buffer flat through the proxy: the combine bytes the transport
    was asked to move, and the minimum: one row and two floats per pair this rank holds for a
    home on another node."""
    T, L = N // world_size, E // world_size
    buf = moe_comm.Buffer(dist.group.WORLD, H, E, T, torch.bfloat16, max_topk=K,
                          ranks_per_node=ranks_per_node, transport="nixl", ep_invariant=True)
    try:
        x, idx, w = data(400)
        mine = slice(rank * T, (rank + 1) * T)
        res = buf.dispatch(x[mine], idx[mine], w[mine])
        buf.combine(expert(res.x, experts_of(res, rank, L)), res.handle, weights=res.weights)
        remote = (res.src_rank >= 0) & (res.src_rank // ranks_per_node != rank // ranks_per_node)
        moved = buf.internode_bytes().get("combine", [])
        return {"moved": sum(moved), "want": int(remote.sum()) * (2 * H + 8),
                "hierarchical": buf.hierarchical}
    finally:
        buf.close()
