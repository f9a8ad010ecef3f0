"""Low-latency mode on virtual ranks and on CPU ranks, against the reference."""
import pytest
import torch

import moe_comm
from cases import Case, make_inputs, names_rank
from ll_jobs import (
    ll_dropped_and_reordered_hooks,
    ll_misuse,
    ll_pipelined_dispatches,
    ll_round_trip,
    ll_skip,
    ll_two_in_flight,
)
from moe_comm import reference
from moe_comm.testing import lockstep

LOOPBACK = [  # (case, fp8, ue8m0, col_major)
    (Case(1, 4, 128, 1, (6,), seed=1), True, False, False),
    (Case(2, 8, 2048, 8, (5, 3), routing="one_expert", seed=2), True, True, False),
    (Case(4, 16, 128, 16, (7, 0, 4, 9), seed=3), False, False, False),
    (Case(4, 32, 256, 8, (8, 8, 2, 6), routing="empty_rank", seed=4), True, False, True),
    (Case(8, 16, 128, 2, (3, 1, 0, 4, 2, 5, 1, 3), routing="zipf", seed=5), True, True, True),
    (Case(2, 4, 7168, 2, (2, 1), seed=6), True, False, False),
]


@pytest.mark.parametrize("case, fp8, ue8m0, col_major", LOOPBACK,
                         ids=[f"{c}-fp8{int(f)}-ue{int(u)}-cm{int(m)}" for c, f, u, m in LOOPBACK])
def test_loopback_matches_reference(case, fp8, ue8m0, col_major):
    R, T = case.world_size, case.max_tokens
    bufs = moe_comm.Buffer.loopback(R, case.hidden, case.num_experts, T, case.dtype,
                                    low_latency=True)
    for it in range(2):
        xs, idxs, ws = make_inputs(case, it)
        got = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=fp8, ue8m0=ue8m0,
                                            col_major_scales=col_major)
        want = reference.low_latency_dispatch_all(xs, idxs, num_experts=case.num_experts,
                                                  max_tokens=T, fp8=fp8, ue8m0=ue8m0,
                                                  col_major_scales=col_major)
        for r in range(R):
            assert torch.equal(got[r].count, want[r].count)
            for e, n in enumerate(want[r].count.tolist()):
                a, b = got[r].x[e, :n], want[r].x[e, :n]
                assert torch.equal(a.view(torch.uint8) if fp8 else a,
                                   b.view(torch.uint8) if fp8 else b), (r, e)
                assert torch.equal(got[r].src_info[e, :n], want[r].src_info[e, :n])
                if fp8:
                    assert torch.equal(got[r].x_scales[e, :n], want[r].x_scales[e, :n])
        ys = [torch.randn(g.x.shape).to(torch.bfloat16) for g in got]
        outs = lockstep.low_latency_combine(bufs, ys, idxs, ws, [g.handle for g in got])
        ref_outs = reference.low_latency_combine_all(ys, idxs, ws, want, T)
        for r in range(R):
            assert torch.equal(outs[r], ref_outs[r]), r
    assert dict(bufs[0].launches) == {"ll_dispatch_send": 2, "ll_dispatch_recv": 2,
                                      "ll_combine_send": 2, "ll_combine_recv": 2}


def test_the_native_dispatch_sends_the_buffers_dtype_unless_a_format_is_asked_for():
    """H = 64 cannot be FP8 (groups of 128): a plain call sends bf16 rows bit for bit; asking
    for FP8 there raises naming the hidden size; ``ue8m0`` alone asks for FP8."""
    case = Case(2, 4, 64, 2, (3, 2), seed=21)
    bufs = moe_comm.Buffer.loopback(2, case.hidden, case.num_experts, case.max_tokens,
                                    low_latency=True)
    xs, idxs, _ = make_inputs(case)
    got = lockstep.low_latency_dispatch(bufs, xs, idxs)
    want = reference.low_latency_dispatch_all(xs, idxs, num_experts=case.num_experts,
                                              max_tokens=case.max_tokens, fp8=False)
    for r in range(2):
        assert got[r].x.dtype == torch.bfloat16 and got[r].x_scales is None
        assert torch.equal(got[r].count, want[r].count)
        for e, n in enumerate(want[r].count.tolist()):
            assert torch.equal(got[r].x[e, :n], want[r].x[e, :n]), (r, e)
    for kwargs in (dict(fp8=True), dict(ue8m0=True)):
        with pytest.raises(ValueError, match="hidden % 128 == 0"):
            bufs[0].low_latency_dispatch(xs[0], idxs[0], **kwargs)


