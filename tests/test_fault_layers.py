"""Each layer of the fault-tolerance exclusion alone, on virtual ranks (``Buffer.loopback``).

Three places keep an excluded rank out of a call, and in a whole run they cover for each
other, so each is tested where the others cannot help:

* the combine's sum (``kernels.combine``, ``live``): a rank excluded *after* the dispatch (the
  layout still sent it rows), whose partials never come; its staging slice holds stale rows of
  earlier calls and garbage;
* the layout's destinations (``kernels.layout``, ``mask[d]``): nothing is stored into an
  excluded rank's staging;
* the layout's self-fence (``mask[me]``): an excluded rank whose host does not read the mask
  (as on a GPU) stores nothing into anyone's staging and its call raises RankExcludedError.
"""
import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from fault_jobs import survivors_inputs

import moe_comm
from cases import Case, expert_fn, make_inputs
from moe_comm import reference
from moe_comm.fault import RankExcludedError
from moe_comm.kernels import comm
from moe_comm.ops import wrap_dispatch_outputs
from moe_comm.testing import lockstep
from rank_jobs import FIELDS, kernel_waits

CASE = Case(4, 16, 256, 2, (6, 5, 7, 5), seed=61)
DEAD = 3
GARBAGE = 0xFF  # every byte: NaN in bf16, fp32 and e4m3 alike


def _buffers(in_kernels: bool):
    with kernel_waits(in_kernels):
        return moe_comm.Buffer.loopback(CASE.world_size, CASE.hidden, CASE.num_experts,
                                        CASE.max_tokens, CASE.dtype, fault_tolerant=True,
                                        timeout_s=30.0)


def _full_call(bufs, it: int) -> None:
    xs, idxs, ws = make_inputs(CASE, it)
    got = lockstep.dispatch(bufs, xs, idxs, ws)
    ys = [expert_fn(g.x, g.expert_offsets) for g in got]
    lockstep.combine(bufs, ys, [g.handle for g in got], [g.weights for g in got])


def _fill(buf, region: str, source: int | None = None) -> torch.Tensor:
    """Both parities of ``region`` on ``buf`` (only source ``source``'s slice if given) set to
    garbage; returns the view."""
    view = buf.layout.view(buf.heap, region)
    part = view if source is None else view[:, source]
    part.view(torch.uint8).fill_(GARBAGE)
    return part


def _untouched(part: torch.Tensor) -> bool:
    return bool((part.view(torch.uint8) == GARBAGE).all())


def _reference(it: int, no_source: set, no_expert: set, combine_dtype=None):
    """(dispatch results, combine outputs) of call ``it`` over the survivors."""
    xs, idxs, ws, _ = survivors_inputs(CASE, it, no_source, no_expert)
    want = reference.dispatch_all(xs, idxs, ws, num_experts=CASE.num_experts)
    ys = [expert_fn(w.x, w.expert_offsets) for w in want]
    outs = reference.combine_all(ys, [w.handle for w in want], [w.weights for w in want],
                                 combine_dtype=combine_dtype)
    return want, outs


@pytest.mark.parametrize("in_kernels", [False, True], ids=["host_waits", "kernel_waits"])
@pytest.mark.parametrize("combine_dtype", [None, "fp8"])
def test_combine_leaves_out_a_rank_excluded_after_its_rows_were_sent(in_kernels,
                                                                     combine_dtype):
    """Calls 0 and 1 fill both staging parities; in call 2 rank 3 gets its rows, is then
    excluded and sends no partials: the others' sums leave its stale, garbage-filled slice
    out."""
    bufs = _buffers(in_kernels)
    engines = [buf.normal_engine for buf in bufs]
    for it in range(2):
        _full_call(bufs, it)
    it = 2
    xs, idxs, ws = make_inputs(CASE, it)
    got = lockstep.dispatch(bufs, xs, idxs, ws)   # the layout sent rows to every rank
    assert any((g.handle.slot_of[:, DEAD] >= 0).any() for g in got)
    bufs[0].mask_rank(DEAD)
    live = [r for r in range(CASE.world_size) if r != DEAD]
    for r in live:
        _fill(bufs[r], "combine_rows", DEAD)
    pending = {r: engines[r].combine_send(expert_fn(got[r].x, got[r].expert_offsets),
                                          got[r].weights, None, got[r].handle.slot_rows,
                                          got[r].handle.recv_slot_offsets,
                                          fp8=combine_dtype == "fp8") for r in live}
    _, want = _reference(it, set(), {DEAD}, combine_dtype)
    for r in live:
        out, _ = engines[r].combine_recv(pending[r], got[r].handle.slot_of, want_pair=False)
        assert not out.isnan().any(), f"rank {r}: the excluded rank's staging was summed"
        assert torch.equal(out, want[r]), f"rank {r}: combine differs"


@pytest.mark.parametrize("survivors_in_kernels", [False, True],
                         ids=["host_waits", "kernel_waits"])
