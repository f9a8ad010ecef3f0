"""Published measurements of EP dispatch/combine implementations, each a fit or a validation
case of that implementation's profile.

Every case names its source (repository, file and section; the snapshot is given in
docs/PERFMODEL.md). A case's `role` says whether the profile's constants were fitted to it
("fit") or it only checks the model ("validation"). GB/s values are turned into times with
the model's logical bytes in the source's convention (model.py's module docstring), so the
comparison is always in microseconds.

Shape unless a case says otherwise: hidden 7168, top-8 of 256 experts (DeepSeek-V3).
Assumptions where a source is silent are listed in `ASSUMPTIONS` and in docs/PERFMODEL.md.
"""
from __future__ import annotations

from dataclasses import dataclass

ROLES = ("fit", "validation")


@dataclass(frozen=True)
class Case:
    """One published number."""

    implementation: str
    system: str
    mode: str
    phase: str            # "dispatch" or "combine"
    metric: str           # "us" or "GBps"
    value: float
    ep: int
    tokens: int
    role: str
    source: str
    gpus_per_node: int = 8
    dispatch_dtype: str = "fp8"
    combine_dtype: str = "bf16"
    routing: str = "uniform"
    num_experts: int = 256
    num_sms: int | None = None

    @property
    def label(self) -> str:
        d = "" if self.dispatch_dtype == "fp8" and self.combine_dtype == "bf16" else \
            f" {self.dispatch_dtype}/{self.combine_dtype}"
        sms = f" {self.num_sms} SMs" if self.num_sms else ""
        return (f"{self.system} {self.mode} EP{self.ep} T{self.tokens}{d}{sms} {self.phase}")


_V1 = "DeepEP README, Performance (docs/legacy.md on main)"
_V2 = "DeepEP V2 README, Performance"
_TRT = ("TensorRT-LLM tech blog 18, One-Sided AlltoAll over NVLink, Performance Benchmark "
        "(docs/source/blogs/tech_blog)")
_NCCL = "NCCL EP README, Reference performance numbers (contrib/nccl_ep/README.md)"

ASSUMPTIONS = {
    "deepep-v1": "256 experts (the test scripts' default for the normal kernels; the LL test "
                 "defaults to 288, which EP256 cannot divide); normal internode routing "
                 "group-limited to min(nodes, 4) nodes as in its test; 24 SMs",
    "deepep-v2": "8K tokens per rank; 256 experts; uniform routing; SM100 = B200, SM90 = an "
                 "H100-class NVLink (450 GB/s; the README names only the architecture, and "
                 "on H800's 200 GB/s NVLink the forwarding alone would take longer than the "
                 "published time); CX7 at 400 Gb/s",
    "trtllm-onesided": "perfect router ('balanced': min(k, ep) distinct ranks per token), as "
                       "its benchmark's --perfect_router; the post-quant table taken as EP8 "
                       "GB200 (its BF16 row equals the EP8 GB200 sweep)",
    "nccl-ep": "CX7 400 Gb/s per GPU (the README names no NIC); 256 experts, uniform routing",
}


def _v1() -> list[Case]:
    cases = [Case("deepep-v1", "h800", "normal", ph, "GBps", v, 8, 4096, "fit", _V1)
             for ph, v in (("dispatch", 153.0), ("combine", 158.0))]
    for ep, d, c in ((16, 43.0, 43.0), (32, 58.0, 57.0), (64, 51.0, 50.0)):
        nodes = ep // 8
        routing = f"group_limited:{nodes}:{min(nodes, 4)}" if nodes > 4 else "uniform"
        cases += [Case("deepep-v1", "h800", "normal", ph, "GBps", v, ep, 4096, "validation",
                       _V1, routing=routing) for ph, v in (("dispatch", d), ("combine", c))]
    for ep, d, c in ((8, 77, 114), (16, 118, 195), (32, 155, 273), (64, 173, 314),
                     (128, 192, 369), (256, 194, 360)):
        role = "fit" if ep == 8 else "validation"
        cases += [Case("deepep-v1", "h800", "low_latency", ph, "us", float(v), ep, 128, role,
                       _V1) for ph, v in (("dispatch", d), ("combine", c))]
    return cases


