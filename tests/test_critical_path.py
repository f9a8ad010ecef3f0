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
    """A kernel source the IR's locations name: line 2 stores rows, line 3 is a cold branch,
    line 4 a gather the routing masks, line 5 a branch taken now and then."""
    path = tmp_path / "k.py"
    path.write_text("x = 1\ntl.store(p, v)  # gate: row\nif bad:  # gate: cold\n"
                    "v = tl.load(p, mask=m)  # gate: live\nif fuller:  # gate: rare\n")
    return str(path)


def walk(body, source, scalars=None, hints=None, grid=(1, 1, 1)):
    text = module(body, source)
    return cp.analyse(text, {"n": 4} if scalars is None else scalars, grid, hints or {},
                      {(os.path.basename(source), 2)}, {(os.path.basename(source), 4)})


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


def test_a_rare_branch_counts_each_arm_as_often_as_it_is_taken(source):
    body = """\
    %c = arith.cmpi slt, %n, %n : i32 loc(#loc5)
    scf.if %c {
      %x = tt.load %a : !tt.ptr<i32> loc(#loc1)
      %q = tt.addptr %a, %x : !tt.ptr<i32>, i32 loc(#loc1)
      %y = tt.load %q : !tt.ptr<i32> loc(#loc1)
      tt.store %a, %y : !tt.ptr<i32> loc(#loc1)
    } else {
      %z = tt.load %a : !tt.ptr<i32> loc(#loc1)
      tt.store %a, %z : !tt.ptr<i32> loc(#loc1)
    } loc(#loc5)
"""
    weighed = walk(body, source, hints={cp.RARE: 0.25})
    assert weighed.steps == pytest.approx(0.25 * 2 + 0.75 * 1)
    assert weighed.bytes == pytest.approx(0.25 * 3 * 4 + 0.75 * 2 * 4)
    assert walk(body, source).steps == 2  # without the hint: the heavier arm


def test_a_software_pipelined_loop_waits_a_share_of_a_step_a_trip(source):
    body = """\
    %c0 = arith.constant 0 : i32 loc(#loc1)
    %c1 = arith.constant 1 : i32 loc(#loc1)
    %buf = ttg.local_alloc : () -> !ttg.memdesc<{smem}> loc(#loc1)
    %p = tt.splat %a : !tt.ptr<i32> -> {ptrs} loc(#loc1)
    %t0 = ttg.async_copy_global_to_local %p, %buf : {ptrs} -> <{smem}> loc(#loc1)
    %g0 = ttg.async_commit_group tokens %t0 loc(#loc1)
    %r = scf.for %i = %c0 to %n step %c1 iter_args(%tok = %g0) -> (!ttg.async.token)  : i32 {{
      %w = ttg.async_wait %tok {{num = {ahead} : i32}} loc(#loc1)
      %v = ttg.local_load %buf token %w : !ttg.memdesc<{smem}> -> {values} loc(#loc1)
      tt.store %p, %v : {ptrs} loc(#loc2)
      %t1 = ttg.async_copy_global_to_local %p, %buf : {ptrs} -> <{smem}> loc(#loc1)
      %g1 = ttg.async_commit_group tokens %t1 loc(#loc1)
      scf.yield %g1 : !ttg.async.token loc(#loc1)
    }} loc(#loc1)
""".replace("{smem}", "128xi32, #shared, #smem, mutable").replace(
        "{ptrs}", "tensor<128x!tt.ptr<i32>, #blocked>").replace(
        "{values}", "tensor<128xi32, #blocked>")
    # the first copy before the loop, then a trip waits for the copies of 1 + num trips back
    one_ahead = walk(body.format(ahead=1), source, {"n": 4})
    assert one_ahead.steps == pytest.approx(1 + 4 / 2)
    assert one_ahead.inflight_bytes == 2 * 128 * 4  # this trip's tile and the next one's
    assert one_ahead.bytes == (1 + 2 * 4) * 128 * 4
    assert walk(body.format(ahead=2), source, {"n": 4}).steps == pytest.approx(1 + 4 / 3)
    # num 0 leaves nothing in flight: each trip waits a whole step for the last trip's copies
    assert walk(body.format(ahead=0), source, {"n": 4}).steps == pytest.approx(1 + 4)


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


