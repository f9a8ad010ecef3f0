"""Rank jobs for the framework plugins: ``job(rank, world_size, ...)``, module level.

Each job puts the framework's own layer and the plugin's layer side by side on the same weights
and inputs, runs forward and backward through both, and returns what the test asserts on.
Framework shims are applied here, inside the worker processes, and undone before returning.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_comm.integrations import BufferCache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """max |a - b| in float64; 0.0 for two Nones, inf when only one is None or shapes differ."""
    if a is None and b is None:
        return 0.0
    if a is None or b is None or a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max())


def _compare(named_a: dict, named_b: dict) -> dict:
    """Per name: (exactly equal, max |diff|, max |value|)."""
    out = {}
    for name, a in named_a.items():
        b = named_b.get(name)
        exact = a is not None and b is not None and a.shape == b.shape and torch.equal(a, b)
        out[name] = (bool(exact) or (a is None and b is None), _diff(a, b),
                     0.0 if a is None or a.numel() == 0 else float(a.double().abs().max()))
    return out


# ------------------------------------------------------------------------------- formats
def quantize_dequantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x [..., H]`` through ``fmt``'s quantizer and dequantizer, per token, back in x's dtype:
    what the plugins' experts get from a dispatch in ``fmt`` (the kernels quantize bit for bit
    as these references; NVFP4's global scale from all of ``x``, as the send computes it)."""
    from moe_comm import microscale, reference

    rows = x.detach().reshape(-1, x.shape[-1])
    if fmt == "fp8":
        out = reference.dequantize_fp8(*reference.quantize_fp8(rows))
    elif fmt == "mxfp8":
        out = microscale.dequantize_mxfp8(*microscale.quantize_mxfp8(rows))
    else:
        out = microscale.dequantize_nvfp4(*microscale.quantize_nvfp4(rows))
    return out.to(x.dtype).reshape(x.shape)


