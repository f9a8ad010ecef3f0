"""torch.compile of an MoE layer over a Buffer, on every CPU rank of a pool: the layer compiled
with ``fullgraph=True`` by inductor (dynamic shapes) against the same layer run eagerly, bit
for bit in its output and every gradient, for calls whose token counts differ."""
from __future__ import annotations

import unittest.mock

import torch
import torch.distributed as dist

import moe_comm
from cases import Case, make_inputs
from moe_comm import microscale, reference


def _rows(res, fmt: str | None) -> torch.Tensor:
    """The received rows as float32 (quantized rows dequantized, elementwise)."""
    if fmt == "fp8":
        return reference.dequantize_fp8(res.x, res.x_scales)
    if fmt == "mxfp8":
        return microscale.dequantize_mxfp8(res.x, res.x_scales)
    if fmt == "nvfp4":
        return microscale.dequantize_nvfp4(res.x, res.x_scales, res.x_global_scale)
    return res.x.float()


def layer_fn(buf: moe_comm.Buffer, fmt: str | None):
    """dispatch -> experts (row ``r`` of local expert ``e`` scaled by ``1 + e / 8``, one
    multiply: no reordering a compiler could do changes its bits) -> combine."""
    L = buf.num_local_experts
    scale = 1 + torch.arange(L, dtype=torch.float32) / 8

    def layer(x, idx, w):
        res = (buf.dispatch(x, idx, w, dispatch_dtype=fmt) if fmt in ("mxfp8", "nvfp4")
               else buf.dispatch(x, idx, w, fp8=fmt == "fp8"))
        rows = _rows(res, fmt)
        expert = torch.repeat_interleave(torch.arange(L), res.tokens_per_expert,
                                         output_size=rows.shape[0])
        y = (rows * scale[expert][:, None]).to(buf.dtype)
        return buf.combine(y, res.handle, res.weights)

    return layer


def _step(layer, case: Case, it: int, rank: int, grads: bool, x_grad: bool):
    """The layer's output and the gradients of ``x`` (where ``x_grad``: quantized rows carry
    none) and of the router weights."""
    xs, idxs, ws = make_inputs(case, it)
    x = xs[rank].clone().requires_grad_(grads and x_grad)
    w = ws[rank].clone().requires_grad_(grads)
    out = layer(x, idxs[rank], w)
    if not grads:
        return [out.detach()]
    (out.float() * torch.linspace(-1, 1, out.shape[1])).sum().backward()
    return [out.detach(), *(g for g in (x.grad, w.grad) if g is not None)]


def compiled_layer(rank, world_size, case: Case, token_counts: tuple, fmt: str | None = None,
                   grads: bool = True, backend: str = "inductor") -> dict:
    """The layer eager, then compiled, for each entry of ``token_counts`` (tokens on every
    rank): whether each output and gradient is bit-identical, the graph breaks and graphs that
    ``torch._dynamo.explain`` sees, and whether a later call recompiled."""
    import dataclasses

    import torch._dynamo as dynamo
    import torch._inductor.config as inductor_config

    dynamo.reset()
    # bf16 and fp16 values rounded where eager rounds them (inductor keeps fp32 otherwise)
    inductor_config.emulate_precision_casts = True
    # a compiled call compiles before it sends: a peer may wait for this rank's compiles
    buf = moe_comm.Buffer(dist.group.WORLD, case.hidden, case.num_experts, max(token_counts),
                          case.dtype, max_topk=case.topk, timeout_s=600)
    layer = layer_fn(buf, fmt)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=backend)
    exact, recompiled = [], False
    for i, T in enumerate(token_counts):
        tokens = dataclasses.replace(case, tokens=(T,) * world_size)
        want = _step(layer, tokens, i, rank, grads, fmt is None)
        with dynamo.config.patch(error_on_recompile=i > 0):
            try:
                got = _step(compiled, tokens, i, rank, grads, fmt is None)
            except dynamo.exc.RecompileError:
                recompiled = True
                got = _step(compiled, tokens, i, rank, grads, fmt is None)
        exact.append([torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                      if a.shape == b.shape else False for a, b in zip(got, want)]
                     + [len(got) == len(want)])
    xs, idxs, ws = make_inputs(dataclasses.replace(case, tokens=(token_counts[0],) * world_size))
    with dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        explained = dynamo.explain(layer)(xs[rank], idxs[rank], ws[rank])
    buf.close()
    return dict(exact=exact, recompiled=recompiled, graph_breaks=explained.graph_break_count,
                graphs=explained.graph_count, values=len(exact[0]) - 1)


# ----------------------------------------------------------------- low-latency mode
_LL_MARKERS = (("ll_dispatch_send.default", "dispatch_send"),
               ("ll_dispatch_recv.default", "dispatch_recv"),
               ("ll_combine_send.default", "combine_send"),
               ("ll_combine_recv.default", "combine_recv"), ("extern_kernels.mm", "mm"))


