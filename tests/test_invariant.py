"""The EP-invariant combine (``Buffer(..., ep_invariant=True)``): the same tokens and experts
give the same output bits on 1, 2, 4 and 8 virtual ranks, in rounds, in both modes, whatever the
other tokens of the batch, and equal ``reference.invariant_combine``; the default combine's
bits differ on the same data (so the comparisons can fail)."""
import pytest
import torch
from invariant_jobs import (
    E,
    H,
    K,
    N,
    bytes_across_nodes,
    data,
    expert,
    experts_of,
    low_latency_across_nodes,
    train_calls,
)

from moe_comm import Buffer
from moe_comm.reference import invariant_combine
from moe_comm.testing import lockstep
from moe_comm.workspace import staging_slot_bytes
from rank_jobs import kernel_waits, with_kernel_waits


def want(x, idx, w, dtype=torch.bfloat16):
    rows = torch.stack([expert(x, idx[:, k].clamp(min=0)) for k in range(K)], 1)
    return invariant_combine(rows, idx, w, dtype=dtype)


def run_normal(R: int, x, idx, w, *, invariant=True, staging_bytes=None, calls=1,
               dtype=torch.bfloat16):
    """Dispatch, experts, combine on R virtual ranks (rank r: tokens ``r * N/R ...``); the
    outputs in global token order, and the Buffers."""
    bufs = Buffer.loopback(R, H, E, N // R, dtype, max_topk=K, ep_invariant=invariant,
                           staging_bytes=staging_bytes)
    for _ in range(calls):  # repeated calls: both parities
        outs = run_calls(bufs, x, idx, w)
    return torch.cat(outs), bufs


