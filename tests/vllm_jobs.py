"""Jobs that drive vLLM 0.33.0's DeepEP prepare/finalize classes over ``moe_comm.deep_ep`` on
CPU ranks (``tests/test_vllm.py``).

Each rank builds vLLM's all2all manager for ``--all2all-backend deepep_high_throughput`` or
``deepep_low_latency`` over the gloo group and lets vLLM's own factory
(``all2all_utils.maybe_make_prepare_finalize``) make the prepare/finalize object from a
``FusedMoEConfig`` with ``use_ep=True`` and DP = the EP ranks: its ``deep_ep.Buffer`` is the
facade's. Then ``prepare`` (dispatch), a per-expert elementwise expert, ``finalize`` (combine),
checked three ways:

* against a model of the same computation written here from the global inputs every rank
  builds from one seed, with the rounding of each step: bit for bit;
* against vLLM's path without EP (``MoEPrepareAndFinalizeNoDPEPModular``, every expert local)
  on the same tokens: bit for bit where the rounding is the same, else within the bound stated
  at ``_close_to``;
* against a dense float64 reference: within the same bound.

The CUDA-only pieces stood in are listed in ``vllm_shims``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from vllm_shims import vllm_cpu

BF16_UNIT = 2.0 ** -8   # bf16's unit roundoff (8 significant bits)


def import_vllm(rank, world_size) -> str:
    """Imports vLLM's modules that the jobs use (10 to 30 s a process on a loaded machine)
    without any collective, so that no rank waits for another's import inside gloo's timeout
    in the jobs after it. Returns vLLM's platform."""
    with vllm_cpu(rank, world_size):
        from vllm.distributed.device_communicators import all2all  # noqa: F401
        from vllm.model_executor.layers.fused_moe import all2all_utils  # noqa: F401
        from vllm.platforms import current_platform

        return type(current_platform).__name__


# ----------------------------------------------------------------------------- inputs, expert
def global_inputs(seed: int, iteration: int, tokens: tuple[int, ...], hidden: int,
                  num_experts: int, topk: int):
    """Every rank's ``(x [T, H] bf16, topk_ids [T, K] int64, topk_weights [T, K] fp32)``, from
    one seed: distinct valid experts per token (vLLM's routers never return -1)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + iteration)
    out = []
    for T in tokens:
        x = torch.randn((T, hidden), generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(T)]) \
            if T else torch.empty((0, topk), dtype=torch.int64)
        w = torch.rand((T, topk), generator=g)
        out.append((x, ids.to(torch.int64), w))
    return out


def expert(x: torch.Tensor, g: torch.Tensor | int) -> torch.Tensor:
    """The elementwise expert ``g`` (global id): ``x * (1 + g / 8) + g`` in fp32, rounded to
    x's dtype. ``g``: an int, or one id per row."""
    g = torch.as_tensor(g, dtype=torch.float32)
    if g.dim() == 1:
        g = g[:, None]
    return (x.float() * (1 + g / 8) + g).to(x.dtype)


def standard_experts(x: torch.Tensor, topk_ids: torch.Tensor,
                     expert_map: torch.Tensor | None) -> torch.Tensor:
    """vLLM's Standard activation format: ``[M, K, H]``, row ``(m, k)`` = expert
    ``topk_ids[m, k]`` applied to ``x[m]``; zero where ``expert_map`` maps the expert to -1
    (another rank's), as vLLM's fused experts write for such choices."""
    M, K = topk_ids.shape
    out = torch.zeros((M, K, x.shape[1]), dtype=x.dtype)
    for k in range(K):
        ids = topk_ids[:, k]
        local = torch.ones_like(ids, dtype=torch.bool) if expert_map is None \
            else expert_map[ids] >= 0
        if local.any():
            out[local, k] = expert(x[local], ids[local])
    return out