def ll_layer_fn(buf: moe_comm.Buffer, fp8s: tuple, ops: bool):
    """Micro-batches ``(x, topk_idx, topk_weights)`` through the low-latency pair, all in flight
    together (one per entry of ``fp8s``, its format): the dispatch sends, a matmul on unrelated
    tensors, the receives, the experts (row of local expert ``e`` times ``1 + e / 8``, one
    multiply after the FP8 dequantization's), the combine sends, a second matmul, the
    receives. ``ops``: through ``moe_comm.ll_ops``; else the Buffer's own calls and hooks."""
    from moe_comm import ll_ops

    L, H = buf.num_local_experts, buf.hidden
    scale = (1 + torch.arange(L, dtype=torch.float32) / 8)[:, None, None]

    def rows(recv, fp8):  # [L, R * T_max, H] float32
        if not fp8:
            return recv.x.float()
        q = recv.x.float().unflatten(-1, (H // 128, 128))
        return (q * recv.x_scales[..., None]).flatten(-2)

    def layer(batches, aux, wa, wb):
        if ops:
            sent = [ll_ops.dispatch_send(buf, x, idx, fp8=f)
                    for (x, idx, _), f in zip(batches, fp8s)]
        else:
            sent = [buf.low_latency_dispatch(x, idx, fp8=f, return_hook=True)
                    for (x, idx, _), f in zip(batches, fp8s)]
        aux = torch.relu(aux @ wa)  # (a shared expert, say) while the rows travel
        if ops:
            recvs = [ll_ops.dispatch_recv(buf, s, after=[aux]) for s in sent]
        else:
            for _, hook in sent:
                hook()
            recvs = [recv for recv, _ in sent]
        ys = [(rows(r, f) * scale).to(buf.dtype) for r, f in zip(recvs, fp8s)]
        if ops:
            sent = [ll_ops.combine_send(buf, y, idx, w, r.handle)
                    for y, r, (_, idx, w) in zip(ys, recvs, batches)]
        else:
            sent = [buf.low_latency_combine(y, idx, w, r.handle, return_hook=True)
                    for y, r, (_, idx, w) in zip(ys, recvs, batches)]
        aux = aux @ wb
        if ops:
            outs = [ll_ops.combine_recv(buf, s, after=[aux]) for s in sent]
        else:
            for _, hook in sent:
                hook()
            outs = [out for out, _ in sent]
        return outs, [(r.x, r.x_scales, r.count, r.src_info) for r in recvs], aux

    return layer


def _ll_values(result) -> list[torch.Tensor]:
    """The layer's outputs as byte tensors: each combine output, the aux result, and of each
    dispatch the counts and the valid rows ``[0, count[e])`` of x, scales and src_info."""
    outs, recvs, aux = result
    values = [*outs, aux]
    for x, scales, count, src_info in recvs:
        values.append(count)
        for t in (x, scales, src_info):
            if t is not None:
                values.append(torch.cat([t[e, :n] for e, n in enumerate(count.tolist())]))
    return [v.contiguous().view(torch.uint8) for v in values]


def ll_compiled_layer(rank, world_size, case: Case, token_counts: tuple, fp8s: tuple,
                      dynamic: bool | None) -> dict:
    """The low-latency layer through ``moe_comm.ll_ops`` compiled (inductor, ``fullgraph``)
    and eager against the Buffer's own calls, for each entry of ``token_counts`` (tokens of
    every micro-batch on every rank; the Buffer's T_max is the largest): whether each value is
    bit-identical, which calls recompiled, the graph breaks and graphs of
    ``torch._dynamo.explain``, and the order of the communication ops and the matmuls in the
    code inductor generated."""
    import dataclasses
    import re

    import torch._dynamo as dynamo
    import torch._inductor.config as inductor_config
    from torch._inductor.graph import GraphLowering

    dynamo.reset()
    inductor_config.emulate_precision_casts = True
    buf = moe_comm.Buffer(dist.group.WORLD, case.hidden, case.num_experts, max(token_counts),
                          case.dtype, max_topk=case.topk, low_latency=True, timeout_s=600)
    hooks, layer = ll_layer_fn(buf, fp8s, ops=False), ll_layer_fn(buf, fp8s, ops=True)
    # (so that inductor keeps each matmul after its send: moe_comm.ll_ops)
    compiled = torch.compile(layer, fullgraph=True, dynamic=dynamic, backend="inductor",
                             options={"reorder_for_peak_memory": False})
    g = torch.Generator().manual_seed(5 + rank)
    aux, wa, wb = (torch.randn(shape, generator=g) for shape in ((8, 64), (64, 64), (64, 32)))

    def inputs(it: int, T: int) -> list:
        tokens = dataclasses.replace(case, tokens=(T,) * world_size)
        return [tuple(v[rank] for v in make_inputs(tokens, len(fp8s) * it + mb))
                for mb in range(len(fp8s))]

    exact, recompiled, code = [], [], []
    for i, T in enumerate(token_counts):
        batches = inputs(i, T)
        want = _ll_values(hooks(batches, aux, wa, wb))
        eager = _ll_values(layer(batches, aux, wa, wb))
        with unittest.mock.patch.object(GraphLowering, "save_output_code", code.append):
            try:
                with dynamo.config.patch(error_on_recompile=i > 0):
                    got = _ll_values(compiled(batches, aux, wa, wb))
            except dynamo.exc.RecompileError:  # (raised before the graph ran: nothing sent)
                got = _ll_values(compiled(batches, aux, wa, wb))
                recompiled.append(True)
            else:
                recompiled.append(False)
        exact.append([len(got) == len(want) == len(eager)]
                     + [torch.equal(a, b) and torch.equal(c, b)
                        for a, c, b in zip(got, eager, want)])
    explained = dynamo.explain(layer)(inputs(0, token_counts[0]), aux, wa, wb)
    orders = []
    for source in code:  # each compile's wrapper: its extern calls in the order they run
        call = source[source.index("def call("):]
        found = sorted((m.start(), name) for marker, name in _LL_MARKERS
                       for m in re.finditer(re.escape(marker), call))
        orders.append([name for _, name in found])
    buf.close()
    return dict(exact=exact, recompiled=recompiled, graph_breaks=explained.graph_break_count,
                graphs=explained.graph_count, orders=orders)
