"""moe_comm as Megatron-Core's MoE token dispatcher.

One line, before the model is built::

    from moe_comm.integrations.megatron import apply_megatron
    apply_megatron()   # MoELayer with moe_token_dispatcher_type "alltoall" or "flex" uses moe_comm

or, in a layer spec, the layer class (any ``moe_token_dispatcher_type``)::

    from moe_comm.integrations.megatron import MoeCommMoELayer
    spec = get_moe_module_spec(use_te=False, num_experts=E)
    spec.module = MoeCommMoELayer

``MoeCommTokenDispatcher`` implements Megatron's ``MoETokenDispatcher`` interface, constructed
as ``(num_local_experts, local_expert_indices, config=..., pg_collection=...)``:

==========================  =====================================================================
``dispatch_preprocess``     ``tokens [S, B, H]``, ``routing_map [T, E]`` bool, ``probs [T, E]``
                            -> ``(x [T, H], topk_weights [T, K] float32)``; the token's experts in
                            ascending id order (``-1`` where the router dropped a choice); local
``token_dispatch``          ``moe_comm.Buffer.dispatch`` over the expert-parallel group
``dispatch_postprocess``    -> ``(rows [N, H], tokens_per_expert [L] int64 on CPU,
                            permuted_probs [N])``: rows grouped by local expert, then source
                            rank, then source token, the order of Megatron's alltoall dispatcher
``combine_preprocess``      identity (the experts already applied ``permuted_probs``)
``token_combine``           ``moe_comm.Buffer.combine`` without weights: a plain sum per token
``combine_postprocess``     -> ``[S, B, H]``
==========================  =====================================================================

Expert ``e`` lives on expert-parallel rank ``e // L`` (``L = num_moe_experts / EP``), as in
Megatron. Supported: any EP size, token dropping by the router (``moe_expert_capacity_factor``
without padding), ``SequentialMLP`` experts (tested; ``TEGroupedMLP`` takes the same inputs),
shared experts without overlap. Not supported (rejected when the layer is built): expert
tensor parallelism (``expert_tensor_parallel_size > 1``, and with it sequence parallelism inside
the MoE layer), ``moe_pad_expert_input_to_capacity``, ``moe_router_padding_for_quantization``,
``moe_shared_expert_overlap``. Untested: ``overlap_moe_expert_parallel_comm`` (it reaches into
the flex dispatcher's DeepEP manager) and CUDA-graph capture of the MoE layer.

The layer's moe_comm Buffers come from :data:`moe_comm.integrations.buffers` (see
:class:`~moe_comm.integrations.BufferCache` for how they are sized).

EP-invariant output (one node): ``apply_megatron(ep_invariant=True)``, ``MoeCommMoELayer``
built with ``ep_invariant=True`` (``ModuleSpec(..., params={"ep_invariant": True})``) or
``MoeCommTokenDispatcher(..., ep_invariant=True)``. The layer's Buffer is then
``moe_comm.Buffer(..., ep_invariant=True)``: its combine sums each token's expert output rows
in fp32 in ascending expert order (the choice order here) and rounds once, so the combined
output is a function of those rows alone, whatever the EP size and expert placement.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

from . import BufferCache, _check_ep_invariant, buffers

# MoeCommTokenDispatcher and MoeCommMoELayer subclass Megatron's classes, so they are made on
# first access (module __getattr__), when megatron-core is imported.
__all__ = ["apply_megatron", "revert_megatron", "is_applied", "available", "routing_to_topk"]

_REPLACED = ("MoEAlltoAllTokenDispatcher", "MoEFlexTokenDispatcher")
_originals: dict[str, type] = {}
_settings: dict = {"max_tokens_per_rank": None, "ep_invariant": False}
_classes: dict[str, type] = {}


def available() -> bool:
    """Whether megatron-core's MoE layer can be imported."""
    try:
        import megatron.core.transformer.moe.moe_layer  # noqa: F401
    except ImportError:
        return False
    return True


def is_applied() -> bool:
    return bool(_originals)


