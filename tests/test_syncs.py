"""Host synchronisations per op, padding, and the fixed-size dispatch (``max_recv_rows``).

Every host read of tensor data in the torch layer goes through one counted helper
(``moe_comm.host_sync``). Two guards catch a read that bypasses it: on CPU ranks
``ReadCounter`` counts the reads made through torch's Python API (``.item()``, ``.tolist()``,
``int(t)``, ``bool(t)``, ...); and the GPU flavours' ops run on the ``meta`` device
(``sync_jobs``), where a read of data by any route (``torch.equal``, ``.cpu()``, ``.numpy()``,
a copy into a host tensor, a boolean index) raises. Budgets per call: low-latency dispatch and
combine 0, normal combine 0, normal dispatch 1 (the row count) and 0 with ``max_recv_rows``.
"""
import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

import moe_comm
from cases import Case, expert_fn, make_inputs
from moe_comm import reference
from moe_comm.testing import lockstep

_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "__array__")


class ReadCounter:
    """Counts host reads of tensor data made through torch's Python API inside the block."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in _READS:
            original = getattr(torch.Tensor, name)

            def counted(*args, _original=original, **kwargs):
                self.count += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


def _syncs(bufs) -> int:
    return sum(sum(b.host_syncs.values()) for b in bufs)


CASE = Case(4, 16, 256, 4, (9, 0, 6, 11), routing="zipf", alignment=8, seed=41)


def test_normal_mode_reads_once_per_dispatch_and_never_in_combine(monkeypatch):
    bufs = moe_comm.Buffer.loopback(4, CASE.hidden, CASE.num_experts, CASE.max_tokens)
    xs, idxs, ws = make_inputs(CASE)
    reads = ReadCounter(monkeypatch)
    got = lockstep.dispatch(bufs, xs, idxs, ws, CASE.alignment)
    assert reads.count == _syncs(bufs) == 4  # one per rank: the received-row count
    assert all(dict(b.host_syncs) == {"rows": 1} for b in bufs)
    ys = [expert_fn(g.x, g.expert_offsets) for g in got]
    lockstep.combine(bufs, ys, [g.handle for g in got], [g.weights for g in got])
    lockstep.dispatch(bufs, xs, idxs, ws, CASE.alignment, max_recv_rows=200)
    assert reads.count == _syncs(bufs) == 4  # combine and the fixed-size dispatch: none


def test_gpu_flavours_read_nothing_else_on_the_meta_device():
    """Every op of every GPU flavour on meta tensors, through the phases and through the public
    ``Buffer.dispatch`` / ``Buffer.combine`` and the low-latency hooks: only the counted helper
    reads (once per rank and dispatch without ``max_recv_rows``; the gate's drivers pass it
    everywhere else)."""
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, os.path.join(here, "sync_jobs.py")],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    reads = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(reads) == 9
    for flavour, count in reads.items():  # normal: lockstep's and Buffer.dispatch's, 4 each
        assert count == (0 if flavour.endswith("_ll") else 8), (flavour, count)


def test_low_latency_reads_nothing(monkeypatch):
    bufs = moe_comm.Buffer.loopback(4, CASE.hidden, CASE.num_experts, CASE.max_tokens,
                                    low_latency=True)
    xs, idxs, ws = make_inputs(CASE)
    reads = ReadCounter(monkeypatch)
    for fp8 in (False, True):
        got = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=fp8)
        ys = [torch.zeros(g.x.shape, dtype=torch.bfloat16) for g in got]
        lockstep.low_latency_combine(bufs, ys, idxs, ws, [g.handle for g in got])
    assert reads.count == 0 and _syncs(bufs) == 0


def test_training_step_reads_once(monkeypatch):
    """Forward and backward of dispatch + combine on one rank: only the forward dispatch
    reads (its row count); the backward ops (cached dispatch, combine) read nothing."""
    case = Case(1, 4, 64, 2, (8,), torch.float64, seed=42)
    buf = moe_comm.Buffer.loopback(1, 64, 4, 8, torch.float64)[0]
    xs, idxs, ws = make_inputs(case)
    x, w = xs[0].clone().requires_grad_(), ws[0].clone().requires_grad_()
    reads = ReadCounter(monkeypatch)
    res = buf.dispatch(x, idxs[0], w)
    out = buf.combine(res.x * 2, res.handle, res.weights)
    out.sum().backward()
    assert reads.count == _syncs([buf]) == 1 and buf.host_syncs == {"rows": 1}


@contextlib.contextmanager
def _garbage_allocations(monkeypatch):
    """torch.empty returns memory full of NaN (floats) or -7 (integers): whatever a kernel
    does not write shows."""
    original = torch.empty

    def poisoned(*args, **kwargs):
        t = original(*args, **kwargs)
        if t.numel() and t.device.type == "cpu":
            t.fill_(float("nan") if t.is_floating_point() else -7)
        return t

    with monkeypatch.context() as m:
        m.setattr(torch, "empty", poisoned)
        yield


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (compares NaN payloads and FP8/E8M0 codes exactly)."""
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("max_recv_rows", [None, 160])
def test_only_padding_rows_are_zeroed_and_they_all_are(monkeypatch, max_recv_rows):
    """The outputs come from uninitialised memory (no fill launch): the expand writes every
    row of every output, padding included (zeros, source -1, weight 0), and every row of the
    handle's slot_rows (-1 past the last slot), the same on every call."""
    bufs = moe_comm.Buffer.loopback(4, CASE.hidden, CASE.num_experts, CASE.max_tokens)
    xs, idxs, ws = make_inputs(CASE)
    want = reference.dispatch_all(xs, idxs, ws, num_experts=CASE.num_experts,
                                  expert_alignment=CASE.alignment)
    with _garbage_allocations(monkeypatch):
        first = lockstep.dispatch(bufs, xs, idxs, ws, CASE.alignment,
                                  max_recv_rows=max_recv_rows)
        got = lockstep.dispatch(bufs, xs, idxs, ws, CASE.alignment, max_recv_rows=max_recv_rows)
    for g, w, a in zip(got, want, first):
        rows = w.x.shape[0]
        assert g.x.shape[0] == (rows if max_recv_rows is None else max_recv_rows)
        assert torch.equal(g.x[:rows], w.x)  # padding inside the groups: zeros
        assert torch.equal(g.expert_offsets, w.expert_offsets)
        assert torch.equal(g.tokens_per_expert, w.tokens_per_expert)
        for field in ("src_rank", "src_token", "weights"):
            assert torch.equal(getattr(g, field)[:rows], getattr(w, field)), field
        assert (g.x[rows:] == 0).all() and (g.src_rank[rows:] == -1).all()
        assert (g.src_token[rows:] == -1).all() and (g.weights[rows:] == 0).all()
        slots = int(g.handle.recv_slot_offsets[-1])
        assert (g.handle.slot_rows[slots:] == -1).all()
        assert torch.equal(g.handle.slot_rows, a.handle.slot_rows)
    ys = [torch.cat([expert_fn(w.x, w.expert_offsets), g.x[w.x.shape[0]:]])
          for g, w in zip(got, want)]
    outs = lockstep.combine(bufs, ys, [g.handle for g in got], [g.weights for g in got])
    ref = reference.combine_all([expert_fn(w.x, w.expert_offsets) for w in want],
                                [w.handle for w in want], [w.weights for w in want])
    for o, r in zip(outs, ref):
        assert torch.equal(o, r)


