"""kernels.critical_path on hand-made Triton GPU IR: what costs a dependent step, how loops,
waits and cold branches count, which bytes travel together, what a row store waits for."""
import os

import pytest

from moe_comm.kernels import critical_path as cp

LAYOUTS = "".join(
    f"#{name} = #ttg.blocked<{{sizePerThread = [{per_thread}], threadsPerWarp = [32], "
    f"warpsPerCTA = [{warps}], order = [0]}}>\n"
    for name, per_thread, warps in (("blocked", 1, 4), ("blocked1", 1, 1), ("blocked2", 4, 4)))


def module(body: str, source: str, args: str = "%a: !tt.ptr<i32> loc(\"a\"(#loc)), "
           "%n: i32 loc(\"n\"(#loc))") -> str:
    """A one-function TTGIR module around ``body``; ``#locN`` is line N of ``source``."""
    lines = open(source).read().count("\n") + 1
    locs = "\n".join(f'#loc{i} = loc("{source}":{i}:1)' for i in range(1, lines + 1))
    return (f'{LAYOUTS}#loc = loc("{source}":1:1)\n{locs}\n'
            'module attributes {"ttg.num-warps" = 4 : i32} {\n'
            f"  tt.func public @k({args}) attributes {{noinline = false}} {{\n"
            f"{body}"
            "    tt.return loc(#loc)\n  } loc(#loc)\n} loc(#loc)\n")


@pytest.fixture
def source(tmp_path):
    """A kernel source the IR's locations name: line 2 stores rows, line 3 is a cold branch."""
    path = tmp_path / "k.py"
    path.write_text("x = 1\ntl.store(p, v)  # gate: row\nif bad:  # gate: cold\n")
    return str(path)


def walk(body, source, scalars=None, hints=None, grid=(1, 1, 1)):
    text = module(body, source)
    return cp.analyse(text, {"n": 4} if scalars is None else scalars, grid, hints or {},
                      {(os.path.basename(source), 2)})


def test_loads_issued_together_cost_one_step_and_their_bytes_travel_together(source):
    path = walk("""\
    %p = tt.splat %a : !tt.ptr<i32> -> tensor<128x!tt.ptr<i32>, #blocked> loc(#loc1)
    %x = tt.load %p : tensor<128x!tt.ptr<i32>, #blocked> loc(#loc1)
    %y = tt.load %p : tensor<128x!tt.ptr<i32>, #blocked> loc(#loc1)
    %s = arith.addi %x, %y : tensor<128xi32, #blocked> loc(#loc1)
    tt.store %p, %s : tensor<128x!tt.ptr<i32>, #blocked> loc(#loc2)
""", source)
    assert path.steps == 1
    assert path.inflight_bytes == 2 * 128 * 4  # both loads, issued in the same step
    assert path.bytes == 3 * 128 * 4


def test_a_load_whose_address_is_loaded_waits_for_it(source):
    path = walk("""\
    %i = tt.load %a : !tt.ptr<i32> loc(#loc1)
    %q = tt.addptr %a, %i : !tt.ptr<i32>, i32 loc(#loc1)
    %v = tt.load %q : !tt.ptr<i32> loc(#loc1)
    tt.store %a, %v : !tt.ptr<i32> loc(#loc1)
""", source)
    assert path.steps == 2


def test_a_load_does_not_pass_a_store_before_it(source):
    path = walk("""\
    %x = tt.load %a : !tt.ptr<i32> loc(#loc1)
    tt.store %a, %x : !tt.ptr<i32> loc(#loc1)
    %y = tt.load %a : !tt.ptr<i32> loc(#loc1)
    tt.store %a, %y : !tt.ptr<i32> loc(#loc1)
""", source)
    assert path.steps == 2


def test_a_loop_costs_its_trips_times_a_trip(source):
    body = """\
    %c0 = arith.constant 0 : i32 loc(#loc1)
    %c1 = arith.constant 1 : i32 loc(#loc1)
    scf.for %i = %c0 to %n step %c1  : i32 {
      %x = tt.load %a : !tt.ptr<i32> loc(#loc1)
      tt.store %a, %x : !tt.ptr<i32> loc(#loc1)
    } loc(#loc1)
"""
    assert walk(body, source, {"n": 4}).steps == 4
    assert walk(body, source, {"n": 9}).steps == 9
    # a bound the launch does not give is named; a declared count takes its place
    unknown = walk(body, source, {})
    assert unknown.unknown_loops and unknown.steps == 1
    assert walk(body, source, {}, {"i": 3}).steps == 3
    # one parse serves every launch (the gate walks each config's launch of a compiled kernel)
    parsed = cp.parse(module(body, source))
    assert [cp.walk(parsed, {"n": n}, (1, 1, 1)).steps for n in (4, 9, 4)] == [4, 9, 4]


