"""moe_comm's token dispatcher inside a real Megatron-Core ``MoELayer`` on CPU ranks, against
Megatron's own alltoall dispatcher: same weights, same inputs, forward and backward.

Exact (``torch.equal``) where both sum the same values in the same order: top-2 (a token's two
expert outputs are added once, and a + b == b + a), any dtype. With top-4 Megatron adds a
token's outputs one after another in expert order while moe_comm adds each rank's share first,
so the output and the input gradient agree to fp32 rounding; the expert and router gradients
stay exact (the experts see the same rows in the same order).
"""
import sys

import pytest

pytest.importorskip("megatron.core.transformer.moe.moe_layer",
                    reason="megatron-core is not installed (pip install -e .[megatron])")

from integration_jobs import (
    buffer_cache_fault_tolerant,
    buffer_cache_keys,
    megatron_fault_step,
    megatron_formats,
    megatron_parity,
    megatron_rejects,
)
from moe_comm.integrations import megatron as plugin
from moe_comm.testing.launch import RankPool

INEXACT_WITH_TOPK_ABOVE_2 = {"out", "x.grad"}


def check(reports, world_size, *, inexact=(), rtol=1e-6, ours="MoeCommTokenDispatcher"):
    for rank, rep in enumerate(reports):
        assert rep["their_dispatcher"] == "MoEAlltoAllTokenDispatcher", rep
        assert rep["our_dispatcher"] == ours, rep
        if world_size > 1:
            assert rep["bytes_to_peers"] > 0, f"rank {rank}: moe_comm sent nothing"
        assert rep["buffers"] == 1
        for step, tensors in enumerate(rep["steps"]):
            assert {"out", "x.grad", "router.weight.grad"} <= set(tensors)
            for name in ("out", "x.grad", "router.weight.grad"):
                assert tensors[name][2] > 0, f"rank {rank} step {step}: {name} is all zeros"
            assert any(scale > 0 for name, (_, _, scale) in tensors.items()
                       if ".local_experts." in name), f"rank {rank}: no expert got a token"
            for name, (equal, diff, scale) in tensors.items():
                if name in inexact:
                    assert diff <= rtol * scale, \
                        f"rank {rank} step {step}: {name} differs by {diff:.3e} (max {scale:.3e})"
                else:
                    assert equal, f"rank {rank} step {step}: {name} differs by {diff:.3e}"


@pytest.mark.parametrize("world_size, dtype, experts, tokens", [
    (2, "float32", 8, ((7, 2), (5, 3))),
    (2, "bfloat16", 4, ((8, 2), (8, 2))),
    (4, "float32", 16, ((6, 2), (3, 1), (5, 2), (4, 3))),
    (4, "bfloat16", 8, ((4, 2), (6, 1), (2, 2), (5, 2))),
], ids=["R2-fp32", "R2-bf16", "R4-fp32", "R4-bf16"])
def test_top2_equals_megatron_alltoall_exactly(ranks, world_size, dtype, experts, tokens):
    reports = ranks(world_size).run(megatron_parity, dtype, 16, experts, 2, tokens, seed=11)
    check(reports, world_size)


def test_top4_equals_megatron_within_fp32_rounding(ranks):
    tokens = ((6, 2), (5, 2), (4, 2), (7, 1))
    reports = ranks(4).run(megatron_parity, "float32", 16, 8, 4, tokens, seed=12)
    check(reports, 4, inexact=INEXACT_WITH_TOPK_ABOVE_2)


def test_router_token_drops_are_honoured(ranks):
    """``moe_expert_capacity_factor`` without padding: the router drops choices, the plugin
    sends only what is left (``-1`` choices) and still matches Megatron exactly."""
    reports = ranks(2).run(megatron_parity, "float32", 16, 4, 2, ((12, 2), (10, 2)), seed=13,
                           capacity_factor=0.5)
    check(reports, 2)
    assert sum(rep["dropped"] for rep in reports) > 0, "no choice was dropped: weak test"


def test_shared_expert_without_overlap(ranks):
    reports = ranks(2).run(megatron_parity, "float32", 16, 4, 2, ((6, 2), (6, 2)), seed=14,
                           shared_expert=True)
    check(reports, 2)
    assert any("shared_experts" in name for name in reports[0]["steps"][0])


