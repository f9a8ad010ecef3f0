"""Transports: how a rank reaches peers it holds no load/store pointer to (other nodes).

``nvshmem``: GPU-initiated NVSHMEM puts from the kernels (IBGDA), no host involvement.
``nixl``: a proxy per rank (:class:`NixlProxy`): the kernels write what a remote peer gets into
this rank's outboxes and post descriptors into a ring in host-visible memory
(``moe_comm.kernels.proxy``); a host thread drains the ring with NIXL (UCX by default, which
serves InfiniBand, RoCE and TCP; LIBFABRIC for AWS EFA) and raises the peer's signal word only
after the data is in place. Works with any NIC and on CPU ranks.
"""
from __future__ import annotations

from .errors import TransportError
from .select import TRANSPORTS, choose_transport

__all__ = ["TRANSPORTS", "TransportError", "choose_transport", "NixlProxy"]


def __getattr__(name):
    if name == "NixlProxy":  # NIXL is imported only where the transport is used
        from .nixl import NixlProxy

        return NixlProxy
    raise AttributeError(name)
