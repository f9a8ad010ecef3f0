"""Shared fixtures: the interpreter switch, pools of CPU ranks, and a /dev/shm leak check."""
import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import pytest  # noqa: E402

from moe_comm.testing.launch import RankPool  # noqa: E402

IN_CI = os.environ.get("CI", "").lower() == "true"
# vLLM's and SGLang's DeepEP paths run in their own environments (make test-vllm, make
# test-sglang: vLLM pins torch 2.14.0, both bring dozens of packages); where the framework is
# missing its module is left out instead of skipped
collect_ignore = [f"test_{name}.py" for name in ("vllm", "sglang")
                  if importlib.util.find_spec(name) is None]


def _fail_skip_in_ci(report, what: str) -> None:
    reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = "failed"
    report.longrepr = f"{what} skipped under CI=true (only GPU tests may skip): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true a skipped test fails unless it needs a GPU (``@pytest.mark.gpu``): a
    missing dependency on the CI machine must not pass as green."""
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and item.get_closest_marker("gpu") is None \
            and not hasattr(report, "wasxfail"):
        _fail_skip_in_ci(report, "test")


# MOE_COMM_FAILURES_AT_ONCE=1 (bench/gpu_check.sh): each failure's traceback is printed as it
# happens, so a run killed at its time limit still shows why the tests before it failed
FAILURES_AT_ONCE = os.environ.get("MOE_COMM_FAILURES_AT_ONCE", "") == "1"


def pytest_runtest_logreport(report):
    if FAILURES_AT_ONCE and report.failed:
        print(f"\n---- {report.nodeid} failed ({report.when}):\n{report.longreprtext}\n",
              flush=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a whole module skipped at import (``pytest.importorskip``)."""
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped:
        _fail_skip_in_ci(report, "module")

# make test compiles the gate's variants beside the suite (Makefile): the gate test runs last,
# when they are in the cache (from a cold cache alone it compiles them itself)
LAST = ("tests/test_gate.py::test_gate_passes_at_the_runtime_configurations",)


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.nodeid in LAST)  # stable: the rest keep their order


_pools: dict[int, RankPool] = {}


def _shm_entries() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("moe_comm")}
    except FileNotFoundError:
        return set()


@pytest.fixture(scope="session")
def ranks():
    """``ranks(R)`` -> a live RankPool of R gloo ranks, shared by every test of the session."""

    def get(world_size: int) -> RankPool:
        pool = _pools.get(world_size)
        if pool is None or not pool.healthy():
            pool = _pools[world_size] = RankPool(world_size)
        return pool

    before = _shm_entries()
    yield get
    for pool in _pools.values():
        pool.close()
    _pools.clear()
    leaked = _shm_entries() - before
    assert not leaked, f"files left in /dev/shm: {sorted(leaked)}"
