"""What one op costs the host with the GPU flavour: launches, aten calls, allocations, Python
calls and host microseconds, on virtual ranks on the ``meta`` device (no GPU, no interpreter).

    python bench/host_cost.py [--calls 200] [--json bench/results/host_cost.json]

The static gate's virtual ranks (``moe_comm.gate``: the GPU flavour, in-kernel waits, one node,
DeepSeek-V3 decode sizes: 8 ranks, 128 tokens, H 7168, top-8, 256 experts, bf16) run each op
in lockstep with every Triton launch counted and stubbed out (``StubbedLaunches``). Per op and
rank:

* ``launches``: Triton kernels plus every aten op that launches a kernel on a GPU (anything but
  views, metadata and bare allocations): what a GPU's launch queue receives;
* ``triton`` and ``torch``: those launches split;
* ``aten``: every aten call; ``allocs``: the new tensors they return (a caching allocator's
  work on a GPU);
* ``python``: calls of moe_comm's own Python functions (``sys.setprofile``; torch's are not
  counted: on meta tensors torch runs Python reference kernels a GPU runs in C++);
* ``host_us``: median microseconds per op and rank over ``--calls`` calls (lockstep over the
  ranks, divided by the ranks) on this machine's CPU, without Triton's launch path and the
  driver, and with torch's meta kernels (Python references, slower than a GPU's C++ dispatch
  for ops like ``cumsum`` and ``floor_divide``). Compare it between runs of this script only:
  it is not the eager host time on a GPU and never a GPU timing.

The counts are exact and asserted by tests (``tests/test_host_cost.py``); the times are not.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

if __name__ == "__main__":  # compiled kernels (recorded, stubbed), set before any is defined;
    os.environ["TRITON_INTERPRET"] = "0"  # imported (tests) it leaves the environment alone

import torch  # noqa: E402
import triton  # noqa: E402
from torch._library.custom_ops import OPDEFS as _OPDEFS  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import moe_comm  # noqa: E402
import moe_comm.kernels  # noqa: E402
from moe_comm import gate, lockstep  # noqa: E402

CONFIG = gate.GateConfig("dsv3-decode", 8, 256, 7168, 8, 128, nvshmem=False)
DTYPE = torch.bfloat16
_OURS = tuple(os.path.dirname(m.__file__) + os.sep for m in (moe_comm, moe_comm.kernels))
_ALLOCATING = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}
_NO_KERNEL = {"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "resize_", "set_",
              "_local_scalar_dense", "item", "lift_fresh", "detach_"}  # item: a host read


def _op_name(func) -> str:
    return func._schema.name.split("::")[-1]


def launches_a_kernel(func) -> bool:
    """Whether aten op ``func`` launches a kernel on a GPU: not a view (an output aliasing an
    input without writing it), not metadata, not a bare allocation."""
    name = _op_name(func)
    if name in _ALLOCATING or name in _NO_KERNEL:
        return False
    return not any(r.alias_info is not None and not r.alias_info.is_write
                   for r in func._schema.returns)


class AtenCounter(TorchDispatchMode):
    """Counts aten calls, the kernels they would launch and the tensors they allocate."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls["aten"] += 1
        if launches_a_kernel(func):
            self.calls["torch"] += 1
            self.calls[f"op:{_op_name(func)}"] += 1
        views = any(r.alias_info is not None for r in func._schema.returns)
        if not views:
            flat = out if isinstance(out, (tuple, list)) else (out,)
            self.calls["allocs"] += sum(isinstance(t, torch.Tensor) for t in flat)
        return out


class LaunchCounter:
    """Counts what one op puts on a GPU's launch queue while it runs for real (CPU ranks or a
    GPU): its Triton launches and every aten op outside them that launches a kernel
    (:func:`launches_a_kernel`; the interpreter's own torch calls inside a launch are not the
    op's). ``count``: both; ``names``: the Triton kernels; ``torch_ops``: the aten ops."""

    def __init__(self):
        self.names: list[str] = []
        self.torch_ops: collections.Counter = collections.Counter()
        self._inside = 0

    @property
    def count(self) -> int:
        return len(self.names) + sum(self.torch_ops.values())

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self._classes = (triton.runtime.jit.JITFunction, InterpretedFunction)
        self._runs = [cls.run for cls in self._classes]
        counter = self

        def wrap(run):
            def counted(fn, *args, **kwargs):
                counter.names.append(getattr(fn, "fn", fn).__name__)
                counter._inside += 1
                try:
                    return run(fn, *args, **kwargs)
                finally:
                    counter._inside -= 1
            return counted

        for cls, run in zip(self._classes, self._runs):
            cls.run = wrap(run)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                ours = _OPDEFS.get(func._schema.name)  # moe_comm's custom ops: look inside
                if ours is not None:
                    with self:
                        return ours._init_fn(*args, **kwargs)
                if not counter._inside and launches_a_kernel(func):
                    counter.torch_ops[_op_name(func)] += 1
                return func(*args, **kwargs)

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for cls, run in zip(self._classes, self._runs):
            cls.run = run


