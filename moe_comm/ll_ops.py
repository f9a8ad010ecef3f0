"""The low-latency mode as four torch.library custom ops, for ``torch.compile(fullgraph=True)``.

A send and its receive are separate ops, so a compiled graph can hold other work between them::

    from moe_comm import ll_ops

    @torch.compile(fullgraph=True, options={"reorder_for_peak_memory": False})
    def layer(x, topk_idx, topk_weights, h):
        sent = ll_ops.dispatch_send(buf, x, topk_idx, fp8=True)
        h = shared_expert(h)                             # runs while the rows travel
        recv = ll_ops.dispatch_recv(buf, sent, after=[h])        # a LowLatencyRecv
        y = experts(recv.x, recv.x_scales, recv.count)          # [L, R * T_max, H]
        sent = ll_ops.combine_send(buf, y, topk_idx, topk_weights, recv.handle)
        h = more_work(h)
        return ll_ops.combine_recv(buf, sent, after=[h]) + h    # [T, H]

Ops (``buffer_id``, a string, names the Buffer and is a constant of a compiled graph; each op is
collective over the Buffer's ranks, as ``Buffer.low_latency_dispatch`` / ``_combine`` are):

* ``moe_comm::ll_dispatch_send(buffer_id, x, topk_idx, fp8, ue8m0=False,
  col_major_scales=False, dispatch_dtype=None, global_scale=None)`` -> ticket: runs
  ``low_latency_dispatch(..., return_hook=True)`` and keeps its hook on the Buffer under the
  call's serial.
* ``moe_comm::ll_dispatch_recv(buffer_id, ticket, after, fp8, ue8m0=False,
  col_major_scales=False, dispatch_dtype=None)`` -> ``(x, x_scales, x_global_scale, count,
  src_info, layout, src_k)``: runs that hook. Shapes as in ``LowLatencyRecv`` and
  ``LowLatencyHandle``, fixed by the Buffer: ``x`` [L, R * T_max, H] (NVFP4: [L, R * T_max,
  H/2] uint8), ``x_scales`` as the format gives them ([0] float32 without FP8),
  ``x_global_scale`` [L, R * T_max] (NVFP4; [0] float32 otherwise), ``count`` [L], ``src_info``
  and ``src_k`` [L, R * T_max], ``layout`` [L, R, 2] (int32). The format arguments must be the
  send's (they fix the shapes a compiler sees; the receive checks them).
* ``moe_comm::ll_combine_send(buffer_id, y, topk_idx, topk_weights, layout, src_info, src_k,
  fp8=False, renormalize=False)`` -> ticket: ``low_latency_combine(..., return_hook=True)``
  with the handle's three tensors (``fp8``: ``combine_dtype="fp8"``).
* ``moe_comm::ll_combine_recv(buffer_id, ticket, topk_idx, topk_weights, after)`` -> out
  [T, H]: runs that hook. ``topk_idx`` and ``topk_weights`` are the send's: the receive sums
  with them, and as inputs of this op a compiler keeps them alive (and unchanged) until it ran.

``after`` (Tensor[], read by nobody): tensors the receive waits for in the graph, so that the
work computing them runs before it (inductor otherwise moves work that the receive does not
need to where the tensors are used, often past the receive). Inductor's
``reorder_for_peak_memory`` (on by default) may still hoist that work above the send; compile
with ``options={"reorder_for_peak_memory": False}`` to keep the program's order.

A ticket is [2] int64 on the CPU, ``(channel, serial)``: the receive reads it on the host
(no device synchronisation) and finds the send's hook by it, so the two calls in flight per
channel that the low-latency mode allows (``low_latency.IN_FLIGHT``) are received each by its
own ticket. A receive without its send, or a second receive of one ticket, raises naming the
serial. The receives return the send's outputs (new, or its parity's earlier ones once
nothing refers to them: ``Buffer.low_latency_dispatch``), filled by the receive.

Order: the four ops are registered as ordered side effects (``EffectType.ORDERED``): a compiled
graph threads one effect token through them, so no pass drops, merges or reorders them against
each other, and every rank runs its collectives in program order. The ops have no autograd
(the low-latency mode serves inference), run on the host between kernels (no CUDA graphs:
the receive finds its hook by the ticket), and take no ``cumulative_local_expert_recv_stats``
(an in-place update) and no ``scale_layout="swizzled"``; ``Buffer.low_latency_dispatch`` has
both outside a graph.
"""
from typing import NamedTuple

