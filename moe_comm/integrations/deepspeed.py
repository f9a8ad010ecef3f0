"""moe_comm inside DeepSpeed's MoE layer (``deepspeed.moe.layer.MoE``).

DeepSpeed's ``MOELayer`` moves fixed ``[E, capacity, H]`` blocks through an equal-split
all-to-all: every expert slot travels, filled or not. ``MoeCommMOELayer`` is a drop-in
subclass that moves only the routed (token, expert) pairs with ``moe_comm.Buffer``. One line,
before the model is built::

    from moe_comm.integrations.deepspeed import apply_deepspeed
    apply_deepspeed()                      # every MoE(...) built afterwards; mode="dropless"

or on a model that already exists (parameters are kept)::

    from moe_comm.integrations.deepspeed import convert
    convert(model, mode="capacity")

Modes:

* ``"dropless"`` (default): the gate runs as with ``drop_tokens=False`` (no token is dropped),
  each local expert runs once over its received rows (no padding), and ``combine`` weights the
  rows by the gate values. Equal to DeepSpeed with ``drop_tokens=False`` up to fp32 rounding:
  the experts' GEMMs see different row counts (no padding rows), so weight gradients sum the
  rows in another order; with k >= 3 (or bf16/fp16 rows of one token on two ranks) the sum
  over a token's experts is grouped by rank.
* ``"capacity"``: DeepSpeed's gating exactly as configured (capacity factor, ``min_capacity``,
  ``drop_tokens``, random token selection); only the kept pairs travel, and each expert rank
  rebuilds DeepSpeed's ``[EP, L, capacity, H]`` block from them and runs DeepSpeed's own
  ``Experts`` module on it. Outputs and gradients equal DeepSpeed's bit for bit for k <= 2 in
  fp32, and for k = 1 in any dtype (see docs/INTEGRATIONS.md for the rest).

``ep_invariant=True`` (in ``apply_deepspeed``, ``convert`` or the class; one node) builds the
layer's Buffer with ``moe_comm.Buffer(..., ep_invariant=True)``: its combine sums each token's
``gate value * expert output row`` in fp32 in the order of the token's choices (DeepSpeed's
``k`` order) and rounds once, so the combined output is a function of those rows and gate
values alone, whatever the EP size and expert placement.

The forward returns what DeepSpeed's returns (``MoE`` then gives ``out, l_aux, exp_counts``).
Expert ``e`` lives on rank ``e // num_local_experts`` of the expert-parallel group, as in
DeepSpeed. Not supported: tensor parallelism of the non-expert part (``groups.mpu`` with TP >
1) and Tutel's dispatcher (ignored). Expert modules must act row-wise on ``[..., H]``, which
DeepSpeed's own padded blocks already assume.

Fault tolerance and formats (docs/FAULT_TOLERANCE.md; docs/FORMATS.md "FP8 dispatch", "FP8 combine";
:mod:`moe_comm.integrations`), in ``apply_deepspeed``, ``convert`` and the class:
``fault_tolerant=True`` (with ``max_tokens_per_rank``) builds the Buffer with
``moe_comm.Buffer(..., fault_tolerant=True)``: a rank that dies is excluded and the survivors'
layers complete forward and backward, the dead rank's experts left out of each token's sum (as
if the gate had dropped those choices). The dropless mode's gate then skips DeepSpeed's capacity
agreement (an all_reduce over the expert-parallel group whose result that mode does not use);
the capacity mode needs ``drop_tokens=True`` (its capacity is then computed locally; with
``drop_tokens=False`` it is agreed by that all_reduce: refused). ``dispatch_dtype="fp8" |
"mxfp8" | "nvfp4"``: the tokens travel quantized and the experts get them dequantized to the
layer's dtype, the input gradient straight through; ``combine_dtype="fp8"``: the weighted
partial sums travel as FP8. Bad values raise ValueError naming the option before anything is
sent.
"""
from __future__ import annotations

import os
import warnings

import torch
from torch import nn

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

# MoeCommMOELayer subclasses DeepSpeed's MOELayer, so it is made on first access (module
# __getattr__), when deepspeed is imported.
__all__ = ["apply_deepspeed", "revert_deepspeed", "convert", "is_applied", "available",
           "capacity_slots", "MODES"]

MODES = ("dropless", "capacity")
_originals: dict[str, type] = {}
_settings: dict = {"mode": "dropless", "max_tokens_per_rank": None, "ep_invariant": False,
                   "fault_tolerant": False, "dispatch_dtype": None, "combine_dtype": None}
