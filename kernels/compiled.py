"""What the compiled code shows: build a recorded launch for an architecture and read it.

For one :class:`~moe_comm.kernels.recording.Launch` and one ``sm_XX``, :func:`inspect_launch`
compiles with ``triton.compile`` (no GPU or driver needed; results land in Triton's cache) and
reads:

* registers, stack bytes (spills and local arrays) and static shared memory of the kernel, from
  ``cuobjdump -res-usage`` on the cubin (Triton's own copy of the tool);
* the narrowest global store of each kind of row data. Stores are found in the PTX and mapped to
  source lines through its ``.loc`` directives; a line whose ``tl.store`` carries a comment
  ``# gate: row`` (token rows), ``# gate: scales`` (FP8 scales) or ``# gate: exponents``
  (UE8M0 exponent bytes) moves row data;
* every NVSHMEM call and how many threads of a program issue it, from the Triton IR: a call
  under ``if one_thread():`` (a branch on ``%tid.x == 0``) has one issuer, any other call is
  issued by every thread (the right count only for block-scoped calls, ``*_block``);
* the memory order of the signal instructions: lines marked ``# gate: publish`` must compile to
  ``.release.sys`` stores or atomics, lines marked ``# gate: acquire`` to ``.acquire.sys``;
* the loads from host memory (the error record and the proxy's ring: pointers made from the
  ``errors_addr`` and ``ring_addr`` arguments), from the Triton IR: how many a program makes
  outside loops, and any inside a loop or a spin.

:func:`violations` turns the facts into the gate's failures.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field

GATE_TAGS = ("row", "scales", "exponents", "scalebytes", "tail", "publish", "acquire", "cold",
             "rare", "live")
# on an ``if``: a branch a correct call does not take (an error's), or one taken as often as
# its schedule's ``rare`` says (kernels.critical_path weighs its arms)
BRANCH_TAGS = ("cold", "rare")
# on a ``tl.load``: a gather whose lanes the routing masks; kernels.critical_path counts the
# share of its lanes that load at uniform routing (a schedule's ``live``), not the whole tile.
# A store's tag followed by ``live`` (``# gate: row live``) is a store the routing masks the
# same way: the share of its lanes that store counts
LOAD_TAGS = ("live",)
# Narrowest store (bits) each kind of row data may use where rows are 16-byte aligned. FP8
# scales are one float (UE8M0: one byte) per 128 channels: a tile of BLOCK_H channels of a token
# has BLOCK_H / 128 of them (32 bytes at BLOCK_H = 1024), spread over the threads that hold the
# tile's codes, so one thread holds one scale, not four; they are 3% (1%) of an FP8 row's bytes.
# "scalebytes": NVFP4's e4m3 scale per 16 channels (one byte per 8 bytes of packed values).
# "tail": the last (payload % 16) bytes of a row copied as raw bytes (UE8M0 exponents).
MIN_STORE_BITS = {"row": 128, "scales": 32, "exponents": 8, "scalebytes": 8, "tail": 8}
_MARKER = re.compile(r"#\s*gate:\s*([a-z]+)(\s+live)?\s*$")
_STORE = re.compile(r"\b(st|atom|red)\.((?:[a-zA-Z0-9_:]+\.)*[a-zA-Z0-9_:]+)")
# Ordering loads: Triton compiles an acquire fetch-and-add of 0 whose value is used to an
# acquire load (``ld.global.sys.acquire``).
_ACQUIRE_LOAD = re.compile(r"\b(ld)\.((?:[a-zA-Z0-9_:]+\.)*acquire(?:\.[a-zA-Z0-9_:]+)*)")


@dataclass
class Facts:
    """What one compiled variant shows (one row of bench/results/gpu_gate.tsv)."""

    kernel: str
    arch: int
    config: str
    variant: str
    regs: int = 0
    stack_bytes: int = 0
    smem_bytes: int = 0
    row_store_bits: dict = field(default_factory=dict)  # tag -> narrowest store (bits)
    nvshmem_issuers: dict = field(default_factory=dict)  # symbol -> "block" or thread count
    unordered_signals: list = field(default_factory=list)  # "file:line instruction"
    markers_emitted: list = field(default_factory=list)  # "file:line" of marked lines in the PTX
    host_loads: int = 0  # loads from host memory outside loops (one per program each)
    host_loads_in_loops: int = 0  # loads from host memory inside a loop or a spin
    # fp32 fused multiply-adds in a kernel compiled without contraction (enable_fp_fusion=False:
    # the EP-invariant sums round each product and sum); -1 where contraction is allowed
    fused_mul_adds: int = -1
    programs: int = 0  # the launch's grid (the gate fills these three from the recording)
    max_trips: int = 0
    schedule: str = ""
    # config -> the busiest program's path at that config's launch (kernels.critical_path):
    # steps, bytes, inflight_kb, predicted_us, in_row_loops, unknown_loops
    paths: dict = field(default_factory=dict)
    paths_summary: list = field(default_factory=list)  # the paths the TSV's columns show
    speed_notes: list = field(default_factory=list)  # speed facts not yet held as rules
    compile_s: float = 0.0
    uses_nvshmem: bool = False
    error: str = ""

    def as_row(self) -> dict:
        row = asdict(self)
        paths = self.paths_summary or list(self.paths.values())
        row["speed_notes"] = "; ".join(self.speed_notes) or "-"
        row["steps"] = f"{max(p['steps'] for p in paths):g}" if paths else ""
        inflight = [p["inflight_kb"] for p in paths if p["inflight_kb"] is not None]
        row["inflight_kb"] = f"{min(inflight):.1f}" if inflight else "-"
        row["predicted_us"] = (f"{max(p['predicted_us'] for p in paths):.1f}" if paths
                               else "")
        for name in ("row_store_bits", "nvshmem_issuers"):
            row[name] = ",".join(f"{k}={v}" for k, v in sorted(row[name].items())) or "-"
        row["unordered_signals"] = ";".join(self.unordered_signals) or "-"
        row["markers_emitted"] = ",".join(sorted(set(self.markers_emitted))) or "-"
        row["host_loads"] = (f"{self.host_loads}" if not self.host_loads_in_loops
                             else f"{self.host_loads}+{self.host_loads_in_loops} in loops")
        return row


def cuobjdump() -> str:
    """Triton's bundled cuobjdump (CUDA's, where the wheel has none)."""
    import triton.backends.nvidia as nvidia

    bundled = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    return bundled if os.path.exists(bundled) else "cuobjdump"


def compile_launch(launch, arch: int):
    """``triton.compile`` of a recorded launch for ``sm_<arch>``; read ``.asm`` and
    ``.metadata`` only (the result cannot run here)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=launch.kernel, signature=launch.signature,
                       constexprs=launch.constexprs, attrs=launch.attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))