def batched_experts(x: torch.Tensor, counts: torch.Tensor, first_expert: int) -> torch.Tensor:
    """vLLM's BatchedExperts format: ``x [L, R * T_max, H]``, ``counts [L]``; expert
    ``first_expert + e`` on the first ``counts[e]`` rows of block ``e``, the rest zero."""
    out = torch.zeros_like(x)
    for e in range(x.shape[0]):
        n = int(counts[e])
        out[e, :n] = expert(x[e, :n], first_expert + e)
    return out


# ----------------------------------------------------------------------------- vLLM objects
def fused_moe_config(rank: int, world_size: int, backend: str, num_experts: int, topk: int,
                     hidden: int, max_num_tokens: int):
    """The ``FusedMoEConfig`` a layer of ``num_experts`` experts gets with
    ``--data-parallel-size world_size --enable-expert-parallel --all2all-backend backend``."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    parallel = FusedMoEParallelConfig(
        tp_size=1, pcp_size=1, dp_size=world_size, ep_size=world_size, tp_rank=0, pcp_rank=0,
        dp_rank=rank, ep_rank=rank, sp_size=1, use_ep=True, all2all_backend=backend,
        enable_eplb=False)
    L = num_experts // world_size
    return FusedMoEConfig(
        num_experts=num_experts, experts_per_token=topk, hidden_dim=hidden,
        intermediate_size=hidden, num_local_experts=L, num_logical_experts=num_experts,
        activation=MoEActivation.SILU, device="cpu", routing_method=RoutingMethodType.TopK,
        moe_parallel_config=parallel, in_dtype=torch.bfloat16, max_num_tokens=max_num_tokens)


def no_ep_path(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               num_experts: int) -> torch.Tensor:
    """vLLM's path without EP on these tokens: ``MoEPrepareAndFinalizeNoDPEPModular``'s prepare,
    every expert local, its finalize (``TopKWeightAndReduceContiguous``)."""
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
        MoEPrepareAndFinalizeNoDPEPModular,
    )
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceDelegate,
    )

    pf = MoEPrepareAndFinalizeNoDPEPModular()
    a1q, scale, meta, ids, w = pf.prepare(x, topk_weights, topk_ids, num_experts, None, False,
                                          FUSED_MOE_UNQUANTIZED_CONFIG)
    assert scale is None and meta is None and ids is None and w is None
    out = torch.empty_like(x)
    pf.finalize(out, standard_experts(a1q, topk_ids, None), topk_weights, topk_ids, False,
                TopKWeightAndReduceDelegate())
    return out


# ----------------------------------------------------------------------------- references
def dense_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
    """``(sum_k w_k * expert_k(x) in float64, sum_k |w_k * expert_k(x)|)`` per element, the
    expert outputs rounded as the expert rounds them."""
    acc = torch.zeros(x.shape, dtype=torch.float64)
    mag = torch.zeros(x.shape, dtype=torch.float64)
    for k in range(topk_ids.shape[1]):
        term = topk_weights[:, k:k + 1].double() * expert(x, topk_ids[:, k]).double()
        acc += term
        mag += term.abs()
    return acc, mag


def _close_to(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor, topk: int,
              what: str) -> float:
    """``|got - want| <= 2 K u * sum_k |w_k y_k| + tiny``: each path rounds each of its K
    weighted terms and K partial sums once at most (u = 2^-8, bf16). Returns the largest
    difference in units of that bound."""
    bound = 2 * topk * BF16_UNIT * mag + 1e-30
    ratio = float(((got.double() - want.double()).abs() / bound).max()) if got.numel() else 0.0
    assert ratio <= 1.0, f"{what}: off by {ratio:.3f} of the bound"
    return ratio


# ----------------------------------------------------------------------------- high throughput
def ht_receive_model(inputs, rank: int, num_local: int, num_experts: int):
    """What DeepEP's normal dispatch delivers to ``rank`` and vLLM's ``_receiver`` makes of it:
    one row per (source, token) with an expert here, by source then token; the top-k ids global
    (+ rank's offset) where local, else ``num_experts - 1`` on rank 0 and 0 elsewhere; the
    weights zero where not local; the count of rows per local expert; the origins."""
    lo, hi = rank * num_local, (rank + 1) * num_local
    rows, ids, ws, origin = [], [], [], []
    for s, (x, idx, w) in enumerate(inputs):
        for t in range(x.shape[0]):
            local = (idx[t] >= lo) & (idx[t] < hi)
            if local.any():
                rows.append(x[t])
                ids.append(torch.where(local, idx[t], num_experts - 1 if rank == 0 else 0))
                ws.append(torch.where(local, w[t], 0.0))
                origin.append((s, t))
    H, K = inputs[0][0].shape[1], inputs[0][1].shape[1]
    x = torch.stack(rows) if rows else torch.empty((0, H), dtype=torch.bfloat16)
    i = torch.stack(ids) if ids else torch.empty((0, K), dtype=torch.int64)
    w = torch.stack(ws) if ws else torch.empty((0, K))
    counts = [sum(int((idx[t] == e).any()) for _, idx, _ in inputs for t in range(idx.shape[0]))
              for e in range(lo, hi)]
    return x, i, w, counts, origin


def ht_output_model(inputs, home: int, num_local: int, world_size: int) -> torch.Tensor:
    """The high-throughput result at ``home``: on each rank that got a token, vLLM's finalize
    weights each local choice (bf16(w * y)) and sums the token's K rows in bf16, choice order
    (other ranks' choices are zero rows); DeepEP's combine adds those partial rows over the
    ranks in fp32, rank order, and rounds once."""
    x, idx, w = inputs[home]
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for d in range(world_size):
        lo, hi = d * num_local, (d + 1) * num_local
        local = (idx >= lo) & (idx < hi)
        partial = torch.zeros(x.shape, dtype=torch.bfloat16)
        for k in range(idx.shape[1]):
            term = torch.where(local[:, k:k + 1], expert(x, idx[:, k]),
                               torch.zeros((), dtype=x.dtype))
            term = (term.float() * torch.where(local[:, k], w[:, k], 0.0)[:, None]) \
                .to(torch.bfloat16)
            partial = partial + term
        acc += torch.where(local.any(1, keepdim=True), partial.float(), 0.0)
    return acc.to(torch.bfloat16)


def high_throughput(rank, world_size, tokens: tuple[int, ...], hidden: int, num_experts: int,
                    topk: int, seed: int = 0, iterations: int = 2) -> dict:
    """``--all2all-backend deepep_high_throughput``: ``DeepEPHTAll2AllManager.get_handle``
    builds the facade's Buffer; ``DeepEPHTPrepareAndFinalize`` prepare -> Standard-format
    experts (vLLM's ``expert_map`` semantics) -> finalize, over calls of different sizes.
    Returns what it compared."""
    report = {"calls": 0, "tokens": 0, "equal_to_no_ep": 0, "within_bound": 0,
              "worst_ratio": 0.0}
    with vllm_cpu(rank, world_size):
        import deep_ep
        from vllm.distributed.device_communicators.all2all import DeepEPHTAll2AllManager
        from vllm.model_executor.layers.fused_moe.all2all_utils import (
            maybe_make_prepare_finalize,
        )
        from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
        from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht import (
            DeepEPHTPrepareAndFinalize,
        )
        from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
            TopKWeightAndReduceDelegate,
        )

        import moe_comm.deep_ep

        assert deep_ep is moe_comm.deep_ep
        manager = DeepEPHTAll2AllManager(dist.group.WORLD)
        assert not manager.internode and manager.dp_world_size == world_size
        moe = fused_moe_config(rank, world_size, "deepep_high_throughput", num_experts, topk,
                               hidden, max(tokens))
        pf = maybe_make_prepare_finalize(moe, FUSED_MOE_UNQUANTIZED_CONFIG,
                                         all2all_manager=manager)
        assert isinstance(pf, DeepEPHTPrepareAndFinalize), type(pf)
        assert isinstance(pf.buffer, moe_comm.deep_ep.Buffer) and not pf.buffer.low_latency_mode
        L = num_experts // world_size
        expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
        expert_map[rank * L:(rank + 1) * L] = torch.arange(L, dtype=torch.int32)
        for it in range(iterations):
            sizes = tokens if it % 2 == 0 else tuple((t + 1) // 2 for t in tokens)
            inputs = global_inputs(seed, it, sizes, hidden, num_experts, topk)
            x, ids, w = inputs[rank]
            ex, ex_scale, meta, eids, ew = pf.prepare(
                x, w, ids, num_experts, expert_map, False, FUSED_MOE_UNQUANTIZED_CONFIG)
            want_x, want_ids, want_w, want_counts, _ = ht_receive_model(inputs, rank, L,
                                                                        num_experts)
            where = f"rank {rank} call {it}"
            assert ex_scale is None
            assert torch.equal(ex, want_x), f"{where}: received rows"
            assert torch.equal(eids, want_ids), f"{where}: received top-k ids"
            assert torch.equal(ew, want_w), f"{where}: received top-k weights"
            assert meta.expert_num_tokens_cpu.tolist() == want_counts, f"{where}: counts"
            out = torch.full_like(x, float("nan"))
            pf.finalize(out, standard_experts(ex, eids, expert_map), ew, eids, False,
                        TopKWeightAndReduceDelegate())
            assert torch.equal(out, ht_output_model(inputs, rank, L, world_size)), \
                f"{where}: finalize against the model"
            _compare_paths(report, out, x, ids, w, num_experts, topk, where,
                           one_rank=((ids // L) == (ids[:, :1] // L)).all(1))
        manager.destroy()
    return report


# ----------------------------------------------------------------------------- low latency
def low_latency(rank, world_size, tokens: tuple[int, ...], hidden: int, num_experts: int,
                topk: int, seed: int = 0, iterations: int = 2, fp8: bool = False) -> dict:
    """``--all2all-backend deepep_low_latency``: ``DeepEPLLAll2AllManager.get_handle`` sizes
    the facade's Buffer with ``get_low_latency_rdma_size_hint``; ``DeepEPLLPrepareAndFinalize``
    prepare -> BatchedExperts-format experts -> finalize (the weighted combine), over calls of
    different sizes. ``fp8``: the quant config of an FP8 model with 128 x 128 blocks, for which
    vLLM's factory turns on ``use_fp8_dispatch``: DeepEP quantizes in the dispatch and vLLM
    hands the (codes, scales) pair to the experts as it came. Returns what it compared."""
    report = {"calls": 0, "tokens": 0, "equal_to_no_ep": 0, "within_bound": 0,
              "worst_ratio": 0.0}
    T = max(tokens)
    with vllm_cpu(rank, world_size):
        from vllm.distributed.device_communicators.all2all import DeepEPLLAll2AllManager
        from vllm.model_executor.layers.fused_moe.all2all_utils import (
            maybe_make_prepare_finalize,
        )
        from vllm.model_executor.layers.fused_moe.config import (
            FUSED_MOE_UNQUANTIZED_CONFIG,
            fp8_w8a8_moe_quant_config,
        )
        from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import (
            DeepEPLLPrepareAndFinalize,
        )
        from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
            TopKWeightAndReduceDelegate,
        )

        import moe_comm.deep_ep
        from moe_comm import reference

        manager = DeepEPLLAll2AllManager(dist.group.WORLD)
        moe = fused_moe_config(rank, world_size, "deepep_low_latency", num_experts, topk,
                               hidden, T)
        qc = FUSED_MOE_UNQUANTIZED_CONFIG
        if fp8:   # (weight scales are the experts' business; these are never read here)
            qc = fp8_w8a8_moe_quant_config(w1_scale=torch.ones(1), w2_scale=torch.ones(1),
                                           block_shape=[128, 128])
        pf = maybe_make_prepare_finalize(moe, qc, all2all_manager=manager)
        assert isinstance(pf, DeepEPLLPrepareAndFinalize), type(pf)
        assert isinstance(pf.buffer, moe_comm.deep_ep.Buffer) and pf.buffer.low_latency_mode
        assert pf.use_fp8_dispatch == fp8 and pf.max_num_tokens_per_rank() == T
        L = num_experts // world_size
        for it in range(iterations):
            sizes = tokens if it % 2 == 0 else tuple((t + 1) // 2 for t in tokens)
            inputs = global_inputs(seed, it, sizes, hidden, num_experts, topk)
            x, ids, w = inputs[rank]
            ex, ex_scale, meta, eids, ew = pf.prepare(x, w, ids, num_experts, None, False, qc)
            where = f"rank {rank} call {it}"
            assert eids is None and ew is None
            assert ex.shape == (L, world_size * T, hidden), ex.shape
            if fp8:   # the experts get DeepEP's pair; they dequantize it
                assert ex.dtype == torch.float8_e4m3fn and ex_scale.shape == ex.shape[:2] + (
                    hidden // 128,), (ex.dtype, ex_scale.shape)
                ex = reference.dequantize_fp8(ex.flatten(0, 1), ex_scale.flatten(0, 1)) \
                    .view(ex.shape).to(torch.bfloat16)
                inputs = [(reference.dequantize_fp8(*reference.quantize_fp8(xs))
                           .to(torch.bfloat16), idx, ws) for xs, idx, ws in inputs]
                x = inputs[rank][0]   # what the experts can see of the tokens
            else:
                assert ex_scale is None
            counts = meta.expert_num_tokens
            for e in range(L):   # DeepEP's low-latency order: by source rank, then token
                g = rank * L + e
                want = [xs[t] for xs, idx, _ in inputs for t in range(idx.shape[0])
                        if (idx[t] == g).any()]
                assert int(counts[e]) == len(want), f"{where}: count of expert {g}"
                if want:
                    assert torch.equal(ex[e, :len(want)], torch.stack(want)), \
                        f"{where}: rows of expert {g}"
            out = torch.full_like(x, float("nan"))
            pf.finalize(out, batched_experts(ex, counts, rank * L), w, ids, False,
                        TopKWeightAndReduceDelegate())
            want_out = torch.zeros(x.shape, dtype=torch.float32)  # fp32, choice order, once
            for k in range(topk):
                want_out += w[:, k:k + 1] * expert(x, ids[:, k]).float()
            assert torch.equal(out, want_out.to(torch.bfloat16)), \
                f"{where}: finalize against the model"
            _compare_paths(report, out, x, ids, w, num_experts, topk, where,
                           one_rank=torch.zeros(x.shape[0], dtype=torch.bool))
        manager.destroy()
    return report


def _compare_paths(report: dict, out, x, ids, w, num_experts: int, topk: int, where: str,
                   one_rank: torch.Tensor) -> None:
    """``out`` against vLLM's path without EP (bit for bit on the tokens in ``one_rank``,
    where both round the same way) and against the float64 reference, both within the bound.
    A rank without tokens has nothing to compare (vLLM's path without EP is not called with
    none: its ``TopKWeightAndReduceContiguous`` cannot reshape 0 weights)."""
    report["calls"] += 1
    if x.shape[0] == 0:
        return
    theirs = no_ep_path(x, ids, w, num_experts)
    exact, mag = dense_reference(x, ids, w)
    same = (out == theirs).all(1)
    assert same[one_rank].all(), f"{where}: differs from vLLM's path without EP where the " \
                                 "rounding is the same"
    ratio = max(_close_to(out, theirs, 2 * mag, topk, f"{where}: against the path without EP"),
                _close_to(out, exact, mag, topk, f"{where}: against the dense reference"))
    report["tokens"] += x.shape[0]
    report["equal_to_no_ep"] += int(same.sum())
    report["within_bound"] += int((~same).sum())
    report["worst_ratio"] = max(report["worst_ratio"], ratio)
