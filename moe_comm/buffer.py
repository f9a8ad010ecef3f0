"""``Buffer``: owns one rank's symmetric workspace and runs dispatch and combine on it.

Every op is two phases, *send* (local layout, puts into peers, publish an epoch) and *receive*
(bounded wait for every peer's epoch, then local work). ``dispatch``/``combine`` run both; the
loopback driver (``moe_comm.testing.lockstep``) runs each phase for all virtual ranks in turn.
The phases and their waits belong to the Buffer's two engines, components it sets up and calls:
``NormalEngine`` (``buf.normal_engine``, ``moe_comm.normal_mode``) and ``LowLatencyEngine``
(``buf.ll_engine``, ``moe_comm.low_latency``); the fault policy is a third (``buf.fault``).

Why two parities of staging are enough (no "consumed" signal): every rank publishes to every
rank on every call, and every receive waits for all of them. Rank A writes call ``n + 2`` of a
channel into rank B's parity ``n % 2`` only after A's receive of call ``n + 1`` returned, which
needed B's send of ``n + 1``, which B issues only after its receive of call ``n`` (the reader of
that parity) finished. Calls of one channel are serial on a rank, so the reader is always done.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import os
import secrets
import socket

import numpy as np
import torch
import torch.distributed as dist

from . import _registry, env
from .call_descriptor import PeerInputError, refusal, refusal_inputs
from .channels import CHANNEL_NAMES, Channels
from .error_record import INPUT_RECORD, TIMEOUT_RECORD, ErrorRecord
from .fault import FaultPolicy, RankExcludedError, reached, renormalized
from .kernels import emulated_puts
from .kernels.bound import BoundLaunches
from .kernels.comm import Flavour, PeerTimeoutError
from .kernels.nvshmem import device_bitcode, install_module_init_hook
from .low_latency import LowLatencyEngine
from .low_latency import workspace_bytes as ll_workspace_bytes
from .microscale import swizzle_128x4
from .nodes import NEVER, Nodes, internode_peers, never_signalled, relay_of, signal_labels
from .normal_mode import NormalEngine
from .ops import combine_autograd, dispatch_autograd, wrap_dispatch_outputs
from .plan import BufferPlan, check_config, resolve
from .symm import SymmetricHeap, create_loopback_heaps
from .symm.select import choose_backend, create_heap, default_device
from .transport import NixlProxy, choose_transport
from .transport.select import nixl_backend as nixl_backend_name
from .types import DispatchHandle, DispatchResult
from .validation import (
    check_combine_bounds,
    check_combine_inputs,
    check_dispatch_bounds,
    check_dispatch_inputs,
    combine_is_fp8,
    dispatch_signature,
    resolve_fp8,
    scale_code,
    sent_rows_check,
)

# Buffer ids: strings unique across processes and runs, not only within one process. The
# custom ops take the id, and their fake implementations take their shapes from its Buffer
# (``moe_comm.ops``); under torch.compile a string is a constant of the graph's code (an int
# would become a symbolic input), so a compiled graph kept on disk (inductor's cache) belongs
# to that Buffer alone, never to another process's Buffer of other sizes.
_ids = (f"{secrets.token_hex(6)}-{n}" for n in itertools.count(1))
_CONFIG_FIELDS = ("hidden", "num_experts", "max_tokens_per_rank", "dtype", "max_topk",
                  "dispatch_dtype", "low_latency", "backend", "device_type", "kernel_impl",
                  "ranks_per_node", "transport", "hierarchical", "nixl_backend",
                  "fault_tolerant", "staging_bytes", "ep_invariant", "num_sms")
KERNEL_IMPLS = ("auto", "triton", "cuda")
_SIGNATURES_KEPT = 64  # dispatch input signatures a Buffer remembers as checked
# kernel_impl="auto" on GPUs: the faster implementation per mode on the last measured GPU run
# (docs/PERF.md, 2026-12-04 evening, H200, 8 virtual ranks, device us per rank: the
# low-latency FP8 dispatch 226 on Triton against 242 on csrc/, the bf16 combine 163 against
# 311; normal mode runs on Triton only). Rewrite it from the next run's table.
FASTER_ON_GPU = {"low_latency": "triton", "normal": "triton"}


def check_kernel_impl(kernel_impl: str, device: torch.device, low_latency: bool,
                      fault_tolerant: bool = False, proxy: bool = False,
                      csrc_loads=None) -> str:
    """``triton`` everywhere; ``cuda`` (csrc/) for the low-latency ops on GPUs; ``auto``:
    ``FASTER_ON_GPU`` where csrc/ can serve the Buffer (a CUDA device, ``low_latency``, no
    fault tolerance, no proxy, and its cubin loads: ``csrc_loads(device)``), else ``triton``."""
    if kernel_impl not in KERNEL_IMPLS:
        raise ValueError(f"kernel_impl must be one of {KERNEL_IMPLS}, got {kernel_impl!r}")
    if kernel_impl == "auto":
        if (device.type != "cuda" or not low_latency or fault_tolerant or proxy
                or FASTER_ON_GPU["low_latency"] != "cuda"):
            return "triton"
        if csrc_loads is None:
            from .csrc_kernels import csrc_loads
        return "cuda" if csrc_loads(device) else "triton"
    if kernel_impl == "cuda" and (device.type != "cuda" or not low_latency):
        raise ValueError("kernel_impl='cuda' runs the low-latency kernels of csrc/ on GPUs: "
                         "it needs a CUDA device and low_latency=True")
    return kernel_impl


def _check_same_config(configs: list[dict]) -> None:
    for rank, cfg in enumerate(configs):
        for field in _CONFIG_FIELDS:
            if cfg[field] != configs[0][field]:
                raise ValueError(f"Buffer arguments differ across ranks: rank {rank} passed "
                                 f"{field}={cfg[field]}, rank 0 passed {field}="
                                 f"{configs[0][field]}; every rank must pass the same values")


class Buffer:
    """Expert-parallel dispatch/combine for one rank of ``group``.

    Collective constructor: every rank passes the same ``hidden``, ``num_experts``,
    ``max_tokens_per_rank``, ``dtype`` and ``max_topk`` (checked; the error names the rank that
    differs). Expert ``e`` lives on rank ``e // (num_experts // world_size)``.
    ``timeout_s`` (default ``MOE_COMM_TIMEOUT_S``) bounds every wait for a peer.
    Under ``mpirun`` / ``srun``: ``Buffer(None, ..., comm=MPI.COMM_WORLD)`` (an mpi4py
    communicator; the torch group is made from it, ``moe_comm.mpi``).
    ``fault_tolerant=True``: a rank silent for ``timeout_s`` is excluded and calls complete on
    the others, instead of raising PeerTimeoutError (``moe_comm.fault``: ``active_ranks``,
    ``mask_rank``, ``clean_mask``); across nodes through the proxy in flat mode only.
    ``staging_bytes`` (default ``workspace.DEFAULT_STAGING_BYTES``) bounds the normal mode's
    staging: where the whole batch does not fit, every call runs in ``rounds`` through rings of
    ``ring_slots`` slots per source (``moe_comm.normal_mode``; one node, across nodes through
    the proxy, flat or hierarchical, and across hosts over NVSHMEM; fault-tolerant Buffers too).
    On GPUs, one node (fault-tolerant too) or across hosts over NVSHMEM, such a ring is cut to
    the largest whose rounds run in one launch per op on ``num_sms`` programs
    (``moe_comm.rings``; every rank passes the same ``num_sms``, checked): more rounds, less
    memory than the budget.
    ``ep_invariant=True``: every combine sums each token's choices in choice order, each product
    and sum rounded to fp32, so its bits depend on no EP size or placement
    (``reference.invariant_combine``, ``kernels.invariant``); on one node, across nodes through
    the proxy (flat by default there; hierarchical keeps its forwarders for the dispatch), and
    in the low-latency mode over any transport; the Buffer's dtype only (no FP8 combine).
    """

    def __init__(self, group: dist.ProcessGroup | None, hidden: int, num_experts: int,
                 max_tokens_per_rank: int, dtype: torch.dtype = torch.bfloat16, *,
                 max_topk: int | None = None, dispatch_dtype: torch.dtype | None = None,
                 low_latency: bool = False, timeout_s: float | None = None,
                 backend: str = "auto", device: torch.device | str | None = None,
                 num_sms: int | None = None, kernel_impl: str = "auto",
                 ranks_per_node: int | None = None, transport: str = "auto",
                 hierarchical: bool | None = None, nixl_backend: str | None = None,
                 comm=None, fault_tolerant: bool = False, staging_bytes: int | None = None,
                 ep_invariant: bool = False):
        if comm is not None:
            if group is not None:
                raise ValueError("pass either group or comm (an mpi4py communicator), not both")
            from .mpi import process_group

            group = process_group(comm)
        elif group is None and not dist.is_initialized():
            raise ValueError("group is None and torch.distributed is not initialised: pass a "
                             "torch process group, or comm= an mpi4py communicator")
        if max_topk is None and isinstance(num_experts, int):
            max_topk = min(16, num_experts)
        device = torch.device(device) if device is not None else default_device()
        config = dict(hidden=hidden, num_experts=num_experts,
                      max_tokens_per_rank=max_tokens_per_rank, dtype=dtype, max_topk=max_topk,
                      dispatch_dtype=dispatch_dtype, low_latency=bool(low_latency),
                      backend=backend, device_type=device.type, kernel_impl=kernel_impl,
                      ranks_per_node=ranks_per_node, transport=transport,
                      hierarchical=hierarchical, nixl_backend=nixl_backend,
                      fault_tolerant=bool(fault_tolerant), staging_bytes=staging_bytes,
                      ep_invariant=bool(ep_invariant), num_sms=num_sms,
                      host=socket.gethostname(),
                      pid=os.getpid())
        world_size = dist.get_world_size(group)
        configs: list = [None] * world_size
        dist.all_gather_object(configs, config, group=group)
        _check_same_config(configs)
        check_config(world_size, hidden, num_experts, max_tokens_per_rank, dtype, max_topk,
                     dispatch_dtype)
        nodes = Nodes.of(world_size, ranks_per_node, [c["host"] for c in configs], device,
                         split_hosts=backend == "nvshmem" or transport == "nixl"
                         or (transport == "nvshmem" and device.type == "cpu"))
        chosen = choose_backend(backend, device, nodes.num_hosts)
        # IBGDA is not probed: GPUs keep NVSHMEM across nodes unless "nixl" is asked for
        via = choose_transport(transport, device, nodes.count, ibgda=device.type == "cuda")
        nixl_backend = nixl_backend_name(nixl_backend) if via == "nixl" else None
        if fault_tolerant and kernel_impl == "cuda":
            raise ValueError("fault_tolerant=True runs the Triton kernels: the csrc/ kernels "
                             "(kernel_impl='cuda') do not exclude silent peers")
        plan = resolve(world_size, hidden, num_experts, max_tokens_per_rank, dtype, max_topk,
                       low_latency=bool(low_latency), ranks_per_node=nodes.ranks_per_node,
                       transport=via, hierarchical=hierarchical,
                       fault_tolerant=bool(fault_tolerant), ep_invariant=ep_invariant,
                       kernel_impl=kernel_impl, staging_bytes=staging_bytes,
                       device_type=device.type, num_sms=num_sms)
        layout = plan.layout
        heap = create_heap(chosen, group, layout.nbytes, device, nodes.ranks_per_node,
                           puts=layout.rdma and chosen == "shm")
        proxy = None
        try:
            if heap.put_bases:
                emulated_puts.register(heap.local.data_ptr(), heap.nbytes, heap.put_bases)
            if via == "nixl":
                peers = internode_peers(layout, heap.rank)
                # the low-latency mode posts a descriptor per (token, expert) pair and per expert
                slots = 4 * len(peers) + (max_tokens_per_rank * max_topk + num_experts
                                          if low_latency else 0)
                if layout.invariant:  # a descriptor per (token, choice) of a round
                    slots += layout.ring_slots * max_topk
                proxy = NixlProxy(group, heap.local, heap.rank, world_size, peers,
                                  timeout_s=env.timeout_s() if timeout_s is None
                                  else float(timeout_s), backend=nixl_backend, slots=max(8, slots),
                                  labels=signal_labels(layout, heap.rank),
                                  tolerant=bool(fault_tolerant))
            self._setup(heap, plan, timeout_s, dispatch_dtype, kernel_impl, proxy=proxy,
                        fault_tolerant=fault_tolerant, ep_invariant=ep_invariant,
                        own_process=True)
        except BaseException:
            if proxy is not None:
                proxy.close()
            emulated_puts.forget(heap.local.data_ptr())
            heap.close()
            raise
        self.backend = chosen
        self.transport = via
        if self.fault_tolerant:  # processes of this node: a dead one is excluded at once
            self.fault.peer_pids = {r: c["pid"] for r, c in enumerate(configs)
                                    if r != self.rank and r // nodes.ranks_per_node
                                    == self.rank // nodes.ranks_per_node
                                    and c["host"] == config["host"]}

    @classmethod
    def loopback(cls, world_size: int, hidden: int, num_experts: int, max_tokens_per_rank: int,
                 dtype: torch.dtype = torch.bfloat16, *, max_topk: int | None = None,
                 dispatch_dtype: torch.dtype | None = None, low_latency: bool = False,
                 timeout_s: float | None = None, device="cpu", num_sms: int | None = None,
                 kernel_impl: str = "auto", fault_tolerant: bool = False,
                 staging_bytes: int | None = None, ep_invariant: bool = False) -> list[Buffer]:
        """``world_size`` virtual ranks in this process; drive them with
        ``moe_comm.testing.lockstep``
        (``fault_tolerant``: as ``Buffer(..., fault_tolerant=True)``; ``clean_mask`` needs
        every rank at once, which one thread cannot give)."""
        if max_topk is None and isinstance(num_experts, int):
            max_topk = min(16, num_experts)
        check_config(world_size, hidden, num_experts, max_tokens_per_rank, dtype, max_topk,
                     dispatch_dtype)
        plan = resolve(world_size, hidden, num_experts, max_tokens_per_rank, dtype, max_topk,
                       low_latency=bool(low_latency), ep_invariant=ep_invariant,
                       kernel_impl=kernel_impl, staging_bytes=staging_bytes,
                       device_type=torch.device(device).type, num_sms=num_sms,
                       own_process=False)
        heaps = create_loopback_heaps(world_size, plan.layout.nbytes, device)
        buffers = []
        for heap in heaps:
            buf = cls.__new__(cls)
            buf._setup(heap, plan, timeout_s, dispatch_dtype, kernel_impl,
                       fault_tolerant=fault_tolerant, ep_invariant=ep_invariant)
            buf.backend, buf.transport = "loopback", None
            buffers.append(buf)
        return buffers

    def _setup(self, heap: SymmetricHeap, plan: BufferPlan, timeout_s: float | None,
               dispatch_dtype: torch.dtype | None, kernel_impl: str = "auto",
               flavour: Flavour | None = None, proxy=None, fault_tolerant: bool = False,
               ep_invariant: bool | None = None, own_process: bool = False) -> None:
        """This rank's Buffer over ``heap`` as ``plan`` (``moe_comm.plan``) decided it.
        ``own_process``: every rank drives its Buffer from a process of its own (not virtual
        ranks of one process), so a rank's launch may wait for peers that run at the same time
        (``kernels.combine_rounds``, ``kernels.invariant_rounds``,
        ``kernels.dispatch_rounds``)."""
        layout, num_experts = plan.layout, plan.num_experts
        self.heap, self.layout, self.proxy = heap, layout, proxy
        self.device: torch.device = heap.device  # (read on every op: an attribute)
        self.channels = Channels(heap, layout)  # regions, epochs, words, send offsets
        self._bound = BoundLaunches()  # launches with their fixed arguments bound once
        self._passed_signatures: set = set()  # dispatch inputs' (validation.dispatch_signature)
        self.rank, self.world_size = heap.rank, heap.world_size
        self.hidden, self.dtype = layout.hidden, layout.dtype
        # (None: the layout's, as the meta-device twins of moe_comm.warmup build it)
        self.ep_invariant = layout.invariant if ep_invariant is None else ep_invariant
        self.dispatch_dtype = dispatch_dtype or layout.dtype
        self._row_bytes = layout.hidden * torch.empty((), dtype=layout.dtype).element_size()
        self.num_experts, self.num_local_experts = num_experts, layout.num_local_experts
        self.max_tokens_per_rank, self.max_topk = layout.max_tokens, layout.max_topk
        self.timeout_s = env.timeout_s() if timeout_s is None else float(timeout_s)
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        on_gpu = heap.device.type == "cuda"
        self.num_sms = plan.num_sms
        self.kernel_impl = check_kernel_impl(  # (csrc/ neither excludes peers nor sums unfused)
            kernel_impl, heap.device, layout.low_latency,
            fault_tolerant or (flavour is not None and flavour.fault_tolerant)
            or self.ep_invariant, proxy is not None)
        self._kernel_impl_auto = kernel_impl == "auto"  # csrc/ leaves what it lacks to Triton
        self.errors = ErrorRecord(heap.device)
        self._error_words = self.errors.words
        self.fault_tolerant = bool(fault_tolerant or (flavour is not None
                                                      and flavour.fault_tolerant))
        self.flavour = flavour or self._default_flavour(on_gpu)
        self.id = next(_ids)
        self.launches: collections.Counter[str] = collections.Counter()
        self.host_syncs: collections.Counter[str] = collections.Counter()
        self._failure: str | None = None
        self._stats = layout.view(heap, "stats")
        self._xstats = layout.view(heap, "xstats")
        self.ranks_per_node, self.num_nodes = layout.ranks_per_node, layout.num_nodes
        self.hierarchical = layout.hierarchical
        if proxy is not None:
            for region, index in never_signalled(layout, heap.rank):
                layout.view(heap, region)[index] = NEVER  # waits see them arrived
        self._last_handle = None  # the latest dispatch's handle (a refused combine's)
        self.own_process = own_process
        # per format, whether a call's rounds run in one launch per op (decided once)
        self.plan = plan.with_one_launch(self.flavour, own_process, proxy is not None,
                                         self.ep_invariant)
        self.fault = FaultPolicy(self.channels, self.flavour, proxy, enabled=self.fault_tolerant,
                                 timeout_s=self.timeout_s, launches=self.launches,
                                 observe_through=self._checking_transport)
        self.ll_engine = LowLatencyEngine(
            self, stats=self._stats, bound=self._bound, kernel_impl_auto=self._kernel_impl_auto,
            checked=self._checked, check_usable=self._check_usable,
            checking_transport=self._checking_transport, mark_failed=self._mark_failed,
            refusal_inputs=functools.partial(refusal_inputs, self))
        self.normal_engine = NormalEngine(
            self, stats=self._stats, xstats=self._xstats, bound=self._bound,
            check_usable=self._check_usable, checking_transport=self._checking_transport,
            mark_failed=self._mark_failed)
        _registry.register(self)

    def _default_flavour(self, on_gpu: bool) -> Flavour:
        """GPUs: compiled kernels that wait in the kernels, NVSHMEM for peers without a
        pointer. CPU ranks: the interpreter, waits on the host (``MOE_COMM_WAIT=kernel``: in
        the kernels, as on a GPU)."""
        heap, elem = self.heap, self._row_bytes // self.hidden
        common = dict(local_base=heap.local.data_ptr(), errors_addr=self.errors.address,
                      timeout_ns=int(self.timeout_s * 1e9),
                      row_align=16 if self._row_bytes % 16 == 0 else elem,
                      fault_tolerant=self.fault_tolerant,
                      mask_off=self.layout["ft_mask"].offset)
        if self.proxy is not None:  # peers on other nodes: the proxy
            return Flavour(transport=2, ring_addr=self.proxy.ring_addr,
                           ring_slots=self.proxy.slots,
                           ranks_per_node=self.layout.ranks_per_node,
                           hierarchical=self.layout.hierarchical,
                           device_wait=on_gpu or env.kernel_waits(), compiled=on_gpu,
                           **common)
        if not on_gpu:  # (across nodes over NVSHMEM: the interpreter's puts)
            return Flavour(transport=int(self.layout.rdma), device_wait=env.kernel_waits(),
                           **common)
        transport = int(bool((heap.peer_ptrs == 0).any()))
        bitcode = ""
        if transport:  # kernels call NVSHMEM: link its bitcode, initialise each module
            major, minor = torch.cuda.get_device_capability(heap.device)
            bitcode = device_bitcode(10 * major + minor)
            install_module_init_hook()
        return Flavour(transport=transport, device_wait=True, compiled=True, bitcode=bitcode,
                       **common)

    # ----------------------------------------------------------------- public API
    def active_ranks(self) -> torch.Tensor:
        """bool [R] on the Buffer's device: True where the rank is active in this rank's view
        (no synchronisation; on GPUs a device tensor). ``~active_ranks()`` is DeepEP's polarity."""
        return self.fault.active_ranks()

    @property
    def exclusions(self) -> list[tuple[int, str, float]]:
        """The ranks this rank excluded: ``(rank, channel, seconds waited)`` each."""
        return self.fault.exclusions

    def mask_rank(self, rank: int) -> None:
        """Excludes ``rank`` on purpose (maintenance, a rank known to be bad), on every rank:
        no call waits for it, sends to it or reads from it until ``clean_mask(readmit=True)``.
        On ``rank`` itself calls then raise :class:`RankExcludedError`."""
        self.fault.require("mask_rank")
        if isinstance(rank, bool) or not isinstance(rank, int) \
                or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        self.fault.exclude(rank)

    def clean_mask(self, readmit: bool = False) -> torch.Tensor:
        """Collective over the live ranks; returns the agreed ``active_ranks()``.

        Every participant announces itself on every rank and waits (bounded by the timeout)
        for the ranks active in its view, or with ``readmit`` for every rank; a rank that does
        not announce is excluded on every rank. ``readmit`` also takes back the ranks that
        announce (excluded on purpose, or for being slow); a dead rank stays excluded. Two
        rounds: a rank one participant excludes in the first is excluded on every participant
        by the end of the second. Each participant's epochs move to the largest any reached, and
        staging acknowledgements count as given, so all start the next call together. No call
        may be in flight. (A rank that dies, or arrives at the very edge of the timeout, during
        clean_mask itself can leave the views different: call it again.)"""
        self.fault.require("clean_mask")
        self._check_usable()
        if any(self.ll_engine.queue):
            raise RuntimeError("clean_mask with a low-latency hook not yet called; call the "
                               "hooks first")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every earlier kernel (and store) is done
        self._resync_epochs(self.fault.agree(readmit))
        return self.active_ranks()

    def _resync_epochs(self, agreed: list[int]) -> None:
        """Every channel's epoch := the agreed one (host mirrors and device words), and the
        low-latency acknowledgements as if every destination consumed every call so far."""
        self.channels.epochs[:] = agreed[:2]
        self.channels.epoch_words.copy_(torch.tensor(agreed[:2], dtype=torch.int64))
        if self.layout.low_latency:  # (a readmitted rank's waits start afresh)
            self.ll_engine.resync(agreed)

    # ----------------------------------------------------------------- low-latency mode
    def low_latency_dispatch(self, x, topk_idx: torch.Tensor, *, fp8: bool | None = None,
                             ue8m0: bool = False, col_major_scales: bool = False,
                             cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             return_hook: bool = False, dispatch_dtype: str | None = None,
                             global_scale: torch.Tensor | None = None,
                             scale_layout: str = "row_major"):
        return self.ll_engine.dispatch(
            x, topk_idx, fp8=fp8, ue8m0=ue8m0, col_major_scales=col_major_scales,
            cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
            return_hook=return_hook, dispatch_dtype=dispatch_dtype, global_scale=global_scale,
            scale_layout=scale_layout)

    def low_latency_combine(self, y: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor | None, handle, *,
                            return_hook: bool = False, renormalize: bool = False,
                            combine_dtype: str | torch.dtype | None = None,
                            out: torch.Tensor | None = None):
        return self.ll_engine.combine(y, topk_idx, topk_weights, handle,
                                      return_hook=return_hook, renormalize=renormalize,
                                      combine_dtype=combine_dtype, out=out)

    def clean_low_latency_buffer(self) -> None:
        self.ll_engine.clean()

    def low_latency_combine_buffer(self) -> torch.Tensor:
        return self.ll_engine.combine_buffer()

    low_latency_dispatch.__doc__ = LowLatencyEngine.dispatch.__doc__
    low_latency_combine.__doc__ = LowLatencyEngine.combine.__doc__
    clean_low_latency_buffer.__doc__ = LowLatencyEngine.clean.__doc__
    low_latency_combine_buffer.__doc__ = LowLatencyEngine.combine_buffer.__doc__
    low_latency_workspace_bytes = staticmethod(ll_workspace_bytes)

    @property
    def dispatch_serial(self) -> int:
        """Number of forward dispatches completed; a handle is valid for combine while current."""
        return self.normal_engine.dispatch_serial

    @property
    def workspace_bytes(self) -> int:
        """Bytes of symmetric memory this rank allocated (see ``moe_comm.workspace``)."""
        return self.layout.nbytes

    @property
    def staging_bytes(self) -> int:
        """Bytes of the normal mode's staging (``moe_comm.workspace``: 2 parities x R sources x
        ``ring_slots`` slots of both channels; flat across nodes through the proxy, the
        outboxes' as many again): the ``staging_bytes`` asked for at most, but for each
        region's parity rounded up to 128 bytes (``moe_comm.workspace``)."""
        return self.layout.staging_bytes

    @property
    def ring_slots(self) -> int:
        """Staging slots per source and parity; ``max_tokens_per_rank`` when a call is one
        round, fewer when ``staging_bytes`` bounds it (``moe_comm.normal_mode``), fewer still
        where one launch runs a call's rounds on a GPU (``moe_comm.rings``)."""
        return self.layout.ring_slots

    @property
    def rounds(self) -> int:
        """Rounds of every normal-mode call: ``ceil(max_tokens_per_rank / ring_slots)``."""
        return self.layout.rounds

    def warmup(self, topk: int | None = None, *, fp8: bool | None = None,
               backward: bool = True) -> dict:
        """Compiles every kernel this Buffer's calls launch, before the first call, so that the
        first call loads them instead of compiling while its peers wait (``moe_comm.warmup``).
        Local: no peer takes part. ``topk`` (default ``max_topk``): the K the calls will pass;
        ``fp8`` (default: ``dispatch_dtype`` is FP8, or the low-latency mode): an FP8 dispatch;
        ``backward``: the ops of the backward pass too. Returns ``{"variants": [kernel names],
        "seconds": wall time}``; on CPU ranks (interpreted kernels) nothing is compiled.
        Equivalent, in effect::

            buf.dispatch(x, idx, w, fp8=fp8); buf.combine(y, handle, w)  # (+ backward), but
            # nothing moves and no peer waits"""
        from .warmup import compile_ahead

        return compile_ahead(self, topk, fp8, backward)

    @staticmethod
    def required_workspace_bytes(world_size: int, hidden: int, num_experts: int,
                                 max_tokens_per_rank: int, dtype: torch.dtype = torch.bfloat16,
                                 max_topk: int | None = None, *,
                                 staging_bytes: int | None = None,
                                 ranks_per_node: int | None = None,
                                 hierarchical: bool | None = None,
                                 transport: str = "nixl", ep_invariant: bool = False,
                                 one_launch_sms: int | None = None) -> int:
        """``workspace_bytes`` of a Buffer with these arguments, without allocating it: on one
        node, or (``ranks_per_node`` < ``world_size``) across nodes through the proxy
        (``transport="nixl"``; ``hierarchical`` as the Buffer's, None: hierarchical) or over
        NVSHMEM (``transport="nvshmem"``, the nodes on different hosts). The normal
        mode's staging holds ``ring_slots = min(T, staging_bytes // per_slot)`` slots per source
        (below T rounded down to a multiple of 16 where that leaves any; default budget
        ``workspace.DEFAULT_STAGING_BYTES``), with ``ROW = H * b``::

            one node:      per_slot = 2 * R * (2 * ROW + 4 * (1 + 3 * K) + 4 * K)
            flat:          2 * per_slot(one node)        (the outboxes: a slot per peer)
            hierarchical:  per_slot(one node) + 2 * (M * (4 * ROW + 8 * (1 + 3K + N) + 8 * K)
                                                     + R * (ROW + 4 * K))
            NVSHMEM:       per_slot(one node) + 2 * (ROW + 4 * (1 + 3K) + R * (ROW + 4 * K))

        (``M`` nodes of ``N`` ranks: the outboxes' slot per node and the forwarders' regions;
        over NVSHMEM the outboxes the puts read; ``workspace.staging_slot_bytes``);
        ``ep_invariant`` (one node) adds ``2 * K * (ROW + 8)`` per slot; the rest
        grows with R only through per-peer words (``moe_comm.workspace`` gives every
        region). ``one_launch_sms``: a Buffer on GPUs, a process per rank (fault-tolerant
        too), with ``num_sms=one_launch_sms`` (the Buffer's default is
        ``rings.DEFAULT_GPU_SMS``): on one node, or across hosts over NVSHMEM, a ring of
        several rounds is cut to the largest that every format's rounds in one launch fit
        (``moe_comm.rings``)."""
        max_topk = min(16, num_experts) if max_topk is None else max_topk
        check_config(world_size, hidden, num_experts, max_tokens_per_rank, dtype, max_topk)
        N = world_size if ranks_per_node is None else ranks_per_node
        if isinstance(N, bool) or not isinstance(N, int) or N < 1 or world_size % N:
            raise ValueError(f"ranks_per_node must be a positive divisor of world_size="
                             f"{world_size}, got {ranks_per_node!r}")
        if transport not in ("nixl", "nvshmem"):
            raise ValueError("transport must be 'nixl' (the proxy) or 'nvshmem' (puts across "
                             f"hosts), got {transport!r}")
        return resolve(world_size, hidden, num_experts, max_tokens_per_rank, dtype, max_topk,
                       ranks_per_node=N, transport=transport, hierarchical=hierarchical,
                       ep_invariant=ep_invariant, staging_bytes=staging_bytes,
                       device_type="cpu" if one_launch_sms is None else "cuda",
                       num_sms=one_launch_sms).layout.nbytes

    def dispatch(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                 topk_idx: torch.Tensor, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, *, fp8: bool | None = None, ue8m0: bool = False,
                 col_major_scales: bool = False, max_recv_rows: int | None = None,
                 dispatch_dtype: str | None = None, global_scale: torch.Tensor | None = None,
                 scale_layout: str = "row_major") -> DispatchResult:
        """Sends each token to the ranks of its top-k experts; returns the rows this rank got.

        ``x`` [T, H] of ``dtype`` (T <= max_tokens_per_rank, may be 0); ``topk_idx`` [T, K]
        int64 in ``[0, E)`` or -1; ``topk_weights`` [T, K] float32 or None. Equivalent to::

            pairs = [(s, t, k) for every rank s, token t of s, choice k with
                     topk_idx_s[t, k] on this rank]             # sorted by (expert, s, t)
            x_out[row] = x_s[t]; weights[row] = topk_weights_s[t, k]
            # each expert's group padded with zero rows to a multiple of expert_alignment

        Differentiable in ``x`` and ``topk_weights`` (backward = combine of the row gradients).

        One host synchronisation (reading how many rows arrived, to size ``res.x``);
        ``max_recv_rows`` (an upper bound of this rank's rows, padding included; like DeepEP's
        ``num_worst_tokens``) makes it zero: ``res.x`` has that many rows, those past
        ``res.expert_offsets[-1]`` are zero padding (``src_rank`` -1), and more rows than that
        raise.

        A row of ``topk_idx`` with an id outside ``[-1, E)`` or an expert twice is sent nowhere
        and raises ValueError once the call is complete on every rank (the kernels check the
        ids; no host read), or at this rank's next call on a GPU without the synchronisation.

        FP8 (``fp8=True``; the default when the Buffer has ``dispatch_dtype=float8_e4m3fn``):
        the send kernel quantizes each token per 128 channels (``reference.quantize_fp8``) and
        ``res.x`` is float8_e4m3fn with ``res.x_scales`` float32 [rows, H/128]; ``ue8m0``:
        power-of-two scales as biased exponents packed 4 per int32 [rows, ceil(H/512)];
        ``col_major_scales``: ``x_scales`` is a [rows, G] view of [G, rows] memory. ``x`` may
        also be a quantized pair ``(x_fp8, scales)``. FP8 rows carry no gradient to ``x``.

        MXFP8 (``dispatch_dtype="mxfp8"``, normal mode): e4m3 values and one E8M0 scale per 32
        channels, the smallest power of two >= amax / 448 (``moe_comm.microscale``); ``res.x``
        float8_e4m3fn, ``res.x_scales`` float8_e8m0fnu [rows, H/32] row-major
        (``microscale.swizzle_128x4`` gives the layout of block-scaled GEMMs); ``x`` may be a
        pair ``(x_fp8, scales [T, H/32] float8_e8m0fnu)``; needs H % 32 == 0. A row costs
        H + H/32 bytes plus metadata on the link.

        NVFP4 (``dispatch_dtype="nvfp4"``): e2m1 values, one e4m3 scale per 16 channels and a
        float32 global scale (``moe_comm.microscale.quantize_nvfp4``): ``global_scale`` [1]
        float32, or computed on the device from this rank's ``x`` (no host read). ``res.x``
        [rows, H/2] uint8, two codes per byte, low nibble first (``.view(
        torch.float4_e2m1fn_x2)`` for PyTorch), ``res.x_scales`` float8_e4m3fn [rows, H/16],
        ``res.x_global_scale`` [rows] float32: each row's source's global scale. ``x`` may be
        a triple ``(values [T, H/2], scales [T, H/16], global [1] or [T])``; needs
        H % 16 == 0. A row costs H/2 + H/16 + 4 bytes plus metadata on the link.
        ``scale_layout="swizzled"`` (MXFP8, NVFP4): ``res.x_scales`` flat in the 128x4 layout
        of block-scaled GEMMs (``microscale.swizzle_128x4``). Quantized dispatches carry no
        gradient to ``x``; the router weights' gradient flows as with any dispatch.
        """
        self._ready()
        if self.ep_invariant:  # (a call only where it may refuse: the host path counts them)
            self._invariant_normal_mode()
        try:
            ue8m0 = (int(bool(ue8m0)) if dispatch_dtype is None and scale_layout == "row_major"
                     else scale_code(dispatch_dtype, ue8m0, scale_layout))  # (plain: no call)
            rows, scales, mode = self._dispatch_inputs(
                x, topk_idx, topk_weights, expert_alignment, fp8, ue8m0, col_major_scales,
                max_recv_rows, global_scale)
        except (TypeError, ValueError) as error:
            self._refuse_dispatch(error)
            raise
        res = dispatch_autograd(self, rows, scales, topk_idx, topk_weights, expert_alignment,
                                mode, ue8m0, col_major_scales, max_recv_rows)
        if scale_layout == "swizzled":
            res = dataclasses.replace(res, x_scales=swizzle_128x4(res.x_scales))
        return self._with_routing(res, topk_idx, topk_weights) if self.fault_tolerant else res

    def _refuse_dispatch(self, error: BaseException) -> None:
        """This rank's dispatch input is bad (``error``, which the caller raises next): it still
        takes part in the call's protocol, with no rows and a refusal for its call descriptor
        (``moe_comm.call_descriptor``), so every peer's call completes and raises
        PeerInputError naming this rank and the argument, where it would otherwise wait out
        the timeout; every rank can make the next call. Equivalent to::

            self.dispatch(x[:0], topk_idx[:0])   # no rows, the counts say 'refused'
        """
        empty = refusal_inputs(self)
        if empty is None:
            return
        with torch.no_grad():
            engine = self.normal_engine
            engine.dispatch_recv(engine.dispatch_send(*empty, None, refusal=refusal(error)), 1)
        try:  # this rank's own record of the call (every peer differs from a refusal)
            self._raise_input_errors("dispatch")
        except PeerInputError:
            pass

    def _refuse_combine(self, error: BaseException) -> None:
        """This rank's combine input is bad (``error``, which the caller raises next): it still
        takes part in the call, a combine of zeros over its latest dispatch's handle with a
        refusal for its call descriptor in every signal word (``moe_comm.call_descriptor``),
        so every peer's combine completes and raises PeerInputError naming this rank and the
        argument, where it would otherwise wait out the timeout. Equivalent to::

            self.combine(zeros_like(y), latest_handle)   # the signal words say 'refused'

        Nothing to take part in before a first dispatch (no peer can combine either)."""
        handle = self._last_handle
        if refusal_inputs(self) is None or handle is None:
            return
        y = torch.zeros((handle.num_rows, self.hidden), dtype=self.dtype, device=self.device)
        engine = self.normal_engine
        engine.combine_refusal = refusal(error, combine=True)
        try:
            with torch.no_grad():
                combine_autograd(self, y, handle, None, False)
        except PeerInputError:  # (its own record: every peer differs)
            pass
        finally:
            engine.combine_refusal = 0

    def _dispatch_inputs(self, x, topk_idx, topk_weights, expert_alignment, fp8, ue8m0: int,
                         col_major_scales, max_recv_rows=None, global_scale=None) -> tuple:
        """``(rows, scales, mode)`` of a dispatch's ``x`` (``validation.resolve_fp8``), the
        inputs checked once per distinct signature (``validation.dispatch_signature``: what
        the checks read; with ``MOE_COMM_CHECK_INPUTS=0`` only what keeps the kernels inside
        their buffers, every call: ``validation.check_dispatch_bounds``)."""
        rows, scales, mode = resolve_fp8(
            x, fp8, ue8m0, col_major_scales, default_fp8=self.dispatch_dtype != self.dtype,
            hidden=self.hidden, device=self.device, global_scale=global_scale)
        dtype, width = sent_rows_check(mode, ue8m0, self.hidden, self.dtype)
        if env.check_inputs():
            signature = None if torch.compiler.is_compiling() else dispatch_signature(
                rows, topk_idx, topk_weights, expert_alignment, max_recv_rows, width, dtype)
            if signature is None or signature not in self._passed_signatures:
                check_dispatch_inputs(rows, topk_idx, topk_weights, expert_alignment,
                                      hidden=width, max_tokens=self.max_tokens_per_rank,
                                      max_topk=self.max_topk, dtype=dtype,
                                      device=self.device, max_recv_rows=max_recv_rows)
                if signature is not None:
                    if len(self._passed_signatures) >= _SIGNATURES_KEPT:
                        self._passed_signatures.clear()
                    self._passed_signatures.add(signature)
        else:
            check_dispatch_bounds(rows, topk_idx, topk_weights, hidden=width,
                                  max_tokens=self.max_tokens_per_rank, max_topk=self.max_topk,
                                  itemsize=dtype.itemsize)
        return rows, scales, mode

    def _combine_inputs(self, y, handle, weights) -> None:
        """A combine's inputs checked (``validation.check_combine_inputs``), or with
        ``MOE_COMM_CHECK_INPUTS=0`` only what keeps the kernels inside their buffers."""
        if env.check_inputs():
            check_combine_inputs(y, handle, weights, buffer_id=self.id,
                                 latest_serial=self.normal_engine.dispatch_serial,
                                 hidden=self.hidden, dtype=self.dtype, device=self.device)
        else:
            check_combine_bounds(y, handle, weights, buffer_id=self.id, hidden=self.hidden,
                                 itemsize=self.dtype.itemsize)

    def _with_routing(self, res: DispatchResult, topk_idx, topk_weights) -> DispatchResult:
        """``res`` whose handle keeps the routing: a fault-tolerant Buffer's (for
        ``combine(..., renormalize=True)``)."""
        return dataclasses.replace(res, handle=dataclasses.replace(
            res.handle, topk_idx=topk_idx, topk_weights=topk_weights))

    def dispatch_by_slot(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                         topk_idx: torch.Tensor, topk_weights: torch.Tensor | None = None,
                         expert_alignment: int = 1, *, fp8: bool | None = None,
                         ue8m0: bool = False, col_major_scales: bool = False) -> DispatchResult:
        """:meth:`dispatch` whose ``res.x`` (and ``res.x_scales``) hold each received token
        once, in slot order (source rank, then token: DeepEP's normal-mode order); the rest
        (weights, ``src_rank``, ``src_token``, the counts, the handle) by output row, as
        :meth:`dispatch` returns them. Equivalent to::

            res = self.dispatch(x, topk_idx, topk_weights, expert_alignment, ...)
            n = res.handle.recv_slot_offsets[-1]                  # tokens received
            first = where(slot_rows[:n] >= 0, slot_rows[:n], big).min(1)  # a row per token
            res.x, res.x_scales = res.x[first], res.x_scales[first]

        without that copy (the expand kernel stores each token's row once, at its slot). Not
        differentiable; one round (a staging budget that holds the whole batch); one host
        synchronisation, as :meth:`dispatch` without ``max_recv_rows``."""
        self._ready()
        if self.ep_invariant:  # (a call only where it may refuse: the host path counts them)
            self._invariant_normal_mode()
        if self.layout.rounds > 1:
            raise ValueError(f"dispatch_by_slot needs one round; this Buffer runs a call in "
                             f"{self.layout.rounds} (staging_bytes={self.staging_bytes})")
        try:
            ue8m0 = scale_code(None, ue8m0)
            rows, scales, mode = self._dispatch_inputs(x, topk_idx, topk_weights,
                                                       expert_alignment, fp8, ue8m0,
                                                       col_major_scales)
        except (TypeError, ValueError) as error:
            self._refuse_dispatch(error)
            raise
        with torch.no_grad():
            engine = self.normal_engine
            pending = engine.dispatch_send(rows, topk_idx, topk_weights, scales, mode, ue8m0)
            outs = engine.dispatch_recv(pending, expert_alignment, col_major_scales,
                                        slot_major=True)
        self._raise_input_errors("dispatch")
        res = wrap_dispatch_outputs(self, outs, topk_idx.shape[1], topk_weights is not None,
                                    mode, int(ue8m0), topk_idx)
        return self._with_routing(res, topk_idx, topk_weights) if self.fault_tolerant else res

    def combine(self, y: torch.Tensor, handle: DispatchHandle,
                weights: torch.Tensor | None = None, *, renormalize: bool = False,
                combine_dtype: str | torch.dtype | None = None) -> torch.Tensor:
        """Sums each token's expert rows back on its home rank: ``out`` [T, H] of ``y.dtype``.

        ``y`` [rows, H] in the row order of the dispatch that made ``handle``. Equivalent to::

            out[t] = sum(weights[r] * y[r] for the rows r of token t on every rank)  # fp32

        partial sums per (token, expert rank) are rounded to ``y.dtype`` before they travel;
        ranks are summed in order 0..R-1. Differentiable in ``y`` and ``weights``. No host
        synchronisation.

        ``combine_dtype="fp8"``: each fp32 partial travels quantized per 128 channels (e4m3
        codes and a float32 scale, ``reference.quantize_fp8``: H + H/32 bytes instead of 2H)
        and is dequantized at home before the fp32 sum::

            out[t] = sum(dequantize_fp8(*quantize_fp8(partial_d)) for d in order)

        Error: each partial's element is off by at most 2**-4 of itself, or 2**-10 * amax / 448
        of its 128-channel group where it falls in e4m3's subnormal range; the errors of the
        ranks add. The backward is that of the exact combine (straight through). Needs
        H % 128 == 0. Hierarchical mode: partials for other nodes reach this node's forwarders
        as they are (NVLink) and the forwarders send their fp32 sums as FP8 (the link across
        nodes carries FP8 only).

        Fault tolerance: the rows of excluded expert ranks are left out (``moe_comm.fault``);
        ``renormalize=True`` then scales each token by the dispatch's ``sum_k topk_weights[t, k]
        / sum of the weights whose expert rank contributed`` (0 where none did), computed on the
        rounded output (no change without a failure, up to that rounding).
        """
        self._ready()
        if self.ep_invariant:  # (a call only where it may refuse: the host path counts them)
            self._invariant_normal_mode()
        try:  # (inline: the host path counts every Python call)
            fp8 = combine_is_fp8(combine_dtype, dtype=self.dtype, hidden=self.hidden,
                                 ep_invariant=self.ep_invariant)
            self._combine_inputs(y, handle, weights)
            if renormalize:
                self.fault.require("renormalize=True")
                if handle.topk_weights is None:
                    raise ValueError("renormalize=True needs the dispatch's topk_weights")
        except (TypeError, ValueError) as error:
            self._refuse_combine(error)
            raise
        out = combine_autograd(self, y, handle, weights, fp8)
        if renormalize:
            idx = handle.topk_idx
            owner = (idx.clamp(min=0) // self.num_local_experts).clamp(max=self.world_size - 1)
            live = (torch.ones(self.world_size, dtype=torch.bool, device=self.device)
                    if self.normal_engine.combine_live is None
                    else self.normal_engine.combine_live != 0)
            if live.dim() == 2:  # rounds: token t summed in round t // ring_slots
                window = torch.arange(idx.shape[0], device=self.device) // self.ring_slots
                live = live[window]
            arrived = (reached(idx, live, self.num_local_experts, self.num_experts)
                       & (handle.slot_of.gather(1, owner) >= 0))
            out = renormalized(out, idx, handle.topk_weights, arrived)
        return out

    def stats(self) -> dict[str, int]:
        """Bytes moved since the Buffer was built: what this rank's kernels stored through
        pointers (rows, metadata, signals), and across nodes what they wrote into outboxes or
        forwarded, and what the transport was asked to move (``internode_*``: data bytes per
        channel, all peers; :meth:`internode_bytes` has them per peer)."""
        values = self._stats.tolist()
        out = {"dispatch_bytes_to_peers": values[0], "dispatch_bytes_to_self": values[1],
               "combine_bytes_to_peers": values[2], "combine_bytes_to_self": values[3]}
        if self.proxy is not None:
            x = self._xstats.tolist()
            out.update(dispatch_bytes_to_outbox=x[0], combine_bytes_to_outbox=x[1],
                       dispatch_bytes_forwarded=x[2], combine_bytes_to_forwarders=x[3])
            for channel, per_peer in self.proxy.bytes_by_label().items():  # settles the ring
                out[f"internode_{channel}_bytes"] = int(per_peer.sum())
            out["internode_messages"] = int(self.proxy.messages_to.sum())
        return out

    def internode_bytes(self) -> dict[str, list[int]]:
        """Data bytes the transport was asked to move, per channel and destination rank."""
        if self.proxy is None:
            return {}
        return {channel: per_peer.tolist()
                for channel, per_peer in self.proxy.bytes_by_label().items()}

    def close(self) -> None:
        """Releases the workspace (collective on GPU heaps: every rank closes, then the memory
        is unmapped, so no peer still writes into it). Later calls raise."""
        healthy = self._failure is None
        if healthy:
            self._failure = "the Buffer was closed"
        _registry.unregister(self)
        self.channels.signal_words = None
        if self.proxy is not None:  # a healthy rank waits (bounded) for its peers to close too
            excluded = [] if self.fault.mask_words is None else \
                np.flatnonzero(self.fault.mask_words).tolist()
            self.proxy.close(wait_for_peers=healthy, gone=excluded)
        emulated_puts.forget(self.heap.local.data_ptr())
        self.heap.close()

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Buffer(rank={self.rank}/{self.world_size}, hidden={self.hidden}, "
                f"num_experts={self.num_experts}, max_tokens_per_rank={self.max_tokens_per_rank}, "
                f"dtype={self.dtype}, workspace_bytes={self.workspace_bytes})")

    # ----------------------------------------------------------------- phases
    def _invariant_normal_mode(self) -> None:
        """An EP-invariant low-latency Buffer across hosts over NVSHMEM runs the low-latency
        mode only."""
        if self.ep_invariant and not self.layout.invariant:
            raise ValueError("this EP-invariant Buffer spans hosts over NVSHMEM: it runs the "
                             "low-latency mode only (low_latency_dispatch / "
                             "low_latency_combine); the normal mode's invariant combine runs on "
                             "one node or through the proxy (transport='nixl')")

    def _ready(self) -> None:
        """Raises what an earlier call left: the Buffer unusable, or a bad input a kernel
        recorded (host reads of the error record). A trace under ``torch.compile`` cannot read
        it; the custom ops check it themselves when they run (``moe_comm.ops``)."""
        if torch.compiler.is_compiling():
            return
        self._checked("an earlier call")

    def _checked(self, what: str, channel: str = "device") -> None:
        """``_check_usable(channel)`` then ``_raise_input_errors(what)``: every op's first
        check, one read of the record's two flags while it is clean."""
        words = self._error_words
        if self._failure is None and words[TIMEOUT_RECORD] != 1 and words[INPUT_RECORD] != 1:
            return
        self._check_usable(channel)
        self._raise_input_errors(what)

    def _mark_failed(self, reason: str) -> None:
        """The Buffer is unusable from now on (``moe_comm._guard``): ``reason`` says why."""
        self._failure = reason

    def _check_usable(self, channel: str = "device") -> None:
        """Raises if the Buffer failed, or a kernel's wait recorded a timeout (which makes it
        unusable; with fault tolerance a kernel records one only when it found this rank
        excluded: RankExcludedError, and the Buffer stays usable). Reads the error record only:
        no synchronisation."""
        if self._failure is None and self._error_words[TIMEOUT_RECORD] != 1:
            return
        if self.fault_tolerant and self.errors.timed_out():
            if self.errors.take_self_exclusion(self.rank):
                self.ll_engine.clear_timed_out()  # the low-latency kernels' flag too
                raise RankExcludedError(self.rank, int(self.fault.mask[self.rank]) - 1)
        if self._failure is None and self.errors.timed_out():
            self._failure = f"a kernel's bounded wait timed out on the {channel} channel"
            if self.proxy is not None:  # a transport that failed is the cause: say so
                self.proxy.check()
            try:
                self.errors.raise_timeout(rank=self.rank, channel=channel,
                                          timeout_s=self.timeout_s)
            except PeerTimeoutError as exc:  # (a normal-mode wait records the source rank)
                via = (relay_of(self.rank, exc.peer, channel, self.ranks_per_node,
                                self.hierarchical) if channel in CHANNEL_NAMES.values()
                       else None)
                if via is None:
                    raise
                raise PeerTimeoutError(self.rank, exc.peer, channel, exc.expected,
                                       exc.observed, self.timeout_s, via=via) from None
        if self._failure is not None:
            raise RuntimeError(f"moe_comm Buffer on rank {self.rank} is unusable: "
                               f"{self._failure}. Build a new Buffer on every rank.")

    def _raise_input_errors(self, what: str) -> None:
        """Raises a bad input a kernel recorded (bad expert id, repeated expert, too many rows)
        once the call is complete on this rank, so every rank stays in step and the Buffer
        stays usable. Runs after each call and at the start of the next (a GPU may record it
        after the call returned)."""
        if self._error_words[INPUT_RECORD] == 1:
            self.errors.raise_input_error(rank=self.rank, what=what)

    def _checking_transport(self, observe):
        """``observe`` for a host wait; through the proxy it raises a transport failure first."""
        if self.proxy is None:
            return observe
        proxy = self.proxy

        def checked():
            proxy.check()
            return observe()

        return checked
