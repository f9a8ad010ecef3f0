"""``nvshmem``: the NVSHMEM symmetric heap through nvshmem4py, for peers on other nodes.

Bootstrap over the torch.distributed group (collective)::

    uid = nvshmem.core.get_unique_id()          # on rank 0, broadcast over the group
    nvshmem.core.init(device=Device(i), uid=uid, rank=r, nranks=R, initializer_method="uid")
    segment = nvshmem.core.tensor((nbytes,), dtype=torch.uint8)
    peer_ptrs[p] = nvshmem_ptr(segment, p)       # 0 for a peer only reachable by RDMA

Kernels store through ``peer_ptrs[p]`` where it is not 0 and use NVSHMEM device puts (to the
*local* symmetric address ``local_ptr``, which NVSHMEM translates) where it is 0. The group's
ranks must be the NVSHMEM PEs in the same order (``group`` = the world group).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from .base import SymmetricHeap
from .cuda import peer_table

_initialized_with: tuple | None = None  # (world size, device index) of this process's init


def _import_nvshmem():
    try:
        import nvshmem.bindings as bindings
        import nvshmem.core as core
    except ImportError as error:
        raise RuntimeError("the 'nvshmem' heap needs nvshmem4py: pip install nvshmem4py-cu13 "
                           "(or -cu12) next to the matching nvidia-nvshmem wheel") from error
    return core, bindings


def encode_unique_id(uid) -> bytes:
    """The bytes of an NVSHMEM unique id, to send over a torch.distributed group."""
    return np.asarray(uid._data).view(np.int8).tobytes()


def decode_unique_id(core, payload: bytes):
    """An NVSHMEM unique id from :func:`encode_unique_id`'s bytes."""
    uid = core.get_unique_id(empty=True)
    view = np.asarray(uid._data).view(np.int8)
    view[:] = np.frombuffer(payload, dtype=np.int8)
    return uid


def init_nvshmem(group: dist.ProcessGroup, device: torch.device) -> None:
    """Initialises NVSHMEM once per process with a unique id broadcast over ``group``."""
    global _initialized_with
    core, _ = _import_nvshmem()
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if _initialized_with is not None:
        if _initialized_with != (world_size, device.index):
            raise RuntimeError(f"NVSHMEM is already initialised for {_initialized_with}; one "
                               "process joins one NVSHMEM job")
        return
    if dist.get_world_size() != world_size:
        raise ValueError("the nvshmem heap needs the world group (NVSHMEM PEs are the ranks)")
    payload = [encode_unique_id(core.get_unique_id()) if rank == 0 else None]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    from cuda.core import Device

    core.init(device=Device(device.index), uid=decode_unique_id(core, payload[0]), rank=rank,
              nranks=world_size, initializer_method="uid")
    _initialized_with = (world_size, device.index)


class NvshmemHeap(SymmetricHeap):
    """Collective constructor; ``peer_ptrs`` holds 0 for peers NVSHMEM reaches only by RDMA,
    and for every rank outside this rank's node of ``ranks_per_node`` ranks: the kernels put to
    those through NVSHMEM even where it could map them (nodes that split a host, so that
    several processes of one GPU run the NVSHMEM path as nodes on different hosts would)."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device,
                 ranks_per_node: int | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("the 'nvshmem' heap needs a CUDA build of torch and a GPU")
        core, bindings = _import_nvshmem()
        init_nvshmem(group, device)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.nbytes = int(nbytes)
        self._group, self._core = group, core
        self.local = core.tensor((self.nbytes,), dtype=torch.uint8)
        self.local.zero_()
        base = self.local.data_ptr()
        node = self.rank // (ranks_per_node or self.world_size)
        self.peer_ptrs = peer_table(
            [bindings.ptr(base, p) if p // (ranks_per_node or self.world_size) == node else 0
             for p in range(self.world_size)], self.world_size, device)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)

    @property
    def rdma_peers(self) -> list[int]:
        """Peers reached by NVSHMEM puts rather than load/store."""
        return [p for p, a in enumerate(self.peer_ptrs.tolist()) if a == 0]

    def barrier(self) -> None:
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self._group)

    def close(self) -> None:
        if self.local.numel():
            self.barrier()
            self._core.free_tensor(self.local)
        self.peer_ptrs = torch.zeros_like(self.peer_ptrs)
        self.local = torch.empty(0, dtype=torch.uint8, device=self.peer_ptrs.device)
