"""Dispatches whose ranks disagree: normal ones on one node, over NVSHMEM and through the proxy
(flat with fault tolerance, hierarchical), in rounds; low-latency ones, and low-latency
combines, on one node, over NVSHMEM and through the proxy with fault tolerance; the
DeepEP-compatible module's. A bad input
on the odd ranks, or options that must agree set differently there
(``moe_comm.call_descriptor``). The odd ranks raise their own error, every other rank
PeerInputError naming the first rank whose call differs and what differs, each within the call:
under WITHIN_S, where a rank left waiting would wait MOE_COMM_TIMEOUT_S (120 s), and a
correct call afterwards matches the reference bit for bit on every rank."""
import pytest
from call_agreement_jobs import (
    COMBINE_ROWS,
    disagreeing_calls,
    facade_refusals,
    low_latency_disagreements,
)

# s: a call that ends by itself takes 0.05-0.15 s on two ranks here, up to a few seconds on a
# loaded machine with four ranks on two cores; one that waited for a peer would take 120 s
WITHIN_S = 10.0

CONFIGS = {  # (ranks, Buffer arguments)
    "one-node": (2, {}),
    "nvshmem-rounds": (2, dict(ranks_per_node=1, transport="nvshmem", ring_slots=2)),
    "proxy-hierarchical-rounds": (4, dict(ranks_per_node=2, transport="nixl",
                                          hierarchical=True, ring_slots=2)),
    "proxy-flat-fault-tolerant-rounds": (4, dict(ranks_per_node=2, transport="nixl",
                                                 hierarchical=False, fault_tolerant=True,
                                                 ring_slots=2)),
    # the GPU protocol, interpreted: the waits (and the combine's checks) in the kernels; in
    # rounds a call's later rounds in one launch
    "one-node-kernel-waits": (2, dict(in_kernels=True)),
    "proxy-hierarchical-rounds-kernel-waits": (4, dict(ranks_per_node=2, transport="nixl",
                                                       hierarchical=True, ring_slots=2,
                                                       in_kernels=True)),
}
# the odd ranks' own error (type, text) for each refusal, and what their peers' message names
REFUSED = {"x int32": ("TypeError", "x must be torch.bfloat16", "its x was bad"),
           "more tokens than the maximum": ("ValueError", "more than max_tokens_per_rank",
                                            "its x was bad"),
           "x other hidden": ("ValueError", "x has hidden size 64", "its x was bad"),
           "topk_idx fewer rows": ("ValueError", "topk_idx has 1 rows", "its topk_idx was bad"),
           "expert_alignment 0": ("ValueError", "expert_alignment must be",
                                  "its expert_alignment was bad")}
# what a combine's message names where the formats differ: as a rank with combine_dtype="fp8"
# sees one without, and the other way round
COMBINE_FORMATS = ("it sent rows in the Buffer's dtype, this rank FP8 rows with float32 scales "
                   "(combine_dtype must agree)",
                   "it sent FP8 rows with float32 scales, this rank rows in the Buffer's dtype "
                   "(combine_dtype must agree)")
# what the message of each disagreement names, as an even rank sees rank 1 and an odd one rank 0
DIFFERS = {"fp8 on rank 0 only": ("it sent rows in the Buffer's dtype, this rank FP8 rows",
                                  "it sent FP8 rows with float32 scales, this rank rows in"),
           "fp8 on rank 0 only, no host read": (
               "it sent rows in the Buffer's dtype, this rank FP8 rows",
               "it sent FP8 rows with float32 scales, this rank rows in"),
           "mxfp8 against fp8": ("it sent MXFP8 rows, this rank FP8 rows",
                                 "it sent FP8 rows with float32 scales, this rank MXFP8 rows"),
           "weights on rank 0 only": ("its topk_weights None, this rank's given",
                                      "its topk_weights given, this rank's None"),
           "top-k differs": ("its top-k 3, this rank's 2", "its top-k 2, this rank's 3")}