_classes: dict[str, type] = {}


def _import_deepspeed_moe():
    if not torch.cuda.is_available():  # DeepSpeed's CPU accelerator, unless one was chosen
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.moe import layer, sharded_moe

    return layer, sharded_moe


def available() -> bool:
    """Whether DeepSpeed's MoE layer can be imported."""
    try:
        _import_deepspeed_moe()
    except ImportError:
        return False
    return True


def is_applied() -> bool:
    return bool(_originals)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; choose one of {MODES}")


def _check_options(mode, max_tokens_per_rank, ep_invariant, fault_tolerant, dispatch_dtype,
                   combine_dtype) -> None:
    _check_mode(mode)
    _check_ep_invariant(ep_invariant)
    _check_fault_tolerant(fault_tolerant)
    _check_sizing(fault_tolerant, max_tokens_per_rank)
    _check_formats(dispatch_dtype, combine_dtype, ep_invariant=ep_invariant)


def apply_deepspeed(mode: str = "dropless", max_tokens_per_rank: int | None = None,
                    ep_invariant: bool = False, fault_tolerant: bool = False,
                    dispatch_dtype: str | None = None, combine_dtype: str | None = None) -> bool:
    """Makes every ``deepspeed.moe.layer.MoE`` built from now on use :class:`MoeCommMOELayer`
    in ``mode`` (``ep_invariant``, ``fault_tolerant``: its Buffer's ``moe_comm.Buffer(...,
    ep_invariant=..., fault_tolerant=...)``, ``fault_tolerant`` with ``max_tokens_per_rank``;
    ``dispatch_dtype`` None, "fp8", "mxfp8", "nvfp4" and ``combine_dtype`` None, "fp8": the
    formats on the wire). Idempotent (a second call only updates the options for layers built
    afterwards). Returns False, with a warning and no change, when DeepSpeed is not
    installed."""
    _check_options(mode, max_tokens_per_rank, ep_invariant, fault_tolerant, dispatch_dtype,
                   combine_dtype)
    try:
        layer, _ = _import_deepspeed_moe()
    except ImportError as error:
        warnings.warn(f"apply_deepspeed(): deepspeed is not importable ({error}); nothing was "
                      "changed. pip install deepspeed to use the plugin.", stacklevel=2)
        return False
    _settings.update(mode=mode, max_tokens_per_rank=max_tokens_per_rank,
                     ep_invariant=ep_invariant, fault_tolerant=fault_tolerant,
                     dispatch_dtype=dispatch_dtype, combine_dtype=combine_dtype)
    if not _originals:
        _originals["MOELayer"] = layer.MOELayer
        layer.MOELayer = _layer_class()
    return True


def revert_deepspeed() -> None:
    """Undoes :func:`apply_deepspeed` for layers built afterwards (idempotent)."""
    if not _originals:
        return
    layer, _ = _import_deepspeed_moe()
    layer.MOELayer = _originals.pop("MOELayer")


def convert(module: nn.Module, mode: str = "dropless", max_tokens_per_rank: int | None = None,
            buffer_cache: BufferCache | None = None, ep_invariant: bool = False,
            fault_tolerant: bool = False, dispatch_dtype: str | None = None,
            combine_dtype: str | None = None) -> int:
    """Turns every DeepSpeed ``MOELayer`` inside ``module`` into a :class:`MoeCommMOELayer`
    in place (same parameters, same process groups); returns how many were converted.
    Layers converted before get the new options."""
    _check_options(mode, max_tokens_per_rank, ep_invariant, fault_tolerant, dispatch_dtype,
                   combine_dtype)
    _, sharded_moe = _import_deepspeed_moe()
    cls = _layer_class()
    count = 0
    for sub in module.modules():
        if isinstance(sub, sharded_moe.MOELayer):
            sub.__class__ = cls
            sub._moe_comm_setup(mode, max_tokens_per_rank, buffer_cache, ep_invariant,
                                fault_tolerant, dispatch_dtype, combine_dtype)
            count += 1
    return count


