"""GPU tests with one process per rank (``pytest -m gpu``, ``TRITON_INTERPRET=0``): 2 and 4
processes share one GPU, each with its own Buffer over the ``cuda`` heap (every peer's segment
mapped into every process), both modes, bf16 and FP8, both low-latency kernel implementations,
bounded staging in rounds, and a CUDA graph captured and replayed in every process; then 2
processes over the ``nvshmem`` heap, each its own node, so that every row between them moves by
NVSHMEM device puts (Triton's NVSHMEM-linked kernels and csrc/'s); then the proxy's GPU half,
alone (``gpu_proxy_jobs``), under 2 Buffers, each its own node, whose rows all go through the
proxy (NIXL, device memory to device memory), and under 4 in hierarchical mode (two nodes of
two); every result checked on its rank against the reference (``gpu_process_jobs``).

What it proves and what it does not: the heap's mapping across processes, the in-kernel waits
on peers that are other processes, and graph replays that wait on other processes' graphs. The
processes' kernels take turns on the GPU (no MPS), so the times printed (each process's first
call, which compiles or loads every kernel) are not performance numbers.

Skipped where there is no CUDA device; bench/gpu_check.sh runs them on a lent GPU.
"""
import os

import gpu_process_jobs as jobs
import pytest
import torch

from cases import Case
from moe_comm.symm.cuda import OVERLAP_ENV
from moe_comm.testing.launch import RankPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="GPU tests run compiled kernels: set TRITON_INTERPRET=0"),
]
# a wait ends after the peer's time slice; the first call of a process loads its kernels
ENV = {OVERLAP_ENV: "1", "MOE_COMM_TIMEOUT_S": "60", "CUDA_VISIBLE_DEVICES": "0"}


@pytest.fixture(scope="module")
def gpu_ranks():
    pools = {}

    def get(world_size: int, heap: str = "cuda") -> RankPool:
        """A pool per size and heap (a process joins one NVSHMEM job for its life)."""
        key = (world_size, heap)
        if key not in pools or not pools[key].healthy():
            pools[key] = RankPool(world_size, env=ENV, compiled=True, timeout_s=300)
        return _EndedByFailure(pools[key])

    yield get
    for pool in pools.values():
        pool.close()


class _EndedByFailure:
    """A pool whose failed job ends it: a process whose CUDA context took an error (sticky
    after an illegal access) would fail every later test, so the next one gets new processes."""

    def __init__(self, pool: RankPool):
        self.pool = pool

    def run(self, *args, **kwargs) -> list:
        try:
            return self.pool.run(*args, **kwargs)
        except BaseException:
            self.pool.close(force=True)
            raise


def _report(what: str, facts: list[dict]) -> None:
    warm = facts[0]["warmup"]
    print(f"{what}: mapping {facts[0]['mapping']!r}, rounds {facts[0]['rounds']}, transport "
          f"{facts[0]['transport']}, first call {[f['first_call_s'] for f in facts]} s per "
          "process (" + ("compile or load included" if warm is None else
                         f"after a warm-up of {warm[0]} variants in "
                         f"{[f['warmup'][1] for f in facts]} s") + ")")
    assert all(f["mapping"] == facts[0]["mapping"] for f in facts), facts


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("fp8", [False, True])
def test_normal_mode_across_processes_matches_reference(gpu_ranks, world_size, fp8):
    """The FP8 runs warm up first (``Buffer.warmup``): their first call loads its kernels."""
    case = Case(world_size, 8 * world_size, 2048, 8,
                tuple(64 + 9 * r for r in range(world_size)), routing="zipf", alignment=16,
                seed=world_size)
    facts = gpu_ranks(world_size).run(jobs.normal_mode, case, fp8, warm=fp8)
    if fp8:
        assert all(f["warmup"][0] > 0 for f in facts), facts
    _report(f"normal R={world_size} fp8={fp8}", facts)


@pytest.mark.parametrize("fp8", [False, True])
def test_normal_mode_in_rounds_across_processes_matches_reference(gpu_ranks, fp8):
    """16 slots per source: 7 rounds a call at 100 tokens, each round's wait on other
    processes."""
    case = Case(4, 32, 2048, 8, (64, 73, 0, 100), routing="zipf", alignment=16, seed=17)
    facts = gpu_ranks(4).run(jobs.normal_mode, case, fp8, ring_slots=16)
    assert facts[0]["rounds"] == 7
    _report(f"normal in rounds fp8={fp8}", facts)


def test_normal_mode_rounds_cut_to_one_launch_across_processes(gpu_ranks):
    """A budget of 1024 slots per source at 1200 tokens, 4 programs: the ring is cut to the 240
    slots one launch runs a round of (``moe_comm.rings``), 5 rounds a call, and every call's
    rounds run in one launch a dispatch (after round 0's send) and one a combine."""
    case = Case(4, 32, 2048, 8, (600, 0, 1100, 1200), routing="zipf", alignment=16, seed=23)
    facts = gpu_ranks(4).run(jobs.normal_mode, case, False, ring_slots=1024, num_sms=4)
    assert all(f["ring_slots"] == 240 and f["rounds"] == 5 for f in facts), facts
    assert all(f["one_launch"] == {"dispatch_rounds": 3, "combine_rounds": 3}
               for f in facts), facts
    _report("normal in rounds cut to one launch", facts)


@pytest.mark.parametrize("world_size", [2, 4])
def test_normal_mode_graph_replays_across_processes(gpu_ranks, world_size):
    case = Case(world_size, 8 * world_size, 2048, 8, (64,) * world_size, routing="zipf",
                alignment=16, seed=13)
    _report(f"graph R={world_size}",
            gpu_ranks(world_size).run(jobs.normal_mode_graph, case, True))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kernel_impl", ["triton", "cuda"])
