"""The cost model: time of one dispatch call and one combine call of an `Implementation` on a
`System`.

A phase (dispatch or combine) of one rank is modelled as

    time_us = latency_us + max(overlap_us, max(terms_us.values()))

where every entry of `terms_us` is the time one resource alone needs for the most loaded rank
(the resources work concurrently, so only the largest counts), `latency_us` is the
implementation's serial per-call cost (fixed, per peer, per token; implementations.py) plus
the path latency of the last message, and `overlap_us` the implementation's fixed work that
data transfers hide. The `bottleneck` is the largest term, or "latency" when the fixed part
exceeds every term.

| term             | resource and formula                                                    |
|------------------|-------------------------------------------------------------------------|
| nvlink           | max(sent, received) NVLink bytes / (nvlink_GBps x copy efficiency)      |
| rdma             | max(sent, received) wire bytes (IB headers) / (NIC line rate x NIC      |
|                  | efficiency); leaf-uplink                                                |
|                  | share x oversubscription when the fabric is oversubscribed              |
| pcie             | GPU<->NIC bytes incl. TLP headers and one WQE fetch per message         |
| nic_message_rate | RDMA messages (writes + count signals) / NIC message rate               |
| sm_issue         | bytes the SMs copy / (num_sms x per-SM copy rate) + RDMA posts / (num_sms|
|                  | x per-SM post rate)                                                     |
| hbm              | device-memory reads + writes / HBM bandwidth                            |

Bandwidth conventions (`GBps`, GB = 1e9 bytes, per rank, mean over ranks), chosen so that
published numbers compare:
* low_latency: bytes once per (token, selected expert) pair, local pairs included; an FP8
  message is hidden + hidden/128*4 (scales) + 16 (header) bytes, other dtypes hidden*size.
* normal, one node: NVLink rows received (tokens x distinct destination ranks, own rank
  included) x hidden x bytes per element.
* normal, several nodes: (token, destination node) pairs, own node included, x hidden x bytes
  per element.
In both normal conventions an FP8 element counts (1 + 4/128) bytes, i.e. (1 + 4/128)/2 of BF16.

EP-invariant combine (``ep_invariant=True``, normal mode, one node or flat across nodes): the
combine moves one row per (token, top-k choice) pair home, un-reduced, in the Buffer's dtype,
each with EP_INVARIANT_PAIR_BYTES of metadata, and the home rank sums a token's rows in choice
order. Its rows are pairs (the ll_* pair classes of loads.py) where the default combine has
one reduced row per (token, rank) (the rank_* classes); each row costs payload + 8 bytes:

    NVLink rows  = same-node pairs   (PAIR_CLASSES: ll_send_self, ll_send_nvl, ll_recv_nvl)
    network rows = other-node pairs  (PAIR_RDMA_CLASSES: ll_send_rdma, ll_recv_rdma), one RDMA
                   write (one NIC message, one post) of payload + 8 bytes per pair

Across nodes it is modelled in flat mode (``hierarchical=None`` resolves to flat, as the
library's Buffer does; hierarchical=True is not modelled yet), so
the dispatch is the flat dispatch and the combine's network rows replace the flat combine's
(token, remote rank) rows. The signals and the bandwidth convention (logical bytes) stay as
they are, so the extra bytes show in PhaseBytes (nvlink_bytes, rdma_bytes, pcie_bytes,
sent_nvlink_bytes, sent_rdma_bytes, hbm_bytes) and in time. Low-latency mode already moves one
row per pair: ep_invariant changes no byte there.
"""
from __future__ import annotations

import math

import numpy as np

from .formats import element_bytes, input_bytes, payload_bytes
from .implementations import Algorithm, Implementation, get_implementation
from .loads import (
    FLAT_CLASSES,
    INTERNODE_CLASSES,
    INTRANODE_CLASSES,
    LL_CLASSES,
    Layout,
    Loads,
    LoadStat,
    compute_loads,
)
from .systems import System, get_system
from .workload import (
    FP8_LL_CONVENTION_HEADER,
    MODES,
    PhaseBytes,
    PhasePrediction,
    Prediction,
    _check_ep_invariant,
    _check_int,
    _workload,
)

