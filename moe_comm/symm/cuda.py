"""``cuda``: device memory every peer maps, for peers reachable by load/store (one node, or an
NVLink domain such as GB200 NVL72).

    segment = torch.distributed._symmetric_memory.empty(nbytes, dtype=uint8, device=dev)
    handle = torch.distributed._symmetric_memory.rendezvous(segment, group)   # collective
    peer_ptrs = handle.buffer_ptrs                 # every peer's segment, mapped here

Needs a CUDA build of torch >= 2.6 and GPUs that can map each other's memory.

Several processes on one GPU (tests, or a GPU shared by ranks): torch symmetric memory refuses
ranks whose devices overlap unless ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``; where it still
refuses, the segments are mapped with CUDA IPC instead (``cudaIpcGetMemHandle`` of each rank's
own ``cudaMalloc``, opened by every other process of the host; through cupy). ``mapping`` says
which one a heap used. With ``ranks_per_node`` smaller than the group (nodes that split a host:
the proxy or NVSHMEM between them) the ranks of other nodes get no pointer.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .base import SymmetricHeap

OVERLAP_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"


class CudaHeap(SymmetricHeap):
    """Collective constructor over ``group``; one segment per rank on ``device``."""

    _handle = None  # torch symmetric memory's handle (its peers' mappings live with it)
    _ipc = None  # or (device index, own allocation, {peer: opened address}) through CUDA IPC

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device,
                 ranks_per_node: int | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("the 'cuda' heap needs a CUDA build of torch and a GPU; "
                               f"this torch is {torch.__version__} with no CUDA device")
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.nbytes = int(nbytes)
        self._group = group
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        places: list = [None] * self.world_size
        dist.all_gather_object(places, (os.uname().nodename, str(torch.cuda.get_device_properties(
            device).uuid)), group=group)
        shared = len(set(places)) < len(places)  # two ranks of one host on one GPU
        self.mapping = "torch symmetric memory"
        error = None
        if not shared or os.environ.get(OVERLAP_ENV) == "1":
            error = self._rendezvous(device)
            if error is not None and not shared:
                raise error
        if shared and (error is not None or os.environ.get(OVERLAP_ENV) != "1"):
            self.mapping = "cuda ipc" + ("" if error is None else
                                         f" (torch symmetric memory refused: {error})")
            self._map_by_ipc(device)
        if ranks_per_node is not None and ranks_per_node < self.world_size:
            # nodes that split a host (the proxy between processes of one GPU): the ranks of
            # other nodes get no pointer, so the kernels hand their rows to the transport
            node = self.rank // ranks_per_node
            self.peer_ptrs[torch.arange(self.world_size, device=self.peer_ptrs.device)
                           // ranks_per_node != node] = 0
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every segment is zeroed before anyone writes into it

    def _rendezvous(self, device) -> BaseException | None:
        """torch symmetric memory; the error where it refuses (then nothing is held)."""
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError as error:  # torch < 2.6
            raise RuntimeError(f"torch {torch.__version__} has no symmetric memory "
                               "(torch.distributed._symmetric_memory needs torch >= 2.6)") \
                from error
        try:
            local = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=device)
            local.zero_()
            handle = symm_mem.rendezvous(local, self._group)
        except RuntimeError as error:
            return error
        self.local, self._handle = local, handle
        self.peer_ptrs = peer_table(handle.buffer_ptrs, self.world_size, device)
        return None

    def _map_by_ipc(self, device) -> None:
        """Each rank's own allocation, opened by every peer through its CUDA IPC handle."""
        import cupy

        with cupy.cuda.Device(device.index):
            base = cupy.cuda.runtime.malloc(self.nbytes)
            handle = cupy.cuda.runtime.ipcGetMemHandle(base)
            handles: list = [None] * self.world_size
            dist.all_gather_object(handles, bytes(handle), group=self._group)
            opened = {p: cupy.cuda.runtime.ipcOpenMemHandle(h) for p, h in enumerate(handles)
                      if p != self.rank}
        self._ipc = (device.index, base, opened)
        memory = cupy.cuda.UnownedMemory(base, self.nbytes, self)
        array = cupy.ndarray((self.nbytes,), dtype=cupy.uint8,
                             memptr=cupy.cuda.MemoryPointer(memory, 0))
        self.local = torch.as_tensor(array, device=device)
        self.local.zero_()
        self.peer_ptrs = peer_table([base if p == self.rank else opened[p]
                                     for p in range(self.world_size)], self.world_size, device)

    def barrier(self) -> None:
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self._group)

    def close(self) -> None:
        """Collective: every rank's kernels are done and every rank reached ``close`` before
        any segment is unmapped (a peer may still be storing into this one otherwise)."""
        if self._handle is not None or self._ipc is not None:
            self.barrier()
        device = self.local.device
        self.peer_ptrs = torch.zeros_like(self.peer_ptrs)
        self._handle = None
        self.local = torch.empty(0, dtype=torch.uint8, device=device)
        if self._ipc is not None:
            import cupy

            index, base, opened = self._ipc
            self._ipc = None
            with cupy.cuda.Device(index):
                for ptr in opened.values():
                    cupy.cuda.runtime.ipcCloseMemHandle(ptr)
                dist.barrier(group=self._group)  # no peer maps this segment any more
                cupy.cuda.runtime.free(base)


def peer_table(addresses, world_size: int, device) -> torch.Tensor:
    """The [world_size] int64 pointer table on ``device`` (0 where a peer is unreachable)."""
    addresses = [int(a or 0) for a in addresses]
    if len(addresses) != world_size:
        raise RuntimeError(f"got {len(addresses)} peer addresses for {world_size} ranks")
    return torch.tensor(addresses, dtype=torch.int64, device=device)
