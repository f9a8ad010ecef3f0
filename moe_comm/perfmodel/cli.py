"""Command line: one table of predictions, one row per (system, implementation, mode, ep);
optional plot. Two more commands: `validate` (the published cases, measured against
predicted) and `study` (regenerates docs/CODESIGN.md and its plots).

    python -m moe_comm.perfmodel --system h800 b200 --mode low_latency --ep 8 16 32 64 \\
        --tokens 128 --hidden 7168 --topk 8 --experts 256 --plot ll.png
    python -m moe_comm.perfmodel --implementation moe_comm trtllm-onesided bound \\
        --system gb200-nvl72 --ep 8 64 --tokens 16 --dispatch-dtype bf16
    python -m moe_comm.perfmodel validate
    python -m moe_comm.perfmodel study --out docs

Bytes columns are per rank in MB (1e6 bytes): logical (the mode's bandwidth convention),
the minimum that must leave a rank, and NVLink / RDMA bytes of the busiest rank, of the
dispatch; combine_nvlink_MB: the combine's NVLink bytes of the busiest rank (``--ep-invariant``
sends one combine row per (token, choice) pair, so it grows there; across nodes it runs flat,
where the combine's network rows are pairs too).
"""
from __future__ import annotations

import argparse
import sys

from .formats import COMBINE_DTYPES, DTYPES
from .implementations import IMPLEMENTATIONS
from .model import predict
from .systems import SYSTEMS
from .workload import MODES, Prediction

COLUMNS = (  # header, width-free formatter
    ("system", lambda p: p.system),
    ("implementation", lambda p: p.implementation),
    ("mode", lambda p: p.mode),
    ("ep", lambda p: str(p.ep)),
    ("nodes", lambda p: str(p.nodes)),
    ("tokens", lambda p: str(p.tokens_per_rank)),
    ("dispatch_us", lambda p: f"{p.dispatch_us:.1f}"),
    ("dispatch_GBps", lambda p: f"{p.dispatch_GBps:.1f}"),
    ("dispatch_bound", lambda p: p.dispatch.bottleneck),
    ("combine_us", lambda p: f"{p.combine_us:.1f}"),
    ("combine_GBps", lambda p: f"{p.combine_GBps:.1f}"),
    ("combine_bound", lambda p: p.combine.bottleneck),
    ("logical_MB", lambda p: f"{p.dispatch.bytes.logical_bytes / 1e6:.2f}"),
    ("min_link_MB", lambda p: f"{p.dispatch.bytes.min_link_bytes / 1e6:.2f}"),
    ("nvlink_MB", lambda p: f"{p.dispatch.bytes.nvlink_bytes / 1e6:.2f}"),
    ("rdma_MB", lambda p: f"{p.dispatch.bytes.rdma_bytes / 1e6:.2f}"),
    ("combine_nvlink_MB", lambda p: f"{p.combine.bytes.nvlink_bytes / 1e6:.2f}"),
    ("ranks/token", lambda p: f"{p.ranks_per_token:.2f}"),
)
_LEFT = {"system", "implementation", "mode", "dispatch_bound", "combine_bound"}


