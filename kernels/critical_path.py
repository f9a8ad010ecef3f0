"""What a compiled kernel's loop nest predicts: dependent steps, bytes in flight, time.

:func:`analyse` reads the Triton GPU IR (``asm["ttgir"]``) of one compiled variant and walks
the path of its busiest program (program 0 of every axis, both arms of every branch: the
heavier one counts) as a warp issues it, in order, stalling at the first use of a value that
is not there yet. Counted in *steps*, one dependent global round trip each (about 0.5 us on an
H200 under load, :data:`LATENCY_US`):

* a global load costs a step when its value is first used (loads issued before that use
  travel together: they are the bytes in flight);
* an atomic whose value is used, or that orders memory (release, acquire), costs one; a relaxed
  atomic whose value is unused is a fire-and-forget reduction, like a store;
* a barrier across warps costs one: ``tl.debug_barrier``, and the reductions, scans,
  histograms and layout conversions whose data crosses warps (read off the layouts);
* a wait (``scf.while``) is counted as if its peers had arrived: the polls before it and its
  condition once, never the spin; so is a branch marked ``# gate: cold`` on its ``if`` line (a
  wait's slow path, a bad input's or a timeout's record): not taken; a branch marked
  ``# gate: rare`` counts each arm as often as it is taken at uniform routing (the hint
  :data:`RARE`);
* a software-pipelined loop's copies (``ttg.async_copy_global_to_local``) issue like loads; its
  ``async_wait`` waits for the copies of ``1 + ahead`` trips back, ``ahead`` the trips of
  copies it leaves in flight (its ``num`` over the commit groups of a trip): ``1 / (1 + ahead)``
  of a step a trip, after the step that fills the pipeline;
* a loop costs its trips times the steps of one trip. Trips come from the loop's bounds,
  evaluated from the launch's scalars, grid and constants; a bound made of loaded data (rows
  received, slots filled) needs a declared count at uniform routing (``hints``: the induction
  variable's name -> trips), else the analysis says which loop it could not count.

Stores cost no step. *Bytes* are the tiles' sizes (masked lanes included: an upper bound of the
useful bytes), loads plus stores, times the trips; a load marked ``# gate: live`` (a gather whose
lanes the routing masks) counts the share of its lanes that load at uniform routing (the hint
:data:`LIVE`), and a store marked ``# gate: row live`` (a row per routed choice or
destination, masked where the routing sends none) the share that stores. *In flight*
(``inflight_kb``) is, for each store marked ``# gate: row``, the bytes of the loads issued in
the step whose value it stores; the least over a kernel's row stores. The predicted time of a
launch (:func:`predicted_us`) is the slower of its busiest program's steps (times the waves of
programs the GPU holds at once) and its bytes over the SMs it runs on at :data:`SM_GBPS` each.
Both constants are fitted to the kernels measured on an H200 (docs/PERF.md, "The gate's
predictions against the measurements").
"""
from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass, field

# Fitted to the kernels measured on an H200 on 2026-12-04, as this analysis reads them
# (bench/measured/gate-paths-320afca.tsv, bench/fit_model.py; docs/PERF.md)
LATENCY_US = 0.35  # one dependent step under load
SM_GBPS = 39.0  # bytes (loads plus stores) one SM moves per microsecond, in kB, when not waiting
BARRIER_STEPS = 1.0  # a barrier across warps, in steps
LIVE = "@live"  # hint: the share of a marked load's or store's lanes that move (no loop's name)
RARE = "@rare"  # hint: how often an ``if`` marked ``# gate: rare`` is taken
GPU_SMS = 132  # SMs of an H100 / H200
REGISTERS_PER_SM = 65536
WARPS_PER_SM = 64

_DTYPE_BYTES = {"i1": 1, "i8": 1, "i16": 2, "i32": 4, "i64": 8, "f16": 2, "bf16": 2, "f32": 4,
                "f64": 8, "f8E4M3FN": 1, "f8E5M2": 1, "f8E4M3FNUZ": 1, "f8E5M2FNUZ": 1}
