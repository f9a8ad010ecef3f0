"""One-line mutations of the product, each with the tests that must catch it (``make mutants``).

    python tests/mutants.py [--list] [--only NAME ...] [--timeout S]

Each entry of ``MUTANTS`` breaks one promise of the README or docs/ with a one-line change of the
product and names the tests that hold that promise. The runner copies the tree (the files git
tracks, and untracked ones it does not ignore) into a temporary folder, runs every named test
there unchanged first (the control: a test that fails without a mutation catches nothing),
then applies each mutation alone, runs its tests (``pytest -x``) and puts the file back. A
mutation is caught when its tests fail (pytest's exit status 1) or hang past ``--timeout``. It
prints one row per mutation and exits 1 if any is not caught, or if the control fails. The
copy imports its own ``moe_comm`` (``PYTHONPATH``, checked before anything runs); nothing in
the checkout changes. About 50 minutes on 2 cores (102 mutations, 2026-12-07).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Mutant:
    name: str
    promise: str  # what the README or docs/ promise that the mutation breaks
    path: str  # relative to the tree
    old: str  # text within one line of the product
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail
    nth: int = 0  # which occurrence of ``old`` (where it occurs more than once)


F = "tests/test_fault.py::"
ST = "tests/test_staging.py::"
FL = "tests/test_fault_layers.py::"

IV = "tests/test_invariant.py::"
EP = "tests/test_emulated_puts.py::"

MUTANTS = (
    # ---- the EP-invariant combine
    Mutant("invariant_sum_in_reverse_choice_order",
           "ep_invariant=True sums each token's choices in choice order",
           "kernels/invariant.py", "for k in range(K):", "for k in range(K - 1, -1, -1):",
           (IV + "test_other_dtypes[dtype0]",),  # fp32 output: bf16 would hide the order
           nth=2),  # (the docstring's, the proxy descriptors', the reduce's)
    Mutant("invariant_send_rows_by_pass_not_choice",
           "ep_invariant: the send stores each (token, choice) row at its choice's place",
           "kernels/invariant.py",
           "at = base + tl.sum(tl.where(mine, kk[None, :], 0), axis=1)", "at = base + c",
           (IV + "test_other_dtypes[dtype0]",)),
    Mutant("invariant_sums_an_excluded_rank",
           "ep_invariant with fault tolerance leaves the choices of an excluded rank out",
           "kernels/invariant.py",
           "vk = vk & (tl.load(live + ids_k // L, mask=vk, other=0) != 0)", "vk = vk",
           (IV + "test_a_rank_excluded_after_the_dispatch_is_left_out_of_the_sum[host_waits]",)),
    Mutant("invariant_pairs_of_an_excluded_rank",
           "ep_invariant with fault tolerance leaves an excluded rank's choices out of a "
           "combine with values per row, and their values 0",
           "kernels/invariant.py",
           "valid = valid & (tl.load(live + rank, mask=valid, other=0) != 0)", "valid = valid",
           (IV + "test_a_rank_excluded_after_the_dispatch_is_left_out_of_the_sum[host_waits]",)),
    # ---- fault tolerance: each exclusion layer alone
    Mutant("combine_sums_excluded_partials",
           "combine leaves out the partials of excluded expert ranks",
           "kernels/combine.py", "slot = tl.where(tl.load(live + d) != 0, slot, -1)",
           "slot = slot", (FL + "test_combine_leaves_out_a_rank_excluded_after_its_rows_were_"
                           "sent[None-host_waits]",
                           F + "test_kill_one_rank_normal_mode_4_ranks[in_combine]")),
    Mutant("fp8_combine_sums_excluded_partials",
           "the FP8 combine leaves out the partials of excluded expert ranks",
           "kernels/combine.py", "slot = tl.where(tl.load(live + d) != 0, slot, -1)",
           "slot = slot", (FL + "test_combine_leaves_out_a_rank_excluded_after_its_rows_were_"
                           "sent[fp8-kernel_waits]",), nth=1),
    Mutant("layout_sends_to_excluded_ranks",
           "dispatch sends nothing to an excluded rank",
           "kernels/layout.py",
           "out = tl.load(mask + tl.maximum(dest, 0), mask=dest >= 0, other=0) != 0",
           "out = dest < -1",
           (FL + "test_layout_sends_nothing_to_or_from_an_excluded_rank[host_waits]",)),
    Mutant("layout_without_self_fence",
           "an excluded rank writes no row (the device-side fence of GPUs)",
           "kernels/layout.py",
           "out = out | (tl.load(mask + me + tl.zeros_like(dest)) != 0)", "out = out",
           (FL + "test_layout_sends_nothing_to_or_from_an_excluded_rank[kernel_waits]",)),
    Mutant("mask_polarity", "active_ranks(): True = active",
           "moe_comm/fault.py", "return self.mask == 0", "return self.mask != 0",
           (F + "test_fault_tolerance_arguments",)),
    Mutant("renormalize_by_survivors", "renormalize=True rescales by total / surviving weight",
           "moe_comm/fault.py", "total / torch.where(surviving != 0, surviving, 1)",
           "surviving / torch.where(surviving != 0, total, 1)",
           (F + "test_kill_one_rank_normal_mode_4_ranks[in_combine]",)),
    Mutant("dead_process_not_noticed",
           "a peer process of this node that has ended is excluded at once",
           "moe_comm/fault.py", "if self.mask_words[peer] == 0 and not pid_alive(pid):",
           "if self.mask_words[peer] == 0 and not pid_alive(pid) and False:",
           (F + "test_kill_one_rank_normal_mode_4_ranks[between]",)),
    # ---- the DeepEP facade
    Mutant("deep_ep_padding_not_zero", "num_worst_tokens pads recv_x with zero rows",
           "moe_comm/deep_ep/buffer.py", "recv_x = pad(recv_x, 0)", "recv_x = pad(recv_x, 7)",
           ("tests/test_deep_ep.py::test_normal_mode_matches_deepep_semantics[2-1]",)),
    # ---- host reads
    Mutant("host_read_in_combine_by_torch_equal",
           "combine reads nothing on the host",
           "moe_comm/normal_combine.py", "T, dev = slot_of.shape[0], self.device",
           "T, dev = slot_of.shape[0], self.device if torch.equal(slot_of, slot_of) else None",
           ("tests/test_syncs.py::test_gpu_flavours_read_nothing_else_on_the_meta_device",)),
    Mutant("host_read_in_low_latency_combine_by_cpu",
           "the low-latency ops read nothing on the host",
           "moe_comm/low_latency.py", "out = torch.empty((topk_idx.shape[0], self.hidden),",
           "out = torch.empty((topk_idx.cpu().shape[0], self.hidden),",
           ("tests/test_syncs.py::test_gpu_flavours_read_nothing_else_on_the_meta_device",)),
    # ---- bound launches: a warm launch is the launch Triton's own path makes
    Mutant("bound_specs_without_alignment",
           "a launch binds again where Triton specialises its tensors otherwise",
           "kernels/bound.py", "out.append((v.dtype, v.data_ptr() % 16 == 0)",
           "out.append((v.dtype, True)",
           ("tests/test_host_cost.py::test_every_bound_launch_is_the_launch_tritons_path_makes",)),
    Mutant("bound_call_without_alignment",
           "a bound launch is taken only by calls Triton specialises alike",
           "kernels/bound.py", "got.append((v.dtype, v.data_ptr() % 16 == 0)",
           "got.append((v.dtype, True)",
           ("tests/test_host_cost.py::test_every_bound_launch_is_the_launch_tritons_path_makes",)),
    Mutant("bound_key_without_grid",
           "a bound launch keeps the grid of the calls it serves",
           "kernels/combine.py", 'key = ("combine_reduce", grid, staging.shape,',
           'key = ("combine_reduce", staging.shape,',
           ("tests/test_host_cost.py::test_every_bound_launch_is_the_launch_tritons_path_makes",)),
    Mutant("bound_launch_keeps_old_arguments",
           "a bound launch passes this call's tensors",
           "kernels/bound.py", "            args[slot] = value",
           "            args[slot] = args[slot]",
           ("tests/test_host_cost.py::test_every_bound_launch_is_the_launch_tritons_path_makes",),
           nth=1),  # (__call__'s; the first is BoundLaunch.arguments')
    Mutant("bound_launch_holds_first_call_tensors",
           "a bound launch keeps none of the caller's tensors alive",
           "kernels/bound.py",
           "self.args = [None if i in self.slots else a for i, a in enumerate(args)]",
           "self.args = list(args)",
           ("tests/test_host_cost.py::test_every_bound_launch_is_the_launch_tritons_path_makes",)),
    # ---- the user's calls: the custom op where autograd or a watcher needs it
    Mutant("eager_ignores_autograd",
           "a call autograd records runs under the op's autograd Function",
           "moe_comm/ops.py", "if torch.is_grad_enabled() and (x.requires_grad or (",
           "if False and (x.requires_grad or (",
           ("tests/test_ops.py::test_eager_calls_run_the_ops_body_with_its_results",)),
    Mutant("eager_ignores_dispatch_modes",
           "a call a dispatch mode watches goes through the op",
           "moe_comm/ops.py", "            or torch._C._len_torch_dispatch_stack()\n", "",
           ("tests/test_ops.py::test_eager_calls_run_the_ops_body_with_its_results",)),
    # ---- the static gate
    Mutant("gate_drops_mxfp8", "the gate compiles every dispatch format",
           "moe_comm/testing/gate.py", 'for fmt in ("mxfp8", "nvfp4"):', 'for fmt in ("nvfp4",):',
           ("tests/test_gate.py::test_gate_drivers_launch_the_listed_variants",)),
    Mutant("gate_drops_fault_tolerant_low_latency",
           "the gate compiles the fault-tolerant flavour in both modes",
           "moe_comm/testing/gate.py", "(name, dtype, 0, True, False, True)]", "]",
           ("tests/test_gate.py::test_gate_drivers_launch_the_listed_variants",)),
    Mutant("gate_specialisation_rule_off",
           "the gate fails when ranks specialise apart",
           "moe_comm/testing/gate.py", "if any(len(set(g)) > 1 for g in groups):", "if False:",
           ("tests/test_gate.py::test_each_rule_fails_on_its_mutation[specialised_rank-None]",)),
    # ---- formats
    Mutant("nvfp4_global_scale_keeps_infinity",
           "NVFP4's global scale is taken over the finite |x|",
           "moe_comm/microscale.py",
           "a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))",
           "a = torch.where(torch.isnan(a), torch.zeros_like(a), a)",
           ("tests/test_microscale.py::test_nvfp4_global_scale_against_an_independent_oracle",)),
    Mutant("amax_floor", "scales floor amax at 1e-4 (MXFP8, NVFP4)",
           "moe_comm/microscale.py", "AMAX_FLOOR = 1e-4", "AMAX_FLOOR = 1e-5",
           ("tests/test_microscale.py::test_nvfp4_global_scale_against_an_independent_oracle",)),
    Mutant("fp8_scale_floor", "FP8 scale = max(amax, 1e-4) / 448",
           "kernels/quant.py", "tl.maximum(tl.max(tl.abs(v3), axis=2), 1e-4)",
           "tl.maximum(tl.max(tl.abs(v3), axis=2), 1e-5)",
           ("tests/test_fp8.py::test_quantize_matches_reference_and_error_bound",)),
    Mutant("ue8m0_rounds_down", "UE8M0 rounds scales up to powers of two",
           "kernels/quant.py", "exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.uint32)",
           "exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.uint32) * 0",
           ("tests/test_fp8.py::test_quantize_matches_reference_and_error_bound",)),
    Mutant("nan_lost_in_bf16_rounding", "a payload NaN (0x7FFFFFFF) stays NaN through bf16",
           "kernels/numerics.py",
           "rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)",
           "rounded = rounded",
           ("tests/test_nan.py::test_payload_nan_weight_and_nan_rows_reach_the_output",)),
    # ---- the protocol and the data path
    Mutant("combine_rank_order_reversed", "the home rank sums the partials in rank order 0..R-1",
           "kernels/combine.py", "for d in range(d0, d1):",
           "for d in range(d1 - 1, d0 - 1, -1):",
           ("tests/test_loopback.py::test_home_rank_sums_partials_in_rank_order",)),
    Mutant("combine_send_choices_compacted_reversed",
           "a token's choices on one rank are summed in order k = 0, 1, ... (normal mode)",
           "kernels/combine.py", "place = tl.cumsum(valid, axis=1) - 1",
           "place = count[:, None] - tl.cumsum(valid, axis=1)",
           ("tests/test_loopback.py::test_combine_sums_a_ranks_choices_in_choice_order",)),
    Mutant("combine_send_fullest_slot_short", "combine: out[t] sums every row of t",
           "kernels/combine.py", "if kmax > g * IN_FLIGHT:",
           "if kmax > g * IN_FLIGHT + IN_FLIGHT:",
           ("tests/test_loopback.py::test_matches_reference",)),
    Mutant("ring_positions_not_rebased", "rounds: a token's slot less its rank's earlier rounds",
           "kernels/layout.py", "        before += rows", "        before += rows * 0",
           ("tests/test_layout.py::test_ring_positions_match_their_statement",
            ST + "test_rounds_match_reference[R4-E8-H64-K2-T9.3.0.11-bfloat16-uniform-a1-1]")),
    Mutant("node_rows_numbered_from_one",
           "hierarchical rounds: a token's row in a node's message is its place in the window",
           "kernels/layout.py",
           "tl.where(hit > 0, seen - before + tl.cumsum(hit, axis=0) - 1, -1)",
           "tl.where(hit > 0, seen - before + tl.cumsum(hit, axis=0), -1)",
           ("tests/test_layout.py::test_ring_positions_match_their_statement"
            "[17-2-4-3-bad-2-tiles64]",
            ST + "test_hierarchical_nodes_in_rounds_match_reference")),
    Mutant("hierarchical_round_forwarded_into_round_0_slots",
           "hierarchical rounds in one launch: round i's forwarded slots at round i's rows",
           "kernels/dispatch_rounds.py", "fwd_slots + i * (R // N) * W * N,", "fwd_slots,",
           (ST + "test_hierarchical_nodes_in_rounds_match_reference",)),
    Mutant("hierarchical_round_outbox_by_the_first_window",
           "hierarchical rounds in one launch: a token's row in round i's node message",
           "kernels/dispatch_rounds.py", "node_ring + first * (R // N), plan", "node_ring, plan",
           (ST + "test_hierarchical_nodes_in_rounds_match_reference",)),
    Mutant("forwarder_tiles_numbered_across_nodes",
           "hierarchical rounds in one launch: tile t of node b's message is its own tile t",
           "kernels/internode.py",
           "forward_rows(b, w - tl.sum(tl.where(at_b, tiles_end - node_tiles, 0), axis=0),",
           "forward_rows(b, w,",
           (ST + "test_hierarchical_rounds_in_one_launch_deal_every_nodes_messages",)),
    Mutant("low_latency_choice_order_reversed",
           "the low-latency combine sums a token's choices in order k = 0, 1, ...",
           "kernels/low_latency.py",
           "for k in tl.static_range(BLOCK_K):  # unrolled: every choice's load",
           "for k in tl.static_range(BLOCK_K - 1, -1, -1):  # unrolled: every choice's load",
           ("tests/test_loopback.py::test_low_latency_combine_sums_in_choice_order",)),
    Mutant("nixl_progress_thread_polls",
           "nixl: between calls a rank's process stays under a tenth of a core",
           "moe_comm/transport/nixl.py", "enable_prog_thread=False,", "enable_prog_thread=True,",
           ("tests/test_internode.py::test_an_idle_proxy_leaves_the_cores_alone",)),
    Mutant("one_staging_parity", "staging is double-buffered by epoch parity",
           "kernels/dispatch.py", "parity = epoch % 2", "parity = epoch * 0",
           ("tests/test_ranks.py::test_stragglers_back_to_back_bit_identical",)),
    Mutant("padding_not_zeroed", "padding rows are zero",
           "kernels/dispatch.py", "tl.zeros([BLOCK_T, BLOCK_H], out.dtype.element_ty),",
           "tl.full([BLOCK_T, BLOCK_H], 7, out.dtype.element_ty),",
           ("tests/test_syncs.py::test_only_padding_rows_are_zeroed_and_they_all_are",)),
    Mutant("bad_expert_id_not_recorded",
           "a row with a bad expert id raises ValueError after the call",
           "kernels/layout.py", "        if first < T:  # gate: cold\n",
           "        if first < 0:  # gate: cold\n",
           ("tests/test_ranks.py::test_a_bad_expert_row_goes_nowhere_and_raises_after_the_call",)),
    Mutant("layout_order_not_by_token",
           "rows of an expert come by source rank, then source token",
           "kernels/layout.py", "(flat_token[None, :] < local[:, None])",
           "(flat_token[None, :] <= local[:, None])",
           ("tests/test_layout.py::test_routing_layout_matches_its_statement",)),
    Mutant("slot_rows_tail_not_written",
           "every output is written by the expand: no fill launch",
           "kernels/dispatch.py", "tl.full([BLOCK_Z, BLOCK_K], -1, tl.int32),",
           "tl.full([BLOCK_Z, BLOCK_K], 0, tl.int32),",
           ("tests/test_syncs.py::test_only_padding_rows_are_zeroed_and_they_all_are",)),
    Mutant("dispatch_fills_an_output",
           "a normal dispatch launches 5 kernels on a GPU, no torch one",
           "moe_comm/normal_dispatch.py",
           "src_rank = torch.empty(rows, dtype=torch.int64, device=dev)",
           "src_rank = torch.full((rows,), -1, dtype=torch.int64, device=dev)",
           ("tests/test_host_cost.py::test_launches_per_op_are_counted_and_bounded",)),
    Mutant("too_many_rows_not_recorded",
           "more rows than max_recv_rows raise RuntimeError",
           "kernels/dispatch.py", "        if total > max_rows:", "        if total < 0:",
           ("tests/test_syncs.py::test_too_few_max_recv_rows_raise_after_the_call_and_the_"
            "buffer_goes_on",)),
    Mutant("signal_bytes_not_counted", "bytes per combine: n_d * H * b + 8",
           "kernels/combine.py", "signal_bytes = 8 + tl.zeros([1], tl.int64)",
           "signal_bytes = 0 + tl.zeros([1], tl.int64)",
           ("tests/test_loopback.py::test_launch_counts",
            "tests/test_ranks.py::test_bytes_on_the_link_are_the_minimum_and_launches_as_"
            "documented")),
    Mutant("metadata_bytes_miscounted", "bytes per dispatch: n_d * (H * b + 4 * (1 + 3K)) + ...",
           "kernels/dispatch.py", "row_bytes += 4 * (1 + 3 * K)", "row_bytes += 4 * (1 + 2 * K)",
           ("tests/test_ranks.py::test_bytes_on_the_link_are_the_minimum_and_launches_as_"
            "documented",)),
    Mutant("timeout_names_this_rank", "a timeout names the peer that did not arrive",
           "kernels/comm.py",
           "raise PeerTimeoutError(rank, s, channel, expected, int(observe()[s]), timeout_s)",
           "raise PeerTimeoutError(rank, rank, channel, expected, int(observe()[s]), timeout_s)",
           ("tests/test_ranks.py::test_peer_that_skips_a_call_is_named_within_the_timeout"
            "[host-waits]",)),
    Mutant("wait_not_bounded_by_timeout", "every wait for a peer ends after MOE_COMM_TIMEOUT_S",
           "kernels/comm.py", "deadline = start + timeout_s", "deadline = start + 10 * timeout_s",
           ("tests/test_ranks.py::test_peer_that_skips_a_call_is_named_within_the_timeout"
            "[host-waits]",)),
    Mutant("combine_reads_rows_on_the_host",
           "a normal combine reads no tensor data on the host",
           "moe_comm/buffer.py", "out = combine_autograd(self, y, handle, weights, fp8)",
           "out = combine_autograd(self, y, handle, weights, fp8 or not torch.equal(y, y))",
           ("tests/test_syncs.py::test_gpu_flavours_read_nothing_else_on_the_meta_device",)),
    Mutant("bounds_let_more_tokens_through",
           "with MOE_COMM_CHECK_INPUTS=0 no kernel reaches outside its buffers",
           "moe_comm/validation.py", "    if x.shape[0] > max_tokens:",
           "    if x.shape[0] > 2 * max_tokens:",
           ("tests/test_bounds.py::test_normal_mode_bounds_hold_without_the_checks",)),
    Mutant("facade_cached_dispatch_takes_any_rows",
           "the facade's cached dispatch checks x against its handle",
           "moe_comm/deep_ep/checks.py", "    if tuple(t.shape) != (tokens, hidden):",
           "    if t.shape[1] > hidden:",
           ("tests/test_deep_ep.py::test_bad_input_to_every_facade_call_names_the_argument",)),
    Mutant("native_low_latency_quantizes_by_default",
           "the native low-latency dispatch sends the Buffer's dtype unless a format is asked",
           "moe_comm/low_latency.py",
           "            fp8 = bool(dispatch_dtype is not None or ue8m0 or col_major_scales)",
           "            fp8 = True",
           ("tests/test_low_latency.py::"
            "test_the_native_dispatch_sends_the_buffers_dtype_unless_a_format_is_asked_for",)),
    Mutant("proxy_fence_does_not_wait",
           "a signal posted alone goes out after every earlier transfer to its peer completed",
           "moe_comm/transport/nixl.py",
           "            if peer in held or oldest.get(peer, after + 1) <= after:",
           "            if peer in held:",
           ("tests/test_proxy_order.py",)),
    Mutant("third_low_latency_send_allowed",
           "a third low-latency send before the oldest hook raises",
           "moe_comm/low_latency.py", "if len(queue) < IN_FLIGHT:",
           "if len(queue) <= IN_FLIGHT:",
           ("tests/test_low_latency.py::test_misuse_raises_clear_errors",)),
    Mutant("low_latency_hook_receives_only_itself",
           "a hook runs every earlier receive of its channel first (dropped or reordered "
           "hooks each give their own call's rows)",
           "moe_comm/low_latency.py", "    oldest = queue.pop(0)",
           "    oldest = queue.pop(-1)",
           ("tests/test_low_latency.py::"
            "test_dropped_and_reordered_hooks_give_each_call_its_own_rows",)),
    Mutant("ranks_do_not_compare_call_descriptors",
           "a normal dispatch whose ranks pass options that must agree raises on every rank",
           "kernels/comm.py",
           "first = tl.min(tl.where(keep & (desc != mine), src, none), axis=0)",
           "first = tl.min(tl.where(keep & (desc != desc), src, none), axis=0)",
           ("tests/test_call_agreement.py::"
            "test_a_rank_that_refuses_or_disagrees_is_named_on_every_rank_within_the_call"
            "[one-node]",)),
    Mutant("bad_dispatch_input_is_not_refused",
           "a rank whose dispatch input is bad takes part in the call: its peers raise within it",
           "moe_comm/buffer.py",
           "        empty = refusal_inputs(self)",
           "        empty = None",
           ("tests/test_call_agreement.py::"
            "test_a_rank_that_refuses_or_disagrees_is_named_on_every_rank_within_the_call"
            "[one-node]",)),
    Mutant("low_latency_receive_ignores_call_descriptors",
           "a low-latency dispatch whose ranks pass other formats raises in every hook",
           "kernels/low_latency.py",
           "        if s == 0:  # a source with another call descriptor is recorded",
           "        if s < 0:  # a source with another call descriptor is recorded",
           ("tests/test_call_agreement.py::"
            "test_a_low_latency_rank_that_refuses_or_disagrees_is_named_by_every_hook"
            "[one-node]",)),
    Mutant("bad_low_latency_input_is_not_refused",
           "a rank whose low-latency input is bad takes part: its peers' hooks raise",
           "moe_comm/low_latency.py",
           "        empty = self._refusal_inputs()",
           "        empty = None",
           ("tests/test_call_agreement.py::"
            "test_a_low_latency_rank_that_refuses_or_disagrees_is_named_by_every_hook"
            "[one-node]",)),
    Mutant("held_low_latency_outputs_are_reused",
           "a low-latency dispatch never writes into outputs the caller still holds",
           "moe_comm/low_latency.py", "sys.getrefcount(t) != refs[i]",
           "sys.getrefcount(t) < 0",
           ("tests/test_low_latency.py::"
            "test_outputs_are_reused_only_when_nothing_refers_to_them",)),
    Mutant("combine_ignores_call_descriptors",
           "a normal combine whose ranks pass other formats or refuse raises on every rank",
           "moe_comm/error_record.py",
           "if word >> EPOCH_SHIFT == epoch and theirs != mine:",
           "if word >> EPOCH_SHIFT == epoch and theirs != theirs:",
           ("tests/test_call_agreement.py::"
            "test_a_rank_that_refuses_or_disagrees_is_named_on_every_rank_within_the_call"
            "[one-node]",)),
    Mutant("combine_kernel_wait_ignores_call_descriptors",
           "with the waits in the kernels, a combine whose ranks differ raises on every rank",
           "kernels/comm.py", "    keep = valid & ((words >> EPOCH_SHIFT) == epoch)",
           "    keep = valid & ((words >> EPOCH_SHIFT) < 0)",
           ("tests/test_call_agreement.py::"
            "test_a_rank_that_refuses_or_disagrees_is_named_on_every_rank_within_the_call"
            "[one-node-kernel-waits]",)),
    Mutant("bad_combine_input_is_not_refused",
           "a rank whose combine input is bad takes part in the call: its peers raise within it",
           "moe_comm/buffer.py",
           "        if refusal_inputs(self) is None or handle is None:",
           "        if True:",
           ("tests/test_call_agreement.py::"
            "test_a_rank_that_refuses_or_disagrees_is_named_on_every_rank_within_the_call"
            "[one-node]",)),
    Mutant("forwarder_passes_on_its_own_descriptor",
           "hierarchical: a home on another node hears that a rank of the forwarder's node "
           "differs",
           "kernels/internode.py", "        relay = first | MIXED", "        relay = mine",
           ("tests/test_call_agreement.py::"
            "test_a_rank_that_refuses_or_disagrees_is_named_on_every_rank_within_the_call"
            "[proxy-hierarchical-rounds]",)),
    Mutant("low_latency_combine_ignores_call_descriptors",
           "a low-latency combine whose ranks pass other formats raises in every hook",
           "kernels/low_latency.py",
           "        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):  # gate: cold",
           "        if (tl.program_id(0) < 0) & (tl.program_id(1) == 0):  # gate: cold",
           ("tests/test_call_agreement.py::"
            "test_a_low_latency_rank_that_refuses_or_disagrees_is_named_by_every_hook"
            "[one-node]",)),
    Mutant("bad_low_latency_combine_input_is_not_refused",
           "a rank whose low-latency combine input is bad takes part: its peers' hooks raise",
           "moe_comm/low_latency.py",
           "        empty = self._refusal_inputs()",
           "        empty = None",
           ("tests/test_call_agreement.py::"
            "test_a_low_latency_rank_that_refuses_or_disagrees_is_named_by_every_hook"
            "[one-node]",), nth=1),
    # ---- bounded staging: the rounds of a call
    Mutant("round_meta_names_window_token",
           "a row sent in a later round names its token by its index in the call",
           "kernels/dispatch.py", "tl.store(meta, t + t_base, mask=sm)",
           "tl.store(meta, t, mask=sm)",
           (ST + "test_rounds_match_reference[R4-E8-H64-K2-T9.3.0.11-bfloat16-uniform-a1-1]",)),
    Mutant("round_sends_the_first_window",
           "each round sends its own window of the call's tokens",
           "moe_comm/normal_dispatch.py",
           "window = slice(t_base, t_base + self.layout.ring_slots)",
           "window = slice(0, self.layout.ring_slots)",
           (ST + "test_rounds_match_reference[R4-E8-H64-K2-T9.3.0.11-bfloat16-uniform-a1-1]",)),
    Mutant("outbox_round_meta_names_window_token",
           "a row sent to another node in a later round names its token by its index in the call",
           "kernels/internode.py", "tl.store(meta, t + t_base, mask=sm)",
           "tl.store(meta, t, mask=sm)",
           (ST + "test_quantized_hierarchical_nodes_in_rounds_of_one_slot[fp8-ue8m0]",)),
    Mutant("outboxes_not_paid_from_the_budget",
           "across nodes, flat, the staging budget pays for the outboxes' slots too",
           "moe_comm/workspace.py", "return 2 * per_slot", "return per_slot",
           (ST + "test_flat_nodes_in_rounds_match_reference_and_move_the_whole_batch_bytes",)),
    Mutant("one_launch_combine_reads_the_other_parity",
           "a combine's rounds in one launch give the bits of the launches per round",
           "kernels/combine_rounds.py",
           "staging + parity * STAGING_PARITY, meta + parity * META_PARITY,",
           "staging + (1 - parity) * STAGING_PARITY, meta + parity * META_PARITY,",
           (ST + "test_one_launch_combines_give_the_bits_of_launches_per_round",)),
    Mutant("one_launch_dispatch_forgets_the_earlier_rounds_slots",
           "a dispatch's rounds in one launch give the bits of the launches per round",
           "kernels/dispatch_rounds.py", "end = end + tl.sum(n, axis=0)", "end = end + 0",
           (ST + "test_one_launch_dispatches_give_the_bits_of_launches_per_round",)),
    Mutant("one_launch_invariant_combine_reads_the_other_parity",
           "the EP-invariant combine's rounds in one launch give the bits of the launches per "
           "round",
           "kernels/invariant_rounds.py",
           "stage + parity * STAGE_PARITY, meta + parity * META_PARITY,",
           "stage + (1 - parity) * STAGE_PARITY, meta + parity * META_PARITY,",
           (ST + "test_one_launch_invariant_combines_give_the_bits_of_launches_per_round",)),
    Mutant("one_launch_cached_dispatch_expands_round_0s_slots_each_round",
           "combine's backward in rounds as one launch gives the bits of the launches per round",
           "kernels/dispatch_rounds.py", "ends = tl.load(view + src + 1, mask=sm, other=0)",
           "ends = tl.load(slot_offsets + src + 1, mask=sm, other=0)",
           (ST + "test_one_launch_combines_give_the_bits_of_launches_per_round",)),
    Mutant("ft_one_launch_combine_sums_every_source",
           "a fault-tolerant combine in one launch sums each round over the sources it heard",
           "kernels/combine_rounds.py",
           "HAS_PAIR, ACC_FP64, REDUCE_EVEN_H, HIER, FT, FP8, ROW_BYTES,",
           "HAS_PAIR, ACC_FP64, REDUCE_EVEN_H, HIER, False, FP8, ROW_BYTES,",
           (ST + "test_kills_between_rounds_leave_the_survivors_exact[kernel_waits]",)),
    Mutant("ft_one_launch_dispatch_takes_sources_that_stopped",
           "a fault-tolerant dispatch in one launch expands each round from the sources it heard",
           "kernels/dispatch_rounds.py",
           "arrived = arrived & (tl.load(live + i * R + src, mask=sm, other=0) != 0)",
           "arrived = arrived",
           (ST + "test_kills_between_rounds_leave_the_survivors_exact[kernel_waits]",)),
    Mutant("ft_one_launch_dispatch_fills_padding_alone",
           "a fault-tolerant dispatch in one launch fills every output row before its rows",
           "kernels/dispatch_rounds.py",
           "        padded_from = 0", "        padded_from = total",
           (ST + "test_kills_between_rounds_leave_the_survivors_exact[kernel_waits]",)),
    Mutant("ft_laying_out_send_waits_without_excluding",
           "a fault-tolerant round 0 that lays out what arrived excludes a silent source",
           "kernels/dispatch.py", "LAY_OUT=lay_out is not None, FT=ft,",
           "LAY_OUT=lay_out is not None, FT=False,",
           (ST + "test_kills_between_rounds_leave_the_survivors_exact[kernel_waits]",)),
    Mutant("ft_one_launch_invariant_combine_sums_every_source",
           "a fault-tolerant EP-invariant combine in one launch sums each round over the "
           "sources it heard",
           "kernels/invariant_rounds.py",
           "HAS_WEIGHTS, HAS_PAIR, FT, REDUCE_EVEN_H, REDUCE_T, REDUCE_H,",
           "HAS_WEIGHTS, HAS_PAIR, False, REDUCE_EVEN_H, REDUCE_T, REDUCE_H,",
           (ST + "test_kills_between_rounds_ep_invariant_in_one_launch",)),
    Mutant("ft_one_launch_excludes_by_stores_on_every_node",
           "a fault-tolerant call in one launch through the proxy excludes a silent source on "
           "the ranks it reaches by stores",
           "kernels/comm.py", " " * 34 + "BLOCK_R, NUM_THREADS, TRANSPORT,\n",
           " " * 34 + "BLOCK_R, NUM_THREADS, 0,\n",
           (ST + "test_kills_between_rounds_across_nodes[kernel_waits]",)),
    Mutant("hierarchical_one_launch_combine_forwards_round_0s_rows",
           "a hierarchical combine in one launch gives the bits of the launches per round",
           "kernels/combine_rounds.py",
           "hc_box_rows, hc_box_meta, fwd_slots + i * (R // N) * W * N,",
           "hc_box_rows, hc_box_meta, fwd_slots,",
           (ST + "test_one_launch_combines_across_nodes_give_the_bits_of_launches_per_round["
            "hierarchical]",)),
    Mutant("proxy_one_launch_invariant_outbox_bytes_uncounted",
           "the stats count the bytes written into the outboxes (an EP-invariant combine in "
           "one launch through the proxy too)",
           "kernels/invariant_rounds.py",
           "slot_offsets + i * OFFSETS_STRIDE, src_token, peer_ptrs, stats, xstats,",
           "slot_offsets + i * OFFSETS_STRIDE, src_token, peer_ptrs, stats, stats,",
           (ST + "test_one_launch_combines_across_nodes_give_the_bits_of_launches_per_round["
            "invariant-flat]",)),
    Mutant("proxy_one_launch_combine_partials_by_stores_alone",
           "a combine in one launch across nodes through the proxy puts the partials for other "
           "nodes into the outbox and posts them",
           "kernels/combine_rounds.py", "ACC_FP64, FP8, TRANSPORT, HIER,",
           "ACC_FP64, FP8, 0, HIER,",
           (ST + "test_flat_nodes_in_rounds_with_waits_in_the_kernels_run_in_one_launch",)),
    Mutant("proxy_one_launch_dispatch_rows_by_stores_alone",
           "a dispatch in one launch across nodes through the proxy puts the rows for other "
           "nodes into the outboxes and posts them",
           "kernels/dispatch_rounds.py", "UE8M0, GS, TRANSPORT, PROXY_BOX, ALIGN, EVEN_H,",
           "UE8M0, GS, TRANSPORT, False, ALIGN, EVEN_H,",
           (ST + "test_flat_nodes_in_rounds_with_waits_in_the_kernels_run_in_one_launch",)),
    Mutant("flat_proxy_message_of_expert_0s_rows",
           "across nodes, flat, each rank on another node gets every row sent to it",
           "kernels/internode.py", "n = slots_in(tl.load(counts + d * (L + 1) + L).to(tl.int64))",
           "n = slots_in(tl.load(counts + d * (L + 1)).to(tl.int64))",
           ("tests/test_internode.py::test_hierarchical_cross_node_bytes_are_the_minimum_and_"
            "below_flat",)),
    Mutant("flat_proxy_cached_rows_but_slot_0s",
           "across nodes, flat, combine's backward in rounds sends each round all its rows",
           "moe_comm/normal_dispatch.py", "self._round_windows(ring >= 0)",
           "self._round_windows(ring > 0)",
           (ST + "test_gradients_of_flat_nodes_in_rounds_match_reference_autograd[kernel_waits]",
            ST + "test_gradients_of_flat_nodes_in_rounds_match_reference_autograd[host_waits]")),
    Mutant("flat_proxy_outbox_bytes_without_metadata",
           "the stats count the bytes written into the outboxes, metadata included",
           "kernels/dispatch.py", "* (payload + SEND_META * 4 * META_STRIDE), 0)",
           "* payload, 0)",
           ("tests/test_internode.py::test_hierarchical_cross_node_bytes_are_the_minimum_and_"
            "below_flat",)),
    Mutant("nvshmem_one_launch_dispatch_by_stores_alone",
           "a dispatch in one launch across hosts over NVSHMEM puts the rows for peers without "
           "a pointer",
           "kernels/dispatch_rounds.py", "UE8M0, GS, TRANSPORT, PROXY_BOX, ALIGN, EVEN_H,",
           "UE8M0, GS, 0, False, ALIGN, EVEN_H,",
           (EP + "test_nvshmem_rounds_in_one_launch_give_the_bits_and_puts_of_launches_per_"
                 "round",)),
    Mutant("nvshmem_combine_per_round",
           "across hosts over NVSHMEM a combine's rounds run in one launch",
           "moe_comm/plan.py", "flavour.transport in (0, 1) and not proxy",
           "flavour.transport == 0 and not proxy",
           (EP + "test_nvshmem_rounds_in_one_launch_give_the_bits_and_puts_of_launches_per_"
                 "round",)),
    Mutant("nvshmem_quantizing_send_in_the_plain_tiles",
           "on GPUs across hosts over NVSHMEM every format's rounds run in one launch, the "
           "ring cut to fit them",
           "kernels/dispatch_rounds.py", 'send = "dispatch_rounds_send_nvshmem_quantizing"',
           'send = "dispatch_rounds_send"',
           (ST + "test_gpu_rings_are_cut_to_what_one_launch_runs_a_round_of",)),
    Mutant("fp8_dispatch_scales_zeroed_by_a_launch",
           "a normal dispatch, FP8 too, launches at most 5 kernels",
           "moe_comm/normal_dispatch.py", "col_major_scales, dev, alloc)", "col_major_scales, dev)",
           ("tests/test_host_cost.py::test_launches_per_op_are_counted_and_bounded",)),
    Mutant("ft_round_decision_read_without_its_ok_bit",
           "every program of a fault-tolerant launch takes program 0's decision, a stop too",
           "kernels/comm.py",
           "go = seen & ((tl.load(decided, volatile=True) & 1) != 0)", "go = seen",
           (FL + "test_one_decision_per_round_for_every_program_of_a_launch",)),
    Mutant("gpu_ring_cut_one_multiple_short_of_the_largest_that_fits",
           "on GPUs a ring of several rounds is cut to the largest that every format's one "
           "launch fits",
           "moe_comm/rings.py",
           "lo, hi = (mid, hi) if fits(mid * RING_SLOT_MULTIPLE) else (lo, mid)",
           "lo, hi = (mid, hi) if fits(mid * RING_SLOT_MULTIPLE + 16) else (lo, mid)",
           (ST + "test_gpu_rings_are_cut_to_what_one_launch_runs_a_round_of",)),
    Mutant("gpu_ring_cut_left_to_the_budget",
           "on GPUs a ring of several rounds is cut to what one launch runs a round of",
           "moe_comm/plan.py",
           "cut = one_launch_sms(device_type, proxy, num_sms) if own_process else None",
           "cut = None",
           (ST + "test_gpu_rings_are_cut_to_what_one_launch_runs_a_round_of",)),
    Mutant("round_0_send_lays_out_without_waiting",
           "a dispatch in rounds whose round 0's send lays out what arrived waits for every "
           "source first, bounded, naming a late one",
           "kernels/dispatch.py", "R, L, alignment, me, COUNT_PARITY, True, False, FT, 0,",
           "R, L, alignment, me, COUNT_PARITY, False, False, FT, 0,",
           (ST + "test_one_launch_op_names_a_peer_that_skips_it[dispatch]",
            ST + "test_one_launch_dispatches_give_the_bits_of_launches_per_round")),
    Mutant("forwarders_not_paid_from_the_budget",
           "across nodes, hierarchical, the staging budget pays for the outboxes' slot per node "
           "and the forwarders' regions",
           "moe_comm/workspace.py",
           "return (per_slot + PARITIES * (M * (4 * row + 8 * node_meta + 8 * K)"
           " + R * (row + 4 * K))",
           "return (2 * per_slot",
           (ST + "test_hierarchical_workspace_across_nodes_from_ep_16_to_256",)),
    Mutant("node_rows_numbered_across_the_call",
           "hierarchical rounds number each node's message rows within the round's window",
           "kernels/layout.py", "            before = seen  # those of the earlier rounds",
           "            before = seen * 0",
           (ST + "test_hierarchical_nodes_in_rounds_match_reference",)),
    Mutant("forwarder_reuses_the_first_rounds_slots",
           "a hierarchical round's combine sends back the slots its own forwarder pass took",
           "moe_comm/forwarders.py",
           "return fwd_slots[i * M:(i + 1) * M], fwd_n[i * S:i * S + M]",
           "return fwd_slots[:M], fwd_n[:M]",
           (ST + "test_hierarchical_nodes_in_rounds_match_reference",)),
    Mutant("ft_later_rounds_place_rows_by_their_own_counts",
           "fault tolerance in rounds: a source that stops after round 0 moves no other "
           "source's rows",
           "moe_comm/normal_dispatch.py", "_, _, _, offsets = self._received_layout(",
           "row_base, _, _, offsets = self._received_layout(",
           (ST + "test_kills_between_rounds_leave_the_survivors_exact[host_waits]",)),
    Mutant("ft_combine_rounds_hear_round_0_only",
           "fault tolerance in rounds: each combine round leaves out the ranks it did not hear",
           "moe_comm/normal_combine.py", "live = round_pending.live", "live = pending.live",
           (ST + "test_kills_between_rounds_leave_the_survivors_exact[host_waits]",)),
    Mutant("renormalize_reads_the_last_round_only",
           "renormalize=True in rounds renormalises each token by the ranks its round heard",
           "moe_comm/buffer.py", "live = live[window]", "live = live[-1]",
           (ST + "test_kills_between_rounds_leave_the_survivors_exact[host_waits]",)),
    # ---- the performance model
    Mutant("perfmodel_regression", "the model predicts the published numbers (pinned accuracy)",
           "moe_comm/perfmodel/implementations.py", "per_peer_us=0.114,", "per_peer_us=0.150,",
           ("tests/test_perfmodel.py::test_validation_cases_within_bounds",)),    # ---- CPU ranks
    Mutant("interpreter_repatches_per_helper_call",
           "a helper call inside a launch does not patch triton.language again",
           "kernels/interpreter.py", "if langs is None or not needed <= langs:", "if True:",
           ("tests/test_interpreter.py::test_one_patch_per_launch_and_the_same_results",)),
    Mutant("block_type_memo_ignores_pointer_kind",
           "a launch's block types are one per value: pointers differ by space and constness",
           "kernels/interpreter.py",
           'return ("pointer", _type_key(ty.element_ty), ty.address_space, ty.const)',
           'return ("pointer", _type_key(ty.element_ty))',
           ("tests/test_interpreter.py::test_block_types_are_made_once_per_value_in_a_launch",)),
    Mutant("low_latency_combine_ignores_out", "low_latency_combine(out=) writes the caller's out",
           "moe_comm/low_latency.py", "handle, renormalize, fp8, impl, out=out)",
           "handle, renormalize, fp8, impl, out=None)",
           ("tests/test_low_latency.py::test_combine_writes_into_the_callers_out",)),
    Mutant("pairwise_cover_holds_single_values_only",
           "make test's Triton 3.6 gate compiles every pair of values that meet at run time",
           "moe_comm/testing/gate.py",
           "return {(a, b) for i, a in enumerate(words) for b in words[i:]}",
           "return {(a, a) for a in words}",
           ("tests/test_gate.py::test_the_pairwise_cover_holds_every_pair_a_kernel_runs_"
            "and_the_op_targets",)),
)


def _files(root: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=root, capture_output=True, check=True).stdout.decode()
    return [f for f in out.split("\0") if f and os.path.isfile(os.path.join(root, f))]


def copy_tree(root: str, dest: str) -> None:
    """The checkout's files into ``dest``, with ``moe_comm/kernels`` pointing at ``kernels``
    (what the editable install maps), so that ``PYTHONPATH=dest`` imports the copy."""
    for rel in _files(root):
        os.makedirs(os.path.dirname(os.path.join(dest, rel)) or dest, exist_ok=True)
        shutil.copy2(os.path.join(root, rel), os.path.join(dest, rel))
    os.symlink(os.path.join("..", "kernels"), os.path.join(dest, "moe_comm", "kernels"))


def _env(tree: str) -> dict:
    return {**os.environ, "PYTHONPATH": tree, "PYTHONDONTWRITEBYTECODE": "1"}


def check_imports(tree: str) -> None:
    probe = ("import moe_comm, moe_comm.kernels.combine as c; "
             "print(moe_comm.__file__); print(c.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tree, env=_env(tree),
                         capture_output=True, text=True, check=True).stdout.split()
    real = os.path.realpath(tree)
    if not all(os.path.realpath(p).startswith(real + os.sep) for p in out):
        raise SystemExit(f"the copy imports {out}, not its own files under {tree}")


def run_tests(tree: str, tests, timeout_s: float) -> tuple[str, float]:
    """('passed' | 'failed' | 'timed out' | 'error <status>', seconds)."""
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        proc = subprocess.run(cmd, cwd=tree, env=_env(tree), capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "timed out", time.monotonic() - start
    status = {0: "passed", 1: "failed"}.get(proc.returncode, f"error {proc.returncode}")
    if status.startswith("error"):
        print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n", file=sys.stderr)
    return status, time.monotonic() - start


def mutate(tree: str, m: Mutant) -> str:
    """Applies ``m`` in ``tree``; returns the original text of the file."""
    path = os.path.join(tree, m.path)
    with open(path) as f:
        source = f.read()
    if "\n" in m.old.strip("\n") or "\n" in m.new.strip("\n"):
        raise SystemExit(f"{m.name}: a mutation changes one line")
    at = -1
    for _ in range(m.nth + 1):
        at = source.find(m.old, at + 1)
        if at < 0:
            raise SystemExit(f"{m.name}: occurrence {m.nth} of {m.old!r} not in {m.path}")
    with open(path, "w") as f:
        f.write(source[:at] + m.new + source[at + len(m.old):])
    return source


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the table, run nothing")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these mutations only")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds a mutation's tests may run (longer counts as a hang)")
    args = parser.parse_args(argv)
    names = {m.name for m in MUTANTS}
    if len(names) != len(MUTANTS):
        raise SystemExit("two mutations share a name")
    unknown = set(args.only or ()) - names
    if unknown:
        raise SystemExit(f"unknown mutations: {sorted(unknown)}")
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name:<40} {m.path:<36} {m.promise}\n{'':<40} " + " ".join(m.tests))
        return 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="moe_comm_mutants_") as tmp:
        tree = os.path.join(tmp, "tree")
        copy_tree(ROOT, tree)
        check_imports(tree)
        for m in chosen:   # every mutation applies (and the file goes back)
            original = mutate(tree, m)
            with open(os.path.join(tree, m.path), "w") as f:
                f.write(original)
        tests = list(dict.fromkeys(t for m in chosen for t in m.tests))
        print(f"control: {len(tests)} tests on the unchanged copy ...", flush=True)
        status, seconds = run_tests(tree, tests, 4 * args.timeout)
        print(f"control: {status} in {seconds:.0f} s", flush=True)
        if status != "passed":
            print("the tests fail without a mutation: nothing can be said", file=sys.stderr)
            return 1
        rows = []
        for m in chosen:
            original = mutate(tree, m)
            try:
                status, seconds = run_tests(tree, m.tests, args.timeout)
            finally:
                with open(os.path.join(tree, m.path), "w") as f:
                    f.write(original)
            verdict = {"failed": "caught", "timed out": "caught (hang)",
                       "passed": "NOT CAUGHT"}.get(status, status)
            rows.append((m, verdict, seconds))
            print(f"{m.name:<40} {verdict:<14} {seconds:6.0f} s  {m.promise}", flush=True)
    missed = [m.name for m, verdict, _ in rows if not verdict.startswith("caught")]
    print(f"\n{len(rows) - len(missed)} of {len(rows)} mutations caught in "
          f"{time.monotonic() - start:.0f} s" + (f"; not caught: {', '.join(missed)}"
                                                 if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
