"""Dispatch/combine on one GPU with virtual ranks (loopback): checked, then timed with CUDA events.

    TRITON_INTERPRET=0 python bench/gpu_bench.py --out perf.md

Rows: normal mode at DeepSeek-V3 sizes (8 virtual ranks, 4096 tokens each, hidden 7168, top-8,
256 experts; bf16 and FP8) and low-latency mode (128 tokens each, FP8), the Triton and the CUDA
(csrc/) implementations side by side, and the torch baseline (moe_comm.reference's permutation
path on the same GPU). Each op runs all virtual ranks in turn on one stream, so its time is the
sum of the ranks' kernels; bytes are what the kernels stored (moe_comm's own counters: rows,
metadata, signals), GB = 1e9; the ceiling is a measured device-to-device copy (bytes copied per
second). Median and spread over ``--iters`` after ``--warmup``.

Before anything of a configuration is timed, its results are checked against moe_comm.reference
on the same inputs (bench/gpu_compare.py): rows, FP8 codes and scales, counts and source info
byte for byte, combine outputs within one ulp (plus the rounding of the partial sums that travel
in normal mode). The results of the last timed calls are checked again. The normal-mode dispatch
is sized by ``max_recv_rows`` (the largest rank's received rows, rounded up to 256), so no host
synchronisation sits inside the timed region (checked: ``host_syncs`` does not move).

Also measured, each in its own section of the table: the low-latency pair as CUDA-graph replays
(the way inference engines run decode: dispatch and combine each captured once for every rank,
then replayed with new inputs; checked after the last replay); each row-moving kernel's bytes
read plus written (counted from the call's own outputs: rows, slots, tokens) over its device
time, against the copy ceiling (``kernel_shares``); the host time per op and rank; and
back-to-back normal dispatches sized by ``max_recv_rows`` (``--iters`` of them queued without a
synchronisation: the host time per call against the device time per call, so whether the host
stays ahead of the device).

Any error or mismatch is printed with what failed; the other rows still run, the table marks the
row FAILED, and the script exits 1.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import traceback
from functools import partial

import torch
from gpu_compare import (
    assert_within_one_ulp,
    check_ll_dispatch,
    check_normal_dispatch,
    ll_combine_slack,
    normal_combine_slack,
    settle,
)

import moe_comm
from moe_comm import reference
from moe_comm.testing import lockstep

ROW_ROUNDING = 256  # max_recv_rows = the largest rank's rows, rounded up to this


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


def host_syncs(bufs) -> int:
    return sum(sum(b.host_syncs.values()) for b in bufs)


def kernel_times(op, calls: int = 5) -> dict[str, tuple[float, float]]:
    """``{kernel: (device ms per call, launches per call)}`` of what ``op`` runs on the GPU
    (torch.profiler, CUDA activity only): the device's own time, without the host's."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            op()
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        us = getattr(evt, "self_cuda_time_total", 0) if us is None else us
        if us > 0:
            out[evt.key] = (us / 1e3 / calls, evt.count / calls)
    return out


