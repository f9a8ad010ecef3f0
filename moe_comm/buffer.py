"""``Buffer``: owns one rank's symmetric workspace and runs dispatch and combine on it.

Every op is two phases, *send* (local layout, puts into peers, publish an epoch) and *receive*
(bounded wait for every peer's epoch, then local work). ``dispatch``/``combine`` run both; the
loopback driver (``moe_comm.lockstep``) runs each phase for all virtual ranks in turn.

Why two parities of staging are enough (no "consumed" signal): every rank publishes to every
rank on every call, and every receive waits for all of them. Rank A writes call ``n + 2`` of a
channel into rank B's parity ``n % 2`` only after A's receive of call ``n + 1`` returned, which
needed B's send of ``n + 1``, which B issues only after its receive of call ``n`` (the reader of
that parity) finished. Calls of one channel are serial on a rank, so the reader is always done.
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton

from . import _registry, env
from .kernels.combine import combine_reduce, combine_send
from .kernels.comm import wait_epochs
from .kernels.dispatch import dispatch_expand, dispatch_send
from .kernels.layout import routing_layout
from .ops import combine_autograd, dispatch_autograd
from .symm import ShmHeap, SymmetricHeap, create_loopback_heaps
from .types import DispatchHandle, DispatchResult
from .validation import FLOAT_DTYPES, check_combine_inputs, check_dispatch_inputs
from .workspace import COMBINE, DISPATCH, WorkspaceLayout

_ids = itertools.count(1)
_CHANNEL_NAMES = {DISPATCH: "dispatch", COMBINE: "combine"}
_CONFIG_FIELDS = ("hidden", "num_experts", "max_tokens_per_rank", "dtype", "max_topk")


@dataclass
class PendingSend:
    """What a send phase leaves for its receive phase."""

    channel: int
    epoch: int
    slot_of: torch.Tensor | None = None  # [T, R] int32 (dispatch)
    topk: int = 0
    has_weights: bool = False


def _check_config(world_size: int, hidden, num_experts, max_tokens_per_rank, dtype, max_topk):
    for name, v in (("hidden", hidden), ("num_experts", num_experts),
                    ("max_tokens_per_rank", max_tokens_per_rank), ("max_topk", max_topk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    if num_experts % world_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by the world size "
                         f"{world_size}; expert e lives on rank e // (num_experts // world_size)")
    if max_topk > num_experts:
        raise ValueError(f"max_topk={max_topk} exceeds num_experts={num_experts}")


def _check_same_config(configs: list[dict]) -> None:
    for rank, cfg in enumerate(configs):
        for field in _CONFIG_FIELDS:
            if cfg[field] != configs[0][field]:
                raise ValueError(f"Buffer arguments differ across ranks: rank {rank} passed "
                                 f"{field}={cfg[field]}, rank 0 passed {field}="
                                 f"{configs[0][field]}; every rank must pass the same values")


def _block_sizes(hidden: int) -> tuple[int, int]:
    """(tokens, channels) per tile: wide tiles keep the interpreter's per-program cost low."""
    return 64, min(triton.next_power_of_2(hidden), 2048)


