"""GPU tests (``pytest -m gpu``, with ``TRITON_INTERPRET=0``): virtual ranks on one GPU against
the reference, both low-latency kernel implementations, CUDA-graph capture of the low-latency
pair and of normal mode sized by ``max_recv_rows``, normal mode in rounds (bounded staging), and
the host synchronisations of each op.

The reference runs on the CPU from CPU copies of the inputs; GPU results are compared there:
byte for byte where the GPU computes exactly (rows, FP8 codes and scales, counts, source info),
within one ulp where it may fuse multiply-adds (combine; see bench/gpu_compare.py). After each
op the tests wait for the device and raise what the kernels recorded (a timed-out wait, a bad
input): on a GPU those land in pinned memory and would otherwise surface at the next call.

Skipped where there is no CUDA device; bench/gpu_check.sh runs them on a lent GPU.
"""
import collections
import os
import sys
from pathlib import Path

import pytest
import torch

import moe_comm
from cases import Case, expert_fn, make_inputs
from moe_comm import csrc_build, reference
from moe_comm.testing import lockstep

BENCH = str(Path(__file__).resolve().parent.parent / "bench")
if BENCH not in sys.path:  # the comparisons are shared with bench/gpu_bench.py
    sys.path.append(BENCH)
from gpu_compare import (
    assert_within_one_ulp,
    check_ll_dispatch,
    check_normal_dispatch,
    ll_combine_slack,
    normal_combine_slack,
    same_bytes,
    settle,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="GPU tests run compiled kernels: set TRITON_INTERPRET=0"),
]
DEV = "cuda"


def _cuda(tensors):
    return None if tensors is None else [t.to(DEV) for t in tensors]


def _worst_case_rows(case: Case) -> int:
    """An upper bound of the rows any rank receives (padding included): every token of every
    rank picks min(K, L) of this rank's experts, each group padded."""
    L = case.num_experts // case.world_size
    return (case.world_size * case.max_tokens * min(case.topk, L)
            + L * (case.alignment - 1))


def _rows_as_floats(res) -> torch.Tensor:
    """Dispatched rows as fp32 (FP8 rows dequantized)."""
    if res.x.dtype == torch.float8_e4m3fn:
        return reference.dequantize_fp8(res.x, res.x_scales)
    return res.x.float()


