"""Host side of the csrc/ low-latency kernels: load the cubin, check, pack arguments, launch.

``CsrcLowLatencyKernels`` offers the four launchers of ``moe_comm.kernels.low_latency`` under the
same names, positional arguments and keywords, plus what the CUDA kernels need on top:

* ``acks`` on the sends: (byte offset, parity stride) of ``ll_acks[channel]``; the send kernels
  wait there (in the kernel, bounded) until every destination consumed the parity's last call;
* ``outbox_offset`` on the sends: byte offset of ``ll_outbox`` (dispatch, ``[T_max, S]`` uint8)
  or ``ll_combine_outbox`` (combine, ``[L, R * T_max, H]`` of the dtype), the symmetric sources
  of NVSHMEM puts (touched only for peers whose ``peer_ptrs`` entry is 0);
* ``signals`` on the combine receive: the local ``ll_combine_signals`` [2, R] int64 view (the
  receive kernels wait for their signals themselves);
* ``error``: an int64[4] record (device memory, or pinned host memory reached through unified
  addressing) that a kernel whose wait timed out fills with (1, peer, expected, observed), see
  :func:`raise_if_timed_out`; ``pes``: int32 [R] NVSHMEM PE of each rank (None: PE = rank).

``block_t`` / ``block_h`` are accepted and ignored (the CUDA kernels use one warp per token or
row). Grids cover the work (``launch_grids``) and depend only on the Buffer's sizes.

The module is loaded with ``cuda.core`` (always present next to nvshmem4py) or ``cupy``
(``loader="cupy"``), both imported lazily; with ``nvshmem=True`` it is initialised for NVSHMEM
(``nvshmem.core.library_init`` / ``module_init``), which needs ``nvshmem.core.init`` first.
Without NVSHMEM peers (one GPU, NVLink only) the kernels never call into NVSHMEM and no
initialisation is needed.
"""
from __future__ import annotations

import collections
import math

import numpy as np
import torch

from . import csrc_build

THREADS = 256  # csrc/common.cuh kThreads
WARPS_PER_BLOCK = THREADS // 32
MAX_GRID = 2047  # csrc/common.cuh kMaxGrid (the ticket field's width)
MAX_TOPK = 32  # meta word = token * 32 + choice
MAX_DYNAMIC_SMEM_BYTES = 48 * 1024
DEFAULT_TIMEOUT_S = 120.0
DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3}

PTR, I32, I64 = "ptr", "i32", "i64"
# Parameters of each extern "C" kernel in csrc/low_latency.cu, in order (tests/test_csrc.py
# checks this table against the source).
SIGNATURES: dict[str, tuple[tuple[str, str], ...]] = {
    "ll_dispatch_send": (
        ("x", PTR), ("topk_idx", PTR), ("peer_ptrs", PTR), ("pes", PTR), ("state", PTR),
        ("stats", PTR), ("rows_off", I64), ("rows_parity_stride", I64), ("meta_off", I64),
        ("meta_parity_stride", I64), ("signals_off", I64), ("signals_parity_stride", I64),
        ("acks_off", I64), ("acks_parity_stride", I64), ("outbox_off", I64), ("T", I32),
        ("H", I32), ("K", I32), ("R", I32), ("L", I32), ("E", I32), ("me", I32), ("TMAX", I32),
        ("slot_bytes", I64), ("x_dtype", I32), ("fp8", I32), ("ue8m0", I32),
        ("descriptor", I32), ("timeout_ns", I64), ("err", PTR)),
    "ll_dispatch_recv": (
        ("staging", PTR), ("meta", PTR), ("signals", PTR), ("peer_ptrs", PTR), ("pes", PTR),
        ("state", PTR), ("out", PTR), ("out_scales", PTR), ("count", PTR), ("src_info", PTR),
        ("src_k", PTR), ("layout", PTR), ("recv_stats", PTR), ("recv_stats_int64", I32),
        ("acks_off", I64), ("acks_parity_stride", I64), ("H", I32), ("R", I32), ("L", I32),
        ("me", I32), ("TMAX", I32), ("slot_bytes", I64), ("row_bytes", I64),
        ("scale_row_stride", I64), ("scale_group_stride", I64), ("scale_expert_stride", I64),
        ("fp8", I32), ("ue8m0", I32), ("timeout_ns", I64), ("err", PTR),
        ("input_err", PTR)),
    "ll_combine_send": (
        ("y", PTR), ("layout", PTR), ("src_info", PTR), ("src_k", PTR), ("peer_ptrs", PTR),
        ("pes", PTR), ("state", PTR), ("stats", PTR), ("rows_off", I64),
        ("rows_parity_stride", I64), ("signals_off", I64), ("signals_parity_stride", I64),
        ("acks_off", I64), ("acks_parity_stride", I64), ("outbox_off", I64), ("H", I32),
        ("R", I32), ("L", I32), ("me", I32), ("TMAX", I32), ("KMAX", I32), ("row_bytes", I64),
        ("descriptor", I32), ("timeout_ns", I64), ("err", PTR)),
    "ll_combine_recv": (
        ("staging", PTR), ("topk_idx", PTR), ("topk_weights", PTR), ("out", PTR),
        ("signals", PTR), ("peer_ptrs", PTR), ("pes", PTR), ("state", PTR), ("acks_off", I64),
        ("acks_parity_stride", I64), ("T", I32), ("H", I32), ("K", I32), ("R", I32),
        ("me", I32), ("TMAX", I32), ("KMAX", I32), ("dtype", I32), ("timeout_ns", I64),
        ("err", PTR), ("input_err", PTR)),
}
_CASTS = {PTR: np.uint64, I32: np.int32, I64: np.int64}
_INT_RANGES = {I32: (-(2**31), 2**31 - 1), I64: (-(2**63), 2**63 - 1), PTR: (0, 2**64 - 1)}


