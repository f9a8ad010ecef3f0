"""An expert-parallel mixture-of-experts layer on CPU ranks, checked against a dense layer.

    torchrun --nproc-per-node 4 examples/moe_layer.py     # one process per rank (gloo)
    python examples/moe_layer.py --ranks 4                  # the same, ranks started for you

Each rank holds E / R experts. Forward: route, ``buf.dispatch`` the tokens to the experts'
ranks, run the local experts over their contiguous rows, ``buf.combine`` the weighted outputs
home. Backward flows through both ops. Every rank also builds all E experts from the same seed
and computes the dense layer on its own tokens; outputs and gradients must agree.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import moe_comm
from moe_comm.testing.launch import run_ranks

HIDDEN, FFN, EXPERTS, TOPK, TOKENS = 64, 128, 8, 2, 48


def expert_weights(num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All experts' weights, the same on every rank: w1 [E, H, F], w2 [E, F, H]."""
    g = torch.Generator().manual_seed(1234)
    w1 = torch.randn((num_experts, HIDDEN, FFN), generator=g) / HIDDEN ** 0.5
    w2 = torch.randn((num_experts, FFN, HIDDEN), generator=g) / FFN ** 0.5
    return w1, w2


def route(x: torch.Tensor, router: torch.Tensor):
    probs = torch.softmax(x @ router, dim=-1)
    weights, idx = probs.topk(TOPK, dim=-1)
    return weights / weights.sum(-1, keepdim=True), idx


def moe_forward(buf: moe_comm.Buffer, x, router, w1_local, w2_local):
    """Expert-parallel layer: dispatch, local experts on their row groups, combine."""
    weights, idx = route(x, router)
    res = buf.dispatch(x, idx, weights)
    offsets = res.expert_offsets.tolist()
    y = torch.cat([F.gelu(res.x[a:b] @ w1_local[e]) @ w2_local[e]
                   for e, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))])
    return buf.combine(y, res.handle, weights=res.weights)


def dense_forward(x, router, w1, w2):
    """The same layer with every expert in this process."""
    weights, idx = route(x, router)
    out = torch.zeros_like(x)
    for k in range(TOPK):
        h = F.gelu(torch.einsum("th,thf->tf", x, w1[idx[:, k]]))
        out = out + weights[:, k:k + 1] * torch.einsum("tf,tfh->th", h, w2[idx[:, k]])
    return out


def run(rank: int, world_size: int) -> float:
    L = EXPERTS // world_size
    buf = moe_comm.Buffer(dist.group.WORLD, hidden=HIDDEN, num_experts=EXPERTS,
                          max_tokens_per_rank=TOKENS, dtype=torch.float32)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn((TOKENS - 5 * rank, HIDDEN), generator=g)  # ranks differ in tokens
    router = torch.randn((HIDDEN, EXPERTS), generator=torch.Generator().manual_seed(7))
    w1, w2 = expert_weights(EXPERTS)
    mine = slice(rank * L, (rank + 1) * L)

    xe, w1e, w2e = (t.clone().requires_grad_() for t in (x, w1[mine], w2[mine]))
    out = moe_forward(buf, xe, router, w1e, w2e)
    out.square().sum().backward()

    xd, w1d, w2d = (t.clone().requires_grad_() for t in (x, w1, w2))
    dense = dense_forward(xd, router, w1d, w2d)
    dense.square().sum().backward()
    for grad in (w1d.grad, w2d.grad):  # expert gradients sum over every rank's tokens
        dist.all_reduce(grad)

    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xe.grad, xd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w1e.grad, w1d.grad[mine], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w2e.grad, w2d.grad[mine], rtol=1e-4, atol=1e-5)
    buf.close()
    return float((out - dense).detach().abs().max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="ranks to start (without torchrun)")
    args = parser.parse_args()
    for rank, err in run_ranks(args.ranks, run).items():
        print(f"rank {rank}: output and gradients match the dense layer "
              f"(max |out - dense| = {err:.2e})")
    return 0

if __name__ == "__main__":
    sys.exit(main())
