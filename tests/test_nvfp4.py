"""NVFP4 dispatch in both modes: e2m1 values packed two per byte, one e4m3 scale per 16
channels and a float32 global scale, quantized in the send kernel; bit for bit the
plain-PyTorch reference (``moe_comm.microscale``)."""
import pytest
import torch

import moe_comm
from cases import Case, make_inputs, nvfp4_global_scale_oracle
from moe_comm import microscale, reference
from moe_comm.perfmodel import moe_comm_counters
from moe_comm.testing import lockstep


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _adversarial(xs):
    """NaN, infinity, an all-zero token, tiny values and one huge token (global scale); rank
    1's whole batch tiny (below the global scale's floor; zero in fp16)."""
    xs = [x.clone() for x in xs]
    for r, x in enumerate(xs):
        if x.shape[0] > 3:
            x[0, 3 + r] = float("nan")
            x[1, 17] = float("-inf")
            x[2] = 0.0
            x[3] *= 300.0
            x[-1] *= 1e-6
        if r == 1:
            x.mul_(1e-30)
    return xs


def _check(g, w, H):
    assert g.x.dtype == torch.uint8 and g.x.shape == (g.src_rank.shape[0], H // 2)
    assert g.x_scales.dtype == torch.float8_e4m3fn and g.x_scales.shape == (g.x.shape[0], H // 16)
    assert g.x_scales.is_contiguous()
    assert torch.equal(g.x, w.x)
    assert torch.equal(_bytes(g.x_scales), _bytes(w.x_scales))
    assert torch.equal(g.x_global_scale, w.x_global_scale)
    for field in ("weights", "src_rank", "src_token", "tokens_per_expert", "expert_offsets"):
        assert torch.equal(getattr(g, field), getattr(w, field)), field


CASES = [
    Case(2, 8, 256, 8, (13, 0), dtype=torch.float32, routing="zipf", alignment=16, seed=81),
    Case(4, 16, 80, 4, (9, 4, 0, 11), routing="one_expert", seed=82),       # H % 32 != 0
    Case(8, 16, 128, 4, (6, 9, 2, 7, 5, 0, 8, 4), routing="zipf", seed=83),
    Case(4, 16, 160, 2, (7, 7, 7, 7), dtype=torch.float16, routing="empty_rank", seed=84),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_nvfp4_dispatch_matches_reference(case):
    R, H = case.world_size, case.hidden
    xs, idxs, ws = make_inputs(case)
    xs = _adversarial(xs)
    bufs = moe_comm.Buffer.loopback(R, H, case.num_experts, case.max_tokens, case.dtype,
                                    max_topk=case.topk)
    for it, given in enumerate((None, torch.tensor([0.05]))):  # both staging parities
        got = lockstep.dispatch(bufs, xs, idxs, ws, case.alignment, dispatch_dtype="nvfp4",
                                global_scale=given)
        want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts,
                                      expert_alignment=case.alignment, dispatch_dtype="nvfp4",
                                      global_scale=given)
        for r in range(R):
            _check(got[r], want[r], H)
            rows = int(want[r].expert_offsets[-1])
            if given is not None:
                assert torch.equal(got[r].x_global_scale[got[r].src_rank >= 0],
                                   given.expand(int((got[r].src_rank >= 0).sum())))
            assert rows == got[r].x.shape[0]
        # each row carries its own source's global scale: sources differ (a huge token)
        if it == 0:
            for r in range(R):
                for s in range(R):
                    mine = got[r].src_rank == s
                    if mine.any():
                        expect = nvfp4_global_scale_oracle(xs[s])
                        assert torch.equal(got[r].x_global_scale[mine],
                                           expect.expand(int(mine.sum())))
        ys = [microscale.dequantize_nvfp4(g.x, g.x_scales, g.x_global_scale).nan_to_num()
              .to(case.dtype) for g in got]
        outs = lockstep.combine(bufs, ys, [g.handle for g in got], [g.weights for g in got])
        refs = reference.combine_all(ys, [w.handle for w in want], [w.weights for w in want])
        for o, f in zip(outs, refs, strict=True):
            assert torch.equal(o, f)


def test_nvfp4_quantized_input_and_bytes_on_the_link():
    case = Case(4, 16, 256, 4, (8, 8, 8, 8), routing="zipf", seed=85)
    R, H, E, K = 4, case.hidden, case.num_experts, case.topk
    xs, idxs, ws = make_inputs(case)
    triples = [microscale.quantize_nvfp4(x) for x in xs]
    # a per-row global scale travels as given (e.g. rows re-dispatched after a receive)
    per_row = [(q, s, g.expand(q.shape[0]).contiguous()) for q, s, g in triples]
    as_fp4 = [(q.view(torch.float4_e2m1fn_x2), s, g) for q, s, g in triples]
    bufs = moe_comm.Buffer.loopback(R, H, E, 8, case.dtype, max_topk=K)
    before = [b.stats() for b in bufs]
    want = reference.dispatch_all(xs, idxs, ws, num_experts=E, dispatch_dtype="nvfp4")
    for inputs in (triples, per_row, as_fp4):
        got = lockstep.dispatch(bufs, inputs, idxs, ws, dispatch_dtype="nvfp4")
        for r in range(R):
            _check(got[r], want[r], H)
    # a row is H/2 + H/16 + 4 (its global scale) bytes plus metadata; the model counts the same
    ids = torch.cat(idxs).numpy()
    counted = moe_comm_counters(ids, ep=R, num_experts=E, hidden=H, gpus_per_node=R,
                                dispatch_dtype="nvfp4")
    for r, b in enumerate(bufs):
        stats = b.stats()
        for key in ("dispatch_bytes_to_peers", "dispatch_bytes_to_self"):
            assert stats[key] - before[r][key] == 3 * counted[r]["dispatch"][key], (r, key)


def test_nvfp4_row_is_under_30_percent_of_bf16_at_7168():
    """H = 7168, K = 8: the bytes a dispatch stores per row, counted by the kernels."""
    H, E, K = 7168, 16, 8
    torch.manual_seed(86)
    x = torch.randn(3, H).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(3)])
    rows = {}
    for dtype in ("nvfp4", None):
        buf = moe_comm.Buffer.loopback(1, H, E, 4, torch.bfloat16, max_topk=K)[0]
        buf.dispatch(x, idx, dispatch_dtype=dtype, fp8=False if dtype is None else None)
        signal = 8 + 4 * (E + 1)
        rows[dtype] = (buf.stats()["dispatch_bytes_to_self"] - signal) // 3
    meta = 4 * (1 + 3 * K)
    assert rows["nvfp4"] == H // 2 + H // 16 + 4 + meta == 4136
    assert rows[None] == 2 * H + meta
    assert rows["nvfp4"] / rows[None] < 0.30


