"""moe_comm inside DeepSpeed's MoE layer on CPU ranks (DS_ACCELERATOR=cpu, gloo), against
DeepSpeed's own ``MOELayer``: same weights, same inputs, forward and backward.

Capacity mode runs DeepSpeed's own experts on DeepSpeed's own block layout, so outputs and
every gradient are equal bit for bit for k = 1 (any dtype) and k = 2 (fp32). With k = 2 in
bf16 only the output differs, by at most one bf16 rounding: moe_comm rounds each expert rank's
share of a token to bf16 before it travels, DeepSpeed rounds the fp32 sum once (gradients stay
exact). With k = 4 the order of the sum over a token's experts differs (fp32 rounding).

Dropless mode equals DeepSpeed with ``drop_tokens=False`` to fp32 rounding: each expert runs
once over exactly its rows, where DeepSpeed runs it over a padded block in another row order,
so GEMMs and gradient sums see the rows differently.
"""
import os
import sys

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is first imported
pytest.importorskip("deepspeed.moe.sharded_moe",
                    reason="deepspeed is not installed (pip install -e .[deepspeed])")

import torch

from integration_jobs import deepspeed_parity
from moe_comm.integrations import deepspeed as plugin

FP32_RTOL = 1e-5


def check(reports, world_size, *, exact=True, only_out_inexact=False, rtol=FP32_RTOL):
    for rank, rep in enumerate(reports):
        assert rep["their_layer"] == "MOELayer" and rep["our_layer"] == "MoeCommMOELayer", rep
        if world_size > 1:
            assert rep["bytes_to_peers"] > 0, f"rank {rank}: moe_comm sent nothing"
        for step, tensors in enumerate(rep["steps"]):
            assert {"out", "l_aux", "exp_counts", "x.grad",
                    "deepspeed_moe.gate.wg.weight.grad"} <= set(tensors)
            for name in ("out", "x.grad", "deepspeed_moe.gate.wg.weight.grad"):
                assert tensors[name][2] > 0, f"rank {rank} step {step}: {name} is all zeros"
            for name, (equal, diff, scale) in tensors.items():
                where = f"rank {rank} step {step}: {name}"
                if exact and not (only_out_inexact and name == "out"):
                    assert equal, f"{where} differs by {diff:.3e}"
                else:
                    assert diff <= rtol * max(scale, 1.0), f"{where} differs by {diff:.3e}"
            assert tensors["exp_counts"][0] and tensors["l_aux"][0], "routing differs"


@pytest.mark.parametrize("topk, dtype", [(1, "float32"), (2, "float32"), (1, "bfloat16")])
def test_capacity_mode_equals_deepspeed_exactly(ranks, topk, dtype):
    reports = ranks(2).run(deepspeed_parity, dtype, 16, 8, topk, 16, seed=21, mode="capacity",
                           drop_tokens=True)
    check(reports, 2)
    assert sum(rep["dropped"] for rep in reports) > 0, "no token was dropped: weak test"


def test_capacity_mode_top2_bf16_output_within_one_rounding(ranks):
    reports = ranks(2).run(deepspeed_parity, "bfloat16", 16, 8, 2, 16, seed=22,
                           mode="capacity", drop_tokens=True)
    check(reports, 2, only_out_inexact=True, rtol=2 ** -8)


def test_capacity_mode_keeps_no_drop_capacity_on_four_ranks(ranks):
    """``drop_tokens=False``: DeepSpeed's capacity is the largest expert load over the ranks."""
    reports = ranks(4).run(deepspeed_parity, "float32", 16, 8, 2, 16, seed=23, mode="capacity",
                           drop_tokens=False)
    check(reports, 4)
    assert sum(rep["dropped"] for rep in reports) == 0


def test_capacity_mode_top4_within_fp32_rounding(ranks):
    reports = ranks(2).run(deepspeed_parity, "float32", 16, 8, 4, 16, seed=24, mode="capacity",
                           drop_tokens=True)
    check(reports, 2, exact=False)


@pytest.mark.parametrize("world_size, topk", [(2, 1), (2, 2), (4, 2)])
def test_dropless_mode_equals_deepspeed_without_drops(ranks, world_size, topk):
    reports = ranks(world_size).run(deepspeed_parity, "float32", 16, 4 * world_size, topk, 16,
                                    seed=25, mode="dropless", drop_tokens=False)
    check(reports, world_size, exact=False)


