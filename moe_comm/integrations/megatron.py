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

Fault tolerance and formats (docs/FAULT_TOLERANCE.md; docs/FORMATS.md "FP8 dispatch", "FP8 combine";
:mod:`moe_comm.integrations`): ``apply_megatron(fault_tolerant=True, max_tokens_per_rank=N)``
builds the Buffers with ``moe_comm.Buffer(..., fault_tolerant=True)``: a rank that dies is
excluded and each survivor's layer completes forward and backward, the dead rank's experts left
out of its tokens' sums (as if the router had dropped those choices; the experts' gradients get
no rows from the dead rank's tokens). ``dispatch_dtype="fp8" | "mxfp8" | "nvfp4"``: the rows
travel quantized and the experts get them dequantized to the layer's dtype, the input gradient
straight through; ``combine_dtype="fp8"``: the expert outputs' partial sums travel as FP8. The
same keywords on ``MoeCommMoELayer`` (``params={...}``, with ``max_tokens_per_rank``) and
``MoeCommTokenDispatcher``; bad values raise ValueError naming the option when the layer is built
or the plugin applied, before anything is sent.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

from . import (
    FROM_SETTINGS,
    BufferCache,
    _check_combine_dtype,
    _check_dispatch_dtype,
    _check_ep_invariant,
    _check_fault_tolerant,
    _check_formats,
    _check_sizing,
    buffers,
    dispatch,
)

# MoeCommTokenDispatcher and MoeCommMoELayer subclass Megatron's classes, so they are made on
# first access (module __getattr__), when megatron-core is imported.
__all__ = ["apply_megatron", "revert_megatron", "is_applied", "available", "routing_to_topk"]