# ll_state: 4 epochs and 4 tickets the csrc kernels share with the Triton ones, then the Triton
# waits' timed-out flag (kernels.low_latency.TIMED_OUT), which csrc/ leaves alone
STATE_WORDS = 9


def pack_args(kernel: str, **values) -> list:
    """The kernel's arguments in parameter order as fixed-width numpy scalars. A tensor passes
    its ``data_ptr()``, None a null pointer. Raises on a missing, unknown or out-of-range one."""
    params = SIGNATURES[kernel]
    names = {n for n, _ in params}
    unknown = sorted(set(values) - names)
    missing = [n for n, _ in params if n not in values]
    if unknown or missing:
        raise TypeError(f"{kernel}: unknown arguments {unknown}, missing {missing}")
    packed = []
    for name, kind in params:
        v = values[name]
        if kind == PTR:
            v = 0 if v is None else (v.data_ptr() if isinstance(v, torch.Tensor) else v)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{kernel}: {name} must be an integer ({kind}), got {v!r}")
        lo, hi = _INT_RANGES[kind]
        if not lo <= int(v) <= hi:
            raise OverflowError(f"{kernel}: {name}={int(v)} does not fit {kind}")
        packed.append(_CASTS[kind](int(v)))
    return packed


def launch_grids(*, world_size: int, num_local_experts: int, max_tokens: int
                 ) -> dict[str, int]:
    """Blocks per launch of each kernel (fixed by the Buffer's sizes: CUDA-graph safe): as many
    as the work has, up to ``MAX_GRID`` (the kernels loop past it): a warp per token of the
    send, a block per (local expert, source) of the receive and the combine send, a block per
    token of the combine receive (its warps split the row). The low-latency pair takes the
    whole GPU, as DeepEP's does (``num_sms`` is the normal mode's budget, not this mode's)."""
    items = num_local_experts * world_size  # (local expert, source) blocks
    warps = max(1, math.ceil(max_tokens / WARPS_PER_BLOCK))
    return {"ll_dispatch_send": min(warps, MAX_GRID), "ll_dispatch_recv": min(items, MAX_GRID),
            "ll_combine_send": min(items, MAX_GRID),
            "ll_combine_recv": min(max(1, max_tokens), MAX_GRID)}


