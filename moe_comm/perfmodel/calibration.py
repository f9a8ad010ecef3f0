"""Calibration: the only measurements any model constant is fitted to.

Published numbers of the DeepEP V1 kernels on H800 (8 GPUs per node, NVLink ~160 GB/s per
direction, one 400 Gb/s ConnectX-7 per GPU), hidden 7168, top-8 of 256 experts, FP8 dispatch,
BF16 combine, uniform routing:

| mode        | EP | tokens/rank | dispatch     | combine      |
|-------------|----|-------------|--------------|--------------|
| normal      | 8  | 4096        | 153 GB/s     | 158 GB/s     |
| low_latency | 8  | 128         | 77 us        | 114 us       |

Three constants are fitted (model.ModelConstants): one NVLink copy efficiency shared by both
modes, and one fixed per-call cost per mode. Four numbers, three unknowns: the fit is
over-determined, so the residuals below are a genuine check of the model's shape.

    python -c "from moe_comm.perfmodel.calibration import fit_constants, report; \\
               print(report(fit_constants()))"
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .model import FITTED, ModelConstants, predict


@dataclass(frozen=True)
class CalibrationPoint:
    """One published number: `metric` is "GBps" (mode's convention) or "us"."""

    mode: str
    phase: str      # "dispatch" or "combine"
    metric: str     # "GBps" or "us"
    target: float
    workload: tuple  # (ep, tokens_per_rank)


_SHAPE: dict[str, Any] = {"system": "h800", "hidden": 7168, "topk": 8, "num_experts": 256,
          "dispatch_dtype": "fp8", "combine_dtype": "bf16", "routing": "uniform",
          "gpus_per_node": 8}

CALIBRATION_POINTS = (
    CalibrationPoint("normal", "dispatch", "GBps", 153.0, (8, 4096)),
    CalibrationPoint("normal", "combine", "GBps", 158.0, (8, 4096)),
    CalibrationPoint("low_latency", "dispatch", "us", 77.0, (8, 128)),
    CalibrationPoint("low_latency", "combine", "us", 114.0, (8, 128)),
)


def predicted(point: CalibrationPoint, constants: ModelConstants = FITTED) -> float:
    """The model's value of `point.metric` for the point's workload."""
    ep, T = point.workload
    p = predict(mode=point.mode, ep=ep, tokens_per_rank=T, constants=constants, **_SHAPE)
    phase = p.dispatch if point.phase == "dispatch" else p.combine
    return phase.GBps if point.metric == "GBps" else phase.time_us


def _target_time_and_rest(point: CalibrationPoint, efficiency: float):
    """(target time in us, model time without the fixed cost) for one point."""
    ep, T = point.workload
    zero = ModelConstants(efficiency, 0.0, 0.0)
    p = predict(mode=point.mode, ep=ep, tokens_per_rank=T, constants=zero, **_SHAPE)
    phase = p.dispatch if point.phase == "dispatch" else p.combine
    target_us = (phase.bytes.logical_bytes / (point.target * 1e3) if point.metric == "GBps"
                 else point.target)
    return target_us, phase.time_us


def _best_fixed(pairs) -> tuple:
    """Fixed cost F >= 0 minimising sum(log((F + rest) / target)^2), and that sum."""
    def loss(F):
        return sum(math.log((F + rest) / tgt) ** 2 for tgt, rest in pairs)
    lo, hi = 0.0, max(tgt for tgt, _ in pairs)
    for _ in range(100):   # the loss is unimodal in F: golden-section search
        a, b = lo + 0.382 * (hi - lo), lo + 0.618 * (hi - lo)
        lo, hi = (lo, b) if loss(a) <= loss(b) else (a, hi)
    F = 0.5 * (lo + hi)
    return F, loss(F)


def fit_constants(points=CALIBRATION_POINTS) -> ModelConstants:
    """Least squares in log time over all points: efficiency in (0, 1], fixed costs >= 0."""
    def solve(eff):
        by_mode = {}
        for pt in points:
            by_mode.setdefault(pt.mode, []).append(_target_time_and_rest(pt, eff))
        fixed = {mode: _best_fixed(pairs) for mode, pairs in by_mode.items()}
        return sum(loss for _, loss in fixed.values()), fixed
    lo, hi = 0.3, 1.0
    for _ in range(60):
        a, b = lo + 0.382 * (hi - lo), lo + 0.618 * (hi - lo)
        lo, hi = (lo, b) if solve(a)[0] <= solve(b)[0] else (a, hi)
    eff = 0.5 * (lo + hi)
    fixed = solve(eff)[1]
    return ModelConstants(nvlink_copy_efficiency=eff,
                          normal_fixed_us=fixed.get("normal", (0.0,))[0],
                          low_latency_fixed_us=fixed.get("low_latency", (0.0,))[0])


def report(constants: ModelConstants = FITTED) -> str:
    """The calibration table: target, prediction and error of every point, as text."""
    lines = [f"constants: {constants}",
             f"{'mode':<12} {'phase':<9} {'metric':<6} {'target':>8} {'model':>8} {'error':>7}"]
    for pt in CALIBRATION_POINTS:
        value = predicted(pt, constants)
        lines.append(f"{pt.mode:<12} {pt.phase:<9} {pt.metric:<6} {pt.target:>8.1f} "
                     f"{value:>8.1f} {100 * (value / pt.target - 1):>+6.1f}%")
    return "\n".join(lines)
