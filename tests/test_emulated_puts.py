"""CPU ranks grouped into nodes over NVSHMEM (``transport="nvshmem"``): a peer on another node
has no pointer, so every row between nodes moves by the NVSHMEM flavour's puts
(``kernels.nvshmem``), which the interpreter runs as copies into the peer's mapping
(``kernels.emulated_puts``). The kernels are the GPU's NVSHMEM branches, as they are."""
import pytest
import torch
from internode_jobs import ll_nodes_case, nodes_case

from cases import Case
from moe_comm.kernels import emulated_puts
from moe_comm.workspace import staging_slot_bytes
from rank_jobs import gradients, with_kernel_waits

NVSHMEM = dict(transport="nvshmem")


def _budget(case: Case, slots: int) -> int:
    """The ``staging_bytes`` of ``slots`` slots per source over NVSHMEM (its outboxes too)."""
    return slots * staging_slot_bytes(case.world_size, case.hidden, case.topk, case.dtype,
                                      rdma=True)


def _by_kind(put: dict, kind: str, world_size: int) -> list[int]:
    return [put.get((kind, p), 0) for p in range(world_size)]


def test_nvshmem_rounds_in_one_launch_give_the_bits_and_puts_of_launches_per_round(ranks):
    """2 nodes x 2 ranks, Zipf routing, an empty rank, stragglers, two calls: the whole batch,
    rings of two slots per source launched per round (6 rounds a call, waits on the host) and
    the same rounds in one launch per op (waits in the kernels: ``kernels.dispatch_rounds``
    and ``kernels.combine_rounds`` with ``TRANSPORT`` 1) are each bit for bit against the
    reference (the job checks). Nothing reaches another node but puts: no pointer to it,
    every byte put goes there, none is left pending, and a call puts one epoch per channel to
    each remote rank (whole batch). The rounds put the same bytes in either form; beyond the
    whole batch each later round puts its counts (L + 1 words) and an epoch per channel to
    every remote rank."""
    case = Case(4, 16, 128, 4, (9, 0, 5, 12), torch.bfloat16, "zipf", 16, seed=211)
    L, calls, rounds = case.num_experts // 4, 2, 6
    later = calls * (rounds - 1)
    kwargs = dict(iterations=calls, straggle_s=0.02, max_topk=case.topk, **NVSHMEM)
    whole = ranks(4).run(nodes_case, case, 2, False, **kwargs)
    per_round = ranks(4).run(nodes_case, case, 2, False, staging_bytes=_budget(case, 2),
                             **kwargs)
    one_launch = ranks(4).run(with_kernel_waits, nodes_case, case, 2, False,
                              staging_bytes=_budget(case, 2), **kwargs)
    for rank, (w, a, b) in enumerate(zip(whole, per_round, one_launch, strict=True)):
        remote = [p // 2 != rank // 2 for p in range(4)]
        for rep in (w, a, b):
            assert rep["transport"] == 1, rank
            assert rep["pending"] == 0 and rep["registered"] == 0, rank  # none left behind
            assert all(rep["peer_ptrs"][p] == 0 for p in range(4) if remote[p]), rank
            assert {pe for _, pe in rep["put"]} <= {p for p in range(4) if remote[p]}, rank
        assert _by_kind(w["put"], "signals", 4) == [calls * 2 * 8 * r for r in remote], rank
        assert w["ring_slots"] == case.max_tokens and a["ring_slots"] == 2, rank
        assert a["launches"]["dispatch_send"] == a["launches"]["combine_send"] \
            == calls * rounds, (rank, a["launches"])
        assert b["device_wait"] and b["launches"]["dispatch_send"] \
            == b["launches"]["dispatch_rounds"] == b["launches"]["combine_rounds"] == calls, \
            (rank, b["launches"])
        assert "combine_send" not in b["launches"] and "dispatch_expand" not in b["launches"]
        assert a["put"] == b["put"], rank
        for p in range(4):
            rows = a["put"].get(("rows", p), 0) - w["put"].get(("rows", p), 0)
            assert rows == later * 4 * (L + 1) * remote[p], (rank, p, rows)
            signals = a["put"].get(("signals", p), 0) - w["put"].get(("signals", p), 0)
            assert signals == later * 2 * 8 * remote[p], (rank, p, signals)
        for key in ("dispatch_bytes_to_peers", "dispatch_bytes_to_self",
                    "combine_bytes_to_peers", "combine_bytes_to_self"):
            assert a["stats"][key] == b["stats"][key], (rank, key)


@pytest.mark.parametrize("fmt", [dict(fp8=True, ue8m0=True, combine_dtype="fp8"),
                                 dict(fp8=None, dispatch_dtype="nvfp4")],
                         ids=["fp8-ue8m0", "nvfp4"])
def test_quantized_nvshmem_rounds_of_one_slot_in_one_launch(ranks, fmt):
    """One slot per source (8 rounds a call, both parities four times), waits in the kernels:
    quantized rows and FP8 partials bit for bit against the reference, a launch per op."""
    case = Case(4, 8, 128, 2, (5, 8, 0, 6), torch.bfloat16, "uniform", 1, seed=212)
    reports = ranks(4).run(with_kernel_waits, nodes_case, case, 2, False, iterations=1,
                           max_topk=case.topk, staging_bytes=_budget(case, 1), **NVSHMEM, **fmt)
    for rank, rep in enumerate(reports):
        assert rep["ring_slots"] == 1, rank
        assert rep["launches"]["dispatch_rounds"] == rep["launches"]["combine_rounds"] == 1, \
            (rank, rep["launches"])


def test_gradients_over_nvshmem_in_rounds_match_reference_autograd(ranks):
    """Forward and backward (the cached dispatch in one launch) in rounds of two slots."""
    case = Case(4, 16, 64, 4, (5, 3, 0, 6), torch.float64, "uniform", 16, seed=213)
    ranks(4).run(with_kernel_waits, gradients, case, ranks_per_node=2, hierarchical=False,
                 max_topk=4, staging_bytes=_budget(case, 2), **NVSHMEM)


def test_low_latency_over_nvshmem_puts_the_minimum(ranks):
    """The low-latency mode, FP8 dispatch, three calls: bit for bit, and the puts move exactly
    each pair for an expert on another node (its row and meta word) and each combined row
    home from there."""
    case = Case(4, 8, 128, 4, (7, 12, 0, 16), torch.bfloat16, "uniform", 1, seed=42)
    for rank, rep in enumerate(ranks(4).run(ll_nodes_case, case, 2, fp8=True, **NVSHMEM)):
        put = rep["put"]
        assert rep["pending"] == 0 and rep["registered"] == 0, rank
        moved = sum(_by_kind(put, "rows", 4)) + sum(_by_kind(put, "words", 4))
        assert moved == rep["want_dispatch"] + rep["want_combine"], (rank, put)
        assert all(pe // 2 != rank // 2 for _, pe in put), (rank, put)


def test_emulated_puts_refuse_what_a_gpu_would_fault_on():
    """A put outside every registered segment, or to a PE the job does not have, raises; a
    segment with an unmapped peer is refused; forgetting a segment drops only its own puts."""
    local = torch.zeros(64, dtype=torch.uint8)
    peer = torch.zeros(64, dtype=torch.uint8)
    base = local.data_ptr()
    with pytest.raises(ValueError, match="mapped"):
        emulated_puts.register(base, 64, [base, 0])
    emulated_puts.register(base, 64, [base, peer.data_ptr()])
    try:
        src = torch.arange(8, dtype=torch.uint8)
        emulated_puts.putmem_nbi_block(base + 8, src.data_ptr(), 8, 1)
        src += 1  # a non-blocking put reads its source when it completes
        assert emulated_puts.pending() == 1 and peer.sum() == 0
        emulated_puts.quiet()
        assert peer[8:16].tolist() == list(range(1, 9)) and local.sum() == 0
        assert emulated_puts.pending() == 0
        with pytest.raises(ValueError, match="outside every registered segment"):
            emulated_puts.putmem_nbi_block(base + 60, src.data_ptr(), 8, 1)
        with pytest.raises(ValueError, match="PE 2"):
            emulated_puts.putmem_nbi_block(base, src.data_ptr(), 8, 2)
        # two segments in one process: forgetting one drops its pending puts, not the other's
        other, other_peer = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
        emulated_puts.register(other.data_ptr(), 64, [other.data_ptr(), other_peer.data_ptr()])
        emulated_puts.putmem_nbi_block(other.data_ptr(), src.data_ptr(), 8, 1)
        emulated_puts.putmem_nbi_block(base, src.data_ptr(), 8, 1)
        emulated_puts.forget(other.data_ptr())
        assert emulated_puts.pending() == 1 and emulated_puts.registered() == 1
        emulated_puts.fence()
        assert peer[:8].tolist() == list(range(1, 9)) and other_peer.sum() == 0
    finally:
        emulated_puts.forget(base)