def new_error_record(device: torch.device | str) -> torch.Tensor:
    """int64[4] zeros the kernels can write on timeout: pinned host memory for a CUDA device
    (readable without a device synchronisation), a plain tensor otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.zeros(4, dtype=torch.int64, pin_memory=True)
    return torch.zeros(4, dtype=torch.int64, device=device)


def raise_if_timed_out(record: torch.Tensor, *, rank: int, channel: str, timeout_s: float,
                       in_flight: bool = False) -> None:
    """Raises ``PeerTimeoutError`` if a kernel recorded a timeout; the record is left as it is.

    Word 0 reads -1 while a kernel is writing the record and 1 once it is complete, so a pinned
    record may be polled while kernels run (``in_flight=True`` treats -1 as "not yet"); otherwise
    call it after the kernels finished."""
    flag, peer, expected, observed = (int(v) for v in record.tolist())
    if flag == 0 or (flag == -1 and in_flight):
        return
    if flag != 1:
        raise RuntimeError(f"moe_comm rank {rank}: the {channel} error record is being written "
                           f"({record.tolist()}); read it after the kernel has finished")
    from .kernels.comm import PeerTimeoutError

    raise PeerTimeoutError(rank, peer, channel, expected, observed, timeout_s)


# ------------------------------------------------------------------------------ module loaders
class _StreamRef:
    """A raw CUstream handle in the ``__cuda_stream__`` protocol (cuda.core)."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class CudaCoreModule:
    """A cubin loaded with ``cuda.core`` (a CUlibrary)."""

    def __init__(self, path, device_index: int):
        from cuda.core import Device, ObjectCode

        Device(device_index).set_current()
        self.code = ObjectCode.from_cubin(str(path))
        self._kernels: dict = {}
        self._configs: dict = {}
        self._nvshmem_object = None

    def nvshmem_init(self) -> None:
        import nvshmem.core as nvshmem

        self._nvshmem_object = nvshmem.NvshmemKernelObject.from_obj(self.code)
        nvshmem.library_init(self._nvshmem_object)

    def launch(self, name: str, grid: int, block: int, shared_bytes: int, args: list,
               stream: int) -> None:
        from cuda.core import LaunchConfig, launch

        kernel = self._kernels.get(name)
        if kernel is None:
            kernel = self._kernels[name] = self.code.get_kernel(name)
        config = self._configs.get((grid, block, shared_bytes))
        if config is None:
            config = self._configs[grid, block, shared_bytes] = LaunchConfig(
                grid=grid, block=block, shmem_size=shared_bytes)
        launch(_StreamRef(stream), config, kernel, *args)


class CupyModule:
    """A cubin loaded with ``cupy.RawModule`` (a CUmodule)."""

    def __init__(self, path, device_index: int):
        import cupy

        self._cupy = cupy
        self._device_index = device_index
        with cupy.cuda.Device(device_index):
            self.module = cupy.RawModule(path=str(path))
        self._kernels: dict = {}

    def _kernel(self, name: str):
        kernel = self._kernels.get(name)
        if kernel is None:
            kernel = self._kernels[name] = self.module.get_function(name)
        return kernel

    def nvshmem_init(self) -> None:
        import nvshmem.core as nvshmem

        handle = self._kernel(next(iter(SIGNATURES))).kernel.module.ptr  # the CUmodule
        nvshmem.module_init(nvshmem.NvshmemKernelObject.from_handle(handle))

    def launch(self, name: str, grid: int, block: int, shared_bytes: int, args: list,
               stream: int) -> None:
        cupy = self._cupy
        with cupy.cuda.Device(self._device_index), cupy.cuda.ExternalStream(stream):
            self._kernel(name)((grid,), (block,), tuple(args), shared_mem=shared_bytes)


LOADERS = {"cuda.core": CudaCoreModule, "cupy": CupyModule}


_MODULES: dict = {}  # (device index, loader) -> loaded module, one per process


