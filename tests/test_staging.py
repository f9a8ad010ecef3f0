"""Bounded staging (``staging_bytes``): calls stream through rings of one or two slots per
source in rounds, bit-exact against the reference and against the whole-batch staging."""
import pytest
import torch
from internode_jobs import nodes_case
from staging_jobs import (
    DISPATCH_FORMS,
    combine_forms,
    dies_after_round_0,
    dispatch_forms,
    rounds_with_failures,
    skip_one_op,
    slots_budget,
    streamed_case,
)
from test_fault import TIMEOUT_NODES_S, TIMEOUT_S, fresh_pool
from test_loopback import check_case

import moe_comm
from cases import Case, expert_fn, make_inputs, names_rank
from moe_comm import microscale, reference
from moe_comm.testing import lockstep
from moe_comm.workspace import DEFAULT_STAGING_BYTES, staging_slot_bytes
from rank_jobs import construct, gradients, with_kernel_waits


def bounded(case: Case, slots: int | None, **kwargs) -> list:
    """Virtual ranks of ``case`` whose staging holds ``slots`` slots per source (None: all)."""
    budget = None if slots is None else slots_budget(case, slots)
    return moe_comm.Buffer.loopback(case.world_size, case.hidden, case.num_experts,
                                    case.max_tokens, case.dtype, max_topk=case.topk,
                                    staging_bytes=budget, **kwargs)


MATRIX = [
    (Case(4, 8, 64, 2, (9, 3, 0, 11), routing="uniform", seed=201), 1),
    (Case(4, 16, 64, 4, (8, 8, 8, 8), torch.float16, "zipf", 16, seed=202), 2),
    (Case(4, 8, 96, 2, (7, 0, 5, 6), torch.float32, "one_expert", 1, False, seed=203), 1),
    (Case(4, 16, 64, 8, (6, 6, 6, 6), routing="empty_rank", alignment=16, seed=204), 2),
    (Case(2, 4, 64, 2, (5, 4), routing="all_invalid", seed=205), 1),
]


@pytest.mark.parametrize("case, slots", MATRIX, ids=lambda v: str(v))
def test_rounds_match_reference(case, slots):
    bufs = bounded(case, slots)
    assert bufs[0].ring_slots == slots and bufs[0].rounds == -(-case.max_tokens // slots)
    check_case(case, iterations=2, buffers=bufs)  # two calls: both parities of every round


def test_rounds_launches_and_bytes_against_whole_batch():
    case = Case(4, 16, 64, 2, (9, 3, 0, 11), seed=206)
    xs, idxs, ws = make_inputs(case)
    runs = {}
    for slots in (None, 2):
        bufs = bounded(case, slots)
        got = lockstep.dispatch(bufs, xs, idxs, ws)
        after_dispatch = [dict(b.launches) for b in bufs]
        ys = [expert_fn(g.x, g.expert_offsets) for g in got]
        outs = lockstep.combine(bufs, ys, [g.handle for g in got], [g.weights for g in got])
        runs[slots] = (bufs, got, outs, after_dispatch)
    full, part = runs[None], runs[2]
    rounds = part[0][0].rounds
    assert rounds == 6 and full[0][0].rounds == 1
    L = case.num_experts // case.world_size
    for r in range(4):
        for a, b in zip((full[1][r].x, full[1][r].src_token, full[2][r]),
                        (part[1][r].x, part[1][r].src_token, part[2][r])):
            assert torch.equal(a, b), r
        d = part[3][r]
        assert (d["layout"], d["dispatch_send"], d["received_layout"], d["dispatch_expand"]) \
            == (2, rounds, rounds, rounds), d
        c = part[0][r].launches
        assert c["combine_send"] == rounds
        # a reduce per round that holds tokens of this rank (none for an empty rank)
        assert c["combine_reduce"] == -(-case.tokens[r] // 2), (r, dict(c))
        # the same rows on the link; each later round adds its signal words: per destination
        # the epoch (8 bytes) and the counts (4 * (L + 1)) of a dispatch, the epoch of a combine
        s_full, s_part = full[0][r].stats(), part[0][r].stats()
        extra = rounds - 1
        assert s_part["dispatch_bytes_to_peers"] - s_full["dispatch_bytes_to_peers"] \
            == extra * 3 * (8 + 4 * (L + 1))
        assert s_part["dispatch_bytes_to_self"] - s_full["dispatch_bytes_to_self"] \
            == extra * (8 + 4 * (L + 1))
        assert s_part["combine_bytes_to_peers"] - s_full["combine_bytes_to_peers"] == extra * 3 * 8
        assert s_part["combine_bytes_to_self"] - s_full["combine_bytes_to_self"] == extra * 8


def test_rounds_with_max_recv_rows_and_backward_ops():
    """The static-shape dispatch, the cached dispatch (combine's backward) and the combine of
    per-row values (dispatch's backward) in rounds: the same bits as the whole batch."""
    case = Case(4, 16, 64, 4, (10, 2, 7, 0), routing="zipf", seed=207)
    xs, idxs, ws = make_inputs(case)
    results = {}
    for slots in (None, 1):
        bufs = bounded(case, slots)
        got = lockstep.dispatch(bufs, xs, idxs, ws, max_recv_rows=48)
        handles = [g.handle for g in got]
        grads = [torch.randn((t, case.hidden), generator=torch.Generator().manual_seed(t))
                 .to(case.dtype) for t in case.tokens]
        rows = lockstep.dispatch_cached(bufs, grads, handles)
        values = [torch.linspace(-1, 1, g.x.shape[0]) for g in got]
        ys = [(g.x.float() * 1.5 + 0.25).to(case.dtype) for g in got]
        pairs = lockstep.combine_with_pairs(bufs, ys, handles, values)
        results[slots] = (got, rows, pairs)
    for r in range(4):
        a, b = results[None], results[1]
        assert torch.equal(a[0][r].x, b[0][r].x) and b[0][r].x.shape[0] == 48
        assert torch.equal(a[0][r].src_rank, b[0][r].src_rank)
        assert torch.equal(a[1][r], b[1][r]), r
        assert torch.equal(a[2][r][0], b[2][r][0]) and torch.equal(a[2][r][1], b[2][r][1]), r
    want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts)
    for r in range(4):
        n = int(want[r].expert_offsets[-1])
        assert torch.equal(results[1][0][r].x[:n], want[r].x)


@pytest.mark.parametrize("fmt", ["fp8", "fp8-ue8m0-colmajor", "fp8-pair", "mxfp8", "mxfp8-pair",
                                 "nvfp4", "nvfp4-triple"])
def test_quantized_rounds_match_reference(fmt):
    case = Case(4, 16, 256, 4, (7, 2, 0, 5), routing="one_expert", seed=208)
    xs, idxs, ws = make_inputs(case)
    bufs = bounded(case, 2)
    assert bufs[0].rounds == 4
    kwargs = {"fp8": dict(fp8=True), "fp8-ue8m0-colmajor": dict(fp8=True, ue8m0=True,
                                                                col_major_scales=True),
              "fp8-pair": dict(fp8=True), "mxfp8": dict(dispatch_dtype="mxfp8"),
              "mxfp8-pair": dict(dispatch_dtype="mxfp8"),
              "nvfp4": dict(dispatch_dtype="nvfp4", global_scale=torch.tensor([0.05])),
              "nvfp4-triple": dict(dispatch_dtype="nvfp4")}[fmt]
    sent = xs  # or quantized rows with their per-token scales, which travel as they are
    if fmt == "fp8-pair":
        sent = [reference.quantize_fp8(x) for x in xs]
    elif fmt == "mxfp8-pair":
        sent = [microscale.quantize_mxfp8(x) for x in xs]
    elif fmt == "nvfp4-triple":  # a global scale per row, as after an earlier receive
        sent = [(q, s, g.expand(q.shape[0]).contiguous())
                for q, s, g in (microscale.quantize_nvfp4(x) for x in xs)]
    got = lockstep.dispatch(bufs, sent, idxs, ws, **kwargs)
    want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts, **kwargs)
    for r in range(4):
        g, w = got[r], want[r]
        assert torch.equal(g.x.view(torch.uint8), w.x.view(torch.uint8)), (fmt, r)
        if g.x_scales.element_size() == 1:  # E8M0 / e4m3 scale bytes
            assert torch.equal(g.x_scales.view(torch.uint8), w.x_scales.view(torch.uint8)), r
        else:
            assert torch.equal(g.x_scales, w.x_scales), (fmt, r)
        if fmt == "nvfp4":
            assert torch.equal(g.x_global_scale, w.x_global_scale), r
        for field in ("weights", "src_rank", "src_token", "expert_offsets"):
            assert torch.equal(getattr(g, field), getattr(w, field)), (fmt, r, field)
    ys = [((torch.arange(g.src_rank.numel() * case.hidden) % 13) * 0.25 - 1.5)
          .reshape(-1, case.hidden).to(case.dtype) for g in got]  # the experts' rows
    for dtype in (None, "fp8"):
        outs = lockstep.combine(bufs, ys, [g.handle for g in got], [g.weights for g in got],
                                combine_dtype=dtype)
        refs = reference.combine_all(ys, [w.handle for w in want], [w.weights for w in want],
                                     combine_dtype=dtype)
        for r in range(4):
            assert torch.equal(outs[r], refs[r]), (fmt, dtype, r)


