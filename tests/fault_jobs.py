"""Fault-tolerance jobs for CPU ranks: ranks die for real (SIGKILL) and the survivors go on.

``kills`` maps a doomed rank to ``(call, point)``: it dies at call ``call`` at ``point``:

* ``between``: before the call (between two calls);
* ``after_dispatch_send``: after its dispatch sent (its rows and epoch reached everyone),
  before it receives;
* ``in_combine``: normal mode: inside combine, before its partials are sent; low-latency mode:
  after its combine rows were sent, before its receive (the survivors learn at the next call).
  In the normal mode each survivor first fills its combine staging slice of that rank with
  garbage (both parities; at call 1 and later it also holds the rank's stale partials): a sum
  that does not leave the rank out shows.

Every surviving rank checks every call against the reference computed over the survivors:
sources that died before sending left out, choices of experts whose rank did not contribute set
to -1 (neither counted nor renormalised unless asked).
"""
from __future__ import annotations

import os
import signal
import time

import torch

from cases import Case, expert_fn, make_inputs
from ll_jobs import _all_ys, check_recv, new_ll_buffer
from moe_comm import reference
from rank_jobs import FIELDS, kernel_waits, new_buffer

_SENT = ("after_dispatch_send", "in_combine")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _dead(kills: dict, it: int, points: tuple) -> set[int]:
    """Ranks dead by call ``it``: died at an earlier call, or at this one at one of ``points``."""
    return {r for r, (k, p) in kills.items() if k < it or (k == it and p in points)}


def survivors_inputs(case: Case, it: int, no_source: set[int], no_expert: set[int],
                     pin: int | None = None):
    """Inputs of call ``it`` as the survivors see them: ranks in ``no_source`` sent nothing,
    choices of experts on ranks in ``no_expert`` are -1. ``pin``: token 0 of every rank picks
    only experts of rank ``pin`` (needs topk <= experts per rank). Returns ``(xs, idxs, ws,
    original idxs)``."""
    xs, idxs, ws = make_inputs(case, it)
    L = case.num_experts // case.world_size
    if pin is not None:
        for idx in idxs:
            if idx.shape[0]:
                idx[0] = torch.arange(pin * L, pin * L + case.topk)
    original = [idx.clone() for idx in idxs]
    gone = torch.tensor(sorted(no_expert), dtype=torch.int64)
    for s in range(case.world_size):
        owner = idxs[s].clamp(min=0) // L
        idxs[s] = torch.where((idxs[s] >= 0) & torch.isin(owner, gone), -1, idxs[s])
        if s in no_source:
            xs[s], idxs[s], original[s] = xs[s][:0], idxs[s][:0], original[s][:0]
            ws[s] = ws[s][:0]
    return xs, idxs, ws, original


def _renormalised(out, idx_all, idx_kept, w):
    """The expected ``renormalize=True`` output from the plain one."""
    total = (w * (idx_all >= 0)).sum(1)
    kept = (w * (idx_kept >= 0)).sum(1)
    factor = torch.where(kept != 0, total / torch.where(kept != 0, kept, 1), 0)
    return (out.float() * factor[:, None]).to(out.dtype)


def _doom(buf, kills: dict, rank: int, it: int) -> None:
    """Arms this rank's death at call ``it`` (normal mode); on the others, garbage where the
    partials of a rank dying inside this call's combine would be."""
    for r, (k, point) in kills.items():
        if r != rank and (k, point) == (it, "in_combine"):
            buf.layout.view(buf.heap, "combine_rows")[:, r].view(torch.uint8).fill_(0xFF)
    if kills.get(rank, (None,))[0] != it:
        return
    point = kills[rank][1]
    if point == "between":
        _die()
    if point == "after_dispatch_send":
        send = buf.normal_engine.dispatch_send

        def send_then_die(*args, **kwargs):
            pending = send(*args, **kwargs)
            _die()
            return pending

        buf.normal_engine.dispatch_send = send_then_die
    if point == "in_combine":
        buf.normal_engine.combine_send = lambda *args, **kwargs: _die()