def __getattr__(name: str):
    if name == "MoeCommMOELayer":
        return _layer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def capacity_slots(src_rank: torch.Tensor, local_expert: torch.Tensor, second_pass: torch.Tensor,
                   world_size: int, num_local_experts: int, capacity: int) -> torch.Tensor:
    """Flat index in DeepSpeed's received block ``[world_size, L, capacity]`` of each row.

    Rows arrive grouped by local expert, then source rank, then source token. DeepSpeed
    places a source's tokens for an expert in token order, except that top-2 gating puts every
    first-choice token before the second-choice ones (``second_pass``); the position of a row
    within its (expert, source) group in that order is its capacity slot.
    """
    n = src_rank.numel()
    group = local_expert * world_size + src_rank
    order = torch.argsort(group * 2 + second_pass.long(), stable=True)
    counts = torch.bincount(group, minlength=num_local_experts * world_size)
    starts = torch.cumsum(counts, 0) - counts
    location = torch.empty_like(src_rank)
    location[order] = torch.arange(n, device=src_rank.device) - starts[group[order]]
    if n and int(location.max()) >= capacity:
        raise RuntimeError("a received row does not fit DeepSpeed's capacity; the ranks "
                           "disagree on the capacity (different token counts per rank?)")
    return (src_rank * num_local_experts + local_expert) * capacity + location


