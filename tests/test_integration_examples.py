"""The integration examples and the framework comparison of the benchmark, end to end (small)."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from integration_jobs import framework_compare_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None \
    and importlib.util.find_spec("megatron.core") is not None
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed "
                                    "(pip install -e .[megatron])")
needs_deepspeed = pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed "
                                     "(pip install -e .[deepspeed])")


def _run(*args, timeout=600, module=False):
    cmd = [sys.executable, "-m", *args] if module else [sys.executable, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _losses(stdout: str, kind: str) -> dict[int, float]:
    pattern = rf"\[{kind}[^\]]*\]\s+step\s+(\d+)\s+loss\s+([0-9.]+)"
    return {int(s): float(v) for s, v in re.findall(pattern, stdout)}


def test_train_moe_ep_matches_dense_training_on_four_ranks_and_learns():
    """20 steps: the loss of every step equals dense training's, and it falls (3.95 -> 2.89
    with the example's seed)."""
    proc = _run("examples/train_moe_ep.py", "--ranks", "4", "--steps", "20", "--print-every",
                "1", timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: expert-parallel training equals dense training" in proc.stdout
    ep, dense = _losses(proc.stdout, "expert-parallel"), _losses(proc.stdout, "dense")
    assert sorted(ep) == sorted(dense) == list(range(20))
    for step in ep:
        assert ep[step] == pytest.approx(dense[step], rel=1e-4, abs=0), step
    assert ep[19] < 0.75 * ep[0], ep


@pytest.mark.slow
def test_train_moe_ep_under_torchrun():
    proc = _run("torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "examples/train_moe_ep.py", "--steps", "3", "--print-every", "1", module=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[expert-parallel, 2 ranks] step    2" in proc.stdout
    assert "OK: expert-parallel training equals dense training" in proc.stdout


@needs_megatron
def test_megatron_example_one_line_plugin():
    proc = _run("examples/megatron_moe.py", "--ranks", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2, proc.stdout
    for line in lines:
        assert "MoeCommTokenDispatcher" in line
        assert "output 0.0e+00, input gradient 0.0e+00" in line, line


@needs_deepspeed
def test_deepspeed_example_one_line_plugin():
    proc = _run("examples/deepspeed_moe.py", "--ranks", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2, proc.stdout
    for line in lines:
        assert "MoeCommMOELayer" in line
        diffs = [float(v) for v in re.findall(r"(?:output|gradient) ([0-9.e+-]+)", line)]
        assert len(diffs) == 2 and max(diffs) < 1e-5, line


def _variants(rows):
    return [(row, v) for row in rows for v in row["variants"]]


@needs_deepspeed
def test_framework_compare_deepspeed_bytes_and_agreement(ranks):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import framework_compare

    R, H, E, K, T = 2, 32, 8, 2, 24
    rows = ranks(R).run(framework_compare_job, "deepspeed", H, E, K, T, "fp32", 5)
    capacity_rows = [v for _, v in _variants(rows) if "capacity_factor" in v["variant"]]
    nodrop_rows = [v for _, v in _variants(rows) if "drop_tokens=False" in v["variant"]]
    assert len(capacity_rows) == len(nodrop_rows) == R
    for v in capacity_rows + nodrop_rows:
        # DeepSpeed: [E, C, H] fp32 blocks, the (R-1)/R that leave the rank, there and back
        assert v["framework_row_bytes"] == 2 * (R - 1) * (E // R) * v["capacity"] * H * 4, v
        assert v["framework_bytes"] == v["framework_row_bytes"]
        assert 0 < v["moe_comm_row_bytes"] < v["moe_comm_bytes"]
    for v in capacity_rows:
        assert v["outputs_equal"], v
    for v in nodrop_rows:
        assert v["dropped_pairs"] == 0 and v["max_abs_diff"] < 1e-5, v
    assert sum(v["dropped_pairs"] for v in capacity_rows) > 0
    # moe_comm's rows: each token once per other rank it goes to, there and back
    for group in (capacity_rows, nodrop_rows):
        assert sum(v["moe_comm_row_bytes"] for v in group) == \
            2 * sum(v["remote_token_ranks"] for v in group) * H * 4
    table = framework_compare.format_rows(rows)
    for line in [line for line in table.splitlines() if line.startswith("DeepSpeed")]:
        ratio = float(re.search(r"([0-9.]+)x", line).group(1))
        assert ratio > 1.0, line
    assert "DeepSpeed capacity_factor=1 / capacity" in table and "exact" in table


@needs_megatron
def test_framework_compare_megatron_bytes_and_agreement(ranks):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import framework_compare

    R, H, E, K, T = 2, 32, 8, 2, 24
    rows = ranks(R).run(framework_compare_job, "megatron", H, E, K, T, "fp32", 6)
    variants = [v for _, v in _variants(rows)]
    assert len(variants) == R
    for v in variants:
        assert v["outputs_equal"], v
        assert v["framework_bytes"] > v["framework_row_bytes"]  # + probs and counts
    # Megatron: one row per (token, expert) pair on another rank, there and back
    assert sum(v["framework_row_bytes"] for v in variants) == \
        2 * sum(v["remote_pairs"] for v in variants) * H * 4
    assert sum(v["moe_comm_row_bytes"] for v in variants) == \
        2 * sum(v["remote_token_ranks"] for v in variants) * H * 4
    summary = framework_compare.summarize(rows)
    assert len(summary) == 1
    assert summary[0]["moe_comm_row_bytes"] <= summary[0]["framework_row_bytes"]
    assert "Megatron alltoall / dropless" in framework_compare.format_rows(rows)


def test_framework_compare_rejects_unknown_framework():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import framework_compare

    with pytest.raises(ValueError, match="megatron"):
        framework_compare.framework_job(0, 1, "vllm", 8, 2, 1, 4, "fp32", 0)
