"""bench/host_cost.py: launches per op of the GPU flavour counted on the meta device (every
kernel, torch's too), and the classification behind the count. Counts only, never times."""
import json
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "bench"))

# launches per op and rank today, and the speed issue's limits (normal dispatch <= 5, normal
# combine <= 3, low-latency dispatch and combine <= 2 each): a regression fails, the
# low-latency pair is at its limit, normal mode not yet.
TODAY = {"dispatch": 27, "combine": 5, "ll_dispatch": 2, "ll_combine": 2}


def test_what_launches_a_kernel():
    interpret = os.environ.get("TRITON_INTERPRET")
    from host_cost import launches_a_kernel

    assert os.environ.get("TRITON_INTERPRET") == interpret  # ranks started later inherit it

    aten = torch.ops.aten
    for op in (aten.add.Tensor, aten.copy_.default, aten.cumsum.default, aten.zeros.default,
               aten.fill_.Scalar, aten._to_copy.default, aten.index_select.default):
        assert launches_a_kernel(op), op
    for op in (aten.view.default, aten.slice.Tensor, aten.select.int, aten.as_strided.default,
               aten.empty.memory_format, aten.empty_strided.default, aten.unsqueeze.default,
               aten.expand.default, aten.t.default):
        assert not launches_a_kernel(op), op


def test_launches_per_op_are_counted_and_bounded(tmp_path):
    out = tmp_path / "host_cost.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "host_cost.py"),
                           "--calls", "1", "--json", str(out)], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result) == set(TODAY)
    for op, row in result.items():
        assert row["launches"] == row["triton"] + row["torch"], (op, row)
        assert row["launches"] <= TODAY[op], (op, row)
        assert sum(row["torch_ops"].values()) == row["torch"], (op, row)
        assert row["aten"] >= row["torch"] and row["python"] > 0, (op, row)
    # the low-latency pair launches only its two Triton kernels, no torch kernel
    for op in ("ll_dispatch", "ll_combine"):
        assert result[op]["triton"] == 2 and result[op]["torch"] == 0, result[op]
    assert result["ll_dispatch"]["triton_kernels"] == {"ll_dispatch_recv_kernel": 1,
                                                      "ll_dispatch_send_kernel": 1}
    # a normal dispatch: layout, send, wait, expand, plus torch's small ops
    assert result["dispatch"]["triton_kernels"] == {
        "dispatch_expand_kernel": 1, "routing_layout_kernel": 1, "dispatch_send_kernel": 1,
        "wait_epochs_kernel": 1}, result["dispatch"]
    assert "host cost per op and rank" in proc.stdout and "launches" in proc.stdout
