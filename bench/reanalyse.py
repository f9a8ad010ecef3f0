#!/usr/bin/env python3
"""Regenerates a measured commit's gate paths (bench/measured/gate-paths-<commit>.tsv).

    python3 bench/reanalyse.py --commit {320afca,f243e99} [--workdir DIR] [--out TSV]
        [--analyser DIR] [--live KERNEL:FILE:LINE=SHARE ...] [--compare TSV] [--refresh]
        [--verbose]

The kernels a GPU run timed are those of the commit it ran (``COMMITS``: 320afca for the H200
run of 2026-12-04, f243e99 for that of 2026-12-01). This script rebuilds the commit's row of
each timed kernel variant as its TSV has it: the commit's own gate drivers (bf16, one node,
DeepSeek-V3 prefill and decode sizes, the normal dispatch sized by ``max_recv_rows`` as
bench/gpu_bench.py sized it) record the launches, the variants are compiled for sm_90 under
Triton 3.6, and each variant's TTGIR is walked by a ``critical_path.py`` (by default this
tree's, ``kernels/``), so the commit's kernels can be read by a later analyser.

Three stages; the first two run once per commit and are cached under ``--workdir``, so a run
with other ``--live`` options or another ``--analyser`` takes seconds:

1. record: a worker process under ``--python`` (Triton 3.6) imports ``moe_comm`` and
   ``moe_comm.kernels`` from a checkout of the commit (``<workdir>/src``, cloned from this
   repository when missing) and runs its drivers with Triton's launches recorded, not run. A
   row takes the specialisations recorded with its kernel, config and flags in recording
   order: the n-th row of the same text takes the n-th (the last where fewer; the others are
   walked too, ``--verbose`` compares them), and of that specialisation the launch with the
   most serial trips by the commit's ``kernels.tiles.schedule_facts`` (the first launch where
   the commit has none);
2. compile: the same worker, one variant at a time (``TRITON_CACHE_DIR`` under the workdir,
   ``nice -n 10``): the TTGIR, and the registers and shared memory cuobjdump reads;
3. analyse (this process): ``critical_path.analyse(ttgir, scalars, grid, hints, row_lines,
   live_lines)`` and ``predicted_us(path, programs, regs, num_warps, smem_bytes)``; hints are
   the commit's trips of the loops bounded by data at uniform routing (its TSV's header).

Row and live lines are read from the commit's ``kernels/`` by this tree's
``kernels.compiled.marked_lines``: every line of a call marked ``# gate: row`` (row stores),
``# gate: live`` (gathers the routing masks) or ``# gate: <tag> live`` (stores the routing
masks, also live lines).
``KERNEL:FILE:LINE=SHARE`` adds the lines of the call starting at FILE:LINE to the kernel's
live lines and sets its hint ``critical_path.LIVE`` to SHARE (one share a kernel): each
commit's own (``Commit.live``: the old kernels' stores and gathers that this tree's gate marks
``live``), then those of ``--live``.

The TSV's header is the commit's TSV's, followed by a line naming the analyser and the live
shares. ``--compare`` (by default the committed TSV) prints every column that
differs, row by row.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import inspect
import json
import math
import os
import pickle
import re
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
ARCH = 90
# config -> low-latency mode: what the rows were recorded with
CONFIG_MODES = {"dsv3-prefill": False, "dsv3-decode": True}
# constexprs the gate leaves out of a variant's text (tiles and derived sizes)
HIDDEN_FLAGS = ("NUM_THREADS", "KMAX", "META_STRIDE")


@dataclass(frozen=True)
class Commit:
    """A measured commit: its TSV's rows ``(kernel, config, variant text)`` in order, the trips
    of its loops bounded by data (kernel -> loop -> trips: a number or an expression in the
    launch's scalars and constexprs, ``g0 g1 g2`` (grid) and ``programs``; a loop is named by
    its induction variable or ``file:line``), the rows its normal dispatch was sized for, and
    the module of its gate drivers; ``live``: ``KERNEL:FILE:LINE=SHARE`` of each row store
    and gather whose lanes the routing masks, where the gate of this tree marks the same
    store or gather ``live`` (:data:`REACHES`, :data:`CHOICE`), so that the commit's kernels
    are counted as the gate counts this tree's."""

    rows: tuple
    hints: dict
    max_recv_rows: int
    live: tuple = ()  # the commit's masked row stores and gathers, as --live gives them
    gate_module: str = "moe_comm.gate"


