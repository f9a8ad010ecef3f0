"""Which heap a Buffer gets, and making it.

``auto``: CPU tensors -> ``shm``; GPUs on one node -> ``cuda`` (torch symmetric memory);
GPUs on several nodes -> ``nvshmem`` (NVSHMEM puts for peers on other nodes). A user may force
any backend; ``loopback`` is made by ``Buffer.loopback`` (virtual ranks in one process).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .base import SymmetricHeap

BACKENDS = ("auto", "shm", "cuda", "nvshmem")


def choose_backend(requested: str, device: torch.device, num_nodes: int) -> str:
    """The backend for ``device`` when the group spans ``num_nodes`` hosts."""
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (or use Buffer.loopback for "
                         f"virtual ranks), got {requested!r}")
    if requested == "shm" and device.type != "cpu":
        raise ValueError(f"the 'shm' heap holds CPU tensors; device is {device}")
    if requested in ("cuda", "nvshmem") and device.type != "cuda":
        raise ValueError(f"the {requested!r} heap needs a CUDA device, got {device}")
    if requested == "shm" and num_nodes > 1:
        raise ValueError(f"the 'shm' heap spans one host; this group spans {num_nodes}")
    if requested == "cuda" and num_nodes > 1:
        raise ValueError(f"the 'cuda' heap needs load/store access to every peer; this group "
                         f"spans {num_nodes} hosts: use backend='nvshmem' (or 'auto')")
    if requested != "auto":
        return requested
    if device.type == "cpu":
        return "shm"
    return "cuda" if num_nodes == 1 else "nvshmem"


def default_device() -> torch.device:
    """The current CUDA device where there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def create_heap(backend: str, group: dist.ProcessGroup, nbytes: int,
                device: torch.device, ranks_per_node: int | None = None,
                puts: bool = False) -> SymmetricHeap:
    """Collective: a heap of ``nbytes`` per rank from the chosen backend (only the segments of
    this rank's node of ``ranks_per_node`` ranks are reachable by load/store; ``puts``: the
    ``shm`` heap maps the others for the interpreter's NVSHMEM puts, ``ShmHeap.put_bases``)."""
    if backend == "shm":
        from .shm import ShmHeap

        return ShmHeap(group, nbytes, ranks_per_node, puts)
    if backend == "cuda":
        from .cuda import CudaHeap

        return CudaHeap(group, nbytes, device, ranks_per_node)
    if backend == "nvshmem":
        from .nvshmem import NvshmemHeap

        return NvshmemHeap(group, nbytes, device, ranks_per_node)
    raise ValueError(f"unknown backend {backend!r}")
