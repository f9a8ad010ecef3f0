"""The examples and the benchmark run end to end (small sizes)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_moe_layer_example_matches_dense():
    proc = _run("examples/moe_layer.py", "--ranks", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("output and gradients match the dense layer") == 2


def test_serving_survives_a_killed_rank():
    proc = _run("examples/serve_ep_with_failures.py", "--mode", "low_latency", "--steps", "5",
                "--kill", "3", "--kill-step", "2", "--timeout", "6")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for mode in ("low_latency",):
        lines = [line for line in proc.stdout.splitlines() if line.startswith(mode)]
        assert len(lines) == 6, proc.stdout
        assert all("agrees with the reference" in line for line in lines[:5]), proc.stdout
        masks = [line.split("active ")[1][:4] for line in lines[:5]]
        assert masks[0] == "1111" and masks[2:] == ["1110"] * 3, proc.stdout
        assert "time from the kill to the first step completed without rank 3" in lines[5]


@pytest.mark.slow
def test_benchmark_prints_one_table_and_agrees(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run("bench/dispatch_bench.py", "--ranks", "2", "--tokens", "16", "--iters", "1",
                "--configs", "GPT-OSS-120B", "Mixtral-8x7B", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GPT-OSS-120B" in proc.stdout and "exact" in proc.stdout
    rows = json.loads(out.read_text())
    assert [r["config"] for r in rows] == ["GPT-OSS-120B", "Mixtral-8x7B"]
    for r in rows:
        assert r["matches_reference"]
        assert r["min_link_bytes"] <= r["link_bytes"] <= 1.2 * r["min_link_bytes"] + 4096
        # every kernel counted, torch's too: layout (2), send, received layout, expand; send,
        # reduce (CPU ranks wait on the host)
        assert (r["dispatch_launches"], r["combine_launches"]) == (5, 2)
        assert r["host_syncs"] == 1  # the dispatch's received-row count, per rank and iteration
        assert r["pred_dispatch_us"] > 0 and r["pred_combine_us"] > 0


@pytest.mark.slow
def test_benchmark_counts_the_bytes_of_the_link_formats(tmp_path):
    """NVFP4 dispatch and FP8 combine: the bytes the kernels stored, against the formulas."""
    out = tmp_path / "bench.json"
    proc = _run("bench/dispatch_bench.py", "--ranks", "2", "--tokens", "16", "--iters", "1",
                "--configs", "Mixtral-8x7B", "--dispatch-dtype", "nvfp4", "--combine-dtype",
                "fp8", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NVFP4 dispatch, FP8 combine" in proc.stdout
    (r,) = json.loads(out.read_text())
    assert r["matches_reference"] and (r["dispatch_dtype"], r["combine_dtype"]) == ("nvfp4", "fp8")
    H, K, L, R = 4096, 2, 4, 2
    rows = r["min_link_bytes"] // (H // 2 + H // 16 + 4)          # NVFP4 rows to the other rank
    assert rows > 0 and r["min_link_bytes"] == rows * (H // 2 + H // 16 + 4)
    # each row's metadata (source token; expert, slot, weight per choice), then per peer the
    # counts of its experts and the epoch
    assert r["link_bytes"] == r["min_link_bytes"] + rows * 4 * (1 + 3 * K) \
        + R * (4 * (L + 1) + 8)
    # the FP8 partials back: H + H/32 bytes a row, then one epoch per peer
    assert r["min_combine_link_bytes"] == rows * (H + H // 32)
    assert r["combine_link_bytes"] == r["min_combine_link_bytes"] + R * 8


def test_invariant_training_same_bits_at_ep_2_and_4():
    """Two steps of an MoE layer: with ep_invariant=True the losses and every gradient are the
    same bits at EP 2 and EP 4; the default combine's are not (so the comparison can fail)."""
    proc = _run("examples/invariant_training.py", "--ranks", "2", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    invariant = [line for line in lines if line.startswith("ep_invariant=True step")]
    default = [line for line in lines if line.startswith("default combine")]
    assert len(invariant) == len(default) == 2, proc.stdout
    assert all(line.endswith("losses and gradients equal bit for bit") for line in invariant)
    assert all("differ: " in line for line in default), proc.stdout
    assert "OK: with ep_invariant=True every EP size trains to the same bits" in proc.stdout