def test_low_latency_across_processes_matches_reference(gpu_ranks, world_size, kernel_impl):
    from test_gpu import _csrc_or_skip

    _csrc_or_skip(kernel_impl)
    case = Case(world_size, 4 * world_size, 7168, 8, (128,) * world_size, seed=3)
    _report(f"low latency R={world_size} {kernel_impl}",
            gpu_ranks(world_size).run(jobs.low_latency, case, kernel_impl))


# ------------------------------------------------------------------------------ NVSHMEM
# Two PEs on one GPU, each its own node (ranks_per_node=1): the pointer table holds 0 for the
# other, so the kernels put to it through NVSHMEM device calls, as to a rank on another host.
NVSHMEM = dict(backend="nvshmem", ranks_per_node=1)


def _carried_or_skip(module: str, wheel: str) -> None:
    """Skips unless ``module`` imports (the GPU image lacks ``wheel``; bench/gpu_check.sh
    installs the one carried in .whl/)."""
    pytest.importorskip(module, reason=f"{wheel} is not installed (bench/gpu_check.sh installs a "
                        "carried wheel from .whl/)")


def _nvshmem_or_skip() -> None:
    _carried_or_skip("nvshmem.core", "nvshmem4py")


@pytest.mark.parametrize("fp8", [False, True])
def test_nvshmem_puts_between_processes_normal_mode(gpu_ranks, fp8):
    _nvshmem_or_skip()
    case = Case(2, 16, 2048, 8, (64, 73), routing="zipf", alignment=16, seed=21)
    facts = gpu_ranks(2, "nvshmem").run(jobs.normal_mode, case, fp8, **NVSHMEM)
    assert [f["transport"] for f in facts] == [1, 1], facts
    _report(f"NVSHMEM normal fp8={fp8}", facts)


def test_nvshmem_puts_between_processes_in_rounds(gpu_ranks):
    _nvshmem_or_skip()
    case = Case(2, 16, 2048, 8, (64, 100), routing="zipf", alignment=16, seed=22)
    facts = gpu_ranks(2, "nvshmem").run(jobs.normal_mode, case, True, ring_slots=16,
                                         **NVSHMEM)
    assert facts[0]["rounds"] == 7 and facts[0]["transport"] == 1, facts
    _report("NVSHMEM normal in rounds", facts)


@pytest.mark.parametrize("kernel_impl", ["triton", "cuda"])
def test_nvshmem_puts_between_processes_low_latency(gpu_ranks, kernel_impl):
    from test_gpu import _csrc_or_skip

    _nvshmem_or_skip()
    _csrc_or_skip(kernel_impl)
    case = Case(2, 8, 7168, 8, (128, 128), seed=23)
    facts = gpu_ranks(2, "nvshmem").run(jobs.low_latency, case, kernel_impl, **NVSHMEM)
    assert [f["transport"] for f in facts] == [1, 1], facts
    _report(f"NVSHMEM low latency {kernel_impl}", facts)


# ------------------------------------------------------------------------------ the proxy
def test_proxy_moves_device_memory_between_processes(gpu_ranks):
    """The proxy's GPU half: descriptors posted by a kernel to a ring in pinned memory, NIXL
    WRITEs from device memory to the peer's device memory, the signal raised in device memory
    after the rows landed; contiguous and strided rows, every byte checked."""
    _nixl_or_skip()
    import gpu_proxy_jobs

    facts = gpu_ranks(2, "nixl").run(gpu_proxy_jobs.device_to_device)
    rows, row = 64, 14336
    for f in facts:
        assert f["memory"] == "VRAM"
        assert f["bytes"] == {"first": rows * row, "second": rows // 2 * row // 2}, f
        assert f["messages"] == 2, f
    print(f"proxy device to device: {facts}")


# A Buffer through the proxy: 2 processes of the GPU, each its own node (flat), so every row
# between them goes through the proxy's ring and NIXL, device memory to device memory.
PROXY = dict(transport="nixl", ranks_per_node=1, hierarchical=False)


def _nixl_or_skip() -> None:
    _carried_or_skip("nixl_cu13", "nixl-cu13")


@pytest.mark.parametrize("fp8", [False, True])
def test_proxy_between_processes_normal_mode(gpu_ranks, fp8):
    _nixl_or_skip()
    case = Case(2, 16, 2048, 8, (64, 73), routing="zipf", alignment=16, seed=24)
    facts = gpu_ranks(2, "nixl").run(jobs.normal_mode, case, fp8, **PROXY)
    assert [f["transport"] for f in facts] == [2, 2], facts
    _report(f"proxy normal fp8={fp8}", facts)


def test_proxy_between_processes_low_latency(gpu_ranks):
    _nixl_or_skip()
    case = Case(2, 8, 7168, 8, (128, 128), seed=25)
    facts = gpu_ranks(2, "nixl").run(jobs.low_latency, case, "triton", **PROXY)
    assert [f["transport"] for f in facts] == [2, 2], facts
    _report("proxy low latency", facts)


def test_proxy_between_processes_hierarchical(gpu_ranks):
    """Two nodes of two processes, hierarchical: rows cross once per node through the proxy
    and the forwarders (each waiting in a kernel) store them into their node's staging."""
    _nixl_or_skip()
    case = Case(4, 16, 2048, 8, (64, 73, 0, 50), routing="zipf", alignment=16, seed=26)
    facts = gpu_ranks(4, "nixl").run(jobs.normal_mode, case, False, transport="nixl",
                                      ranks_per_node=2, hierarchical=True)
    assert [f["transport"] for f in facts] == [2] * 4, facts
    _report("proxy normal hierarchical 2x2", facts)