def test_layout_sends_nothing_to_or_from_an_excluded_rank(survivors_in_kernels):
    """Rank 3 is excluded before call 1. The survivors store nothing into its staging (the
    layout drops it as a destination). Rank 3 itself runs the GPU protocol (in-kernel waits,
    no host read of the mask), so only the self-fence of its layout kernel stops its rows: the
    survivors' staging slice of source 3 stays as it was, and its call raises."""
    bufs = _buffers(survivors_in_kernels)
    engines = [buf.normal_engine for buf in bufs]
    _full_call(bufs, 0)
    bufs[0].mask_rank(DEAD)
    dead = bufs[DEAD]   # as on a GPU: waits in the kernels, the host does not read the mask
    dead.normal_engine.flavour = dataclasses.replace(dead.flavour, device_wait=True)
    dead.fault.mask_words = None
    live = [r for r in range(CASE.world_size) if r != DEAD]
    into_dead = [_fill(bufs[DEAD], "dispatch_rows", s) for s in live]
    from_dead = [_fill(bufs[r], "dispatch_rows", DEAD) for r in live]
    it = 1
    xs, idxs, ws = make_inputs(CASE, it)
    pending = {r: engines[r].dispatch_send(xs[r], idxs[r], ws[r])
               for r in range(CASE.world_size)}
    assert _untouched(torch.stack(into_dead)), "a survivor stored rows into the excluded rank"
    assert _untouched(torch.stack(from_dead)), "the excluded rank stored rows (no self-fence)"
    assert not (pending[DEAD].slot_of >= 0).any()
    assert not (pending[0].slot_of[:, DEAD] >= 0).any()
    with pytest.raises(RankExcludedError, match=f"rank {DEAD} was excluded"):
        engines[DEAD].dispatch_recv(pending[DEAD], 1)
    want, want_out = _reference(it, {DEAD}, {DEAD})
    got = {r: wrap_dispatch_outputs(bufs[r], engines[r].dispatch_recv(pending[r], 1), CASE.topk,
                                    True, 0, 0) for r in live}
    for r in live:
        for field in FIELDS:
            assert torch.equal(getattr(got[r], field), getattr(want[r], field)), (r, field)
    outs = lockstep.combine([bufs[r] for r in live],
                            [expert_fn(got[r].x, got[r].expert_offsets) for r in live],
                            [got[r].handle for r in live], [got[r].weights for r in live])
    for r, out in zip(live, outs):
        assert torch.equal(out, want_out[r]), f"rank {r}: combine differs"


@triton.jit
def _decide_kernel(signals, live, decided, go, peer_ptrs, errors_addr, local_base,
                   mask_off: tl.int64, expected: tl.int64, timeout_ns: tl.int64, R, me, first_pid,
                   BLOCK: tl.constexpr, NUM_THREADS: tl.constexpr):
    """Each program (numbered from ``first_pid``) takes ``wait_or_exclude_once`` and stores what
    it returned at ``go[pid]``."""
    pid = tl.program_id(0) + first_pid
    errors = errors_addr.to(tl.pointer_type(tl.int64))
    mask = comm.local_ptr(local_base, mask_off, tl.int64, 8)
    deadline = comm.uniform_now_ns(NUM_THREADS) + timeout_ns
    ok = comm.wait_or_exclude_once(pid, signals, expected, live, decided, deadline, timeout_ns,
                                   errors, mask, me, peer_ptrs, mask_off, R, local_base, BLOCK,
                                   NUM_THREADS, 0)
    tl.store(go + pid + tl.arange(0, 1), tl.full([1], 1, tl.int32) * ok)


def test_one_decision_per_round_for_every_program_of_a_launch():
    """``kernels.comm.wait_or_exclude_once`` (a fault-tolerant combine's rounds in one launch,
    whose programs must sum the same sources) on 3 ranks' segments, rank 0 deciding, epoch 7:
    program 0 waits, excludes the silent rank 2 on every rank, writes who arrived and the
    decision; program 1 takes that decision. A rank excluded itself decides to stop, and its
    other programs stop too; a program whose decision never comes stops at its deadline and
    names its own rank."""
    from moe_comm.error_record import ErrorRecord

    R, me, epoch, mask_off = 3, 0, 7, 64
    segments = [torch.zeros(16, dtype=torch.int64) for _ in range(R)]
    peer_ptrs = torch.tensor([s.data_ptr() for s in segments], dtype=torch.int64)

    def decide(signal_words, first_pid=0, programs=2, decided=None):
        record = ErrorRecord(torch.device("cpu"))
        live = torch.full((R,), -1, dtype=torch.int32)
        decided = torch.zeros(1, dtype=torch.int64) if decided is None else decided
        go = torch.full((2,), -1, dtype=torch.int32)
        _decide_kernel[(programs,)](
            torch.tensor(signal_words, dtype=torch.int64), live, decided, go, peer_ptrs,
            record.address, segments[me].data_ptr(), mask_off, epoch, 20_000_000, R, me,
            first_pid, BLOCK=4, NUM_THREADS=128)
        return live.tolist(), int(decided), go.tolist(), record

    live, decided, go, record = decide([epoch, epoch + 1, epoch - 1])
    assert live == [1, 1, 0] and decided == 2 * epoch + 1 and go == [1, 1]
    assert [int(s[mask_off // 8 + 2]) for s in segments] == [me + 1] * R  # on every rank
    assert not record.timed_out()
    live, decided, go, record = decide([epoch, epoch, 0])  # rank 2 excluded: not waited for
    assert live == [1, 1, 0] and go == [1, 1] and not record.timed_out()
    segments[me][mask_off // 8 + me] = 2  # this rank excluded by rank 1
    live, decided, go, record = decide([epoch] * R)
    assert decided == 2 * epoch and go == [0, 0] and record.timed_out()
    segments[me][mask_off // 8 + me] = 0
    stale = torch.full((1,), 2 * epoch - 1, dtype=torch.int64)  # the last round's, ok
    _, decided, go, record = decide([epoch] * R, first_pid=1, programs=1, decided=stale)
    assert decided == 2 * epoch - 1 and go == [-1, 0] and record.timed_out()
    assert int(record.timeout_part[1]) == me  # (flag, peer, expected, observed)
