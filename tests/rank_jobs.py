"""Jobs that run on every CPU rank of a pool: ``job(rank, world_size, ...)``, module level."""
from __future__ import annotations

import contextlib
import hashlib
import os
import random
import time

import torch
import torch.distributed as dist

import moe_comm
from cases import Case, expert_fn, make_inputs
from moe_comm import reference

FIELDS = ("x", "weights", "src_rank", "src_token", "tokens_per_expert", "expert_offsets")


def _digest(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def new_buffer(case: Case, **kwargs) -> moe_comm.Buffer:
    return moe_comm.Buffer(dist.group.WORLD, hidden=case.hidden, num_experts=case.num_experts,
                           max_tokens_per_rank=case.max_tokens, dtype=case.dtype, **kwargs)


def check_against_oracle(rank, case, it, res, out, xs, idxs, ws, ys_all=None,
                         hierarchical_nodes: int | None = None):
    """``res`` (and ``out``, a combine with the dispatch's weights, unless None) bit for bit
    against the all-ranks reference (``hierarchical_nodes``: sums in node order, as a
    hierarchical Buffer's across nodes of that many ranks)."""
    want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts,
                                  expert_alignment=case.alignment)
    for field in FIELDS:
        a, b = getattr(res, field), getattr(want[rank], field)
        if b is None:
            assert a is None, f"rank {rank}: {field} should be None"
        else:
            assert torch.equal(a, b), f"rank {rank}: {field} differs in iteration {it}"
    if out is None:  # (the dispatch alone)
        return
    ys = [expert_fn(w.x, w.expert_offsets) for w in want]
    ref_out = reference.combine_all(ys, [w.handle for w in want], [w.weights for w in want],
                                    hierarchical_nodes=hierarchical_nodes)
    assert torch.equal(out, ref_out[rank]), f"rank {rank}: combine differs in iteration {it}"


def run_case(rank, world_size, case: Case, iterations: int = 1, straggle_s: float = 0.0,
             distributed_reference: bool = False) -> list[str]:
    """Dispatch + combine ``iterations`` times with new routing each time; checks every result
    against the all-ranks oracle; returns one digest per iteration."""
    assert world_size == case.world_size
    delay = random.Random(1000 * case.seed + rank)
    digests = []
    with new_buffer(case) as buf:
        for it in range(iterations):
            xs, idxs, ws = make_inputs(case, it)
            w = ws[rank] if ws is not None else None
            if straggle_s:
                time.sleep(delay.uniform(0, straggle_s))
            res = buf.dispatch(xs[rank], idxs[rank], w, expert_alignment=case.alignment)
            if straggle_s:
                time.sleep(delay.uniform(0, straggle_s))
            y = expert_fn(res.x, res.expert_offsets)
            out = buf.combine(y, res.handle, weights=res.weights)
            check_against_oracle(rank, case, it, res, out, xs, idxs, ws)
            if distributed_reference:
                ref = reference.dispatch(xs[rank], idxs[rank], w, case.num_experts,
                                         expert_alignment=case.alignment)
                assert torch.equal(ref.x, res.x) and torch.equal(ref.src_token, res.src_token)
                ref_out = reference.combine(y, ref.handle, ref.weights)
                assert torch.equal(ref_out, out), f"rank {rank}: distributed reference differs"
            digests.append(_digest(res.x, res.weights, res.src_rank, res.src_token, out))
    return digests


@contextlib.contextmanager
def kernel_waits(on: bool = True):
    """Buffers built inside wait in their kernels (the GPU protocol, interpreted) when ``on``;
    the pool's processes outlive a job, so the variable is put back."""
    old = os.environ.get("MOE_COMM_WAIT")
    os.environ["MOE_COMM_WAIT"] = "kernel" if on else "host"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MOE_COMM_WAIT")
        else:
            os.environ["MOE_COMM_WAIT"] = old