def resource_usage(cubin: bytes) -> tuple[int, int, int]:
    """(registers, stack bytes, static shared bytes) of the cubin's kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump(), "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no resource line:\n{out}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def _source_markers(path: str, live_stores: bool = False) -> dict[int, str]:
    """Line -> the tag of its ``# gate:`` marker; ``live_stores``: only the lines whose tag is
    followed by ``live`` (stores the routing masks), each tagged ``live``."""
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return {}
    return {i + 1: "live" if live_stores else m.group(1) for i, line in enumerate(lines)
            if (m := _MARKER.search(line)) and (m.group(2) or not live_stores)}


def _marked_spans(path: str, live_stores: bool = False) -> dict[int, tuple[str, int]]:
    """Every line of a marked call -> ``(tag, line of the marker)`` (``live_stores``: of the
    stores marked ``live``). A call written over several lines is one statement; Triton 3.9
    locates its instruction on the line the call starts on, Triton 3.6 on a later one (the line
    of its value), so the marker covers them all."""
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return {}
    spans = {}
    for start, tag in _source_markers(path, live_stores).items():
        for line in call_span(lines, start):
            spans.setdefault(line, (tag, start))
    return spans


def call_span(lines: list, start: int) -> range:
    """The lines (1-based) of ``lines`` of the call that starts on line ``start``: to the line
    where its parentheses close."""
    depth, end = 0, start
    for end in range(start, len(lines) + 1):
        code = lines[end - 1].split("#", 1)[0]
        depth += code.count("(") - code.count(")")
        if depth <= 0:
            break
    return range(start, end + 1)


def _resolve(path: str, package_dir: str) -> str:
    """A source file named in the PTX; a cached binary may name a checkout that has moved, so a
    file of the kernel's own package is looked up there by name."""
    local = os.path.join(package_dir, os.path.basename(path))
    return local if os.path.exists(local) else path


