"""Train a small MoE transformer with expert parallelism on CPU ranks, and check every step
against the same model trained in one process with dense experts from the same seed.

    torchrun --nproc-per-node 4 examples/train_moe_ep.py     # one process per rank (gloo)
    python examples/train_moe_ep.py --ranks 4                 # the same, ranks started for you
    python examples/train_moe_ep.py --ranks 2 --steps 20      # a quick run

Model: token embedding, ``--layers`` pre-norm blocks of causal self-attention and an MoE
feed-forward (``--experts`` experts, top-2 softmax router), output head. Task (synthetic):
predict ``PERM[x[t-1]]`` from the tokens up to ``t``, ``PERM`` a fixed permutation of the
vocabulary: attention has to fetch the previous token and the feed-forward to look it up.

Expert parallelism: rank r holds experts ``r*E/R .. (r+1)*E/R - 1`` of every MoE layer; each
rank trains on its own slice of the global batch (data parallel for everything else).
``moe_comm.Buffer.dispatch`` sends each token to the ranks of its two experts,
``Buffer.combine`` brings the gate-weighted outputs home; both are differentiable, so the
backward pass moves the gradients the same way. Non-expert gradients are averaged over the
ranks with ``all_reduce``; an expert's gradient already sums every rank's tokens and is divided
by R, so each step optimises the mean loss over the global batch.

The dense model is the same network with all experts in one process, trained on the whole
global batch with the same optimizer. Its loss must equal the expert-parallel loss at every
step up to fp32 rounding (the two sum a token's expert outputs, and an expert's gradient over
tokens, in different orders); the run fails otherwise.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import moe_comm

VOCAB, SEQ, HIDDEN, HEADS, FFN, TOPK = 32, 16, 32, 4, 64, 2
LOSS_RTOL = 1e-4  # fp32 rounding differences, grown over the training run, stay far below this


class MoEFeedForward(nn.Module):
    """Top-2 MoE feed-forward over ``num_experts`` experts, of which this module holds
    ``experts[first:first + local]``; ``buf`` is None for the dense (all experts) version."""

    def __init__(self, num_experts: int, first: int, local: int, gen: torch.Generator):
        super().__init__()
        self.num_experts, self.first, self.local = num_experts, first, local
        self.router = nn.Parameter(torch.randn((HIDDEN, num_experts), generator=gen) * 0.1)
        w1 = torch.randn((num_experts, HIDDEN, FFN), generator=gen) / HIDDEN ** 0.5
        w2 = torch.randn((num_experts, FFN, HIDDEN), generator=gen) / FFN ** 0.5
        self.w1 = nn.Parameter(w1[first:first + local].clone())
        self.w2 = nn.Parameter(w2[first:first + local].clone())
        self.buf: moe_comm.Buffer | None = None

    def route(self, x: torch.Tensor):
        probs = torch.softmax(x @ self.router, dim=-1)
        weights, idx = probs.topk(TOPK, dim=-1)
        return idx, weights / weights.sum(-1, keepdim=True)

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return F.gelu(rows @ self.w1[e]) @ self.w2[e]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, HIDDEN)
        idx, weights = self.route(x)
        if self.buf is None:  # dense: every expert here
            out = torch.zeros_like(x)
            for e in range(self.num_experts):
                tok, k = (idx == e).nonzero(as_tuple=True)
                out = out.index_add(0, tok, self.expert(e, x[tok]) * weights[tok, k, None])
            return out.reshape(shape)
        res = self.buf.dispatch(x.contiguous(), idx, weights)
        bounds = res.expert_offsets.tolist()
        y = torch.cat([self.expert(e, res.x[a:b])
                       for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))])
        return self.buf.combine(y, res.handle, weights=res.weights).reshape(shape)


class Block(nn.Module):
    def __init__(self, num_experts: int, first: int, local: int, gen: torch.Generator):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv = nn.Parameter(torch.randn((HIDDEN, 3 * HIDDEN), generator=gen) / HIDDEN ** 0.5)
        self.proj = nn.Parameter(torch.randn((HIDDEN, HIDDEN), generator=gen) / HIDDEN ** 0.5)
        self.moe = MoEFeedForward(num_experts, first, local, gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = (self.norm1(x) @ self.qkv).split(HIDDEN, dim=-1)
        heads = [t.reshape(B, S, HEADS, HIDDEN // HEADS).transpose(1, 2) for t in (q, k, v)]
        att = F.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + att.transpose(1, 2).reshape(B, S, HIDDEN) @ self.proj
        return x + self.moe(self.norm2(x))


class TinyMoETransformer(nn.Module):
    """The whole network; ``rank``/``world_size`` pick the experts this copy holds."""

    def __init__(self, layers: int, num_experts: int, seed: int, rank: int = 0,
                 world_size: int = 1):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)  # same draws on every rank and dense
        local = num_experts // world_size
        self.embed = nn.Parameter(torch.randn((VOCAB, HIDDEN), generator=gen) * 0.5)
        self.blocks = nn.ModuleList(Block(num_experts, rank * local, local, gen)
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Parameter(torch.randn((HIDDEN, VOCAB), generator=gen) / HIDDEN ** 0.5)

    def moe_layers(self) -> list[MoEFeedForward]:
        return [block.moe for block in self.blocks]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed[tokens]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.head


def global_batch(step: int, sequences: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's whole batch, the same on every rank: tokens and targets ``[sequences, SEQ]``."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, VOCAB, (sequences, SEQ), generator=gen)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed + 12345))
    targets = perm[torch.roll(tokens, 1, dims=1)]
    targets[:, 0] = perm[tokens[:, 0]]  # no previous token: its own image
    return tokens, targets


def loss_fn(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))


def is_expert_param(name: str) -> bool:
    return name.endswith(("moe.w1", "moe.w2"))


def train_ep(rank: int, world_size: int, args: argparse.Namespace) -> list[float]:
    """Expert-parallel training on this rank; returns the global mean loss of every step."""
    torch.set_num_threads(1)
    if args.experts % world_size:
        raise SystemExit(f"--experts {args.experts} must be divisible by {world_size} ranks")
    model = TinyMoETransformer(args.layers, args.experts, args.seed, rank, world_size)
    per_rank = args.batch
    buf = moe_comm.Buffer(dist.group.WORLD, hidden=HIDDEN, num_experts=args.experts,
                          max_tokens_per_rank=per_rank * SEQ, dtype=torch.float32,
                          max_topk=TOPK)
    for layer in model.moe_layers():  # one workspace serves every layer
        layer.buf = buf
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses, start = [], time.monotonic()
    for step in range(args.steps):
        tokens, targets = global_batch(step, per_rank * world_size, args.seed)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = loss_fn(model, tokens[mine], targets[mine])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for name, p in model.named_parameters():
            if is_expert_param(name):
                p.grad /= world_size  # already summed over every rank's tokens
            else:
                dist.all_reduce(p.grad)
                p.grad /= world_size
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world_size)
        if rank == 0 and (step % args.print_every == 0 or step == args.steps - 1):
            print(f"[expert-parallel, {world_size} ranks] step {step:4d}  loss "
                  f"{losses[-1]:.4f}  ({time.monotonic() - start:.1f} s)", flush=True)
    buf.close()
    return losses


def train_dense(world_size: int, args: argparse.Namespace) -> list[float]:
    """The same model with every expert in this process, on the whole global batch."""
    torch.set_num_threads(1)
    model = TinyMoETransformer(args.layers, args.experts, args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses, start = [], time.monotonic()
    for step in range(args.steps):
        tokens, targets = global_batch(step, args.batch * world_size, args.seed)
        loss = loss_fn(model, tokens, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % args.print_every == 0 or step == args.steps - 1:
            print(f"[dense, one process]        step {step:4d}  loss {losses[-1]:.4f}  "
                  f"({time.monotonic() - start:.1f} s)", flush=True)
    return losses


def compare(ep: list[float], dense: list[float]) -> int:
    diffs = [abs(a - b) / max(1.0, abs(b)) for a, b in zip(ep, dense)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    print(f"loss {ep[0]:.4f} -> {ep[-1]:.4f} (expert-parallel), {dense[0]:.4f} -> "
          f"{dense[-1]:.4f} (dense); largest relative difference {diffs[worst]:.2e} at step "
          f"{worst}")
    if diffs[worst] > LOSS_RTOL:
        print(f"FAIL: expert-parallel and dense losses differ by more than {LOSS_RTOL:g}")
        return 1
    if len(ep) >= 50 and not ep[-1] < 0.7 * ep[0]:
        print("FAIL: the loss did not fall")
        return 1
    print("OK: expert-parallel training equals dense training (fp32 tolerance)")
    return 0


def _torchrun_main(args: argparse.Namespace) -> int:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ep = train_ep(rank, world_size, args)
    status = 0
    if rank == 0:
        status = compare(ep, train_dense(world_size, args))
    flag = torch.tensor([status])
    dist.broadcast(flag, 0)
    # Free every object that still refers to the process group (the model's Buffer) before
    # destroying it; a gloo group released only at interpreter exit can abort the process.
    gc.collect()
    dist.destroy_process_group()
    return int(flag)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="ranks to start (without torchrun)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--print-every", type=int, default=25)
    args = parser.parse_args()
    if "RANK" in os.environ:  # started by torchrun
        return _torchrun_main(args)
    from moe_comm.testing.launch import parallel_launch

    ep = parallel_launch(args.ranks, train_ep, args)[0]
    return compare(ep, train_dense(args.ranks, args))


if __name__ == "__main__":
    sys.exit(main())