def _layer_class() -> type:
    if "layer" in _classes:
        return _classes["layer"]
    _, sharded_moe = _import_deepspeed_moe()
    from deepspeed.utils import groups
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

    class MoeCommMOELayer(sharded_moe.MOELayer):
        """DeepSpeed ``MOELayer`` whose token movement is ``moe_comm`` dispatch/combine (see
        the module doc). Same constructor as DeepSpeed's, plus keyword-only ``mode``,
        ``max_tokens_per_rank``, ``buffer_cache``, ``ep_invariant``, ``fault_tolerant``,
        ``dispatch_dtype`` and ``combine_dtype`` (None for ``mode``, ``max_tokens_per_rank``,
        ``ep_invariant`` and ``fault_tolerant``, and the two formats left out:
        :func:`apply_deepspeed`'s; a format given as None: no quantization)."""

        def __init__(self, *args, mode: str | None = None,
                     max_tokens_per_rank: int | None = None,
                     buffer_cache: BufferCache | None = None,
                     ep_invariant: bool | None = None, fault_tolerant: bool | None = None,
                     dispatch_dtype=FROM_SETTINGS, combine_dtype=FROM_SETTINGS, **kwargs):
            for check, value in ((_check_ep_invariant, ep_invariant),
                                 (_check_fault_tolerant, fault_tolerant)):
                if value is not None:
                    check(value)
            if dispatch_dtype is not FROM_SETTINGS:
                _check_dispatch_dtype(dispatch_dtype)
            if combine_dtype is not FROM_SETTINGS:
                _check_combine_dtype(combine_dtype)
            super().__init__(*args, **kwargs)
            self._moe_comm_setup(mode, max_tokens_per_rank, buffer_cache, ep_invariant,
                                 fault_tolerant, dispatch_dtype, combine_dtype)

        def _moe_comm_setup(self, mode, max_tokens_per_rank, buffer_cache,
                            ep_invariant=None, fault_tolerant=None,
                            dispatch_dtype=FROM_SETTINGS, combine_dtype=FROM_SETTINGS) -> None:
            options = dict(mode=mode, max_tokens_per_rank=max_tokens_per_rank,
                           ep_invariant=ep_invariant, fault_tolerant=fault_tolerant)
            options = {k: _settings[k] if v is None else v for k, v in options.items()}
            for name, value in (("dispatch_dtype", dispatch_dtype),
                                ("combine_dtype", combine_dtype)):
                options[name] = _settings[name] if value is FROM_SETTINGS else value
            _check_options(**options)
            for name, value in options.items():
                setattr(self, name, value)
            self.buffer_cache = buffer_cache if buffer_cache is not None else buffers
            self.buffer = None

        def _gate(self, reshaped_input, used_token):
            if self.mode == "capacity":
                return self.gate(reshaped_input, used_token, True, False)
            drop, group = self.gate.drop_tokens, self.gate.ep_group
            self.gate.drop_tokens = False
            if self.fault_tolerant:  # no capacity agreement (all_reduce): dropless ignores it
                self.gate.ep_group = None
            try:
                return self.gate(reshaped_input, used_token, True, False)
            finally:
                self.gate.drop_tokens, self.gate.ep_group = drop, group

        def forward(self, *input: torch.Tensor, **kwargs) -> torch.Tensor:
            if bwc_tensor_model_parallel_world_size(groups.mpu) > 1:
                raise ValueError("MoeCommMOELayer does not support tensor parallelism of the "
                                 "non-expert layers")
            if self.ep_group is None:
                raise RuntimeError("the MoE layer has no expert-parallel group yet: call "
                                   "MoE.set_deepspeed_parallelism() or deepspeed.initialize()")
            hidden = input[0].shape[-1]
            x = input[0].reshape(-1, hidden)
            _check_formats(self.dispatch_dtype, self.combine_dtype, hidden=hidden,
                           dtype=x.dtype, ep_invariant=self.ep_invariant)
            _check_sizing(self.fault_tolerant, self.max_tokens_per_rank)
            if self.fault_tolerant and self.mode == "capacity" and not self.gate.drop_tokens:
                raise ValueError("fault_tolerant=True in mode='capacity' needs drop_tokens=True: "
                                 "with drop_tokens=False DeepSpeed's gate agrees on the "
                                 "capacity with an all_reduce over the expert-parallel group, "
                                 "which a dead rank would block; use mode='dropless'")
            used_token = input[1] if len(input) > 1 else None
            self.l_aux, capacity, num_experts, indices, locations, gates, self.exp_counts = \
                self._gate(x, used_token)
            topk = indices.shape[0]
            topk_idx = indices.t().long().contiguous()  # [S, k], -1 = dropped
            weights = gates.t().float()  # [S, k]
            # Top-2 gating places second choices after all first choices: the sign bit of the
            # weight tells the expert rank which pass a row belongs to (x * -1 is exact).
            second = self.mode == "capacity" and getattr(self.gate, "k", topk) == 2
            if second:
                weights = weights * torch.tensor([1.0, -1.0], dtype=weights.dtype,
                                                 device=weights.device)
            self.buffer = self.buffer_cache.get(
                self.ep_group, hidden=hidden, num_experts=num_experts, dtype=x.dtype,
                max_topk=topk, num_tokens=x.shape[0],
                max_tokens_per_rank=self.max_tokens_per_rank, device=x.device,
                ep_invariant=self.ep_invariant, fault_tolerant=self.fault_tolerant)
            res = dispatch(self.buffer, x.contiguous(), topk_idx, weights.contiguous(),
                           self.dispatch_dtype)
            if self.mode == "capacity":
                y, row_weights = self._capacity_experts(res, int(capacity), second)
            else:
                y, row_weights = self._dropless_experts(res), res.weights
            out = self.buffer.combine(y, res.handle, weights=row_weights,
                                      combine_dtype=self.combine_dtype)
            return out.reshape(input[0].shape)

        def _dropless_experts(self, res) -> torch.Tensor:
            bounds = res.expert_offsets.tolist()
            outs = []
            for expert, a, b in zip(self.experts.deepspeed_experts, bounds[:-1], bounds[1:]):
                out = expert(res.x[a:b])
                outs.append(out[0] if isinstance(out, tuple) else out)
            return torch.cat(outs) if outs else res.x[:0]

        def _capacity_experts(self, res, capacity: int, second: bool):
            L, R = self.num_local_experts, self.ep_size
            hidden, dev = res.x.shape[1], res.x.device
            local = torch.repeat_interleave(torch.arange(L, device=dev),
                                            res.tokens_per_expert.to(dev))
            if second:
                second_pass = torch.signbit(res.weights)
                sign = torch.where(second_pass, -1.0, 1.0).to(res.weights.dtype)
                row_weights = res.weights * sign
            else:
                second_pass = torch.zeros_like(res.src_rank, dtype=torch.bool)
                row_weights = res.weights
            slots = capacity_slots(res.src_rank, local, second_pass, R, L, capacity)
            # DeepSpeed's block as its all-to-all would have delivered it: zeros where no
            # token is routed, read by one gather (backward: each row's gradient from its slot).
            source = torch.full((R * L * capacity,), res.x.shape[0], dtype=torch.long,
                                device=dev)
            source[slots] = torch.arange(res.x.shape[0], device=dev)
            padded = torch.cat([res.x, res.x.new_zeros((1, hidden))])
            block = padded.index_select(0, source).view(R, L, capacity, hidden)
            expert_out = self.experts(block).reshape(R * L * capacity, hidden)
            return expert_out.index_select(0, slots), row_weights

    _classes["layer"] = MoeCommMOELayer
    return MoeCommMOELayer