# Live shares at uniform routing, DeepSeek-V3 (8 ranks, 256 experts, top-8; kernels.tiles):
REACHES = 0.6618315  # a token reaches a given rank (reaches_rank): a send's store into it
CHOICE = 0.1888698  # a received token's choices there, 1.511 (slot_rows_mean), over 8
_DISPATCH_BF16 = "SEND_META=1 HAS_WEIGHTS=1 FP8=0 UE8M0=0"
_DISPATCH_FP8 = "SEND_META=1 HAS_WEIGHTS=1 FP8=1 UE8M0=0"
COMMITS = {
    "320afca": Commit(
        rows=(
            ("layout_count_kernel", "dsv3-prefill", "bfloat16 FT=0 CHUNK=16"),
            ("layout_place_kernel", "dsv3-prefill", "bfloat16 CHUNK=16"),
            ("dispatch_send_kernel", "dsv3-prefill",
             f"bfloat16 {_DISPATCH_BF16} GS=128 TRANSPORT=0 ALIGN=16 EVEN_H=1"),
            ("received_layout_kernel", "dsv3-prefill", "bfloat16 WAIT=1 LIVE=0 FT=0 TRANSPORT=0"),
            ("dispatch_expand_kernel", "dsv3-prefill",
             "bfloat16 CACHED=0 HAS_WEIGHTS=1 FP8=0 UE8M0=0 GLOBAL=0 LIVE=0 EVEN_H=1"),
            ("combine_send_kernel", "dsv3-prefill",
             "bfloat16 HAS_WEIGHTS=1 HAS_PAIR=0 ACC_FP64=0 FP8=0 TRANSPORT=0 HIER=0 ALIGN=16 "
             "EVEN_H=1 IN_FLIGHT=4"),
            ("wait_epochs_kernel", "dsv3-prefill", "bfloat16 "),
            ("combine_reduce_kernel", "dsv3-prefill",
             "bfloat16 HAS_PAIR=0 ACC_FP64=0 EVEN_H=1 HIER=0 LIVE=0 FP8=0"),
            ("dispatch_send_kernel", "dsv3-prefill",
             f"bfloat16 {_DISPATCH_FP8} GS=128 TRANSPORT=0 ALIGN=16 EVEN_H=1"),
            ("dispatch_expand_kernel", "dsv3-prefill",
             "bfloat16 CACHED=0 HAS_WEIGHTS=1 FP8=1 UE8M0=0 GLOBAL=0 LIVE=0 EVEN_H=1"),
            ("ll_dispatch_send_kernel", "dsv3-decode",
             "bfloat16 FP8=1 UE8M0=0 GS=128 FT=0 TRANSPORT=0 DEVICE_WAIT=1 EVEN_H=1"),
            ("ll_dispatch_recv_kernel", "dsv3-decode",
             "bfloat16 FP8=1 UE8M0=0 GLOBAL=0 HAS_STATS=0 TRANSPORT=0 DEVICE_WAIT=1 FT=0 "
             "EVEN_H=1"),
            ("ll_combine_send_kernel", "dsv3-decode",
             "bfloat16 TRANSPORT=0 DEVICE_WAIT=1 FT=0 ZERO_COPY=0 FP8=0 ALIGN=16 EVEN_H=1"),
            ("ll_combine_recv_kernel", "dsv3-decode",
             "bfloat16 HAS_WEIGHTS=1 TRANSPORT=0 DEVICE_WAIT=1 FT=0 FP8=0 EVEN_H=1"),
        ),
        hints={
            "combine_send_kernel": {"w": "math.ceil(8*TMAX*(1-(7/8)**8)/BLOCK_T/programs)",
                                    "c0": 1.09},
            "dispatch_expand_kernel": {
                "j0": "math.ceil(TMAX*(1-(1-1/g0)**K)/(BLOCK_T*g1))",
                "dispatch.py:356": 0,
                "dispatch.py:361": "math.ceil((max_rows-TMAX*K)/(BLOCK_Z*g0*g1))",
                "dispatch.py:367":
                    "math.ceil((SLOTS-g0*TMAX*(1-(1-1/g0)**K))/(BLOCK_Z*g0*g1))"},
            "ll_dispatch_recv_kernel": {"j0": 1},
            "ll_combine_send_kernel": {"j0": 1},
        },
        max_recv_rows=33280,
        # the send's store into each destination, the expand's store of each choice, the
        # combine send's gathers: 4 rows of a slot in a pass, 1.09 passes (its hint c0)
        live=(f"dispatch_send_kernel:dispatch.py:149={REACHES}",
              f"dispatch_expand_kernel:dispatch.py:330={CHOICE}",
              f"combine_send_kernel:combine.py:134={CHOICE * 8 / (4 * 1.09):.7f}")),
    "f243e99": Commit(
        rows=(
            ("routing_layout_kernel", "dsv3-prefill", "bfloat16 "),
            ("dispatch_send_kernel", "dsv3-prefill",
             f"bfloat16 {_DISPATCH_BF16} TRANSPORT=0 ALIGN=16 EVEN_H=1"),
            ("wait_epochs_kernel", "dsv3-prefill", "bfloat16 "),  # the dispatch's
            ("dispatch_expand_kernel", "dsv3-prefill",
             "bfloat16 CACHED=0 HAS_WEIGHTS=1 FP8=0 UE8M0=0 EVEN_H=1"),
            ("combine_send_kernel", "dsv3-prefill",
             "bfloat16 HAS_WEIGHTS=1 HAS_PAIR=0 ACC_FP64=0 TRANSPORT=0 HIER=0 ALIGN=16 "
             "EVEN_H=1"),
            ("wait_epochs_kernel", "dsv3-prefill", "bfloat16 "),  # the combine's
            ("combine_reduce_kernel", "dsv3-prefill",
             "bfloat16 HAS_PAIR=0 ACC_FP64=0 EVEN_H=1 HIER=0"),
            ("dispatch_send_kernel", "dsv3-prefill",
             f"bfloat16 {_DISPATCH_FP8} TRANSPORT=0 ALIGN=16 EVEN_H=1"),
            ("dispatch_expand_kernel", "dsv3-prefill",
             "bfloat16 CACHED=0 HAS_WEIGHTS=1 FP8=1 UE8M0=0 EVEN_H=1"),
            ("ll_dispatch_send_kernel", "dsv3-decode",
             "bfloat16 FP8=1 UE8M0=0 TRANSPORT=0 DEVICE_WAIT=1 EVEN_H=1"),
            ("ll_dispatch_recv_kernel", "dsv3-decode",
             "bfloat16 FP8=1 UE8M0=0 HAS_STATS=0 TRANSPORT=0 DEVICE_WAIT=1 EVEN_H=1"),
            ("ll_combine_send_kernel", "dsv3-decode",
             "bfloat16 TRANSPORT=0 DEVICE_WAIT=1 ZERO_COPY=0 ALIGN=16 EVEN_H=1"),
            ("ll_combine_recv_kernel", "dsv3-decode",
             "bfloat16 HAS_WEIGHTS=1 TRANSPORT=0 DEVICE_WAIT=1 EVEN_H=1"),
        ),
        hints={
            "dispatch_expand_kernel": {
                "j0": "math.ceil(TMAX*(1-(1-1/g0)**K)/(BLOCK_T*g1))",
                "r0": "math.ceil((max_rows-TMAX*K)/(BLOCK_T*g0*g1))"},
            "combine_send_kernel": {"j0": "math.ceil(TMAX*(1-(1-1/g0)**K)/(BLOCK_T*g1))"},
            "ll_dispatch_recv_kernel": {"j0": 1},
            "ll_combine_send_kernel": {"j0": 1},
        },
        max_recv_rows=33280,
        # the send's store into each destination, the expand's and the combine send's loops
        # over the K choices (a store, a gather each)
        live=(f"dispatch_send_kernel:dispatch.py:142={REACHES}",
              f"dispatch_expand_kernel:dispatch.py:308={CHOICE}",
              f"combine_send_kernel:combine.py:141={CHOICE}")),
}

