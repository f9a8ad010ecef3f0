"""MXFP8 dispatch (normal mode): e4m3 values and one E8M0 scale per 32 channels, quantized in
the send kernel; bit for bit the plain-PyTorch reference (``moe_comm.microscale``)."""
import pytest
import torch

import moe_comm
from cases import Case, make_inputs
from moe_comm import microscale, reference
from moe_comm.perfmodel import moe_comm_counters
from moe_comm.testing import lockstep


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _adversarial(xs):
    """NaN, infinity, an all-zero token and tiny values in the inputs."""
    xs = [x.clone() for x in xs]
    for r, x in enumerate(xs):
        if x.shape[0] > 2:
            x[0, 3 + r] = float("nan")
            x[1, 40] = float("inf")
            x[2] = 0.0
            x[-1] *= 1e-6
    return xs


CASES = [
    Case(2, 8, 256, 8, (13, 0), routing="zipf", alignment=16, seed=61),
    Case(4, 16, 96, 4, (9, 3, 0, 11), routing="one_expert", seed=62),        # H % 128 != 0
    Case(8, 32, 512, 8, (6, 9, 2, 7, 5, 0, 8, 4), dtype=torch.float32, routing="zipf",
         seed=63),
    Case(4, 16, 160, 2, (7, 7, 7, 7), dtype=torch.float16, routing="empty_rank", seed=64),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_mxfp8_dispatch_matches_reference(case):
    R, H = case.world_size, case.hidden
    xs, idxs, ws = make_inputs(case)
    xs = _adversarial(xs)
    bufs = moe_comm.Buffer.loopback(R, H, case.num_experts, case.max_tokens, case.dtype,
                                    max_topk=case.topk)
    for it in range(2):   # twice: both staging parities
        got = lockstep.dispatch(bufs, xs, idxs, ws, case.alignment, dispatch_dtype="mxfp8")
        want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts,
                                      expert_alignment=case.alignment, dispatch_dtype="mxfp8")
        for r in range(R):
            g, w = got[r], want[r]
            assert g.x.dtype == torch.float8_e4m3fn and g.x_scales.dtype == torch.float8_e8m0fnu
            assert g.x_scales.shape == (g.x.shape[0], H // 32) and g.x_scales.is_contiguous()
            assert torch.equal(_bytes(g.x), _bytes(w.x)), (r, it)
            assert torch.equal(_bytes(g.x_scales), _bytes(w.x_scales)), (r, it)
            for field in ("weights", "src_rank", "src_token", "tokens_per_expert",
                          "expert_offsets"):
                assert torch.equal(getattr(g, field), getattr(w, field)), (r, field)
        # the combine of the dequantized rows works as after any dispatch
        ys = [microscale.dequantize_mxfp8(g.x, g.x_scales).nan_to_num().to(case.dtype)
              for g in got]
        outs = lockstep.combine(bufs, ys, [g.handle for g in got], [g.weights for g in got])
        refs = reference.combine_all(ys, [w.handle for w in want], [w.weights for w in want])
        for o, f in zip(outs, refs, strict=True):
            assert torch.equal(o, f)


def test_mxfp8_quantized_pair_and_bytes_on_the_link():
    case = Case(4, 16, 256, 4, (8, 8, 8, 8), routing="zipf", seed=65)
    R, H, E, K = 4, case.hidden, case.num_experts, case.topk
    xs, idxs, ws = make_inputs(case)
    pairs = [microscale.quantize_mxfp8(x) for x in xs]
    bufs = moe_comm.Buffer.loopback(R, H, E, 8, case.dtype, max_topk=K)
    before = [b.stats() for b in bufs]
    got = lockstep.dispatch(bufs, pairs, idxs, ws, dispatch_dtype="mxfp8")
    again = lockstep.dispatch(bufs, xs, idxs, ws, dispatch_dtype="mxfp8")
    want = reference.dispatch_all(xs, idxs, ws, num_experts=E, dispatch_dtype="mxfp8")
    for r in range(R):
        for res in (got[r], again[r]):
            assert torch.equal(_bytes(res.x), _bytes(want[r].x))
            assert torch.equal(_bytes(res.x_scales), _bytes(want[r].x_scales))
    # a row is H + H/32 bytes plus metadata; the performance model counts the same
    ids = torch.cat(idxs).numpy()
    counted = moe_comm_counters(ids, ep=R, num_experts=E, hidden=H, gpus_per_node=R,
                                dispatch_dtype="mxfp8")
    for r, b in enumerate(bufs):
        stats = b.stats()
        for key in ("dispatch_bytes_to_peers", "dispatch_bytes_to_self"):
            assert stats[key] - before[r][key] == 2 * counted[r]["dispatch"][key], (r, key)


def test_mxfp8_errors_before_any_kernel():
    buf = moe_comm.Buffer.loopback(1, 80, 4, 8, torch.bfloat16)[0]
    x = torch.randn(4, 80).to(torch.bfloat16)
    idx = torch.zeros((4, 1), dtype=torch.int64)
    with pytest.raises(ValueError, match="hidden % 32"):
        buf.dispatch(x, idx, dispatch_dtype="mxfp8")
    buf = moe_comm.Buffer.loopback(1, 64, 4, 8, torch.bfloat16)[0]
    x = torch.randn(4, 64).to(torch.bfloat16)
    for kwargs, match in ((dict(fp8=False), "cannot go with fp8=False"),
                          (dict(ue8m0=True), "E8M0 by definition"),
                          (dict(col_major_scales=True), "swizzle_128x4"),
                          (dict(dispatch_dtype="int4"), "dispatch_dtype must be")):
        kwargs.setdefault("dispatch_dtype", "mxfp8")
        with pytest.raises(ValueError, match=match):
            buf.dispatch(x, idx, **kwargs)
    q, s = microscale.quantize_mxfp8(x)
    with pytest.raises(ValueError, match="one per 32 channels"):
        buf.dispatch((q, s[:, :1]), idx, dispatch_dtype="mxfp8")
    with pytest.raises(TypeError, match="float8_e8m0fnu"):
        buf.dispatch((q, s.float()), idx, dispatch_dtype="mxfp8")
    assert buf.stats()["dispatch_bytes_to_self"] == 0       # nothing ran
    res = buf.dispatch(x, idx, dispatch_dtype="mxfp8")
    assert res.x.shape == (4, 64) and res.x_scales.shape == (4, 2)


@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "hier"])
def test_mxfp8_across_nodes(ranks, hierarchical):
    pytest.importorskip("nixl_cu13")
    from internode_jobs import nodes_case
    case = Case(4, 16, 160, 4, (9, 0, 6, 11), routing="zipf", seed=66)
    reports = ranks(4).run(nodes_case, case, 2, hierarchical, iterations=2, fp8=None,
                           dispatch_dtype="mxfp8")
    assert len(reports) == 4


