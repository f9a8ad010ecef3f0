"""Fits the static gate's two constants to kernels measured on a GPU, and checks them.

    python bench/fit_model.py --fit KERNELS.tsv PATHS.tsv [--check KERNELS.tsv PATHS.tsv ...]

``KERNELS.tsv``: what ``bench/gpu_bench.py --kernels-tsv`` writes (each op's kernels, device us
per call over all ranks, launches per call). ``PATHS.tsv``: what ``python -m moe_comm.testing.gate``
writes beside its table (``gpu_gate_paths.tsv``: every variant's busiest program, per config:
dependent steps, bytes, grid, registers), of the same commit. Each measured kernel is matched
to its variant (``OPS``), measured per launch and rank (device time over launches), and the
model of ``moe_comm.kernels.critical_path``::

    predicted_us = max(waves * steps * LATENCY_US, MB * programs / min(programs, SMs) / SM_GBPS)

is fitted: the one latency and per-SM throughput whose worst relative error over the kernels
is least (a grid search; of those within half a percent of it, the least squared log error).
``--check`` prints other runs' kernels against the fitted constants.
Prints markdown tables (measured, predicted, error): the fitted run against the fitted
constants and against the gate's own (what the gate predicted before the run), then each check.
"""
from __future__ import annotations

import argparse
import csv
import math
import re
import sys

from moe_comm.kernels import critical_path

# gpu_bench's ops (a pattern of their names) -> (the gate's config, {kernel: the flags its
# variant holds}) for the bf16 variants of one node
OPS = (
    (r"^normal EP8 T=4096 bf16 dispatch \(triton\)$", "dsv3-prefill", {
        "layout_count_kernel": "FT=0", "layout_place_kernel": "",
        "dispatch_send_kernel": "HAS_WEIGHTS=1 FP8=0 TRANSPORT=0",
        "received_layout_kernel": "WAIT=1 LIVE=0 FT=0 TRANSPORT=0",
        "dispatch_expand_kernel": "CACHED=0 HAS_WEIGHTS=1 FP8=0 LIVE=0",
        "routing_layout_kernel": "", "wait_epochs_kernel": ""}),
    (r"^normal EP8 T=4096 fp8 dispatch \(triton\)$", "dsv3-prefill", {
        "dispatch_send_kernel": "HAS_WEIGHTS=1 FP8=1 UE8M0=0 TRANSPORT=0",
        "dispatch_expand_kernel": "CACHED=0 HAS_WEIGHTS=1 FP8=1 UE8M0=0 LIVE=0"}),
    (r"^normal EP8 T=4096 bf16 combine \(triton\)$", "dsv3-prefill", {
        "combine_send_kernel": "HAS_WEIGHTS=1 HAS_PAIR=0 FP8=0 TRANSPORT=0",
        "wait_epochs_kernel": "", "combine_reduce_kernel": "HAS_PAIR=0 FP8=0"}),
    (r"^low-latency EP8 T=128 fp8 dispatch \(triton\)$", "dsv3-decode", {
        "ll_dispatch_send_kernel": "FP8=1 UE8M0=0 TRANSPORT=0",
        "ll_dispatch_recv_kernel": "FP8=1 UE8M0=0 TRANSPORT=0"}),
    (r"^low-latency EP8 T=128 bf16 combine \(triton\)$", "dsv3-decode", {
        "ll_combine_send_kernel": "TRANSPORT=0 ZERO_COPY=0 FP8=0",
        "ll_combine_recv_kernel": "HAS_WEIGHTS=1 TRANSPORT=0 FP8=0"}),
)


def read_tsv(path: str) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader((line for line in f if not line.startswith("#")),
                                   delimiter="\t"))


def holds(variant: str, flags: list[str]) -> bool:
    """Whether a variant's text holds each ``NAME=VALUE`` of ``flags``; a flag the variant's
    kernel does not have (an older kernel's) holds where it is off (``=0``)."""
    have = dict(f.split("=", 1) for f in variant.split() if "=" in f)
    return all(have.get(name, "0") == value for name, value in (f.split("=", 1)
                                                               for f in flags))


