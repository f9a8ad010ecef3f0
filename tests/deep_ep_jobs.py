"""Jobs for ``moe_comm.deep_ep`` on CPU ranks, checked against a plain-PyTorch model of DeepEP's
documented semantics (written here from DeepEP's README and tests, not from moe_comm)."""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.distributed as dist

from cases import Case, make_inputs
from moe_comm import deep_ep, reference, workspace


def deepep_dispatch_model(xs, idxs, ws, rank: int, num_experts: int, alignment: int):
    """What rank ``rank`` receives from DeepEP's normal dispatch: ``(rows, local ids, weights,
    counts per local expert aligned, [(source, token)])``, one row per (source, token) with an
    expert here, ordered by source then token."""
    R = len(xs)
    L = num_experts // R
    rows, ids, weights, origin = [], [], [], []
    for s in range(R):
        for t in range(xs[s].shape[0]):
            idx = idxs[s][t]
            local = (idx >= rank * L) & (idx < (rank + 1) * L)
            if local.any():
                rows.append(xs[s][t])
                ids.append(torch.where(local, idx - rank * L, -1))
                weights.append(torch.where(local, ws[s][t], 0.0))
                origin.append((s, t))
    H, K = xs[0].shape[1], idxs[0].shape[1]
    x = torch.stack(rows) if rows else torch.empty((0, H), dtype=xs[0].dtype)
    i = torch.stack(ids) if ids else torch.empty((0, K), dtype=torch.int64)
    w = torch.stack(weights) if weights else torch.empty((0, K))
    counts = [int((i == e).sum()) for e in range(L)]
    counts = [(c + alignment - 1) // alignment * alignment for c in counts]
    return x, i, w, counts, origin


def deepep_combine_model(received, home: int, num_tokens: int, hidden: int, topk: int, dtype):
    """DeepEP's combine at rank ``home``: each token's rows summed over the ranks that got it
    (fp32, rank order, rounded once), and the weight rows summed the same way.
    ``received[r] = (rows y_r, weight rows, origin)``."""
    acc = torch.zeros((num_tokens, hidden))
    wacc = torch.zeros((num_tokens, topk))
    for y, w, origin in received:
        for i, (s, t) in enumerate(origin):
            if s == home:
                acc[t] += y[i].float()
                wacc[t] += w[i]
    return acc.to(dtype), wacc


@contextlib.contextmanager
def _setting(env: dict | None = None, staging_bytes: int | None = None):
    """Environment variables (``env``) and moe_comm's default staging budget (``staging_bytes``:
    small enough, calls run in rounds) for the block, restored after it."""
    saved_env = {k: os.environ.get(k) for k in env or {}}
    saved_staging = workspace.DEFAULT_STAGING_BYTES
    os.environ.update(env or {})
    if staging_bytes is not None:
        workspace.DEFAULT_STAGING_BYTES = staging_bytes
    try:
        yield
    finally:
        workspace.DEFAULT_STAGING_BYTES = saved_staging
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def nodes_combine_model(received, xs, idxs, ws, home: int, case: Case, ranks_per_node: int):
    """The facade's combine across nodes at ``home``: moe_comm's hierarchical sum order
    (``reference.combine_all(..., hierarchical_nodes=N)``) of DeepEP's rows, each (source,
    token) row laid on its first row of moe_comm's expert-major receive (the other rows
    zero). ``received[r] = (rows y_r, weight rows, origin)`` in DeepEP's order."""
    want = reference.dispatch_all(xs, idxs, ws, num_experts=case.num_experts)
    ys = []
    for d, (y, _, origin) in enumerate(received):
        rows = torch.zeros((want[d].x.shape[0], case.hidden), dtype=case.dtype)
        for i, (s, t) in enumerate(origin):
            hit = ((want[d].src_rank == s) & (want[d].src_token == t)).nonzero().flatten()
            rows[int(hit.min())] = y[i]
        ys.append(rows)
    return reference.combine_all(ys, [w.handle for w in want],
                                 hierarchical_nodes=ranks_per_node)[home]


def normal_mode(rank, world_size, case: Case, iterations: int = 2, fp8: bool = False,
                ranks_per_node: int | None = None, by_env: bool = False,
                staging_bytes: int | None = None) -> dict:
    """get_dispatch_layout, dispatch (bf16 or an FP8 pair), a cached dispatch, combine with
    and without weights, ``num_worst_tokens``: each against the model, over calls of different
    sizes. ``ranks_per_node``: DeepEP's internode mode (``num_rdma_bytes > 0``) over nodes of
    that many ranks, given as the Buffer's argument or (``by_env``) as
    ``MOE_COMM_RANKS_PER_NODE`` with ``num_rdma_bytes`` from ``Config``'s hint; the
    combine then against ``reference.combine_all(..., hierarchical_nodes=N)``.
    ``staging_bytes``: moe_comm's default staging budget for the job (calls in rounds).
    Returns what the facade built."""
    E, R = case.num_experts, world_size
    N = ranks_per_node
    env = {"MOE_COMM_RANKS_PER_NODE": str(N)} if by_env else {}
    with _setting(env, staging_bytes):
        if N is None:
            buf = deep_ep.Buffer(dist.group.WORLD, int(1e9), 0)
        elif by_env:
            hint = deep_ep.Config().get_rdma_buffer_size_hint(case.hidden * 2, R)
            assert hint > 0, hint
            buf = deep_ep.Buffer(dist.group.WORLD, int(1e9), hint)
        else:
            buf = deep_ep.Buffer(dist.group.WORLD, int(1e9), int(1e9), ranks_per_node=N)
        report = _normal_mode_calls(buf, rank, R, E, case, iterations, fp8, N)
        report.update(nodes=(buf.num_rdma_ranks, buf.num_nvl_ranks),
                      transport=buf._normal.transport, hierarchical=buf._normal.hierarchical,
                      rounds=buf._normal.rounds)
        buf.destroy()
    return report


def _normal_mode_calls(buf, rank: int, R: int, E: int, case: Case, iterations: int, fp8: bool,
                       N: int | None) -> dict:
    for it in range(iterations):
        xs, idxs, ws = make_inputs(case, it)
        if it % 2:  # a smaller batch on the second call: the workspace is reused
            xs, idxs, ws = [x[:3] for x in xs], [i[:3] for i in idxs], [w[:3] for w in ws]
        per_rank, rdma, per_expert, in_rank, event = buf.get_dispatch_layout(idxs[rank], E)
        L = E // R
        valid = idxs[rank] >= 0
        assert torch.equal(per_expert, torch.bincount(idxs[rank][valid], minlength=E).int())
        want_in_rank = torch.stack([((idxs[rank] >= d * L) & (idxs[rank] < d * L + L)).any(1)
                                    for d in range(R)], 1)
        assert torch.equal(in_rank, want_in_rank) and torch.equal(per_rank,
                                                                  want_in_rank.sum(0).int())
        if N is None:
            assert rdma is None
        else:  # tokens with an expert on any rank of each node
            want_rdma = [int(want_in_rank[:, b * N:b * N + N].any(1).sum())
                         for b in range(R // N)]
            assert rdma.dtype == torch.int32 and rdma.tolist() == want_rdma, (rdma, want_rdma)
        sent = xs
        if fp8:
            pairs = [reference.quantize_fp8(x) for x in xs]
            sent = [reference.dequantize_fp8(*p).to(case.dtype) for p in pairs]
            x_in = pairs[rank]
        else:
            x_in = xs[rank]
        recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
            x_in, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idxs[rank],
            topk_weights=ws[rank], expert_alignment=case.alignment)
        event.current_stream_wait()
        want_x, want_idx, want_w, want_counts, origin = deepep_dispatch_model(
            sent, idxs, ws, rank, E, case.alignment)
        got_x = reference.dequantize_fp8(*recv_x).to(case.dtype) if fp8 else recv_x
        assert torch.equal(got_x, want_x), f"rank {rank} call {it}: recv_x"
        assert torch.equal(recv_idx, want_idx), f"rank {rank} call {it}: recv_topk_idx"
        assert torch.equal(recv_w, want_w), f"rank {rank} call {it}: recv_topk_weights"
        assert counts == want_counts, f"rank {rank} call {it}: counts {counts} {want_counts}"
        # a cached dispatch (combine's backward) moves other rows the same way
        other = [x * 2 + 1 for x in xs]
        cached, none_idx, none_w, none_counts, none_handle, _ = buf.dispatch(other[rank],
                                                                              handle=handle)
        assert none_idx is None and none_w is None and none_counts is None
        assert none_handle is None
        assert torch.equal(cached, deepep_dispatch_model(other, idxs, ws, rank, E, 1)[0])
        # combine: the rows this rank got (as they are: DeepEP's combine does not weight them)
        y = (got_x.float() * 0.5 + rank).to(case.dtype)
        combined, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w)
        plain, no_w, _ = buf.combine(y, handle)  # (DeepEP's rows read in place)
        received = [None] * R
        dist.all_gather_object(received, (y, recv_w, origin))
        want_out, want_cw = deepep_combine_model(received, rank, xs[rank].shape[0], case.hidden,
                                                 case.topk, case.dtype)
        if N is not None:
            want_out = nodes_combine_model(received, xs, idxs, ws, rank, case, N)
        assert torch.equal(combined, want_out), f"rank {rank} call {it}: combine"
        assert torch.equal(combined_w, want_cw), f"rank {rank} call {it}: combined weights"
        assert no_w is None and torch.equal(plain, want_out), f"rank {rank} call {it}: plain"
        # num_worst_tokens: the same rows, padded
        worst = R * xs[rank].shape[0] + 8
        padded_x, padded_idx, padded_w, _, _, _ = buf.dispatch(
            x_in, num_tokens_per_expert=per_expert, topk_idx=idxs[rank], topk_weights=ws[rank],
            num_worst_tokens=worst)
        n = want_idx.shape[0]
        padded_rows = padded_x[0] if fp8 else padded_x
        assert padded_rows.shape[0] == worst and torch.equal(padded_idx[:n], want_idx)
        assert (padded_idx[n:] == -1).all() and not padded_w[n:].any()
        assert torch.equal(padded_rows[:n].view(torch.uint8), (recv_x[0] if fp8 else recv_x)
                           .view(torch.uint8)), f"rank {rank} call {it}: padded recv_x"
        assert not padded_rows[n:].view(torch.uint8).any(), "padding rows are not zero"
        if fp8:
            assert torch.equal(padded_x[1][:n], recv_x[1]) and not padded_x[1][n:].any()
    return {}


def refusals(rank, world_size, case: Case) -> dict:
    """What the facade cannot honour raises NotImplementedError with a sentence (every rank
    together: nothing is left half done)."""
    buf = deep_ep.Buffer(dist.group.WORLD, int(1e9), 0, low_latency_mode=True)
    xs, idxs, ws = make_inputs(case)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[rank], case.num_experts)
    out = {}

    def record(name, fn):
        try:
            fn()
        except NotImplementedError as error:
            out[name] = str(error)

    record("no_topk", lambda: buf.dispatch(xs[rank], num_tokens_per_rank=per_rank,
                                           is_token_in_rank=in_rank,
                                           num_tokens_per_expert=per_expert))
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
        xs[rank], num_tokens_per_expert=per_expert, topk_idx=idxs[rank], topk_weights=ws[rank])
    record("bias", lambda: buf.combine(recv_x, handle, bias=torch.zeros_like(xs[rank])))
    record("nonlocal_weights", lambda: buf.combine(recv_x, handle,
                                                   topk_weights=torch.ones_like(recv_w)))
    record("logfmt", lambda: buf.low_latency_combine(None, None, None, None, use_logfmt=True))
    record("round_scale", lambda: buf.low_latency_dispatch(
        xs[rank], idxs[rank], case.max_tokens, case.num_experts, round_scale=True))
    record("nvfp4", lambda: buf.low_latency_dispatch(
        xs[rank], idxs[rank], case.max_tokens, case.num_experts, use_nvfp4=True,
        x_global_scale=torch.ones(1)))
    buf.destroy()
    return out


