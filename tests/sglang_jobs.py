"""Jobs that run sglang 0.5.21's DeepEP token dispatcher over ``moe_comm.deep_ep`` on CPU ranks.

Each job builds SGLang the way ``--moe-a2a-backend deepep --deepep-mode {normal, low_latency,
auto}`` does on every rank (``ServerArgs`` -> ``publish`` -> ``initialize_model_parallel`` ->
``initialize_moe_config`` -> ``create_moe_dispatcher``), feeds it hidden states and top-k
choices, runs a cheap elementwise expert on what arrives, combines, and compares the output of
every token with a dense computation over all experts from the global inputs (no expert
parallelism, no dispatcher). The stand-ins for CUDA-only pieces are in ``sglang_shims``.

The expert stage is what SGLang's DeepGEMM runner does around its GEMMs, with the GEMMs replaced
by ``expert(x, e) = x * (1 + e / 8) + e`` (global expert id ``e``, fp32, rounded to bf16):

* normal mode: each received token through the experts of its local choices, weighted by its
  ``recv_topk_weights`` and summed in fp32 in choice order, written as bf16 (what SGLang's
  ``ep_scatter`` -> grouped GEMM -> ``ep_gather`` compute), then ``combine``, which adds the
  per-rank bf16 partial sums in fp32 and rounds once;
* low-latency mode: the expert on the first ``masked_m[e]`` rows of each local expert's block
  (DeepGEMM's masked layout), then ``combine``, which weights and sums in fp32 in choice order.

The dense reference is ``bf16(sum_k w[t, k] * bf16(expert(x~[t], e[t, k])))`` in fp32 in choice
order, where ``x~`` is ``x`` or its FP8 round trip (normal mode: SGLang's per-token group cast;
low-latency mode: DeepEP's, ``scale = max(amax, 1e-4) / 448``). How close each mode comes is
documented on ``check_against_dense``.
"""
from __future__ import annotations

import contextlib
import os

import sglang_shims
import torch
import torch.distributed as dist

HIDDEN = 256
FP8_GROUP = 128
UNIT_ROUNDOFF_BF16 = 2.0 ** -8
MAX_DISPATCH_TOKENS = 16  # SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK (default 128)


# ------------------------------------------------------------------ inputs and the reference
def make_inputs(world_size: int, num_experts: int, topk: int, tokens: tuple[int, ...],
                seed: int):
    """Every rank's ``(x [T, H] bf16, topk_ids [T, K] int32, topk_weights [T, K] fp32)`` from one
    seed. Ids are distinct per token; one token of each rank has every choice -1 (what SGLang's
    top-k writes for padding tokens) and one more choice is -1 somewhere."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for rank, T in enumerate(tokens):
        x = torch.randn((T, HIDDEN), generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(T)])
        w = torch.rand((T, topk), generator=g)
        if T > 2:
            ids[rank % T] = -1
            ids[(rank + 1) % T, -1] = -1
        out.append((x, ids.to(torch.int32), w))
    return out


def expert(x: torch.Tensor, e) -> torch.Tensor:
    """The stand-in for expert ``e``'s MLP: elementwise, fp32, bf16 out."""
    e = torch.as_tensor(e, dtype=torch.float32)
    if e.dim() == 1:
        e = e[:, None]
    return (x.float() * (1 + e / 8) + e).to(torch.bfloat16)


