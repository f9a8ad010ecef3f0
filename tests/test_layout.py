"""The routing layout (two launches over token chunks) and the received layout, each against a
plain-PyTorch statement of what it computes, on adversarial ids: bad rows (ids out of range, an
expert twice), all -1 rows, one expert for every token, empty ranks, chunks that do not fill,
the GPU's 16-token chunks as well as the interpreter's 64, and the fault-tolerance mask; and
the ring positions of a call in rounds (bounded staging)."""
import pytest
import torch

from moe_comm.error_record import ErrorRecord
from moe_comm.kernels.comm import Flavour
from moe_comm.kernels.dispatch import received_layout
from moe_comm.kernels.layout import ring_positions, routing_layout


def layout_reference(idx: torch.Tensor, R: int, L: int, excluded=()):
    """``(slot_of, pair_pos, counts, first bad row or None)`` as kernels/layout.py states it."""
    T, K = idx.shape
    E = R * L
    bad = ((idx < -1) | (idx >= E)).any(1)
    for t in range(T):
        ids = [int(e) for e in idx[t] if e >= 0]
        bad[t] |= len(ids) != len(set(ids))
    idx = torch.where(bad[:, None], -1, idx)
    for r in excluded:
        idx = torch.where((idx >= 0) & (idx // L == r), -1, idx)
    dest = torch.where(idx >= 0, idx // L, -1)
    slot_of = torch.full((T, R), -1, dtype=torch.int32)
    counts = torch.zeros((R, L + 1), dtype=torch.int32)
    for d in range(R):
        goes = (dest == d).any(1)
        slot_of[:, d] = torch.where(goes, goes.to(torch.int32).cumsum(0) - 1, -1)
        counts[d, L] = goes.sum()
        counts[d, :L] = torch.bincount(idx[dest == d] - d * L, minlength=L)
    pair_pos = torch.full((T, K), -1, dtype=torch.int32)
    seen: dict[int, int] = {}
    for t in range(T):
        for k in range(K):
            e = int(idx[t, k])
            if e >= 0:
                pair_pos[t, k] = seen.get(e, 0)
        for e in idx[t].tolist():
            if e >= 0:
                seen[e] = seen.get(e, 0) + 1
    first = int(bad.nonzero()[0]) if bad.any() else None
    return slot_of, pair_pos, counts, first


def _ids(T, R, L, K, routing, seed):
    g = torch.Generator().manual_seed(seed)
    E = R * L
    if T == 0:
        return torch.empty((0, K), dtype=torch.int64)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if routing == "one_expert":
        idx[:, 0] = 0
        idx[:, 1:] = torch.where(idx[:, 1:] == 0, E - 1, idx[:, 1:])
    if routing == "empty_rank":  # nobody picks the last rank's experts
        idx = torch.where(idx >= E - L, -1, idx)
    if routing == "all_invalid":
        idx[:] = -1
    if routing == "bad" and T > 6:
        idx[T // 3, 0] = E + 5  # out of range
        idx[T // 2, 1] = idx[T // 2, 0]  # an expert twice
        idx[5] = -1
        idx[T - 1, 0] = -2
    return idx


CASES = [(0, 2, 4, 2, "uniform"), (1, 4, 2, 2, "uniform"), (17, 2, 4, 3, "bad"),
         (200, 4, 8, 8, "bad"), (300, 8, 4, 4, "one_expert"), (130, 3, 5, 2, "empty_rank"),
         (70, 4, 4, 4, "all_invalid"), (64, 8, 32, 8, "uniform")]


@pytest.mark.parametrize("gpu_chunks", [False, True], ids=["chunks64", "chunks16"])
@pytest.mark.parametrize("T, R, L, K, routing", CASES)
def test_routing_layout_matches_its_statement(T, R, L, K, routing, gpu_chunks):
    idx = _ids(T, R, L, K, routing, seed=T + R)
    record = ErrorRecord(torch.device("cpu"))
    # the GPU flavour's tiles (16-token chunks) run under the interpreter too
    flavour = Flavour(errors_addr=record.address, compiled=gpu_chunks)
    slot_of, pair_pos, counts = routing_layout(idx, R, L, flavour)
    want_slot, want_pos, want_counts, first = layout_reference(idx, R, L)
    assert torch.equal(slot_of, want_slot)
    assert torch.equal(pair_pos, want_pos)
    assert torch.equal(counts, want_counts)
    words = record.tensor.tolist()
    if first is None:
        assert words[4] == 0, words
    else:  # the first bad row of all chunks, whichever chunk's program ran first
        assert words[4] == 1 and words[6] == first, (words, first)


def ring_reference(slot_of: torch.Tensor, counts: torch.Tensor, W: int, rounds: int):
    """``(ring [T, R], per-round counts [rounds, R, C])`` of a call in rounds of ``W`` tokens:
    a token's slot less its rank's slots of the earlier rounds; each round publishes the call's
    counts with its own rows per rank in the last column."""
    T, R = slot_of.shape
    hits = torch.zeros((rounds * W, R), dtype=torch.int32)
    hits[:T] = slot_of >= 0
    rows = hits.view(rounds, W, R).sum(1, dtype=torch.int32)
    first = rows.cumsum(0, dtype=torch.int32) - rows
    ring = torch.where(slot_of >= 0, slot_of - first[torch.arange(T) // W], -1).to(torch.int32)
    per_round = counts.expand(rounds, *counts.shape).clone()
    per_round[:, :, -1] = rows
    return ring, per_round


def node_ring_reference(slot_of: torch.Tensor, N: int, W: int, rounds: int):
    """``(node_ring [T, M], node_counts [rounds, M])``, token by token: the row of token t in
    node b's message of its round (the tokens of the window before it that go to some rank of
    node b), -1 where t goes to none; and the rows of each round's message to node b."""
    T, R = slot_of.shape
    M = R // N
    node_ring = torch.full((T, M), -1, dtype=torch.int32)
    node_counts = torch.zeros((rounds, M), dtype=torch.int32)
    for t in range(T):
        for b in range(M):
            if bool((slot_of[t, b * N:(b + 1) * N] >= 0).any()):
                node_ring[t, b] = node_counts[t // W, b]
                node_counts[t // W, b] += 1
    return node_ring, node_counts


@pytest.mark.parametrize("gpu_tiles", [False, True], ids=["tiles64", "tiles256"])
@pytest.mark.parametrize("T, R, L, K, routing, W", [
    (0, 2, 4, 2, "uniform", 1), (1, 4, 2, 2, "uniform", 1), (17, 2, 4, 3, "bad", 2),
    (200, 4, 8, 8, "bad", 3), (300, 8, 4, 4, "one_expert", 64), (130, 3, 5, 2, "empty_rank", 16),
    (70, 4, 4, 4, "all_invalid", 7), (600, 8, 32, 8, "uniform", 272)])
def test_ring_positions_match_their_statement(T, R, L, K, routing, W, gpu_tiles):
    """Rounds of one token, of a few, of more than a tile and of a tile that ends past the
    last token; the layout of adversarial ids gives the slots and counts."""
    idx = _ids(T, R, L, K, routing, seed=T + W)
    flavour = Flavour(errors_addr=ErrorRecord(torch.device("cpu")).address, compiled=gpu_tiles)
    slot_of, _, counts = routing_layout(idx, R, L, flavour)
    rounds = max(1, -(-T // W))
    ring, words = ring_positions(slot_of, counts, W, rounds, flavour)
    want_ring, want_rounds = ring_reference(slot_of, counts, W, rounds)
    C = counts.shape[1]
    assert words.shape == (rounds, -(-R * C // 4) * 4)
    assert torch.equal(ring, want_ring)
    assert torch.equal(words[:, :R * C].view(rounds, R, C), want_rounds)
    for N in (n for n in range(1, R) if R % n == 0):  # hierarchical: nodes of N ranks, same launch
        *same, node_ring, node_counts = ring_positions(slot_of, counts, W, rounds, flavour,
                                                      ranks_per_node=N)
        assert torch.equal(same[0], want_ring)
        assert torch.equal(same[1][:, :R * C], words[:, :R * C])
        want_node_ring, want_node_counts = node_ring_reference(slot_of, N, W, rounds)
        assert torch.equal(node_ring, want_node_ring), N
        assert torch.equal(node_counts, want_node_counts), N


@pytest.mark.parametrize("excluded, me", [((1,), 0), ((0, 3), 2), ((2,), 2)])
def test_routing_layout_leaves_out_excluded_ranks(excluded, me):
    """Fault tolerance: nothing goes to an excluded rank; once this rank is excluded itself,
    nothing goes anywhere (the fence against its late writes)."""
    R, L, K, T = 4, 4, 4, 90
    idx = _ids(T, R, L, K, "uniform", seed=5)
    mask = torch.zeros(R, dtype=torch.int64)
    mask[list(excluded)] = 1
    flavour = Flavour(errors_addr=ErrorRecord(torch.device("cpu")).address, compiled=True,
                      fault_tolerant=True, local_base=mask.data_ptr(), mask_off=0)
    slot_of, pair_pos, counts = routing_layout(idx, R, L, flavour, me)
    gone = tuple(range(R)) if me in excluded else excluded
    want_slot, want_pos, want_counts, _ = layout_reference(idx, R, L, gone)
    assert torch.equal(slot_of, want_slot) and torch.equal(counts, want_counts)
    assert torch.equal(pair_pos, want_pos)


def _received_reference(counts, alignment, live):
    per_source = counts[:, :-1].to(torch.int64) * live[:, None]
    slots = counts[:, -1].to(torch.int64) * live
    tokens_per_expert = per_source.sum(0)
    padded = (tokens_per_expert + alignment - 1) // alignment * alignment
    expert_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), padded.cumsum(0)])
    row_base = expert_offsets[:-1][None, :] + per_source.cumsum(0) - per_source
    slot_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), slots.cumsum(0)])
    return row_base, tokens_per_expert, expert_offsets, slot_offsets


@pytest.mark.parametrize("R, L, alignment", [(1, 1, 1), (4, 8, 16), (8, 3, 1), (5, 32, 128)])
@pytest.mark.parametrize("epoch", [5, 6])  # both parities
@pytest.mark.parametrize("live", [False, True])
def test_received_layout_matches_its_statement(R, L, alignment, epoch, live):
    g = torch.Generator().manual_seed(R * L + epoch)
    both = torch.randint(0, 50, (2, R, L + 1), generator=g, dtype=torch.int32)
    both[:, :, L] = both[:, :, :L].sum(-1) // 2  # slots: fewer than pairs
    epochs = torch.tensor([epoch])
    arrived = (torch.rand(R, generator=g) < 0.6).to(torch.int32) if live else None
    got = received_layout(both, torch.zeros(R, dtype=torch.int64), epochs, arrived,
                          world_size=R, num_local_experts=L, alignment=alignment, wait=False)
    keep = arrived.to(torch.int64) if live else torch.ones(R, dtype=torch.int64)
    for a, b in zip(got, _received_reference(both[epoch % 2], alignment, keep)):
        assert torch.equal(a, b)


def test_received_layout_waits_for_every_source_and_a_timeout_counts_nothing():
    """With the wait fused (GPUs; here in the interpreter): every source arrived, the layout
    is the counts'; one source behind at the deadline: the timeout names it and every count
    is zero (nothing is read from staging that a late source may still write)."""
    R, L = 4, 2
    counts = torch.randint(1, 9, (2, R, L + 1), dtype=torch.int32)
    record = ErrorRecord(torch.device("cpu"))
    flavour = Flavour(device_wait=True, errors_addr=record.address, timeout_ns=50_000_000)
    signals = torch.tensor([7, 8, 7, 9])
    got = received_layout(counts, signals, torch.tensor([7]), None, world_size=R,
                          num_local_experts=L, alignment=1, wait=True, flavour=flavour)
    assert torch.equal(got[1], counts[1, :, :L].sum(0).to(torch.int64))
    assert record.tensor[0] == 0
    signals[2] = 6  # rank 2 did not publish call 7
    got = received_layout(counts, signals, torch.tensor([7]), None, world_size=R,
                          num_local_experts=L, alignment=1, wait=True, flavour=flavour)
    assert record.tensor[:4].tolist() == [1, 2, 7, 6]  # flag, peer, expected, observed
    assert not any(t.any() for t in got)


def test_a_fault_tolerant_received_layout_excludes_the_silent_source():
    """The fault-tolerant wait fused into the received layout: a source still silent at the
    deadline is excluded on every rank (its mask word := this rank + 1, through the peer
    pointers) and counts zero; the others count; a rank that finds itself excluded counts
    nothing and records a timeout naming itself."""
    R, L, me = 3, 2, 1
    masks = [torch.zeros(R, dtype=torch.int64) for _ in range(R)]  # every rank's mask words
    peer_ptrs = torch.tensor([m.data_ptr() for m in masks])
    counts = torch.randint(1, 9, (2, R, L + 1), dtype=torch.int32)
    record = ErrorRecord(torch.device("cpu"))
    flavour = Flavour(device_wait=True, errors_addr=record.address, timeout_ns=50_000_000,
                      fault_tolerant=True, local_base=masks[me].data_ptr(), mask_off=0)
    signals = torch.tensor([4, 5, 5])  # source 0 did not publish call 5

    got = received_layout(counts, signals, torch.tensor([5]), None, world_size=R,
                          num_local_experts=L, alignment=1, wait=True, flavour=flavour,
                          peer_ptrs=peer_ptrs, rank=me)
    assert [m.tolist() for m in masks] == [[me + 1, 0, 0]] * R
    assert record.tensor[0] == 0  # excluded, not timed out
    for a, b in zip(got, _received_reference(counts[1], 1, torch.tensor([0, 1, 1]))):
        assert torch.equal(a, b)
    # next call: rank 0 excluded already (not waited for), everyone else arrived at once
    signals[1:] = 6
    got = received_layout(counts, signals, torch.tensor([6]), None, world_size=R,
                          num_local_experts=L, alignment=1, wait=True, flavour=flavour,
                          peer_ptrs=peer_ptrs, rank=me)
    for a, b in zip(got, _received_reference(counts[0], 1, torch.tensor([0, 1, 1]))):
        assert torch.equal(a, b)
    # this rank excluded by a peer: it counts nothing and names itself
    masks[me][me] = 3
    got = received_layout(counts, signals, torch.tensor([6]), None, world_size=R,
                          num_local_experts=L, alignment=1, wait=True, flavour=flavour,
                          peer_ptrs=peer_ptrs, rank=me)
    assert not any(t.any() for t in got)
    assert record.tensor[:3].tolist() == [1, me, 6]