def host_ms(op, iters: int) -> float:
    """Median host time of one call, the device left to run behind (Python, checks and
    launches: the floor of a call's time when the kernels take less). Each call starts on an
    idle device: calls queued one after another would fill the launch queue (about a thousand
    launches; a call in rounds launches hundreds) and the host would then wait for the device."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        op()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def host_ms_triton_path(op, iters: int) -> float:
    """:func:`host_ms` with every launch through Triton's own launch path (no bound launches,
    ``kernels.bound``): what binding each launch once saves."""
    from moe_comm.kernels import bound

    bound.ENABLED = False
    try:
        return host_ms(op, iters)
    finally:
        bound.ENABLED = True


def measure(label, op, bufs, key, iters, warmup, ceiling):
    before = stats_bytes(bufs, key) if bufs else 0
    times = cuda_time_ms(op, iters, warmup)
    per_call = (stats_bytes(bufs, key) - before) / (iters + warmup) if bufs else 0
    ms = statistics.median(times)
    gbps = per_call / (ms * 1e-3) / 1e9 if per_call else float("nan")
    row = {"op": label, "median_ms": ms, "min_ms": min(times), "max_ms": max(times),
           "bytes": per_call, "GBps": gbps, "of_ceiling": gbps / ceiling, "kernels": {}}
    try:  # where the time goes: the kernels' device time against the timed (host-paced) time
        row["kernels"] = kernel_times(op)
        row["host_ms"] = host_ms(op, iters)
        row["host_ms_triton_path"] = host_ms_triton_path(op, iters)
    except Exception as error:
        row["kernels_error"] = describe(error)
    return row


def write_kernel_times(path: str, rows: list[dict], device: str) -> None:
    """One line per (op, kernel) the profiler saw: device us per call, all ranks, and the
    launches per call (bench/fit_model.py reads them)."""
    with open(path, "w") as f:
        f.write("device\top\tkernel\tdevice_us_per_call\tlaunches_per_call\n")
        for row in rows:
            for kernel, (ms, launches) in sorted(row.get("kernels", {}).items()):
                f.write(f"{device}\t{row['op']}\t{kernel}\t{ms * 1e3:.3f}\t{launches:g}\n")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _as_bf16_rows(res) -> torch.Tensor:
    """What the stand-in experts return: the rows themselves (FP8 rows dequantized)."""
    if res.x.dtype == torch.float8_e4m3fn:
        return reference.dequantize_fp8(res.x, res.x_scales).to(torch.bfloat16)
    return res.x


# ------------------------------------------------------------------------------ per kernel
# bytes each row-moving kernel reads plus writes, from the counts of one call (all ranks)
def normal_kernel_bytes(res, T: int, H: int, elem: int, meta_bytes: int) -> dict[str, int]:
    """``{kernel: bytes read + written}`` of one normal-mode call of every rank, from its
    results ``res`` (the DispatchResults): ``T`` tokens per rank of ``H`` channels, ``elem``
    bytes a channel on the link, ``meta_bytes`` per slot. The send reads each token once and
    writes one row per slot; the expand reads each slot's row and writes each output row
    (padding included); the combine send reads each output row and writes one partial per
    slot; the reduce reads each partial and writes each token."""
    R = len(res)
    slots = sum(int(r.handle.recv_slot_offsets[-1]) for r in res)
    rows = sum(r.x.shape[0] for r in res)
    row = H * elem
    return {"dispatch_send_kernel": R * T * row + slots * (row + meta_bytes),
            "dispatch_expand_kernel": slots * (row + meta_bytes) + rows * row,
            "combine_send_kernel": rows * H * 2 + slots * H * 2,
            "combine_reduce_kernel": slots * H * 2 + R * T * H * 2}


def kernel_shares(kernels: dict, bytes_by_kernel: dict, ceiling: float) -> dict[str, float]:
    """``{kernel: share of the copy ceiling}``: bytes over the kernel's device time (ms per
    call from ``kernel_times``), in GB/s, over ``ceiling`` (bytes copied per second, GB/s; a
    copy reads and writes each byte, so reads plus writes at the ceiling are twice it)."""
    out = {}
    for name, nbytes in bytes_by_kernel.items():
        ms = sum(t for k, (t, _) in kernels.items() if k.startswith(name))
        if ms > 0:
            out[name] = nbytes / (ms * 1e-3) / 1e9 / (2 * ceiling)
    return out


def back_to_back(op, calls: int) -> dict:
    """``calls`` calls of ``op`` queued without a synchronisation: host ms per call (the time to
    issue them) against device ms per call (events around the whole batch)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        op()
    host = (time.perf_counter() - t0) * 1e3 / calls
    end.record()
    end.synchronize()
    return {"host_ms": host, "device_ms": start.elapsed_time(end) / calls,
            "host_ahead": host < 0.5 * start.elapsed_time(end) / calls}


