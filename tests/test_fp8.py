"""FP8 (e4m3fn) dispatch: the send kernel quantizes per token and per 128 channels."""
import pytest
import torch

import moe_comm
from cases import Case, make_inputs
from moe_comm import reference
from moe_comm.kernels.quant import quantize_fp8
from moe_comm.testing import lockstep


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _strides(t: torch.Tensor) -> tuple:
    """Strides of the dimensions longer than 1 (the others' strides mean nothing)."""
    return tuple(s for s, n in zip(t.stride(), t.shape) if n > 1) if t.numel() else ()


def test_encoder_rounds_every_value_like_torch():
    """All finite e4m3 values, every midpoint between neighbours (ties to even) and a dense
    sweep; one 448 per group pins the scale to 1, so the codes are the rounding itself."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    values = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.linspace(-448, 448, 40001),
                        torch.logspace(-9, 2.65, 4000), -torch.logspace(-9, 2.65, 4000)])
    values = values[: values.numel() // 127 * 127].view(-1, 127)
    x = torch.cat([torch.full((values.shape[0], 1), 448.0), values], dim=1)
    q, scales, _ = quantize_fp8(x)
    ref_q, ref_scales = reference.quantize_fp8(x)
    assert torch.equal(scales, torch.ones_like(scales)) and torch.equal(scales, ref_scales)
    assert torch.equal(_bytes(q), _bytes(ref_q))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_quantize_matches_reference_and_error_bound(dtype, ue8m0):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn((33, 1024), generator=g) * torch.logspace(-5, 3, 1024)).to(dtype)
    x[4] = 0  # an all-zero token
    q, scales, exps = quantize_fp8(x, ue8m0=ue8m0)
    ref_q, ref_scales = reference.quantize_fp8(x, ue8m0=ue8m0)
    assert torch.equal(scales, ref_scales) and torch.equal(_bytes(q), _bytes(ref_q))
    if ue8m0:
        assert torch.equal(exps.to(torch.int32) << 23, scales.view(torch.int32))
    x32 = x.float()
    err = (reference.dequantize_fp8(q, scales) - x32).abs()
    s = scales.repeat_interleave(128, dim=1)
    bound = torch.maximum(x32.abs() * 2.0 ** -4, s * 2.0 ** -10)  # normal / subnormal e4m3
    assert (err <= bound).all(), float((err - bound).max())
    assert torch.equal(q[4].float(), torch.zeros(1024))


FP8_CASES = [
    Case(1, 8, 128, 2, (9,), seed=1),
    Case(2, 8, 256, 8, (13, 0), routing="zipf", alignment=16, seed=2),
    Case(4, 16, 2048, 4, (5, 3, 0, 7), routing="one_expert", seed=3),
    Case(4, 32, 384, 8, (12, 6, 9, 1), dtype=torch.float32, routing="empty_rank", seed=4),
]


@pytest.mark.parametrize("case", FP8_CASES, ids=str)
@pytest.mark.parametrize("ue8m0, col_major", [(False, False), (True, False), (False, True),
                                              (True, True)])
def test_fp8_dispatch_matches_reference(case, ue8m0, col_major):
    R = case.world_size
    bufs = moe_comm.Buffer.loopback(R, case.hidden, case.num_experts, case.max_tokens,
                                    case.dtype)
    xs, idxs, ws = make_inputs(case)
    got = lockstep.dispatch(bufs, xs, idxs, ws, case.alignment, fp8=True, ue8m0=ue8m0,
                            col_major_scales=col_major)
    want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts,
                                  expert_alignment=case.alignment, fp8=True, ue8m0=ue8m0,
                                  col_major_scales=col_major)
    for r in range(R):
        assert got[r].x.dtype == torch.float8_e4m3fn
        assert torch.equal(_bytes(got[r].x), _bytes(want[r].x)), r
        assert _strides(got[r].x_scales) == _strides(want[r].x_scales), r
        assert torch.equal(got[r].x_scales, want[r].x_scales), r
        assert torch.equal(got[r].weights, want[r].weights)
        assert torch.equal(got[r].src_token, want[r].src_token)
    # combine stays in the Buffer's dtype: experts work on the dequantized rows
    ys = []
    for res in got:
        scales = res.x_scales
        if ue8m0:
            scales = reference.unpack_ue8m0(scales, case.hidden // 128)
        ys.append(reference.dequantize_fp8(res.x, scales).to(case.dtype))
    outs = lockstep.combine(bufs, ys, [g.handle for g in got], [g.weights for g in got])
    ref_outs = reference.combine_all(ys, [w.handle for w in want], [w.weights for w in want])
    for r in range(R):
        assert torch.equal(outs[r], ref_outs[r]), r


def test_prequantized_pair_and_fp8_buffer_default():
    case = Case(2, 8, 256, 2, (7, 4), seed=9)
    bufs = moe_comm.Buffer.loopback(2, 256, 8, 7, torch.bfloat16,
                                    dispatch_dtype=torch.float8_e4m3fn)
    xs, idxs, ws = make_inputs(case)
    pairs = [reference.quantize_fp8(x) for x in xs]
    got = lockstep.dispatch(bufs, pairs, idxs, ws)  # fp8 by the Buffer's dispatch_dtype
    again = lockstep.dispatch(bufs, xs, idxs, ws)  # quantized by the kernel: the same bits
    want = reference.dispatch_all(pairs, idxs, ws, num_experts=8, fp8=True)
    for r in range(2):
        assert torch.equal(_bytes(got[r].x), _bytes(want[r].x))
        assert torch.equal(_bytes(again[r].x), _bytes(want[r].x))
        assert torch.equal(got[r].x_scales, want[r].x_scales)


def test_fp8_bytes_on_the_link():
    """A quantized row costs H + 4H/128 bytes (H + H/128 with ue8m0) instead of H * 2."""
    R, E, H, K = 2, 4, 512, 2
    case = Case(R, E, H, K, (16, 16), seed=5)
    xs, idxs, ws = make_inputs(case)
    L, meta = E // R, 4 * (1 + 3 * K)
    sent = [sum(1 for row in idxs[0].tolist() if any(e >= 0 and e // L == d for e in row))
            for d in range(R)]
    for ue8m0, payload in ((False, H + 4 * H // 128), (True, H + H // 128), (None, 2 * H)):
        bufs = moe_comm.Buffer.loopback(R, H, E, 16, torch.bfloat16)
        before = bufs[0].stats()["dispatch_bytes_to_peers"]
        if ue8m0 is None:
            lockstep.dispatch(bufs, xs, idxs, ws)
        else:
            lockstep.dispatch(bufs, xs, idxs, ws, fp8=True, ue8m0=ue8m0)
        got = bufs[0].stats()["dispatch_bytes_to_peers"] - before
        assert got == sent[1] * (payload + meta) + 4 * (L + 1) + 8


def test_fp8_errors_before_any_kernel():
    bufs = moe_comm.Buffer.loopback(1, 192, 4, 8, torch.bfloat16)
    x = torch.randn(4, 192).to(torch.bfloat16)
    idx = torch.zeros((4, 1), dtype=torch.int64)
    with pytest.raises(ValueError, match="hidden % 128"):
        bufs[0].dispatch(x, idx, fp8=True)
    buf = moe_comm.Buffer.loopback(1, 256, 4, 8, torch.bfloat16)[0]
    x = torch.randn(4, 256).to(torch.bfloat16)
    with pytest.raises(ValueError, match="pass fp8=True"):
        buf.dispatch(x, idx, ue8m0=True)
    with pytest.raises(ValueError, match="no gradient"):
        buf.dispatch(x.clone().requires_grad_(), idx, fp8=True)
    q, s = reference.quantize_fp8(x)
    with pytest.raises(ValueError, match="scales have shape"):
        buf.dispatch((q, s[:, :1]), idx)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        buf.dispatch((x, s), idx)
    with pytest.raises(ValueError, match="ue8m0"):
        buf.dispatch((q, s), idx, ue8m0=True)
    with pytest.raises(TypeError, match="dispatch_dtype"):
        moe_comm.Buffer.loopback(1, 256, 4, 8, torch.bfloat16, dispatch_dtype=torch.float16)
    assert buf.dispatch_serial == 0  # nothing ran
    res = buf.dispatch(x, idx, fp8=True)
    assert res.x.dtype == torch.float8_e4m3fn and buf.dispatch_serial == 1


def test_fp8_dispatch_keeps_router_weight_gradients():
    buf = moe_comm.Buffer.loopback(1, 128, 2, 4, torch.float32)[0]
    x = torch.randn(4, 128)
    idx = torch.tensor([[0, 1], [1, -1], [0, 1], [-1, -1]])
    w = torch.rand(4, 2, requires_grad=True)
    res = buf.dispatch(x, idx, w, fp8=True)
    assert not res.x.requires_grad
    y = reference.dequantize_fp8(res.x, res.x_scales)
    out = buf.combine(y, res.handle, res.weights)
    out.sum().backward()
    ref = reference.dispatch_all([x], [idx], [w.detach().requires_grad_()], num_experts=2,
                                 fp8=True)[0]
    expected = torch.zeros(4, 2)
    for row in range(y.shape[0]):  # d out / d w[t, k] = sum of that pair's row
        t, k = int(ref.src_token[row]), None
        for kk in range(2):
            if idx[t, kk] == (0 if row < int(ref.expert_offsets[1]) else 1):
                k = kk
        expected[t, k] = y[row].sum()
    torch.testing.assert_close(w.grad, expected)


def test_opcheck_fp8_variants():
    buf = moe_comm.Buffer.loopback(1, 256, 4, 8, torch.bfloat16)[0]
    xs, idxs, ws = make_inputs(Case(1, 4, 256, 2, (8,), seed=4))
    for ue8m0 in (False, True):
        for col in (False, True):
            torch.library.opcheck(torch.ops.moe_comm.dispatch.default,
                                  (buf.id, xs[0], None, idxs[0], ws[0], 1, 1, ue8m0, col,
                                   None))


@pytest.mark.parametrize("ue8m0, col_major", [(False, False), (True, True)])
def test_fp8_on_cpu_ranks(ranks, ue8m0, col_major):
    from rank_jobs import fp8_case

    case = Case(4, 16, 256, 4, (6, 0, 9, 3), routing="zipf", alignment=16, seed=23)
    ranks(4).run(fp8_case, case, ue8m0, col_major)