def test_a_gather_the_routing_masks_counts_its_live_lanes_only(source):
    body = """\
    %p = tt.splat %a : !tt.ptr<i32> -> tensor<128x!tt.ptr<i32>, #blocked> loc(#loc1)
    %x = tt.load %p : tensor<128x!tt.ptr<i32>, #blocked> loc(#loc1)
    %y = tt.load %p : tensor<128x!tt.ptr<i32>, #blocked> loc({line})
    %s = arith.addi %x, %y : tensor<128xi32, #blocked> loc(#loc1)
    tt.store %p, %s : tensor<128x!tt.ptr<i32>, #blocked> loc(#loc2)
"""
    marked = walk(body.format(line="#loc4"), source, hints={cp.LIVE: 0.25})
    assert marked.bytes == (1 + 0.25 + 1) * 128 * 4
    assert marked.inflight_bytes == (1 + 0.25) * 128 * 4
    assert marked.steps == 1
    # without the hint the marked load counts whole; an unmarked load never takes the hint
    assert walk(body.format(line="#loc4"), source).bytes == 3 * 128 * 4
    assert walk(body.format(line="#loc1"), source, hints={cp.LIVE: 0.25}).bytes == 3 * 128 * 4


def test_a_store_the_routing_masks_counts_its_live_lanes_only(source):
    """A row store on a line the routing masks (``# gate: row live``: one of a token's
    destinations or choices, stored where the routing sends it there) moves the hint's share
    of its bytes; the loads it stores stay whole."""
    body = """\
    %p = tt.splat %a : !tt.ptr<i32> -> tensor<128x!tt.ptr<i32>, #blocked> loc(#loc1)
    %x = tt.load %p : tensor<128x!tt.ptr<i32>, #blocked> loc(#loc1)
    tt.store %p, %x : tensor<128x!tt.ptr<i32>, #blocked> loc({line})
"""
    marked = walk(body.format(line="#loc4"), source, hints={cp.LIVE: 0.25})
    assert marked.bytes == (1 + 0.25) * 128 * 4
    assert marked.steps == 1
    assert walk(body.format(line="#loc4"), source).bytes == 2 * 128 * 4
    assert walk(body.format(line="#loc2"), source, hints={cp.LIVE: 0.25}).bytes == 2 * 128 * 4


def test_predicted_time_is_the_slower_of_steps_and_bytes():
    path = cp.Path(steps=10, bytes=0)
    assert cp.predicted_us(path, programs=132, regs=64, num_warps=8) == \
        pytest.approx(10 * cp.LATENCY_US)
    # twice the programs one wave holds: two waves
    assert cp.predicted_us(path, programs=2 * 132 * 4, regs=64, num_warps=8) == \
        pytest.approx(2 * 10 * cp.LATENCY_US)
    heavy = cp.Path(steps=1, bytes=cp.SM_GBPS * 1e3 * 100)  # 100 us of one SM's bytes
    assert cp.predicted_us(heavy, programs=20, regs=64, num_warps=8) == pytest.approx(100)


def test_the_combine_sends_routing_hints_match_a_uniform_draw():
    """tiles.live_choices, fuller_tiles, further_rows, fullest_slot, slot_rows_mean and
    reaches_rank against tokens routed at random: rank 0 of 8 holds 32 of 256 experts, top-8;
    its slots are the tokens with a choice there, in tiles of 64."""
    import numpy as np

    from moe_comm.kernels.tiles import (
        fuller_tiles,
        fullest_slot,
        further_rows,
        live_choices,
        reaches_rank,
        slot_rows_mean,
    )

    rng = np.random.default_rng(0)
    chosen = rng.random((100_000, 256)).argpartition(8, axis=1)[:, :8]
    rows = (chosen < 32).sum(axis=1)
    rows = rows[rows > 0]  # one slot each
    for in_flight in (1, 2, 4):
        share = np.minimum(rows, in_flight).mean() / in_flight
        assert live_choices(8, 256, 8, in_flight) == pytest.approx(share, abs=0.01)
    tiles = rows[: rows.size // 64 * 64].reshape(-1, 64).max(axis=1)  # a tile's fullest slot
    for in_flight in (2, 4):
        assert fuller_tiles(8, 256, 8, 64, in_flight) == pytest.approx(
            (tiles > in_flight).mean(), abs=0.02)
        assert further_rows(8, 256, 8, 64, in_flight) == pytest.approx(
            np.maximum(tiles - in_flight, 0).mean(), abs=0.05)
    assert fullest_slot(8, 256, 8, 64) == pytest.approx(tiles.mean(), abs=0.05)
    assert slot_rows_mean(8, 256, 8) == pytest.approx(rows.mean(), abs=0.01)
    # a token reaches rank 0 where one of its choices is there (the send's live share)
    assert reaches_rank(8, 256, 8) == pytest.approx((chosen < 32).any(axis=1).mean(), abs=0.01)
