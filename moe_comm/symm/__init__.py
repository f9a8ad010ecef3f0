"""Symmetric heaps: one segment per rank, reachable from every rank through a peer-pointer table.

Backends: ``shm`` (CPU processes on one host) and ``loopback`` (virtual ranks in one process).
"""
from .base import SymmetricHeap
from .loopback import LoopbackHeap, create_loopback_heaps
from .shm import ShmHeap, reap_stale_segments

__all__ = ["SymmetricHeap", "ShmHeap", "LoopbackHeap", "create_loopback_heaps",
           "reap_stale_segments"]