def matched(kernels_tsv: str, paths_tsv: str) -> list[dict]:
    """Each measured kernel of an op of :data:`OPS` with its variant's path: ``op, kernel,
    measured_us`` (per launch and rank), ``steps, mbytes, programs, regs, num_warps,
    smem_bytes``; kernels without a path (torch's own) are left out."""
    paths = [p for p in read_tsv(paths_tsv) if p["arch"] == "90"
             and p["variant"].startswith("bfloat16")]
    out = []
    for row in read_tsv(kernels_tsv):
        for pattern, config, kernels in OPS:
            if not re.match(pattern, row["op"]) or row["kernel"] not in kernels:
                continue
            want = kernels[row["kernel"]].split()
            found = [p for p in paths if p["kernel"] == row["kernel"] and p["config"] == config
                     and holds(p["variant"], want)]
            if not found:
                continue
            p = max(found, key=lambda p: float(p["steps"]))
            out.append(dict(op=row["op"], kernel=row["kernel"],
                            measured_us=float(row["device_us_per_call"])
                            / float(row["launches_per_call"]),
                            steps=float(p["steps"]), mbytes=float(p["mbytes"]),
                            programs=int(p["programs"]), regs=int(p["regs"]),
                            num_warps=int(p["num_warps"]), smem_bytes=int(p["smem_bytes"])))
    return out


def predicted(k: dict, latency_us: float, sm_gbps: float) -> float:
    """``kernels.critical_path.predicted_us`` with these constants."""
    resident = critical_path.resident_programs(k["regs"], k["num_warps"], k["smem_bytes"])
    waves = math.ceil(k["programs"] / (critical_path.GPU_SMS * resident))
    return max(waves * k["steps"] * latency_us,
               k["mbytes"] * 1e6 * k["programs"]
               / (min(k["programs"], critical_path.GPU_SMS) * sm_gbps * 1e3))


def fit(kernels: list[dict]) -> tuple[float, float, float]:
    """``(latency_us, sm_gbps, worst relative error)`` minimising the worst error; of the
    constants within half a percent of that least worst error (where the worst kernel is one
    that neither constant moves, many fit as well), those with the least squared log error
    over all the kernels, so the fit does not depend on the order of the search."""
    scored = []
    for latency in (x / 100 for x in range(10, 201)):
        for gbps in range(10, 301):
            ratios = [predicted(k, latency, gbps) / k["measured_us"] for k in kernels]
            scored.append((max(abs(r - 1) for r in ratios),
                           sum(math.log(r) ** 2 for r in ratios), latency, float(gbps)))
    least = min(s[0] for s in scored)
    worst, _, latency, gbps = min((s for s in scored if s[0] <= least + 0.005),
                                  key=lambda s: s[1])
    return latency, gbps, worst


def table(kernels: list[dict], latency_us: float, sm_gbps: float, title: str) -> str:
    lines = [title, "", "| op | kernel | measured us | steps | MB | predicted us | error |",
             "|---|---|---|---|---|---|---|"]
    for k in kernels:
        p = predicted(k, latency_us, sm_gbps)
        lines.append(f"| {k['op']} | {k['kernel']} | {k['measured_us']:.1f} | {k['steps']:g} | "
                     f"{k['mbytes']:.2f} | {p:.1f} | {p / k['measured_us'] - 1:+.0%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", nargs=2, metavar=("KERNELS", "PATHS"), required=True)
    parser.add_argument("--check", nargs=2, metavar=("KERNELS", "PATHS"), action="append",
                        default=[])
    args = parser.parse_args(argv)
    kernels = matched(*args.fit)
    if not kernels:
        print("no measured kernel matches a variant of the paths", file=sys.stderr)
        return 1
    latency, gbps, worst = fit(kernels)
    print(f"fitted: LATENCY_US = {latency:.2f}, SM_GBPS = {gbps:g} (worst error {worst:.0%} "
          f"over {len(kernels)} kernels); kernels.critical_path has {critical_path.LATENCY_US} "
          f"and {critical_path.SM_GBPS:g}\n")
    print(table(kernels, latency, gbps, f"fitted to {args.fit[0]}"))
    print()
    print(table(kernels, critical_path.LATENCY_US, critical_path.SM_GBPS,
                f"{args.fit[0]} against the gate's constants (its predictions, unfitted)"))
    for check in args.check:
        print()
        print(table(matched(*check), latency, gbps, f"checked: {check[0]}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