def test_outputs_are_reused_only_when_nothing_refers_to_them():
    """A dispatch writes into the outputs its parity's call before last made, if the caller
    dropped them (no new tensors); outputs, a handle or a view the caller still holds are
    never written again (new ones are made): every held result equals the reference after
    four more calls, and a combine with an old handle is right."""
    case = Case(2, 8, 128, 2, (5, 3), seed=31)
    R, T = case.world_size, case.max_tokens
    bufs = moe_comm.Buffer.loopback(R, case.hidden, case.num_experts, T, low_latency=True)

    def call(it, **kwargs):
        xs, idxs, ws = make_inputs(case, it)
        got = lockstep.low_latency_dispatch(bufs, xs, idxs, **kwargs)
        want = reference.low_latency_dispatch_all(xs, idxs, num_experts=case.num_experts,
                                                  max_tokens=T, fp8=kwargs.get("fp8", False))
        return got, want, (idxs, ws)

    def same(got, want):
        for r in range(R):
            assert torch.equal(got[r].count, want[r].count), r
            for e, n in enumerate(want[r].count.tolist()):
                assert torch.equal(got[r].x[e, :n], want[r].x[e, :n]), (r, e)
                assert torch.equal(got[r].src_info[e, :n], want[r].src_info[e, :n]), (r, e)

    def where(got):
        return [(g.x.data_ptr(), g.handle.layout.data_ptr()) for g in got]

    first, want1, _ = call(0)  # parity 1
    second, want2, routing2 = call(1)  # parity 0
    held = where(first)
    kept_view = ([g.x[0].view(torch.int16).clone() for g in first],  # (bits: rows past the
                 [g.x[0].view(torch.int16) for g in first])  # count are any, NaN too)
    del first  # only a view of each rank's x stays: the storage is still read
    third, want3, _ = call(2)  # parity 1: new outputs (a view of the first call's x is held)
    assert all(a[0] != b[0] and a[1] != b[1] for a, b in zip(where(third), held))
    assert all(torch.equal(a, b) for a, b in zip(*kept_view))
    handle2 = [g.handle for g in second]
    x2 = [g.x for g in second]
    del second  # the handle and x stay
    fourth, want4, _ = call(3)  # parity 0: every output new
    assert all(a[0] != b[0] and a[1] != b[1] for a, b in zip(where(fourth),
                                                             [(x.data_ptr(), h.layout.data_ptr())
                                                              for x, h in zip(x2, handle2)]))
    same(third, want3)
    same(fourth, want4)
    ys = [torch.randn(x.shape).to(torch.bfloat16) for x in x2]
    outs = lockstep.low_latency_combine(bufs, ys, *routing2, handle2)
    ref = reference.low_latency_combine_all(ys, *routing2, want2, T)
    assert all(torch.equal(o, w) for o, w in zip(outs, ref))
    at3, at4 = where(third), where(fourth)
    del kept_view, third, x2, handle2
    fifth, want5, _ = call(4)  # parity 1: the third call's outputs are free again: reused
    assert where(fifth) == at3
    del fourth
    sixth, want6, _ = call(5)  # parity 0: the fourth's, reused
    assert where(sixth) == at4
    same(fifth, want5)
    same(sixth, want6)
    with_fp8, _, _ = call(6, fp8=True)  # another format: outputs of its own
    assert with_fp8[0].x.dtype == torch.float8_e4m3fn


