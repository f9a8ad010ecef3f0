"""Compile ahead: every kernel a Buffer's calls launch, before its first call.

A call's kernels compile when they are first launched: seconds on a GPU, while the peers of
that rank wait for it in their own kernels (time counted against their timeouts), and ranks
sharing a GPU wait longer still. ``Buffer.warmup()`` makes the first call load its kernels
instead of compiling them::

    twins = [Buffer(rank r) for r in range(R)]   # on the meta device: no memory, no peers;
                                                 # this Buffer's layout, flavour and sizes
    with kernels.recording.recording(arch) as launches:
        dispatch + combine (+ their backward ops) on the twins, K = topk, T = max_tokens
    for variant in distinct(launches): triton.compile(variant)   # into Triton's cache

The recording is the static gate's (``moe_comm.testing.gate``): the twins launch what the
Buffer would,
with the signature, constants and alignment facts Triton derives from real arguments, so each
compile lands on the cache entry the Buffer's first launch looks up. Local (no peer takes part)
and cached by Triton across processes. The csrc/ low-latency kernels (``kernel_impl="cuda"``)
are built and loaded instead. On CPU ranks the interpreter compiles nothing: a no-op.
"""
from __future__ import annotations

import time

import torch


class RingStandIn:
    """What a Buffer asks of its proxy while its launches are recorded (no ring, no thread)."""

    ring_addr, slots, peers = 0, 4096, ()

    def check(self) -> None:
        pass

    def notify(self, peers, offset: int, value: int) -> None:
        pass


def twins(buffer_class, plan, flavour, *, proxy: bool = False,
          dispatch_dtype: torch.dtype | None = None, own_process: bool = False) -> list:
    """Virtual ranks (``moe_comm.Buffer``, passed in: this module lies below it) on the meta
    device with ``plan`` (``moe_comm.plan``) and ``flavour`` (the GPU's: every wait, the
    proxy's forwarders' too, is a kernel), whose ops launch nothing but can be recorded;
    ``own_process``: they launch what ranks in processes of their own launch."""
    from .symm import create_loopback_heaps

    buffers = []
    for heap in create_loopback_heaps(plan.layout.world_size, plan.layout.nbytes, "meta"):
        buf = buffer_class.__new__(buffer_class)
        buf._setup(heap, plan, None, dispatch_dtype, kernel_impl="triton", flavour=flavour,
                   proxy=RingStandIn() if proxy else None, own_process=own_process)
        buf.backend = "twin"
        buffers.append(buf)
    return buffers


def drive(bufs, topk: int, fp8: bool, backward: bool) -> None:
    """The calls of one step on the twins ``bufs``: dispatch (sized by ``max_recv_rows``: no
    host read; the same kernels as without) and combine with weights, and with ``backward`` the
    backward of each (a cached dispatch, a combine with router-weight gradients); low-latency
    Buffers: their dispatch (``fp8``) and combine."""
    from .testing import lockstep

    b = bufs[0]
    T, H, R = b.max_tokens_per_rank, b.hidden, b.world_size

    def meta(*shape, dtype):
        return [torch.empty(shape, dtype=dtype, device="meta") for _ in bufs]

    xs, idxs = meta(T, H, dtype=b.dtype), meta(T, topk, dtype=torch.int64)
    ws = meta(T, topk, dtype=torch.float32)
    if b.layout.low_latency:
        recvs = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=fp8)
        ys = [torch.empty(r.x.shape, dtype=b.dtype, device="meta") for r in recvs]
        lockstep.low_latency_combine(bufs, ys, idxs, ws, [r.handle for r in recvs])
        return
    rows = R * T * topk
    res = lockstep.dispatch(bufs, xs, idxs, ws, fp8=fp8, max_recv_rows=rows)
    handles = [r.handle for r in res]
    ys = meta(rows, H, dtype=b.dtype)
    lockstep.combine(bufs, ys, handles, [r.weights for r in res])
    if backward:
        lockstep.dispatch_cached(bufs, xs, handles)
        lockstep.combine_with_pairs(bufs, ys, handles, meta(rows, dtype=torch.float32))


def launches(buf, topk: int, fp8: bool, backward: bool, arch: int) -> list:
    """The distinct launches (``kernels.recording.Launch``) of :func:`drive` for ``buf``, as
    compiled for ``sm_<arch>``."""
    from .kernels.recording import recording

    bufs = twins(type(buf), buf.plan, buf.flavour, proxy=buf.proxy is not None,
                 dispatch_dtype=buf.dispatch_dtype, own_process=buf.own_process)
    with recording(arch) as recorded:
        drive(bufs, topk, fp8, backward)
    return list({launch.key: launch for launch in recorded}.values())


def compile_ahead(buf, topk: int | None = None, fp8: bool | None = None,
                  backward: bool = True, arch: int | None = None) -> dict:
    """What ``Buffer.warmup`` does (see there); ``arch`` defaults to the Buffer's device's."""
    start = time.perf_counter()
    topk = buf.max_topk if topk is None else topk
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= buf.max_topk:
        raise ValueError(f"topk must be an int in [1, max_topk={buf.max_topk}], got {topk!r}")
    if fp8 is None:  # the Buffer's own choice: FP8 dispatch where it was asked for
        fp8 = buf.layout.low_latency or buf.dispatch_dtype == torch.float8_e4m3fn
    if not buf.flavour.compiled:
        return dict(variants=[], seconds=0.0)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(buf.device)
        arch = 10 * major + minor
    if buf.kernel_impl == "cuda":  # csrc/: its cubin built (or found) and loaded
        from .csrc_kernels import load_module

        load_module(buf.device)
        return dict(variants=["csrc low_latency"], seconds=time.perf_counter() - start)
    from .kernels.compiled import compile_launch

    names = []
    for launch in launches(buf, topk, bool(fp8), backward, arch):
        compile_launch(launch, arch)
        names.append(launch.name)
    return dict(variants=sorted(names), seconds=time.perf_counter() - start)
