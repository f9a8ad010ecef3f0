"""The static gate: every kernel as the Buffer launches it on a GPU, compiled for sm_90 and
sm_100 and read (spills, store widths, NVSHMEM issuers, signal ordering); each rule's mutation
makes it fail; its readers on hand-made PTX and IR."""
import csv
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import pytest

from moe_comm.kernels.compiled import (
    Facts,
    check_markers,
    host_loads,
    marked_instructions,
    nvshmem_issuers,
    unemitted_markers,
    violations,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
COMPILED_ENV = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
ROW_KERNELS = {"dispatch_send_kernel", "dispatch_expand_kernel", "combine_send_kernel",
               "combine_reduce_kernel", "ll_dispatch_send_kernel", "ll_dispatch_recv_kernel",
               "ll_combine_send_kernel", "ll_combine_recv_kernel", "quantize_kernel",
               "outbox_dispatch_kernel", "forward_dispatch_kernel", "forward_combine_kernel",
               "invariant_send_kernel", "invariant_reduce_kernel", "combine_rounds_kernel",
               "dispatch_rounds_kernel", "invariant_rounds_kernel"}


VARIANTS_FILE = os.path.join(HERE, "gate_variants.txt")


DSV3_CONFIGS = ("dsv3-prefill", "dsv3-decode", "dsv3-prefill-rounds")


def _listed_variants() -> set[str]:
    with open(VARIANTS_FILE) as f:
        return {line.strip() for line in f if line.strip()}


@functools.cache
def _recorded() -> subprocess.CompletedProcess:
    """``gate --list --schedules``: the variant list, then every variant's grid, from one
    recording of the drivers (shared by the two tests below)."""
    return subprocess.run([sys.executable, "-m", "moe_comm.testing.gate", "--list", "--schedules"],
                          capture_output=True, text=True, env=COMPILED_ENV, cwd=ROOT,
                          timeout=600)


def test_gate_drivers_launch_the_listed_variants():
    """The variants the gate's drivers launch at each config (recorded, not compiled) are
    exactly those of tests/gate_variants.txt: a format, flavour, dtype or op that drops out of
    a driver, or one added without a look at what it compiles, fails here. After a deliberate
    change: python -m moe_comm.testing.gate --list > tests/gate_variants.txt
    (TRITON_INTERPRET=0)."""
    proc = _recorded()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = {line.strip() for line in proc.stdout.splitlines() if line.strip()
           and " programs=" not in line and not line.startswith(("gate: ", "FAIL "))}
    want = _listed_variants()
    assert got == want, (f"missing: {sorted(want - got)[:20]}", f"new: {sorted(got - want)[:20]}")
    for what in (" FP8=1", " FP8=2", " GS=32", " GS=16", " UE8M0=1", " TRANSPORT=1",
                 " TRANSPORT=2", " HIER=1", " FT=1", " LIVE=1", " float64", " float16",
                 " float32"):   # formats, flavours and dtypes are in the list itself
        assert any(what in line for line in want), what


def test_grids_and_serial_trips_hold_at_the_deepseek_sizes():
    """Every recorded variant declares its schedule (``kernels.tiles.SCHEDULES``); at the
    DeepSeek-V3 sizes none runs more than 32 serial trips in a program, sends and receives
    that wait stay within num_sms programs and row movers fill a wave (recorded, not compiled:
    the grids and arguments the Buffer launches with); the numbers the issue's speed targets
    rest on are what they were designed to be."""
    proc = _recorded()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 6 and parts[4].startswith("programs="):
            key = (parts[0], parts[1], parts[2])
            programs, trips = int(parts[4][9:]), int(parts[5][6:])
            old = rows.get(key, (parts[3], 0, 0))
            rows[key] = (parts[3], max(old[1], programs), max(old[2], trips))
    prefill, decode = "dsv3-prefill", "dsv3-decode"
    b16 = "bfloat16"
    assert rows[(prefill, "layout_place_kernel", b16)] == ("control", 256, 18)
    assert rows[(prefill, "layout_count_kernel", b16)][1] == 256  # a wave of 16-token chunks
    assert rows[(prefill, "dispatch_send_kernel", b16)] == ("persistent", 20, 13)  # 16 a tile
    assert rows[(prefill, "combine_send_kernel", b16)] == ("persistent", 20, 17)
    assert rows[(prefill, "dispatch_expand_kernel", b16)][:2] == ("wave", 264)
    assert rows[(decode, "combine_reduce_kernel", b16)][:2] == ("wave", 224)
    # the low-latency pair covers its work, every SM where it has the blocks (the most
    # programs of any bf16 variant): a program per token (NVFP4; two tokens for the other
    # formats), per (expert, source) block, per two tokens and a group of 128 channels (FP8
    # slots; per token and half a row for bf16 slots); a block's rows in one pass (FP8
    # combine: a row a pass)
    for kernel, want in (("ll_dispatch_send_kernel", (128, 1)), ("ll_dispatch_recv_kernel",
                         (256, 1)), ("ll_combine_send_kernel", (256, 4)),
                         ("ll_combine_recv_kernel", (3584, 1))):
        kind, programs, trips = rows[(decode, kernel, b16)]
        assert kind == "whole-gpu" and (programs, trips) == want, (kernel, programs, trips)
    assert "gate: " in proc.stdout and " 0 problems" in proc.stdout


GATE_BESIDE_WAIT_S = 1800


def _gate_at_the_runtime_configurations() -> tuple[int, str, str]:
    """``(exit status, output, TSV path)`` of the gate at the runtime configurations: every
    variant of the DeepSeek-V3 sizes for sm_90; for sm_100 one bf16 variant of those sizes
    without NVSHMEM per kernel (gate.brief_variants); make gpu-gate builds everything for
    both, the small config too (the CPU tests' sizes: no GPU runs them). Under make test the
    Makefile runs this gate beside the suite (its GATE_ARGS are these arguments) and names
    its files in ``MOE_COMM_GATE_BESIDE`` (``<stem>.rc`` written when it ends): this waits
    for that run (bounded) instead of compiling the same variants again; elsewhere the gate
    runs here."""
    beside = os.environ.get("MOE_COMM_GATE_BESIDE")
    if beside:
        stem = os.path.join(ROOT, beside)
        deadline = time.monotonic() + GATE_BESIDE_WAIT_S
        while not os.path.exists(stem + ".rc"):
            assert time.monotonic() < deadline, \
                f"the gate beside the suite wrote no {stem}.rc in {GATE_BESIDE_WAIT_S} s"
            time.sleep(1)
        with open(stem + ".rc") as rc, open(stem + ".log") as log:
            return int(rc.read()), log.read(), stem + ".tsv"
    out = os.path.join(ROOT, "bench", "results", "gpu_gate.tsv")
    proc = subprocess.run([sys.executable, "-m", "moe_comm.testing.gate", "--arch", "90",
                           "--brief-arch", "100", "--config", *DSV3_CONFIGS, "--out", out],
                          capture_output=True, text=True, env=COMPILED_ENV, cwd=ROOT,
                          timeout=1800)
    return proc.returncode, proc.stdout + proc.stderr, out


@pytest.mark.slow
def test_gate_passes_at_the_runtime_configurations():
    status, output, out = _gate_at_the_runtime_configurations()
    assert status == 0, output[-9000:]
    rows = list(csv.DictReader(open(out), delimiter="\t"))
    assert {r["kernel"] for r in rows} == ROW_KERNELS | {"layout_count_kernel",
                                                         "layout_place_kernel",
                                                         "received_layout_kernel",
                                                         "wait_epochs_kernel",
                                                         "wait_relayed_epochs_kernel",
                                                         "ft_wait_epochs_kernel",
                                                         "set_word_on_all_kernel",
                                                         "checked_topk_idx_kernel",
                                                         "ring_positions_kernel"}
    assert {r["arch"] for r in rows} == {"90", "100"}
    for r in rows:  # the table says what the rules need, and every row passed them
        assert r["status"] == "ok" and r["stack_bytes"] == "0", r
        if r["kernel"] in ROW_KERNELS:
            bits = dict(kv.split("=") for kv in r["row_store_bits"].split(","))
            assert int(bits["row"]) == 128, r
    configs = {c for r in rows for c in r["config"].split("+")}
    assert configs == set(DSV3_CONFIGS)
    compiled = {f"{c} {r['kernel']} {r['variant'].split(' tile=')[0]}"
                for r in rows for c in r["config"].split("+")}
    # every listed variant of those sizes compiled, nothing else
    assert compiled == {v for v in _listed_variants() if v.split()[0] in DSV3_CONFIGS}
    nvshmem = [r for r in rows if r["nvshmem_issuers"] != "-"]
    assert {r["kernel"] for r in nvshmem} == {"dispatch_send_kernel", "combine_send_kernel",
                                              "dispatch_rounds_kernel", "combine_rounds_kernel",
                                              "ll_dispatch_send_kernel",
                                              "ll_dispatch_recv_kernel",
                                              "ll_combine_send_kernel", "ll_combine_recv_kernel"}
    assert {r["arch"] for r in nvshmem} == {"90"}

    def variants(arch):
        return {(r["kernel"], r["config"], r["variant"]) for r in rows if r["arch"] == arch}

    brief = {v for v in variants("90") if v[2].startswith("bfloat16") and "dsv3" in v[1]
             and v not in {(r["kernel"], r["config"], r["variant"]) for r in nvshmem}}
    assert variants("100") <= brief  # one per kernel, every kernel
    assert sorted(k for k, _, _ in variants("100")) == sorted({k for k, _, _ in brief})
    for r in nvshmem:
        for item in r["nvshmem_issuers"].split(","):
            symbol, issuers = item.split("=")
            assert issuers == ("block" if symbol.endswith("_block") else "1"), r
    dtypes = {r["variant"].split()[0] for r in rows}
    assert dtypes == {"bfloat16", "float16", "float32", "float64"}
    assert "gate: " in output and " 0 failing" in output


def _mutation(name: str, tmp_path) -> dict:
    proc = subprocess.run([sys.executable, os.path.join(HERE, "gate_jobs.py"), name,
                           str(tmp_path)], capture_output=True, text=True, env=COMPILED_ENV,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("name, expect", [
    ("none", None),
    ("scalar_store", "stores row 16 bits at a time"),
    ("unguarded_nvshmem", "nvshmem_quiet is issued by 512"),
    ("spilling_tile", "spills or uses local memory"),
    ("relaxed_publish", "signal without release/acquire ordering"),
    ("specialised_rank", None),
    ("rank_constexpr", None),
    ("dropped_acquire", "emitted no instruction"),
    ("unbounded_grid", "programs for a kernel that waits or may overlap compute"),
    ("one_send_program", "serial trips (at most 32)"),
    ("thin_expand", "fills less than one wave"),
    ("host_load_in_spin", "loads host memory inside a loop or spin"),
])
def test_each_rule_fails_on_its_mutation(name, expect, tmp_path):
    report = _mutation(name, tmp_path)
    found = report["violations"] + report["unemitted_acquires"] + report["schedule_problems"]
    if expect is None:
        assert found == [], report
    else:
        assert any(expect in v for v in found), report
    apart = name in ("specialised_rank", "rank_constexpr")
    assert report["keys_differ"] == apart, report
    # the gate's own rule: ranks 0..7 launching one op twice must agree
    assert report["specialisation_problems"] == (
        ["dispatch_send_kernel specialises differently on different ranks"] if apart else []), \
        report


@pytest.mark.slow
@pytest.mark.parametrize("name, expect", [
    ("none", None),
    ("ll_capped_grid", "20 programs for 256 blocks of work"),
    ("ll_choice_loop_at_run_time", "dependent steps in a program (a low-latency kernel takes "
                                   "at most 20)"),
    ("ll_barrier_in_row_loop", "rows wait inside a loop that stores them for: "
                               "low_latency.py"),
    ("ll_slower_step", "low-latency FP8 dispatch [dsv3-decode]: predicted"),
])
def test_each_low_latency_speed_rule_fails_on_its_mutation(name, expect, tmp_path):
    """The low-latency pair's speed rules (the ops the targets name, one node, bf16, DeepSeek-V3
    decode sizes): a grid that covers its blocks, at most 20 dependent steps a program, no
    barrier inside a loop that stores rows, each op's predicted time within its target; the
    unbroken copy passes them all."""
    report = _mutation(f"ll:{name}", tmp_path)
    if expect is None:
        assert report["problems"] == [], report
        assert all(" meets" in line for line in report["ops"][1:]), report
        assert max(report["steps"].values()) <= 20, report
    else:
        assert any(expect in p for p in report["problems"]), report


@pytest.mark.slow
@pytest.mark.parametrize("name, expect", [
    ("none", None),
    ("expand_column_in_row_loop", "dispatch_expand_kernel: rows wait inside a loop that stores "
                                  "them for: dispatch.py"),
    ("expand_thin_tile", "dispatch_expand_kernel: 16.0 KB of row loads in flight at a wait "
                         "(at least 32)"),
    ("combine_choice_in_row_loop", "combine_send_kernel: rows wait inside a loop that stores "
                                   "them for: combine.py"),
])
def test_the_normal_row_loop_rules_fail_on_their_mutations(name, expect, tmp_path):
    """The normal bf16 mode's row movers of one node (the dispatch's send and expand, the
    combine's send; DeepSeek-V3 prefill sizes) store their rows without waiting inside the row
    loop on a barrier across warps, a reduction or an index gather, each with at least 32 KB of
    rows in flight at a wait: the expand's choices taken out of the tile in a run-time
    loop again (a reduction per choice and channel tile), its tile of 8 slots again (16 KB), or
    the combine send's further rows' indices loaded in its channel loop again, fails the
    gate."""
    report = _mutation(f"rows:{name}", tmp_path)
    assert report["kernels"] == ["combine_send_kernel", "dispatch_expand_kernel",
                                 "dispatch_send_kernel"], report
    if expect is None:
        assert report["problems"] == [], report
    else:
        assert any(expect in p for p in report["problems"]), report


def test_the_slim_nvshmem_library_compiles_to_the_same_code():
    """The gate links ``kernels.nvshmem_slim``'s library instead of the whole NVSHMEM device
    bitcode: the NVSHMEM send compiles to the same PTX against both (its puts, fence and
    quiet calls included), and the slim library was built, not fallen back from."""
    with tempfile.TemporaryDirectory() as fresh:  # both compiled here, neither from a cache
        proc = subprocess.run([sys.executable, os.path.join(HERE, "gate_jobs.py"), "slim_library"],
                              capture_output=True, text=True, timeout=900,
                              env={**COMPILED_ENV, "TRITON_CACHE_DIR": fresh})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["slim_path"].endswith(".ll"), report
    assert report["slim"]["s"] > 0 and report["whole"]["s"] > 0, report
    assert report["whole"]["ptx"] == report["slim"]["ptx"], report
    assert report["slim"]["calls"] > 0, report  # the NVSHMEM functions are really linked


def test_the_slim_nvshmem_library_has_every_function_the_kernels_call():
    from moe_comm.kernels import nvshmem_slim

    source = open(os.path.join(ROOT, "kernels", "nvshmem.py")).read()
    called = set(re.findall(r'\("(nvshmemx?_\w+)", _I32\)', source))
    assert called and called == set(nvshmem_slim.ENTRY_POINTS)
    linked = "\n".join([
        "; ModuleID = 'x'",
        "define ptx_kernel void @stub(ptr %0) #0 !dbg !10 {",
        "  ret void",
        "}",
        *[f"define internal void @{name}(ptr %0) #1 {{\n  ret void\n}}"
          for name in nvshmem_slim.ENTRY_POINTS],
        "define internal fastcc void @helper() #2 {",
        "  ret void",
        "}",
        "!llvm.module.flags = !{!2, !3, !4}",
        '!2 = !{i32 2, !"Debug Info Version", i32 3}',
        '!3 = !{i32 4, !"nvvm-reflect-ftz", i32 1}',
        '!4 = !{i32 1, !"wchar_size", i32 4}'])
    text = nvshmem_slim.library_text(linked)
    assert "@stub" not in text and "define internal fastcc void @helper()" in text
    for name in nvshmem_slim.ENTRY_POINTS:
        assert f"define void @{name}(" in text, name
    assert "!llvm.module.flags = !{!4}" in text
    with pytest.raises(RuntimeError, match="entry points missing"):
        nvshmem_slim.library_text(linked.replace("@nvshmem_fence(", "@other("))
    # a launch's options link the library given where they link one, and change nothing else
    options = {"num_warps": 8, "extern_libs": (("libdevice", "d.bc"),
                                               ("libnvshmem_device", "whole.bc"))}
    swapped = nvshmem_slim.with_library(options, "slim.ll")
    assert swapped == {"num_warps": 8, "extern_libs": (("libdevice", "d.bc"),
                                                       ("libnvshmem_device", "slim.ll"))}
    assert options["extern_libs"][1] == ("libnvshmem_device", "whole.bc")  # not changed
    plain = {"num_warps": 4, "extern_libs": (("libdevice", "d.bc"),)}
    assert nvshmem_slim.with_library(plain, "slim.ll") == plain


def test_markers_must_sit_on_the_line_where_the_store_starts(tmp_path):
    path = tmp_path / "k.py"
    path.write_text("x = 1\n"
                    "tl.store(p, v,  # gate: row\n"
                    "         mask=m)\n"
                    "tl.store(p, v,\n"
                    "         mask=m)  # gate: row\n"
                    "tl.atomic_xchg(w, 1, sem='release')  # gate: publish\n"
                    "tl.store(q, v)  # gate: rows\n")
    problems = check_markers(str(path))
    assert len(problems) == 2, problems
    assert ":5:" in problems[0] and "no store starts" in problems[0]
    assert ":7:" in problems[1] and "unknown gate tag" in problems[1]


def test_a_store_the_routing_masks_is_a_row_store_and_a_live_line(tmp_path):
    """``# gate: row live``: a row store (its widths, the bytes in flight at it) whose lanes the
    routing masks (kernels.critical_path counts the schedule's live share of its bytes), every
    line of its call; only a store of row data takes ``live``."""
    from moe_comm.kernels.compiled import marked_lines

    (tmp_path / "k.py").write_text("x = 1\n"
                                   "tl.store(p, v,  # gate: row live\n"
                                   "         mask=m)\n"
                                   "v = tl.load(q, mask=m)  # gate: live\n"
                                   "tl.store(r, v)  # gate: row\n")
    assert marked_lines(str(tmp_path), "row") == {("k.py", 2), ("k.py", 3), ("k.py", 5)}
    assert marked_lines(str(tmp_path), "live") == {("k.py", 2), ("k.py", 3), ("k.py", 4)}
    assert check_markers(str(tmp_path / "k.py")) == []
    (tmp_path / "k.py").write_text("if bad:  # gate: cold live\n")
    problems = check_markers(str(tmp_path / "k.py"))
    assert len(problems) == 1 and ":1:" in problems[0] and "only a store" in problems[0], \
        problems


def test_store_widths_are_read_per_marked_line(tmp_path):
    src = tmp_path / "kern.py"
    src.write_text("a\n"
                   "tl.store(p, v)  # gate: row\n"
                   "tl.store(q, w)  # gate: scales\n"
                   "tl.atomic_xchg(s, 1)  # gate: publish\n"
                   "tl.store(r, z)\n")
    ptx = (".loc 1 2 5\n"
           "@%p1 st.global.v4.b32 [ %rd1 + 0 ], { %r1, %r2, %r3, %r4 };\n"
           "@%p1 st.global.b16 [ %rd2 + 0 ], { %rs1 };\n"
           ".loc 1 3 5\n"
           "st.global.b32 [%rd3], %r5;\n"
           "st.local.v4.b32 [%rd3], {%r1, %r2, %r3, %r4};\n"
           ".loc 1 4 5\n"
           "atom.global.relaxed.sys.exch.b64 %rd9, [%rd4], %rd5;\n"
           ".loc 1 5 1\n"
           "st.global.b8 [%rd6], %rs2;\n"
           f'.file 1 "/somewhere/else/{src.name}"\n')
    found = marked_instructions(ptx, str(tmp_path))
    tags = [(tag, line, ins) for tag, _, line, ins in found]
    assert tags == [("row", 2, "st.global.v4.b32"), ("row", 2, "st.global.b16"),
                    ("scales", 3, "st.global.b32"), ("publish", 4,
                                                     "atom.global.relaxed.sys.exch.b64"),
                    ("", 5, "st.global.b8")]


def test_acquire_loads_are_read_and_every_marker_must_emit(tmp_path):
    """Triton compiles a fetch-and-add of 0 whose value is used to an acquire load: the gate
    reads it as the marked instruction; a call over several lines is marked on all of them; a
    marker no variant emitted is a problem."""
    src = tmp_path / "comm.py"
    src.write_text("a\n"
                   "return tl.atomic_add(w, 0, sem='acquire', scope='sys')  # gate: acquire\n"
                   "tl.atomic_add(v, 0, sem='acquire', scope='sys')  # gate: acquire\n"
                   "x = tl.load(w)\n"
                   "tl.store(out + r,  # gate: row\n"
                   "         tl.zeros([8], tl.bfloat16),\n"
                   "         mask=m)\n"
                   "y = 1\n")
    ptx = (".loc 1 2 5\n"
           "@%p1 ld.global.sys.acquire.b64 %rd1, [ %rd2 + 0 ];\n"
           ".loc 1 4 5\n"
           "ld.global.b64 %rd3, [ %rd2 + 0 ];\n"
           ".loc 1 6 5\n"  # Triton 3.6: a call over lines 5-7 located on its value's line
           "@%p2 st.global.v4.b32 [ %rd4 + 0 ], { %r1, %r1, %r1, %r1 };\n"
           ".loc 1 8 1\n"
           "st.global.b8 [%rd6], %rs2;\n"
           f'.file 1 "/elsewhere/{src.name}"\n')
    found = marked_instructions(ptx, str(tmp_path))
    assert [(t, line, i) for t, _, line, i in found] == [
        ("acquire", 2, "ld.global.sys.acquire.b64"), ("row", 5, "st.global.v4.b32"),
        ("", 8, "st.global.b8")]
    assert unemitted_markers(["comm.py:2", "comm.py:5"], [str(src)]) == [
        "comm.py:3: '# gate: acquire' emitted no instruction in any compiled variant"]
    assert unemitted_markers(["comm.py:2", "comm.py:3", "comm.py:5"], [str(src)]) == []


def test_nvshmem_issuers_follow_the_one_thread_guard():
    ttir = """
    %c0_i32 = arith.constant 0 : i32
    %0 = tt.elementwise_inline_asm "mov.u32 $0, %tid.x;" {constraints = "=r"} : -> i32
    %1 = arith.cmpi eq, %0, %c0_i32 : i32
    %2 = tt.extern_elementwise %a {libname = "", symbol = "nvshmemx_putmem_nbi_block"} : i32
    scf.if %1 {
      %3 = tt.extern_elementwise {libname = "", symbol = "nvshmem_quiet"} : () -> i32
    } else {
      %4 = tt.extern_elementwise {libname = "", symbol = "nvshmem_fence"} : () -> i32
    }
    scf.if %cond {
      %5 = tt.extern_elementwise %b {libname = "", symbol = "nvshmem_int_p"} : i32
    }
    scf.if %1 {
      %6 = tt.extern_elementwise %c {symbol = "nvshmemx_signal_op"} : i32
      %7 = tt.extern_elementwise %c {symbol = "nvshmemx_putmem_nbi_warp_block"} : i32
    }
    """
    assert nvshmem_issuers(ttir, 256) == {
        "nvshmemx_putmem_nbi_block": "block", "nvshmem_quiet": "1", "nvshmem_fence": "256",
        "nvshmem_int_p": "256", "nvshmemx_signal_op": "1",
        "nvshmemx_putmem_nbi_warp_block": "block-in-1-thread"}


def test_host_loads_follow_the_address_into_its_regions_only():
    """Loads of pointers made from ``errors_addr``: counted outside loops, inside a loop or a
    spin apart; a name a sibling region reuses for another address is not followed; a value
    loaded from host memory is data, not an address."""
    ttir = ("  tt.func public @k(%x: !tt.ptr<i64> loc(\"x\"(#loc)), %errors_addr: i64 "
            "loc(\"errors_addr\"(#loc))) attributes {noinline = false} {") + """
    %0 = tt.int_to_ptr %errors_addr : i64 -> !tt.ptr<i64> loc(#loc1)
    %1 = tt.load %0 : !tt.ptr<i64> loc(#loc2)
    %2 = tt.load %x : !tt.ptr<i64> loc(#loc3)
    scf.for %i = %c0 to %n step %c1  : i32 {
      %3 = tt.addptr %0, %c1 : !tt.ptr<i64>, i32 loc(#loc4)
      %4 = tt.load %3 : !tt.ptr<i64> loc(#loc5)
    } loc(#loc6)
    scf.if %c {
      %5 = tt.addptr %x, %c1 : !tt.ptr<i64>, i32 loc(#loc7)
      %6 = tt.load %5 : !tt.ptr<i64> loc(#loc8)
    } else {
      %5 = tt.addptr %0, %c1 : !tt.ptr<i64>, i32 loc(#loc7)
      %6 = tt.load %5 : !tt.ptr<i64> loc(#loc8)
      %7 = tt.int_to_ptr %1 : i64 -> !tt.ptr<i64> loc(#loc9)
    } loc(#loc10)
    scf.while (%a = %b) : (i32) -> () {
      %8 = tt.splat %0 : !tt.ptr<i64> -> tensor<128x!tt.ptr<i64>> loc(#loc11)
      %9 = tt.load %8 {isVolatile = true} : tensor<128x!tt.ptr<i64>> loc(#loc12)
      scf.condition(%t) loc(#loc13)
    } do {
      %10 = tt.load %x : !tt.ptr<i64> loc(#loc14)
      scf.yield loc(#loc15)
    } loc(#loc16)
    tt.return loc(#loc17)
  } loc(#loc18)
"""
    assert host_loads(ttir) == (2, 2)
    assert host_loads(ttir, names=("x",)) == (2, 1)


def test_rules():
    ok = Facts("k", 90, "c", "v", row_store_bits={"row": 128, "scales": 32, "exponents": 8},
               nvshmem_issuers={"nvshmem_quiet": "1", "nvshmemx_putmem_nbi_block": "block"})
    assert violations(ok, rows_aligned=True) == []
    bad = Facts("k", 90, "c", "v", stack_bytes=8, row_store_bits={"row": 64},
                nvshmem_issuers={"nvshmem_quiet": "128",
                                 "nvshmemx_putmem_nbi_block": "block-in-1-thread"},
                unordered_signals=["comm.py:3 atom.global.relaxed.exch.b64"])
    found = violations(bad, rows_aligned=True)
    assert len(found) == 5, found
    assert violations(Facts("k", 90, "c", "v", row_store_bits={"row": 16}),
                      rows_aligned=False) == []
    assert "does not compile" in violations(Facts("k", 90, "c", "v", error="boom"), True)[0]


class _FakeLaunch:
    def __init__(self, name, **flags):
        self.name, self._flags, self.options = name, flags, {"num_warps": 4}

    def flags(self):
        return dict(self._flags)


def test_the_pairwise_cover_holds_every_pair_a_kernel_runs_and_the_op_targets():
    """make test's Triton 3.6 gate compiles ``pairwise_cover`` of the variants: every pair of
    one kernel's specialisation values that some variant holds together is held by a chosen
    one, the variants the op predictions read are chosen, and a full product of flags is not
    compiled whole."""
    from moe_comm.testing.gate import Variant, _tokens, pairwise_cover

    def variant(name, dtype="bfloat16", **flags):
        return Variant(_FakeLaunch(name, **flags), ["dsv3-prefill"], dtype, True, [])

    product = [variant("combine_send_kernel", dtype, A=a, B=b, C=c)
               for dtype in ("bfloat16", "float16") for a in range(3) for b in range(3)
               for c in range(2)]
    target = variant("dispatch_send_kernel", HAS_WEIGHTS=1, FP8=0, TRANSPORT=0)
    others = [variant("dispatch_send_kernel", HAS_WEIGHTS=1, FP8=f, TRANSPORT=t)
              for f in (1, 2) for t in (0, 1)]
    chosen = pairwise_cover([*product, *others, target])
    assert target in chosen
    assert len([v for v in chosen if v.launch.name == "combine_send_kernel"]) < len(product)
    for group in (product, [*others, target]):
        kept = [v for v in chosen if v in group]
        for v in group:
            words = sorted(_tokens(v))
            for i, a in enumerate(words):
                for b in words[i:]:
                    assert any({a, b} <= _tokens(k) for k in kept), (a, b)
