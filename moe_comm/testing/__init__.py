"""The harness, apart from the runtime: what drives Buffers without a framework.

* ``lockstep``: virtual ranks in one process (``Buffer.loopback``), every rank's phase run
  before any rank waits (also what ``Buffer.warmup`` records launches through);
* ``launch``: pools of CPU ranks as processes joined by gloo (``RankPool``), and
  ``rank_preload``, what their fork server imports once;
* ``gate``: the static gate's drivers (``python -m moe_comm.testing.gate``).

Only ``lockstep`` is imported with the package.
"""
from . import lockstep

__all__ = ["lockstep"]