LL_CASES = [
    Case(2, 8, 256, 4, (6, 5), routing="zipf", seed=71),
    Case(4, 16, 96, 2, (4, 0, 5, 3), routing="one_expert", seed=72),       # H % 128 != 0
    Case(8, 16, 128, 4, (3, 4, 2, 5, 1, 0, 4, 3), dtype=torch.float16, seed=73),
]


@pytest.mark.parametrize("case", LL_CASES, ids=str)
def test_mxfp8_low_latency_matches_reference(case):
    R, H = case.world_size, case.hidden
    bufs = moe_comm.Buffer.loopback(R, H, case.num_experts, case.max_tokens, case.dtype,
                                    max_topk=case.topk, low_latency=True)
    for it in range(2):
        xs, idxs, ws = make_inputs(case, it)
        xs = _adversarial(xs)
        recvs = lockstep.low_latency_dispatch(bufs, xs, idxs, dispatch_dtype="mxfp8")
        want = reference.low_latency_dispatch_all(xs, idxs, num_experts=case.num_experts,
                                                  max_tokens=case.max_tokens,
                                                  dispatch_dtype="mxfp8")
        L = case.num_experts // R
        for r in range(R):
            g, w = recvs[r], want[r]
            assert g.x_scales.dtype == torch.float8_e8m0fnu
            assert g.x_scales.shape == (L, R * case.max_tokens, H // 32)
            assert torch.equal(g.count, w.count)
            for e, n in enumerate(w.count.tolist()):
                assert torch.equal(_bytes(g.x[e, :n]), _bytes(w.x[e, :n])), (r, it, e)
                assert torch.equal(_bytes(g.x_scales[e, :n]), _bytes(w.x_scales[e, :n]))
                assert torch.equal(g.src_info[e, :n], w.src_info[e, :n])
        ys = []
        for g in recvs:
            L_, rows, _ = g.x.shape
            y = microscale.dequantize_mxfp8(g.x.reshape(L_ * rows, H),
                                            g.x_scales.reshape(L_ * rows, -1))
            ys.append(y.nan_to_num().reshape(L_, rows, H).to(case.dtype))
        outs = lockstep.low_latency_combine(bufs, ys, idxs, ws, [g.handle for g in recvs])
        refs = reference.low_latency_combine_all(ys, idxs, ws, want, case.max_tokens)
        for o, f in zip(outs, refs, strict=True):
            assert torch.equal(o, f)


def test_mxfp8_low_latency_errors():
    buf = moe_comm.Buffer.loopback(1, 64, 4, 8, torch.bfloat16, low_latency=True)[0]
    x = torch.randn(4, 64).to(torch.bfloat16)
    idx = torch.zeros((4, 1), dtype=torch.int64)
    for kwargs, match in ((dict(fp8=False), "cannot go with fp8=False"),
                          (dict(col_major_scales=True), "swizzle_128x4"),
                          (dict(ue8m0=True), "E8M0 by definition")):
        with pytest.raises(ValueError, match=match):
            buf.low_latency_dispatch(x, idx, dispatch_dtype="mxfp8", **kwargs)
    recv, _ = buf.low_latency_dispatch(x, idx, dispatch_dtype="mxfp8")
    assert recv.x_scales.shape == (4, 8, 2) and int(recv.count.sum()) == 4


def test_mxfp8_low_latency_across_nodes(ranks):
    pytest.importorskip("nixl_cu13")
    from internode_jobs import ll_nodes_case
    case = Case(4, 8, 160, 2, (5, 7, 0, 6), routing="zipf", seed=74)
    reports = ranks(4).run(ll_nodes_case, case, 2, iterations=2, fp8=True,
                           dispatch_dtype="mxfp8")
    for rank, rep in enumerate(reports):
        # every pair to an expert on the other node costs H + H/32 + 4 bytes, nothing more
        assert rep["ll_dispatch"] == rep["want_dispatch"], (rank, rep)
        assert rep["ll_combine"] == rep["want_combine"], (rank, rep)
    assert sum(rep["want_dispatch"] for rep in reports) > 0
