"""The hardware's lower bound of one dispatch and one combine: no implementation beats it.

Whatever the algorithm, a token must reach every rank that holds one of its experts, and
every NVLink domain that holds one, at least once. Per rank (mean over ranks, so that a
perfectly balanced implementation is not excluded):

    nvlink term = max(rows to, rows from the other ranks of its domain) x payload / NVLink peak
    nic term    = max(rows to, rows from other domains, one per (token, domain)) x payload
                  / NIC line rate
    time        = max(terms) + one path latency (NVLink store, or one RDMA write across)

Payload only (no metadata, headers or scales beyond the dtype's own), datasheet peaks (no
protocol efficiency), combine the mirror image with the combine dtype. tests/test_perfmodel.py
checks that no published measurement lies below it. An EP-invariant combine (``ep_invariant``,
normal mode) brings every (token, choice) pair home un-reduced, so its rows are pairs: NVLink
rows the pairs whose expert is on another rank of the home's domain, network rows the pairs
whose expert is in another domain (one per (token, choice), not per (token, domain)).
"""
from __future__ import annotations

import numpy as np

from .formats import element_bytes, payload_bytes
from .loads import LoadStat, compute_loads
from .systems import get_system
from .workload import (
    FP8_LL_CONVENTION_HEADER,
    MODES,
    PhaseBytes,
    PhasePrediction,
    Prediction,
    _check_ep_invariant,
    _workload,
)

_CLASSES = ("rank_send_self", "rank_send_nvl", "rank_recv_nvl")
_NODE_CLASSES = ("node_send_rdma", "node_recv_rdma")
_PAIR_CLASSES = ("ll_send_nvl", "ll_recv_nvl")  # the EP-invariant combine's NVLink rows
_PAIR_NODE_CLASSES = ("ll_send_rdma", "ll_recv_rdma")  # and its network rows


def predict_bound(system, mode: str = "normal", *, ep: int, tokens_per_rank: int, hidden: int,
                  topk: int, num_experts: int, dispatch_dtype="fp8", combine_dtype="bf16",
                  routing="uniform", gpus_per_node: int | None = None, seed: int = 0,
                  sim_tokens: int = 65536, ep_invariant: bool = False) -> Prediction:
    """`predict(..., implementation="bound")`: the lower bound above, as a Prediction whose
    GB/s follow `mode`'s bandwidth convention (so they compare with published numbers)."""
    sysm = get_system(system)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    spec, L, T, H, k, d_dtype, c_dtype = _workload(sysm, ep, tokens_per_rank, hidden, topk,
                                                   num_experts, dispatch_dtype, combine_dtype,
                                                   routing, gpus_per_node, sim_tokens)
    pairwise = _check_ep_invariant(ep_invariant, mode, L, c_dtype) and mode == "normal"
    classes = _CLASSES + (_NODE_CLASSES if L.nodes > 1 else ()) + (
        _PAIR_CLASSES + (_PAIR_NODE_CLASSES if L.nodes > 1 else ()) if pairwise else ())
    loads = compute_loads(L, T, k, spec, classes, np.random.default_rng(seed), sim_tokens)
    nvl_GBps = sysm.nvlink_peak_GBps
    path = sysm.rdma_latency_us if L.nodes > 1 else (sysm.nvlink_latency_us if ep > 1 else 0.0)
    zero = LoadStat(0.0, 0.0)
    pairs = T * loads.pairs_per_token
    phases = []
    for phase, dtype in (("dispatch", d_dtype), ("combine", c_dtype)):
        P = payload_bytes(dtype, H)
        pair_rows = pairwise and phase == "combine"
        nvl = _PAIR_CLASSES if pair_rows else ("rank_send_nvl", "rank_recv_nvl")
        nvl_rows = max(loads[c].mean for c in nvl)
        net = [loads.stats.get(c, zero).mean for c in (_PAIR_NODE_CLASSES if pair_rows
                                                        else _NODE_CLASSES)]
        terms = {"nvlink": nvl_rows * P / (nvl_GBps * 1e3)}
        if L.nodes > 1:
            terms["rdma"] = max(net) * P / (sysm.nic_GBps * 1e3)
        if mode == "low_latency":
            conv = payload_bytes(dtype, H) + (FP8_LL_CONVENTION_HEADER
                                              if phase == "dispatch" and dtype == "fp8" else 0)
            logical = pairs * conv
        else:
            rows = T * (loads.nodes_per_token if L.nodes > 1 else loads.ranks_per_token)
            logical = rows * H * element_bytes(dtype)
        name, worst = max(terms.items(), key=lambda kv: kv[1])
        time_us = worst + path
        nbytes = PhaseBytes(
            logical_bytes=logical,
            min_link_bytes=T * loads.ranks_per_token * (1 - 1 / L.ep) * P,
            nvlink_bytes=nvl_rows * P, rdma_bytes=max(net) * P if L.nodes > 1 else 0.0,
            pcie_bytes=0.0, hbm_bytes=0.0,
            local_fraction=loads["rank_send_self"].mean / max(T * loads.ranks_per_token, 1e-12),
            nvlink_domain_fraction=1.0 - (net[0] / max(
                pairs if pair_rows else T * loads.nodes_per_token, 1e-12) if L.nodes > 1
                else 0.0))
        phases.append(PhasePrediction(
            time_us=time_us, GBps=logical / time_us / 1e3 if time_us else 0.0,
            bottleneck="latency" if path > worst else name, terms_us=terms, latency_us=path,
            bytes=nbytes, imbalance=1.0))
    return Prediction(system=sysm.name, mode=mode, implementation="bound", ep=L.ep,
                      tokens_per_rank=T, hidden=H, topk=k, num_experts=L.num_experts,
                      gpus_per_node=L.gpn, nodes=L.nodes, routing=spec.label(),
                      dispatch_dtype=d_dtype, combine_dtype=c_dtype, dispatch=phases[0],
                      combine=phases[1], pairs_per_token=loads.pairs_per_token,
                      ranks_per_token=loads.ranks_per_token,
                      nodes_per_token=loads.nodes_per_token, method=loads.method,
                      ep_invariant=bool(ep_invariant))
