"""SGLang 0.5.21's DeepEP token dispatcher, as ``--moe-a2a-backend deepep`` builds it, over
``moe_comm.deep_ep.install()`` on two CPU ranks, against a dense computation over all experts
from the same global inputs (no expert parallelism, no dispatcher).

SGLang itself builds the dispatcher on each rank: ``ServerArgs(tp_size=2, ep_size=2,
moe_a2a_backend="deepep", deepep_mode=..., deepep_dispatcher_output_dtype=...)`` published,
its parallel groups built on the ranks' gloo world, ``create_moe_dispatcher`` ->
``MaybeTboDeepEPDispatcher`` -> ``DeepEPDispatcher(async_finish=True, return_recv_hook=True)``.
Its ``DeepEPBuffer`` constructs ``deep_ep.Buffer``, which is ``moe_comm.deep_ep.Buffer``. The
stand-ins for CUDA-only pieces are listed in ``sglang_shims``; the expert stage and the
reference, and how exact each mode is, in ``sglang_jobs``:

* low-latency mode (bf16 and FP8 dispatch): equal to the reference (``torch.equal``);
* normal mode (bf16 and FP8 dispatch): equal for tokens whose choices live on one rank, within
  bf16 rounding of the per-rank partial sums for the others (SGLang's ``ep_gather`` writes each
  rank's weighted sum as bf16 before DeepEP's combine adds them);
* ``--deepep-mode auto``: prefill batches in normal mode, decode batches in low-latency mode,
  alternating on one dispatcher and one buffer.

Not run here, and why: SGLang's ``ep_scatter`` / ``ep_gather`` Triton kernels (DeepEP normal
layout <-> DeepGEMM's contiguous layout) index with ``.to(tl.int64)`` on ``range`` loop
variables, which Triton 3.9's interpreter yields as Python ints (``AttributeError: 'int'
object has no attribute 'to'``); the expert stage computes what they compute in PyTorch. The
expert GEMMs (DeepGEMM, CUDA only) are the elementwise stand-in expert.

SGLang is imported only inside the test's own rank processes, never in the pytest process:
``import sglang`` sets defaults for ``TRITON_CACHE_DIR`` and other cache variables and patches
transformers, which would leak into every later test. The ranks are a pool of their own,
closed at the end of the module, for the same reason.
"""
import importlib.metadata
import importlib.util
import os

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.importorskip("sglang", reason="sglang is not installed (make test installs "
                        "sglang==0.5.21 and its import chain without dependencies)")

import sglang_jobs
import sglang_shims

from moe_comm.testing.launch import RankPool

if importlib.metadata.version("sglang") != sglang_shims.SGLANG_VERSION:
    pytest.skip(f"sglang {importlib.metadata.version('sglang')} is installed; the stand-ins "
                f"are written for {sglang_shims.SGLANG_VERSION}", allow_module_level=True)

WORLD = 2
EXPERTS, TOPK = 8, 3
BATCHES = [(5, 7), (3, 4)]  # tokens per rank, per call (the second call reuses the buffer)
FIRST_JOB_S = 240  # the first job imports SGLang on every rank


def _shm_entries() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("moe_comm")}
    except FileNotFoundError:
        return set()


@pytest.fixture(scope="module")
def sglang_ranks():
    before = _shm_entries()
    pool = RankPool(WORLD, timeout_s=FIRST_JOB_S)
    try:
        yield pool
    finally:
        pool.close()
    leaked = _shm_entries() - before
    assert not leaked, f"files left in /dev/shm: {sorted(leaked)}"


def _check(reports, deepep_mode: str):
    """How SGLang built it on every rank, and that the inputs exercised both kinds of token
    (choices on one rank, choices on both)."""
    flags = {"normal": {"async_finish": True}, "low_latency": {"return_recv_hook": True},
             "auto": {"async_finish": True, "return_recv_hook": True}}[deepep_mode]
    for rep in reports:
        assert rep["dispatcher"] == ["MaybeTboDeepEPDispatcher", "DeepEPDispatcher"], rep
        assert rep["flags"] == flags, rep
        assert rep["buffer"] == ["moe_comm.deep_ep.buffer", deepep_mode != "normal"], rep
    calls = [call for rep in reports for call in rep["calls"]]
    spanning = sum(call["spanning"] for call in calls)
    assert 0 < spanning < sum(call["tokens"] for call in calls), \
        f"every token or no token spans both ranks: weak test ({calls})"
    return calls


@pytest.mark.parametrize("output_dtype", ["bf16", "fp8"])
def test_normal_mode_matches_dense_within_bf16_partial_sums(sglang_ranks, output_dtype):
    reports = sglang_ranks.run(sglang_jobs.deepep_mode_job, "normal", output_dtype, EXPERTS, TOPK,
                               BATCHES, 11, timeout_s=FIRST_JOB_S)
    calls = _check(reports, "normal")
    assert any(call["max_abs_diff"] > 0 for call in calls), \
        "no partial sum rounded: the bound was not exercised"


@pytest.mark.parametrize("output_dtype", ["bf16", "fp8"])
def test_low_latency_mode_equals_dense(sglang_ranks, output_dtype):
    reports = sglang_ranks.run(sglang_jobs.deepep_mode_job, "low_latency", output_dtype, EXPERTS,
                               TOPK, BATCHES, 12, timeout_s=FIRST_JOB_S)
    calls = _check(reports, "low_latency")
    assert all(call["max_abs_diff"] == 0.0 for call in calls), calls


def test_auto_mode_switches_normal_and_low_latency_per_batch(sglang_ranks):
    reports = sglang_ranks.run(sglang_jobs.auto_mode_job, "fp8", EXPERTS, TOPK,
                               [(5, 7), (3, 4), (6, 2)], 13, timeout_s=FIRST_JOB_S)
    _check(reports, "auto")
    for rep in reports:
        assert rep["modes"] == ["normal", "low_latency", "normal"], rep
