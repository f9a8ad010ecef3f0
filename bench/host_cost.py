"""What one op costs the host with the GPU flavour: launches, aten calls, allocations, Python
calls and host microseconds, on virtual ranks on the ``meta`` device (no GPU, no interpreter).

    python bench/host_cost.py [--calls 200] [--json bench/results/host_cost.json]
    python bench/host_cost.py --verify      # every bound launch checked against Triton's path

The static gate's virtual ranks (``moe_comm.testing.gate``: the GPU flavour, in-kernel waits,
one node,
DeepSeek-V3 decode sizes: 8 ranks, 128 tokens, H 7168, top-8, 256 experts, bf16) run each op
in lockstep; ``dispatch_rounds`` and ``combine_rounds`` are the normal mode with a bounded
staging of 32 slots per source (4 rounds a call; the ranks launch what ranks in processes of
their own launch, so a combine's rounds are one launch, ``kernels.combine_rounds``, and a
dispatch's five: the layout's two, the ring positions, round 0's send, which lays out what
arrived, and ``kernels.dispatch_rounds``); ``dispatch_rounds_ft`` and ``combine_rounds_ft``,
those ops of a fault-tolerant Buffer, and ``*_rounds_nvshmem``, of a Buffer whose ranks are
on two hosts (NVSHMEM puts between them; ``dispatch_fp8_rounds_nvshmem``: a send that
quantizes to FP8), launch as many. Triton believes it drives an sm_90 GPU whose compiled
kernels are stand-ins that record their launches
(``kernels.recording.compiled_stand_ins``): every launch takes Triton's whole launch path, or
the Buffer's bound one (``kernels.bound``), and ends in a launcher that does nothing. Per op
and rank:

* ``launches``: Triton kernels plus every aten op that launches a kernel on a GPU (anything but
  views, metadata and bare allocations): what a GPU's launch queue receives;
* ``triton`` and ``torch``: those launches split; ``bound``: the Triton launches made through
  a bound launch (all of them once the Buffer has made each launch once);
* ``aten``: every aten call; ``allocs``: the new tensors they return (a caching allocator's
  work on a GPU);
* ``args``: the run-time arguments of the op's Triton launches, summed (each compiled kernel's
  parameters that are neither ``tl.constexpr`` nor specialised to a constant:
  ``kernels.recording.runtime_args``): what the launcher packs on every launch;
* ``python``: calls of moe_comm's own Python functions (``sys.setprofile``; torch's are not
  counted: on meta tensors torch runs Python reference kernels a GPU runs in C++; nor are the
  stand-in driver's and kernels', which on a GPU are Triton's driver);
* ``host_us``: median microseconds per op and rank over ``--calls`` calls (lockstep over the
  ranks, divided by the ranks) on this machine's CPU, the bound launches included but not the
  driver's launch call, and with torch's meta kernels (Python references, slower than a GPU's
  C++ dispatch for ops like ``cumsum`` and ``floor_divide``); ``triton_path_us``: the same with
  every launch through Triton's own launch path (``MOE_COMM_BOUND_LAUNCHES=0``). Compare them
  between runs of this script only: they are not the eager host time on a GPU and never a GPU
  timing.

The ops above run in lockstep through the engines' phases (``moe_comm.testing.lockstep``), as
the tests drive them. ``user_path`` (printed after them) runs a user's calls instead,
``Buffer.dispatch`` then ``Buffer.combine`` on each rank in turn (their waits are in the
stand-in kernels, so no rank waits for another), with the input checks, the results and the
handle: ``python``, ``host_us``, ``launches``, and ``through_op``, the calls that went through
the custom op and its autograd Function (none: autograd records nothing of these calls, so they
run the op's body, ``moe_comm.ops.path``). No aten count there: a dispatch mode watching the
call makes it take the op, whose meta kernel is its fake. ``custom_op_host_us`` times what a
custom op of the dispatch's schema adds to a call on this CPU (the body alone, through the op,
through the op under an autograd Function).

``--verify`` drives every launch of the gate's flavours (both modes, every format, the
backward ops, fault tolerance, NVSHMEM and the proxy; the small and DeepSeek-V3 decode sizes;
then token counts that change and a misaligned input) with ``kernels.bound.VERIFY`` on: each
call takes Triton's path and is checked against the bound launch of its key (the same
specialisation, grid and arguments); it exits 1 on the first mismatch.

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

if __name__ == "__main__":  # compiled kernels (stand-ins), set before any is defined;
    os.environ["TRITON_INTERPRET"] = "0"  # imported (tests) it leaves the environment alone

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch._library.custom_ops import OPDEFS as _OPDEFS  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

import moe_comm  # noqa: E402
import moe_comm.kernels  # noqa: E402
from moe_comm.kernels import bound as bound_launches  # noqa: E402
from moe_comm.kernels.recording import compiled_stand_ins  # noqa: E402
from moe_comm.testing import gate, lockstep  # noqa: E402

CONFIG = gate.GateConfig("dsv3-decode", 8, 256, 7168, 8, 128, nvshmem=False)
# bounded staging at the same sizes: every normal-mode call in 4 rounds of 32 slots per source
ROUNDS_CONFIG = gate.GateConfig("dsv3-decode-rounds", 8, 256, 7168, 8, 128, nvshmem=False,
                                ring_slots=32)
DTYPE = torch.bfloat16
_OURS = tuple(os.path.dirname(m.__file__) + os.sep for m in (moe_comm, moe_comm.kernels))
_DRIVER = os.path.join(os.path.dirname(moe_comm.kernels.__file__), "recording.py")  # the GPU's
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
    GPU): its Triton launches (through Triton's path or a bound one) and every aten op outside
    them that launches a kernel
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
        self._bound_call = bound_launches.BoundLaunch.__call__
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

        def bound_call(launch, *values):  # a bound launch (kernels.bound) on a GPU
            counter.names.append(launch.name)
            return self._bound_call(launch, *values)

        for cls, run in zip(self._classes, self._runs):
            cls.run = wrap(run)
        bound_launches.BoundLaunch.__call__ = bound_call

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
        bound_launches.BoundLaunch.__call__ = self._bound_call


OPS = {"normal": ("dispatch", "combine"), "low_latency": ("ll_dispatch", "ll_combine")}


def user_path(calls: int = 200) -> dict:
    """``{"Buffer.dispatch": row, "Buffer.combine": row}``, each row ``{python, host_us,
    launches, through_op}`` per call and rank (module docstring)."""
    from moe_comm import ops as torch_ops

    R = CONFIG.world_size
    through_op = collections.Counter()
    functions = (torch_ops._Dispatch, torch_ops._Combine)  # (their apply: torch's, inherited)

    def counting(function):
        apply = function.apply

        def counted(*args):
            through_op[function.__name__] += 1
            return apply(*args)
        return counted

    out = {}
    with compiled_stand_ins() as launched:
        bufs = gate._buffers(CONFIG, DTYPE, False, 0, 90)
        xs, idxs, ws = gate._inputs(CONFIG, DTYPE)
        rows = gate.max_recv_rows(CONFIG)
        state = {}

        def dispatch():
            state["res"] = [buf.dispatch(x, idx, w, max_recv_rows=rows)
                            for buf, x, idx, w in zip(bufs, xs, idxs, ws)]

        def combine():
            res = state["res"]
            if "ys" not in state:  # (made once, outside what is counted)
                state["ys"] = [torch.empty(r.x.shape, dtype=DTYPE, device="meta") for r in res]
            for buf, y, r in zip(bufs, state["ys"], res):
                buf.combine(y, r.handle, r.weights)

        for function in functions:
            function.apply = counting(function)
        try:
            for op, run in (("Buffer.dispatch", dispatch), ("Buffer.combine", combine)):
                for _ in range(2):
                    run()
                del launched[:]
                through_op.clear()
                run()
                out[op] = {"launches": len(launched) / R, "python": _python_calls(run) / R,
                           "host_us": _median_us(run, calls, launched),
                           "through_op": sum(through_op.values())}
                del launched[:]
        finally:
            for function in functions:
                del function.apply
    return out


def custom_op_host_us(calls: int = 2000) -> dict:
    """What a custom op adds to a call's host time on this CPU: a probe op of
    ``moe_comm::dispatch``'s schema whose body makes its 14 small outputs, timed as the body
    alone, through the op, and through the op under an autograd Function (medians of
    ``calls``, microseconds per call): ``{"body", "op", "op_and_function"}``."""
    import moe_comm.ops  # noqa: F401  (registers moe_comm::dispatch)

    def body():
        return tuple(torch.empty(4) for _ in range(14))

    schema = str(torch.ops.moe_comm.dispatch.default._schema)
    probe = torch.library.custom_op("moe_comm_host_cost::probe", mutates_args=(),
                                    schema=schema[schema.index("("):])(
        lambda *args: body())

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            outs = probe(*args)
            ctx.mark_non_differentiable(*outs[1:])
            return outs

        @staticmethod
        def backward(ctx, *grads):
            return (None,) * 10

    x, idx, w = torch.randn(4, 4), torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 2)
    args = ("probe", x, None, idx, w, 1, 0, 0, False, 8)
    out = {}
    for name, run in (("body", body), ("op", lambda: probe(*args)),
                      ("op_and_function", lambda: Function.apply(*args))):
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times) * 1e6
    return out


def _bound_calls(bufs) -> int:
    return sum(b._bound.bound_calls for b in bufs)


def _ops(bufs):
    """op name -> a callable running it once on every rank, in the order a layer calls them."""
    xs, idxs, ws = gate._inputs(CONFIG, DTYPE)
    state = {}

    def dispatch():
        rows = gate.max_recv_rows(CONFIG)
        state["res"] = lockstep.dispatch(bufs, xs, idxs, ws, max_recv_rows=rows)

    def dispatch_fp8():  # quantized by the send
        rows = gate.max_recv_rows(CONFIG)
        state["res_fp8"] = lockstep.dispatch(bufs, xs, idxs, ws, fp8=True, max_recv_rows=rows)

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

    return {"normal": {"dispatch": dispatch, "combine": combine, "dispatch_fp8": dispatch_fp8},
            "low_latency": {"ll_dispatch": ll_dispatch, "ll_combine": ll_combine}}


def _python_calls(op) -> int:
    """Calls of moe_comm's own Python functions during ``op()``."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(_OURS) and name != _DRIVER:
            calls += 1
    sys.setprofile(profile)
    try:
        op()
    finally:
        sys.setprofile(None)
    return calls


