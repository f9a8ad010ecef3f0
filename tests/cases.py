"""Self-checking inputs: every rank builds every rank's inputs from one seed.

A rank therefore knows the expected result of a collective op without communicating: it runs
``moe_comm.reference.dispatch_all`` on the inputs of all ranks and takes its own entry.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    world_size: int
    num_experts: int
    hidden: int
    topk: int
    tokens: tuple[int, ...]  # tokens per rank
    dtype: torch.dtype = torch.bfloat16
    routing: str = "uniform"  # uniform | zipf | one_expert | empty_rank | all_invalid
    alignment: int = 1
    weights: bool = True
    seed: int = 0

    @property
    def max_tokens(self) -> int:
        return max(max(self.tokens), 1)

    def __str__(self) -> str:
        return (f"R{self.world_size}-E{self.num_experts}-H{self.hidden}-K{self.topk}-"
                f"T{'.'.join(map(str, self.tokens))}-{str(self.dtype)[6:]}-{self.routing}-"
                f"a{self.alignment}{'' if self.weights else '-noweights'}")


def _route(g: torch.Generator, case: Case, rank: int, T: int) -> torch.Tensor:
    E, K = case.num_experts, case.topk
    if T == 0:
        return torch.empty((0, K), dtype=torch.int64)
    if case.routing == "one_expert":  # every token picks expert 0 (and K-1 others at random)
        idx = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64),
                                      torch.randperm(E - 1, generator=g)[:K - 1] + 1])
                           for _ in range(T)])
    elif case.routing == "zipf":  # heavy skew towards low expert ids, without repeats in a row
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
        idx = torch.stack([torch.multinomial(p, K, replacement=False, generator=g)
                           for _ in range(T)])
    else:
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if case.routing == "empty_rank":  # nobody routes to the last rank's experts
        L = E // case.world_size
        idx = torch.where(idx >= E - L, -1, idx)
    if case.routing == "all_invalid":
        idx = torch.full_like(idx, -1)
    if T > 2 and case.routing != "all_invalid":  # some unused choices and one all -1 row
        drop = torch.rand(idx.shape, generator=g) < 0.1
        idx = torch.where(drop, -1, idx)
        idx[(rank + 1) % T] = -1
    return idx.to(torch.int64)


def make_inputs(case: Case, iteration: int = 0):
    """``(xs, topk_idxs, topk_weights)``: lists over ranks; rows stamped with the source rank."""
    g = torch.Generator().manual_seed(case.seed * 1_000_003 + iteration)
    xs, idxs, ws = [], [], []
    for rank, T in enumerate(case.tokens):
        x = torch.randn((T, case.hidden), generator=g, dtype=torch.float32)
        x[:, 0] = rank  # the payload says where it came from
        xs.append(x.to(case.dtype))
        idxs.append(_route(g, case, rank, T))
        ws.append(torch.rand((T, case.topk), generator=g, dtype=torch.float32))
    return xs, idxs, (ws if case.weights else None)


def expert_fn(x: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """A cheap, row-dependent stand-in for the experts: ``y = x * (1 + e / 8) + e``."""
    counts = expert_offsets.diff()
    e = torch.repeat_interleave(torch.arange(counts.numel()), counts).to(torch.float32)
    return (x.float() * (1 + e[:, None] / 8) + e[:, None]).to(x.dtype)


def nvfp4_global_scale_oracle(x: torch.Tensor) -> torch.Tensor:
    """NVFP4's documented global scale written from docs/FORMATS.md ("NVFP4") alone, element by
    element in Python and numpy's float32 (no code shared with the product): ``max(amax of the
    finite |x|, 1e-4) / (448 * 6)`` as one IEEE float32 division; [1] float32."""
    import math

    import numpy as np

    amax = max((abs(v) for v in x.double().flatten().tolist() if math.isfinite(v)), default=0.0)
    amax = max(np.float32(amax), np.float32(1e-4))
    return torch.tensor([np.float32(amax) / np.float32(448 * 6)], dtype=torch.float32)


def names_rank(message: str, peer: int) -> bool:
    """Whether an error's text names ``peer`` as the rank this one waited for: a timeout
    ("waiting for rank p ") or, across nodes, the transport towards it ("transport to rank p
    ")."""
    return f"waiting for rank {peer} " in message or f"transport to rank {peer} " in message