_OP = re.compile(r'^(?:(%[\w.$-]+)(?::(\d+))?(?:\s*,\s*%[\w.$-]+)*\s*=\s*)?"?([\w.]+)"?')
_SSA = re.compile(r"%[\w.$-]+(?:#\d+)?")
_LOC = re.compile(r"loc\((#loc\d*)\)\s*$")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_ITER_ARG = re.compile(r"(%[\w.$-]+)\s*=")  # the names an ``iter_args(%a = %b, ...)`` binds


@dataclass
class Op:
    results: list
    name: str
    text: str  # the op's own line(s), regions left out
    regions: list = field(default_factory=list)  # each a list of Op
    loc: str = ""

    def operands(self) -> list:
        body = self.text.split("=", 1)[1] if self.results else self.text
        body = body.split(" loc(")[0]
        return [s.split("#")[0] for s in _SSA.findall(body)]


@dataclass
class Module:
    args: list  # the function's argument names, in order
    body: list  # of Op
    layouts: dict  # "#blocked1" -> attribute text
    locs: dict  # "#loc12" -> text
    num_warps: int


def parse(ttgir: str) -> Module:
    """The kernel function of a TTGIR module as a tree of ops."""
    layouts, locs, num_warps = {}, {}, 4
    lines = ttgir.splitlines()
    body_start = 0
    for i, line in enumerate(lines):  # attributes and locations: before and after the body
        m = re.match(r"(#[\w]+) = (.*)$", line)
        if m and m.group(1).startswith("#loc"):
            locs[m.group(1)] = m.group(2)
        elif m:
            layouts[m.group(1)] = m.group(2)
        w = re.search(r'"ttg.num-warps" = (\d+)', line)
        if w:
            num_warps = int(w.group(1))
        if "tt.func public" in line and not body_start:
            body_start = i
    args = re.findall(r"[(,]\s*(%[\w.$-]+):", lines[body_start])
    stack: list[list] = [[]]
    owners: list[Op] = []
    for line in lines[body_start + 1:]:
        s = line.strip()
        if not s or s.startswith("^bb"):
            continue
        if s.startswith("}"):
            rest = s[1:].strip()
            if not owners:  # the function's own end
                break
            region = stack.pop()
            owner = owners[-1]
            owner.regions.append(region)
            if rest.endswith("{"):  # "} else {", "} do {"
                stack.append([])
                continue
            owners.pop()
            m = _LOC.search(s)
            if m:
                owner.loc = m.group(1)
            if rest.startswith(")"):  # the end of a generic op's regions: its types
                owner.text += " " + rest
            continue
        m = _OP.match(s)
        if m is None:
            continue
        name = m.group(3)
        results = []
        if m.group(1):
            head = s.split("=", 1)[0]
            for r in re.findall(r"(%[\w.$-]+)(?::(\d+))?", head):
                results.append(r[0])
        op = Op(results, name, s)
        lm = _LOC.search(s)
        if lm:
            op.loc = lm.group(1)
        stack[-1].append(op)
        if s.endswith("{"):
            owners.append(op)
            stack.append([])
    return Module(args, stack[0], layouts, locs, num_warps)


def source_of(module: Module, loc: str, depth: int = 0) -> tuple[str, int]:
    """``(file, line)`` an op's location names (the callee's, through inlined calls)."""
    text = module.locs.get(loc, "")
    if depth > 50 or not text:
        return "", 0
    m = re.match(r'loc\("([^"]+)":(\d+):\d+\)', text)
    if m:
        return m.group(1), int(m.group(2))
    m = re.match(r"loc\(callsite\((#loc\d*) at (#loc\d*)\)\)", text)
    if m:
        return source_of(module, m.group(1), depth + 1)
    m = re.match(r'loc\("[^"]*"\((#loc\d*)\)\)', text)
    if m:
        return source_of(module, m.group(1), depth + 1)
    m = re.match(r"loc\(fused\[(#loc\d*)", text)
    if m:
        return source_of(module, m.group(1), depth + 1)
    return "", 0