def test_combine_writes_into_the_callers_out():
    """``out=``: the receive writes the sums into the caller's tensor, which the call returns
    (no new output), bit for bit the reference's; an ``out`` of the wrong shape, dtype or
    layout is refused before anything is sent, naming it."""
    case = Case(2, 8, 128, 2, (5, 3), seed=41)
    R, T = case.world_size, case.max_tokens
    bufs = moe_comm.Buffer.loopback(R, case.hidden, case.num_experts, T, low_latency=True)
    xs, idxs, ws = make_inputs(case)
    got = lockstep.low_latency_dispatch(bufs, xs, idxs)
    want = reference.low_latency_dispatch_all(xs, idxs, num_experts=case.num_experts,
                                              max_tokens=T, fp8=False)
    ys = [torch.randn(g.x.shape).to(torch.bfloat16) for g in got]
    outs = [torch.full((idx.shape[0], case.hidden), float("nan"), dtype=torch.bfloat16)
            for idx in idxs]
    sent = [buf.low_latency_combine(y, idx, w, g.handle, return_hook=True, out=o)
            for buf, y, idx, w, g, o in zip(bufs, ys, idxs, ws, got, outs)]
    for _, hook in sent:
        hook()
    ref = reference.low_latency_combine_all(ys, idxs, ws, want, T)
    for r in range(R):
        assert sent[r][0] is outs[r]
        assert torch.equal(outs[r], ref[r]), r
    tokens = idxs[0].shape[0]
    for bad, error, words in (
            (torch.empty(tokens + 1, case.hidden, dtype=torch.bfloat16), ValueError, "out must"),
            (torch.empty(case.hidden, tokens, dtype=torch.bfloat16).t(), ValueError,
             "not contiguous"),
            (torch.empty(tokens, case.hidden, dtype=torch.float32), TypeError, "out")):
        with pytest.raises(error, match=words):
            bufs[0].low_latency_combine(ys[0], idxs[0], ws[0], got[0].handle, out=bad)


def test_loopback_of_no_ranks_raises_value_error():
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        moe_comm.Buffer.loopback(0, 64, 4, 3)


