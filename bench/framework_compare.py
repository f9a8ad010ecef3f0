"""A framework's own MoE dispatcher against moe_comm on the same routing: bytes and agreement.

For ``bench/dispatch_bench.py --framework megatron|deepspeed``. On a
``moe_comm.testing.launch.RankPool``
(or any gloo group of CPU ranks)::

    import framework_compare   # bench/ on sys.path
    rows = pool.run(framework_compare.framework_job, "deepspeed", hidden, num_experts, topk,
                    tokens, "bf16", seed)                 # one dict per rank
    print(framework_compare.format_rows(rows))          # one line per comparison

``framework_job(rank, world_size, framework, hidden, num_experts, topk, tokens, dtype_name,
seed)`` builds one MoE layer of the framework (``tokens`` tokens on every rank, ``hidden``,
``num_experts`` experts, top-``topk``, ``dtype_name`` in bf16/fp16/fp32 or the torch names) and
the same layer with the moe_comm plugin, loads the same weights, feeds both the same input
(so the router makes the same choices), and runs one forward pass of each. It returns the
config and a list ``variants``, one entry per comparison:

* ``deepspeed``, two: DeepSpeed 0.19.8 ``MoE`` with its default capacity (``capacity_factor=1``,
  ``drop_tokens=True``, ``min_capacity=4``) against ``MoeCommMOELayer(mode="capacity")`` (same
  capacity, same drops); and DeepSpeed with ``drop_tokens=False`` against
  ``mode="dropless"``. Random token selection and top-2 sampling are off so that both runs
  route alike. DeepSpeed moves ``[E, C, H]`` blocks with an equal-split all-to-all, every
  expert slot whether a token fills it or not: ``2 * (R-1) * L * C * H * b`` bytes per rank
  for dispatch plus combine (``L = E/R`` local experts; ``C`` the capacity, with
  ``drop_tokens=False`` the largest expert load over all ranks);
* ``megatron``, one: Megatron-Core 0.16.1 ``MoELayer`` with ``moe_token_dispatcher_type=
  "alltoall"`` (dropless) against ``MoeCommMoELayer``. Megatron's all-to-all sends one row per
  (token, expert) pair whose expert is on another rank (a token with two experts on one rank
  crosses twice), its probabilities (fp32, one per pair) by a second all-to-all, and first
  all-gathers the per-expert counts (int64, E per rank).

Bytes are those one rank sends to the other ranks during one forward dispatch + combine (the
backward pass moves the same amounts again). The framework's are counted at the
``torch.distributed`` calls it makes (``all_to_all_single``, ``all_gather*``), split into rows
(``[n, H]`` tensors) and metadata; moe_comm's come from ``Buffer.stats()`` (rows plus per-row
routing metadata, per-expert counts and signals), its rows being each token once per distinct
other destination rank (dispatch) and one partial sum per (token, expert rank) (combine).
``ratio`` = framework bytes / moe_comm bytes.

Agreement: ``max_abs_diff`` between the two outputs on this rank and whether they are equal bit
for bit (expected for top-k <= 2 in fp32 except DeepSpeed's dropless comparison, which differs
by fp32 rounding; see docs/INTEGRATIONS.md).

Megatron needs ``torch.cuda`` stand-ins on CPU (tests/framework_shims.py, applied inside this
job and undone after it); DeepSpeed runs on its CPU accelerator.
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist

_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
FRAMEWORKS = ("megatron", "deepspeed")


def _shims():
    """tests/framework_shims.py: the CPU stand-ins the frameworks need (not a library part)."""
    if _TESTS not in sys.path:
        sys.path.insert(0, _TESTS)
    import framework_shims

    return framework_shims


class _Counter:
    """Bytes this rank hands to other ranks through the collectives it calls."""

    def __init__(self, hidden: int):
        self.hidden = hidden
        self.row_bytes = 0
        self.meta_bytes = 0
        self.calls = 0

    def add(self, tensor: torch.Tensor, nbytes: int) -> None:
        self.calls += 1
        if tensor.dim() >= 2 and tensor.shape[-1] == self.hidden:
            self.row_bytes += nbytes
        else:
            self.meta_bytes += nbytes


@contextlib.contextmanager
def _count_collectives(counter: _Counter, gather_aliases: tuple = ()):
    """Wraps the ``torch.distributed`` calls, and ``(module, name)`` aliases of
    ``all_gather_into_tensor`` bound at import time, to count what this rank sends."""
    original = {name: getattr(dist, name) for name in
                ("all_to_all_single", "all_gather_into_tensor", "all_gather")}
    aliases = [(obj, name, getattr(obj, name)) for obj, name in gather_aliases]

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        world, me = dist.get_world_size(group), dist.get_rank(group)
        per_row = input[0].numel() * input.element_size() if input.shape[0] else 0
        if input_split_sizes is None:
            sent = input.numel() * input.element_size() // world * (world - 1)
        else:
            sizes = [int(s) for s in input_split_sizes]
            sent = (sum(sizes) - sizes[me]) * per_row
        counter.add(input, sent)
        return original["all_to_all_single"](output, input, output_split_sizes,
                                             input_split_sizes, group=group, async_op=async_op)

    def all_gather_into_tensor(output, input, group=None, async_op=False):
        counter.add(input, input.numel() * input.element_size() * (dist.get_world_size(group) - 1))
        return original["all_gather_into_tensor"](output, input, group=group, async_op=async_op)

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        counter.add(tensor, tensor.numel() * tensor.element_size()
                    * (dist.get_world_size(group) - 1))
        return original["all_gather"](tensor_list, tensor, group=group, async_op=async_op)

    try:
        dist.all_to_all_single = all_to_all_single
        dist.all_gather_into_tensor = all_gather_into_tensor
        dist.all_gather = all_gather
        for obj, name, _ in aliases:
            setattr(obj, name, all_gather_into_tensor)
        yield counter
    finally:
        for name, fn in original.items():
            setattr(dist, name, fn)
        for obj, name, fn in aliases:
            setattr(obj, name, fn)


def _moe_comm_bytes(buf, before: dict, world_size: int, row_nbytes: int,
                    dispatch_rows: int) -> tuple[int, int]:
    """(total, rows) bytes moe_comm sent to peers since ``before`` (dispatch + combine);
    ``dispatch_rows``: this rank's (token, other destination rank) pairs."""
    after = buf.stats()
    total = sum(after[k] - before[k] for k in ("dispatch_bytes_to_peers",
                                               "combine_bytes_to_peers"))
    combine = after["combine_bytes_to_peers"] - before["combine_bytes_to_peers"]
    combine_rows = (combine - 8 * (world_size - 1)) // row_nbytes  # one row per pair, + 8
    return total, (dispatch_rows + combine_rows) * row_nbytes


