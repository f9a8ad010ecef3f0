"""``moe_comm.deep_ep``: DeepEP's Buffer API over moe_comm, against a model of DeepEP's
semantics (``deep_ep_jobs``) on CPU ranks."""
import subprocess
import sys
import types

import deep_ep_jobs
import pytest
import torch

from cases import Case
from moe_comm import deep_ep


@pytest.mark.parametrize("R,alignment", [(2, 1), (4, 4), (8, 1)])
def test_normal_mode_matches_deepep_semantics(ranks, R, alignment):
    case = Case(R, 4 * R, 128, 4, tuple(6 + (r % 3) for r in range(R)), alignment=alignment,
                seed=R)
    ranks(R).run(deep_ep_jobs.normal_mode, case)


def test_normal_mode_fp8_pairs(ranks):
    case = Case(2, 8, 256, 2, (7, 5), seed=3)
    ranks(2).run(deep_ep_jobs.normal_mode, case, fp8=True)


@pytest.mark.parametrize("fp8,by_env", [(False, False), (True, True)],
                         ids=["bf16-argument", "fp8-environment"])
def test_internode_normal_mode_on_two_nodes(ranks, fp8, by_env):
    """``num_rdma_bytes > 0`` on 2 nodes of 2 CPU ranks (``ranks_per_node=2``, or
    ``MOE_COMM_RANKS_PER_NODE=2`` with Config's RDMA hint): the workspace spans the nodes
    through the proxy, hierarchical; the layout's ``num_tokens_per_rdma_rank``, the dispatch
    (bf16 or FP8 pairs), the cached dispatch and ``num_worst_tokens`` give the intranode
    model's bits, the combine ``reference.combine_all(..., hierarchical_nodes=2)``'s."""
    pytest.importorskip("nixl_cu13")
    case = Case(4, 16, 256 if fp8 else 128, 4, (7, 5, 8, 6), seed=31 + fp8)
    for out in ranks(4).run(deep_ep_jobs.normal_mode, case, iterations=2 - fp8, fp8=fp8,
                            ranks_per_node=2, by_env=by_env):
        assert out["nodes"] == (2, 2) and out["transport"] == "nixl", out
        assert out["hierarchical"] and out["rounds"] == 1, out


@pytest.mark.parametrize("R,N", [(4, 2), (2, None)], ids=["2x2-nodes", "one-node"])
def test_normal_mode_in_rounds_keeps_deepep_order(ranks, R, N):
    """moe_comm's staging bounded so that a call runs in rounds (its slots arrive by round,
    then source): the facade still returns DeepEP's order by source then token, and combine
    and the cached dispatch map the rows back."""
    from moe_comm.workspace import staging_slot_bytes

    if N is not None:
        pytest.importorskip("nixl_cu13")
    case = Case(R, 4 * R, 128, 2, tuple(8 - (r % 3) for r in range(R)), seed=40 + R)
    per_slot = staging_slot_bytes(R, case.hidden, case.topk, case.dtype, outboxes=N is not None,
                                  ranks_per_node=N)
    for out in ranks(R).run(deep_ep_jobs.normal_mode, case, iterations=1, ranks_per_node=N,
                            staging_bytes=5 * per_slot):
        assert out["rounds"] == 2, out   # 8 tokens, 5 slots per source


def test_ranks_per_node_is_checked():
    """The ranks per node: the Buffer's argument, else MOE_COMM_RANKS_PER_NODE, else 8
    (DeepEP's); a bad value raises naming where it came from; Config's RDMA hint is 0 on one
    node and positive across nodes (callers that pass it get the internode mode)."""
    from moe_comm.deep_ep import buffer as facade

    assert facade.ranks_per_node_setting() == 8 == facade.NUM_MAX_NVL_PEERS
    assert deep_ep.Config().get_rdma_buffer_size_hint(256, 8) == 0  # one node, as DeepEP's
    assert deep_ep.Config().get_rdma_buffer_size_hint(256, 16) > 0
    with pytest.raises(ValueError, match="ranks_per_node must be a positive int, got 0"):
        deep_ep.Buffer(None, ranks_per_node=0)
    with pytest.raises(ValueError, match="12 ranks are not whole nodes of 8"):
        facade.checks.whole_nodes(12, 8)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOE_COMM_RANKS_PER_NODE", "2")
        assert facade.ranks_per_node_setting() == 2 and facade.ranks_per_node_setting(4) == 4
        assert deep_ep.Config().get_rdma_buffer_size_hint(256, 4) > 0
        mp.setenv("MOE_COMM_RANKS_PER_NODE", "two")
        with pytest.raises(ValueError, match="MOE_COMM_RANKS_PER_NODE='two'"):
            deep_ep.Buffer(None)


