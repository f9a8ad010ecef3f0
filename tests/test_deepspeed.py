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

from integration_jobs import (
    deepspeed_fault_step,
    deepspeed_formats,
    deepspeed_parity,
    deepspeed_rejects,
)
from moe_comm.integrations import deepspeed as plugin
from moe_comm.testing.launch import RankPool

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


def check_formats(reports, *, exact: bool, fp8_combine: bool = False):
    """Every tensor of every step equal to DeepSpeed's (``exact``; else within fp32 rounding,
    the dropless mode's), the output within the FP8 combine's bound instead with
    ``fp8_combine``; the format visible in the output."""
    for rank, rep in enumerate(reports):
        assert rep["our_layer"] == "MoeCommMOELayer" and rep["bytes_to_peers"] > 0, rep
        for step, tensors in enumerate(rep["steps"]):
            where = f"rank {rank} step {step}"
            assert tensors.pop("plain_differs"), f"{where}: the output is the unquantized one"
            assert tensors.pop("input_in_bound"), f"{where}: rows outside the format's bound"
            excess = tensors.pop("combine_excess", None)
            if fp8_combine:
                assert excess is not None and excess <= 0, \
                    f"{where}: the FP8 combine exceeds its bound by {excess}"
                assert not tensors["out"][0], f"{where}: the FP8 combine changed nothing"
            for name in ("out", "x.grad", "deepspeed_moe.gate.wg.weight.grad"):
                assert tensors[name][2] > 0, f"{where}: {name} is all zeros"
            assert tensors["exp_counts"][0] and tensors["l_aux"][0], "routing differs"
            for name, (equal, diff, scale) in tensors.items():
                if fp8_combine and name == "out":
                    continue
                if exact:
                    assert equal, f"{where}: {name} differs by {diff:.3e}"
                else:
                    assert diff <= FP32_RTOL * max(scale, 1.0), \
                        f"{where}: {name} differs by {diff:.3e}"


@pytest.mark.parametrize("dispatch_dtype, use", [("fp8", "class"), ("mxfp8", "class"),
                                                 ("nvfp4", "apply")])
def test_quantized_dispatch_equals_deepspeed_fed_the_same_rows(ranks, dispatch_dtype, use):
    """``convert(..., dispatch_dtype=...)`` (or ``apply_deepspeed``), capacity mode, top-2 fp32:
    the tokens travel quantized and the experts get them dequantized. DeepSpeed's own layer
    with the tokens it places in its expert blocks put through ``dequantize(quantize(x))``
    (identity backward: the plugin's straight-through gradient) gives the same output and
    gradients bit for bit; the rows are within the format's bound of ``x`` (FP8, MXFP8: 2**-4
    relative, 2**-10 * scale near zero, docs/FORMATS.md "FP8 dispatch"; NVFP4: 2**-2 relative
    plus 2**-2 * block scale, from its grid), and the output differs from DeepSpeed's
    unquantized one."""
    reports = ranks(2).run(deepspeed_formats, "float32", 128, 8, 2, 16, seed=71,
                           mode="capacity", drop_tokens=True, dispatch_dtype=dispatch_dtype,
                           use=use)
    for rep in reports:
        assert rep["formats"] == (dispatch_dtype, None)
    check_formats(reports, exact=True)


@pytest.mark.parametrize("mode, dispatch_dtype", [("capacity", "fp8"), ("dropless", "nvfp4")])
def test_fp8_combine_output_within_its_bound(ranks, mode, dispatch_dtype):
    """``combine_dtype="fp8"``: each expert rank's weighted partial sum of a token travels as
    FP8. The output differs from DeepSpeed's (fed the same rows) by at most the documented
    bound of the FP8 combine (docs/FORMATS.md "FP8 combine": per partial 2**-4 of each element or
    2**-10 * amax / 448 of its 128-channel group, the ranks' errors added; plus the dtype's
    rounding of both outputs), computed from the rows and gate values the ranks combined. The
    backward is the exact combine's: gradients bit for bit in capacity mode, to fp32 rounding
    in dropless mode (as without the formats)."""
    reports = ranks(2).run(deepspeed_formats, "float32", 128, 8, 2, 16, seed=72, mode=mode,
                           drop_tokens=mode == "capacity", dispatch_dtype=dispatch_dtype,
                           combine_dtype="fp8")
    check_formats(reports, exact=mode == "capacity", fp8_combine=True)


