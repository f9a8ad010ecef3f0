"""Virtual ranks in one process (``Buffer.loopback``, ``moe_comm.testing.lockstep``) vs the
reference."""
import pytest
import torch

import moe_comm
from cases import Case, expert_fn, make_inputs
from moe_comm import reference
from moe_comm.testing import lockstep

FIELDS = ("x", "weights", "src_rank", "src_token", "tokens_per_expert", "expert_offsets")


def check_case(case: Case, iterations: int = 1, buffers=None):
    R = case.world_size
    buffers = buffers or moe_comm.Buffer.loopback(R, case.hidden, case.num_experts,
                                                 case.max_tokens, case.dtype)
    for it in range(iterations):
        xs, idxs, ws = make_inputs(case, it)
        got = lockstep.dispatch(buffers, xs, idxs, ws, expert_alignment=case.alignment)
        want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts,
                                      expert_alignment=case.alignment)
        for r in range(R):
            for field in FIELDS:
                a, b = getattr(got[r], field), getattr(want[r], field)
                if b is None:
                    assert a is None, (r, field)
                else:
                    assert torch.equal(a, b), f"rank {r} {field} differs in iteration {it}"
        ys = [expert_fn(g.x, g.expert_offsets) for g in got]
        outs = lockstep.combine(buffers, ys, [g.handle for g in got], [g.weights for g in got])
        ref_outs = reference.combine_all(ys, [w.handle for w in want], [w.weights for w in want])
        for r in range(R):
            assert torch.equal(outs[r], ref_outs[r]), f"rank {r} combine differs in iteration {it}"
    return buffers


MATRIX = [
    Case(R, R * f, H, K, tokens, dtype, routing, align, weights=w, seed=i)
    for i, (R, f, H, K, tokens, dtype, routing, align, w) in enumerate([
        (1, 1, 64, 1, (5,), torch.bfloat16, "uniform", 1, True),
        (1, 32, 128, 8, (40,), torch.float32, "zipf", 16, True),
        (2, 1, 64, 1, (7, 0), torch.float16, "uniform", 1, False),
        (2, 4, 96, 2, (33, 12), torch.bfloat16, "one_expert", 16, True),
        (2, 32, 128, 8, (20, 25), torch.float32, "zipf", 1, True),
        (4, 1, 64, 2, (9, 3, 0, 11), torch.bfloat16, "uniform", 1, True),
        (4, 4, 64, 8, (12, 12, 12, 12), torch.float16, "empty_rank", 16, True),
        (4, 4, 64, 2, (10, 6, 8, 1), torch.float32, "all_invalid", 1, True),
        (4, 32, 128, 8, (30, 0, 17, 22), torch.bfloat16, "zipf", 16, False),
        (4, 32, 256, 1, (16, 16, 2, 5), torch.float16, "one_expert", 1, True),
        (8, 4, 64, 8, (6, 0, 3, 9, 1, 4, 7, 2), torch.bfloat16, "uniform", 16, True),
    ])
]


@pytest.mark.parametrize("case", MATRIX, ids=str)
def test_matches_reference(case):
    check_case(case, iterations=2)


def test_hidden_not_a_power_of_two_and_wide():
    check_case(Case(2, 8, 7168, 8, (3, 5), torch.bfloat16, "uniform", seed=3))


def test_results_are_fresh_tensors():
    case = Case(2, 8, 64, 2, (6, 4))
    buffers = moe_comm.Buffer.loopback(2, 64, 8, 6, torch.bfloat16)
    xs, idxs, ws = make_inputs(case)
    first = lockstep.dispatch(buffers, xs, idxs, ws)
    kept = [r.x.clone() for r in first]
    xs2, idxs2, ws2 = make_inputs(case, iteration=1)
    lockstep.dispatch(buffers, xs2, idxs2, ws2)
    for r in range(2):
        assert torch.equal(first[r].x, kept[r]), "a later call overwrote an earlier result"
        assert first[r].x.untyped_storage().data_ptr() != buffers[r].heap.local.data_ptr()


def test_launch_counts():
    case = Case(4, 16, 64, 2, (8, 8, 8, 8))
    buffers = moe_comm.Buffer.loopback(4, 64, 16, 8, torch.bfloat16)
    check_case(case, buffers=buffers)
    # dispatch: layout (count, place), send, received layout, expand; combine: send, reduce
    # (CPU ranks wait on the host: no wait launch)
    assert dict(buffers[0].launches) == {"layout": 2, "dispatch_send": 1, "received_layout": 1,
                                         "dispatch_expand": 1, "combine_send": 1,
                                         "combine_reduce": 1}