# ------------------------------------------------------------------------------ normal mode
def _normal_config(fp8, xs, idxs, ws, E, args, ceiling, rows, failures,
                   staging_bytes=None, num_sms=None) -> int:
    """Checks, times and checks again one normal-mode configuration; returns max_recv_rows.
    ``staging_bytes``: the Buffers' staging budget (None: the default); ``num_sms``: the SMs of
    the persistent send grids (None: the Buffer's default)."""
    R, T, H = len(xs), xs[0].shape[0], xs[0].shape[1]
    K = idxs[0].shape[1]
    name = f"normal EP{R} T={T} {'fp8' if fp8 else 'bf16'}"
    if staging_bytes is not None:
        name += f" staging {staging_bytes / 2**30:.2f} GiB"
    if num_sms is not None:
        name += f" num_sms={num_sms}"
    bufs, bound = [], 0
    try:
        log(f"{name}: reference and check")
        want = reference.dispatch_all(xs, idxs, ws, num_experts=E, fp8=fp8)
        bound = -(-max(w.x.shape[0] for w in want) // ROW_ROUNDING) * ROW_ROUNDING
        ys_ref = [_as_bf16_rows(w) for w in want]
        ref_handles, ref_weights = [w.handle for w in want], [w.weights for w in want]
        ref_outs = reference.combine_all(ys_ref, ref_handles, ref_weights)
        slack = normal_combine_slack(ys_ref, ref_handles, ref_weights)
        bufs = moe_comm.Buffer.loopback(R, H, E, T, torch.bfloat16, device="cuda",
                                        staging_bytes=staging_bytes, num_sms=num_sms)
        staging = staging_row(bufs[0], name)
        dispatch = partial(lockstep.dispatch, bufs, xs, idxs, ws, fp8=fp8, max_recv_rows=bound)

        def check(res, outs, when):
            for r, (g, w) in enumerate(zip(res, want)):
                check_normal_dispatch(g, w, f"{name} dispatch rank {r} ({when})")
            for r, (o, w, s) in enumerate(zip(outs, ref_outs, slack)):
                assert_within_one_ulp(o, w, s, f"{name} combine rank {r} ({when})")

        def round_trip():
            res = dispatch()
            ys = [_as_bf16_rows(g) for g in res]
            combine = partial(lockstep.combine, bufs, ys, [g.handle for g in res],
                              [g.weights for g in res])
            outs = combine()
            settle(bufs, name)
            return res, outs, combine

        syncs = host_syncs(bufs)
        res, outs, _ = round_trip()
        check(res, outs, "before timing")
        del res, outs
        log(f"{name}: timing (max_recv_rows={bound})")
        rows.append(measure(f"{name} dispatch (triton)", dispatch, bufs, "dispatch", args.iters,
                            args.warmup, ceiling))
        rows[-1]["back_to_back"] = back_to_back(dispatch, args.iters)
        settle(bufs, f"{name} back to back")
        # the latest dispatch: its handles stay valid for repeated combines
        res, outs, combine = round_trip()
        rows.append(measure(f"{name} combine (triton)", combine, bufs, "combine", args.iters,
                            args.warmup, ceiling))
        for r in rows[-2:]:
            r["staging"] = staging
        per_kernel = normal_kernel_bytes(res, T, H, 1 + 4 / 128 if fp8 else 2, 4 * (1 + 3 * K))
        for r in rows[-2:]:
            r["shares"] = kernel_shares(r["kernels"], per_kernel, ceiling)
        outs = combine()
        settle(bufs, name)
        check(res, outs, "after timing")
        if host_syncs(bufs) != syncs:
            raise AssertionError(f"{name}: {host_syncs(bufs) - syncs} host synchronisations in "
                                 "dispatches sized by max_recv_rows (the budget is 0)")
    except Exception as error:
        failures.append(f"{name}: {describe(error)}")
        traceback.print_exc()
        rows.append({"op": f"{name} (triton)", "error": describe(error)})
    finally:
        for b in bufs:
            b.close()
    return bound


def staging_row(buf, name: str) -> dict:
    """The staging of one rank of ``buf``: bytes, rounds, and its share of the GPU's memory."""
    total = torch.cuda.get_device_properties(buf.device).total_memory
    return {"config": name, "staging_bytes": buf.staging_bytes, "rounds": buf.rounds,
            "ring_slots": buf.ring_slots, "workspace_bytes": buf.workspace_bytes,
            "gpu_bytes": total}


def normal_rows(args, ceiling, failures):
    R, T, H, E, K = 8, args.tokens, 7168, 256, 8
    xs, idxs, ws = inputs(R, T, H, E, K)
    rows = []
    if args.sms_sweep:  # bf16 only, one row pair per SM count of the persistent send grids
        bounds = [_normal_config(False, xs, idxs, ws, E, args, ceiling, rows, failures,
                                 num_sms=n) for n in args.sms_sweep]
        return rows, max(bounds)
    bounds = [_normal_config(fp8, xs, idxs, ws, E, args, ceiling, rows, failures)
              for fp8 in (False, True)]
    # the default budget stages the whole batch at EP 8; an eighth of it runs every call in 8
    # rounds, as the default does at EP 64
    full = moe_comm.Buffer.required_workspace_bytes(R, H, E, T, torch.bfloat16, K)
    bounds.append(_normal_config(False, xs, idxs, ws, E, args, ceiling, rows, failures,
                                 staging_bytes=full // 8))
    name = f"normal EP{R} T={T} bf16"
    try:
        ref = partial(reference.dispatch_all, xs, idxs, ws, num_experts=E)
        rows.append(measure(f"{name} dispatch (torch reference)", ref, None, "dispatch",
                            args.iters, args.warmup, ceiling))
        res = ref()
        rows.append(measure(f"{name} combine (torch reference)",
                            partial(reference.combine_all, [r.x for r in res],
                                    [r.handle for r in res], [r.weights for r in res]),
                            None, "combine", args.iters, args.warmup, ceiling))
    except Exception as error:
        failures.append(f"{name} torch reference: {describe(error)}")
        traceback.print_exc()
        rows.append({"op": f"{name} (torch reference)", "error": describe(error)})
    return rows, max(bounds)


# ------------------------------------------------------------------------------ low latency
def _low_latency_impl(impl, xs, idxs, ws, E, want, ys, ref_outs, slack, args, ceiling, rows,
                      failures) -> None:
    """Checks, times and checks again the low-latency pair of one implementation."""
    R, T, H = len(xs), xs[0].shape[0], xs[0].shape[1]
    name = f"low-latency EP{R} T={T}"
    bufs = []
    try:
        log(f"{name} ({impl}): check")
        bufs = moe_comm.Buffer.loopback(R, H, E, T, torch.bfloat16, low_latency=True,
                                        device="cuda", kernel_impl=impl)
        dispatch = partial(lockstep.low_latency_dispatch, bufs, xs, idxs, fp8=True)

        def check(recvs, outs, when):
            for r, (got, w) in enumerate(zip(recvs, want)):
                check_ll_dispatch(got, w, f"{name} ({impl}) dispatch rank {r} ({when})")
            for r, (o, w, s) in enumerate(zip(outs, ref_outs, slack)):
                assert_within_one_ulp(o, w, s, f"{name} ({impl}) combine rank {r} ({when})")

        def round_trip():
            recvs = dispatch()
            combine = partial(lockstep.low_latency_combine, bufs, ys, idxs, ws,
                              [r.handle for r in recvs])
            outs = combine()
            settle(bufs, name)
            return recvs, outs, combine

        syncs = host_syncs(bufs)
        recvs, outs, _ = round_trip()
        check(recvs, outs, "before timing")
        log(f"{name} ({impl}): timing")
        rows.append(measure(f"{name} fp8 dispatch ({impl})", dispatch, bufs, "dispatch",
                            args.iters, args.warmup, ceiling))
        recvs, outs, combine = round_trip()
        rows.append(measure(f"{name} bf16 combine ({impl})", combine, bufs, "combine",
                            args.iters, args.warmup, ceiling))
        outs = combine()
        settle(bufs, name)
        check(recvs, outs, "after timing")
        rows += graph_replays(name, impl, bufs, xs, idxs, ws, ys, args, check)
        if host_syncs(bufs) != syncs:
            raise AssertionError(f"{name} ({impl}): {host_syncs(bufs) - syncs} host "
                                 "synchronisations (the budget is 0)")
    except Exception as error:
        failures.append(f"{name} ({impl}): {describe(error)}")
        traceback.print_exc()
        rows.append({"op": f"{name} ({impl})", "error": describe(error)})
    finally:
        for b in bufs:
            b.close()


def graph_replays(name, impl, bufs, xs, idxs, ws, ys, args, check) -> list[dict]:
    """The low-latency dispatch and combine of every virtual rank each captured once in a CUDA
    graph, replayed in turn (dispatch, combine, ...) and timed per replay with CUDA events; the
    results of the last replays are checked."""
    dispatch_graph, combine_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(dispatch_graph):
        recvs = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=True)
    with torch.cuda.graph(combine_graph):
        outs = lockstep.low_latency_combine(bufs, ys, idxs, ws, [r.handle for r in recvs])
    times: dict[str, list[float]] = {"dispatch": [], "combine": []}
    for it in range(args.warmup + args.iters):
        for what, graph in (("dispatch", dispatch_graph), ("combine", combine_graph)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            if it >= args.warmup:
                times[what].append(start.elapsed_time(end))
    settle(bufs, f"{name} ({impl}) graph replays")
    check(recvs, outs, "after the graph replays")
    return [{"op": f"{name} {what} CUDA-graph replay ({impl})", "graph": True,
             "median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t),
             "bytes": 0, "kernels": {}} for what, t in times.items()]


def low_latency_rows(args, ceiling, failures):
    R, T, H, E, K = 8, 128, 7168, 256, 8
    L = E // R
    xs, idxs, ws = inputs(R, T, H, E, K, seed=1)
    cpu = [[t.cpu() for t in v] for v in (xs, idxs, ws)]
    log(f"low-latency EP{R} T={T}: reference (CPU)")
    want = reference.low_latency_dispatch_all(cpu[0], cpu[1], num_experts=E, max_tokens=T,
                                              fp8=True)
    g = torch.Generator(device="cuda").manual_seed(2)
    ys = [torch.randn((L, R * T, H), device="cuda", generator=g).to(torch.bfloat16)
          for _ in range(R)]
    ys_cpu = [y.cpu() for y in ys]
    ref_outs = reference.low_latency_combine_all(ys_cpu, cpu[1], cpu[2], want, T)
    slack = ll_combine_slack(ys_cpu, [w.count for w in want], cpu[1], cpu[2])
    rows = []
    for impl in ("triton", "cuda"):
        _low_latency_impl(impl, xs, idxs, ws, E, want, ys, ref_outs, slack, args, ceiling, rows,
                          failures)
    return rows


def to_markdown(rows, ceiling, device, bound) -> str:
    lines = [f"{datetime.date.today()} on {device}; copy ceiling {ceiling:.0f} GB/s "
             "(device-to-device, bytes copied per second); times are for all 8 virtual ranks "
             "in turn on one GPU. Every configuration was checked against moe_comm.reference "
             "before and after timing (rows, FP8 codes and scales, counts, source info byte for "
             "byte; combine within one ulp). Normal-mode dispatch sized by max_recv_rows="
             f"{bound or 'n/a'} (the largest rank's rows rounded up to {ROW_ROUNDING}): no host "
             "synchronisation in the timed region; the torch reference synchronises.", "",
             "| op | median ms | min-max ms | kernels' device ms | host ms per call | "
             "bytes (kernels' counters) | GB/s | of ceiling |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['op']} | FAILED: {r['error'][:160]} | | | | | | |")
            continue
        device_ms = (f"{sum(ms for ms, _ in r['kernels'].values()):.3f}" if r["kernels"]
                     else "n/a")
        host = f"{r['host_ms']:.3f}" if "host_ms" in r else "n/a"
        head = (f"| {r['op']} | {r['median_ms']:.3f} | {r['min_ms']:.3f}-{r['max_ms']:.3f} | "
                f"{device_ms} | {host}")
        if not r["bytes"]:  # the torch baseline has no byte counters
            lines.append(f"{head} | n/a | n/a | n/a |")
            continue
        lines.append(f"{head} | {r['bytes'] / 1e6:.1f} MB | {r['GBps']:.1f} | "
                     f"{r['of_ceiling']:.0%} |")
    R = 8
    lines += ["", f"Per op and rank ({R} virtual ranks: the kernels' device time and the host "
              "time divided by the ranks; CUDA-graph replays: the replay's time divided by the "
              "ranks; host us through Triton's launch path: every launch bound and "
              "specialised again, as without kernels/bound.py):", "",
              "| op | device us per rank | host us per rank | host us, Triton's launch path |",
              "|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            continue
        device_ms = (sum(ms for ms, _ in r["kernels"].values()) if r["kernels"]
                     else r["median_ms"] if r.get("graph") else None)
        host = f"{r['host_ms'] * 1e3 / R:.1f}" if "host_ms" in r else "n/a"
        unbound = (f"{r['host_ms_triton_path'] * 1e3 / R:.1f}" if "host_ms_triton_path" in r
                   else "n/a")
        device = f"{device_ms * 1e3 / R:.1f}" if device_ms is not None else "n/a"
        lines.append(f"| {r['op']} | {device} | {host} | {unbound} |")
    shares = [r for r in rows if r.get("shares")]
    if shares:
        lines += ["", "Row-moving kernels: bytes read plus written (from the call's rows, slots "
                  "and tokens) over the kernel's device time, as a share of the copy ceiling "
                  "(reads plus writes at the ceiling = 100%):", ""]
        for r in shares:
            lines.append(f"- {r['op']}: " + "; ".join(f"{k} {v:.0%}"
                                                      for k, v in r["shares"].items()))
    staged = {r["staging"]["config"]: r["staging"] for r in rows if r.get("staging")}
    if staged:
        lines += ["", "Normal-mode staging per rank (`staging_bytes`: rounds through per-source "
                  "rings; the workspace holds it and the per-peer words):", "",
                  "| config | staging | rounds | slots per source | workspace | of GPU memory |",
                  "|---|---|---|---|---|---|"]
        for name, st in staged.items():
            lines.append(f"| {name} | {st['staging_bytes'] / 2**30:.3f} GiB | {st['rounds']} | "
                         f"{st['ring_slots']} | {st['workspace_bytes'] / 2**30:.3f} GiB | "
                         f"{st['workspace_bytes'] / st['gpu_bytes']:.1%} |")
    queued = [r for r in rows if r.get("back_to_back")]
    if queued:
        lines += ["", "Back-to-back dispatches (queued without a synchronisation):", ""]
        for r in queued:
            b = r["back_to_back"]
            lines.append(f"- {r['op']}: host {b['host_ms']:.3f} ms per call, device "
                         f"{b['device_ms']:.3f} ms per call: the host "
                         f"{'stays ahead' if b['host_ahead'] else 'does not stay ahead'} "
                         "(host time below half the device time)")
    lines += ["", "Kernels per op (torch.profiler, device time per call; 'n' = launches per "
              "call, all virtual ranks):", ""]
    for r in rows:
        if "error" in r or r.get("graph"):
            continue
        if r.get("kernels_error"):
            lines.append(f"- {r['op']}: profiler failed: {r['kernels_error'][:160]}")
            continue
        top = sorted(r["kernels"].items(), key=lambda kv: -kv[1][0])[:6]
        lines.append(f"- {r['op']}: " + "; ".join(f"{name[:48]} {ms:.3f} ms n={n:g}"
                                                  for name, (ms, n) in top))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="")
    parser.add_argument("--kernels-tsv", default="",
                        help="each op's kernels, device us per call (all ranks) and launches "
                             "per call: what bench/fit_model.py fits the gate's constants to")
    parser.add_argument("--sms-sweep", type=int, nargs="+", default=[],
                        help="only the bf16 normal mode, once per SM count of the persistent "
                             "send grids (Buffer num_sms), and no low-latency rows")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("set TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name()
    failures: list[str] = []
    ceiling = copy_ceiling_GBps(args.iters)
    rows, bound = [], 0
    try:
        normal, bound = normal_rows(args, ceiling, failures)
        rows += normal
    except Exception as error:
        failures.append(f"normal mode: {describe(error)}")
        traceback.print_exc()
    torch.cuda.empty_cache()
    try:
        rows += [] if args.sms_sweep else low_latency_rows(args, ceiling, failures)
    except Exception as error:
        failures.append(f"low-latency mode: {describe(error)}")
        traceback.print_exc()
    table = to_markdown(rows, ceiling, device, bound)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    if args.kernels_tsv:
        write_kernel_times(args.kernels_tsv, rows, device)
    if failures:
        print(f"\nFAILED ({len(failures)}):", *failures, sep="\n  ")
        return 1
    print("\nall configurations agree with moe_comm.reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
