"""GPU tests (``pytest -m gpu``, with ``TRITON_INTERPRET=0``): virtual ranks on one GPU against
the reference, both kernel implementations, and CUDA-graph capture of the low-latency pair.

Skipped where there is no CUDA device; bench/gpu_check.sh runs them on a lent GPU.
"""
import os

import pytest
import torch

import moe_comm
from cases import Case, expert_fn, make_inputs
from moe_comm import lockstep, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="GPU tests run compiled kernels: set TRITON_INTERPRET=0"),
]
DEV = "cuda"


def _cuda(tensors):
    return None if tensors is None else [t.to(DEV) for t in tensors]


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("fp8", [False, True])
def test_normal_mode_matches_reference(world_size, fp8):
    case = Case(world_size, 8 * world_size, 2048, 8, tuple(64 + 9 * r for r in range(world_size)),
                routing="zipf", alignment=16, seed=world_size)
    bufs = moe_comm.Buffer.loopback(world_size, case.hidden, case.num_experts, case.max_tokens,
                                    case.dtype, device=DEV)
    for it in range(3):
        xs, idxs, ws = make_inputs(case, it)
        got = lockstep.dispatch(bufs, _cuda(xs), _cuda(idxs), _cuda(ws), case.alignment, fp8=fp8)
        want = reference.dispatch_all(_cuda(xs), _cuda(idxs), _cuda(ws),
                                      num_experts=case.num_experts,
                                      expert_alignment=case.alignment, fp8=fp8)
        for g, w in zip(got, want):
            assert torch.equal(g.x.view(torch.uint8), w.x.view(torch.uint8))
            assert torch.equal(g.src_token, w.src_token) and torch.equal(g.weights, w.weights)
        ys = [expert_fn(w.x.float() if not fp8 else reference.dequantize_fp8(w.x, w.x_scales),
                        w.expert_offsets.cpu()).to(case.dtype).to(DEV) for w in want]
        outs = lockstep.combine(bufs, ys, [g.handle for g in got], [g.weights for g in got])
        ref = reference.combine_all(ys, [w.handle for w in want], [w.weights for w in want])
        for o, r in zip(outs, ref):  # fused multiply-adds may differ in the last bit
            torch.testing.assert_close(o.float(), r.float(), rtol=1e-2, atol=1e-2)


def _ll_round(bufs, case, it, fp8):
    T = case.max_tokens
    xs, idxs, ws = make_inputs(case, it)
    got = lockstep.low_latency_dispatch(bufs, _cuda(xs), _cuda(idxs), fp8=fp8)
    want = reference.low_latency_dispatch_all(xs, idxs, num_experts=case.num_experts,
                                              max_tokens=T, fp8=fp8)
    for g, w in zip(got, want):
        assert torch.equal(g.count.cpu(), w.count)
        for e, n in enumerate(w.count.tolist()):
            assert torch.equal(g.x[e, :n].cpu().view(torch.uint8), w.x[e, :n].view(torch.uint8))
    ys = [torch.randn(g.x.shape, device=DEV).to(case.dtype) for g in got]
    outs = lockstep.low_latency_combine(bufs, ys, _cuda(idxs), _cuda(ws),
                                        [g.handle for g in got])
    ref = reference.low_latency_combine_all([y.cpu() for y in ys], idxs, ws, want, T)
    for o, r in zip(outs, ref):
        torch.testing.assert_close(o.cpu().float(), r.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("kernel_impl", ["triton", "cuda"])
def test_low_latency_matches_reference(world_size, kernel_impl):
    case = Case(world_size, 4 * world_size, 7168, 8, (128,) * world_size, seed=3)
    bufs = moe_comm.Buffer.loopback(world_size, case.hidden, case.num_experts, 128, case.dtype,
                                    low_latency=True, device=DEV, kernel_impl=kernel_impl)
    for it in range(3):
        _ll_round(bufs, case, it, fp8=it % 2 == 0)


def test_low_latency_pair_replays_in_a_cuda_graph():
    """Capture dispatch + combine once; replays with new inputs give the reference's results."""
    R, E, H, K, T = 4, 16, 2048, 8, 64
    case = Case(R, E, H, K, (T,) * R, seed=11)
    bufs = moe_comm.Buffer.loopback(R, H, E, T, torch.bfloat16, low_latency=True, device=DEV)
    xs, idxs, ws = (_cuda(v) for v in make_inputs(case, 0))
    ys = [torch.zeros((E // R, R * T, H), dtype=torch.bfloat16, device=DEV) for _ in range(R)]

    def step():
        recvs = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=True)
        for y, r in zip(ys, recvs):
            y.copy_(reference.dequantize_fp8(
                r.x.reshape(-1, H), r.x_scales.reshape(-1, H // 128)).reshape(y.shape))
        return recvs, lockstep.low_latency_combine(bufs, ys, idxs, ws, [r.handle for r in recvs])

    step()  # compile every kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recvs, outs = step()
    for it in range(1, 4):
        new_x, new_idx, new_w = make_inputs(case, it)
        for dst, src in zip(xs + idxs + ws, new_x + new_idx + new_w):
            dst.copy_(src.to(DEV))
        graph.replay()
        torch.cuda.synchronize()
        want = reference.low_latency_dispatch_all(new_x, new_idx, num_experts=E, max_tokens=T,
                                                  fp8=True)
        for g, w in zip(recvs, want):
            assert torch.equal(g.count.cpu(), w.count), it
        ref = reference.low_latency_combine_all([y.cpu() for y in ys], new_idx, new_w, want, T)
        for o, r in zip(outs, ref):
            torch.testing.assert_close(o.cpu().float(), r.float(), rtol=1e-2, atol=1e-2)
