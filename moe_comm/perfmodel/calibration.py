"""Calibration and validation: fit each profile's constants to its "fit" cases only, and
measure the error on every other published number (published.py).

    python -m moe_comm.perfmodel validate          # the table of docs/PERFMODEL.md
    from moe_comm.perfmodel.calibration import fit, validation_summary
    fit("trtllm-onesided")                         # refit from the published numbers

The fit minimises the sum of squared log errors over the fit cases (Nelder-Mead over the free
constants scaled to their bounds, FREE below, from the stored values); an implementation's
validation error is the median and the largest |predicted / measured - 1| over its
validation cases.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from .implementations import IMPLEMENTATIONS, Implementation, get_implementation, with_algorithm
from .model import predict
from .published import CASES, Case

# Free constants per implementation: (mode or "*" for every mode, field, phase index or None
# for both phases / a scalar, lower bound, upper bound).
FREE = {
    "deepep-v1": (("*", "copy_efficiency", None, 0.3, 1.2), ("normal", "fixed_us", None, 0, 400),
                  ("low_latency", "fixed_us", None, 0, 200)),
    "deepep-v2": (("normal", "copy_efficiency", None, 0.3, 1.2),
                  ("normal", "fixed_us", None, 0, 400), ("normal", "nic_efficiency", None, 0.3, 1),
                  ("normal", "sm_copy_GBps", None, 20, 400)),
    "trtllm-onesided": (("normal", "copy_efficiency", None, 0.3, 1.2),
                        ("normal", "fixed_us", 0, 0, 60), ("normal", "fixed_us", 1, 0, 60),
                        ("normal", "overlap_us", 0, 0, 40), ("normal", "overlap_us", 1, 0, 40),
                        ("normal", "per_peer_us", None, 0, 0.5),
                        ("normal", "spread_penalty", None, 0, 0.5)),
    "nccl-ep": (("low_latency", "copy_efficiency", None, 0.3, 1.2),
                ("low_latency", "fixed_us", 0, 0, 200), ("low_latency", "fixed_us", 1, 0, 200),
                ("low_latency", "nic_efficiency", None, 0.3, 1.0)),
}


def cases_of(name: str, role: str | None = None) -> list[Case]:
    return [c for c in CASES if c.implementation == name and (role is None or c.role == role)]


def _predict(case: Case, impl: Implementation):
    return predict(case.system, case.mode, ep=case.ep, tokens_per_rank=case.tokens,
                   hidden=7168, topk=8, num_experts=case.num_experts,
                   dispatch_dtype=case.dispatch_dtype, combine_dtype=case.combine_dtype,
                   routing=case.routing, gpus_per_node=case.gpus_per_node,
                   num_sms=case.num_sms, implementation=impl)


def times(case: Case, impl: Implementation | str | None = None) -> tuple[float, float]:
    """(measured us, predicted us) of one case; GB/s become times with the model's logical
    bytes of the case's convention."""
    impl = get_implementation(impl or case.implementation)
    phase = getattr(_predict(case, impl), case.phase)
    measured = case.value if case.metric == "us" else \
        phase.bytes.logical_bytes / (case.value * 1e3)
    return measured, phase.time_us


def _get(impl: Implementation, mode: str, field: str, index):
    value = getattr(impl.modes[mode], field)
    return value[index if index is not None else 0] if isinstance(value, tuple) else value


def _set(impl: Implementation, mode: str, field: str, index, x: float) -> Implementation:
    for m in (impl.modes if mode == "*" else (mode,)):
        old = getattr(impl.modes[m], field)
        if isinstance(old, tuple):
            new = tuple(x if index is None or i == index else v for i, v in enumerate(old))
        else:
            new = x
        impl = with_algorithm(impl, m, **{field: new})
    return impl


def _loss(impl: Implementation, cases) -> float:
    return sum(math.log(p / m) ** 2 for m, p in (times(c, impl) for c in cases))


def _apply(impl: Implementation, free, u) -> Implementation:
    """`impl` with each FREE constant set from u in [0, 1] (mapped onto its bounds)."""
    for (mode, field, index, lo, hi), x in zip(free, u, strict=True):
        impl = _set(impl, mode, field, index, lo + (hi - lo) * min(max(x, 0.0), 1.0))
    return impl