def normal_mode_with_failures(rank, world_size, case: Case, kills: dict, calls: int,
                              timeout_s: float, renormalize: bool = False, pin: int | None = None,
                              in_kernels: bool = False, ll_case: Case | None = None,
                              ll_kills: dict | None = None, clean_after: bool = False,
                              **buffer_kwargs) -> dict:
    """``calls`` dispatch + combine calls with ``kills``; each survivor's call checked. Returns
    the call times, this rank's ``active_ranks()`` and exclusions. ``ll_case``: also a
    low-latency Buffer built at the start, run afterwards: the dead ranks are found again (they
    died "between" calls there), and ``ll_kills`` die in it (3 calls, or the call of the last
    death and 20 more). ``clean_after``: then ``clean_mask()`` and one more call.
    ``buffer_kwargs``: e.g. nodes."""
    with kernel_waits(in_kernels):
        buf = new_buffer(case, fault_tolerant=True, timeout_s=timeout_s, **buffer_kwargs)
        ll_buf = (new_ll_buffer(ll_case, fault_tolerant=True, timeout_s=timeout_s,
                                **buffer_kwargs) if ll_case else None)
    seconds = []
    for it in range(calls):
        _doom(buf, kills, rank, it)
        no_source = _dead(kills, it, ("between",))
        no_expert = _dead(kills, it, ("between",) + _SENT)
        xs, idxs, ws, original = survivors_inputs(case, it, no_source, no_expert, pin)
        start = time.monotonic()
        res = buf.dispatch(xs[rank], original[rank], ws[rank])  # the Buffer drops the dead
        y = expert_fn(res.x, res.expert_offsets)
        out = buf.combine(y, res.handle, weights=res.weights, renormalize=renormalize)
        seconds.append(time.monotonic() - start)
        want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts)
        for field in FIELDS:
            a, b = getattr(res, field), getattr(want[rank], field)
            assert torch.equal(a, b), f"rank {rank} call {it}: {field} differs"
        ys = [expert_fn(w.x, w.expert_offsets) for w in want]
        want_out = reference.combine_all(ys, [w.handle for w in want], [w.weights for w in want])
        want_out = want_out[rank]
        if renormalize:
            want_out = _renormalised(want_out, original[rank], idxs[rank], ws[rank])
        assert torch.equal(out, want_out), f"rank {rank} call {it}: combine differs"
        if pin is not None and pin in no_expert and out.shape[0]:
            assert not out[0].any(), f"rank {rank} call {it}: a token of a dead rank's experts"
    report = dict(seconds=seconds, active=buf.active_ranks().tolist(),
                  excluded=sorted({r for r, _, _ in buf.exclusions}),
                  waited=[w for _, _, w in buf.exclusions])
    if clean_after:
        report["cleaned"] = buf.clean_mask().tolist()
        _checked_call(buf, case, rank, calls, set(kills))
    if ll_buf is not None:
        ll_kills = ll_kills or {}
        ll_calls_n = max(k for k, _ in ll_kills.values()) + 21 if ll_kills else 3
        ll = ll_calls(rank, ll_case, ll_buf, {**{r: (0, "between") for r in kills}, **ll_kills},
                      ll_calls_n)
        report.update(ll_seconds=ll["seconds"], ll_active=ll["active"])
    return report


def ll_calls(rank, case: Case, buf, kills: dict, calls: int, fp8: bool = False,
             renormalize: bool = False) -> dict:
    """``calls`` low-latency dispatch + combine calls on ``buf`` with ``kills``, checked."""
    seconds = []
    for it in range(calls):
        doomed = kills.get(rank, (None, None))
        if doomed == (it, "between"):
            _die()
        no_source = _dead(kills, it, ("between",))
        no_expert = _dead(kills, it, ("between", "after_dispatch_send"))
        xs, idxs, ws, _ = survivors_inputs(case, it, no_source, set())
        _, idxs_c, _, _ = survivors_inputs(case, it, no_source, no_expert)
        start = time.monotonic()
        recv, hook = buf.low_latency_dispatch(xs[rank], make_inputs(case, it)[1][rank],
                                              fp8=fp8, return_hook=True)
        if doomed == (it, "after_dispatch_send"):
            _die()
        hook()
        ys, refs = _all_ys(case, xs, idxs, fp8, it)
        out, chook = buf.low_latency_combine(ys[rank], make_inputs(case, it)[1][rank],
                                             ws[rank], recv.handle, return_hook=True,
                                             renormalize=renormalize)
        if doomed == (it, "in_combine"):
            _die()
        chook()
        seconds.append(time.monotonic() - start)
        check_recv(rank, case, it, recv, xs, idxs, fp8)
        want = reference.low_latency_combine_all(ys, idxs_c, ws, refs, case.max_tokens)[rank]
        if renormalize:
            want = _renormalised(want, make_inputs(case, it)[1][rank], idxs_c[rank], ws[rank])
        assert torch.equal(out, want), f"rank {rank} call {it}: low-latency combine differs"
    return dict(seconds=seconds, active=buf.active_ranks().tolist(),
                excluded=sorted({r for r, _, _ in buf.exclusions}))


def low_latency_with_failures(rank, world_size, case: Case, kills: dict, calls: int,
                              timeout_s: float, fp8: bool = False, in_kernels: bool = False,
                              renormalize: bool = False, by_timeout: bool = False,
                              **buffer_kwargs) -> dict:
    """``by_timeout``: dead processes are found by the timeout alone (not by their pid)."""
    with kernel_waits(in_kernels):
        buf = new_ll_buffer(case, fault_tolerant=True, timeout_s=timeout_s, **buffer_kwargs)
    if by_timeout:
        buf.fault.peer_pids = {}
    return ll_calls(rank, case, buf, kills, calls, fp8, renormalize)