def deepep_ll_fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """DeepEP's low-latency FP8 cast (per token, per 128 channels, ``max(amax, 1e-4) / 448``),
    dequantized: what an expert sees of ``x``."""
    T, H = x.shape
    g = x.float().reshape(T, H // FP8_GROUP, FP8_GROUP)
    scale = g.abs().amax(-1).clamp(min=1e-4) / torch.tensor(448.0)
    q = (g / scale[..., None]).to(torch.float8_e4m3fn)
    return (q.float() * scale[..., None]).reshape(T, H)


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP8 rows [N, H] times their per-128-channel scales [N, H / 128] (any strides): fp32."""
    N, H = q.shape
    return (q.float().reshape(N, H // FP8_GROUP, FP8_GROUP) * scales[..., None]).reshape(N, H)


def sglang_fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    return dequantize(*sglang_shims.fp8_group_quant(x, FP8_GROUP))


def dense_reference(x, ids, w, seen):
    """``(out [T, H] bf16, magnitude [T, H] fp32 = sum_k |w y|)`` without expert parallelism:
    every token against all of its experts, summed in fp32 in choice order."""
    xs = seen(x)
    acc = torch.zeros(x.shape, dtype=torch.float32)
    mag = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(ids.shape[1]):
        valid = ids[:, k] >= 0
        y = expert(xs, ids[:, k].clamp(min=0)).float() * w[:, k, None]
        acc = acc + torch.where(valid[:, None], y, 0.0)
        mag = mag + torch.where(valid[:, None], y.abs(), 0.0)
    return acc.to(torch.bfloat16), mag


def check_against_dense(out, ref, mag, ids, rank: int, local_experts: int, exact: bool,
                        what: str) -> dict:
    """Low-latency mode (``exact``): ``torch.equal`` for every token: the combine weights and
    sums in fp32 in choice order and rounds once, as the reference does.

    Normal mode: the combine adds per-rank partial sums that ``ep_gather`` already rounded to
    bf16, so a token whose choices live on one rank equals the reference exactly, and a token
    whose choices span ranks is within ``2^-8 * (sum_k |w y| + 2 |ref|)`` of it (each partial
    and the final sum rounded once to bf16, unit roundoff 2^-8) plus fp32 noise."""
    owners = torch.where(ids >= 0, ids.long() // local_experts, -1)
    spans = torch.tensor([len(set(row.tolist()) - {-1}) > 1 for row in owners], dtype=torch.bool)
    if exact:
        assert torch.equal(out, ref), f"rank {rank} {what}: differs from the dense reference " \
            f"by {(out.float() - ref.float()).abs().max():.3e}"
    else:
        single = ~spans
        assert torch.equal(out[single], ref[single]), \
            f"rank {rank} {what}: a token with all choices on one rank differs"
        diff = (out.float() - ref.float()).abs()[spans]
        bound = (UNIT_ROUNDOFF_BF16 * (mag + 2 * ref.float().abs()) + 1e-6 * mag)[spans]
        assert bool((diff <= bound).all()), \
            f"rank {rank} {what}: {(diff - bound).max():.3e} beyond the rounding bound"
    return {"tokens": int(out.shape[0]), "spanning": int(spans.sum()),
            "max_abs_diff": float((out.float() - ref.float()).abs().max())
            if out.numel() else 0.0}


# ------------------------------------------------------------------ SGLang on the pool's ranks
@contextlib.contextmanager
def sglang_deepep_engine(rank: int, world_size: int, deepep_mode: str, output_dtype: str):
    """SGLang's process state for ``--tp-size R --ep-size R --moe-a2a-backend deepep
    --deepep-mode <mode> --deepep-dispatcher-output-dtype <dtype> --device cpu`` on this rank,
    over the pool's gloo world; everything it built is torn down on exit (the DeepEP buffer,
    its groups, the published context, the environment)."""
    deepep = sglang_shims.import_sglang()
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    saved_env = dict(os.environ)
    os.environ["SGLANG_USE_MESSAGE_QUEUE_BROADCASTER"] = "false"  # shared memory + zmq: unused
    os.environ["SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(MAX_DISPATCH_TOKENS)
    groups = dist.distributed_c10d._world.pg_map
    before = set(groups)
    server_args = ServerArgs(model_path="dummy", device="cpu", tp_size=world_size,
                             ep_size=world_size, moe_a2a_backend="deepep",
                             deepep_mode=deepep_mode,
                             deepep_dispatcher_output_dtype=output_dtype,
                             disable_custom_all_reduce=True)
    reset_context()
    try:
        publish(server_args, role="test", ranks=SpawnRanks(world_rank=rank))
        parallel_state.init_distributed_environment(world_size=world_size, rank=rank,
                                                    local_rank=rank, backend="gloo")
        parallel_state.initialize_model_parallel(backend="gloo")
        initialize_moe_config()
        assert get_parallel().tp_group.world_size == world_size
        with sglang_shims.sglang_cpu_shims():
            yield deepep
    finally:
        state = deepep.DeepEPBuffer._state()
        if state.buffer is not None:
            state.buffer.destroy()
        deepep.DeepEPConfig._instance = None
        parallel_state.destroy_model_parallel()
        if parallel_state._WORLD is not None:
            parallel_state._WORLD.destroy()
            parallel_state._WORLD = None
        reset_context()
        for group in [g for g in groups if g not in before]:
            dist.destroy_process_group(group)
        os.environ.clear()
        os.environ.update(saved_env)


def build_dispatcher(num_experts: int, topk: int):
    """What ``FusedMoE.__init__`` builds under ``--moe-a2a-backend deepep``."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import create_moe_dispatcher
    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.runtime_context import get_parallel

    R = get_parallel().tp_group.world_size
    config = MoeRunnerConfig(num_experts=num_experts, num_local_experts=num_experts // R,
                             hidden_size=HIDDEN, top_k=topk, params_dtype=torch.bfloat16)
    return create_moe_dispatcher(config, quant_method=None)


