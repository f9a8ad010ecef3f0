"""Jobs for GPU ranks as processes (``RankPool(..., compiled=True)``), several of them sharing
one GPU: ``job(rank, world_size, ...)`` on every rank, each rank its own process with its own
Buffer over the ``cuda`` heap, every result checked on the rank against the reference run on
the CPU from every rank's inputs (``cases.make_inputs``), as tests/test_gpu.py checks virtual
ranks. Without MPS the kernels of different processes take turns on the GPU: a wait for a peer
ends only after the peer's time slice, so these runs say nothing about speed."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from test_gpu import (  # (test_gpu puts bench/ on the path for gpu_compare's checks)
    _expert_fn_on_device,
    _rows_as_floats,
    _worst_case_rows,
    _ys_reference,
    assert_within_one_ulp,
    check_ll_dispatch,
    check_normal_dispatch,
    ll_combine_slack,
    normal_combine_slack,
    same_bytes,
    settle,
)

import moe_comm
from cases import Case, make_inputs
from moe_comm import reference

GPU = "cuda:0"


def _buffer(case: Case, device: str, **kwargs) -> moe_comm.Buffer:
    """This rank's Buffer on ``device``: the GPU over the ``cuda`` heap unless ``kwargs`` say
    otherwise, or ``"cpu"`` (CPU ranks: how tests/test_ranks.py checks these jobs)."""
    if device != "cpu":
        torch.cuda.set_device(0)
        kwargs.setdefault("backend", "cuda")
    return moe_comm.Buffer(dist.group.WORLD, case.hidden, case.num_experts, case.max_tokens,
                           case.dtype, max_topk=case.topk, device=device, **kwargs)


def _facts(buf: moe_comm.Buffer, first_call_s: float, warmup: dict | None = None) -> dict:
    """What the test reports: how the heap maps peers, the rounds and their ring, the
    launches that ran a call's rounds in one, whether the kernels put through NVSHMEM
    (transport 1), the first call's time and the warm-up's."""
    return dict(mapping=getattr(buf.heap, "mapping", type(buf.heap).__name__),
                rounds=buf.rounds, ring_slots=buf.ring_slots,
                one_launch={k: buf.launches[k] for k in ("dispatch_rounds", "combine_rounds")},
                transport=buf.flavour.transport,
                first_call_s=round(first_call_s, 3),
                warmup=None if warmup is None else (len(warmup["variants"]),
                                                    round(warmup["seconds"], 3)))


def _warmed(buf: moe_comm.Buffer, warm: bool, fp8: bool) -> dict | None:
    """``buf.warmup()`` on every rank, then a barrier: no first call compiles."""
    if not warm:
        return None
    done = buf.warmup(fp8=fp8)
    dist.barrier()
    return done


def _check_dispatch(rank, case, it, res, fp8, what) -> tuple:
    """Checks this rank's dispatch of call ``it``; returns the reference's results of every
    rank and their expert outputs (CPU)."""
    xs, idxs, ws = make_inputs(case, it)
    want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts,
                                  expert_alignment=case.alignment, fp8=fp8)
    check_normal_dispatch(res, want[rank], f"{what} rank {rank}")
    return want, _ys_reference(want, case.dtype)


def _check_combine(rank, want, ys_ref, out, what) -> None:
    handles, weights = [w.handle for w in want], [w.weights for w in want]
    ref = reference.combine_all(ys_ref, handles, weights)
    slack = normal_combine_slack(ys_ref, handles, weights)
    assert_within_one_ulp(out, ref[rank], slack[rank], what=f"{what} combine rank {rank}")


def normal_mode(rank, world_size, case: Case, fp8: bool, ring_slots: int | None = None,
                calls: int = 3, warm: bool = False, device: str = GPU,
                **buffer_kwargs) -> dict:
    """``calls`` dispatch + combine calls, new routing each, checked against the reference
    (``ring_slots``: a staging of that many slots per source, the calls in rounds;
    ``buffer_kwargs``: e.g. the NVSHMEM heap with a node per rank)."""
    from moe_comm.workspace import staging_slot_bytes

    budget = (None if ring_slots is None else ring_slots * staging_slot_bytes(
        world_size, case.hidden, case.topk, case.dtype,
        rdma=buffer_kwargs.get("backend") == "nvshmem"))  # (its outboxes: a node per rank)
    with _buffer(case, device, staging_bytes=budget, **buffer_kwargs) as buf:
        warmed = _warmed(buf, warm, fp8)
        first = None
        for it in range(calls):
            what = f"call {it} fp8={fp8} rounds={buf.rounds}"
            xs, idxs, ws = make_inputs(case, it)
            start = time.perf_counter()
            res = buf.dispatch(xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device),
                               case.alignment, fp8=fp8)
            settle([buf], what)
            want, ys_ref = _check_dispatch(rank, case, it, res, fp8, what)
            out = buf.combine(ys_ref[rank].to(device), res.handle, weights=res.weights)
            settle([buf], what)
            if first is None:  # the first call compiles or loads every kernel it launches
                first = time.perf_counter() - start
            _check_combine(rank, want, ys_ref, out, what)
        return _facts(buf, first, warmed)


def normal_mode_graph(rank, world_size, case: Case, fp8: bool, device: str = GPU) -> dict:
    """Dispatch sized by ``max_recv_rows``, the experts and combine captured once in a CUDA
    graph in this process; replays with new inputs give the reference's rows and sums."""
    max_rows = _worst_case_rows(case)
    with _buffer(case, device) as buf:
        xs, idxs, ws = (v[rank].to(device) for v in make_inputs(case, 0))

        def step():
            res = buf.dispatch(xs, idxs, ws, case.alignment, fp8=fp8, max_recv_rows=max_rows)
            y = _expert_fn_on_device(_rows_as_floats(res), res.expert_offsets).to(case.dtype)
            return res, y, buf.combine(y, res.handle, weights=res.weights)

        start = time.perf_counter()
        step()  # compile and load every kernel outside the capture
        settle([buf], "warm-up")
        first = time.perf_counter() - start
        dist.barrier()  # no rank captures while a peer still runs its warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            res, y, out = step()
        for it in range(1, 4):
            what = f"fp8={fp8} replay {it}"
            new = [v[rank] for v in make_inputs(case, it)]
            for dst, src in zip((xs, idxs, ws), new):
                dst.copy_(src.to(device))
            dist.barrier()  # every process's inputs are in place before any replay
            graph.replay()
            settle([buf], what)
            want, ys_ref = _check_dispatch(rank, case, it, res, fp8, what)
            same_bytes(y[:ys_ref[rank].shape[0]], ys_ref[rank],
                       f"{what} rank {rank} expert outputs")
            _check_combine(rank, want, ys_ref, out, what)
        return _facts(buf, first)