def test_workspace_bytes_formula():
    R, T, H, E, K, b = 4, 128, 7168, 256, 8, 2
    L = E // R
    S = ((max(H * b, H + 4 * H // 128) + 15) // 16) * 16
    formula = 2 * L * R * T * (S + 4) + 2 * T * K * H * b + 8 * (2 * L * R + 6 * R + 8)
    got = moe_comm.Buffer.low_latency_workspace_bytes(R, H, E, T, torch.bfloat16, max_topk=K)
    assert formula <= got <= formula + 7 * 128
    bufs = moe_comm.Buffer.loopback(2, 256, 4, 8, torch.bfloat16, low_latency=True)
    plain = moe_comm.Buffer.loopback(2, 256, 4, 8, torch.bfloat16)
    assert bufs[0].workspace_bytes - plain[0].workspace_bytes == \
        moe_comm.Buffer.low_latency_workspace_bytes(2, 256, 4, 8, torch.bfloat16)


def test_bytes_on_the_link_one_put_per_pair():
    case = Case(2, 8, 256, 4, (12, 5), seed=8)
    bufs = moe_comm.Buffer.loopback(2, 256, 8, 12, torch.bfloat16, low_latency=True)
    xs, idxs, _ = make_inputs(case)
    remote_pairs = int(((idxs[0] >= 4) & (idxs[0] < 8)).sum())
    for fp8, row in ((False, 512), (True, 256 + 8)):
        before = bufs[0].stats()["dispatch_bytes_to_peers"]
        lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=fp8)
        sent = bufs[0].stats()["dispatch_bytes_to_peers"] - before
        assert sent == remote_pairs * (row + 4) + 8 * 4  # + one signal per remote expert


WORLD = [
    (Case(1, 4, 128, 2, (5,), seed=11), True),
    (Case(2, 8, 2048, 8, (6, 2), seed=12), True),
    (Case(4, 16, 128, 16, (9, 0, 5, 7), routing="one_expert", seed=13), False),
    (Case(4, 16, 256, 1, (4, 4, 4, 4), routing="empty_rank", seed=14), True),
]


@pytest.mark.parametrize("case, fp8", WORLD, ids=[f"{c}-fp8{int(f)}" for c, f in WORLD])
def test_ranks_match_reference(ranks, case, fp8):
    stats = ranks(case.world_size).run(ll_round_trip, case, fp8, iterations=2)
    for rank, got in enumerate(stats):  # received rows per local expert, both calls
        L = case.num_experts // case.world_size
        want = [0] * L
        for it in range(2):
            _, idxs, _ = make_inputs(case, it)
            for idx in idxs:
                for e in range(L):
                    want[e] += int((idx == rank * L + e).sum())
        assert got == want


@pytest.mark.slow
def test_eight_ranks_ue8m0_col_major(ranks):
    case = Case(8, 16, 256, 8, (4, 0, 3, 5, 1, 2, 4, 3), routing="zipf", seed=15)
    ranks(8).run(ll_round_trip, case, True, True, True)


@pytest.mark.slow
@pytest.mark.parametrize("in_kernels", [False, True], ids=["host-waits", "kernel-waits"])
def test_two_in_flight_with_stragglers(ranks, in_kernels):
    """With kernel waits also on two programs per kernel (``num_sms=2``): the persistent
    receive and combine-send programs each walk 8 of the 16 (expert, source) blocks, waiting
    inside the loop, and the last of the two acknowledges."""
    ranks(4).run(ll_two_in_flight, Case(4, 16, 256, 4, (6, 3, 8, 5), seed=16),
                 rounds=10 if not in_kernels else 4, straggle_s=0.03, in_kernels=in_kernels,
                 **({"num_sms": 2} if in_kernels else {}))


@pytest.mark.slow
@pytest.mark.parametrize("in_kernels", [False, True], ids=["host-waits", "kernel-waits"])
def test_pipelined_dispatches_wait_for_acknowledgements(ranks, in_kernels):
    ranks(4).run(ll_pipelined_dispatches, Case(4, 8, 128, 2, (5, 5, 5, 5), seed=17), calls=12,
                 straggle_s=0.2, in_kernels=in_kernels)


def test_misuse_raises_clear_errors(ranks):
    for rank, errors in enumerate(ranks(2).run(ll_misuse, Case(2, 8, 128, 2, (5, 3), seed=18))):
        missing = [name for name, text in errors.items() if text is None]
        assert not missing, f"rank {rank}: no error for {missing}"
        assert "were waiting for their hooks on rank" in errors["third_send"]
        assert "Call 1 has now been received" in errors["third_send"], errors["third_send"]
        assert "already called" in errors["hook_twice"]
        assert "call its hook first" in errors["combine_before_receive"]
        assert "low_latency=True" in errors["no_ll_workspace"]


def test_dropped_and_reordered_hooks_give_each_call_its_own_rows(ranks):
    """A hook never called, called late or out of order: every dispatch and combine after it
    (and the late hook itself) matches the reference bit for bit; two dropped hooks make the
    next send raise naming them, and the calls after that are right."""
    for rank, errors in enumerate(ranks(2).run(ll_dropped_and_reordered_hooks,
                                               Case(2, 8, 128, 2, (5, 3), seed=20))):
        assert len(errors) == 1, (rank, errors)
        assert "calls ([11, 12]) were waiting" in errors[0], errors[0]
        assert "Call 11 has now been received" in errors[0], errors[0]


@pytest.mark.parametrize("in_kernels", [False, True], ids=["host-waits", "kernel-waits"])
def test_skipped_call_times_out_naming_the_peer(ranks, in_kernels):
    """The hook of the call that failed raises, naming the skipper; nothing is acknowledged
    (with the wait in the receive kernel: it copies nothing and publishes nothing); the Buffer
    refuses later calls."""
    reports = ranks(4).run(ll_skip, Case(4, 8, 128, 2, (4, 4, 4, 4), seed=19), skipper=1,
                           wait_timeout_s=2.0, in_kernels=in_kernels)
    for rank, report in enumerate(reports):
        assert report["acks"] == [[0] * 4, [0] * 4], report  # no parity acknowledged anywhere
        if rank == 1:
            continue
        assert report["peer"] == 1 and "low-latency dispatch" in report["raised"], report
        assert "timed out" in report["raised"], report
        assert names_rank(report["raised"], 1), report
        assert 2.0 <= report["elapsed_s"] < 7.0
        assert "unusable" in report["later"], report