def _expert_fn_on_device(x: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """``cases.expert_fn`` computed where ``x`` lies, without a host read (CUDA-graph safe):
    the expert of each row comes from ``expert_offsets`` on the device; rows past the last
    group (``max_recv_rows`` padding, ignored by combine) count as the last expert."""
    L = expert_offsets.numel() - 1
    rows = torch.arange(x.shape[0], device=x.device)
    e = torch.searchsorted(expert_offsets[1:].contiguous(), rows, right=True)
    e = e.clamp(max=L - 1).to(torch.float32)
    return x.float() * (1 + e[:, None] / 8) + e[:, None]


def _ys_reference(want, dtype) -> list[torch.Tensor]:
    """The expert outputs for the reference's rows (CPU)."""
    return [expert_fn(_rows_as_floats(w), w.expert_offsets).to(dtype) for w in want]


def _padded(y: torch.Tensor, rows: int) -> torch.Tensor:
    """``y`` [n, H] on the GPU with zero rows appended up to ``rows``."""
    out = torch.zeros((rows, y.shape[1]), dtype=y.dtype, device=DEV)
    out[:y.shape[0]] = y.to(DEV)
    return out


def _check_combine(outs, ys_ref, want, what):
    handles, weights = [w.handle for w in want], [w.weights for w in want]
    ref = reference.combine_all(ys_ref, handles, weights)
    slack = normal_combine_slack(ys_ref, handles, weights)
    for r, (o, w, s) in enumerate(zip(outs, ref, slack)):
        assert_within_one_ulp(o, w, s, what=f"{what} combine rank {r}")


def _csrc_or_skip(kernel_impl: str) -> None:
    """The CUDA implementation compiles csrc/ with nvcc against NVSHMEM's headers on first use."""
    if kernel_impl == "cuda" and (csrc_build.find_nvcc() is None
                                  or csrc_build.find_nvshmem() is None):
        pytest.skip("kernel_impl='cuda' needs nvcc and the NVSHMEM headers and device library "
                    "to build csrc/ (see tests/test_csrc.py)")


def test_reference_quantizes_alike_on_the_gpu_and_the_cpu():
    """The reference runs on whichever device its inputs lie (the benchmark's torch baseline
    runs it on the GPU): its FP8 codes and scales must not depend on that."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn((2048, 7168), generator=g) * 3).to(torch.bfloat16)
    for ue8m0 in (False, True):
        q_gpu, s_gpu = reference.quantize_fp8(x.to(DEV), ue8m0)
        q_cpu, s_cpu = reference.quantize_fp8(x, ue8m0)
        same_bytes(s_gpu.cpu(), s_cpu, f"scales ue8m0={ue8m0}")
        same_bytes(q_gpu.cpu(), q_cpu, f"codes ue8m0={ue8m0}")


# ------------------------------------------------------------------------------ normal mode
def _checked_round_trip(bufs, case: Case, it: int, fp8: bool, max_rows: int | None, what: str):
    """Dispatch and combine call ``it`` of ``case`` on the virtual ranks ``bufs``, each checked
    against the reference; returns ``(dispatch results, combine outputs)``."""
    xs, idxs, ws = make_inputs(case, it)
    got = lockstep.dispatch(bufs, _cuda(xs), _cuda(idxs), _cuda(ws), case.alignment, fp8=fp8,
                            max_recv_rows=max_rows)
    settle(bufs, what)
    want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts,
                                  expert_alignment=case.alignment, fp8=fp8)
    for r, (g, w) in enumerate(zip(got, want)):
        check_normal_dispatch(g, w, f"{what} rank {r}")
    ys_ref = _ys_reference(want, case.dtype)
    ys = [_padded(y, g.x.shape[0]) for y, g in zip(ys_ref, got)]
    outs = lockstep.combine(bufs, ys, [g.handle for g in got], [g.weights for g in got])
    settle(bufs, what)
    _check_combine(outs, ys_ref, want, what)
    return got, outs


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("fp8", [False, True])
def test_normal_mode_matches_reference(world_size, fp8):
    """Three calls (both staging parities); the second sized by ``max_recv_rows``."""
    case = Case(world_size, 8 * world_size, 2048, 8, tuple(64 + 9 * r for r in range(world_size)),
                routing="zipf", alignment=16, seed=world_size)
    bufs = moe_comm.Buffer.loopback(world_size, case.hidden, case.num_experts, case.max_tokens,
                                    case.dtype, device=DEV)
    for it in range(3):
        max_rows = _worst_case_rows(case) if it == 1 else None
        _checked_round_trip(bufs, case, it, fp8, max_rows,
                            f"R={world_size} fp8={fp8} call {it} max_recv_rows={max_rows}")
    # the later calls' launches went through bound launches (kernels/bound.py), and matched
    assert all(b._bound.bound_calls > 0 for b in bufs), [b._bound.bound_calls for b in bufs]


@pytest.mark.parametrize("fp8", [False, True])
def test_normal_mode_in_rounds_matches_whole_batch_and_reference(fp8):
    """Bounded staging on the GPU: rings of 16 slots per source (7 rounds a call at 100 tokens),
    two calls (both parities of every round), the second sized by ``max_recv_rows``; rows byte
    for byte against the reference, and every output bit for bit against the same inputs
    through the whole-batch staging (the same kernels sum in the same order)."""
    from moe_comm.workspace import staging_slot_bytes

    R, slots = 4, 16
    case = Case(R, 8 * R, 2048, 8, (64, 73, 0, 100), routing="zipf", alignment=16, seed=17)
    per_slot = staging_slot_bytes(R, case.hidden, case.topk, case.dtype, False, None)
    runs = {}
    for budget in (None, slots * per_slot):
        bufs = moe_comm.Buffer.loopback(R, case.hidden, case.num_experts, case.max_tokens,
                                        case.dtype, device=DEV, max_topk=case.topk,
                                        staging_bytes=budget)
        assert bufs[0].rounds == (1 if budget is None else -(-case.max_tokens // slots))
        calls = []
        for it in range(2):
            max_rows = _worst_case_rows(case) if it == 1 else None
            got, outs = _checked_round_trip(bufs, case, it, fp8, max_rows,
                                            f"fp8={fp8} rounds={bufs[0].rounds} call {it}")
            calls.append(([g.x.cpu() for g in got], [o.cpu() for o in outs]))
        runs[budget is None] = calls
    for it, (whole, bounded) in enumerate(zip(runs[True], runs[False])):
        for r in range(R):
            same_bytes(bounded[0][r], whole[0][r], f"call {it} rank {r} rows, rounds vs whole")
            same_bytes(bounded[1][r], whole[1][r], f"call {it} rank {r} combine, rounds vs whole")


def test_bound_launches_are_tritons_launches_on_the_gpu(monkeypatch):
    """With real compiled kernels and device addresses: every launch of both modes (FP8 and
    bf16, three calls each) takes Triton's path and is checked against its bound launch (the
    same compiled kernel, grid and arguments: ``kernels.bound.VERIFY``)."""
    from moe_comm.kernels import bound

    monkeypatch.setattr(bound, "VERIFY", True)
    world_size = 4
    case = Case(world_size, 8 * world_size, 2048, 8, (64, 73, 1, 100), routing="zipf",
                alignment=16, seed=5)
    bufs = moe_comm.Buffer.loopback(world_size, case.hidden, case.num_experts, case.max_tokens,
                                    case.dtype, device=DEV)
    for it in range(3):
        xs, idxs, ws = make_inputs(case, it)
        got = lockstep.dispatch(bufs, _cuda(xs), _cuda(idxs), _cuda(ws), case.alignment,
                                fp8=it == 1, max_recv_rows=_worst_case_rows(case))
        ys = [torch.zeros_like(g.x, dtype=case.dtype) for g in got]
        lockstep.combine(bufs, ys, [g.handle for g in got], [g.weights for g in got])
        settle(bufs, f"normal call {it}")
    ll = Case(world_size, 4 * world_size, 7168, 8, (128,) * world_size, seed=3)
    ll_bufs = moe_comm.Buffer.loopback(world_size, ll.hidden, ll.num_experts, 128, ll.dtype,
                                       low_latency=True, device=DEV, kernel_impl="triton")
    for it in range(3):
        _ll_round(ll_bufs, ll, it, fp8=it % 2 == 0)
    assert all(len(b._bound) > 0 for b in bufs + ll_bufs)


@pytest.mark.parametrize("fp8, rounds", [(False, False), (True, False), (True, True)])
def test_normal_mode_with_max_recv_rows_replays_in_a_cuda_graph(fp8, rounds):
    """Dispatch (sized by ``max_recv_rows``: no host read), the experts and combine captured
    once in a CUDA graph; each replay with new inputs and new routing gives the reference's
    rows and sums. ``rounds``: bounded staging of 16 slots per source (4 rounds a call)."""
    from moe_comm.workspace import staging_slot_bytes

    R, E, H, K, T = 4, 32, 2048, 8, 64
    case = Case(R, E, H, K, (T,) * R, routing="zipf", alignment=16, seed=13)
    max_rows = _worst_case_rows(case)
    budget = 16 * staging_slot_bytes(R, H, K, case.dtype) if rounds else None
    bufs = moe_comm.Buffer.loopback(R, H, E, T, case.dtype, device=DEV, max_topk=K,
                                    staging_bytes=budget)
    assert bufs[0].rounds == (4 if rounds else 1)
    xs, idxs, ws = (_cuda(v) for v in make_inputs(case, 0))  # the graph's input tensors

    def step():
        res = lockstep.dispatch(bufs, xs, idxs, ws, case.alignment, fp8=fp8,
                                max_recv_rows=max_rows)
        ys = [_expert_fn_on_device(_rows_as_floats(r), r.expert_offsets).to(case.dtype)
              for r in res]
        outs = lockstep.combine(bufs, ys, [r.handle for r in res], [r.weights for r in res])
        return res, ys, outs

    step()  # compile and load every kernel outside the capture
    settle(bufs, "warm-up")
    syncs = [collections.Counter(b.host_syncs) for b in bufs]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res, ys, outs = step()
    assert [collections.Counter(b.host_syncs) for b in bufs] == syncs, "host read in capture"
    for it in range(1, 4):
        what = f"fp8={fp8} rounds={rounds} replay {it}"
        new_x, new_idx, new_w = make_inputs(case, it)
        for dst, src in zip(xs + idxs + ws, new_x + new_idx + new_w):
            dst.copy_(src.to(DEV))
        graph.replay()
        settle(bufs, what)
        want = reference.dispatch_all(new_x, new_idx, new_w, num_experts=E,
                                      expert_alignment=case.alignment, fp8=fp8)
        for r, (g, w) in enumerate(zip(res, want)):
            check_normal_dispatch(g, w, f"{what} rank {r}")
        ys_ref = _ys_reference(want, case.dtype)
        for r, (y, y_ref) in enumerate(zip(ys, ys_ref)):
            same_bytes(y[:y_ref.shape[0]], y_ref, f"{what} rank {r} expert outputs")
        _check_combine(outs, ys_ref, want, what)


# ------------------------------------------------------------------------------ low latency
def _ll_round(bufs, case, it, fp8):
    T, what = case.max_tokens, f"call {it} fp8={fp8}"
    xs, idxs, ws = make_inputs(case, it)
    got = lockstep.low_latency_dispatch(bufs, _cuda(xs), _cuda(idxs), fp8=fp8)
    settle(bufs, what)
    want = reference.low_latency_dispatch_all(xs, idxs, num_experts=case.num_experts,
                                              max_tokens=T, fp8=fp8)
    for r, (g, w) in enumerate(zip(got, want)):
        check_ll_dispatch(g, w, f"{what} rank {r}")
    gen = torch.Generator(device=DEV).manual_seed(100 + it)
    ys = [torch.randn(w.x.shape, device=DEV, generator=gen).to(case.dtype) for w in want]
    outs = lockstep.low_latency_combine(bufs, ys, _cuda(idxs), _cuda(ws),
                                        [g.handle for g in got])
    settle(bufs, what)
    ys_cpu = [y.cpu() for y in ys]
    ref = reference.low_latency_combine_all(ys_cpu, idxs, ws, want, T)
    slack = ll_combine_slack(ys_cpu, [w.count for w in want], idxs, ws)
    for r, (o, w, s) in enumerate(zip(outs, ref, slack)):
        assert_within_one_ulp(o, w, s, what=f"{what} combine rank {r}")


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("kernel_impl", ["triton", "cuda"])
def test_low_latency_matches_reference(world_size, kernel_impl):
    _csrc_or_skip(kernel_impl)
    case = Case(world_size, 4 * world_size, 7168, 8, (128,) * world_size, seed=3)
    bufs = moe_comm.Buffer.loopback(world_size, case.hidden, case.num_experts, 128, case.dtype,
                                    low_latency=True, device=DEV, kernel_impl=kernel_impl)
    for it in range(3):
        _ll_round(bufs, case, it, fp8=it % 2 == 0)
    if kernel_impl == "triton":  # the later calls through bound launches (kernels/bound.py)
        assert all(b._bound.bound_calls > 0 for b in bufs), [b._bound.bound_calls for b in bufs]


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
    settle(bufs, "warm-up")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recvs, outs = step()
    for it in range(1, 4):
        what = f"replay {it}"
        new_x, new_idx, new_w = make_inputs(case, it)
        for dst, src in zip(xs + idxs + ws, new_x + new_idx + new_w):
            dst.copy_(src.to(DEV))
        graph.replay()
        settle(bufs, what)
        want = reference.low_latency_dispatch_all(new_x, new_idx, num_experts=E, max_tokens=T,
                                                  fp8=True)
        for r, (g, w) in enumerate(zip(recvs, want)):
            check_ll_dispatch(g, w, f"{what} rank {r}")
        ys_cpu = [y.cpu() for y in ys]
        ref = reference.low_latency_combine_all(ys_cpu, new_idx, new_w, want, T)
        slack = ll_combine_slack(ys_cpu, [w.count for w in want], new_idx, new_w)
        for r, (o, w, s) in enumerate(zip(outs, ref, slack)):
            assert_within_one_ulp(o, w, s, what=f"{what} combine rank {r}")


# ------------------------------------------------------------------------------ host syncs
def _delta(after: collections.Counter, before: collections.Counter) -> dict:
    return {k: v for k, v in (after - before).items() if v}


class _Recorder:
    """What each virtual rank's counters gained during one op."""

    def __init__(self, bufs):
        self.bufs = bufs

    def __enter__(self):
        self.syncs = [collections.Counter(b.host_syncs) for b in self.bufs]
        self.launches = [collections.Counter(b.launches) for b in self.bufs]
        return self

    def __exit__(self, *exc):
        self.sync_deltas = [_delta(b.host_syncs, s) for b, s in zip(self.bufs, self.syncs)]
        self.launch_deltas = [_delta(b.launches, s) for b, s in zip(self.bufs, self.launches)]