class _StraightThrough(torch.autograd.Function):
    """``quantize_dequantize`` forward, identity backward: the frameworks' own path fed the rows
    the plugin's experts see, with the gradient the plugin gives ``x``."""

    @staticmethod
    def forward(ctx, x, fmt):
        return quantize_dequantize(x, fmt)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def format_error_bound(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Bound of ``|quantize_dequantize(x) - x|`` per element. FP8 (docs/FORMATS.md "FP8
    dispatch"): at most ``2**-4 |x|`` in e4m3's normal range, ``2**-10 * scale`` in its
    subnormal range, scale = max(amax of the 128-channel group, 1e-4) / 448; MXFP8 the same with
    the power-of-two scale of its 32-channel block. NVFP4 (from its grid: e2m1 keeps one
    mantissa bit, its smallest step is 0.5): ``2**-2 |x|`` plus ``2**-2 * s * g`` (s, g: the
    block and global scales)."""
    from moe_comm import microscale, reference

    rows = x.detach().float().reshape(-1, x.shape[-1])
    T, H = rows.shape
    if fmt == "nvfp4":
        _, s, g = microscale.quantize_nvfp4(rows)
        step = (s.float() * g).repeat_interleave(microscale.NVFP4_GROUP, dim=1)
        return (rows.abs() * 2.0 ** -2 + step * 2.0 ** -2).reshape(x.shape)
    if fmt == "fp8":
        scale = reference.quantize_fp8(rows)[1].repeat_interleave(128, dim=1)
    else:
        codes = microscale.quantize_mxfp8(rows)[1].view(torch.uint8).to(torch.int32)
        scale = (codes << 23).view(torch.float32).repeat_interleave(microscale.MX_GROUP, dim=1)
    return (rows.abs() * 2.0 ** -4 + scale * 2.0 ** -10).reshape(x.shape)


def input_within_format_bound(x: torch.Tensor, fmt: str) -> bool:
    err = (quantize_dequantize(x, fmt).double() - x.double()).abs()
    return bool((err <= format_error_bound(x, fmt).double()).all())


def fp8_combine_bounds(calls: list[dict], rank: int, world_size: int
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per recorded forward: the exact combine of this rank's tokens (float64, no rounding of
    the partials) and the error bound of an FP8 combine from docs/FORMATS.md "FP8 combine": per
    partial (the sum of a token's weighted rows on one expert rank) ``2**-4`` of each element,
    or ``2**-10 * amax / 448`` of its 128-channel group; the ranks' errors add. Collective."""
    results = []
    for call in calls:
        sent = {name: call[name] for name in ("src_rank", "src_token", "y", "weights")}
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, sent)
        T, H = call["out"].shape
        parts = torch.zeros((world_size, T, H), dtype=torch.float64)
        for d, got in enumerate(everyone):
            mine = got["src_rank"] == rank
            rows = got["y"][mine].double()
            if got["weights"] is not None:
                rows = rows * got["weights"][mine].double()[:, None]
            parts[d].index_add_(0, got["src_token"][mine], rows)
        amax = parts.abs().reshape(world_size, T, H // 128, 128).amax(-1).clamp(min=1e-4)
        floor = (amax * 2.0 ** -10 / 448).repeat_interleave(128, dim=-1)
        bound = (parts.abs() * 2.0 ** -4 + floor).sum(0)
        results.append((parts.sum(0), bound, parts.abs().sum(0)))
    return results


def check_fp8_combine_steps(steps: list, outs: list, cache, rank: int, world_size: int):
    """Each step's ``combine_excess`` (:func:`check_fp8_combine`) from ``outs``, one ``(ours,
    theirs)`` pair of outputs per step, against the bounds of the combines ``cache`` recorded."""
    for step, bounds, (ours_out, their_out) in zip(
            steps, fp8_combine_bounds(cache.calls, rank, world_size), outs):
        step["combine_excess"] = check_fp8_combine(ours_out, their_out, bounds)


def check_fp8_combine(ours: torch.Tensor, theirs: torch.Tensor, bounds: tuple) -> float:
    """Largest excess of ``|ours - theirs|`` over the FP8 combine's bound (<= 0: within it):
    ``theirs`` is the exact combine rounded to the dtype, so the bound gets two roundings of
    the dtype (and 1e-5 of itself for the fp32 partials) on top."""
    _, bound, magnitude = bounds
    eps = torch.finfo(ours.dtype).eps
    allowed = bound * (1 + 1e-5) + 2 * eps * magnitude + 1e-30
    return float(((ours.double() - theirs.double()).abs() - allowed).max())


# ------------------------------------------------------------------------------- EP-invariant
class RecordingCache(BufferCache):
    """A BufferCache whose Buffers record, per forward, the dispatch's routing and the rows it
    delivered, and the combine's expert output rows, row weights and output."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def get(self, *args, **kwargs):
        buf = super().get(*args, **kwargs)
        if "dispatch" not in vars(buf):  # each Buffer wrapped once
            dispatch, combine = buf.dispatch, buf.combine

            def recording_dispatch(x, topk_idx, *more, **options):
                res = dispatch(x, topk_idx, *more, **options)
                self.calls.append({"topk_idx": topk_idx.detach().clone(),
                                   "src_rank": res.src_rank, "src_token": res.src_token,
                                   "tokens_per_expert": res.tokens_per_expert})
                return res

            def recording_combine(y, handle, weights=None, **options):
                out = combine(y, handle, weights, **options)
                self.calls[-1].update(
                    y=y.detach().clone(), out=out.detach().clone(),
                    weights=None if weights is None else weights.detach().clone())
                return out

            buf.dispatch, buf.combine = recording_dispatch, recording_combine
        return buf


def invariant_reference(calls: list[dict], rank: int, world_size: int, num_experts: int
                        ) -> list[tuple[bool, float]]:
    """Per recorded forward: (whether this rank's combine output equals, bit for bit,
    ``reference.invariant_combine`` of its tokens' expert output rows and row weights, gathered
    from the ranks that computed them; max |difference|). Collective over the world."""
    from moe_comm import reference

    L = num_experts // world_size
    results = []
    for call in calls:
        sent = {name: call[name] for name in ("src_rank", "src_token", "tokens_per_expert", "y",
                                              "weights")}
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, sent)
        idx, out = call["topk_idx"], call["out"]
        (T, K), H = idx.shape, out.shape[1]
        rows = torch.zeros((T, K, H), dtype=call["y"].dtype)
        weights = None if call["weights"] is None else torch.zeros((T, K))
        found = torch.zeros((T, K), dtype=torch.bool)
        for r, got in enumerate(everyone):
            experts = r * L + torch.repeat_interleave(torch.arange(L), got["tokens_per_expert"])
            for i, expert in enumerate(experts.tolist()):
                if int(got["src_rank"][i]) != rank:
                    continue
                t = int(got["src_token"][i])
                (k,) = (idx[t] == expert).nonzero()[:, 0].tolist()
                rows[t, k] = got["y"][i]
                if weights is not None:
                    weights[t, k] = got["weights"][i]
                found[t, k] = True
        assert torch.equal(found, idx >= 0), f"rank {rank}: a choice's row is missing"
        want = reference.invariant_combine(rows, idx, weights, dtype=out.dtype)
        results.append((bool(torch.equal(out, want)), _diff(out, want)))
    return results


def buffer_cache_keys(rank, world_size) -> dict:
    """One BufferCache asked for the same sizes with ``ep_invariant`` False and True, twice
    each: ``{ep_invariant: [the Buffers' ep_invariant]}`` and how many Buffers it holds."""
    cache = BufferCache()
    sizes = dict(hidden=16, num_experts=2 * world_size, dtype=torch.float32, max_topk=2,
                 num_tokens=4, max_tokens_per_rank=8)
    got = {flag: [cache.get(dist.group.WORLD, **sizes, ep_invariant=flag) for _ in range(2)]
           for flag in (False, True)}
    found = {"live": len(cache), "same": [a is b for a, b in got.values()],
             "distinct": got[False][0] is not got[True][0],
             "flags": {flag: [buf.ep_invariant for buf in bufs] for flag, bufs in got.items()}}
    try:
        cache.get(dist.group.WORLD, **sizes, ep_invariant=None)
    except ValueError as error:
        found["error"] = str(error)
    cache.close()
    return found


def buffer_cache_fault_tolerant(rank, world_size) -> dict:
    """The cache keys its Buffers by ``fault_tolerant`` too, and a fault-tolerant Buffer needs a
    fixed size (sizing by the batch is a collective)."""
    cache = BufferCache()
    sizes = dict(hidden=16, num_experts=2 * world_size, dtype=torch.float32, max_topk=2,
                 num_tokens=4)
    got = {flag: [cache.get(dist.group.WORLD, **sizes, max_tokens_per_rank=8,
                            fault_tolerant=flag) for _ in range(2)] for flag in (False, True)}
    found = {"live": len(cache), "same": [a is b for a, b in got.values()],
             "distinct": got[False][0] is not got[True][0],
             "flags": {flag: [buf.fault_tolerant for buf in bufs] for flag, bufs in got.items()},
             "errors": []}
    for bad in (dict(max_tokens_per_rank=None, fault_tolerant=True),
                dict(max_tokens_per_rank=8, fault_tolerant="yes")):
        try:
            cache.get(dist.group.WORLD, **sizes, **bad)
        except ValueError as error:
            found["errors"].append(str(error))
    found["live_after"] = len(cache)
    cache.close()
    return found


# ------------------------------------------------------------------------------- Megatron
def _megatron_config(world_size: int, dtype: torch.dtype, hidden: int, num_experts: int,
                     topk: int, dispatcher_type: str, capacity_factor: float | None,
                     shared_expert: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=hidden, ffn_hidden_size=2 * hidden, num_attention_heads=4,
        num_moe_experts=num_experts, moe_ffn_hidden_size=2 * hidden, moe_router_topk=topk,
        moe_token_dispatcher_type=dispatcher_type, moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        moe_expert_capacity_factor=capacity_factor,
        moe_shared_expert_intermediate_size=hidden if shared_expert else None,
        moe_permute_fusion=False, expert_model_parallel_size=world_size,
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        add_bias_linear=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False, init_method_std=0.2)


def _megatron_layer(config, layer_cls=None, params: dict | None = None):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts,
                               moe_grouped_gemm=False)
    if layer_cls is not None:
        spec.module = layer_cls
    if params:
        spec.params = {**spec.params, **params}
    return build_module(spec, config=config)


def _run_megatron_layer(layer, x: torch.Tensor, grad_out: torch.Tensor) -> dict:
    x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    out, bias = layer(x)
    assert bias is None
    out.backward(grad_out)
    tensors = {"out": out.detach(), "x.grad": x.grad}
    for name, p in layer.named_parameters():
        tensors[f"{name}.grad"] = p.grad
    return tensors


def _side_by_side(theirs, ours, report: dict, rank: int, seed: int, steps: int, shape: tuple,
                  dtype) -> None:
    """``ours`` takes ``theirs``' weights; ``steps`` forward+backward passes of both on the same
    new inputs each time, compared into ``report["steps"]``."""
    ours.load_state_dict(theirs.state_dict())
    report["their_dispatcher"] = type(theirs.token_dispatcher).__name__
    report["our_dispatcher"] = type(ours.token_dispatcher).__name__
    g = torch.Generator().manual_seed(seed * 100 + rank)
    for _ in range(steps):
        x = torch.randn(shape, generator=g).to(dtype)
        grad_out = torch.randn(shape, generator=g).to(dtype)
        report["steps"].append(_compare(_run_megatron_layer(theirs, x, grad_out),
                                        _run_megatron_layer(ours, x, grad_out)))


def megatron_parity(rank, world_size, dtype_name: str, hidden: int, num_experts: int,
                    topk: int, tokens: tuple, seed: int, *, dispatcher_type: str = "alltoall",
                    use: str = "spec", capacity_factor: float | None = None,
                    shared_expert: bool = False, steps: int = 2,
                    ep_invariant: bool | None = None) -> dict:
    """Megatron's own alltoall dispatcher vs moe_comm's, same weights and inputs, ``steps``
    forward+backward passes (new inputs each); ``use`` = "spec" (``MoeCommMoELayer``) or
    "apply" (``apply_megatron()`` then a plain spec with ``dispatcher_type``). With
    ``ep_invariant`` (spec: ``params={"ep_invariant": ...}``; apply: ``apply_megatron(
    ep_invariant=...)``) the report also has the Buffer's ``ep_invariant`` and, per step,
    ``invariant_reference`` (see :func:`invariant_reference`)."""
    from framework_shims import megatron_cpu_shims, megatron_parallel_state
    from moe_comm.integrations import megatron as plugin

    dtype = DTYPES[dtype_name]
    seq, batch = tokens[rank]
    report: dict = {"steps": []}
    cache = RecordingCache()
    options = {} if ep_invariant is None else {"ep_invariant": ep_invariant}
    with megatron_cpu_shims(), megatron_parallel_state(world_size):
        torch.manual_seed(seed)
        theirs = _megatron_layer(_megatron_config(world_size, dtype, hidden, num_experts, topk,
                                                  "alltoall", capacity_factor, shared_expert))
        config = _megatron_config(world_size, dtype, hidden, num_experts, topk,
                                  dispatcher_type, capacity_factor, shared_expert)
        if use == "spec":
            ours = _megatron_layer(config, plugin.MoeCommMoELayer, params=options)
        else:
            settings = dict(plugin._settings)
            assert plugin.apply_megatron(**options) and plugin.apply_megatron(**options)
            report["applied"] = plugin.is_applied()
            try:
                ours = _megatron_layer(config)
            finally:
                plugin.revert_megatron()
                plugin._settings.update(settings)  # the next job in this worker starts afresh
            report["reverted"] = not plugin.is_applied()
        ours.token_dispatcher.buffer_cache = cache
        _side_by_side(theirs, ours, report, rank, seed, steps, (seq, batch, hidden), dtype)
        buf = ours.token_dispatcher.buffer
        report["bytes_to_peers"] = buf.stats()["dispatch_bytes_to_peers"]
        report["dropped"] = int((ours.token_dispatcher.topk_idx < 0).sum())
        report["buffers"] = len(cache)
        report["ep_invariant"] = buf.ep_invariant
        if ep_invariant is not None:
            report["invariant_reference"] = invariant_reference(cache.calls, rank, world_size,
                                                                num_experts)
        cache.close()
    return report


def megatron_rejects(rank, world_size) -> dict:
    """What the plugin refuses, each with its message: configs it does not support, and
    shared-expert overlap."""
    from framework_shims import megatron_cpu_shims, megatron_parallel_state
    from moe_comm.integrations import megatron as plugin

    errors = {}
    with megatron_cpu_shims(), megatron_parallel_state(world_size):
        base = dict(world_size=world_size, dtype=torch.float32, hidden=16, num_experts=4,
                    topk=2, dispatcher_type="alltoall", capacity_factor=None,
                    shared_expert=False)
        config = _megatron_config(**{**base, "capacity_factor": 1.0})
        config.moe_pad_expert_input_to_capacity = True
        try:
            _megatron_layer(config, plugin.MoeCommMoELayer)
        except ValueError as error:
            errors["pad_to_capacity"] = str(error)
        layer = _megatron_layer(_megatron_config(**base), plugin.MoeCommMoELayer)
        try:
            layer.token_dispatcher.set_shared_experts(None)
        except ValueError as error:
            errors["shared_expert_overlap"] = str(error)
        # options that do not fit the layer: refused when it is built (hidden 16 here)
        for name, params in (("fp8_hidden", {"dispatch_dtype": "fp8"}),
                             ("mxfp8_hidden", {"dispatch_dtype": "mxfp8"}),
                             ("combine_hidden", {"combine_dtype": "fp8"}),
                             ("bad_dispatch_dtype", {"dispatch_dtype": "int8"}),
                             ("bad_combine_dtype", {"combine_dtype": torch.bfloat16}),
                             ("bad_fault_tolerant", {"fault_tolerant": 1}),
                             ("unsized_fault_tolerant", {"fault_tolerant": True}),
                             ("invariant_fp8_combine", {"ep_invariant": True,
                                                        "combine_dtype": "fp8"})):
            try:
                _megatron_layer(_megatron_config(**base), plugin.MoeCommMoELayer, params=params)
            except ValueError as error:
                errors[name] = str(error)
        layer = _megatron_layer(_megatron_config(**base), plugin.MoeCommMoELayer,
                                params={"dispatch_dtype": "nvfp4"})  # 16 % 16 == 0: fits
        errors["nvfp4_fits"] = layer.token_dispatcher.dispatch_dtype
    return errors


def _run_megatron_step(layer, x, grad_out, optimizer=None) -> dict:
    """One training step: forward, backward of ``<out, grad_out>``, then ``optimizer.step()``."""
    tensors = _run_megatron_layer(layer, x, grad_out)
    if optimizer is not None:
        optimizer.step()
    return tensors


def megatron_formats(rank, world_size, dtype_name: str, hidden: int, num_experts: int,
                     topk: int, tokens: tuple, seed: int, *, dispatch_dtype: str | None = None,
                     combine_dtype: str | None = None, use: str = "spec",
                     steps: int = 2) -> dict:
    """The plugin's layer with ``dispatch_dtype`` / ``combine_dtype`` (``use``: "spec",
    ``MoeCommMoELayer`` params; "apply", ``apply_megatron(...)``) against Megatron's own
    alltoall dispatcher fed the same rows: its dispatcher's input goes through
    ``quantize_dequantize`` (identity backward), so both layers' experts see the same
    dequantized rows. Per step: ``_compare`` of everything; ``plain_differs``, whether the
    output differs from Megatron's unquantized path; ``input_in_bound``, the dequantized rows
    within the format's bound of ``x``; with the FP8 combine, ``combine_excess`` (see
    :func:`check_fp8_combine`) and whether the output differs from Megatron's."""
    from framework_shims import megatron_cpu_shims, megatron_parallel_state
    from moe_comm.integrations import megatron as plugin

    dtype = DTYPES[dtype_name]
    seq, batch = tokens[rank]
    report: dict = {"steps": []}
    cache = RecordingCache()
    options = {"dispatch_dtype": dispatch_dtype, "combine_dtype": combine_dtype}
    with megatron_cpu_shims(), megatron_parallel_state(world_size):
        torch.manual_seed(seed)
        config = _megatron_config(world_size, dtype, hidden, num_experts, topk, "alltoall",
                                  None, False)
        theirs = _megatron_layer(config)
        if use == "spec":
            ours = _megatron_layer(config, plugin.MoeCommMoELayer, params=options)
        else:
            settings = dict(plugin._settings)
            assert plugin.apply_megatron(**options)
            try:
                ours = _megatron_layer(config)
            finally:
                plugin.revert_megatron()
                plugin._settings.update(settings)
        ours.token_dispatcher.buffer_cache = cache
        ours.load_state_dict(theirs.state_dict())
        report["our_dispatcher"] = type(ours.token_dispatcher).__name__
        report["formats"] = (ours.token_dispatcher.dispatch_dtype,
                             ours.token_dispatcher.combine_dtype)
        preprocess = theirs.token_dispatcher.dispatch_preprocess
        fed = {"quantized": False}

        def quantized_preprocess(hidden_states, routing_map, probs):
            if fed["quantized"] and dispatch_dtype is not None:
                hidden_states = _StraightThrough.apply(hidden_states, dispatch_dtype)
            return preprocess(hidden_states, routing_map, probs)

        theirs.token_dispatcher.dispatch_preprocess = quantized_preprocess
        g = torch.Generator().manual_seed(seed * 100 + rank)
        outs = []
        for _ in range(steps):
            x = torch.randn((seq, batch, hidden), generator=g).to(dtype)
            grad_out = torch.randn((seq, batch, hidden), generator=g).to(dtype)
            plain = _run_megatron_layer(theirs, x, grad_out)["out"]
            fed["quantized"] = True
            want = _run_megatron_layer(theirs, x, grad_out)
            fed["quantized"] = False
            got = _run_megatron_layer(ours, x, grad_out)
            compared = _compare(want, got)
            compared["plain_differs"] = not torch.equal(plain, got["out"])
            compared["input_in_bound"] = (dispatch_dtype is None
                                          or input_within_format_bound(x, dispatch_dtype))
            report["steps"].append(compared)
            outs.append((got["out"].reshape(-1, hidden), want["out"].reshape(-1, hidden)))
        if combine_dtype is not None:
            check_fp8_combine_steps(report["steps"], outs, cache, rank, world_size)
        report["bytes_to_peers"] = ours.token_dispatcher.buffer.stats()["dispatch_bytes_to_peers"]
        cache.close()
    return report


def _kill_at(obj, name: str) -> None:
    """This process dies (SIGKILL) when ``obj.name`` is next called."""
    import os
    import signal

    setattr(obj, name, lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL))


def megatron_fault_step(rank, world_size, hidden: int, num_experts: int, topk: int,
                        tokens: tuple, seed: int, doomed: int, max_tokens: int) -> dict:
    """``apply_megatron(fault_tolerant=True, max_tokens_per_rank=max_tokens)``; step 0 on every
    rank; rank ``doomed`` dies (SIGKILL) inside training step 1, when its layer reaches the
    dispatch; the survivors complete steps 1 and 2 (forward, backward, SGD). The reference,
    computed before the death by Megatron's own alltoall dispatcher on every rank: the same
    steps with the router's choices of the dead rank's experts dropped and the dead rank
    sending no token (what the survivors' layers see). Per survivor: ``_compare`` of each
    step, the parameters after the steps, and the Buffer's active ranks."""
    from framework_shims import megatron_cpu_shims, megatron_parallel_state
    from moe_comm.integrations import megatron as plugin

    seq, batch = tokens[rank]
    report: dict = {}
    L = num_experts // world_size
    with megatron_cpu_shims(), megatron_parallel_state(world_size):
        torch.manual_seed(seed)
        config = _megatron_config(world_size, torch.float32, hidden, num_experts, topk,
                                  "alltoall", None, False)
        theirs = _megatron_layer(config)
        settings = dict(plugin._settings)
        assert plugin.apply_megatron(max_tokens_per_rank=max_tokens, fault_tolerant=True)
        try:
            ours = _megatron_layer(config)
        finally:
            plugin.revert_megatron()
            plugin._settings.update(settings)
        ours.token_dispatcher.buffer_cache = cache = BufferCache()
        ours.load_state_dict(theirs.state_dict())
        g = torch.Generator().manual_seed(seed * 100 + rank)
        inputs = [(torch.randn((seq, batch, hidden), generator=g),
                   torch.randn((seq, batch, hidden), generator=g)) for _ in range(3)]
        report["step0"] = _compare(_run_megatron_step(theirs, *inputs[0]),
                                   _run_megatron_step(ours, *inputs[0]))
        report["fault_tolerant"] = ours.token_dispatcher.buffer.fault_tolerant
        route = theirs.router.forward
        keep = torch.ones(num_experts, dtype=torch.bool)
        keep[doomed * L:(doomed + 1) * L] = False
        if rank == doomed:
            keep[:] = False

        def survivors_route(*args, **kwargs):
            probs, routing_map = route(*args, **kwargs)
            return probs * keep, routing_map & keep

        theirs.router.forward = survivors_route
        sgd = torch.optim.SGD(theirs.parameters(), lr=0.1)
        want = [_run_megatron_step(theirs, *inputs[s], sgd) for s in (1, 2)]
        report["dropped"] = int((~keep).sum())
        if rank == doomed:
            _kill_at(ours.token_dispatcher.buffer, "dispatch")
        sgd = torch.optim.SGD(ours.parameters(), lr=0.1)
        got = [_run_megatron_step(ours, *inputs[s], sgd) for s in (1, 2)]
        report["steps"] = [_compare(a, b) for a, b in zip(want, got)]
        mine = dict(ours.named_parameters())
        report["params_equal"] = all(torch.equal(p, mine[name])
                                     for name, p in theirs.named_parameters())
        report["finite"] = all(bool(torch.isfinite(t).all()) for step in got
                               for t in step.values() if t is not None)
        report["active"] = ours.token_dispatcher.buffer.active_ranks().tolist()
        cache.close()
    return report


# ------------------------------------------------------------------------------- DeepSpeed
class _ExpertMLP(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden, ffn)
        self.fc2 = torch.nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _deepspeed_moe(deepspeed, world_size, hidden, num_experts, topk, drop_tokens, seed,
                   capacity_factor, min_capacity):
    from deepspeed.moe.layer import MoE

    torch.manual_seed(seed)
    moe = MoE(hidden_size=hidden, expert=_ExpertMLP(hidden, 2 * hidden), num_experts=num_experts,
              ep_size=world_size, k=topk, capacity_factor=capacity_factor,
              min_capacity=min_capacity, drop_tokens=drop_tokens, use_rts=False,
              top2_2nd_expert_sampling=False)
    moe.set_deepspeed_parallelism()
    return moe


def _run_deepspeed_moe(moe, x: torch.Tensor, grad_out: torch.Tensor) -> dict:
    x = x.clone().requires_grad_()
    moe.zero_grad(set_to_none=True)
    out, l_aux, exp_counts = moe(x)
    (out.float() * grad_out.float()).sum().add(l_aux).backward()
    tensors = {"out": out.detach(), "l_aux": l_aux.detach().reshape(1),
               "exp_counts": exp_counts.reshape(-1), "x.grad": x.grad}
    for name, p in moe.named_parameters():
        tensors[f"{name}.grad"] = p.grad
    return tensors


def deepspeed_parity(rank, world_size, dtype_name: str, hidden: int, num_experts: int,
                     topk: int, tokens: int, seed: int, *, mode: str, drop_tokens: bool,
                     capacity_factor: float = 1.0, min_capacity: int = 1, steps: int = 2,
                     use: str = "class", plugin_drop_tokens: bool | None = None,
                     ep_invariant: bool | None = None) -> dict:
    """DeepSpeed's ``MOELayer`` vs ``MoeCommMOELayer`` in ``mode`` ("capacity" or
    "dropless"), same weights and inputs. The reference runs with ``drop_tokens``, the plugin's
    layer is built with ``plugin_drop_tokens`` (default: the same); ``use`` = "class"
    (``convert`` the layer) or "apply" (``apply_deepspeed()`` before ``MoE(...)``). With
    ``ep_invariant`` (passed to ``convert`` or ``apply_deepspeed``) the report also has the
    Buffer's ``ep_invariant`` and, per step, ``invariant_reference`` (see
    :func:`invariant_reference`)."""
    from framework_shims import deepspeed_cpu_env

    deepspeed = deepspeed_cpu_env()
    from moe_comm.integrations import deepspeed as plugin

    dtype = DTYPES[dtype_name]
    cache = RecordingCache()
    options = {} if ep_invariant is None else {"ep_invariant": ep_invariant}
    theirs = _deepspeed_moe(deepspeed, world_size, hidden, num_experts, topk, drop_tokens, seed,
                            capacity_factor, min_capacity)
    if plugin_drop_tokens is not None:
        drop_tokens = plugin_drop_tokens
    report: dict = {"steps": []}
    if use == "apply":
        settings = dict(plugin._settings)
        assert plugin.apply_deepspeed(mode=mode, **options) and \
            plugin.apply_deepspeed(mode=mode, **options)
        try:
            ours = _deepspeed_moe(deepspeed, world_size, hidden, num_experts, topk, drop_tokens,
                                  seed, capacity_factor, min_capacity)
        finally:
            plugin.revert_deepspeed()
            plugin._settings.update(settings)  # the next job in this worker starts afresh
    else:
        ours = _deepspeed_moe(deepspeed, world_size, hidden, num_experts, topk, drop_tokens,
                              seed, capacity_factor, min_capacity)
        plugin.convert(ours, mode=mode, **options)
    ours.deepspeed_moe.buffer_cache = cache
    ours.load_state_dict(theirs.state_dict())
    theirs.to(dtype)
    ours.to(dtype)
    report["their_layer"] = type(theirs.deepspeed_moe).__name__
    report["our_layer"] = type(ours.deepspeed_moe).__name__
    g = torch.Generator().manual_seed(seed * 100 + rank)
    for _ in range(steps):
        x = torch.randn((2, tokens // 2, hidden), generator=g).to(dtype)
        grad_out = torch.randn((2, tokens // 2, hidden), generator=g).to(dtype)
        a = _run_deepspeed_moe(theirs, x, grad_out)
        b = _run_deepspeed_moe(ours, x, grad_out)
        report["steps"].append(_compare(a, b))
    report["bytes_to_peers"] = ours.deepspeed_moe.buffer.stats()["dispatch_bytes_to_peers"]
    report["ep_invariant"] = ours.deepspeed_moe.buffer.ep_invariant
    if ep_invariant is not None:
        report["invariant_reference"] = invariant_reference(cache.calls, rank, world_size,
                                                            num_experts)
    with torch.no_grad():  # the last step's routing, recomputed by DeepSpeed's gate
        gate_out = theirs.deepspeed_moe.gate(x.reshape(-1, hidden), None, True)
    report["dropped"] = int((gate_out[3] < 0).sum())
    report["capacity"] = int(gate_out[1])
    cache.close()
    return report


def deepspeed_formats(rank, world_size, dtype_name: str, hidden: int, num_experts: int,
                      topk: int, tokens: int, seed: int, *, mode: str, drop_tokens: bool,
                      dispatch_dtype: str | None = None, combine_dtype: str | None = None,
                      use: str = "class", steps: int = 2) -> dict:
    """``MoeCommMOELayer`` with ``dispatch_dtype`` / ``combine_dtype`` (``use``: "class",
    ``convert(...)``; "apply", ``apply_deepspeed(...)``) against DeepSpeed's own ``MOELayer``
    fed the same rows: the tokens it places in its expert blocks (``sharded_moe._sparse_encode``)
    go through ``quantize_dequantize`` (identity backward). Reports as
    :func:`megatron_formats`."""
    from framework_shims import deepspeed_cpu_env

    deepspeed = deepspeed_cpu_env()
    from deepspeed.moe import sharded_moe

    from moe_comm.integrations import deepspeed as plugin

    dtype = DTYPES[dtype_name]
    cache = RecordingCache()
    options = {"dispatch_dtype": dispatch_dtype, "combine_dtype": combine_dtype}
    theirs = _deepspeed_moe(deepspeed, world_size, hidden, num_experts, topk, drop_tokens, seed,
                            1.0, 1)
    if use == "apply":
        settings = dict(plugin._settings)
        assert plugin.apply_deepspeed(mode=mode, **options)
        try:
            ours = _deepspeed_moe(deepspeed, world_size, hidden, num_experts, topk, drop_tokens,
                                  seed, 1.0, 1)
        finally:
            plugin.revert_deepspeed()
            plugin._settings.update(settings)
    else:
        ours = _deepspeed_moe(deepspeed, world_size, hidden, num_experts, topk, drop_tokens,
                              seed, 1.0, 1)
        plugin.convert(ours, mode=mode, **options)
    layer = ours.deepspeed_moe
    layer.buffer_cache = cache
    ours.load_state_dict(theirs.state_dict())
    theirs.to(dtype)
    ours.to(dtype)
    report: dict = {"steps": [], "our_layer": type(layer).__name__,
                    "formats": (layer.dispatch_dtype, layer.combine_dtype)}
    encode = sharded_moe._sparse_encode

    def quantized_encode(reshaped_input, *args):
        return encode(_StraightThrough.apply(reshaped_input, dispatch_dtype), *args)

    g = torch.Generator().manual_seed(seed * 100 + rank)
    outs = []
    for _ in range(steps):
        x = torch.randn((2, tokens // 2, hidden), generator=g).to(dtype)
        grad_out = torch.randn((2, tokens // 2, hidden), generator=g).to(dtype)
        plain = _run_deepspeed_moe(theirs, x, grad_out)["out"]
        if dispatch_dtype is not None:
            sharded_moe._sparse_encode = quantized_encode
        try:
            want = _run_deepspeed_moe(theirs, x, grad_out)
        finally:
            sharded_moe._sparse_encode = encode
        got = _run_deepspeed_moe(ours, x, grad_out)
        compared = _compare(want, got)
        compared["plain_differs"] = not torch.equal(plain, got["out"])
        compared["input_in_bound"] = (dispatch_dtype is None
                                      or input_within_format_bound(x, dispatch_dtype))
        report["steps"].append(compared)
        outs.append((got["out"].reshape(-1, hidden), want["out"].reshape(-1, hidden)))
    if combine_dtype is not None:
        check_fp8_combine_steps(report["steps"], outs, cache, rank, world_size)
    report["bytes_to_peers"] = layer.buffer.stats()["dispatch_bytes_to_peers"]
    cache.close()
    return report


def deepspeed_fault_step(rank, world_size, hidden: int, num_experts: int, topk: int,
                         tokens: int, seed: int, doomed: int, max_tokens: int,
                         mode: str = "dropless") -> dict:
    """``convert(..., mode, fault_tolerant=True, max_tokens_per_rank=max_tokens)``; step 0 on
    every rank; rank ``doomed`` dies (SIGKILL) inside training step 1, when its layer calls the
    Buffer's dispatch; the survivors complete steps 1 and 2 (forward, backward, SGD). The
    reference, computed before the death by DeepSpeed's own ``MOELayer`` (``drop_tokens=False``
    for the dropless mode) on every rank: the same steps with the gate's choices of the dead
    rank's experts dropped (index -1) and the dead rank sending no token. Reports as
    :func:`megatron_fault_step`."""
    from framework_shims import deepspeed_cpu_env

    deepspeed = deepspeed_cpu_env()
    from moe_comm.integrations import deepspeed as plugin

    drop_tokens = mode == "capacity"
    L = num_experts // world_size
    theirs = _deepspeed_moe(deepspeed, world_size, hidden, num_experts, topk, drop_tokens, seed,
                            1.0, 1)
    ours = _deepspeed_moe(deepspeed, world_size, hidden, num_experts, topk, drop_tokens, seed,
                          1.0, 1)
    cache = BufferCache()
    plugin.convert(ours, mode=mode, fault_tolerant=True, max_tokens_per_rank=max_tokens,
                   buffer_cache=cache)
    ours.load_state_dict(theirs.state_dict())
    g = torch.Generator().manual_seed(seed * 100 + rank)
    inputs = [(torch.randn((2, tokens // 2, hidden), generator=g),
               torch.randn((2, tokens // 2, hidden), generator=g)) for _ in range(3)]
    report: dict = {"step0": _compare(_run_deepspeed_moe(theirs, *inputs[0]),
                                      _run_deepspeed_moe(ours, *inputs[0]))}
    layer = ours.deepspeed_moe
    report["fault_tolerant"] = layer.buffer.fault_tolerant
    gate = theirs.deepspeed_moe.gate
    route = gate.forward

    def survivors_route(*args, **kwargs):
        out = list(route(*args, **kwargs))
        indices = out[3]
        drop = (indices >= 0) & ((indices.long() // L == doomed) | (rank == doomed))
        out[3] = torch.where(drop, torch.full_like(indices, -1), indices)
        report["dropped"] = report.get("dropped", 0) + int(drop.sum())
        return tuple(out)

    gate.forward = survivors_route

    def step(moe, optimizer, x, grad_out):
        tensors = _run_deepspeed_moe(moe, x, grad_out)
        optimizer.step()
        return tensors

    sgd = torch.optim.SGD(theirs.parameters(), lr=0.1)
    want = [step(theirs, sgd, *inputs[s]) for s in (1, 2)]
    if rank == doomed:
        _kill_at(layer.buffer, "dispatch")
    sgd = torch.optim.SGD(ours.parameters(), lr=0.1)
    got = [step(ours, sgd, *inputs[s]) for s in (1, 2)]
    report["steps"] = [_compare(a, b) for a, b in zip(want, got)]
    mine = dict(ours.named_parameters())
    with torch.no_grad():
        report["params_diff"] = max(_diff(p, mine[name])
                                    for name, p in theirs.named_parameters())
        report["params_scale"] = max(float(p.abs().max()) for p in theirs.parameters())
    report["finite"] = all(bool(torch.isfinite(t.float()).all()) for s in got
                           for t in s.values() if t is not None)
    report["active"] = layer.buffer.active_ranks().tolist()
    cache.close()
    return report


def deepspeed_rejects(rank, world_size) -> dict:
    """What the plugin refuses, each with its message, before anything is sent."""
    from framework_shims import deepspeed_cpu_env

    deepspeed = deepspeed_cpu_env()
    from moe_comm.integrations import deepspeed as plugin

    errors = {}
    x = torch.randn((2, 4, 16))
    for name, options, drop_tokens in (
            ("fp8_hidden", {"dispatch_dtype": "fp8"}, True),
            ("combine_hidden", {"combine_dtype": "fp8"}, True),
            ("capacity_without_drops", {"mode": "capacity", "fault_tolerant": True,
                                        "max_tokens_per_rank": 8}, False)):
        moe = _deepspeed_moe(deepspeed, world_size, 16, 2 * world_size, 2, drop_tokens, 1,
                             1.0, 1)
        plugin.convert(moe, **options)
        try:
            moe(x)
        except ValueError as error:
            errors[name] = str(error)
        if moe.deepspeed_moe.buffer is not None:
            errors[name + ": sent"] = True
    moe = _deepspeed_moe(deepspeed, world_size, 16, 2 * world_size, 2, True, 1, 1.0, 1)
    for name, options in (("bad_dispatch_dtype", {"dispatch_dtype": "fp4"}),
                          ("bad_combine_dtype", {"combine_dtype": "nvfp4"}),
                          ("bad_fault_tolerant", {"fault_tolerant": None}),
                          ("unsized_fault_tolerant", {"fault_tolerant": True}),
                          ("invariant_fp8_combine", {"ep_invariant": True,
                                                     "combine_dtype": "fp8"})):
        try:
            plugin.convert(moe, **options)
        except ValueError as error:
            errors[name] = str(error)
    return errors


# ------------------------------------------------------------------------------- benchmark
def framework_compare_job(rank, world_size, *args) -> dict:
    """``bench/framework_compare.framework_job`` (bench/ is put on this worker's path)."""
    import os
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import framework_compare

    return framework_compare.framework_job(rank, world_size, *args)


def megatron_deep_ep_parity(rank, world_size, dtype_name: str, hidden: int, num_experts: int,
                            topk: int, tokens: tuple, seed: int, steps: int = 3) -> dict:
    """Megatron-Core's own flex dispatcher with its DeepEP backend, unmodified, running over
    ``moe_comm.deep_ep`` (installed as ``deep_ep`` before Megatron is imported: run in a fresh
    pool), against Megatron's alltoall dispatcher on the same weights and inputs."""
    from moe_comm import deep_ep

    deep_ep.install()
    from megatron.core.transformer.moe import fused_a2a

    from framework_shims import megatron_cpu_shims, megatron_parallel_state

    dtype = DTYPES[dtype_name]
    seq, batch = tokens[rank]
    report: dict = {"steps": [], "have_deep_ep": fused_a2a.HAVE_DEEP_EP}
    with megatron_cpu_shims(), megatron_parallel_state(world_size):
        torch.manual_seed(seed)
        theirs = _megatron_layer(_megatron_config(world_size, dtype, hidden, num_experts, topk,
                                                  "alltoall", None, False))
        ours = _megatron_layer(_megatron_config(world_size, dtype, hidden, num_experts, topk,
                                                "flex", None, False))
        _side_by_side(theirs, ours, report, rank, seed, steps, (seq, batch, hidden), dtype)
        buf = fused_a2a._buffer
        report["buffer"] = type(buf).__module__
        report["bytes_to_peers"] = buf._normal.stats()["dispatch_bytes_to_peers"]
        report["buffers"] = 1
        buf.destroy()
        fused_a2a._buffer = None
    return report
