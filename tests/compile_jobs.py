"""torch.compile of an MoE layer over a Buffer, on every CPU rank of a pool: the layer compiled
with ``fullgraph=True`` by inductor (dynamic shapes) against the same layer run eagerly, bit
for bit in its output and every gradient, for calls whose token counts differ."""
from __future__ import annotations

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