@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_fault_tolerant_step_completes_on_the_survivors(mode):
    """``convert(..., fault_tolerant=True, max_tokens_per_rank=16)`` on 3 ranks; rank 1 is
    killed (SIGKILL) inside training step 1, as its layer calls the dispatch. Ranks 0 and 2
    complete steps 1 and 2 (forward, backward, SGD) against DeepSpeed's own layer running the
    same steps (before the death, on all ranks) with the gate's choices of rank 1's experts
    dropped and rank 1 sending no token: bit for bit in capacity mode (``drop_tokens=True``),
    to fp32 rounding in dropless mode (against ``drop_tokens=False``, as without faults; its
    gate then skips DeepSpeed's capacity all_reduce, which would wait for the dead rank)."""
    with RankPool(3) as pool:  # of its own: a killed rank breaks its process group
        reports = pool.run(deepspeed_fault_step, 16, 6, 2, 16, 81, doomed=1, max_tokens=16,
                           mode=mode, may_die=(1,))
    assert reports[1] is None, "rank 1 was not killed"
    exact = mode == "capacity"
    for rank in (0, 2):
        rep = reports[rank]
        assert rep["fault_tolerant"] and rep["active"] == [True, False, True], rep
        assert rep["dropped"] > 0 and rep["finite"], rep
        assert rep["params_diff"] <= (0.0 if exact else FP32_RTOL * rep["params_scale"]), rep
        for step, tensors in enumerate([rep["step0"], *rep["steps"]]):
            for name in ("out", "x.grad", "deepspeed_moe.gate.wg.weight.grad"):
                assert tensors[name][2] > 0, f"rank {rank} step {step}: {name} is all zeros"
            for name, (equal, diff, scale) in tensors.items():
                where = f"rank {rank} step {step}: {name}"
                if exact:
                    assert equal, f"{where} differs by {diff:.3e}"
                else:
                    assert diff <= FP32_RTOL * max(scale, 1.0), f"{where} differs by {diff:.3e}"


def test_format_and_fault_tolerance_options_are_refused_before_anything_is_sent(ranks):
    for errors in ranks(2).run(deepspeed_rejects):
        assert "dispatch_dtype='fp8' needs hidden % 128 == 0" in errors["fp8_hidden"]
        assert "combine_dtype='fp8' needs hidden % 128 == 0" in errors["combine_hidden"]
        assert "needs drop_tokens=True" in errors["capacity_without_drops"]
        assert "dispatch_dtype must be one of" in errors["bad_dispatch_dtype"]
        assert "combine_dtype must be one of" in errors["bad_combine_dtype"]
        assert "fault_tolerant must be True or False" in errors["bad_fault_tolerant"]
        assert "needs a fixed max_tokens_per_rank" in errors["unsized_fault_tolerant"]
        assert "cannot go with ep_invariant=True" in errors["invariant_fp8_combine"]
        assert not any(name.endswith(": sent") for name in errors), errors
    settings = dict(plugin._settings)
    for options, message in (({"dispatch_dtype": "e4m3"}, "dispatch_dtype must be one of"),
                             ({"combine_dtype": "nvfp4"}, "combine_dtype must be one of"),
                             ({"fault_tolerant": 0}, "fault_tolerant must be True or False"),
                             ({"fault_tolerant": True}, "needs a fixed max_tokens_per_rank")):
        with pytest.raises(ValueError, match=message):
            plugin.apply_deepspeed(**options)
    assert not plugin.is_applied() and plugin._settings == settings


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
