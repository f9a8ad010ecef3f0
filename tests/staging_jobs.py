"""Jobs on CPU ranks for a normal mode whose staging is bounded (``staging_bytes``): every call
runs in rounds through rings of a few slots per source."""
from __future__ import annotations

import dataclasses
import functools
import random
import time

import torch
import torch.distributed as dist
from fault_jobs import _die, _renormalised, survivors_inputs

import moe_comm
from cases import Case, expert_fn, make_inputs
from moe_comm import microscale, reference
from moe_comm.workspace import COMBINE, DISPATCH, staging_slot_bytes
from rank_jobs import (
    FIELDS,
    _digest,
    check_against_oracle,
    kernel_waits,
    new_buffer,
    record_failure,
)


def slots_budget(case: Case, slots: int, outboxes: bool = False,
                 ranks_per_node: int | None = None, invariant: bool = False) -> int:
    """The ``staging_bytes`` that pays for ``slots`` slots per source of ``case`` (``outboxes``:
    of a Buffer across nodes through the proxy; with ``ranks_per_node``, hierarchical;
    ``invariant``: of an EP-invariant Buffer)."""
    return slots * staging_slot_bytes(case.world_size, case.hidden, case.topk, case.dtype,
                                      outboxes, ranks_per_node, invariant=invariant)


def streamed_case(rank, world_size, case: Case, slots: int | None, iterations: int = 1,
                  straggle_s: float = 0.0, in_kernels: bool = False) -> dict:
    """Dispatch + combine ``iterations`` times (new routing each time, random per-rank delays
    around each op), each result checked against the all-ranks oracle; ``slots`` None stages
    the whole batch. Returns the rounds, one digest per iteration and the byte counters."""
    delay = random.Random(1000 * case.seed + rank)
    digests = []
    budget = None if slots is None else slots_budget(case, slots)
    with kernel_waits(in_kernels), moe_comm.Buffer(
            dist.group.WORLD, hidden=case.hidden, num_experts=case.num_experts,
            max_tokens_per_rank=case.max_tokens, dtype=case.dtype, max_topk=case.topk,
            staging_bytes=budget) as buf:
        for it in range(iterations):
            xs, idxs, ws = make_inputs(case, it)
            w = ws[rank] if ws is not None else None
            time.sleep(delay.uniform(0, straggle_s))
            res = buf.dispatch(xs[rank], idxs[rank], w, expert_alignment=case.alignment)
            time.sleep(delay.uniform(0, straggle_s))
            out = buf.combine(expert_fn(res.x, res.expert_offsets), res.handle,
                              weights=res.weights)
            check_against_oracle(rank, case, it, res, out, xs, idxs, ws)
            digests.append(_digest(res.x, res.weights, res.src_rank, res.src_token, out))
        return {"rounds": buf.rounds, "ring_slots": buf.ring_slots, "digests": digests,
                "stats": buf.stats(), "launches": dict(buf.launches),
                "staging_bytes": buf.staging_bytes, "workspace_bytes": buf.workspace_bytes}


def _die_in_round(buf, phase: str) -> None:
    """This rank's ``phase`` ("dispatch" or "combine") sends its round 0, then the process ends
    (SIGKILL) where round 1 would be sent (this rank's call launches per round to do so; its
    peers' may run their rounds in one launch: the rounds are the same on the link)."""
    engine = buf.normal_engine
    send = getattr(engine, f"{phase}_send")
    table = f"{phase}_in_one_launch"
    engine.plan = dataclasses.replace(engine.plan, **{
        table: dict.fromkeys(getattr(engine.plan, table), False)})

    def send_then_die_in_round_1(*args, **kwargs):
        pending = send(*args, **kwargs)
        later = pending.send_round

        def round_or_die(i):
            if i == 1:
                _die()
            later(i)

        pending.send_round = round_or_die
        return pending

    setattr(engine, f"{phase}_send", send_then_die_in_round_1)


