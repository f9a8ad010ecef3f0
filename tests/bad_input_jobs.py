"""The native Buffer's public calls with one mistake each: ``table(buf, low)`` lists
``(what, call, error type, text the message must hold)``, run the same way on every rank
(``bad_inputs``), so that no rank waits for another."""
from __future__ import annotations

import torch

import moe_comm
from cases import Case, make_inputs
from moe_comm import reference

CASE = Case(2, 8, 64, 2, (5, 3), seed=71)  # H = 64: FP8 (groups of 128) cannot apply


def _inputs(rank: int, world_size: int):
    case = Case(world_size, CASE.num_experts, CASE.hidden, CASE.topk,
                CASE.tokens[:world_size], seed=CASE.seed)
    xs, idxs, ws = make_inputs(case)
    return case, xs, idxs, ws


def table(buf, ll, x, idx, w, latest, recv, other, other_recv):
    """``buf``: a normal Buffer with ``latest()`` its latest dispatch; ``ll``: a low-latency Buffer
    with ``recv`` its latest received dispatch; ``other`` / ``other_recv``: another normal /
    low-latency Buffer's dispatch result."""
    T, H, K = x.shape[0], x.shape[1], idx.shape[1]
    big = buf.max_tokens_per_rank + 1
    y = torch.zeros_like(latest().x)
    return [
        ("x a list", lambda: buf.dispatch(x.tolist(), idx, w), TypeError, "x must be a"),
        ("x 1-d", lambda: buf.dispatch(x[0], idx, w), ValueError, "x must have 2 dims"),
        ("x int32", lambda: buf.dispatch(x.int(), idx, w), TypeError, "x must be"),
        ("x other hidden", lambda: buf.dispatch(x[:, :32], idx, w), ValueError,
         "x has hidden size 32"),
        ("x more tokens than the maximum",
         lambda: buf.dispatch(torch.zeros(big, H, dtype=x.dtype),
                              torch.zeros(big, K, dtype=torch.int64)), ValueError,
         "max_tokens_per_rank"),
        ("topk_idx float", lambda: buf.dispatch(x, idx.float(), w), TypeError,
         "topk_idx must be"),
        ("topk_idx 1-d", lambda: buf.dispatch(x, idx[:, 0], w), ValueError,
         "topk_idx must have 2 dims"),
        ("topk_idx fewer rows", lambda: buf.dispatch(x, idx[:1], w), ValueError,
         "topk_idx has 1 rows"),
        ("topk_idx more choices than max_topk",
         lambda: buf.dispatch(x, torch.zeros(T, buf.max_topk + 1, dtype=torch.int64)),
         ValueError, "top-k is"),
        ("weights float64", lambda: buf.dispatch(x, idx, w.double()), TypeError,
         "topk_weights must be"),
        ("weights shape", lambda: buf.dispatch(x, idx, w[:, :1]), ValueError,
         "topk_weights has shape"),
        ("expert_alignment 0", lambda: buf.dispatch(x, idx, w, 0), ValueError,
         "expert_alignment must be"),
        ("max_recv_rows -1", lambda: buf.dispatch(x, idx, w, max_recv_rows=-1), ValueError,
         "max_recv_rows must be"),
        ("fp8 where hidden % 128", lambda: buf.dispatch(x, idx, w, fp8=True), ValueError,
         "hidden"),
        ("dispatch_dtype unknown", lambda: buf.dispatch(x, idx, w, dispatch_dtype="int4"),
         ValueError, "dispatch_dtype must be"),
        ("scale_layout unknown", lambda: buf.dispatch(x, idx, w, scale_layout="tiled"),
         ValueError, "scale_layout must be"),
        ("combine y other rows", lambda: buf.combine(y[:-1] if len(y) else
                                                     torch.zeros(1, H, dtype=y.dtype),
                                                     latest().handle, latest().weights),
         ValueError, "y has shape"),
        ("combine y float64", lambda: buf.combine(y.double(), latest().handle, latest().weights),
         TypeError, "y must be"),
        ("combine handle a tuple", lambda: buf.combine(y, (1, 2), latest().weights), TypeError,
         "handle must be"),
        ("combine another Buffer's handle", lambda: buf.combine(y, other.handle, latest().weights),
         ValueError, "another Buffer"),
        ("combine weights shape", lambda: buf.combine(y, latest().handle, torch.zeros(len(y) + 1)),
         ValueError, "weights has"),
        ("combine_dtype unknown", lambda: buf.combine(y, latest().handle, latest().weights,
                                                      combine_dtype="int8"),
         ValueError, "combine_dtype must be"),
        ("renormalize without fault tolerance",
         lambda: buf.combine(y, latest().handle, latest().weights, renormalize=True),
         (ValueError, RuntimeError), "fault_tolerant"),
        ("low-latency x int32", lambda: ll.low_latency_dispatch(x.int(), idx), TypeError,
         "x must be"),
        ("low-latency more tokens than the maximum",
         lambda: ll.low_latency_dispatch(torch.zeros(big, H, dtype=x.dtype),
                                         torch.zeros(big, K, dtype=torch.int64)),
         ValueError, "max_tokens_per_rank"),
        ("low-latency fp8 where hidden % 128", lambda: ll.low_latency_dispatch(x, idx, fp8=True),
         ValueError, "hidden % 128 == 0"),
        ("low-latency stats shape",
         lambda: ll.low_latency_dispatch(
             x, idx, cumulative_local_expert_recv_stats=torch.zeros(99, dtype=torch.int32)),
         ValueError, "cumulative_local_expert_recv_stats must have shape"),
        ("low-latency combine y shape",
         lambda: ll.low_latency_combine(recv.x[:, :1], idx, w, recv.handle), ValueError,
         "y has shape"),
        ("low-latency combine topk shape",
         lambda: ll.low_latency_combine(recv.x, idx[:, :1], w, recv.handle), ValueError,
         "topk_idx has shape"),
        ("low-latency combine out shape",
         lambda: ll.low_latency_combine(recv.x, idx, w, recv.handle,
                                        out=torch.empty(1, H, dtype=x.dtype)), ValueError,
         "out must be a contiguous"),
        ("low-latency combine handle a tuple",
         lambda: ll.low_latency_combine(recv.x, idx, w, (1, 2)), TypeError, "handle must be"),
        ("low-latency combine another Buffer's handle",
         lambda: ll.low_latency_combine(recv.x, idx, w, other_recv.handle), ValueError,
         "another Buffer"),
        ("low-latency on a normal Buffer", lambda: buf.low_latency_dispatch(x, idx),
         RuntimeError, "low_latency=True"),
    ]


