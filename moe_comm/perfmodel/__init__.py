"""moe_comm.perfmodel: analytical model and routing simulator of EP dispatch and combine.

Predicts the time, bandwidth and bottleneck of one dispatch and one combine call on real
systems, from 8 GPUs to hundreds of thousands, for this package (the default) or another
implementation's profile (IMPLEMENTATIONS), or the hardware's lower bound:

    from moe_comm.perfmodel import predict, System, SYSTEMS
    p = predict(system="h800", mode="low_latency", ep=64, tokens_per_rank=128, hidden=7168,
                topk=8, num_experts=256, dispatch_dtype="fp8", combine_dtype="bf16",
                routing="uniform", gpus_per_node=8)
    p.dispatch_us, p.combine_us        # one call, microseconds (slowest rank)
    p.dispatch_GBps, p.combine_GBps    # logical bandwidth in the mode's convention, GB = 1e9
    p.bottleneck                       # of the slower phase; see BOTTLENECKS
    p.bytes["dispatch"]                # PhaseBytes: logical, minimum, per-link, local fraction
    p.dispatch.terms_us                # time each resource alone needs (which term bounds)
    predict(..., implementation="deepep-v1")   # "deepep-v2", "trtllm-onesided", "nccl-ep"
    predict(..., implementation="bound")       # no implementation can be faster
    moe_comm_counters(ids, ep=..., ...)        # this package's exact bytes for a routing

Only numpy and the standard library are imported; torch tensors are accepted as routing
input without importing torch, matplotlib is imported by the CLI's --plot and the study only.

Benchmark integration. For a measured row with world size R, T tokens per rank, hidden H,
top-k K, E experts and payload dtype `dtype` (a torch dtype or a name of DTYPES):

    from moe_comm.perfmodel import predict
    p = predict(args.system, "normal", ep=R, tokens_per_rank=T, hidden=H, topk=K,
                num_experts=E, dispatch_dtype=dtype, combine_dtype=dtype,
                routing=topk_idx)          # or "uniform"; topk_idx: [R*T, K] global, or any
                                           # [N, K] sample of expert ids (-1 = none)
    p.dispatch_us, p.combine_us            # predicted time of that workload on that system
    p.bytes["dispatch"].min_link_bytes     # minimum bytes per rank (each token once per
    p.bytes["combine"].min_link_bytes      # other destination rank), mean over ranks

Use mode="low_latency" for the low-latency ops. Combine dtypes: COMBINE_DTYPES.
"""
from .bound import predict_bound
from .counted import moe_comm_counters
from .formats import COMBINE_DTYPES, DTYPES, payload_bytes
from .implementations import IMPLEMENTATIONS, Algorithm, Implementation, get_implementation
from .model import predict
from .routing import expected_fanout
from .systems import GB, SYSTEMS, System, get_system
from .workload import BOTTLENECKS, MODES, PhaseBytes, PhasePrediction, Prediction

__all__ = [
    "BOTTLENECKS",
    "COMBINE_DTYPES",
    "DTYPES",
    "GB",
    "IMPLEMENTATIONS",
    "MODES",
    "SYSTEMS",
    "Algorithm",
    "Implementation",
    "PhaseBytes",
    "PhasePrediction",
    "Prediction",
    "System",
    "expected_fanout",
    "get_implementation",
    "get_system",
    "moe_comm_counters",
    "payload_bytes",
    "predict",
    "predict_bound",
]