def rounds_with_failures(rank, world_size, case: Case, kills: dict, calls: int, slots: int,
                         timeout_s: float, renormalize: bool = False, in_kernels: bool = False,
                         ep_invariant: bool = False, **nodes) -> dict:
    """Fault tolerance in rounds: ``calls`` dispatch + combine calls of a Buffer whose staging
    holds ``slots`` slots per source; ``kills`` maps a rank to ``(call, point)``, point
    "dispatch_round" (it dies after round 0 of its dispatch send) or "combine_round" (after
    round 0 of its combine send). Each survivor checks every call against the reference over
    the survivors: a source that stops after round 0 leaves its rows of later windows as
    padding rows (zero, src_rank / src_token -1; still counted in tokens_per_expert); an expert
    rank that stops after round 0 of the combine contributes to the tokens of window 0 only.
    Before the call of a death the survivors fill that rank's staging slice of the parity of
    round 1 (dispatch or combine, where it stops) with garbage: a round that reads it shows.
    ``nodes``: across nodes through the proxy (``ranks_per_node``, ``transport="nixl"``).
    ``ep_invariant``: an EP-invariant Buffer, its combine against ``reference.invariant_combine``
    over the choices that count."""
    with kernel_waits(in_kernels):
        buf = new_buffer(case, fault_tolerant=True, timeout_s=timeout_s, max_topk=case.topk,
                         staging_bytes=slots_budget(case, slots, outboxes=bool(nodes),
                                                    invariant=ep_invariant),
                         ep_invariant=ep_invariant, **nodes)
    W = buf.ring_slots
    for it in range(calls):
        stops = {r: p for r, (k, p) in kills.items() if k == it}
        gone = {r for r, (k, _) in kills.items() if k < it}
        if rank in stops:
            _die_in_round(buf, stops[rank].split("_")[0])
        for r, point in stops.items():  # the parity of round 1 (of the phase it stops in):
            if r != rank:                 # its other parity may already hold its round 0
                phase = point.split("_")[0]
                parity = (buf.channels.epochs[DISPATCH if phase == "dispatch" else COMBINE] + 2) % 2
                view = buf.layout.view(buf.heap, f"{phase}_rows")
                view[parity, r].view(torch.uint8).fill_(0xFF)
        no_expert = gone | {r for r, p in stops.items() if p == "dispatch_round"}
        late = {r for r, p in stops.items() if p == "combine_round"}
        xs, idxs, ws, original = survivors_inputs(case, it, gone, no_expert)
        _, idxs_late, _, _ = survivors_inputs(case, it, gone, no_expert | late)
        res = buf.dispatch(xs[rank], original[rank], ws[rank])
        y = expert_fn(res.x, res.expert_offsets)
        out = buf.combine(y, res.handle, weights=res.weights, renormalize=renormalize)
        want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts)
        mine = want[rank]
        cut = torch.zeros(mine.src_rank.shape, dtype=torch.bool)
        for r, p in stops.items():
            if p == "dispatch_round":
                cut |= (mine.src_rank == r) & (mine.src_token >= W)
        expect = {f: getattr(mine, f).clone() for f in FIELDS}
        expect["x"][cut] = 0
        expect["weights"][cut] = 0
        expect["src_rank"][cut] = -1
        expect["src_token"][cut] = -1
        for field in FIELDS:
            assert torch.equal(getattr(res, field), expect[field]), \
                f"rank {rank} call {it}: {field} differs"
        first = (torch.arange(out.shape[0]) < W)[:, None]
        if ep_invariant:  # each choice's row as expert_fn makes it, the choices that count
            L = case.num_experts // case.world_size
            e = (original[rank].clamp(min=0) % L).float()[..., None]
            rows = (xs[rank].float()[:, None] * (1 + e / 8) + e).to(case.dtype)
            counts = torch.where(first, idxs[rank] >= 0, idxs_late[rank] >= 0)
            want = reference.invariant_combine(rows, original[rank], ws[rank], counts=counts)
            assert torch.equal(out, want), f"rank {rank} call {it}: combine differs"
            continue
        outs = []
        for kept in (idxs, idxs_late):
            ref = reference.dispatch_all(xs, kept, ws, num_experts=case.num_experts)
            ys = [expert_fn(w.x, w.expert_offsets) for w in ref]
            o = reference.combine_all(ys, [w.handle for w in ref], [w.weights for w in ref])[rank]
            outs.append(_renormalised(o, original[rank], kept[rank], ws[rank])
                        if renormalize else o)
        assert torch.equal(out, torch.where(first, outs[0], outs[1])), \
            f"rank {rank} call {it}: combine differs"
    return {"active": buf.active_ranks().tolist(), "rounds": buf.rounds,
            "excluded": sorted({r for r, _, _ in buf.exclusions}),
            "launches": dict(buf.launches)}


def _bounded_buffer(case: Case, slots: int, in_kernels: bool = True, **kwargs):
    """A Buffer whose staging holds ``slots`` slots per source (``in_kernels``: waits in the
    kernels; ``kwargs`` more of the Buffer's arguments: with ``ranks_per_node`` across nodes,
    through the proxy)."""
    N = kwargs.get("ranks_per_node") or case.world_size
    budget = slots_budget(case, slots, outboxes=N < case.world_size,
                          ranks_per_node=N if kwargs.get("hierarchical") else None,
                          invariant=kwargs.get("ep_invariant", False))
    with kernel_waits(in_kernels):
        return new_buffer(case, max_topk=case.topk, staging_bytes=budget, **kwargs)