def apply_megatron(max_tokens_per_rank: int | None = None,
                   ep_invariant: bool = False) -> bool:
    """Makes every ``MoELayer`` built from now on with ``moe_token_dispatcher_type`` "alltoall"
    or "flex" dispatch with moe_comm. Idempotent (a second call only updates
    ``max_tokens_per_rank``, the fixed Buffer size; ``None`` sizes by the batch; and
    ``ep_invariant``, the Buffers' ``moe_comm.Buffer(..., ep_invariant=...)``, for layers built
    afterwards; also the default of ``MoeCommMoELayer`` and ``MoeCommTokenDispatcher``).
    Returns False, with a warning and no change, when megatron-core is not installed."""
    _check_ep_invariant(ep_invariant)
    try:
        from megatron.core.transformer.moe import moe_layer
    except ImportError as error:
        warnings.warn(f"apply_megatron(): megatron-core is not importable ({error}); nothing "
                      "was changed. pip install megatron-core to use the plugin.", stacklevel=2)
        return False
    _settings.update(max_tokens_per_rank=max_tokens_per_rank, ep_invariant=ep_invariant)
    dispatcher = _dispatcher_class()
    if not _originals:
        for name in _REPLACED:
            _originals[name] = getattr(moe_layer, name)
            setattr(moe_layer, name, dispatcher)
    return True


def revert_megatron() -> None:
    """Undoes :func:`apply_megatron` for layers built afterwards (idempotent)."""
    if not _originals:
        return
    from megatron.core.transformer.moe import moe_layer

    for name, cls in _originals.items():
        setattr(moe_layer, name, cls)
    _originals.clear()


def __getattr__(name: str):
    if name == "MoeCommTokenDispatcher":
        return _dispatcher_class()
    if name == "MoeCommMoELayer":
        return _layer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _require_megatron():
    try:
        from megatron.core.transformer.moe import moe_layer, token_dispatcher
    except ImportError as error:
        raise ImportError("moe_comm.integrations.megatron needs megatron-core "
                          f"(pip install megatron-core): {error}") from error
    return moe_layer, token_dispatcher


def _check_config(config, tp_size: int) -> None:
    unsupported = []
    if tp_size > 1:
        unsupported.append(f"expert tensor parallelism (expert TP size {tp_size})")
    if getattr(config, "moe_pad_expert_input_to_capacity", False):
        unsupported.append("moe_pad_expert_input_to_capacity=True")
    if getattr(config, "moe_router_padding_for_quantization", False):
        unsupported.append("moe_router_padding_for_quantization=True")
    if unsupported:
        raise ValueError("the moe_comm token dispatcher does not support "
                         + ", ".join(unsupported) + "; use Megatron's own dispatcher for these")