def test_a_wait_counts_its_polls_once_and_never_its_spin(source):
    path = walk("""\
    %x = tt.load %a {isVolatile = true} : !tt.ptr<i32> loc(#loc1)
    %w = scf.while (%v = %x) : (i32) -> i32 {
      %c = arith.cmpi slt, %v, %n : i32 loc(#loc1)
      scf.condition(%c) %v : i32 loc(#loc1)
    } do {
    ^bb0(%v2: i32 loc(#loc1)):
      %y = tt.load %a {isVolatile = true} : !tt.ptr<i32> loc(#loc1)
      %z = tt.load %a {isVolatile = true} : !tt.ptr<i32> loc(#loc1)
      scf.yield %z : i32 loc(#loc1)
    } loc(#loc1)
    %o = tt.atomic_rmw add, acquire, sys, %a, %n : (!tt.ptr<i32>, i32) -> i32 loc(#loc1)
""", source)
    assert path.steps == 2  # the poll, then the acquire


def test_a_cold_branch_is_not_taken_the_heavier_arm_is(source):
    body = """\
    %c = arith.cmpi slt, %n, %n : i32 loc({loc})
    scf.if %c {{
      %x = tt.load %a : !tt.ptr<i32> loc(#loc1)
      %q = tt.addptr %a, %x : !tt.ptr<i32>, i32 loc(#loc1)
      %y = tt.load %q : !tt.ptr<i32> loc(#loc1)
      tt.store %a, %y : !tt.ptr<i32> loc(#loc1)
    }} loc({loc})
"""
    assert walk(body.format(loc="#loc1"), source).steps == 2
    assert walk(body.format(loc="#loc3"), source).steps == 0  # line 3: "# gate: cold"


def test_barriers_across_warps_cost_a_step_and_those_within_a_warp_none(source):
    body = """\
    %r = tt.make_range {{end = {n} : i32, start = 0 : i32}} : tensor<{n}xi32, {layout}> loc(#loc1)
    %s = "tt.reduce"(%r) <{{axis = 0 : i32}}> ({{
    ^bb0(%u: i32 loc(#loc1), %v: i32 loc(#loc1)):
      %w = arith.addi %u, %v : i32 loc(#loc1)
      tt.reduce.return %w : i32 loc(#loc1)
    }}) : (tensor<{n}xi32, {layout}>) -> i32 loc(#loc1)
    tt.store %a, %s : !tt.ptr<i32> loc(#loc1)
"""
    assert walk(body.format(n=128, layout="#blocked"), source).steps == 1  # 4 warps
    assert walk(body.format(n=32, layout="#blocked"), source).steps == 0  # one warp's span
    assert walk(body.format(n=128, layout="#blocked1"), source).steps == 0  # one warp
    convert = """\
    %r = tt.make_range {end = 512 : i32, start = 0 : i32} : tensor<512xi32, #blocked> loc(#loc1)
    %c = ttg.convert_layout %r : tensor<512xi32, #blocked> -> tensor<512xi32, #blocked2> loc(#loc1)
    %p = tt.splat %a : !tt.ptr<i32> -> tensor<512x!tt.ptr<i32>, #blocked2> loc(#loc1)
    tt.store %p, %c : tensor<512x!tt.ptr<i32>, #blocked2> loc(#loc1)
"""
    assert walk(convert, source).steps == 1  # element 32 moves from warp 1 to warp 0


def test_what_rows_wait_for_inside_a_loop_that_stores_them(source):
    body = """\
    %c0 = arith.constant 0 : i32 loc(#loc1)
    %c1 = arith.constant 1 : i32 loc(#loc1)
    scf.for %i = %c0 to %n step %c1  : i32 {{
      %x = tt.load %a : !tt.ptr<i32> loc(#loc1)
      %q = tt.addptr %a, {offset} : !tt.ptr<i32>, i32 loc(#loc1)
      %y = tt.load %q : !tt.ptr<i32> loc(#loc1)
      tt.store %a, %y : !tt.ptr<i32> loc(#loc2)
    }} loc(#loc1)
"""
    gathered = walk(body.format(offset="%x"), source)
    assert any("index gather" in w for w in gathered.barriers_in_row_loops)
    assert gathered.steps == 2 * 4
    plain = walk(body.format(offset="%i"), source)
    assert plain.barriers_in_row_loops == [] and plain.steps == 4


def test_predicted_time_is_the_slower_of_steps_and_bytes():
    path = cp.Path(steps=10, bytes=0)
    assert cp.predicted_us(path, programs=132, regs=64, num_warps=8) == \
        pytest.approx(10 * cp.LATENCY_US)
    # twice the programs one wave holds: two waves
    assert cp.predicted_us(path, programs=2 * 132 * 4, regs=64, num_warps=8) == \
        pytest.approx(2 * 10 * cp.LATENCY_US)
    heavy = cp.Path(steps=1, bytes=cp.SM_GBPS * 1e3 * 100)  # 100 us of one SM's bytes
    assert cp.predicted_us(heavy, programs=20, regs=64, num_warps=8) == pytest.approx(100)