def combine_forms(rank, world_size, case: Case, slots: int, in_kernels: bool,
                  iterations: int = 2, straggle_s: float = 0.0, ep_invariant: bool = False,
                  fault_tolerant: bool = False, **buffer_kwargs) -> dict:
    """Every form of a combine in rounds of ``slots`` slots, ``iterations`` times (new routing
    each time, random delays before each combine): with weights (checked against the oracle),
    without, with FP8 partials, and the per-row values of dispatch's backward
    (``moe_comm.ops``: the router weights' gradient); then combine's backward, the cached
    dispatch of a gradient. ``in_kernels``: waits in the kernels, so a Buffer of processes
    runs each combine and each cached dispatch as one launch (``kernels.combine_rounds``,
    ``kernels.dispatch_rounds``); host waits launch per round. ``ep_invariant``: an
    EP-invariant Buffer (``kernels.invariant_rounds`` in one launch; its sums are in choice
    order, so only the dispatch is checked against the oracle, and it has no FP8 partials).
    ``fault_tolerant``: a fault-tolerant Buffer (every rank alive: the same bits).
    ``buffer_kwargs``: more of the Buffer's arguments (nodes through the proxy). Returns the
    digests, the launches and the byte counters."""
    delay = random.Random(2000 * case.seed + rank)
    digests = []
    with _bounded_buffer(case, slots, in_kernels, ep_invariant=ep_invariant,
                         fault_tolerant=fault_tolerant, **buffer_kwargs) as buf:
        for it in range(iterations):
            xs, idxs, ws = make_inputs(case, it)
            res = buf.dispatch(xs[rank], idxs[rank], ws[rank], expert_alignment=case.alignment)
            y = expert_fn(res.x, res.expert_offsets)
            time.sleep(delay.uniform(0, straggle_s))
            out = buf.combine(y, res.handle, weights=res.weights)
            check_against_oracle(rank, case, it, res, None if ep_invariant else out, xs, idxs,
                                 ws, hierarchical_nodes=buf.ranks_per_node if buf.hierarchical
                                 else None)
            time.sleep(delay.uniform(0, straggle_s))
            plain = buf.combine(y, res.handle)
            fp8 = None if ep_invariant else buf.combine(y, res.handle, weights=res.weights,
                                                        combine_dtype="fp8")
            values = torch.linspace(-1, 1, res.x.shape[0]) * (rank + 1)
            h = res.handle
            pair_sum, pairs = torch.ops.moe_comm.combine(
                buf.id, y, res.weights, values, h.slot_of, h.slot_rows, h.recv_slot_offsets,
                *h.node_tensors(), topk_idx=h.topk_idx, src_token=h.src_token)
            # a gradient of each source's tokens (exact in every dtype): row t of rank s is
            # base[t] * (s + 1) * (it + 1); each received row must be its source token's
            base = ((torch.arange(case.max_tokens * case.hidden) % 11) * 0.125 - 0.5).reshape(
                case.max_tokens, case.hidden)
            grad = (base[:xs[rank].shape[0]] * (rank + 1) * (it + 1)).to(case.dtype)
            time.sleep(delay.uniform(0, straggle_s))
            backward = torch.ops.moe_comm.dispatch_cached(
                buf.id, grad, h.slot_of, h.slot_rows, h.recv_slot_offsets,
                res.tokens_per_expert, res.expert_offsets, res.x.shape[0], *h.node_tensors())
            real = res.src_rank >= 0
            want = torch.where(real[:, None], base[res.src_token.clamp(min=0)]
                               * (res.src_rank[:, None] + 1) * (it + 1), 0).to(case.dtype)
            assert torch.equal(backward, want), (rank, it)
            digests.append(_digest(out, plain, fp8, pair_sum, pairs, backward))
        return {"digests": digests, "launches": dict(buf.launches), "rounds": buf.rounds,
                "stats": buf.stats(), "internode": buf.internode_bytes()}


def skip_one_op(rank, world_size, case: Case, slots: int, skipper: int, wait_timeout_s: float,
                op: str, **buffer_kwargs) -> dict:
    """Waits in the kernels, rounds of ``slots`` slots: ``skipper`` does not run ``op``
    ("dispatch": nobody's round 0 arrives from it; "combine": every rank dispatches first);
    the others' op (its waits in round 0's send and one launch) must fail within the timeout,
    naming it (``buffer_kwargs``: more of the Buffer's arguments, nodes through the proxy)."""
    xs, idxs, ws = make_inputs(case)
    buf = _bounded_buffer(case, slots, timeout_s=wait_timeout_s, **buffer_kwargs)
    report = {"raised": None, "rounds": buf.rounds}
    dispatch = functools.partial(buf.dispatch, xs[rank], idxs[rank], ws[rank])
    res = dispatch() if op == "combine" else None
    if rank != skipper:
        record_failure(report, dispatch if op == "dispatch" else lambda: buf.combine(
            expert_fn(res.x, res.expert_offsets), res.handle, weights=res.weights))
        report["launches"] = dict(buf.launches)
    dist.barrier()
    buf.close()
    return report