def _store_bits(opcode_suffix: str) -> int:
    parts = opcode_suffix.split(".")
    lanes = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
    width = next((int(p[1:]) for p in reversed(parts) if re.fullmatch(r"[bsuf]\d+", p)), 0)
    return lanes * width


def marked_instructions(ptx: str, package_dir: str) -> list[tuple[str, str, int, str]]:
    """``(tag, file, line, instruction)`` for every st/atom/red and acquire load of the PTX whose
    ``.loc`` is a source line of the kernel's own package: ``tag`` is the ``# gate:`` marker of
    the call that line belongs to (``line``: the marker's), or "" (code linked in from
    elsewhere, NVSHMEM's, is not listed)."""
    files = {int(n): _resolve(p, package_dir)
             for n, p in re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, re.M)}
    markers = {n: _marked_spans(p) for n, p in files.items()}
    found, loc = [], None
    for line in ptx.splitlines():
        stripped = line.strip()
        parts = stripped.split()
        if parts and parts[0] == ".loc":
            loc = (int(parts[1]), int(parts[2]))
            continue
        m = _STORE.search(stripped) or _ACQUIRE_LOAD.search(stripped)
        if m is None or loc is None or m.group(1) == "st" and "global" not in m.group(2):
            continue
        path = files.get(loc[0], "")
        # NVSHMEM's device code is inlined with the .loc of its extern wrapper (nvshmem.py)
        if os.path.dirname(path) == package_dir and os.path.basename(path) != "nvshmem.py":
            tag, line = markers.get(loc[0], {}).get(loc[1], ("", loc[1]))
            found.append((tag, path, line, f"{m.group(1)}.{m.group(2)}"))
    return found


def check_markers(path: str) -> list[str]:
    """Markers that cannot be read: a ``# gate:`` comment on a line where no ``tl.store`` or
    ``tl.atomic_*`` call starts (the PTX locates a call by the line it starts on)."""
    bad = []
    live_stores = _source_markers(path, live_stores=True)
    for line_no, tag in _source_markers(path).items():
        text = open(path).read().splitlines()[line_no - 1]
        if tag not in GATE_TAGS:
            bad.append(f"{path}:{line_no}: unknown gate tag {tag!r}")
        elif line_no in live_stores and tag not in MIN_STORE_BITS:
            bad.append(f"{path}:{line_no}: '# gate: {tag} live': only a store of row data "
                       f"takes 'live'")
        elif tag in BRANCH_TAGS:
            if not text.lstrip().startswith("if "):
                bad.append(f"{path}:{line_no}: '# gate: {tag}' on a line where no if starts")
        elif tag in LOAD_TAGS:
            if "tl.load(" not in text:
                bad.append(f"{path}:{line_no}: '# gate: {tag}' on a line where no load starts")
        elif "tl.store(" not in text and "tl.atomic_" not in text:
            bad.append(f"{path}:{line_no}: '# gate: {tag}' on a line where no store starts")
    return bad