def _v2() -> list[Case]:
    rows = (("b200", 8, 24, 643.0, 675.0, "fit"), ("h100", 16, 12, 90.0, 81.0, "fit"),
            ("h100", 32, 6, 61.0, 61.0, "validation"), ("b200", 16, 12, 90.0, 91.0, "validation"),
            ("b200", 8, 64, 726.0, 740.0, "validation"))
    return [Case("deepep-v2", system, "normal", ph, "GBps", v, ep, 8192, role, _V2, num_sms=sms)
            for system, ep, sms, d, c, role in rows for ph, v in (("dispatch", d),
                                                                   ("combine", c))]


# (tokens per rank, dispatch us, combine us) per EP size, BF16 both ways, GB200 NVL72
_TRT_SWEEP = {
    8: ((1, 18.9, 31.0), (2, 18.4, 31.1), (4, 18.1, 31.4), (8, 17.6, 31.4), (16, 18.5, 32.6),
        (32, 18.2, 32.7), (64, 22.3, 34.1), (128, 31.7, 38.1), (256, 50.8, 53.0),
        (512, 89.5, 91.7), (1024, 166.3, 175.6), (2048, 311.8, 322.6)),
    16: ((1, 18.8, 30.8), (2, 19.1, 31.4), (4, 18.5, 31.6), (8, 18.9, 31.8), (16, 18.4, 33.0),
         (32, 20.2, 34.2), (64, 24.1, 35.6), (128, 34.6, 39.9), (256, 54.8, 57.0),
         (512, 97.1, 98.2), (1024, 181.2, 188.2), (2048, 343.3, 348.4)),
    32: ((1, 19.8, 31.4), (2, 19.7, 31.3), (4, 19.6, 31.4), (8, 19.4, 32.2), (16, 18.9, 33.4),
         (32, 21.1, 34.6), (64, 26.2, 36.4), (128, 37.8, 41.1), (256, 61.5, 59.7),
         (512, 109.6, 102.5), (1024, 197.5, 197.5), (2048, 373.7, 369.5)),
    64: ((1, 27.8, 32.6), (2, 24.8, 32.2), (4, 29.1, 33.0), (8, 20.4, 33.3), (16, 20.6, 35.0),
         (32, 23.1, 36.1), (64, 28.8, 37.7), (128, 41.6, 44.5), (256, 65.3, 62.9),
         (512, 115.7, 106.7), (1024, 209.4, 199.2), (2048, 399.2, 372.1)),
}
_TRT_FIT = {(8, 1), (8, 128), (8, 2048), (64, 1), (64, 2048)}


def _trt() -> list[Case]:
    cases = []
    for ep, rows in _TRT_SWEEP.items():
        for T, d, c in rows:
            role = "fit" if (ep, T) in _TRT_FIT else "validation"
            cases += [Case("trtllm-onesided", "gb200-nvl72", "normal", ph, "us", v, ep, T, role,
                           _TRT, gpus_per_node=72, dispatch_dtype="bf16", routing="balanced")
                      for ph, v in (("dispatch", d), ("combine", c))]
    for dtype, d in (("mxfp8", 172.2), ("nvfp4", 101.7)):
        cases.append(Case("trtllm-onesided", "gb200-nvl72", "normal", "dispatch", "us", d, 8,
                          2048, "validation", _TRT + ", post-quant dispatch table",
                          gpus_per_node=72, dispatch_dtype=dtype, routing="balanced"))
    return cases


def _nccl() -> list[Case]:
    rows = ((8, 224.3, 185.2, "fit"), (16, 76.7, 73.0, "fit"), (32, 53.6, 50.0, "validation"),
            (64, 48.8, 43.8, "validation"))
    return [Case("nccl-ep", "h100", "low_latency", ph, "GBps", v, ep, 128, role, _NCCL,
                 dispatch_dtype="bf16") for ep, d, c, role in rows
            for ph, v in (("dispatch", d), ("combine", c))]


CASES: tuple = tuple(_v1() + _v2() + _trt() + _nccl())

# Published numbers not used, and why (docs/PERFMODEL.md repeats this):
NOT_USED = {
    "uccl-ep": "AWS EFA (SRD, CPU proxy): the published combine of one platform varies 3x "
               "across EP sizes (18, 26, 43 GB/s at EP16, 24, 32 on p5en), which no "
               "bandwidth model without a per-case constant fits; the EFA fabric is not "
               "modelled (message rate, SRD, proxy latency)",
    "pplx-kernels": "its README names no GPU, NIC or expert count",
    "pplx-garden": "its tables do not say which GPU each column used",
    "hybrid-ep": "algorithm bandwidth whose byte formula the README does not state, and "
                 "'Torch API' times that include copies outside the kernels",
}
