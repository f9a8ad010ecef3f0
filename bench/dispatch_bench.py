"""Standalone dispatch/combine benchmark on CPU ranks (one process per rank, shm heap).

    python bench/dispatch_bench.py --ranks 4 --tokens 128 --system h800
    python bench/dispatch_bench.py --mode low_latency --fp8      # decode: 128 tokens per rank
    python bench/dispatch_bench.py --dispatch-dtype mxfp8       # MXFP8 rows (E8M0 per 32)
    python bench/dispatch_bench.py --dispatch-dtype nvfp4       # NVFP4 rows (e2m1, e4m3 per 16)

Prints one table, one row per model config (real hidden sizes, expert counts and top-k):

* rows: (token, expert) rows received, summed over ranks;
* link MB: bytes the kernels stored into other ranks during one dispatch (rows, metadata,
  counts, signals; measured by the kernels' counters, summed over ranks), next to the minimum
  payload: normal mode, each token's row once per distinct other destination rank;
  low-latency mode, each (token, expert) pair on another rank; a row is H*b bytes, or
  H + 4*H/128 with FP8, H + H/32 with MXFP8, H/2 + H/16 + 4 with NVFP4; overhead =
  link / min - 1 (metadata and signals);
* launches: kernel launches of one dispatch / one combine on rank 0, every kernel counted as a
  GPU's queue would receive it (Triton's and torch's, ``host_cost.LaunchCounter``; CPU ranks
  wait on the host, so the wait launch of a GPU's combine is not among them); syncs: host
  reads of device data in one dispatch + combine on rank 0 (``buf.host_syncs``; on a GPU each
  stalls the host until the stream reaches it);
* ref: whether every rank's dispatch rows and combine output equal the reference
  (``moe_comm.reference`` over ``all_to_all_single``) bit for bit;
* cpu ms: wall time of the slowest rank, median [min-max] over the timed iterations, for
  moe_comm and for the reference. These are Triton *interpreter* times on CPU: they measure
  the interpreter, not the design, and are never GPU performance;
* pred us: what the same workload costs on ``--system`` according to ``moe_comm.perfmodel``
  (normal mode, routing taken from the benchmark's own ``topk_idx``), next to that model's
  minimum bytes per rank.

The same rows go to ``--json`` (default ``bench/results/dispatch_bench.json``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden: int
    experts: int
    topk: int


CONFIGS = [
    ModelConfig("DeepSeek-V3", 7168, 256, 8),
    ModelConfig("Qwen3-235B-A22B", 4096, 128, 8),
    ModelConfig("GPT-OSS-120B", 2880, 128, 4),
    ModelConfig("Mixtral-8x7B", 4096, 8, 2),
]


def make_routing(cfg: ModelConfig, world_size: int, tokens: int, routing: str, seed: int):
    """Every rank's inputs from one seed: ``(xs, topk_idxs, topk_weights)`` lists over ranks."""
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for _ in range(world_size):
        xs.append(torch.randn((tokens, cfg.hidden), generator=g))
        if routing == "zipf":
            p = 1.0 / torch.arange(1, cfg.experts + 1, dtype=torch.float64) ** 1.2
            scores = torch.rand((tokens, cfg.experts), generator=g, dtype=torch.float64) * p
        else:
            scores = torch.rand((tokens, cfg.experts), generator=g)
        idxs.append(scores.topk(cfg.topk, dim=1).indices)
        ws.append(torch.softmax(torch.randn((tokens, cfg.topk), generator=g), dim=1))
    return xs, idxs, ws


GROUP = {"fp8": 128, "mxfp8": 32, "nvfp4": 16}  # channels per scale of each link format


