"""The performance model's moe_comm profile counts exactly the bytes the kernels move.

For a grid of shapes (ranks, experts, top-k, hidden, dtypes, FP8, routing, modes, nodes) one
dispatch and one combine run on CPU ranks; every counter of ``Buffer.stats()`` and every
per-peer byte count of the transport must equal `moe_comm_counters`, and the busiest rank's
bytes per link class that `predict` reports must equal the measured ones.
"""
import numpy as np
import pytest
import torch
from perfmodel_jobs import link_bytes

import moe_comm
from moe_comm.perfmodel import moe_comm_counters, predict
from moe_comm.testing import lockstep
from moe_comm.workspace import staging_slot_bytes


def _routing(kind: str, R: int, T: int, E: int, K: int, seed: int) -> np.ndarray:
    """[R*T, K] global routing: uniform, skewed (most picks on the first rank), with -1 rows
    and slots, or one rank receiving nothing."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((R * T, E)), axis=1)[:, :K]
    if kind == "skew":
        hot = np.argsort(rng.random((R * T, E // R)), axis=1)[:, :K]
        ids = np.where(rng.random((R * T, 1)) < 0.7, hot[:, :K], ids)
    elif kind == "holes":
        ids[rng.random(ids.shape) < 0.3] = -1
        ids[::5] = -1
    elif kind == "empty_rank":
        L = E // R
        ids = np.array([rng.choice([e for e in range(E) if e // L != R - 1], K, replace=False)
                        for _ in range(R * T)])
    return ids.astype(np.int64)


def _loopback_counters(ids, R, E, H, dtype, fp8, low_latency, staging_bytes=None):
    """Run one dispatch + combine on loopback ranks; per rank {"dispatch": .., "combine": ..}."""
    K = ids.shape[1]
    T = ids.shape[0] // R
    bufs = moe_comm.Buffer.loopback(R, H, E, T, dtype, max_topk=K, low_latency=low_latency,
                                    staging_bytes=staging_bytes)
    idxs = [torch.from_numpy(ids[r * T:(r + 1) * T]) for r in range(R)]
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn((T, H), generator=g).to(dtype) for _ in range(R)]
    ws = [torch.rand((T, K), generator=g) for _ in range(R)]
    s0 = [b.stats() for b in bufs]
    if low_latency:
        recv = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=fp8)
        s1 = [b.stats() for b in bufs]
        lockstep.low_latency_combine(bufs, [torch.zeros(r.x.shape, dtype=dtype) for r in recv],
                                     idxs, ws, [r.handle for r in recv])
    else:
        res = lockstep.dispatch(bufs, xs, idxs, ws, fp8=fp8)
        s1 = [b.stats() for b in bufs]
        lockstep.combine(bufs, [torch.zeros((r.x.shape[0], H), dtype=dtype) for r in res],
                         [r.handle for r in res], [r.weights for r in res])
    s2 = [b.stats() for b in bufs]
    return [{"dispatch": {k: s1[r][k] - s0[r][k] for k in s1[r]},
             "combine": {k: s2[r][k] - s1[r][k] for k in s2[r]}} for r in range(R)]


def _check(got, want, label):
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        for phase in ("dispatch", "combine"):
            for key, value in w[phase].items():
                assert g[phase][key] == value, (label, rank, phase, key, g[phase][key], value)


def _dtype_names(dtype, fp8):
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    return ("fp8" if fp8 else name), name


# (R, E, H, K, T, dtype, fp8, routing)
GRID = [
    (2, 4, 128, 2, 6, torch.bfloat16, False, "uniform"),
    (4, 16, 256, 4, 5, torch.bfloat16, True, "skew"),
    (4, 8, 64, 8, 4, torch.float32, False, "holes"),
    (3, 12, 128, 3, 7, torch.float16, False, "empty_rank"),
    (8, 32, 128, 8, 3, torch.bfloat16, True, "uniform"),
]


@pytest.mark.parametrize("low_latency", [False, True], ids=["normal", "low_latency"])
@pytest.mark.parametrize("shape", GRID, ids=lambda s: f"R{s[0]}-E{s[1]}-H{s[2]}-K{s[3]}-T{s[4]}-"
                         f"{str(s[5])[6:]}{'-fp8' if s[6] else ''}-{s[7]}")
def test_counters_equal_kernels_on_one_node(shape, low_latency):
    R, E, H, K, T, dtype, fp8, kind = shape
    ids = _routing(kind, R, T, E, K, seed=R * 100 + K)
    got = _loopback_counters(ids, R, E, H, dtype, fp8, low_latency)
    d_name, c_name = _dtype_names(dtype, fp8)
    mode = "low_latency" if low_latency else "normal"
    want = moe_comm_counters(ids, ep=R, num_experts=E, hidden=H, gpus_per_node=R, mode=mode,
                             dispatch_dtype=d_name, combine_dtype=c_name)
    _check(got, want, shape)
    # predict(routing=the same global ids): the busiest rank's NVLink bytes as measured
    p = predict("h800", mode, ep=R, tokens_per_rank=T, hidden=H, topk=K, num_experts=E,
                dispatch_dtype=d_name, combine_dtype=c_name, routing=ids, gpus_per_node=R)
    for phase in ("dispatch", "combine"):
        measured = max(g[phase][f"{phase}_bytes_to_peers"] for g in got)
        assert getattr(p, phase).bytes.sent_nvlink_bytes == measured, (phase, shape)
        assert getattr(p, phase).bytes.sent_rdma_bytes == 0


def test_counters_count_the_signals_of_every_round():
    """Bounded staging: 3 rounds a call; the kernels' counters equal the model's with
    ``rounds=3`` (the rows once, each round's epoch and counts to every rank), and predict
    charges each later round its serial cost."""
    R, E, H, K, T = 4, 16, 128, 4, 6
    ids = _routing("skew", R, T, E, K, seed=11)
    budget = 2 * staging_slot_bytes(R, H, K, torch.bfloat16)
    got = _loopback_counters(ids, R, E, H, torch.bfloat16, False, False, staging_bytes=budget)
    want = moe_comm_counters(ids, ep=R, num_experts=E, hidden=H, gpus_per_node=R, rounds=3)
    _check(got, want, "rounds=3")
    one = moe_comm_counters(ids, ep=R, num_experts=E, hidden=H, gpus_per_node=R)
    assert want[0]["dispatch"]["dispatch_bytes_to_peers"] > one[0]["dispatch"][
        "dispatch_bytes_to_peers"]
    kwargs = dict(ep=R, tokens_per_rank=T, hidden=H, topk=K, num_experts=E, routing=ids,
                  gpus_per_node=R, dispatch_dtype="bf16")
    p3, p1 = predict("h800", rounds=3, **kwargs), predict("h800", **kwargs)
    for phase in ("dispatch", "combine"):
        measured = max(g[phase][f"{phase}_bytes_to_peers"] for g in got)
        assert getattr(p3, phase).bytes.sent_nvlink_bytes == measured, phase
        assert getattr(p3, phase).time_us > getattr(p1, phase).time_us, phase
    with pytest.raises(ValueError, match="the normal mode only"):
        predict("h800", "low_latency", rounds=2, **kwargs)


# (nodes, ranks per node, E, H, K, T, fp8, routing, hierarchical, low latency)
NODE_GRID = [
    (2, 2, 16, 128, 4, 6, False, "uniform", False, False),
    (2, 2, 16, 256, 4, 6, True, "holes", True, False),
    (2, 2, 8, 128, 2, 5, False, "skew", False, True),
    (2, 2, 16, 128, 4, 4, True, "uniform", False, True),
]


@pytest.mark.parametrize("setup", NODE_GRID, ids=lambda s: (
    f"{s[0]}x{s[1]}-E{s[2]}-H{s[3]}-K{s[4]}-T{s[5]}{'-fp8' if s[6] else ''}-{s[7]}-"
    f"{'ll' if s[9] else ('hier' if s[8] else 'flat')}"))
def test_counters_equal_kernels_and_transport_across_nodes(ranks, setup):
    pytest.importorskip("nixl_cu13")
    M, N, E, H, K, T, fp8, kind, hier, ll = setup
    R = M * N
    ids = _routing(kind, R, T, E, K, seed=7 * R + K)
    got = ranks(R).run(link_bytes, torch.from_numpy(ids), H, E, N, hier, ll, fp8)
    mode = "low_latency" if ll else "normal"
    want = moe_comm_counters(ids, ep=R, num_experts=E, hidden=H, gpus_per_node=N, mode=mode,
                             hierarchical=hier, dispatch_dtype="fp8" if fp8 else "bf16")
    _check(got, want, setup)
    if hier:
        return   # forwarders' stores: checked above, not split by link in the kernels' counters
    p = predict("h800", mode, ep=R, tokens_per_rank=T, hidden=H, topk=K, num_experts=E,
                dispatch_dtype="fp8" if fp8 else "bf16", routing=ids, gpus_per_node=N,
                hierarchical=False)
    L = E // R
    for phase in ("dispatch", "combine"):
        channel = ("ll_" if ll else "") + phase
        rdma = [sum(g[phase]["per_peer"][channel]) for g in got]
        nvlink = [g[phase][f"{phase}_bytes_to_peers"] for g in got]
        if ll:   # the low-latency kernels count the rows they stage for the NIC, and the
            #      signals of experts on other nodes, among their stores
            signals = (R - N) * (L * 8 if phase == "dispatch" else 8)
            nvlink = [n - r - signals for n, r in zip(nvlink, rdma, strict=True)]
        assert getattr(p, phase).bytes.sent_rdma_bytes == max(rdma), (phase, setup)
        assert getattr(p, phase).bytes.sent_nvlink_bytes == max(nvlink), (phase, setup)


def _rounds_across_nodes(ranks, hierarchical: bool, seed: int):
    """2 nodes x 2 ranks through the proxy, staging of 2 slots per source (3 rounds a call),
    skewed routing: checks every counter of the kernels and the transport against
    ``moe_comm_counters(rounds=3)``. Returns ``(measured, counters with rounds=3, counters of
    one round, (predict with rounds=3, predict of one round), L)``."""
    pytest.importorskip("nixl_cu13")
    M, N, E, H, K, T = 2, 2, 16, 128, 4, 6
    R = M * N
    ids = _routing("skew", R, T, E, K, seed=seed)
    budget = 2 * staging_slot_bytes(R, H, K, torch.bfloat16, outboxes=True,
                                    ranks_per_node=N if hierarchical else None)
    got = ranks(R).run(link_bytes, torch.from_numpy(ids), H, E, N, hierarchical, False, False,
                       staging_bytes=budget)
    counters = dict(ep=R, num_experts=E, hidden=H, gpus_per_node=N, hierarchical=hierarchical)
    want = moe_comm_counters(ids, rounds=3, **counters)
    _check(got, want, f"{'hierarchical' if hierarchical else 'flat'}, rounds=3")
    kwargs = dict(ep=R, tokens_per_rank=T, hidden=H, topk=K, num_experts=E, routing=ids,
                  gpus_per_node=N, dispatch_dtype="bf16", hierarchical=hierarchical)
    return (got, want, moe_comm_counters(ids, **counters),
            (predict("h800", rounds=3, **kwargs), predict("h800", **kwargs)), E // R)


def _extra_per_peer(rounds: dict, one: dict) -> list[int]:
    """Per destination, the dispatch bytes the transport moves in rounds beyond one round."""
    return [a - b for a, b in zip(rounds["dispatch"]["per_peer"]["dispatch"],
                                  one["dispatch"]["per_peer"]["dispatch"], strict=True)]


def test_counters_count_each_rounds_message_across_nodes_flat(ranks):
    """Flat across 2 nodes, 3 rounds a call: the kernels' and the transport's counts equal the
    model's with ``rounds=3`` (each later round's counts travel in every remote peer's message,
    its epoch to every rank); predict reports the busiest rank's bytes per link and charges
    each later round its serial cost and one more network path."""
    got, want, one, (p3, p1), L = _rounds_across_nodes(ranks, False, seed=13)
    for w, o in zip(want, one, strict=True):
        assert sorted(_extra_per_peer(w, o)) == [0, 0, 2 * 4 * (L + 1), 2 * 4 * (L + 1)]
    for phase in ("dispatch", "combine"):
        rdma = max(sum(g[phase]["per_peer"][phase]) for g in got)
        nvlink = max(g[phase][f"{phase}_bytes_to_peers"] for g in got)
        assert getattr(p3, phase).bytes.sent_rdma_bytes == rdma, phase
        assert getattr(p3, phase).bytes.sent_nvlink_bytes == nvlink, phase
        assert getattr(p3, phase).time_us > getattr(p1, phase).time_us, phase


def test_counters_count_each_rounds_message_across_nodes_hierarchical(ranks):
    """Hierarchical across 2 nodes, 3 rounds a call: the kernels' and the transport's counts
    equal the model's with ``rounds=3`` (each later round's counts of the node's ranks travel in
    the message to the rail peer of the other node, its epoch to every rank of the node; the
    forwarded rows are the same); predict's RDMA bytes equal the busiest rank's and each later
    round costs time."""
    got, want, one, (p3, p1), L = _rounds_across_nodes(ranks, True, seed=17)
    N = 2
    for w, o in zip(want, one, strict=True):
        assert sorted(_extra_per_peer(w, o)) == [0, 0, 0, 2 * 4 * (N * (L + 1) + 1)]
        assert w["dispatch"]["dispatch_bytes_forwarded"] == o["dispatch"][
            "dispatch_bytes_forwarded"]
    for phase in ("dispatch", "combine"):
        rdma = max(sum(g[phase]["per_peer"][phase]) for g in got)
        assert getattr(p3, phase).bytes.sent_rdma_bytes == rdma, phase
        assert getattr(p3, phase).time_us > getattr(p1, phase).time_us, phase


@pytest.mark.parametrize("mode", ["flat", "hier", "ll"])
def test_counters_of_nvfp4_dispatch_and_fp8_combine_across_nodes(ranks, mode):
    """NVFP4 rows (H/2 + H/16 + 4 bytes) out, FP8 partials (H + H/32) back; hierarchical:
    the partials reach the forwarders in bf16 and cross the nodes as FP8."""
    pytest.importorskip("nixl_cu13")
    M, N, E, H, K, T = 2, 2, 16, 256, 4, 5
    R = M * N
    ids = _routing("skew", R, T, E, K, seed=31)
    hier, ll = mode == "hier", mode == "ll"
    got = ranks(R).run(link_bytes, torch.from_numpy(ids), H, E, N, hier, ll, ll,
                       dispatch_dtype="nvfp4", combine_dtype="fp8")
    want = moe_comm_counters(ids, ep=R, num_experts=E, hidden=H, gpus_per_node=N,
                             mode="low_latency" if ll else "normal", hierarchical=hier,
                             dispatch_dtype="nvfp4", combine_dtype="fp8")
    _check(got, want, mode)
    assert sum(sum(g["combine"]["per_peer"]["ll_combine" if ll else "combine"]) for g in got)
