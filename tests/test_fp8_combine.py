"""FP8 combine in both modes: each partial (normal mode) or expert row (low-latency mode)
travels as e4m3 codes with one float32 scale per 128 channels and is dequantized at home;
bit for bit the plain-PyTorch reference, within the documented error of the exact combine."""
import pytest
import torch

import moe_comm
from cases import Case, make_inputs
from moe_comm import reference
from moe_comm.perfmodel import moe_comm_counters
from moe_comm.testing import lockstep

CASES = [
    Case(2, 8, 256, 8, (13, 0), dtype=torch.float32, routing="zipf", alignment=16, seed=101),
    Case(4, 16, 128, 4, (9, 4, 0, 11), routing="one_expert", seed=102),
    Case(8, 16, 128, 4, (6, 9, 2, 7, 5, 0, 8, 4), routing="zipf", seed=103),
    Case(4, 16, 384, 2, (7, 7, 7, 7), dtype=torch.float16, routing="empty_rank", seed=104),
]


def _exact(ys, want, dtype):
    """The combine in float64 with no rounding of the partials (what FP8 approximates), and
    the error bound of each output element: per partial 2**-4 of it, or 2**-10 * amax / 448
    of its group, summed over the ranks, plus the final rounding to ``dtype``."""
    R = len(ys)
    parts = [reference.partials(ys[d].double(), want[d].weights.double()
                                if want[d].weights is not None else None,
                                want[d].handle.recv_rows) for d in range(R)]
    exact, bound = [], []
    for s in range(R):
        toks, T = want[s].handle.send_tokens, want[s].handle.num_tokens
        H = ys[0].shape[1]
        e = torch.zeros((T, H), dtype=torch.float64)
        b = torch.zeros((T, H), dtype=torch.float64)
        for d in range(R):
            p = parts[d][s]
            amax = p.abs().reshape(p.shape[0], H // 128, 128).amax(-1).clamp(min=1e-4)
            floor = (amax * 2.0 ** -10 / 448).repeat_interleave(128, dim=1)
            e = e.index_add(0, toks[d], p)
            b = b.index_add(0, toks[d], p.abs() * 2.0 ** -4 + floor)
        eps = torch.finfo(dtype).eps
        exact.append(e)
        bound.append(b * (1 + 1e-6) + e.abs() * eps + 1e-30)
    return exact, bound


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fp8_combine_matches_reference_within_its_bound(case):
    R, H = case.world_size, case.hidden
    xs, idxs, ws = make_inputs(case)
    bufs = moe_comm.Buffer.loopback(R, H, case.num_experts, case.max_tokens, case.dtype,
                                    max_topk=case.topk)
    for it in range(2):   # both staging parities
        got = lockstep.dispatch(bufs, xs, idxs, ws, case.alignment)
        want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts,
                                      expert_alignment=case.alignment)
        ys = [(g.x.float() * (1 + it) + 0.5).to(case.dtype) for g in got]
        ys[0][:1] *= 1e-7                         # tiny rows: the subnormal range of e4m3
        outs = lockstep.combine(bufs, ys, [g.handle for g in got], [g.weights for g in got],
                                combine_dtype="fp8")
        refs = reference.combine_all(ys, [w.handle for w in want], [w.weights for w in want],
                                     combine_dtype="fp8")
        exact, bound = _exact(ys, want, case.dtype)
        for r in range(R):
            assert torch.equal(outs[r], refs[r]), (r, it)
            err = (outs[r].double() - exact[r]).abs()
            assert bool((err <= bound[r]).all()), (r, float((err - bound[r]).max()))
        plain = lockstep.combine(bufs, ys, [g.handle for g in got], [g.weights for g in got])
        assert any(not torch.equal(a, b) for a, b in zip(outs, plain) if a.numel())