@pytest.mark.parametrize("R,fp8,ue8m0", [(2, False, False), (4, True, False), (8, False, False),
                                         (2, True, True)])
def test_low_latency_matches_deepep_semantics(ranks, R, fp8, ue8m0):
    case = Case(R, 2 * R, 512 if ue8m0 else 256, 2, tuple(4 + r for r in range(R)), seed=5 + R)
    for out in ranks(R).run(deep_ep_jobs.low_latency, case, fp8=fp8, ue8m0=ue8m0):
        assert out == {"nodes": 1, "transport": None}, out


def test_low_latency_on_two_nodes(ranks):
    """The low-latency workspace spans the same nodes as the normal one (2 x 2 CPU ranks
    through the proxy): FP8 dispatch and combine against the model."""
    pytest.importorskip("nixl_cu13")
    case = Case(4, 8, 256, 2, (4, 5, 6, 3), seed=23)
    for out in ranks(4).run(deep_ep_jobs.low_latency, case, fp8=True, ranks_per_node=2):
        assert out == {"nodes": 2, "transport": "nixl"}, out


def test_ep_invariant_sums_in_choice_order(ranks):
    """``Buffer(..., ep_invariant=True)`` builds both moe_comm workspaces EP-invariant: the
    normal combine adds each token's per-rank rows in choice order, the low-latency one its
    weighted rows, both as ``reference.invariant_combine``. Four ranks, top-4, fp32: some token
    sums three or more rows, whose rank order (DeepEP's, the default) rounds differently."""
    case = Case(4, 8, 128, 4, (6, 5, 4, 6), dtype=torch.float32, seed=17)
    found = ranks(4).run(deep_ep_jobs.ep_invariant_sums, case)
    for rank, out in enumerate(found):
        assert out["workspaces_ep_invariant"] == (True, True), (rank, out)
        assert out["normal"] and out["combined_weights"] and out["low_latency"], (rank, out)
        assert out["nodes"] == (1, 1), (rank, out)
    assert any(out["default_differs"] for out in found), "rank order sums alike: weak test"
    with pytest.raises(ValueError, match="ep_invariant must be True or False, got 1"):
        deep_ep.Buffer(None, ep_invariant=1)


def test_ep_invariant_on_two_nodes(ranks):
    """The same sums with ``num_rdma_bytes > 0`` on 2 nodes of 2 CPU ranks: both workspaces
    span the nodes (moe_comm's normal mode flat through the proxy) and give the invariant
    bits."""
    pytest.importorskip("nixl_cu13")
    case = Case(4, 8, 128, 4, (6, 5, 4, 6), dtype=torch.float32, seed=17)
    found = ranks(4).run(deep_ep_jobs.ep_invariant_sums, case, ranks_per_node=2)
    for rank, out in enumerate(found):
        assert out["workspaces_ep_invariant"] == (True, True), (rank, out)
        assert out["normal"] and out["combined_weights"] and out["low_latency"], (rank, out)
        assert out["nodes"] == (2, 2), (rank, out)


def test_what_cannot_be_honoured_raises_with_a_sentence(ranks):
    case = Case(2, 8, 256, 2, (5, 6), seed=9)
    for out in ranks(2).run(deep_ep_jobs.refusals, case):
        assert set(out) == {"no_topk", "bias", "nonlocal_weights", "logfmt", "round_scale",
                            "nvfp4"}, out
        assert all(msg.startswith("moe_comm.deep_ep: ") and len(msg) > 40
                   for msg in out.values()), out