def _median_us(op, calls: int, launched: list) -> float:
    times = []
    for _ in range(calls):
        del launched[:]  # (a record keeps the launch's tensors alive; a GPU's launch does not)
        start = time.perf_counter()
        op()
        times.append((time.perf_counter() - start) / CONFIG.world_size)
    return statistics.median(times) * 1e6


def measure(calls: int = 200) -> dict:
    """``{op: {launches, triton, torch, bound, aten, allocs, args, python, host_us,
    triton_path_us, triton_kernels, torch_ops}}`` per rank; ``dispatch_rounds`` and
    ``combine_rounds``: the normal mode with a bounded staging (``ROUNDS_CONFIG``: ``rounds``
    calls' worth of launches in one); ``dispatch_rounds_ft`` and ``combine_rounds_ft``: the
    same ops of a fault-tolerant Buffer; ``*_rounds_nvshmem``: of a Buffer whose peers on
    other hosts get NVSHMEM puts (``dispatch_fp8_rounds_nvshmem``: its dispatch quantizing to
    FP8 in the send)."""
    R = CONFIG.world_size
    out = {}
    with compiled_stand_ins() as launched:
        for mode, cfg, suffix, transport, flags, names in (
                ("normal", CONFIG, "", 0, (), OPS["normal"]),
                ("normal", ROUNDS_CONFIG, "_rounds", 0, (), OPS["normal"]),
                ("normal", ROUNDS_CONFIG, "_rounds_ft", 0, (False, True), OPS["normal"]),
                ("normal", ROUNDS_CONFIG, "_rounds_nvshmem", 1, (),
                 (*OPS["normal"], "dispatch_fp8")),
                ("low_latency", CONFIG, "", 0, (), OPS["low_latency"])):
            bufs = gate._buffers(cfg, DTYPE, mode == "low_latency", transport, 90, *flags)
            ops = _ops(bufs)[mode]
            for name in names:
                op = ops[name]
                name += suffix
                for _ in range(2):  # warm: the first calls of each staging parity fill the
                    op()  # Buffer's caches and bind its launches
                # (the records hold the launches' tensors: dropped as a GPU's launches do, so
                # that what a layer no longer holds is free again)
                del launched[:]
                bound_before = _bound_calls(bufs)
                with AtenCounter() as counter:
                    op()
                triton_launches = len(launched)
                args = sum(len(c.kernel.runtime_args) for c in launched)
                bound = _bound_calls(bufs) - bound_before
                kernels = collections.Counter(c.kernel.name for c in launched)
                del launched[:]
                python = _python_calls(op)
                host_us = _median_us(op, calls, launched)
                bound_launches.ENABLED = False
                try:
                    triton_path_us = _median_us(op, calls, launched)
                finally:
                    bound_launches.ENABLED = True
                del launched[:]
                counts = counter.calls
                out[name] = {
                    "launches": (triton_launches + counts["torch"]) / R,
                    "triton": triton_launches / R, "torch": counts["torch"] / R,
                    "bound": bound / R,
                    "aten": counts["aten"] / R, "allocs": counts["allocs"] / R,
                    "args": args / R,
                    "python": python / R, "host_us": host_us, "triton_path_us": triton_path_us,
                    "triton_kernels": {k: v / R for k, v in sorted(kernels.items())},
                    "torch_ops": {k[3:]: v / R for k, v in sorted(counts.items())
                                  if k.startswith("op:")}}
    return out


