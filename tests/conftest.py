"""Shared fixtures: the interpreter switch, pools of CPU ranks, and a /dev/shm leak check."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import pytest  # noqa: E402

from moe_comm.launch import RankPool  # noqa: E402

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
