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

# launches per op and rank, every kernel counted (torch's too): the limits of the default GPU
# path (normal dispatch <= 5, normal combine <= 3, low-latency dispatch and combine <= 2 each)
LIMITS = {"dispatch": 5, "combine": 3, "ll_dispatch": 2, "ll_combine": 2}
# bounded staging (4 rounds a call), as ranks in processes of their own launch it (the twins
# do): a dispatch launches the layout, the rounds' ring positions, round 0's send (which lays
# out what arrived), then one launch for the rest (kernels.dispatch_rounds): within the normal
# dispatch's 5; a combine runs its rounds in one launch (kernels.combine_rounds); a
# fault-tolerant Buffer's ops launch as many (its dispatch took 32 launches at 4 rounds, its
# combine 14, when they launched per round), and so do those of a Buffer across hosts over
# NVSHMEM (20 and 12 when they launched per round), there a send that quantizes to FP8 too
# (its scales from uninitialised memory: the expand writes every row's)
LIMITS.update(dispatch_rounds=5, combine_rounds=1, dispatch_rounds_ft=5, combine_rounds_ft=1,
              dispatch_rounds_nvshmem=5, combine_rounds_nvshmem=1,
              dispatch_fp8_rounds_nvshmem=5)
# the host path per op and rank today (views, offsets, tiles and launch arguments made once
# per Buffer, every launch bound, the error record's flags read without a call below the op,
# a dispatch's inputs checked once per signature): aten calls, allocations, moe_comm's Python
# calls; a regression fails. Every op is within 40 Python calls (the target), a low-latency
# op within 1 allocation. A normal dispatch allocates its 9 outputs that hold
# data (a custom op's outputs may not share storage: torch.library checks it on every call);
# the layout's pair positions and counts, round 0's row bases and the empty outputs are the
# Buffer's, a send's grid made once per format (17 allocations and 58 Python calls before)
HOST_PATH = {"dispatch": (11, 9, 34), "combine": (2, 2, 28), "ll_dispatch": (4, 0, 35),
             "ll_combine": (1, 1, 31), "dispatch_rounds": (23, 11, 38),
             "combine_rounds": (2, 2, 24), "dispatch_rounds_ft": (23, 11, 40),
             "combine_rounds_ft": (3, 3, 26), "dispatch_rounds_nvshmem": (23, 11, 38),
             "combine_rounds_nvshmem": (2, 2, 24),
             "dispatch_fp8_rounds_nvshmem": (26, 12, 40)}
# moe_comm's Python calls per call and rank through the Buffer's own calls today (the input
# checks, the results and the handle on top of the engine's; the custom op and its autograd
# Function are taken only where autograd records the call)
USER_PATH = {"Buffer.dispatch": 40, "Buffer.combine": 35}
# the run-time arguments of an op's launches today (each compiled kernel's parameters that are
# neither constexpr nor specialised to a constant, summed over the op's launches); a regression
# fails. The target is 30 for a normal dispatch: not met (a descriptor table in device memory
# would replace the Buffer's fixed scalars)
LAUNCH_ARGS = {"dispatch": 122, "combine": 61, "ll_dispatch": 65, "ll_combine": 53,
               "dispatch_rounds": 168, "combine_rounds": 65, "dispatch_rounds_ft": 168,
               "combine_rounds_ft": 65, "dispatch_rounds_nvshmem": 168,
               "combine_rounds_nvshmem": 65, "dispatch_fp8_rounds_nvshmem": 168}


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
               aten.expand.default, aten.t.default, aten.item.default):
        assert not launches_a_kernel(op), op


def test_launches_per_op_are_counted_and_bounded(tmp_path):
    out = tmp_path / "host_cost.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "host_cost.py"),
                           "--calls", "1", "--json", str(out)], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    user = result.pop("user_path")
    op_us = result.pop("custom_op_us")  # what eager calls no longer pay: more than the body
    assert op_us["op_and_function"] > op_us["op"] > op_us["body"] > 0, op_us
    assert set(result) == set(LIMITS)
    # a user's calls (Buffer.dispatch, Buffer.combine) that autograd records nothing of run
    # the custom op's body: the engines' launches, no op, the input checks and results on top
    for op, engine_op in (("Buffer.dispatch", "dispatch"), ("Buffer.combine", "combine")):
        row = user[op]
        assert row["through_op"] == 0 and row["launches"] == result[engine_op]["launches"], row
        assert result[engine_op]["python"] < row["python"] <= USER_PATH[op], (op, row)
    for op, row in result.items():
        assert row["launches"] == row["triton"] + row["torch"], (op, row)
        assert row["bound"] == row["triton"], (op, row)  # every warm launch skips binding
        assert row["launches"] <= LIMITS[op], (op, row)
        assert sum(row["torch_ops"].values()) == row["torch"], (op, row)
        assert row["aten"] >= row["torch"] and row["python"] > 0, (op, row)
        aten, allocs, python = HOST_PATH[op]
        assert row["aten"] <= aten and row["allocs"] <= allocs, (op, row)
        assert row["python"] <= python, (op, row)
        assert 0 < row["args"] <= LAUNCH_ARGS[op], (op, row)
    # every op launches only its Triton kernels, no torch kernel
    for op in result:
        assert result[op]["torch"] == 0, (op, result[op])
    # in rounds: the layout, the ring positions, round 0's send (laying out what arrived),
    # then one launch; a combine in one launch (it takes the ring positions from the
    # dispatch's handle)
    assert result["dispatch_rounds"]["triton_kernels"] == {
        "layout_count_kernel": 1, "layout_place_kernel": 1, "ring_positions_kernel": 1,
        "dispatch_send_kernel": 1, "dispatch_rounds_kernel": 1}
    assert result["combine_rounds"]["triton_kernels"] == {"combine_rounds_kernel": 1}
    assert result["combine_rounds_ft"]["triton_kernels"] == {"combine_rounds_kernel": 1}
    assert result["combine_rounds_nvshmem"]["triton_kernels"] == {"combine_rounds_kernel": 1}
    assert result["dispatch_rounds_nvshmem"]["triton_kernels"] \
        == result["dispatch_fp8_rounds_nvshmem"]["triton_kernels"] \
        == result["dispatch_rounds"]["triton_kernels"]
    assert result["ll_dispatch"]["triton_kernels"] == {"ll_dispatch_recv_kernel": 1,
                                                      "ll_dispatch_send_kernel": 1}
    # a normal dispatch: the layout's two passes, send, the wait fused with the received
    # layout, expand; a combine: send, wait, reduce
    assert result["dispatch"]["triton_kernels"] == {
        "layout_count_kernel": 1, "layout_place_kernel": 1, "dispatch_send_kernel": 1,
        "received_layout_kernel": 1, "dispatch_expand_kernel": 1}, result["dispatch"]
    assert result["combine"]["triton_kernels"] == {
        "combine_send_kernel": 1, "wait_epochs_kernel": 1, "combine_reduce_kernel": 1}
    assert "host cost per op and rank" in proc.stdout and "launches" in proc.stdout