class _NoDeviceSync:
    """torch raises on any synchronising CUDA call inside the block (``.item()``, a blocking
    copy between host and device, ``nonzero``...): a second witness next to ``host_syncs``."""

    def __enter__(self):
        self.previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(self.previous)


def test_host_syncs_per_op_on_the_gpu():
    """Normal dispatch reads its row count once (``rows``), none with ``max_recv_rows``;
    combine reads nothing; launches per op as documented in ``moe_comm.normal_mode`` (waits run
    in kernels on a GPU: the dispatch's in its received layout, the combine's a ``wait``
    launch)."""
    case = Case(4, 16, 1024, 4, (40, 33, 47, 29), routing="zipf", alignment=8, seed=61)
    bufs = moe_comm.Buffer.loopback(4, case.hidden, case.num_experts, case.max_tokens,
                                    case.dtype, device=DEV)
    xs, idxs, ws = (_cuda(v) for v in make_inputs(case, 0))
    res = lockstep.dispatch(bufs, xs, idxs, ws, case.alignment)  # compile outside the checks
    lockstep.combine(bufs, [r.x for r in res], [r.handle for r in res], [r.weights for r in res])
    settle(bufs, "warm-up")
    dispatch_launches = {"layout": 2, "dispatch_send": 1, "received_layout": 1,
                         "dispatch_expand": 1}
    combine_launches = {"combine_send": 1, "combine_reduce": 1, "wait": 1}

    with _Recorder(bufs) as rec:
        res = lockstep.dispatch(bufs, xs, idxs, ws, case.alignment)
    assert rec.sync_deltas == [{"rows": 1}] * 4
    assert rec.launch_deltas == [dispatch_launches] * 4
    with _Recorder(bufs) as rec, _NoDeviceSync():
        lockstep.combine(bufs, [r.x for r in res], [r.handle for r in res],
                         [r.weights for r in res])
    assert rec.sync_deltas == [{}] * 4
    assert rec.launch_deltas == [combine_launches] * 4
    settle(bufs, "normal mode")

    max_rows = _worst_case_rows(case)
    for fp8 in (False, True):
        with _Recorder(bufs) as rec, _NoDeviceSync():
            res = lockstep.dispatch(bufs, xs, idxs, ws, case.alignment, fp8=fp8,
                                    max_recv_rows=max_rows)
        assert rec.sync_deltas == [{}] * 4, f"fp8={fp8}"
        assert rec.launch_deltas == [dispatch_launches] * 4, f"fp8={fp8}"
        ys = [_rows_as_floats(r).to(case.dtype) for r in res]
        with _Recorder(bufs) as rec, _NoDeviceSync():
            lockstep.combine(bufs, ys, [r.handle for r in res], [r.weights for r in res])
        assert rec.sync_deltas == [{}] * 4, f"fp8={fp8}"
        assert rec.launch_deltas == [combine_launches] * 4, f"fp8={fp8}"
        settle(bufs, f"max_recv_rows fp8={fp8}")


