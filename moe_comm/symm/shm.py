"""``shm``: one process per rank on one host, segments in POSIX shared memory.

Bootstrap (collective over the torch.distributed group):

1. every rank creates ``/moe_comm_<pid>_<token>_r<rank>`` (zeroed by ``ftruncate``) and maps it;
2. the names go round with ``all_gather_object``; every rank maps every peer's segment;
3. after a barrier every rank unlinks its own name. From then on the mappings live as long as
   the processes and nothing is left in /dev/shm, whatever happens to the processes later.

A crash inside the few milliseconds between 1 and 3 can leave a name behind; the next bootstrap on
the host removes names whose creating process no longer exists.

The peer-pointer table holds the address of each peer's mapping in *this* process (mappings land
at different addresses in different processes), so a store through ``peer_ptrs[p]`` writes into
rank ``p``'s memory exactly as an NVLink P2P store does.

Nodes: with ``ranks_per_node = N`` a rank maps only the segments of its own node (ranks
``r // N`` equal); the others stay 0 in the table and unmapped in the process, exactly as peers
across a network: only a transport reaches them (``moe_comm.transport``). With
``puts=True`` (across nodes over NVSHMEM) the others stay 0 in the table too, but every segment
is mapped: ``put_bases`` gives each rank's mapping in this process, where the interpreter's
NVSHMEM puts copy (``kernels.emulated_puts``); no kernel holds a pointer to them.
"""
from __future__ import annotations

import _posixshmem
import mmap
import os
import secrets
import weakref

import torch
import torch.distributed as dist

from .base import SymmetricHeap

_PREFIX = "moe_comm_"
_SHM_DIR = "/dev/shm"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs: not gone, and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def reap_stale_segments() -> list[str]:
    """Unlinks moe_comm segments whose creating process has exited; returns their names."""
    if not os.path.isdir(_SHM_DIR):
        return []
    reaped = []
    for name in os.listdir(_SHM_DIR):
        if not name.startswith(_PREFIX):
            continue
        pid_text = name[len(_PREFIX):].split("_", 1)[0]
        if not pid_text.isdigit() or pid_alive(int(pid_text)):
            continue
        try:
            _posixshmem.shm_unlink("/" + name)
            reaped.append(name)
        except FileNotFoundError:
            pass
    return reaped


def _weakrefable(obj) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


def _map(name: str, nbytes: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = _posixshmem.shm_open(name, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class ShmHeap(SymmetricHeap):
    """Collective constructor: every rank of ``group`` must call it with the same ``nbytes``."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, ranks_per_node: int | None = None,
                 puts: bool = False):
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.ranks_per_node = ranks_per_node or self.world_size
        node = self.rank // self.ranks_per_node
        self.nbytes = int(nbytes)
        self._group = weakref.ref(group) if _weakrefable(group) else group
        reap_stale_segments()
        own = f"/{_PREFIX}{os.getpid()}_{secrets.token_hex(4)}_r{self.rank}"
        self._maps: list[mmap.mmap] = []
        unlinked = False
        try:
            own_map = _map(own, self.nbytes, create=True)
            names: list[str | None] = [None] * self.world_size
            dist.all_gather_object(names, own, group=group)
            for peer, name in enumerate(names):
                if peer // self.ranks_per_node != node and not puts:
                    self._maps.append(None)  # another node: never mapped
                    continue
                self._maps.append(own_map if peer == self.rank else _map(name, self.nbytes, False))
            dist.barrier(group=group)
            _posixshmem.shm_unlink(own)
            unlinked = True
        finally:
            if not unlinked:
                try:
                    _posixshmem.shm_unlink(own)
                except FileNotFoundError:
                    pass
        self._segments = [None if m is None else torch.frombuffer(m, dtype=torch.uint8)
                          for m in self._maps]
        self.local = self._segments[self.rank]
        self.put_bases = [s.data_ptr() for s in self._segments] if puts else None
        self.peer_ptrs = torch.tensor([0 if s is None or p // self.ranks_per_node != node
                                       else s.data_ptr() for p, s in enumerate(self._segments)],
                                      dtype=torch.int64)

    def barrier(self) -> None:
        group = self._group() if isinstance(self._group, weakref.ref) else self._group
        if group is None:
            raise RuntimeError("the process group of this heap is gone")
        dist.barrier(group=group)

    def close(self) -> None:
        self._group = None  # a heap must not keep a destroyed process group alive
        self.peer_ptrs = torch.zeros(self.world_size, dtype=torch.int64)
        self.local = torch.empty(0, dtype=torch.uint8)
        self._segments = []
        self.put_bases = None
        for m in self._maps:
            if m is None:
                continue
            try:
                m.close()
            except BufferError:  # a caller still holds a view; the mapping goes with the process
                pass
        self._maps = []