def _checked_call(buf, case: Case, rank: int, it: int, gone: set[int]) -> None:
    """One dispatch + combine of call ``it`` checked against the reference without ``gone``
    (neither as sources nor as experts)."""
    xs, idxs, ws, original = survivors_inputs(case, it, gone, gone)
    res = buf.dispatch(xs[rank], original[rank], ws[rank])
    y = expert_fn(res.x, res.expert_offsets)
    out = buf.combine(y, res.handle, weights=res.weights)
    want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts)
    for field in FIELDS:
        assert torch.equal(getattr(res, field), getattr(want[rank], field)), (rank, it, field)
    ys = [expert_fn(w.x, w.expert_offsets) for w in want]
    want_out = reference.combine_all(ys, [w.handle for w in want], [w.weights for w in want])
    assert torch.equal(out, want_out[rank]), f"rank {rank} call {it}: combine differs"


def stale_rank_readmitted(rank, world_size, case: Case, slow: int, timeout_s: float) -> dict:
    """Rank ``slow`` stops (SIGSTOP) inside call 1, after its layout passed the exclusion check
    and before it wrote any row; the others exclude it and go on; rank 0 continues it after
    call 2, so its call-1 rows and epoch land in the others' staging while they run calls 3-5
    (a stale write: it must change nothing there). It then finds itself excluded
    (RankExcludedError), everyone calls ``clean_mask(readmit=True)`` and calls 6-8 run on all
    ranks again."""
    import torch.distributed as dist

    from moe_comm.fault import RankExcludedError

    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    buf = new_buffer(case, fault_tolerant=True, timeout_s=timeout_s)
    _checked_call(buf, case, rank, 0, set())
    refused = None
    if rank == slow:
        from moe_comm.kernels import dispatch

        send = dispatch.dispatch_send

        def stop_then_send(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGSTOP)  # the layout (the check) has run
            return send(*args, **kwargs)

        dispatch.dispatch_send = stop_then_send
        try:
            _checked_call(buf, case, rank, 1, set())
        except RankExcludedError as error:
            refused = str(error)
        dispatch.dispatch_send = send
    else:
        for it in range(1, 6):
            _checked_call(buf, case, rank, it, {slow})
            if rank == 0 and it == 2:
                os.kill(pids[slow], signal.SIGCONT)
    active = buf.clean_mask(readmit=True).tolist()
    for it in range(6, 9):
        _checked_call(buf, case, rank, it, set())
    return dict(refused=refused, active=active, after=buf.active_ranks().tolist())


def masked_on_purpose(rank, world_size, case: Case, ll_case: Case, masked: int) -> dict:
    """Every rank masks rank ``masked`` (maintenance): the others' calls go on without it and
    its own calls are refused; ``clean_mask(readmit=True)`` takes it back. Both modes; nobody
    waits for a timeout."""
    import torch.distributed as dist

    from moe_comm.fault import RankExcludedError

    buf = new_buffer(case, fault_tolerant=True)
    ll = new_ll_buffer(ll_case, fault_tolerant=True)
    report = {}
    for b in (buf, ll):
        b.mask_rank(masked)
    dist.barrier()   # every mark has landed before anyone calls
    if rank == masked:
        for name, call in (("normal", lambda: _checked_call(buf, case, rank, 0, set())),
                           ("low_latency", lambda: ll_calls(rank, ll_case, ll, {}, 1))):
            try:
                call()
            except RankExcludedError as error:
                report[name] = str(error)
    else:
        for it in range(2):
            _checked_call(buf, case, rank, it, {masked})
        ll_calls(rank, ll_case, ll, {masked: (0, "between")}, 2)
    report["active"] = [b.active_ranks().tolist() for b in (buf, ll)]
    report["cleaned"] = [b.clean_mask(readmit=True).tolist() for b in (buf, ll)]
    for it in range(2, 4):
        _checked_call(buf, case, rank, it, set())
    ll_calls(rank, ll_case, ll, {}, 2)
    report["launches"] = dict(buf.launches)
    buf.close()
    ll.close()
    return report


def late_mark_readmitted(rank, world_size, case: Case, marker: int, marked: int,
                         delay_s: float) -> list:
    """``marker`` masks ``marked`` only after the others have entered
    ``clean_mask(readmit=True)``, then calls it too: its mark lands on them after their clean
    began, and still every view ends all active."""
    import torch.distributed as dist

    buf = new_buffer(case, fault_tolerant=True)
    dist.barrier()
    if rank == marker:
        time.sleep(delay_s)
        buf.mask_rank(marked)
    active = buf.clean_mask(readmit=True).tolist()
    _checked_call(buf, case, rank, 0, set())
    buf.close()
    return active


def no_failure_costs(rank, world_size, case: Case, in_kernels: bool) -> dict:
    """Launches and host reads of two calls per mode, with and without fault tolerance."""
    out = {}
    for ft in (False, True):
        with kernel_waits(in_kernels):
            buf = new_buffer(case, fault_tolerant=ft)
            ll = new_ll_buffer(case, fault_tolerant=ft)
        for it in range(2):
            _checked_call(buf, case, rank, it, set())
        ll_calls(rank, case, ll, {}, 2)
        out[ft] = (dict(buf.launches), dict(buf.host_syncs), dict(ll.launches),
                   dict(ll.host_syncs))
        buf.close()
        ll.close()
    return out