def _payload_bytes(hidden: int, elem: int, fmt: str) -> int:
    """Bytes of one row on the link: FP8 codes plus one fp32 scale per 128 channels, MXFP8
    codes plus one E8M0 byte per 32, NVFP4 packed codes plus one e4m3 byte per 16 and the
    row's fp32 global scale, or H*b."""
    if fmt == "fp8":
        return hidden + 4 * (hidden // 128)
    if fmt == "mxfp8":
        return hidden + hidden // 32
    if fmt == "nvfp4":
        return hidden // 2 + hidden // 16 + 4
    return hidden * elem


def _format_kwargs(fmt: str, mode: str) -> dict:
    """The dispatch keywords of a link format ("" for the rows as they are)."""
    if fmt in ("mxfp8", "nvfp4"):
        return {"dispatch_dtype": fmt}
    if mode == "normal":
        return {"fp8": fmt == "fp8" or None}
    return {"fp8": fmt == "fp8"}


def _dequantized(res, fmt: str, dtype):
    """The rows a dispatch received, as the expert (the identity) sees them."""
    from moe_comm import microscale, reference

    if fmt == "mxfp8":
        return microscale.dequantize_mxfp8(res.x, res.x_scales).to(dtype)
    if fmt == "nvfp4":
        return microscale.dequantize_nvfp4(res.x, res.x_scales, res.x_global_scale).to(dtype)
    return reference.dequantize_fp8(res.x, res.x_scales).to(dtype) if fmt else res.x


@contextlib.contextmanager
def _counting(launches: dict | None, op: str):
    """With ``launches`` a dict: ``launches[op]`` := the launches of the block, every kernel
    counted (``host_cost.LaunchCounter``: Triton's and torch's)."""
    if launches is None:
        yield
        return
    from host_cost import LaunchCounter

    with LaunchCounter() as counter:
        yield
    launches[op] = counter.count


def _normal_call(buf, x, idx, w, fmt: str, combine_fmt: str = "", launches=None):
    """One dispatch + combine; the expert is the identity (on dequantized rows with FP8)."""
    t0 = time.perf_counter()
    with _counting(launches, "dispatch"):
        res = buf.dispatch(x, idx, w, **_format_kwargs(fmt, "normal"))
    t1 = time.perf_counter()
    y = _dequantized(res, fmt, x.dtype)
    t2 = time.perf_counter()
    with _counting(launches, "combine"):
        out = buf.combine(y, res.handle, weights=res.weights, combine_dtype=combine_fmt or None)
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2, (res, y, out)


def _ll_dequantized(recv, fmt: str, dtype):
    """A low-latency receive's [L, rows, H] rows as the expert (the identity) sees them."""
    if not fmt:
        return recv.x
    L, rows = recv.x.shape[:2]
    glob = getattr(recv, "x_global_scale", None)
    flat = SimpleNamespace(x=recv.x.reshape(L * rows, -1),
                           x_scales=recv.x_scales.reshape(L * rows, -1),
                           x_global_scale=None if glob is None else glob.reshape(-1))
    return _dequantized(flat, fmt, dtype).reshape(L, rows, -1)


def _low_latency_call(buf, x, idx, w, fmt: str, combine_fmt: str = "", launches=None):
    t0 = time.perf_counter()
    with _counting(launches, "dispatch"):
        recv, _ = buf.low_latency_dispatch(x, idx, **_format_kwargs(fmt, "low_latency"))
    t1 = time.perf_counter()
    y = _ll_dequantized(recv, fmt, x.dtype)
    t2 = time.perf_counter()
    with _counting(launches, "combine"):
        out, _ = buf.low_latency_combine(y, idx, w, recv.handle,
                                         combine_dtype=combine_fmt or None)
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2, (recv, y, out)


def _agrees(mode, rank, result, xs, idxs, ws, cfg, tokens, fmt, combine_fmt="") -> bool:
    """Bit-for-bit agreement of this rank's dispatch and combine with the reference."""
    from moe_comm import reference

    fp8 = fmt == "fp8"
    block = fmt if fmt in ("mxfp8", "nvfp4") else None
    if mode == "normal":
        res, y, out = result
        ref = reference.dispatch_all(xs, idxs, ws, num_experts=cfg.experts, fp8=fp8,
                                     dispatch_dtype=block)
        ys = [_dequantized(r, fmt, xs[0].dtype) for r in ref]
        ref_out = reference.combine_all(ys, [r.handle for r in ref], [r.weights for r in ref],
                                        combine_dtype=combine_fmt or None)
        same_rows = torch.equal(res.x.view(torch.uint8), ref[rank].x.view(torch.uint8))
        return bool(same_rows and torch.equal(out, ref_out[rank]))
    recv, y, out = result
    ref = reference.low_latency_dispatch_all(xs, idxs, num_experts=cfg.experts,
                                             max_tokens=tokens, fp8=fp8, dispatch_dtype=block)
    ok = torch.equal(recv.count, ref[rank].count)
    for e, n in enumerate(ref[rank].count.tolist()):
        ok = ok and torch.equal(recv.x[e, :n].view(torch.uint8), ref[rank].x[e, :n].view(
            torch.uint8))
    ys = [_ll_dequantized(r, fmt, xs[0].dtype).to(xs[0].dtype) for r in ref]
    for e, n in enumerate(ref[rank].count.tolist()):  # rows past count are never read
        ys[rank][e, :n] = y[e, :n]
    ref_out = reference.low_latency_combine_all(ys, idxs, ws, ref, tokens, combine_fmt or None)
    return bool(ok and torch.equal(out, ref_out[rank]))


def bench_job(rank, world_size, cfg: ModelConfig, tokens: int, dtype_name: str, iters: int,
              warmup: int, routing: str, seed: int, mode: str = "normal",
              fmt: str = "", combine_fmt: str = "", ring_slots: int = 0) -> dict:
    """Runs on every rank: timed moe_comm and reference calls, counters and agreement
    (``ring_slots``: a staging of that many slots per source, the calls in rounds)."""
    import torch.distributed as dist

    import moe_comm
    from moe_comm import reference
    from moe_comm.workspace import staging_slot_bytes

    dtype = DTYPES[dtype_name]
    xs, idxs, ws = make_routing(cfg, world_size, tokens, routing, seed)
    xs = [x.to(dtype) for x in xs]
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    L = cfg.experts // world_size
    payload = _payload_bytes(cfg.hidden, x.element_size(), fmt)
    back = _payload_bytes(cfg.hidden, x.element_size(), combine_fmt)
    if mode == "normal":  # each token once per distinct other destination rank
        dests = [{int(e) // L for e in row if e >= 0} for row in idx.tolist()]
        remote = sum(len(d - {rank}) for d in dests)
    else:  # each (token, expert) pair whose expert is on another rank
        remote = int(((idx >= 0) & (idx // L != rank)).sum())
    min_link_bytes = remote * payload
    min_combine_bytes = sum(  # the rows this rank sends home to other ranks
        len({int(e) // L for e in row if e >= 0} & {rank}) if mode == "normal"
        else int((torch.tensor(row) // L == rank).sum())
        for s in range(world_size) if s != rank for row in idxs[s].tolist()) * back

    budget = (ring_slots * staging_slot_bytes(world_size, cfg.hidden, min(16, cfg.experts),
                                              dtype) if ring_slots else None)
    buf = moe_comm.Buffer(dist.group.WORLD, hidden=cfg.hidden, num_experts=cfg.experts,
                          max_tokens_per_rank=tokens, dtype=dtype,
                          low_latency=mode == "low_latency", staging_bytes=budget)
    call = _normal_call if mode == "normal" else _low_latency_call
    ours_d, ours_c, ref_d, ref_c = [], [], [], []
    for it in range(warmup + iters):
        dist.barrier()
        stats0, syncs0 = buf.stats(), sum(buf.host_syncs.values())
        t_dispatch, t_combine, result = call(buf, x, idx, w, fmt, combine_fmt)
        stats1, syncs1 = buf.stats(), sum(buf.host_syncs.values())
        dist.barrier()
        t3 = time.perf_counter()
        ref = reference.dispatch(x, idx, w, cfg.experts)
        t4 = time.perf_counter()
        reference.combine(ref.x, ref.handle, ref.weights)
        t5 = time.perf_counter()
        if it >= warmup:
            ours_d.append(t_dispatch)
            ours_c.append(t_combine)
            ref_d.append(t4 - t3)
            ref_c.append(t5 - t4)
    launches: dict = {}  # one more call, untimed, with every launch counted (torch's too)
    dist.barrier()
    *_, result = call(buf, x, idx, w, fmt, combine_fmt, launches=launches)
    rows = result[0].x.shape[0] if mode == "normal" else int(result[0].count.sum())
    agrees = _agrees(mode, rank, result, xs, idxs, ws, cfg, tokens, fmt, combine_fmt)
    rounds = buf.rounds
    buf.close()
    return {
        "rows": rows,
        "rounds": rounds,
        "link_bytes": stats1["dispatch_bytes_to_peers"] - stats0["dispatch_bytes_to_peers"],
        "combine_link_bytes": stats1["combine_bytes_to_peers"]
        - stats0["combine_bytes_to_peers"],
        "min_link_bytes": min_link_bytes,
        "min_combine_link_bytes": min_combine_bytes,
        "dispatch_launches": launches["dispatch"],
        "combine_launches": launches["combine"],
        "host_syncs": syncs1 - syncs0,
        "matches_reference": agrees,
        "times_s": {"dispatch": ours_d, "combine": ours_c, "ref_dispatch": ref_d,
                    "ref_combine": ref_c},
    }


def _slowest(per_rank: list[dict], key: str) -> list[float]:
    """Per iteration, the time of the slowest rank (it sets the op's time)."""
    return [max(r["times_s"][key][i] for r in per_rank)
            for i in range(len(per_rank[0]["times_s"][key]))]


def _ms(values: list[float]) -> str:
    return (f"{statistics.median(values) * 1e3:.0f} "
            f"[{min(values) * 1e3:.0f}-{max(values) * 1e3:.0f}]")


def summarize(cfg: ModelConfig, args, per_rank: list[dict]) -> dict:
    row = {"config": cfg.name, **asdict(cfg), "ranks": args.ranks, "tokens_per_rank": args.tokens,
           "dtype": args.dtype, "routing": args.routing, "mode": args.mode,
           "dispatch_dtype": args.dispatch_dtype or args.dtype,
           "combine_dtype": args.combine_dtype or args.dtype,
           "rows": sum(r["rows"] for r in per_rank),
           "link_bytes": sum(r["link_bytes"] for r in per_rank),
           "combine_link_bytes": sum(r["combine_link_bytes"] for r in per_rank),
           "min_link_bytes": sum(r["min_link_bytes"] for r in per_rank),
           "min_combine_link_bytes": sum(r["min_combine_link_bytes"] for r in per_rank),
           "dispatch_launches": per_rank[0]["dispatch_launches"],
           "combine_launches": per_rank[0]["combine_launches"],
           "host_syncs": per_rank[0]["host_syncs"], "rounds": per_rank[0]["rounds"],
           "matches_reference": all(r["matches_reference"] for r in per_rank)}
    for key in ("dispatch", "combine", "ref_dispatch", "ref_combine"):
        row[f"cpu_{key}_s"] = _slowest(per_rank, key)
    if args.system:
        from moe_comm.perfmodel import predict

        _, idxs, _ = make_routing(cfg, args.ranks, args.tokens, args.routing, args.seed)
        p = predict(args.system, args.mode, ep=args.ranks, tokens_per_rank=args.tokens,
                    hidden=cfg.hidden, topk=cfg.topk, num_experts=cfg.experts,
                    dispatch_dtype=args.dispatch_dtype or args.dtype,
                    combine_dtype=args.combine_dtype or args.dtype,
                    routing=torch.cat(idxs),
                    rounds=per_rank[0]["rounds"] if args.mode == "normal" else 1)
        row.update(system=args.system, pred_dispatch_us=p.dispatch_us,
                   pred_combine_us=p.combine_us, pred_bottleneck=p.bottleneck,
                   pred_min_link_bytes_per_rank=p.bytes["dispatch"].min_link_bytes)
    return row


def format_table(rows: list[dict], system: str | None) -> str:
    header = ["config", "H", "E", "K", "tok/rank", "rows", "link MB", "min MB", "overhead",
              "combine MB/min", "launches d/c", "syncs", "ref", "cpu ms dispatch",
              "cpu ms combine", "ref cpu ms d/c"]
    if system:
        header += [f"pred us d/c ({system})", "bound", "model min MB/rank"]
    cells = [header]
    for r in rows:
        line = [r["config"], str(r["hidden"]), str(r["experts"]), str(r["topk"]),
                str(r["tokens_per_rank"]), str(r["rows"]), f"{r['link_bytes'] / 1e6:.3f}",
                f"{r['min_link_bytes'] / 1e6:.3f}",
                f"{r['link_bytes'] / max(r['min_link_bytes'], 1) - 1:+.1%}",
                f"{r['combine_link_bytes'] / 1e6:.3f}/{r['min_combine_link_bytes'] / 1e6:.3f}",
                f"{r['dispatch_launches']}/{r['combine_launches']}", str(r["host_syncs"]),
                "exact" if r["matches_reference"] else "DIFFERS",
                _ms(r["cpu_dispatch_s"]), _ms(r["cpu_combine_s"]),
                f"{statistics.median(r['cpu_ref_dispatch_s']) * 1e3:.0f}/"
                f"{statistics.median(r['cpu_ref_combine_s']) * 1e3:.0f}"]
        if system:
            line += [f"{r['pred_dispatch_us']:.1f}/{r['pred_combine_us']:.1f}",
                     r["pred_bottleneck"], f"{r['pred_min_link_bytes_per_rank'] / 1e6:.3f}"]
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["  ".join(c[i].ljust(widths[i]) if i == 0 else c[i].rjust(widths[i])
                       for i in range(len(header))) for c in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--mode", choices=["normal", "low_latency"], default="normal")
    parser.add_argument("--fp8", action="store_true", help="FP8 dispatch (combine stays in "
                        "--dtype): the same as --dispatch-dtype fp8")
    parser.add_argument("--dispatch-dtype", choices=["bf16", "fp8", "mxfp8", "nvfp4"],
                        default=None,
                        help="what the dispatch sends: bf16 (the rows as they are, with --dtype "
                             "bf16) or quantized in the send kernel: fp8 (per 128 channels), "
                             "mxfp8 (E8M0 per 32), nvfp4 (e2m1, e4m3 per 16, a global scale); "
                             "default --dtype")
    parser.add_argument("--combine-dtype", choices=["bf16", "fp8"], default=None,
                        help="what the combine sends: bf16 (the rows' dtype, with --dtype bf16) "
                             "or fp8 (e4m3 per 128 channels, dequantized at home); default "
                             "--dtype")
    parser.add_argument("--tokens", type=int, default=128,
                        help="tokens per rank (128: a decode batch)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--routing", choices=["uniform", "zipf"], default="uniform")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ring-slots", type=int, default=0,
                        help="normal mode: stage that many slots per source (Buffer "
                        "staging_bytes), every call in rounds (with --nodes: the flat and "
                        "the hierarchical Buffer's); 0: the default budget")
    parser.add_argument("--configs", nargs="+", default=[c.name for c in CONFIGS],
                        choices=[c.name for c in CONFIGS])
    parser.add_argument("--framework", nargs="+", default=[], choices=["megatron", "deepspeed"],
                        help="also compare the framework's own MoE dispatcher with moe_comm "
                             "(bytes and agreement; bench/framework_compare.py)")
    parser.add_argument("--framework-config", type=int, nargs=3, default=[256, 16, 2],
                        metavar=("HIDDEN", "EXPERTS", "TOPK"),
                        help="the MoE layer of the framework comparison (its experts are real "
                             "MLPs: small by default on CPU)")
    parser.add_argument("--nodes", type=int, default=1,
                        help="group the ranks into this many nodes: cross-node bytes of the "
                             "flat and hierarchical modes through the NIXL proxy "
                             "(bench/internode_bench.py)")
    parser.add_argument("--system", default="h800",
                        help="perfmodel system for the prediction columns ('' to skip)")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results",
                                                       "dispatch_bench.json"))
    args = parser.parse_args(argv)
    if args.system:
        from moe_comm.perfmodel import SYSTEMS

        if args.system not in SYSTEMS:
            parser.error(f"--system must be one of {sorted(SYSTEMS)}")

    from moe_comm.testing.launch import RankPool

    configs = [c for c in CONFIGS if c.name in args.configs]
    if args.fp8:
        args.dispatch_dtype = "fp8"
    if args.combine_dtype == "bf16":  # the rows' own dtype
        if args.dtype != "bf16":
            parser.error(f"--combine-dtype bf16 needs --dtype bf16, got --dtype {args.dtype}")
        args.combine_dtype = None
    if args.combine_dtype:  # FP8 partials need hidden % 128 == 0
        skipped = [c.name for c in configs if c.hidden % 128]
        configs = [c for c in configs if c.hidden % 128 == 0]
        if skipped:
            print(f"fp8 combine skips {skipped} (hidden not a multiple of 128)", file=sys.stderr)
    if args.dispatch_dtype == "bf16":  # the rows as they are
        if args.dtype != "bf16":
            parser.error(f"--dispatch-dtype bf16 sends the rows as they are: it needs --dtype "
                         f"bf16, got --dtype {args.dtype}")
        args.dispatch_dtype = None
    if args.dispatch_dtype:  # FP8 needs hidden % 128 == 0, MXFP8 % 32, NVFP4 % 16
        group = GROUP[args.dispatch_dtype]
        skipped = [c.name for c in configs if c.hidden % group]
        configs = [c for c in configs if c.hidden % group == 0]
        if skipped:
            print(f"{args.dispatch_dtype} skips {skipped} (hidden not a multiple of {group})",
                  file=sys.stderr)
    for cfg in configs:
        if cfg.experts % args.ranks:
            parser.error(f"{cfg.name}: {cfg.experts} experts do not split over {args.ranks} ranks")
    if args.nodes > 1:
        return _internode(args, configs)
    rows = []
    start = time.perf_counter()
    print(f"starting {args.ranks} CPU ranks (Triton interpreter) ...", file=sys.stderr, flush=True)
    with RankPool(args.ranks) as pool:
        for i, cfg in enumerate(configs, 1):
            per_rank = pool.run(bench_job, cfg, args.tokens, args.dtype, args.iters, args.warmup,
                                args.routing, args.seed, args.mode, args.dispatch_dtype or "",
                                args.combine_dtype or "", args.ring_slots)
            rows.append(summarize(cfg, args, per_rank))
            print(f"[{i}/{len(configs)}] {cfg.name} done, {time.perf_counter() - start:.0f} s "
                  "elapsed", file=sys.stderr, flush=True)
        framework_rows = []
        for framework in args.framework:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import framework_compare

            hidden, experts, topk = args.framework_config
            framework_rows += pool.run(framework_compare.framework_job, framework, hidden,
                                       experts, topk, args.tokens, args.dtype, args.seed)
            print(f"{framework} comparison done, {time.perf_counter() - start:.0f} s elapsed",
                  file=sys.stderr, flush=True)
    rounds = (f", {rows[0]['rounds']} rounds a call (--ring-slots {args.ring_slots})"
              if rows and rows[0]["rounds"] > 1 else "")
    print(f"\nmoe_comm {args.mode} dispatch/combine, {args.ranks} CPU ranks, {args.tokens} tokens "
          f"per rank, {args.dispatch_dtype.upper() + ' dispatch, ' if args.dispatch_dtype else ''}"
          f"{args.combine_dtype.upper() + ' combine, ' if args.combine_dtype else ''}"
          f"{args.dtype}, {args.routing} routing{rounds}; MB = 1e6 bytes, summed over ranks\n")
    print(format_table(rows, args.system))
    print("\ncpu ms: Triton interpreter on CPU, slowest rank, median [min-max] of "
          f"{args.iters}; not GPU performance. pred: moe_comm.perfmodel on {args.system}.")
    if framework_rows:
        print(f"\nThe frameworks' own dispatchers against moe_comm, same routing, {args.ranks} "
              "CPU ranks (HIDDEN, EXPERTS, TOPK = "
              f"{' '.join(map(str, args.framework_config))}):\n")
        print(framework_compare.format_rows(framework_rows))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"rows written to {args.json}")
    return 0 if all(r["matches_reference"] for r in rows) else 1


def _internode(args, configs) -> int:
    """``--nodes``: the table of bench/internode_bench.py."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import internode_bench

    from moe_comm.testing.launch import RankPool

    if args.ranks % args.nodes:
        raise SystemExit(f"--ranks {args.ranks} does not split into {args.nodes} nodes")
    print(f"starting {args.ranks} CPU ranks in {args.nodes} nodes ...", file=sys.stderr,
          flush=True)
    with RankPool(args.ranks) as pool:
        rows = internode_bench.run(pool, args.ranks, configs, args.nodes, args.tokens,
                                   DTYPES[args.dtype], args.seed, args.ring_slots)
    print(f"\nmoe_comm normal mode across {args.nodes} nodes x {args.ranks // args.nodes} CPU "
          f"ranks (NIXL proxy, UCX), {args.tokens} tokens per rank, {args.dtype}, uniform "
          "routing; MB = 1e6 bytes, summed over ranks\n")
    print(internode_bench.format_rows(rows))
    print("\nproxy/bare: CPU times of NIXL transfers between processes of one machine, not GPU "
          "or NIC performance. model: moe_comm.perfmodel (uniform routing).")
    path = args.json.replace(".json", "_internode.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"rows written to {path}")
    return 0 if all(r["matches_reference"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
