"""Normal dispatches whose ranks disagree: one rank's input is bad (it refuses the call), or
the ranks pass options that must agree (the call descriptor, ``moe_comm.call_descriptor``).
Every rank's error and how long it took come back; then a correct round trip is checked
against the reference, so the Buffer is shown usable."""
from __future__ import annotations

import time

import torch

import moe_comm
from cases import Case, make_inputs
from ll_jobs import _all_ys, check_out, check_recv
from moe_comm import reference
from rank_jobs import kernel_waits

CASE = Case(2, 8, 128, 2, (5, 3), seed=83)  # H = 128: the FP8 formats apply


def _inputs(world_size: int):
    case = Case(world_size, CASE.num_experts, CASE.hidden, CASE.topk,
                (CASE.tokens * world_size)[:world_size], seed=CASE.seed)
    return (case, *make_inputs(case))


def _timed(call, *args, **kwargs) -> tuple[str, str, float]:
    """``(error type or "returned", message, seconds)`` of ``call(*args, **kwargs)``."""
    start = time.monotonic()
    try:
        call(*args, **kwargs)
        return "returned", "", time.monotonic() - start
    except Exception as exc:  # noqa: BLE001 - reported, the test judges it
        return type(exc).__name__, str(exc), time.monotonic() - start


def _both_modes(odd: bool, x, idx, big: int) -> list:
    """The rows of both modes' tables: three bad inputs and two formats that differ."""
    H, K = x.shape[1], idx.shape[1]
    return [
        ("x int32", dict(x=x.int() if odd else x)),
        ("more tokens than the maximum",
         dict(x=torch.zeros(big, H, dtype=x.dtype), idx=torch.full((big, K), -1))
         if odd else {}),
        ("x other hidden", dict(x=x[:, :64] if odd else x)),
        ("fp8 on rank 0 only", dict(fp8=not odd)),
        ("mxfp8 against fp8", dict(dispatch_dtype="mxfp8") if odd else dict(fp8=True)),
    ]


def mismatches(rank: int, x, idx, w, big: int):
    """``(what, the call's arguments on this rank)``: the odd ranks differ from the even (a bad
    input there, refused; or options that must agree)."""
    odd = rank % 2 == 1
    return _both_modes(odd, x, idx, big) + [
        ("topk_idx fewer rows", dict(idx=idx[:1] if odd else idx)),
        ("expert_alignment 0", dict(expert_alignment=0 if odd else 1)),
        ("fp8 on rank 0 only, no host read", dict(fp8=not odd, max_recv_rows=64)),
        ("weights on rank 0 only", dict(w=None if odd else w)),
        ("top-k differs", dict(idx=torch.cat([idx, torch.full_like(idx[:, :1], -1)], 1)
                               if odd else idx,
                               w=torch.cat([w, torch.zeros_like(w[:, :1])], 1) if odd else w)),
    ]


COMBINE_ROWS = ("combine y float32", "combine y fewer rows", "combine weights fewer",
                "combine older handle", "combine fp8 on rank 0 only",
                "combine y float32 on rank 1 only", "combine fp8 on rank 1 only")


def combine_arguments(rank: int, what: str, res, old_handle) -> tuple:
    """``(y, handle, weights, kwargs)`` of this rank's normal combine of row ``what`` of
    ``COMBINE_ROWS`` after the correct dispatch ``res``: the odd ranks differ, or rank 1 alone
    (a bad input there, refused; or the partials' format)."""
    y, handle, w, kwargs = res.x, res.handle, res.weights, {}
    if what.endswith("rank 1 only"):
        if rank != 1:
            return y, handle, w, kwargs
        if "fp8" in what:
            return y, handle, w, dict(combine_dtype="fp8")
        return y.float(), handle, w, kwargs
    if rank % 2 == 0:
        return y, handle, w, dict(combine_dtype="fp8") if "fp8" in what else {}
    if what == "combine y float32":
        y = y.float()
    elif what == "combine y fewer rows":
        y = y[:-1]
    elif what == "combine weights fewer":
        w = w[:-1]
    elif what == "combine older handle":
        handle = old_handle
    return y, handle, w, kwargs


def disagreeing_calls(rank: int, world_size: int, ring_slots: int | None = None,
                      in_kernels: bool = False, **buffer_kwargs) -> dict:
    """Each row of :func:`mismatches`, then each of ``COMBINE_ROWS`` after a correct dispatch,
    on this rank's Buffer (``ring_slots``: staging for that many slots per source, a call in
    rounds; ``in_kernels``: the waits in the kernels, as on GPUs; ``buffer_kwargs``: the
    transport): ``{what: (error type, message, seconds)}``; then ``"rounds"`` and
    ``"after"``: a correct dispatch and combine equal the reference."""
    with kernel_waits(in_kernels):
        return _disagreeing_calls(rank, world_size, ring_slots, **buffer_kwargs)


