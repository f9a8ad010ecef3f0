"""Tests of moe_comm.perfmodel: closed forms, simulators, calibration, scale, CLI, errors."""
import dataclasses
import io
import itertools
import math
import os
import subprocess
import sys
import time
from contextlib import redirect_stdout

import numpy as np
import pytest

from moe_comm.perfmodel import (
    BOTTLENECKS,
    FITTED,
    SYSTEMS,
    System,
    calibration,
    cli,
    expected_fanout,
    loads,
    predict,
    routing,
)

DSV3 = {"hidden": 7168, "topk": 8, "num_experts": 256, "dispatch_dtype": "fp8",
        "combine_dtype": "bf16"}


def _uniform_ids(rng, n, E, k):
    """[n, k] uniform distinct expert ids (random keys, top-k)."""
    return np.argsort(rng.random((n, E)), axis=1)[:, :k]


# ---------------------------------------------------------------- closed forms vs enumeration
@pytest.mark.parametrize("E,k,G", [(12, 3, 2), (12, 3, 3), (12, 4, 4), (12, 5, 6), (10, 2, 5),
                                   (8, 8, 4), (9, 1, 3)])
def test_expected_fanout_matches_enumeration(E, k, G):
    g = E // G
    combos = list(itertools.combinations(range(E), k))
    brute = sum(len({e // g for e in c}) for c in combos) / len(combos)
    assert expected_fanout(E, k, G) == pytest.approx(brute, rel=1e-12, abs=1e-12)


def test_block_untouched_is_stable_for_huge_E():
    E, k, size = 10 ** 7, 8, 40
    exact = math.comb(E - size, k) / math.comb(E, k)
    assert routing.prob_block_untouched(E, k, size) == pytest.approx(exact, rel=1e-12)
    assert routing.prob_block_untouched(16, 8, 10) == 0.0
    assert expected_fanout(2 ** 20, 8, 2 ** 17) == pytest.approx(
        2 ** 17 * (1 - math.comb(2 ** 20 - 8, 8) / math.comb(2 ** 20, 8)), rel=1e-12)


@pytest.mark.parametrize("E,k,J,g", [(12, 4, 2, 3), (12, 5, 3, 4), (10, 3, 1, 5), (9, 4, 3, 2),
                                     (8, 8, 2, 4), (7, 3, 0, 2)])
def test_designated_pmf_matches_enumeration(E, k, J, g):
    brute = np.zeros((k + 1, k + 1))
    combos = list(itertools.combinations(range(E), k))
    for c in combos:
        inside = [e // g for e in c if e < J * g]
        brute[len(set(inside)), len(inside)] += 1
    brute /= len(combos)
    np.testing.assert_allclose(routing.designated_pmf(E, k, J, g), brute, atol=1e-12)


def test_sum_and_max_matches_exact_convolution():
    pmf = np.array([0.5, 0.2, 0.3])
    n, ranks = 5, 7
    dist = np.array([1.0])
    for _ in range(n):
        dist = np.convolve(dist, pmf)
    cdf = np.cumsum(dist)
    exact_max = sum(1 - cdf[x] ** ranks for x in range(dist.size))
    got = loads.sum_and_max(pmf, n, ranks)
    assert got.mean == pytest.approx(n * 0.8)
    assert got.max == pytest.approx(exact_max, rel=1e-9)


def test_sum_and_max_windowed_matches_monte_carlo():
    pmf = routing.picks_in_block_pmf(256, 8, 4)        # pairs one token sends to a rank
    n, ranks = 64 * 128, 64
    got = loads.sum_and_max(pmf, n, ranks)
    rng = np.random.default_rng(1)
    counts = rng.multinomial(n, pmf, size=(3000, ranks))         # [draws, ranks, values]
    draws = (counts @ np.arange(pmf.size)).max(axis=1)
    assert got.mean == pytest.approx(n * 8 * 4 / 256)
    assert got.max == pytest.approx(draws.mean(), rel=0.01)


# ---------------------------------------------------------------- samplers and simulated loads
def test_uniform_loads_match_counted_simulation():
    """E[max over ranks] from the closed form vs exact counts of simulated global routings."""
    layout = loads.Layout(ep=16, gpn=4, m=4)
    T, k = 64, 4
    classes = loads.LL_CLASSES + loads.INTERNODE_CLASSES
    model = loads.compute_loads(layout, T, k, routing.RoutingSpec("uniform"), classes,
                                np.random.default_rng(0), 4096)
    rng = np.random.default_rng(2)
    runs = [loads._counted_loads(layout, T, _uniform_ids(rng, 16 * T, 64, k), classes)
            for _ in range(60)]
    for c in classes:
        sim_mean = np.mean([r[c].mean for r in runs])
        sim_max = np.mean([r[c].max for r in runs])
        assert model[c].mean == pytest.approx(sim_mean, rel=0.03), c
        assert model[c].max == pytest.approx(sim_max, rel=0.05), c
    assert model.ranks_per_token == pytest.approx(expected_fanout(64, k, 16))
    assert model.nodes_per_token == pytest.approx(expected_fanout(64, k, 4))


def test_group_limited_sampler_limits_groups_and_reduces_to_uniform():
    rng = np.random.default_rng(3)
    ids = routing.sample_group_limited(rng, 20000, 64, 6, 8, 3)
    assert ids.shape == (20000, 6)
    assert (np.sort(ids, axis=1)[:, 1:] != np.sort(ids, axis=1)[:, :-1]).all()
    assert max(len(set(row // 8)) for row in ids[:2000]) <= 3
    # with every group kept, the picks are uniform top-k: fan-out matches the closed form
    ids = routing.sample_group_limited(rng, 40000, 64, 6, 8, 8)
    fan = np.mean([len(set(r)) for r in (ids // 8)])
    assert fan == pytest.approx(expected_fanout(64, 6, 8), rel=0.01)
    counts = np.bincount(ids.ravel(), minlength=64) / ids.shape[0]
    np.testing.assert_allclose(counts, 6 / 64, rtol=0.08)


def test_zipf_sampler_and_inclusion_probabilities():
    rng = np.random.default_rng(4)
    E, k = 64, 4
    w = routing.zipf_weights(E, 1.0, rng)
    ids = routing.sample_weighted_distinct(rng, 100000, w, k)
    srt = np.sort(ids, axis=1)
    assert (srt[:, 1:] != srt[:, :-1]).all() and ids.min() >= 0
    freq = np.bincount(ids.ravel(), minlength=E) / ids.shape[0]
    pi = routing.inclusion_probabilities(w, k)
    assert pi.sum() == pytest.approx(k)
    hot = np.argsort(-w)[:8]
    np.testing.assert_allclose(pi[hot], freq[hot], rtol=0.06)
    # alpha = 0 is uniform routing
    ids0 = routing.sample_weighted_distinct(rng, 40000, routing.zipf_weights(E, 0.0, rng), k)
    assert np.mean([len(set(r)) for r in ids0 // 8]) == pytest.approx(
        expected_fanout(E, k, 8), rel=0.01)
    # heavy skew still yields k distinct experts
    heavy = routing.sample_weighted_distinct(rng, 2000, routing.zipf_weights(E, 4.0, rng), 8)
    assert (np.sort(heavy, axis=1)[:, 1:] != np.sort(heavy, axis=1)[:, :-1]).all()


def test_zipf_rank_statistics_match_counted_simulation():
    """The per-rank laws used at scale vs exact counts of fully simulated zipf routings."""
    layout = loads.Layout(ep=16, gpn=4, m=4)
    T, E, k = 256, 64, 4
    rng = np.random.default_rng(11)
    w = routing.zipf_weights(E, 1.0, rng)
    sample = routing.sample_weighted_distinct(rng, 20000, w, k)
    classes = loads.LL_CLASSES + loads.INTERNODE_CLASSES
    model = loads._hetero_loads(layout, T, routing.inclusion_probabilities(w, k), None, None,
                                sample, classes, rng, "test")
    runs = [loads._counted_loads(layout, T, routing.sample_weighted_distinct(rng, 16 * T, w, k),
                                 classes) for _ in range(30)]
    for c in classes:
        assert model[c].mean == pytest.approx(np.mean([r[c].mean for r in runs]), rel=0.03), c
        assert model[c].max == pytest.approx(np.mean([r[c].max for r in runs]), rel=0.05), c


def test_skew_makes_slowest_rank_slower_and_is_seeded():
    base = dict(ep=64, tokens_per_rank=128, gpus_per_node=8, **DSV3)
    uni = predict("h800", "low_latency", **base)
    z1 = predict("h800", "low_latency", routing="zipf:1.0", seed=7, **base)
    z2 = predict("h800", "low_latency", routing="zipf:1.0", seed=7, **base)
    assert z1.dispatch_us == z2.dispatch_us
    assert z1.dispatch_us > uni.dispatch_us
    assert z1.dispatch.imbalance > uni.dispatch.imbalance >= 1.0
    z0 = predict("h800", "low_latency", routing="zipf:0", **base)
    assert z0.dispatch_us == pytest.approx(uni.dispatch_us, rel=0.03)
    gl = predict("h800", "normal", **{**base, "tokens_per_rank": 4096},
                 routing="group_limited:8:2")
    assert gl.nodes_per_token <= 2.0 + 1e-9
    assert gl.dispatch.bytes.rdma_bytes < predict(
        "h800", "normal", **{**base, "tokens_per_rank": 4096}).dispatch.bytes.rdma_bytes


def test_routing_tensor_global_and_sample():
    rng = np.random.default_rng(5)
    ep, T, E, k = 16, 32, 64, 4
    ids = _uniform_ids(rng, ep * T, E, k)
    ids[0, 1] = -1                                            # a masked slot
    p = predict("h100", "low_latency", ep=ep, tokens_per_rank=T, hidden=1024, topk=k,
                num_experts=E, routing=ids, gpus_per_node=8)
    assert p.method == "counted"
    assert p.pairs_per_token == pytest.approx((ep * T * k - 1) / (ep * T))
    assert p.dispatch.bytes.logical_bytes == pytest.approx(
        (ep * T * k - 1) / ep * (1024 + 32 + 16))
    sample = predict("h100", "normal", ep=ep, tokens_per_rank=T, hidden=1024, topk=k,
                     num_experts=E, routing=ids[:100], gpus_per_node=8)
    assert sample.method.startswith("sampled") and sample.dispatch_us > 0
    torch = pytest.importorskip("torch")
    as_tensor = predict("h100", "low_latency", ep=ep, tokens_per_rank=T, hidden=1024, topk=k,
                        num_experts=E, routing=torch.from_numpy(ids), gpus_per_node=8,
                        dispatch_dtype=torch.bfloat16, combine_dtype=torch.bfloat16)
    assert as_tensor.dispatch_dtype == "bf16" and as_tensor.method == "counted"


# ---------------------------------------------------------------- conventions and calibration
def test_bandwidth_conventions():
    H, k, T = 7168, 8, 128
    ll = predict("h800", "low_latency", ep=16, tokens_per_rank=T, gpus_per_node=8, **DSV3)
    assert ll.dispatch.bytes.logical_bytes == pytest.approx(T * k * (H + H / 128 * 4 + 16))
    assert ll.combine.bytes.logical_bytes == pytest.approx(T * k * 2 * H)
    assert ll.dispatch_GBps == pytest.approx(ll.dispatch.bytes.logical_bytes / ll.dispatch_us
                                             / 1e3)
    intra = predict("h800", "normal", ep=8, tokens_per_rank=4096, **DSV3)
    fan = expected_fanout(256, 8, 8)
    assert intra.dispatch.bytes.logical_bytes == pytest.approx(4096 * fan * H * (1 + 4 / 128))
    assert intra.combine.bytes.logical_bytes == pytest.approx(4096 * fan * H * 2)
    inter = predict("h800", "normal", ep=32, tokens_per_rank=4096, **DSV3)
    nodes = expected_fanout(256, 8, 4)
    assert inter.dispatch.bytes.logical_bytes == pytest.approx(4096 * nodes * H * (1 + 4 / 128))
    # the minimum: each token once per other destination rank
    bf = predict("h800", "normal", ep=8, tokens_per_rank=64, hidden=512, topk=4, num_experts=32,
                 dispatch_dtype="bf16", combine_dtype="fp32")
    fan = expected_fanout(32, 4, 8)
    assert bf.bytes["dispatch"].min_link_bytes == pytest.approx(64 * fan * 7 / 8 * 512 * 2)
    assert bf.bytes["combine"].min_link_bytes == pytest.approx(64 * fan * 7 / 8 * 512 * 4)
    assert bf.dispatch.bytes.local_fraction == pytest.approx(1 / 8)


def test_calibration_points_within_ten_percent():
    for point in calibration.CALIBRATION_POINTS:
        got = calibration.predicted(point)
        assert abs(got / point.target - 1) < 0.10, (point, got)


def test_refit_reproduces_the_stored_constants():
    fit = calibration.fit_constants()
    assert fit.nvlink_copy_efficiency == pytest.approx(FITTED.nvlink_copy_efficiency, rel=0.01)
    assert fit.normal_fixed_us == pytest.approx(FITTED.normal_fixed_us, rel=0.02)
    assert fit.low_latency_fixed_us == pytest.approx(FITTED.low_latency_fixed_us, rel=0.02)
    assert "low_latency" in calibration.report()


# ---------------------------------------------------------------- monotonicity
CASES = [("normal", 8, 4096), ("normal", 64, 4096), ("low_latency", 8, 128),
         ("low_latency", 128, 128)]


@pytest.mark.parametrize("mode,ep,T", CASES)
def test_more_bytes_never_faster(mode, ep, T):
    def times(**kw):
        args = dict(ep=ep, tokens_per_rank=T, gpus_per_node=8, **DSV3)
        args.update(kw)
        p = predict("h800", mode, **args)
        return p.dispatch_us, p.combine_us
    for key, values in (("hidden", [1024, 2048, 4096, 7168, 12288]),
                        ("tokens_per_rank", [1, 16, T // 2, T, 2 * T]),
                        ("topk", [1, 2, 4, 6, 8]),
                        ("dispatch_dtype", ["fp8", "bf16", "fp32"]),
                        ("combine_dtype", ["bf16", "fp32"])):
        seq = [times(**{key: v}) for v in values]
        for a, b in itertools.pairwise(seq):
            assert b[0] >= a[0] * (1 - 1e-9) and b[1] >= a[1] * (1 - 1e-9), (key, seq)


@pytest.mark.parametrize("mode,ep,T", CASES)
def test_more_bandwidth_never_slower(mode, ep, T):
    base = SYSTEMS["h800"]
    ref = predict(base, mode, ep=ep, tokens_per_rank=T, **DSV3)
    for field in ("nvlink_peak_GBps", "nic_Gbps", "pcie_GBps", "hbm_GBps", "sm_clock_GHz",
                  "nic_message_rate_Mpps"):
        prev = ref
        for factor in (1.5, 2.0, 4.0):
            faster = dataclasses.replace(base, **{field: getattr(base, field) * factor})
            p = predict(faster, mode, ep=ep, tokens_per_rank=T, **DSV3)
            assert p.dispatch_us <= prev.dispatch_us + 1e-9, field
            assert p.combine_us <= prev.combine_us + 1e-9, field
            prev = p
    slow = dataclasses.replace(base, oversubscription=4.0)
    assert predict(slow, mode, ep=ep, tokens_per_rank=T, **DSV3).combine_us >= ref.combine_us


# ---------------------------------------------------------------- bottlenecks, systems, fabric
def test_bottlenecks_name_the_binding_resource():
    assert predict("h800", "normal", ep=8, tokens_per_rank=4096, **DSV3).bottleneck == "nvlink"
    assert predict("h800", "low_latency", ep=64, tokens_per_rank=128,
                   **DSV3).bottleneck == "rdma"
    assert predict("h800", "low_latency", ep=8, tokens_per_rank=1,
                   **DSV3).dispatch.bottleneck == "latency"
    assert predict("h800", "normal", ep=8, tokens_per_rank=4096, num_sms=1,
                   **DSV3).bottleneck == "sm_issue"
    tiny = predict("h800", "low_latency", ep=64, tokens_per_rank=4096, hidden=32, topk=8,
                   num_experts=256, dispatch_dtype="bf16")
    assert tiny.dispatch.bottleneck == "nic_message_rate"
    narrow = dataclasses.replace(SYSTEMS["h800"], pcie_GBps=8.0)
    assert predict(narrow, "normal", ep=32, tokens_per_rank=4096,
                   **DSV3).bottleneck == "pcie"
    rack = predict("gb200-nvl72", "normal", ep=72, tokens_per_rank=4096,
                   **{**DSV3, "num_experts": 288})
    for p in (tiny, rack):
        for phase in (p.dispatch, p.combine):
            assert phase.bottleneck in BOTTLENECKS
            assert set(phase.terms_us) <= set(BOTTLENECKS)
            assert phase.time_us == pytest.approx(phase.latency_us + max(phase.terms_us.values()))


def test_presets_and_system_fields():
    for name in ("h800", "h100", "h200", "b200", "gb200-nvl72"):
        s = SYSTEMS[name]
        assert isinstance(s, System) and s.nvlink_GBps > 0 and s.nic_GBps == s.nic_Gbps / 8
    assert SYSTEMS["h800"].nvlink_GBps == pytest.approx(160.0)
    assert SYSTEMS["gb200-nvl72"].nvlink_peak_GBps == 900.0
    assert SYSTEMS["gb200-nvl72"].nvlink_domain_size == 72
    p = predict("GB200-NVL72", "low_latency", ep=128, tokens_per_rank=128, **DSV3)
    assert p.gpus_per_node == 64 and p.nodes == 2
    assert predict("gb200-nvl72", "low_latency", ep=64, tokens_per_rank=128,
                   **DSV3).bottleneck != "rdma"
    with pytest.raises(ValueError, match="topology"):
        System(name="x", nvlink_peak_GBps=1, nvlink_domain_size=8, nvlink_latency_us=1,
               topology="torus")


def test_fabric_planes_and_tiers():
    base = {"ep": 4096, "tokens_per_rank": 128, "hidden": 7168, "topk": 8, "num_experts": 8192}
    one = predict("h800", "low_latency", **base)
    assert one.notes and "tiers" in one.notes[0]
    planes = dataclasses.replace(SYSTEMS["h800"], planes=8)
    multi = predict(planes, "low_latency", **base)
    assert multi.dispatch.bytes.nvlink_bytes > one.dispatch.bytes.nvlink_bytes
    assert not predict("h800", "low_latency", ep=64, tokens_per_rank=128, **DSV3).notes


# ---------------------------------------------------------------- scale
def test_scale_one_call_at_131072_ranks():
    for mode, routing_spec in (("low_latency", "uniform"), ("normal", "uniform"),
                               ("low_latency", "zipf:1.0")):
        start = time.perf_counter()
        p = predict("h800", mode, ep=131072, tokens_per_rank=128, hidden=7168, topk=8,
                    num_experts=262144, routing=routing_spec)
        elapsed = time.perf_counter() - start
        assert elapsed < 5.0, (mode, routing_spec, elapsed)
        assert p.dispatch_us > 0 and p.nodes == 16384


def test_scale_sweep_of_twenty_ep_sizes():
    eps = [8 * 2 ** i for i in range(15)] + [24, 48, 96, 192, 384]
    start = time.perf_counter()
    for ep in eps:
        for mode in ("normal", "low_latency"):
            predict("b200", mode, ep=ep, tokens_per_rank=256, hidden=7168, topk=8,
                    num_experts=2 * ep)
    assert time.perf_counter() - start < 30.0


# ---------------------------------------------------------------- CLI and plot
def test_cli_prints_one_table():
    out = io.StringIO()
    with redirect_stdout(out):
        rc = cli.main(["--system", "h800", "b200", "--mode", "low_latency", "--ep", "8", "16",
                       "32", "64", "--tokens", "128", "--hidden", "7168", "--topk", "8",
                       "--experts", "256"])
    assert rc == 0
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 1 + 2 * 4
    assert lines[0].split()[:3] == ["system", "mode", "ep"]
    assert {len(line) for line in lines} == {len(lines[0])}          # aligned columns
    assert "rdma" in out.getvalue() and "nvlink" in out.getvalue()


def test_cli_module_entry_point_and_errors():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
         os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "moe_comm.perfmodel", "--ep", "8", "16",
                          "--experts-per-rank", "32"], capture_output=True, text=True,
                         env=env, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert len(run.stdout.strip().splitlines()) == 3
    assert cli.main(["--ep", "7", "--experts", "256"]) == 2          # 256 % 7 != 0
    assert cli.main(["--system", "tpu", "--ep", "8"]) == 2


def test_cli_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (pip install matplotlib)")
    path = tmp_path / "sweep.png"
    with redirect_stdout(io.StringIO()):
        rc = cli.main(["--system", "h800", "gb200-nvl72", "--mode", "low_latency", "--ep", "8",
                       "16", "32", "64", "128", "--plot", str(path)])
    assert rc == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,match", [
    ({"num_experts": 250}, "divisible by ep"),
    ({"topk": 300}, "exceeds num_experts"),
    ({"system": "tpu-v5"}, "unknown system"),
    ({"mode": "fast"}, "mode must be"),
    ({"routing": "zipf"}, "bad routing"),
    ({"routing": "zipf:-1"}, "bad routing"),
    ({"routing": "power:2"}, "bad routing"),
    ({"routing": "group_limited:3:1"}, "must divide num_experts"),
    ({"routing": "group_limited:8:9"}, "topk_groups"),
    ({"routing": "group_limited:64:1"}, "exceeds"),
    ({"dispatch_dtype": "int8"}, "not supported"),
    ({"combine_dtype": "fp8"}, "not supported"),
    ({"gpus_per_node": 16}, "exceeds the NVLink domain"),
    ({"ep": 24, "gpus_per_node": 16, "num_experts": 240, "system": "gb200-nvl72"},
     "multiple of"),
    ({"num_sms": 500}, "exceeds"),
    ({"ep": 0}, "ep must be"),
    ({"tokens_per_rank": True}, "tokens_per_rank"),
    ({"routing": np.zeros((4, 3), dtype=np.int64)}, "shape"),
    ({"routing": np.full((4, 8), 300)}, r"ids must be in"),
    ({"routing": np.zeros((4, 8), dtype=np.int64)}, "same expert twice"),
    ({"routing": np.zeros((4, 8))}, "integer"),
])
def test_bad_input_raises_clear_errors(kwargs, match):
    args = dict(system="h800", mode="low_latency", ep=16, tokens_per_rank=128, **DSV3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        predict(**args)