def with_kernel_waits(rank, world_size, job, *args, **kwargs):
    """``job`` with the waits of the Buffers it builds inside the kernels."""
    with kernel_waits():
        return job(rank, world_size, *args, **kwargs)


def run_case_kernel_waits(rank, world_size, case: Case, iterations: int,
                          straggle_s: float) -> list[str]:
    """:func:`run_case` with the waits inside the kernels."""
    with kernel_waits():
        return run_case(rank, world_size, case, iterations, straggle_s)


def bad_expert_row(rank, world_size, case: Case, bad_rank: int, kind: str) -> dict:
    """Rank ``bad_rank`` dispatches a row 2 with an id out of range (``kind="range"``) or an
    expert twice (``"repeat"``); it raises once the call is complete, the row reaches nobody,
    every other rank gets the reference's result without that row, and the next call works."""
    xs, idxs, ws = make_inputs(case)
    sent = [i.clone() for i in idxs]
    if kind == "range":
        sent[bad_rank][2, 0] = case.num_experts + 3
    else:
        sent[bad_rank][2, 1] = sent[bad_rank][2, 0] = 1
    clean = [i.clone() for i in idxs]
    clean[bad_rank][2] = -1
    report = {"raised": None}
    with new_buffer(case) as buf:
        try:
            res = buf.dispatch(xs[rank], sent[rank], ws[rank])
        except ValueError as error:
            report["raised"] = str(error)
            res = None
        if rank != bad_rank:
            want = reference.dispatch_all(xs, clean, ws, num_experts=case.num_experts)[rank]
            for field in FIELDS:
                assert torch.equal(getattr(res, field), getattr(want, field)), (rank, field)
        xs, idxs, ws = make_inputs(case, 1)  # everyone still in step: a good round
        res = buf.dispatch(xs[rank], idxs[rank], ws[rank])
        out = buf.combine(expert_fn(res.x, res.expert_offsets), res.handle, res.weights)
        check_against_oracle(rank, case, 1, res, out, xs, idxs, ws)
    return report


def gradients(rank, world_size, case: Case, **buffer_kwargs) -> dict:
    """Forward and backward through moe_comm and through the reference give equal gradients
    (``buffer_kwargs``: e.g. nodes and a transport); returns the Buffer's launches."""
    xs, idxs, ws = make_inputs(case)
    g = torch.Generator().manual_seed(7 + rank)
    grad_out = torch.randn((case.tokens[rank], case.hidden), generator=g, dtype=case.dtype)

    def run(dispatch, combine):
        x = xs[rank].clone().requires_grad_()
        w = ws[rank].clone().requires_grad_()
        res = dispatch(x, idxs[rank], w)
        rows = res.x.shape[0]
        scale = torch.linspace(0.5, 1.5, rows, dtype=case.dtype)[:, None]
        y = torch.tanh(res.x) * scale  # gradients reach x through the rows
        y_leaf = (res.x.detach() * 2).requires_grad_()  # and reach a leaf directly
        out = combine(y, res, res.weights) + combine(y_leaf, res, None) * 0.5
        (out * grad_out).sum().backward()
        return x.grad, w.grad, y_leaf.grad, out.detach()

    with new_buffer(case, **buffer_kwargs) as buf:
        ours = run(lambda x, i, w: buf.dispatch(x, i, w, expert_alignment=case.alignment),
                   lambda y, res, w: _combine_latest(buf, y, res, w))
        launches = dict(buf.launches)
    ref = run(lambda x, i, w: reference.dispatch(x, i, w, case.num_experts,
                                                 expert_alignment=case.alignment),
              lambda y, res, w: reference.combine(y, res.handle, w))
    for name, a, b in zip(("x.grad", "topk_weights.grad", "y.grad", "out"), ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"rank {rank}: {name}")
    return launches


def _combine_latest(buf, y, res, weights):
    return buf.combine(y, res.handle, weights=weights)