@pytest.mark.parametrize("config", CONFIGS)
def test_a_rank_that_refuses_or_disagrees_is_named_on_every_rank_within_the_call(ranks, config):
    world_size, kwargs = CONFIGS[config]
    found = ranks(world_size).run(disagreeing_calls, timeout_s=60.0, **kwargs)
    for rank, calls in enumerate(found):
        assert calls.pop("after") is True, rank  # the Buffer goes on, bit for bit
        assert calls.pop("rounds") == (3 if "ring_slots" in kwargs else 1), rank
        combines = {what: calls.pop(what) for what in COMBINE_ROWS}
        _check_combines(rank, combines, world_size, kwargs)
        assert set(calls) == set(REFUSED) | set(DIFFERS), (rank, sorted(calls))
        for what, (kind, text, seconds) in calls.items():
            assert seconds < WITHIN_S, (rank, what, seconds)  # within the call, not the timeout
            if what in REFUSED and rank % 2:  # the rank with the bad input: its own error
                assert (kind, REFUSED[what][1] in text) == (REFUSED[what][0], True), \
                    (rank, what, kind, text)
                continue
            assert kind == "PeerInputError", (rank, what, kind, text)
            peer = 0 if rank % 2 else 1  # the first rank whose call differs from this one's
            if what in REFUSED:
                want = (f"rank {peer} refused the dispatch", REFUSED[what][2])
            else:
                want = (f"rank {peer} made the dispatch", DIFFERS[what][rank % 2])
            assert all(w in text for w in want), (rank, what, text)


# a normal combine's rows: the odd ranks' own error, and what their peers' message names
COMBINE_REFUSED = {"combine y float32": ("TypeError", "y must be torch.bfloat16", "its y was bad"),
                   "combine y float32 on rank 1 only": ("TypeError", "y must be torch.bfloat16",
                                                        "its y was bad"),
                   "combine y fewer rows": ("ValueError", "y has shape", "its y was bad"),
                   "combine weights fewer": ("ValueError", "weights has", "its weights was bad"),
                   "combine older handle": ("ValueError", "handle comes from an older",
                                            "its handle was bad")}


