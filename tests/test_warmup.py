"""``Buffer.warmup``: what it compiles covers what later calls launch (recorded in a subprocess
for GPU flavours on the meta device), and on CPU ranks it compiles nothing."""
import json
import os
import subprocess
import sys

import pytest

import moe_comm

HERE = os.path.dirname(os.path.abspath(__file__))
SETUPS = ("normal", "normal-fp8", "low-latency", "proxy-flat", "rounds")


@pytest.fixture(scope="module")
def recorded() -> dict:
    proc = subprocess.run([sys.executable, os.path.join(HERE, "warmup_jobs.py")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("setup", SETUPS)
def test_warmup_compiles_every_kernel_later_calls_launch(recorded, setup):
    """Calls with fewer tokens, another alignment, both parities and the backward ops launch
    only what a warm-up with their top-k compiled; another top-k needs its own (BLOCK_K)."""
    row = recorded[setup]
    assert row["missing_after_warmup_k2"]["calls_k2"] == []
    assert row["missing_after_warmup_k1"]["calls_k1"] == []
    assert row["missing_after_warmup_k2"]["calls_k1"], "top-1 calls should need other variants"


def test_warmup_compiles_for_the_gpu_arch(recorded):
    compiled = set(recorded["compiled"])
    assert {"layout_count_kernel", "layout_place_kernel", "dispatch_send_kernel",
            "dispatch_expand_kernel", "combine_send_kernel", "combine_reduce_kernel"} <= compiled


def test_warmup_records_kernels_the_gpu_already_compiled(recorded):
    """Kernels this process already compiled and ran on its GPU are recorded and compiled
    again (a cache hit), never launched with the recording's meta tensors (which, on a GPU,
    was an illegal memory access)."""
    row = recorded["after_a_real_compile"]
    assert row["launched"] == [], row
    assert row["recorded"] == len(recorded["compiled"]), row  # what compile_ahead compiled


def test_warmup_on_cpu_ranks_compiles_nothing_and_checks_topk():
    buf = moe_comm.Buffer.loopback(2, 64, 4, 8, max_topk=2)[0]
    assert buf.warmup() == {"variants": [], "seconds": 0.0}
    assert sum(buf.launches.values()) == 0
    for bad in (0, 3, True, 1.5):
        with pytest.raises(ValueError, match="topk must be an int in"):
            buf.warmup(bad)