def test_fp8_combine_bytes_nan_and_gradient():
    case = Case(4, 16, 256, 4, (8, 8, 8, 8), routing="zipf", seed=105)
    R, H, E = 4, case.hidden, case.num_experts
    xs, idxs, ws = make_inputs(case)
    bufs = moe_comm.Buffer.loopback(R, H, E, 8, case.dtype, max_topk=case.topk)
    got = lockstep.dispatch(bufs, xs, idxs, ws)
    ys = [g.x.clone() for g in got]
    ys[1][0, 5] = float("nan")                # one NaN: its 128-channel group of that partial
    before = [b.stats() for b in bufs]
    outs = lockstep.combine(bufs, ys, [g.handle for g in got], [g.weights for g in got],
                            combine_dtype="fp8")
    # a partial row is H + H/32 bytes (codes, float32 scales); the model counts the same
    counted = moe_comm_counters(torch.cat(idxs).numpy(), ep=R, num_experts=E, hidden=H,
                                gpus_per_node=R, combine_dtype="fp8")
    for r, b in enumerate(bufs):
        for key in ("combine_bytes_to_peers", "combine_bytes_to_self"):
            assert b.stats()[key] - before[r][key] == counted[r]["combine"][key], (r, key)
    s, t = int(got[1].src_rank[0]), int(got[1].src_token[0])
    assert outs[s][t, :128].isnan().all() and not outs[s][t, 128:].isnan().any()
    # the backward is the exact combine's (straight through the quantization)
    buf = moe_comm.Buffer.loopback(1, H, E, 8, torch.bfloat16, max_topk=case.topk)[0]
    x, idx, w = xs[0], idxs[0], ws[0]
    res = buf.dispatch(x, idx, w)
    grads = []
    for fmt in ("fp8", None):
        y = res.x.detach().clone().requires_grad_()
        out = buf.combine(y, res.handle, res.weights, combine_dtype=fmt)
        (out.float() * torch.arange(H, dtype=torch.float32)).sum().backward()
        grads.append(y.grad)
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0


def test_fp8_combine_errors():
    buf = moe_comm.Buffer.loopback(1, 96, 4, 8, torch.bfloat16)[0]
    x = torch.randn(4, 96).to(torch.bfloat16)
    res = buf.dispatch(x, torch.zeros((4, 1), dtype=torch.int64))
    with pytest.raises(ValueError, match="hidden % 128"):
        buf.combine(res.x, res.handle, combine_dtype="fp8")
    buf = moe_comm.Buffer.loopback(1, 128, 4, 8, torch.bfloat16)[0]
    x = torch.randn(4, 128).to(torch.bfloat16)
    res = buf.dispatch(x, torch.zeros((4, 1), dtype=torch.int64))
    with pytest.raises(ValueError, match="combine_dtype must be"):
        buf.combine(res.x, res.handle, combine_dtype="nvfp4")
    out = buf.combine(res.x, res.handle, combine_dtype=torch.bfloat16)   # the Buffer's own
    assert torch.equal(out, x)
    assert buf.stats()["combine_bytes_to_self"] == 4 * 256 + 8


@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "hier"])
def test_fp8_combine_across_nodes(ranks, hierarchical):
    """After an NVFP4 dispatch (the combine of dequantized rows)."""
    pytest.importorskip("nixl_cu13")
    from internode_jobs import nodes_case
    case = Case(4, 16, 256, 4, (9, 0, 6, 11), routing="zipf", seed=106)
    reports = ranks(4).run(nodes_case, case, 2, hierarchical, iterations=2, fp8=None,
                           dispatch_dtype="nvfp4", combine_dtype="fp8")
    for rep in reports:  # across nodes only FP8 rows: H + H/32 bytes each
        assert rep["internode"]["combine"]
        assert sum(rep["internode"]["combine"]) % (256 + 8) == 0, rep["internode"]


