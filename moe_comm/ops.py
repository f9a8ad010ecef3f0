"""torch.library custom ops (with fake implementations) and the autograd Functions over them.

Ops (each one collective over the Buffer's ranks; ``buffer_id``, a string, names the Buffer
and is a constant of a compiled graph):

* ``moe_comm::dispatch(buffer_id, x, x_scales?, topk_idx, topk_weights?, expert_alignment, fp8,
  ue8m0, col_major_scales, max_recv_rows?)`` -> received rows, their FP8 scales (empty unless
  fp8; ``ue8m0`` 0 float32 per 128 channels, 1 packed exponents per 128, 2 MXFP8 E8M0 per
  32, 3 NVFP4 e4m3 per 16 with the rows packed [rows, H/2] uint8), weights, src_rank,
  src_token, tokens_per_expert, expert_offsets, the handle tensors (slot_of, slot_rows,
  recv_slot_offsets, and for the hierarchical mode node_slot_of, fwd_slots, fwd_n: empty
  otherwise), then the NVFP4 rows' global scales [rows] float32 (empty otherwise). With
  ``max_recv_rows`` the output shapes are static (no host synchronisation).
  ``dispatch_cached`` and ``combine`` take the three node tensors last (optional).
* ``moe_comm::dispatch_cached(buffer_id, x, slot_of, slot_rows, recv_slot_offsets,
  tokens_per_expert, expert_offsets, num_rows)`` -> rows: the same movement as an earlier
  dispatch, data only (backward of combine).
* ``moe_comm::combine(buffer_id, y, weights?, pair_values?, slot_of, slot_rows,
  recv_slot_offsets, ..., fp8=False, topk_idx?, src_token?)`` -> (out [T, H], pair_out [T, K]
  or [0]); ``fp8``: the partials travel as FP8 per 128 channels; ``topk_idx`` (home side) and
  ``src_token`` (expert side) from the dispatch: an EP-invariant Buffer's combine needs them.

Backward: dispatch's is ``combine(grad_rows)`` with the row-weight gradients riding along as
``pair_values`` (each (token, choice) lives on exactly one rank, so summing over ranks returns
it exactly); combine's is ``dispatch_cached(grad_out)``, then ``grad_y = w * grad_rows`` and
``grad_w = <grad_rows, y>`` on the expert's rank. Backward calls are collective too: every rank
must run the backward of every op (as they do when all ranks train the same model).

Eager calls run each op's body (``run_dispatch``, ``run_combine``, ``run_dispatch_cached``;
an eager backward, the ops' implementations ``combine_impl``, ``dispatch_cached_impl``) in
place of the op, under the autograd Function where autograd records them and alone where it
does not: the op adds host time only. The op runs where something needs it (``path``):
torch.compile's traces, fake or meta tensors (its fake), a dispatch or function mode watching.

EP-invariant Buffers (``Buffer(..., ep_invariant=True)``): both combines (the forward one and
the dispatch's backward) sum each token's choices in choice order (``kernels.invariant``), and
``grad_w`` is ``row_dot(..., fixed_order=True)``: so ``grad_x``, ``grad_y``, ``grad_w`` and the
router weights' gradient have the same bits at any EP size and placement.
"""
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._registry import lookup
from .kernels.quant import NVFP4
from .types import DispatchHandle, DispatchOutputs, DispatchResult
from .validation import check_cached_rows


