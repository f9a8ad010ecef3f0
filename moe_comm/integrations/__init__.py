"""Framework plugins: moe_comm inside Megatron-Core and DeepSpeed MoE layers.

    from moe_comm.integrations import megatron, deepspeed
    megatron.apply_megatron()      # MoELayer(alltoall | flex) dispatches with moe_comm
    deepspeed.apply_deepspeed()    # deepspeed.moe.layer.MoE moves only the routed tokens

Each plugin imports its framework only when called (``import moe_comm.integrations.megatron``
works without megatron-core), is idempotent, and is also offered as a class to use directly
(``MoeCommTokenDispatcher`` / ``MoeCommMoELayer`` for a Megatron layer spec,
``MoeCommMOELayer`` for DeepSpeed). These modules use moe_comm's public API (and, for the
straight-through gradient of a quantized dispatch, the registered op
``torch.ops.moe_comm.combine``, ``moe_comm/ops.py``); nothing in moe_comm imports them.

Shared here: :class:`BufferCache`, the ``moe_comm.Buffer`` objects the plugins' layers share.

Every plugin takes ``ep_invariant`` (default False) in its ``apply_*`` function and its classes:
``True`` builds the layers' Buffers with ``moe_comm.Buffer(..., ep_invariant=True)`` (one
node): each token's expert output rows are summed in fp32 in the order of its choices and
rounded once (``moe_comm.reference.invariant_combine``), so the combined output depends on
those rows alone, not on the expert-parallel size or the expert placement. Invariant and
default layers never share a Buffer.

They also take ``fault_tolerant`` (default False): the layers' Buffers are built with
``moe_comm.Buffer(..., fault_tolerant=True)``, so a rank that dies is excluded and the layer's
dispatch and combine (forward and backward) complete on the others; the rows of the excluded
rank's experts are left out of each token's sum (not renormalised). It needs a fixed
``max_tokens_per_rank``: sizing by the batch agrees on the size over the group before each
dispatch (a collective a dead rank would block). Only the MoE layer's communication is covered:
the model's other collectives (data-parallel gradient reduction, ...) are the framework's.

And the formats (per call, no Buffer of their own): ``dispatch_dtype`` None (the layer's dtype),
``"fp8"`` (e4m3 per 128 channels, float32 scales), ``"mxfp8"`` (e4m3 per 32, E8M0 scales) or
``"nvfp4"`` (e2m1 per 16, e4m3 scales and a global scale): the rows travel quantized and are
dequantized on the expert rank to the layer's dtype before the experts see them
(:func:`dispatch`). ``moe_comm`` gives quantized rows no gradient to ``x``; the plugins give
``x`` the straight-through one (the gradient of ``dequantize(quantize(x))`` taken as the
identity): the rows' gradients are summed back to their tokens exactly as after an unquantized
dispatch, in the same backward message as the router weights' gradients. ``combine_dtype``
None or ``"fp8"``: each partial sum travels as e4m3 per 128 channels (backward: that of the
exact combine). Needs: ``hidden % 128 == 0`` for ``"fp8"`` (both), ``% 32`` for ``"mxfp8"``,
``% 16`` for ``"nvfp4"``, a 16- or 32-bit layer dtype, and no ``combine_dtype="fp8"`` with
``ep_invariant=True``.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

import moe_comm
from moe_comm import microscale

__all__ = ["BufferCache", "buffers", "dispatch", "DISPATCH_DTYPES", "COMBINE_DTYPES"]

DISPATCH_DTYPES = (None, "fp8", "mxfp8", "nvfp4")
COMBINE_DTYPES = (None, "fp8")
# channels per scale of each format: hidden must be a multiple
_GROUP = {"fp8": 128, "mxfp8": microscale.MX_GROUP, "nvfp4": microscale.NVFP4_GROUP}

_MIN_TOKENS = 64  # smallest max_tokens_per_rank the cache allocates when it sizes by itself


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class _FromSettings:
    """Default of the layer classes' ``dispatch_dtype`` / ``combine_dtype`` (where None is a
    value: no quantization): take the plugin's ``apply_*`` setting."""

    def __repr__(self) -> str:
        return "<the apply_* setting>"


FROM_SETTINGS = _FromSettings()


def _check_ep_invariant(value, where: str = "ep_invariant") -> bool:
    """``value`` if it is a bool (the plugins' ``ep_invariant`` option), else ValueError."""
    if not isinstance(value, bool):
        raise ValueError(f"{where} must be True or False, got {value!r}")
    return value


def _check_fault_tolerant(value) -> bool:
    return _check_ep_invariant(value, "fault_tolerant")


def _check_dispatch_dtype(value) -> str | None:
    if not (value is None or isinstance(value, str)) or value not in DISPATCH_DTYPES:
        raise ValueError(f"dispatch_dtype must be one of {DISPATCH_DTYPES}, got {value!r}")
    return value


