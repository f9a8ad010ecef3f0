"""What goes on the link: payload dtypes (bytes per element, scale layout) and the message
formats of the implementations the model knows.

Payload of one token row of `hidden` elements:

| dtype        | elements       | scales                                   | bytes of a row      |
|--------------|----------------|------------------------------------------|---------------------|
| bf16, fp16   | 2 bytes        | none                                     | 2H                  |
| fp32         | 4 bytes        | none                                     | 4H                  |
| fp8          | e4m3, 1 byte   | fp32 per 128 elements (DeepSeek-V3)      | H + 4 ceil(H/128)   |
| fp8-ue8m0    | e4m3, 1 byte   | UE8M0 byte per 128, packed in int32 words| H + 4 ceil(H/512)   |
| mxfp8        | e4m3, 1 byte   | E8M0 byte per 32 elements (OCP MX v1.0)  | H + ceil(H/32)      |
| nvfp4        | e2m1, 4 bits   | e4m3 byte per 16 elements (+ one fp32    | ceil(H/2) +         |
|              |                | per-tensor scale, not per row)           | ceil(H/16)          |

The per-tensor fp32 of NVFP4 travels once per call in most implementations and is left out
here; a message format that carries it in every row says so (``nvfp4_global_bytes``: this
package's rows hold their source's global scale, 4 bytes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DTYPES = ("fp8", "fp8-ue8m0", "mxfp8", "nvfp4", "bf16", "fp16", "fp32")
COMBINE_DTYPES = ("bf16", "fp16", "fp32", "fp8", "mxfp8", "nvfp4")
UNQUANTIZED = ("bf16", "fp16", "fp32")  # dtypes a Buffer holds (no scales)
_ALIASES = {"float8_e4m3fn": "fp8", "float8_e4m3fnuz": "fp8", "float8_e5m2": "fp8",
            "e4m3": "fp8", "ue8m0": "fp8-ue8m0", "bfloat16": "bf16", "float16": "fp16",
            "half": "fp16", "float32": "fp32", "float": "fp32", "mx-fp8": "mxfp8",
            "nv-fp4": "nvfp4", "fp4": "nvfp4"}


def normalize_dtype(dtype, allowed=DTYPES) -> str:
    """A short name of DTYPES from a short name, a long name or a torch dtype."""
    name = str(dtype).lower().removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in allowed:
        raise ValueError(f"dtype {dtype!r} not supported here; use one of {tuple(allowed)}")
    return name


def payload_bytes(dtype: str, hidden: int) -> int:
    """Bytes of one token row as sent, scales included (table above)."""
    if dtype == "fp8":
        return hidden + 4 * math.ceil(hidden / 128)
    if dtype == "fp8-ue8m0":
        return hidden + 4 * math.ceil(hidden / 512)
    if dtype == "mxfp8":
        return hidden + math.ceil(hidden / 32)
    if dtype == "nvfp4":
        return math.ceil(hidden / 2) + math.ceil(hidden / 16)
    return hidden * {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]


def element_bytes(dtype: str) -> float:
    """Bytes per element with the scales spread over the elements (bandwidth conventions)."""
    return payload_bytes(dtype, 1 << 16) / (1 << 16)


def input_bytes(dtype: str) -> int:
    """Bytes per element the dispatch reads: quantized formats are cast from bf16 input."""
    return {"fp16": 2, "fp32": 4}.get(dtype, 2)


@dataclass(frozen=True)
class MessageFormat:
    """Bytes besides the payload, per message, per destination and per call.

    Normal mode sends one row per (token, destination rank) with `meta_base_bytes +
    meta_per_topk_bytes x K` of metadata; low-latency mode one message per (token, expert)
    with `ll_header_bytes`. Signals: `count_bytes_per_expert x (experts per rank + 1)` per
    destination and `epoch_signal_bytes` per destination and phase in normal mode;
    `ll_count_bytes` per expert in low-latency mode. Hierarchical rows add
    `node_slot_bytes` per rank of the destination node.
    """

    name: str
    ll_header_bytes: int
    ll_count_bytes: int
    meta_base_bytes: int
    meta_per_topk_bytes: int
    count_bytes_per_expert: int
    epoch_signal_bytes: int
    node_slot_bytes: int
    nvfp4_global_bytes: int = 0  # NVFP4's global scale, where it travels in every row

    def payload(self, dtype: str, hidden: int) -> int:
        """Bytes of one row's payload in this format: :func:`payload_bytes`, with NVFP4's
        global scale where every row carries it."""
        return payload_bytes(dtype, hidden) + (self.nvfp4_global_bytes if dtype == "nvfp4"
                                               else 0)

    def normal_meta_bytes(self, topk: int) -> int:
        return self.meta_base_bytes + self.meta_per_topk_bytes * topk

    def normal_count_bytes(self, experts_per_rank: int) -> int:
        """Counts one rank sends each destination rank (one word per expert and a total)."""
        return self.count_bytes_per_expert * (experts_per_rank + 1)

    def node_count_bytes(self, experts_per_rank: int, gpus_per_node: int) -> int:
        """Counts one rank sends each other node in hierarchical mode."""
        return self.count_bytes_per_expert * (gpus_per_node * (experts_per_rank + 1) + 1)


# This package (kernels/, moe_comm/workspace.py): int32 words of metadata per row (source
# token, and per top-k slot expert, weight and slot), an int32 source index per low-latency
# message, int32 counts, int64 epoch signals; NVFP4 rows carry their float32 global scale.
# Checked against the kernels' own counters.
MOE_COMM = MessageFormat("moe_comm", ll_header_bytes=4, ll_count_bytes=8, meta_base_bytes=4,
                         meta_per_topk_bytes=12, count_bytes_per_expert=4,
                         epoch_signal_bytes=8, node_slot_bytes=4, nvfp4_global_bytes=4)

# DeepEP V1 (csrc/kernels/internode_ll.cu, internode.cu): a 16-byte header per low-latency
# message (source token index, padded to 16), per normal row an int64 source index (8) and per
# top-k slot an int32 expert and an fp32 weight (8); counts are small and left out.
DEEPEP_V1 = MessageFormat("deepep-v1", ll_header_bytes=16, ll_count_bytes=0, meta_base_bytes=8,
                          meta_per_topk_bytes=8, count_bytes_per_expert=0,
                          epoch_signal_bytes=0, node_slot_bytes=0)

# An implementation that sends the token and its routing once per destination rank with a
# minimal header (int32 source index, int32 expert + fp32 weight per slot): TensorRT-LLM's
# one-sided NVLink all-to-all (tech blog 18: hidden states, scales, top-k ids and weights in
# one message) is of this shape.
COMPACT = MessageFormat("compact", ll_header_bytes=4, ll_count_bytes=4, meta_base_bytes=4,
                        meta_per_topk_bytes=8, count_bytes_per_expert=0, epoch_signal_bytes=0,
                        node_slot_bytes=0)