# ------------------------------------------------------------------------------ layouts
def _tensor_types(text: str) -> list:
    """``(shape, element, layout)`` of every tensor type in ``text``, in order."""
    found, at = [], 0
    while (at := text.find("tensor<", at)) >= 0:
        depth, i = 0, at + len("tensor")
        for i in range(at + len("tensor"), len(text)):
            depth += {"<": 1, ">": -1}.get(text[i], 0)
            if depth == 0:
                break
        inner = text[at + len("tensor<"):i]
        at = i
        m = re.match(r"((?:\d+x)*)(!tt\.ptr<(\w+)>|\w+)\s*(?:,\s*(.*))?$", inner)
        if m:
            shape = [int(d) for d in m.group(1).split("x") if d]
            found.append((shape, m.group(3) or m.group(2), (m.group(4) or "").strip()))
    return found


def _tensor_type(text: str) -> tuple[list, str, str] | None:
    types = _tensor_types(text)
    return types[0] if types else None


def _blocked(attr: str) -> dict | None:
    m = re.search(r"sizePerThread = \[([\d, ]+)\], threadsPerWarp = \[([\d, ]+)\], "
                  r"warpsPerCTA = \[([\d, ]+)\], order = \[([\d, ]+)\]", attr)
    if m is None:
        return None
    return {k: [int(v) for v in m.group(i + 1).split(",")]
            for i, k in enumerate(("spt", "tpw", "wpc", "order"))}


def _dims(layout: str, module: Module, rank: int) -> tuple[list, list] | None:
    """A distributed layout per dimension of a rank-``rank`` tensor: ``(span, warps, stride)``
    (elements one warp covers, warps along it, its place in the warp index), and the sliced
    parent dimensions every element is replicated over, as ``(warps, stride)``; None where the
    layout is neither blocked nor a slice of a blocked one."""
    m = re.match(r"#ttg\.slice<\{dim = (\d+), parent = (#\w+)\}>", layout)
    if m:
        parent = _dims(m.group(2), module, rank + 1)
        if parent is None:
            return None
        dims, sliced = parent
        k = int(m.group(1))
        return ([d for i, d in enumerate(dims) if i != k],
                sliced + [(dims[k][1], dims[k][2])])
    b = _blocked(module.layouts.get(layout, ""))
    if b is None or len(b["spt"]) != rank:
        return None
    stride, strides = 1, [0] * rank
    for d in b["order"]:
        strides[d] = stride
        stride *= b["wpc"][d]
    return [(b["spt"][d] * b["tpw"][d], b["wpc"][d], strides[d]) for d in range(rank)], []


