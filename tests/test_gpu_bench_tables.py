"""bench/gpu_bench.py's arithmetic, on CPU: the bytes each row-moving kernel reads and writes,
from a call's own counts; its share of the copy ceiling; the table's per-rank, per-kernel and
back-to-back sections (the GPU run fills them; here made-up rows)."""
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))
import gpu_bench  # noqa: E402


def _result(slots: int, rows: int):
    return SimpleNamespace(handle=SimpleNamespace(recv_slot_offsets=torch.tensor([0, slots])),
                           x=torch.empty(rows, 4))


def test_kernel_bytes_come_from_the_calls_counts():
    res = [_result(3, 7), _result(5, 9)]  # 8 slots and 16 rows in all, 2 ranks of 4 tokens
    got = gpu_bench.normal_kernel_bytes(res, T=4, H=4, elem=2, meta_bytes=8)
    row = 4 * 2
    assert got == {"dispatch_send_kernel": 2 * 4 * row + 8 * (row + 8),
                   "dispatch_expand_kernel": 8 * (row + 8) + 16 * row,
                   "combine_send_kernel": 16 * row + 8 * row,
                   "combine_reduce_kernel": 8 * row + 2 * 4 * row}


def test_a_share_of_the_ceiling_counts_reads_and_writes():
    # 2e9 bytes read plus written in 1 ms per call against a 1000 GB/s copy (2000 GB/s of
    # reads plus writes): 2e12 B/s / 2e12 = 100%
    shares = gpu_bench.kernel_shares({"combine_send_kernel_0d1d": (1.0, 1), "x": (5.0, 1)},
                                     {"combine_send_kernel": 2e9, "absent": 1}, 1000.0)
    assert shares == {"combine_send_kernel": 1.0}


def test_the_table_has_its_sections():
    rows = [{"op": "normal dispatch (triton)", "median_ms": 2.0, "min_ms": 1.9, "max_ms": 2.1,
             "bytes": 1e6, "GBps": 0.5, "of_ceiling": 0.01,
             "kernels": {"dispatch_send_kernel": (0.8, 1), "layout_count_kernel": (0.01, 1)},
             "host_ms": 0.4, "host_ms_triton_path": 0.8,
             "shares": {"dispatch_send_kernel": 0.61},
             "back_to_back": {"host_ms": 0.3, "device_ms": 1.0, "host_ahead": True},
             "staging": {"config": "normal EP8", "staging_bytes": 2**29, "rounds": 8,
                         "ring_slots": 512, "workspace_bytes": 2**29 + 2**20,
                         "gpu_bytes": 2**37}},
            {"op": "low-latency dispatch CUDA-graph replay (triton)", "graph": True,
             "median_ms": 0.24, "min_ms": 0.2, "max_ms": 0.3, "bytes": 0, "kernels": {}},
            {"op": "broken", "error": "RuntimeError: boom"}]
    text = gpu_bench.to_markdown(rows, 2000.0, "a GPU", 1024)
    assert "| normal dispatch (triton) | 101.2 | 50.0 | 100.0 |" in text  # per rank: / 8
    assert "| low-latency dispatch CUDA-graph replay (triton) | 30.0 | n/a | n/a |" in text
    assert "dispatch_send_kernel 61%" in text
    assert "host 0.300 ms per call, device 1.000 ms per call: the host stays ahead" in text
    assert "| broken | FAILED: RuntimeError: boom" in text
    assert "| normal EP8 | 0.500 GiB | 8 | 512 | 0.501 GiB | 0.4% |" in text
