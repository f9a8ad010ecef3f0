"""Dispatch/combine on one GPU with virtual ranks (loopback), timed with CUDA events.

    TRITON_INTERPRET=0 python bench/gpu_bench.py --out perf.md

Rows: normal mode at DeepSeek-V3 sizes (8 virtual ranks, 4096 tokens each, hidden 7168, top-8,
256 experts; bf16 and FP8) and low-latency mode (128 tokens each, FP8), the Triton and the CUDA
(csrc/) implementations side by side, and the torch baseline (moe_comm.reference's permutation
path on the same GPU). Each op runs all virtual ranks in turn on one stream, so its time is the
sum of the ranks' kernels; bytes are what the kernels stored (moe_comm's own counters: rows,
metadata, signals), GB = 1e9; the ceiling is a measured device-to-device copy (bytes copied per
second). Median and spread over ``--iters`` after ``--warmup``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from functools import partial

import torch

import moe_comm
from moe_comm import lockstep, reference


def cuda_time_ms(fn, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def copy_ceiling_GBps(iters: int) -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = statistics.median(cuda_time_ms(lambda: dst.copy_(src), iters, 3))
    return src.numel() / (ms * 1e-3) / 1e9


def inputs(R, T, H, E, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn((T, H), generator=g).to(torch.bfloat16).cuda() for _ in range(R)]
    idxs = [torch.rand((T, E), generator=g).topk(K, dim=1).indices.cuda() for _ in range(R)]
    ws = [torch.softmax(torch.randn((T, K), generator=g), 1).cuda() for _ in range(R)]
    return xs, idxs, ws


def stats_bytes(bufs, key):
    return sum(b.stats()[f"{key}_bytes_to_peers"] + b.stats()[f"{key}_bytes_to_self"]
               for b in bufs)


def measure(label, op, bufs, key, iters, warmup, ceiling):
    before = stats_bytes(bufs, key) if bufs else 0
    times = cuda_time_ms(op, iters, warmup)
    per_call = (stats_bytes(bufs, key) - before) / (iters + warmup) if bufs else 0
    ms = statistics.median(times)
    gbps = per_call / (ms * 1e-3) / 1e9 if per_call else float("nan")
    return {"op": label, "median_ms": ms, "min_ms": min(times), "max_ms": max(times),
            "bytes": per_call, "GBps": gbps, "of_ceiling": gbps / ceiling}


def normal_rows(args, ceiling):
    R, T, H, E, K = 8, args.tokens, 7168, 256, 8
    xs, idxs, ws = inputs(R, T, H, E, K)
    bufs = moe_comm.Buffer.loopback(R, H, E, T, torch.bfloat16, device="cuda")
    rows = []
    for fp8 in (False, True):
        name = f"normal EP{R} T={T} {'fp8' if fp8 else 'bf16'}"
        dispatch = partial(lockstep.dispatch, bufs, xs, idxs, ws, fp8=fp8)
        rows.append(measure(f"{name} dispatch (triton)", dispatch, bufs, "dispatch",
                            args.iters, args.warmup, ceiling))
        res = dispatch()  # the latest dispatch: its handles stay valid for repeated combines
        ys = [(reference.dequantize_fp8(r.x, r.x_scales).to(torch.bfloat16) if fp8 else r.x)
              for r in res]
        combine = partial(lockstep.combine, bufs, ys, [r.handle for r in res],
                          [r.weights for r in res])
        rows.append(measure(f"{name} combine (triton)", combine, bufs, "combine", args.iters,
                            args.warmup, ceiling))
    for b in bufs:
        b.close()
    ref = partial(reference.dispatch_all, xs, idxs, ws, num_experts=E)
    rows.append(measure(f"normal EP{R} T={T} bf16 dispatch (torch reference)", ref, None,
                        "dispatch", args.iters, args.warmup, ceiling))
    res = ref()
    rows.append(measure(f"normal EP{R} T={T} bf16 combine (torch reference)",
                        partial(reference.combine_all, [r.x for r in res],
                                [r.handle for r in res], [r.weights for r in res]),
                        None, "combine", args.iters, args.warmup, ceiling))
    return rows


def low_latency_rows(args, ceiling):
    R, T, H, E, K = 8, 128, 7168, 256, 8
    xs, idxs, ws = inputs(R, T, H, E, K, seed=1)
    rows = []
    for impl in ("triton", "cuda"):
        name = f"low-latency EP{R} T={T}"
        try:
            bufs = moe_comm.Buffer.loopback(R, H, E, T, torch.bfloat16, low_latency=True,
                                            device="cuda", kernel_impl=impl)
            recvs = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=True)
        except Exception as error:  # the CUDA kernels need nvcc and NVSHMEM on this machine
            rows.append({"op": f"{name} ({impl})", "error": f"{type(error).__name__}: "
                                                              f"{error}"[:160]})
            continue
        ys = [torch.zeros_like(r.x, dtype=torch.bfloat16) for r in recvs]
        rows.append(measure(f"{name} fp8 dispatch ({impl})",
                            partial(lockstep.low_latency_dispatch, bufs, xs, idxs, fp8=True),
                            bufs, "dispatch", args.iters, args.warmup, ceiling))
        recvs = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=True)
        rows.append(measure(f"{name} bf16 combine ({impl})",
                            partial(lockstep.low_latency_combine, bufs, ys, idxs, ws,
                                    [r.handle for r in recvs]),
                            bufs, "combine", args.iters, args.warmup, ceiling))
        for b in bufs:
            b.close()
    return rows


def to_markdown(rows, ceiling, device) -> str:
    lines = [f"{datetime.date.today()} on {device}; copy ceiling {ceiling:.0f} GB/s "
             "(device-to-device, bytes copied per second); times are for all 8 virtual ranks "
             "in turn on one GPU", "",
             "| op | median ms | min-max ms | bytes (kernels' counters) | GB/s | of ceiling |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['op']} | not run: {r['error']} | | | | |")
            continue
        if not r["bytes"]:  # the torch baseline has no byte counters
            lines.append(f"| {r['op']} | {r['median_ms']:.3f} | {r['min_ms']:.3f}-"
                         f"{r['max_ms']:.3f} | n/a | n/a | n/a |")
            continue
        lines.append(f"| {r['op']} | {r['median_ms']:.3f} | {r['min_ms']:.3f}-{r['max_ms']:.3f}"
                     f" | {r['bytes'] / 1e6:.1f} MB | {r['GBps']:.1f} | {r['of_ceiling']:.0%} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("set TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name()
    ceiling = copy_ceiling_GBps(args.iters)
    rows = normal_rows(args, ceiling) + low_latency_rows(args, ceiling)
    table = to_markdown(rows, ceiling, device)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
