"""Two training steps of an MoE layer at EP 2 and at EP 4: with ``ep_invariant=True`` the
losses and every gradient have the same bits; with the default combine they do not.

    python examples/invariant_training.py            # EP 2 and EP 4, both combines
    python examples/invariant_training.py --ranks 1 2 4 8

The layer: ``E`` experts, each ``y = x * a[e] + b[e]`` per channel (an expert whose output row
depends on its input row alone; a matrix product's rows can depend on how many rows it
multiplies), top-``K`` routing from fixed logits, gate weights that take gradients. Every
rank holds ``E / R`` experts and ``N / R`` tokens of the global batch; the loss is the sum of
every token's ``((out - target) ** 2).sum()``, added in global token order. A step: dispatch,
experts, combine (bf16), the loss, its backward (the gradients of ``a``, ``b``, of the tokens and
of the gate weights), then SGD on the experts. Everything a step depends on is gathered on rank
0 and compared across EP sizes bit for bit.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

import moe_comm

N, H, E, K = 64, 64, 8, 4  # tokens in all, hidden, experts, top-k
LR = 0.05


def batch(step: int):
    """The step's global batch: tokens, targets, expert ids and gate weights (the same on every
    rank)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn((N, H), generator=gen).to(torch.bfloat16)
    target = torch.randn((N, H), generator=gen)
    gates, idx = torch.randn((N, E), generator=gen).softmax(-1).topk(K, -1)
    return x, target, idx, gates


def gather(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's ``t`` stacked in rank order (the same shape on every rank)."""
    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def train(rank: int, world_size: int, invariant: bool) -> dict | None:
    torch.set_num_threads(1)
    T, L = N // world_size, E // world_size
    gen = torch.Generator().manual_seed(0)  # the same parameters at every EP size
    a = torch.rand((E, H), generator=gen) + 0.5
    b = torch.randn((E, H), generator=gen) * 0.1
    buf = moe_comm.Buffer(dist.group.WORLD, hidden=H, num_experts=E, max_tokens_per_rank=T,
                          dtype=torch.bfloat16, max_topk=K, ep_invariant=invariant)
    seen: dict[str, list] = {"loss": [], "grad_a": [], "grad_b": [], "grad_x": [],
                             "grad_gates": []}
    for step in range(2):
        x, target, idx, gates = batch(step)
        mine = slice(rank * T, (rank + 1) * T)
        x, target, idx = x[mine].clone().requires_grad_(), target[mine], idx[mine]
        gates = gates[mine].clone().requires_grad_()
        local_a = a[rank * L:(rank + 1) * L].clone().requires_grad_()
        local_b = b[rank * L:(rank + 1) * L].clone().requires_grad_()
        res = buf.dispatch(x, idx, gates)
        bounds = res.expert_offsets.tolist()
        y = torch.cat([(res.x[lo:hi].float() * local_a[e] + local_b[e]).to(torch.bfloat16)
                       for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))])
        out = buf.combine(y, res.handle, weights=res.weights)
        per_token = ((out.float() - target) ** 2).sum(-1)
        per_token.sum().backward()  # d loss / d out[t] is per token: no sum order in it
        losses = gather(per_token.detach(), world_size)
        total = torch.zeros(1)
        for v in losses:  # the global loss, added in global token order
            total = total + v
        seen["loss"].append(total)
        seen["grad_x"].append(gather(x.grad, world_size))
        seen["grad_gates"].append(gather(gates.grad, world_size))
        seen["grad_a"].append(gather(local_a.grad, world_size))
        seen["grad_b"].append(gather(local_b.grad, world_size))
        with torch.no_grad():  # SGD on the experts this rank holds, then everyone's copy
            a[rank * L:(rank + 1) * L] -= LR * local_a.grad
            b[rank * L:(rank + 1) * L] -= LR * local_b.grad
            a.copy_(gather(a[rank * L:(rank + 1) * L], world_size))
            b.copy_(gather(b[rank * L:(rank + 1) * L], world_size))
    buf.close()
    return seen if rank == 0 else None


def report(runs: dict[int, dict], invariant: bool) -> bool:
    """Prints each step's loss at every EP size and whether all agree bit for bit."""
    sizes = sorted(runs)
    first = runs[sizes[0]]
    agree = True
    name = "ep_invariant=True" if invariant else "default combine  "
    for step in range(2):
        losses = "  ".join(f"EP {R}: {runs[R]['loss'][step].item():.10f}" for R in sizes)
        diffs = []
        for key in first:
            worst = sum(int((runs[R][key][step].view(torch.uint8)
                             != first[key][step].view(torch.uint8)).sum()) for R in sizes[1:])
            if worst:
                diffs.append(f"{key} ({worst} bytes)")
        agree = agree and not diffs
        print(f"{name} step {step}  {losses}  "
              + ("losses and gradients equal bit for bit" if not diffs
                 else "differ: " + ", ".join(diffs)), flush=True)
    return agree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    from moe_comm.testing.launch import parallel_launch

    status = 0
    for invariant in (True, False):
        runs = {R: parallel_launch(R, train, invariant)[0] for R in args.ranks}
        agree = report(runs, invariant)
        if invariant and not agree:
            status = 1
    print("OK: with ep_invariant=True every EP size trains to the same bits" if status == 0
          else "FAIL: ep_invariant=True gave different bits at different EP sizes")
    return status


if __name__ == "__main__":
    sys.exit(main())
