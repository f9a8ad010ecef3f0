"""The static gate: every kernel as the Buffer launches it on a GPU, compiled and read.

    python -m moe_comm.testing.gate [--arch 90 100] [--brief-arch 100] [--jobs N] [--out TSV]
                                    [--cover all|pairs] [--list]
                            [--schedules]

Virtual ranks on the ``meta`` device (no memory, no GPU) drive the public ops with the GPU
flavours (in-kernel waits; across nodes also NVSHMEM puts): normal-mode dispatch in every FP8
mode (MXFP8 and NVFP4 in bf16), combine (also with FP8 partials in bf16), their backward (cached
dispatch, combine with router-weight gradients), and the low-latency pair, for a small size
and DeepSeek-V3 prefill and decode sizes, every dtype the ops take. Triton's own launch path
records each launch (``kernels.recording``): the specialisation is the one a GPU run would
compile, chosen by the same code. Each distinct variant is compiled
for every ``--arch`` and read (``kernels.compiled``); the gate fails when a variant

* specialises differently on two ranks or two calls (a rank that recompiles makes its peers
  wait),
* spills or keeps anything in local memory (stack > 0),
* stores row data narrower than 16 bytes where rows are 16-byte aligned (UE8M0 exponent bytes
  excepted: ``kernels.compiled.MIN_STORE_BITS``),
* issues a thread-scoped NVSHMEM call from more than one thread, or a block-scoped one from
  fewer than the whole block,
* publishes a signal without release ordering, or acquires one without acquire ordering,
* loads host memory (the error record, the proxy's ring) more than once per program, or
  inside a loop or a spin,
* at the DeepSeek-V3 sizes (``kernels.tiles.SCHEDULES``: each kernel's kind and serial loop
  bound, from the grid and arguments the recording captured): runs more than 32 serial trips
  in a program, launches more than ``num_sms`` programs for a kernel that waits or may overlap
  compute (sends, receives that wait), or fewer than a wave of 132 for a row mover that waits
  for nothing. These speed rules read the bf16 and fp16 variants (what DeepSeek-V3 runs in),
  the low-latency kernels at the decode sizes only, and no variant of the proxy (its GPU half
  is not built: it runs on CPU ranks), which the host-memory rule leaves alone too.

One row per variant and architecture goes to the TSV; the table is printed; the exit status is
1 when anything failed. NVSHMEM-linked variants are built at the DeepSeek-V3 sizes in bf16 (the
flavour changes only the send kernels' NVSHMEM paths), and so are the low-latency kernels of
the proxy flavour (descriptors posted into the ring; two nodes); every other flavour at every
size and dtype. The fault-tolerant flavour (waits that exclude a silent peer and the kernel
the host excludes one with) is built at the DeepSeek-V3 sizes in bf16, both modes, on one node.
The proxy flavour covers the normal mode too, flat and hierarchical (its
outbox and forwarding kernels), as launched around the host waits it still has between them.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import csv
import inspect
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field

GATE_DTYPES = ("bfloat16", "float16", "float32", "float64")
# driven once, not once per rank
STANDALONE = ("quantize_kernel", "checked_topk_idx_kernel", "set_word_on_all_kernel")


@dataclass(frozen=True)
class GateConfig:
    name: str
    world_size: int
    num_experts: int
    hidden: int
    topk: int
    tokens: int
    nvshmem: bool  # also build the NVSHMEM flavour at this size
    ring_slots: int | None = None  # bounded staging: the normal mode runs in rounds


CONFIGS = (
    GateConfig("small", 2, 8, 512, 2, 64, nvshmem=False),
    GateConfig("dsv3-prefill", 8, 256, 7168, 8, 4096, nvshmem=True),
    GateConfig("dsv3-decode", 8, 256, 7168, 8, 128, nvshmem=True),
    # bounded staging: every normal-mode call in 8 rounds of 512 slots per source (bf16; one
    # node, flat and hierarchical across two nodes through the proxy, across hosts over NVSHMEM;
    # one node runs a combine's rounds, FP8 too, as one launch: kernels.combine_rounds)
    GateConfig("dsv3-prefill-rounds", 8, 256, 7168, 8, 4096, nvshmem=True, ring_slots=512),
)


GATE_NUM_SMS = 20  # the num_sms of the gate's Buffers (the GPU default)
MAX_LL_STEPS = 20  # dependent steps of a low-latency program (about 0.5 us each)
MIN_INFLIGHT_KB = 32  # row loads in flight per wait of a normal-mode row mover
# normal-mode row movers of one node whose rows wait on nothing inside their row loops (no
# barrier across warps, reduction, layout conversion or index gather there), held as the
# low-latency kernels' are, in the dtypes named; their variants that move rows as they are
# (FP8=0) are held to MIN_INFLIGHT_KB too
SPEED_DTYPES = ("bfloat16", "float16")  # what the speed rules read (DeepSeek-V3 runs in bf16)
HELD_ROW_LOOPS = {"dispatch_send_kernel": SPEED_DTYPES, "dispatch_expand_kernel": SPEED_DTYPES,
                  # fp16 rows: a fuller tile loads its further rows' indices in its loop (holding
                  # every row spills 8 to 16 bytes under Triton 3.6)
                  "combine_send_kernel": ("bfloat16",)}
DSV3 = ("dsv3-prefill", "dsv3-decode", "dsv3-prefill-rounds")


@dataclass
class Variant:
    """One distinct specialisation: where it was seen, and the launch to compile."""

    launch: object
    configs: list
    dtype: str
    rows_aligned: bool
    problems: list
    # config -> (kind, most programs, most serial trips, blocks of work) over its launches
    # (kernels.tiles)
    schedule: dict = field(default_factory=dict)
    # config -> (grid, arguments) of its launch with the most serial trips: what
    # kernels.critical_path walks
    heaviest: dict = field(default_factory=dict)

    def see(self, cfg: GateConfig, launch) -> None:
        """Adds a launch of this variant at ``cfg``: its grid and serial trips (the
        schedules' counts at uniform routing read the config's tokens and top-k)."""
        from ..kernels.tiles import schedule_blocks, schedule_facts

        args = dict(launch.scalars, ROUTED_TOKENS=cfg.tokens, ROUTED_TOPK=cfg.topk,
                    ROUTED_EXPERTS=cfg.num_experts)
        kind, programs, trips = schedule_facts(launch.name, launch.grid, args)
        _, p0, t0, _ = self.schedule.get(cfg.name, (kind, 0, -1, 0))
        self.schedule[cfg.name] = (kind, max(p0, programs), max(t0, trips),
                                   schedule_blocks(launch.name, launch.grid, args))
        if trips > t0:
            self.heaviest[cfg.name] = (tuple(launch.grid), args)

    def schedule_problems(self) -> list[str]:
        """The grid and serial-trip rules at the DeepSeek-V3 sizes, for kernels that run on
        GPUs (``kernels.tiles.SCHEDULES``)."""
        from ..kernels.tiles import SCHEDULES, schedule_problems

        schedule = SCHEDULES[self.launch.name]
        if not self.on_gpus or self.dtype not in SPEED_DTYPES:
            return []
        found = []
        for cfg_name, (kind, programs, trips, blocks) in sorted(self.schedule.items()):
            if cfg_name in (("dsv3-decode",) if schedule.decode else DSV3):
                found += [f"{p} [{cfg_name}]" for p in schedule_problems(
                    self.launch.name, kind, programs, trips, GATE_NUM_SMS, blocks)]
        return found

    def analysis(self) -> dict:
        """What ``kernels.critical_path`` walks for this variant: per config, the grid and
        arguments of its heaviest launch, the trips of its loops bounded by data
        (``Schedule.loops``, at uniform routing), the live share of its masked gathers
        (``Schedule.live``) and how often its rare branch is taken (``Schedule.rare``)."""
        from ..kernels.critical_path import LIVE, RARE
        from ..kernels.tiles import SCHEDULES

        schedule = SCHEDULES[self.launch.name]
        out = {}
        for cfg_name, (grid, args) in self.heaviest.items():
            a = dict(args, grid0=grid[0], grid1=grid[1], grid2=grid[2],
                     programs=grid[0] * grid[1] * grid[2])
            hints = {name: trips(a) for name, trips in schedule.loops.items()}
            if schedule.live is not None:
                hints[LIVE] = schedule.live(a)
            if schedule.rare is not None:
                hints[RARE] = schedule.rare(a)
            out[cfg_name] = (grid, args, hints)
        return out

    def rule_paths(self, facts) -> dict:
        """The paths the speed rules read: at the DeepSeek-V3 sizes (decode for a low-latency
        kernel), of the bf16 and fp16 variants that run on GPUs."""
        from ..kernels.tiles import SCHEDULES

        decode = SCHEDULES[self.launch.name].decode
        if not self.on_gpus or self.dtype not in SPEED_DTYPES:
            return {}
        return {c: p for c, p in facts.paths.items()
                if c in (("dsv3-decode",) if decode else DSV3)}

    def path_problems(self, facts) -> tuple[list[str], list[str]]:
        """``(problems, notes)`` of the busiest program's path (``kernels.critical_path``)
        at the configs of :meth:`rule_paths`. Problems: a low-latency kernel of one node (its
        stores through peer pointers) with a loop whose trips the bounds do not give, more than
        ``MAX_LL_STEPS`` dependent steps, or a barrier across warps, reduction or index gather
        that its rows wait for inside a loop that stores them; the last also for the normal
        mode's row movers of one node (``HELD_ROW_LOOPS``), and for those that move rows as
        they are less than ``MIN_INFLIGHT_KB`` of row loads in flight at a wait. Notes, the
        same facts of the rest of the normal mode (and of the transports' low-latency
        kernels): what its rework has to reach, not yet held."""
        from ..kernels.tiles import PERSISTENT, SCHEDULES, WAVE, WHOLE_GPU

        kind = SCHEDULES[self.launch.name].kind
        one_node = self.launch.flags().get("TRANSPORT", 0) == 0
        held = kind == WHOLE_GPU and one_node
        held_row_loops = held or (one_node
                                  and self.dtype in HELD_ROW_LOOPS.get(self.launch.name, ()))
        held_inflight = held_row_loops and not held and self.launch.flags().get("FP8", 0) == 0
        problems, notes = [], []
        for cfg_name, path in sorted(self.rule_paths(facts).items()):
            where = f" [{cfg_name}]"
            found = []
            if path["unknown_loops"]:
                found.append("loops whose trips the bounds do not give (declare them in "
                             "kernels/tiles.SCHEDULES): " + ", ".join(path["unknown_loops"])
                             + where)
            if kind == WHOLE_GPU and path["steps"] > MAX_LL_STEPS:
                found.append(f"{path['steps']:g} dependent steps in a program (a low-latency "
                             f"kernel takes at most {MAX_LL_STEPS})" + where)
            if path["in_row_loops"]:
                (problems if held_row_loops else found).append(
                    "rows wait inside a loop that stores them for: "
                    + ", ".join(path["in_row_loops"]) + where)
            if (kind in (PERSISTENT, WAVE) and path["inflight_kb"] is not None
                    and path["inflight_kb"] < MIN_INFLIGHT_KB):
                (problems if held_inflight else found).append(
                    f"{path['inflight_kb']:.1f} KB of row loads in flight at a wait "
                    f"(at least {MIN_INFLIGHT_KB})" + where)
            (problems if held else notes).extend(found)
        return problems, notes

    @property
    def on_gpus(self) -> bool:
        """Whether this variant runs on GPUs today: not the proxy's (transport 2: its GPU half
        is not built, it runs on CPU ranks), whose speed rules wait for it."""
        from ..kernels.tiles import SCHEDULES

        return SCHEDULES[self.launch.name].gpu and self.launch.flags().get("TRANSPORT") != 2


# ------------------------------------------------------------------------------ recording
def _buffers(cfg: GateConfig, dtype, low_latency: bool, transport: int, arch: int,
             hierarchical: bool = False, fault_tolerant: bool = False, invariant: bool = False):
    """Virtual ranks on the meta device with the GPU flavour (``transport`` 1: NVSHMEM; 2: the
    proxy, two nodes, ``hierarchical`` or flat; ``fault_tolerant``: the waits exclude silent
    peers; ``invariant``: the EP-invariant combine); their waits, the proxy's forwarders' too,
    are kernels (``warmup.twins``)."""
    import torch

    from ..buffer import Buffer
    from ..kernels.comm import Flavour
    from ..kernels.nvshmem import device_bitcode
    from ..plan import BufferPlan
    from ..warmup import RingStandIn, twins
    from ..workspace import WorkspaceLayout

    L = cfg.num_experts // cfg.world_size
    proxy = transport == 2  # two nodes; the ring's address does not change what compiles
    N = cfg.world_size // 2 if proxy else None
    layout = WorkspaceLayout(cfg.world_size, cfg.tokens, cfg.hidden, L, cfg.topk, dtype,
                             low_latency, rdma=transport == 1, proxy=proxy, ranks_per_node=N,
                             hierarchical=hierarchical, ring_slots=cfg.ring_slots,
                             invariant=invariant)
    elem = torch.empty((), dtype=dtype).element_size()
    flavour = Flavour(transport=transport, device_wait=True, compiled=True,
                      bitcode=device_bitcode(arch) if transport == 1 else "",
                      row_align=16 if cfg.hidden * elem % 16 == 0 else elem,
                      ring_slots=RingStandIn.slots if proxy else 0, ranks_per_node=N or 0,
                      hierarchical=layout.hierarchical, fault_tolerant=fault_tolerant,
                      mask_off=layout["ft_mask"].offset)
    plan = BufferPlan(layout, cfg.num_experts, (None, "nvshmem", "nixl")[transport],
                      GATE_NUM_SMS)
    buffers = twins(Buffer, plan, flavour, proxy=proxy,
                    own_process=True)  # as one process per GPU launches
    for buf in buffers:
        buf.backend = "gate"
    return buffers


def _inputs(cfg: GateConfig, dtype):
    import torch

    def meta(*shape, dt):
        return [torch.empty(shape, dtype=dt, device="meta") for _ in range(cfg.world_size)]

    return (meta(cfg.tokens, cfg.hidden, dt=dtype), meta(cfg.tokens, cfg.topk, dt=torch.int64),
            meta(cfg.tokens, cfg.topk, dt=torch.float32))


def max_recv_rows(cfg: GateConfig) -> int:
    """The ``max_recv_rows`` the drivers pass (no host read on the meta device), as a user
    would size it: twice the rows a rank receives at uniform routing (``tokens * topk``: every
    source sends it ``tokens * topk / world_size``)."""
    return 2 * cfg.tokens * cfg.topk


def drive_normal(bufs, cfg: GateConfig, dtype) -> None:
    """Every normal-mode launch the Buffer makes, each op called twice in a row (both
    parities; ``_specialisation_problems`` compares the two calls)."""
    import torch

    from . import lockstep

    xs, idxs, ws = _inputs(cfg, dtype)
    rows = max_recv_rows(cfg)
    fp8_ok = dtype != torch.float64 and cfg.hidden % 128 == 0
    modes = [dict(weights=True), dict(weights=False)]
    if fp8_ok:
        modes += [dict(weights=True, fp8=True), dict(weights=True, fp8=True, ue8m0=True),
                  dict(weights=True, pair=True)]
    if fp8_ok and dtype == torch.bfloat16:  # MXFP8 and NVFP4: 32- and 16-channel groups
        for fmt in ("mxfp8", "nvfp4"):
            modes += [dict(weights=True, fmt=fmt), dict(weights=True, pair=True, fmt=fmt)]
    for i, mode in enumerate(modes):
        fmt = mode.get("fmt")
        for _ in range(2):
            if mode.get("pair"):
                pairs = [_quantized_meta(x.shape, cfg.hidden, fmt) for x in xs]
                res = lockstep.dispatch(bufs, pairs, idxs, ws, max_recv_rows=rows,
                                        dispatch_dtype=fmt)
            else:
                res = lockstep.dispatch(bufs, xs, idxs, ws if mode["weights"] else None,
                                        fp8=None if fmt else mode.get("fp8", False),
                                        ue8m0=mode.get("ue8m0", False), max_recv_rows=rows,
                                        dispatch_dtype=fmt)
        if i == 0:  # combine and both backward ops follow the weighted bf16 dispatch
            _drive_combines(bufs, cfg, dtype, xs, res, rows)
    if bufs[0].layout.rounds == 1:  # rows by slot (the DeepEP facade's), bf16 and FP8
        for fp8 in (False, True) if fp8_ok else (False,):
            for _ in range(2):
                lockstep.dispatch(bufs, xs, idxs, ws, fp8=fp8, max_recv_rows=rows,
                                  by_slot=True)


def _quantized_meta(shape, hidden: int, fmt: str | None) -> tuple:
    """A quantized input on the meta device: (x_fp8, scales) per 128 channels or MXFP8's, or
    NVFP4's (values, scales, global scale)."""
    import torch

    def meta(size, dt):
        return torch.empty(size, dtype=dt, device="meta")

    T = shape[0]
    if fmt == "nvfp4":
        return (meta((T, hidden // 2), torch.uint8), meta((T, hidden // 16), torch.float8_e4m3fn),
                meta((1,), torch.float32))
    if fmt == "mxfp8":
        return meta(shape, torch.float8_e4m3fn), meta((T, hidden // 32), torch.float8_e8m0fnu)
    return meta(shape, torch.float8_e4m3fn), meta((T, hidden // 128), torch.float32)


def _drive_combines(bufs, cfg: GateConfig, dtype, xs, res, rows: int) -> None:
    import torch

    from . import lockstep

    handles = [r.handle for r in res]
    ys = [torch.empty((rows, cfg.hidden), dtype=dtype, device="meta") for _ in bufs]
    for weights in ([r.weights for r in res], None):
        for _ in range(2):
            lockstep.combine(bufs, ys, handles, weights)
    if _fp8_combine_ok(bufs, cfg, dtype):  # FP8 partials: quantized sends, dequantizing sums
        for _ in range(2):
            lockstep.combine(bufs, ys, handles, [r.weights for r in res], combine_dtype="fp8")
    for _ in range(2):  # the backward of combine: a dispatch of the cached layout
        lockstep.dispatch_cached(bufs, xs, handles)
    for _ in range(2):  # the backward of dispatch: a combine with router-weight gradients
        lockstep.combine_with_pairs(bufs, ys, handles,
                                    [torch.empty(rows, device="meta") for _ in bufs])


def _fp8_combine_ok(bufs, cfg: GateConfig, dtype) -> bool:
    """Where the gate drives a combine that sends FP8: H % 128 == 0, Triton kernels, bf16 (the
    other 16/32-bit dtypes change only the load of y)."""
    import torch

    return (cfg.hidden % 128 == 0 and dtype == torch.bfloat16 and bufs[0].kernel_impl == "triton"
            and not bufs[0].ep_invariant)


def drive_low_latency(bufs, cfg: GateConfig, dtype) -> None:
    """Every low-latency launch, two calls each (both parities)."""
    import torch

    from . import lockstep

    xs, idxs, ws = _inputs(cfg, dtype)
    fp8_ok = dtype != torch.float64 and cfg.hidden % 128 == 0
    modes = [dict(fp8=False)] + ([dict(fp8=True), dict(fp8=True, ue8m0=True)] if fp8_ok else [])
    if fp8_ok and dtype == torch.bfloat16 and bufs[0].kernel_impl == "triton":
        modes[1:1] = [dict(dispatch_dtype="mxfp8"), dict(dispatch_dtype="nvfp4")]
    for mode in modes:
        for _ in range(2):
            recvs = lockstep.low_latency_dispatch(bufs, xs, idxs, **mode)
    for zero_copy in (False, True):
        for _ in range(2):
            ys = [b.low_latency_combine_buffer() if zero_copy else
                  torch.empty(r.x.shape, dtype=dtype, device="meta") for b, r in zip(bufs, recvs)]
            lockstep.low_latency_combine(bufs, ys, idxs, ws, [r.handle for r in recvs])
    if _fp8_combine_ok(bufs, cfg, dtype):
        for _ in range(2):
            ys = [torch.empty(r.x.shape, dtype=dtype, device="meta") for r in recvs]
            lockstep.low_latency_combine(bufs, ys, idxs, ws, [r.handle for r in recvs],
                                         combine_dtype="fp8")


def drive_quantize(cfg: GateConfig, dtype) -> None:
    import torch

    from ..kernels.quant import quantize_fp8

    if dtype != torch.float64 and cfg.hidden % 128 == 0:
        x = torch.empty((cfg.tokens, cfg.hidden), dtype=dtype, device="meta")
        for ue8m0 in (False, True):
            quantize_fp8(x, ue8m0)


def drive_checked_ids(cfg: GateConfig) -> None:
    """The id check that runs before the csrc/ low-latency kernels (``kernel_impl="cuda"``)."""
    import torch

    from ..kernels.comm import Flavour
    from ..kernels.layout import checked_topk_idx

    idx = torch.empty((cfg.tokens, cfg.topk), dtype=torch.int64, device="meta")
    for record in (True, False):  # dispatch, combine
        checked_topk_idx(idx, cfg.num_experts, Flavour(device_wait=True, compiled=True), record)


CHECKED_IDS_CONFIGS = ("small", "dsv3-decode")  # where the csrc/ low-latency kernels run


def gate_runs(cfg: GateConfig) -> list[tuple]:
    """The Buffers the gate drives at ``cfg``: ``(dtype name, dtype, transport, low_latency,
    hierarchical[, fault_tolerant[, invariant]])`` (the arguments of ``_buffers`` after the
    dtype). The EP-invariant combine runs on one node and flat through the proxy, in bf16 (the
    other dtypes change only how rows are loaded)."""
    import torch

    invariant = ("bfloat16", torch.bfloat16, 0, False, False, False, True)
    if cfg.nvshmem:  # and flat through the proxy
        invariant = [invariant, ("bfloat16", torch.bfloat16, 2, False, False, False, True)]
    else:
        invariant = [invariant]
    if cfg.ring_slots is not None:  # rounds: the normal mode of one node and flat through
        runs = [("bfloat16", torch.bfloat16, 0, False, False),  # the proxy (fault-tolerant
                ("bfloat16", torch.bfloat16, 0, False, False, True),  # too), hierarchical
                ("bfloat16", torch.bfloat16, 2, False, False),  # through the proxy, in bf16
                ("bfloat16", torch.bfloat16, 2, False, False, True),  # (the other dtypes
                ("bfloat16", torch.bfloat16, 2, False, True)]  # load rows alone), over NVSHMEM
        # and the EP-invariant combine of one node and flat through the proxy, fault-tolerant
        # too
        ft_invariant = [("bfloat16", torch.bfloat16, 0, False, False, True, True),
                        ("bfloat16", torch.bfloat16, 2, False, False, True, True)]
        return runs + invariant + ft_invariant + (
            [("bfloat16", torch.bfloat16, 1, False, False)] if cfg.nvshmem else [])
    runs = list(invariant)
    for name in GATE_DTYPES:
        dtype = getattr(torch, name)
        for transport in ((0, 1) if cfg.nvshmem and dtype == torch.bfloat16 else (0,)):
            runs.append((name, dtype, transport, False, False))
            runs.append((name, dtype, transport, True, False))
        if cfg.nvshmem and dtype == torch.bfloat16:  # the proxy and fault-tolerant flavours
            runs += [(name, dtype, 2, True, False), (name, dtype, 2, False, False),
                     (name, dtype, 2, False, True), (name, dtype, 0, False, False, True),
                     (name, dtype, 0, True, False, True)]
    return runs


def record_config(cfg: GateConfig, arch: int) -> dict[str, Variant]:
    """The distinct variants the ops launch at ``cfg`` (key -> Variant), with the problems
    seen while recording (a kernel specialised differently per rank or per call)."""
    import torch

    from ..kernels.recording import recording

    variants: dict[str, Variant] = {}
    for name, dtype, transport, low_latency, *flags in gate_runs(cfg):
        bufs = _buffers(cfg, dtype, low_latency, transport, arch, *flags)
        with recording(arch) as launches:
            (drive_low_latency if low_latency else drive_normal)(bufs, cfg, dtype)
            if flags[1:] == [True] and not low_latency:  # what a host excludes a peer with
                bufs[0].fault.exclude(1)
        if not low_latency and not transport:
            with recording(arch) as standalone:
                drive_quantize(cfg, dtype)
                if name == "bfloat16" and cfg.name in CHECKED_IDS_CONFIGS:
                    drive_checked_ids(cfg)
            launches = launches + standalone
        elem = torch.empty((), dtype=dtype).element_size()
        aligned = cfg.hidden * elem % 16 == 0
        for problem in _specialisation_problems(launches, cfg.world_size):
            print(f"FAIL {cfg.name} {name}: {problem}", file=sys.stderr)
            variants.setdefault(f"problem:{problem}", Variant(launches[0], [cfg.name], name,
                                                              aligned, [problem]))
        for launch in launches:
            v = variants.setdefault(launch.key, Variant(launch, [], name, aligned, []))
            if cfg.name not in v.configs:
                v.configs.append(cfg.name)
            v.see(cfg, launch)
    return variants


def _specialisation_problems(launches, world_size: int) -> list[str]:
    """The drivers launch each kernel for ranks 0..R-1 in turn, and call every op twice in a
    row: each group of R launches must be one specialisation (ranks agree), and the two calls
    of an op the same one (parities, epochs and tickets change nothing)."""
    order: dict[str, list] = {}
    for launch in launches:
        if launch.name not in STANDALONE:  # launched once per call, not per rank
            order.setdefault(launch.name, []).append(launch.key)
    problems = []
    for name, keys in order.items():
        groups = [keys[i:i + world_size] for i in range(0, len(keys), world_size)]
        if any(len(set(g)) > 1 for g in groups):
            problems.append(f"{name} specialises differently on different ranks")
        if any(groups[i] != groups[i + 1] for i in range(0, len(groups) - 1, 2)):
            problems.append(f"{name} specialises differently on two calls of one op")
    return problems


def record_configs(configs=CONFIGS, arch: int = 90) -> dict[str, dict[str, Variant]]:
    """:func:`record_config` of each config, by name (one recording for ``--list`` and
    ``--schedules`` together)."""
    return {cfg.name: record_config(cfg, arch) for cfg in configs}


def variant_list(configs=CONFIGS, arch: int = 90, recorded=None) -> list[str]:
    """What the drivers launch at each config, one line per distinct ``config kernel dtype
    flags`` (tiles and warps left out: they follow from the sizes), sorted; recorded, not
    compiled (``--list``; ``recorded``: :func:`record_configs` made already).
    ``tests/gate_variants.txt`` holds the list the tests expect, so a format, flavour or op
    that drops out of a driver fails them."""
    recorded = recorded or record_configs(configs, arch)
    lines = set()
    for cfg in configs:
        for key, v in recorded[cfg.name].items():
            if not key.startswith("problem:"):
                lines.add(f"{cfg.name} {v.launch.name} {_variant_flags(v.launch, v.dtype)}")
    return sorted(lines)


def schedule_table(configs=CONFIGS, arch: int = 90, recorded=None
                   ) -> tuple[list[str], list[str]]:
    """``(lines, problems)``: per recorded variant ``config kernel dtype kind programs trips``
    (``kernels.tiles.SCHEDULES``), and what the grid and serial-trip rules find; recorded, not
    compiled (``--schedules``; ``recorded`` as in :func:`variant_list`)."""
    recorded = recorded or record_configs(configs, arch)
    lines, problems = set(), []
    for cfg in configs:
        for key, v in recorded[cfg.name].items():
            if key.startswith("problem:"):
                continue
            kind, programs, trips, _ = v.schedule[cfg.name]
            lines.add(f"{cfg.name} {v.launch.name} {v.dtype} {kind} programs={programs} "
                      f"trips={trips}")
            problems += [f"{v.launch.name} {_variant_flags(v.launch, v.dtype)}: {p}"
                         for p in v.schedule_problems() if f"[{cfg.name}]" in p]
    return sorted(lines), sorted(set(problems))


# ------------------------------------------------------------------------------ compiling
def _variant_flags(launch, dtype: str) -> str:
    shown = [f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in launch.flags().items()
             if not k.startswith("BLOCK_") and k not in ("NUM_THREADS", "KMAX", "META_STRIDE")]
    return " ".join([dtype, *shown])


def _variant_text(launch, dtype: str) -> str:
    flags = launch.flags()
    tiles = "x".join(str(flags[k]) for k in ("BLOCK_T", "BLOCK_H") if k in flags)
    return (f"{_variant_flags(launch, dtype)} tile={tiles} "
            f"warps={launch.options.get('num_warps')}")


def _compile_job(job):
    """In a worker process: re-import the kernel, compile for ``arch``, read it."""
    (module, name, signature, constexprs, attrs, options, key, arch, config, variant,
     analysis) = job
    os.environ["TRITON_INTERPRET"] = "0"
    import importlib

    from ..kernels.compiled import inspect_launch
    from ..kernels.nvshmem_slim import slim_bitcode, with_library
    from ..kernels.recording import Launch

    kernel = getattr(importlib.import_module(module), name)
    if "libnvshmem_device" in dict(options.get("extern_libs") or ()):
        # the same code as the whole library, linked in a fifth of the time
        options = with_library(options, slim_bitcode(arch))
    launch = Launch(kernel, signature, constexprs, attrs, options, key)
    return inspect_launch(launch, arch, config, variant, analysis)


def _source_file(v: Variant) -> str:
    """The file name of the module ``v``'s kernel is defined in."""
    return os.path.basename(inspect.getsourcefile(v.launch.kernel.fn))


def _jobs(variants, archs, brief_archs, brief: set) -> list[tuple]:
    """The compile jobs of ``variants``: each for every arch of ``archs``, and for
    ``brief_archs`` too where its id is in ``brief``."""
    work = []
    for v in variants:
        launch = v.launch
        for arch in [*archs, *(brief_archs if id(v) in brief else ())]:
            work.append((launch.kernel.fn.__module__, launch.name, launch.signature,
                         launch.constexprs, launch.attrs, launch.options, launch.key, arch,
                         "+".join(v.configs), _variant_text(launch, v.dtype), v.analysis()))
    return work


def _compile_jobs(work: list[tuple], jobs: int) -> list:
    """:func:`_compile_job` of each job, on ``jobs`` processes."""
    if jobs > 1 and len(work) > 1:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            return list(pool.map(_compile_job, work))
    return [_compile_job(job) for job in work]


def _brief(v: Variant) -> bool:
    """Whether a ``--brief-arch`` may compile ``v``: a bf16 variant of the DeepSeek-V3 sizes
    that links no NVSHMEM (the other dtypes change only how rows are loaded and are read at
    the full archs; the NVSHMEM rules read the Triton IR, the same for every arch, and one
    device bitcode serves every arch)."""
    return (v.dtype == "bfloat16" and not v.launch.uses_nvshmem
            and any(c.startswith("dsv3") for c in v.configs))


def brief_variants(variants) -> set[int]:
    """What a ``--brief-arch`` compiles: the first :func:`_brief` variant of each kernel (ids of
    the ``Variant`` objects): every kernel's source compiles for that arch and passes its
    rules; the full arch reads every specialisation."""
    first: dict[str, int] = {}
    for v in variants:
        if _brief(v):
            first.setdefault(v.launch.name, id(v))
    return set(first.values())


def _tokens(v: Variant) -> frozenset:
    """What ``v`` specialises on, as ``name=value`` words: dtype, flags, tile, warps."""
    return frozenset(_variant_text(v.launch, v.dtype).split())


def pairwise_cover(variants) -> list:
    """A subset of ``variants``, in their order, that holds, for every kernel, every pair of
    its specialisation words (:func:`_tokens`) some variant of it holds together (every single
    word too): each flag's every value meets every value of every other flag it meets at run
    time. The variants :data:`OP_TARGETS` reads come first; then, greedily, the variant that
    holds the most pairs not yet held (the first of equals). Beside a gate that compiles every
    variant under one Triton, the cover checks another Triton on every such pair at about half
    the compiles (the DeepSeek-V3 variants: 192 of 381)."""
    def pairs(v):
        words = sorted(_tokens(v))
        return {(a, b) for i, a in enumerate(words) for b in words[i:]}

    def op_target(v):
        return v.dtype == "bfloat16" and any(
            v.launch.name == kernel and set(flags.split()) <= _tokens(v)
            for _, _, _, _, kernels in OP_TARGETS for kernel, flags in kernels)

    by_kernel: dict[str, list] = {}
    for v in variants:
        by_kernel.setdefault(v.launch.name, []).append(v)
    held_by = {id(v): pairs(v) for v in variants}  # (each variant's pairs, made once)
    chosen = set()
    for group in by_kernel.values():
        held = set()
        for v in group:
            if op_target(v):
                chosen.add(id(v))
                held |= held_by[id(v)]
        wanted = set().union(*(held_by[id(v)] for v in group)) - held
        while wanted:
            best = max(group, key=lambda v: len(held_by[id(v)] & wanted))
            chosen.add(id(best))
            wanted -= held_by[id(best)]
    return [v for v in variants if id(v) in chosen]


def run(archs, jobs: int, out: str, configs=CONFIGS, brief_archs=(), cover: str = "all") -> int:
    """Records, compiles every variant (``cover="pairs"``: the :func:`pairwise_cover`, and
    where a ``# gate:`` marker is then emitted by no compiled variant, the other variants of
    the kernels of its file, then every other one while one is still missing) for each of
    ``archs`` and the :func:`brief_variants` for ``brief_archs``, reads, prints; returns the
    exit status."""
    from ..kernels.compiled import check_markers, unemitted_markers, violations
    from ..kernels.recording import post_compile_hook_finds_the_kernel

    start = time.perf_counter()
    print(f"gate: {post_compile_hook_finds_the_kernel(archs[0])}", flush=True)
    variants: dict[str, Variant] = {}
    for cfg in configs:
        for key, v in record_config(cfg, archs[0]).items():
            mine = variants.setdefault(key, v)
            if mine is not v:
                mine.configs += [c for c in v.configs if c not in mine.configs]
                mine.schedule.update(v.schedule)
                mine.heaviest.update(v.heaviest)
    recorded = time.perf_counter() - start
    problems = [v for k, v in variants.items() if k.startswith("problem:")]
    todo = [v for k, v in variants.items() if not k.startswith("problem:")]
    recorded_all = todo
    if cover == "pairs":
        todo = pairwise_cover(todo)
    print(f"gate: {len(recorded_all)} variants recorded in {recorded:.1f} s; compiling "
          + ("them" if cover == "all" else f"a pairwise cover of them, {len(todo)},")
          + " for "
          f"sm_{', sm_'.join(map(str, archs))}"
          + (f" and one bf16 DeepSeek-V3 variant per kernel for "
             f"sm_{', sm_'.join(map(str, brief_archs))}"
             if brief_archs else "") + f" on {jobs} processes", flush=True)
    kernel_dir = os.path.dirname(inspect.getsourcefile(todo[0].launch.kernel.fn))
    sources = [os.path.join(kernel_dir, f) for f in sorted(os.listdir(kernel_dir))
               if f.endswith(".py")]
    marker_problems = [p for path in sources for p in check_markers(path)]
    if any(v.launch.uses_nvshmem for v in recorded_all):  # built once, not in every worker
        from ..kernels.nvshmem_slim import slim_bitcode

        for arch in archs:
            slim_bitcode(arch)
    brief = brief_variants(todo)
    work = _jobs(todo, archs, brief_archs, brief)
    facts = _compile_jobs(work, jobs)

    def unemitted():
        return unemitted_markers([m for f in facts if not f.error
                                  for m in f.markers_emitted], sources)

    missing = unemitted()
    if missing and len(todo) < len(recorded_all):
        # a cover may leave out the one combination of flags that reaches a marked line: the
        # other variants of the kernels of the markers' files, then every other variant
        files = {m.split(":", 1)[0] for m in missing}
        for wanted in (lambda v: _source_file(v) in files, lambda v: True):
            chosen = {id(v) for v in todo}
            rest = [v for v in recorded_all if id(v) not in chosen and wanted(v)]
            if not missing or not rest:
                continue
            print(f"gate: {len(missing)} markers emitted by no variant of the cover; compiling "
                  f"{len(rest)} more variants", flush=True)
            more = _jobs(rest, archs, (), set())
            work, facts, todo = work + more, facts + _compile_jobs(more, jobs), todo + rest
            missing = unemitted()
    marker_problems += missing
    by_key = {v.launch.key: v for v in todo}
    rows, failed = [], 0
    for job, f in zip(work, facts):
        v = by_key[job[6]]
        schedules = list(v.schedule.values())
        f.schedule = schedules[0][0] if schedules else ""
        f.programs = max((p for _, p, _, _ in schedules), default=0)
        f.max_trips = max((t for _, _, t, _ in schedules), default=0)
        held, notes = ([], []) if f.error else v.path_problems(f)
        found = violations(f, v.rows_aligned, host_rules=v.on_gpus) + v.schedule_problems() + held
        f.speed_notes = notes
        rule_paths = list(v.rule_paths(f).values()) or list(f.paths.values())
        f.paths_summary = rule_paths
        failed += bool(found)
        row = f.as_row()
        row["status"] = "ok" if not found else "FAIL: " + "; ".join(found)
        rows.append(row)
    _write_tsv(out, rows)
    _write_paths(paths_tsv(out), list(zip(work, facts)))
    _print_table(rows)
    for p in problems:
        print(f"FAIL {p.configs[0]} {p.dtype}: {p.problems[0]}")
    for p in marker_problems:
        print(f"FAIL marker {p}")
    op_lines, op_problems = op_predictions(list(zip(work, facts)))
    print("\n".join(op_lines))
    for p in op_problems:
        print(f"FAIL {p}")
    total = time.perf_counter() - start
    compile_s = sum(f.compile_s for f in facts)
    print(f"gate: {len(rows)} compiled variants, {failed} failing, {len(problems)} "
          f"specialisation, {len(marker_problems)} marker and {len(op_problems)} op-time "
          f"problems; {compile_s:.0f} s of compiling, {total:.0f} s in all -> {out}")
    return 1 if failed or problems or marker_problems or op_problems else 0


# The ops the speed targets name (an H200, DeepSeek-V3 sizes, per rank): their kernels' bf16
# variants of one node (what the variant's text must hold), the config, the target in us, and
# whether the gate holds it. The normal mode's are read, not held: its row movers' rework
# (kernels.critical_path's notes in the TSV) has not reached them yet.
OP_TARGETS = (
    ("low-latency FP8 dispatch", "dsv3-decode", 30.0, True, (
        ("ll_dispatch_send_kernel", "FP8=1 UE8M0=0 GS=128 FT=0 TRANSPORT=0"),
        ("ll_dispatch_recv_kernel", "FP8=1 UE8M0=0 GLOBAL=0 HAS_STATS=0 TRANSPORT=0 FT=0"))),
    ("low-latency bf16 combine", "dsv3-decode", 40.0, True, (
        ("ll_combine_send_kernel", "TRANSPORT=0 FT=0 ZERO_COPY=0 FP8=0"),
        ("ll_combine_recv_kernel", "HAS_WEIGHTS=1 TRANSPORT=0 FT=0 FP8=0"))),
    ("normal bf16 dispatch", "dsv3-prefill", 600.0, False, (
        ("layout_count_kernel", "FT=0"), ("layout_place_kernel", ""),
        ("dispatch_send_kernel", "HAS_WEIGHTS=1 FP8=0 TRANSPORT=0"),
        ("received_layout_kernel", "WAIT=1 LIVE=0 FT=0 TRANSPORT=0"),
        ("dispatch_expand_kernel", "CACHED=0 HAS_WEIGHTS=1 FP8=0 LIVE=0"))),
    ("normal bf16 combine", "dsv3-prefill", 600.0, False, (
        ("combine_send_kernel", "HAS_WEIGHTS=1 HAS_PAIR=0 FP8=0 TRANSPORT=0 HIER=0"),
        ("wait_epochs_kernel", ""),
        ("combine_reduce_kernel", "HAS_PAIR=0 HIER=0 LIVE=0 FP8=0"))),
)


def op_predictions(done) -> tuple[list[str], list[str]]:
    """``(lines, problems)``: each op of :data:`OP_TARGETS`, its kernels' predicted times at
    its config summed (the slowest bf16 sm_90 variant that matches each), against its target;
    ``done``: (compile job, Facts) pairs."""
    lines, problems = ["gate: predicted device time per op and rank (kernels.critical_path; "
                       "H200 constants fitted to 2026-12-04's kernels):"], []
    for op, cfg, target, held, kernels in OP_TARGETS:
        parts, total, uncounted = [], 0.0, False
        for kernel, flags in kernels:
            want = set(flags.split())
            paths = [f.paths[cfg] for job, f in done
                     if job[1] == kernel and job[7] == 90 and cfg in f.paths
                     and job[9].startswith("bfloat16") and want <= set(job[9].split())]
            if paths:
                slowest = max(p["predicted_us"] for p in paths)
                parts.append(f"{kernel.removesuffix('_kernel')} {slowest:.1f}")
                total += slowest
                uncounted |= any(p["unknown_loops"] for p in paths)
        if not parts:
            continue
        verdict = "meets" if total <= target and not uncounted else "misses"
        if uncounted:
            verdict = "unknown (a loop's trips are not counted)"
        lines.append(f"  {op} [{cfg}]: {total:.1f} us ({', '.join(parts)}); target "
                     f"{target:g} us: {verdict}{'' if held else ' (not held yet)'}")
        if held and (total > target or uncounted):
            note = " (uncounted loops)" if uncounted else ""
            problems.append(f"{op} [{cfg}]: predicted {total:.1f} us{note}, target {target:g} us")
    return lines, problems


COLUMNS = ("kernel", "arch", "config", "variant", "regs", "stack_bytes", "smem_bytes",
           "row_store_bits", "nvshmem_issuers", "unordered_signals", "schedule", "programs",
           "max_trips", "steps", "inflight_kb", "predicted_us", "host_loads", "compile_s",
           "status", "speed_notes")


PATH_COLUMNS = ("kernel", "arch", "config", "variant", "programs", "regs", "num_warps",
                "smem_bytes", "steps", "mbytes", "inflight_kb", "predicted_us")


def paths_tsv(out: str) -> str:
    """Where the gate writes each variant's path per config, beside its table ``out``."""
    return out[:-4] + "_paths.tsv" if out.endswith(".tsv") else out + "_paths.tsv"


def _write_paths(path: str, done) -> None:
    """One row per compiled variant, arch and config: the busiest program's path
    (``kernels.critical_path``) at that config's launch: what bench/fit_model.py fits to."""
    with open(path, "w") as f:
        f.write("\t".join(PATH_COLUMNS) + "\n")
        for job, facts in done:
            for cfg, p in sorted(facts.paths.items()):
                grid = job[10][cfg][0]
                inflight = "-" if p["inflight_kb"] is None else f"{p['inflight_kb']:.1f}"
                f.write("\t".join(str(v) for v in (
                    job[1], job[7], cfg, job[9], grid[0] * grid[1] * grid[2], facts.regs,
                    job[5].get("num_warps", 4), facts.smem_bytes, f"{p['steps']:g}",
                    f"{p['bytes'] / 1e6:.4f}", inflight, f"{p['predicted_us']:.2f}")) + "\n")


def _write_tsv(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, delimiter="\t", extrasaction="ignore",
                                lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "compile_s": f"{row['compile_s']:.1f}"})


def _print_table(rows: list[dict]) -> None:
    print(f"{'kernel':<24} {'sm':>3} {'regs':>4} {'stack':>5} {'smem':>6} "
          f"{'row stores (bits)':<26} {'nvshmem issuers':<34} {'progs':>5} {'trips':>5} "
          f"{'host':>4} {'s':>5}  variant / status")
    for r in sorted(rows, key=lambda r: (r["kernel"], r["variant"], r["arch"])):
        status = "" if r["status"] == "ok" else "  " + r["status"]
        print(f"{r['kernel'][:24]:<24} {r['arch']:>3} {r['regs']:>4} {r['stack_bytes']:>5} "
              f"{r['smem_bytes']:>6} {r['row_store_bits'][:26]:<26} "
              f"{r['nvshmem_issuers'][:34]:<34} {r['programs']:>5} {r['max_trips']:>5} "
              f"{r['host_loads'][:4]:>4} {r['compile_s']:>5.1f}  {r['variant']}"
              f" [{r['config']}]{status}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 100])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--config", nargs="+", choices=[c.name for c in CONFIGS],
                        default=[c.name for c in CONFIGS])
    parser.add_argument("--out", default="bench/results/gpu_gate.tsv")
    parser.add_argument("--brief-arch", type=int, nargs="+", default=[],
                        help="also compile for these one bf16 variant per kernel at the "
                             "DeepSeek-V3 sizes, without NVSHMEM (make test: sm_100)")
    parser.add_argument("--cover", choices=("all", "pairs"), default="all",
                        help="compile every variant, or a subset holding every pair of "
                             "specialisation values a kernel's variants hold together "
                             "(make test: the Triton 3.6 gate)")
    parser.add_argument("--list", action="store_true",
                        help="print the variants the drivers launch per config, compile nothing")
    parser.add_argument("--schedules", action="store_true",
                        help="print each variant's grid and serial trips and check the grid "
                             "rules, compile nothing (with --list: after the list, from the "
                             "same recording)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("the gate compiles for GPUs: run it with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    configs = [c for c in CONFIGS if c.name in args.config]
    recorded = record_configs(configs, args.arch[0]) if args.list or args.schedules else None
    if args.list:
        print("\n".join(variant_list(configs, args.arch[0], recorded)))
        if not args.schedules:
            return 0
    if args.schedules:
        lines, problems = schedule_table(configs, args.arch[0], recorded)
        print("\n".join(lines))
        for p in problems:
            print(f"FAIL {p}")
        print(f"gate: {len(lines)} variants' grids, {len(problems)} problems")
        return 1 if problems else 0
    return run(args.arch, args.jobs, args.out, configs, args.brief_arch, args.cover)


if __name__ == "__main__":
    sys.exit(main())