def run_calls(bufs, x, idx, w) -> list:
    """One dispatch and combine on the virtual ranks ``bufs``: each rank's output."""
    R = len(bufs)
    res = lockstep.dispatch(bufs, list(x.chunk(R)), list(idx.chunk(R)), list(w.chunk(R)))
    ys = [expert(rr.x, experts_of(rr, r, E // R)) for r, rr in enumerate(res)]
    return lockstep.combine(bufs, ys, [rr.handle for rr in res], [rr.weights for rr in res])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_same_bits_on_1_2_4_8_ranks_and_the_default_combine_differs():
    x, idx, w = data()
    expected = want(x, idx, w)
    default_differs = []
    for R in (1, 2, 4, 8):
        out, bufs = run_normal(R, x, idx, w, calls=2)
        assert same_bits(out, expected), R
        assert bufs[0].ep_invariant and bufs[0].layout.rounds == 1
        plain, _ = run_normal(R, x, idx, w, invariant=False)
        default_differs.append(not same_bits(plain, expected))
    assert default_differs[1:] == [True, True, True], default_differs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_other_dtypes(dtype):
    x, idx, w = data(1, dtype)
    expected = want(x, idx, w, dtype)
    for R in (2, 8):
        assert same_bits(run_normal(R, x, idx, w, dtype=dtype)[0], expected), R


def test_rounds_of_a_small_staging_give_the_same_bits():
    """Rings of two slots per source (8 rounds a call on 2 ranks) and of four (2 rounds on 4
    ranks), two calls each (both parities)."""
    x, idx, w = data(2)
    expected = want(x, idx, w)
    for R, slots in ((2, 2), (4, 4)):
        per_slot = staging_slot_bytes(R, H, K, torch.bfloat16, invariant=True)
        out, bufs = run_normal(R, x, idx, w, staging_bytes=slots * per_slot, calls=2)
        assert bufs[0].layout.ring_slots == slots and bufs[0].layout.rounds == N // R // slots
        assert same_bits(out, expected), R


def test_a_token_s_bits_do_not_depend_on_the_rest_of_the_batch():
    """Token t keeps its row and choices; the other tokens change (rows, routes, and where t
    sits): its output bits stay."""
    x, idx, w = data(3)
    x2, idx2, w2 = data(4)
    keep = torch.tensor([0, 7, 12, 30])
    moved = torch.tensor([9, 1, 25, 14])  # where the kept tokens sit in the second batch
    x2[moved], idx2[moved], w2[moved] = x[keep], idx[keep], w[keep]
    first, _ = run_normal(4, x, idx, w)
    second, _ = run_normal(2, x2, idx2, w2)
    assert same_bits(first[keep], second[moved])


def test_skew_empty_ranks_and_rows_that_go_nowhere():
    x, _, w = data(5)
    gen = torch.Generator().manual_seed(5)
    others = torch.stack([torch.randperm(E - 1, generator=gen)[:K - 1] + 1 for _ in range(N)])
    idx = torch.cat([torch.zeros((N, 1), dtype=torch.long), others], 1)  # all pick expert 0
    idx[N // 2:] = -1  # the last ranks send nothing
    idx[: N // 4, 1:] = torch.tensor([1, 2, 3])  # experts of rank 0 (and 1 at EP 8) only
    expected = want(x, idx, w)
    for R in (1, 4, 8):
        assert same_bits(run_normal(R, x, idx, w, calls=2)[0], expected), R


def test_low_latency_mode_gives_the_normal_mode_s_bits():
    x, idx, w = data(6)
    expected = want(x, idx, w)
    for R in (2, 4):
        T = N // R
        bufs = Buffer.loopback(R, H, E, T, torch.bfloat16, max_topk=K, low_latency=True,
                               ep_invariant=True)
        xs, idxs, ws = list(x.chunk(R)), list(idx.chunk(R)), list(w.chunk(R))
        for _ in range(2):
            recv = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=False)
            ys = []
            for r, got in enumerate(recv):
                L = E // R
                e = torch.arange(r * L, (r + 1) * L)[:, None].expand(L, R * T).reshape(-1)
                ys.append(expert(got.x.reshape(L * R * T, H), e).view(L, R * T, H))
            outs = lockstep.low_latency_combine(bufs, ys, idxs, ws, [g.handle for g in recv])
        assert same_bits(torch.cat(outs), expected), R


def test_values_per_choice_come_home_exactly_and_the_sum_is_invariant():
    """The dispatch's backward: row gradients summed per token in choice order (no weights),
    and one value per (token, choice) returned as it was."""
    x, idx, w = data(7)
    for R in (2, 8):
        bufs = Buffer.loopback(R, H, E, N // R, torch.bfloat16, max_topk=K, ep_invariant=True)
        res = lockstep.dispatch(bufs, list(x.chunk(R)), list(idx.chunk(R)), list(w.chunk(R)))
        ys = [expert(rr.x, experts_of(rr, r, E // R)) for r, rr in enumerate(res)]
        values = [rr.weights * 3 - 1 for rr in res]  # any float per row
        got = lockstep.combine_with_pairs(bufs, ys, [rr.handle for rr in res], values)
        out = torch.cat([o for o, _ in got])
        pairs = torch.cat([p for _, p in got])
        rows = torch.stack([expert(x, idx[:, k].clamp(min=0)) for k in range(K)], 1)
        assert same_bits(out, invariant_combine(rows, idx, None, dtype=torch.bfloat16)), R
        assert torch.equal(pairs, torch.where(idx >= 0, w * 3 - 1, 0.0)), R


def test_bad_options_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="ep_invariant must be a bool"):
        Buffer.loopback(2, H, E, 8, max_topk=K, ep_invariant=1)
    bufs = Buffer.loopback(2, H, E, 8, max_topk=K, ep_invariant=True)
    x, idx, w = data()
    res = lockstep.dispatch(bufs, list(x[:16].chunk(2)), list(idx[:16].chunk(2)),
                            list(w[:16].chunk(2)))
    with pytest.raises(ValueError, match="EP-invariant Buffer's combine returns the rows"):
        lockstep.combine(bufs, [rr.x for rr in res], [rr.handle for rr in res],
                         combine_dtype="fp8")
    with pytest.raises(ValueError, match="through the proxy"):
        Buffer.required_workspace_bytes(4, H, E, 8, max_topk=K, ranks_per_node=2,
                                        transport="nvshmem", ep_invariant=True)
    one = Buffer.required_workspace_bytes(4, H, E, 8, max_topk=K)
    more = Buffer.required_workspace_bytes(4, H, E, 8, max_topk=K, ep_invariant=True)
    assert more - one >= 2 * 8 * K * (2 * H + 8)  # inv_rows and inv_meta, both parities
    flat = Buffer.required_workspace_bytes(4, H, E, 8, max_topk=K, ranks_per_node=2,
                                           hierarchical=False)
    flat_more = Buffer.required_workspace_bytes(4, H, E, 8, max_topk=K, ranks_per_node=2,
                                                ep_invariant=True)  # flat: its default
    assert flat_more - flat >= 2 * 8 * K * (2 * H + 8) * (1 + 4)  # and an outbox per rank


def test_bytes_stored_are_one_row_and_two_floats_per_pair():
    x, idx, w = data(8)
    R = 4
    _, bufs = run_normal(R, x, idx, w)
    L, T = E // R, N // R
    for r, buf in enumerate(bufs):
        stats = buf.stats()
        ranks = idx // L  # choices held by each rank, counted where they go home from
        mine = (idx >= 0) & (ranks == r)
        home = torch.arange(N) // T
        to_self = int((mine & (home[:, None] == r)).sum())
        to_peers = int(mine.sum()) - to_self
        row = 2 * H + 8
        assert stats["combine_bytes_to_self"] == to_self * row + 8, r
        assert stats["combine_bytes_to_peers"] == to_peers * row + 8 * (R - 1), r


def _by_call(per_rank: list) -> list:
    """Every rank's (out, grad x, grad w) of each call, in global token order."""
    return [tuple(torch.cat([calls[i][j] for calls in per_rank]) for j in range(3))
            for i in range(len(per_rank[0]))]


def test_processes_with_stragglers_train_to_the_same_bits_at_every_ep_size(ranks):
    """CPU ranks in processes, forward and backward, calls with random delays: the outputs and
    the gradients of the tokens and of the gate weights have the same bits on 1, 2 and 4 ranks,
    with waits on the host and in the kernels, fault tolerant or not, and across nodes through
    the proxy, flat and hierarchical. Three calls (a fast rank reuses a staging parity its
    peers may still read) on one node and on 2x2 flat nodes; 4x2 hierarchical nodes run two
    (both parities). The invariant combine is the same code flat and hierarchical (no
    forwarder takes part: every row straight home), so 2x2 flat covers the flat dispatch and
    that combine's outboxes with stragglers, and 4x2 hierarchical the forwarders' dispatch over
    more than two nodes in an EP-invariant workspace and the combine to three other nodes
    (flat 4x2 and hierarchical 2x2 add no path: tests/test_internode.py runs both modes on 2x2
    and 4x2 for the default combine)."""
    runs = {R: _by_call(ranks(R).run(train_calls, 3, 0.02)) for R in (1, 2, 4)}
    runs["kernel waits"] = _by_call(ranks(4).run(with_kernel_waits, train_calls, 3, 0.02))
    runs["fault tolerant"] = _by_call(ranks(2).run(train_calls, 3, 0.0, fault_tolerant=True))
    for m, n, hierarchical, calls in ((2, 2, False, 3), (4, 2, True, 2)):
        runs[f"{m}x{n} nodes, hierarchical={hierarchical}"] = _by_call(ranks(m * n).run(
            train_calls, calls, 0.02, ranks_per_node=n, transport="nixl",
            hierarchical=hierarchical))
    counts = {name: len(calls) for name, calls in runs.items()}
    assert counts == {**dict.fromkeys(runs, 3), "4x2 nodes, hierarchical=True": 2}, counts
    for it, (out, grad_x, grad_w) in enumerate(runs[1]):
        x, idx, w = data(100 + it)
        assert same_bits(out, want(x, idx, w)), it
        for name, calls in runs.items():
            if it < len(calls):
                assert all(same_bits(a, b) for a, b in zip(calls[it], (out, grad_x, grad_w))), \
                    (name, it)
        assert grad_w.abs().sum() > 0 and grad_x.abs().sum() > 0


@pytest.mark.parametrize("nodes", [(2, 2), (4, 2)], ids=["2x2", "4x2"])
def test_low_latency_across_nodes_gives_the_same_bits(ranks, nodes):
    """Nodes of CPU ranks through the proxy (2 of 2 ranks, 4 of 2): the low-latency combine of
    an EP-invariant Buffer gives the one-process reference's bits (those of the normal mode on
    one node)."""
    m, n = nodes
    per_rank = ranks(m * n).run(low_latency_across_nodes, n, 2)
    for it in range(2):
        x, idx, w = data(200 + it)
        assert same_bits(torch.cat([calls[it] for calls in per_rank]), want(x, idx, w)), it


@pytest.mark.parametrize("in_kernels", [False, True], ids=["host_waits", "kernel_waits"])
def test_a_rank_excluded_after_the_dispatch_is_left_out_of_the_sum(in_kernels):
    """Fault tolerance: calls 0 and 1 fill both parities; in call 2 rank 3 gets its rows, is
    then excluded and sends nothing back. The others' sums leave its choices out (their slots
    hold garbage: NaN in every byte) and equal the reference over the choices that count; so
    do a combine's with values per row (the dispatch's backward), and its values of rank 3's
    choices are 0."""
    R, dead = 4, 3
    with kernel_waits(in_kernels):
        bufs = Buffer.loopback(R, H, E, N // R, torch.bfloat16, max_topk=K, ep_invariant=True,
                               fault_tolerant=True, timeout_s=30.0)
    engines = [buf.normal_engine for buf in bufs]
    for it in range(2):
        run_calls(bufs, *data(300 + it))
    x, idx, w = data(302)
    res = lockstep.dispatch(bufs, list(x.chunk(R)), list(idx.chunk(R)), list(w.chunk(R)))
    bufs[0].mask_rank(dead)
    live = [r for r in range(R) if r != dead]
    for r in live:
        bufs[r].layout.view(bufs[r].heap, "inv_rows").view(torch.uint8).fill_(0xFF)
    pending = {r: engines[r].combine_send(expert(res[r].x, experts_of(res[r], r, E // R)),
                                          res[r].weights, None, res[r].handle.slot_rows,
                                          res[r].handle.recv_slot_offsets,
                                          src_token=res[r].handle.src_token) for r in live}
    counts = (idx >= 0) & (idx // (E // R) != dead)
    rows = torch.stack([expert(x, idx[:, k].clamp(min=0)) for k in range(K)], 1)
    expected = invariant_combine(rows, idx, w, counts=counts).chunk(R)
    for r in live:
        out, _ = engines[r].combine_recv(pending[r], res[r].handle.slot_of, want_pair=False,
                                         topk_idx=res[r].handle.topk_idx)
        assert same_bits(out, expected[r]), r
    for r in live:
        bufs[r].layout.view(bufs[r].heap, "inv_rows").view(torch.uint8).fill_(0xFF)
    pending = {r: engines[r].combine_send(expert(res[r].x, experts_of(res[r], r, E // R)), None,
                                          res[r].weights * 3 - 1, res[r].handle.slot_rows,
                                          res[r].handle.recv_slot_offsets,
                                          src_token=res[r].handle.src_token) for r in live}
    sums = invariant_combine(rows, idx, None, counts=counts).chunk(R)
    values = torch.where(counts, w * 3 - 1, 0.0).chunk(R)
    for r in live:
        out, pairs = engines[r].combine_recv(pending[r], res[r].handle.slot_of, want_pair=True,
                                             topk_idx=res[r].handle.topk_idx)
        assert same_bits(out, sums[r]) and torch.equal(pairs, values[r]), r


def test_across_nodes_the_transport_moves_one_row_and_two_floats_per_remote_pair(ranks):
    """Flat through the proxy (the default of an EP-invariant Buffer across nodes): the combine
    bytes the transport was asked to move are exactly a row and 8 bytes per pair whose home is
    on another node."""
    reports = ranks(4).run(bytes_across_nodes, 2)
    for rank, rep in enumerate(reports):
        assert not rep["hierarchical"]
        assert rep["moved"] == rep["want"] > 0, (rank, rep)