@pytest.mark.parametrize("dispatcher_type", ["alltoall", "flex"])
def test_apply_megatron_replaces_alltoall_and_flex(ranks, dispatcher_type):
    """``apply_megatron()`` (called twice: idempotent) makes a plain spec with this dispatcher
    type build moe_comm's dispatcher; ``revert_megatron()`` restores Megatron's."""
    reports = ranks(2).run(megatron_parity, "float32", 16, 4, 2, ((5, 2), (6, 2)), seed=15,
                           use="apply", dispatcher_type=dispatcher_type)
    check(reports, 2)
    for rep in reports:
        assert rep["applied"] and rep["reverted"]


@pytest.mark.parametrize("use, world_size, dtype, tokens", [
    ("spec", 2, "float32", ((6, 2), (5, 2))),
    ("apply", 4, "bfloat16", ((6, 2), (5, 2), (4, 2), (7, 1))),
], ids=["spec-R2-fp32", "apply-R4-bf16"])
def test_ep_invariant_top4_equals_megatron_and_the_reference(ranks, use, world_size, dtype,
                                                               tokens):
    """``ep_invariant=True`` (``ModuleSpec`` params of ``MoeCommMoELayer``, or
    ``apply_megatron(ep_invariant=True)``) reaches the layer's Buffer, whose combine sums a
    token's expert outputs in choice (= expert) order: the output equals, bit for bit,
    ``reference.invariant_combine`` of the expert output rows, and with top-4 (where the
    default's rank-partial sums differ) Megatron's own alltoall dispatcher in every tensor."""
    reports = ranks(world_size).run(megatron_parity, dtype, 16, 8, 4, tokens, seed=31, use=use,
                                    ep_invariant=True)
    check(reports, world_size)
    for rank, rep in enumerate(reports):
        assert rep["ep_invariant"] is True, f"rank {rank}: the Buffer is not EP-invariant"
        assert [equal for equal, _ in rep["invariant_reference"]] == [True, True], (rank, rep)
    with pytest.raises(ValueError, match="ep_invariant must be True or False"):
        plugin.apply_megatron(ep_invariant=1)


def test_buffer_cache_keeps_invariant_and_default_buffers_apart(ranks):
    """The plugins' BufferCache keys its Buffers by ``ep_invariant`` too: an invariant layer
    and a default one of the same sizes never share a Buffer."""
    for found in ranks(2).run(buffer_cache_keys):
        assert found["live"] == 2 and found["same"] == [True, True] and found["distinct"]
        assert found["flags"] == {False: [False, False], True: [True, True]}, found
        assert "ep_invariant must be True or False, got None" in found["error"], found


def test_unsupported_configs_are_refused_with_a_reason(ranks):
    for errors in ranks(2).run(megatron_rejects):
        assert "moe_pad_expert_input_to_capacity" in errors["pad_to_capacity"]
        assert "moe_shared_expert_overlap=False" in errors["shared_expert_overlap"]
        # the options of the formats and fault tolerance, when the layer is built (hidden 16)
        assert "dispatch_dtype='fp8' needs hidden % 128 == 0" in errors["fp8_hidden"]
        assert "dispatch_dtype='mxfp8' needs hidden % 32 == 0" in errors["mxfp8_hidden"]
        assert "combine_dtype='fp8' needs hidden % 128 == 0" in errors["combine_hidden"]
        assert "dispatch_dtype must be one of" in errors["bad_dispatch_dtype"]
        assert "combine_dtype must be one of" in errors["bad_combine_dtype"]
        assert "fault_tolerant must be True or False" in errors["bad_fault_tolerant"]
        assert "needs a fixed max_tokens_per_rank" in errors["unsized_fault_tolerant"]
        assert "cannot go with ep_invariant=True" in errors["invariant_fp8_combine"]
        assert errors["nvfp4_fits"] == "nvfp4"


def test_format_and_fault_tolerance_options_are_checked_before_anything_is_applied():
    settings = dict(plugin._settings)
    for options, message in (({"dispatch_dtype": "fp4"}, "dispatch_dtype must be one of"),
                             ({"combine_dtype": "mxfp8"}, "combine_dtype must be one of"),
                             ({"fault_tolerant": "yes"}, "fault_tolerant must be True or False"),
                             ({"fault_tolerant": True}, "needs a fixed max_tokens_per_rank"),
                             ({"combine_dtype": "fp8", "ep_invariant": True},
                              "combine_dtype='fp8' cannot go with ep_invariant=True")):
        with pytest.raises(ValueError, match=message):
            plugin.apply_megatron(**options)
    assert not plugin.is_applied() and plugin._settings == settings


