"""Host reads by any route: the GPU flavours' ops on the ``meta`` device (run in a subprocess:
recorded launches, no interpreter).

    python tests/sync_jobs.py

A meta tensor has no data: ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``,
``torch.equal``, a copy into a host tensor, a boolean index or ``bool(t)`` on one raises. The
static gate's virtual ranks (``moe_comm.testing.gate``) drive every op of every GPU flavour on it
(one
node, NVSHMEM, the proxy flat and hierarchical, fault tolerant; every dispatch format, both
combines, the backward ops, the low-latency pair with its hooks), and the normal mode's
public ``Buffer.dispatch`` / ``Buffer.combine`` too, rank after rank; the one read that is
meant, a dispatch's received-row count without ``max_recv_rows``, goes through
``moe_comm.host_sync.read_int``, which is replaced by a stand-in that counts and answers a
bound. Prints, as JSON, the reads per flavour through the helper; any other read raises and
the script fails.
"""
from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

from moe_comm import normal_dispatch, ops  # noqa: E402
from moe_comm.kernels.recording import recording  # noqa: E402
from moe_comm.testing import gate, lockstep  # noqa: E402

CONFIG = gate.GateConfig("syncs", 4, 16, 256, 4, 32, nvshmem=True)
# (name, low_latency, transport, hierarchical, fault_tolerant), as gate.record_config builds them
FLAVOURS = [("one_node", False, 0, False, False), ("one_node_ll", True, 0, False, False),
            ("nvshmem", False, 1, False, False), ("nvshmem_ll", True, 1, False, False),
            ("proxy_flat", False, 2, False, False), ("proxy_hier", False, 2, True, False),
            ("proxy_ll", True, 2, False, False), ("fault_tolerant", False, 0, False, True),
            ("fault_tolerant_ll", True, 0, False, True)]


def public_calls(bufs, xs, idxs, ws, dtype) -> None:
    """The calls a user makes, rank after rank (the waits are in the recorded kernels, so no
    rank waits for another): ``Buffer.dispatch`` sized by the row count and with
    ``max_recv_rows``, ``Buffer.combine`` of each with its weights (the ops' real
    implementations on meta tensors: :func:`main` registers them)."""
    for buf, x, idx, w in zip(bufs, xs, idxs, ws):
        for max_recv_rows in (None, 64):
            res = buf.dispatch(x, idx, w, max_recv_rows=max_recv_rows)
            y = torch.empty(res.x.shape, dtype=dtype, device="meta")
            buf.combine(y, res.handle, res.weights)


def main() -> dict:
    bound = CONFIG.world_size * CONFIG.tokens * CONFIG.topk
    meant = {}

    def read_int(counter, what, value):
        """The counted helper's stand-in: counts the read, checks it is the meant one."""
        assert what == "rows" and value.device.type == "meta" and value.numel() == 1, what
        counter[what] += 1
        return bound

    normal_dispatch.read_int = read_int  # (the dispatch's one host read)
    for op in (ops.dispatch_op, ops.combine_op, ops.dispatch_cached_op, ops.row_dot_op):
        op.register_kernel("meta")(op._init_fn)  # the real op, not its fake, on meta tensors
    dtype = torch.bfloat16
    xs, idxs, ws = gate._inputs(CONFIG, dtype)
    for name, low_latency, transport, hierarchical, fault_tolerant in FLAVOURS:
        with recording(90) as launches:
            bufs = gate._buffers(CONFIG, dtype, low_latency, transport, 90, hierarchical,
                                 fault_tolerant)
            if low_latency:
                gate.drive_low_latency(bufs, CONFIG, dtype)
            else:
                gate.drive_normal(bufs, CONFIG, dtype)
                res = lockstep.dispatch(bufs, xs, idxs, ws)   # sized by the row count
                ys = [torch.empty(r.x.shape, dtype=dtype, device="meta") for r in res]
                lockstep.combine(bufs, ys, [r.handle for r in res], [r.weights for r in res])
                public_calls(bufs, xs, idxs, ws, dtype)
        assert launches, name
        meant[name] = sum(sum(b.host_syncs.values()) for b in bufs)
    return meant


if __name__ == "__main__":
    print(json.dumps(main()))
    sys.stdout.flush()
