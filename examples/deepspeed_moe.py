"""DeepSpeed's MoE layer moving only the routed tokens with moe_comm: one line.

    python examples/deepspeed_moe.py --ranks 2              # CPU ranks, started for you
    torchrun --nproc-per-node 2 examples/deepspeed_moe.py   # one process per rank (gloo)

The line, before the model is built (or ``convert(model)`` afterwards)::

    from moe_comm.integrations.deepspeed import apply_deepspeed
    apply_deepspeed()                    # dropless; apply_deepspeed(mode="capacity") keeps
                                         # DeepSpeed's capacity and token dropping exactly

This script builds ``deepspeed.moe.layer.MoE`` (expert parallel over all ranks, top-2 of 8
experts) twice from one seed: DeepSpeed's own with ``drop_tokens=False`` and the plugin's in
dropless mode, runs forward and backward through both on the same tokens, and prints the
largest differences (fp32 rounding: DeepSpeed runs each expert over a padded block, moe_comm
over exactly its rows). ``bench/framework_compare.py`` measures the bytes each moves. On a CPU
machine DeepSpeed's first ``init_distributed`` JIT-builds its shared-memory all-reduce kernel
(about a minute on 2 cores, cached afterwards in ~/.cache/torch_extensions).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

# first: without a GPU, importing moe_comm selects the Triton interpreter, which must happen
# before a framework imports triton
import moe_comm  # noqa: F401
from moe_comm.testing.launch import run_ranks

HIDDEN, EXPERTS, TOPK, TOKENS = 32, 8, 2, 24


def build(world_size: int):
    from deepspeed.moe.layer import MoE

    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.GELU(),
                                 torch.nn.Linear(2 * HIDDEN, HIDDEN))
    moe = MoE(hidden_size=HIDDEN, expert=expert, num_experts=EXPERTS, ep_size=world_size,
              k=TOPK, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
    moe.set_deepspeed_parallelism()  # deepspeed.initialize() does this in a real run
    return moe


def run(rank: int, world_size: int) -> str:
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
    import deepspeed.comm

    if not deepspeed.comm.is_initialized():
        deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    from deepspeed.moe.layer import MoE

    from moe_comm.integrations import buffers
    from moe_comm.integrations.deepspeed import apply_deepspeed, revert_deepspeed

    theirs = build(world_size)
    apply_deepspeed()  # the one line
    ours = build(world_size)
    revert_deepspeed()  # only so that the script can build DeepSpeed's layer again
    assert isinstance(ours, MoE)
    ours.load_state_dict(theirs.state_dict())

    x = torch.randn((TOKENS, HIDDEN), generator=torch.Generator().manual_seed(rank))
    results = []
    for moe in (theirs, ours):
        xi = x.clone().requires_grad_()
        out, l_aux, _ = moe(xi)
        (out.square().sum() + l_aux).backward()
        results.append((out.detach(), xi.grad))
    (out_a, grad_a), (out_b, grad_b) = results
    buffers.close()  # the plugin's workspaces, before the process group goes
    return (f"rank {rank}: {type(ours.deepspeed_moe).__name__}, output {tuple(out_b.shape)}; max "
            f"|moe_comm - DeepSpeed| output {float((out_a - out_b).abs().max()):.1e}, input "
            f"gradient {float((grad_a - grad_b).abs().max()):.1e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks to start (without torchrun)")
    args = parser.parse_args()
    for line in run_ranks(args.ranks, run).values():
        print(line, flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(main())