def test_buffer_cache_keeps_fault_tolerant_buffers_apart(ranks):
    """``fault_tolerant`` is part of the BufferCache key (a fault-tolerant layer never shares a
    Buffer with a default one) and needs a fixed size."""
    for found in ranks(2).run(buffer_cache_fault_tolerant):
        assert found["live"] == 2 and found["same"] == [True, True] and found["distinct"]
        assert found["flags"] == {False: [False, False], True: [True, True]}, found
        assert "needs a fixed max_tokens_per_rank" in found["errors"][0], found
        assert "fault_tolerant must be True or False" in found["errors"][1], found
        assert found["live_after"] == 2


def check_formats(reports, *, fp8_combine: bool = False):
    """Every tensor of every step equal to Megatron's (the output within the FP8 combine's
    bound instead, with ``fp8_combine``), the format visible in the output."""
    for rank, rep in enumerate(reports):
        assert rep["our_dispatcher"] == "MoeCommTokenDispatcher", rep
        assert rep["bytes_to_peers"] > 0, f"rank {rank}: moe_comm sent nothing"
        for step, tensors in enumerate(rep["steps"]):
            where = f"rank {rank} step {step}"
            assert tensors.pop("plain_differs"), f"{where}: the output is the unquantized one"
            assert tensors.pop("input_in_bound"), f"{where}: rows outside the format's bound"
            excess = tensors.pop("combine_excess", None)
            if fp8_combine:
                assert excess is not None and excess <= 0, \
                    f"{where}: the FP8 combine exceeds its bound by {excess}"
                assert not tensors["out"][0], f"{where}: the FP8 combine changed nothing"
            for name in ("out", "x.grad", "router.weight.grad"):
                assert tensors[name][2] > 0, f"{where}: {name} is all zeros"
            assert any(scale > 0 for name, (_, _, scale) in tensors.items()
                       if ".local_experts." in name), f"rank {rank}: no expert got a token"
            for name, (equal, diff, _) in tensors.items():
                if not (fp8_combine and name == "out"):
                    assert equal, f"{where}: {name} differs by {diff:.3e}"


@pytest.mark.parametrize("dispatch_dtype, use", [("fp8", "spec"), ("mxfp8", "spec"),
                                                 ("nvfp4", "apply")])
def test_quantized_dispatch_equals_megatron_fed_the_same_rows(ranks, dispatch_dtype, use):
    """``dispatch_dtype`` in ``MoeCommMoELayer``'s params (or ``apply_megatron``): the rows
    travel quantized and the experts get them dequantized. Megatron's own alltoall dispatcher
    fed ``dequantize(quantize(x))`` per token (identity backward: the plugin's straight-through
    gradient) then gives the same output and gradients bit for bit (top-2, fp32); the rows are
    within the format's bound of ``x`` (FP8, MXFP8: 2**-4 relative, 2**-10 * scale near zero,
    docs/FORMATS.md "FP8 dispatch"; NVFP4: 2**-2 relative plus 2**-2 * block scale, from its
    grid), and the output differs from Megatron's unquantized one."""
    reports = ranks(2).run(megatron_formats, "float32", 128, 8, 2, ((6, 2), (5, 2)), seed=51,
                           dispatch_dtype=dispatch_dtype, use=use)
    for rep in reports:
        assert rep["formats"] == (dispatch_dtype, None)
    check_formats(reports)


@pytest.mark.parametrize("world_size, dtype, dispatch_dtype, use, tokens", [
    (2, "float32", "fp8", "spec", ((6, 2), (5, 2))),
    (4, "bfloat16", None, "apply", ((4, 2), (6, 1), (2, 2), (5, 2))),
], ids=["R2-fp32-fp8-dispatch", "R4-bf16"])
def test_fp8_combine_output_within_its_bound_gradients_exact(ranks, world_size, dtype,
                                                             dispatch_dtype, use, tokens):
    """``combine_dtype="fp8"``: each expert rank's partial sum of a token travels as FP8. The
    output differs from Megatron's (fed the same rows) by at most the documented bound of the
    FP8 combine (docs/FORMATS.md "FP8 combine": per partial 2**-4 of each element or 2**-10 *
    amax / 448 of its 128-channel group, the ranks' errors added; plus the dtype's rounding of
    both outputs), computed from the expert rows the ranks actually combined; the backward is the
    exact combine's, so every gradient equals Megatron's bit for bit."""
    reports = ranks(world_size).run(megatron_formats, dtype, 128, 8, 2, tokens, seed=52,
                                    dispatch_dtype=dispatch_dtype, combine_dtype="fp8",
                                    use=use)
    for rep in reports:
        assert rep["formats"] == (dispatch_dtype, "fp8")
    check_formats(reports, fp8_combine=True)