def normal_expert_stage(out, rank: int, local_experts: int):
    """DeepEP normal output -> the ``DeepEPNormalCombineInput`` SGLang's DeepGEMM runner hands
    to combine, GEMMs aside: each received row through the expert of each of its local choices,
    weighted by ``recv_topk_weights`` and summed in fp32 in choice order, written as bf16 (what
    SGLang's ``ep_scatter`` -> grouped GEMM -> ``ep_gather`` compute; those two Triton kernels
    do not run under Triton's interpreter, see the test module)."""
    from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPNormalCombineInput

    hs, hs_scale, topk_ids, topk_weights, _ = out
    x = hs.float()
    if hs_scale is not None:
        x = dequantize(x, hs_scale)
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(topk_ids.shape[1]):
        local = topk_ids[:, k] >= 0
        y = expert(x, topk_ids[:, k].clamp(min=0) + rank * local_experts).float()
        acc = acc + torch.where(local[:, None], y * topk_weights[:, k, None], 0.0)
    return DeepEPNormalCombineInput(hidden_states=acc.to(torch.bfloat16), topk_ids=topk_ids,
                                    topk_weights=topk_weights)


def low_latency_expert_stage(out, rank: int, local_experts: int):
    """DeepEP low-latency output ``[L, R * T_max, H]`` -> the expert on each local expert's
    first ``masked_m[e]`` rows -> ``DeepEPLLCombineInput``."""
    from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPLLCombineInput

    hs, hs_scale, topk_ids, topk_weights, masked_m, _ = out
    L, N, H = hs.shape
    y = torch.zeros((L, N, H), dtype=torch.bfloat16)
    for e in range(L):
        n = int(masked_m[e])
        rows = hs[e, :n].float()
        if hs_scale is not None:
            rows = dequantize(rows, hs_scale[e, :n])
        y[e, :n] = expert(rows, rank * local_experts + e)
    return DeepEPLLCombineInput(hidden_states=y, topk_ids=topk_ids, topk_weights=topk_weights)


def dispatch_compute_combine(dispatcher, x, ids, w, rank: int, local_experts: int):
    """One MoE layer's communication as ``FusedMoE.forward`` runs it: ``dispatch`` ->
    expert stage -> ``combine``; returns ``(output, dispatch output)``."""
    from sglang.srt.layers.moe.token_dispatcher.base import DispatchOutputChecker
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    topk = StandardTopKOutput(topk_weights=w, topk_ids=ids,
                              router_logits=torch.zeros((x.shape[0], 1)))
    out = dispatcher.dispatch(hidden_states=x, topk_output=topk)
    if DispatchOutputChecker.format_is_deepep_normal(out):
        combine_input = normal_expert_stage(out, rank, local_experts)
    else:
        assert DispatchOutputChecker.format_is_deepep_ll(out), out.format
        combine_input = low_latency_expert_stage(out, rank, local_experts)
    return dispatcher.combine(combine_input=combine_input), out


