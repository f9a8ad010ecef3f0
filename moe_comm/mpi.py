"""A torch process group for a job started by ``mpirun`` / ``srun``: ``Buffer(..., comm=comm)``.

The Buffer needs a torch group only to exchange small objects at construction (configs, heap
handles, NIXL agent metadata). Given an mpi4py communicator it makes that group itself:

* torch.distributed not initialised: the default group is initialised with gloo over TCP, its
  address agreed through the communicator (``MASTER_ADDR`` / ``MASTER_PORT`` if set; else
  127.0.0.1 when every rank is on one host, rank 0's host name otherwise, and a free port that
  rank 0 picked). torch.distributed stays initialised afterwards, as under torchrun.
* already initialised (e.g. by the framework): the communicator must hold the same ranks in
  the same order as the default group, which is then used.
"""
from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _address(comm) -> str:
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    hosts = comm.allgather(socket.gethostname())
    return "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]


def process_group(comm, timeout_s: float = 300.0) -> dist.ProcessGroup:
    """The torch group of the ranks of ``comm`` (an mpi4py communicator), made if needed.

    Equivalent to what torchrun sets up: rank ``comm.Get_rank()`` of ``comm.Get_size()``."""
    for name in ("Get_rank", "Get_size", "allgather", "bcast"):
        if not callable(getattr(comm, name, None)):
            raise TypeError(f"comm must be an mpi4py communicator (with {name}), got "
                            f"{type(comm).__name__}")
    rank, size = comm.Get_rank(), comm.Get_size()
    if dist.is_initialized():
        ranks = comm.allgather(dist.get_rank())
        if ranks != list(range(dist.get_world_size())):
            raise ValueError(f"comm holds world ranks {ranks} of torch.distributed's "
                             f"{dist.get_world_size()}: with torch.distributed initialised, "
                             "comm must be the whole world in rank order; pass group= (a "
                             "group made by dist.new_group on every rank) instead")
        return dist.group.WORLD
    address = _address(comm)
    port = None
    if rank == 0:
        port = int(os.environ.get("MASTER_PORT") or _free_port(address))
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.group.WORLD