def test_cpu_ranks_with_stragglers_give_the_whole_batch_bits(ranks):
    """Processes in rounds of one slot per source, random delays around every op, host waits
    and waits in the kernels: each call checked against the oracle, every digest equal to the
    whole-batch staging's."""
    case = Case(4, 16, 64, 4, (6, 2, 0, 5), routing="zipf", seed=209)
    full = ranks(4).run(streamed_case, case, None, iterations=3)
    for in_kernels in (False, True):
        part = ranks(4).run(streamed_case, case, 1, iterations=3, straggle_s=0.03,
                            in_kernels=in_kernels)
        for r in range(4):
            assert part[r]["rounds"] == 6 and full[r]["rounds"] == 1
            assert part[r]["digests"] == full[r]["digests"], (in_kernels, r)
            assert part[r]["staging_bytes"] * 4 < full[r]["staging_bytes"]
            # waits in the kernels: each combine's six rounds in one launch
            # (kernels.combine_rounds), each dispatch's round 0 sent and laid out in one, its
            # round-0 expand and five later rounds in another (kernels.dispatch_rounds); host
            # waits: a send per round
            launches = part[r]["launches"]
            combines = (launches.get("combine_rounds", 0), launches.get("combine_send", 0))
            assert combines == ((3, 0) if in_kernels else (0, 18)), (in_kernels, r, launches)
            dispatches = (launches.get("dispatch_rounds", 0), launches["dispatch_send"],
                          launches.get("dispatch_expand", 0), launches.get("received_layout", 0))
            assert dispatches == ((3, 3, 0, 0) if in_kernels else (0, 18, 18, 18)), \
                (in_kernels, r, launches)
            # the later rounds' signal words, 3 calls of 5 (per peer and to itself: the epoch,
            # and a dispatch's counts, 4 * (L + 1) bytes)
            full_stats, part_stats = full[r]["stats"], part[r]["stats"]
            L = case.num_experts // 4
            for op, words in (("combine", 8), ("dispatch", 8 + 4 * (L + 1))):
                assert part_stats[f"{op}_bytes_to_peers"] - full_stats[f"{op}_bytes_to_peers"] \
                    == 3 * 5 * 3 * words, (op, r)
                assert part_stats[f"{op}_bytes_to_self"] - full_stats[f"{op}_bytes_to_self"] \
                    == 3 * 5 * words, (op, r)


def test_gradients_in_rounds_match_reference_autograd(ranks):
    case = Case(2, 8, 32, 2, (7, 4), torch.float64, "uniform", 4, seed=210)
    ranks(2).run(gradients, case, max_topk=2, staging_bytes=slots_budget(case, 2))


