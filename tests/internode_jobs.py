"""Jobs for CPU ranks grouped into nodes (the proxy transport): ``job(rank, world_size, ...)``."""
from __future__ import annotations

import random
import threading
import time

import torch
import torch.distributed as dist

import moe_comm
from cases import Case, expert_fn, make_inputs
from ll_jobs import _all_ys, check_out, check_recv, new_ll_buffer
from moe_comm import microscale, reference
from moe_comm.kernels import emulated_puts
from moe_comm.workspace import low_latency_slot_bytes


def new_buffer(case: Case, ranks_per_node: int, hierarchical: bool, **kwargs):
    group = None if "comm" in kwargs else dist.group.WORLD
    return moe_comm.Buffer(group, hidden=case.hidden, num_experts=case.num_experts,
                           max_tokens_per_rank=case.max_tokens, dtype=case.dtype,
                           ranks_per_node=ranks_per_node,
                           transport=kwargs.pop("transport", "nixl"),
                           hierarchical=hierarchical, **kwargs)


def _put_since(before: dict) -> dict:
    """``kernels.emulated_puts.moved()`` less ``before``: what this job's puts moved."""
    return {k: v - before.get(k, 0) for k, v in emulated_puts.moved().items()
            if v > before.get(k, 0)}


def nodes_case(rank, world_size, case: Case, ranks_per_node: int, hierarchical: bool,
               iterations: int = 2, straggle_s: float = 0.0, fp8: bool = False,
               ue8m0: bool = False, dispatch_dtype: str | None = None,
               combine_dtype: str | None = None, **buffer_kwargs) -> dict:
    """Dispatch + combine ``iterations`` times against the reference (bit for bit); returns
    what the proxy and kernels counted."""
    delay = random.Random(1000 * case.seed + rank)
    N = ranks_per_node
    put_before = emulated_puts.moved()
    with new_buffer(case, N, hierarchical, **buffer_kwargs) as buf:
        assert buf.transport == buffer_kwargs.get("transport", "nixl")
        assert buf.hierarchical == hierarchical
        for it in range(iterations):
            xs, idxs, ws = make_inputs(case, it)
            if straggle_s:
                time.sleep(delay.uniform(0, straggle_s))
            res = buf.dispatch(xs[rank], idxs[rank], ws[rank] if ws else None,
                               expert_alignment=case.alignment, fp8=fp8, ue8m0=ue8m0,
                               dispatch_dtype=dispatch_dtype)
            want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts,
                                          expert_alignment=case.alignment, fp8=fp8, ue8m0=ue8m0,
                                          dispatch_dtype=dispatch_dtype)
            for field in ("x", "x_scales", "x_global_scale", "weights", "src_rank",
                          "src_token", "tokens_per_expert", "expert_offsets"):
                a, b = getattr(res, field, None), getattr(want[rank], field, None)
                if b is None:
                    assert a is None, (rank, field)
                    continue
                if a.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
                    a, b = a.view(torch.uint8), b.view(torch.uint8)
                assert torch.equal(a, b), f"rank {rank}: {field} differs in iteration {it}"
            if straggle_s:
                time.sleep(delay.uniform(0, straggle_s))
            if dispatch_dtype == "mxfp8":
                ys = [microscale.dequantize_mxfp8(w.x, w.x_scales).to(case.dtype) for w in want]
            elif dispatch_dtype == "nvfp4":
                ys = [microscale.dequantize_nvfp4(w.x, w.x_scales, w.x_global_scale)
                      .to(case.dtype) for w in want]
            elif fp8:
                scales = [reference.unpack_ue8m0(w.x_scales, case.hidden // 128) if ue8m0
                          else w.x_scales for w in want]
                ys = [reference.dequantize_fp8(w.x, s).to(case.dtype)
                      for w, s in zip(want, scales)]
            else:
                ys = [expert_fn(w.x, w.expert_offsets) for w in want]
            out = buf.combine(ys[rank], res.handle, weights=res.weights,
                              combine_dtype=combine_dtype)
            ref = reference.combine_all(ys, [w.handle for w in want], [w.weights for w in want],
                                        hierarchical_nodes=N if hierarchical else None,
                                        combine_dtype=combine_dtype)
            assert torch.equal(out, ref[rank]), f"rank {rank}: combine differs in iteration {it}"
        report = {"stats": buf.stats(), "internode": buf.internode_bytes(),
                  "launches": dict(buf.launches), "peer_ptrs": buf.heap.peer_ptrs.tolist(),
                  "ring_slots": buf.ring_slots, "device_wait": buf.flavour.device_wait,
                  "transport": buf.flavour.transport, "put": _put_since(put_before),
                  "pending": emulated_puts.pending()}
    report["registered"] = emulated_puts.registered()
    report["threads"] = sorted(t.name for t in threading.enumerate()
                               if t.name.startswith("moe_comm"))
    return report


def mapped_segments() -> int:
    """How many moe_comm shared-memory segments this process has mapped."""
    with open("/proc/self/maps") as maps:
        return len({line.split()[-2] if line.rstrip().endswith("(deleted)") else
                    line.split()[-1] for line in maps if "/moe_comm_" in line})


def no_pointer_to_another_node(rank, world_size, case: Case, ranks_per_node: int) -> dict:
    """The kernels hold no pointer to another node: 0 in the table, segment not even mapped."""
    with new_buffer(case, ranks_per_node, True) as buf:
        return {"peer_ptrs": buf.heap.peer_ptrs.tolist(), "mapped": mapped_segments()}


def idle_cpu_seconds(rank, world_size, case: Case, ranks_per_node: int,
                     idle_s: float) -> float:
    """CPU seconds this whole process (every thread: the proxy's, NIXL's) spends in ``idle_s``
    of wall time after one dispatch and combine across nodes, while its main thread sleeps."""
    xs, idxs, ws = make_inputs(case)
    with new_buffer(case, ranks_per_node, True) as buf:
        res = buf.dispatch(xs[rank], idxs[rank], ws[rank])
        buf.combine(expert_fn(res.x, res.expert_offsets), res.handle, res.weights)
        dist.barrier()
        before = time.process_time()
        time.sleep(idle_s)
        spent = time.process_time() - before
        dist.barrier()
    return spent


def cross_node_bytes(rank, world_size, case: Case, ranks_per_node: int,
                     hierarchical: bool) -> dict:
    """One dispatch and one combine; the bytes the transport was asked to move per peer, and
    the rows that went to each rank and each node."""
    xs, idxs, ws = make_inputs(case)
    L, N = case.num_experts // world_size, ranks_per_node
    with new_buffer(case, N, hierarchical, max_topk=case.topk) as buf:
        res = buf.dispatch(xs[rank], idxs[rank], ws[rank])
        after_dispatch = buf.internode_bytes()
        buf.combine(expert_fn(res.x, res.expert_offsets), res.handle, res.weights)
        after_combine = buf.internode_bytes()
        stats = buf.stats()

    def goes(s: int, ranks) -> int:  # tokens of rank s with an expert on any of ``ranks``
        return sum(1 for row in idxs[s].tolist()
                   if any(e >= 0 and e // L in ranks for e in row))

    node = lambda r: range(r // N * N, r // N * N + N)  # noqa: E731
    return {"dispatch": after_dispatch["dispatch"], "combine": after_combine["combine"],
            "stats": stats,
            "to_rank": [goes(rank, [d]) for d in range(world_size)],
            "to_node": [goes(rank, node(b * N)) for b in range(world_size // N)],
            "from_node": [goes(s, node(rank)) for s in range(world_size)]}


def stopped_proxy(rank, world_size, case: Case, ranks_per_node: int, victim: int,
                  timeout_s: float) -> dict:
    """One good call, then ``victim`` stops its proxy thread while the others are in their
    next dispatch: every rank must raise within the timeout, saying which peer failed it."""
    xs, idxs, ws = make_inputs(case)
    with new_buffer(case, ranks_per_node, True, timeout_s=timeout_s) as buf:
        res = buf.dispatch(xs[rank], idxs[rank], ws[rank])
        buf.combine(expert_fn(res.x, res.expert_offsets), res.handle, res.weights)
        dist.barrier()
        if rank == victim:
            time.sleep(0.5)
            buf.proxy.stop_thread()
        start = time.monotonic()
        try:
            res = buf.dispatch(xs[rank], idxs[rank], ws[rank])
            buf.combine(expert_fn(res.x, res.expert_offsets), res.handle, res.weights)
        except moe_comm.PeerTimeoutError as exc:
            return {"kind": type(exc).__name__, "peer": exc.peer, "via": exc.via,
                    "message": str(exc), "seconds": time.monotonic() - start}
    return {"kind": None}


def vanished_peer(rank, world_size, case: Case, ranks_per_node: int, victim: int,
                  timeout_s: float, low_latency: bool) -> dict:
    """One good round trip, then ``victim`` drops its NIXL agent (what a crashed process or a
    lost NIC leaves its peers) while the others start the next one: every other rank must
    raise within the timeout, naming the victim (or, hierarchical, the forwarder that waited
    for it). The victim raises too, or stops at its own timeout: nothing hangs."""
    xs, idxs, ws = make_inputs(case)
    kwargs = dict(ranks_per_node=ranks_per_node, transport="nixl", timeout_s=timeout_s)
    buf = new_ll_buffer(case, **kwargs) if low_latency else \
        new_buffer(case, ranks_per_node, True, timeout_s=timeout_s)

    def round_trip():
        if low_latency:
            recv, _ = buf.low_latency_dispatch(xs[rank], idxs[rank], fp8=False)
            buf.low_latency_combine(recv.x.to(case.dtype), idxs[rank], ws[rank], recv.handle)
        else:
            res = buf.dispatch(xs[rank], idxs[rank], ws[rank])
            buf.combine(expert_fn(res.x, res.expert_offsets), res.handle, res.weights)

    with buf:
        round_trip()
        dist.barrier()
        if rank == victim:
            time.sleep(0.3)
            buf.proxy.close(wait_for_peers=False)
        start = time.monotonic()
        try:
            round_trip()
        except (moe_comm.PeerTimeoutError, RuntimeError) as exc:
            return {"kind": type(exc).__name__, "peer": getattr(exc, "peer", None),
                    "via": getattr(exc, "via", None), "message": str(exc),
                    "seconds": time.monotonic() - start}
    return {"kind": None}


def ll_nodes_case(rank, world_size, case: Case, ranks_per_node: int, iterations: int = 3,
                  straggle_s: float = 0.0, fp8: bool = False, ue8m0: bool = False,
                  dispatch_dtype: str | None = None, combine_dtype: str | None = None,
                  transport: str = "nixl") -> dict:
    """Low-latency dispatch + combine across nodes through the proxy (or ``transport``),
    ``iterations`` times, each against the reference bit for bit; returns the bytes the
    transport was asked to move and the minimum: every pair to an expert on another node (row
    and meta word) out, every pair from a source on another node (one combined row) back."""
    delay = random.Random(2000 * case.seed + rank)
    N, L, H = ranks_per_node, case.num_experts // world_size, case.hidden
    payload = (H + H // 32 if dispatch_dtype == "mxfp8"
               else H // 2 + H // 16 + 4 if dispatch_dtype == "nvfp4"
               else H + (H // 128) * (1 if ue8m0 else 4) if fp8
               else H * torch.empty((), dtype=case.dtype).element_size())
    assert payload <= low_latency_slot_bytes(H, case.dtype)
    row = (H + H // 32 if combine_dtype == "fp8"  # ys are bf16
           else H * torch.empty((), dtype=torch.bfloat16).element_size())
    want_out = want_in = 0
    put_before = emulated_puts.moved()
    with new_ll_buffer(case, ranks_per_node=N, transport=transport) as buf:
        assert buf.transport == transport
        for it in range(iterations):
            xs, idxs, ws = make_inputs(case, it)
            time.sleep(delay.uniform(0, straggle_s))
            recv, hook = buf.low_latency_dispatch(xs[rank], idxs[rank], fp8=fp8, ue8m0=ue8m0,
                                                  return_hook=True,
                                                  dispatch_dtype=dispatch_dtype)
            time.sleep(delay.uniform(0, straggle_s))
            hook()
            check_recv(rank, case, it, recv, xs, idxs, fp8, ue8m0,
                       dispatch_dtype=dispatch_dtype)
            ys, refs = _all_ys(case, xs, idxs, fp8, it, dispatch_dtype)
            y = ys[rank]
            if it == iterations - 1:  # the proxy reads y where the caller wrote it: no copy
                y = buf.low_latency_combine_buffer()
                y.copy_(ys[rank])
            out, _ = buf.low_latency_combine(y, idxs[rank], ws[rank], recv.handle,
                                             combine_dtype=combine_dtype)
            check_out(rank, case, it, out, (ys, refs), idxs, ws, combine_dtype)
            node_of = [(i // L) // N for i in range(case.num_experts)]
            mine = idxs[rank][idxs[rank] >= 0].tolist()
            want_out += sum(node_of[e] != rank // N for e in mine) * (payload + 4)
            want_in += sum(int((idxs[s] // L == rank).sum()) for s in range(world_size)
                           if s // N != rank // N) * row
        stats = buf.stats()
        report = {"ll_dispatch": stats.get("internode_ll_dispatch_bytes", 0),
                  "ll_combine": stats.get("internode_ll_combine_bytes", 0),
                  "want_dispatch": want_out, "want_combine": want_in,
                  "peer_ptrs": buf.heap.peer_ptrs.tolist(),
                  "device_wait": buf.flavour.device_wait, "put": _put_since(put_before),
                  "pending": emulated_puts.pending()}
    report["registered"] = emulated_puts.registered()
    report["threads"] = sorted(t.name for t in threading.enumerate()
                               if t.name.startswith("moe_comm"))
    return report
