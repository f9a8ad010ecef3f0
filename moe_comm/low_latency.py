"""Low-latency mode (decode): fixed per-expert slots, one put per (token, expert) pair.

``LowLatencyEngine``, a component of ``Buffer`` (built with ``low_latency=True``)::

    recv, hook = buf.low_latency_dispatch(x, topk_idx, fp8=True, return_hook=True)
    hook()                                  # waits for arrival; until then no kernel runs
    y = experts(recv.x, recv.count)         # [L, R * T_max, H], rows [0, count[e]) valid
    out, hook = buf.low_latency_combine(y, topk_idx, topk_weights, recv.handle,
                                        return_hook=True)
    hook()

The send launches only put and return; the hook waits (bounded) and runs the receive launch.
Shapes depend only on the Buffer, nothing is read back to the host (no synchronisation in either
op: ``host_syncs`` stays 0), and the kernels keep their epochs in device memory
(``moe_comm.kernels.low_latency``). Two calls of a channel may be in flight (double-buffered
staging); a third send before the first hook raises. On load/store transports the combine reads
``y`` where it lies and stores each row straight into its home rank's slot: no copy of ``y`` is
made. A hook raises what the kernels recorded by then (a timeout, a bad row of ``topk_idx``):
at the call that failed on CPU ranks; on a GPU at the first hook or call after the kernel
recorded it. The CUDA kernels of csrc/ (``kernel_impl="cuda"``) do not check expert ids:
with them one small launch per op (``kernels.layout.checked_topk_idx``) hands them
``topk_idx`` with every bad row set to -1, and the dispatch records the first bad row, as the
Triton kernels do in place (no synchronisation either way; ``MOE_COMM_CHECK_INPUTS=0`` keeps
that launch: it is what keeps the CUDA kernels inside their slots).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from . import env
from ._guard import poisons_buffer_on_error
from .call_descriptor import (
    PeerInputError,
    combine_descriptor,
    low_latency_descriptor,
    refusal,
)
from .fault import reached, renormalized
from .kernels.comm import EPOCH_SHIFT, epochs_of, wait_for_epochs
from .kernels.layout import checked_topk_idx
from .kernels.low_latency import (
    TIMED_OUT,
    ll_combine_recv,
    ll_combine_send,
    ll_dispatch_recv,
    ll_dispatch_send,
)
from .kernels.quant import MXFP8, NVFP4, scale_group
from .microscale import swizzle_128x4
from .validation import (
    check_block_scaled_options,
    check_dispatch_bounds,
    check_dispatch_inputs,
    check_tensor,
    combine_is_fp8,
    nvfp4_send_global,
    scale_code,
)
from .workspace import COMBINE, DISPATCH

# the workspace regions low-latency ops read, viewed once when the Buffer is set up (those
# its layout has)
LL_REGIONS = ("ll_dispatch_rows", "ll_dispatch_meta", "ll_dispatch_signals", "ll_combine_rows",
              "ll_combine_signals", "ll_combine_outbox")

IN_FLIGHT = 2  # staging parities per channel


@dataclass(eq=False)
class LowLatencyHandle:
    """What ``low_latency_combine`` needs from a ``low_latency_dispatch`` (caller-owned).

    ``layout`` [L, R, 2] int32: (first row, rows) of each source's block in the output;
    ``src_k`` [L, R * T_max] int32: the top-k choice of each row at its home rank."""

    buffer_id: str
    serial: int
    layout: torch.Tensor
    src_info: torch.Tensor
    src_k: torch.Tensor
    num_tokens: int
    topk: int
    received: bool = False


@dataclass(eq=False)
class LowLatencyRecv:
    """Rows this rank's experts received; valid once the dispatch's hook has returned.

    ``x`` [L, R * T_max, H] (float8_e4m3fn with FP8; NVFP4: [L, R * T_max, H/2] uint8) with
    rows ``[0, count[e])`` of expert ``e`` valid, ordered by source rank then source token;
    ``x_scales`` [L, R * T_max, H/128] float32 (or packed UE8M0 int32 [L, R * T_max,
    ceil(H/512)]; MXFP8 / NVFP4: their byte scales, see ``low_latency_dispatch``) or None;
    ``x_global_scale`` (NVFP4) [L, R * T_max] float32: each row's global scale; ``count`` [L]
    int32;
    ``src_info`` [L, R * T_max] int32 = source rank * T_max + source token;
    ``source_wait_s``: seconds the hook waited for each source (measured on CPU ranks; None
    for a source that did not arrive: excluded, with ``fault_tolerant=True``)."""

    x: torch.Tensor
    x_scales: torch.Tensor | None
    count: torch.Tensor
    src_info: torch.Tensor
    handle: LowLatencyHandle
    source_wait_s: list[float] | None = field(default=None)
    x_global_scale: torch.Tensor | None = None


class _Hook:
    """Callable once; returns its call's receive. The device receives a channel's calls in the
    order they were sent (it counts them), so a hook first runs every earlier receive of its
    channel whose hook has not run (each into its own call's outputs, kept for its hook):
    hooks called in any order, or never, each give their own call's rows."""

    def __init__(self, engine, channel: int, serial: int, receive):
        self._engine, self._channel, self._receive = engine, channel, receive
        self.serial = serial  # the call's epoch on its channel
        self.done = False  # the hook was called
        self.received = False  # the receive ran (by this hook or by a later one)
        self._result = None
        engine.queue[channel].append(self)

    def __call__(self):
        if self.done:
            raise RuntimeError(f"the hook of low-latency {CHANNEL_NAMES[self._channel]} call "
                               f"{self.serial} was already called")
        self.done = True
        queue = self._engine.queue[self._channel]
        while not self.received:
            _receive_oldest(queue)
        what = f"low-latency {CHANNEL_NAMES[self._channel]}"
        self._engine._checked(what, what)
        return self._result


CHANNEL_NAMES = {DISPATCH: "dispatch", COMBINE: "combine"}


def _receive_oldest(queue: list) -> None:
    """Runs the receive of the oldest hook in ``queue`` (its hook returns the result)."""
    oldest = queue.pop(0)
    oldest.received = True
    oldest._result = oldest._receive()


def _stream_of(device: torch.device):
    """The stream this rank's kernels are queued on now (None off CUDA): outputs are reused on
    the stream that last wrote them only, as the caching allocator reuses memory. False while
    a CUDA graph is captured: those outputs are the graph's (never pooled, never reused)."""
    if device.type != "cuda":
        return None
    if torch.cuda.is_current_stream_capturing():
        return False
    return torch.cuda.current_stream(device).cuda_stream


def _dispatch_outputs(L: int, R: int, T: int, H: int, fp8: bool, ue8m0: int, col_major: bool,
                      dtype: torch.dtype, device) -> tuple:
    """A low-latency dispatch's outputs: ``(x, x_global_scale, x_scales, scale memory, scale
    strides, count, src_info, layout, src_k)`` (None where the format has none)."""
    rows = R * T
    if fp8 and ue8m0 == NVFP4:
        x = torch.empty((L, rows, H // 2), device=device, dtype=torch.uint8)
    else:
        x = torch.empty((L, rows, H), device=device,
                        dtype=torch.float8_e4m3fn if fp8 else dtype)
    glob = (torch.empty((L, rows), dtype=torch.float32, device=device)
            if fp8 and ue8m0 == NVFP4 else None)
    scales = (None, None, (0, 0, 0))
    if fp8:
        scales = _ll_scales_out(L, rows, H // scale_group(ue8m0), ue8m0, col_major, device)
    i32 = dict(dtype=torch.int32, device=device)
    return (x, glob, *scales, torch.empty(L, **i32), torch.empty((L, rows), **i32),
            torch.empty((L, R, 2), **i32), torch.empty((L, rows), **i32))


def _pooled(key, outs: tuple) -> tuple:
    """``(key, outs, refs, uses)``: a low-latency dispatch's outputs kept for its parity's next
    call, with the Python references of each tensor and its storage's use count as they are
    while only ``outs`` holds them (measured here: the caller holds the tuple alone)."""
    refs, uses = [], []
    for i in range(len(outs)):  # (as _reusable counts them)
        t = outs[i]
        refs.append(sys.getrefcount(t))
        uses.append(_uses(t))
    return key, outs, tuple(refs), tuple(uses)


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # (a torch without it: no reuse)


def _uses(t) -> int:
    """Tensors over ``t``'s memory (plus one: the storage object asked), 0 for a non-tensor."""
    if not isinstance(t, torch.Tensor) or _USE_COUNT is None:
        return 0
    return _USE_COUNT(t.untyped_storage()._cdata)


def _reusable(pooled, key):
    """The pooled outputs of a parity (``_pooled``), if ``key`` (the format and the stream)
    is theirs and nothing outside the pool refers to them any longer: no Python reference to
    any of them (the caller's recv, its handle, an unrun hook) and no other tensor over their
    memory (a view or slice the caller kept); else None. Outputs are thus never written while
    anyone can read them, and a layer that drops its dispatch's outputs before the call after
    next makes no new ones."""
    if pooled is None or pooled[0] != key or key[-1] is False or _USE_COUNT is None:
        return None
    outs, refs, uses = pooled[1], pooled[2], pooled[3]
    for i in range(len(outs)):  # (no zip: its reused tuple would hold a reference)
        t = outs[i]
        if isinstance(t, torch.Tensor) and (  # (inline: the host path counts every call)
                sys.getrefcount(t) != refs[i]
                or _USE_COUNT(t.untyped_storage()._cdata) != uses[i]):
            return None
    return outs


def _ll_scales_out(L: int, rows: int, groups: int, ue8m0: int, col_major: bool, device):
    """Scales of a low-latency receive: (public [L, rows, width], memory, (expert, row, group)
    strides in elements). MXFP8 (``ue8m0 == 2``) / NVFP4 (3): public E8M0 / e4m3 bytes
    [L, rows, groups], the bytes of packed int32 words (a view with padding bytes unless
    groups % 4 == 0)."""
    width = (groups + 3) // 4 if ue8m0 else groups
    dtype = torch.int32 if ue8m0 else torch.float32
    if ue8m0 >= MXFP8:
        memory = torch.empty((L, rows, width), dtype=dtype, device=device)
        byte_dtype = torch.float8_e8m0fnu if ue8m0 == MXFP8 else torch.float8_e4m3fn
        public = memory.view(torch.uint8)[..., :groups].view(byte_dtype)
        return public, memory, (rows * width, width, 1)
    if col_major:
        memory = torch.empty((L, width, rows), dtype=dtype, device=device)
        return memory.transpose(1, 2), memory, (width * rows, 1, rows)
    memory = torch.empty((L, rows, width), dtype=dtype, device=device)
    return memory, memory, (rows * width, width, 1)


def workspace_bytes(world_size: int, hidden: int, num_experts: int, max_tokens_per_rank: int,
                    dtype: torch.dtype = torch.bfloat16, max_topk: int | None = None) -> int:
    """Bytes the low-latency regions add to a Buffer with these arguments."""
    from .workspace import WorkspaceLayout

    max_topk = min(16, num_experts) if max_topk is None else max_topk
    args = (world_size, max_tokens_per_rank, hidden, num_experts // world_size, max_topk, dtype)
    return WorkspaceLayout(*args, low_latency=True).nbytes - WorkspaceLayout(*args).nbytes


class LowLatencyEngine:
    """The low-latency mode of one Buffer (``buf.ll_engine``; the Buffer's
    ``low_latency_dispatch``, ``low_latency_combine``, ``clean_low_latency_buffer`` and
    ``low_latency_combine_buffer`` call it): its hooks in flight, its pooled outputs, its
    device state (``ll_state``) and its launches.

    It reads the Buffer once, when the Buffer is set up: the configuration, the components it
    shares (heap, layout, channels, error record, fault policy, launch counts, bound launches)
    and four of the Buffer's checks, which it calls afterwards: ``checked`` and
    ``check_usable`` (an earlier failure or recorded error raises), ``checking_transport`` (a
    host wait sees the proxy fail) and ``mark_failed`` (a failed phase makes the Buffer
    unusable, ``moe_comm._guard``). Nothing else of the Buffer is read or written here.
    """

    _READS = ("id", "rank", "world_size", "hidden", "dtype", "device", "num_experts",
              "num_local_experts", "max_tokens_per_rank", "max_topk", "num_sms", "timeout_s",
              "kernel_impl", "flavour", "fault_tolerant", "heap", "layout", "channels",
              "errors", "fault", "launches")

    def __init__(self, buffer, *, stats: torch.Tensor, bound, kernel_impl_auto: bool,
                 checked, check_usable, checking_transport, mark_failed, refusal_inputs):
        for name in self._READS:
            setattr(self, name, getattr(buffer, name))
        self.kernel_impl_auto = kernel_impl_auto
        self._stats, self._bound = stats, bound
        self._checked, self._check_usable = checked, check_usable
        self._checking_transport, self._mark_failed = checking_transport, mark_failed
        self._refusal_inputs = refusal_inputs
        self._offsets: dict = {}  # launch offsets per channel, made once
        self._csrc_kernels = None
        self.queue = ([], [])  # hooks of each channel whose receive has not run, in order
        self.pending_ops = {}  # the same through moe_comm.ll_ops: (channel, serial) -> entry
        self._outputs = [None, None]  # per parity: a dispatch's outputs to reuse, see there
        layout, heap = buffer.layout, buffer.heap
        self.state = None  # epochs, acknowledgements and the kernels' timed-out flag
        if layout.low_latency:
            self.state = layout.view(heap, "ll_state")
            for name in LL_REGIONS:
                if name in layout.regions:  # (the combine outboxes: across nodes only)
                    self.channels.region(name)
        if layout.low_latency and layout.proxy:  # the proxy copies pair meta words from here
            T, K = layout.max_tokens, layout.max_topk
            table = (torch.arange(T, device=heap.device)[:, None] * 32
                     + torch.arange(K, device=heap.device)[None, :])
            layout.view(heap, "ll_meta_table").copy_(table.to(torch.int32))

    def resync(self, agreed: list[int]) -> None:
        """``clean_mask``'s agreed epochs (``agreed[2:]``, per channel): the host mirrors, the
        device state and the acknowledgements, as if every destination consumed every call so
        far; the kernels' timed-out flag cleared."""
        self.channels.ll_epochs[:] = agreed[2:]
        acks = self.channels.region("ll_acks")
        for channel, first in ((DISPATCH, 0), (COMBINE, 2)):
            self.state[first:first + 2] = agreed[2 + channel]
            acks[channel].fill_(agreed[2 + channel])
        self.state[TIMED_OUT] = 0

    def clear_timed_out(self) -> None:
        """The low-latency kernels' device flag of a timeout, cleared (a rank taken back)."""
        if self.state is not None:
            self.state[TIMED_OUT] = 0

    def _impl(self, csrc_can: bool) -> str:
        """The kernels of one low-latency call: the Buffer's, but where csrc/ was chosen
        automatically (``kernel_impl="auto"``) and cannot do the call (MXFP8, NVFP4, an FP8
        combine), Triton's (the two write the same slots and signals, call by call)."""
        if self.kernel_impl == "cuda" and not csrc_can and self.kernel_impl_auto:
            return "triton"
        return self.kernel_impl

    def _csrc(self):
        """The csrc/ kernels for this Buffer's device (``kernel_impl="cuda"``), loaded once."""
        if self._csrc_kernels is None:
            from .csrc_kernels import CsrcLowLatencyKernels

            self._csrc_kernels = CsrcLowLatencyKernels(
                self.device, timeout_s=self.timeout_s,
                nvshmem=self.flavour.transport == 1)
        return self._csrc_kernels

    def _outbox_offset(self, name: str) -> int:
        return self.layout[name].offset if self.layout.ll_outboxes else 0

    def _require(self) -> None:
        if not self.layout.low_latency:
            raise RuntimeError("this Buffer has no low-latency workspace; build it with "
                               "Buffer(..., low_latency=True)")

    def _region_offsets(self, name: str) -> tuple[int, int]:
        return self.layout[name].offset, self.layout.parity_stride(name)

    def _acks(self, channel: int) -> tuple[int, int]:
        """(byte offset, parity stride) of ``ll_acks[channel]`` (computed once per channel)."""
        acks = self._offsets.get(("ll_acks", channel))
        if acks is None:
            lay = self.layout
            first = lay.offset("ll_acks", channel, 0)
            acks = self._offsets[("ll_acks", channel)] = (
                first, lay.offset("ll_acks", channel, 1) - first)
        return acks

    def _check_in_flight(self, channel: int, what: str) -> None:
        """A send finds a staging parity free: with ``IN_FLIGHT`` calls of the channel whose
        hooks have not run, the oldest one's hook was dropped (or is late): its receive runs now
        (into its own outputs, which its hook still returns) and the call raises naming it, so
        the parity is clean and the next call is right."""
        queue = self.queue[channel]
        if len(queue) < IN_FLIGHT:
            return
        oldest = queue[0]
        serials = [h.serial for h in queue]
        _receive_oldest(queue)
        self._check_usable(f"low-latency {what}")
        raise RuntimeError(f"{IN_FLIGHT} low-latency {what} calls ({serials}) were waiting for "
                           f"their hooks on rank {self.rank}: a hook was dropped or called too "
                           f"late. Call {oldest.serial} has now been received (its hook returns "
                           "its rows) and this call was not sent; call each hook before the "
                           f"send after next, or clean_low_latency_buffer() on every rank")

    def clean(self) -> None:
        """Runs every low-latency receive whose hook has not run, oldest first (each into its
        own call's outputs, which its hook still returns), so that no call is left half done;
        call it on every rank (each receive waits for its peers' sends of that call). Equivalent
        to calling every outstanding hook in order and dropping the results."""
        self._require()
        for queue in self.queue:
            while queue:
                _receive_oldest(queue)

    def _begin(self, channel: int, what: str) -> int:
        """Epoch of a new send; waits until every destination consumed this parity's last call."""
        if self.fault_tolerant:
            self.fault.check_self()
        self.channels.ll_epochs[channel] += 1
        epoch = self.channels.ll_epochs[channel]
        if not self.flavour.device_wait:  # GPUs wait in the send kernel itself
            acks = self.channels.region("ll_acks")[channel, epoch % 2].numpy()
            if self.fault_tolerant:
                self.fault.wait(acks.tolist, epoch - IN_FLIGHT,
                                f"low-latency {what} (staging reuse)")
                return epoch
            wait_for_epochs(self._checking_transport(acks.tolist), epoch - IN_FLIGHT,
                            timeout_s=self.timeout_s, rank=self.rank,
                            channel=f"low-latency {what} (staging reuse)")
        return epoch

    def _send_offsets(self, prefix: str, names: tuple, channel: int) -> dict:
        """The byte offsets a low-latency send launches with (computed once per channel)."""
        offsets = self._offsets.get(("ll", channel))
        if offsets is None:
            offsets = {n: self._region_offsets(f"{prefix}{n}") for n in names}
            offsets["acks"] = self._acks(channel)
            outbox = "ll_outbox" if channel == DISPATCH else "ll_combine_outbox"
            if self.layout.ll_outboxes:
                offsets["outbox"] = self._region_offsets(outbox)
            if self.layout.proxy and channel == DISPATCH:
                offsets["meta_table"] = self.layout["ll_meta_table"].offset
            self._offsets[("ll", channel)] = offsets
        return offsets

    def combine_buffer(self) -> torch.Tensor:
        """Where the next ``low_latency_combine`` reads ``y`` from without a copy:
        [L, R * T_max, H] of the Buffer's dtype. Across nodes this is symmetric memory that
        NVSHMEM puts or the proxy read directly; on load/store transports the combine reads any
        ``y`` in place, so this is an ordinary tensor there."""
        self._require()
        shape = (self.num_local_experts, self.world_size * self.max_tokens_per_rank,
                 self.hidden)
        if self.layout.ll_outboxes:
            parity = (self.channels.ll_epochs[COMBINE] + 1) % 2
            return self.channels.region("ll_combine_outbox")[parity]
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _csrc_ids(self, topk_idx: torch.Tensor, record: bool) -> torch.Tensor:
        """``topk_idx`` as the csrc/ kernels may read it: bad rows -1 (one launch; with
        ``record`` the first is recorded), input checks on or off (the csrc/ kernels index
        their slots by the ids unchecked)."""
        self.launches["checked_topk_idx"] += 1
        return checked_topk_idx(topk_idx, self.num_experts, self.flavour, record)

    # ----------------------------------------------------------------- dispatch
    def dispatch(self, x, topk_idx: torch.Tensor, *, fp8: bool | None = None,
                 ue8m0: bool = False, col_major_scales: bool = False,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                 return_hook: bool = False, dispatch_dtype: str | None = None,
                 global_scale: torch.Tensor | None = None, scale_layout: str = "row_major"):
        """Puts every (token, expert) pair into the expert's slot; returns ``(recv, hook)``.

        ``x`` [T, H] of the Buffer's dtype (T <= max_tokens_per_rank); ``topk_idx`` [T, K]
        int64 in ``[0, E)`` or -1. The rows travel in the Buffer's dtype unless a format is
        asked for (``fp8=None``: quantize exactly when ``ue8m0``, ``col_major_scales`` or
        ``dispatch_dtype`` is given). ``fp8=True`` quantizes in the send kernel to FP8 per 128
        channels (H % 128 == 0), with ``ue8m0`` / ``col_major_scales`` as in ``Buffer.dispatch``
        (``moe_comm.deep_ep`` keeps DeepEP's ``use_fp8=True`` default); ``dispatch_dtype="mxfp8"``:
        MXFP8 (E8M0 per 32 channels, H % 32 == 0; ``recv.x_scales`` float8_e8m0fnu
        [L, R * T_max, H/32]); ``"nvfp4"``: NVFP4 as in ``Buffer.dispatch`` (``global_scale``
        [1] float32 or computed on the device; ``recv.x`` [L, R * T_max, H/2] uint8,
        ``recv.x_scales`` float8_e4m3fn [L, R * T_max, H/16], ``recv.x_global_scale``
        [L, R * T_max]); both on the Triton kernels only. ``scale_layout="swizzled"``: each
        expert's block scales in the 128x4 layout (``recv.x_scales`` [L, bytes]).
        ``cumulative_local_expert_recv_stats`` [L] int32/int64: the receive adds each local
        expert's rows to it. With ``return_hook`` the call returns after the send launch and
        ``hook()`` receives; otherwise the call receives and ``hook`` is None. The outputs are
        those of this parity's call before last where nothing refers to them any longer (no
        reference, no view of their memory: ``_reusable``), else new ones: what the caller
        holds is never written again.
        """
        self._checked("an earlier call")
        if self.state is None:  # (no call where it passes: the host path counts calls)
            self._require()
        self._check_in_flight(DISPATCH, "dispatch")
        try:  # (inline: the host path counts every Python call)
            if env.check_inputs():
                check_dispatch_inputs(x, topk_idx, None, 1, hidden=self.hidden,
                                      max_tokens=self.max_tokens_per_rank,
                                      max_topk=self.max_topk, dtype=self.dtype,
                                      device=self.device)
            else:
                check_dispatch_bounds(x, topk_idx, None, hidden=self.hidden,
                                      max_tokens=self.max_tokens_per_rank,
                                      max_topk=self.max_topk, itemsize=self.dtype.itemsize)
            if fp8 is None:
                fp8 = bool(dispatch_dtype is not None or ue8m0 or col_major_scales)
            ue8m0 = scale_code(dispatch_dtype, ue8m0, scale_layout)
            group = scale_group(ue8m0)
            name = {MXFP8: "MXFP8", NVFP4: "NVFP4"}.get(ue8m0, "FP8")
            impl = self._impl(ue8m0 < MXFP8)
            if ue8m0 >= MXFP8:
                check_block_scaled_options(ue8m0, fp8, col_major_scales)
                if impl == "cuda":
                    raise ValueError(f"kernel_impl='cuda' sends FP8 per 128 channels only; "
                                     f"{name} runs on the Triton kernels")
            if fp8 and (self.hidden % group or self.dtype == torch.float64):
                raise ValueError(f"{name} dispatch needs hidden % {group} == 0 and a 16/32-bit "
                                 f"dtype, got hidden={self.hidden}, dtype={self.dtype}")
            glob = nvfp4_send_global(x, global_scale, ue8m0, self.device)
            if not fp8 and (ue8m0 or col_major_scales):
                raise ValueError("ue8m0 and col_major_scales shape FP8 scales; pass fp8=True")
            stats = cumulative_local_expert_recv_stats
            if stats is not None:
                if not isinstance(stats, torch.Tensor) or stats.dtype not in (torch.int32,
                                                                             torch.int64):
                    raise TypeError("cumulative_local_expert_recv_stats must be an int32 or "
                                    "int64 tensor")
                if stats.shape != (self.num_local_experts,) or stats.device != self.device:
                    raise ValueError(f"cumulative_local_expert_recv_stats must have shape "
                                     f"[{self.num_local_experts}] on {self.device}")
        except (TypeError, ValueError) as error:
            self.refuse_dispatch(error)
            raise
        recv, hook = self._dispatch_send(x.contiguous(), topk_idx.contiguous(), fp8, ue8m0,
                                            col_major_scales, stats, glob,
                                            scale_layout == "swizzled", impl)
        if return_hook:
            return recv, hook
        hook()
        return recv, None

    def refuse_dispatch(self, error: BaseException) -> None:
        """This rank's low-latency dispatch input is bad (``error``, which the caller raises
        next): it still sends, no pairs and a refusal for its descriptor in every expert's
        signal word (``moe_comm.call_descriptor``), and receives, so every peer's hook raises
        PeerInputError naming this rank instead of waiting out the timeout. Equivalent to::

            self.dispatch(x[:0], topk_idx[:0])   # the signals say 'refused'
        """
        empty = self._refusal_inputs()
        if empty is None:
            return
        _, hook = self._dispatch_send(*empty, False, 0, False, None, refusal=refusal(error))
        try:  # this rank's own record of the call (every peer differs from a refusal)
            hook()
        except PeerInputError:
            pass

    @poisons_buffer_on_error("low-latency dispatch")
    def _dispatch_send(self, x, topk_idx, fp8, ue8m0, col_major, stats, global_scale=None,
                          swizzle=False, impl="triton", refusal: int = 0):
        """The send of a low-latency dispatch; returns ``(recv, hook)``. Every expert's signal
        word carries the call's descriptor, or ``refusal`` (``moe_comm.call_descriptor``)."""
        epoch = self._begin(DISPATCH, "dispatch")
        descriptor = refusal or low_latency_descriptor(fp8, ue8m0)
        L, R, T, H, dev = (self.num_local_experts, self.world_size, self.max_tokens_per_rank,
                           self.hidden, self.device)
        nvfp4 = fp8 and ue8m0 == NVFP4
        stream = _stream_of(dev)
        key = (fp8, ue8m0, col_major, stream)
        outs = _reusable(self._outputs[epoch % 2], key)
        if outs is None:  # (the parity's last outputs are still held by someone: new ones)
            outs = _dispatch_outputs(L, R, T, H, fp8, ue8m0, col_major, self.dtype, dev)
            self._outputs[epoch % 2] = None if stream is False else _pooled(key, outs)
        recv_x, out_global, scales, scale_memory, scale_strides, count, src_info, layout, \
            src_k = outs
        if nvfp4:
            out_global.zero_()
        if ue8m0 and fp8:
            scale_memory.zero_()  # padding bytes of the packed words
        handle = LowLatencyHandle(self.id, epoch, layout, src_info, src_k, x.shape[0],
                                  topk_idx.shape[1])
        offsets = self._send_offsets("ll_dispatch_", ("rows", "meta", "signals"), DISPATCH)
        common = dict(rank=self.rank, num_local_experts=L, num_experts=self.num_experts,
                      max_tokens=T, slot_bytes=self.layout.ll_slot_bytes, fp8=fp8, ue8m0=ue8m0)
        if impl == "cuda":
            self.launches["ll_dispatch_send"] += self._csrc().ll_dispatch_send(
                x, self._csrc_ids(topk_idx, True), self.heap.peer_ptrs, self.state, self._stats,
                offsets=offsets, acks=offsets["acks"], error=self.errors.timeout_part,
                outbox_offset=self._outbox_offset("ll_outbox"), descriptor=descriptor, **common)
        else:
            self.launches["ll_dispatch_send"] += ll_dispatch_send(
                x, topk_idx, self.heap.peer_ptrs, self.state, self._stats, offsets=offsets,
                num_sms=self.num_sms, flavour=self.flavour, max_topk=self.max_topk,
                global_scale=global_scale, bound=self._bound, descriptor=descriptor, **common)
        recv = LowLatencyRecv(recv_x, scales, count, src_info, handle, x_global_scale=out_global)

        def receive():
            self._dispatch_recv(epoch, recv, scale_memory, scale_strides, ue8m0, stats, impl)
            if swizzle:
                recv.x_scales = torch.stack([swizzle_128x4(s) for s in recv.x_scales])

        return recv, _Hook(self, DISPATCH, epoch, receive)

    @poisons_buffer_on_error("low-latency dispatch")
    def _dispatch_recv(self, epoch, recv, scale_memory, scale_strides, ue8m0, stats,
                          impl="triton"):
        if not self.flavour.device_wait:  # GPUs wait in the receive kernel itself
            words = self.channels.region("ll_dispatch_signals")[epoch % 2].numpy()

            def observed():  # [L, R] words: the oldest epoch each source published
                return (words >> 32).min(axis=0).tolist()

            if self.fault_tolerant:  # a source that stays silent is excluded (counts 0)
                recv.source_wait_s = self.fault.wait(observed, epoch, "low-latency dispatch")
            else:
                recv.source_wait_s = wait_for_epochs(
                    self._checking_transport(observed), epoch, timeout_s=self.timeout_s,
                    rank=self.rank, channel="low-latency dispatch")
        regions = self.channels.regions  # (made at set-up: LL_REGIONS)
        staging = regions["ll_dispatch_rows"]
        if scale_memory is None:  # rows as they are
            staging = staging.view(self.dtype)
        args = (staging, regions["ll_dispatch_meta"],
                regions["ll_dispatch_signals"], self.heap.peer_ptrs,
                self.state, recv.x, scale_memory, recv.count, recv.src_info,
                recv.handle.src_k, recv.handle.layout, stats)
        common = dict(acks=self._acks(DISPATCH), rank=self.rank, scale_strides=scale_strides,
                      ue8m0=ue8m0)
        if impl == "cuda":
            self.launches["ll_dispatch_recv"] += self._csrc().ll_dispatch_recv(
                *args, error=self.errors.timeout_part, input_error=self.errors.input_part,
                **common)
        else:
            self.launches["ll_dispatch_recv"] += ll_dispatch_recv(
                *args, flavour=self.flavour, out_global=recv.x_global_scale,
                num_sms=self.num_sms, bound=self._bound, **common)
        recv.handle.received = True

    # ----------------------------------------------------------------- combine
    def combine(self, y: torch.Tensor, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor | None, handle: LowLatencyHandle, *,
                return_hook: bool = False, renormalize: bool = False,
                combine_dtype: str | torch.dtype | None = None, out: torch.Tensor | None = None):
        """Sends each expert row home and sums ``w[t, k] * row`` there; returns ``(out, hook)``.

        ``y`` [L, R * T_max, H] of the Buffer's dtype, rows as in the dispatch's ``recv.x``;
        ``topk_idx``, ``topk_weights`` [T, K]: the dispatch's routing on this rank. Equivalent
        to ``out[t] = sum_k topk_weights[t, k] * y_row(t, k)`` in fp32, rounded to the dtype.
        Fault tolerance: rows of excluded expert ranks are left out; ``renormalize`` as in
        ``Buffer.combine`` (needs ``topk_weights``). ``combine_dtype="fp8"``: each row travels
        quantized per 128 channels and is dequantized at home before it is weighted
        (``out[t] = sum_k w[t, k] * dequantize_fp8(*quantize_fp8(y_row(t, k)))``; error bound
        as in ``Buffer.combine``), Triton kernels only. ``out`` [T, H] contiguous, of the
        Buffer's dtype and device: the sums are written there (and ``out`` is returned) instead
        of into a new tensor; it must not be read or written until the hook has run.
        """
        self._checked("an earlier call")
        if self.state is None:  # (no call where it passes: the host path counts calls)
            self._require()
        self._check_in_flight(COMBINE, "combine")
        try:  # (inline: the host path counts every Python call)
            if not isinstance(handle, LowLatencyHandle):
                raise TypeError(f"handle must be recv.handle of a low_latency_dispatch, got "
                                f"{type(handle).__name__}")
            if handle.buffer_id != self.id:
                raise ValueError("handle comes from another Buffer")
            if not handle.received:
                raise RuntimeError("the dispatch of this handle has not been received; call "
                                   "its hook first")
            fp8 = combine_is_fp8(combine_dtype, dtype=self.dtype, hidden=self.hidden)
            impl = self._impl(not fp8)
            if fp8 and impl == "cuda":
                raise ValueError("kernel_impl='cuda' combines in the Buffer's dtype only; an "
                                 "FP8 combine runs on the Triton kernels")
            if renormalize:
                self.fault.require("renormalize=True")
                if topk_weights is None:
                    raise ValueError("renormalize=True needs topk_weights")
            L, rows = self.num_local_experts, self.world_size * self.max_tokens_per_rank
            check_tensor("y", y, dtype=self.dtype, ndim=3, device=self.device)
            if y.shape != (L, rows, self.hidden):
                raise ValueError(f"y has shape {tuple(y.shape)}; expected [{L}, {rows}, "
                                 f"{self.hidden}] like recv.x")
            check_tensor("topk_idx", topk_idx, dtype=torch.int64, ndim=2, device=self.device)
            if topk_idx.shape != (handle.num_tokens, handle.topk):
                raise ValueError(f"topk_idx has shape {tuple(topk_idx.shape)}; the dispatch "
                                 f"had [{handle.num_tokens}, {handle.topk}]")
            if topk_weights is not None:
                check_tensor("topk_weights", topk_weights, dtype=torch.float32, ndim=2,
                             device=self.device)
                if topk_weights.shape != topk_idx.shape:
                    raise ValueError("topk_weights and topk_idx shapes differ")
                topk_weights = topk_weights.contiguous()
            if out is not None:
                check_tensor("out", out, dtype=self.dtype, ndim=2, device=self.device)
                if out.shape != (handle.num_tokens, self.hidden) or not out.is_contiguous():
                    raise ValueError(f"out must be a contiguous [{handle.num_tokens}, "
                                     f"{self.hidden}] tensor, got shape {tuple(out.shape)}"
                                     + ("" if out.is_contiguous() else " (not contiguous)"))
        except (TypeError, ValueError, RuntimeError) as error:
            self.refuse_combine(error)
            raise
        out, hook = self._combine_send(y.contiguous(), topk_idx.contiguous(), topk_weights,
                                          handle, renormalize, fp8, impl, out=out)
        if return_hook:
            return out, hook
        hook()
        return out, None

    def _combine_outbox_offset(self, y: torch.Tensor) -> int | None:
        """Where ``y`` lies in this rank's segment if it is one of the combine outboxes (the
        NVSHMEM puts then read it in place: its own offset, whatever the call's parity, so a
        CUDA graph that captured the call replays it right), else None."""
        if not self.layout.ll_outboxes:
            return None
        outboxes = self.channels.regions["ll_combine_outbox"]  # (made at set-up: LL_REGIONS)
        for p in range(outboxes.shape[0]):
            if y.data_ptr() == outboxes[p].data_ptr():
                return y.data_ptr() - self.heap.local.data_ptr()
        return None

    def refuse_combine(self, error: BaseException) -> None:
        """This rank's low-latency combine input is bad (``error``, which the caller raises
        next): it still sends, no rows and a refusal for its descriptor in the word it
        publishes to every rank (``moe_comm.call_descriptor``), and receives, so every peer's
        hook raises PeerInputError naming this rank instead of waiting out the timeout."""
        empty = self._refusal_inputs()
        if empty is None:
            return
        L, R, T = self.num_local_experts, self.world_size, self.max_tokens_per_rank
        ints = dict(dtype=torch.int32, device=self.device)
        nowhere = LowLatencyHandle(self.id, 0, torch.zeros((L, R, 2), **ints),
                                   torch.empty((L, R * T), **ints),
                                   torch.empty((L, R * T), **ints), 0, 1)
        y = torch.empty((L, R * T, self.hidden), dtype=self.dtype, device=self.device)
        impl = self._impl(True)
        _, hook = self._combine_send(y, empty[1], None, nowhere, impl=impl,
                                        refusal=refusal(error, combine=True))
        try:  # this rank's own record of the call (every peer differs from a refusal)
            hook()
        except PeerInputError:
            pass

    @poisons_buffer_on_error("low-latency combine")
    def _combine_send(self, y, topk_idx, topk_weights, handle, renormalize=False, fp8=False,
                         impl="triton", refusal: int = 0, out=None):
        """The send of a low-latency combine; returns ``(out, hook)`` (``out``: the caller's,
        or a new tensor). The word it publishes to every rank carries the call's descriptor, or
        ``refusal`` (``moe_comm.call_descriptor``; a refusal sends no rows)."""
        if fp8 and self._combine_outbox_offset(y) is not None:
            y = y.clone()  # FP8 rows are quantized into the outbox that y lies in
        epoch = self._begin(COMBINE, "combine")
        descriptor = refusal or combine_descriptor(fp8)
        if out is None:
            out = torch.empty((topk_idx.shape[0], self.hidden), dtype=self.dtype,
                              device=self.device)
        args = (y, handle.layout, handle.src_info, handle.src_k, self.heap.peer_ptrs,
                self.state, self._stats)
        offsets = self._send_offsets("ll_combine_", ("rows", "signals"), COMBINE)
        common = dict(offsets=offsets, rank=self.rank, max_tokens=self.max_tokens_per_rank,
                      max_topk=self.max_topk, descriptor=descriptor)
        if impl == "cuda":
            self.launches["ll_combine_send"] += self._csrc().ll_combine_send(
                *args, acks=offsets["acks"], error=self.errors.timeout_part,
                outbox_offset=self._outbox_offset("ll_combine_outbox"), **common)
        else:
            self.launches["ll_combine_send"] += ll_combine_send(
                *args, flavour=self.flavour, y_box_offset=self._combine_outbox_offset(y),
                fp8=fp8, num_sms=self.num_sms, bound=self._bound, **common)

        def receive():
            self._combine_recv(epoch, topk_idx, topk_weights, out, fp8, impl)
            if renormalize:  # the expert ranks whose rows of this call arrived
                signals = self.channels.region("ll_combine_signals")[epoch % 2]
                arrived = reached(topk_idx, (signals >> EPOCH_SHIFT.value) >= epoch,
                                  self.num_local_experts, self.num_experts)
                out.copy_(renormalized(out, topk_idx, topk_weights, arrived))
            return out

        return out, _Hook(self, COMBINE, epoch, receive)

    @poisons_buffer_on_error("low-latency combine")
    def _combine_recv(self, epoch, topk_idx, topk_weights, out, fp8=False, impl="triton"):
        if not self.flavour.device_wait:  # GPUs wait in the receive kernel itself
            # [R] words: each expert rank's epoch (its descriptor below)
            observed = epochs_of(self.channels.region("ll_combine_signals")[epoch % 2].numpy(),
                                 EPOCH_SHIFT.value)
            if self.fault_tolerant:  # an expert rank that stays silent is excluded
                self.fault.wait(observed, epoch, "low-latency combine")
            else:
                wait_for_epochs(self._checking_transport(observed), epoch,
                                timeout_s=self.timeout_s, rank=self.rank,
                                channel="low-latency combine")
        staging = self.channels.regions["ll_combine_rows"]  # (made at set-up: LL_REGIONS)
        signals = self.channels.regions["ll_combine_signals"]
        common = dict(acks=self._acks(COMBINE), rank=self.rank)
        if impl == "cuda":
            self.launches["ll_combine_recv"] += self._csrc().ll_combine_recv(
                staging, self._csrc_ids(topk_idx, False), topk_weights, out, self.heap.peer_ptrs,
                self.state, signals=signals, error=self.errors.timeout_part,
                input_error=self.errors.input_part, **common)
        else:
            self.launches["ll_combine_recv"] += ll_combine_recv(
                staging, topk_idx, topk_weights, out, self.heap.peer_ptrs, self.state,
                signals, num_experts=self.num_experts, flavour=self.flavour, fp8=fp8,
                num_sms=self.num_sms, bound=self._bound, **common)