def check_dispatch_output(out, inputs, rank: int, local_experts: int, fp8: bool,
                          world_size: int) -> None:
    """What arrived, against the global inputs: normal mode, DeepGEMM's 128-aligned counts per
    local expert and one row per (source, token) with a choice here; low-latency mode,
    ``masked_m`` per local expert and SGLang's ``expected_m``."""
    lo, hi = rank * local_experts, (rank + 1) * local_experts
    ids_all = torch.cat([ids for _, ids, _ in inputs]).long()
    per_expert = [int((ids_all == e).sum()) for e in range(lo, hi)]
    here = sum(int(((ids >= lo) & (ids < hi)).any(1).sum()) for _, ids, _ in inputs)
    if len(out) == 5:  # DeepEPNormalDispatchOutput
        hs, hs_scale, recv_ids, _, counts = out
        assert counts == [(c + 127) // 128 * 128 for c in per_expert], (counts, per_expert)
        assert hs.shape[0] == recv_ids.shape[0] == here, (hs.shape, here)
        assert (hs.dtype == torch.float8_e4m3fn) == fp8 and (hs_scale is not None) == fp8
    else:
        hs, hs_scale, _, _, masked_m, expected_m = out
        assert masked_m.tolist() == per_expert, (masked_m.tolist(), per_expert)
        T = inputs[rank][0].shape[0]
        K = inputs[rank][1].shape[1]
        E = local_experts * world_size
        assert expected_m == (T * world_size * K + E) // E
        assert hs.shape == (local_experts, world_size * MAX_DISPATCH_TOKENS, HIDDEN)
        assert (hs.dtype == torch.float8_e4m3fn) == fp8 and (hs_scale is not None) == fp8


# ------------------------------------------------------------------ the jobs
def one_layer_call(dispatcher, world_size: int, rank: int, num_experts: int, topk: int,
                   tokens: tuple[int, ...], seed: int, fp8: bool) -> tuple[str, dict]:
    """Global inputs -> ``dispatch_compute_combine`` on this rank's share -> the checks of what
    arrived and of the output against the dense reference; ``(mode, summary)``."""
    from sglang.srt.layers.moe.token_dispatcher.base import DispatchOutputChecker

    L = num_experts // world_size
    inputs = make_inputs(world_size, num_experts, topk, tokens, seed)
    x, ids, w = inputs[rank]
    out, dispatched = dispatch_compute_combine(dispatcher, x, ids, w, rank, L)
    mode = "normal" if DispatchOutputChecker.format_is_deepep_normal(dispatched) \
        else "low_latency"
    check_dispatch_output(dispatched, inputs, rank, L, fp8, world_size)
    assert out.shape == x.shape and out.dtype == torch.bfloat16, (out.shape, out.dtype)
    if mode == "low_latency":
        seen = deepep_ll_fp8_round_trip if fp8 else (lambda t: t.float())
    else:
        seen = sglang_fp8_round_trip if fp8 else (lambda t: t.float())
    ref, mag = dense_reference(x, ids, w, seen)
    summary = check_against_dense(out, ref, mag, ids, rank, L, exact=mode == "low_latency",
                                  what=f"{mode} call with tokens {tokens}")
    return mode, summary


def describe(deepep, dispatcher) -> dict:
    """How SGLang built it: the dispatcher classes, their stream flags, the DeepEP buffer."""
    inner = dispatcher._inners[0]
    flags = {}
    if hasattr(inner, "_normal_dispatcher"):
        flags["async_finish"] = inner._normal_dispatcher.async_finish
    if hasattr(inner, "_low_latency_dispatcher"):
        flags["return_recv_hook"] = inner._low_latency_dispatcher.return_recv_hook
    buffer = deepep.DeepEPBuffer._state().buffer
    return {"dispatcher": [type(dispatcher).__name__, type(inner).__name__], "flags": flags,
            "buffer": [type(buffer).__module__, buffer.low_latency_mode]}


def deepep_mode_job(rank, world_size, deepep_mode: str, output_dtype: str, num_experts: int,
                    topk: int, batches, seed: int) -> dict:
    """``--deepep-mode normal`` or ``low_latency``: one dispatcher, one dispatch-expert-combine
    per batch (batches of different sizes reuse the buffer), each output against the dense
    reference."""
    with sglang_deepep_engine(rank, world_size, deepep_mode, output_dtype) as deepep:
        dispatcher = build_dispatcher(num_experts, topk)
        calls = []
        for i, tokens in enumerate(batches):
            mode, summary = one_layer_call(dispatcher, world_size, rank, num_experts, topk,
                                           tokens, seed + i, output_dtype == "fp8")
            assert mode == deepep_mode, (mode, deepep_mode)
            calls.append(summary)
        return {**describe(deepep, dispatcher), "calls": calls}


def auto_mode_job(rank, world_size, output_dtype: str, num_experts: int, topk: int, batches,
                  seed: int) -> dict:
    """``--deepep-mode auto``: one dispatcher (and one DeepEP buffer) serving prefill batches in
    normal mode and decode batches in low-latency mode, alternating, as SGLang resolves it from
    ``is_extend_in_batch``."""
    from sglang.srt.runtime_context import get_forward

    with sglang_deepep_engine(rank, world_size, "auto", output_dtype) as deepep:
        dispatcher = build_dispatcher(num_experts, topk)
        modes, calls = [], []
        for i, tokens in enumerate(batches):
            with get_forward().scoped(is_extend_in_batch=i % 2 == 0):
                mode, summary = one_layer_call(dispatcher, world_size, rank, num_experts, topk,
                                               tokens, seed + i, output_dtype == "fp8")
            modes.append(mode)
            calls.append(summary)
        return {**describe(deepep, dispatcher), "modes": modes, "calls": calls}
