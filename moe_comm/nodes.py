"""Ranks grouped into nodes, and what the proxy transport needs to know about them.

Rank ``r`` is local index ``r % N`` of node ``r // N`` (``N = ranks_per_node``). Ranks of one node
reach each other by stores (NVLink, or shared memory on CPU ranks); between nodes only a
transport moves data. With the hierarchical mode a rank exchanges data across nodes only with
the ranks of the same local index (its "rail"), as DeepEP's internode mode does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels.internode import PLAN_FIELDS
from .workspace import WorkspaceLayout

NEVER = 1 << 62  # a signal word nobody writes in this mode: every wait sees it arrived


@dataclass(frozen=True)
class Nodes:
    ranks_per_node: int
    count: int
    num_hosts: int

    @staticmethod
    def of(world_size: int, ranks_per_node: int | None, hosts: list[str],
           device: torch.device, split_hosts: bool = False) -> Nodes:
        """``ranks_per_node`` as given (checked), else the ranks per host (hosts must hold
        contiguous, equal blocks of ranks). On GPUs the nodes are the hosts, unless
        ``split_hosts`` (the NVSHMEM heap, or the proxy: nodes of one host then reach each other
        only by NVSHMEM puts or through the proxy, as nodes on different hosts would; several
        processes of one GPU test it)."""
        num_hosts = len(set(hosts))
        if ranks_per_node is None:
            if num_hosts == 1:
                return Nodes(world_size, 1, 1)
            ranks_per_node = world_size // num_hosts
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) \
                or ranks_per_node < 1 or world_size % ranks_per_node:
            raise ValueError(f"ranks_per_node must be a positive divisor of the world size "
                             f"{world_size}, got {ranks_per_node!r}")
        for r, host in enumerate(hosts):
            first = r // ranks_per_node * ranks_per_node
            if host != hosts[first]:
                raise ValueError(f"ranks_per_node={ranks_per_node}: rank {r} runs on {host!r} "
                                 f"but rank {first} of its node on {hosts[first]!r}; the ranks "
                                 "of a node must share a host")
        per_host = world_size // num_hosts  # (a node within one host: checked above)
        if device.type == "cuda" and ranks_per_node != per_host and not split_hosts:
            raise ValueError(f"on GPUs the nodes are the hosts ({per_host} ranks each; "
                             "backend='nvshmem' or transport='nixl' may split them); got "
                             f"ranks_per_node={ranks_per_node}")
        return Nodes(ranks_per_node, world_size // ranks_per_node, num_hosts)


def internode_peers(layout: WorkspaceLayout, rank: int) -> list[int]:
    """Ranks on other nodes that ``rank`` exchanges data with: all of them (flat, the
    low-latency mode, which puts each pair straight into its expert's rank, and the EP-invariant
    combine, which sends each (token, choice) row straight home), or those with its local index
    (hierarchical normal mode only)."""
    N, R = layout.ranks_per_node, layout.world_size
    return [p for p in range(R) if p // N != rank // N
            and (not layout.hierarchical or layout.low_latency or layout.invariant
                 or p % N == rank % N)]


def signal_labels(layout: WorkspaceLayout, rank: int) -> dict[int, str]:
    """The channel of each signal word ``rank``'s descriptors raise on a peer (for counting)."""
    plan = layout.internode_plan(rank)
    labels = {plan["dst_signal"]: "dispatch", plan["comb_signal"]: "combine"}
    if layout.low_latency:  # the words this rank raises on a peer, both parities
        for p in range(2):
            for e in range(layout.num_local_experts):
                labels[layout.offset("ll_dispatch_signals", p, e, rank)] = "ll_dispatch"
            labels[layout.offset("ll_combine_signals", p, rank)] = "ll_combine"
            for c in range(2):
                labels[layout.offset("ll_acks", c, p, rank)] = "ll_acks"
    return labels


def plan_values(layout: WorkspaceLayout, rank: int) -> list[int]:
    """:meth:`WorkspaceLayout.internode_plan` in the kernels' field order (0 where unused)."""
    plan = layout.internode_plan(rank)
    return [plan.get(name, 0) for name in PLAN_FIELDS]


def never_signalled(layout: WorkspaceLayout, rank: int) -> list[tuple[str, tuple]]:
    """Signal words of ``rank`` that nobody writes in this mode: (region, index)."""
    if not layout.hierarchical:
        return []
    N, R = layout.ranks_per_node, layout.world_size
    node, local = divmod(rank, N)
    words = [("node_signals", (0, node))] + [("node_signals", (1, b))
                                              for b in range(layout.num_nodes)]
    # combine: from another node only its forwarder for this rank (its local index) sends (the
    # EP-invariant combine: every rank, its rows straight home)
    words += [("signals", (1, p)) for p in range(R)
              if p // N != node and p % N != local and not layout.invariant]
    return words


def relay_of(rank: int, peer: int, channel: str, ranks_per_node: int,
             hierarchical: bool) -> int | None:
    """Hierarchical: the rank that forwards ``peer``'s epoch of ``channel`` ("dispatch" or
    "combine") to ``rank`` (dispatch: ``rank``'s node's rank with the peer's local index;
    combine: the peer itself sends its node's sums), None where the peer's own words come
    straight to ``rank``."""
    N = ranks_per_node
    if not hierarchical or peer // N == rank // N:
        return None
    via = (rank // N) * N + peer % N if channel == "dispatch" else peer
    return None if via == rank else via