@pytest.mark.parametrize("kernel_impl", ["triton", "cuda"])
def test_low_latency_host_syncs_on_the_gpu(kernel_impl):
    """Low-latency dispatch and combine read nothing: one launch per phase and rank."""
    _csrc_or_skip(kernel_impl)
    case = Case(4, 16, 2048, 4, (32,) * 4, seed=62)
    bufs = moe_comm.Buffer.loopback(4, case.hidden, case.num_experts, case.max_tokens,
                                    case.dtype, low_latency=True, device=DEV,
                                    kernel_impl=kernel_impl)
    xs, idxs, ws = (_cuda(v) for v in make_inputs(case, 0))
    for fp8 in (False, True):  # compile (and load csrc/) outside the checks
        recvs = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=fp8)
    ys = [torch.zeros(r.x.shape, dtype=case.dtype, device=DEV) for r in recvs]
    lockstep.low_latency_combine(bufs, ys, idxs, ws, [r.handle for r in recvs])
    settle(bufs, "warm-up")
    # csrc/ does not check ids in its kernels: one small launch per op hands it checked ones
    check = {"checked_topk_idx": 1} if kernel_impl == "cuda" else {}
    for fp8 in (False, True):
        with _Recorder(bufs) as rec, _NoDeviceSync():
            recvs = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=fp8)
        assert rec.sync_deltas == [{}] * 4, f"fp8={fp8}"
        assert rec.launch_deltas == [{"ll_dispatch_send": 1, "ll_dispatch_recv": 1,
                                      **check}] * 4
        with _Recorder(bufs) as rec, _NoDeviceSync():
            lockstep.low_latency_combine(bufs, ys, idxs, ws, [r.handle for r in recvs])
        assert rec.sync_deltas == [{}] * 4, f"fp8={fp8}"
        assert rec.launch_deltas == [{"ll_combine_send": 1, "ll_combine_recv": 1, **check}] * 4
        settle(bufs, f"low latency fp8={fp8}")