def _misaligned(x):
    """``x``'s shape and dtype at an address 2 bytes past a 16-byte boundary."""
    flat = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    return flat[1:].view(x.shape)


def verify(configs=("small", "dsv3-decode")) -> dict:
    """Every launch of the gate's drivers at ``configs`` (then changing token counts and a
    misaligned input) with ``kernels.bound.VERIFY`` on; raises ``BoundLaunchMismatch`` on the
    first difference. Returns ``{"launches": n, "verified": m, "kernels": [...]}``."""
    verified = 0
    bound_launches.VERIFY = True
    checks = bound_launches._verify
    names = set()

    def counted(bound, *args):
        nonlocal verified
        verified += 1
        names.add(bound.name)
        return checks(bound, *args)

    bound_launches._verify = counted
    try:
        with compiled_stand_ins() as launched:
            for cfg in (c for c in gate.CONFIGS if c.name in configs):
                for name, dtype, transport, low_latency, *flags in gate.gate_runs(cfg):
                    bufs = gate._buffers(cfg, dtype, low_latency, transport, 90, *flags)
                    (gate.drive_low_latency if low_latency else gate.drive_normal)(
                        bufs, cfg, dtype)
                    if not transport and not any(flags) and name == "bfloat16":
                        _drive_changing_inputs(bufs, cfg, dtype, low_latency)
            total = len(launched)
    finally:
        bound_launches.VERIFY = False
        bound_launches._verify = checks
    return {"launches": total, "verified": verified, "kernels": sorted(names)}