import torch
from torch import Tensor

from ._registry import lookup
from .kernels.quant import NVFP4, scale_group
from .low_latency import CHANNEL_NAMES, LowLatencyHandle, LowLatencyRecv, _ll_scales_out
from .validation import combine_is_fp8, scale_code
from .workspace import COMBINE, DISPATCH


def _ticket(channel: int, serial: int) -> Tensor:
    return torch.tensor([channel, serial], dtype=torch.int64)


def _take(buf, ticket: Tensor, channel: int, static: tuple):
    """The send's entry ``(result, hook, static)`` for ``ticket``, removed (a receive runs
    once). ``static``: what fixes the receive's shapes (the dispatch's format, the combine's
    token count) as the receive was given it; checked first, so a refused receive can be made
    again."""
    what = CHANNEL_NAMES[channel]
    if ticket.dtype != torch.int64 or ticket.shape != (2,):
        raise ValueError(f"ticket must be the [2] int64 tensor ll_{what}_send returned, got "
                         f"{ticket.dtype} {tuple(ticket.shape)}")
    kind, serial = ticket.tolist()
    if kind != channel:
        raise ValueError(f"ll_{what}_recv got a ticket of ll_{CHANNEL_NAMES.get(kind, kind)}_send")
    pending = buf.ll_engine.pending_ops
    entry = pending.get((channel, serial))
    if entry is None:
        raise RuntimeError(f"no low-latency {what} send with serial {serial} waits for its "
                           f"receive on this Buffer (rank {buf.rank}): each ll_{what}_recv runs "
                           f"once, after the ll_{what}_send whose ticket it takes")
    if static != entry[2]:
        names = ("(fp8, ue8m0, col_major_scales, dispatch_dtype)" if channel == DISPATCH else
                 "(tokens,)")
        raise ValueError(f"ll_{what}_recv was given {names} = {static}; its send had "
                         f"{entry[2]}")
    del pending[(channel, serial)]
    return entry


def _ordered(op) -> None:
    """Registers ``op`` as an ordered side effect (see the module's docstring)."""
    try:
        from torch._library.effects import EffectType
    except ImportError:  # older torch
        from torch._higher_order_ops.effects import _EffectType as EffectType
    if hasattr(op, "register_effect"):
        op.register_effect(EffectType.ORDERED)
    else:  # older torch: the effect registry of the higher-order ops
        from torch._higher_order_ops.effects import _register_effectful_op

        _register_effectful_op(op._opoverload, EffectType.ORDERED)


# ----------------------------------------------------------------- dispatch
@torch.library.custom_op("moe_comm::ll_dispatch_send", mutates_args=())
def ll_dispatch_send_op(buffer_id: str, x: Tensor, topk_idx: Tensor, fp8: bool,
                        ue8m0: bool = False, col_major_scales: bool = False,
                        dispatch_dtype: str | None = None,
                        global_scale: Tensor | None = None) -> Tensor:
    buf = lookup(buffer_id)
    recv, hook = buf.low_latency_dispatch(x, topk_idx, fp8=fp8, ue8m0=ue8m0,
                                          col_major_scales=col_major_scales,
                                          dispatch_dtype=dispatch_dtype,
                                          global_scale=global_scale, return_hook=True)
    serial = recv.handle.serial
    buf.ll_engine.pending_ops[(DISPATCH, serial)] = (recv, hook, (fp8, ue8m0, col_major_scales,
                                                      dispatch_dtype))
    return _ticket(DISPATCH, serial)


@ll_dispatch_send_op.register_fake
def _(buffer_id, x, topk_idx, fp8, ue8m0=False, col_major_scales=False, dispatch_dtype=None,
      global_scale=None):
    return torch.empty((2,), dtype=torch.int64)


