"""Fault tolerance on CPU ranks: ranks are killed for real and the survivors keep serving.

Each kill test has its own pool of ranks (a killed rank leaves its process group broken); the
survivors check the call in which the rank died and 20 more against the reference computed
over the survivors (``fault_jobs``). Timeouts are seconds: long enough that a loaded 2-core
machine never makes a live rank look dead, short enough to keep the suite fast.
"""
import contextlib
import os

import fault_jobs
import pytest
import torch

import moe_comm
from cases import Case
from moe_comm.testing.launch import RankPool

CALLS = 22  # the rank dies in call 1: that call and 20 more
# deaths inside combine happen at call 2: both staging parities then hold the dying rank's
# stale partials (and garbage, fault_jobs), which a sum that does not leave it out would add
IN_COMBINE_CALL = 2
# seconds before a silent rank is excluded: a live rank lags its peers by at most about one
# call (0.3 s at 4 ranks, 1 to 3 s at 8 or across nodes under the interpreter on 2 cores)
TIMEOUT_S, TIMEOUT_8_S, TIMEOUT_NODES_S = 6.0, 8.0, 8.0


def _calls(kills: dict) -> int:
    """Calls enough for the call of the last death and 20 more."""
    return max(k for k, _ in kills.values()) + 21


def _shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("moe_comm")}


@contextlib.contextmanager
def fresh_pool(world_size: int):
    """A pool of its own (a killed rank breaks its process group); afterwards nothing of it
    is left: no process, no file in /dev/shm."""
    before = _shm()
    pool = RankPool(world_size)
    try:
        yield pool
    finally:
        pool.close()
    assert not any(p.is_alive() for p in pool._procs), "a rank process is still running"
    assert _shm() <= before, f"files left in /dev/shm: {sorted(_shm() - before)}"


def _survivors(results, dead):
    return {r: res for r, res in enumerate(results) if r not in dead}


def _check_agreement(survivors, dead, key="active"):
    want = [r not in dead for r in range(len(survivors) + len(dead))]
    for rank, res in survivors.items():
        assert res[key] == want, f"rank {rank} sees active ranks {res[key]}, want {want}"


@pytest.mark.parametrize("point", ["between", "after_dispatch_send", "in_combine"])
def test_kill_one_rank_normal_mode_4_ranks(point):
    """(a) between calls (the low-latency Buffer built beside it finds the rank dead too),
    (b) after its dispatch send, (c) inside combine; (b) with a token whose experts all live on
    the dead rank (it comes back as zeros), (c) with renormalised weights."""
    R = 4
    case = Case(R, 2 * R, 128, 2, (6, 0, 7, 5), seed=3)
    kwargs = dict(between=dict(ll_case=case, clean_after=True), after_dispatch_send=dict(pin=1),
                  in_combine=dict(renormalize=True))[point]
    kills = {1: (IN_COMBINE_CALL if point == "in_combine" else 1, point)}
    with fresh_pool(R) as pool:
        results = pool.run(fault_jobs.normal_mode_with_failures, case, kills, _calls(kills),
                           TIMEOUT_S, may_die=(1,), **kwargs)
    assert results[1] is None
    survivors = _survivors(results, {1})
    _check_agreement(survivors, {1})
    if point == "between":
        _check_agreement(survivors, {1}, "ll_active")
        _check_agreement(survivors, {1}, "cleaned")
        # its process had ended: excluded at once (its pid), not after the timeout
        waited = [w for res in survivors.values() for w in res["waited"]]
        assert waited and all(w == 0.0 for w in waited), waited
    assert any(res["excluded"] == [1] for res in survivors.values())


@pytest.mark.parametrize("point", ["after_dispatch_send", "in_combine"])
def test_kill_one_rank_low_latency_4_ranks(point):
    R = 4
    case = Case(R, 2 * R, 256, 2, (6, 7, 0, 5), seed=5)
    with fresh_pool(R) as pool:
        results = pool.run(fault_jobs.low_latency_with_failures, case, {2: (1, point)}, CALLS,
                           TIMEOUT_S, fp8=point == "in_combine",
                           renormalize=point == "after_dispatch_send",
                           by_timeout=point == "in_combine", may_die=(2,))
    survivors = _survivors(results, {2})
    _check_agreement(survivors, {2})


def test_five_ranks_die_8_ranks():
    """Normal mode: in call 1 rank 2 dies between calls, rank 5 after its dispatch send and rank
    6 inside combine; the low-latency Buffer built beside it finds them dead, then loses rank 3
    after its dispatch send and rank 7 after its combine send. Three survivors agree."""
    R = 8
    case = Case(R, 2 * R, 128, 2, (5, 6, 0, 4, 6, 3, 5, 6), seed=11)
    ll_case = Case(R, 2 * R, 256, 2, (5, 6, 4, 4, 6, 3, 5, 6), routing="zipf", seed=13)
    kills = {2: (1, "between"), 5: (1, "after_dispatch_send"),
             6: (IN_COMBINE_CALL, "in_combine")}
    ll_kills = {3: (1, "after_dispatch_send"), 7: (1, "in_combine")}
    dead = set(kills) | set(ll_kills)
    with fresh_pool(R) as pool:
        results = pool.run(fault_jobs.normal_mode_with_failures, case, kills, _calls(kills),
                           TIMEOUT_8_S, may_die=tuple(dead), ll_case=ll_case, ll_kills=ll_kills)
    survivors = _survivors(results, dead)
    assert sorted(survivors) == [0, 1, 4]
    want = [r not in kills for r in range(R)]
    for rank, res in survivors.items():
        assert res["active"] == want, (rank, res["active"])
    _check_agreement(survivors, dead, "ll_active")


