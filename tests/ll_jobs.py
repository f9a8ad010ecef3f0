"""Low-latency jobs for CPU ranks: ``job(rank, world_size, ...)``, module level."""
from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist

import moe_comm
from cases import Case, make_inputs
from moe_comm import reference


def new_ll_buffer(case: Case, **kwargs) -> moe_comm.Buffer:
    return moe_comm.Buffer(dist.group.WORLD, hidden=case.hidden, num_experts=case.num_experts,
                           max_tokens_per_rank=case.max_tokens, dtype=case.dtype,
                           low_latency=True, **kwargs)


def expert_outputs(recv, seed: int) -> torch.Tensor:
    """Deterministic y [L, R*T, H] (the rows past count are never read)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(recv.x.shape, generator=g).to(torch.bfloat16)


def check_recv(rank, case, it, recv, xs, idxs, fp8, ue8m0=False, col_major=False,
               dispatch_dtype=None):
    want = reference.low_latency_dispatch_all(
        xs, idxs, num_experts=case.num_experts, max_tokens=case.max_tokens, fp8=fp8,
        ue8m0=ue8m0, col_major_scales=col_major, dispatch_dtype=dispatch_dtype)[rank]
    assert torch.equal(recv.count, want.count), f"rank {rank} iteration {it}: counts"
    for e, n in enumerate(want.count.tolist()):
        a, b = recv.x[e, :n], want.x[e, :n]
        if fp8 or dispatch_dtype:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
            sa, sb = recv.x_scales[e, :n], want.x_scales[e, :n]
            if sa.dtype in (torch.float8_e8m0fnu, torch.float8_e4m3fn):
                sa, sb = sa.contiguous().view(torch.uint8), sb.contiguous().view(torch.uint8)
            assert torch.equal(sa, sb), (rank, it, e)
            if want.x_global_scale is not None:
                assert torch.equal(recv.x_global_scale[e, :n], want.x_global_scale[e, :n])
        assert torch.equal(a, b), f"rank {rank} iteration {it}: rows of expert {e}"
        assert torch.equal(recv.src_info[e, :n], want.src_info[e, :n]), (rank, it, e)
    return want


def check_out(rank, case, it, out, recvs_all_ranks_ys, idxs, ws, combine_dtype=None):
    ys, refs = recvs_all_ranks_ys
    want = reference.low_latency_combine_all(ys, idxs, ws, refs, case.max_tokens,
                                             combine_dtype)[rank]
    assert torch.equal(out, want), f"rank {rank} iteration {it}: combine"


def _all_ys(case, xs, idxs, fp8, seed, dispatch_dtype=None):
    refs = reference.low_latency_dispatch_all(xs, idxs, num_experts=case.num_experts,
                                              max_tokens=case.max_tokens, fp8=fp8,
                                              dispatch_dtype=dispatch_dtype)
    ys = []
    for r, ref in enumerate(refs):
        g = torch.Generator().manual_seed(seed * 100 + r)
        shape = (*ref.x.shape[:2], case.hidden)  # (NVFP4 rows hold two values per byte)
        ys.append(torch.randn(shape, generator=g).to(torch.bfloat16))
    return ys, refs


def ll_round_trip(rank, world_size, case: Case, fp8: bool, ue8m0: bool = False,
                  col_major: bool = False, iterations: int = 1) -> list[int]:
    """Dispatch + combine, checked against the reference; returns cumulative recv stats."""
    stats = torch.zeros(case.num_experts // world_size, dtype=torch.int64)
    with new_ll_buffer(case) as buf:
        for it in range(iterations):
            xs, idxs, ws = make_inputs(case, it)
            recv, _ = buf.low_latency_dispatch(xs[rank], idxs[rank], fp8=fp8, ue8m0=ue8m0,
                                               col_major_scales=col_major,
                                               cumulative_local_expert_recv_stats=stats)
            check_recv(rank, case, it, recv, xs, idxs, fp8, ue8m0, col_major)
            ys, refs = _all_ys(case, xs, idxs, fp8, it)
            out, _ = buf.low_latency_combine(ys[rank], idxs[rank], ws[rank], recv.handle)
            check_out(rank, case, it, out, (ys, refs), idxs, ws)
            assert recv.source_wait_s is not None and len(recv.source_wait_s) == world_size
    return stats.tolist()


def ll_two_in_flight(rank, world_size, case: Case, rounds: int, straggle_s: float,
                     in_kernels: bool = False, **buffer_kwargs) -> None:
    """Two micro-batches overlapped, as decode does: send A, send B, receive A, combine A while
    B is in flight, ... with random per-rank delays; every result checked. ``in_kernels``: the
    sends wait for the acknowledgements and the receives for the data inside the kernels."""
    from rank_jobs import kernel_waits

    delay = random.Random(77 + rank)
    with kernel_waits(in_kernels):
        buf = new_ll_buffer(case, **buffer_kwargs)
    with buf:
        for rnd in range(rounds):
            batches = [make_inputs(case, 2 * rnd + mb) for mb in range(2)]
            sent = []
            for mb, (xs, idxs, _) in enumerate(batches):
                time.sleep(delay.uniform(0, straggle_s))
                sent.append(buf.low_latency_dispatch(xs[rank], idxs[rank], fp8=mb == 0,
                                                     return_hook=True))
            combines = []
            for mb, ((recv, hook), (xs, idxs, ws)) in enumerate(zip(sent, batches)):
                time.sleep(delay.uniform(0, straggle_s))
                hook()
                it = 2 * rnd + mb
                check_recv(rank, case, it, recv, xs, idxs, fp8=mb == 0)
                ys, refs = _all_ys(case, xs, idxs, mb == 0, it)
                out, chook = buf.low_latency_combine(ys[rank], idxs[rank], ws[rank],
                                                     recv.handle, return_hook=True)
                combines.append((out, chook, ys, refs, idxs, ws, it))
            for out, chook, ys, refs, idxs, ws, it in combines:
                time.sleep(delay.uniform(0, straggle_s))
                chook()
                check_out(rank, case, it, out, (ys, refs), idxs, ws)


def ll_pipelined_dispatches(rank, world_size, case: Case, calls: int, straggle_s: float,
                            in_kernels: bool = False, **buffer_kwargs):
    """Dispatches only, always two in flight: staging parity p is written again while a slow
    peer may still be reading it unless the acknowledgements hold the sender back."""
    from rank_jobs import kernel_waits

    delay = random.Random(500 + rank)
    with kernel_waits(in_kernels):
        buf = new_ll_buffer(case, **buffer_kwargs)
    with buf:
        inflight = []
        for n in range(calls):
            xs, idxs, _ = make_inputs(case, n)
            recv, hook = buf.low_latency_dispatch(xs[rank], idxs[rank], fp8=False,
                                                  return_hook=True)
            inflight.append((recv, hook, xs, idxs, n))
            if len(inflight) == 2:
                old_recv, old_hook, oxs, oidxs, on = inflight.pop(0)
                time.sleep(delay.uniform(0, straggle_s) * (rank == n % world_size))
                old_hook()
                check_recv(rank, case, on, old_recv, oxs, oidxs, fp8=False)
        for recv, hook, xs, idxs, n in inflight:
            hook()
            check_recv(rank, case, n, recv, xs, idxs, fp8=False)


def ll_misuse(rank, world_size, case: Case) -> dict:
    """Errors every rank makes together (so nobody waits): a third send, a hook called twice,
    combine before receive, bad shapes; then a correct call still works."""
    errors = {}
    xs, idxs, ws = make_inputs(case)
    x, idx, w = xs[rank], idxs[rank], ws[rank]

    def expect(name, fn, kinds=(RuntimeError, ValueError, TypeError)):
        try:
            fn()
            errors[name] = None
        except kinds as error:
            errors[name] = f"{type(error).__name__}: {error}"

    with new_ll_buffer(case) as buf:
        r1, h1 = buf.low_latency_dispatch(x, idx, fp8=False, return_hook=True)
        r2, h2 = buf.low_latency_dispatch(x, idx, fp8=False, return_hook=True)
        expect("combine_before_receive", lambda: buf.low_latency_combine(
            torch.zeros_like(r1.x), idx, w, r1.handle))
        expect("third_send", lambda: buf.low_latency_dispatch(x, idx, return_hook=True))
        assert r1.handle.received and not r2.handle.received  # the oldest was received
        h1()  # its hook still returns its rows
        check_recv(rank, case, 0, r1, xs, idxs, fp8=False)
        expect("hook_twice", h1)
        h2()
        check_recv(rank, case, 0, r2, xs, idxs, fp8=False)
        expect("y_shape", lambda: buf.low_latency_combine(r1.x[:, :1], idx, w, r1.handle))
        expect("topk_shape", lambda: buf.low_latency_combine(r1.x, idx[:, :1], w, r1.handle))
        expect("stats_shape", lambda: buf.low_latency_dispatch(
            x, idx, cumulative_local_expert_recv_stats=torch.zeros(99, dtype=torch.int32)))
        expect("too_many_tokens", lambda: buf.low_latency_dispatch(
            torch.zeros((case.max_tokens + 1, case.hidden), dtype=case.dtype),
            torch.zeros((case.max_tokens + 1, 1), dtype=torch.int64)))
        recv, _ = buf.low_latency_dispatch(x, idx, fp8=True)  # still works
        check_recv(rank, case, 0, recv, xs, idxs, fp8=True)
        plain = moe_comm.Buffer.loopback(1, case.hidden, case.num_experts, case.max_tokens,
                                         case.dtype)[0]
        expect("no_ll_workspace", lambda: plain.low_latency_dispatch(x, idx))
    return errors


def ll_skip(rank, world_size, case: Case, skipper: int, wait_timeout_s: float,
            in_kernels: bool = False) -> dict:
    """``skipper`` does not dispatch; the others' hooks raise naming it at that call. With
    ``in_kernels`` the receive kernel waits (the GPU protocol): it times out, copies nothing
    and acknowledges nothing, which the skipper reads in its acknowledgement words."""
    from rank_jobs import kernel_waits

    xs, idxs, _ = make_inputs(case)
    with kernel_waits(in_kernels):
        buf = new_ll_buffer(case, timeout_s=wait_timeout_s)
    report = {"raised": None}
    if rank != skipper:
        _, hook = buf.low_latency_dispatch(xs[rank], idxs[rank], return_hook=True)
        start = time.monotonic()
        try:
            hook()
        except RuntimeError as error:
            report.update(raised=str(error), peer=getattr(error, "peer", None))
        report["elapsed_s"] = time.monotonic() - start
        try:
            buf.low_latency_dispatch(xs[rank], idxs[rank])
        except RuntimeError as error:
            report["later"] = str(error)
    dist.barrier()
    report["acks"] = buf.layout.view(buf.heap, "ll_acks")[0].tolist()  # [parity][rank]
    buf.close()
    return report


def ll_dropped_and_reordered_hooks(rank, world_size, case: Case) -> list[str]:
    """Hooks never called, called late, called in reverse order, and two dropped in a row:
    every result is checked against the reference; returns the errors raised, in order."""
    errors = []

    def dispatch(it, **kwargs):
        xs, idxs, ws = make_inputs(case, it)
        recv, hook = buf.low_latency_dispatch(xs[rank], idxs[rank], fp8=False, **kwargs)
        return recv, hook, xs, idxs, ws

    def round_trip(it, combine_hook=False):
        recv, _, xs, idxs, ws = dispatch(it)
        check_recv(rank, case, it, recv, xs, idxs, fp8=False)
        ys, refs = _all_ys(case, xs, idxs, False, it)
        out, hook = buf.low_latency_combine(ys[rank], idxs[rank], ws[rank], recv.handle,
                                            return_hook=combine_hook)
        if hook is None:
            check_out(rank, case, it, out, (ys, refs), idxs, ws)
        return out, hook, (ys, refs), idxs, ws

    with new_ll_buffer(case) as buf:
        dispatch(0, return_hook=True)  # dropped: an exception between the send and the hook
        for it in range(1, 4):
            round_trip(it)
        dropped = round_trip(4, combine_hook=True)  # a dropped combine hook
        for it in range(5, 8):
            round_trip(it)
        late = dropped[1]()  # called late: still its own call's sums
        check_out(rank, case, 4, late, *dropped[2:])
        sent = [dispatch(it, return_hook=True) for it in (8, 9)]
        for _, hook, *_ in reversed(sent):  # out of order
            hook()
        for it, (recv, _, xs, idxs, _) in zip((8, 9), sent):
            check_recv(rank, case, it, recv, xs, idxs, fp8=False)
        dispatch(10, return_hook=True)
        dispatch(11, return_hook=True)  # two dropped, then a third send
        try:
            dispatch(12, return_hook=True)
        except RuntimeError as error:
            errors.append(str(error))
        for it in range(12, 14):
            round_trip(it)
        kept = dispatch(14, return_hook=True)
        buf.clean_low_latency_buffer()  # receives 14 (on every rank); its hook returns it
        kept[1]()
        check_recv(rank, case, 14, kept[0], *kept[2:4], fp8=False)
        round_trip(15)
    return errors
