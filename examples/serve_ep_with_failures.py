"""Keep serving when a rank dies: decode steps on 4 CPU ranks, one killed mid-run.

    python examples/serve_ep_with_failures.py                  # both modes, rank 2 dies
    python examples/serve_ep_with_failures.py --mode low_latency --kill 1 --kill-step 5

Each mode gets 4 fresh rank processes with a fault-tolerant Buffer
(``Buffer(..., fault_tolerant=True)``). Every step routes a batch of tokens to 8 experts (2 per
rank), dispatches, runs the local experts (``y = x * scale[e] + bias[e]``), combines. At step
``--kill-step`` rank ``--kill`` kills itself (SIGKILL, no goodbye); the others notice (at once:
its process is gone; a rank that only went silent would take the timeout), exclude it in the
shared mask and carry on. Every step is checked bit for bit against a local reference in which
the dead rank's experts are dropped from the step it died in (no renormalisation: a token whose
experts were all there comes back as zeros). Rank 0 prints one line per step (the mask as it
stands after the step) and the time from the kill to the first step completed without the dead
rank.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import moe_comm
from moe_comm.testing.launch import RankPool

HIDDEN, EXPERTS, TOPK, TOKENS = 128, 8, 2, 8


def expert_params():
    g = torch.Generator().manual_seed(7)
    return torch.rand(EXPERTS, generator=g) + 0.5, torch.randn(EXPERTS, generator=g)


def expert(x: torch.Tensor, e: int) -> torch.Tensor:
    scale, bias = expert_params()
    return (x.float() * scale[e] + bias[e]).to(x.dtype)


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn((TOKENS, HIDDEN), generator=g).to(torch.bfloat16)
    scores = torch.randn((TOKENS, EXPERTS), generator=g).softmax(-1)
    w, idx = scores.topk(TOPK, dim=-1)
    return x, idx, w


def expected(x, idx, w, alive: list[bool], ranks: int, low_latency: bool) -> torch.Tensor:
    """What the survivors must get: choices on dead ranks dropped. Low latency sums the
    choices in order (fp32); the normal mode rounds each expert rank's partial sum first."""
    L = EXPERTS // ranks
    if low_latency:
        acc = torch.zeros(x.shape, dtype=torch.float32)
        for k in range(TOPK):
            for t in range(x.shape[0]):
                e = int(idx[t, k])
                if alive[e // L]:
                    acc[t] += w[t, k] * expert(x[t:t + 1], e)[0].float()
        return acc.to(x.dtype)
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for r in range(ranks):
        if not alive[r]:
            continue
        part = torch.zeros(x.shape, dtype=torch.float32)
        for k in range(TOPK):
            for t in range(x.shape[0]):
                e = int(idx[t, k])
                if e // L == r:
                    part[t] += w[t, k] * expert(x[t:t + 1], e)[0].float()
        acc += part.to(x.dtype).float()
    return acc.to(x.dtype)


def step_low_latency(buf, x, idx, w):
    recv, _ = buf.low_latency_dispatch(x, idx, fp8=False)
    y = torch.zeros_like(recv.x)
    for e in range(buf.num_local_experts):
        n = int(recv.count[e])
        y[e, :n] = expert(recv.x[e, :n], buf.rank * buf.num_local_experts + e)
    out, _ = buf.low_latency_combine(y, idx, w, recv.handle)
    return out


def step_normal(buf, x, idx, w):
    res = buf.dispatch(x, idx, w)
    offsets = res.expert_offsets.tolist()
    y = torch.cat([expert(res.x[a:b], buf.rank * buf.num_local_experts + e)
                   for e, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))])
    return buf.combine(y, res.handle, weights=res.weights)


def serve(rank: int, world_size: int, mode: str, steps: int, kill: int, kill_step: int,
          timeout_s: float, stamp: str) -> list[str]:
    low_latency = mode == "low_latency"
    buf = moe_comm.Buffer(dist.group.WORLD, hidden=HIDDEN, num_experts=EXPERTS,
                          max_tokens_per_rank=TOKENS, low_latency=low_latency,
                          fault_tolerant=True, timeout_s=timeout_s)
    lines, first_after = [], None
    for step in range(steps):
        if rank == kill and step == kill_step:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        x, idx, w = batch(step, rank)
        start = time.monotonic()
        out = (step_low_latency if low_latency else step_normal)(buf, x, idx, w)
        seconds = time.monotonic() - start
        alive = buf.active_ranks().tolist()  # may already show a death in the next step
        served_by = [r != kill or step < kill_step for r in range(world_size)]
        ok = torch.equal(out, expected(x, idx, w, served_by, world_size, low_latency))
        if step >= kill_step and first_after is None and not alive[kill]:
            first_after = time.time()
        mask = "".join("1" if a else "0" for a in alive)
        lines.append(f"{mode:<12} step {step:>2}  active {mask}  {seconds:7.3f} s  "
                     f"{'agrees with the reference' if ok else 'DIFFERS from the reference'}")
        if not ok:
            raise AssertionError(lines[-1])
    with open(stamp) as f:
        killed_at = float(f.read())
    lines.append(f"{mode:<12} time from the kill to the first step completed without rank "
                 f"{kill}: {first_after - killed_at:.2f} s (timeout {timeout_s:g} s; a dead "
                 "process of this node is found without it)")
    buf.close()
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["low_latency", "normal", "both"], default="both")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill", type=int, default=2)
    parser.add_argument("--kill-step", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds before a silent "
                        "rank is excluded (MOE_COMM_TIMEOUT_S in production)")
    args = parser.parse_args(argv)
    if not 0 < args.kill < args.ranks or not 0 <= args.kill_step < args.steps:
        parser.error("--kill must be a rank other than 0, --kill-step a step")
    for mode in (["low_latency", "normal"] if args.mode == "both" else [args.mode]):
        with tempfile.TemporaryDirectory(prefix="moe_comm_ft_") as tmp, \
                RankPool(args.ranks) as pool:
            results = pool.run(serve, mode, args.steps, args.kill, args.kill_step, args.timeout,
                               os.path.join(tmp, "killed_at"), may_die=(args.kill,))
        print("\n".join(results[0]), flush=True)
        if any(r is None for i, r in enumerate(results) if i != args.kill):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