# ------------------------------------------------------------------------------ EP invariance
def _invariant_case(seed: int):
    """A DeepSeek-like batch for the invariant combine: 512 tokens in all, H 2048, 64 experts,
    top 8, Zipf-like skew (the first experts are drawn most), a choice and a token to -1."""
    N, H, E, K = 512, 2048, 64, 8
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((N, H), generator=gen).to(torch.bfloat16)
    bias = torch.arange(E, 0, -1, dtype=torch.float32).log() * 2
    w, idx = (torch.randn((N, E), generator=gen) + bias).softmax(-1).topk(K, -1)
    idx[3, 1] = -1
    idx[5] = -1
    return x, idx, w.float(), E


def _invariant_expert(rows: torch.Tensor, e: torch.Tensor, E: int) -> torch.Tensor:
    """Expert ``e[i]`` on row i: one multiply, then one add, each an exact IEEE operation on
    the CPU and the GPU alike (two torch kernels, nothing to fuse)."""
    scale = ((torch.arange(E, dtype=torch.float32) + 1) / 3).to(rows.device)
    return (rows.float() * scale[e][:, None] + 0.25).to(rows.dtype)


def _invariant_outputs(R: int, x, idx, w, E: int, *, invariant: bool, low_latency: bool = False,
                       staging_bytes=None, calls: int = 2) -> torch.Tensor:
    """Dispatch, experts, combine on R virtual ranks of the GPU (rank r: tokens ``r*N/R...``);
    the last call's outputs in global token order, on the CPU."""
    N, H = x.shape
    T, L, K = N // R, E // R, idx.shape[1]
    bufs = moe_comm.Buffer.loopback(R, H, E, T, torch.bfloat16, max_topk=K, device=DEV,
                                    ep_invariant=invariant, low_latency=low_latency,
                                    staging_bytes=staging_bytes)
    xs, idxs, ws = (_cuda(list(v.chunk(R))) for v in (x, idx, w))
    for _ in range(calls):  # both parities
        if low_latency:
            recv = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=False)
            ys = []
            for r, got in enumerate(recv):
                e = torch.arange(r * L, (r + 1) * L, device=DEV)[:, None].expand(L, R * T)
                ys.append(_invariant_expert(got.x.reshape(L * R * T, H), e.reshape(-1), E)
                          .view(L, R * T, H))
            outs = lockstep.low_latency_combine(bufs, ys, idxs, ws, [g.handle for g in recv])
        else:
            res = lockstep.dispatch(bufs, xs, idxs, ws)
            ys = []
            for r, rr in enumerate(res):
                bounds = rr.expert_offsets.tolist()
                e = torch.zeros(rr.x.shape[0], dtype=torch.long)
                for lo in range(L):
                    e[bounds[lo]:bounds[lo + 1]] = r * L + lo
                ys.append(_invariant_expert(rr.x, e.to(DEV), E))
            outs = lockstep.combine(bufs, ys, [rr.handle for rr in res],
                                    [rr.weights for rr in res])
        settle(bufs, f"invariant={invariant} R={R} low_latency={low_latency}")
    return torch.cat(outs).cpu()


