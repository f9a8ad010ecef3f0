"""What one prediction is about and what it returns: the checked workload (routing spec,
``Layout``, sizes, dtypes), the modes, and the ``Prediction`` records. Shared by the model
(``model.py``) and the hardware's lower bound (``bound.py``), which both lie above it."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .formats import COMBINE_DTYPES, DTYPES, UNQUANTIZED, normalize_dtype
from .loads import Layout
from .routing import parse_routing
from .systems import System

MODES = ("normal", "low_latency")
BOTTLENECKS = ("nvlink", "rdma", "pcie", "nic_message_rate", "sm_issue", "hbm", "latency")
FP8_LL_CONVENTION_HEADER = 16  # the low-latency FP8 bandwidth convention counts a 16-byte header


@dataclass(frozen=True)
class PhaseBytes:
    """Bytes of one phase. Per rank; "busiest" fields are for the most loaded rank."""

    logical_bytes: float       # mean rank, in the bandwidth convention of the mode
    min_link_bytes: float      # mean rank: payload of each token once per other destination rank
    nvlink_bytes: float        # busiest rank, max(sent, received), incl. metadata and headers
    rdma_bytes: float          # busiest rank, max(sent, received), on the wire
    pcie_bytes: float          # busiest rank, GPU<->NIC incl. TLP headers and WQE fetches
    hbm_bytes: float           # busiest rank, device-memory reads + writes
    local_fraction: float      # share of deliveries (pairs or rows) that stay on the rank
    nvlink_domain_fraction: float  # share that stays inside the NVLink domain (own rank too)
    sent_nvlink_bytes: float = 0.0  # busiest rank: bytes it stores into other ranks of its
    #                                 domain (payload, metadata, signals; forwarding excluded)
    sent_rdma_bytes: float = 0.0    # busiest rank: bytes it hands the NIC (payload, metadata,
    #                                 counts; no wire headers)


@dataclass(frozen=True)
class PhasePrediction:
    """One dispatch or one combine call."""

    time_us: float
    GBps: float                # logical_bytes / time, GB = 1e9 bytes
    bottleneck: str            # one of BOTTLENECKS
    terms_us: dict             # resource -> time it alone needs (they overlap)
    latency_us: float          # fixed per-call cost + path latency (adds to the largest term)
    bytes: PhaseBytes
    imbalance: float           # busiest rank / mean rank for the bottleneck's traffic


@dataclass(frozen=True)
class Prediction:
    """Result of `predict`: one dispatch and one combine call of the slowest rank."""

    system: str
    mode: str
    implementation: str
    ep: int
    tokens_per_rank: int
    hidden: int
    topk: int
    num_experts: int
    gpus_per_node: int
    nodes: int
    routing: str
    dispatch_dtype: str
    combine_dtype: str
    dispatch: PhasePrediction
    combine: PhasePrediction
    pairs_per_token: float     # valid (token, expert) pairs per token
    ranks_per_token: float     # distinct destination ranks per token, own rank included
    nodes_per_token: float     # distinct destination nodes per token, own node included
    method: str                # how rank loads were obtained
    notes: tuple = field(default_factory=tuple)
    ep_invariant: bool = False  # combine rows per (token, choice) pair, summed at home

    @property
    def dispatch_us(self) -> float:
        return self.dispatch.time_us

    @property
    def combine_us(self) -> float:
        return self.combine.time_us

    @property
    def dispatch_GBps(self) -> float:
        return self.dispatch.GBps

    @property
    def combine_GBps(self) -> float:
        return self.combine.GBps

    @property
    def bottleneck(self) -> str:
        """Bottleneck of the slower phase (see dispatch.bottleneck / combine.bottleneck)."""
        slow = self.combine if self.combine.time_us >= self.dispatch.time_us else self.dispatch
        return slow.bottleneck

    @property
    def bytes(self) -> dict:
        """{"dispatch": PhaseBytes, "combine": PhaseBytes}."""
        return {"dispatch": self.dispatch.bytes, "combine": self.combine.bytes}


def _check_int(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _check_ep_invariant(ep_invariant, mode: str, layout: Layout, c_dtype: str,
                        hierarchical: bool | None = None) -> bool:
    """ep_invariant, validated: normal mode runs it on one node or flat across nodes, in the
    Buffer's dtype."""
    if not isinstance(ep_invariant, (bool, np.bool_)):
        raise ValueError(f"ep_invariant must be True or False, got {ep_invariant!r}")
    if ep_invariant and mode == "normal":
        if layout.nodes > 1 and hierarchical:
            raise ValueError(f"ep_invariant=True across nodes is modelled flat only "
                             f"(hierarchical=False; None resolves to it), got hierarchical="
                             f"{hierarchical!r}: ep={layout.ep} spans {layout.nodes} NVLink "
                             f"domains of {layout.gpn} GPUs; a hierarchical invariant Buffer "
                             f"sends its combine as the flat one does, its dispatch through "
                             f"the forwarders")
        if c_dtype not in UNQUANTIZED:
            raise ValueError(f"ep_invariant=True combines in the Buffer's dtype: combine_dtype "
                             f"must be one of {UNQUANTIZED}, got {c_dtype!r}")
    return bool(ep_invariant)


def _nodes_layout(system: System, ep: int, gpus_per_node) -> int:
    """GPUs per node (NVLink domain) the algorithm uses; see predict's docstring."""
    domain = system.nvlink_domain_size
    if gpus_per_node is None:
        return max(d for d in range(1, min(ep, domain) + 1) if ep % d == 0)
    gpn = _check_int("gpus_per_node", gpus_per_node)
    if gpn > domain:
        raise ValueError(f"gpus_per_node={gpn} exceeds the NVLink domain of {system.name} "
                         f"({domain} GPUs)")
    if ep <= gpn:
        return ep
    if ep % gpn:
        raise ValueError(f"ep={ep} spans several nodes, so it must be a multiple of "
                         f"gpus_per_node={gpn}")
    return gpn


def _workload(sysm: System, ep, tokens_per_rank, hidden, topk, num_experts, dispatch_dtype,
              combine_dtype, routing, gpus_per_node, sim_tokens):
    """Validated (routing spec, Layout, T, H, k, dispatch dtype, combine dtype)."""
    ep = _check_int("ep", ep)
    T = _check_int("tokens_per_rank", tokens_per_rank)
    H = _check_int("hidden", hidden)
    k = _check_int("topk", topk)
    E = _check_int("num_experts", num_experts)
    if k > E:
        raise ValueError(f"topk={k} exceeds num_experts={E}")
    if E % ep:
        raise ValueError(f"num_experts={E} must be divisible by ep={ep} (experts are split "
                         "evenly over ranks)")
    d_dtype = normalize_dtype(dispatch_dtype, DTYPES)
    c_dtype = normalize_dtype(combine_dtype, COMBINE_DTYPES)
    gpn = _nodes_layout(sysm, ep, gpus_per_node)
    _check_int("sim_tokens", sim_tokens, 64)
    spec = parse_routing(routing, E, k)
    if spec.kind == "group_limited":
        gs, m, node_e = E // spec.groups, E // ep, E // ep * gpn
        for size, what in ((m, "experts per rank"), (node_e, "experts per node")):
            if gs % size and size % gs:
                raise ValueError(f"group_limited: group size {gs} and {what} ({size}) must "
                                 "divide one another")
    return spec, Layout(ep=ep, gpn=gpn, m=E // ep), T, H, k, d_dtype, c_dtype