def _check_combines(rank, combines, world_size, kwargs):
    """Every combine row: the own error of a rank with a bad input, else PeerInputError within
    the call naming a rank whose call differs from this one's, or in hierarchical mode the
    rank that forwards such a rank's sums to this one (its node's rank with this rank's local
    index: it is named in its place, "the ranks of its node" where it passes on a format)."""
    N = kwargs.get("ranks_per_node", 0) if kwargs.get("hierarchical", False) else 0
    for what, (kind, text, seconds) in combines.items():
        assert seconds < WITHIN_S, (rank, what, seconds)
        alone = what.endswith("rank 1 only")
        odd = [p == 1 if alone else p % 2 == 1 for p in range(world_size)]
        if what in COMBINE_REFUSED and odd[rank]:
            want = COMBINE_REFUSED[what]
            assert (kind, want[1] in text) == (want[0], True), (rank, what, kind, text)
            continue
        assert kind == "PeerInputError", (rank, what, kind, text)
        differ = {p for p in range(world_size) if odd[p] != odd[rank]}
        relays = {(p // N) * N + rank % N for p in differ if p // N != rank // N} if N else set()
        did = "refused the combine" if what in COMBINE_REFUSED else "made the combine"
        named = [p for p in differ | relays if f"rank {p} {did}" in text]
        assert named, (rank, what, text)
        if what in COMBINE_REFUSED:
            assert COMBINE_REFUSED[what][2] in text, (rank, what, text)
        else:  # (the ranks that pass combine_dtype="fp8": rank 1 alone, or the even ones)
            fp8 = odd[rank] if alone else not odd[rank]
            mixed = "the ranks of its node (whose sums it forwards)" in text
            assert COMBINE_FORMATS[0 if fp8 else 1] in text or mixed and named[0] in relays, \
                (rank, what, text)  # (a forwarder passes on that its node's ranks differ)


def test_the_deep_ep_facade_refuses_a_bad_input_on_one_rank_in_both_modes(ranks):
    found = ranks(2).run(facade_refusals, timeout_s=120)
    own = {"x int32": "TypeError", "x 1-d": "ValueError",
           "topk_idx fewer rows": "ValueError", "low-latency x int32": "TypeError",
           "low-latency topk_idx fewer rows": "ValueError",
           "low-latency combine out of another shape": "ValueError",
           "low-latency combine fp8 y": "TypeError"}
    for rank, calls in enumerate(found):
        assert calls.pop("after") is True and calls.pop("low-latency after") is True, rank
        assert calls.pop("low-latency combine after") is True, rank
        assert set(calls) == set(own), (rank, sorted(calls))
        for what, (kind, text, seconds) in calls.items():
            assert seconds < WITHIN_S, (rank, what, seconds)
            if rank == 1:  # the bad input: its own error
                assert kind == own[what], (what, kind, text)
            else:
                call = "combine" if "combine" in what else "dispatch"
                assert kind == "PeerInputError" and f"rank 1 refused the {call}" in text, \
                    (what, kind, text)


LOW_LATENCY = {  # (ranks, Buffer arguments)
    "one-node": (2, {}),
    "nvshmem": (2, dict(ranks_per_node=1, transport="nvshmem")),
    "proxy-fault-tolerant": (4, dict(ranks_per_node=2, transport="nixl", fault_tolerant=True)),
}
LL_REFUSED = {"x int32": ("TypeError", "x must be torch.bfloat16"),
              "more tokens than the maximum": ("ValueError", "more than max_tokens_per_rank"),
              "x other hidden": ("ValueError", "x has hidden size 64"),
              "stats shape": ("ValueError", "cumulative_local_expert_recv_stats must have")}
LL_DIFFERS = {"fp8 on rank 0 only": DIFFERS["fp8 on rank 0 only"],
              "fp8 on rank 0 only, hooks": DIFFERS["fp8 on rank 0 only"],
              "mxfp8 against fp8": DIFFERS["mxfp8 against fp8"]}
# the combine's: the odd ranks' own error, and what their peers' message names
LL_COMBINE_REFUSED = {"combine y float32": ("TypeError", "y must be torch.bfloat16", "its y"),
                      "combine y other hidden": ("ValueError", "y has shape", "its y"),
                      "combine topk_idx fewer rows": ("ValueError", "topk_idx has shape",
                                                      "its topk_idx")}
LL_COMBINE_DIFFERS = {"combine fp8 on rank 0 only": COMBINE_FORMATS,
                      "combine fp8 on rank 0 only, hooks": COMBINE_FORMATS}


@pytest.mark.parametrize("config", LOW_LATENCY)
def test_a_low_latency_rank_that_refuses_or_disagrees_is_named_by_every_hook(ranks, config):
    world_size, kwargs = LOW_LATENCY[config]
    found = ranks(world_size).run(low_latency_disagreements, timeout_s=60.0, **kwargs)
    for rank, calls in enumerate(found):
        assert calls.pop("after") is True, rank
        combines = {what: calls.pop(what) for what in list(calls) if what.startswith("combine")}
        assert set(calls) == set(LL_REFUSED) | set(LL_DIFFERS), (rank, sorted(calls))
        assert set(combines) == set(LL_COMBINE_REFUSED) | set(LL_COMBINE_DIFFERS), rank
        for what, (kind, text, seconds) in combines.items():
            assert seconds < WITHIN_S, (rank, what, seconds)
            if what in LL_COMBINE_REFUSED and rank % 2:  # the bad input: its own error
                want = LL_COMBINE_REFUSED[what]
                assert (kind, want[1] in text) == (want[0], True), (rank, what, kind, text)
                continue
            peer = 0 if rank % 2 else 1
            want = ((f"rank {peer} refused the combine", LL_COMBINE_REFUSED[what][2] + " was bad")
                    if what in LL_COMBINE_REFUSED else
                    (f"rank {peer} made the combine", LL_COMBINE_DIFFERS[what][rank % 2]))
            assert kind == "PeerInputError" and all(w in text for w in want), \
                (rank, what, kind, text)
        for what, (kind, text, seconds) in calls.items():
            assert seconds < WITHIN_S, (rank, what, seconds)
            if what in LL_REFUSED and rank % 2:
                assert (kind, LL_REFUSED[what][1] in text) == (LL_REFUSED[what][0], True), \
                    (rank, what, kind, text)
                continue
            peer = 0 if rank % 2 else 1
            want = (f"rank {peer} refused the dispatch",) if what in LL_REFUSED else (
                f"rank {peer} made the dispatch", LL_DIFFERS[what][rank % 2])
            assert kind == "PeerInputError" and all(w in text for w in want), \
                (rank, what, kind, text)