def _alike(a, b) -> bool:
    """Two launch arguments alike: tensors of one dtype, shape, strides and offset (fresh
    outputs differ in storage from call to call), anything else equal."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.dtype, a.shape, a.stride(), a.storage_offset()) == \
            (b.dtype, b.shape, b.stride(), b.storage_offset())
    return type(a) is type(b) and a == b


def bound_launches_match_triton() -> int:
    """Each op of both modes called twice on fresh Buffers, binding on: the first call's
    launches take Triton's path, the second's the bound one; both must reach the (stand-in)
    launcher with the same kernel handle, grid, stream and arguments (:func:`_alike`). Returns
    the launch pairs compared; raises ``BoundLaunchMismatch`` otherwise (also when
    :class:`LaunchCounter` misses a bound launch)."""
    pairs = 0
    with compiled_stand_ins() as launched:
        for mode in ("normal", "low_latency"):
            bufs = gate._buffers(CONFIG, DTYPE, mode == "low_latency", 0, 90)
            ops = _ops(bufs)[mode]
            for name in OPS[mode]:
                op = ops[name]
                del launched[:]
                bound_before = _bound_calls(bufs)
                op()
                first = list(launched)
                with LaunchCounter() as counter:  # it counts bound launches too
                    op()
                second = launched[len(first):]
                if counter.count != len(second):
                    raise bound_launches.BoundLaunchMismatch(
                        f"{name}: LaunchCounter saw {counter.count} of {len(second)} launches")
                if _bound_calls(bufs) - bound_before != len(second) or len(first) != len(second):
                    raise bound_launches.BoundLaunchMismatch(
                        f"{name}: {len(second)} launches of the second call, "
                        f"{_bound_calls(bufs) - bound_before} of them bound; {len(first)} first")
                for a, b in zip(first, second):
                    same = (a.kernel is b.kernel and a.grid == b.grid and a.stream == b.stream
                            and len(a.args) == len(b.args)
                            and all(_alike(x, y) for x, y in zip(a.args, b.args)))
                    if not same:
                        raise bound_launches.BoundLaunchMismatch(
                            f"{name}: {b.kernel.name}'s bound launch differs from Triton's")
                    pairs += 1
    return pairs


@triton.jit(do_not_specialize=["n"])
def _probe_kernel(a, b, n, scale: tl.float32, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    tl.store(b + lanes, tl.load(a + lanes, mask=lanes < n) * scale, mask=lanes < n)


def bound_call_is_tritons() -> None:
    """A small kernel launched through Triton's path (binding it), then with its varying arguments
    replaced through the bound launch: the stand-in launcher must receive exactly what Triton's
    own path gives it for the same arguments (the same objects, grid, stream and handle), and a
    call whose tensor lies at another alignment must launch nothing; made while another device
    is current, it must take Triton's path (that device's kernel); the bound launch must not
    keep the first call's varying tensor alive. Raises ``BoundLaunchMismatch`` otherwise."""
    launches = bound_launches.BoundLaunches()
    a, b, c = (torch.empty(64, device="meta") for _ in range(3))
    kwargs = dict(BLOCK=64, num_warps=1)
    with compiled_stand_ins() as launched:
        bound_launches.launch(launches, "probe", _probe_kernel, (2,), (a, b, 7, 0.5), kwargs,
                              ("a", "n"))
        if any(v is a for v in launches._bound["probe"].args):
            raise bound_launches.BoundLaunchMismatch("the bound launch keeps the first call's "
                                                     "varying tensor alive")
        if bound_launches.call_bound(launches, "probe", (_misaligned(c), 9)):
            raise bound_launches.BoundLaunchMismatch(  # Triton specialises it otherwise
                "a bound launch took a tensor at another alignment than the one it was bound to")
        if not bound_launches.call_bound(launches, "probe", (c, 9)):
            raise bound_launches.BoundLaunchMismatch("the probe kernel was not bound")
        _probe_kernel[(2,)](c, b, 9, 0.5, **kwargs)  # Triton's path, the same arguments
        stand_in = driver.active
        stand_in.get_current_device = lambda: 1  # another current device: Triton's path
        try:
            bound_launches.call_bound(launches, "probe", (c, 9))
        finally:
            del stand_in.get_current_device
    bound, triton_path, other_device = launched[1], launched[2], launched[3]
    if other_device.kernel is bound.kernel:
        raise bound_launches.BoundLaunchMismatch(
            "a bound launch made while another device was current used the bound kernel")
    if not (bound.kernel is triton_path.kernel and bound.grid == triton_path.grid
            and bound.stream == triton_path.stream and len(bound.args) == len(triton_path.args)
            and all(x is y if isinstance(x, torch.Tensor) else type(x) is type(y) and x == y
                    for x, y in zip(bound.args, triton_path.args))):
        raise bound_launches.BoundLaunchMismatch(
            f"the bound launch gave the launcher {bound}, Triton's path {triton_path}")