def low_latency(rank, world_size, case: Case, kernel_impl: str, calls: int = 3,
                warm: bool = False, device: str = GPU, **buffer_kwargs) -> dict:
    """Low-latency dispatch + combine ``calls`` times (FP8 and bf16 alternating), checked."""
    T = case.max_tokens
    with _buffer(case, device, low_latency=True, kernel_impl=kernel_impl,
                 **buffer_kwargs) as buf:
        warmed = _warmed(buf, warm, True)
        first = None
        for it in range(calls):
            fp8 = it % 2 == 0
            what = f"call {it} fp8={fp8} {kernel_impl}"
            xs, idxs, ws = make_inputs(case, it)
            start = time.perf_counter()
            recv, _ = buf.low_latency_dispatch(xs[rank].to(device), idxs[rank].to(device), fp8=fp8)
            settle([buf], what)
            want = reference.low_latency_dispatch_all(xs, idxs, num_experts=case.num_experts,
                                                      max_tokens=T, fp8=fp8)
            check_ll_dispatch(recv, want[rank], f"{what} rank {rank}")
            gen = torch.Generator().manual_seed(100 + it)
            ys = [torch.randn(w.x.shape, generator=gen).to(case.dtype) for w in want]
            out, _ = buf.low_latency_combine(ys[rank].to(device), idxs[rank].to(device),
                                             ws[rank].to(device), recv.handle)
            settle([buf], what)
            if first is None:  # the first call compiles or loads every kernel it launches
                first = time.perf_counter() - start
            ref = reference.low_latency_combine_all(ys, idxs, ws, want, T)
            slack = ll_combine_slack(ys, [w.count for w in want], idxs, ws)
            assert_within_one_ulp(out, ref[rank], slack[rank],
                                  what=f"{what} combine rank {rank}")
        return _facts(buf, first, warmed)