class Buffer:
    """Expert-parallel dispatch/combine for one rank of ``group``.

    Collective constructor: every rank passes the same ``hidden``, ``num_experts``,
    ``max_tokens_per_rank``, ``dtype`` and ``max_topk`` (checked; the error names the rank that
    differs). Expert ``e`` lives on rank ``e // (num_experts // world_size)``.
    ``timeout_s`` (default ``MOE_COMM_TIMEOUT_S``) bounds every wait for a peer.
    """

    def __init__(self, group: dist.ProcessGroup, hidden: int, num_experts: int,
                 max_tokens_per_rank: int, dtype: torch.dtype = torch.bfloat16, *,
                 max_topk: int | None = None, timeout_s: float | None = None,
                 backend: str = "auto"):
        if backend not in ("auto", "shm"):
            raise ValueError(f"backend={backend!r}: a process group runs on 'shm' (CPU ranks); "
                             "use Buffer.loopback(...) for virtual ranks")
        if max_topk is None and isinstance(num_experts, int):
            max_topk = min(16, num_experts)
        config = dict(hidden=hidden, num_experts=num_experts,
                      max_tokens_per_rank=max_tokens_per_rank, dtype=dtype, max_topk=max_topk)
        world_size = dist.get_world_size(group)
        configs: list = [None] * world_size
        dist.all_gather_object(configs, config, group=group)
        _check_same_config(configs)
        _check_config(world_size, **config)
        layout = WorkspaceLayout(world_size, max_tokens_per_rank, hidden,
                                 num_experts // world_size, max_topk, dtype)
        self._setup(ShmHeap(group, layout.nbytes), layout, num_experts, timeout_s)

    @classmethod
    def loopback(cls, world_size: int, hidden: int, num_experts: int, max_tokens_per_rank: int,
                 dtype: torch.dtype = torch.bfloat16, *, max_topk: int | None = None,
                 timeout_s: float | None = None, device="cpu") -> list[Buffer]:
        """``world_size`` virtual ranks in this process; drive them with ``moe_comm.lockstep``."""
        if max_topk is None and isinstance(num_experts, int):
            max_topk = min(16, num_experts)
        _check_config(world_size, hidden, num_experts, max_tokens_per_rank, dtype, max_topk)
        layout = WorkspaceLayout(world_size, max_tokens_per_rank, hidden,
                                 num_experts // world_size, max_topk, dtype)
        heaps = create_loopback_heaps(world_size, layout.nbytes, device)
        buffers = []
        for heap in heaps:
            buf = cls.__new__(cls)
            buf._setup(heap, layout, num_experts, timeout_s)
            buffers.append(buf)
        return buffers

    def _setup(self, heap: SymmetricHeap, layout: WorkspaceLayout, num_experts: int,
               timeout_s: float | None) -> None:
        self.heap, self.layout = heap, layout
        self.rank, self.world_size = heap.rank, heap.world_size
        self.hidden, self.dtype = layout.hidden, layout.dtype
        self.num_experts, self.num_local_experts = num_experts, layout.num_local_experts
        self.max_tokens_per_rank, self.max_topk = layout.max_tokens, layout.max_topk
        self.timeout_s = env.timeout_s() if timeout_s is None else float(timeout_s)
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.id = next(_ids)
        self.launches: collections.Counter[str] = collections.Counter()
        self._epochs = [0, 0]  # last epoch issued per channel
        self._tickets = [0, 0]  # send programs launched so far per channel (mirrors `tickets`)
        self._dispatch_serial = 0
        self._failure: str | None = None
        self._signals = layout.view(heap, "signals")
        self._ticket_words = layout.view(heap, "tickets")
        self._stats = layout.view(heap, "stats")
        _registry.register(self)

    # ----------------------------------------------------------------- public API
    @property
    def device(self) -> torch.device:
        return self.heap.device

    @property
    def dispatch_serial(self) -> int:
        """Number of forward dispatches completed; a handle is valid for combine while current."""
        return self._dispatch_serial

    @property
    def workspace_bytes(self) -> int:
        """Bytes of symmetric memory this rank allocated (see ``moe_comm.workspace``)."""
        return self.layout.nbytes

    @staticmethod
    def required_workspace_bytes(world_size: int, hidden: int, num_experts: int,
                                 max_tokens_per_rank: int, dtype: torch.dtype = torch.bfloat16,
                                 max_topk: int | None = None) -> int:
        """``workspace_bytes`` of a Buffer with these arguments, without allocating it."""
        max_topk = min(16, num_experts) if max_topk is None else max_topk
        _check_config(world_size, hidden, num_experts, max_tokens_per_rank, dtype, max_topk)
        return WorkspaceLayout(world_size, max_tokens_per_rank, hidden,
                               num_experts // world_size, max_topk, dtype).nbytes

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor | None = None, expert_alignment: int = 1
                 ) -> DispatchResult:
        """Sends each token to the ranks of its top-k experts; returns the rows this rank got.

        ``x`` [T, H] of ``dtype`` (T <= max_tokens_per_rank, may be 0); ``topk_idx`` [T, K]
        int64 in ``[0, E)`` or -1; ``topk_weights`` [T, K] float32 or None. Equivalent to::

            pairs = [(s, t, k) for every rank s, token t of s, choice k with
                     topk_idx_s[t, k] on this rank]             # sorted by (expert, s, t)
            x_out[row] = x_s[t]; weights[row] = topk_weights_s[t, k]
            # each expert's group padded with zero rows to a multiple of expert_alignment

        Differentiable in ``x`` and ``topk_weights`` (backward = combine of the row gradients).
        """
        self._check_usable()
        check_dispatch_inputs(x, topk_idx, topk_weights, expert_alignment,
                              hidden=self.hidden, num_experts=self.num_experts,
                              max_tokens=self.max_tokens_per_rank, max_topk=self.max_topk,
                              dtype=self.dtype, device=self.device, values=env.check_inputs())
        return dispatch_autograd(self, x, topk_idx, topk_weights, expert_alignment)

    def combine(self, y: torch.Tensor, handle: DispatchHandle,
                weights: torch.Tensor | None = None) -> torch.Tensor:
        """Sums each token's expert rows back on its home rank: ``out`` [T, H] of ``y.dtype``.

        ``y`` [rows, H] in the row order of the dispatch that made ``handle``. Equivalent to::

            out[t] = sum(weights[r] * y[r] for the rows r of token t on every rank)  # fp32

        partial sums per (token, expert rank) are rounded to ``y.dtype`` before they travel;
        ranks are summed in order 0..R-1. Differentiable in ``y`` and ``weights``.
        """
        self._check_usable()
        check_combine_inputs(y, handle, weights, buffer_id=self.id,
                             latest_serial=self.dispatch_serial, hidden=self.hidden,
                             dtype=self.dtype, device=self.device)
        return combine_autograd(self, y, handle, weights)

    def stats(self) -> dict[str, int]:
        """Bytes this rank's kernels stored since the Buffer was built (rows, metadata, signals)."""
        values = self._stats.tolist()
        return {"dispatch_bytes_to_peers": values[0], "dispatch_bytes_to_self": values[1],
                "combine_bytes_to_peers": values[2], "combine_bytes_to_self": values[3]}

    def close(self) -> None:
        """Releases the workspace. Later calls raise."""
        if self._failure is None:
            self._failure = "the Buffer was closed"
        _registry.unregister(self)
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
    def _check_usable(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"moe_comm Buffer on rank {self.rank} is unusable: "
                               f"{self._failure}. Build a new Buffer on every rank.")

    def _fail(self, what: str, error: BaseException) -> None:
        self._failure = f"an earlier {what} failed ({error})"

    def _start(self, channel: int) -> int:
        self._check_usable()
        self._epochs[channel] += 1
        return self._epochs[channel]

    def _draw_tickets(self, channel: int, programs: int) -> tuple[torch.Tensor, int]:
        last = self._tickets[channel] + programs - 1
        self._tickets[channel] += programs
        return self._ticket_words[channel:channel + 1], last

    def _send_offsets(self, channel: int, parity: int) -> dict[str, int]:
        lay, me = self.layout, self.rank
        name = _CHANNEL_NAMES[channel]
        offsets = {"rows": lay.offset(f"{name}_rows", parity, me),
                   "meta": lay.offset(f"{name}_meta", parity, me),
                   "signal": lay.offset("signals", channel, me)}
        if channel == DISPATCH:
            offsets["counts"] = lay.offset("dispatch_counts", parity, me)
        return offsets

    def _wait(self, pending: PendingSend) -> None:
        wait_epochs(self._signals[pending.channel], pending.epoch, timeout_s=self.timeout_s,
                    rank=self.rank, channel=_CHANNEL_NAMES[pending.channel])

    def _staging(self, channel: int, parity: int) -> tuple[torch.Tensor, torch.Tensor]:
        name = _CHANNEL_NAMES[channel]
        rows = self.layout.view(self.heap, f"{name}_rows")[parity]
        meta = self.layout.view(self.heap, f"{name}_meta")[parity]
        return rows, meta

    def _guarded(self, what: str, fn, *args):
        try:
            return fn(*args)
        except BaseException as error:
            self._fail(what, error)
            raise

    def dispatch_send(self, x, topk_idx, topk_weights) -> PendingSend:
        """Send phase of dispatch (inputs already validated): layout + put rows and metadata."""
        return self._guarded("dispatch", self._dispatch_send, x, topk_idx, topk_weights)

    def _dispatch_send(self, x, topk_idx, topk_weights) -> PendingSend:
        epoch = self._start(DISPATCH)
        block_t, block_h = _block_sizes(self.hidden)
        x = x.contiguous()
        topk_idx = topk_idx.contiguous()
        topk_weights = None if topk_weights is None else topk_weights.contiguous()
        slot_of, pair_pos, counts = routing_layout(topk_idx, self.world_size,
                                                   self.num_local_experts, block_t)
        self.launches["layout"] += 1
        grid = max(1, triton.cdiv(x.shape[0], block_t))
        tickets, last = self._draw_tickets(DISPATCH, grid)
        self.launches["dispatch_send"] += dispatch_send(
            x, topk_idx, topk_weights, slot_of, pair_pos, counts, self.heap.peer_ptrs,
            self._stats, tickets, offsets=self._send_offsets(DISPATCH, epoch % 2),
            last_ticket=last, epoch=epoch, rank=self.rank,
            num_local_experts=self.num_local_experts, meta_stride=self.layout.meta_stride,
            max_topk=self.max_topk, block_t=block_t, block_h=block_h, grid=grid,
            topk=topk_idx.shape[1])
        return PendingSend(DISPATCH, epoch, slot_of, topk_idx.shape[1], topk_weights is not None)

    def dispatch_recv(self, pending: PendingSend, expert_alignment: int) -> tuple:
        """Receive phase of dispatch; returns the tensors of ``moe_comm::dispatch``."""
        return self._guarded("dispatch", self._dispatch_recv, pending, expert_alignment)

    def _dispatch_recv(self, pending: PendingSend, expert_alignment: int) -> tuple:
        self._wait(pending)
        parity, L, dev = pending.epoch % 2, self.num_local_experts, self.device
        counts = self.layout.view(self.heap, "dispatch_counts")[parity].to(torch.int64)
        per_source = counts[:, :L]  # [R, L] tokens from source s for expert e
        slot_counts = counts[:, L]  # [R]
        tokens_per_expert = per_source.sum(0)
        padded = (tokens_per_expert + expert_alignment - 1) // expert_alignment * expert_alignment
        zero = torch.zeros(1, dtype=torch.int64, device=dev)
        expert_offsets = torch.cat([zero, padded.cumsum(0)])
        row_base = expert_offsets[:-1][None, :] + per_source.cumsum(0) - per_source
        slot_offsets = torch.cat([zero, slot_counts.cumsum(0)])
        rows, slots = int(expert_offsets[-1]), int(slot_offsets[-1])
        out = torch.zeros((rows, self.hidden), dtype=self.dtype, device=dev)
        out_weights = (torch.zeros(rows, dtype=torch.float32, device=dev) if pending.has_weights
                       else torch.empty(0, dtype=torch.float32, device=dev))
        src_rank = torch.full((rows,), -1, dtype=torch.int64, device=dev)
        src_token = torch.full((rows,), -1, dtype=torch.int64, device=dev)
        slot_rows = torch.empty((slots, pending.topk), dtype=torch.int32, device=dev)
        staging, meta = self._staging(DISPATCH, parity)
        block_t, block_h = _block_sizes(self.hidden)
        self.launches["dispatch_expand"] += dispatch_expand(
            staging, meta, slot_counts.to(torch.int32), slot_offsets, row_base, slot_rows, out,
            out_weights if pending.has_weights else None, src_rank, src_token,
            max_slots=int(slot_counts.max()), topk=pending.topk,
            num_local_experts=L, meta_stride=self.layout.meta_stride, max_topk=self.max_topk,
            block_t=block_t, block_h=block_h)
        self._dispatch_serial += 1
        return (out, out_weights, src_rank, src_token, tokens_per_expert, expert_offsets,
                pending.slot_of, slot_rows, slot_offsets)

    def dispatch_cached_send(self, x, slot_of) -> PendingSend:
        """Send phase of a dispatch that reuses an earlier layout (the backward of combine)."""
        return self._guarded("dispatch", self._dispatch_cached_send, x, slot_of)

    def _dispatch_cached_send(self, x, slot_of) -> PendingSend:
        epoch = self._start(DISPATCH)
        block_t, block_h = _block_sizes(self.hidden)
        x = x.contiguous()
        grid = max(1, triton.cdiv(x.shape[0], block_t))
        tickets, last = self._draw_tickets(DISPATCH, grid)
        self.launches["dispatch_send"] += dispatch_send(
            x, None, None, slot_of, None, None, self.heap.peer_ptrs, self._stats, tickets,
            offsets=self._send_offsets(DISPATCH, epoch % 2), last_ticket=last, epoch=epoch,
            rank=self.rank, num_local_experts=self.num_local_experts,
            meta_stride=self.layout.meta_stride, max_topk=self.max_topk, block_t=block_t,
            block_h=block_h, grid=grid, topk=1)
        return PendingSend(DISPATCH, epoch)

    def dispatch_cached_recv(self, pending: PendingSend, slot_rows, slot_offsets,
                             num_rows: int) -> torch.Tensor:
        """Receive phase of a cached dispatch: rows [num_rows, H], zero in padding."""
        return self._guarded("dispatch", self._dispatch_cached_recv, pending, slot_rows,
                             slot_offsets, num_rows)

    def _dispatch_cached_recv(self, pending, slot_rows, slot_offsets, num_rows) -> torch.Tensor:
        self._wait(pending)
        out = torch.zeros((num_rows, self.hidden), dtype=self.dtype, device=self.device)
        slot_counts = slot_offsets.diff()
        staging, _ = self._staging(DISPATCH, pending.epoch % 2)
        block_t, block_h = _block_sizes(self.hidden)
        self.launches["dispatch_expand"] += dispatch_expand(
            staging, None, slot_counts.to(torch.int32), slot_offsets, None, slot_rows, out,
            None, None, None, max_slots=int(slot_counts.max()), topk=slot_rows.shape[1],
            num_local_experts=self.num_local_experts, meta_stride=self.layout.meta_stride,
            max_topk=self.max_topk, block_t=block_t, block_h=block_h)
        return out

    def combine_send(self, y, weights, pair_values, slot_rows, slot_offsets) -> PendingSend:
        """Send phase of combine: reduce each received token's rows, put the partial home."""
        return self._guarded("combine", self._combine_send, y, weights, pair_values, slot_rows,
                             slot_offsets)

    def _combine_send(self, y, weights, pair_values, slot_rows, slot_offsets) -> PendingSend:
        epoch = self._start(COMBINE)
        block_t, block_h = _block_sizes(self.hidden)
        slot_counts = slot_offsets.diff()
        tiles = max(1, triton.cdiv(int(slot_counts.max()), block_t))
        tickets, last = self._draw_tickets(COMBINE, self.world_size * tiles)
        self.launches["combine_send"] += combine_send(
            y.contiguous(), weights, pair_values, slot_rows, slot_counts.to(torch.int32),
            slot_offsets, self.heap.peer_ptrs, self._stats, tickets,
            offsets=self._send_offsets(COMBINE, epoch % 2), last_ticket=last, epoch=epoch,
            rank=self.rank, topk=slot_rows.shape[1], max_topk=self.max_topk, block_t=block_t,
            block_h=block_h, grid_tiles=tiles)
        return PendingSend(COMBINE, epoch, topk=slot_rows.shape[1])

    def combine_recv(self, pending: PendingSend, slot_of, want_pair: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Receive phase of combine: ``(out [T, H], pair_out [T, K] float32 or empty)``."""
        return self._guarded("combine", self._combine_recv, pending, slot_of, want_pair)

    def _combine_recv(self, pending, slot_of, want_pair):
        self._wait(pending)
        T, dev = slot_of.shape[0], self.device
        out = torch.empty((T, self.hidden), dtype=self.dtype, device=dev)
        pair_out = torch.empty((T, pending.topk) if want_pair else (0,), dtype=torch.float32,
                               device=dev)
        staging, meta = self._staging(COMBINE, pending.epoch % 2)
        block_t, block_h = _block_sizes(self.hidden)
        self.launches["combine_reduce"] += combine_reduce(
            staging, meta, slot_of, out, pair_out if want_pair else None, topk=pending.topk,
            max_topk=self.max_topk, block_t=block_t, block_h=block_h)
        return out, pair_out