def _remote(topk_idx: torch.Tensor, rank: int, world_size: int, num_local_experts: int
            ) -> tuple[int, int]:
    """(pairs, distinct (token, rank) pairs) of this rank's tokens whose expert is elsewhere."""
    dest = torch.where(topk_idx >= 0, topk_idx // num_local_experts, -1)
    remote = (dest >= 0) & (dest != rank)
    distinct = sum(int((dest == d).any(dim=1).sum()) for d in range(world_size) if d != rank)
    return int(remote.sum()), distinct


def _variant(name, counted, buf, before, world_size, x, topk_idx, rank, L, want, got,
             **extra) -> dict:
    row_nbytes = x.shape[-1] * x.element_size()
    pairs, distinct = _remote(topk_idx, rank, world_size, L)
    total, rows = _moe_comm_bytes(buf, before, world_size, row_nbytes, distinct)
    return dict(variant=name, framework_bytes=counted.row_bytes + counted.meta_bytes,
                framework_row_bytes=counted.row_bytes, remote_pairs=pairs,
                remote_token_ranks=distinct,
                moe_comm_bytes=total, moe_comm_row_bytes=rows,
                dropped_pairs=int((topk_idx < 0).sum()),
                outputs_equal=bool(torch.equal(want, got)),
                max_abs_diff=float((want.double() - got.double()).abs().max()) if want.numel()
                else 0.0, **extra)


def _deepspeed(rank, world_size, hidden, num_experts, topk, tokens, dtype, seed) -> list[dict]:
    _shims().deepspeed_cpu_env()
    from deepspeed.moe.layer import MoE

    from moe_comm.integrations import BufferCache
    from moe_comm.integrations import deepspeed as plugin

    def build(drop_tokens):
        torch.manual_seed(seed)
        expert = torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(),
                                     torch.nn.Linear(2 * hidden, hidden))
        moe = MoE(hidden_size=hidden, expert=expert, num_experts=num_experts,
                  ep_size=world_size, k=topk, use_rts=False, top2_2nd_expert_sampling=False,
                  drop_tokens=drop_tokens)
        moe.set_deepspeed_parallelism()
        return moe.to(dtype)

    L = num_experts // world_size
    x = torch.randn((tokens, hidden), generator=torch.Generator().manual_seed(seed + rank))
    x = x.to(dtype)
    variants = []
    cases = (("capacity_factor=1 / capacity", True, "capacity"),
             ("drop_tokens=False / dropless", False, "dropless"))
    for name, drop_tokens, mode in cases:
        theirs, ours = build(drop_tokens), build(drop_tokens)
        cache = BufferCache()
        plugin.convert(ours, mode=mode, max_tokens_per_rank=tokens, buffer_cache=cache)
        ours.load_state_dict(theirs.state_dict())
        with torch.no_grad():
            with _count_collectives(_Counter(hidden)) as counted:
                want, _, _ = theirs(x)
            ours(x)  # allocates the Buffer (collective), outside the measurement
            buf = ours.deepspeed_moe.buffer
            before = buf.stats()
            got, _, _ = ours(x)
            gate = theirs.deepspeed_moe.gate
            _, capacity, _, indices, _, _, _ = gate(x.reshape(-1, hidden), None, True)
        variants.append(_variant(f"DeepSpeed {name}", counted, buf, before, world_size, x,
                                 indices.t().long(), rank, L, want, got,
                                 capacity=int(capacity)))
        cache.close()
    return variants