def test_workspace_formula():
    R, T, H, E, K, b = 4, 64, 256, 32, 8, 2
    L = E // R
    formula = 2 * R * T * (2 * H * b + 4 * (1 + 3 * K) + 4 * K) + 2 * R * (L + 1) * 4 + 72 * R + 144
    got = moe_comm.Buffer.required_workspace_bytes(R, H, E, T, torch.bfloat16, max_topk=K)
    # each of 13 regions rounded up to 128 bytes, and the two halves of the 5 staged by parity
    assert formula <= got <= formula + (13 + 5) * 128
    assert moe_comm.Buffer.loopback(R, H, E, T, torch.bfloat16, max_topk=K)[0].workspace_bytes \
        == got


def _order_values(n: int) -> torch.Tensor:
    """1, 2**-24, 2**-24, 0, ...: summed in fp32 from the first, the small ones vanish (1 +
    2**-24 rounds to 1); from the last, they add up to 2**-23 first and survive."""
    return torch.tensor([1.0, 2.0 ** -24, 2.0 ** -24] + [0.0] * (n - 3))


def test_home_rank_sums_partials_in_rank_order():
    """Each token picks one expert on each of 4 ranks; rank d's expert rows hold
    ``_order_values(4)[d]``: the documented order 0..R-1 gives exactly 1.0."""
    R, H = 4, 64
    bufs = moe_comm.Buffer.loopback(R, H, R, 3, torch.float32)
    xs = [torch.randn(3, H) for _ in range(R)]
    idxs = [torch.arange(R).repeat(3, 1) for _ in range(R)]
    got = lockstep.dispatch(bufs, xs, idxs)
    ys = [torch.full_like(g.x, float(_order_values(R)[r])) for r, g in enumerate(got)]
    for out in lockstep.combine(bufs, ys, [g.handle for g in got]):
        assert torch.equal(out, torch.ones(3, H)), out[:, 0]


def test_combine_sums_a_ranks_choices_in_choice_order():
    """A token's choices on one rank are summed in order k = 0, 1, ... before the partial goes
    home (the combine send gathers them compacted per slot: a choice order scrambled there
    shows here). Each token picks all 4 experts of its one rank in a shuffled order; the row of
    choice k holds ``_order_values(4)[k]``: choice order gives exactly 1.0."""
    R, E, H, T = 2, 8, 64, 3
    bufs = moe_comm.Buffer.loopback(R, H, E, T, torch.float32, max_topk=4)
    xs = [torch.randn(T, H) for _ in range(R)]
    # token t of rank r picks the experts of rank (r + t) % 2, in an order that is not sorted
    idxs = [torch.stack([torch.tensor([2, 0, 3, 1]) + 4 * ((r + t) % R) for t in range(T)])
            for r in range(R)]
    got = lockstep.dispatch(bufs, xs, idxs)
    ys = []
    for r, g in enumerate(got):
        y = torch.zeros_like(g.x)
        for row in range(g.x.shape[0]):
            e = int(torch.searchsorted(g.expert_offsets[1:], torch.tensor(row), right=True))
            src, t = int(g.src_rank[row]), int(g.src_token[row])
            k = int((idxs[src][t] == r * (E // R) + e).nonzero())
            y[row] = _order_values(4)[k]
        ys.append(y)
    for out in lockstep.combine(bufs, ys, [g.handle for g in got]):
        assert torch.equal(out, torch.ones(T, H)), out[:, 0]


def test_low_latency_combine_sums_in_choice_order():
    """The same for the choices of a token in the low-latency combine: ``out[t] = sum over k =
    0, 1, ... of w[t, k] * y_row(t, k)``, from choice 0."""
    R, H, K = 2, 64, 4
    bufs = moe_comm.Buffer.loopback(R, H, 4 * R, 2, torch.float32, low_latency=True)
    xs = [torch.randn(2, H) for _ in range(R)]
    idxs = [torch.tensor([[0, 4, 5, 1], [6, 2, 3, 7]]) for _ in range(R)]
    ws = [torch.ones(2, K) for _ in range(R)]
    recvs = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=False)
    # y_row(t, k) = _order_values(K)[k]: the expert row of every (token, choice) by its choice
    ys = []
    for r, recv in enumerate(recvs):
        y = torch.zeros_like(recv.x)
        for e in range(recv.x.shape[0]):
            for i in range(int(recv.count[e])):
                src, t = divmod(int(recv.src_info[e, i]), 2)
                k = int((idxs[src][t] == r * 4 + e).nonzero())
                y[e, i] = _order_values(K)[k]
        ys.append(y)
    for out in lockstep.low_latency_combine(bufs, ys, idxs, ws, [g.handle for g in recvs]):
        assert torch.equal(out, torch.ones(2, H)), out[:, 0]