def fit(name: str, iterations: int = 400) -> Implementation:
    """The profile `name` with its FREE constants fitted to its "fit" cases: Nelder-Mead on
    the constants scaled to [0, 1] by their bounds, from the stored values."""
    impl, cases, free = IMPLEMENTATIONS[name], cases_of(name, "fit"), FREE[name]
    m = next(iter(impl.modes))
    start = [(_get(impl, m if mode == "*" else mode, field, index) - lo) / (hi - lo)
             for mode, field, index, lo, hi in free]

    def loss(u):
        return _loss(_apply(impl, free, u), cases)
    n = len(start)
    simplex = [list(start)] + [[x + (0.1 if i == j else 0.0) for j, x in enumerate(start)]
                               for i in range(n)]
    values = [loss(u) for u in simplex]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centre = [sum(u[j] for u in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]

        def towards(t, worst=worst, centre=centre):
            return [c + t * (w - c) for c, w in zip(centre, worst, strict=True)]
        refl = towards(-1.0)
        f_refl = loss(refl)
        if f_refl < values[0]:
            exp = towards(-2.0)
            f_exp = loss(exp)
            simplex[-1], values[-1] = (exp, f_exp) if f_exp < f_refl else (refl, f_refl)
        elif f_refl < values[-2]:
            simplex[-1], values[-1] = refl, f_refl
        else:
            con = towards(0.5)
            f_con = loss(con)
            if f_con < values[-1]:
                simplex[-1], values[-1] = con, f_con
            else:   # shrink towards the best
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, u, strict=True)]
                                    for u in simplex[1:]]
                values = [values[0]] + [loss(u) for u in simplex[1:]]
        if max(values) - min(values) < 1e-10:
            break
    best = simplex[min(range(n + 1), key=values.__getitem__)]
    return _apply(impl, free, [min(max(x, 0.0), 1.0) for x in best])


def fitted_constants(impl: Implementation) -> dict:
    """{"mode.field[index]": value} of the FREE constants of `impl`."""
    out = {}
    for mode, field, index, _, _ in FREE[impl.name]:
        m = next(iter(impl.modes)) if mode == "*" else mode
        key = f"{mode}.{field}" + (f"[{index}]" if index is not None else "")
        out[key] = _get(impl, m, field, index)
    return out


@dataclass(frozen=True)
class Row:
    case: Case
    measured_us: float
    predicted_us: float

    @property
    def error(self) -> float:
        return self.predicted_us / self.measured_us - 1.0


def rows(name: str | None = None) -> list[Row]:
    return [Row(c, *times(c)) for c in CASES if name is None or c.implementation == name]


def validation_summary(name: str, computed: list[Row] | None = None
                       ) -> tuple[float, float, int]:
    """(median |error|, largest |error|, cases) over the validation cases of `name`
    (``computed``: its rows() when the caller has them already)."""
    computed = rows(name) if computed is None else computed
    errs = [abs(r.error) for r in computed if r.case.role == "validation"]
    return statistics.median(errs), max(errs), len(errs)


def table() -> str:
    """The markdown table of docs/PERFMODEL.md: every case, measured, predicted, error."""
    lines = ["| implementation | case | source | measured | predicted | error | role |",
             "|---|---|---|---|---|---|---|"]
    for r in rows():
        c = r.case
        shown = f"{c.value:g} GB/s = {r.measured_us:.1f} us" if c.metric == "GBps" else \
            f"{r.measured_us:.1f} us"
        lines.append(f"| {c.implementation} | {c.label} | {c.source} | {shown} | "
                     f"{r.predicted_us:.1f} us | {100 * r.error:+.1f}% | {c.role} |")
    return "\n".join(lines)


def report() -> str:
    """Per implementation: fitted constants and the validation error, as text."""
    out = []
    for name in FREE:
        computed = rows(name)
        med, worst, n = validation_summary(name, computed)
        fit_err = [abs(r.error) for r in computed if r.case.role == "fit"]
        out.append(f"{name}: {len(fit_err)} fit cases (largest error {100 * max(fit_err):.1f}%),"
                   f" {n} validation cases: median {100 * med:.1f}%, largest {100 * worst:.1f}%")
        out.append("    " + ", ".join(f"{k}={v:.4g}" for k, v in
                                      fitted_constants(IMPLEMENTATIONS[name]).items()))
    return "\n".join(out)
