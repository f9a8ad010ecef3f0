"""DeepEP V1's ``Buffer`` (normal and low-latency modes) over ``moe_comm.Buffer``.

Normal mode, DeepEP's layout (the receive order of its intranode and internode kernels)::

    recv_x[i]            one row per (source rank s, token t of s) with an expert on this rank,
                         ordered by s, then t (FP8: the pair (codes, scales [N, H/128]))
    recv_topk_idx[i, k]  topk_idx_s[t, k] - rank * L if that expert is on this rank, else -1
    recv_topk_weights    topk_weights_s[t, k] where recv_topk_idx[i, k] >= 0, else 0
    num_recv_tokens_per_expert_list[e]   rows of local expert e, rounded up to expert_alignment
    combine(x, handle)   out[t] = sum over the ranks r that got token t of x_r[row of t]
                         (unweighted, fp32, rank order, rounded once; across nodes see below);
                         with topk_weights, combined_topk_weights[t, k] = the weight row of the
                         rank that holds choice k (each choice is local to one rank)
    dispatch(x, handle=h)   the rows of x moved as the dispatch that made h moved them

moe_comm's own dispatch is expert-major (a row per (token, local choice)). The facade asks for
the rows by slot instead (``Buffer.dispatch_by_slot``): the receive kernel stores each received
(source, token) once, in DeepEP's order, so the facade adds no copy of the rows. Only where the
staging runs a call in rounds (slots by round, then source) does it gather one row per (source,
token) into DeepEP's order: one copy, ``N * H`` elements read and written per call (FP8 pairs:
``N * (H + 4 * H / 128)`` bytes). It reads the received-row count on the host (as DeepEP's
normal dispatch does). combine
and the cached dispatch move DeepEP's rows in place: the handle maps each received (source,
token) slot to its DeepEP row, which moe_comm's kernels read (combine) or write (cached
dispatch) directly; a combine with ``topk_weights``, or of an EP-invariant Buffer, first lays the
rows out expert-major (one zero-filled buffer of moe_comm's rows), as the weights go per choice.
Where moe_comm's staging runs a call in rounds (``moe_comm.Buffer.rounds``: large batches,
many ranks) its slots arrive by round; the facade still orders them by source, then token.

Internode normal mode (DeepEP: ``num_rdma_bytes > 0`` with more ranks than one node holds): the
workspaces span the nodes, ``moe_comm.Buffer(..., ranks_per_node=N, transport="nixl")`` (stores
within a node, the NIXL proxy between nodes; hierarchical, moe_comm's default there and DeepEP's
design: a token crosses to each node once; flat with ``ep_invariant=True``). ``N``, the ranks
per node: ``Buffer(..., ranks_per_node=N)`` (moe_comm's argument, not DeepEP's), else the
environment variable ``MOE_COMM_RANKS_PER_NODE``, else 8 (DeepEP's ``NUM_MAX_NVL_PEERS``); a
group of at most ``N`` ranks is one node, a larger one must be whole nodes. The calls and
layouts are the intranode ones, as in DeepEP: ``get_dispatch_layout`` returns
``num_tokens_per_rdma_rank`` [nodes] int32 (tokens with an expert on any rank of the node; None
on one node), ``dispatch`` takes it, the handle stays opaque; dispatch, cached dispatch and
combined weights have the intranode bits. combine's sum follows moe_comm's hierarchical order
(``reference.combine_all(..., hierarchical_nodes=N)``): a token's rows on each other node are
summed there in fp32, rank order, rounded once; the home adds, in fp32 and node order, its own
node's rows one by one and each other node's sum, rounding once (DeepEP's internode combine
also rounds each node's sum). ``num_rdma_bytes = 0`` keeps one ``moe_comm.Buffer`` over the
group with the nodes moe_comm finds (its hosts), as before. The low-latency workspace spans the
same nodes. ``ep_invariant=True`` goes to both workspaces as it is: across nodes
``moe_comm.Buffer`` then runs its normal mode flat (each (token, choice) row home through the
proxy on its own, summed there in choice order: the one-node bits) and the low-latency mode as
on one node.

Sizing: DeepEP sizes its buffer in bytes up front; moe_comm's workspace needs the shapes, so it
is built at the first call and grows to the largest call seen (``num_nvl_bytes`` and
``num_rdma_bytes`` are kept for callers that compare them; ``num_rdma_bytes > 0`` only chooses
the internode mode). Every normal dispatch agrees on the sizes with one small all-reduce over
the group (a host collective; DeepEP's normal dispatch synchronises with the host too). The
low-latency workspace is built at the first ``low_latency_dispatch`` from
``num_max_dispatch_tokens_per_rank``, hidden and the number of experts, as DeepEP's hint sizes
it.

EP-invariant sums (``Buffer(..., ep_invariant=True)``; not a DeepEP argument): both
workspaces are ``moe_comm.Buffer(..., ep_invariant=True)``. The normal combine then adds a
token's rows in fp32 in the order of its choices (of each rank's choices one carries the rank's
row, the others add zero) instead of in rank order, rounding once. The low-latency combine
already sums ``w[t, k] * x_row(t, k)`` in choice order, so its output has the same bits at any
EP size and expert placement with or without the option.

Streams: moe_comm runs on the caller's current stream, so ``async_finish`` and
``allocate_on_comm_stream`` change no result; ``previous_event`` is waited for first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

import moe_comm

from .. import env
from . import checks
from .utils import EventHandle, EventOverlap

_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
NUM_MAX_NVL_PEERS = 8  # DeepEP's ranks per node: the default of ``ranks_per_node``


def ranks_per_node_setting(value: int | None = None) -> int:
    """Ranks per node of the facade: ``value`` (``Buffer(..., ranks_per_node=)``), else
    ``MOE_COMM_RANKS_PER_NODE``, else ``NUM_MAX_NVL_PEERS`` (8, DeepEP's)."""
    if value is not None:
        return checks.positive_int(value, "ranks_per_node")
    return env.ranks_per_node(NUM_MAX_NVL_PEERS)


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"moe_comm.deep_ep: {what}")