LL_CASES = [
    Case(2, 8, 256, 4, (6, 5), routing="zipf", seed=111),
    Case(4, 16, 128, 2, (4, 0, 5, 3), routing="one_expert", seed=112),
    Case(8, 16, 128, 2, (3, 4, 2, 5, 1, 0, 4, 3), dtype=torch.float16, seed=113),
]


@pytest.mark.parametrize("case", LL_CASES, ids=str)
def test_fp8_combine_low_latency_matches_reference(case):
    R, H = case.world_size, case.hidden
    bufs = moe_comm.Buffer.loopback(R, H, case.num_experts, case.max_tokens, case.dtype,
                                    max_topk=case.topk, low_latency=True)
    for it in range(2):
        xs, idxs, ws = make_inputs(case, it)
        recvs = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=False)
        want = reference.low_latency_dispatch_all(xs, idxs, num_experts=case.num_experts,
                                                  max_tokens=case.max_tokens)
        ys = [(g.x.float() * 3 - 1).to(case.dtype) for g in recvs]
        outs = lockstep.low_latency_combine(bufs, ys, idxs, ws, [g.handle for g in recvs],
                                            combine_dtype="fp8")
        refs = reference.low_latency_combine_all(ys, idxs, ws, want, case.max_tokens, "fp8")
        exact = reference.low_latency_combine_all([y.double() for y in ys], idxs, ws, want,
                                                  case.max_tokens)
        L = case.num_experts // R
        for r in range(R):
            assert torch.equal(outs[r], refs[r]), (r, it)
            err = (outs[r].double() - exact[r].double()).abs()
            assert bool((err <= _ll_bound(ys, idxs[r], ws[r], L, want, r, case)).all()), r


def _ll_bound(ys, idx, w, L, want, s, case):
    """Error bound of one rank's FP8 low-latency combine: per (token, choice) row its FP8
    error bound times |w|, summed, plus the rounding to the dtype."""
    T, K = idx.shape
    H = case.hidden
    bound = torch.zeros((T, H), dtype=torch.float64)
    total = torch.zeros((T, H), dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            g = int(idx[t, k])
            if g < 0:
                continue
            d, le = g // L, g % L
            hit = ((want[d].src_info[le] == s * case.max_tokens + t)
                   & (want[d].src_k[le] == k)).nonzero()
            row = ys[d][le, int(hit[0])].double()
            amax = row.abs().reshape(-1, 128).amax(-1).clamp(min=1e-4)
            floor = (amax * 2.0 ** -10 / 448).repeat_interleave(128)
            bound[t] += (row.abs() * 2.0 ** -4 + floor) * abs(float(w[t, k]))
            total[t] += row * float(w[t, k])
    return bound * (1 + 1e-6) + total.abs() * torch.finfo(case.dtype).eps + 1e-30


def test_fp8_combine_low_latency_bytes_and_errors():
    case = Case(2, 8, 256, 2, (6, 6), routing="uniform", seed=114)
    R, H = 2, case.hidden
    bufs = moe_comm.Buffer.loopback(R, H, 8, 6, torch.bfloat16, max_topk=2, low_latency=True)
    xs, idxs, ws = make_inputs(case)
    recvs = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=False)
    before = [b.stats()["combine_bytes_to_peers"] for b in bufs]
    lockstep.low_latency_combine(bufs, [g.x for g in recvs], idxs, ws,
                                 [g.handle for g in recvs], combine_dtype="fp8")
    L = 8 // R
    for r, b in enumerate(bufs):   # every row to another rank: H + H/32 bytes, then a signal
        rows = sum(int((idxs[s] // L == r).sum()) for s in range(R) if s != r)
        assert rows > 0
        assert b.stats()["combine_bytes_to_peers"] - before[r] == rows * (H + H // 32) + 8
    with pytest.raises(ValueError, match="combine_dtype must be"):
        bufs[0].low_latency_combine(recvs[0].x, idxs[0], ws[0], recvs[0].handle,
                                    combine_dtype="mxfp8")