def deepep_low_latency_model(xs, idxs, rank: int, num_experts: int):
    """DeepEP's low-latency receive at ``rank``: per local expert, the rows of every (source,
    token) that picked it, sources in rank order, tokens in order; ``[(source, token)]``."""
    R = len(xs)
    L = num_experts // R
    blocks = []
    for e in range(rank * L, rank * L + L):
        rows, origin = [], []
        for s in range(R):
            for t in range(xs[s].shape[0]):
                if (idxs[s][t] == e).any():
                    rows.append(xs[s][t])
                    origin.append((s, t))
        blocks.append((rows, origin))
    return blocks


def low_latency(rank, world_size, case: Case, iterations: int = 2, fp8: bool = False,
                ue8m0: bool = False, ranks_per_node: int | None = None) -> dict:
    """low_latency_dispatch (bf16; FP8 with column-major scales; with ``ue8m0`` power-of-two
    scales packed four exponents per int32, DeepEP's ``round_scale=True, use_ue8m0=True``)
    with a hook and ``cumulative_local_expert_recv_stats``, then low_latency_combine into
    ``out=`` and into the zero-copy buffer, against the model; before the second call two
    dispatches whose hooks are dropped, then ``clean_low_latency_buffer``.
    ``ranks_per_node``: across nodes of that many ranks. Returns the nodes and transport of
    the workspace."""
    T = case.max_tokens
    R, E, H = world_size, case.num_experts, case.hidden
    L = E // R
    buf = deep_ep.Buffer(dist.group.WORLD, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(
        T, H, R, E), low_latency_mode=True, num_qps_per_rank=L, ranks_per_node=ranks_per_node)
    stats = torch.full((L,), 3, dtype=torch.int32)   # counts are added to what is there
    want_stats = stats.clone()
    for it in range(iterations):
        xs, idxs, ws = make_inputs(case, it)
        if it == 1:  # two hooks dropped (an exception after each send): cleaned on every rank
            for _ in range(2):
                buf.low_latency_dispatch(xs[rank], idxs[rank], T, E, use_fp8=fp8,
                                         return_recv_hook=True)
            buf.clean_low_latency_buffer(T, H, E)
        recv_x, count, handle, event, hook = buf.low_latency_dispatch(
            xs[rank], idxs[rank], T, E, cumulative_local_expert_recv_stats=stats, use_fp8=fp8,
            round_scale=ue8m0, use_ue8m0=ue8m0, return_recv_hook=True)
        hook()
        rows = recv_x[0] if fp8 else recv_x
        assert rows.shape == (L, R * T, H)
        if ue8m0:
            assert recv_x[1].dtype == torch.int32 and recv_x[1].shape == (L, R * T, H // 512)
        elif fp8:
            assert recv_x[1].shape == (L, R * T, H // 128) and recv_x[1].stride(1) == 1
        sent = xs
        if fp8:
            sent = [reference.dequantize_fp8(*reference.quantize_fp8(x, ue8m0=ue8m0))
                    .to(case.dtype) for x in xs]
        blocks = deepep_low_latency_model(sent, idxs, rank, E)
        for e, (want_rows, _) in enumerate(blocks):
            n = len(want_rows)
            assert int(count[e]) == n, f"rank {rank} call {it}: count of expert {e}"
            want_stats[e] += n
            got = rows[e, :n]
            if fp8:
                scales = recv_x[1][e, :n]
                if ue8m0:   # exponent bytes back to power-of-two scales
                    scales = reference.unpack_ue8m0(scales, H // 128)
                got = reference.dequantize_fp8(got, scales).to(case.dtype)
            if n:
                assert torch.equal(got, torch.stack(want_rows)), f"rank {rank}: expert {e}"
        assert torch.equal(stats, want_stats), f"rank {rank} call {it}: recv stats {stats}"
        # combine: every rank's expert outputs, from one seed
        ys = []
        for r in range(R):
            g = torch.Generator().manual_seed(100 * it + r)
            ys.append(torch.randn((L, R * T, H), generator=g).to(case.dtype))
        out = torch.empty((xs[rank].shape[0], H), dtype=case.dtype)
        y = ys[rank]
        if it % 2:  # zero copy: the expert outputs written where the combine reads them
            y = buf.get_next_low_latency_combine_buffer(handle)
            y.copy_(ys[rank])
        combined, _, chook = buf.low_latency_combine(y, idxs[rank], ws[rank], handle,
                                                      zero_copy=bool(it % 2), out=out,
                                                      return_recv_hook=True)
        chook()
        want = torch.zeros((xs[rank].shape[0], H))
        for k in range(case.topk):
            for t in range(xs[rank].shape[0]):
                e = int(idxs[rank][t, k])
                if e < 0:
                    continue
                owner = e // L
                origin = deepep_low_latency_model(sent, idxs, owner, E)[e - owner * L][1]
                row = ys[owner][e - owner * L, origin.index((rank, t))]
                want[t] += ws[rank][t, k] * row.float()
        assert combined is out and torch.equal(out, want.to(case.dtype)), f"rank {rank} {it}"
    buf.clean_low_latency_buffer(T, H, E)
    report = {"nodes": buf._low_latency.num_nodes, "transport": buf._low_latency.transport}
    buf.destroy()
    return report


def shrink_masks(rank, world_size, case: Case) -> list:
    """``enable_shrink``: query, mask the last rank (every rank asks), query, clean, query; a
    low-latency call before and after. DeepEP's polarity: 1 = masked."""
    T, R, E = case.max_tokens, world_size, case.num_experts
    buf = deep_ep.Buffer(dist.group.WORLD, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(
        T, case.hidden, R, E), low_latency_mode=True, enable_shrink=True)
    xs, idxs, _ = make_inputs(case)
    statuses = []
    status = torch.full((R,), 7, dtype=torch.int32)

    def query():
        buf.low_latency_query_mask_buffer(status)
        statuses.append(status.tolist())

    buf.low_latency_dispatch(xs[rank], idxs[rank], T, E, use_fp8=False)
    query()
    dist.barrier()
    buf.low_latency_update_mask_buffer(R - 1, True)
    dist.barrier()
    query()
    _call_while_masked(buf, case, rank, R - 1)
    buf.low_latency_clean_mask_buffer()
    query()
    recv_x, count, _, _, _ = buf.low_latency_dispatch(xs[rank], idxs[rank], T, E, use_fp8=False)
    blocks = deepep_low_latency_model(xs, idxs, rank, E)
    assert count.tolist() == [len(rows) for rows, _ in blocks]
    # vLLM's clean_buffers: what get_local_buffer_tensor hands out zeroed on every rank (no
    # barrier: a rank may zero while a faster one is in the clean), then the clean
    local = buf.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True)
    assert local.data_ptr() > buf._low_latency.heap.local.data_ptr() and local.any()
    local.zero_()
    buf.low_latency_clean_mask_buffer()
    query()
    for _ in range(2):  # both parities: a whole dispatch and combine checked
        _call_while_masked(buf, case, rank, masked=-1)
    buf.destroy()
    return statuses


def _call_while_masked(buf, case: Case, rank: int, masked: int) -> None:
    """One low-latency dispatch and combine while ``masked`` is masked: its own call is refused
    (RankExcludedError), the others' leave it out as a source and as an expert rank."""
    from moe_comm.fault import RankExcludedError

    T, R, E, H = case.max_tokens, case.world_size, case.num_experts, case.hidden
    L = E // R
    xs, idxs, ws = make_inputs(case, 1)
    if rank == masked:
        try:
            buf.low_latency_dispatch(xs[rank], idxs[rank], T, E, use_fp8=False)
        except RankExcludedError as error:
            assert f"rank {masked} was excluded" in str(error), error
            return
        raise AssertionError(f"rank {masked} is masked, yet its call was not refused")
    sent = [x[:0] if s == masked else x for s, x in enumerate(xs)]
    kept = [i[:0] if s == masked else torch.where(i // L == masked, -1, i)
            for s, i in enumerate(idxs)]
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(xs[rank], idxs[rank], T, E,
                                                            use_fp8=False)
    blocks = deepep_low_latency_model(sent, kept, rank, E)
    for e, (want_rows, _) in enumerate(blocks):
        assert int(count[e]) == len(want_rows), f"rank {rank}: count of expert {e} while masked"
        if want_rows:
            assert torch.equal(recv_x[e, :len(want_rows)], torch.stack(want_rows))
    g = torch.Generator().manual_seed(7)
    ys = [torch.randn((L, R * T, H), generator=g).to(case.dtype) for _ in range(R)]
    out, _, _ = buf.low_latency_combine(ys[rank], idxs[rank], ws[rank], handle)
    want = torch.zeros((xs[rank].shape[0], H))
    for t in range(xs[rank].shape[0]):
        for k in range(case.topk):
            e = int(kept[rank][t, k])
            if e >= 0:
                owner = e // L
                origin = deepep_low_latency_model(sent, kept, owner, E)[e - owner * L][1]
                row = ys[owner][e - owner * L, origin.index((rank, t))]
                want[t] += ws[rank][t, k] * row.float()
    assert torch.equal(out, want.to(case.dtype)), f"rank {rank}: combine while masked"


def bad_facade_inputs(rank, world_size) -> dict:
    """Each facade call with a mistake a new user makes: ``{what: "Error: message"}`` (or
    what came back where nothing was wrong)."""
    buf = deep_ep.Buffer(dist.group.WORLD, int(1e9), 0, low_latency_mode=True,
                         num_qps_per_rank=1, enable_shrink=True)
    E, T, H, K = 8, 6, 128, 2
    x = torch.randn(T, H, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = torch.rand(T, K)
    found = {}

    def probe(what, fn):
        try:
            result = fn()
            found[what] = "ok" if result is not None else "None"
        except Exception as exc:  # noqa: BLE001 - what a user would see, reported
            found[what] = f"{type(exc).__name__}: {exc}"

    probe("local buffer before a call", lambda: buf.get_local_buffer_tensor(
        torch.int8, use_rdma_buffer=True))
    probe("local buffer normal workspace", lambda: buf.get_local_buffer_tensor(torch.int8))
    probe("layout int32 topk_idx", lambda: buf.get_dispatch_layout(idx.int(), E))
    probe("layout float topk_idx", lambda: buf.get_dispatch_layout(idx.float(), E))
    probe("layout 1-d topk_idx", lambda: buf.get_dispatch_layout(idx[:, 0], E))
    probe("layout list topk_idx", lambda: buf.get_dispatch_layout(idx.tolist(), E))
    probe("layout num_experts float", lambda: buf.get_dispatch_layout(idx, 8.0))
    probe("layout num_experts 7", lambda: buf.get_dispatch_layout(idx, 7))
    probe("layout id >= num_experts", lambda: buf.get_dispatch_layout(idx + E, E))
    layout = buf.get_dispatch_layout(idx, E)
    per_rank, _, per_expert, in_rank, _ = layout

    def dispatch(x=x, idx=idx, w=w):
        return buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
                            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    probe("dispatch x 3-d", lambda: dispatch(x=x[None]))
    probe("dispatch x fewer tokens", lambda: dispatch(x=x[:3]))
    probe("dispatch float topk_idx", lambda: dispatch(idx=idx.float()))
    probe("dispatch int weights", lambda: dispatch(w=w.int()))
    probe("dispatch weights shape", lambda: dispatch(w=w[:, :1]))
    probe("dispatch int32 x", lambda: dispatch(x=x.int()))
    probe("dispatch id >= num_experts", lambda: dispatch(idx=idx + E))  # (every rank: in step)
    res = dispatch()  # a good call: every rank in step
    handle = res[4]
    probe("combine tuple handle", lambda: buf.combine(res[0], handle=(1, 2)))
    probe("combine x 1-d", lambda: buf.combine(res[0][:, 0], handle=handle))
    probe("combine other hidden", lambda: buf.combine(res[0][:, :64], handle=handle))
    probe("cached dispatch tuple handle", lambda: buf.dispatch(x, handle=(1, 2)))
    probe("cached dispatch other hidden", lambda: buf.dispatch(x[:, :64], handle=handle))
    probe("cached dispatch fewer tokens", lambda: buf.dispatch(x[:3], handle=handle))
    out = buf.combine(res[0], handle=handle)  # a good call
    found["good calls"] = f"ok {tuple(out[0].shape)}"
    probe("low-latency int32 topk_idx (converted)",
          lambda: buf.low_latency_dispatch(x, idx.int(), 8, E, use_fp8=False))
    probe("low-latency int32 x", lambda: buf.low_latency_dispatch(x.int(), idx, 8, E,
                                                                   use_fp8=False))
    recv = buf.low_latency_dispatch(x, idx, 8, E, use_fp8=False)
    probe("low-latency combine out shape", lambda: buf.low_latency_combine(
        recv[0], idx, w, recv[2], out=torch.empty(7, H, dtype=torch.bfloat16)))
    probe("low-latency combine tuple handle",
          lambda: buf.low_latency_combine(recv[0], idx, w, (1, 2)))
    probe("low-latency combine buffer tuple handle",
          lambda: buf.get_next_low_latency_combine_buffer((1, 2)))
    buf.low_latency_combine(recv[0], idx, w, recv[2])  # a good call
    local = functools.partial(buf.get_local_buffer_tensor, use_rdma_buffer=True)
    probe("local buffer dtype str", lambda: local("int8"))
    probe("local buffer odd offset", lambda: local(torch.int32, offset=2))
    probe("local buffer size too large", lambda: local(torch.int8, size=(1 << 40,)))
    probe("local buffer int32 [4, 2] at 8", lambda: local(torch.int32, size=(4, 2), offset=8))
    buf.destroy()
    return found


def ep_invariant_sums(rank, world_size, case: Case, ranks_per_node: int | None = None) -> dict:
    """``deep_ep.Buffer(..., ep_invariant=True)``: whether both moe_comm workspaces are
    EP-invariant, and each combine against ``reference.invariant_combine``: the normal one adds
    each token's per-rank rows in choice order (a rank's row on its choice of the lowest expert
    id there, zero on its other choices), the low-latency one ``w[t, k] * row(t, k)`` in choice
    order. ``default_differs``: DeepEP's rank-order sum (what the default returns) is not the
    invariant one for this rank's tokens. ``ranks_per_node``: across nodes of that many ranks
    (``num_rdma_bytes > 0``)."""
    R, E, H, K, T = world_size, case.num_experts, case.hidden, case.topk, case.max_tokens
    L = E // R
    buf = deep_ep.Buffer(dist.group.WORLD, int(1e9), 0 if ranks_per_node is None else int(1e9),
                         low_latency_mode=True, ep_invariant=True, ranks_per_node=ranks_per_node)
    xs, idxs, ws = make_inputs(case)
    idx, n = idxs[rank], xs[rank].shape[0]
    found: dict = {}
    # normal mode
    _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, E)
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
        xs[rank], num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=ws[rank])
    origin = deepep_dispatch_model(xs, idxs, ws, rank, E, 1)[4]
    y = (recv_x.float() * 0.5 + rank).to(case.dtype)
    combined, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w)
    received: list = [None] * R
    dist.all_gather_object(received, (y, recv_w, origin))
    rows = torch.zeros((n, K, H), dtype=case.dtype)
    for r, (y_r, _, origin_r) in enumerate(received):
        for i, (s, t) in enumerate(origin_r):
            if s == rank:
                here = [k for k in range(K) if int(idx[t, k]) >= 0 and int(idx[t, k]) // L == r]
                rows[t, min(here, key=lambda k: int(idx[t, k]))] = y_r[i]
    want = reference.invariant_combine(rows, idx, dtype=case.dtype)
    rank_order, want_w = deepep_combine_model(received, rank, n, H, K, case.dtype)
    found["normal"] = bool(torch.equal(combined, want))
    found["combined_weights"] = bool(torch.equal(combined_w, want_w))
    found["default_differs"] = not torch.equal(rank_order, want)
    # low-latency mode
    recv_ll, _, ll_handle, _, _ = buf.low_latency_dispatch(xs[rank], idx, T, E, use_fp8=False)
    ys = [torch.randn((L, R * T, H), generator=torch.Generator().manual_seed(50 + r))
          .to(case.dtype) for r in range(R)]
    out, _, _ = buf.low_latency_combine(ys[rank], idx, ws[rank], ll_handle)
    rows = torch.zeros((n, K, H), dtype=case.dtype)
    for t in range(n):
        for k in range(K):
            e = int(idx[t, k])
            if e >= 0:
                owner = e // L
                source = deepep_low_latency_model(xs, idxs, owner, E)[e - owner * L][1]
                rows[t, k] = ys[owner][e - owner * L, source.index((rank, t))]
    found["low_latency"] = bool(torch.equal(
        out, reference.invariant_combine(rows, idx, ws[rank], dtype=case.dtype)))
    found["workspaces_ep_invariant"] = (buf._normal.ep_invariant, buf._low_latency.ep_invariant)
    found["nodes"] = (buf._normal.num_nodes, buf._low_latency.num_nodes)
    buf.destroy()
    return found
