"""bench/fit_model.py on the recorded runs (bench/measured/): which measured kernel is which
compiled variant, what one launch measured, and that the gate's two constants are the fit of the
run they say they come from."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import fit_model  # noqa: E402
import gpu_bench  # noqa: E402

from moe_comm.kernels import critical_path  # noqa: E402

MEASURED = os.path.join(ROOT, "bench", "measured")
RUN_1204 = (os.path.join(MEASURED, "h200-2026-12-04-kernels.tsv"),
            os.path.join(MEASURED, "gate-paths-320afca.tsv"))


def test_each_measured_triton_kernel_finds_its_variant():
    kernels = fit_model.matched(*RUN_1204)
    ops = {k["op"] for k in kernels}
    assert len(ops) == len(fit_model.OPS)  # every op of the map was in that run
    assert len(kernels) == 14
    by_name = {(k["op"], k["kernel"]): k for k in kernels}
    send = by_name[("low-latency EP8 T=128 fp8 dispatch (triton)", "ll_dispatch_send_kernel")]
    # that run's kernel: 20 programs (the Buffer's num_sms), over a hundred dependent steps each
    assert send["programs"] == 20 and send["steps"] > 100
    assert all(k["measured_us"] > 0 and k["steps"] > 0 for k in kernels)


def test_the_gates_constants_are_the_fit_of_the_run_they_name():
    latency, gbps, worst = fit_model.fit(fit_model.matched(*RUN_1204))
    assert (latency, gbps) == (critical_path.LATENCY_US, critical_path.SM_GBPS)
    assert worst == pytest.approx(0.52, abs=0.01)  # docs/PERF.md says 52%


def test_a_flag_an_older_kernel_lacks_holds_where_it_is_off():
    assert fit_model.holds("bfloat16 FP8=0", ["FP8=0", "TRANSPORT=0"])
    assert not fit_model.holds("bfloat16 FP8=0", ["TRANSPORT=1"])
    assert not fit_model.holds("bfloat16 FP8=1 TRANSPORT=0", ["FP8=0"])


def test_what_the_benchmark_writes_is_what_the_fit_reads(tmp_path):
    """gpu_bench's --kernels-tsv: device us per call over every rank and launches per call; the
    fit divides one by the other (one launch, all ranks: the sum of the ranks' launches)."""
    rows = [{"op": "low-latency EP8 T=128 bf16 combine (triton)",
             "kernels": {"ll_combine_recv_kernel": (0.240, 8),  # ms per call, launches per call
                         "some_torch_kernel": (0.010, 1)}}]
    path = tmp_path / "kernels.tsv"
    gpu_bench.write_kernel_times(str(path), rows, "NVIDIA H200")
    kernels = fit_model.matched(str(path), RUN_1204[1])
    assert [(k["kernel"], k["measured_us"]) for k in kernels] == [("ll_combine_recv_kernel",
                                                                   pytest.approx(30.0))]
    p = kernels[0]
    assert fit_model.predicted(p, 1.0, 1e9) == pytest.approx(
        p["steps"] * -(-p["programs"] // (critical_path.GPU_SMS * critical_path.resident_programs(
            p["regs"], p["num_warps"], p["smem_bytes"]))))


@pytest.mark.parametrize("commit", ["320afca", "f243e99"])
def test_the_recorded_analyses_name_what_reanalyse_records(commit):
    """bench/measured/gate-paths-<commit>.tsv is what bench/reanalyse.py writes for that commit:
    its rows, in order, the trips of its loops bounded by data and the live shares it gives the
    commit's masked stores and gathers (the header names them); a row or share changed on one
    side only fails here."""
    import json

    import reanalyse

    path = os.path.join(MEASURED, f"gate-paths-{commit}.tsv")
    header = [line[2:].rstrip("\n") for line in open(path) if line.startswith("#")]
    rows = [(r["kernel"], r["config"], r["variant"]) for r in fit_model.read_tsv(path)]
    spec = reanalyse.COMMITS[commit]
    assert rows == list(spec.rows)
    hints = next(line for line in header if line.startswith("routing: "))
    assert json.loads(hints.removeprefix("routing: ")) == spec.hints
    note = " ".join(header[header.index(hints) + 1:])
    assert note.startswith("Walked by kernels/critical_path.py at ")
    assert note.endswith("live shares: " + " ".join(spec.live)), note
