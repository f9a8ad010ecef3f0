"""``cuda``: torch symmetric memory, for peers reachable by load/store (one node, or an NVLink
domain such as GB200 NVL72).

    segment = torch.distributed._symmetric_memory.empty(nbytes, dtype=uint8, device=dev)
    handle = torch.distributed._symmetric_memory.rendezvous(segment, group)   # collective
    peer_ptrs = handle.buffer_ptrs                 # every peer's segment, mapped here

Needs a CUDA build of torch >= 2.6 and GPUs that can map each other's memory.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .base import SymmetricHeap


class CudaHeap(SymmetricHeap):
    """Collective constructor over ``group``; one segment per rank on ``device``."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device):
        if not torch.cuda.is_available():
            raise RuntimeError("the 'cuda' heap needs a CUDA build of torch and a GPU; "
                               f"this torch is {torch.__version__} with no CUDA device")
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError as error:  # torch < 2.6
            raise RuntimeError(f"torch {torch.__version__} has no symmetric memory "
                               "(torch.distributed._symmetric_memory needs torch >= 2.6)") \
                from error
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.nbytes = int(nbytes)
        self._group = group
        self.local = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.local.zero_()
        self._handle = symm_mem.rendezvous(self.local, group)
        self.peer_ptrs = peer_table(self._handle.buffer_ptrs, self.world_size, device)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every segment is zeroed before anyone writes into it

    def barrier(self) -> None:
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self._group)

    def close(self) -> None:
        """Collective: every rank's kernels are done and every rank reached ``close`` before
        any segment is unmapped (a peer may still be storing into this one otherwise)."""
        if self._handle is not None:
            self.barrier()
        self.peer_ptrs = torch.zeros_like(self.peer_ptrs)
        self._handle = None
        self.local = torch.empty(0, dtype=torch.uint8, device=self.local.device)


def peer_table(addresses, world_size: int, device) -> torch.Tensor:
    """The [world_size] int64 pointer table on ``device`` (0 where a peer is unreachable)."""
    addresses = [int(a or 0) for a in addresses]
    if len(addresses) != world_size:
        raise RuntimeError(f"got {len(addresses)} peer addresses for {world_size} ranks")
    return torch.tensor(addresses, dtype=torch.int64, device=device)
