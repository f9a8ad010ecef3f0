"""With ``MOE_COMM_CHECK_INPUTS=0`` no kernel reaches outside its buffers, whatever the input:
every rank's workspace segment lies between guard bytes, bad inputs go in with the checks off,
and the guards must read as they were written; a correct call afterwards is right."""
import pytest
import torch

import moe_comm
from cases import Case, make_inputs
from moe_comm import reference
from moe_comm.symm import loopback
from moe_comm.testing import lockstep

GUARD, PATTERN = 4096, 0xA5
CASE = Case(2, 8, 128, 2, (5, 3), seed=31)


@pytest.fixture
def guarded(monkeypatch):
    """``(make, intact)``: ``make(**kwargs)`` builds 2 virtual ranks whose segments lie between
    guard bytes; ``intact()`` is whether every guard byte still holds the pattern."""
    blocks = []

    def heaps(world_size, nbytes, device="cpu"):
        segments = []
        for _ in range(world_size):
            block = torch.full((nbytes + 2 * GUARD,), PATTERN, dtype=torch.uint8)
            block[GUARD:GUARD + nbytes] = 0
            blocks.append(block)
            segments.append(block[GUARD:GUARD + nbytes])
        ptrs = torch.tensor([s.data_ptr() for s in segments], dtype=torch.int64)
        return [loopback.LoopbackHeap(r, segments, ptrs) for r in range(world_size)]

    monkeypatch.setattr(moe_comm.buffer, "create_loopback_heaps", heaps)
    monkeypatch.setenv("MOE_COMM_CHECK_INPUTS", "0")

    def make(**kwargs):
        return moe_comm.Buffer.loopback(2, CASE.hidden, CASE.num_experts, CASE.max_tokens,
                                        max_topk=2, **kwargs)

    def intact():
        return all(bool((b[:GUARD] == PATTERN).all() and (b[-GUARD:] == PATTERN).all())
                   for b in blocks)

    return make, intact


def _round_trip_is_right(bufs, xs, idxs, ws):
    got = lockstep.dispatch(bufs, xs, idxs, ws)
    want = reference.dispatch_all(xs, idxs, ws, num_experts=CASE.num_experts)
    for g, w in zip(got, want):
        assert torch.equal(g.x, w.x) and torch.equal(g.tokens_per_expert, w.tokens_per_expert)
    outs = lockstep.combine(bufs, [g.x for g in got], [g.handle for g in got],
                            [g.weights for g in got])
    sums = reference.combine_all([w.x for w in want], [w.handle for w in want],
                                 [w.weights for w in want])
    assert all(torch.equal(o, s) for o, s in zip(outs, sums))


def test_normal_mode_bounds_hold_without_the_checks(guarded):
    make, intact = guarded
    bufs = make()
    xs, idxs, ws = make_inputs(CASE)
    T = CASE.max_tokens
    refused = {  # each changes no byte of any segment
        "more tokens than the maximum": ([torch.randn(T + 1, CASE.hidden).bfloat16()] * 2,
                                         [torch.zeros(T + 1, 2, dtype=torch.int64)] * 2, None),
        "another hidden size": ([torch.randn(3, CASE.hidden + 8).bfloat16()] * 2,
                                [torch.zeros(3, 2, dtype=torch.int64)] * 2, None),
        "more choices than max_topk": (xs, [torch.zeros(len(x), 3, dtype=torch.int64)
                                            for x in xs], None),
        "4-byte ids": (xs, [i.int() for i in idxs], None),
        "8-byte weights": (xs, idxs, [w.double() for w in ws]),
    }
    for what, (x, i, w) in refused.items():
        before = [b.heap.local.clone() for b in bufs]
        with pytest.raises(ValueError):
            lockstep.dispatch(bufs, x, i, w)
        assert all(torch.equal(b.heap.local, s) for b, s in zip(bufs, before)), what
        assert intact(), what
    bad = [i.clone() for i in idxs]
    bad[0][0] = torch.tensor([CASE.num_experts + 3, -7])  # ids out of range: the kernels bound
    bad[1][1] = torch.tensor([1, 1])  # an expert twice
    with pytest.raises(ValueError, match="topk_idx row"):
        lockstep.dispatch(bufs, xs, bad, ws)
    assert intact()
    first = lockstep.dispatch(bufs, xs, idxs, ws)
    lockstep.dispatch(bufs, xs, idxs, ws)  # the first handle is stale now
    stale = [torch.randn(r.x.shape).bfloat16() for r in first]
    lockstep.combine(bufs, stale, [r.handle for r in first], [r.weights for r in first])
    assert intact()
    other = moe_comm.Buffer.loopback(2, CASE.hidden, CASE.num_experts, 4 * T, max_topk=2)
    big = lockstep.dispatch(other, [torch.cat([x] * 4) for x in xs],
                            [torch.cat([i] * 4) for i in idxs])
    with pytest.raises(ValueError, match="handle must be the DispatchResult.handle"):
        lockstep.combine(bufs, [torch.zeros(r.x.shape).bfloat16() for r in big],
                         [r.handle for r in big])
    with pytest.raises(ValueError, match=r"y must be \["):
        lockstep.combine(bufs, [torch.zeros(len(r.x) + 1, CASE.hidden).bfloat16()
                                for r in first], [r.handle for r in first])
    assert intact()
    _round_trip_is_right(bufs, xs, idxs, ws)  # the Buffer goes on working
    assert intact()


def test_low_latency_bounds_hold_without_the_checks(guarded):
    make, intact = guarded
    bufs = make(low_latency=True)
    xs, idxs, _ = make_inputs(CASE)
    T = CASE.max_tokens
    for what, (x, i) in {
            "more tokens than the maximum": ([torch.randn(T + 1, CASE.hidden).bfloat16()] * 2,
                                             [torch.zeros(T + 1, 2, dtype=torch.int64)] * 2),
            "another hidden size": ([torch.randn(3, 64).bfloat16()] * 2,
                                    [torch.zeros(3, 2, dtype=torch.int64)] * 2)}.items():
        before = [b.heap.local.clone() for b in bufs]
        with pytest.raises(ValueError):
            bufs[0].low_latency_dispatch(x[0], i[0])
        assert all(torch.equal(b.heap.local, s) for b, s in zip(bufs, before)), what
    bad = [i.clone() for i in idxs]
    bad[0][0] = torch.tensor([CASE.num_experts + 3, -7])
    with pytest.raises(ValueError, match="topk_idx row"):
        lockstep.low_latency_dispatch(bufs, xs, bad)
    assert intact()
    got = lockstep.low_latency_dispatch(bufs, xs, idxs)
    want = reference.low_latency_dispatch_all(xs, idxs, num_experts=CASE.num_experts,
                                              max_tokens=T, fp8=False)
    for g, w in zip(got, want):
        assert torch.equal(g.count, w.count)
    assert intact()