@torch.library.custom_op("moe_comm::ll_dispatch_recv", mutates_args=())
def ll_dispatch_recv_op(buffer_id: str, ticket: Tensor, after: list[Tensor], fp8: bool,
                        ue8m0: bool = False,
                        col_major_scales: bool = False, dispatch_dtype: str | None = None
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    buf = lookup(buffer_id)
    recv, hook, _ = _take(buf, ticket, DISPATCH, (fp8, ue8m0, col_major_scales, dispatch_dtype))
    hook()

    def or_empty(t):  # (each output a tensor of its own)
        return recv.count.new_empty((0,), dtype=torch.float32) if t is None else t

    return (recv.x, or_empty(recv.x_scales), or_empty(recv.x_global_scale), recv.count,
            recv.src_info, recv.handle.layout, recv.handle.src_k)


@ll_dispatch_recv_op.register_fake
def _(buffer_id, ticket, after, fp8, ue8m0=False, col_major_scales=False,
      dispatch_dtype=None):
    buf = lookup(buffer_id)
    L, R, T, H = (buf.num_local_experts, buf.world_size, buf.max_tokens_per_rank, buf.hidden)
    rows, dev, i32 = R * T, buf.device, torch.int32
    code = scale_code(dispatch_dtype, ue8m0)
    nvfp4 = fp8 and code == NVFP4
    x = (torch.empty((L, rows, H // 2), dtype=torch.uint8, device=dev) if nvfp4 else
         torch.empty((L, rows, H), dtype=torch.float8_e4m3fn if fp8 else buf.dtype, device=dev))
    scales = (_ll_scales_out(L, rows, H // scale_group(code), code, col_major_scales, dev)[0]
              if fp8 else torch.empty((0,), dtype=torch.float32, device=dev))
    glob = torch.empty((L, rows) if nvfp4 else (0,), dtype=torch.float32, device=dev)
    return (x, scales, glob, torch.empty((L,), dtype=i32, device=dev),
            torch.empty((L, rows), dtype=i32, device=dev),
            torch.empty((L, R, 2), dtype=i32, device=dev),
            torch.empty((L, rows), dtype=i32, device=dev))


# ----------------------------------------------------------------- combine
@torch.library.custom_op("moe_comm::ll_combine_send", mutates_args=())
def ll_combine_send_op(buffer_id: str, y: Tensor, topk_idx: Tensor, topk_weights: Tensor | None,
                       layout: Tensor, src_info: Tensor, src_k: Tensor, fp8: bool = False,
                       renormalize: bool = False) -> Tensor:
    buf = lookup(buffer_id)
    # the receive's outputs exist only once it ran: the handle's dispatch was received
    handle = LowLatencyHandle(buf.id, -1, layout, src_info, src_k, topk_idx.shape[0],
                              topk_idx.shape[1], received=True)
    out, hook = buf.low_latency_combine(y, topk_idx, topk_weights, handle, return_hook=True,
                                        renormalize=renormalize,
                                        combine_dtype="fp8" if fp8 else None)
    serial = buf.channels.ll_epochs[COMBINE]
    buf.ll_engine.pending_ops[(COMBINE, serial)] = (out, hook, (topk_idx.shape[0],))
    return _ticket(COMBINE, serial)


@ll_combine_send_op.register_fake
def _(buffer_id, y, topk_idx, topk_weights, layout, src_info, src_k, fp8=False,
      renormalize=False):
    return torch.empty((2,), dtype=torch.int64)


@torch.library.custom_op("moe_comm::ll_combine_recv", mutates_args=())
def ll_combine_recv_op(buffer_id: str, ticket: Tensor, topk_idx: Tensor,
                       topk_weights: Tensor | None, after: list[Tensor]) -> Tensor:
    buf = lookup(buffer_id)
    out, hook, _ = _take(buf, ticket, COMBINE, (topk_idx.shape[0],))
    hook()
    return out


@ll_combine_recv_op.register_fake
def _(buffer_id, ticket, topk_idx, topk_weights, after):
    buf = lookup(buffer_id)
    return torch.empty((topk_idx.shape[0], buf.hidden), dtype=buf.dtype, device=buf.device)


for _op in (ll_dispatch_send_op, ll_dispatch_recv_op, ll_combine_send_op, ll_combine_recv_op):
    _ordered(_op)


# ----------------------------------------------------------------- Python API
class DispatchTicket(NamedTuple):
    """What ``dispatch_send`` returns: the op's ticket and the call's static arguments."""

    ticket: Tensor
    fp8: bool
    ue8m0: bool
    col_major_scales: bool
    dispatch_dtype: str | None
    num_tokens: int
    topk: int


class CombineTicket(NamedTuple):
    """What ``combine_send`` returns: the op's ticket and the routing its receive sums with."""

    ticket: Tensor
    topk_idx: Tensor
    topk_weights: Tensor | None


def dispatch_send(buf, x: Tensor, topk_idx: Tensor, *, fp8: bool = True, ue8m0: bool = False,
                  col_major_scales: bool = False, dispatch_dtype: str | None = None,
                  global_scale: Tensor | None = None) -> DispatchTicket:
    """The send of ``buf.low_latency_dispatch`` (same arguments) as ``moe_comm::ll_dispatch_send``;
    pass the result to ``dispatch_recv``."""
    ticket = torch.ops.moe_comm.ll_dispatch_send(buf.id, x, topk_idx, fp8, ue8m0,
                                                 col_major_scales, dispatch_dtype, global_scale)
    return DispatchTicket(ticket, fp8, ue8m0, col_major_scales, dispatch_dtype,
                          topk_idx.shape[0], topk_idx.shape[1])


def dispatch_recv(buf, sent: DispatchTicket, after: list[Tensor] | tuple = ()
                  ) -> LowLatencyRecv:
    """The receive of the dispatch ``sent`` (``moe_comm::ll_dispatch_recv``): a LowLatencyRecv
    whose ``handle`` goes to ``combine_send`` (or to ``buf.low_latency_combine``);
    ``x_scales`` / ``x_global_scale`` None where the format has none; ``source_wait_s`` None.
    ``after``: tensors whose work runs before the receive (see the module's docstring)."""
    x, scales, glob, count, src_info, layout, src_k = torch.ops.moe_comm.ll_dispatch_recv(
        buf.id, sent.ticket, list(after), sent.fp8, sent.ue8m0, sent.col_major_scales,
        sent.dispatch_dtype)
    nvfp4 = sent.fp8 and sent.dispatch_dtype == "nvfp4"
    handle = LowLatencyHandle(buf.id, -1, layout, src_info, src_k, sent.num_tokens, sent.topk,
                              received=True)
    return LowLatencyRecv(x, scales if sent.fp8 else None, count, src_info, handle,
                          x_global_scale=glob if nvfp4 else None)


def combine_send(buf, y: Tensor, topk_idx: Tensor, topk_weights: Tensor | None,
                 handle: LowLatencyHandle, *, combine_dtype: str | torch.dtype | None = None,
                 renormalize: bool = False) -> CombineTicket:
    """The send of ``buf.low_latency_combine`` (same arguments; ``handle`` from
    ``dispatch_recv`` or ``low_latency_dispatch``) as ``moe_comm::ll_combine_send``; pass the
    result to ``combine_recv``."""
    fp8 = combine_is_fp8(combine_dtype, dtype=buf.dtype, hidden=buf.hidden,
                         ep_invariant=buf.ep_invariant)
    ticket = torch.ops.moe_comm.ll_combine_send(buf.id, y, topk_idx, topk_weights,
                                                handle.layout, handle.src_info, handle.src_k,
                                                fp8, renormalize)
    return CombineTicket(ticket, topk_idx, topk_weights)


def combine_recv(buf, sent: CombineTicket, after: list[Tensor] | tuple = ()) -> Tensor:
    """The receive of the combine ``sent`` (``moe_comm::ll_combine_recv``): out [T, H];
    ``after`` as in ``dispatch_recv``."""
    return torch.ops.moe_comm.ll_combine_recv(buf.id, sent.ticket, sent.topk_idx,
                                              sent.topk_weights, list(after))
