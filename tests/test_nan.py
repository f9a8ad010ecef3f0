"""NaN survives every path: output NaN wherever the reference gives NaN, the rest bit-exact.

A GPU's canonical fp32 NaN is 0x7FFFFFFF, whose bf16 rounding by "add half an ulp" carries into
the sign bit (0x8000 = -0.0); the interpreter's own NaN (0x7FC00000) would hide that, so the
inputs carry payload NaNs 0x7FFFFFFF explicitly.
"""
import pytest
import torch

import moe_comm
from cases import Case, make_inputs
from moe_comm import reference
from moe_comm.testing import lockstep

GPU_NAN = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)[0]


def _same_with_nan(got: torch.Tensor, want: torch.Tensor, what: str) -> int:
    """Asserts NaN where ``want`` has NaN, equal values elsewhere; returns the NaN count."""
    got, want = got.float(), want.float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaN positions differ"
    assert torch.equal(got[~nan], want[~nan]), f"{what}: finite values differ"
    return int(nan.sum())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_payload_nan_weight_and_nan_rows_reach_the_output(dtype):
    case = Case(2, 8, 256, 2, (7, 5), dtype, seed=91)
    bufs = moe_comm.Buffer.loopback(2, case.hidden, case.num_experts, case.max_tokens, dtype)
    xs, idxs, ws = make_inputs(case)
    idxs[0][3] = torch.tensor([1, 5])  # token 3 of rank 0: one expert per rank
    ws[0][3, 0] = GPU_NAN  # its router weight for expert 1: the GPU's NaN bits
    got = lockstep.dispatch(bufs, xs, idxs, ws)
    want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts)
    ys = [w.x.clone() for w in want]
    ys[1][0, :7] = float("nan")  # a NaN row (one token of rank 1's expert rows)
    outs = lockstep.combine(bufs, ys, [g.handle for g in got], [g.weights for g in got])
    ref = reference.combine_all(ys, [w.handle for w in want], [w.weights for w in want])
    nans = [_same_with_nan(outs[r], ref[r], f"rank {r} combine ({dtype})") for r in range(2)]
    assert torch.isnan(outs[0][3]).all(), "the token with the NaN router weight"
    assert sum(nans) > case.hidden, "the NaN row reached a token too"


def test_payload_nan_rows_are_copied_bit_for_bit():
    case = Case(2, 8, 128, 2, (6, 6), torch.float32, seed=92)
    bufs = moe_comm.Buffer.loopback(2, 128, 8, 6, torch.float32)
    xs, idxs, ws = make_inputs(case)
    xs[0][2, 10:20] = GPU_NAN
    got = lockstep.dispatch(bufs, xs, idxs, ws)
    want = reference.dispatch_all(xs, idxs, ws, num_experts=8)
    for g, w in zip(got, want):
        assert torch.equal(_bits(g.x), _bits(w.x))  # the payload NaN itself travels


@pytest.mark.parametrize("ue8m0", [False, True])
def test_nan_and_inf_through_fp8(ue8m0):
    case = Case(2, 8, 512, 2, (6, 4), seed=93)
    bufs = moe_comm.Buffer.loopback(2, 512, 8, 6, torch.bfloat16)
    xs, idxs, ws = make_inputs(case)
    xs[0][1, 130] = float("nan")  # group 1 of token 1
    xs[0][2, 300] = float("inf")  # group 2 of token 2
    xs[1][0, 5] = -float("nan")
    got = lockstep.dispatch(bufs, xs, idxs, ws, fp8=True, ue8m0=ue8m0)
    want = reference.dispatch_all(xs, idxs, ws, num_experts=8, fp8=True, ue8m0=ue8m0)
    for r, (g, w) in enumerate(zip(got, want)):
        if w.x.shape[0] == 0:
            continue
        scales_g, scales_w = g.x_scales, w.x_scales
        if ue8m0:
            assert torch.equal(scales_g, scales_w), r  # NaN scale: exponent byte 255
            scales_g = reference.unpack_ue8m0(scales_g, 4)
            scales_w = reference.unpack_ue8m0(scales_w, 4)
        else:
            assert torch.equal(torch.isnan(scales_g), torch.isnan(scales_w)), r
        deq_g = reference.dequantize_fp8(g.x, scales_g)
        deq_w = reference.dequantize_fp8(w.x, scales_w)
        _same_with_nan(deq_g, deq_w, f"rank {r} fp8 (ue8m0={ue8m0})")
    assert any(torch.isnan(reference.dequantize_fp8(
        g.x, reference.unpack_ue8m0(g.x_scales, 4) if ue8m0 else g.x_scales)).any()
        for g in got)


def test_low_latency_combine_keeps_a_payload_nan_weight():
    case = Case(2, 8, 256, 2, (5, 3), seed=94)
    bufs = moe_comm.Buffer.loopback(2, 256, 8, 5, torch.bfloat16, low_latency=True)
    xs, idxs, ws = make_inputs(case)
    idxs[1][0] = torch.tensor([0, 6])
    ws[1][0, 1] = GPU_NAN
    got = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=False)
    want = reference.low_latency_dispatch_all(xs, idxs, num_experts=8, max_tokens=5)
    ys = [g.x.clone() for g in got]
    outs = lockstep.low_latency_combine(bufs, ys, idxs, ws, [g.handle for g in got])
    ref = reference.low_latency_combine_all(ys, idxs, ws, want, 5)
    assert _same_with_nan(outs[1], ref[1], "low-latency combine") == case.hidden
    assert torch.isnan(outs[1][0]).all()