def test_the_launch_counter_sees_every_kernel_of_the_public_ops():
    """``LaunchCounter`` (the benchmark's launches column) counts what a GPU's queue gets from
    the public ops, running for real on a CPU rank: the Triton kernels, torch's kernels (also
    inside moe_comm's custom ops), no host read (``item``) and nothing the interpreter does
    inside a launch."""
    from host_cost import LaunchCounter

    import moe_comm

    buf = moe_comm.Buffer.loopback(1, 128, 8, 6)[0]
    g = torch.Generator().manual_seed(3)
    x = torch.randn((6, 128), generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 8, (6, 2), generator=g)
    idx[:, 1] = (idx[:, 0] + 1) % 8
    w = torch.rand((6, 2), generator=g)
    with LaunchCounter() as dispatch:
        res = buf.dispatch(x, idx, w)
    assert dispatch.names == ["layout_count_kernel", "layout_place_kernel",
                              "dispatch_send_kernel", "received_layout_kernel",
                              "dispatch_expand_kernel"]
    assert dispatch.count == 5 and not dispatch.torch_ops
    with LaunchCounter() as combine:
        y = res.x * 2  # not the op's: outside the counter
        buf.combine(y, res.handle, weights=res.weights)
    assert combine.names == ["combine_send_kernel", "combine_reduce_kernel"]
    with LaunchCounter() as torch_too:
        buf.combine(res.x * 2, res.handle, weights=res.weights)
    assert torch_too.torch_ops == {"mul": 1} and torch_too.count == 3


_WARM_PROXY_COMBINES = """
import host_cost
from moe_comm.testing import gate
with host_cost.compiled_stand_ins():
    for flags in ((False,), (True,), (False, True), (False, False, True)):
        bufs = gate._buffers(host_cost.ROUNDS_CONFIG, host_cost.DTYPE, False, 2, 90, *flags)
        ops = host_cost._ops(bufs)["normal"]
        ops["dispatch"]()
        ops["combine"]()
        calls, bound = host_cost._bound_calls(bufs), sum(len(b._bound) for b in bufs)
        ops["combine"]()
        ops["combine"]()
        print(flags, host_cost._bound_calls(bufs) - calls,
              sum(len(b._bound) for b in bufs) - bound)
"""


def test_warm_one_launch_combines_through_the_proxy_reuse_their_bound_launch():
    """Through the proxy in rounds (flat, hierarchical, fault-tolerant, EP-invariant; the GPU
    flavour on the meta device): each warm combine's one launch goes through the launch bound
    by the first call and binds nothing new (a fixed tensor made afresh per call would give
    every call a key of its own)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", _WARM_PROXY_COMBINES], capture_output=True,
                          text=True, env=env, timeout=600, cwd=os.path.join(ROOT, "bench"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 4, proc.stdout
    for line in lines:  # 8 ranks, 2 warm combines: 16 bound calls, no new bound launch
        assert line.endswith(" 16 0"), line


def test_every_bound_launch_is_the_launch_tritons_path_makes():
    """``host_cost.py --verify``: every launch of the gate's flavours (both modes, every
    format, the backward ops, fault tolerance, NVSHMEM, the proxy; changing token counts and a
    misaligned input) checked against the bound launch of its key, a small kernel's bound
    launch against Triton's own, and each op's second call reaching the launcher as its
    first did."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "host_cost.py"),
                           "--verify"], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    checked, total = (int(w) for w in line.split(":")[1].split()[:3:2])
    assert checked > 5000 and total > checked, line
    for kernel in ("layout_count_kernel", "dispatch_send_kernel", "received_layout_kernel",
                   "dispatch_expand_kernel", "combine_send_kernel", "wait_epochs_kernel",
                   "ft_wait_epochs_kernel", "combine_reduce_kernel", "ll_dispatch_send_kernel",
                   "ll_dispatch_recv_kernel", "ll_combine_send_kernel",
                   "ll_combine_recv_kernel"):
        assert kernel in line, (kernel, line)
    assert "96 bound launches reached the launcher" in line, line