def _megatron(rank, world_size, hidden, num_experts, topk, tokens, dtype, seed) -> list[dict]:
    shims = _shims()
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_comm.integrations import BufferCache
    from moe_comm.integrations import megatron as plugin

    shim = shims.megatron_cpu_shims() if not torch.cuda.is_available() \
        else contextlib.nullcontext()
    with shim, shims.megatron_parallel_state(world_size):
        config = TransformerConfig(
            num_layers=1, hidden_size=hidden, num_attention_heads=4, num_moe_experts=num_experts,
            moe_ffn_hidden_size=2 * hidden, ffn_hidden_size=2 * hidden, moe_router_topk=topk,
            moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32",
            moe_permute_fusion=False, expert_model_parallel_size=world_size,
            use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16, add_bias_linear=False, moe_aux_loss_coeff=0.0)
        spec = get_moe_module_spec(use_te=False, num_experts=num_experts)
        torch.manual_seed(seed)
        theirs = build_module(spec, config=config)
        spec.module = plugin.MoeCommMoELayer
        ours = build_module(spec, config=config)
        cache = BufferCache()
        ours.token_dispatcher.buffer_cache = cache
        ours.token_dispatcher.max_tokens_per_rank = tokens
        ours.load_state_dict(theirs.state_dict())
        x = torch.randn((tokens, 1, hidden), generator=torch.Generator().manual_seed(seed + rank))
        x = x.to(dtype)
        with torch.no_grad():
            gather = ((mappings, "dist_all_gather_func"),)
            with _count_collectives(_Counter(hidden), gather) as counted:
                want, _ = theirs(x)
            ours(x)  # allocates the Buffer (collective), outside the measurement
            buf = ours.token_dispatcher.buffer
            before = buf.stats()
            got, _ = ours(x)
        variant = _variant("Megatron alltoall / dropless", counted, buf, before,
                           world_size, x, ours.token_dispatcher.topk_idx, rank,
                           num_experts // world_size, want, got, capacity=None)
        cache.close()
    return [variant]


def framework_job(rank: int, world_size: int, framework: str, hidden: int, num_experts: int,
                  topk: int, tokens: int, dtype_name: str, seed: int) -> dict:
    """One rank's comparison (module doc); a RankPool job. Returns plain values: the config
    and ``variants``, one dict per comparison (Megatron: one; DeepSpeed: its default capacity
    config against moe_comm's capacity mode, and ``drop_tokens=False`` against dropless) with
    ``framework_bytes``, ``framework_row_bytes``, ``moe_comm_bytes``, ``moe_comm_row_bytes``,
    ``remote_pairs``, ``dropped_pairs``, ``capacity``, ``outputs_equal``, ``max_abs_diff``."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework={framework!r}; choose one of {FRAMEWORKS}")
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype_name={dtype_name!r}; choose one of {sorted(DTYPES)}")
    run = _megatron if framework == "megatron" else _deepspeed
    variants = run(rank, world_size, hidden, num_experts, topk, tokens, DTYPES[dtype_name], seed)
    return dict(framework=framework, rank=rank, world_size=world_size, hidden=hidden,
                num_experts=num_experts, topk=topk, tokens=tokens, dtype=dtype_name,
                variants=variants)


def summarize(rows: list[dict]) -> list[dict]:
    """Per (config, variant): bytes summed over the ranks, ratio, agreement."""
    out: dict[tuple, dict] = {}
    for row in rows:
        config = tuple(row[k] for k in ("framework", "world_size", "hidden", "num_experts",
                                        "topk", "tokens", "dtype"))
        for v in row["variants"]:
            acc = out.setdefault(config + (v["variant"],), dict(
                zip(("framework", "world_size", "hidden", "num_experts", "topk", "tokens",
                     "dtype"), config), variant=v["variant"], framework_bytes=0,
                framework_row_bytes=0, moe_comm_bytes=0, moe_comm_row_bytes=0,
                dropped_pairs=0, outputs_equal=True, max_abs_diff=0.0, capacity=v["capacity"]))
            for key in ("framework_bytes", "framework_row_bytes", "moe_comm_bytes",
                        "moe_comm_row_bytes", "dropped_pairs"):
                acc[key] += v[key]
            acc["outputs_equal"] &= v["outputs_equal"]
            acc["max_abs_diff"] = max(acc["max_abs_diff"], v["max_abs_diff"])
    for acc in out.values():
        acc["ratio"] = acc["framework_bytes"] / max(1, acc["moe_comm_bytes"])
    return list(out.values())


def format_rows(rows: list[dict]) -> str:
    """One table: a line per (framework, config, variant), bytes summed over the ranks
    (1 MB = 1e6 bytes); ``rows`` is what ``framework_job`` returned on every rank, for any
    number of configs."""
    header = (f"{'framework / moe_comm mode':<38} {'R':>2} {'H':>5} {'E':>4} {'k':>2} {'T':>5} "
              f"{'dtype':<5} {'C':>4} {'their MB':>9} {'rows':>8} {'moe_comm MB':>11} "
              f"{'rows':>8} {'ratio':>6} {'dropped':>7}  outputs")
    lines = [header, "-" * len(header)]
    for s in summarize(rows):
        agree = "exact" if s["outputs_equal"] else f"max |diff| {s['max_abs_diff']:.1e}"
        capacity = "-" if s["capacity"] is None else str(s["capacity"])
        lines.append(
            f"{s['variant']:<38} {s['world_size']:>2} {s['hidden']:>5} {s['num_experts']:>4} "
            f"{s['topk']:>2} {s['tokens']:>5} {s['dtype']:<5} {capacity:>4} "
            f"{s['framework_bytes'] / 1e6:>9.3f} {s['framework_row_bytes'] / 1e6:>8.3f} "
            f"{s['moe_comm_bytes'] / 1e6:>11.3f} {s['moe_comm_row_bytes'] / 1e6:>8.3f} "
            f"{s['ratio']:>5.2f}x {s['dropped_pairs']:>7}  {agree}")
    lines.append("Bytes each rank sent to the other ranks in one forward dispatch + combine, "
                 "summed over ranks (backward: the same again); rows = token rows only, the "
                 "rest is routing metadata. C = DeepSpeed's capacity per expert.")
    return "\n".join(lines)