def test_flat_nodes_in_rounds_match_reference_and_move_the_whole_batch_bytes(ranks):
    """2 nodes x 2 ranks through the proxy, flat, rings of two slots per source (6 rounds a
    call), stragglers, two calls, each checked bit for bit against the reference by the job;
    the rows and metadata that cross nodes and every row stored equal the whole batch's, and
    each later round adds its counts to every remote peer's message and its epoch (and, in a
    dispatch, its counts) to every rank of the node."""
    pytest.importorskip("nixl_cu13")
    case = Case(4, 16, 128, 4, (9, 0, 5, 12), torch.bfloat16, "zipf", 16, seed=211)
    L, calls, rounds = case.num_experts // 4, 2, 6
    later = calls * (rounds - 1)
    # two slots: for 4 sources and both parities, staging and outboxes, a dispatch row and its
    # metadata (1 + 3K words), a combine row and its K values
    budget = 2 * 2 * 2 * 4 * (2 * 128 * 2 + 4 * (1 + 3 * 4) + 4 * 4)
    runs = {slots: ranks(4).run(nodes_case, case, 2, False, iterations=calls, straggle_s=0.02,
                                max_topk=case.topk,
                                staging_bytes=None if slots is None else budget)
            for slots in (None, 2)}
    for rank, (full, part) in enumerate(zip(runs[None], runs[2], strict=True)):
        assert part["ring_slots"] == 2, rank
        assert full["ring_slots"] == case.max_tokens, rank
        assert full["launches"]["dispatch_send"] == calls, rank
        assert part["launches"]["dispatch_send"] == part["launches"]["combine_send"] \
            == calls * rounds, rank
        assert "dispatch_outbox" not in part["launches"], rank  # (the send fills them)
        # every remote peer's message carries each later round's counts
        extras = [later * 4 * (L + 1) if p // 2 != rank // 2 else 0 for p in range(4)]
        _check_round_extras(rank, part, full, calls, rounds, L, extras,
                            ("dispatch_bytes_to_outbox", "combine_bytes_to_outbox"))


def test_flat_nodes_in_rounds_with_waits_in_the_kernels_run_in_one_launch(ranks):
    """2 nodes x 2 ranks through the proxy, flat, rings of two slots (6 rounds a call), waits
    in the kernels: every combine's rounds in one launch (``kernels.combine_rounds``: the
    partials for other nodes into the outbox, one transfer per home there) and every
    dispatch's after its round 0 (``kernels.dispatch_rounds``: the rows for other nodes into
    the outboxes by the send itself, one transfer per rank there), bit for bit against the
    reference, with the bytes and messages of the launches per round."""
    pytest.importorskip("nixl_cu13")
    case = Case(4, 16, 128, 4, (9, 0, 5, 12), torch.bfloat16, "zipf", 16, seed=212)
    budget = 2 * 2 * 2 * 4 * (2 * 128 * 2 + 4 * (1 + 3 * 4) + 4 * 4)  # (as above: 2 slots)
    kwargs = dict(iterations=2, straggle_s=0.02, max_topk=case.topk, staging_bytes=budget)
    per_round = ranks(4).run(nodes_case, case, 2, False, **kwargs)
    one_launch = ranks(4).run(with_kernel_waits, nodes_case, case, 2, False, **kwargs)
    for rank, (a, b) in enumerate(zip(one_launch, per_round, strict=True)):
        assert a["device_wait"] and a["ring_slots"] == 2, rank
        assert a["launches"]["combine_rounds"] == 2, (rank, a["launches"])
        assert "combine_send" not in a["launches"], (rank, a["launches"])
        # a dispatch: round 0's send (it lays out what arrived), then one launch
        assert (a["launches"]["dispatch_send"], a["launches"]["dispatch_rounds"]) == (2, 2), \
            (rank, a["launches"])
        for name in ("dispatch_outbox", "dispatch_expand", "received_layout"):
            assert name not in a["launches"], (rank, name, a["launches"])
        assert b["launches"]["dispatch_send"] == 12 and "dispatch_outbox" not in b["launches"], \
            (rank, b["launches"])  # (a flat send fills its outboxes itself)
        assert a["internode"] == b["internode"], rank
        for key in ("combine_bytes_to_peers", "combine_bytes_to_self",
                    "combine_bytes_to_outbox", "dispatch_bytes_to_peers",
                    "dispatch_bytes_to_self", "dispatch_bytes_to_outbox", "internode_messages"):
            assert a["stats"][key] == b["stats"][key], (rank, key)


def test_hierarchical_rounds_in_one_launch_deal_every_nodes_messages(ranks):
    """4 nodes of one rank through the proxy, hierarchical, rings of two slots (6 rounds a
    call), waits in the kernels: each forwarder's pass in the one launch takes the messages of
    three other nodes, their row tiles dealt together (``kernels.internode.forward_messages``).
    Bit for bit against the reference (two calls, stragglers), a dispatch in the launches of
    one round, and every forwarder stores exactly the rows of its node's tokens from the other
    nodes (a row and its metadata each)."""
    pytest.importorskip("nixl_cu13")
    case = Case(4, 16, 128, 4, (9, 0, 5, 12), torch.bfloat16, "zipf", 16, seed=217)
    calls, L = 2, case.num_experts // 4
    reports = ranks(4).run(with_kernel_waits, nodes_case, case, 1, True, iterations=calls,
                           straggle_s=0.02, max_topk=case.topk,
                           staging_bytes=slots_budget(case, 2, outboxes=True, ranks_per_node=1))
    row = 2 * case.hidden + 4 * (1 + 3 * case.topk)  # bf16 payload and metadata
    for f, report in enumerate(reports):
        got = report["launches"]
        assert report["ring_slots"] == 2 and all(got[name] == calls for name in (
            "dispatch_outbox", "dispatch_forward", "dispatch_rounds")), (f, got)
        assert "dispatch_expand" not in got, (f, got)
        rows = 0
        for it in range(calls):
            _, idxs, _ = make_inputs(case, it)
            rows += sum(int(((idxs[s] >= 0) & (idxs[s] // L == f)).any(-1).sum())
                        for s in range(4) if s != f)
        assert report["stats"]["dispatch_bytes_forwarded"] == rows * row, (f, rows)


def _check_round_extras(rank, part, full, calls: int, rounds: int, L: int, extras: list[int],
                        same: tuple[str, ...]) -> None:
    """Across nodes, what ``calls`` calls of ``rounds`` rounds each moved beyond the whole
    batch on ``rank``: ``extras[p]`` more bytes in the dispatch messages to peer ``p``, the same
    combine bytes across nodes and the same counters ``same``, each later round's counts and
    epoch to every rank of the node (8 bytes in a combine), and ``rounds`` times the
    messages."""
    later = calls * (rounds - 1)
    for p, want in enumerate(extras):
        extra = part["internode"]["dispatch"][p] - full["internode"]["dispatch"][p]
        assert extra == want, (rank, p, extra)
    assert part["internode"]["combine"] == full["internode"]["combine"], rank
    a, b = part["stats"], full["stats"]
    for key in same:
        assert a[key] == b[key], (rank, key)
    signals = later * (4 * (L + 1) + 8)  # a round's counts and epoch, to a rank
    assert a["dispatch_bytes_to_peers"] - b["dispatch_bytes_to_peers"] == signals, rank
    assert a["dispatch_bytes_to_self"] - b["dispatch_bytes_to_self"] == signals, rank
    assert a["combine_bytes_to_peers"] - b["combine_bytes_to_peers"] == later * 8, rank
    assert a["internode_messages"] == rounds * b["internode_messages"], rank


@pytest.mark.parametrize("fmt, in_kernels", [
    (dict(fp8=True, ue8m0=True, combine_dtype="fp8"), False),
    (dict(fp8=None, dispatch_dtype="nvfp4"), False),
    (dict(fp8=True, ue8m0=True, combine_dtype="fp8"), True)],
    ids=["fp8-ue8m0", "nvfp4", "fp8-ue8m0-one-launch"])
def test_quantized_flat_nodes_in_rounds_of_one_slot(ranks, fmt, in_kernels):
    """Flat across 2 nodes, one slot per source: a call of 8 rounds (each round an epoch, so
    both parities four times): quantized rows (and FP8 partials) bit for bit against the
    reference; with the waits in the kernels, the rounds after round 0 in one launch (the send
    quantizing to FP8 into the staging of its node and the outboxes for the other)."""
    pytest.importorskip("nixl_cu13")
    case = Case(4, 8, 128, 2, (5, 8, 0, 6), torch.bfloat16, "uniform", 1, seed=212)
    job = (with_kernel_waits, nodes_case) if in_kernels else (nodes_case,)
    reports = ranks(4).run(*job, case, 2, False, iterations=1, max_topk=case.topk,
                           staging_bytes=slots_budget(case, 1, outboxes=True), **fmt)
    sends = [(r["launches"]["dispatch_send"], r["launches"].get("dispatch_rounds", 0),
              r["launches"].get("combine_rounds", 0)) for r in reports]
    assert sends == [(1, 1, 1) if in_kernels else (8, 0, 0)] * 4, sends


@pytest.mark.parametrize("in_kernels", [False, True], ids=["host_waits", "kernel_waits"])
def test_gradients_of_flat_nodes_in_rounds_match_reference_autograd(ranks, in_kernels):
    """float64 forward and backward in rounds of two slots; with the waits in the kernels every
    op's rounds in one launch, the backward of combine (a cached dispatch: its rows alone, the
    rows to each rank of each round counted for the descriptors) too."""
    case = Case(4, 16, 64, 4, (5, 3, 0, 6), torch.float64, "uniform", 16, seed=213)
    job = (with_kernel_waits, gradients) if in_kernels else (gradients,)
    reports = ranks(4).run(*job, case, ranks_per_node=2, transport="nixl", hierarchical=False,
                           max_topk=4, staging_bytes=slots_budget(case, 2, outboxes=True))
    for rank, launches in enumerate(reports):
        assert "dispatch_outbox" not in launches, (rank, launches)
        if in_kernels:  # a dispatch, two combines and their backward: two cached dispatches
            assert (launches["dispatch_send"], launches["dispatch_rounds"],  # and a combine
                    launches["combine_rounds"]) == (1, 3, 3), (rank, launches)


def test_workspace_formula_from_ep_8_to_1024():
    """DeepSeek-V3 sizes: the default budget stages the whole batch at EP 8, stays under 2 GiB
    at every EP size, and the rest of the workspace grows with R only through per-peer words,
    not with max_tokens_per_rank."""
    H, K, dtype, L = 7168, 8, torch.bfloat16, 4
    per_slot = staging_slot_bytes(1, H, K, dtype)
    assert per_slot == 2 * (2 * H * 2 + 4 * (1 + 3 * K) + 4 * K)
    rest = {}
    for R in (8, 16, 64, 256, 1024):
        total = moe_comm.Buffer.required_workspace_bytes(R, H, R * L, 4096, dtype, K)
        slots = DEFAULT_STAGING_BYTES // (R * per_slot)
        slots = 4096 if slots >= 4096 else slots // 16 * 16  # windows stay 16-byte aligned
        staging = R * slots * per_slot  # each region's parity a multiple of 128 bytes here
        assert total < 2 << 30, (R, total)
        if R == 8:
            assert slots == 4096
        rest[R] = total - staging
        assert 0 < rest[R] < 256 * R + 1024, (R, rest[R])  # per-peer words only
        if slots < 4096:  # bounded: more tokens per rank cost nothing more
            assert moe_comm.Buffer.required_workspace_bytes(R, H, R * L, 65536, dtype, K) \
                == total
    assert rest[1024] > rest[8]
    small = moe_comm.Buffer.required_workspace_bytes(64, H, 256, 4096, dtype, K,
                                                     staging_bytes=64 * per_slot * 16)
    assert small - rest[64] == 64 * 16 * per_slot


def test_gpu_rings_are_cut_to_what_one_launch_runs_a_round_of():
    """DeepSeek-V3 sizes, a process per GPU on one node, 20 programs: where the default budget
    gives a ring of several rounds too large for the rounds in one launch (EP 16, EP 32; EP 8
    with the EP-invariant combine), the ring is cut to the largest multiple of 16 that every
    format's one launch fits, and the Buffer runs every format in one launch there; rings
    that fit (EP 128) and whole batches (EP 8) stay. More programs fit more; CPU ranks and the
    proxy keep the budget's. Across hosts over NVSHMEM the same, over the formats that run in
    one launch there."""
    from moe_comm.kernels.comm import Flavour
    from moe_comm.plan import BufferPlan
    from moe_comm.rings import fits_every_format, one_launch_sms, staging_ring_slots
    from moe_comm.warmup import twins
    from moe_comm.workspace import WorkspaceLayout

    H, K, T, dtype = 7168, 8, 4096, torch.bfloat16
    for R, inv, budget, cut in ((16, False, 2176, 640), (32, False, 1088, 576),
                                (64, False, 544, 512), (8, True, 2912, 656),
                                (128, False, 272, 272), (8, False, None, None)):
        assert staging_ring_slots(None, R, T, H, K, dtype, invariant=inv) == budget, R
        assert staging_ring_slots(None, R, T, H, K, dtype, invariant=inv,
                                  one_launch_sms=20) == cut, R
        layout = WorkspaceLayout(R, T, H, 256 // R, K, dtype, ring_slots=cut, invariant=inv)
        assert moe_comm.Buffer.required_workspace_bytes(
            R, H, 256, T, dtype, K, ep_invariant=inv, one_launch_sms=20) == layout.nbytes, R
        if cut is None:
            continue
        assert cut % 16 == 0 and fits_every_format(cut, R, H, K, 2, 20, inv), R
        assert cut == budget or not fits_every_format(cut + 16, R, H, K, 2, 20, inv), R
    assert moe_comm.Buffer.required_workspace_bytes(16, H, 256, T, dtype, K) > (1 << 30) \
        > moe_comm.Buffer.required_workspace_bytes(16, H, 256, T, dtype, K, one_launch_sms=20)
    assert staging_ring_slots(None, 32, T, H, K, dtype, one_launch_sms=132) > 576
    assert moe_comm.Buffer.required_workspace_bytes(  # across nodes: per round, no cut
        32, H, 256, T, dtype, K, ranks_per_node=8, one_launch_sms=20) \
        == moe_comm.Buffer.required_workspace_bytes(32, H, 256, T, dtype, K, ranks_per_node=8)
    with pytest.raises(ValueError, match="num_sms must be a positive int"):
        moe_comm.Buffer.required_workspace_bytes(16, H, 256, T, dtype, K, one_launch_sms=0)
    assert one_launch_sms("cuda", False, None) == 20
    assert one_launch_sms("cuda", False, 24) == 24
    for args in (("cpu", False, 20), ("cuda", True, 20)):
        assert one_launch_sms(*args) is None, args
    # across hosts over NVSHMEM (nodes of 8): the same cut over every format there (a send
    # that quantizes in tiles of 4 tokens decides it): EP 16's 1424 slots (3 rounds) become
    # 560 (8 rounds), EP 32's 720 (6) 512 (8); EP 64's 352 already fit
    for R, budget, cut in ((16, 1424, 560), (32, 720, 512), (64, 352, 352)):
        assert staging_ring_slots(None, R, T, H, K, dtype, rdma=True) == budget, R
        assert staging_ring_slots(None, R, T, H, K, dtype, rdma=True, one_launch_sms=20) == cut
        assert fits_every_format(cut, R, H, K, 2, 20, False, nvshmem=True), R
        assert cut == budget or not fits_every_format(cut + 16, R, H, K, 2, 20, False, True), R
        assert moe_comm.Buffer.required_workspace_bytes(
            R, H, 256, T, dtype, K, ranks_per_node=8, transport="nvshmem", one_launch_sms=20) \
            == WorkspaceLayout(R, T, H, 256 // R, K, dtype, rdma=True, ring_slots=cut).nbytes, R
    for ring in (560, 576):  # every format, the quantizing sends the first to drop out
        layout = WorkspaceLayout(16, T, H, 16, K, dtype, rdma=True, ring_slots=ring)
        buf = twins(moe_comm.Buffer, BufferPlan(layout, 256, "nvshmem", 20),
                    Flavour(transport=1, device_wait=True, compiled=True), own_process=True)[0]
        assert all(buf.plan.combine_in_one_launch.values()), ring
        assert {key for key, one in buf.plan.dispatch_in_one_launch.items() if not one} == (
            set() if ring == 560 else {(1, ue8m0, elem) for ue8m0 in (0, 1, 2) for elem in (1, 2)})
    # the Buffer's own tables (GPU flavour, processes of their own): all at the cut ring, not
    # all a multiple above (EP 16: the FP8 combine and the NVFP4-quantizing send fit 640)
    for ring in (640, 656):
        layout = WorkspaceLayout(16, T, H, 16, K, dtype, ring_slots=ring)
        buf = twins(moe_comm.Buffer, BufferPlan(layout, 256, num_sms=20),
                    Flavour(device_wait=True, compiled=True), own_process=True)[0]
        tables = [*buf.plan.combine_in_one_launch.values(),
                  *buf.plan.dispatch_in_one_launch.values()]
        assert len(tables) == 4 + 3 * 4 * 2 and any(tables), ring
        assert all(tables) == fits_every_format(ring, 16, H, K, 2, 20, False) == (ring == 640)


def test_flat_workspace_across_nodes_from_ep_16_to_256():
    """DeepSeek-V3 sizes, nodes of 8 ranks, flat through the proxy: the default budget pays for
    the staging and the outboxes, the whole workspace stays under 2 GiB and does not grow with
    max_tokens_per_rank (the whole batch would take 7 GiB at EP 16, 28 GiB at EP 64)."""
    from moe_comm.workspace import WorkspaceLayout, ring_slots_for
    H, K, dtype = 7168, 8, torch.bfloat16
    per_slot = 2 * 2 * (2 * H * 2 + 4 * (1 + 3 * K) + 4 * K)  # both parities, staging + outbox

    def layout(R, T, slots):
        return WorkspaceLayout(R, T, H, 256 // R, K, dtype, proxy=True, ranks_per_node=8,
                               ring_slots=slots)

    for R, rounds in ((16, 4), (64, 16), (256, 64)):
        slots = ring_slots_for(None, R, 4096, H, K, dtype, outboxes=True)
        assert slots == DEFAULT_STAGING_BYTES // (R * per_slot) // 16 * 16, R
        bounded, whole = layout(R, 4096, slots), layout(R, 4096, None)
        assert bounded.rounds == rounds and bounded.staging_bytes <= DEFAULT_STAGING_BYTES, R
        assert bounded.nbytes < 2 << 30 < 7 << 30 <= whole.nbytes, R
        assert layout(R, 65536, slots).nbytes == bounded.nbytes, R
        assert moe_comm.Buffer.required_workspace_bytes(
            R, H, 256, 4096, dtype, K, ranks_per_node=8, hierarchical=False) == bounded.nbytes


def test_hierarchical_workspace_across_nodes_from_ep_16_to_256():
    """DeepSeek-V3 sizes, nodes of 8 ranks, hierarchical through the proxy: the default budget
    pays for the staging, the outboxes (a slot per destination node) and the forwarders'
    regions; the whole workspace stays under 2 GiB and does not grow with max_tokens_per_rank
    (the whole batch would take 6 GiB at EP 16, 24 GiB at EP 64, 98 GiB at EP 256)."""
    from moe_comm.workspace import WorkspaceLayout, ring_slots_for
    H, K, dtype, N = 7168, 8, torch.bfloat16, 8
    row, meta = 2 * H, 4 * (1 + 3 * K)

    def per_slot(R):
        """Both parities: the staging; per node a dispatch row with its node metadata in the
        outbox and in the forwarder's regions, a combine row with its weights in the outbox
        and in the node sums; a partial with its weights per source rank."""
        M = R // N
        staging = 2 * R * (2 * row + meta + 4 * K)
        node_meta = 4 * (1 + 3 * K + N)
        return staging + 2 * (M * (2 * (row + node_meta) + 2 * (row + 4 * K))
                              + R * (row + 4 * K))

    def layout(R, T, slots):
        return WorkspaceLayout(R, T, H, 256 // R, K, dtype, proxy=True, ranks_per_node=N,
                               hierarchical=True, ring_slots=slots)

    for R, rounds, whole_gib in ((16, 4, 6), (64, 14, 24), (256, 64, 98)):
        slots = ring_slots_for(None, R, 4096, H, K, dtype, outboxes=True, ranks_per_node=N)
        assert slots == DEFAULT_STAGING_BYTES // per_slot(R) // 16 * 16, R
        bounded, whole = layout(R, 4096, slots), layout(R, 4096, None)
        assert bounded.rounds == rounds, (R, bounded.rounds)
        assert bounded.staging_bytes == slots * per_slot(R) <= DEFAULT_STAGING_BYTES, R
        assert bounded.nbytes < 2 << 30 and whole.nbytes > whole_gib << 30, R
        assert layout(R, 65536, slots).nbytes == bounded.nbytes, R
        assert moe_comm.Buffer.required_workspace_bytes(R, H, 256, 4096, dtype, K,
                                                        ranks_per_node=N) == bounded.nbytes, R
    with pytest.raises(ValueError, match="ranks_per_node must be a positive divisor"):
        moe_comm.Buffer.required_workspace_bytes(16, H, 256, 4096, dtype, K, ranks_per_node=6)


def test_staging_errors_before_anything_is_allocated(ranks):
    case = Case(2, 4, 64, 2, (4, 4))
    with pytest.raises(ValueError, match="less than one slot per source"):
        moe_comm.Buffer.loopback(2, 64, 4, 4, max_topk=2, staging_bytes=100)
    for bad in (0, -5, True, 2.5):
        with pytest.raises(ValueError, match="staging_bytes must be a positive int"):
            moe_comm.Buffer.loopback(2, 64, 4, 4, max_topk=2, staging_bytes=bad)
    # fault tolerance runs in rounds on one node
    assert moe_comm.Buffer.loopback(2, 64, 4, 4, max_topk=2, fault_tolerant=True,
                                    staging_bytes=slots_budget(case, 1))[0].rounds == 4
    budget = slots_budget(Case(2, 4, 64, 2, (8, 8)), 2)
    errors = ranks(2).run(construct, {0: dict(staging_bytes=budget), 1: dict()})
    assert all(e is not None and "staging_bytes" in e and "rank 1" in e for e in errors), errors
    with pytest.raises(ValueError, match="either over NVSHMEM"):
        staging_slot_bytes(2, 64, 2, torch.bfloat16, outboxes=True, rdma=True)
    with pytest.raises(ValueError, match="transport must be 'nixl'"):
        moe_comm.Buffer.required_workspace_bytes(16, 64, 16, 8, ranks_per_node=8,
                                                 transport="nccl")


def test_nvshmem_workspace_across_hosts_from_ep_16_to_1024():
    """DeepSeek-V3 sizes across hosts over NVSHMEM: the default budget pays for the staging and
    the outboxes the puts read (a row and metadata per slot, a partial per slot of each home);
    the whole workspace stays under 2 GiB, does not grow with max_tokens_per_rank, and its
    outboxes hold one round's slots (the whole batch would take 5 GiB at EP 16)."""
    from moe_comm.workspace import RDMA_REGIONS, WorkspaceLayout, ring_slots_for
    H, K, dtype = 7168, 8, torch.bfloat16
    row, meta = 2 * H, 4 * (1 + 3 * K)

    def per_slot(R):  # both parities: staging, the dispatch outbox, the combine outbox
        return 2 * R * (2 * row + meta + 4 * K) + 2 * (row + meta) + 2 * R * (row + 4 * K)

    def layout(R, T, slots):
        return WorkspaceLayout(R, T, H, 256 // R if R <= 256 else 1, K, dtype, rdma=True,
                               ring_slots=slots)

    for R, rounds in ((16, 3), (64, 12), (256, 52), (1024, 256)):
        E = max(256, R)
        slots = ring_slots_for(None, R, 4096, H, K, dtype, rdma=True)
        assert slots == DEFAULT_STAGING_BYTES // per_slot(R) // 16 * 16, R
        bounded, whole = layout(R, 4096, slots), layout(R, 4096, None)
        assert bounded.rounds == rounds, (R, bounded.rounds)
        outboxes = sum(bounded[name].nbytes for name in RDMA_REGIONS)
        assert outboxes == slots * 2 * ((row + meta) + R * (row + 4 * K)), R
        assert bounded.staging_bytes == slots * per_slot(R) <= DEFAULT_STAGING_BYTES, R
        assert bounded.nbytes < 2 << 30, R
        assert layout(R, 65536, slots).nbytes == bounded.nbytes, R
        assert moe_comm.Buffer.required_workspace_bytes(
            R, H, E, 4096, dtype, K, ranks_per_node=8, transport="nvshmem") == bounded.nbytes, R
        if R == 16:
            assert whole.nbytes > 5 << 30


def test_hierarchical_nodes_in_rounds_match_reference(ranks):
    """2 nodes x 2 ranks through the proxy, hierarchical (the default across nodes), rings of
    two slots per source (6 rounds a call: each round's node messages, forwarding and node
    sums), stragglers, two calls, each checked bit for bit against the reference by the job;
    the rows that cross nodes, are forwarded and stored equal the whole batch's, and each later
    round adds its node counts to every node message and its counts and epoch to every rank of
    the node. With the waits in the kernels every dispatch's rounds after its round 0 run in
    one launch (``kernels.dispatch_rounds`` with HIER: each round's rows for the other node once
    into the outboxes, one descriptor to its forwarder, then the forwarder's pass, in the
    launch), a dispatch in the launches of one round: its bits, bytes, messages and forwarded
    rows are those of the launches per round."""
    pytest.importorskip("nixl_cu13")
    case = Case(4, 16, 128, 4, (9, 0, 5, 12), torch.bfloat16, "zipf", 16, seed=214)
    L, N, calls, rounds = case.num_experts // 4, 2, 2, 6
    later = calls * (rounds - 1)
    budget = slots_budget(case, 2, outboxes=True, ranks_per_node=N)
    runs = {slots: ranks(4).run(nodes_case, case, N, True, iterations=calls, straggle_s=0.02,
                                max_topk=case.topk,
                                staging_bytes=None if slots is None else budget)
            for slots in (None, 2)}
    # waits in the kernels: every dispatch's rounds after its round 0 in one launch
    one_launch = ranks(4).run(with_kernel_waits, nodes_case, case, N, True, iterations=calls,
                              straggle_s=0.02, max_topk=case.topk, staging_bytes=budget)
    for rank, (full, part, one) in enumerate(zip(runs[None], runs[2], one_launch,
                                                 strict=True)):
        got = one["launches"]  # round 0: send, outbox, the forwarder's wait and pass,
        assert all(got[name] == calls for name in (  # received layout; then one
            "dispatch_send", "dispatch_outbox", "dispatch_forward", "received_layout",
            "dispatch_rounds", "ring_positions")) and "dispatch_expand" not in got, (rank, got)
        assert one["internode"] == part["internode"], rank
        for key in ("dispatch_bytes_to_peers", "dispatch_bytes_to_self",
                    "dispatch_bytes_to_outbox", "dispatch_bytes_forwarded",
                    "internode_messages"):
            assert one["stats"][key] == part["stats"][key], (rank, key)
        assert part["ring_slots"] == 2 and full["ring_slots"] == case.max_tokens, rank
        assert full["launches"]["dispatch_forward"] == calls, rank
        assert part["launches"]["dispatch_forward"] == part["launches"]["combine_forward"] \
            == part["launches"]["dispatch_outbox"] == calls * rounds, rank
        # a node message carries the counts of each rank of the node, then the node's rows
        node_counts = 4 * (N * (L + 1) + 1)
        extras = [later * node_counts if p // N != rank // N and p % N == rank % N else 0
                  for p in range(4)]  # to the rail peer of the other node only
        _check_round_extras(rank, part, full, calls, rounds, L, extras,
                            ("dispatch_bytes_to_outbox", "combine_bytes_to_outbox",
                             "dispatch_bytes_forwarded", "combine_bytes_to_forwarders"))


@pytest.mark.parametrize("fmt, in_kernels", [
    (dict(fp8=True, ue8m0=True, combine_dtype="fp8"), False),
    (dict(fp8=None, dispatch_dtype="mxfp8"), False),
    (dict(fp8=None, dispatch_dtype="mxfp8"), True)],
    ids=["fp8-ue8m0", "mxfp8", "mxfp8-one-launch"])
def test_quantized_hierarchical_nodes_in_rounds_of_one_slot(ranks, fmt, in_kernels):
    """Hierarchical across 2 nodes, one slot per source (8 rounds a call): quantized rows
    forwarded as they travel (and FP8 partials summed by the forwarders) bit for bit against
    the reference; with the waits in the kernels, the rounds after round 0 in one launch (the
    send quantizing to MXFP8 into the staging of its node and, once per node, the outboxes for
    the other; its codes and exponent bytes forwarded as they came)."""
    pytest.importorskip("nixl_cu13")
    case = Case(4, 8, 128, 2, (5, 8, 0, 6), torch.bfloat16, "uniform", 1, seed=215)
    job = (with_kernel_waits, nodes_case) if in_kernels else (nodes_case,)
    reports = ranks(4).run(*job, case, 2, True, iterations=1, max_topk=case.topk,
                           staging_bytes=slots_budget(case, 1, outboxes=True, ranks_per_node=2),
                           **fmt)
    forwards = [(r["launches"]["dispatch_forward"], r["launches"].get("dispatch_rounds", 0))
                for r in reports]
    assert forwards == [(1, 1) if in_kernels else (8, 0)] * 4, forwards


@pytest.mark.parametrize("in_kernels", [False, True], ids=["host_waits", "kernel_waits"])
def test_gradients_of_hierarchical_nodes_in_rounds_match_reference_autograd(ranks, in_kernels):
    """float64 forward and backward (the backward's cached dispatch forwards each round as the
    dispatch placed it) in rounds of two slots; with the waits in the kernels every op's
    rounds in one launch, the cached dispatch's too (each round's rows for the other node once
    into the outbox, its forwarder's pass placing them by the handle's slots)."""
    case = Case(4, 16, 64, 4, (5, 3, 0, 6), torch.float64, "uniform", 16, seed=216)
    job = (with_kernel_waits, gradients) if in_kernels else (gradients,)
    reports = ranks(4).run(*job, case, ranks_per_node=2, transport="nixl", hierarchical=True,
                           max_topk=4, staging_bytes=slots_budget(case, 2, outboxes=True,
                                                                  ranks_per_node=2))
    for rank, launches in enumerate(reports):
        if in_kernels:  # a dispatch (round 0 laid out by launches of its own), two combines
            assert (launches["dispatch_forward"], launches["dispatch_rounds"],  # and their
                    launches["combine_rounds"]) == (1, 3, 3), (rank, launches)  # backward
        else:
            assert "dispatch_rounds" not in launches, (rank, launches)



@pytest.mark.parametrize("in_kernels", [False, True], ids=["host_waits", "kernel_waits"])
def test_kills_between_rounds_leave_the_survivors_exact(in_kernels):
    """Fault tolerance in rounds (2 slots per source, 4 rounds a call) on 4 CPU ranks killed
    for real: rank 1 dies after round 0 of its dispatch in call 1, rank 2 after round 0 of its
    combine in call 2; weights renormalised. Every survivor's call equals the reference over
    the survivors (``staging_jobs.rounds_with_failures``: the later windows' rows of rank 1 are
    padding, rank 2's partials reach window 0 only) and the survivors agree on who is gone."""
    R = 4
    case = Case(R, 2 * R, 64, 2, (6, 7, 0, 5), seed=23)
    kills = {1: (1, "dispatch_round"), 2: (2, "combine_round")}
    with fresh_pool(R) as pool:
        results = pool.run(rounds_with_failures, case, kills, 4, 2, TIMEOUT_S,
                           renormalize=True, in_kernels=in_kernels, may_die=tuple(kills))
    survivors = [res for r, res in enumerate(results) if r not in kills]
    assert len(survivors) == 2 and all(res["rounds"] == 4 for res in survivors)
    assert all(res["active"] == [True, False, False, True] for res in survivors), survivors
    # in-kernel waits: every combine's and every dispatch's rounds in one launch, each round
    # deciding who it sums or expands (the dispatch's round 0: its send)
    assert all(res["launches"].get("combine_rounds", 0) == (4 if in_kernels else 0)
               and res["launches"].get("dispatch_rounds", 0) == (4 if in_kernels else 0)
               for res in survivors), [res["launches"] for res in survivors]
    # host waits list who they excluded (rank 2 may be the one that excluded rank 1, before it
    # died itself); in-kernel waits write the mask alone, checked above
    excluded = set().union(*(res["excluded"] for res in survivors))
    assert excluded <= {1, 2} and (in_kernels or excluded), excluded


def test_kills_between_rounds_ep_invariant_in_one_launch():
    """An EP-invariant fault-tolerant Buffer in rounds of 2 slots (4 rounds), waits in the
    kernels, the kills of ``test_kills_between_rounds_leave_the_survivors_exact``: every
    survivor's dispatch and combine in one launch, each round's sources decided once for the
    launch (``kernels.invariant_rounds``), the sums equal ``reference.invariant_combine`` over
    the choices that count (rank 2's in window 0 only)."""
    R = 4
    case = Case(R, 2 * R, 64, 2, (6, 7, 0, 5), seed=23)
    kills = {1: (1, "dispatch_round"), 2: (2, "combine_round")}
    with fresh_pool(R) as pool:
        results = pool.run(rounds_with_failures, case, kills, 4, 2, TIMEOUT_S, in_kernels=True,
                           ep_invariant=True, may_die=tuple(kills))
    survivors = [res for r, res in enumerate(results) if r not in kills]
    assert all(res["active"] == [True, False, False, True] for res in survivors), survivors
    assert all(res["rounds"] == 4 and res["launches"].get("combine_rounds", 0) == 4
               and res["launches"].get("dispatch_rounds", 0) == 4 for res in survivors), \
        [res["launches"] for res in survivors]


@pytest.mark.parametrize("in_kernels, ep_invariant", [(False, False), (True, False),
                                                      (True, True)],
                         ids=["host_waits", "kernel_waits", "kernel_waits_ep_invariant"])
def test_kills_between_rounds_across_nodes(in_kernels, ep_invariant):
    """Two nodes of two ranks, flat through the proxy, 2 slots per source: rank 1 (first node)
    dies after round 0 of its dispatch in call 1, rank 2 (second node) after round 0 of its
    combine in call 2; with host waits its node peer excludes it at once, the other node after
    the timeout; with waits in the kernels every survivor's ops run their rounds in one launch
    (an EP-invariant Buffer's combine too), each excluding it after the timeout on the ranks of
    its node. Every survivor's call equals the reference over the survivors."""
    pytest.importorskip("nixl_cu13")
    R = 4
    case = Case(R, 2 * R, 64, 2, (6, 7, 0, 5), seed=29)
    kills = {1: (1, "dispatch_round"), 2: (2, "combine_round")}
    with fresh_pool(R) as pool:
        results = pool.run(rounds_with_failures, case, kills, 4, 2, TIMEOUT_NODES_S,
                           in_kernels=in_kernels, ep_invariant=ep_invariant,
                           may_die=tuple(kills), ranks_per_node=2, transport="nixl",
                           hierarchical=False)
    survivors = [res for r, res in enumerate(results) if r not in kills]
    assert all(res["rounds"] == 4 for res in survivors), survivors
    assert all(res["active"] == [True, False, False, True] for res in survivors), survivors
    assert all(res["launches"].get("combine_rounds", 0) == (4 if in_kernels else 0)
               and res["launches"].get("dispatch_rounds", 0) == (4 if in_kernels else 0)
               for res in survivors), [res["launches"] for res in survivors]


def test_one_launch_combines_give_the_bits_of_launches_per_round(ranks):
    """Processes with waits in the kernels run a combine in rounds as one launch
    (``kernels.combine_rounds``): with weights (against the oracle), without, FP8 partials and
    per-row values, rounds of one slot and of two, stragglers: the same bits as the launches
    per round of host waits. The cached dispatch (combine's backward) likewise, in one launch
    (``kernels.dispatch_rounds``), each row its source token's gradient. A fault-tolerant
    Buffer (rounds of two slots) too."""
    case = Case(4, 16, 128, 4, (7, 0, 5, 3), routing="zipf", seed=211)
    for slots in (1, 2):
        per_round = ranks(4).run(combine_forms, case, slots, False)
        one_launch = ranks(4).run(combine_forms, case, slots, True, straggle_s=0.02)
        rounds = -(-case.max_tokens // slots)
        for r in range(4):
            assert one_launch[r]["rounds"] == rounds, one_launch[r]
            assert one_launch[r]["digests"] == per_round[r]["digests"], (slots, r)
            # 4 combines a call, 2 calls
            assert one_launch[r]["launches"]["combine_rounds"] == 8, one_launch[r]
            assert "combine_send" not in one_launch[r]["launches"], one_launch[r]
            assert "combine_rounds" not in per_round[r]["launches"], per_round[r]
            assert per_round[r]["launches"]["combine_send"] == 8 * rounds, per_round[r]
            # a dispatch and a cached dispatch a call: each one launch past round 0's send
            # (the cached one sends round 0 in its launch too)
            got = one_launch[r]["launches"]
            assert (got["dispatch_rounds"], got["dispatch_send"]) == (4, 2), got
            assert "dispatch_expand" not in got and "wait" not in got, got
            assert per_round[r]["launches"]["dispatch_send"] == 4 * rounds, per_round[r]
    # fault-tolerant, every rank alive: the same bits, and the same launches (each round's
    # sources decided once for the launch, kernels.comm.wait_or_exclude_once)
    ft = ranks(4).run(combine_forms, case, 2, True, straggle_s=0.02, fault_tolerant=True)
    for r in range(4):
        assert ft[r]["digests"] == per_round[r]["digests"], r
        got = ft[r]["launches"]
        assert (got["dispatch_rounds"], got["dispatch_send"], got["combine_rounds"]) \
            == (4, 2, 8), got
        assert "dispatch_expand" not in got and "wait" not in got, got


def test_one_launch_invariant_combines_give_the_bits_of_launches_per_round(ranks):
    """An EP-invariant Buffer of processes with waits in the kernels runs its combine in rounds
    as one launch (``kernels.invariant_rounds``): with weights, without and with per-row
    values, rounds of one slot, stragglers: the same bits as the launches per round."""
    case = Case(4, 16, 128, 4, (7, 0, 5, 3), routing="zipf", seed=215)
    per_round = ranks(4).run(combine_forms, case, 1, False, ep_invariant=True)
    one_launch = ranks(4).run(combine_forms, case, 1, True, straggle_s=0.02, ep_invariant=True)
    for r in range(4):
        assert one_launch[r]["rounds"] == case.max_tokens, one_launch[r]
        assert one_launch[r]["digests"] == per_round[r]["digests"], r
        # 3 combines a call, 2 calls
        assert one_launch[r]["launches"]["combine_rounds"] == 6, one_launch[r]
        assert "combine_send" not in one_launch[r]["launches"], one_launch[r]
        assert "combine_rounds" not in per_round[r]["launches"], per_round[r]
        assert per_round[r]["launches"]["combine_send"] == 6 * case.max_tokens, per_round[r]


@pytest.mark.parametrize("ep_invariant, hierarchical", [(True, False), (True, True),
                                                       (False, True)],
                         ids=["invariant-flat", "invariant-hierarchical", "hierarchical"])
def test_one_launch_combines_across_nodes_give_the_bits_of_launches_per_round(
        ranks, ep_invariant, hierarchical):
    """2 nodes x 2 ranks through the proxy, rings of two slots (4 rounds a call), waits in the
    kernels: every combine runs its rounds in one launch. The EP-invariant combine, flat and
    hierarchical alike (no forwarder takes part; ``kernels.invariant_rounds``: the rows for
    homes on other nodes into the outboxes, a descriptor each, the epoch after them); the
    hierarchical combine with each round's forwarder pass in the launch
    (``kernels.internode.forward_round``: this node's partials for the other node summed in
    local-rank order, one transfer per node home), its sums against the reference in node order.
    With weights, without, FP8 partials (not EP-invariant) and per-row values, stragglers: the
    bits, bytes and messages of the launches per round."""
    pytest.importorskip("nixl_cu13")
    case = Case(4, 8, 128, 4, (7, 0, 5, 3), routing="zipf", seed=216)
    kw = dict(ep_invariant=ep_invariant, ranks_per_node=2, transport="nixl",
              hierarchical=hierarchical, iterations=1)
    per_round = ranks(4).run(combine_forms, case, 2, False, **kw)
    one_launch = ranks(4).run(combine_forms, case, 2, True, straggle_s=0.02, **kw)
    combines = 3 if ep_invariant else 4  # a call's (combine_forms)
    for r in range(4):
        a, b = one_launch[r], per_round[r]
        assert a["rounds"] == 4 and a["digests"] == b["digests"], r
        assert a["launches"]["combine_rounds"] == combines, a["launches"]
        for name in ("combine_send", "combine_forward", "combine_reduce"):
            assert name not in a["launches"], (name, a["launches"])
        assert "combine_rounds" not in b["launches"], b["launches"]
        assert b["launches"]["combine_send"] == combines * 4, b["launches"]
        assert a["internode"] == b["internode"], r
        for key in ("combine_bytes_to_peers", "combine_bytes_to_self",
                    "combine_bytes_to_outbox", "combine_bytes_to_forwarders",
                    "internode_messages"):
            assert a["stats"][key] == b["stats"][key], (r, key)
    assert sum(sum(rep["internode"]["combine"]) for rep in one_launch) > 0


@pytest.mark.parametrize("op", ["combine", "dispatch"])
def test_one_launch_op_names_a_peer_that_skips_it(ranks, op):
    """A rank skips the op: the others' combine (one launch) or dispatch (its round 0's send
    waits for every source to lay them out) name it within the timeout."""
    case = Case(4, 8, 64, 2, (6, 6, 6, 6), seed=212)
    timeout_s = 2.0
    reports = ranks(4).run(skip_one_op, case, 2, skipper=1, wait_timeout_s=timeout_s, op=op)
    for rank, report in enumerate(reports):
        assert report["rounds"] == 3, report
        if rank == 1:
            assert report["raised"] is None
            continue
        launches = report["launches"]
        if op == "combine":
            assert launches["combine_rounds"] == 1, report
        else:  # named after round 0's send: nothing later launched
            assert launches["dispatch_send"] == 1 and "dispatch_rounds" not in launches \
                and "received_layout" not in launches, report
        assert report["peer"] == 1, report
        assert f"moe_comm rank {rank}" in report["raised"], report
        assert names_rank(report["raised"], 1), report
        assert timeout_s <= report["elapsed_s"] < timeout_s + 5, report


def test_hierarchical_one_launch_combine_names_a_rank_that_skips_it(ranks):
    """2 nodes x 2 ranks through the proxy, hierarchical, waits in the kernels: rank 1 skips the
    combine. Every other rank's one launch fails within the timeout naming a rank: rank 0's
    forwarder pass and rank 3's wait (rank 1 forwards node 0's sums to it) name rank 1; rank 2
    waits for the sums of rank 0, whose pass timed out, and names rank 0."""
    pytest.importorskip("nixl_cu13")
    case = Case(4, 8, 64, 2, (6, 6, 6, 6), seed=218)
    timeout_s = 2.0
    reports = ranks(4).run(skip_one_op, case, 2, skipper=1, wait_timeout_s=timeout_s,
                           op="combine", ranks_per_node=2, transport="nixl", hierarchical=True)
    for rank, report in enumerate(reports):
        assert report["rounds"] == 3, report
        if rank == 1:
            assert report["raised"] is None
            continue
        assert report["launches"]["combine_rounds"] == 1, report
        assert report["peer"] == (0 if rank == 2 else 1), report
        assert f"moe_comm rank {rank}" in report["raised"], report
        assert timeout_s <= report["elapsed_s"] < 2 * timeout_s + 5, report


def test_one_launch_dispatches_give_the_bits_of_launches_per_round(ranks):
    """Processes with waits in the kernels run a dispatch's later rounds as one launch
    (``kernels.dispatch_rounds``): bf16 (against the oracle), FP8 (quantized by the send,
    UE8M0 column-major, pre-quantized), MXFP8, NVFP4 (a global scale, or one per row) and
    ``max_recv_rows``, rounds of one slot and of two, stragglers: the rows, scales, layout and
    handle have the bits of the launches per round."""
    case = Case(4, 16, 256, 4, (7, 2, 0, 5), routing="zipf", seed=213)
    # every format in rounds of one slot (9 calls a process, one after another); in rounds of
    # two slots (where a round's rows of a source sit at two slot offsets) the formats whose
    # rows or scales are laid out differently (bf16, column-major FP8 scales, MXFP8 and NVFP4
    # pre-quantized, the max_recv_rows bound)
    two_slot_forms = ("bf16", "fp8-ue8m0-colmajor", "mxfp8-pair", "nvfp4-triple",
                      "max-recv-rows")
    for slots, iterations, forms in ((1, 1, DISPATCH_FORMS), (2, 1, two_slot_forms)):
        kw = dict(iterations=iterations, forms=forms)
        per_round = ranks(4).run(dispatch_forms, case, slots, False, **kw)
        one_launch = ranks(4).run(dispatch_forms, case, slots, True, straggle_s=0.02, **kw)
        rounds = -(-case.max_tokens // slots)
        calls = iterations * len(forms)
        for r in range(4):
            assert one_launch[r]["rounds"] == rounds, one_launch[r]
            assert one_launch[r]["digests"] == per_round[r]["digests"], (slots, r)
            got = one_launch[r]["launches"]
            assert (got["dispatch_rounds"], got["dispatch_send"]) == (calls, calls) \
                and "dispatch_expand" not in got and "received_layout" not in got, got
            assert "dispatch_rounds" not in per_round[r]["launches"], per_round[r]
            assert per_round[r]["launches"]["dispatch_send"] == calls * rounds, per_round[r]


def test_one_launch_dispatch_names_a_peer_that_stops_after_round_0():
    case = Case(4, 8, 64, 2, (6, 6, 6, 6), seed=214)
    timeout_s = 2.0
    with fresh_pool(4) as pool:
        reports = pool.run(dies_after_round_0, case, 2, victim=3, wait_timeout_s=timeout_s,
                           may_die=(3,))
    assert reports[3] is None  # (killed)
    for rank, report in enumerate(reports[:3]):
        assert report["rounds"] == 3 and report["launches"]["dispatch_rounds"] == 1, report
        assert report["peer"] == 3, report
        assert f"moe_comm rank {rank}" in report["raised"], report
        assert names_rank(report["raised"], 3), report
        assert timeout_s <= report["elapsed_s"] < timeout_s + 5, report


def test_hierarchical_one_launch_dispatch_names_a_rank_that_stops_after_round_0():
    """2 nodes x 2 ranks through the proxy, hierarchical, waits in the kernels: rank 3 sends
    and lays out round 0 of its dispatch, then its process ends. Every other rank's launch of
    the later rounds fails within the timeout naming a rank, and rank 3 in its message: rank
    1's transfer of round 1 to rank 3 (the forwarder of node 1 for it) fails, naming it; rank
    0 waits for rank 3's epoch (forwarded by rank 1, which has failed), rank 2 for rank 1's
    (forwarded by rank 3)."""
    pytest.importorskip("nixl_cu13")
    case = Case(4, 8, 64, 2, (6, 6, 6, 6), seed=219)
    timeout_s = 2.0
    with fresh_pool(4) as pool:
        reports = pool.run(dies_after_round_0, case, 2, victim=3, wait_timeout_s=timeout_s,
                           may_die=(3,), ranks_per_node=2, transport="nixl", hierarchical=True)
    assert reports[3] is None  # (killed)
    for rank, report in enumerate(reports[:3]):
        assert report["rounds"] == 3 and report["launches"]["dispatch_rounds"] == 1, report
        assert report["peer"] == (1 if rank == 2 else 3), report
        assert f"moe_comm rank {rank}" in report["raised"], report
        assert names_rank(report["raised"], report["peer"]) and "rank 3" in report["raised"], \
            report
        assert timeout_s <= report["elapsed_s"] < 2 * timeout_s + 5, report


def test_launches_of_a_calls_rounds_check_their_fault_words():
    """A launch of a call's rounds takes, fault-tolerant, who each round heard ([rounds, R]
    int32) and its decision words (int64), and otherwise neither: anything else is a
    ValueError that names the launch, before anything runs."""
    from moe_comm.kernels.comm import check_round_words

    live = torch.zeros((3, 4), dtype=torch.int32)
    words = torch.zeros(2, dtype=torch.int64)
    check_round_words(True, live, words, 3, 4, "dispatch")
    check_round_words(False, None, None, 3, 4, "dispatch")
    for ft, lv, wd in ((True, None, words), (True, live, None), (False, live, words),
                       (False, None, words)):
        with pytest.raises(ValueError, match="fault-tolerant combine in one launch takes"):
            check_round_words(ft, lv, wd, 3, 4, "combine")
    for lv, wd in ((live[:2], words), (live.long(), words), (live, words.int())):
        with pytest.raises(ValueError, match=r"live must be \[rounds=3, R=4\] int32"):
            check_round_words(True, lv, wd, 3, 4, "dispatch")