def unemitted_markers(emitted, paths) -> list[str]:
    """The ``# gate:`` markers of the files ``paths`` that no compiled variant emitted an
    instruction for (``emitted``: the union of :attr:`Facts.markers_emitted`): a marked store or
    acquire the compiler dropped (an acquire whose value is unused), or a marked line no
    compiled kernel reaches."""
    seen = set(emitted)
    return [f"{os.path.basename(p)}:{line}: '# gate: {tag}' emitted no instruction in any "
            f"compiled variant" for p in paths for line, tag in _source_markers(p).items()
            if tag not in BRANCH_TAGS + LOAD_TAGS and f"{os.path.basename(p)}:{line}" not in seen]


_SSA = re.compile(r"(%[\w#.]+)")


def nvshmem_issuers(ttir: str, num_threads: int) -> dict[str, str]:
    """For every NVSHMEM call of the IR: ``"block"`` for block-scoped calls made by the whole
    program, else how many threads issue it (1 under ``one_thread()``, every thread otherwise).
    A block-scoped call under a one-thread guard reads ``"block-in-1-thread"``."""
    defs: dict[str, str] = {}
    for line in ttir.splitlines():
        m = re.match(r"\s*(%[\w#.]+)(?::\d+)?\s*=\s*(.*)", line)
        if m:
            defs[m.group(1)] = m.group(2)

    def is_tid(name: str) -> bool:
        return "%tid.x" in defs.get(name, "")

    def is_zero(name: str) -> bool:
        return bool(re.match(r"arith\.constant\s+0\b", defs.get(name, "")))

    def guards_one_thread(cond: str) -> bool:
        d = defs.get(cond, "")
        m = re.match(r"arith\.cmpi\s+eq,\s*(%[\w#.]+),\s*(%[\w#.]+)", d)
        return bool(m) and ((is_tid(m.group(1)) and is_zero(m.group(2)))
                            or (is_tid(m.group(2)) and is_zero(m.group(1))))

    stack: list[bool] = []  # per open region: does it run in one thread only?
    result: dict[str, str] = {}
    for line in ttir.splitlines():
        stripped = line.strip()
        closes = stripped.startswith("}")
        if closes and stack:
            stack.pop()
        m = re.search(r'symbol\s*=\s*"(nvshmem\w*)"', stripped)
        if m and "tt.extern_elementwise" in stripped:
            symbol = m.group(1)
            one = any(stack)
            block_scoped = symbol.endswith("_block")
            if block_scoped:
                issuers = "block-in-1-thread" if one else "block"
            else:
                issuers = "1" if one else str(num_threads)
            previous = result.get(symbol)
            result[symbol] = issuers if previous in (None, issuers) else f"{previous}|{issuers}"
        if stripped.endswith("{"):
            cond = re.match(r"(?:%[\w#.]+(?::\d+)?\s*=\s*)?scf\.if\s+(%[\w#.]+)", stripped)
            if closes:  # "} else {": the else branch of a guard runs in the other threads
                stack.append(False)
            else:
                stack.append(bool(cond) and guards_one_thread(cond.group(1)))
    return result


HOST_POINTERS = ("errors_addr", "ring_addr")  # int64 arguments that address host memory
_ADDRESS_OPS = {"tt.int_to_ptr", "tt.addptr", "tt.splat", "tt.broadcast", "tt.expand_dims",
                "tt.reshape", "tt.bitcast", "arith.addi", "arith.subi", "arith.muli",
                "arith.extsi", "arith.extui", "arith.select"}
_DEFINITION = re.compile(r"\s*(%[\w#.]+)\s*=\s*([\w.]+)")