def format_table(preds: list[Prediction]) -> str:
    """Aligned text table of predictions (columns in COLUMNS)."""
    cells = [[h for h, _ in COLUMNS]] + [[f(p) for _, f in COLUMNS] for p in preds]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = []
    for row in cells:
        parts = [c.ljust(w) if h in _LEFT else c.rjust(w)
                 for c, w, (h, _) in zip(row, widths, COLUMNS, strict=True)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def plot_series(preds: list[Prediction]) -> dict[str, list[Prediction]]:
    """The plot's lines: label -> predictions by EP size, one line per (system, implementation,
    mode). The label names the system and the implementation, and the mode where the
    predictions have more than one."""
    series: dict = {}
    for p in preds:
        series.setdefault((p.system, p.implementation, p.mode), []).append(p)
    modes = {mode for _, _, mode in series}
    return {f"{system} {implementation}" + (f" {mode}" if len(modes) > 1 else ""):
            sorted(ps, key=lambda p: p.ep)
            for (system, implementation, mode), ps in series.items()}


def plot(preds: list[Prediction], path: str) -> None:
    """Time and bandwidth against EP size, one line per :func:`plot_series` entry; dispatch
    solid, combine dashed. Writes a PNG with matplotlib's Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (label, ps) in enumerate(plot_series(preds).items()):
        eps = [p.ep for p in ps]
        color = f"C{i % 10}"
        for ax, get in ((ax_t, lambda p, ph: getattr(p, ph).time_us),
                        (ax_b, lambda p, ph: getattr(p, ph).GBps)):
            ax.plot(eps, [get(p, "dispatch") for p in ps], "-o", color=color, ms=3,
                    label=f"{label} dispatch")
            ax.plot(eps, [get(p, "combine") for p in ps], "--s", color=color, ms=3,
                    label=f"{label} combine")
    first = preds[0]
    for ax, ylabel in ((ax_t, "time per call (us)"), (ax_b, "bandwidth (GB/s, mode convention)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("EP size (ranks)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_yscale("log")
    ax_b.legend(fontsize=7)
    fig.suptitle(f"{first.tokens_per_rank} tokens/rank, hidden {first.hidden}, top-{first.topk}, "
                 f"{first.dispatch_dtype} dispatch / {first.combine_dtype} combine, "
                 f"{first.routing} routing")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m moe_comm.perfmodel",
                                 description="Predict EP dispatch/combine time on real systems.")
    ap.add_argument("--system", nargs="+", default=["h800"],
                    help=f"preset names: {', '.join(SYSTEMS)}")
    ap.add_argument("--mode", nargs="+", default=["normal"], choices=MODES)
    ap.add_argument("--implementation", nargs="+", default=["moe_comm"],
                    choices=tuple(IMPLEMENTATIONS) + ("bound",),
                    help="implementation profiles, or 'bound' for the hardware's lower bound")
    ap.add_argument("--hierarchical", choices=("yes", "no"), default=None,
                    help="normal mode across nodes: hierarchical or flat (default: the "
                         "implementation's)")
    ap.add_argument("--ep", nargs="+", type=int, required=True, help="EP sizes (ranks)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens per rank (default 4096 normal, 128 low_latency)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    experts = ap.add_mutually_exclusive_group()
    experts.add_argument("--experts", type=int, default=None, help="total experts (default 256)")
    experts.add_argument("--experts-per-rank", type=int, default=None,
                         help="experts per rank, so that E = this x ep for every EP size")
    ap.add_argument("--dispatch-dtype", default="fp8", choices=DTYPES)
    ap.add_argument("--combine-dtype", default="bf16", choices=COMBINE_DTYPES)
    ap.add_argument("--routing", default="uniform",
                    help='"uniform", "zipf:<alpha>" or "group_limited:<groups>:<topk_groups>"')
    ap.add_argument("--gpus-per-node", type=int, default=None,
                    help="GPUs per NVLink domain used (default: fits the system)")
    ap.add_argument("--num-sms", type=int, default=None)
    ap.add_argument("--ep-invariant", action="store_true",
                    help="EP-invariant combine: one row per (token, choice) pair home, summed "
                         "there in choice order (normal mode: one node or flat across nodes, "
                         "the Buffer's dtype)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", metavar="FILE.png", default=None,
                    help="also draw time and bandwidth against EP size")
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["study"]:
        from .study import main as study_main
        return study_main(argv[1:])
    if argv[:1] == ["validate"]:
        from .calibration import report, table
        print(table())
        print()
        print(report())
        return 0
    args = build_parser().parse_args(argv)
    hier = None if args.hierarchical is None else args.hierarchical == "yes"
    preds = []
    try:
        for system in args.system:
            for impl in args.implementation:
                for mode in args.mode:
                    tokens = args.tokens or (4096 if mode == "normal" else 128)
                    for ep in args.ep:
                        experts = (args.experts_per_rank * ep if args.experts_per_rank
                                   else args.experts or 256)
                        preds.append(predict(
                            system, mode, ep=ep, tokens_per_rank=tokens, hidden=args.hidden,
                            topk=args.topk, num_experts=experts,
                            dispatch_dtype=args.dispatch_dtype,
                            combine_dtype=args.combine_dtype, routing=args.routing,
                            gpus_per_node=args.gpus_per_node, num_sms=args.num_sms,
                            seed=args.seed, implementation=impl, hierarchical=hier,
                            ep_invariant=args.ep_invariant))
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(preds))
    for note in dict.fromkeys(n for p in preds for n in p.notes):
        print(f"note: {note}", file=sys.stderr)
    if args.plot:
        try:
            plot(preds, args.plot)
        except ImportError:
            print("error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
    return 0