def record_failure(report: dict, call) -> None:
    """``call()``, and into ``report`` what it raised (``raised``, the ``peer`` named), and how
    long it took (``elapsed_s``)."""
    start = time.monotonic()
    try:
        call()
    except RuntimeError as error:
        report["raised"] = str(error)
        report["peer"] = getattr(error, "peer", None)
    report["elapsed_s"] = time.monotonic() - start


def skip_one_call(rank, world_size, case: Case, skipper: int, wait_timeout_s: float,
                  in_kernels: bool = False) -> dict:
    """``skipper`` does not dispatch; the others must fail within the timeout, naming it
    (``in_kernels``: the bounded wait runs in the wait kernel, as on a GPU)."""
    xs, idxs, ws = make_inputs(case)
    with kernel_waits(in_kernels):
        buf = new_buffer(case, timeout_s=wait_timeout_s)
    report = {"raised": None}
    if rank != skipper:
        record_failure(report, lambda: buf.dispatch(xs[rank], idxs[rank], ws[rank]))
        try:
            buf.dispatch(xs[rank], idxs[rank], ws[rank])
        except RuntimeError as error:
            report["later"] = str(error)
    dist.barrier()
    buf.close()
    return report


def bad_inputs(rank, world_size, case: Case) -> dict:
    """Every rank makes the same bad call (so nobody waits). Types, shapes and sizes raise
    before any kernel; bad expert ids are found by the kernels, the row is sent nowhere, and
    the call raises once complete on every rank. A good call afterwards is still correct."""
    xs, idxs, ws = make_inputs(case)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    E, H, T = case.num_experts, case.hidden, case.max_tokens
    errors = {}
    with new_buffer(case) as buf:
        other = moe_comm.Buffer.loopback(1, H, E, T, case.dtype)[0]
        calls = {
            "dtype": lambda: buf.dispatch(x.float() if case.dtype != torch.float32 else x.half(),
                                          idx, w),
            "shape": lambda: buf.dispatch(x[None], idx, w),
            "hidden": lambda: buf.dispatch(torch.zeros((x.shape[0], H + 1), dtype=case.dtype),
                                           idx, w),
            "too_many_tokens": lambda: buf.dispatch(
                torch.zeros((T + 1, H), dtype=case.dtype),
                torch.zeros((T + 1, case.topk), dtype=torch.int64), None),
            "expert_too_large": lambda: buf.dispatch(x, torch.full_like(idx, E), w),
            "expert_below_minus_one": lambda: buf.dispatch(x, torch.full_like(idx, -2), w),
            "duplicate_expert": lambda: buf.dispatch(x, idx[:, :1].clamp(min=0).repeat(
                1, case.topk), w),
            "idx_dtype": lambda: buf.dispatch(x, idx.int(), w),
            "weights_shape": lambda: buf.dispatch(x, idx, w[:, :1]),
            "alignment": lambda: buf.dispatch(x, idx, w, expert_alignment=0),
            "handle_type": lambda: buf.combine(x, "not a handle"),
        }
        for name, call in calls.items():
            try:
                call()
                errors[name] = None
            except (TypeError, ValueError) as error:
                errors[name] = f"{type(error).__name__}: {error}"
        res = buf.dispatch(x, idx, w)  # nothing above changed any state
        y = expert_fn(res.x, res.expert_offsets)
        for name, call in {
            "y_rows": lambda: buf.combine(y[1:], res.handle, res.weights),
            "y_dtype": lambda: buf.combine(y.double(), res.handle, res.weights),
            "weights_rows": lambda: buf.combine(y, res.handle, res.weights[1:]),
            "other_buffer_handle": lambda: other.combine(
                torch.zeros((res.handle.num_rows, H), dtype=case.dtype), res.handle),
        }.items():
            try:
                call()
                errors[name] = None
            except (TypeError, ValueError) as error:
                errors[name] = f"{type(error).__name__}: {error}"
        out = buf.combine(y, res.handle, weights=res.weights)
        check_against_oracle(rank, case, 0, res, out, xs, idxs, ws)
        stale = res.handle
        res2 = buf.dispatch(x, idx, w)
        try:
            buf.combine(y, stale, res.weights)
            errors["older_handle"] = None
        except ValueError as error:
            errors["older_handle"] = f"ValueError: {error}"
        buf.combine(expert_fn(res2.x, res2.expert_offsets), res2.handle, res2.weights)
    return errors