def _disagreeing_calls(rank: int, world_size: int, ring_slots, **buffer_kwargs) -> dict:
    import torch.distributed as dist

    from moe_comm.workspace import staging_slot_bytes

    case, xs, idxs, ws = _inputs(world_size)
    if ring_slots is not None:
        nodes = buffer_kwargs.get("transport") == "nixl"
        hierarchical = nodes and buffer_kwargs.get("hierarchical", True)
        buffer_kwargs["staging_bytes"] = ring_slots * staging_slot_bytes(
            world_size, case.hidden, case.num_experts, torch.bfloat16, outboxes=nodes,
            ranks_per_node=buffer_kwargs["ranks_per_node"] if hierarchical else None,
            rdma=buffer_kwargs.get("transport") == "nvshmem")
    buf = moe_comm.Buffer(dist.group.WORLD, hidden=case.hidden, num_experts=case.num_experts,
                          max_tokens_per_rank=case.max_tokens, max_topk=case.num_experts,
                          **buffer_kwargs)
    found = {"rounds": buf.rounds}
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    with buf:
        buf.dispatch(x, idx, w)  # compiled and warm
        for what, args in mismatches(rank, x, idx, w, buf.max_tokens_per_rank + 1):
            kwargs = {k: v for k, v in args.items() if k not in ("x", "idx", "w")}
            found[what] = _timed(buf.dispatch, args.get("x", x), args.get("idx", idx),
                                 args.get("w", w), **kwargs)
        old = buf.dispatch(x, idx, w).handle
        for what in COMBINE_ROWS:
            y, handle, weights, kwargs = combine_arguments(rank, what, buf.dispatch(x, idx, w),
                                                           old)
            found[what] = _timed(buf.combine, y, handle, weights, **kwargs)
        got = buf.dispatch(x, idx, w)
        want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts)
        out = buf.combine(got.x, got.handle, got.weights)
        sums = reference.combine_all([r.x for r in want], [r.handle for r in want],
                                     [r.weights for r in want])
        found["after"] = torch.equal(got.x, want[rank].x) and torch.equal(out, sums[rank])
    return found


