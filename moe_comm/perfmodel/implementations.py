"""Implementation profiles: what one implementation adds on top of what the hardware forces.

A `System` (systems.py) says what the hardware can do; an `Implementation` says how one
library uses it: its message formats, its algorithm per mode (one message per (token,
expert) pair, or one row per (token, destination rank); across NVLink domains hierarchical,
flat or not at all), the SMs it runs on, and its fixed costs. `predict(...,
implementation=NAME)` combines the two; `implementation="bound"` is the hardware alone.

A phase of one call costs

    time = fixed_us + per_peer_us x peers + per_token_us x tokens + path latency
           + max(overlap_us, largest term)

* fixed_us: work no transfer overlaps (launch, prologue, the final barrier's last leg);
* per_peer_us: per destination rank of the call (signal writes and polls of a barrier that
  touches every peer), so small batches slow down with EP;
* per_token_us: serial work per token of the rank that no transfer overlaps (a scan over the
  tokens in order, on a few SMs);
* overlap_us: fixed work that runs while data moves (a floor below which the transfer hides);
* terms: NVLink, NIC, PCIe, NIC message rate, SM issue, HBM (model.py), where the NVLink term
  uses `copy_efficiency` of the System's NVLink bandwidth and grows by `spread_penalty` per
  doubling of destination ranks beyond 8 (stores scattered over more peers).

Fitted constants come from the published numbers listed as "fit" in published.py; every
other published number of the implementation is a validation case (tests/test_perfmodel.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .formats import COMPACT, DEEPEP_V1, MOE_COMM, MessageFormat

KINDS = ("per_pair", "per_rank")
INTERNODE = ("hierarchical", "flat", "none")


@dataclass(frozen=True)
class Algorithm:
    """How one mode of one implementation moves tokens (see the module docstring)."""

    kind: str                  # "per_pair": a message per (token, expert); "per_rank": a row
    #                            per (token, destination rank), deduplicated
    internode: str             # across NVLink domains: "hierarchical" (a row per (token,
    #                            node), forwarded over NVLink), "flat" (a row per (token,
    #                            rank)), "none" (one NVLink domain only)
    fmt: MessageFormat
    num_sms: int | None        # SMs the kernels use; None = all of the GPU
    copy_efficiency: float     # share of System.nvlink_GBps the copies sustain
    fixed_us: tuple            # (dispatch, combine) serial per-call cost
    overlap_us: tuple = (0.0, 0.0)   # (dispatch, combine) fixed work transfers hide
    per_peer_us: float = 0.0   # per destination rank and call
    per_token_us: tuple = (0.0, 0.0)  # (dispatch, combine) serial work per token of the rank
    spread_penalty: float = 0.0      # extra NVLink time per doubling of peers beyond 8
    nic_efficiency: float = 1.0      # share of the NIC line rate reached
    sm_copy_GBps: float | None = None  # bytes one SM copies per second (GB/s); None = the
    #                                    System's estimate (sm_copy_bytes_per_clk x clock)

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.internode not in INTERNODE:
            raise ValueError(f"Algorithm: kind must be one of {KINDS} and internode one of "
                             f"{INTERNODE}, got {self.kind!r}, {self.internode!r}")
        if not 0 < self.copy_efficiency <= 1.5 or not 0 < self.nic_efficiency <= 1:
            raise ValueError("Algorithm: copy_efficiency in (0, 1.5], nic_efficiency in (0, 1]")

    def replace(self, **changes) -> Algorithm:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Implementation:
    """One library: an Algorithm per mode it has, the system its numbers were measured on,
    and where each constant comes from."""

    name: str
    title: str
    modes: dict                # mode name -> Algorithm
    measured_on: tuple = ()    # System presets of its published numbers
    notes: tuple = field(default_factory=tuple)

    def algorithm(self, mode: str, hierarchical: bool | None = None) -> Algorithm:
        if mode not in self.modes:
            raise ValueError(f"implementation {self.name!r} has no {mode!r} mode (it has "
                             f"{sorted(self.modes)})")
        alg = self.modes[mode]
        if hierarchical is not None and alg.kind == "per_rank" and alg.internode != "none":
            alg = alg.replace(internode="hierarchical" if hierarchical else "flat")
        return alg

    def replace(self, **changes) -> Implementation:
        return dataclasses.replace(self, **changes)


def with_algorithm(impl: Implementation, mode: str, **changes) -> Implementation:
    """A copy of `impl` whose `mode` Algorithm has some fields changed (for fitting)."""
    modes = dict(impl.modes)
    modes[mode] = modes[mode].replace(**changes)
    return impl.replace(modes=modes)


# This package's own constants, from one H200 with 8 virtual ranks on the GPU at DeepSeek-V3
# sizes: the run of 2026-12-04 (evening) on commit 320afca, docs/PERF.md, device time per call
# summed over the 8 ranks in bench/measured/h200-2026-12-04-kernels.tsv.
# Normal dispatch's routing layout: layout_count_kernel 30 us + layout_place_kernel 98 us per
# call for 8 ranks of 4096 tokens each, per token of the rank (it scales with the rank's tokens).
MOE_COMM_LAYOUT_US = (30 + 98) / 8 / 4096
# Normal mode's per-SM copy rate: what that run's bf16 dispatch send copied, 4096 tokens x
# 5.29 destinations (uniform top-8 of 256 experts on 8 ranks) x 14,336 bytes in 320.6 us a rank
# on 20 SMs: 48.5 GB/s an SM (tests/test_perfmodel.py computes it from the data file;
# moe_comm.perfmodel does not import the kernels). That run's combine send, which gathers the
# rows it sums at random, copied about 7.
MOE_COMM_SM_COPY_GBPS = 48.5
# Normal mode's SMs: the Buffer's default num_sms on GPUs (moe_comm/rings.py DEFAULT_GPU_SMS).
MOE_COMM_NUM_SMS = 20

# Fitted constants: calibration.fit(name) over the "fit" cases of published.py, rounded to
# three digits (tests/test_perfmodel.py refits and compares). DeepEP V1 (H800, CX7 400G):
# fitted to its intranode normal and EP8 low-latency numbers; internode and EP16..256 validate.
_V1_NORMAL = Algorithm("per_rank", "hierarchical", DEEPEP_V1, num_sms=24, copy_efficiency=0.959,
                       fixed_us=(133.0, 133.0))
_V1_LL = Algorithm("per_pair", "flat", DEEPEP_V1, num_sms=None, copy_efficiency=0.959,
                   fixed_us=(29.3, 29.3))

IMPLEMENTATIONS: dict[str, Implementation] = {
    "moe_comm": Implementation(
        "moe_comm", "this package",
        {"normal": _V1_NORMAL.replace(fmt=MOE_COMM, num_sms=MOE_COMM_NUM_SMS,
                                      sm_copy_GBps=MOE_COMM_SM_COPY_GBPS,
                                      per_token_us=(MOE_COMM_LAYOUT_US, 0.0)),
         "low_latency": _V1_LL.replace(fmt=MOE_COMM)},
        notes=("message formats exact: tests/test_perfmodel_bytes.py checks every byte the "
               "kernels count on CPU ranks",
               "measured (one H200, 8 virtual ranks on the GPU, DeepSeek-V3 sizes, run of "
               "2026-12-04 evening on commit 320afca, bench/measured/h200-2026-12-04-kernels.tsv"
               "): the normal dispatch's routing layout, 0.0039 us per token of the rank "
               "(layout_count_kernel 30 us + layout_place_kernel 98 us per call over 8 ranks of "
               "4096 tokens), and the normal mode's per-SM copy rate, 48.5 GB/s copied (that "
               "run's bf16 dispatch send: 4096 x 5.29 rows of 14,336 bytes in 320.6 us a rank "
               "on 20 SMs; its combine send, gathering at random, copied about 7)",
               "normal mode on 20 SMs: the Buffer's default num_sms on GPUs "
               "(moe_comm/rings.py DEFAULT_GPU_SMS)",
               "DeepEP V1's fitted values, not measured for this package: the NVLink copy "
               "efficiency and the fixed costs (virtual ranks on one GPU have no NVLink and share "
               "its SMs, so their times do not transfer), and every low-latency constant (the "
               "low-latency kernels were rewritten after that run; no GPU has run the new ones)",
               "across nodes hierarchical by default (Buffer(hierarchical=None)); "
               "hierarchical=False gives the flat mode")),
    "deepep-v1": Implementation(
        "deepep-v1", "DeepEP V1 (NVSHMEM; normal and low-latency kernels)",
        {"normal": _V1_NORMAL, "low_latency": _V1_LL}, measured_on=("h800",),
        notes=("README / docs/legacy.md 'Performance': H800, CX7 400 Gb/s, hidden 7168, top-8, "
               "FP8 dispatch, BF16 combine",
               "24 SMs for the normal kernels (its test scripts)")),
    "deepep-v2": Implementation(
        "deepep-v2", "DeepEP V2 (NCCL GIN; ElasticBuffer, hybrid mode)",
        {"normal": Algorithm("per_rank", "hierarchical", DEEPEP_V1, num_sms=24,
                             copy_efficiency=0.809, fixed_us=(0.0, 0.0), nic_efficiency=0.868,
                             sm_copy_GBps=186.0)},
        measured_on=("h100", "b200"),
        notes=("README 'Performance': 8K tokens, hidden 7168, top-8, FP8 dispatch, BF16 combine,"
               " logical bandwidth incl. local traffic; only large batches are published",
               "message format taken as V1's (the README does not give it)")),
    "trtllm-onesided": Implementation(
        "trtllm-onesided", "TensorRT-LLM one-sided NVLink all-to-all (NVLinkOneSided)",
        {mode: Algorithm("per_rank", "none", COMPACT, num_sms=None, copy_efficiency=0.950,
                         fixed_us=(10.6, 16.9), overlap_us=(6.87, 9.78), per_peer_us=0.114,
                         spread_penalty=0.0179) for mode in ("normal", "low_latency")},
        measured_on=("gb200-nvl72",),
        notes=("tech blog 18: one CTA per token, each token pushed once per destination rank, "
               "combine pulls and reduces; a flag barrier over every peer per call",
               "NVLink domain only (no NIC path); the same kernels serve both modes")),
    "nccl-ep": Implementation(
        "nccl-ep", "NCCL EP (GIN; low-latency mode)",
        {"low_latency": Algorithm("per_pair", "flat", DEEPEP_V1, num_sms=None,
                                  copy_efficiency=0.962, fixed_us=(25.9, 39.3),
                                  nic_efficiency=0.994)},
        measured_on=("h100",),
        notes=("README reference numbers: H100, 8 GPUs per node, BF16 both ways, 128 tokens; "
               "expert-major layout, one message per (token, expert); its low-latency kernels "
               "derive from DeepEP's, so the 16-byte message header is taken as DeepEP's",
               "high-throughput mode: no published numbers (being tuned), so not modelled")),
}


def get_implementation(impl: str | Implementation) -> Implementation:
    if isinstance(impl, Implementation):
        return impl
    key = str(impl).strip().lower()
    if key in IMPLEMENTATIONS:
        return IMPLEMENTATIONS[key]
    raise ValueError(f"unknown implementation {impl!r}; known: {sorted(IMPLEMENTATIONS)} or "
                     "'bound' (the hardware's lower bound)")


__all__ = ["Algorithm", "IMPLEMENTATIONS", "Implementation", "get_implementation",
           "with_algorithm"]
