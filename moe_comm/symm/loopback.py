"""``loopback``: N virtual ranks in one process, for unit tests and single-device runs.

All segments are ordinary tensors on one device; every virtual rank's pointer table lists the
same N addresses. There is no concurrency between virtual ranks: a driver runs each phase of an
op for every rank before the next phase (see ``Buffer.loopback`` and
``moe_comm.testing.lockstep``), so
a wait is always already satisfied when it is reached.
"""
from __future__ import annotations

import torch

from .base import SymmetricHeap


class LoopbackHeap(SymmetricHeap):
    """Virtual rank ``rank`` of a set created by :func:`create_loopback_heaps`."""

    def __init__(self, rank: int, segments: list[torch.Tensor], peer_ptrs: torch.Tensor):
        self.rank = rank
        self.world_size = len(segments)
        self.nbytes = segments[0].numel()
        self.local = segments[rank]
        self.peer_ptrs = peer_ptrs
        self._segments = segments

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        self.local = torch.empty(0, dtype=torch.uint8, device=self.local.device)
        self.peer_ptrs = torch.zeros_like(self.peer_ptrs)
        self._segments = []


def create_loopback_heaps(world_size: int, nbytes: int,
                          device: torch.device | str = "cpu") -> list[LoopbackHeap]:
    """``world_size`` zeroed segments of ``nbytes`` on ``device``; one heap per virtual rank."""
    if world_size < 1 or nbytes <= 0:
        raise ValueError(f"need world_size >= 1 and nbytes > 0, got {world_size}, {nbytes}")
    segments = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(world_size)]
    ptrs = torch.tensor([s.data_ptr() for s in segments], dtype=torch.int64, device=device)
    return [LoopbackHeap(r, segments, ptrs) for r in range(world_size)]
