"""``python -m moe_comm.deep_ep --check``: which parts of DeepEP's API moe_comm honours."""
from __future__ import annotations

import argparse
import sys

HONOURED = [
    ("Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, ...)", "yes",
     "workspace built at the first call, grown to the largest call (sizes are upper bounds)"),
    ("Buffer.num_sms / set_num_sms / get_dispatch_config / get_combine_config / Config", "yes",
     "num_sms sizes moe_comm's GPU grids; chunk sizes change nothing"),
    ("get_low_latency_rdma_size_hint", "yes", "moe_comm's low-latency workspace bytes"),
    ("get_dispatch_layout", "yes",
     "no host read; num_tokens_per_rdma_rank across nodes, None on one node"),
    ("dispatch (top-k, FP8 pair, expert_alignment, num_worst_tokens)", "yes",
     "DeepEP's row order, stored there by moe_comm's receive (in rounds: one copy into it); "
     "one host read of the row count, one small all-reduce of sizes"),
    ("dispatch(handle=...) cached", "yes",
     "rows of the Buffer's dtype (not FP8 pairs), written in DeepEP's order directly"),
    ("dispatch without topk_idx", "no", "NotImplementedError"),
    ("combine (topk_weights)", "yes",
     "reads DeepEP's rows in place (with topk_weights: one expert-major copy); weights must be "
     "0 where recv_topk_idx is -1 (checked, else NotImplementedError)"),
    ("combine(bias=...)", "no", "NotImplementedError"),
    ("async_finish / previous_event / allocate_on_comm_stream", "yes",
     "one stream: ordered already; previous_event is waited for"),
    ("low_latency_dispatch (bf16, FP8, use_ue8m0 with round_scale, hook, recv stats)", "yes",
     "column-major scales [L, R*T, H/128]"),
    ("round_scale without use_ue8m0, dispatch/combine_wait_recv_cost_stats", "no",
     "NotImplementedError"),
    ("low_latency_combine (hook, out=, zero_copy, get_next_low_latency_combine_buffer)", "yes",
     ""),
    ("low_latency_combine(use_logfmt=True)", "no", "NotImplementedError"),
    ("low_latency_dispatch(use_nvfp4=True, x_global_scale=) (the hybrid-ep branch)", "no",
     "NotImplementedError: its CuTe-DSL layout is not reproduced; moe_comm.Buffer(..., "
     "dispatch_dtype='nvfp4') has moe_comm's"),
    ("clean_low_latency_buffer", "yes", "receives every call whose hook was not called"),
    ("enable_shrink: update (mask=True) / query / clean mask", "yes",
     "moe_comm's fault-tolerance mask; unmasking one rank: NotImplementedError; clean is "
     "collective over the live ranks"),
    ("get_local_buffer_tensor(use_rdma_buffer=True) with enable_shrink", "yes",
     "a view of moe_comm's low-latency workspace (its layout, not DeepEP's) after its protocol "
     "words: zeroing it, then the clean mask call on every live rank, resets it (vLLM's "
     "clean_buffers); other workspaces: NotImplementedError"),
    ("internode normal mode (num_rdma_bytes > 0, more ranks than a node)", "yes",
     "nodes of ranks_per_node= / MOE_COMM_RANKS_PER_NODE / 8 ranks, NIXL proxy between them, "
     "hierarchical (flat with ep_invariant); low-latency mode across the same nodes"),
    ("deep_ep.utils.EventOverlap / EventHandle", "yes", ""),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="print the feature table")
    args = parser.parse_args(argv)
    if not args.check:
        parser.print_help()
        return 0
    width = max(len(name) for name, _, _ in HONOURED)
    for name, state, note in HONOURED:
        print(f"{name:<{width}}  {state:<3}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