@torch.library.custom_op("moe_comm::dispatch", mutates_args=())
def dispatch_op(buffer_id: str, x: Tensor, x_scales: Optional[Tensor], topk_idx: Tensor,
                topk_weights: Optional[Tensor], expert_alignment: int, fp8: int, ue8m0: int,
                col_major_scales: bool, max_recv_rows: Optional[int]
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                           Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    buf = lookup(buffer_id)
    buf._ready()  # (a compiled graph's call: nothing checked the Buffer before)
    return tuple(run_dispatch(buf, x, x_scales, topk_idx, topk_weights, expert_alignment, fp8,
                              ue8m0, col_major_scales, max_recv_rows))


def run_dispatch(buf, x, x_scales, topk_idx, topk_weights, expert_alignment, fp8, ue8m0,
                 col_major_scales, max_recv_rows) -> DispatchOutputs:
    """What ``moe_comm::dispatch`` runs on the Buffer ``buf`` once it is checked
    (``Buffer._ready``): its send, then its receive."""
    engine = buf.normal_engine
    pending = engine.dispatch_send(x, topk_idx, topk_weights, x_scales, fp8, ue8m0,
                                   expert_alignment)
    outs = engine.dispatch_recv(pending, expert_alignment, col_major_scales, max_recv_rows)
    buf._raise_input_errors("dispatch")
    return outs


@dispatch_op.register_fake
def _(buffer_id, x, x_scales, topk_idx, topk_weights, expert_alignment, fp8, ue8m0,
      col_major_scales, max_recv_rows):
    buf = lookup(buffer_id)
    ctx = torch.library.get_ctx()
    rows = ctx.new_dynamic_size() if max_recv_rows is None else max_recv_rows
    slots = buf.world_size * buf.max_tokens_per_rank
    T, K = topk_idx.shape
    R, L, H = buf.world_size, buf.num_local_experts, x.shape[1]
    i64, i32 = torch.int64, torch.int32
    nvfp4 = bool(fp8) and ue8m0 == NVFP4
    if fp8 == 2 and nvfp4:  # x: packed values
        H *= 2
    if fp8 and ue8m0 == 2:  # MXFP8: E8M0 bytes per 32 channels
        scales = x.new_empty((rows, H // 32), dtype=torch.float8_e8m0fnu)
    elif nvfp4:  # NVFP4: e4m3 bytes per 16 channels
        scales = x.new_empty((rows, H // 16), dtype=torch.float8_e4m3fn)
    elif fp8:
        groups = H // 128
        width = (groups + 3) // 4 if ue8m0 else groups
        sdt = i32 if ue8m0 else torch.float32
        scales = (x.new_empty((width, rows), dtype=sdt).t() if col_major_scales
                  else x.new_empty((rows, width), dtype=sdt))
    else:
        scales = x.new_empty((0,), dtype=torch.float32)
    recv_x = (x.new_empty((rows, H // 2), dtype=torch.uint8) if nvfp4 else
              x.new_empty((rows, H), dtype=torch.float8_e4m3fn if fp8 else buf.dtype))
    node_slot_of, fwd_slots, fwd_n = _node_fakes(buf, x, T)
    return tuple(DispatchOutputs(
        x=recv_x, scales=scales,
        weights=x.new_empty((rows if topk_weights is not None else 0,), dtype=torch.float32),
        src_rank=x.new_empty((rows,), dtype=i64), src_token=x.new_empty((rows,), dtype=i64),
        tokens_per_expert=x.new_empty((L,), dtype=i64),
        expert_offsets=x.new_empty((L + 1,), dtype=i64),
        slot_of=x.new_empty((T, R), dtype=i32), slot_rows=x.new_empty((slots, K), dtype=i32),
        slot_offsets=x.new_empty((buf.normal_engine.slot_offsets_size,), dtype=i64),
        node_slot_of=node_slot_of, fwd_slots=fwd_slots, fwd_n=fwd_n,
        global_scale=x.new_empty((rows if nvfp4 else 0,), dtype=torch.float32)))


def _node_fakes(buf, x, T):
    """node_slot_of [T, M], fwd_slots [rounds * M, W, N], fwd_n [rounds * S] (int32; empty
    unless the Buffer is hierarchical; ``NormalEngine.forward_slot_shapes``)."""
    i32 = torch.int32
    if not buf.hierarchical:
        return tuple(x.new_empty((0,), dtype=i32) for _ in range(3))
    slots, counts = buf.normal_engine.forward_slot_shapes()
    return (x.new_empty((T, buf.num_nodes), dtype=i32), x.new_empty(slots, dtype=i32),
            x.new_empty(counts, dtype=i32))


def dispatch_cached_impl(buffer_id: str, x: Tensor, slot_of: Tensor, slot_rows: Tensor,
                         recv_slot_offsets: Tensor, tokens_per_expert: Tensor,
                         expert_offsets: Tensor, num_rows: int,
                         node_slot_of: Optional[Tensor] = None,
                         fwd_slots: Optional[Tensor] = None,
                         fwd_n: Optional[Tensor] = None) -> Tensor:
    """``moe_comm::dispatch_cached``'s implementation (an eager backward calls it in place of
    the op): the Buffer checked, then :func:`run_dispatch_cached`."""
    buf = lookup(buffer_id)
    buf._ready()
    return run_dispatch_cached(buf, x, slot_of, slot_rows, recv_slot_offsets, tokens_per_expert,
                               expert_offsets, num_rows, node_slot_of, fwd_slots, fwd_n)


dispatch_cached_op = torch.library.custom_op("moe_comm::dispatch_cached", dispatch_cached_impl,
                                             mutates_args=())


def run_dispatch_cached(buf, x, slot_of, slot_rows, recv_slot_offsets, tokens_per_expert,
                        expert_offsets, num_rows, node_slot_of=None, fwd_slots=None,
                        fwd_n=None) -> Tensor:
    """What ``moe_comm::dispatch_cached`` runs on the Buffer ``buf`` once it is checked
    (``Buffer._ready``): the rows checked, its send, then its receive."""
    check_cached_rows(x, slot_of, hidden=buf.hidden, dtype=buf.dtype)
    engine = buf.normal_engine
    pending = engine.dispatch_cached_send(x, slot_of, node_slot_of)
    return engine.dispatch_cached_recv(pending, slot_rows, recv_slot_offsets, tokens_per_expert,
                                       expert_offsets, num_rows, fwd_slots, fwd_n)


@dispatch_cached_op.register_fake
def _(buffer_id, x, slot_of, slot_rows, recv_slot_offsets, tokens_per_expert, expert_offsets,
      num_rows, node_slot_of=None, fwd_slots=None, fwd_n=None):
    return x.new_empty((num_rows, x.shape[1]))


def combine_impl(buffer_id: str, y: Tensor, weights: Optional[Tensor],
                 pair_values: Optional[Tensor], slot_of: Tensor, slot_rows: Tensor,
                 recv_slot_offsets: Tensor, node_slot_of: Optional[Tensor] = None,
                 fwd_slots: Optional[Tensor] = None, fwd_n: Optional[Tensor] = None,
                 fp8: bool = False, topk_idx: Optional[Tensor] = None,
                 src_token: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """``moe_comm::combine``'s implementation (an eager backward calls it in place of the op):
    the Buffer checked, then :func:`run_combine`."""
    buf = lookup(buffer_id)
    buf._ready()  # (a compiled graph's call: nothing checked the Buffer before)
    buf._invariant_normal_mode()
    return run_combine(buf, y, weights, pair_values, slot_of, slot_rows, recv_slot_offsets,
                       node_slot_of, fwd_slots, fwd_n, fp8, topk_idx, src_token)


combine_op = torch.library.custom_op("moe_comm::combine", combine_impl, mutates_args=())


def run_combine(buf, y, weights, pair_values, slot_of, slot_rows, recv_slot_offsets,
                node_slot_of, fwd_slots, fwd_n, fp8, topk_idx, src_token) -> tuple:
    """What ``moe_comm::combine`` runs on the Buffer ``buf`` once it is checked
    (``Buffer._ready``, ``Buffer._invariant_normal_mode``): its send, then its receive."""
    if buf.ep_invariant and (topk_idx is None or src_token is None):
        raise ValueError("an EP-invariant Buffer's combine needs the dispatch's topk_idx and "
                         "src_token (its handle carries them)")
    engine = buf.normal_engine
    pending = engine.combine_send(y, weights, pair_values, slot_rows, recv_slot_offsets,
                                  fwd_slots, fwd_n, fp8, src_token)
    out = engine.combine_recv(pending, slot_of, want_pair=pair_values is not None,
                              node_slot_of=node_slot_of, topk_idx=topk_idx)
    buf._raise_input_errors("combine")  # (a peer that refused or sent another format)
    return out


@combine_op.register_fake
def _(buffer_id, y, weights, pair_values, slot_of, slot_rows, recv_slot_offsets,
      node_slot_of=None, fwd_slots=None, fwd_n=None, fp8=False, topk_idx=None, src_token=None):
    T, K = slot_of.shape[0], slot_rows.shape[1]
    pair_shape = (T, K) if pair_values is not None else (0,)
    return y.new_empty((T, y.shape[1])), y.new_empty(pair_shape, dtype=torch.float32)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_dot(a: Tensor, b: Tensor, fixed_order: bool = False) -> Tensor:
    """``(a * b).sum(-1)`` in fp32 (fp64 for fp64 rows), as float32: the router-weight
    gradient of combine (``moe_comm::row_dot`` where a compiler could reorder its sums).

    ``fixed_order`` (EP-invariant Buffers): fp32 products summed by halving, whatever the
    device or the number of rows (a reduction kernel's order may follow the row count)::

        p = zero-padded (a.float() * b.float()) to a power-of-two width
        while p.shape[-1] > 1: p = p[..., :half] + p[..., half:]
    """
    if not fixed_order:
        acc = _acc_dtype(a.dtype)
        return (a.to(acc) * b.to(acc)).sum(-1).to(torch.float32)
    p = a.float() * b.float()
    width = 1 << max(0, p.shape[-1] - 1).bit_length()
    if width != p.shape[-1]:
        p = torch.nn.functional.pad(p, (0, width - p.shape[-1]))
    while p.shape[-1] > 1:
        half = p.shape[-1] // 2
        p = p[..., :half] + p[..., half:]
    return p[..., 0].clone()


# an op of its own, so that a compiler cannot reorder its sums: compiled and eager steps give
# the same bits
row_dot_op = torch.library.custom_op("moe_comm::row_dot", row_dot, mutates_args=())


@row_dot_op.register_fake
def _(a, b, fixed_order=False):
    return a.new_empty(a.shape[:-1], dtype=torch.float32)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, body, buffer_id, x, x_scales, topk_idx, topk_weights, expert_alignment,
                fp8, ue8m0, col_major_scales, max_recv_rows):
        args = (x, x_scales, topk_idx, topk_weights, expert_alignment, fp8, ue8m0,
                col_major_scales, max_recv_rows)  # (body: the op's, in place of the op)
        outs = tuple(run_dispatch(lookup(buffer_id), *args)) if body else \
            torch.ops.moe_comm.dispatch(buffer_id, *args)
        o = DispatchOutputs(*outs)
        nodes = (o.node_slot_of, o.fwd_slots, o.fwd_n)
        ctx.buffer_id, ctx.num_rows = buffer_id, o.x.shape[0]
        ctx.save_for_backward(o.slot_of, o.slot_rows, o.slot_offsets, topk_idx, o.src_token,
                              *nodes)
        ctx.mark_non_differentiable(o.scales, o.src_rank, o.src_token, o.tokens_per_expert,
                                    o.expert_offsets, o.slot_of, o.slot_rows, o.slot_offsets,
                                    *nodes, o.global_scale)
        ctx.fp8 = bool(fp8)
        if fp8:  # quantized rows carry no gradient to x
            ctx.mark_non_differentiable(o.x)
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        grads = DispatchOutputs(*grads)
        grad_x, grad_w = grads.x, grads.weights
        slot_of, slot_rows, slot_off, topk_idx, src_token, *nodes = ctx.saved_tensors
        buf = lookup(ctx.buffer_id)
        if grad_x is None or ctx.fp8:
            grad_x = slot_of.new_zeros((ctx.num_rows, buf.hidden), dtype=buf.dtype)
        # Router-weight gradients always travel (zeros when unused) so that every rank runs the
        # same protocol whatever its own requires_grad flags.
        if grad_w is None or grad_w.numel() != ctx.num_rows:
            grad_w = slot_of.new_zeros((ctx.num_rows,), dtype=torch.float32)
        invariant = (topk_idx, src_token) if buf.ep_invariant else (None, None)
        grad_x = grad_x.contiguous()
        args = (grad_x, None, grad_w.contiguous(), slot_of, slot_rows, slot_off, *nodes, False,
                *invariant)
        dx, dtopk_w = (torch.ops.moe_comm.combine if path(buf, grad_x, None) == "op"
                       else combine_impl)(ctx.buffer_id, *args)
        return (None, None, dx if ctx.needs_input_grad[2] else None, None, None,
                dtopk_w if ctx.needs_input_grad[5] else None, None, None, None, None, None)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, body, buffer_id, y, weights, slot_of, slot_rows, slot_off,
                tokens_per_expert, expert_offsets, node_slot_of, fwd_slots, fwd_n, fp8,
                topk_idx, src_token):
        args = (y, weights, None, slot_of, slot_rows, slot_off, node_slot_of, fwd_slots, fwd_n,
                fp8, topk_idx, src_token)  # (body: the op's, in place of the op)
        out, _ = run_combine(lookup(buffer_id), *args) if body else \
            torch.ops.moe_comm.combine(buffer_id, *args)
        ctx.buffer_id, ctx.fixed_order = buffer_id, topk_idx is not None
        ctx.save_for_backward(y, weights, slot_of, slot_rows, slot_off, tokens_per_expert,
                              expert_offsets, node_slot_of, fwd_slots, fwd_n)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        y, weights, slot_of, slot_rows, slot_off, tokens_per_expert, expert_offsets, \
            *nodes = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        args = (grad_out, slot_of, slot_rows, slot_off, tokens_per_expert, expert_offsets,
                y.shape[0], *nodes)
        buf = lookup(ctx.buffer_id)
        grad_rows = (torch.ops.moe_comm.dispatch_cached if path(buf, grad_out, None) == "op"
                     else dispatch_cached_impl)(ctx.buffer_id, *args)
        acc = _acc_dtype(y.dtype)
        if weights is None:
            grad_y, grad_w = grad_rows, None
        else:
            grad_y = (grad_rows.to(acc) * weights.to(acc)[:, None]).to(y.dtype)
            grad_w = None
            if ctx.needs_input_grad[3]:
                grad_w = (torch.ops.moe_comm.row_dot if path(buf, y, None) == "op"
                          else row_dot)(grad_rows, y, ctx.fixed_order)
        return (None, None, grad_y, grad_w, None, None, None, None, None, None, None, None, None,
                None, None)


def path(buf, x: Tensor, differentiable: Optional[Tensor]) -> str:
    """How a dispatch or combine of ``x`` on ``buf`` runs: ``"op"``, through its custom op
    (under its autograd Function), where something traces the call (torch.compile), ``x`` is
    no plain tensor on the Buffer's device (a fake or meta tensor: the op's fake) or a dispatch
    or function mode watches it; else its body (:func:`run_dispatch`, :func:`run_combine`)
    in place of the op, which would add only its host time: ``"autograd"`` under the autograd
    Function where autograd records the call (grad mode on and ``x`` or ``differentiable``
    requiring grad), ``"body"`` alone otherwise."""
    if (torch.compiler.is_compiling() or type(x) is not Tensor or x.device != buf.device
            or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled()):
        return "op"
    if torch.is_grad_enabled() and (x.requires_grad or (
            differentiable is not None and differentiable.requires_grad)):
        return "autograd"
    return "body"


def dispatch_autograd(buf, x, x_scales, topk_idx, topk_weights, expert_alignment, fp8=0,
                      ue8m0=0, col_major_scales=False, max_recv_rows=None) -> DispatchResult:
    """Runs ``moe_comm::dispatch`` (or its body: :func:`path`) under autograd where it records
    the call, and wraps the outputs."""
    how = path(buf, x, topk_weights)
    if how == "body":
        outs = run_dispatch(buf, x, x_scales, topk_idx, topk_weights, expert_alignment, fp8,
                            int(ue8m0), col_major_scales, max_recv_rows)
    else:
        outs = _Dispatch.apply(how == "autograd", buf.id, x, x_scales, topk_idx, topk_weights,
                               expert_alignment, fp8, int(ue8m0), col_major_scales,
                               max_recv_rows)
    return wrap_dispatch_outputs(buf, outs, topk_idx.shape[1], topk_weights is not None, fp8,
                                 int(ue8m0), topk_idx)


def wrap_dispatch_outputs(buf, outs, topk: int, has_weights: bool, fp8: int, ue8m0: int = 0,
                          topk_idx=None) -> DispatchResult:
    """The tensors of ``moe_comm::dispatch`` as a DispatchResult with its handle (an
    EP-invariant Buffer's keeps ``topk_idx`` and ``src_token``; the handle's rows are those of
    ``src_rank``, which a slot-major dispatch's ``recv_x`` does not have)."""
    o = DispatchOutputs(*outs)
    invariant = buf.ep_invariant
    handle = DispatchHandle(buf.id, buf.normal_engine.dispatch_serial, o.slot_of, o.slot_rows,
                            o.slot_offsets, o.src_rank.shape[0], topk, o.tokens_per_expert,
                            o.expert_offsets, o.node_slot_of, o.fwd_slots, o.fwd_n,
                            topk_idx=topk_idx if invariant else None,
                            src_token=o.src_token if invariant else None)
    buf._last_handle = handle  # (a combine this rank refuses takes part with it)
    return DispatchResult(o.x, o.scales if fp8 else None, o.weights if has_weights else None,
                          o.src_rank, o.src_token, o.tokens_per_expert, o.expert_offsets, handle,
                          o.global_scale if fp8 and ue8m0 == NVFP4 else None)


def combine_autograd(buf, y, handle: DispatchHandle, weights, fp8: bool = False) -> Tensor:
    """Runs ``moe_comm::combine`` under autograd with the tensors of ``handle``; the backward
    of an FP8 combine is that of the exact one (straight through the quantization)."""
    invariant = (handle.topk_idx, handle.src_token) if buf.ep_invariant else (None, None)
    how = path(buf, y, weights)
    if how == "body":
        return run_combine(buf, y, weights, None, handle.slot_of, handle.slot_rows,
                           handle.recv_slot_offsets, *handle.node_tensors(), fp8,
                           *invariant)[0]
    return _Combine.apply(how == "autograd", buf.id, y, weights, handle.slot_of,
                          handle.slot_rows,
                          handle.recv_slot_offsets, handle.tokens_per_expert,
                          handle.expert_offsets, *handle.node_tensors(), fp8, *invariant)
