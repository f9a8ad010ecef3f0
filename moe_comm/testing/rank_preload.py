"""What the fork server of ``moe_comm.testing.launch.RankPool`` holds before it forks a rank.

Imported once by the server (``multiprocessing``'s ``forkserver`` start method): the workers'
environment, torch with one thread (and ``torch._dynamo``, which the custom ops import on their
first call), Triton in interpreter mode and the kernels, each kernel run once on a tiny problem
of virtual ranks (the interpreter prepares a kernel's code on its first call: seconds per
process). Every rank forked afterwards starts with all of it in memory instead of paying it
again. Nothing here starts a thread, a process group or a shared-memory segment,
so forking stays safe.
"""
import os

from .launch import WORKER_ENV

os.environ.update(WORKER_ENV)

import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401  (the custom ops' first call imports it: seconds a rank)
import torch.distributed  # noqa: E402,F401  (the workers' process groups)

torch.set_num_threads(1)

from .. import Buffer  # noqa: E402
from . import lockstep  # noqa: E402


def _warm_up() -> None:
    """One normal dispatch + combine and one low-latency pair on two virtual ranks."""
    R, H, E, T = 2, 128, 4, 4
    xs = [torch.ones((T, H), dtype=torch.bfloat16) for _ in range(R)]
    idxs = [torch.tensor([[0, 3], [1, 2], [2, -1], [3, 0]]) for _ in range(R)]
    ws = [torch.ones((T, 2)) for _ in range(R)]
    bufs = Buffer.loopback(R, H, E, T, low_latency=True)
    got = lockstep.dispatch(bufs, xs, idxs, ws)
    lockstep.combine(bufs, [g.x for g in got], [g.handle for g in got], [g.weights for g in got])
    recvs = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=True)
    lockstep.low_latency_combine(bufs, [torch.zeros(r.x.shape, dtype=torch.bfloat16)
                                        for r in recvs], idxs, ws, [r.handle for r in recvs])
    for buf in bufs:
        buf.close()


_warm_up()
