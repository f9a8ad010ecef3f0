"""CPU ranks grouped into nodes: every byte between nodes moves through the NIXL proxy."""
import pytest
import torch
from internode_jobs import (
    cross_node_bytes,
    idle_cpu_seconds,
    ll_nodes_case,
    no_pointer_to_another_node,
    nodes_case,
    stopped_proxy,
    vanished_peer,
)

from cases import Case
from ll_jobs import ll_pipelined_dispatches, ll_two_in_flight
from rank_jobs import gradients, with_kernel_waits

pytest.importorskip("nixl_cu13")

# (nodes x ranks per node, hierarchical, case, stragglers, fp8, ue8m0)
SETUPS = [
    ((2, 2), False, Case(4, 16, 128, 4, (13, 0, 9, 21), torch.bfloat16, "zipf", 16, seed=41),
     0.0, False, False),
    ((2, 2), True, Case(4, 16, 128, 4, (13, 0, 9, 21), torch.bfloat16, "zipf", 16, seed=41),
     0.05, False, False),
    ((2, 2), True, Case(4, 8, 256, 2, (7, 12, 0, 16), torch.bfloat16, "uniform", 1, seed=42),
     0.0, True, False),
    ((2, 2), True, Case(4, 16, 256, 4, (10, 3, 14, 0), torch.float16, "one_expert", 1,
                        seed=43), 0.0, True, True),
    ((4, 2), True, Case(8, 32, 128, 4, (6, 0, 9, 4, 11, 2, 7, 5), torch.bfloat16, "uniform", 1,
                        seed=44), 0.03, False, False),
    ((4, 2), False, Case(8, 16, 64, 2, (5, 8, 0, 3, 6, 4, 9, 1), torch.float32, "empty_rank", 1,
                         seed=45), 0.0, False, False),
    ((2, 4), True, Case(8, 32, 128, 8, (9, 4, 0, 12, 6, 3, 8, 11), torch.bfloat16, "zipf", 16,
                        seed=46), 0.03, False, False),
]


def _id(setup) -> str:
    (m, n), hier, case, straggle, fp8, ue8m0 = setup
    return (f"{m}x{n}-{'hier' if hier else 'flat'}-{case}"
            + ("-stragglers" if straggle else "") + ("-fp8" if fp8 else "")
            + ("-ue8m0" if ue8m0 else ""))


def _iterations(straggle: float) -> int:
    """Three calls where stragglers let a fast rank reuse a staging parity its peers may still
    read (the race double buffering must survive); two (both parities) elsewhere."""
    return 3 if straggle else 2


