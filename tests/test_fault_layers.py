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
from fault_jobs import survivors_inputs

import moe_comm
from cases import Case, expert_fn, make_inputs
from moe_comm import lockstep, reference
from moe_comm.fault import RankExcludedError
from moe_comm.ops import wrap_dispatch_outputs
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
    pending = {r: bufs[r].combine_send(expert_fn(got[r].x, got[r].expert_offsets),
                                       got[r].weights, None, got[r].handle.slot_rows,
                                       got[r].handle.recv_slot_offsets,
                                       fp8=combine_dtype == "fp8") for r in live}
    _, want = _reference(it, set(), {DEAD}, combine_dtype)
    for r in live:
        out, _ = bufs[r].combine_recv(pending[r], got[r].handle.slot_of, want_pair=False)
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
    _full_call(bufs, 0)
    bufs[0].mask_rank(DEAD)
    dead = bufs[DEAD]   # as on a GPU: waits in the kernels, the host does not read the mask
    dead.flavour = dataclasses.replace(dead.flavour, device_wait=True)
    dead._mask_words = None
    live = [r for r in range(CASE.world_size) if r != DEAD]
    into_dead = [_fill(bufs[DEAD], "dispatch_rows", s) for s in live]
    from_dead = [_fill(bufs[r], "dispatch_rows", DEAD) for r in live]
    it = 1
    xs, idxs, ws = make_inputs(CASE, it)
    pending = {r: bufs[r].dispatch_send(xs[r], idxs[r], ws[r]) for r in range(CASE.world_size)}
    assert _untouched(torch.stack(into_dead)), "a survivor stored rows into the excluded rank"
    assert _untouched(torch.stack(from_dead)), "the excluded rank stored rows (no self-fence)"
    assert not (pending[DEAD].slot_of >= 0).any()
    assert not (pending[0].slot_of[:, DEAD] >= 0).any()
    with pytest.raises(RankExcludedError, match=f"rank {DEAD} was excluded"):
        bufs[DEAD].dispatch_recv(pending[DEAD], 1)
    want, want_out = _reference(it, {DEAD}, {DEAD})
    got = {r: wrap_dispatch_outputs(bufs[r], bufs[r].dispatch_recv(pending[r], 1), CASE.topk,
                                    True, 0, 0) for r in live}
    for r in live:
        for field in FIELDS:
            assert torch.equal(getattr(got[r], field), getattr(want[r], field)), (r, field)
    outs = lockstep.combine([bufs[r] for r in live],
                            [expert_fn(got[r].x, got[r].expert_offsets) for r in live],
                            [got[r].handle for r in live], [got[r].weights for r in live])
    for r, out in zip(live, outs):
        assert torch.equal(out, want_out[r]), f"rank {r}: combine differs"