NODES = dict(ranks_per_node=2, transport="nixl")  # two nodes of two ranks, flat


@pytest.mark.parametrize("in_kernels", [False, True], ids=["host-waits", "kernel-waits"])
def test_kill_across_nodes(in_kernels):
    """Two nodes of two ranks, the proxy between them: rank 3 dies between calls; its node
    peer (stores) and the other node (the proxy) exclude it; the low-latency Buffer finds it
    too; then clean_mask over both nodes. Three calls after the kill (the proxy is slow under
    the interpreter). ``in_kernels``: the waits run in the kernels, as on GPUs."""
    R = 4
    case = Case(R, 2 * R, 128, 2, (6, 5, 7, 5), seed=37)
    with fresh_pool(R) as pool:
        results = pool.run(fault_jobs.normal_mode_with_failures, case, {3: (1, "between")}, 4,
                           TIMEOUT_NODES_S, ll_case=case, clean_after=True, may_die=(3,),
                           in_kernels=in_kernels, **NODES)
    survivors = _survivors(results, {3})
    for key in ("active", "ll_active", "cleaned"):
        _check_agreement(survivors, {3}, key)


@pytest.mark.parametrize("kills", [{3: (1, "between")},
                                   {3: (1, "after_dispatch_send"),
                                    1: (IN_COMBINE_CALL, "in_combine")}],
                         ids=["between", "after_dispatch_send_and_in_combine"])
def test_kill_with_waits_in_kernels(kills):
    """The GPU protocol (the kernels wait, time out and mark the mask themselves), run by the
    interpreter: a rank dies between calls (both modes); or one dies after its dispatch send
    and another inside combine (normal mode: the in-kernel waits of combine exclude them)."""
    R = 4
    case = Case(R, 2 * R, 128, 2, (6, 5, 7, 5), seed=17)
    between = list(kills.values()) == [(1, "between")]
    with fresh_pool(R) as pool:
        results = pool.run(fault_jobs.normal_mode_with_failures, case, kills,
                           6 if between else max(k for k, _ in kills.values()) + 3, TIMEOUT_S,
                           in_kernels=True, ll_case=case if between else None,
                           may_die=tuple(kills))
    survivors = _survivors(results, set(kills))
    _check_agreement(survivors, set(kills))
    if between:
        _check_agreement(survivors, set(kills), "ll_active")


def test_stale_rank_is_fenced_then_readmitted():
    R = 4
    case = Case(R, 2 * R, 128, 2, (6, 5, 7, 5), seed=19)
    with fresh_pool(R) as pool:
        results = pool.run(fault_jobs.stale_rank_readmitted, case, 2, TIMEOUT_S)
    assert "rank 2 was excluded from the expert-parallel group" in results[2]["refused"]
    for rank, res in enumerate(results):
        assert res["active"] == [True] * R and res["after"] == [True] * R, (rank, res)


def test_mask_rank_then_readmit(ranks):
    R = 4
    case = Case(R, 2 * R, 128, 2, (6, 5, 7, 5), seed=23)
    ll_case = Case(R, 2 * R, 256, 2, (4, 5, 3, 5), seed=29)
    results = ranks(R).run(fault_jobs.masked_on_purpose, case, ll_case, 3)
    assert set(results[3]) >= {"normal", "low_latency"}
    assert "excluded from the expert-parallel group by rank" in results[3]["normal"]
    for rank, res in enumerate(results):
        assert res["active"] == [[True, True, True, False]] * 2, (rank, res)
        assert res["cleaned"] == [[True] * R] * 2, (rank, res)


def test_a_mark_landing_during_readmit_is_taken_back(ranks):
    R = 4
    case = Case(R, 2 * R, 128, 2, (4, 6, 5, 3), seed=37)
    for rank, active in enumerate(ranks(R).run(fault_jobs.late_mark_readmitted, case, 0, 2,
                                               1.0)):
        assert active == [True] * R, (rank, active)


@pytest.mark.parametrize("in_kernels", [False, True])
def test_no_failure_no_extra_launch_or_sync(ranks, in_kernels):
    R = 2
    case = Case(R, 4, 128, 2, (5, 6), seed=31)
    for rank, costs in enumerate(ranks(R).run(fault_jobs.no_failure_costs, case, in_kernels)):
        assert costs[True] == costs[False], (rank, costs)


def test_fault_tolerance_arguments():
    bufs = moe_comm.Buffer.loopback(2, 64, 4, 8)
    with pytest.raises(RuntimeError, match="fault_tolerant=True"):
        bufs[0].mask_rank(1)
    with pytest.raises(RuntimeError, match="fault_tolerant=True"):
        bufs[0].clean_mask()
    assert bufs[0].active_ranks().tolist() == [True, True]
    assert bufs[0].active_ranks().dtype == torch.bool
