"""CPU ranks in processes over the ``shm`` heap, against the reference."""
import pytest
import torch

from cases import Case, names_rank
from rank_jobs import (
    bad_expert_row,
    bad_inputs,
    construct,
    count_traffic,
    gradients,
    launch_mode,
    run_case,
    run_case_kernel_waits,
    skip_one_call,
    with_kernel_waits,
)

CASES = [
    Case(R, E, H, K, tokens, dtype, routing, align, weights=w, seed=i)
    for i, (R, E, H, K, tokens, dtype, routing, align, w) in enumerate([
        (1, 1, 64, 1, (6,), torch.bfloat16, "uniform", 1, True),
        (1, 32, 128, 8, (24,), torch.float32, "zipf", 16, True),
        (2, 2, 64, 1, (9, 0), torch.float16, "uniform", 1, True),
        (2, 8, 128, 2, (17, 30), torch.bfloat16, "one_expert", 16, False),
        (2, 64, 128, 8, (25, 11), torch.float32, "zipf", 1, True),
        (4, 4, 64, 1, (7, 0, 12, 3), torch.bfloat16, "uniform", 16, True),
        (4, 16, 128, 2, (20, 20, 20, 20), torch.float16, "empty_rank", 1, True),
        (4, 16, 64, 8, (9, 14, 0, 5), torch.float32, "all_invalid", 16, True),
        (4, 128, 128, 8, (16, 3, 28, 10), torch.bfloat16, "zipf", 16, True),
        (4, 128, 256, 2, (12, 12, 1, 0), torch.float16, "one_expert", 1, True),
    ])
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(ranks, case):
    ranks(case.world_size).run(run_case, case, iterations=2)


def test_eight_ranks(ranks):
    case = Case(8, 64, 128, 8, (10, 0, 7, 16, 3, 12, 1, 9), torch.bfloat16, "uniform", 16, seed=21)
    ranks(8).run(run_case, case, iterations=2)


def test_distributed_reference_agrees_with_oracle(ranks):
    case = Case(4, 16, 64, 4, (11, 0, 6, 13), torch.bfloat16, "zipf", 16, seed=31)
    ranks(4).run(run_case, case, distributed_reference=True)


@pytest.mark.slow
def test_stragglers_back_to_back_bit_identical(ranks):
    """20 calls, new routing each time, random per-rank delays; same seed -> same bits."""
    case = Case(4, 16, 128, 4, (24, 5, 17, 30), torch.bfloat16, "zipf", 1, seed=41)
    first = ranks(4).run(run_case, case, iterations=20, straggle_s=0.05)
    second = ranks(4).run(run_case, case, iterations=20, straggle_s=0.05)
    assert first == second
    assert len(set(first[0])) == 20, "each iteration should produce different data"


@pytest.mark.parametrize("world_size", [2, 4])
def test_gradients_match_reference_autograd(ranks, world_size):
    case = Case(world_size, 4 * world_size, 32, 2, tuple(5 + 3 * r for r in range(world_size)),
                torch.float64, "uniform", 4, seed=51)
    ranks(world_size).run(gradients, case)


@pytest.mark.parametrize("in_kernels", [False, True], ids=["host-waits", "kernel-waits"])
def test_peer_that_skips_a_call_is_named_within_the_timeout(ranks, in_kernels):
    case = Case(4, 8, 64, 2, (6, 6, 6, 6), seed=61)
    timeout_s = 2.0
    reports = ranks(4).run(skip_one_call, case, skipper=2, wait_timeout_s=timeout_s,
                           in_kernels=in_kernels)
    for rank, report in enumerate(reports):
        if rank == 2:
            assert report["raised"] is None
            continue
        assert report["peer"] == 2, report
        assert f"moe_comm rank {rank}" in report["raised"], report
        assert names_rank(report["raised"], 2), report
        assert "expected epoch >= 1, observed 0" in report["raised"]
        assert timeout_s <= report["elapsed_s"] < timeout_s + 5, report
        assert "unusable" in report["later"]


def test_bad_inputs_raise_clear_errors(ranks):
    case = Case(2, 8, 64, 2, (7, 5), seed=71)
    for rank, errors in enumerate(ranks(2).run(bad_inputs, case)):
        missing = [name for name, text in errors.items() if text is None]
        assert not missing, f"rank {rank}: no error for {missing}"
        assert "ValueError" in errors["too_many_tokens"] and "max_tokens_per_rank" in \
            errors["too_many_tokens"]
        assert "row 0 picks expert" in errors["duplicate_expert"] and "twice" in \
            errors["duplicate_expert"]
        assert "holds expert id 8" in errors["expert_too_large"]
        assert "holds expert id -2" in errors["expert_below_minus_one"]
        assert "TypeError" in errors["dtype"] and "TypeError" in errors["idx_dtype"]
        assert "another Buffer" in errors["other_buffer_handle"]
        assert "older dispatch" in errors["older_handle"]


@pytest.mark.parametrize("kind", ["range", "repeat"])
def test_a_bad_expert_row_goes_nowhere_and_raises_after_the_call(ranks, kind):
    case = Case(4, 16, 64, 2, (6, 5, 6, 4), seed=72)
    reports = ranks(4).run(bad_expert_row, case, bad_rank=1, kind=kind)
    for rank, report in enumerate(reports):
        if rank != 1:
            assert report["raised"] is None, report
            continue
        expect = "holds expert id 19" if kind == "range" else "picks expert 1 twice"
        assert "topk_idx row 2" in report["raised"] and expect in report["raised"], report


@pytest.mark.slow
def test_kernel_waits_across_processes_with_stragglers(ranks):
    """The GPU flavour's waits (in the kernels: spin, deadline, acquire, error record) between
    CPU ranks, calls back to back with random delays: every result equals the oracle."""
    case = Case(4, 16, 128, 4, (9, 4, 0, 7), routing="zipf", alignment=4, seed=73)
    digests = ranks(4).run(run_case_kernel_waits, case, iterations=4, straggle_s=0.05)
    assert all(len(d) == 4 for d in digests)


def test_constructor_names_the_rank_that_differs(ranks):
    errors = ranks(4).run(construct, {2: dict(hidden=128)})
    for text in errors:
        assert text is not None and "rank 2 passed hidden=128" in text, text
    # num_sms too: on GPUs the ring of a call in rounds depends on it (moe_comm.rings)
    for text in ranks(4).run(construct, {1: dict(num_sms=4)}):
        assert text is not None and "rank 1 passed num_sms=4" in text, text


@pytest.mark.parametrize("kwargs, expect", [
    (dict(num_experts=6), "not divisible by the world size"),
    (dict(hidden=0), "hidden must be a positive int"),
    (dict(dtype=torch.int32), "dtype must be one of"),
    (dict(num_sms=0), "num_sms must be a positive int"),
])
def test_constructor_rejects_bad_config(ranks, kwargs, expect):
    for text in ranks(4).run(construct, {"all": kwargs}):
        assert text is not None and expect in text, text


def _delta(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def test_bytes_on_the_link_are_the_minimum_and_launches_as_documented(ranks):
    R, E, H, K = 4, 16, 128, 4
    case = Case(R, E, H, K, (20, 0, 13, 31), torch.bfloat16, "zipf", 1, seed=81)
    L, row_bytes, meta_bytes = E // R, H * 2, 4 * (1 + 3 * K)
    for rank, rep in enumerate(ranks(R).run(count_traffic, case)):
        # a token crosses to a rank once: the receiver's staging holds exactly one row per token
        assert rep["written_rows_from"] == rep["received_from"], rank
        d_stats = _delta(rep["stats"][1], rep["stats"][0])
        peers = [d for d in range(R) if d != rank]
        to_peers = sum(rep["sent_to"][d] * (row_bytes + meta_bytes) for d in peers) \
            + len(peers) * (4 * (L + 1) + 8)
        assert d_stats["dispatch_bytes_to_peers"] == to_peers, rank
        assert d_stats["dispatch_bytes_to_self"] == \
            rep["sent_to"][rank] * (row_bytes + meta_bytes) + 4 * (L + 1) + 8
        c_stats = _delta(rep["stats"][2], rep["stats"][1])
        assert c_stats["combine_bytes_to_peers"] == \
            sum(rep["received_from"][s] * row_bytes for s in peers) + 8 * len(peers)
        got_any = sum(rep["received_from"]) > 0
        assert _delta(rep["launches"][1], rep["launches"][0]) == \
            {"layout": 2, "dispatch_send": 1, "received_layout": 1,
             "dispatch_expand": int(got_any)}
        has_tokens = case.tokens[rank] > 0
        assert _delta(rep["launches"][2], rep["launches"][1]) == \
            {"layout": 0, "dispatch_send": 0, "received_layout": 0, "dispatch_expand": 0,
             "combine_send": 1, "combine_reduce": int(has_tokens)}


def test_compiled_pool_spawns_ranks_whose_kernels_compile(ranks):
    """``RankPool(compiled=True)`` (GPU ranks as processes): spawned, not forked from the
    interpreter's fork server, so the kernels a rank imports compile; the default pool's
    ranks interpret them."""
    from moe_comm.testing.launch import RankPool

    with RankPool(2, compiled=True) as pool:
        assert pool.run(launch_mode) == [("0", "JITFunction", 2)] * 2
    assert ranks(2).run(launch_mode) == [("1", "InterpretedFunction", 2)] * 2


def test_the_gpu_proxy_job_holds_on_cpu_ranks(ranks):
    """tests/gpu_proxy_jobs.py between CPU ranks (host memory): a kernel posts, the proxy moves
    contiguous and strided rows and raises each signal after them."""
    pytest.importorskip("nixl_cu13")
    import gpu_proxy_jobs

    facts = ranks(2).run(gpu_proxy_jobs.device_to_device, row_bytes=256, rows=8, device="cpu")
    assert facts == [{"bytes": {"first": 8 * 256, "second": 4 * 128}, "messages": 2,
                      "memory": "DRAM"}] * 2, facts


@pytest.mark.parametrize("job", ["normal", "rounds", "low-latency", "proxy", "proxy-low-latency",
                                 "proxy-hierarchical"])
def test_the_gpu_process_jobs_hold_on_cpu_ranks(ranks, job):
    """The jobs tests/test_gpu_processes.py runs on a GPU, run here on CPU ranks (their checks
    against the reference, the warm-up, the rounds; through the proxy with a node per rank,
    the waits in the kernels) so that a GPU run fails only for what a GPU changes."""
    import gpu_process_jobs as jobs

    proxy = dict(transport="nixl", ranks_per_node=1, hierarchical=False)
    if job.startswith("proxy"):
        pytest.importorskip("nixl_cu13")
    normal = Case(2, 8, 256, 4, (13, 21), routing="zipf", alignment=16, seed=61)
    low = Case(2, 4, 256, 4, (16, 16), seed=62)
    run = {
        "normal": lambda: ranks(2).run(jobs.normal_mode, normal, True, calls=2, warm=True,
                                       device="cpu"),
        "rounds": lambda: ranks(2).run(jobs.normal_mode, normal, False, ring_slots=4, calls=2,
                                       device="cpu"),
        "low-latency": lambda: ranks(2).run(jobs.low_latency, low, "triton", calls=2,
                                            device="cpu"),
        "proxy": lambda: ranks(2).run(with_kernel_waits, jobs.normal_mode, normal, False,
                                      calls=2, device="cpu", **proxy),
        "proxy-low-latency": lambda: ranks(2).run(with_kernel_waits, jobs.low_latency, low,
                                                  "triton", calls=2, device="cpu", **proxy),
        "proxy-hierarchical": lambda: ranks(4).run(
            with_kernel_waits, jobs.normal_mode, Case(4, 16, 256, 4, (13, 21, 0, 9),
                                                      routing="zipf", alignment=16, seed=63),
            False, calls=2, device="cpu", transport="nixl", ranks_per_node=2,
            hierarchical=True),
    }[job]
    facts = run()
    assert len(facts) == (4 if job == "proxy-hierarchical" else 2), facts
    assert all(f["first_call_s"] > 0 for f in facts), facts
    assert facts[0]["rounds"] == (6 if job == "rounds" else 1), facts
    assert facts[0]["transport"] == (2 if job.startswith("proxy") else 0), facts
    if job == "normal":
        assert facts[0]["warmup"][0] == 0, facts  # interpreted kernels: nothing to compile