def bad_inputs(rank: int, world_size: int, group=None) -> dict:
    """Every row of :func:`table` on this rank's Buffers, then a correct round trip in both
    modes checked against the reference. Returns ``{what: "Type: message"}``, or for a call
    that did not raise what it returned."""
    import torch.distributed as dist

    case, xs, idxs, ws = _inputs(rank, world_size)
    kwargs = dict(hidden=case.hidden, num_experts=case.num_experts,
                  max_tokens_per_rank=case.max_tokens)
    buf = moe_comm.Buffer(group or dist.group.WORLD, **kwargs)
    ll = moe_comm.Buffer(group or dist.group.WORLD, low_latency=True, **kwargs)
    other = moe_comm.Buffer(group or dist.group.WORLD, **kwargs)
    other_ll = moe_comm.Buffer(group or dist.group.WORLD, low_latency=True, **kwargs)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    found = {}
    with buf, ll, other, other_ll:
        res = buf.dispatch(x, idx, w)
        other_res = other.dispatch(x, idx, w)
        recv, _ = ll.low_latency_dispatch(x, idx)
        other_recv, _ = other_ll.low_latency_dispatch(x, idx)
        latest = [res]  # a refused dispatch is a call (on two ranks: the handles before it
        for what, call, kinds, text in table(buf, ll, x, idx, w, lambda: latest[0], recv,
                                             other_res, other_recv):  # are old)
            if what.startswith("combine") and latest[0] is res:
                latest[0] = buf.dispatch(x, idx, w)
            try:
                call()
                found[what] = "returned"
            except kinds as exc:
                found[what] = f"{type(exc).__name__}: {exc}" if text in str(exc) else \
                    f"wrong text {type(exc).__name__}: {exc}"
            except Exception as exc:  # noqa: BLE001 - reported: the wrong kind of error
                found[what] = f"wrong kind {type(exc).__name__}: {exc}"
        got = buf.dispatch(x, idx, w)  # the Buffers go on working, bit for bit
        want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts)
        found["dispatch after"] = torch.equal(got.x, want[rank].x)
        out = buf.combine(got.x, got.handle, got.weights)
        sums = reference.combine_all([r.x for r in want], [r.handle for r in want],
                                     [r.weights for r in want])
        found["combine after"] = torch.equal(out, sums[rank])
        recv, _ = ll.low_latency_dispatch(x, idx)
        lwant = reference.low_latency_dispatch_all(xs, idxs, num_experts=case.num_experts,
                                                   max_tokens=case.max_tokens)[rank]
        found["low-latency after"] = torch.equal(recv.count, lwant.count) and all(
            torch.equal(recv.x[e, :n], lwant.x[e, :n]) for e, n in enumerate(lwant.count.tolist()))
    return found
