"""The co-design study: `python -m moe_comm.perfmodel study [--out DIR]` writes
DIR/CODESIGN.md and its plots in DIR/codesign/ (default DIR: docs).

Questions, for DeepSeek-V3 and a 1T-parameter MoE, EP from 8 to 16,384 GPUs: how long one
layer's dispatch + combine takes against the layer's expert compute; at which NIC bandwidth
and NVLink domain size communication hides behind compute with two-batch overlap; where the
hierarchical mode beats the flat one; what routing skew and link formats change. Every
number comes from `predict` (implementation "moe_comm" unless a table says otherwise).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

from .model import predict
from .systems import System, with_nic


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer: hidden size, routed experts, top-k, expert FFN width, shared experts."""

    name: str
    hidden: int
    experts: int
    topk: int
    expert_ffn: int
    shared: int
    moe_layers: int

    def expert_flops_per_token(self) -> float:
        """Routed + shared experts: three matmuls (gate, up, down) of hidden x expert_ffn."""
        return 2.0 * 3 * self.hidden * self.expert_ffn * (self.topk + self.shared)


MODELS = (
    MoEShape("DeepSeek-V3", hidden=7168, experts=256, topk=8, expert_ffn=2048, shared=1,
             moe_layers=58),
    # A 1T-parameter MoE of the Kimi-K2 shape: 384 experts x 60 MoE layers x 3 x 7168 x 2048
    # weights = 1.01e12 routed parameters.
    MoEShape("MoE-1T", hidden=7168, experts=384, topk=8, expert_ffn=2048, shared=1,
             moe_layers=60),
)

# Dense FP8 tensor throughput per GPU (datasheets; the NVL576 one is an assumption) and the
# share of it expert GEMMs reach (an assumption, stated in the document).
FP8_PFLOPS = {"h800": 1.979, "h100": 1.979, "h200": 1.979, "b200": 4.5, "gb200-nvl72": 5.0,
              "b300": 4.5, "gb300-nvl72": 5.0, "gb300-nvl72-2plane": 5.0, "nvl576": 10.0}
MFU = 0.5
TOKENS = 4096          # tokens per rank and layer (training / prefill micro-batch pair)
EPS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def experts_for(shape: MoEShape, ep: int) -> int:
    """Experts as laid out on `ep` ranks: padded to a multiple of ep with redundant replicas
    (EP beyond the expert count replicates experts; a token picks one replica)."""
    return math.ceil(shape.experts / ep) * ep


def compute_us(shape: MoEShape, system: str, tokens: int) -> float:
    """Expert compute of one layer for `tokens` tokens on one GPU, microseconds."""
    return shape.expert_flops_per_token() * tokens / (FP8_PFLOPS[system] * 1e15 * MFU) * 1e6


def comm_us(shape: MoEShape, system, ep: int, tokens: int, **kw) -> float:
    """Dispatch + combine of one layer (normal mode, FP8 dispatch, BF16 combine)."""
    args = dict(dispatch_dtype="fp8", combine_dtype="bf16")
    args.update(kw)
    p = predict(system, "normal", ep=ep, tokens_per_rank=tokens, hidden=shape.hidden,
                topk=shape.topk, num_experts=experts_for(shape, ep), **args)
    return p.dispatch_us + p.combine_us


def _domain(base: str, size: int, nic_Gbps: float) -> System:
    s = with_nic(base, nic_Gbps)
    return s.replace(name=f"{base}:{size}@{nic_Gbps:g}G", nvlink_domain_size=size)