@pytest.mark.parametrize("fmt", [dict(fp8=True), dict(fp8=True, ue8m0=True),
                                 dict(fp8=True, col_major_scales=True),
                                 dict(dispatch_dtype="mxfp8"), dict(dispatch_dtype="nvfp4")],
                         ids=["fp8", "ue8m0", "col_major", "mxfp8", "nvfp4"])
def test_quantized_outputs_are_written_whole_from_uninitialised_memory(monkeypatch, fmt):
    """Quantized rows, their scales (every byte of UE8M0's packed words: H = 640 has 5 groups,
    3 spare bytes in the second word) and NVFP4's global scales, padding rows zero, from
    memory full of garbage: byte for byte the reference."""
    case = Case(2, 8, 640, 2, (7, 5), routing="zipf", alignment=4, seed=9)
    bufs = moe_comm.Buffer.loopback(2, case.hidden, case.num_experts, case.max_tokens)
    xs, idxs, ws = make_inputs(case)
    want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts,
                                  expert_alignment=case.alignment, **fmt)
    with _garbage_allocations(monkeypatch):
        got = lockstep.dispatch(bufs, xs, idxs, ws, case.alignment, max_recv_rows=40, **fmt)
    for g, w in zip(got, want):
        rows = w.x.shape[0]
        assert torch.equal(_bits(g.x[:rows]), _bits(w.x)) and not _bits(g.x[rows:]).any()
        assert torch.equal(_bits(g.x_scales[:rows]), _bits(w.x_scales))
        assert not _bits(g.x_scales[rows:]).any()
        if fmt.get("dispatch_dtype") == "nvfp4":
            assert torch.equal(g.x_global_scale[:rows], w.x_global_scale)
            assert not g.x_global_scale[rows:].any()