HEADER = """\
# The busiest program's path of each kernel variant that gpu_bench timed, as
# kernels.critical_path reads commit {commit}'s kernels compiled for sm_90 under Triton 3.6
# (recorded with that commit's gate drivers: bf16, one node, DeepSeek-V3 sizes, max_recv_rows
# {max_recv_rows} as the benchmark sized it); the trips of its loops bounded by data at uniform
# routing: {hints}
"""
PATH_COLUMNS = ("kernel", "arch", "config", "variant", "programs", "regs", "num_warps",
                "smem_bytes", "steps", "mbytes", "inflight_kb", "predicted_us")
COMPARED = PATH_COLUMNS[4:]


# ------------------------------------------------------------------------------ markers
def call_lines(package_dir: str, file: str, line: int) -> set:
    """``(file, line)`` of every line of the call that starts at ``file:line``."""
    path = os.path.join(package_dir, file)
    if not os.path.isfile(path):
        raise SystemExit(f"--live: no {file} in {package_dir}")
    from moe_comm.kernels.compiled import call_span

    with open(path) as f:
        lines = f.read().splitlines()
    if not 1 <= line <= len(lines):
        raise SystemExit(f"--live: {file} has no line {line}")
    return {(file, n) for n in call_span(lines, line)}


# ------------------------------------------------------------------------------ worker
def _use_src(src: str) -> None:
    """Imports ``moe_comm`` and ``moe_comm.kernels`` from the checkout ``src`` only: drops an
    editable install's finder (it would map them to this tree) and maps ``moe_comm.kernels`` to
    ``src/kernels``, as setup.py's package_dir does."""
    import importlib.abc

    sys.meta_path[:] = [f for f in sys.meta_path
                        if "__editable__" not in getattr(f, "__module__", "")
                        and "__editable__" not in getattr(type(f), "__module__", "")]
    kernels = os.path.join(src, "kernels")

    class KernelsFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname == "moe_comm.kernels":
                return importlib.util.spec_from_file_location(
                    fullname, os.path.join(kernels, "__init__.py"),
                    submodule_search_locations=[kernels])
            return None

    sys.meta_path.insert(0, KernelsFinder())
    sys.path.insert(0, src)