def host_loads(ttir: str, names=HOST_POINTERS) -> tuple[int, int]:
    """``(loads outside loops, loads inside a loop or spin)`` of host memory in the Triton IR:
    ``tt.load`` of a pointer computed from one of the kernel arguments ``names``, followed
    through the ops that make addresses (``_ADDRESS_OPS``: integer arithmetic on the address,
    the cast to a pointer, pointer offsets, splats and broadcasts; a loaded value is data, not
    an address). A load under ``scf.for`` or ``scf.while`` runs once per trip or spin."""
    header = re.search(r"tt\.func public @\w+\((.*)\)\s*attributes", ttir)
    args = set()
    if header:
        args = {ssa for ssa, name in re.findall(r'(%[\w#.]+): [^%]*?loc\("(\w+)"',
                                                 header.group(1)) if name in names}
    # one pass in order: a value is defined before its uses, and a name belongs to the region
    # it is defined in and those inside it (sibling regions reuse names)
    scopes: list[dict] = [{a: True for a in args}]
    loops: list[bool] = []  # per open region: is it a loop body?
    outside = inside = 0

    def host(name: str) -> bool:
        return next((scope[name] for scope in reversed(scopes) if name in scope), False)

    for line in ttir.splitlines():
        stripped = line.strip()
        if stripped.startswith("}") and loops:
            loops.pop()
            scopes.pop()
        m = re.search(r"tt\.load\s+(%[\w#.]+)", stripped)
        if m and host(m.group(1)):
            if any(loops):
                inside += 1
            else:
                outside += 1
        d = _DEFINITION.match(line)
        if d:
            scopes[-1][d.group(1)] = d.group(2) in _ADDRESS_OPS and any(
                host(u) for u in _SSA.findall(line[d.end():]))
        if stripped.endswith("{"):
            loops.append("scf.for" in stripped or "scf.while" in stripped
                         or stripped.startswith("} do {"))
            scopes.append({})
    return outside, inside


def marked_lines(package_dir: str, wanted: str) -> set:
    """``(file name, line)`` of every line of a call marked ``# gate: <wanted>`` in the
    kernels' sources: the row stores (``row``, what ``kernels.critical_path`` measures the
    bytes in flight at), the gathers and stores the routing masks (``live``: ``# gate: live``
    loads and stores marked ``# gate: <tag> live``)."""
    lines = set()
    for name in sorted(os.listdir(package_dir)):
        if name.endswith(".py"):
            path = os.path.join(package_dir, name)
            spans = list(_marked_spans(path).items())
            if wanted == "live":
                spans += _marked_spans(path, live_stores=True).items()
            lines |= {(name, line) for line, (tag, _) in spans if tag == wanted}
    return lines


def walk_paths(ttgir: str, analysis: dict, package_dir: str, regs: int, smem: int,
               num_warps: int) -> dict:
    """``config -> path facts`` of a compiled kernel at each of its launches: ``analysis``
    maps a config to ``(grid, arguments, trips of the loops bounded by data)``."""
    from . import critical_path

    rows, live = marked_lines(package_dir, "row"), marked_lines(package_dir, "live")
    module = critical_path.parse(ttgir)  # once: each config walks the same module
    paths = {}
    for cfg, (grid, args, hints) in analysis.items():
        path = critical_path.walk(module, args, grid, hints, rows, live)
        programs = 1
        for g in grid:
            programs *= g
        paths[cfg] = dict(
            steps=path.steps, bytes=path.bytes,
            inflight_kb=None if path.inflight_bytes is None else path.inflight_bytes / 1024,
            predicted_us=critical_path.predicted_us(path, programs, regs, num_warps, smem),
            in_row_loops=sorted(set(path.barriers_in_row_loops)),
            unknown_loops=sorted(set(path.unknown_loops)))
    return paths


