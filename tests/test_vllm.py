"""vLLM 0.33.0's DeepEP prepare/finalize classes (``--all2all-backend deepep_high_throughput``
and ``deepep_low_latency``) over ``moe_comm.deep_ep`` on 2 CPU ranks (``vllm_jobs``).

vLLM 0.33.0 pins ``torch==2.14.0``; it runs in its own environment (``.venv-vllm``,
``make test-vllm``), not in the suite's. The stand-ins for its CUDA-only pieces are listed in
``vllm_shims``.
"""
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm installs it in "
                                   ".venv-vllm)")

import vllm_jobs  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def vllm_imported(ranks):
    """vLLM imported on both ranks before the first job's collectives."""
    assert ranks(2).run(vllm_jobs.import_vllm) == ["CpuPlatform"] * 2


def _check(reports: list[dict], world_size: int) -> None:
    assert len(reports) == world_size
    for report in reports:
        assert report["calls"] == 2, report
        assert report["worst_ratio"] <= 1.0, report


def test_high_throughput_prepare_finalize(ranks):
    """DeepEPHTPrepareAndFinalize from vLLM's factory, its Buffer the facade's: the received
    rows, top-k ids (global, vLLM's -1 remapping), weights and per-expert counts equal DeepEP's
    normal-mode model; the output equals the model bit for bit, equals vLLM's path without EP
    bit for bit on tokens whose experts all sit on one rank, and is within the stated bound
    elsewhere and of the float64 reference."""
    reports = ranks(2).run(vllm_jobs.high_throughput, (6, 5), 256, 8, 3, seed=1)
    _check(reports, 2)
    assert all(r["tokens"] > 0 for r in reports), reports
    assert sum(r["equal_to_no_ep"] for r in reports) > 0, reports


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-dispatch"])
def test_low_latency_prepare_finalize(ranks, fp8):
    """DeepEPLLPrepareAndFinalize from vLLM's factory, its Buffer sized by the facade's
    ``get_low_latency_rdma_size_hint``: the [L, R * T, H] blocks and counts equal DeepEP's
    low-latency model (with ``fp8``: vLLM's ``use_fp8_dispatch``, the pair dequantizes to
    DeepEP's 128-channel FP8 groups); the output equals the weighted fp32 combine bit for bit
    and is within the stated bound of vLLM's path without EP and of the float64 reference."""
    reports = ranks(2).run(vllm_jobs.low_latency, (4, 3), 2048, 4, 2, seed=2 + fp8, fp8=fp8)
    _check(reports, 2)
    assert all(r["tokens"] > 0 for r in reports), reports


def test_rank_without_tokens(ranks):
    """A DP rank with no tokens in both modes: it still takes part in the dispatch and the
    combine, and the other rank's results are checked as above."""
    ht = ranks(2).run(vllm_jobs.high_throughput, (9, 0), 512, 4, 2, seed=4)
    ll = ranks(2).run(vllm_jobs.low_latency, (5, 0), 2048, 4, 2, seed=5)
    for reports in (ht, ll):
        _check(reports, 2)
        assert reports[1]["tokens"] == 0 and reports[0]["tokens"] > 0, reports
