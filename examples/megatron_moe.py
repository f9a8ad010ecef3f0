"""Megatron-Core's MoELayer with moe_comm as its token dispatcher: one line.

    python examples/megatron_moe.py --ranks 2             # CPU ranks, started for you
    torchrun --nproc-per-node 2 examples/megatron_moe.py  # one process per rank (gloo)

The line, before the model is built::

    from moe_comm.integrations.megatron import apply_megatron
    apply_megatron()   # MoELayer(moe_token_dispatcher_type="alltoall" or "flex") -> moe_comm

This script builds one MoE layer (expert parallel over all ranks, top-2 of 8 experts) twice from
one seed, once with Megatron's own alltoall dispatcher and once after ``apply_megatron()``, runs
forward and backward through both on the same tokens and prints the largest differences (0:
the two dispatchers deliver the same rows in the same order). On a machine without CUDA,
Megatron needs the ``torch.cuda`` stand-ins of tests/framework_shims.py (applied here).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

# first: without a GPU, importing moe_comm selects the Triton interpreter, which must happen
# before a framework imports triton
import moe_comm  # noqa: F401
from moe_comm.testing.launch import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN, EXPERTS, TOPK, SEQ, BATCH = 32, 8, 2, 12, 2


def run(rank: int, world_size: int) -> str:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from framework_shims import megatron_cpu_shims, megatron_parallel_state
    from moe_comm.integrations import buffers
    from moe_comm.integrations.megatron import apply_megatron, revert_megatron

    shims = megatron_cpu_shims() if not torch.cuda.is_available() else contextlib.nullcontext()
    with shims, megatron_parallel_state(world_size):
        config = TransformerConfig(
            num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=EXPERTS,
            moe_ffn_hidden_size=2 * HIDDEN, moe_router_topk=TOPK,
            moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32",
            expert_model_parallel_size=world_size, use_cpu_initialization=True,
            add_bias_linear=False, init_method_std=0.2)
        spec = get_moe_module_spec(use_te=False, num_experts=EXPERTS)
        torch.manual_seed(0)
        theirs = build_module(spec, config=config)

        apply_megatron()  # the one line
        ours = build_module(spec, config=config)
        revert_megatron()  # only so that the script can build Megatron's layer again

        ours.load_state_dict(theirs.state_dict())
        x = torch.randn((SEQ, BATCH, HIDDEN), generator=torch.Generator().manual_seed(rank))
        results = []
        for layer in (theirs, ours):
            xi = x.clone().requires_grad_()
            out, _ = layer(xi)
            out.square().sum().backward()
            results.append((out.detach(), xi.grad))
        (out_a, grad_a), (out_b, grad_b) = results
        name = type(ours.token_dispatcher).__name__
        buffers.close()  # the plugin's workspaces, before the process group goes
        return (f"rank {rank}: {name}, output {tuple(out_b.shape)}; max |moe_comm - Megatron| "
                f"output {float((out_a - out_b).abs().max()):.1e}, input gradient "
                f"{float((grad_a - grad_b).abs().max()):.1e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks to start (without torchrun)")
    args = parser.parse_args()
    for line in run_ranks(args.ranks, run).values():
        print(line, flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(main())