def test_too_few_max_recv_rows_raise_after_the_call_and_the_buffer_goes_on():
    bufs = moe_comm.Buffer.loopback(2, 128, 8, 12, torch.bfloat16)
    case = Case(2, 8, 128, 4, (12, 12), seed=43)
    xs, idxs, ws = make_inputs(case)
    with pytest.raises(RuntimeError, match=r"rows arrived but max_recv_rows=5"):
        lockstep.dispatch(bufs, xs, idxs, ws, max_recv_rows=5)
    got = lockstep.dispatch(bufs, xs, idxs, ws)  # every rank finished the call: still usable
    want = reference.dispatch_all(xs, idxs, ws, num_experts=8)
    assert all(torch.equal(g.x, w.x) for g, w in zip(got, want))


def test_checked_topk_idx_clears_bad_rows_and_records_the_first_without_a_read(monkeypatch):
    """What kernel_impl="cuda" (csrc/, whose kernels do not check ids) launches before each op:
    a copy of topk_idx with every bad row -1, the first bad row recorded, nothing read back."""
    from moe_comm.error_record import ErrorRecord
    from moe_comm.kernels.comm import Flavour
    from moe_comm.kernels.layout import checked_topk_idx

    reads = ReadCounter(monkeypatch)

    def check(ids, want_out, error):
        record = ErrorRecord(torch.device("cpu"))
        before = reads.count
        out = checked_topk_idx(ids, 4, Flavour(errors_addr=record.address))
        assert reads.count == before
        assert out.dtype == torch.int64 and out.tolist() == want_out
        if error is None:
            record.raise_input_error(rank=0, what="t")
        else:
            with pytest.raises(ValueError, match=error):
                record.raise_input_error(rank=0, what="t")

    good = [[0, 3], [-1, -1], [2, -1]]
    check(torch.tensor(good), good, None)
    many = torch.randint(-1, 4, (150, 1))  # rows of one column cannot repeat an expert
    many[97, 0], many[120, 0] = 4, -2
    want = many.clone()
    want[97, 0] = want[120, 0] = -1
    check(many, want.tolist(), r"row 97 holds expert id 4")
    check(torch.tensor([[0, 3], [1, -1], [2, 2], [5, 0]]), [[0, 3], [1, -1], [-1, -1], [-1, -1]],
          r"row 2 picks expert 2 twice")
    check(torch.empty((0, 3), dtype=torch.int64), [], None)