def test_ep_invariant_combine_gives_the_same_bits_on_1_2_4_8_ranks_on_the_gpu():
    """The compiled kernels (launched without contraction, so no fused multiply-add) give the
    CPU reference's bits at every EP size, in rounds, and in the low-latency mode; the default
    combine's bits differ at some EP size on the same data (the comparison can fail)."""
    from moe_comm.workspace import staging_slot_bytes
    x, idx, w, E = _invariant_case(27)
    K = idx.shape[1]
    rows = torch.stack([_invariant_expert(x, idx[:, k].clamp(min=0), E) for k in range(K)], 1)
    want = reference.invariant_combine(rows, idx, w, dtype=torch.bfloat16)
    default_differs = []
    for R in (1, 2, 4, 8):
        got = _invariant_outputs(R, x, idx, w, E, invariant=True)
        same_bytes(got, want, f"invariant combine R={R}")
        plain = _invariant_outputs(R, x, idx, w, E, invariant=False, calls=1)
        default_differs.append(not torch.equal(plain.view(torch.int16), want.view(torch.int16)))
    assert any(default_differs), default_differs
    per_slot = staging_slot_bytes(4, x.shape[1], K, torch.bfloat16, invariant=True)
    same_bytes(_invariant_outputs(4, x, idx, w, E, invariant=True, staging_bytes=16 * per_slot),
               want, "invariant combine R=4 in rounds of 16 slots")
    for R in (2, 8):
        same_bytes(_invariant_outputs(R, x, idx, w, E, invariant=True, low_latency=True), want,
                   f"invariant low-latency combine R={R}")