def _dim_warps(n: int, span: int, warps: int) -> list:
    """For each of ``n`` elements along a dimension, the warps (coordinates) that hold it: the
    layout's tile repeats over a longer dimension and wraps around a shorter one."""
    tile = span * warps
    if n >= tile:
        return [((i // span) % warps,) for i in range(n)]
    return [tuple(sorted({p // span for p in range(tile) if p % n == i})) for i in range(n)]


def crosses_warps(op: Op, module: Module) -> bool:
    """Whether a reduction, scan, histogram or layout conversion moves data between warps
    (through shared memory, with a barrier); unknown layouts count as crossing."""
    if module.num_warps == 1:
        return False
    t = _tensor_type(op.text)
    if t is None:
        return False
    shape, _, layout = t
    if op.name == "tt.histogram":
        return True
    if op.name in ("tt.reduce", "tt.scan"):
        axis = int(re.search(r"axis = (\d+)", op.text).group(1))
        dims = _dims(layout, module, len(shape))
        if dims is None:
            return True
        span, warps, _ = dims[0][axis]
        return warps > 1 and shape[axis] > span
    if op.name == "ttg.convert_layout":
        types = _tensor_types(op.text)
        src = _holders(shape, layout, module)
        dst = _holders(shape, types[-1][2], module) if len(types) > 1 else None
        return src is None or dst is None or any(not d <= s for s, d in zip(src, dst))
    return False


def _holders(shape: list, layout: str, module: Module) -> list | None:
    """The warps (linear indices) that hold each element of a tensor in ``layout``, in
    row-major element order; None for a layout not read here, or a tensor too large to list."""
    dims = _dims(layout, module, len(shape))
    if dims is None or math.prod(shape) > 1 << 16:
        return None
    along, sliced = dims
    extra = {0}
    for warps, stride in sliced:
        extra = {e + w * stride for e in extra for w in range(warps)}
    per_dim = [[{w * stride for w in ws} for ws in _dim_warps(n, span, warps)]
               for n, (span, warps, stride) in zip(shape, along)]
    out = []
    for index in itertools.product(*(range(n) for n in shape)):
        held = set(extra)
        for d, i in enumerate(index):
            held = {h + w for h in held for w in per_dim[d][i]}
        out.append(frozenset(held))
    return out


# ------------------------------------------------------------------------------ values
def _int_constant(text: str):
    m = re.search(r"arith\.constant\s+(-?\d+|true|false)\s*:\s*(i\d+|index)", text)
    if m is None:
        return None
    v = m.group(1)
    return {"true": 1, "false": 0}.get(v, None) if v in ("true", "false") else int(v)


def _evaluate(op: Op, values: dict, grid: tuple):
    """The value of a scalar integer op (None where it depends on data or a tensor)."""
    if "tensor<" in op.text.split(" loc(")[0].split("->")[-1] and op.name != "tt.get_program_id":
        return None
    name = op.name
    if name == "arith.constant":
        return _int_constant(op.text)
    if name == "tt.get_program_id":
        return 0
    if name == "tt.get_num_programs":
        axis = "xyz".index(re.search(r"get_num_programs\s+(\w)", op.text).group(1))
        return grid[axis]
    ins = [values.get(o) for o in op.operands()]
    if any(v is None for v in ins):
        return None
    if name in ("arith.extsi", "arith.extui", "arith.trunci", "arith.index_cast"):
        return ins[0]
    if name == "arith.select":
        return ins[1] if ins[0] else ins[2]
    if name == "arith.cmpi":
        pred = re.search(r"arith\.cmpi\s+(\w+)", op.text).group(1)
        a, b = ins
        return int({"eq": a == b, "ne": a != b, "slt": a < b, "sle": a <= b, "sgt": a > b,
                    "sge": a >= b, "ult": a < b, "ule": a <= b, "ugt": a > b,
                    "uge": a >= b}[pred])
    a, b = (ins + [0, 0])[:2]
    table = {
        "arith.addi": lambda: a + b, "arith.subi": lambda: a - b, "arith.muli": lambda: a * b,
        "arith.divsi": lambda: int(a / b) if b else None,
        "arith.divui": lambda: a // b if b else None,
        "arith.remsi": lambda: int(math.fmod(a, b)) if b else None,
        "arith.remui": lambda: a % b if b else None,
        "arith.ceildivsi": lambda: -(-a // b) if b else None,
        "arith.floordivsi": lambda: a // b if b else None,
        "arith.maxsi": lambda: max(a, b), "arith.minsi": lambda: min(a, b),
        "arith.maxui": lambda: max(a, b), "arith.minui": lambda: min(a, b),
        "arith.andi": lambda: a & b, "arith.ori": lambda: a | b, "arith.xori": lambda: a ^ b,
        "arith.shli": lambda: a << b, "arith.shrsi": lambda: a >> b,
        "arith.shrui": lambda: a >> b,
    }
    f = table.get(name)
    return f() if f else None


def _bytes(op: Op) -> int:
    t = _tensor_type(op.text)
    if t is None:
        m = re.search(r"!tt\.ptr<(\w+)>", op.text)
        return _DTYPE_BYTES.get(m.group(1), 4) if m else 0
    shape, elem, _ = t
    return math.prod(shape) * _DTYPE_BYTES.get(elem, 4)


# ------------------------------------------------------------------------------ the walk
@dataclass
class Path:
    """The busiest program's path through one compiled variant."""

    steps: float = 0.0
    bytes: float = 0.0  # loads plus stores (tile sizes), all trips
    inflight_bytes: float | None = None  # least bytes in flight at a row store's wait
    # inside a loop that stores rows: its barriers, and the reductions, layout conversions
    # across warps and index gathers that the rows it stores (their values, addresses, masks)
    # wait for
    barriers_in_row_loops: list = field(default_factory=list)  # "file:line what"
    unknown_loops: list = field(default_factory=list)  # "file:line for VAR": no trip count


class _Walk:
    def __init__(self, module: Module, scalars: dict, grid: tuple, hints: dict,
                 row_lines: set, live_lines: set = frozenset()):
        self.m = module
        self.values: dict = {a: scalars.get(a.lstrip("%")) for a in module.args}
        self.ready: dict = {}
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.hints = hints
        self.row_lines = row_lines  # (basename, line) of the row stores
        self.live_lines = live_lines  # (basename, line) of the loads and stores the routing masks
        self.loads_at: dict = {}  # issue step -> bytes
        self.loaded: dict = {}  # value -> the issue step of the latest load it is made from
        self.marks: dict = {}  # value -> the cross-warp ops and gathers of a row loop it needs
        self.path = Path()
        self.pipelines: list = []  # per loop being walked: (commit groups, copy bytes) a trip
        self.copies: set = set()  # the tokens of asynchronous copies
        self.used = set()
        self.trace: list | None = None

    def where(self, op: Op) -> str:
        f, line = source_of(self.m, op.loc)
        return f"{os.path.basename(f)}:{line}"

    def loop_name(self, op: Op, var: str) -> str:
        """The Python name of a loop's variable (``for NAME in range(...)`` on its source
        line), else the IR's."""
        m = re.search(r"\bfor\s+(\w+)\s+in\b", self.source_line(op))
        return m.group(1) if m else re.sub(r"_\d+$", "", var.lstrip("%"))

    def source_line(self, op: Op) -> str:
        """The op's source line; where a cached binary names a checkout that is not here, the
        file of the same name in this package (as ``compiled._resolve`` reads the PTX's)."""
        path, line = source_of(self.m, op.loc)
        for candidate in (path, os.path.join(_PACKAGE_DIR, os.path.basename(path))):
            try:
                with open(candidate) as f:
                    return f.read().splitlines()[line - 1]
            except (OSError, IndexError):
                continue
        return ""

    def marked(self, op: Op, tag: str) -> bool:
        """An op whose source line ends in ``# gate: <tag>``."""
        return re.search(rf"#\s*gate:\s*{tag}\s*$", self.source_line(op)) is not None

    def is_cold(self, op: Op) -> bool:
        """An ``if`` whose source line is marked ``# gate: cold``."""
        return self.marked(op, "cold")

    def rare(self, op: Op) -> float | None:
        """How often an ``if`` marked ``# gate: rare`` is taken (the hint :data:`RARE`)."""
        return self.hints[RARE] if RARE in self.hints and self.marked(op, "rare") else None

    def is_row_store(self, op: Op) -> bool:
        f, line = source_of(self.m, op.loc)
        return (os.path.basename(f), line) in self.row_lines

    def live_share(self, op: Op) -> float:
        """The share of a load's or store's lanes that move: :data:`LIVE`'s hint where it is
        marked."""
        f, line = source_of(self.m, op.loc)
        marked = (os.path.basename(f), line) in self.live_lines
        return self.hints.get(LIVE, 1.0) if marked else 1.0

    def pipelined_ahead(self, op: Op) -> int:
        """Trips of copies an ``async_wait`` inside a software-pipelined loop leaves in flight:
        its ``num`` (commit groups still outstanding) over the groups a trip commits."""
        m = re.search(r"\{num = (\d+)", op.text)
        return int(m.group(1)) // self.pipelines[-1][0] if m else 0

    def operands_ready(self, op: Op, skip=()) -> float:
        """When ``op``'s operands are there (``skip``: those it does not wait for: a loop's
        yield passes the tokens of its asynchronous copies on, their wait waits)."""
        return max([0.0] + [self.ready.get(o, 0.0) for o in op.operands() if o not in skip])

    def region(self, ops: list, start: float, row_loop: bool = False) -> tuple[float, float]:
        """Walks ``ops`` from step ``start``: ``(step at which the last op issued, bytes
        moved)``. Within a region an op issues once its operands are there (the compiler hoists
        loads over arithmetic), but no earlier than the stores, atomics and barriers before it
        (memory ops keep their order: a load cannot pass a store that may alias it), and loops,
        branches and waits run in order with everything else."""
        moved = 0.0
        floor = start  # no op issues before: the last barrier or control-flow op
        floor_mem = start  # no memory op issues before: the last store, atomic, barrier
        done = start  # the latest issue so far
        for op in ops:
            name = op.name
            if name in ("scf.for", "scf.while", "scf.if"):
                at = max(done, floor_mem, self.operands_ready(op))
                if name == "scf.for":
                    end, b = self.loop(op, at, row_loop)
                elif name == "scf.while":  # the polls' condition once: the peers arrived
                    end, b = self.region(op.regions[0], at) if op.regions else (at, 0.0)
                elif (p := self.rare(op)) is not None:  # each arm as often as it is taken
                    arms = [self.region(r, at, row_loop) for r in op.regions] + [(at, 0.0)]
                    end = at + p * (arms[0][0] - at) + (1 - p) * (arms[1][0] - at)
                    b = p * arms[0][1] + (1 - p) * arms[1][1]
                else:  # the heavier arm, but never a branch marked cold
                    regions = op.regions[1:] if self.is_cold(op) else op.regions
                    arms = [self.region(r, at, row_loop) for r in regions] or [(at, 0.0)]
                    end, b = max(e for e, _ in arms), max(b for _, b in arms)
                moved += b
                floor = floor_mem = done = end
                yields = [o for region in op.regions for y in region[-1:]
                          if y.name == "scf.yield" for o in y.operands()]
                made_of = max([-1.0] + [self.loaded.get(o, -1.0) for o in yields])
                marks = frozenset().union(*(self.marks.get(o, frozenset()) for o in yields))
                for r in op.results:
                    self.ready[r] = end
                    self.loaded[r] = made_of
                    self.marks[r] = marks
                continue
            passes_on = name in ("scf.yield", "ttg.async_commit_group")  # copies' tokens
            at = max(floor, self.operands_ready(op, skip=self.copies if passes_on else ()))
            loaded = max([-1.0] + [self.loaded.get(o, -1.0) for o in op.operands()])
            # what in this loop's trip the value waited for (kept inside loops that store rows)
            marks = frozenset().union(*(self.marks.get(o, frozenset()) for o in op.operands()))
            if name in ("ttg.async_copy_global_to_local", "ttg.async_commit_group"):
                self.copies.update(op.results)
            if name in ("tt.load", "ttg.async_copy_global_to_local"):  # (the copy: a token)
                at = max(at, floor_mem)
                if row_loop and op.operands() and self.loaded.get(op.operands()[0], -1.0) >= start:
                    marks = marks | {f"{self.where(op)} index gather"}
                n = _bytes(op) * self.live_share(op)
                moved += n
                self.loads_at[at] = self.loads_at.get(at, 0.0) + n
                ready = at + 1
                loaded = at
            elif name == "tt.store":
                at = max(at, floor_mem)
                floor_mem = at
                moved += _bytes(op) * self.live_share(op)
                ready = at
                if self.is_row_store(op):  # the loads issued with those of its rows
                    self.path.barriers_in_row_loops += sorted(marks)
                    value = op.operands()[1] if len(op.operands()) > 1 else None
                    t = self.loaded.get(value, -1.0)
                    batch = self.loads_at.get(t, 0.0) if t >= 0 else None
                    old = self.path.inflight_bytes
                    if batch is not None:
                        self.path.inflight_bytes = batch if old is None else min(old, batch)
            elif name in ("tt.atomic_rmw", "tt.atomic_cas"):
                at = max(at, floor_mem)
                ordered = re.search(r"\b(release|acquire|acq_rel)\b", op.text) is not None
                waits = ordered or name == "tt.atomic_cas" or any(r in self.used
                                                                  for r in op.results)
                ready = at + 1 if waits else at
                floor_mem = ready
                moved += _bytes(op)
            elif name in ("ttg.barrier", "gpu.barrier") or (
                    name in ("tt.reduce", "tt.scan", "tt.histogram", "ttg.convert_layout")
                    and crosses_warps(op, self.m)):
                at = max(at, done, floor_mem) if name.endswith("barrier") else at
                ready = at + BARRIER_STEPS
                floor = floor_mem = ready
                if row_loop and name.endswith("barrier"):  # every warp waits for every other
                    self.path.barriers_in_row_loops.append(f"{self.where(op)} barrier")
                elif row_loop:  # what the row data waits for, if it flows into a row store
                    marks = marks | {f"{self.where(op)} {name.split('.')[-1]} across warps"}
            elif name == "ttg.async_commit_group":  # issues at once; its token: when they land
                ready = self.operands_ready(op)
            elif name == "ttg.async_wait":  # the thread waits (then every warp, a barrier)
                at = max(at, done, floor_mem)
                ready = at
                # its tokens carried by the loop (a drain after a pipelined loop names none: it
                # waits for the copies of trips past the loop's end, which load nothing)
                carried = op.operands() and not any(o in self.ready for o in op.operands())
                if carried and self.pipelines and self.pipelines[-1][0]:  # in a loop that
                    # copies: the oldest of 1 + ahead trips' copies (issued in earlier trips, in
                    # flight for as many trips), a share of a step a trip
                    ahead = self.pipelined_ahead(op)
                    at = max(floor, done, floor_mem)
                    ready = at + 1 / (1 + ahead)
                    self.loads_at[at] = self.loads_at.get(at, 0.0) \
                        + (1 + ahead) * self.pipelines[-1][1]
                loaded = at
                floor = floor_mem = ready
            elif name == "tt.extern_elementwise" and "nvshmem" in op.text:
                at = max(at, floor_mem)
                ready = floor_mem = at + 1
            else:
                ready = at
                if op.results:
                    self.values[op.results[0]] = _evaluate(op, self.values, self.grid)
            done = max(done, at)
            for r in op.results:
                self.ready[r] = ready
                self.loaded[r] = loaded
                self.marks[r] = marks
        return max(done, floor, floor_mem), moved

    def _contains_row_store(self, ops: list) -> bool:
        for op in ops:
            if op.name == "tt.store" and self.is_row_store(op):
                return True
            if op.name == "scf.if" and any(self._contains_row_store(r) for r in op.regions):
                return True
        return False

    def loop(self, op: Op, now: float, in_row_loop: bool = False) -> tuple[float, float]:
        m = re.match(r"(?:%[\w.$-]+(?::\d+)?\s*=\s*)?scf\.for\s+(%[\w.$-]+)\s*=\s*"
                     r"(%[\w.$-]+)(?:#\d+)?\s+to\s+(%[\w.$-]+)(?:#\d+)?\s+step\s+"
                     r"(%[\w.$-]+)(?:#\d+)?", op.text)
        var, lb, ub, step = m.groups()
        base = self.loop_name(op, var)
        lo, hi, st = (self.values.get(v) for v in (lb, ub, step))
        here = self.where(op)
        if here in self.hints or base in self.hints:
            trips = self.hints.get(here, self.hints.get(base))
        elif None in (lo, hi, st) or st <= 0:
            self.path.unknown_loops.append(f"{here} for {base}")
            trips = 1
        else:
            trips = max(0, -(-(hi - lo) // st))
        # the induction variable takes its last value (loops bounded by it see the most)
        last = None
        if None not in (lo, st) and trips >= 1:
            last = lo + (int(trips) - 1) * st
        self.values[var] = last if last is not None else lo
        row_loop = in_row_loop or (self._contains_row_store(op.regions[0]) if op.regions
                                   else False)
        # the loop's iter_args are its own values: a sibling region may have printed the same
        # names (MLIR numbers them per region), whose times they must not take
        for arg in _ITER_ARG.findall(op.text.split("iter_args(", 1)[1] if "iter_args(" in op.text
                                     else ""):
            for table in (self.ready, self.loaded, self.marks):
                table.pop(arg, None)
        start = now
        body = op.regions[0] if op.regions else []
        self.pipelines.append((
            sum(o.name == "ttg.async_commit_group" for o in body),
            sum(_bytes(o) * self.live_share(o) for o in body
                if o.name == "ttg.async_copy_global_to_local")))
        end, moved = self.region(body, start, row_loop) if body else (now, 0.0)
        self.pipelines.pop()
        per_trip = end - start
        now = start + trips * per_trip
        if self.trace is not None:
            self.trace.append(f"{here} for {base}: {trips} trips x {per_trip:g} steps")
        for r in op.results:
            self.ready[r] = now
        return now, trips * moved


def _uses(ops: list, used: set) -> None:
    for op in ops:
        used.update(op.operands())
        for r in op.regions:
            _uses(r, used)


def analyse(ttgir: str, scalars: dict, grid: tuple, hints: dict | None = None,
            row_lines: set | None = None, live_lines: set | None = None) -> Path:
    """The busiest program's :class:`Path` through a compiled kernel launched with ``grid``
    and scalar arguments ``scalars`` (by name); ``hints``: trips of loops bounded by loaded
    data, by induction variable (and :data:`LIVE`); ``row_lines`` / ``live_lines``: ``(file
    basename, line)`` of the row stores / of the loads and stores the routing masks (``live``)."""
    return walk(parse(ttgir), scalars, grid, hints, row_lines, live_lines)


def walk(module: Module, scalars: dict, grid: tuple, hints: dict | None = None,
         row_lines: set | None = None, live_lines: set | None = None) -> Path:
    """:func:`analyse` of a module already parsed (:func:`parse`; the walk leaves it as it
    was, so one parse serves every launch of the kernel)."""
    w = _Walk(module, scalars, grid, hints or {}, row_lines or set(), live_lines or set())
    _uses(module.body, w.used)
    end, moved = w.region(module.body, 0.0)
    w.path.steps = end
    w.path.bytes = moved
    return w.path


def resident_programs(regs: int, num_warps: int, smem_bytes: int = 0) -> int:
    """Programs of one kernel an SM holds at once (registers, warps, shared memory)."""
    threads = 32 * num_warps
    by_regs = REGISTERS_PER_SM // max(1, regs * threads)
    by_warps = WARPS_PER_SM // num_warps
    by_smem = (228 * 1024) // smem_bytes if smem_bytes else 32
    return max(1, min(by_regs, by_warps, by_smem, 32))


def predicted_us(path: Path, programs: int, regs: int, num_warps: int, smem_bytes: int = 0,
                 sms: int = GPU_SMS) -> float:
    """The launch's predicted device time: its busiest program's steps, once per wave of
    programs the GPU holds at once, or its bytes over the SMs it runs on, whichever is
    slower."""
    waves = math.ceil(programs / (sms * resident_programs(regs, num_warps, smem_bytes)))
    latency = waves * path.steps * LATENCY_US
    throughput = path.bytes * programs / (min(programs, sms) * SM_GBPS * 1e3)
    return max(latency, throughput)
