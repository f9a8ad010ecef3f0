"""The symmetric heap interface shared by every backend.

A heap is one segment of ``nbytes`` bytes per rank, the same size on every rank, zeroed when it
is allocated. A rank reaches its own segment as a tensor (``local``) and every peer's segment
through a **peer-pointer table**: ``peer_ptrs[p]`` is the address (int64) at which this process
can load from and store to rank ``p``'s segment, or 0 where it cannot (a peer reached only by
NVSHMEM puts across nodes). Kernels take the table as an argument and do
``tl.load(peer_ptrs + p).to(tl.pointer_type(...))``: on CPU ranks and over NVLink a remote put
is a plain store through that address.

Equivalent PyTorch, for a table where every peer is reachable::

    segments = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(world_size)]
    peer_ptrs = torch.tensor([s.data_ptr() for s in segments], dtype=torch.int64)
"""
from __future__ import annotations

import abc

import torch


class SymmetricHeap(abc.ABC):
    """One rank's view of a symmetric heap. Subclasses set the attributes in ``__init__``."""

    rank: int
    world_size: int
    nbytes: int
    local: torch.Tensor  # [nbytes] uint8, this rank's segment
    peer_ptrs: torch.Tensor  # [world_size] int64 addresses, 0 where a peer is not reachable
    # every rank's segment as mapped in this process, for the interpreter's NVSHMEM puts
    # (``kernels.emulated_puts``; the shm heap with puts=True), else None
    put_bases: list[int] | None = None

    @property
    def device(self) -> torch.device:
        return self.local.device

    def view(self, byte_offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Typed view of this segment: ``local[byte_offset:].view(dtype)[:numel].view(shape)``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if byte_offset % itemsize:
            raise ValueError(f"offset {byte_offset} is not aligned to {dtype} ({itemsize} bytes)")
        numel = 1
        for s in shape:
            numel *= s
        end = byte_offset + numel * itemsize
        if end > self.nbytes:
            raise ValueError(f"view [{byte_offset}, {end}) exceeds the heap ({self.nbytes} bytes)")
        return self.local[byte_offset:end].view(dtype).view(shape)

    @abc.abstractmethod
    def barrier(self) -> None:
        """Returns once every rank of the heap has called it (no-op for virtual ranks)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases this rank's mappings; kernels must not use ``peer_ptrs`` afterwards."""

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
                f"nbytes={self.nbytes}, device={self.device})")