def _variant_text(flags: dict, dtype: str) -> str:
    """The variant as the TSV writes it: the dtype, a space, the flags but tiles."""
    shown = [f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in flags.items()
             if not k.startswith("BLOCK_") and k not in HIDDEN_FLAGS]
    return f"{dtype} " + " ".join(shown)


def _size_dispatch(gate, rows: int) -> None:
    """Makes the drivers size the normal dispatch (and the combines after it) for ``rows``
    received rows: through ``gate.max_recv_rows`` where the drivers have it, else by passing
    ``rows`` to ``lockstep.dispatch`` and ``gate._drive_combines`` in place of theirs."""
    if hasattr(gate, "max_recv_rows"):
        gate.max_recv_rows = lambda cfg: rows
        return
    from moe_comm import lockstep

    dispatch, drive_combines = lockstep.dispatch, gate._drive_combines

    def sized_dispatch(*args, **kwargs):
        kwargs["max_recv_rows"] = rows
        return dispatch(*args, **kwargs)

    def sized_combines(bufs, cfg, dtype, xs, res, _rows):
        return drive_combines(bufs, cfg, dtype, xs, res, rows)

    lockstep.dispatch, gate._drive_combines = sized_dispatch, sized_combines


class _LaunchArguments:
    """Keeps the grid and scalar arguments (ints, floats, bools by name, constexprs included)
    of each launch Triton's cache hook sees, in the hook's order: what a recorded launch
    carries in later commits, taken here the same way for every commit."""

    def __init__(self):
        from triton.runtime.jit import JITFunction

        self.seen, self._calls, self._cls = [], [], JITFunction
        self._run = JITFunction.run

    def __enter__(self):
        run, calls = self._run, self._calls

        def run_noting(fn, *args, grid, warmup, **kwargs):
            values = dict(zip(fn.arg_names, args))
            values.update((k, v) for k, v in kwargs.items() if k in fn.arg_names)
            scalars = {k: v for k, v in values.items() if isinstance(v, (bool, int, float))}
            g = tuple(grid(values) if callable(grid) else grid)
            calls.append((g + (1,) * (3 - len(g)), scalars))
            try:
                return run(fn, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                calls.pop()

        self._cls.run = run_noting
        return self

    def hook(self):
        """Wraps the cache hook in place now (inside the commit's ``recording``)."""
        import triton

        recorded = triton.knobs.runtime.jit_cache_hook

        def noting(**kwargs):
            self.seen.append(self._calls[-1])
            return recorded(**kwargs)

        triton.knobs.runtime.jit_cache_hook = noting

    def __exit__(self, *exc):
        self._cls.run = self._run


def worker(args) -> int:
    """Records the commit's rows and compiles the variants not cached (one at a time)."""
    os.environ["TRITON_INTERPRET"] = "0"
    _use_src(args.src)
    import importlib

    import torch
    import triton

    import moe_comm
    import moe_comm.kernels as kernels_pkg
    for mod, want in ((moe_comm, args.src), (kernels_pkg, os.path.join(args.src, "kernels"))):
        if not os.path.abspath(mod.__file__).startswith(os.path.abspath(want) + os.sep):
            raise SystemExit(f"{mod.__name__} imported from {mod.__file__}, not {want}")
    from moe_comm.kernels import tiles
    from moe_comm.kernels.compiled import compile_launch, resource_usage
    from moe_comm.kernels.recording import recording

    commit = COMMITS[args.commit]
    gate = importlib.import_module(commit.gate_module)
    schedule_facts = getattr(tiles, "schedule_facts", None)
    print(f"worker: Triton {triton.__version__}, torch {torch.__version__}, {gate.__name__} "
          f"from {gate.__file__}", flush=True)
    t0 = time.perf_counter()
    _size_dispatch(gate, commit.max_recv_rows)
    by_name = {c.name: c for c in gate.CONFIGS}
    wanted = set(commit.rows)
    found: dict = {}  # row -> {key: [launch, grid, scalars, trips, launches]}
    for cfg_name, low_latency in CONFIG_MODES.items():
        cfg = by_name[cfg_name]
        bufs = gate._buffers(cfg, torch.bfloat16, low_latency, 0, ARCH)
        with _LaunchArguments() as arguments, recording(ARCH) as launches:
            arguments.hook()
            (gate.drive_low_latency if low_latency else gate.drive_normal)(
                bufs, cfg, torch.bfloat16)
        if len(arguments.seen) != len(launches):
            raise SystemExit(f"{len(launches)} launches recorded, {len(arguments.seen)} seen")
        for launch, (grid, scalars) in zip(launches, arguments.seen):
            row = (launch.name, cfg_name, _variant_text(launch.flags(), "bfloat16"))
            if row not in wanted:
                continue
            trips = 0
            if schedule_facts is not None:
                trips = schedule_facts(launch.name, grid, scalars)[2]
            seen = found.setdefault(row, {}).setdefault(
                launch.key, [launch, grid, scalars, trips, 0])
            seen[4] += 1
            if trips > seen[3]:  # the first launch with the most trips
                seen[1:4] = grid, scalars, trips
    print(f"worker: recorded in {time.perf_counter() - t0:.1f} s", flush=True)
    recorded, occurrence = [], {}
    for row in commit.rows:
        keys = list(found.get(row, {}).values())
        if not keys:
            raise SystemExit(f"{row}: not recorded")
        n = occurrence[row] = occurrence.get(row, -1) + 1
        mine = keys[min(n, len(keys) - 1)]
        entries = []
        for launch, grid, scalars, trips, count in [mine] + [k for k in keys if k is not mine]:
            entries.append(dict(key=launch.key, grid=grid, scalars=scalars,
                                flags=launch.flags(), options=dict(launch.options),
                                attrs=repr(launch.attrs), launches=count, trips=trips))
            _compile(args, launch, row, compile_launch, resource_usage, triton)
        recorded.append(dict(entries[0], alternatives=entries[1:]))
    path = os.path.join(args.cache, "recording.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(dict(rows=commit.rows, max_recv_rows=commit.max_recv_rows,
                         recorded=recorded), f)
    os.replace(path + ".tmp", path)
    return 0