def test_dropless_mode_never_drops_even_when_deepspeed_would(ranks):
    """A layer configured to drop (``drop_tokens=True``, capacity factor 0.25) built under
    ``apply_deepspeed()`` still sends every token: it equals DeepSpeed with drop_tokens=False."""
    reports = ranks(2).run(deepspeed_parity, "float32", 16, 8, 2, 16, seed=26, mode="dropless",
                           drop_tokens=False, capacity_factor=0.25, use="apply",
                           plugin_drop_tokens=True)
    check(reports, 2, exact=False)


def test_apply_deepspeed_builds_the_plugin_layer(ranks):
    """``apply_deepspeed()`` (twice: idempotent) before ``MoE(...)``; reverted afterwards."""
    reports = ranks(2).run(deepspeed_parity, "float32", 16, 8, 2, 16, seed=27, mode="capacity",
                           drop_tokens=True, use="apply")
    check(reports, 2)


def check_ep_invariant(reports, steps: int = 2):
    for rank, rep in enumerate(reports):
        assert rep["ep_invariant"] is True, f"rank {rank}: the Buffer is not EP-invariant"
        assert [equal for equal, _ in rep["invariant_reference"]] == [True] * steps, (rank, rep)


@pytest.mark.parametrize("topk, dtype", [(4, "float32"), (2, "bfloat16")])
def test_ep_invariant_capacity_mode_output_equals_deepspeed_exactly(ranks, topk, dtype):
    """``convert(..., ep_invariant=True)``: the Buffer sums each token's ``gate * row`` in
    choice order in fp32 and rounds once, as DeepSpeed's combine does: the output equals
    DeepSpeed's bit for bit where the default's per-rank partials differ (top-4 fp32, top-2
    bf16), and ``reference.invariant_combine`` of the rows. The gradients stay within fp32
    rounding (``grad_w`` sums in a fixed order of its own)."""
    reports = ranks(2).run(deepspeed_parity, dtype, 16, 8, topk, 16, seed=41, mode="capacity",
                           drop_tokens=True, ep_invariant=True)
    check(reports, 2, exact=False, rtol=FP32_RTOL if dtype == "float32" else 2 ** -8)
    for rank, rep in enumerate(reports):
        for step, tensors in enumerate(rep["steps"]):
            assert tensors["out"][0], f"rank {rank} step {step}: out differs from DeepSpeed's"
    check_ep_invariant(reports)


def test_ep_invariant_dropless_mode_through_apply_deepspeed(ranks):
    """``apply_deepspeed(ep_invariant=True)``: the layer built afterwards has an EP-invariant
    Buffer; its output is ``reference.invariant_combine`` of the expert rows bit for bit."""
    reports = ranks(2).run(deepspeed_parity, "float32", 16, 8, 4, 16, seed=42, mode="dropless",
                           drop_tokens=False, use="apply", ep_invariant=True)
    check(reports, 2, exact=False)
    check_ep_invariant(reports)
    with pytest.raises(ValueError, match="ep_invariant must be True or False"):
        plugin.apply_deepspeed(ep_invariant="yes")


def test_capacity_slots_follow_deepspeed_order():
    """Rows come grouped by (local expert, source rank, token); top-2's second choices go
    after the first choices of the same (expert, source)."""
    src = torch.tensor([0, 0, 0, 1, 0, 1])
    local = torch.tensor([0, 0, 0, 0, 1, 1])
    second = torch.tensor([True, False, False, False, False, False])
    slots = plugin.capacity_slots(src, local, second, world_size=2, num_local_experts=2,
                                  capacity=3)
    # (src*L + e)*C + location: expert 0 from rank 0 -> locations 2, 0, 1
    assert slots.tolist() == [2, 0, 1, 6, 3, 9]
    with pytest.raises(RuntimeError, match="capacity"):
        plugin.capacity_slots(src, local, second, world_size=2, num_local_experts=2,
                              capacity=2)


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="dropless"):
        plugin.apply_deepspeed(mode="padded")


def test_apply_deepspeed_without_deepspeed_is_a_noop_with_a_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed.moe", None)
    with pytest.warns(UserWarning, match="deepspeed is not importable"):
        assert plugin.apply_deepspeed() is False
    assert not plugin.is_applied()
