"""Mutation checks of the static gate (run in a subprocess: compiled kernels, no interpreter).

    python tests/gate_jobs.py MUTATION WORKDIR
    python tests/gate_jobs.py slim_library      # kernels.nvshmem_slim against the whole library
    python tests/gate_jobs.py ll:MUTATION WORKDIR  # the low-latency pair's speed rules

Copies ``kernels/`` to ``WORKDIR``, breaks one habit the gate enforces (``MUTATIONS``), records
a GPU launch of the broken copy's dispatch send at DeepSeek-V3 sizes with the same recorder the
gate uses, compiles it for sm_90 and prints, as JSON: the gate's violations (with those of an
in-kernel wait), the grid and serial-trip rules of that send and of a recorded dispatch
expand, whether ranks 0 and 1 got different specialisations, what the gate's specialisation
rule (``gate._specialisation_problems``) says of the launches of all 8 ranks, two calls each
(as the gate's drivers make them), and the acquire markers of ``comm.py`` that neither that
send nor an in-kernel wait emitted. ``none`` breaks nothing (the control).
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import sys

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")

# name -> (file, text, replacement, transport of the launch to inspect)
MUTATIONS = {
    "none": ("comm.py", "", "", 1),
    "scalar_store": (  # no alignment fact on peer pointers: rows go out 2 bytes at a time
        "comm.py", "    return tl.multiple_of(addr.to(tl.pointer_type(dtype)), ALIGN)\n",
        "    return addr.to(tl.pointer_type(dtype))\n", 0),
    "unguarded_nvshmem": (  # nvshmem_quiet from every thread of the program
        "dispatch.py", "        if one_thread():\n            quiet()\n    tl.atomic_add(stats",
        "        quiet()\n    tl.atomic_add(stats", 1),
    "spilling_tile": (  # the interpreter's wide tiles on a GPU
        "tiles.py", "    if not compiled:\n", "    if True:\n", 0),
    "relaxed_publish": (  # the epoch published without release ordering
        "comm.py", 'tl.cast(epoch, tl.int64), sem="release", scope="sys")  # gate: publish',
        'tl.cast(epoch, tl.int64), sem="relaxed", scope="sys")  # gate: publish', 0),
    "specialised_rank": (  # per-rank scalars specialised: rank 0 and rank 1 compile apart
        "dispatch.py", "@triton.jit(do_not_specialize=_SEND_PER_CALL)", "@triton.jit", 0),
    "rank_constexpr": (  # a constexpr the launcher derives from the rank
        "dispatch.py", "        EVEN_H=even(H, tile.block_h),\n",
        "        EVEN_H=even(H, tile.block_h) and rank % 2 == 0,\n", 0),
    "unbounded_grid": (  # a persistent send sized by its work, not num_sms: every SM
        "tiles.py", "    return min(work_tiles, num_sms) if num_sms else work_tiles\n",
        "    return work_tiles\n", 0),
    "one_send_program": (  # a send walking every token tile in one program
        "tiles.py", "    return min(work_tiles, num_sms) if num_sms else work_tiles\n",
        "    return 1\n", 0),
    "thin_expand": (  # the expand one program per source: less than a wave
        "tiles.py",
        "    return 1 if not compiled else max(1, triton.cdiv(GPU_PROGRAMS, world_size))",
        "    return 1", 0),
    "host_load_in_spin": (  # the error record (host memory on GPUs) read on every poll
        "comm.py",  # (wait_epochs_kernel's wait: its epoch read just before)
        "    epoch = tl.load(epochs)\n    ok = wait_all_at_least(",
        "    epoch = tl.load(epochs)\n"
        "    while timed_out(errors_addr.to(tl.pointer_type(tl.int64)), NUM_THREADS) \\\n"
        "            & (uniform_now_ns(NUM_THREADS) < deadline):\n"
        "        deadline -= 1\n"
        "    ok = wait_all_at_least(", 0),
    "dropped_acquire": (  # the waits' acquire on a path the compiler drops: no instruction
        "comm.py",
        '    return tl.atomic_add(word, 0, mask=mask, sem="acquire", scope="sys")'
        '  # gate: acquire\n',
        '    if word is None:\n'
        '        tl.atomic_add(word, 0, mask=mask, sem="acquire", scope="sys")  # gate: acquire\n'
        '    return tl.load(word, mask=mask, volatile=True)\n', 0),
}
# The low-latency pair's speed rules (kernels.critical_path): name -> (file, text,
# replacement). The broken copy's launchers run under the real Buffer (one node, bf16,
# DeepSeek-V3 decode sizes); the gate's own rules read what they launch.
LL_MUTATIONS = {
    "none": ("low_latency.py", "", ""),
    "ll_capped_grid": (  # the receive on num_sms programs again: 20 for 256 blocks
        "low_latency.py",
        "    launch(bound, key, ll_dispatch_recv_kernel, (L * R,), args, kwargs, _RECV_VARYING)",
        "    launch(bound, key, ll_dispatch_recv_kernel, (min(L * R, 20),), args, kwargs,\n"
        "           _RECV_VARYING)"),
    "ll_choice_loop_at_run_time": (  # the combine's choices one after another, not unrolled,
        # each reloading its expert rank's signal word before its row (the old receive)
        "low_latency.py",
        "        for k in tl.static_range(BLOCK_K):"
        "  # unrolled: every choice's load issued at once\n"
        "            vk = column(valid.to(tl.int32), k) != 0\n",
        "        for k in range(K):\n"
        "            vk = column(valid.to(tl.int32), k) != 0\n"
        "            dk = column(tl.where(valid, ids, 0), k) // (E // R)\n"
        "            vk = vk & (tl.load(signals + parity * R + dk, mask=vk, other=0) >= epoch)\n"),
    "ll_barrier_in_row_loop": (  # every pass of the receive's rows waits for every warp
        "low_latency.py",
        "            # the pass's rows, meta words and scales, loaded before any is stored\n",
        "            tl.debug_barrier()\n"),
    "ll_slower_step": (  # a dependent step ten times as long: the ops' times over target
        "critical_path.py", "LATENCY_US = 0.35", "LATENCY_US = 3.5"),
}
# The normal dispatch's row movers' rule (no wait inside a row loop): name -> (file, text,
# replacement); the broken copy's dispatch launchers run under the real Buffer (one node, bf16,
# DeepSeek-V3 prefill sizes).
ROW_LOOP_MUTATIONS = {
    "none": ("dispatch.py", "", ""),
    "expand_column_in_row_loop": (  # the choices in a run-time loop again, each one's rows
        # taken out of the tile per channel tile (a reduction across warps before its stores)
        "dispatch.py",
        "                for k in tl.static_range(BLOCK_K):  # each choice's rows from registers\n"
        "                    dst_row = dsts[k].to(tl.int64)\n",
        "                for c in range(K):\n"
        "                    dst_row = column(row, c).to(tl.int64)\n"),
    "expand_thin_tile": (  # the expand's tile of 8 slots again: 16 KB of bf16 rows in flight
        "tiles.py", '               "dispatch_expand": 2 * TILE_BYTES_PER_THREAD,\n', ""),
    "combine_choice_in_row_loop": (  # a fuller tile's further rows: their indices loaded in
        # its channel loop again (an index gather before the rows it gathers)
        "combine.py",
        "acc = _add_row(acc, y, further[k],\n",
        "rc, wc = _choice(slots, k, jm, weights, HAS_WEIGHTS)\n"
        "                            acc = _add_row(acc, y, rc,\n"),
}
RANKS = 8


def broken_copy(name: str, workdir: str, mutations: dict = MUTATIONS):
    """The kernels package with mutation ``name`` applied, imported under a fresh name."""
    file, text, replacement = mutations[name][:3]
    package = f"mutated_{name}"
    target = os.path.join(workdir, package)
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(KERNELS, target, ignore=shutil.ignore_patterns("__pycache__"))
    path = os.path.join(target, file)
    source = open(path).read()
    if text:
        if text not in source:
            raise SystemExit(f"mutation {name}: text not found in {file}")
        open(path, "w").write(source.replace(text, replacement, 1))
    sys.path.insert(0, workdir)
    return importlib.import_module(package)


def record_send(pkg, transport: int, rank: int):
    """One recorded dispatch send (bf16, weights) at DeepSeek-V3 sizes, as rank ``rank``."""
    import torch

    from moe_comm.kernels.nvshmem_slim import slim_bitcode

    recording = importlib.import_module(pkg.__name__ + ".recording")
    dispatch = importlib.import_module(pkg.__name__ + ".dispatch")
    comm = importlib.import_module(pkg.__name__ + ".comm")
    R, T, H, K, L = RANKS, 4096, 7168, 8, 32

    def meta(*shape, dtype=torch.int32):
        return torch.empty(shape, dtype=dtype, device="meta")

    flavour = comm.Flavour(transport=transport, device_wait=True, compiled=True,
                           bitcode=slim_bitcode(90) if transport else "")
    with recording.recording(90) as launches:
        dispatch.dispatch_send(
            meta(T, H, dtype=torch.bfloat16), meta(T, K, dtype=torch.int64),
            meta(T, K, dtype=torch.float32), meta(T, R), meta(T, K), meta(R, L + 1),
            meta(R, dtype=torch.int64), meta(4, dtype=torch.int64), meta(1, dtype=torch.int64),
            meta(1, dtype=torch.int64),
            offsets=dict(rows=((1 << 20) + rank * 2 * H * T, 1 << 28),
                         meta=((1 << 21) + rank * 100 * T, 1 << 24),
                         counts=((1 << 22) + rank * 4 * (L + 1), 4096),
                         signal=(1 << 12) + 8 * rank),
            rank=rank, num_local_experts=L, meta_stride=1 + 3 * K, max_topk=K,
            grid=dispatch.send_grid(T, H, 20, flavour, 2), topk=K, row_bytes=2 * H,
            flavour=flavour)
    return launches[0]


def record_expand(pkg):
    """One recorded dispatch expand (bf16, weights) at DeepSeek-V3 prefill sizes, as a GPU
    Buffer launches it (``max_recv_rows`` twice the rows of uniform routing)."""
    import torch

    recording = importlib.import_module(pkg.__name__ + ".recording")
    dispatch = importlib.import_module(pkg.__name__ + ".dispatch")
    comm = importlib.import_module(pkg.__name__ + ".comm")
    R, T, H, K, L = RANKS, 4096, 7168, 8, 32
    rows = 2 * T * K

    def meta(*shape, dtype=torch.int64):
        return torch.empty(shape, dtype=dtype, device="meta")

    flavour = comm.Flavour(device_wait=True, compiled=True)
    with recording.recording(90) as launches:
        dispatch.dispatch_expand(
            meta(2, R, T, H, dtype=torch.bfloat16), meta(2, R, T, 1 + 3 * K, dtype=torch.int32),
            meta(1), meta(R + 1), meta(R, L), meta(L), meta(L + 1),
            meta(R * T, K, dtype=torch.int32), meta(rows, H, dtype=torch.bfloat16),
            meta(rows, dtype=torch.float32), meta(rows), meta(rows), rank=0, topk=K,
            num_local_experts=L, meta_stride=1 + 3 * K, max_topk=K, flavour=flavour)
    return launches[0]


def schedule_problems(launch) -> list[str]:
    """The gate's grid and serial-trip rules (``moe_comm.kernels.tiles``, the real ones) for a
    launch of the broken copy at the DeepSeek-V3 sizes."""
    from moe_comm.kernels.tiles import schedule_facts
    from moe_comm.kernels.tiles import schedule_problems as problems

    kind, programs, trips = schedule_facts(launch.name, launch.grid, launch.scalars)
    return problems(launch.name, kind, programs, trips, 20)


def record_wait(pkg):
    """One recorded in-kernel wait of the normal mode (``wait_epochs_kernel``), as a GPU
    Buffer launches it."""
    import torch

    recording = importlib.import_module(pkg.__name__ + ".recording")
    comm = importlib.import_module(pkg.__name__ + ".comm")
    signals = torch.empty(RANKS, dtype=torch.int64, device="meta")
    epochs = torch.empty(1, dtype=torch.int64, device="meta")
    with recording.recording(90) as launches:
        comm.wait_epochs_kernel[(1,)](signals, epochs, 1 << 40, 10 ** 9, RANKS, 0,
                                      BLOCK_R=RANKS, NUM_THREADS=128, COMBINE=False,
                                      num_warps=4)
    return launches[0]


def slim_library_report() -> dict:
    """The NVSHMEM dispatch send (as the gate records it) compiled for sm_90 against the whole
    device library and against ``kernels.nvshmem_slim``'s: the PTX of each (a hash of its code,
    up to the debug info's file table, which names the checkout's paths) and the seconds each
    compile took. The caller gives a fresh ``TRITON_CACHE_DIR``: Triton's cache key does not
    hold those paths, so an entry from another checkout differs in them."""
    import hashlib
    import time

    from moe_comm import kernels
    from moe_comm.kernels.compiled import compile_launch
    from moe_comm.kernels.nvshmem import device_bitcode
    from moe_comm.kernels.nvshmem_slim import slim_bitcode, with_library
    from moe_comm.kernels.recording import Launch

    launch = record_send(kernels, 1, 0)
    report = {"slim_path": slim_bitcode(90)}
    for name, library in (("whole", device_bitcode(90)), ("slim", report["slim_path"])):
        options = with_library(launch.options, library)
        start = time.perf_counter()
        compiled = compile_launch(Launch(launch.kernel, launch.signature, launch.constexprs,
                                         launch.attrs, options, launch.key), 90)
        code = compiled.asm["ptx"].split("\t.file\t", 1)[0]  # not the paths of the debug info
        report[name] = {"ptx": hashlib.sha256(code.encode()).hexdigest(),
                        "calls": compiled.asm["ptx"].count("call.uni"),
                        "s": round(time.perf_counter() - start, 2)}
    return report


def _inspected(cfg_name: str, low_latency: bool, keep) -> tuple[list, list, list]:
    """``(variants, problems, done)`` at ``cfg_name`` of the gate's one-node bf16 Buffer (the
    low-latency one or the normal one) for the recorded variants ``keep(variant, text)``
    selects: each compiled for sm_90 and its busiest program walked; ``problems`` its
    schedule's, the held rules' of its path and the compiled code's; ``done`` the (job,
    facts) pairs ``gate.op_predictions`` reads."""
    import torch

    from moe_comm.kernels import compiled
    from moe_comm.testing import gate

    cfg = next(c for c in gate.CONFIGS if c.name == cfg_name)
    runs = gate.gate_runs
    gate.gate_runs = lambda c: [r for r in runs(c) if r[:4] == ("bfloat16", torch.bfloat16, 0,
                                                                 low_latency) and len(r) == 5]
    variants = [v for k, v in gate.record_config(cfg, 90).items() if not k.startswith("problem:")
                and keep(v, gate._variant_text(v.launch, v.dtype))]
    problems, done = [], []
    for v in variants:
        text = gate._variant_text(v.launch, v.dtype)
        facts = compiled.inspect_launch(v.launch, 90, cfg.name, text, v.analysis())
        problems += [f"{v.launch.name}: {p}" for p in v.schedule_problems()
                     + v.path_problems(facts)[0] + compiled.violations(facts, True)]
        done.append(((None, v.launch.name, None, None, None, None, None, 90, cfg.name, text),
                     facts))
    return variants, problems, done


def ll_main(name: str, workdir: str) -> dict:
    """The gate's speed rules on the low-latency pair of the broken copy: its launchers under the
    Buffer's own low-latency calls (the gate's driver), each launch compiled and its busiest
    program walked; the schedules and the critical path's constants are the broken copy's."""
    from moe_comm import low_latency as ll_mode
    from moe_comm.kernels import critical_path
    from moe_comm.testing import gate

    pkg = broken_copy(name, workdir, LL_MUTATIONS)
    launchers = importlib.import_module(pkg.__name__ + ".low_latency")
    for launcher in ("ll_dispatch_send", "ll_dispatch_recv", "ll_combine_send",
                     "ll_combine_recv"):
        setattr(ll_mode, launcher, getattr(launchers, launcher))
    mutated = importlib.import_module(pkg.__name__ + ".critical_path")
    critical_path.LATENCY_US = mutated.LATENCY_US
    cfg_name = "dsv3-decode"
    targets = [(kernel, set(flags.split())) for _, c, _, held, kernels in gate.OP_TARGETS
               if held and c == cfg_name for kernel, flags in kernels]
    variants, problems, done = _inspected(
        cfg_name, True, lambda v, text: any(v.launch.name == kernel and flags <= set(text.split())
                                            for kernel, flags in targets))
    lines, op_problems = gate.op_predictions(done)
    return {"problems": problems + op_problems, "ops": lines,
            "steps": {f"{v.launch.name} {gate._variant_flags(v.launch, v.dtype)}":
                      f.paths[cfg_name]["steps"] for v, (_, f) in zip(variants, done)}}


def row_loop_main(name: str, workdir: str) -> dict:
    """The held row-loop rules on the normal bf16 mode's row movers of the broken copy (its
    dispatch and combine launchers under the Buffer's own calls, the gate's driver): each
    variant compiled and its busiest program walked at DeepSeek-V3 prefill sizes."""
    from moe_comm import normal_combine, normal_dispatch
    from moe_comm.testing import gate

    pkg = broken_copy(name, workdir, ROW_LOOP_MUTATIONS)
    broken_dispatch = importlib.import_module(pkg.__name__ + ".dispatch")
    normal_dispatch.dispatch_kernels = broken_dispatch
    normal_combine.combine_kernels = importlib.import_module(pkg.__name__ + ".combine")
    flags = {"HAS_WEIGHTS=1", "FP8=0"}
    variants, problems, _ = _inspected(
        "dsv3-prefill", False, lambda v, text: v.launch.name in gate.HELD_ROW_LOOPS
        and flags <= set(text.split()))
    return {"problems": problems, "kernels": sorted({v.launch.name for v in variants})}


def main(name: str, workdir: str) -> dict:
    from moe_comm.kernels.compiled import inspect_launch, unemitted_markers, violations
    from moe_comm.testing.gate import _specialisation_problems

    pkg = broken_copy(name, workdir)
    transport = MUTATIONS[name][3]
    launches = [record_send(pkg, transport, rank) for _ in range(2) for rank in range(RANKS)]
    facts = inspect_launch(launches[1], 90, "dsv3", name)
    wait = inspect_launch(record_wait(pkg), 90, "dsv3", name)
    comm_py = os.path.join(os.path.dirname(pkg.__file__), "comm.py")
    expand = record_expand(pkg)
    return {"violations": violations(facts, rows_aligned=True) + violations(wait, True),
            "schedule_problems": [f"{launch.name}: {p}" for launch in (launches[1], expand)
                                  for p in schedule_problems(launch)],
            "unemitted_acquires": [m for m in unemitted_markers(
                facts.markers_emitted + wait.markers_emitted, [comm_py]) if "acquire" in m],
            "keys_differ": launches[0].key != launches[1].key,
            "specialisation_problems": _specialisation_problems(launches, RANKS),
            "stack_bytes": facts.stack_bytes, "row_store_bits": facts.row_store_bits,
            "nvshmem_issuers": facts.nvshmem_issuers}


if __name__ == "__main__":
    if sys.argv[1] == "slim_library":
        print(json.dumps(slim_library_report()))
    elif sys.argv[1].startswith("ll:"):
        print(json.dumps(ll_main(sys.argv[1][3:], sys.argv[2])))
    elif sys.argv[1].startswith("rows:"):
        print(json.dumps(row_loop_main(sys.argv[1][5:], sys.argv[2])))
    else:
        print(json.dumps(main(sys.argv[1], sys.argv[2])))