def test_nvfp4_errors_before_any_kernel():
    buf = moe_comm.Buffer.loopback(1, 72, 4, 8, torch.bfloat16)[0]
    x = torch.randn(4, 72).to(torch.bfloat16)
    idx = torch.zeros((4, 1), dtype=torch.int64)
    with pytest.raises(ValueError, match="hidden % 16"):
        buf.dispatch(x, idx, dispatch_dtype="nvfp4")
    buf = moe_comm.Buffer.loopback(1, 64, 4, 8, torch.bfloat16)[0]
    x = torch.randn(4, 64).to(torch.bfloat16)
    q, s, g = microscale.quantize_nvfp4(x)
    for kwargs, match in ((dict(fp8=False), "cannot go with fp8=False"),
                          (dict(ue8m0=True), "e4m3 by definition"),
                          (dict(col_major_scales=True), "swizzle_128x4"),
                          (dict(scale_layout="tiled"), "scale_layout must be"),
                          (dict(global_scale=torch.ones(2)), "1 element"),
                          (dict(global_scale=torch.ones(1, dtype=torch.float64)), "float32")):
        kwargs.setdefault("dispatch_dtype", "nvfp4")
        with pytest.raises((ValueError, TypeError), match=match):
            buf.dispatch(x, idx, **kwargs)
    with pytest.raises(ValueError, match="global_scale is NVFP4's"):
        buf.dispatch(x, idx, dispatch_dtype="mxfp8", global_scale=torch.ones(1))
    with pytest.raises(ValueError, match="'mxfp8' or 'nvfp4'"):
        buf.dispatch(x, idx, fp8=True, scale_layout="swizzled")
    with pytest.raises(TypeError, match="or a quantized NVFP4 tuple"):
        buf.dispatch((q, s), idx, dispatch_dtype="nvfp4")
    with pytest.raises(ValueError, match="one per 16 channels"):
        buf.dispatch((q, s[:, :2], g), idx, dispatch_dtype="nvfp4")
    with pytest.raises(ValueError, match="bytes per row"):
        buf.dispatch((q[:, :16], s, g), idx, dispatch_dtype="nvfp4")
    with pytest.raises(ValueError, match="carries its global scale"):
        buf.dispatch((q, s, g), idx, dispatch_dtype="nvfp4", global_scale=g)
    with pytest.raises(ValueError, match="or 4 \\(one per row\\)"):
        buf.dispatch((q, s, torch.ones(3)), idx, dispatch_dtype="nvfp4")
    with pytest.raises(ValueError, match="no gradient"):
        buf.dispatch(x.requires_grad_(), idx, dispatch_dtype="nvfp4")
    assert buf.stats()["dispatch_bytes_to_self"] == 0       # nothing ran
    res = buf.dispatch(x.detach(), idx, dispatch_dtype="nvfp4", scale_layout="swizzled")
    assert torch.equal(res.x, q) and torch.equal(res.x_global_scale, g.expand(4))
    assert res.x_scales.shape == (512,)     # the 128x4 layout of block-scaled GEMMs
    assert torch.equal(_bytes(res.x_scales), _bytes(microscale.swizzle_128x4(s)))