def _check_combine_dtype(value) -> str | None:
    if not (value is None or isinstance(value, str)) or value not in COMBINE_DTYPES:
        raise ValueError(f"combine_dtype must be one of {COMBINE_DTYPES}, got {value!r}")
    return value


def _check_sizing(fault_tolerant: bool, max_tokens_per_rank) -> None:
    if fault_tolerant and max_tokens_per_rank is None:
        raise ValueError("fault_tolerant=True needs a fixed max_tokens_per_rank: sizing by the "
                         "batch agrees on the size over the group before each dispatch, a "
                         "collective that a dead rank would block")


def _check_formats(dispatch_dtype, combine_dtype, *, hidden: int | None = None,
                   dtype: torch.dtype | None = None, ep_invariant: bool = False) -> None:
    """ValueError naming the option when a format does not fit the layer (``hidden``,
    ``dtype``: unknown where None) or the other options."""
    _check_dispatch_dtype(dispatch_dtype)
    _check_combine_dtype(combine_dtype)
    if combine_dtype is not None and ep_invariant:
        raise ValueError(f"combine_dtype={combine_dtype!r} cannot go with ep_invariant=True (an "
                         "EP-invariant combine sums the rows in the layer's dtype); pass None")
    for option, value in (("dispatch_dtype", dispatch_dtype), ("combine_dtype", combine_dtype)):
        if value is None:
            continue
        if hidden is not None and hidden % _GROUP[value]:
            raise ValueError(f"{option}={value!r} needs hidden % {_GROUP[value]} == 0, got "
                             f"hidden={hidden}")
        if dtype is not None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{option}={value!r} needs a 16- or 32-bit layer dtype, got {dtype}")


def dequantize_rows(res: moe_comm.DispatchResult, dispatch_dtype: str,
                    dtype: torch.dtype) -> torch.Tensor:
    """The rows of a quantized dispatch (``dispatch_dtype`` "fp8" with float32 scales,
    "mxfp8" or "nvfp4", row-major scales) as ``[rows, H]`` of ``dtype``."""
    if dispatch_dtype == "fp8":
        rows = microscale.dequantize_fp8(res.x, res.x_scales)
    elif dispatch_dtype == "mxfp8":
        rows = microscale.dequantize_mxfp8(res.x, res.x_scales)
    else:
        rows = microscale.dequantize_nvfp4(res.x, res.x_scales, res.x_global_scale)
    return rows.to(dtype)


class _QuantizedDispatch(torch.autograd.Function):
    """A quantized ``Buffer.dispatch`` whose rows come back dequantized, with the
    straight-through gradient to ``x``. The backward is the dispatch's own backward message
    (``moe_comm::combine`` of the row gradients, the router weights' gradients riding along as
    ``pair_values``, ``moe_comm/ops.py``) with the rows' gradients kept instead of dropped."""

    @staticmethod
    def forward(ctx, x, topk_weights, buf, topk_idx, dispatch_dtype, box):
        options = {"fp8": True} if dispatch_dtype == "fp8" else \
            {"dispatch_dtype": dispatch_dtype}
        res = buf.dispatch(x.detach(), topk_idx,
                           None if topk_weights is None else topk_weights.detach(), **options)
        rows = dequantize_rows(res, dispatch_dtype, x.dtype)
        box.append(dataclasses.replace(res, x=rows, x_scales=None, x_global_scale=None))
        ctx.buf, ctx.handle, ctx.x_dtype = buf, res.handle, x.dtype
        ctx.has_weights = topk_weights is not None
        if ctx.has_weights:
            return rows, res.weights
        weights = rows.new_empty((0,), dtype=torch.float32)
        ctx.mark_non_differentiable(weights)
        return rows, weights

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_rows, grad_weights):
        buf, h = ctx.buf, ctx.handle
        # every rank runs this collective, whatever reached it: zeros where nothing did
        if grad_rows is None:
            grad_rows = h.slot_of.new_zeros((h.num_rows, buf.hidden), dtype=buf.dtype)
        pairs = None
        if ctx.has_weights:
            pairs = (grad_weights if grad_weights is not None and
                     grad_weights.numel() == h.num_rows else
                     h.slot_of.new_zeros((h.num_rows,), dtype=torch.float32))
            pairs = pairs.to(torch.float32).contiguous()
        invariant = (h.topk_idx, h.src_token) if buf.ep_invariant else (None, None)
        dx, dw = torch.ops.moe_comm.combine(buf.id, grad_rows.to(buf.dtype).contiguous(), None,
                                            pairs, h.slot_of, h.slot_rows, h.recv_slot_offsets,
                                            *h.node_tensors(), False, *invariant)
        return (dx.to(ctx.x_dtype), dw if ctx.has_weights else None, None, None, None, None)