# ----------------------------------------------------------------------------- the sections
def ep_scaling(out: list, fig) -> None:
    systems = ("h800", "b200", "gb200-nvl72", "gb300-nvl72", "nvl576")
    out.append("## 1. Dispatch + combine per layer against expert compute\n")
    out.append(f"{TOKENS} tokens per rank, normal mode (hierarchical across domains), FP8 "
               "dispatch, BF16 combine, uniform routing. Compute: routed + shared experts of "
               f"one layer at {int(MFU * 100)}% of dense FP8 peak. Ratio = communication / "
               "compute: below 1 it can hide behind compute.\n")
    data = {}
    for shape in MODELS:
        out.append(f"**{shape.name}** (hidden {shape.hidden}, {shape.experts} experts, top-"
                   f"{shape.topk}, expert FFN {shape.expert_ffn}, {shape.shared} shared)\n")
        out.append("| EP | " + " | ".join(f"{s} us (ratio)" for s in systems) + " |")
        out.append("|---" * (len(systems) + 1) + "|")
        for ep in EPS:
            cells = []
            for s in systems:
                c = comm_us(shape, s, ep, TOKENS)
                data.setdefault((shape.name, s), []).append(c)
                cells.append(f"{c:,.0f} ({c / compute_us(shape, s, TOKENS):.2f})")
            out.append(f"| {ep} | " + " | ".join(cells) + " |")
        out.append("")
        out.append("Expert compute per layer: " + ", ".join(
            f"{s} {compute_us(shape, s, TOKENS):,.0f} us" for s in systems) + ".\n")
    if fig is not None:
        f, axes = fig.plt.subplots(1, len(MODELS), figsize=(12, 4.5))
        for ax, shape in zip(axes, MODELS, strict=True):
            for i, s in enumerate(systems):
                ax.plot(EPS, data[(shape.name, s)], "-o", ms=3, color=f"C{i}", label=s)
                ax.axhline(compute_us(shape, s, TOKENS), color=f"C{i}", ls=":", lw=1)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("EP (GPUs)")
            ax.set_ylabel("dispatch + combine per layer (us)")
            ax.set_title(f"{shape.name}: dotted = expert compute")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.save(f, "ep_scaling")
    out.append("![EP scaling](codesign/ep_scaling.png)\n")


NICS = (200, 400, 800, 1600, 3200, 6400)
DOMAINS = (8, 16, 32, 72, 144, 288, 576)
HIDE_EPS = (256, 1024, 4096)


def hiding(out: list, fig) -> None:
    out.append("## 2. When communication hides behind compute (two-batch overlap)\n")
    out.append("Two micro-batches of "
               f"{TOKENS // 2} tokens per rank: the dispatch + combine of one runs while the "
               "other computes its experts, so communication hides when comm(T/2) <= "
               "compute(T/2). GPU: GB300-class (5 PF dense FP8 at "
               f"{int(MFU * 100)}%); NVLink 900 GB/s per direction; the domain size and the "
               "NIC line rate per GPU vary (message rate and host link scale with the NIC). "
               "Cells: the smallest NIC (Gb/s) that hides communication for the hardware's "
               "lower bound (any implementation) / for this package's profile; '-' if none "
               f"up to {NICS[-1]}. The map plots the bound's ratio at EP 1024.\n")
    half = TOKENS // 2
    grids = {}
    for shape in MODELS:
        comp = compute_us(shape, "gb300-nvl72", half)
        out.append(f"**{shape.name}** (compute per micro-batch and layer {comp:,.0f} us)\n")
        out.append("| EP \\ domain | " + " | ".join(str(d) for d in DOMAINS) + " |")
        out.append("|---" * (len(DOMAINS) + 1) + "|")
        for ep in HIDE_EPS:
            cells = []
            for d in DOMAINS:
                need = {}
                for impl in ("bound", "moe_comm"):
                    for nic in NICS:
                        r = comm_us(shape, _domain("gb300-nvl72", d, nic), ep, half,
                                    implementation=impl) / comp
                        grids[(shape.name, impl, ep, d, nic)] = r
                        if r <= 1 and impl not in need:
                            need[impl] = str(nic)
                cells.append(f"{need.get('bound', '-')} / {need.get('moe_comm', '-')}")
            out.append(f"| {ep} | " + " | ".join(cells) + " |")
        out.append("")
        p = predict(_domain("gb300-nvl72", 72, 1600), "normal", ep=1024, tokens_per_rank=half,
                    hidden=shape.hidden, topk=shape.topk, num_experts=experts_for(shape, 1024))
        out.append(f"What binds this package's profile at EP 1024, domain 72, 1600G: dispatch "
                   f"{p.dispatch_us:,.0f} us ({p.dispatch.bottleneck}), combine "
                   f"{p.combine_us:,.0f} us ({p.combine.bottleneck}), of which "
                   f"{p.dispatch.latency_us + p.combine.latency_us:,.0f} us fixed costs; "
                   "terms (us): " + ", ".join(
                       f"{k} {p.dispatch.terms_us[k]:,.0f}+{p.combine.terms_us[k]:,.0f}"
                       for k in p.dispatch.terms_us) + ".\n")
    if fig is not None:
        f, axes = fig.plt.subplots(1, len(MODELS), figsize=(12, 4.5))
        ep = 1024
        for ax, shape in zip(axes, MODELS, strict=True):
            z = [[grids[(shape.name, "bound", ep, d, n)] for d in DOMAINS] for n in NICS]
            im = ax.imshow(z, origin="lower", cmap="RdYlGn_r", vmin=0, vmax=3, aspect="auto")
            ax.set_xticks(range(len(DOMAINS)), [str(d) for d in DOMAINS])
            ax.set_yticks(range(len(NICS)), [str(n) for n in NICS])
            ax.set_xlabel("NVLink domain (GPUs)")
            ax.set_ylabel("NIC per GPU (Gb/s)")
            ax.set_title(f"{shape.name}, EP {ep}: bound comm / compute")
            for i, row in enumerate(z):
                for j, v in enumerate(row):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6)
            f.colorbar(im, ax=ax)
        fig.save(f, "hiding_map")
    out.append("![comm / compute by NIC and domain](codesign/hiding_map.png)\n")