def inspect_launch(launch, arch: int, config: str, variant: str,
                   analysis: dict | None = None) -> Facts:
    """Compiles ``launch`` for ``sm_<arch>`` and reads what the gate checks; ``analysis``
    (:func:`walk_paths`): the launches whose busiest program to walk."""
    import inspect as pyinspect

    facts = Facts(launch.name, arch, config, variant, uses_nvshmem=launch.uses_nvshmem)
    start = time.perf_counter()
    try:
        compiled = compile_launch(launch, arch)
    except Exception as error:  # every failure becomes a row, then the gate fails
        while error.__cause__ is not None or error.__context__ is not None:
            error = error.__cause__ or error.__context__
        text = " ".join(str(error).split())
        facts.error = f"{type(error).__name__}: {text[:400]}"
        facts.compile_s = time.perf_counter() - start
        return facts
    facts.compile_s = time.perf_counter() - start
    facts.regs, facts.stack_bytes, facts.smem_bytes = resource_usage(compiled.asm["cubin"])
    package_dir = os.path.dirname(pyinspect.getsourcefile(launch.kernel.fn))
    for tag, path, line, instruction in marked_instructions(compiled.asm["ptx"], package_dir):
        where = f"{os.path.basename(path)}:{line} {instruction}"
        if tag:
            facts.markers_emitted.append(f"{os.path.basename(path)}:{line}")
        if tag in MIN_STORE_BITS:
            bits = _store_bits(instruction.split(".", 1)[1])
            facts.row_store_bits[tag] = min(bits, facts.row_store_bits.get(tag, bits))
        elif tag == "publish" and not (".release" in instruction and ".sys" in instruction):
            facts.unordered_signals.append(where)
        elif tag == "acquire" and not (".acquire" in instruction and ".sys" in instruction):
            facts.unordered_signals.append(where)
        elif not tag and "exch" in instruction and ".release" not in instruction:
            facts.unordered_signals.append(where)  # each exchange of ours publishes a word
    facts.nvshmem_issuers = nvshmem_issuers(compiled.asm["ttir"],
                                            32 * int(launch.options.get("num_warps", 4)))
    facts.host_loads, facts.host_loads_in_loops = host_loads(compiled.asm["ttir"])
    if launch.options.get("enable_fp_fusion") is False:
        facts.fused_mul_adds = sum(line.lstrip().startswith("fma.rn.f32")
                                   for line in compiled.asm["ptx"].splitlines())
    if analysis:
        facts.paths = walk_paths(compiled.asm["ttgir"], analysis, package_dir, facts.regs,
                                 facts.smem_bytes, int(launch.options.get("num_warps", 4)))
    return facts


def violations(facts: Facts, rows_aligned: bool, host_rules: bool = True) -> list[str]:
    """The gate's rules for one variant; ``rows_aligned``: rows start on 16-byte boundaries in
    this configuration (else narrower row stores are allowed); ``host_rules``: hold it to the
    host-memory rule (not the proxy's variants, which run on CPU ranks only so far)."""
    if facts.error:
        return [f"does not compile: {facts.error}"]
    found = []
    if facts.stack_bytes > 0:
        found.append(f"spills or uses local memory: {facts.stack_bytes} bytes of stack per thread")
    for tag, bits in facts.row_store_bits.items():
        if rows_aligned and bits < MIN_STORE_BITS[tag]:
            found.append(f"stores {tag} {bits} bits at a time (needs {MIN_STORE_BITS[tag]})")
    for symbol, issuers in facts.nvshmem_issuers.items():
        scoped = symbol.endswith("_block")
        if (scoped and issuers != "block") or (not scoped and issuers != "1"):
            found.append(f"{symbol} is issued by {issuers} threads of a program "
                         f"(its scope means {'the whole block' if scoped else 'one thread'})")
    for where in facts.unordered_signals:
        found.append(f"signal without release/acquire ordering: {where}")
    if facts.fused_mul_adds > 0:
        found.append(f"{facts.fused_mul_adds} fp32 fused multiply-adds though compiled without "
                     "contraction (each product and sum must round: the EP-invariant sums)")
    if not host_rules:
        return found
    if facts.host_loads_in_loops:
        found.append(f"loads host memory inside a loop or spin ({facts.host_loads_in_loops} "
                     f"load(s) of the error record or ring per trip)")
    elif facts.host_loads > 1:
        found.append(f"loads host memory {facts.host_loads} times per program (at most once)")
    return found