def _drive_changing_inputs(bufs, cfg, dtype, low_latency: bool) -> None:
    """Calls whose token count changes, and whose input lies at a misaligned address (each
    twice: the second call of a key is the one checked)."""
    xs, idxs, ws = gate._inputs(cfg, dtype)
    for tokens in (cfg.tokens, cfg.tokens // 2, 1):
        for misaligned in (False, True):
            x = [_misaligned(v[:tokens]) if misaligned else v[:tokens] for v in xs]
            idx, w = [v[:tokens] for v in idxs], [v[:tokens] for v in ws]
            for _ in range(2):
                if low_latency:
                    recvs = lockstep.low_latency_dispatch(bufs, x, idx, fp8=True)
                    ys = [torch.empty(r.x.shape, dtype=dtype, device="meta") for r in recvs]
                    lockstep.low_latency_combine(bufs, ys, idx, w, [r.handle for r in recvs])
                else:
                    rows = gate.max_recv_rows(cfg)
                    res = lockstep.dispatch(bufs, x, idx, w, max_recv_rows=rows)
                    ys = [torch.empty(r.x.shape, dtype=dtype, device="meta") for r in res]
                    lockstep.combine(bufs, ys, [r.handle for r in res], [r.weights for r in res])


def table(result: dict) -> str:
    cols = ("launches", "triton", "torch", "bound", "aten", "allocs", "args", "python",
            "host_us", "triton_path_us")
    width = max(24, *(len(op) + 1 for op in result))
    lines = [f"{'op':<{width}}" + "".join(f"{c:>10}" if len(c) < 10 else f" {c}" for c in cols)]
    for op, row in result.items():
        lines.append(f"{op:<{width}}" + "".join(
            f"{row[c]:>10.1f}" if c.endswith("_us") else f"{row[c]:>10g}" for c in cols[:-1])
            + f"{row[cols[-1]]:>15.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200, help="timed calls per op (median)")
    ap.add_argument("--json", default="bench/results/host_cost.json")
    ap.add_argument("--verify", action="store_true",
                    help="check every bound launch against Triton's path instead")
    args = ap.parse_args(argv)
    if args.calls < 1:
        ap.error("--calls must be >= 1")
    if args.verify:
        result = verify()
        bound_call_is_tritons()
        pairs = bound_launches_match_triton()
        print(f"bound launches: {result['verified']} of {result['launches']} launches checked "
              f"against Triton's path, none differs; kernels: {', '.join(result['kernels'])}; "
              f"{pairs} bound launches reached the launcher as Triton's did")
        return 0
    result = measure(args.calls)
    print(f"host cost per op and rank, GPU flavour on the meta device ({CONFIG.world_size} "
          f"virtual ranks, {CONFIG.tokens} tokens, H {CONFIG.hidden}, top-{CONFIG.topk}, "
          f"{CONFIG.num_experts} experts, bf16; low-latency dispatch FP8); host_us: this CPU, "
          f"bound launches into stand-in kernels; triton_path_us: every launch through "
          f"Triton's launch path; medians of {args.calls}")
    print(table(result))
    for op, row in result.items():
        print(f"{op}: " + ", ".join(f"{k} {v:g}" for k, v in
                                    {**row["triton_kernels"], **row["torch_ops"]}.items()))
    user = user_path(args.calls)
    print("\nthrough the Buffer's own calls, per call and rank (user_path):")
    for op, row in user.items():
        print(f"{op:<24}" + "".join(f" {k} {v:g}" if not k.endswith("_us") else f" {k} {v:.1f}"
                                    for k, v in row.items()))
    op_us = custom_op_host_us()
    print("a custom op of the dispatch's schema on this CPU, us per call: " + ", ".join(
        f"{k} {v:.1f}" for k, v in op_us.items()) + " (eager calls run the op's body)")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({**result, "user_path": user, "custom_op_us": op_us}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