def test_bad_input_to_every_facade_call_names_the_argument(ranks):
    """What a new user passes wrongly gets TypeError or ValueError naming the argument before
    anything runs (int32 ids are converted, as engines keep them); an expert id out of range
    counts nowhere in the layout and the dispatch raises it once the call is complete."""
    named = {
        "layout float topk_idx": "TypeError: topk_idx must be int64",
        "layout 1-d topk_idx": "ValueError: topk_idx must be [num_tokens, num_topk]",
        "layout list topk_idx": "TypeError: topk_idx must be a torch.Tensor",
        "layout num_experts float": "TypeError: num_experts must be a positive int",
        "layout num_experts 7": "ValueError: num_experts=7 is not divisible",
        "dispatch x 3-d": "ValueError: x must be [num_tokens, hidden]",
        "dispatch x fewer tokens": "ValueError: x has 3 tokens, topk_idx 6",
        "dispatch float topk_idx": "TypeError: topk_idx must be int64",
        "dispatch int weights": "TypeError: topk_weights must be floating point",
        "dispatch weights shape": "ValueError: topk_weights has shape (6, 1)",
        "dispatch id >= num_experts": "ValueError: moe_comm rank",
        "dispatch int32 x": "TypeError: x must be rows of one of torch.bfloat16",
        "combine other hidden": "ValueError: x has hidden 64; the dispatch that made the "
                                "handle moved 128",
        "cached dispatch other hidden": "ValueError: x has shape (6, 64); the dispatch that "
                                        "made the handle moved [6, 128]",
        "cached dispatch fewer tokens": "ValueError: x has shape (3, 128); the dispatch that "
                                        "made the handle moved [6, 128]",
        "low-latency int32 x": "TypeError: x must be rows of one of torch.bfloat16",
        "low-latency combine out shape": "ValueError: out must be [6, 128] torch.bfloat16 on "
                                         "cpu, got [7, 128]",
        "combine tuple handle": "TypeError: handle must be the handle a dispatch returned",
        "combine x 1-d": "ValueError: x must be [num_tokens, hidden]",
        "cached dispatch tuple handle": "TypeError: handle must be the handle a dispatch",
        "low-latency combine tuple handle": "TypeError: handle must be the handle a "
                                            "low_latency_dispatch returned",
        "low-latency combine buffer tuple handle": "TypeError: handle must be the handle a "
                                                   "low_latency_dispatch returned",
        "local buffer before a call": "RuntimeError: moe_comm builds the low-latency "
                                      "workspace at the first low_latency_dispatch",
        "local buffer normal workspace": "NotImplementedError: moe_comm.deep_ep: "
                                         "get_local_buffer_tensor hands out the low-latency",
        "local buffer dtype str": "TypeError: dtype must be a torch.dtype",
        "local buffer odd offset": "ValueError: offset must be a byte offset",
        "local buffer size too large": "ValueError: size (1099511627776,) needs",
    }
    fine = {"layout int32 topk_idx": "ok", "layout id >= num_experts": "ok",
            "low-latency int32 topk_idx (converted)": "ok", "good calls": "ok (6, 128)",
            "local buffer int32 [4, 2] at 8": "ok"}
    for rank, found in enumerate(ranks(2).run(deep_ep_jobs.bad_facade_inputs)):
        assert set(found) == set(named) | set(fine), (rank, found)
        for what, start in {**named, **fine}.items():
            assert found[what].startswith(start), (rank, what, found[what])
        assert "ids must be in [0, num_experts)" in found["dispatch id >= num_experts"], found


def test_install_registers_and_refuses_a_real_deep_ep(monkeypatch):
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    monkeypatch.delitem(sys.modules, "deep_ep.utils", raising=False)
    deep_ep.install()
    import deep_ep as imported
    from deep_ep.utils import EventOverlap

    assert imported is deep_ep and EventOverlap is deep_ep.EventOverlap
    deep_ep.install()  # idempotent
    monkeypatch.setitem(sys.modules, "deep_ep", types.ModuleType("deep_ep"))
    with pytest.raises(RuntimeError, match="already imported"):
        deep_ep.install()


def test_check_prints_the_feature_table():
    proc = subprocess.run([sys.executable, "-m", "moe_comm.deep_ep", "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "get_dispatch_layout" in proc.stdout and "use_logfmt" in proc.stdout


def test_shrink_mask_calls(ranks):
    R = 4
    case = Case(R, 2 * R, 128, 2, (4, 5, 3, 4), seed=13)
    for statuses in ranks(R).run(deep_ep_jobs.shrink_masks, case):   # a call while masked
        assert statuses == [[0] * R, [0] * (R - 1) + [1], [0] * R, [0] * R], statuses