def _compile(args, launch, row, compile_launch, resource_usage, triton) -> None:
    """Compiles ``launch`` for sm_90 unless cached: its TTGIR, registers, shared memory."""
    cached = os.path.join(args.cache, "compiled", _cache_name(launch.key))
    if os.path.exists(cached):
        return
    t1 = time.perf_counter()
    compiled = compile_launch(launch, ARCH)
    regs, stack, smem = resource_usage(compiled.asm["cubin"])
    data = dict(key=launch.key, kernel=launch.name, ttgir=compiled.asm["ttgir"], regs=regs,
                stack_bytes=stack, smem_bytes=smem,
                num_warps=int(launch.options.get("num_warps", 4)),
                triton=triton.__version__, compile_s=time.perf_counter() - t1)
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    with open(cached + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(cached + ".tmp", cached)
    print(f"worker: compiled {launch.name} [{row[1]}] in {data['compile_s']:.1f} s: "
          f"regs {regs}, smem {smem}", flush=True)


def _cache_name(key: str) -> str:
    return hashlib.sha256(f"{key} sm_{ARCH}".encode()).hexdigest()[:32] + ".json"


# ------------------------------------------------------------------------------ analysis
def load_analyser(directory: str):
    """The module ``critical_path.py`` of ``directory``, loaded on its own."""
    path = os.path.join(directory, "critical_path.py")
    if not os.path.isfile(path):
        raise SystemExit(f"--analyser: no critical_path.py in {directory}")
    spec = importlib.util.spec_from_file_location("reanalyse_critical_path", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def evaluate(value, names: dict):
    """A hint's trips: a number, or an expression in ``names`` (and ``math``)."""
    if isinstance(value, str):
        return eval(value, {"__builtins__": {}, "math": math}, dict(names))
    return value


def parse_live(options: list, package_dir: str) -> dict:
    """kernel -> (share, {(file, line)}) of the ``--live`` options."""
    live: dict = {}
    for text in options:
        m = re.fullmatch(r"(\w+):([\w.]+):(\d+)=([0-9.eE+-]+)", text)
        if m is None:
            raise SystemExit(f"--live {text!r}: want KERNEL:FILE:LINE=SHARE")
        kernel, file, line, share = m.group(1), m.group(2), int(m.group(3)), float(m.group(4))
        old_share, lines = live.get(kernel, (share, set()))
        if old_share != share:
            raise SystemExit(f"--live: two shares for {kernel}: {old_share} and {share}")
        live[kernel] = (share, lines | call_lines(package_dir, file, line))
    return live


def analyse_rows(args, cp, commit: Commit, recorded: list) -> list[dict]:
    """The TSV's rows, each with what ``--verbose`` prints (keys starting with ``_``)."""
    from moe_comm.kernels.compiled import marked_lines  # (this tree's reading of markers)

    package_dir = os.path.join(args.src, "kernels")
    marked = marked_lines(package_dir, "row"), marked_lines(package_dir, "live")
    extra_live = parse_live(list(commit.live) + args.live, package_dir)
    unknown = set(extra_live) - {k for k, _, _ in commit.rows}
    if unknown:
        raise SystemExit(f"--live: no row of kernel {', '.join(sorted(unknown))}")
    out = []
    for (kernel, config, variant), rec in zip(commit.rows, recorded):
        values = walk_entry(args, cp, commit, kernel, rec, marked, extra_live)
        others = [walk_entry(args, cp, commit, kernel, alt, marked, extra_live)
                  for alt in rec["alternatives"]]
        out.append(dict(kernel=kernel, arch=ARCH, config=config, variant=variant, **values,
                        _rec=rec, _others=others))
    return out


def walk_entry(args, cp, commit: Commit, kernel: str, rec: dict, marked: tuple,
               extra_live: dict) -> dict:
    """The TSV's columns of one recorded variant, walked by the analyser ``cp``."""
    with open(os.path.join(args.cache, "compiled", _cache_name(rec["key"]))) as f:
        comp = json.load(f)
    grid = tuple(rec["grid"])
    programs = grid[0] * grid[1] * grid[2]
    names = dict(rec["scalars"], **rec["flags"], g0=grid[0], g1=grid[1], g2=grid[2],
                 programs=programs)
    hints = {k: evaluate(v, names) for k, v in commit.hints.get(kernel, {}).items()}
    rows_marked, live = marked[0], set(marked[1])
    if kernel in extra_live:
        share, lines = extra_live[kernel]
        live |= lines
        hints[getattr(cp, "LIVE", "@live")] = share
    if "live_lines" in inspect.signature(cp.analyse).parameters:
        path = cp.analyse(comp["ttgir"], rec["scalars"], grid, hints, rows_marked, live)
    elif live:
        raise SystemExit("this analyser's analyse() takes no live lines")
    else:
        path = cp.analyse(comp["ttgir"], rec["scalars"], grid, hints, rows_marked)
    predicted = cp.predicted_us(path, programs, comp["regs"], comp["num_warps"],
                                comp["smem_bytes"])
    inflight = None if path.inflight_bytes is None else path.inflight_bytes / 1024
    return dict(programs=programs, regs=comp["regs"], num_warps=comp["num_warps"],
                smem_bytes=comp["smem_bytes"], steps=f"{path.steps:g}",
                mbytes=f"{path.bytes / 1e6:.4f}",
                inflight_kb="-" if inflight is None else f"{inflight:.1f}",
                predicted_us=f"{predicted:.2f}", _hints=hints, _unknown=path.unknown_loops)


# ------------------------------------------------------------------------------ files
def _git(directory: str, *argv: str) -> str:
    done = subprocess.run(["git", "-C", directory, *argv], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def analyser_note(directory: str, live: list, cp) -> str:
    """The header's last line(s): the analyser (its path in its repository, the commit, and
    whether it has changes not committed; the constants of its ``predicted_us``) and the live
    shares."""
    path = os.path.realpath(os.path.join(directory, "critical_path.py"))
    top = _git(os.path.dirname(path), "rev-parse", "--show-toplevel")
    if top:
        rel = os.path.relpath(path, top)
        name = f"{rel} at {_git(top, 'rev-parse', '--short', 'HEAD')}"
        if _git(top, "--no-optional-locks", "status", "--porcelain", "--", rel):
            name += ", with uncommitted changes"
    else:
        name = path
    shares = "live shares: " + " ".join(live) if live else "no live shares"
    text = (f"Walked by {name} (predicted_us at LATENCY_US {cp.LATENCY_US:g}, SM_GBPS "
            f"{cp.SM_GBPS:g}); {shares}")
    return "".join(f"# {line}\n" for line in textwrap.wrap(text, 98, break_on_hyphens=False))


def write_tsv(path: str, commit_name: str, rows: list[dict], note: str) -> None:
    commit = COMMITS[commit_name]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(HEADER.format(commit=commit_name, max_recv_rows=commit.max_recv_rows,
                              hints=json.dumps(commit.hints)))
        f.write(note)
        f.write("\t".join(PATH_COLUMNS) + "\n")
        for r in rows:
            f.write("\t".join(str(r[c]) for c in PATH_COLUMNS) + "\n")


def read_tsv(path: str) -> tuple[list[str], list[dict]]:
    """A TSV's '#' lines and its rows."""
    import csv

    with open(path) as f:
        lines = f.readlines()
    header = [line for line in lines if line.startswith("#")]
    rows = list(csv.DictReader((line for line in lines if not line.startswith("#")),
                               delimiter="\t"))
    return header, rows


def compare(mine: str, theirs: str) -> int:
    """Prints each row and column where ``mine`` differs from ``theirs``; the count."""
    (h1, a), (h2, b) = read_tsv(mine), read_tsv(theirs)
    diffs = 0
    if len(a) != len(b):
        print(f"compare: {len(a)} rows here, {len(b)} in {theirs}")
        diffs += 1
    for x, y in zip(a, b):
        if (x["kernel"], x["config"], x["variant"]) != (y["kernel"], y["config"], y["variant"]):
            print(f"compare: row {x['kernel']} {x['variant']!r} against {y['kernel']} "
                  f"{y['variant']!r}")
            diffs += 1
            continue
        for c in COMPARED:
            if x[c] != y[c]:
                fp8 = " FP8=1" if "FP8=1" in x["variant"] else ""
                print(f"compare: {x['kernel']}{fp8} [{x['config']}] {c}: {x[c]} here, "
                      f"{y[c]} there")
                diffs += 1
    if h1[:len(h2)] != h2:  # the analyser's line(s) follow the committed header
        print("compare: the committed '#' header lines differ")
        diffs += 1
    print(f"compare: {diffs} differences against {theirs}")
    return diffs


# ------------------------------------------------------------------------------ main
def checkout(src: str, commit: str) -> None:
    """Clones this repository to ``src`` and checks ``commit`` out, unless already there."""
    if not os.path.isdir(src):
        os.makedirs(os.path.dirname(src), exist_ok=True)
        subprocess.run(["git", "clone", "-q", ROOT, src], check=True)
        subprocess.run(["git", "-C", src, "checkout", "-q", commit], check=True)
    head = _git(src, "rev-parse", "HEAD")
    want = _git(src, "rev-parse", f"{commit}^{{commit}}")
    if not head or head != want:
        raise SystemExit(f"{src} is at {head or '?'}, not {commit}: remove it or give another "
                         "--workdir")


def load_recording(args, commit: Commit):
    """The cached recording, if it is the commit's and every variant it names is compiled."""
    path = os.path.join(args.cache, "recording.pkl")
    if args.refresh or not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        data = pickle.load(f)
    if data["rows"] != commit.rows or data["max_recv_rows"] != commit.max_recv_rows:
        return None
    entries = [e for r in data["recorded"] for e in [r, *r["alternatives"]]]
    if not all(os.path.exists(os.path.join(args.cache, "compiled", _cache_name(e["key"])))
               for e in entries):
        return None
    return data["recorded"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--commit", required=True, choices=sorted(COMMITS))
    p.add_argument("--workdir", help="the commit's checkout and caches (default "
                   "~/.cache/moe_comm/reanalyse/<commit>)")
    p.add_argument("--out", help="the TSV to write (default <workdir>/gate-paths-<commit>.tsv)")
    p.add_argument("--analyser", default=os.path.join(ROOT, "kernels"),
                   help="directory of the critical_path.py to walk with (default kernels/)")
    p.add_argument("--live", action="append", default=[], metavar="KERNEL:FILE:LINE=SHARE",
                   help="the call starting at FILE:LINE of the commit's kernels/ moves SHARE "
                        "of its lanes (the kernel's hint critical_path.LIVE), besides the "
                        "commit's own (COMMITS)")
    p.add_argument("--compare", help="the TSV to compare with ('' for none; default "
                   "bench/measured/gate-paths-<commit>.tsv)")
    p.add_argument("--python", default=os.path.join(ROOT, ".venv-triton36", "bin", "python"),
                   help="the Triton 3.6 interpreter that records and compiles")
    p.add_argument("--refresh", action="store_true", help="record and compile again")
    p.add_argument("--verbose", action="store_true", help="print each row's launch and hints")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    start = time.perf_counter()
    commit = COMMITS[args.commit]
    workdir = os.path.abspath(os.path.expanduser(
        args.workdir or os.path.join("~", ".cache", "moe_comm", "reanalyse", args.commit)))
    args.src = os.path.join(workdir, "src")
    args.cache = os.path.join(workdir, "cache")
    out = args.out or os.path.join(workdir, f"gate-paths-{args.commit}.tsv")
    if args.compare is None:
        args.compare = os.path.join(ROOT, "bench", "measured", f"gate-paths-{args.commit}.tsv")
    checkout(args.src, args.commit)
    recorded = load_recording(args, commit)
    if recorded is None:
        compiled_dir = os.path.join(args.cache, "compiled")
        if args.refresh and os.path.isdir(compiled_dir):
            for name in os.listdir(compiled_dir):
                os.remove(os.path.join(compiled_dir, name))
        os.makedirs(args.cache, exist_ok=True)
        env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=args.src,
                   TRITON_CACHE_DIR=os.path.join(workdir, "triton_cache"))
        cmd = ["nice", "-n", "10", args.python, os.path.abspath(__file__), "--worker",
               "--commit", args.commit, "--src", args.src, "--cache", args.cache]
        rc = subprocess.run(cmd, env=env).returncode
        if rc:
            print(f"worker failed ({rc})", file=sys.stderr)
            return rc
        recorded = load_recording(argparse.Namespace(cache=args.cache, refresh=False), commit)
    cp = load_analyser(args.analyser)
    rows = analyse_rows(args, cp, commit, recorded)
    write_tsv(out, args.commit, rows, analyser_note(
        args.analyser, list(commit.live) + args.live, cp))
    if args.verbose:
        for r in rows:
            rec = r["_rec"]
            print(f"{r['kernel']} [{r['config']}] {r['variant']}: grid {rec['grid']} "
                  f"({rec['launches']} launches, {rec['trips']} trips), hints {r['_hints']}"
                  + (f", unknown loops {r['_unknown']}" if r["_unknown"] else ""))
            for alt, o in zip(rec["alternatives"], r["_others"]):
                same = all(o[c] == r[c] for c in COMPARED)
                print(f"  another specialisation with the same flags ({alt['launches']} "
                      f"launches, attrs {alt['attrs']}): "
                      + ("the same columns" if same else
                         ", ".join(f"{c} {o[c]}" for c in COMPARED if o[c] != r[c])))
    print(f"wrote {out} ({len(rows)} rows) in {time.perf_counter() - start:.1f} s")
    if args.compare and os.path.exists(args.compare):
        compare(out, args.compare)
    elif args.compare:
        print(f"compare: no {args.compare}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