def test_fault_tolerant_step_completes_on_the_survivors():
    """``apply_megatron(fault_tolerant=True, max_tokens_per_rank=16)`` on 3 ranks; rank 1 is
    killed (SIGKILL) inside training step 1, as its layer reaches the dispatch. Ranks 0 and 2
    complete steps 1 and 2 (forward, backward, SGD): outputs, input gradients, every
    gradient and the updated parameters equal, bit for bit, Megatron's own alltoall dispatcher
    running the same steps (before the death, on all ranks) with the router's choices of rank
    1's experts dropped and rank 1 sending no token."""
    with RankPool(3) as pool:  # of its own: a killed rank breaks its process group
        reports = pool.run(megatron_fault_step, 16, 6, 2, ((6, 2), (5, 2), (7, 1)), 61,
                           doomed=1, max_tokens=16, may_die=(1,))
    assert reports[1] is None, "rank 1 was not killed"
    for rank in (0, 2):
        rep = reports[rank]
        assert rep["fault_tolerant"] and rep["active"] == [True, False, True], rep
        assert rep["dropped"] == 2 and rep["finite"] and rep["params_equal"], rep
        for step, tensors in enumerate([rep["step0"], *rep["steps"]]):
            for name in ("out", "x.grad", "router.weight.grad"):
                assert tensors[name][2] > 0, f"rank {rank} step {step}: {name} is all zeros"
            for name, (equal, diff, _) in tensors.items():
                assert equal, f"rank {rank} step {step}: {name} differs by {diff:.3e}"


def test_apply_megatron_without_megatron_is_a_noop_with_a_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core.transformer.moe", None)
    with pytest.warns(UserWarning, match="megatron-core is not importable"):
        assert plugin.apply_megatron() is False
    assert not plugin.is_applied()


def test_routing_map_to_topk_keeps_expert_order_and_gradients():
    import torch

    routing = torch.tensor([[False, True, False, True], [True, False, False, False],
                            [False, False, False, False]])
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
                         requires_grad=True)
    idx, weights = plugin.routing_to_topk(routing, probs, 2)
    assert idx.tolist() == [[1, 3], [0, -1], [-1, -1]]
    assert weights.tolist() == [[0.30000001192092896, 0.699999988079071], [1.0, 0.0], [0.0, 0.0]]
    weights.sum().backward()
    assert probs.grad.tolist() == routing.float().tolist()
    with pytest.raises(ValueError, match="more than moe_router_topk"):
        plugin.routing_to_topk(torch.ones((1, 4), dtype=torch.bool), torch.ones((1, 4)), 2)


@pytest.mark.parametrize("world_size, dtype, experts, tokens", [
    (2, "float32", 8, ((7, 2), (5, 3))),
    (4, "bfloat16", 8, ((4, 2), (6, 1), (2, 2), (5, 2))),
], ids=["R2-fp32", "R4-bf16"])
def test_flex_dispatcher_over_moe_comm_deep_ep(world_size, dtype, experts, tokens):
    """Megatron's flex dispatcher with its DeepEP backend, unmodified, over moe_comm.deep_ep:
    outputs and every gradient equal Megatron's alltoall dispatcher over three steps."""
    from integration_jobs import megatron_deep_ep_parity
    from moe_comm.testing.launch import RankPool

    with RankPool(world_size) as pool:  # fresh processes: deep_ep installed before megatron
        reports = pool.run(megatron_deep_ep_parity, dtype, 16, experts, 2, tokens, seed=21)
    for rep in reports:
        assert rep["have_deep_ep"] and rep["buffer"] == "moe_comm.deep_ep.buffer", rep
    check(reports, world_size, ours="MoEFlexTokenDispatcher")