@pytest.mark.parametrize("setup", SETUPS, ids=_id)
def test_nodes_match_reference_bit_for_bit(ranks, setup):
    (m, n), hier, case, straggle, fp8, ue8m0 = setup
    reports = ranks(m * n).run(nodes_case, case, n, hier, iterations=_iterations(straggle),
                               straggle_s=straggle, fp8=fp8, ue8m0=ue8m0)
    for rank, rep in enumerate(reports):
        assert rep["threads"] == [], f"rank {rank}: threads left: {rep['threads']}"
        # nothing between nodes moved by stores: every byte across went through the proxy
        remote = [p for p in range(m * n) if p // n != rank // n]
        assert all(rep["peer_ptrs"][p] == 0 for p in remote), rank
        assert rep["stats"]["internode_dispatch_bytes"] > 0 or case.routing == "empty_rank"


def test_kernels_hold_no_pointer_to_another_node(ranks):
    case = Case(4, 8, 64, 2, (4, 4, 4, 4))
    for rank, rep in enumerate(ranks(4).run(no_pointer_to_another_node, case, 2)):
        node = rank // 2
        assert [p != 0 for p in rep["peer_ptrs"]] == [p // 2 == node for p in range(4)], rank
        assert rep["mapped"] == 2, f"rank {rank} maps {rep['mapped']} segments, not its node's 2"


def test_an_idle_proxy_leaves_the_cores_alone(ranks):
    """Between calls a rank's proxy sleeps (backing off to 1 ms) and nothing else of NIXL polls
    (NIXL's own progress thread, left on, spent about half a core per idle rank here): over
    2 s idle each rank's process, every thread counted, uses under a tenth of a core."""
    case = Case(4, 8, 64, 2, (5, 3, 0, 6), torch.bfloat16, "uniform", 1, seed=47)
    idle_s = 2.0
    spent = ranks(4).run(idle_cpu_seconds, case, 2, idle_s)
    assert all(s < 0.1 * idle_s for s in spent), spent


def test_gradients_across_nodes(ranks):
    case = Case(4, 16, 64, 4, (9, 5, 0, 12), torch.float64, "uniform", 16, seed=47)
    ranks(4).run(gradients, case, ranks_per_node=2, transport="nixl")


def _cross_node(ranks, case, n, hier):
    return ranks(case.world_size).run(cross_node_bytes, case, n, hier)


def test_hierarchical_cross_node_bytes_are_the_minimum_and_below_flat(ranks):
    """Dispatch: per token, one row per other node it has experts on, with its metadata
    (1 + 3K words, K = the Buffer's max_topk) and the slot on each of the node's N ranks (N
    words); per (source, other node) one message with the node's counts (N (L + 1) + 1
    words). Combine: one row per token per other node. Flat: the same per destination rank."""
    R, N, E, H, K = 8, 4, 32, 128, 8
    case = Case(R, E, H, K, (24, 17, 30, 9, 21, 0, 28, 12), torch.bfloat16, "uniform", 1,
                seed=48)
    L, row = E // R, H * 2
    hier = _cross_node(ranks, case, N, True)
    flat = _cross_node(ranks, case, N, False)
    total_hier = total_flat = 0
    for rank in range(R):
        h, f = hier[rank], flat[rank]
        for p in range(R):
            if p // N == rank // N:
                assert h["dispatch"][p] == f["dispatch"][p] == 0 and h["combine"][p] == 0
                continue
            if p % N == rank % N:  # the forwarder of p's node for this rank
                rows = h["to_node"][p // N]
                assert h["dispatch"][p] == rows * (row + 4 * (1 + 3 * K + N)) \
                    + 4 * (N * (L + 1) + 1), (rank, p)
                assert h["combine"][p] == h["from_node"][p] * row, (rank, p)
            else:
                assert h["dispatch"][p] == 0 and h["combine"][p] == 0, (rank, p)
            assert f["dispatch"][p] == f["to_rank"][p] * (row + 4 * (1 + 3 * K)) \
                + 4 * (L + 1), (rank, p)
        to_nodes = sum(h["to_node"][b] for b in range(R // N) if b != rank // N)
        to_ranks = sum(f["to_rank"][p] for p in range(R) if p // N != rank // N)
        total_hier += to_nodes
        total_flat += to_ranks
        # what the kernels wrote into the outboxes (flat: the send itself), counted where
        # written: those rows with their metadata
        assert f["stats"]["dispatch_bytes_to_outbox"] == to_ranks * (row + 4 * (1 + 3 * K)), \
            rank
        assert h["stats"]["dispatch_bytes_to_outbox"] == to_nodes * (row + 4 * (1 + 3 * K + N)), \
            rank
    # the node-dedup factor of this routing: rows across nodes, flat over hierarchical
    assert total_flat > 1.5 * total_hier


@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "hierarchical"])
def test_nodes_with_the_waits_in_the_kernels(ranks, hierarchical):
    """Through the proxy with the waits in the kernels (``MOE_COMM_WAIT=kernel``: how GPUs
    wait, interpreted), three calls with stragglers, bit for bit. A call waits in one kernel
    for the combine (the dispatch's received layout waits itself) and, hierarchical, in one
    more before each of the forwarders' kernels."""
    case = Case(4, 16, 128, 4, (13, 0, 9, 21), torch.bfloat16, "zipf", 16, seed=51)
    reports = ranks(4).run(with_kernel_waits, nodes_case, case, 2, hierarchical, iterations=3,
                           straggle_s=0.05)
    for rank, rep in enumerate(reports):
        waits = 3 * (3 if hierarchical else 1)
        assert rep["device_wait"] and rep["launches"]["wait"] == waits, (rank, rep["launches"])
        assert rep["threads"] == [], rank


def test_low_latency_across_nodes_with_the_waits_in_the_kernels(ranks):
    case = Case(4, 8, 256, 4, (16, 16, 16, 16), torch.bfloat16, seed=52)
    reports = ranks(4).run(with_kernel_waits, ll_nodes_case, case, 2, iterations=3,
                           straggle_s=0.05)
    for rank, rep in enumerate(reports):
        assert rep["device_wait"] and rep["ll_dispatch"] == rep["want_dispatch"], (rank, rep)
        assert rep["ll_combine"] == rep["want_combine"] and rep["threads"] == [], (rank, rep)


@pytest.mark.parametrize("in_kernels", [False, True], ids=["host-waits", "kernel-waits"])
def test_a_stopped_proxy_is_named_by_every_rank_within_the_timeout(ranks, in_kernels):
    """Kernel waits: a wait that timed out raises the transport's failure where there is one
    (the victim's), else names the rank it waited for; the other node's ranks wait for the
    victim and name it, a rank of the victim's node may wait for one of them that stopped
    first (a rank that raised sends no more) and names that one."""
    case = Case(4, 8, 64, 2, (6, 5, 7, 4), seed=49)
    timeout_s, victim = 3.0, 2
    job = (with_kernel_waits, stopped_proxy) if in_kernels else (stopped_proxy,)
    reports = ranks(4).run(*job, case, 2, victim, timeout_s)
    for rank, rep in enumerate(reports):
        assert rep["kind"] is not None, f"rank {rank} did not raise"
        assert rep["seconds"] < timeout_s + 2.0, (rank, rep)
        if not in_kernels or rank // 2 != victim // 2:
            assert victim in (rep["peer"], rep["via"]), (rank, rep["message"])
            assert f"rank {rep['peer']}" in rep["message"], (rank, rep["message"])
    assert reports[victim]["kind"] == "TransportError"


@pytest.mark.parametrize("low_latency", [False, True], ids=["normal-hier", "low-latency"])
def test_a_vanished_peer_is_named_across_nodes_and_nothing_hangs(ranks, low_latency):
    """Rank 2's agent vanishes: the ranks of the other node, which need it through the
    transport, name it within the timeout. Its own node's ranks reach it by stores; they raise
    too, bounded, naming whichever peer stopped first (a rank that raised sends no more)."""
    case = Case(4, 8, 128, 2, (6, 5, 7, 4), seed=50)
    timeout_s, victim = 3.0, 2
    reports = ranks(4).run(vanished_peer, case, 2, victim, timeout_s, low_latency)
    for rank, rep in enumerate(reports):
        assert rep["kind"] is not None, f"rank {rank} did not raise"
        assert rep["seconds"] < 2 * timeout_s + 2.0, (rank, rep)
        if rank // 2 != victim // 2:
            assert rep["kind"] in ("PeerTimeoutError", "TransportError"), (rank, rep)
            assert rep["seconds"] < timeout_s + 2.0, (rank, rep)
            assert victim in (rep["peer"], rep["via"]), (rank, rep["message"])
            assert f"rank {rep['peer']}" in rep["message"], (rank, rep["message"])


# ------------------------------------------------------------------------------ low latency
LL_SETUPS = [  # (nodes x ranks per node, case, stragglers, fp8, ue8m0)
    ((2, 2), Case(4, 16, 256, 4, (7, 0, 5, 8), torch.bfloat16, "zipf", seed=51), 0.05, False,
     False),
    ((2, 2), Case(4, 8, 256, 2, (6, 8, 3, 0), torch.bfloat16, "uniform", seed=52), 0.0, True,
     False),
    ((2, 4), Case(8, 16, 256, 4, (4, 0, 6, 3, 5, 2, 7, 1), torch.bfloat16, "uniform", seed=53),
     0.02, True, True),
    ((4, 2), Case(8, 32, 128, 8, (5, 3, 0, 6, 2, 4, 1, 7), torch.bfloat16, "empty_rank",
                  seed=54), 0.0, False, False),
]


def _ll_id(setup) -> str:
    (m, n), case, straggle, fp8, ue8m0 = setup
    return (f"{m}x{n}-{case}" + ("-stragglers" if straggle else "") + ("-fp8" if fp8 else "")
            + ("-ue8m0" if ue8m0 else ""))


@pytest.mark.parametrize("setup", LL_SETUPS, ids=_ll_id)
def test_low_latency_across_nodes_matches_reference_and_moves_the_minimum(ranks, setup):
    """Decode across nodes through the proxy: one descriptor per (token, expert) pair on
    another node, the expert's signal after them; results bit for bit, and the transport asked
    to move exactly those pairs (row and meta word out, one row back)."""
    (m, n), case, straggle, fp8, ue8m0 = setup
    reports = ranks(m * n).run(ll_nodes_case, case, n, iterations=_iterations(straggle),
                               straggle_s=straggle, fp8=fp8, ue8m0=ue8m0)
    for rank, rep in enumerate(reports):
        assert rep["threads"] == [], f"rank {rank}: threads left: {rep['threads']}"
        assert all(rep["peer_ptrs"][p] == 0 for p in range(m * n) if p // n != rank // n)
        assert rep["ll_dispatch"] == rep["want_dispatch"], (rank, rep)
        assert rep["ll_combine"] == rep["want_combine"], (rank, rep)
    assert sum(r["ll_dispatch"] for r in reports) > 0


def test_low_latency_across_nodes_two_in_flight(ranks):
    """Two micro-batches overlapped with stragglers: the acknowledgements cross nodes through
    the proxy too, so a staging parity is never overwritten while a peer reads it."""
    case = Case(4, 8, 128, 2, (5, 6, 0, 4), torch.bfloat16, "uniform", seed=55)
    ranks(4).run(ll_two_in_flight, case, rounds=3, straggle_s=0.03, ranks_per_node=2,
                 transport="nixl")
    ranks(4).run(ll_pipelined_dispatches, case, calls=6, straggle_s=0.03, ranks_per_node=2,
                 transport="nixl")


@pytest.mark.parametrize("nodes,num_sms", [(2, 20), (4, 20), (8, 20), (2, None), (16, 8)])
def test_forwarders_run_on_other_nodes_within_num_sms(nodes, num_sms):
    from kernels.internode import forward_grid

    other, per_node = forward_grid(nodes, 4096, 64, num_sms, compiled=True)
    assert other == nodes - 1 and per_node >= 1
    if num_sms and num_sms >= other:
        assert other * per_node <= num_sms
    assert per_node <= 32
    assert forward_grid(nodes, 4096, 64, num_sms, compiled=False) == (nodes - 1, 1)