def construct(rank, world_size, kwargs_by_rank: dict) -> str | None:
    """Builds a Buffer with per-rank arguments; returns the error text or None."""
    kwargs = dict(hidden=64, num_experts=8, max_tokens_per_rank=8, dtype=torch.bfloat16)
    kwargs.update(kwargs_by_rank.get(rank, kwargs_by_rank.get("all", {})))
    try:
        moe_comm.Buffer(dist.group.WORLD, **kwargs).close()
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def count_traffic(rank, world_size, case: Case) -> dict:
    """Bytes and launches of one dispatch and one combine, measured three ways: the kernels'
    own counters, the staging rows that changed on the receiver, and the launch counter."""
    xs, idxs, ws = make_inputs(case)
    L = case.num_experts // world_size
    with new_buffer(case) as buf:
        region = buf.layout["dispatch_rows"]
        buf.heap.local[region.offset:region.offset + region.nbytes].fill_(0xA5)  # sentinel
        dist.barrier()
        stats0, launches0 = buf.stats(), dict(buf.launches)
        res = buf.dispatch(xs[rank], idxs[rank], ws[rank])
        stats1, launches1 = buf.stats(), dict(buf.launches)
        buf.combine(expert_fn(res.x, res.expert_offsets), res.handle, res.weights)
        stats2, launches2 = buf.stats(), dict(buf.launches)
        staged = buf.layout.view(buf.heap, "dispatch_rows")[1]  # call 1 uses parity 1
        written = (staged.view(torch.uint8) != 0xA5).any(dim=-1).sum(dim=-1).tolist()
        dist.barrier()

    def sent(s: int, d: int) -> int:  # tokens of rank s that pick an expert of rank d
        return sum(1 for row in idxs[s].tolist() if any(e >= 0 and e // L == d for e in row))

    return {"stats": [stats0, stats1, stats2], "launches": [launches0, launches1, launches2],
            "written_rows_from": written,
            "sent_to": [sent(rank, d) for d in range(world_size)],
            "received_from": [sent(s, rank) for s in range(world_size)]}


def fp8_case(rank, world_size, case: Case, ue8m0: bool, col_major: bool) -> None:
    """FP8 normal-mode dispatch on CPU ranks against the reference, then combine."""
    xs, idxs, ws = make_inputs(case)
    with new_buffer(case) as buf:
        res = buf.dispatch(xs[rank], idxs[rank], ws[rank], case.alignment, fp8=True,
                           ue8m0=ue8m0, col_major_scales=col_major)
        want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts,
                                      expert_alignment=case.alignment, fp8=True, ue8m0=ue8m0,
                                      col_major_scales=col_major)
        assert torch.equal(res.x.view(torch.uint8), want[rank].x.view(torch.uint8)), rank
        assert torch.equal(res.x_scales, want[rank].x_scales), rank
        scales = [reference.unpack_ue8m0(w.x_scales, case.hidden // 128) if ue8m0
                  else w.x_scales for w in want]
        ys = [reference.dequantize_fp8(w.x, s).to(case.dtype) for w, s in zip(want, scales)]
        out = buf.combine(ys[rank], res.handle, weights=res.weights)
        ref_out = reference.combine_all(ys, [w.handle for w in want], [w.weights for w in want])
        assert torch.equal(out, ref_out[rank]), rank


def launch_mode(rank, world_size) -> tuple:
    """How this rank's kernels would launch (the class of a kernel: ``JITFunction`` compiles,
    ``InterpretedFunction`` interprets), and its group's size."""
    from moe_comm.kernels import dispatch

    return (os.environ.get("TRITON_INTERPRET"), type(dispatch.dispatch_send_kernel).__name__,
            dist.get_world_size())
