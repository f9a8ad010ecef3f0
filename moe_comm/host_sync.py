"""Host reads of device data: the one helper every such read of the torch layer goes through.

On a GPU a host read of a device tensor waits for the stream to reach it (a synchronisation:
the host stops issuing work, and a CUDA graph cannot be captured across it). Each Buffer counts
its reads per reason in ``buf.host_syncs``; the tests hold the ops to their budgets: low-latency
dispatch and combine 0 per call, normal combine 0, normal dispatch 1 (the received-row count,
which sizes the output; 0 with ``max_recv_rows``). Polling signal words on CPU ranks and reading
the pinned error record are not device reads and do not count.
"""
from __future__ import annotations

import collections

import torch


def read_int(counter: collections.Counter, what: str, value: torch.Tensor) -> int:
    """``int(value)`` for a one-element device tensor, counted under ``what``."""
    counter[what] += 1
    return int(value.item())