DISPATCH_FORMS = ("bf16", "fp8", "fp8-ue8m0-colmajor", "fp8-pair", "mxfp8", "mxfp8-pair",
                  "nvfp4", "nvfp4-triple", "max-recv-rows")


def _dispatch_form(buf, case: Case, rank: int, form: str, x, idx, w):
    """``buf.dispatch`` of this rank's tokens in ``form`` (``DISPATCH_FORMS``)."""
    kwargs = {"fp8": dict(fp8=True),
              "fp8-ue8m0-colmajor": dict(fp8=True, ue8m0=True, col_major_scales=True),
              "fp8-pair": dict(fp8=True), "mxfp8": dict(dispatch_dtype="mxfp8"),
              "mxfp8-pair": dict(dispatch_dtype="mxfp8"),
              "nvfp4": dict(dispatch_dtype="nvfp4", global_scale=torch.tensor([0.05])),
              "nvfp4-triple": dict(dispatch_dtype="nvfp4"),
              "max-recv-rows": dict(max_recv_rows=4 * case.max_tokens * case.topk)}.get(form, {})
    sent = x
    if form == "fp8-pair":
        sent = reference.quantize_fp8(x)
    elif form == "mxfp8-pair":
        sent = microscale.quantize_mxfp8(x)
    elif form == "nvfp4-triple":  # a global scale per row, as after an earlier receive
        q, s, g = microscale.quantize_nvfp4(x)
        sent = (q, s, g.expand(q.shape[0]).contiguous())
    return buf.dispatch(sent, idx, w, expert_alignment=case.alignment, **kwargs)


def dispatch_forms(rank, world_size, case: Case, slots: int, in_kernels: bool,
                   iterations: int = 2, straggle_s: float = 0.0,
                   forms: tuple = DISPATCH_FORMS) -> dict:
    """Each format in ``forms`` of a dispatch in rounds of ``slots`` slots (``DISPATCH_FORMS``),
    ``iterations`` times with new routing and random delays; the bf16 one checked against the
    oracle with its combine. ``in_kernels``: waits in the kernels, so a Buffer of processes
    runs a dispatch's later rounds as one launch (``kernels.dispatch_rounds``); host waits
    launch per round. Returns a digest per call and form, and the launches."""
    delay = random.Random(3000 * case.seed + rank)
    digests = []
    with _bounded_buffer(case, slots, in_kernels) as buf:
        for it in range(iterations):
            xs, idxs, ws = make_inputs(case, it)
            for form in forms:
                time.sleep(delay.uniform(0, straggle_s))
                res = _dispatch_form(buf, case, rank, form, xs[rank], idxs[rank], ws[rank])
                out = buf.combine(expert_fn(res.x, res.expert_offsets), res.handle,
                                  weights=res.weights) if form == "bf16" else None
                if form == "bf16":
                    check_against_oracle(rank, case, it, res, out, xs, idxs, ws)
                scales = getattr(res, "x_scales", None)  # (column-major: read row by row)
                scales = None if scales is None else scales.reshape(-1).clone()
                digests.append(_digest(res.x.view(torch.uint8), scales, res.weights,
                                       res.src_rank, res.src_token, res.expert_offsets,
                                       res.handle.recv_slot_offsets, res.handle.slot_rows,
                                       getattr(res, "x_global_scale", None), out))
        return {"digests": digests, "launches": dict(buf.launches), "rounds": buf.rounds}


def dies_after_round_0(rank, world_size, case: Case, slots: int, victim: int,
                       wait_timeout_s: float, **buffer_kwargs) -> dict:
    """Waits in the kernels, rounds of ``slots`` slots, no fault tolerance: ``victim`` sends
    and lays out round 0 of its dispatch, then its process ends (SIGKILL) where the launch of
    the later rounds would start. The others' launch (``kernels.dispatch_rounds``) must fail
    within the timeout, naming it (``buffer_kwargs``: more of the Buffer's arguments, nodes
    through the proxy)."""
    xs, idxs, ws = make_inputs(case)
    buf = _bounded_buffer(case, slots, timeout_s=wait_timeout_s, **buffer_kwargs)
    report = {"raised": None, "rounds": buf.rounds}
    if rank == victim:
        buf.normal_engine._dispatch_rounds = lambda *args, **kwargs: _die()
    record_failure(report, lambda: buf.dispatch(xs[rank], idxs[rank], ws[rank]))
    report["launches"] = dict(buf.launches)
    return report