def dispatch(buf: moe_comm.Buffer, x: torch.Tensor, topk_idx: torch.Tensor,
             topk_weights: torch.Tensor | None,
             dispatch_dtype: str | None = None) -> moe_comm.DispatchResult:
    """``buf.dispatch(x, topk_idx, topk_weights)`` in the plugins' ``dispatch_dtype``: None
    sends ``x`` as it is; "fp8", "mxfp8", "nvfp4" send quantized rows and return them in
    ``res.x`` dequantized to ``x.dtype`` (``res.x_scales`` None), with the straight-through
    gradient to ``x`` (the rows' gradients summed to their tokens, as for unquantized rows)
    and the router weights' gradient as after any dispatch. Collective over the Buffer's
    ranks, forward and backward."""
    if dispatch_dtype is None:
        return buf.dispatch(x, topk_idx, topk_weights)
    _check_dispatch_dtype(dispatch_dtype)
    box: list = []
    rows, weights = _QuantizedDispatch.apply(x, topk_weights, buf, topk_idx, dispatch_dtype,
                                             box)
    return dataclasses.replace(box[0], x=rows,
                               weights=weights if topk_weights is not None else None)


class BufferCache:
    """``moe_comm.Buffer`` objects shared by the MoE layers of a model, one per
    (process group, hidden, num_experts, dtype, max_topk, ep_invariant, fault_tolerant).

    Layers of one model share a Buffer: a handle is only needed between a layer's dispatch and
    its combine, and backward passes keep their own routing tensors, so any number of layers
    (and micro-batches in flight) can use one workspace.

    Sizing (``max_tokens_per_rank``):

    * fixed (``max_tokens_per_rank=N`` here or in ``apply_*``): the Buffer holds N tokens per
      rank; a larger batch raises ``ValueError`` before anything is sent;
    * ``None`` (default): before each dispatch the ranks agree on the largest token count
      (one ``all_reduce(MAX)`` of one int64 over the group) and the cache allocates a Buffer
      for the next power of two (at least 64) when the current one is too small. Replaced
      Buffers stay open until :meth:`close`, because backward passes of earlier steps may
      still refer to them.

    ``ep_invariant=True`` gets a Buffer built with ``moe_comm.Buffer(..., ep_invariant=True)``
    (its combine sums each token's rows in choice order: the same bits at any EP size for the
    same rows); it is part of the key, so an invariant layer and a default one never share a Buffer.
    So is ``fault_tolerant=True`` (``moe_comm.Buffer(..., fault_tolerant=True)``), which needs a
    fixed ``max_tokens_per_rank`` (ValueError otherwise: the size agreement is a collective).
    The formats (``dispatch_dtype``, ``combine_dtype``) are per call: layers that differ only
    in them share a Buffer.
    """

    def __init__(self) -> None:
        self._live: dict[tuple, moe_comm.Buffer] = {}
        self._retired: list[moe_comm.Buffer] = []

    def get(self, group, *, hidden: int, num_experts: int, dtype: torch.dtype, max_topk: int,
            num_tokens: int, max_tokens_per_rank: int | None = None,
            device: torch.device | str = "cpu", ep_invariant: bool = False,
            fault_tolerant: bool = False) -> moe_comm.Buffer:
        """A Buffer for ``num_tokens`` tokens on this rank; collective over ``group`` when it
        builds one or sizes by the batch (``device``: where the size agreement's one-element
        tensor lives for the group's backend; ``ep_invariant``, ``fault_tolerant``: as
        ``moe_comm.Buffer``'s)."""
        ep_invariant = _check_ep_invariant(ep_invariant)
        fault_tolerant = _check_fault_tolerant(fault_tolerant)
        _check_sizing(fault_tolerant, max_tokens_per_rank)
        key = (group, hidden, num_experts, dtype, max_topk, ep_invariant, fault_tolerant)
        buf = self._live.get(key)
        if max_tokens_per_rank is not None:
            if num_tokens > max_tokens_per_rank:
                raise ValueError(
                    f"{num_tokens} tokens on this rank exceed max_tokens_per_rank="
                    f"{max_tokens_per_rank}; pass a larger value (or None to size by the batch)")
            need = max_tokens_per_rank
            if buf is not None and buf.max_tokens_per_rank == need:
                return buf
        else:
            most = torch.tensor([num_tokens], dtype=torch.int64, device=device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
            if buf is not None and int(most) <= buf.max_tokens_per_rank:
                return buf
            need = max(_MIN_TOKENS, _next_power_of_2(int(most)))
        if buf is not None:
            self._retired.append(buf)
        buf = moe_comm.Buffer(group, hidden=hidden, num_experts=num_experts,
                              max_tokens_per_rank=need, dtype=dtype, max_topk=max_topk,
                              ep_invariant=ep_invariant, fault_tolerant=fault_tolerant)
        self._live[key] = buf
        return buf

    def __len__(self) -> int:
        return len(self._live)

    def close(self) -> None:
        """Closes every Buffer (collective in spirit: call it on every rank at the same point,
        when no backward pass is pending)."""
        for buf in [*self._live.values(), *self._retired]:
            buf.close()
        self._live.clear()
        self._retired.clear()


buffers = BufferCache()
"""The cache the plugins use unless a layer is given its own."""