_REPLACED = ("MoEAlltoAllTokenDispatcher", "MoEFlexTokenDispatcher")
_originals: dict[str, type] = {}
_settings: dict = {"max_tokens_per_rank": None, "ep_invariant": False, "fault_tolerant": False,
                   "dispatch_dtype": None, "combine_dtype": None}
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
                   ep_invariant: bool = False, fault_tolerant: bool = False,
                   dispatch_dtype: str | None = None, combine_dtype: str | None = None) -> bool:
    """Makes every ``MoELayer`` built from now on with ``moe_token_dispatcher_type`` "alltoall"
    or "flex" dispatch with moe_comm. Idempotent (a second call only updates the options for
    layers built afterwards; they are also the defaults of ``MoeCommMoELayer`` and
    ``MoeCommTokenDispatcher``): ``max_tokens_per_rank``, the fixed Buffer size (``None``
    sizes by the batch); ``ep_invariant`` and ``fault_tolerant``, the Buffers'
    ``moe_comm.Buffer(..., ep_invariant=..., fault_tolerant=...)`` (``fault_tolerant`` needs
    ``max_tokens_per_rank``); ``dispatch_dtype`` (None, "fp8", "mxfp8", "nvfp4") and
    ``combine_dtype`` (None, "fp8"), the formats on the wire (see the module doc).
    Returns False, with a warning and no change, when megatron-core is not installed."""
    _check_ep_invariant(ep_invariant)
    _check_fault_tolerant(fault_tolerant)
    _check_sizing(fault_tolerant, max_tokens_per_rank)
    _check_formats(dispatch_dtype, combine_dtype, ep_invariant=ep_invariant)
    try:
        from megatron.core.transformer.moe import moe_layer
    except ImportError as error:
        warnings.warn(f"apply_megatron(): megatron-core is not importable ({error}); nothing "
                      "was changed. pip install megatron-core to use the plugin.", stacklevel=2)
        return False
    _settings.update(max_tokens_per_rank=max_tokens_per_rank, ep_invariant=ep_invariant,
                     fault_tolerant=fault_tolerant, dispatch_dtype=dispatch_dtype,
                     combine_dtype=combine_dtype)
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
                     ep_invariant: bool | None = None, buffer_cache: BufferCache | None = None,
                     fault_tolerant: bool | None = None, dispatch_dtype=FROM_SETTINGS,
                     combine_dtype=FROM_SETTINGS):
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
            self.buffer_cache = buffer_cache if buffer_cache is not None else buffers
            self.buffer = None  # the Buffer of the current dispatch
            self.cudagraph_attrs = []
            self.configure(max_tokens_per_rank=max_tokens_per_rank, ep_invariant=ep_invariant,
                           fault_tolerant=fault_tolerant, dispatch_dtype=dispatch_dtype,
                           combine_dtype=combine_dtype, defaults=True)

        def configure(self, *, max_tokens_per_rank=None, ep_invariant=None,
                      fault_tolerant=None, dispatch_dtype=FROM_SETTINGS,
                      combine_dtype=FROM_SETTINGS, defaults: bool = False) -> None:
            """Sets the given options (the others stay; with ``defaults``, the others take
            :func:`apply_megatron`'s), checked together against the layer's config."""
            given = {"max_tokens_per_rank": max_tokens_per_rank, "ep_invariant": ep_invariant,
                     "fault_tolerant": fault_tolerant}
            given = {k: v for k, v in given.items() if v is not None}
            for name, value in (("dispatch_dtype", dispatch_dtype),
                                ("combine_dtype", combine_dtype)):
                if value is not FROM_SETTINGS:
                    given[name] = value
            options = {name: given.get(name, _settings[name] if defaults else
                                       getattr(self, name)) for name in _settings}
            _check_ep_invariant(options["ep_invariant"])
            _check_fault_tolerant(options["fault_tolerant"])
            _check_sizing(options["fault_tolerant"], options["max_tokens_per_rank"])
            _check_formats(options["dispatch_dtype"], options["combine_dtype"],
                           hidden=self.config.hidden_size, dtype=self.config.params_dtype,
                           ep_invariant=options["ep_invariant"])
            for name, value in options.items():
                setattr(self, name, value)

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
            _check_formats(self.dispatch_dtype, self.combine_dtype,
                           hidden=hidden_states.shape[1], dtype=hidden_states.dtype,
                           ep_invariant=self.ep_invariant)
            self.buffer = self.buffer_cache.get(
                self.ep_group, hidden=hidden_states.shape[1], num_experts=self.num_experts,
                dtype=hidden_states.dtype, max_topk=self.topk,
                num_tokens=hidden_states.shape[0], max_tokens_per_rank=self.max_tokens_per_rank,
                device=hidden_states.device, ep_invariant=self.ep_invariant,
                fault_tolerant=self.fault_tolerant)
            res = dispatch(self.buffer, hidden_states, self.topk_idx, probs,
                           self.dispatch_dtype)
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
            out = self.buffer.combine(hidden_states.contiguous(), self.handle,
                                      combine_dtype=self.combine_dtype)
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
        ``ep_invariant``; None: :func:`apply_megatron`'s, False unless set there; likewise
        ``max_tokens_per_rank``, ``fault_tolerant``, and ``dispatch_dtype`` /
        ``combine_dtype``, where None means no quantization and leaving them out
        :func:`apply_megatron`'s)."""

        def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                     ep_invariant: bool | None = None, max_tokens_per_rank: int | None = None,
                     fault_tolerant: bool | None = None, dispatch_dtype=FROM_SETTINGS,
                     combine_dtype=FROM_SETTINGS):
            if ep_invariant is not None:
                _check_ep_invariant(ep_invariant)
            if fault_tolerant is not None:
                _check_fault_tolerant(fault_tolerant)
            if dispatch_dtype is not FROM_SETTINGS:
                _check_dispatch_dtype(dispatch_dtype)
            if combine_dtype is not FROM_SETTINGS:
                _check_combine_dtype(combine_dtype)
            with _dispatchers_replaced(moe_layer, dispatcher):
                super().__init__(config=config, submodules=submodules,
                                 layer_number=layer_number, pg_collection=pg_collection)
            self.token_dispatcher.configure(
                max_tokens_per_rank=max_tokens_per_rank, ep_invariant=ep_invariant,
                fault_tolerant=fault_tolerant, dispatch_dtype=dispatch_dtype,
                combine_dtype=combine_dtype)

    _classes["layer"] = MoeCommMoELayer
    return MoeCommMoELayer