def load_module(device: torch.device, loader: str = "auto"):
    """Builds (or finds) the cubin for ``device``'s architecture and loads it (once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, loader)
    if key not in _MODULES:
        _MODULES[key] = _load_module(index, loader)
    return _MODULES[key]


def csrc_loads(device: torch.device) -> bool:
    """Whether the csrc/ kernels load for ``device`` (their cubin is found or built, a loader
    imports): what ``kernel_impl="auto"`` asks before it picks them."""
    try:
        load_module(device)
    except Exception:  # no cubin, no nvcc, no cupy: the Triton kernels serve
        return False
    return True


def _load_module(index: int, loader: str):
    major, minor = torch.cuda.get_device_capability(index)
    path = csrc_build.locate_cubin(major * 10 + minor)
    if loader == "auto":
        try:
            import cuda.core  # noqa: F401

            loader = "cuda.core"
        except ImportError:
            loader = "cupy"
    if loader not in LOADERS:
        raise ValueError(f"loader must be 'auto', 'cuda.core' or 'cupy', got {loader!r}")
    return LOADERS[loader](path, index)


# ------------------------------------------------------------------------------ launcher
class CsrcLowLatencyKernels:
    """The csrc/ kernels of one device, launched like ``moe_comm.kernels.low_latency``'s.

    ``timeout_s``: bound of every in-kernel wait; ``nvshmem``: initialise the module for NVSHMEM
    (some peer is reached through NVSHMEM); ``module``: an already loaded module (tests pass a
    fake with ``launch(name, grid, block, shared_bytes, args, stream)``).
    """

    def __init__(self, device: torch.device | str, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, nvshmem: bool = False,
                 loader: str = "auto", module=None):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        if module is None:
            if self.device.type != "cuda":
                raise RuntimeError(f"the csrc kernels run on CUDA devices, got {self.device}")
            module = load_module(self.device, loader)
            if nvshmem and not getattr(module, "nvshmem_ready", False):
                module.nvshmem_init()
                module.nvshmem_ready = True
        self.module = module
        self.launches: collections.Counter[str] = collections.Counter()  # launches per kernel

    # ------------------------------------------------------------------ helpers
    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)

    def _check(self, name: str, t: torch.Tensor | None, dtypes=None, numel: int | None = None,
               optional: bool = False, ndim: int | None = None) -> None:
        if t is None:
            if optional:
                return
            raise TypeError(f"{name} is required")
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device}; the csrc kernels run on {self.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if dtypes is not None and t.dtype not in dtypes:
            raise TypeError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
        if numel is not None and t.numel() != numel:
            raise ValueError(f"{name} must have {numel} elements, got {t.numel()}")
        if ndim is not None and t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")

    def _check_error(self, error: torch.Tensor | None) -> None:
        """The error record: int64[4] on the device, or in pinned host memory."""
        if error is None:
            return
        if error.dtype != torch.int64 or error.numel() != 4 or not error.is_contiguous():
            raise ValueError("error must be a contiguous int64 tensor of 4 elements "
                             "(see new_error_record)")
        if error.device != self.device and not (error.device.type == "cpu"
                                                and self.device.type == "cuda"
                                                and error.is_pinned()):
            raise ValueError(f"error is on {error.device}; use {self.device} or pinned host "
                             "memory (new_error_record)")

    def _peers(self, peer_ptrs: torch.Tensor, pes: torch.Tensor | None, rank: int) -> int:
        self._check("peer_ptrs", peer_ptrs, (torch.int64,))
        R = peer_ptrs.numel()
        self._check("pes", pes, (torch.int32,), R, optional=True)
        if not 0 <= rank < R:
            raise ValueError(f"rank {rank} is outside the {R} entries of peer_ptrs")
        return R

    def _launch(self, name: str, grid: int, shared_bytes: int, **values) -> bool:
        if shared_bytes > MAX_DYNAMIC_SMEM_BYTES:
            raise ValueError(f"{name} needs {shared_bytes} bytes of shared memory (> "
                             f"{MAX_DYNAMIC_SMEM_BYTES}); too many experts or ranks")
        args = pack_args(name, **values)
        stream = (torch.cuda.current_stream(self.device).cuda_stream
                  if self.device.type == "cuda" else 0)
        self.module.launch(name, grid, THREADS, shared_bytes, args, stream)
        self.launches[name] += 1
        return True

    def grids(self, world_size: int, num_local_experts: int, max_tokens: int) -> dict[str, int]:
        return launch_grids(world_size=world_size, num_local_experts=num_local_experts,
                            max_tokens=max_tokens)

    # ------------------------------------------------------------------ the four launchers
    def ll_dispatch_send(self, x, topk_idx, peer_ptrs, state, stats, *, offsets: dict, rank: int,
                         num_local_experts: int, num_experts: int, max_tokens: int,
                         slot_bytes: int, fp8: bool, ue8m0: bool, acks: tuple,
                         outbox_offset: int, error=None, pes=None, block_t=None,
                         block_h=None, descriptor: int = 0) -> bool:
        """``kernels.low_latency.ll_dispatch_send`` in CUDA; ``acks``: ll_acks[DISPATCH];
        ``descriptor``: the call's (``moe_comm.call_descriptor``), above each count."""
        R = self._peers(peer_ptrs, pes, rank)
        self._check("x", x, tuple(DTYPE_CODES), ndim=2)
        self._check("topk_idx", topk_idx, (torch.int64,), ndim=2)
        self._check("state", state, (torch.int64,), STATE_WORDS)
        self._check("stats", stats, (torch.int64,), 4)
        self._check_error(error)
        T, H = x.shape
        K = topk_idx.shape[1]
        L, E = num_local_experts, num_experts
        if topk_idx.shape[0] != T or K > MAX_TOPK or T > max_tokens:
            raise ValueError(f"topk_idx {tuple(topk_idx.shape)} must be [T={T}, K <= {MAX_TOPK}]"
                             f" with T <= max_tokens={max_tokens}")
        if E != L * R:
            raise ValueError(f"num_experts={E} != num_local_experts={L} x world size {R}")
        if fp8 and (H % 128 or x.dtype == torch.float64):
            raise ValueError(f"FP8 needs hidden % 128 == 0 and a 16/32-bit dtype, got H={H}, "
                             f"{x.dtype}")
        payload = H + (H // 128) * (1 if ue8m0 else 4) if fp8 else H * x.element_size()
        if payload > slot_bytes or slot_bytes % 16:
            raise ValueError(f"slot_bytes={slot_bytes} must be a multiple of 16 holding "
                             f"{payload} bytes")
        grid = self.grids(R, L, max_tokens)["ll_dispatch_send"]
        return self._launch(
            "ll_dispatch_send", grid, 4 * E, x=x, topk_idx=topk_idx, peer_ptrs=peer_ptrs,
            pes=pes, state=state, stats=stats, rows_off=offsets["rows"][0],
            rows_parity_stride=offsets["rows"][1], meta_off=offsets["meta"][0],
            meta_parity_stride=offsets["meta"][1], signals_off=offsets["signals"][0],
            signals_parity_stride=offsets["signals"][1], acks_off=acks[0],
            acks_parity_stride=acks[1], outbox_off=outbox_offset, T=T, H=H, K=K, R=R, L=L, E=E,
            me=rank, TMAX=max_tokens, slot_bytes=slot_bytes, x_dtype=DTYPE_CODES[x.dtype],
            fp8=int(fp8), ue8m0=int(fp8 and ue8m0), descriptor=descriptor,
            timeout_ns=self.timeout_ns, err=error)

    def ll_dispatch_recv(self, staging, meta, signals, peer_ptrs, state, out, out_scales, count,
                         src_info, src_k, layout, recv_stats, *, acks: tuple, rank: int,
                         scale_strides: tuple, ue8m0: bool, error=None, pes=None, block_t=None,
                         block_h=None, input_error=None) -> bool:
        """``kernels.low_latency.ll_dispatch_recv`` in CUDA: ``staging`` [P, L, R, TMAX, slot]
        (uint8 or the rows' dtype), ``out`` [L, R * TMAX, H] (float8_e4m3fn with FP8);
        ``input_error``: the record's input part (a source with another call descriptor)."""
        R = self._peers(peer_ptrs, pes, rank)
        self._check_error(error)
        self._check_error(input_error)
        self._check("staging", staging, ndim=5)
        self._check("out", out, ndim=3)
        P, L, R_staging, TMAX, slot = staging.shape
        if R_staging != R or P != 2:
            raise ValueError(f"staging {tuple(staging.shape)} must be [2, L, R={R}, TMAX, slot]")
        for name, t, dtypes in (("meta", meta, (torch.int32,)),
                                ("signals", signals, (torch.int64,)),
                                ("count", count, (torch.int32,)),
                                ("src_info", src_info, (torch.int32,)),
                                ("src_k", src_k, (torch.int32,)),
                                ("layout", layout, (torch.int32,))):
            self._check(name, t, dtypes)
        self._check("state", state, (torch.int64,), STATE_WORDS)
        self._check("recv_stats", recv_stats, (torch.int32, torch.int64), L, optional=True)
        H = out.shape[2]
        fp8 = out.dtype == torch.float8_e4m3fn
        if out.shape != (L, R * TMAX, H):
            raise ValueError(f"out {tuple(out.shape)} must be [{L}, {R * TMAX}, H]")
        if fp8 and out_scales is None:
            raise ValueError("FP8 receive needs out_scales")
        grid = self.grids(R, L, TMAX)["ll_dispatch_recv"]
        return self._launch(
            "ll_dispatch_recv", grid, 4 * R, staging=staging, meta=meta, signals=signals,
            peer_ptrs=peer_ptrs, pes=pes, state=state, out=out,
            out_scales=out_scales if fp8 else None, count=count, src_info=src_info, src_k=src_k,
            layout=layout, recv_stats=recv_stats,
            recv_stats_int64=int(recv_stats is not None and recv_stats.dtype == torch.int64),
            acks_off=acks[0], acks_parity_stride=acks[1], H=H, R=R, L=L, me=rank, TMAX=TMAX,
            slot_bytes=slot * staging.element_size(), row_bytes=H * out.element_size(),
            scale_row_stride=scale_strides[1], scale_group_stride=scale_strides[2],
            scale_expert_stride=scale_strides[0], fp8=int(fp8), ue8m0=int(fp8 and ue8m0),
            timeout_ns=self.timeout_ns, err=error, input_err=input_error)

    def ll_combine_send(self, y, layout, src_info, src_k, peer_ptrs, state, stats, *,
                        offsets: dict, rank: int, max_tokens: int, max_topk: int, acks: tuple,
                        outbox_offset: int, error=None, pes=None, block_t=None,
                        block_h=None, descriptor: int = 0) -> bool:
        """``kernels.low_latency.ll_combine_send`` in CUDA; ``acks``: ll_acks[COMBINE];
        ``descriptor``: the call's (``moe_comm.call_descriptor``), above the epoch."""
        R = self._peers(peer_ptrs, pes, rank)
        self._check_error(error)
        self._check("y", y, tuple(DTYPE_CODES), ndim=3)
        for name, t in (("layout", layout), ("src_info", src_info), ("src_k", src_k)):
            self._check(name, t, (torch.int32,))
        self._check("state", state, (torch.int64,), STATE_WORDS)
        self._check("stats", stats, (torch.int64,), 4)
        L, rows, H = y.shape
        if rows != R * max_tokens or layout.shape != (L, R, 2):
            raise ValueError(f"y {tuple(y.shape)} / layout {tuple(layout.shape)} must be "
                             f"[L, {R * max_tokens}, H] / [L, {R}, 2]")
        grid = self.grids(R, L, max_tokens)["ll_combine_send"]
        return self._launch(
            "ll_combine_send", grid, 0, y=y, layout=layout, src_info=src_info, src_k=src_k,
            peer_ptrs=peer_ptrs, pes=pes, state=state, stats=stats, rows_off=offsets["rows"][0],
            rows_parity_stride=offsets["rows"][1], signals_off=offsets["signals"][0],
            signals_parity_stride=offsets["signals"][1], acks_off=acks[0],
            acks_parity_stride=acks[1], outbox_off=outbox_offset, H=H, R=R, L=L, me=rank,
            TMAX=max_tokens, KMAX=max_topk, row_bytes=H * y.element_size(),
            descriptor=descriptor, timeout_ns=self.timeout_ns, err=error)

    def ll_combine_recv(self, staging, topk_idx, topk_weights, out, peer_ptrs, state, *,
                        acks: tuple, rank: int, signals, error=None, pes=None, block_t=None,
                        block_h=None, input_error=None) -> bool:
        """``kernels.low_latency.ll_combine_recv`` in CUDA: ``staging`` [P, TMAX, KMAX, H];
        ``signals``: the local ll_combine_signals [P, R] int64; ``input_error``: the record's
        input part (an expert rank with another call descriptor)."""
        R = self._peers(peer_ptrs, pes, rank)
        self._check_error(error)
        self._check_error(input_error)
        self._check("staging", staging, tuple(DTYPE_CODES), ndim=4)
        self._check("topk_idx", topk_idx, (torch.int64,), ndim=2)
        P, TMAX, KMAX, H = staging.shape
        self._check("topk_weights", topk_weights, (torch.float32,), topk_idx.numel(),
                    optional=True)
        self._check("out", out, (staging.dtype,))
        self._check("signals", signals, (torch.int64,), P * R)
        self._check("state", state, (torch.int64,), STATE_WORDS)
        T, K = topk_idx.shape
        if K > KMAX or T > TMAX or out.shape != (T, H):
            raise ValueError(f"topk_idx {tuple(topk_idx.shape)} / out {tuple(out.shape)} do not "
                             f"fit staging {tuple(staging.shape)}")
        grid = self.grids(R, 1, TMAX)["ll_combine_recv"]  # independent of L
        return self._launch(
            "ll_combine_recv", grid, 0, staging=staging, topk_idx=topk_idx,
            topk_weights=topk_weights, out=out, signals=signals, peer_ptrs=peer_ptrs, pes=pes,
            state=state, acks_off=acks[0], acks_parity_stride=acks[1], T=T, H=H, K=K, R=R,
            me=rank, TMAX=TMAX, KMAX=KMAX, dtype=DTYPE_CODES[staging.dtype],
            timeout_ns=self.timeout_ns, err=error, input_err=input_error)