class StubbedLaunches:
    """Within it every Triton launch (``kernel[grid](...)``) is counted and returns at once:
    no argument binding, no compile, no driver."""

    def __init__(self):
        self.names: list[str] = []

    @property
    def count(self) -> int:
        return len(self.names)

    def __enter__(self):
        self._run = triton.runtime.jit.JITFunction.run

        def run(fn, *args, **kwargs):
            self.names.append(fn.fn.__name__)
        triton.runtime.jit.JITFunction.run = run
        return self

    def __exit__(self, *exc):
        triton.runtime.jit.JITFunction.run = self._run


def _ops(bufs):
    """op name -> a callable running it once on every rank, in the order a layer calls them."""
    xs, idxs, ws = gate._inputs(CONFIG, DTYPE)
    state = {}

    def dispatch():
        rows = gate.max_recv_rows(CONFIG)
        state["res"] = lockstep.dispatch(bufs, xs, idxs, ws, max_recv_rows=rows)

    def expert_outputs(key, received):
        """The combine's input, made once (on the warm call, outside what is counted): the
        received shapes do not change between calls."""
        if key not in state:
            state[key] = [torch.empty(r.x.shape, dtype=DTYPE, device="meta") for r in received]
        return state[key]

    def combine():
        res = state["res"]
        ys = expert_outputs("ys", res)
        lockstep.combine(bufs, ys, [r.handle for r in res], [r.weights for r in res])

    def ll_dispatch():
        state["recvs"] = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=True)

    def ll_combine():
        recvs = state["recvs"]
        ys = expert_outputs("ll_ys", recvs)
        lockstep.low_latency_combine(bufs, ys, idxs, ws, [r.handle for r in recvs])

    return {"normal": {"dispatch": dispatch, "combine": combine},
            "low_latency": {"ll_dispatch": ll_dispatch, "ll_combine": ll_combine}}


def _python_calls(op) -> int:
    """Calls of moe_comm's own Python functions during ``op()``."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(_OURS):
            calls += 1
    sys.setprofile(profile)
    try:
        op()
    finally:
        sys.setprofile(None)
    return calls


def measure(calls: int = 200) -> dict:
    """``{op: {launches, triton, torch, aten, allocs, python, host_us, torch_ops}}`` per rank."""
    R = CONFIG.world_size
    out = {}
    for mode in ("normal", "low_latency"):
        with StubbedLaunches() as launches:
            bufs = gate._buffers(CONFIG, DTYPE, mode == "low_latency", 0, 90)
            for name, op in _ops(bufs)[mode].items():
                op()  # warm: first calls fill the Buffer's caches
                before = launches.count
                with AtenCounter() as counter:
                    op()
                triton_launches = launches.count - before
                kernels = collections.Counter(launches.names[before:])
                python = _python_calls(op)
                times = []
                for _ in range(calls):
                    start = time.perf_counter()
                    op()
                    times.append((time.perf_counter() - start) / R)
                counts = counter.calls
                out[name] = {
                    "launches": (triton_launches + counts["torch"]) / R,
                    "triton": triton_launches / R, "torch": counts["torch"] / R,
                    "aten": counts["aten"] / R, "allocs": counts["allocs"] / R,
                    "python": python / R, "host_us": statistics.median(times) * 1e6,
                    "triton_kernels": {k: v / R for k, v in sorted(kernels.items())},
                    "torch_ops": {k[3:]: v / R for k, v in sorted(counts.items())
                                  if k.startswith("op:")}}
    return out


def table(result: dict) -> str:
    cols = ("launches", "triton", "torch", "aten", "allocs", "python", "host_us")
    lines = ["op           " + "".join(f"{c:>10}" for c in cols)]
    for op, row in result.items():
        lines.append(f"{op:<13}" + "".join(
            f"{row[c]:>10.1f}" if c == "host_us" else f"{row[c]:>10g}" for c in cols))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200, help="timed calls per op (median)")
    ap.add_argument("--json", default="bench/results/host_cost.json")
    args = ap.parse_args(argv)
    if args.calls < 1:
        ap.error("--calls must be >= 1")
    result = measure(args.calls)
    print(f"host cost per op and rank, GPU flavour on the meta device ({CONFIG.world_size} "
          f"virtual ranks, {CONFIG.tokens} tokens, H {CONFIG.hidden}, top-{CONFIG.topk}, "
          f"{CONFIG.num_experts} experts, bf16; low-latency dispatch FP8); host_us: this CPU, "
          f"moe_comm's host path without Triton's launch path, median of {args.calls}")
    print(table(result))
    for op, row in result.items():
        print(f"{op}: " + ", ".join(f"{k} {v:g}" for k, v in
                                    {**row["triton_kernels"], **row["torch_ops"]}.items()))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