def routing_to_topk(routing_map: torch.Tensor, probs: torch.Tensor, topk: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``routing_map [T, E]`` bool and ``probs [T, E]`` -> ``topk_idx [T, topk]`` int64 (the
    selected experts in ascending order, then -1) and ``topk_weights [T, topk]`` float32
    (``probs`` at those experts, 0 for -1; differentiable in ``probs``)."""
    T, E = routing_map.shape
    ids = torch.arange(E, device=routing_map.device)
    key = torch.where(routing_map, ids, E)
    if topk < E:
        chosen = torch.topk(key, topk, dim=1, largest=False, sorted=True).values
        if T and bool((routing_map.sum(dim=1) > topk).any()):
            raise ValueError(f"routing_map selects more than moe_router_topk={topk} experts "
                             "for some token")
    else:
        chosen = key.sort(dim=1).values
    valid = chosen < E
    topk_idx = torch.where(valid, chosen, -1)
    weights = probs.gather(1, torch.where(valid, chosen, 0))
    weights = torch.where(valid, weights, torch.zeros_like(weights)).to(torch.float32)
    return topk_idx, weights.contiguous()


def _dispatcher_class() -> type:
    if "dispatcher" in _classes:
        return _classes["dispatcher"]
    _, token_dispatcher = _require_megatron()

    class MoeCommTokenDispatcher(token_dispatcher.MoETokenDispatcher):
        """Megatron ``MoETokenDispatcher`` over ``moe_comm.Buffer`` (see the module doc)."""

        def __init__(self, num_local_experts: int, local_expert_indices: list[int], config,
                     pg_collection=None, *, max_tokens_per_rank: int | None = None,
                     ep_invariant: bool | None = None, buffer_cache: BufferCache | None = None):
            if pg_collection is None:
                from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

                pg_collection = get_default_pg_collection()
            super().__init__(config=config, pg_collection=pg_collection)
            _check_config(config, self.tp_size)
            self.num_local_experts = num_local_experts
            self.local_expert_indices = list(local_expert_indices)
            self.num_experts = config.num_moe_experts
            self.topk = config.moe_router_topk
            ep_rank = dist.get_rank(self.ep_group) if self.ep_size > 1 else 0
            first = ep_rank * num_local_experts
            if self.local_expert_indices != list(range(first, first + num_local_experts)):
                raise ValueError(f"local experts {self.local_expert_indices} on EP rank "
                                 f"{ep_rank}: moe_comm places expert e on rank e // "
                                 f"{num_local_experts}")
            self.max_tokens_per_rank = (max_tokens_per_rank if max_tokens_per_rank is not None
                                        else _settings["max_tokens_per_rank"])
            self.ep_invariant = _check_ep_invariant(
                ep_invariant if ep_invariant is not None else _settings["ep_invariant"])
            self.buffer_cache = buffer_cache if buffer_cache is not None else buffers
            self.buffer = None  # the Buffer of the current dispatch
            self.cudagraph_attrs = []

        def set_shared_experts(self, shared_experts):
            raise ValueError(
                "the moe_comm token dispatcher does not overlap shared experts with its "
                "communication; set moe_shared_expert_overlap=False (MoELayer then runs the "
                "shared experts itself)")

        def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                                probs: torch.Tensor):
            assert routing_map.dim() == 2 and routing_map.dtype == torch.bool, \
                "routing_map must be a [T, E] bool tensor"
            assert probs.dim() == 2, "probs must be a [T, E] tensor"
            self.hidden_shape = hidden_states.shape
            self.probs_dtype = probs.dtype
            x = hidden_states.reshape(-1, self.hidden_shape[-1]).contiguous()
            self.topk_idx, topk_weights = routing_to_topk(routing_map, probs, self.topk)
            return x, topk_weights

        def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
            self.buffer = self.buffer_cache.get(
                self.ep_group, hidden=hidden_states.shape[1], num_experts=self.num_experts,
                dtype=hidden_states.dtype, max_topk=self.topk,
                num_tokens=hidden_states.shape[0], max_tokens_per_rank=self.max_tokens_per_rank,
                device=hidden_states.device, ep_invariant=self.ep_invariant)
            res = self.buffer.dispatch(hidden_states, self.topk_idx, probs)
            self.handle, self.tokens_per_expert = res.handle, res.tokens_per_expert
            return res.x, res.weights

        def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
            tokens_per_expert = self.tokens_per_expert.to("cpu")
            self.tokens_per_expert = None
            return hidden_states, tokens_per_expert, probs.to(self.probs_dtype)

        def combine_preprocess(self, hidden_states: torch.Tensor):
            return hidden_states

        def token_combine(self, hidden_states: torch.Tensor, async_finish: bool = True,
                          allocate_on_comm_stream: bool = True):
            out = self.buffer.combine(hidden_states.contiguous(), self.handle)
            self.handle = None
            return out

        def combine_postprocess(self, hidden_states: torch.Tensor):
            return hidden_states.view(self.hidden_shape)

    _classes["dispatcher"] = MoeCommTokenDispatcher
    return MoeCommTokenDispatcher


@contextlib.contextmanager
def _dispatchers_replaced(moe_layer, cls):
    names = ("MoEAllGatherTokenDispatcher", *_REPLACED)
    saved = {name: getattr(moe_layer, name) for name in names}
    try:
        for name in names:
            setattr(moe_layer, name, cls)
        yield
    finally:
        for name, value in saved.items():
            setattr(moe_layer, name, value)


def _layer_class() -> type:
    if "layer" in _classes:
        return _classes["layer"]
    moe_layer, _ = _require_megatron()
    dispatcher = _dispatcher_class()

    class MoeCommMoELayer(moe_layer.MoELayer):
        """``MoELayer`` whose token dispatcher is moe_comm's, whatever
        ``moe_token_dispatcher_type`` says; use it as ``ModuleSpec(module=MoeCommMoELayer,
        submodules=MoESubmodules(...))`` (``params={"ep_invariant": True}``: the dispatcher's
        ``ep_invariant``; None: :func:`apply_megatron`'s, False unless set there)."""

        def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                     ep_invariant: bool | None = None):
            if ep_invariant is not None:
                _check_ep_invariant(ep_invariant)
            with _dispatchers_replaced(moe_layer, dispatcher):
                super().__init__(config=config, submodules=submodules,
                                 layer_number=layer_number, pg_collection=pg_collection)
            if ep_invariant is not None:
                self.token_dispatcher.ep_invariant = ep_invariant

    _classes["layer"] = MoeCommMoELayer
    return MoeCommMoELayer