DEFAULT_IMPLEMENTATION = "moe_comm"
EP_INVARIANT_PAIR_BYTES = 8    # per (token, choice) combine row: fp32 router weight + fp32 value
PAIR_CLASSES = ("ll_send_self", "ll_send_nvl", "ll_recv_nvl")  # INTRANODE_CLASSES, in pairs
PAIR_RDMA_CLASSES = ("ll_send_rdma", "ll_recv_rdma")  # rank_send_rdma, rank_recv_rdma in pairs


def _fabric(system: System, layout: Layout, any_to_any: bool):
    """(switch hops of the longest RDMA path, share of RDMA bytes that leave the source leaf,
    switch tiers needed). any_to_any: low-latency traffic; else rail-aligned normal traffic.

    A leaf switch gives half its ports to NICs. Rail-optimized: GPU i of up to radix/2 nodes
    share a leaf (rail i), so traffic between rails climbs to the spine. Fat-tree: a leaf holds
    radix/2 consecutive GPUs. Tiers: the fewest t with radix * (radix/2)**(t-1) >= NICs per
    plane (one switch when they fit on it).
    """
    ep, gpn, nodes, radix = layout.ep, layout.gpn, layout.nodes, system.switch_radix
    if nodes == 1:
        return 0, 0.0, 0
    endpoints = math.ceil(ep / system.planes)
    rail = system.topology == "rail-optimized"
    if endpoints <= radix and not (rail and any_to_any and gpn > 1):
        return 1, 0.0, 1
    tiers = 2
    while radix * (radix // 2) ** (tiers - 1) < endpoints:
        tiers += 1
    per_leaf = radix // 2
    if rail:
        same = min(per_leaf, nodes) - 1              # same-rail GPUs of other nodes, my leaf
        share = same / (ep - gpn) if any_to_any else same / (nodes - 1)
    else:
        same = min(max(1, per_leaf // gpn), nodes) - 1   # other nodes under my leaf
        share = same * gpn / (ep - gpn) if any_to_any else same / (nodes - 1)
    cross = 1.0 - share
    return (2 * tiers - 1 if cross > 1e-12 else 1), cross, tiers


class _Costs:
    """Shared unit conversions of one prediction (all rates in bytes or messages per us)."""

    def __init__(self, system: System, alg: Algorithm, num_sms: int, layout: Layout,
                 any_to_any: bool):
        s = system
        self.s, self.alg = s, alg
        peers = max(layout.gpn, 2) if layout.ep > 1 else 2
        spread = 1.0 + alg.spread_penalty * max(0.0, math.log2(min(peers, layout.ep) / 8))
        self.nvl_Bpus = s.nvlink_GBps * alg.copy_efficiency * 1e3 / spread
        self.nic_Bpus = s.nic_GBps * alg.nic_efficiency * 1e3
        self.pcie_Bpus = s.pcie_GBps * 1e3
        self.hbm_Bpus = s.hbm_GBps * 1e3
        per_sm = alg.sm_copy_GBps if alg.sm_copy_GBps is not None else s.sm_copy_GBps
        self.sm_Bpus = num_sms * per_sm * 1e3
        self.sm_msgs_per_us = num_sms * s.sm_messages_per_us
        self.hops, self.cross_leaf, self.tiers = _fabric(s, layout, any_to_any)
        self.leaf_factor = max(1.0, self.cross_leaf * s.oversubscription)
        self.relay = (1.0 - 1.0 / s.planes) if (any_to_any and layout.nodes > 1) else 0.0
        self.peers = layout.ep - 1

    def latency(self, phase: int, path_us: float, tokens: int) -> float:
        """Serial per-call cost of a phase (0 dispatch, 1 combine) plus the path latency."""
        a = self.alg
        return a.fixed_us[phase] + a.per_peer_us * self.peers + a.per_token_us[phase] * tokens \
            + path_us

    def wire(self, msg: float) -> float:
        """Bytes on the IB wire for one RDMA write of msg payload bytes."""
        s = self.s
        return msg + math.ceil(msg / s.rdma_mtu_bytes) * s.rdma_header_bytes_per_packet \
            + s.rdma_header_bytes_per_message

    def pcie(self, msg: float, wqe: bool) -> float:
        """PCIe bytes for one message crossing GPU<->NIC (plus its WQE fetch when sending)."""
        s = self.s

        def tlp(n: float) -> float:
            return n + math.ceil(n / s.pcie_max_payload_bytes) * s.pcie_tlp_overhead_bytes
        return tlp(msg) + (tlp(s.rdma_wqe_bytes) if wqe else 0.0)

    def rdma_path_us(self) -> float:
        return self.s.rdma_latency_us + max(self.hops - 1, 0) * self.s.switch_latency_us

    def rdma_terms(self, msg: float, sent: float, recv: float, extra_msgs: float) -> dict:
        """Terms of RDMA traffic: sent/recv messages of `msg` bytes for the busiest rank."""
        busiest = max(sent, recv)
        return {"rdma": busiest * self.wire(msg) * self.leaf_factor / self.nic_Bpus,
                "pcie": max(sent * self.pcie(msg, True), recv * self.pcie(msg, False))
                / self.pcie_Bpus,
                "nic_message_rate": (busiest + extra_msgs) / self.s.nic_message_rate_Mpps}


def _finish(terms: dict, ratios: dict, latency_us: float, overlap_us: float, logical: float,
            nbytes: PhaseBytes) -> PhasePrediction:
    name, worst = max(terms.items(), key=lambda kv: kv[1])
    time_us = latency_us + max(worst, overlap_us)
    bottleneck = "latency" if latency_us + overlap_us > worst else name
    return PhasePrediction(time_us=time_us, GBps=logical / time_us / 1e3 if time_us else 0.0,
                           bottleneck=bottleneck, terms_us=dict(terms),
                           latency_us=time_us - worst if worst < time_us else latency_us,
                           bytes=nbytes, imbalance=ratios.get(bottleneck, 1.0))


def _busier(a, b):
    """The LoadStat (send or receive side) whose busiest rank carries more."""
    return a if a.max >= b.max else b


def _ratio(*stats) -> float:
    mean = sum(s.mean for s in stats)
    return sum(s.max for s in stats) / mean if mean > 0 else 1.0


def _low_latency(c: _Costs, L: Layout, loads: Loads, T: int, H: int, k: int, d_dtype: str,
                 c_dtype: str):
    """One message per (token, expert) pair, put directly to the expert's rank."""
    fmt = c.alg.fmt
    s_self, s_nvl, s_rdma = loads["ll_send_self"], loads["ll_send_nvl"], loads["ll_send_rdma"]
    r_nvl, r_rdma = loads["ll_recv_nvl"], loads["ll_recv_rdma"]
    pairs = T * loads.pairs_per_token
    signals = (L.ep - L.gpn) * L.m      # one count per (remote expert) and call
    rdma_used = L.nodes > 1 and s_rdma.mean > 0
    if rdma_used:     # the last message crosses the fabric (after an NVLink relay hop if any)
        path = c.rdma_path_us() + (c.s.nvlink_latency_us if c.relay else 0.0)
    else:
        path = c.s.nvlink_latency_us if L.ep > 1 else 0.0
    rdma_msgs = signals if rdma_used else 0
    in_bytes = input_bytes(d_dtype)
    conv_header = FP8_LL_CONVENTION_HEADER if d_dtype == "fp8" else 0
    out = []
    for i, (phase, msg, logical_msg) in enumerate((
            ("dispatch", fmt.payload(d_dtype, H) + fmt.ll_header_bytes,
             payload_bytes(d_dtype, H) + conv_header),
            ("combine", fmt.payload(c_dtype, H), payload_bytes(c_dtype, H)))):
        # combine sends back what dispatch delivered: the send and receive roles swap
        snd_nvl, rcv_nvl = (s_nvl, r_nvl) if phase == "dispatch" else (r_nvl, s_nvl)
        snd_rdma, rcv_rdma = (s_rdma, r_rdma) if phase == "dispatch" else (r_rdma, s_rdma)
        nvl_rows = max(snd_nvl.max + c.relay * snd_rdma.max, rcv_nvl.max + c.relay * rcv_rdma.mean)
        terms = {"nvlink": nvl_rows * msg / c.nvl_Bpus}
        terms.update(c.rdma_terms(msg, snd_rdma.max, rcv_rdma.max, signals) if rdma_used else {})
        sent = s_self.max + snd_nvl.max + snd_rdma.max
        recv = s_self.max + rcv_nvl.max + rcv_rdma.max
        if phase == "dispatch":   # read x, write messages, receivers land them
            sm_bytes = sent * msg
            hbm = T * H * in_bytes + sent * msg + (snd_rdma.max + recv) * msg
            sig_nvl = (L.gpn - 1) * L.m * fmt.ll_count_bytes
        else:                     # send expert outputs, then reduce k rows per token
            sm_bytes = (sent + recv) * msg + T * msg
            hbm = sent * msg + (snd_rdma.max + 2 * recv) * msg + T * msg
            sig_nvl = (L.gpn - 1) * fmt.epoch_signal_bytes
        terms["sm_issue"] = sm_bytes / c.sm_Bpus + (snd_rdma.max + rdma_msgs) / c.sm_msgs_per_us
        terms["hbm"] = hbm / c.hbm_Bpus
        net = _ratio(_busier(snd_rdma, rcv_rdma))
        ratios = {"nvlink": _ratio(_busier(snd_nvl, rcv_nvl)), "rdma": net, "pcie": net,
                  "nic_message_rate": net}
        nbytes = PhaseBytes(
            logical_bytes=pairs * logical_msg,
            min_link_bytes=T * loads.ranks_per_token * (1 - 1 / L.ep) * payload_bytes(
                d_dtype if phase == "dispatch" else c_dtype, H),
            nvlink_bytes=nvl_rows * msg,
            rdma_bytes=max(snd_rdma.max, rcv_rdma.max) * c.wire(msg) if rdma_used else 0.0,
            pcie_bytes=max(snd_rdma.max * c.pcie(msg, True), rcv_rdma.max * c.pcie(msg, False))
            if rdma_used else 0.0,
            hbm_bytes=hbm,
            local_fraction=s_self.mean / pairs if pairs else 0.0,
            nvlink_domain_fraction=(s_self.mean + s_nvl.mean) / pairs if pairs else 0.0,
            sent_nvlink_bytes=snd_nvl.max * msg + sig_nvl,
            sent_rdma_bytes=snd_rdma.max * msg)
        out.append(_finish(terms, ratios, c.latency(i, path, T), c.alg.overlap_us[i],
                           nbytes.logical_bytes, nbytes))
    return out


def _normal(c: _Costs, L: Layout, loads: Loads, T: int, H: int, k: int, d_dtype: str,
            c_dtype: str, rounds: int = 1, ep_invariant: bool = False):
    """One row per (token, destination rank); across domains hierarchical or flat. ``rounds``
    (bounded staging): each round past the first costs the per-call serial work again (its own
    launches and signals, the forwarder's pass in hierarchical mode), one more set of signal
    words per peer (hierarchical: per other node) and, across domains, one more network path (a
    round's receive waits for that round's remote rows). ``ep_invariant`` (one domain, or flat
    across domains): the combine moves one row per (token, choice) pair, payload +
    EP_INVARIANT_PAIR_BYTES each, same-node pairs over NVLink (PAIR_CLASSES) and other-node
    pairs over the network (PAIR_RDMA_CLASSES), one message each."""
    alg, fmt = c.alg, c.alg.fmt
    internode = L.nodes > 1
    hier = internode and alg.internode == "hierarchical"
    own = loads["rank_send_self"]
    rows_total = T * loads.ranks_per_token
    pairs = T * loads.pairs_per_token
    path = (c.s.nvlink_latency_us if L.ep > 1 else 0.0) + (c.rdma_path_us() if internode else 0.0)
    in_bytes = input_bytes(d_dtype)
    direct_snd, direct_rcv = loads["rank_send_nvl"], loads["rank_recv_nvl"]
    if hier:
        in_domain = own.mean + loads["rank_send_nvl"].mean
        logical_rows = T * loads.nodes_per_token
        fwd_snd, fwd_rcv = loads["fwd_send_nvl"], loads["fwd_recv_nvl"]
        net_snd, net_rcv = loads["node_send_rdma"], loads["node_recv_rdma"]
        net_dests = L.nodes - 1
    elif internode:
        in_domain = own.mean + loads["rank_send_nvl"].mean
        logical_rows = T * loads.nodes_per_token
        net_snd, net_rcv = loads["rank_send_rdma"], loads["rank_recv_rdma"]
        net_dests = L.ep - L.gpn
    else:
        in_domain = rows_total
        logical_rows = rows_total
        net_snd = net_rcv = LoadStat(0.0, 0.0)
        net_dests = 0
    meta = fmt.normal_meta_bytes(k)
    counts = fmt.normal_count_bytes(L.m)
    out = []
    for i, phase in enumerate(("dispatch", "combine")):
        dtype = d_dtype if phase == "dispatch" else c_dtype
        elem = element_bytes(dtype)
        P = fmt.payload(dtype, H)
        row = P + (meta if phase == "dispatch" else 0)
        delivered = rows_total
        domain_fraction = in_domain / rows_total if rows_total else 0.0
        if ep_invariant and phase == "combine":
            own, direct_snd, direct_rcv = (loads[name] for name in PAIR_CLASSES)
            if internode:   # flat: every other-node pair is a network row of its own
                net_snd, net_rcv = (loads[name] for name in PAIR_RDMA_CLASSES)
            row, delivered = P + EP_INVARIANT_PAIR_BYTES, pairs
            domain_fraction = 1.0 - net_snd.mean / pairs if pairs else 0.0
        net_row = row + (fmt.node_slot_bytes * L.gpn if hier and phase == "dispatch" else 0)
        if hier:   # NVLink carries the forwarded rows (the direct ones of the sender's node too)
            snd = fwd_snd if phase == "dispatch" else fwd_rcv
            rcv = fwd_rcv if phase == "dispatch" else fwd_snd
        else:
            snd, rcv = (direct_snd, direct_rcv) if phase == "dispatch" else \
                (direct_rcv, direct_snd)
        nvl_rows = max(snd.max, rcv.max)
        terms = {"nvlink": nvl_rows * row / c.nvl_Bpus}
        ratios = {"nvlink": _ratio(_busier(snd, rcv))}
        nsnd, nrcv = (net_snd, net_rcv) if phase == "dispatch" else (net_rcv, net_snd)
        net_rows = max(nsnd.max, nrcv.max)
        if internode:
            terms.update(c.rdma_terms(net_row, nsnd.max, nrcv.max, net_dests))
            r = _ratio(_busier(nsnd, nrcv))
            ratios.update(rdma=r, pcie=r, nic_message_rate=r)
        # every row is copied by SMs once per hop (staging, forwarding, expert-major output)
        moved = (net_rows + own.max + snd.max + rcv.max) * row
        out_rows = pairs * _ratio(own, fwd_rcv if hier else direct_rcv)  # expert-major rows
        terms["sm_issue"] = (moved + out_rows * P) / c.sm_Bpus + net_rows / c.sm_msgs_per_us
        terms["hbm"] = (T * H * in_bytes + 2 * moved + 2 * net_rows * net_row
                        + out_rows * P) / c.hbm_Bpus
        signals = rounds * (L.gpn - 1) * ((counts if phase == "dispatch" else 0)
                            + fmt.epoch_signal_bytes)
        if phase == "dispatch":
            sent_rdma = nsnd.max * net_row + (
                rounds * (L.nodes - 1) * fmt.node_count_bytes(L.m, L.gpn) if hier
                else rounds * net_dests * counts)
        else:
            sent_rdma = nsnd.max * net_row
        nbytes = PhaseBytes(
            logical_bytes=logical_rows * H * elem,
            min_link_bytes=rows_total * (1 - 1 / L.ep) * P,
            nvlink_bytes=nvl_rows * row,
            rdma_bytes=net_rows * c.wire(net_row) if internode else 0.0,
            pcie_bytes=max(nsnd.max * c.pcie(net_row, True), nrcv.max * c.pcie(net_row, False))
            if internode else 0.0,
            hbm_bytes=terms["hbm"] * c.hbm_Bpus,
            local_fraction=own.mean / delivered if delivered else 0.0,
            nvlink_domain_fraction=domain_fraction,
            sent_nvlink_bytes=(direct_snd.max if phase == "dispatch" else direct_rcv.max) * row
            + signals,
            sent_rdma_bytes=sent_rdma if internode else 0.0)
        later = (rounds - 1) * (alg.fixed_us[i] + alg.per_peer_us * c.peers
                                + (c.rdma_path_us() if internode else 0.0))
        out.append(_finish(terms, ratios, c.latency(i, path, T) + later, alg.overlap_us[i],
                           nbytes.logical_bytes, nbytes))
    return out


def predict(system: str | System = "h800", mode: str = "normal", *, ep: int,
            tokens_per_rank: int, hidden: int, topk: int, num_experts: int,
            dispatch_dtype="fp8", combine_dtype="bf16", routing="uniform",
            gpus_per_node: int | None = None, num_sms: int | None = None, seed: int = 0,
            sim_tokens: int = 65536, implementation: str | Implementation = DEFAULT_IMPLEMENTATION,
            hierarchical: bool | None = None, rounds: int = 1,
            ep_invariant: bool = False) -> Prediction:
    """Predict one dispatch and one combine call of `mode` on `system` for the slowest rank.

    system: preset name (SYSTEMS) or a System. mode: "normal" (dedup per destination rank,
    per node across nodes, NVLink forwarding) or "low_latency" (every (token, expert) pair
    put directly). ep: ranks; tokens_per_rank: T; hidden: H; topk: k; num_experts: E
    (E % ep == 0). dispatch_dtype: one of formats.DTYPES ("fp8", "fp8-ue8m0", "mxfp8",
    "nvfp4", "bf16", "fp16", "fp32") or a torch dtype; quantized formats are cast from bf16
    input. combine_dtype: one of formats.COMBINE_DTYPES. routing: see routing.py.
    gpus_per_node: GPUs of one NVLink domain the algorithm uses; None picks the largest
    divisor of ep that fits the system's NVLink domain. num_sms: SMs the kernels use (default:
    the implementation's). seed / sim_tokens: Monte Carlo seed and sample size for simulated
    routing. implementation: a name of IMPLEMENTATIONS (default "moe_comm"), an
    Implementation (recalibration), or "bound" (the hardware's lower bound, bound.py).
    hierarchical: normal mode across nodes, hierarchical (True) or flat (False); None = the
    implementation's default (flat with ep_invariant in normal mode). rounds: normal mode with
    bounded staging (``Buffer.rounds``): every round past the first adds the per-call serial
    cost, the signal words of one more epoch per peer and, across nodes, one more network
    path. ep_invariant: the EP-invariant
    combine (module docstring): normal mode sends one row per (token, choice) pair home,
    payload in combine_dtype (the Buffer's: bf16, fp16 or fp32) + 8 bytes, instead of one
    reduced row per (token, rank); same-node pairs over NVLink, other-node pairs one network
    write each. Across nodes it runs flat: hierarchical=None means flat there, and
    hierarchical=True is not modelled yet (ValueError). Low-latency predictions do not change.
    """
    if isinstance(implementation, str) and implementation.strip().lower() == "bound":
        from .bound import predict_bound
        return predict_bound(system, mode, ep=ep, tokens_per_rank=tokens_per_rank,
                             hidden=hidden, topk=topk, num_experts=num_experts,
                             dispatch_dtype=dispatch_dtype, combine_dtype=combine_dtype,
                             routing=routing, gpus_per_node=gpus_per_node, seed=seed,
                             sim_tokens=sim_tokens, ep_invariant=ep_invariant)
    impl = get_implementation(implementation)
    sysm = get_system(system)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    alg = impl.algorithm(mode, hierarchical)
    spec, layout, T, H, k, d_dtype, c_dtype = _workload(sysm, ep, tokens_per_rank, hidden, topk,
                                                        num_experts, dispatch_dtype,
                                                        combine_dtype, routing, gpus_per_node,
                                                        sim_tokens)
    rounds = _check_int("rounds", rounds)
    ep_invariant = _check_ep_invariant(ep_invariant, mode, layout, c_dtype, hierarchical)
    if ep_invariant and mode == "normal" and hierarchical is None:
        alg = impl.algorithm(mode, False)   # as Buffer(ep_invariant=True): flat across nodes
    if rounds > 1 and mode != "normal":
        raise ValueError(f"rounds={rounds}: bounded staging runs the normal mode only (got "
                         f"mode={mode!r})")
    if alg.internode == "none" and layout.nodes > 1:
        raise ValueError(f"{impl.name} works inside one NVLink domain only: ep={ep} needs "
                         f"{layout.nodes} domains of {layout.gpn} GPUs")
    default_sms = alg.num_sms if alg.num_sms is not None else sysm.num_sms
    sms = min(default_sms, sysm.num_sms) if num_sms is None else _check_int("num_sms", num_sms)
    if sms > sysm.num_sms:
        raise ValueError(f"num_sms={sms} exceeds the {sysm.num_sms} SMs of {sysm.name}")
    if mode == "low_latency":
        classes = LL_CLASSES
    elif layout.nodes == 1:
        classes = INTRANODE_CLASSES + (PAIR_CLASSES if ep_invariant else ())
    elif alg.internode == "hierarchical":
        classes = INTERNODE_CLASSES + ("rank_send_nvl", "rank_recv_nvl")
    else:
        classes = FLAT_CLASSES + ((PAIR_CLASSES + PAIR_RDMA_CLASSES) if ep_invariant else ())
    loads = compute_loads(layout, T, k, spec, classes, np.random.default_rng(seed), sim_tokens)
    costs = _Costs(sysm, alg, sms, layout, any_to_any=(mode == "low_latency"))
    if mode == "low_latency":
        dispatch, combine = _low_latency(costs, layout, loads, T, H, k, d_dtype, c_dtype)
    else:
        dispatch, combine = _normal(costs, layout, loads, T, H, k, d_dtype, c_dtype, rounds,
                                    ep_invariant)
    notes = []
    if costs.tiers > sysm.tiers:
        notes.append(f"{math.ceil(ep / sysm.planes)} NICs per plane need {costs.tiers} switch "
                     f"tiers of radix {sysm.switch_radix}; {sysm.name} lists {sysm.tiers}, the "
                     f"model assumes {costs.tiers}")
    return Prediction(system=sysm.name, mode=mode, implementation=impl.name, ep=ep,
                      tokens_per_rank=T, hidden=H, topk=k, num_experts=layout.num_experts,
                      gpus_per_node=layout.gpn, nodes=layout.nodes,
                      routing=spec.label(), dispatch_dtype=d_dtype, combine_dtype=c_dtype,
                      dispatch=dispatch, combine=combine,
                      pairs_per_token=loads.pairs_per_token,
                      ranks_per_token=loads.ranks_per_token,
                      nodes_per_token=loads.nodes_per_token, method=loads.method,
                      notes=tuple(notes), ep_invariant=ep_invariant)