@dataclass
class Config:
    """DeepEP's performance configuration (SMs, chunk sizes). moe_comm picks its own tiles and
    grids, so the numbers change nothing; the size hints stand in for DeepEP's."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes DeepEP would reserve for one node's chunked queues (kept only for callers
        that compare it with ``Buffer.num_nvl_bytes``)."""
        return num_ranks * self.num_max_nvl_chunked_recv_tokens * hidden_bytes

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0 on one node (as DeepEP's); across nodes (more than ``MOE_COMM_RANKS_PER_NODE``
        ranks, default 8) the bytes of the chunked queues per node, so that callers which pass
        the hint as ``num_rdma_bytes`` get the internode mode."""
        N = ranks_per_node_setting()
        if num_ranks <= N:
            return 0
        return (num_ranks // N) * self.num_max_rdma_chunked_recv_tokens * hidden_bytes


@dataclass(eq=False)
class _NormalHandle:
    """What combine and the cached dispatch need (opaque to callers, as DeepEP's handle)."""

    buffer: moe_comm.Buffer
    moe: moe_comm.DispatchHandle
    first_row: torch.Tensor  # [N] int64: moe_comm row of each DeepEP row (its first choice)
    choice_rows: torch.Tensor  # [N, K] int64: moe_comm row of each DeepEP row's choices, or -1
    slot_rows: torch.Tensor  # [slots, 1] int32: DeepEP row of each received slot, -1 past them
    num_recv: int
    rows: int  # moe_comm's expert-major rows


@dataclass(eq=False)
class _LowLatencyHandle:
    buffer: moe_comm.Buffer
    moe: object  # moe_comm.low_latency.LowLatencyHandle


def _wait(previous_event) -> None:
    if previous_event is not None:
        previous_event.current_stream_wait()


class Buffer:
    """``deep_ep.Buffer`` over moe_comm (see the module docstring for what each call returns).

    ``num_rdma_bytes > 0`` with more ranks than a node holds runs DeepEP's internode mode over
    moe_comm's nodes (``ranks_per_node``, moe_comm's argument: default
    ``MOE_COMM_RANKS_PER_NODE``, else 8; the module doc); ``allow_mnnvl`` and
    ``num_qps_per_rank`` change nothing. ``enable_shrink=True`` builds the low-latency
    workspace fault tolerant (``moe_comm.fault``) for the mask calls; ``ep_invariant=True``
    (moe_comm's, not DeepEP's) builds both workspaces EP-invariant (see the module doc).
    ``num_nvl_ranks`` / ``num_rdma_ranks``: the ranks per node and the nodes the workspaces
    span (1 node without ``num_rdma_bytes``)."""

    num_sms: int = 20

    def __init__(self, group: dist.ProcessGroup | None, num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None, ep_invariant: bool = False,
                 ranks_per_node: int | None = None):
        self.ep_invariant = checks.flag(ep_invariant, "ep_invariant")
        per_node = ranks_per_node_setting(ranks_per_node)  # (checked before the group is touched)
        if comm is not None:
            from moe_comm.mpi import process_group

            group = process_group(comm)
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.num_nvl_bytes, self.num_rdma_bytes = int(num_nvl_bytes), int(num_rdma_bytes)
        self.num_nvl_ranks, self.num_rdma_ranks = self.group_size, 1
        if self.num_rdma_bytes > 0 and self.group_size > per_node:  # DeepEP's internode mode
            checks.whole_nodes(self.group_size, per_node)
            self.num_nvl_ranks, self.num_rdma_ranks = per_node, self.group_size // per_node
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy, self.enable_shrink = explicitly_destroy, bool(enable_shrink)
        self._normal: moe_comm.Buffer | None = None
        self._low_latency: moe_comm.Buffer | None = None
        self._destroyed = False

    # ----------------------------------------------------------------- configuration
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """SMs for the normal mode's persistent grids on GPUs (moe_comm's ``num_sms``)."""
        if new_num_sms < 1:
            raise ValueError(f"num_sms must be positive, got {new_num_sms}")
        Buffer.num_sms = int(new_num_sms)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Bytes of moe_comm's low-latency workspace for these sizes (bf16)."""
        return moe_comm.Buffer.low_latency_workspace_bytes(
            num_ranks, hidden, num_experts, num_max_dispatch_tokens_per_rank)

    def get_local_buffer_tensor(self, dtype: torch.dtype, size=None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """The low-latency workspace (DeepEP's RDMA buffer: ``use_rdma_buffer=True``, a Buffer
        built with ``low_latency_mode`` and ``enable_shrink``) as ``dtype`` from byte ``offset``
        (``size``: a shape; default all that follows), a view. Its layout is moe_comm's, not
        DeepEP's; what a caller may do with it is zero it with no call in flight and then, on
        every live rank, ``low_latency_clean_mask_buffer()`` (vLLM's ``clean_buffers``), which
        sets the epochs and acknowledgements again. The view starts after the normal mode's
        signal words and the fault-tolerance words that clean exchanges (a rank zeroing them
        after a faster peer announced itself there would erase the announcement). The other
        workspaces have no call that sets them up again after a zeroing: refused::

            seg = workspace bytes of this rank after its fault-tolerance words
            return seg[offset:].view(dtype)[:prod(size)].view(size)
        """
        self._check_alive()
        if not (use_rdma_buffer and self.low_latency_mode and self.enable_shrink):
            raise _unsupported("get_local_buffer_tensor hands out the low-latency workspace "
                               "of a Buffer built with low_latency_mode=True and "
                               "enable_shrink=True (use_rdma_buffer=True) only: after a zeroing "
                               "low_latency_clean_mask_buffer() sets it up again; the other "
                               "workspaces have no such call")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        buf = self._low_latency
        if buf is None:
            raise RuntimeError("moe_comm builds the low-latency workspace at the first "
                               "low_latency_dispatch (it needs the sizes): call it first")
        seg = buf.heap.local[_after_fault_tolerance_words(buf.layout):]
        item = torch.empty((), dtype=dtype).element_size()
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 \
                or offset % item or offset > seg.numel():
            raise ValueError(f"offset must be a byte offset in [0, {seg.numel()}] and a multiple "
                             f"of {dtype}'s {item} bytes, got {offset!r}")
        room = (seg.numel() - offset) // item
        shape = (room,) if size is None else tuple(torch.Size(size))
        count = math.prod(shape)
        if count > room:
            raise ValueError(f"size {shape} needs {count * item} bytes; the workspace has "
                             f"{room * item} from offset {offset}")
        return seg[offset:offset + count * item].view(dtype).view(shape)

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    def destroy(self) -> None:
        """Releases the workspaces (collective, like DeepEP's)."""
        for buf in (self._normal, self._low_latency):
            if buf is not None:
                buf.close()
        self._normal = self._low_latency = None
        self._destroyed = True

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("moe_comm.deep_ep.Buffer: destroy() was called")

    @property
    def internode(self) -> bool:
        """The workspaces span several nodes (DeepEP's internode mode)."""
        return self.num_rdma_ranks > 1

    def _nodes(self) -> dict:
        """``moe_comm.Buffer`` arguments of the facade's nodes (none on one node)."""
        if not self.internode:
            return {}
        return dict(ranks_per_node=self.num_nvl_ranks, transport="nixl")

    # ----------------------------------------------------------------- normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event=None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """``(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [nodes] int32 across
        nodes (tokens with an expert on any rank of the node) else None, num_tokens_per_expert
        [E] int32, is_token_in_rank [T, R] bool, event)``, on the device, no host read."""
        self._check_alive()
        R = self.group_size
        topk_idx = checks.topk_idx(topk_idx)
        L = checks.num_experts(num_experts, R) // R
        _wait(previous_event)
        # ids outside [-1, E) count nowhere here; the dispatch reports them
        valid = (topk_idx >= 0) & (topk_idx < num_experts)
        ids = torch.where(valid, topk_idx, 0)
        per_expert = torch.zeros(num_experts, dtype=torch.int32, device=topk_idx.device)
        per_expert.index_add_(0, ids.flatten(),
                              valid.flatten().to(torch.int32))
        hits = torch.nn.functional.one_hot(ids // L, R).to(torch.bool) & valid[..., None]
        in_rank = hits.any(1)
        per_rank = in_rank.sum(0, dtype=torch.int32)
        per_node = None
        if self.internode:
            per_node = in_rank.view(-1, self.num_rdma_ranks, self.num_nvl_ranks).any(2) \
                .sum(0, dtype=torch.int32)
        return per_rank, per_node, per_expert, in_rank, EventOverlap(EventHandle())

    def _normal_buffer(self, tokens: int, topk: int, hidden: int, dtype: torch.dtype,
                       num_experts: int, device: torch.device) -> moe_comm.Buffer:
        """The normal-mode workspace, (re)built on every rank alike: the largest call agreed by
        an all-reduce over the group."""
        code = _DTYPES.index(dtype) if dtype in _DTYPES else -1
        sizes = torch.tensor([tokens, topk, hidden, num_experts, code], dtype=torch.int64,
                             device=device if dist.get_backend(self.group) == "nccl" else "cpu")
        lows = -sizes.clone()
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=self.group)
        dist.all_reduce(lows, op=dist.ReduceOp.MAX, group=self.group)
        T, K, H, E, top_code = sizes.tolist()
        if (H, E, top_code) != (-lows[2].item(), -lows[3].item(), -lows[4].item()) \
                or code < 0:
            raise ValueError(f"ranks disagree on hidden, num_experts or dtype (hidden up to "
                             f"{H}, num_experts up to {E}, this rank {dtype}): every rank must "
                             "pass the same, in one of " + ", ".join(map(str, _DTYPES)))
        buf = self._normal
        if buf is not None and buf.hidden == H and buf.num_experts == E and buf.dtype == dtype \
                and buf.max_tokens_per_rank >= T and buf.max_topk >= K:
            return buf
        if buf is not None:
            T = max(T, buf.max_tokens_per_rank)
            buf.close()
        self._normal = moe_comm.Buffer(
            self.group, hidden=H, num_experts=E, max_tokens_per_rank=max(1, T), dtype=dtype,
            max_topk=K, device=device, num_sms=Buffer.num_sms if device.type == "cuda" else None,
            ep_invariant=self.ep_invariant, **self._nodes())
        return self._normal

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config=None, previous_event=None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event)``; with ``handle`` (a cached dispatch) only ``recv_x`` and the event."""
        self._check_alive()
        _wait(previous_event)
        if handle is not None:
            return self._cached_dispatch(x, handle)
        if topk_idx is None:
            raise _unsupported("a dispatch without topk_idx (routing by is_token_in_rank "
                               "alone) is not supported: pass topk_idx, or a handle")
        pair = isinstance(x, tuple)
        try:
            rows = checks.rows(x)
            if not pair:
                checks.float_rows(rows, _DTYPES)
            topk_idx = checks.topk_idx(topk_idx)
            topk_weights = checks.weights(topk_weights, topk_idx)
            checks.tokens_match(rows, topk_idx)
            if num_tokens_per_expert is None:
                raise ValueError("num_tokens_per_expert (from get_dispatch_layout) is needed")
        except (TypeError, ValueError) as error:
            self._refuse_dispatch(error)
            raise
        T, H = rows.shape
        num_experts = num_tokens_per_expert.numel()
        dtype = torch.bfloat16 if pair else rows.dtype
        buf = self._normal_buffer(T, topk_idx.shape[1], H, dtype, num_experts, rows.device)
        by_slot = buf.rounds == 1  # rows arrive in DeepEP's order: no copy here
        with torch.no_grad():
            res = (buf.dispatch_by_slot if by_slot else buf.dispatch)(
                x, topk_idx, topk_weights, expert_alignment=expert_alignment)
        h = res.handle
        # received slots: one per (source, token)
        n = res.x.shape[0] if by_slot else int(h.recv_slot_offsets[-1])
        choice_rows = h.slot_rows[:n].to(torch.int64)  # [N, K] moe_comm row of each choice
        used = choice_rows >= 0
        first = torch.where(used, choice_rows, h.num_rows).amin(1)
        slot_row = torch.arange(n, dtype=torch.int32, device=first.device)
        if buf.rounds > 1:  # slots by round, then source, then token: DeepEP's is by source
            order = torch.argsort(res.src_rank[first] * buf.max_tokens_per_rank
                                  + res.src_token[first])
            first, choice_rows, used = first[order], choice_rows[order], used[order]
            slot_row = torch.empty_like(slot_row).index_copy_(0, order, slot_row)
        slot_rows = torch.full((h.slot_rows.shape[0], 1), -1, dtype=torch.int32,
                               device=first.device)
        slot_rows[:n, 0] = slot_row
        # in rounds the facade's one copy: expert-major rows to DeepEP's order
        recv_x = res.x if by_slot else res.x[first]
        local = torch.searchsorted(res.expert_offsets, choice_rows.clamp(min=0), right=True) - 1
        recv_idx = torch.where(used, local, -1)
        recv_w = None
        if res.weights is not None:
            recv_w = torch.where(used, res.weights[choice_rows.clamp(min=0)], 0.0)
        if pair:
            recv_x = (recv_x, res.x_scales if by_slot else res.x_scales[first])
        per_expert = (res.tokens_per_expert + expert_alignment - 1) // expert_alignment \
            * expert_alignment
        if num_worst_tokens:
            if n > num_worst_tokens:
                raise RuntimeError(f"{n} rows arrived but num_worst_tokens={num_worst_tokens}")
            recv_x, recv_idx, recv_w = _pad_rows(recv_x, recv_idx, recv_w, num_worst_tokens)
        out_handle = _NormalHandle(buf, h, first, choice_rows, slot_rows, n, h.num_rows)
        return (recv_x, recv_idx, recv_w, per_expert.tolist(), out_handle,
                EventOverlap(EventHandle()))

    def _refuse_dispatch(self, error: BaseException) -> None:
        """This rank's dispatch input is bad (``error``, raised next): where the peers go on into
        the call (a workspace exists), take part as they do, with no rows and a refusal, so
        theirs raises ``moe_comm.PeerInputError`` within the call (``Buffer._refuse_dispatch``)."""
        native = self._normal
        if native is not None:
            self._normal_buffer(0, 1, native.hidden, native.dtype, native.num_experts,
                                native.device)._refuse_dispatch(error)

    def _cached_dispatch(self, x, handle: _NormalHandle):
        checks.handle(handle, _NormalHandle, "dispatch")
        if isinstance(x, tuple):
            raise _unsupported("a cached dispatch of an FP8 pair is not supported (moe_comm's "
                               "cached dispatch moves rows of the Buffer's dtype)")
        buf, h, n = handle.buffer, handle.moe, handle.num_recv
        checks.cached_rows(checks.rows(x), h.num_tokens, buf.hidden, buf.dtype)
        dev, L = x.device, buf.num_local_experts
        one_group = torch.zeros(L, dtype=torch.int64, device=dev)
        one_group[0] = n
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev),
                             one_group.cumsum(0)])
        with torch.no_grad():
            recv_x = torch.ops.moe_comm.dispatch_cached(
                buf.id, x.contiguous(), h.slot_of, handle.slot_rows, h.recv_slot_offsets,
                one_group, offsets, n, *h.node_tensors())  # each slot straight to its row
        return recv_x, None, None, None, None, EventOverlap(EventHandle())

    def combine(self, x: torch.Tensor, handle: _NormalHandle, topk_weights=None, bias=None,
                config=None, previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """``(combined_x [T, H], combined_topk_weights [T, K] or None, event)``."""
        self._check_alive()
        _wait(previous_event)
        if bias is not None:
            raise _unsupported("combine(bias=...) is not supported: add the bias to the "
                               "output (DeepEP adds it before rounding)")
        checks.handle(handle, _NormalHandle, "dispatch")
        checks.rows(x)
        buf, h, n = handle.buffer, handle.moe, handle.num_recv
        if x.shape[1] != buf.hidden:
            raise ValueError(f"x has hidden {x.shape[1]}; the dispatch that made the handle "
                             f"moved {buf.hidden}")
        if x.shape[0] < n:
            raise ValueError(f"x has {x.shape[0]} rows; the dispatch that made the handle "
                             f"received {n}")
        if topk_weights is not None and (topk_weights.dim() != 2 or topk_weights.shape[0] < n):
            raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}; it must be "
                             f"[rows, num_topk] like the dispatch's recv_topk_weights")
        if x.dtype != buf.dtype:
            raise TypeError(f"x is {x.dtype}; the dispatch that made the handle moved {buf.dtype}")
        if topk_weights is None and not buf.ep_invariant:  # each slot's one row, in place
            with torch.no_grad():
                out, _ = torch.ops.moe_comm.combine(
                    buf.id, x[:n].contiguous(), None, None, h.slot_of, handle.slot_rows,
                    h.recv_slot_offsets, *h.node_tensors(), False, None, None)
            return out, None, EventOverlap(EventHandle())
        # per choice (weights; EP-invariant sums): moe_comm's expert-major rows
        y = torch.zeros((handle.rows, x.shape[1]), dtype=x.dtype, device=x.device)
        y[handle.first_row] = x[:n]  # one row per token: its other rows add zeros
        pair_values = None
        if topk_weights is not None:
            slot_rows = handle.choice_rows
            used = slot_rows >= 0
            w = topk_weights[:n].float()
            if bool((w[~used] != 0).any()):
                raise _unsupported("combine sums each token's weights of the choices local to "
                                   "each rank; topk_weights holds non-zero values where "
                                   "recv_topk_idx is -1 (DeepEP would add those too)")
            pair_values = torch.zeros(handle.rows, dtype=torch.float32, device=x.device)
            pair_values[slot_rows[used]] = w[used]
        with torch.no_grad():
            out, pair_out = torch.ops.moe_comm.combine(
                buf.id, y, None, pair_values, h.slot_of, h.slot_rows, h.recv_slot_offsets,
                *h.node_tensors(), False, h.topk_idx, h.src_token)  # (EP-invariant: not None)
        return out, pair_out if topk_weights is not None else None, EventOverlap(EventHandle())

    # ----------------------------------------------------------------- low-latency mode
    def _low_latency_buffer(self, max_tokens: int, hidden: int, num_experts: int,
                            dtype: torch.dtype, device: torch.device) -> moe_comm.Buffer:
        buf = self._low_latency
        if buf is not None:
            if (buf.max_tokens_per_rank, buf.hidden, buf.num_experts, buf.dtype) != \
                    (max_tokens, hidden, num_experts, dtype):
                raise ValueError("low_latency_dispatch sizes changed (num_max_dispatch_tokens_"
                                 "per_rank, hidden, num_experts, dtype): build a new Buffer")
            return buf
        if not self.low_latency_mode:
            raise RuntimeError("this Buffer was built with low_latency_mode=False")
        self._low_latency = moe_comm.Buffer(
            self.group, hidden=hidden, num_experts=num_experts, max_tokens_per_rank=max_tokens,
            dtype=dtype, max_topk=min(16, num_experts), low_latency=True, device=device,
            fault_tolerant=self.enable_shrink, ep_invariant=self.ep_invariant, **self._nodes())
        return self._low_latency

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False,
                             use_nvfp4: bool = False, x_global_scale=None):
        """``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` [L, R * T_max, H] (FP8:
        the pair (codes, column-major scales [L, R * T_max, H/128], or packed UE8M0 int32 with
        ``use_ue8m0``)), ``recv_count`` [L] int32; ``hook`` receives (``return_recv_hook``),
        else the call has received and ``hook`` is None."""
        self._check_alive()
        if use_nvfp4 or x_global_scale is not None:  # (DeepEP's hybrid-ep branch, SGLang, vLLM)
            raise _unsupported("use_nvfp4 / x_global_scale: the NVFP4 layout of DeepEP's "
                               "hybrid-ep branch (rows as [R*T, H/2, L], swizzled scales for "
                               "CuTe-DSL) is not reproduced; moe_comm.Buffer(..., "
                               "dispatch_dtype='nvfp4') has moe_comm's NVFP4 low-latency "
                               "dispatch")
        if dispatch_wait_recv_cost_stats is not None:
            raise _unsupported("dispatch_wait_recv_cost_stats (GPU cycles per source) is not "
                               "recorded; on CPU ranks recv.source_wait_s has the seconds")
        if round_scale and not use_ue8m0:
            raise _unsupported("round_scale without use_ue8m0 (power-of-two scales kept as "
                               "float32) is not supported")
        try:
            if use_ue8m0 and not round_scale:
                raise ValueError("use_ue8m0 needs round_scale=True (as in DeepEP)")
            checks.float_rows(checks.rows(x), _DTYPES)
            topk_idx = checks.topk_idx(topk_idx)
            checks.tokens_match(x, topk_idx)
            checks.num_experts(num_experts, self.group_size)
            buf = self._low_latency_buffer(num_max_dispatch_tokens_per_rank, x.shape[1],
                                           num_experts, x.dtype, x.device)
        except (TypeError, ValueError) as error:
            if self._low_latency is not None:  # the peers go on into the call: take part
                self._low_latency.ll_engine.refuse_dispatch(error)
            raise
        recv, hook = buf.low_latency_dispatch(
            x, topk_idx, fp8=use_fp8, ue8m0=use_ue8m0, col_major_scales=use_fp8,
            cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
            return_hook=True)
        if not return_recv_hook:
            hook()
            hook = None
        recv_x = (recv.x, recv.x_scales) if use_fp8 else recv.x
        return (recv_x, recv.count, _LowLatencyHandle(buf, recv.handle),
                EventOverlap(EventHandle()), hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: _LowLatencyHandle,
                            use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats=None):
        """``(combined_x [T, H], event, hook)``: ``out[t] = sum_k w[t, k] * x_row(t, k)``
        (fp32, choice order, rounded once). ``zero_copy``: ``x`` is
        ``get_next_low_latency_combine_buffer(handle)`` (moe_comm reads any ``x`` in place)."""
        self._check_alive()
        if use_logfmt:
            raise _unsupported("use_logfmt (DeepEP's LogFMT combine encoding) is not supported")
        if combine_wait_recv_cost_stats is not None:
            raise _unsupported("combine_wait_recv_cost_stats (GPU cycles per source) is not "
                               "recorded")
        try:
            checks.handle(handle, _LowLatencyHandle, "low_latency_dispatch")
            topk_idx = checks.topk_idx(topk_idx)
            topk_weights = checks.weights(topk_weights, topk_idx)
            checks.out_rows(out, topk_idx.shape[0], handle.buffer.hidden, handle.buffer.dtype,
                            handle.buffer.device)
        except (TypeError, ValueError) as error:
            if self._low_latency is not None:  # the peers go on into the call: take part
                self._low_latency.ll_engine.refuse_combine(error)
            raise
        # a contiguous out is written by the receive itself; another gets a copy of the sums
        copied = out is not None and not out.is_contiguous()
        result, hook = handle.buffer.low_latency_combine(
            x, topk_idx, topk_weights, handle.moe, return_hook=True,
            out=None if copied else out)

        def receive():
            hook()
            if copied:
                out.copy_(result)

        if not return_recv_hook:
            receive()
            receive = None
        return (out if out is not None else result), EventOverlap(EventHandle()), receive

    def get_next_low_latency_combine_buffer(self, handle: _LowLatencyHandle) -> torch.Tensor:
        return checks.handle(handle, _LowLatencyHandle,
                             "low_latency_dispatch").buffer.low_latency_combine_buffer()

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Runs every low-latency receive whose hook was not called, oldest first (``moe_comm``
        ``Buffer.clean_low_latency_buffer``), so that no call is left half done; call it on
        every rank. The signals need no reset: they are epochs that only grow."""
        self._check_alive()
        if self._low_latency is not None:
            self._low_latency.clean_low_latency_buffer()

    # ----------------------------------------------------------------- masks (enable_shrink)
    def _shrinkable(self) -> moe_comm.Buffer:
        if not self.enable_shrink:
            raise RuntimeError("the mask calls need Buffer(..., enable_shrink=True)")
        if self._low_latency is None:
            raise RuntimeError("moe_comm builds the low-latency workspace at the first "
                               "low_latency_dispatch (it needs the sizes): call it first")
        return self._low_latency

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """``mask=True`` excludes the rank on every rank (``moe_comm`` ``mask_rank``)."""
        buf = self._shrinkable()
        if not mask:
            raise _unsupported("unmasking one rank is not supported: "
                               "low_latency_clean_mask_buffer() takes every live rank back")
        buf.mask_rank(int(rank_to_mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Fills ``mask_status`` [R] int32 with DeepEP's polarity: 1 = masked."""
        mask_status.copy_((~self._shrinkable().active_ranks()).to(mask_status.dtype))

    def low_latency_clean_mask_buffer(self) -> None:
        """Every rank active again: collective over the live ranks (``clean_mask(readmit=
        True)``; DeepEP's is local, here every live rank must call it)."""
        self._shrinkable().clean_mask(readmit=True)


def _after_fault_tolerance_words(layout) -> int:
    """The byte offset where the workspace's regions after ``ft_*`` begin (those come after
    the normal mode's signal, ticket and epoch words)."""
    ends = [layout.offset(name) + region.nbytes for name, region in layout.regions.items()
            if name.startswith("ft_")]
    if not ends:
        raise ValueError("a fault-tolerant workspace has ft_* regions")
    return max(ends)


def _pad_rows(recv_x, recv_idx, recv_w, rows: int):
    """Pads DeepEP's outputs to ``rows`` (``num_worst_tokens``): zero rows, -1 ids, 0 weights."""
    def pad(t, value):
        out = torch.full((rows, *t.shape[1:]), value, dtype=t.dtype, device=t.device)
        out[:t.shape[0]] = t
        return out

    if isinstance(recv_x, tuple):
        recv_x = (pad(recv_x[0].view(torch.uint8), 0).view(recv_x[0].dtype), pad(recv_x[1], 0))
    else:
        recv_x = pad(recv_x, 0)
    return recv_x, pad(recv_idx, -1), None if recv_w is None else pad(recv_w, 0.0)
