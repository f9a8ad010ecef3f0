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
    return errors


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