def hier_vs_flat(out: list, fig) -> None:
    out.append("## 3. Hierarchical against flat across domains\n")
    out.append("Flat: one RDMA row per (token, destination rank); hierarchical: one per "
               "(token, destination domain), forwarded over NVLink. Cells: flat time / "
               f"hierarchical time for DeepSeek-V3, {TOKENS} tokens per rank (above 1: "
               "hierarchical wins).\n")
    setups = [(d, nic) for d in (8, 72) for nic in (400, 800, 1600)]
    eps = (16, 64, 256, 1024, 4096, 16384)
    shape = MODELS[0]
    out.append("| domain, NIC | " + " | ".join(f"EP {e}" for e in eps) + " |")
    out.append("|---" * (len(eps) + 1) + "|")
    series = {}
    for d, nic in setups:
        sysm = _domain("gb300-nvl72", d, nic)
        cells = []
        for ep in eps:
            if ep <= d:
                cells.append("one domain")
                continue
            flat = comm_us(shape, sysm, ep, TOKENS, hierarchical=False)
            hier = comm_us(shape, sysm, ep, TOKENS, hierarchical=True)
            series.setdefault((d, nic), []).append((ep, flat / hier))
            cells.append(f"{flat / hier:.2f}")
        out.append(f"| {d}, {nic}G | " + " | ".join(cells) + " |")
    out.append("")
    if fig is not None:
        fig.lines("hier_vs_flat", {f"domain {d}, {nic}G": pts for (d, nic), pts in series.items()},
                  "EP (GPUs)", "flat / hierarchical time", logx=True, hline=1.0)
    out.append("![flat over hierarchical](codesign/hier_vs_flat.png)\n")