def facade_refusals(rank: int, world_size: int) -> dict:
    """The DeepEP-compatible dispatch, low-latency dispatch and low-latency combine with a bad
    input on the odd ranks, once their workspace exists: ``{what: (error type, message,
    seconds)}``, then ``"after"`` / ``"low-latency after"`` / ``"low-latency combine after"``:
    the same correct call gives what it gave before (the rows, the counts, the sums)."""
    import torch.distributed as dist

    from moe_comm import deep_ep

    case, xs, idxs, ws = _inputs(world_size)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    buf = deep_ep.Buffer(dist.group.WORLD, int(1e9), 0)

    def dispatch(x, idx, w):
        per_rank, rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, case.num_experts)
        return buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=rdma,
                            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                            topk_idx=idx, topk_weights=w)

    odd = rank % 2 == 1
    found = {}
    try:
        first = dispatch(x, idx, w)[0]
        for what, args in (("x int32", (x.int(), idx, w)),
                           ("x 1-d", (x[0], idx, w)),
                           ("topk_idx fewer rows", (x, idx[:1], w[:1]))):
            found[what] = _timed(dispatch, *(args if odd else (x, idx, w)))
        found["after"] = torch.equal(dispatch(x, idx, w)[0], first)
    finally:
        buf.destroy()
    T, E, H = case.max_tokens, case.num_experts, case.hidden
    ll = deep_ep.Buffer(dist.group.WORLD, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(
        T, H, world_size, E), low_latency_mode=True, num_qps_per_rank=E // world_size)
    try:
        first = ll.low_latency_dispatch(x, idx, T, E, use_fp8=False)[1]
        for what, args in (("low-latency x int32", (x.int(), idx)),
                           ("low-latency topk_idx fewer rows", (x, idx[:1]))):
            found[what] = _timed(ll.low_latency_dispatch, *(args if odd else (x, idx)), T, E,
                                 use_fp8=False)
        found["low-latency after"] = torch.equal(
            ll.low_latency_dispatch(x, idx, T, E, use_fp8=False)[1], first)
        for what, out in (("low-latency combine out of another shape",
                           torch.empty(len(idx) + 1, H, dtype=x.dtype) if odd else None),
                          ("low-latency combine fp8 y", None)):
            recv_x, _, handle, _, _ = ll.low_latency_dispatch(x, idx, T, E, use_fp8=False)
            y = recv_x.to(torch.float8_e4m3fn) if odd and out is None else recv_x
            found[what] = _timed(ll.low_latency_combine, y, idx, w, handle, out=out)
        recv_x, _, handle, _, _ = ll.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        combined = ll.low_latency_combine(recv_x, idx, w, handle)[0]
        found["low-latency combine after"] = torch.equal(
            combined, ll.low_latency_combine(recv_x, idx, w, handle)[0])
    finally:
        ll.destroy()
    return found


def low_latency_mismatches(rank: int, x, idx, big: int):
    """``(what, arguments of this rank's low-latency dispatch)``: the odd ranks differ."""
    odd = rank % 2 == 1
    return _both_modes(odd, x, idx, big) + [
        ("stats shape", dict(cumulative_local_expert_recv_stats=torch.zeros(99, dtype=torch.int32))
         if odd else {}),
        ("fp8 on rank 0 only, hooks", dict(fp8=not odd, return_hook=True)),
    ]


def _low_latency_round(buf, x, idx, **kwargs) -> None:
    """A low-latency dispatch, its hook called where it returned one."""
    _, hook = buf.low_latency_dispatch(x, idx, **kwargs)
    if hook is not None:
        hook()


def low_latency_combine_mismatches(rank: int, y, idx, w):
    """``(what, arguments of this rank's low-latency combine)``: the odd ranks differ (a bad
    input there, refused; or the rows' format)."""
    odd = rank % 2 == 1
    return [
        ("combine y float32", dict(y=y.float() if odd else y)),
        ("combine y other hidden", dict(y=y[..., :64] if odd else y)),
        ("combine topk_idx fewer rows", dict(idx=idx[:1] if odd else idx)),
        ("combine fp8 on rank 0 only", dict(combine_dtype=None if odd else "fp8")),
        ("combine fp8 on rank 0 only, hooks", dict(combine_dtype=None if odd else "fp8",
                                                   return_hook=True)),
    ]


def _low_latency_combine_round(buf, y, idx, w, handle, **kwargs) -> None:
    """A low-latency combine, its hook called where it returned one."""
    _, hook = buf.low_latency_combine(y, idx, w, handle, **kwargs)
    if hook is not None:
        hook()


def low_latency_disagreements(rank: int, world_size: int, **buffer_kwargs) -> dict:
    """Each row of :func:`low_latency_mismatches` and of
    :func:`low_latency_combine_mismatches` (each after a correct dispatch) on a low-latency
    Buffer (with hooks: the hook raises): ``{what: (error type, message, seconds)}``; then
    ``"after"``: a correct low-latency dispatch and combine equal the reference."""
    import torch.distributed as dist

    case, xs, idxs, ws = _inputs(world_size)
    buf = moe_comm.Buffer(dist.group.WORLD, hidden=case.hidden, num_experts=case.num_experts,
                          max_tokens_per_rank=case.max_tokens, low_latency=True,
                          **buffer_kwargs)
    x, idx = xs[rank], idxs[rank]
    ys, refs = _all_ys(case, xs, idxs, False, seed=7)
    found = {}
    with buf:
        buf.low_latency_dispatch(x, idx)  # warm
        for what, args in low_latency_mismatches(rank, x, idx, buf.max_tokens_per_rank + 1):
            kwargs = {k: v for k, v in args.items() if k not in ("x", "idx")}
            found[what] = _timed(_low_latency_round, buf, args.get("x", x),
                                 args.get("idx", idx), **kwargs)
        w = ws[rank]
        for what, args in low_latency_combine_mismatches(rank, ys[rank], idx, w):
            recv, _ = buf.low_latency_dispatch(x, idx)
            kwargs = {k: v for k, v in args.items() if k not in ("y", "idx")}
            found[what] = _timed(_low_latency_combine_round, buf, args.get("y", ys[rank]),
                                 args.get("idx", idx), w, recv.handle, **kwargs)
        recv, _ = buf.low_latency_dispatch(x, idx)
        check_recv(rank, case, "after", recv, xs, idxs, False)  # (raises where it differs)
        out, _ = buf.low_latency_combine(ys[rank], idx, w, recv.handle)
        check_out(rank, case, "after", out, (ys, refs), idxs, ws)
        found["after"] = True
    return found
