"""Which transport a Buffer uses for peers on other nodes."""
from __future__ import annotations

import os

import torch

TRANSPORTS = ("auto", "nixl", "nvshmem")
NIXL_BACKENDS = ("UCX", "LIBFABRIC")


def choose_transport(requested: str, device: torch.device, num_nodes: int,
                     ibgda: bool = False) -> str | None:
    """``None`` on one node (every peer has a pointer). ``auto``: ``nvshmem`` on GPUs whose
    NICs do GPU-initiated RDMA (``ibgda``), ``nixl`` otherwise (CPU ranks, EFA, any NIC).
    ``nvshmem`` on CPU ranks: the NVSHMEM flavour's kernels in the interpreter, each put a copy
    into the peer's mapping (``kernels.emulated_puts``)."""
    if requested not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {requested!r}")
    if num_nodes == 1:
        return None
    if requested != "auto":
        return requested
    return "nvshmem" if device.type == "cuda" and ibgda else "nixl"


def nixl_backend(requested: str | None = None) -> str:
    """The NIXL backend: the argument, else ``MOE_COMM_NIXL_BACKEND``, else ``UCX``."""
    name = requested or os.environ.get("MOE_COMM_NIXL_BACKEND", "") or "UCX"
    if name not in NIXL_BACKENDS:
        raise ValueError(f"NIXL backend must be one of {NIXL_BACKENDS} (argument nixl_backend "
                         f"or MOE_COMM_NIXL_BACKEND), got {name!r}")
    return name