@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "hier"])
def test_nvfp4_across_nodes(ranks, hierarchical):
    """H % 32 != 0; the FP8 combine of tests/test_fp8_combine.py runs with NVFP4 rows too."""
    pytest.importorskip("nixl_cu13")
    from internode_jobs import nodes_case
    case = Case(4, 16, 176, 4, (9, 0, 6, 11), routing="zipf", seed=87)
    reports = ranks(4).run(nodes_case, case, 2, hierarchical, iterations=2, fp8=None,
                           dispatch_dtype="nvfp4")
    assert len(reports) == 4


LL_CASES = [
    Case(2, 8, 256, 4, (6, 5), routing="zipf", seed=91),
    Case(4, 16, 80, 2, (4, 0, 5, 3), routing="one_expert", seed=92),        # H % 32 != 0
    Case(8, 16, 64, 2, (3, 4, 2, 5, 1, 0, 4, 3), dtype=torch.float16, seed=93),
]


@pytest.mark.parametrize("case", LL_CASES, ids=str)
def test_nvfp4_low_latency_matches_reference(case):
    R, H = case.world_size, case.hidden
    L = case.num_experts // R
    bufs = moe_comm.Buffer.loopback(R, H, case.num_experts, case.max_tokens, case.dtype,
                                    max_topk=case.topk, low_latency=True)
    for it, given in enumerate((None, torch.tensor([0.02]))):
        xs, idxs, ws = make_inputs(case, it)
        xs = _adversarial(xs)
        recvs = lockstep.low_latency_dispatch(bufs, xs, idxs, dispatch_dtype="nvfp4",
                                              global_scale=given)
        want = reference.low_latency_dispatch_all(xs, idxs, num_experts=case.num_experts,
                                                  max_tokens=case.max_tokens,
                                                  dispatch_dtype="nvfp4", global_scale=given)
        for r in range(R):
            g, w = recvs[r], want[r]
            assert g.x.dtype == torch.uint8 and g.x.shape == (L, R * case.max_tokens, H // 2)
            assert g.x_scales.dtype == torch.float8_e4m3fn
            assert g.x_scales.shape == (L, R * case.max_tokens, H // 16)
            assert torch.equal(g.count, w.count)
            for e, n in enumerate(w.count.tolist()):
                assert torch.equal(g.x[e, :n], w.x[e, :n]), (r, it, e)
                assert torch.equal(_bytes(g.x_scales[e, :n]), _bytes(w.x_scales[e, :n]))
                assert torch.equal(g.x_global_scale[e, :n], w.x_global_scale[e, :n])
                assert torch.equal(g.src_info[e, :n], w.src_info[e, :n])
        ys = []
        for g in recvs:
            rows = g.x.shape[1]
            y = microscale.dequantize_nvfp4(g.x.reshape(L * rows, H // 2),
                                            g.x_scales.reshape(L * rows, -1),
                                            g.x_global_scale.reshape(-1))
            ys.append(y.nan_to_num().reshape(L, rows, H).to(case.dtype))
        outs = lockstep.low_latency_combine(bufs, ys, idxs, ws, [g.handle for g in recvs])
        refs = reference.low_latency_combine_all(ys, idxs, ws, want, case.max_tokens)
        for o, f in zip(outs, refs, strict=True):
            assert torch.equal(o, f)


def test_nvfp4_low_latency_errors_and_swizzle():
    buf = moe_comm.Buffer.loopback(1, 64, 4, 8, torch.bfloat16, low_latency=True)[0]
    x = torch.randn(4, 64).to(torch.bfloat16)
    idx = torch.zeros((4, 1), dtype=torch.int64)
    for kwargs, match in ((dict(fp8=False), "cannot go with fp8=False"),
                          (dict(col_major_scales=True), "swizzle_128x4"),
                          (dict(ue8m0=True), "e4m3 by definition"),
                          (dict(global_scale=torch.ones(3)), "1 element")):
        with pytest.raises((ValueError, TypeError), match=match):
            buf.low_latency_dispatch(x, idx, dispatch_dtype="nvfp4", **kwargs)
    recv, _ = buf.low_latency_dispatch(x, idx, dispatch_dtype="nvfp4")
    assert recv.x_scales.shape == (4, 8, 4) and int(recv.count.sum()) == 4
    plain = recv.x_scales.clone()
    recv, _ = buf.low_latency_dispatch(x, idx, dispatch_dtype="nvfp4", scale_layout="swizzled")
    assert recv.x_scales.shape == (4, 512)
    for e in range(4):
        assert torch.equal(_bytes(microscale.unswizzle_128x4(recv.x_scales[e], 8, 4)),
                           _bytes(plain[e]))


def test_nvfp4_dispatch_and_fp8_combine_low_latency_across_nodes(ranks):
    pytest.importorskip("nixl_cu13")
    from internode_jobs import ll_nodes_case
    case = Case(4, 8, 256, 2, (5, 7, 0, 6), routing="zipf", seed=94)
    reports = ranks(4).run(ll_nodes_case, case, 2, iterations=2, fp8=True,
                           dispatch_dtype="nvfp4", combine_dtype="fp8")
    for rank, rep in enumerate(reports):
        # every pair to an expert on the other node costs H/2 + H/16 + 4 + 4 bytes, every
        # row back from one H + H/32
        assert rep["ll_dispatch"] == rep["want_dispatch"], (rank, rep)
        assert rep["ll_combine"] == rep["want_combine"], (rank, rep)
    assert sum(rep["want_dispatch"] for rep in reports) > 0
    assert sum(rep["want_combine"] for rep in reports) > 0