def skew(out: list, fig) -> None:
    out.append("## 4. Routing skew\n")
    alphas = (0.0, 0.5, 1.0, 1.5)
    eps = (64, 256, 1024)
    shape = MODELS[0]
    out.append("Expert popularity ~ 1/rank^alpha over a seeded random placement (zipf), "
               "DeepSeek-V3 on GB200 NVL72, normal mode. Cells: dispatch + combine relative "
               "to uniform routing (the slowest rank sets the time).\n")
    out.append("| EP | " + " | ".join(f"alpha {a:g}" for a in alphas) + " |")
    out.append("|---" * (len(alphas) + 1) + "|")
    rows = {}
    for ep in eps:
        base = comm_us(shape, "gb200-nvl72", ep, TOKENS)
        vals = [comm_us(shape, "gb200-nvl72", ep, TOKENS, routing=f"zipf:{a:g}") / base
                if a else 1.0 for a in alphas]
        rows[ep] = vals
        out.append(f"| {ep} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    out.append("")
    if fig is not None:
        fig.lines("skew", {f"EP {ep}": list(zip(alphas, vals, strict=True))
                           for ep, vals in rows.items()}, "zipf alpha", "time / uniform")
    out.append("![skew](codesign/skew.png)\n")


def formats(out: list, fig) -> None:
    out.append("## 5. Formats on the link\n")
    shape = MODELS[0]
    dtypes = ("bf16", "fp8", "mxfp8", "nvfp4")
    eps = (8, 64, 512, 4096)
    out.append("Dispatch time by payload format (combine BF16, then FP8), DeepSeek-V3 on "
               f"GB300 NVL72, {TOKENS} tokens per rank, normal mode, microseconds.\n")
    out.append("| EP | " + " | ".join(f"dispatch {d}" for d in dtypes)
               + " | combine bf16 | combine fp8 |")
    out.append("|---" * (len(dtypes) + 3) + "|")
    series = {d: [] for d in dtypes}
    for ep in eps:
        cells = []
        for d in dtypes:
            p = predict("gb300-nvl72", "normal", ep=ep, tokens_per_rank=TOKENS,
                        hidden=shape.hidden, topk=shape.topk,
                        num_experts=experts_for(shape, ep), dispatch_dtype=d)
            series[d].append(p.dispatch_us)
            cells.append(f"{p.dispatch_us:,.0f}")
        for c in ("bf16", "fp8"):
            p = predict("gb300-nvl72", "normal", ep=ep, tokens_per_rank=TOKENS,
                        hidden=shape.hidden, topk=shape.topk,
                        num_experts=experts_for(shape, ep), combine_dtype=c)
            cells.append(f"{p.combine_us:,.0f}")
        out.append(f"| {ep} | " + " | ".join(cells) + " |")
    out.append("")
    if fig is not None:
        fig.lines("formats", {d: list(zip(eps, series[d], strict=True)) for d in dtypes},
                  "EP (GPUs)", "dispatch (us)", logx=True, logy=True)
    out.append("![formats](codesign/formats.png)\n")


HEADER = """# Co-design study: EP communication from 8 to 16,384 GPUs

Generated by `python -m moe_comm.perfmodel study` (moe_comm.perfmodel.study); do not edit by
hand, rerun the command. Model: docs/PERFMODEL.md. Implementation profile "moe_comm": its
bytes are exact (checked against the kernels); its normal mode runs on 20 SMs (the Buffer's
default) at a per-SM copy rate and with a routing-layout cost measured on one H200 with
virtual ranks (2026-12-04, docs/PERFMODEL.md section 6); its fixed costs and NVLink copy
efficiency are DeepEP V1's fitted ones (virtual ranks on one GPU cannot measure them), so read
the small-batch rows as DeepEP-like. Systems: the presets of moe_comm.perfmodel.systems (GB300
NVL72: 800 Gb/s ConnectX-8 per GPU; NVL576: roadmap assumptions). EP beyond the expert count
replicates experts (the count is padded to a multiple of EP); power-of-two EP on a 72-GPU
domain uses 64 GPUs of it. The two shapes share hidden size, top-k and expert width, so once
experts are replicated (EP above 256 and 384) their per-layer traffic and compute are the
same; they differ below.
"""


class _Figures:
    """Writes the study's PNGs into one folder (matplotlib's Agg backend)."""

    def __init__(self, outdir: str):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        self.plt, self.outdir = plt, outdir

    def save(self, f, name: str) -> None:
        f.tight_layout()
        f.savefig(os.path.join(self.outdir, f"{name}.png"), dpi=100)
        self.plt.close(f)

    def lines(self, name: str, series: dict, xlabel: str, ylabel: str, *, logx: bool = False,
              logy: bool = False, hline: float | None = None) -> None:
        """One axes, one line per entry of series {label: [(x, y), ...]}."""
        f, ax = self.plt.subplots(figsize=(7, 4.5))
        for i, (label, pts) in enumerate(series.items()):
            ax.plot([x for x, _ in pts], [y for _, y in pts], "-o", ms=3, color=f"C{i}",
                    label=label)
        if hline is not None:
            ax.axhline(hline, color="k", lw=0.8)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        self.save(f, name)


def run(outdir: str, plots: bool = True) -> str:
    """Writes outdir/CODESIGN.md (and outdir/codesign/*.png); returns the markdown path."""
    figdir = os.path.join(outdir, "codesign")
    os.makedirs(figdir, exist_ok=True)
    fig = _Figures(figdir) if plots else None
    out = [HEADER]
    for section in (ep_scaling, hiding, hier_vs_flat, skew, formats):
        section(out, fig)
    path = os.path.join(outdir, "CODESIGN.md")
    with open(path, "w") as fh:
        fh.write("\n".join(out).rstrip() + "\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_comm.perfmodel study",
                                 description="Regenerate the co-design study and its plots.")
    ap.add_argument("--out", default="docs", help="folder of CODESIGN.md (plots in codesign/)")
    ap.add_argument("--no-plots", action="store_true", help="tables only (no matplotlib)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    try:
        path = run(args.out, plots=not args.no_plots)
    except ImportError:
        print("error: the plots need matplotlib (pip install matplotlib), or pass --no-plots",
              file=sys.stderr)
        return 2
    print(f"wrote {path} in {time.perf_counter() - start:.1f} s")
    return 0


__all__ = ["MODELS", "MoEShape", "compute_us", "comm_us", "experts_for", "main", "run"]
