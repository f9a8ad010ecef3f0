"""Plain-PyTorch dispatch and combine: the oracle of the tests and the benchmark's baseline.

Same semantics as ``Buffer.dispatch`` / ``Buffer.combine`` (see their docstrings), built from
indexing and ``all_to_all_single``, differentiable with ordinary torch autograd:

* ``dispatch(x, topk_idx, topk_weights, num_experts, group)`` / ``combine(y, handle, weights)``:
  one call per rank over a torch.distributed group;
* ``dispatch_all(xs, topk_idxs, ...)`` / ``combine_all(ys, handles, ...)``: every rank's inputs
  in one process (the exchange is a transpose of per-destination lists), for virtual ranks and
  for self-checking tests where each rank builds all ranks' inputs from one seed.

Both forms run the same four steps: route (which tokens go to which rank, token order), exchange,
expand (rows grouped by local expert, then source rank, then source token; groups padded to
``expert_alignment``), and on the way back reduce per (token, expert rank) in fp32 (fp64 for
fp64 data), round to the data type, exchange, and sum on the home rank in rank order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import microscale
from .microscale import dequantize_fp8


@dataclass
class RefHandle:
    """``send_tokens[d]``: this rank's tokens sent to rank d, in order; ``recv_rows[s]``
    [n_s, K]: output row of each received (token of s, choice), -1 where not on this rank."""

    send_tokens: list[torch.Tensor]
    recv_rows: list[torch.Tensor]
    num_tokens: int
    num_rows: int


@dataclass
class RefDispatch:
    x: torch.Tensor
    weights: torch.Tensor | None
    src_rank: torch.Tensor
    src_token: torch.Tensor
    tokens_per_expert: torch.Tensor
    expert_offsets: torch.Tensor
    handle: RefHandle
    x_scales: torch.Tensor | None = None
    x_global_scale: torch.Tensor | None = None


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------ FP8 (e4m3fn), per 128 channels
FP8_GROUP = 128
MXFP8_CODE = 2  # the ``ue8m0`` code of MXFP8 in the ops (validation.MXFP8)
NVFP4_CODE = 3  # and of NVFP4


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A copy with canonical row-major strides (``.view(dtype)`` needs them, also when empty)."""
    return t.clone(memory_format=torch.contiguous_format)


def quantize_fp8(x: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [T, H] float8_e4m3fn, scales [T, H/128] float32)`` with ``x ~ q * scale`` per group.

    ``scale = max(amax, 1e-4) / 448``; with ``ue8m0`` the scale is rounded up to a power of two.
    A NaN in a group makes its amax and scale NaN (infinite with ``ue8m0``): the whole group
    dequantizes to NaN.
    """
    T, H = x.shape
    g = x.float().reshape(T, H // FP8_GROUP, FP8_GROUP)
    amax = g.abs().amax(-1).clamp(min=1e-4)
    # divided by a tensor, not a Python number: on CUDA torch turns division by a scalar into
    # a multiplication by its rounded reciprocal, which can miss the IEEE quotient by an ulp
    scale = amax / torch.full_like(amax, 448.0)
    if ue8m0:  # NaN and infinity: exponent 255 (E8M0's NaN), an infinite scale
        scale = microscale.ue8m0_ceil(scale)
    q = (g / scale[..., None]).reshape(T, H).to(torch.float8_e4m3fn)
    return q, scale


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales [N, G] -> biased exponents packed 4 per int32 [N, ceil(G/4)]
    (group 4i + j in byte j of word i, little-endian; padding bytes 0)."""
    N, G = scales.shape
    exps = microscale.e8m0_codes(scales)
    padded = torch.zeros((N, (G + 3) // 4 * 4), dtype=torch.uint8, device=scales.device)
    padded[:, :G] = exps
    return padded.view(torch.int32)


def unpack_ue8m0(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of :func:`pack_ue8m0`: fp32 scales [N, groups]."""
    exps = _dense(packed).view(torch.uint8)[:, :groups]
    exps = exps.to(torch.int32)
    return (exps << 23).view(torch.float32)


def _scale_code(dispatch_dtype: str | None, ue8m0: bool) -> int:
    """0 float32 scales per 128, 1 power-of-two per 128 (``ue8m0``), 2 MXFP8 (E8M0 per 32),
    3 NVFP4 (e4m3 per 16 and a global scale)."""
    codes = {"mxfp8": MXFP8_CODE, "nvfp4": NVFP4_CODE}
    return codes[dispatch_dtype] if dispatch_dtype in codes else int(bool(ue8m0))


def _fp8_payload(x, code: int, global_scale=None) -> torch.Tensor:
    """Rows to send in an FP8 dispatch, as bytes: [T, H] codes then the scales ([T, H/128]
    fp32, or MXFP8 [T, H/32] E8M0 bytes; NVFP4: [T, H/2] packed codes, [T, H/16] e4m3
    scales, then each row's global scale). ``x`` is a tensor (quantized here; NVFP4 with
    ``global_scale`` or its own) or an already quantized tuple."""
    if code == NVFP4_CODE:
        q, scales, gs = x if isinstance(x, (tuple, list)) else \
            microscale.quantize_nvfp4(x, global_scale)
        per_row = torch.zeros(q.shape[0], device=q.device) + gs.float().reshape(-1)
        return torch.cat([_dense(q).view(torch.uint8), _dense(scales).view(torch.uint8),
                          per_row.view(torch.uint8).reshape(-1, 4)], dim=1)
    if code == MXFP8_CODE:
        q, scales = x if isinstance(x, (tuple, list)) else microscale.quantize_mxfp8(x)
    else:
        q, scales = x if isinstance(x, (tuple, list)) else quantize_fp8(x, bool(code))
    return torch.cat([_dense(q).view(torch.uint8), _dense(scales).view(torch.uint8)], dim=1)


def _split_nvfp4(payload: torch.Tensor, hidden: int):
    """NVFP4 payload rows -> (values [N, H/2] uint8, scales [N, H/16] e4m3, global [N])."""
    half, groups = hidden // 2, hidden // microscale.NVFP4_GROUP
    return (_dense(payload[:, :half]), _dense(payload[:, half:half + groups]).view(
        torch.float8_e4m3fn), _dense(payload[:, half + groups:]).view(torch.float32).reshape(-1))


def _split_fp8(res: RefDispatch, hidden: int, code: int, col_major: bool) -> RefDispatch:
    payload = res.x
    if code == NVFP4_CODE:
        res.x, res.x_scales, res.x_global_scale = _split_nvfp4(payload, hidden)
        return res
    res.x = _dense(payload[:, :hidden]).view(torch.float8_e4m3fn)
    if code == MXFP8_CODE:
        res.x_scales = _dense(payload[:, hidden:]).view(torch.float8_e8m0fnu)
        return res
    scales = _dense(payload[:, hidden:]).view(torch.float32)
    if code:
        scales = pack_ue8m0(scales)
    res.x_scales = scales.t().contiguous().t() if col_major else scales
    return res


def route(topk_idx: torch.Tensor, world_size: int, num_experts: int):
    """Per destination d: the tokens sent there (once each, in order) and, per choice, the
    local expert on d (-1 if the choice is elsewhere or unused): ``([n_d], [n_d, K])`` lists."""
    L = num_experts // world_size
    dest = torch.where(topk_idx >= 0, topk_idx.div(L, rounding_mode="floor"), -1)
    tokens, local = [], []
    for d in range(world_size):
        sel = (dest == d).any(dim=1).nonzero().flatten()
        tokens.append(sel)
        local.append(torch.where(dest[sel] == d, topk_idx[sel] - d * L, -1))
    return tokens, local


def expand(recv_x: list[torch.Tensor], recv_tok: list[torch.Tensor], recv_local: list[torch.Tensor],
           recv_w: list[torch.Tensor] | None, num_local_experts: int, expert_alignment: int
           ) -> RefDispatch:
    """Rows received from each source -> expert-major rows with padding (one rank's output)."""
    L = num_local_experts
    H, dev = recv_x[0].shape[1], recv_x[0].device
    K = recv_local[0].shape[1]
    n = [t.numel() for t in recv_tok]
    slot = torch.cat(recv_x)  # [N, H], ordered by source then token
    local = torch.cat(recv_local)  # [N, K]
    src = torch.repeat_interleave(torch.arange(len(n), device=dev), torch.tensor(n, device=dev))
    tok = torch.cat(recv_tok)
    pair_slot = torch.arange(slot.shape[0], device=dev)[:, None].expand(-1, K)
    valid = local >= 0
    e, i = local[valid], pair_slot[valid]  # pairs in (slot, k) order
    order = torch.sort(e, stable=True).indices  # by expert, then source, then token
    e, i = e[order], i[order]
    tokens_per_expert = torch.bincount(e, minlength=L)
    padded = (tokens_per_expert + expert_alignment - 1) // expert_alignment * expert_alignment
    offsets = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
    start = torch.cat([tokens_per_expert.new_zeros(1), tokens_per_expert.cumsum(0)])[:-1]
    row = offsets[e] + torch.arange(e.numel(), device=dev) - start[e]
    rows = int(offsets[-1])
    x_out = slot.new_zeros((rows, H)).index_put((row,), slot[i])
    src_rank = torch.full((rows,), -1, dtype=torch.int64, device=dev).index_put((row,), src[i])
    src_token = torch.full((rows,), -1, dtype=torch.int64, device=dev).index_put((row,), tok[i])
    w_out = None
    if recv_w is not None:
        w = torch.cat(recv_w)[valid][order]
        w_out = w.new_zeros(rows).index_put((row,), w)
    recv_rows = torch.full_like(local, -1)
    recv_rows[pair_slot[valid][order], torch.nonzero(valid)[:, 1][order]] = row
    handle = RefHandle([], list(recv_rows.split(n)), 0, rows)
    return RefDispatch(x_out, w_out, src_rank, src_token, tokens_per_expert, offsets, handle)


def partials(y: torch.Tensor, weights: torch.Tensor | None, recv_rows: list[torch.Tensor],
             fp8: bool = False) -> list[torch.Tensor]:
    """Per source s: for each of its tokens here, sum over choices of ``w * y[row]`` in choice
    order, accumulated in fp32 (fp64 for fp64) and rounded to ``y.dtype``; with ``fp8``
    quantized from fp32 per 128 channels and dequantized (fp32): what arrives at home."""
    acc = _acc_dtype(y.dtype)
    out = []
    for rows in recv_rows:
        total = y.new_zeros((rows.shape[0], y.shape[1]), dtype=acc)
        for k in range(rows.shape[1]):
            r = rows[:, k]
            v = y[r.clamp(min=0)].to(acc)
            if weights is not None:
                v = v * weights[r.clamp(min=0)].to(acc)[:, None]
            total = total + torch.where((r >= 0)[:, None], v, 0)
        out.append(dequantize_fp8(*quantize_fp8(total)) if fp8 else total.to(y.dtype))
    return out


def sum_home(back: list[torch.Tensor], send_tokens: list[torch.Tensor], num_tokens: int,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out[t] = sum over d in order of back[d][position of t]``, in fp32 (fp64 for fp64),
    rounded to ``dtype`` (default: the partials')."""
    dtype = back[0].dtype if dtype is None else dtype
    out = back[0].new_zeros((num_tokens, back[0].shape[1]), dtype=_acc_dtype(dtype))
    for d, toks in enumerate(send_tokens):
        out = out.index_add(0, toks, back[d].to(out.dtype))
    return out.to(dtype)


def invariant_combine(choice_rows: torch.Tensor, topk_idx: torch.Tensor,
                      weights: torch.Tensor | None = None, *, dtype: torch.dtype | None = None,
                      counts: torch.Tensor | None = None) -> torch.Tensor:
    """The EP-invariant combine (``Buffer(..., ep_invariant=True)``) on one process:
    ``choice_rows`` [T, K, H], the expert output row of each (token, choice); ``weights`` [T, K]
    (None: the rows themselves); ``counts`` [T, K] bool, the choices that count (default
    ``topk_idx >= 0``). Every product and every addition rounded to fp32, choices in order::

        acc = 0
        for k in range(K): acc = acc + fl32(fl32(w[t, k]) * fl32(row(t, k)))   where counted
        out[t] = acc.to(dtype)
    """
    counts = topk_idx >= 0 if counts is None else counts
    T, K, H = choice_rows.shape
    acc = torch.zeros((T, H), dtype=torch.float32, device=choice_rows.device)
    for k in range(K):
        p = choice_rows[:, k].float()
        if weights is not None:
            p = p * weights[:, k, None].float()
        acc = acc + torch.where(counts[:, k, None], p, 0.0)
    return acc.to(choice_rows.dtype if dtype is None else dtype)


# ------------------------------------------------------------------ one process per rank
class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with given splits; backward swaps the splits."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), recv_splits, send_splits, ctx.group), None, \
            None, None


def _exchange(chunks: list[torch.Tensor], group) -> list[torch.Tensor]:
    """``chunks[d]`` goes to rank d; returns what each rank sent here, as a list by source."""
    send = [c.shape[0] for c in chunks]
    recv_t = torch.empty(len(chunks), dtype=torch.int64)
    dist.all_to_all_single(recv_t, torch.tensor(send, dtype=torch.int64), group=group)
    recv = recv_t.tolist()
    out = _AllToAll.apply(torch.cat(chunks), send, recv, group)
    return list(out.split(recv))


def dispatch(x, topk_idx, topk_weights, num_experts: int, group=None,
             expert_alignment: int = 1, *, fp8: bool = False, ue8m0: bool = False,
             col_major_scales: bool = False, dispatch_dtype: str | None = None,
             global_scale=None) -> RefDispatch:
    """Reference ``Buffer.dispatch`` for this rank of ``group`` (``x`` may be a (q, scales)
    pair with ``fp8``; ``dispatch_dtype="mxfp8"`` / ``"nvfp4"``: MXFP8 / NVFP4)."""
    R = dist.get_world_size(group)
    code = _scale_code(dispatch_dtype, ue8m0)
    fp8 = fp8 or code >= MXFP8_CODE
    rows = _fp8_payload(x, code, global_scale) if fp8 else x
    tokens, local = route(topk_idx, R, num_experts)
    recv_x = _exchange([rows[t] for t in tokens], group)
    recv_tok = _exchange(tokens, group)
    recv_local = _exchange(local, group)
    recv_w = None if topk_weights is None else _exchange([topk_weights[t] for t in tokens], group)
    res = expand(recv_x, recv_tok, recv_local, recv_w, num_experts // R, expert_alignment)
    res.handle.send_tokens, res.handle.num_tokens = tokens, topk_idx.shape[0]
    if fp8:
        _split_fp8(res, _hidden(x), code, col_major_scales)
    return res


def combine(y, handle: RefHandle, weights=None, group=None) -> torch.Tensor:
    """Reference ``Buffer.combine`` for this rank of ``group``."""
    back = _exchange(partials(y, weights, handle.recv_rows), group)
    return sum_home(back, handle.send_tokens, handle.num_tokens)


# ------------------------------------------------------------------ all ranks in one process
def dispatch_all(xs, topk_idxs, topk_weights=None, *, num_experts: int,
                 expert_alignment: int = 1, fp8: bool = False, ue8m0: bool = False,
                 col_major_scales: bool = False, dispatch_dtype: str | None = None,
                 global_scale=None) -> list[RefDispatch]:
    """Reference dispatch of every rank at once: ``xs[r]``, ``topk_idxs[r]`` are rank r's inputs
    (NVFP4: every rank quantizes with ``global_scale`` if given, else with its own)."""
    R = len(xs)
    code = _scale_code(dispatch_dtype, ue8m0)
    fp8 = fp8 or code >= MXFP8_CODE
    rows = [_fp8_payload(x, code, global_scale) if fp8 else x for x in xs]
    routes = [route(idx, R, num_experts) for idx in topk_idxs]
    results = []
    for d in range(R):
        recv_x = [rows[s][routes[s][0][d]] for s in range(R)]
        recv_tok = [routes[s][0][d] for s in range(R)]
        recv_local = [routes[s][1][d] for s in range(R)]
        recv_w = None if topk_weights is None else \
            [topk_weights[s][routes[s][0][d]] for s in range(R)]
        res = expand(recv_x, recv_tok, recv_local, recv_w, num_experts // R, expert_alignment)
        res.handle.send_tokens, res.handle.num_tokens = routes[d][0], topk_idxs[d].shape[0]
        if fp8:
            _split_fp8(res, _hidden(xs[d]), code, col_major_scales)
        results.append(res)
    return results


def _hidden(x) -> int:
    if isinstance(x, (tuple, list)):  # a quantized tuple: NVFP4's values hold two per byte
        return x[0].shape[1] * (2 if len(x) == 3 else 1)
    return x.shape[1]


def combine_all(ys, handles: list[RefHandle], weights=None, *,
                hierarchical_nodes: int | None = None, combine_dtype=None) -> list[torch.Tensor]:
    """Reference combine of every rank at once. ``hierarchical_nodes=N`` (ranks per node): the
    order of the hierarchical mode: each other node's partials of a token are summed first (in
    rank order, fp32, rounded to the dtype once), then the home sums in node order: its own
    node's partials one by one, every other node's sum as one term. ``combine_dtype="fp8"``:
    the partials travel as FP8 (``partials(..., fp8=True)``); hierarchical: the partials of
    other nodes' tokens as they are, their fp32 node sums as FP8."""
    R = len(ys)
    weights = weights if weights is not None else [None] * R
    fp8 = combine_dtype in ("fp8", torch.float8_e4m3fn)
    parts = [partials(ys[d], weights[d], handles[d].recv_rows, fp8) for d in range(R)]
    if hierarchical_nodes is None:
        return [sum_home([parts[d][s] for d in range(R)], handles[s].send_tokens,
                         handles[s].num_tokens, ys[0].dtype) for s in range(R)]
    N = hierarchical_nodes
    plain = [partials(ys[d], weights[d], handles[d].recv_rows) for d in range(R)] if fp8 \
        else parts  # what reaches the forwarders
    outs = []
    for s in range(R):
        toks, T = handles[s].send_tokens, handles[s].num_tokens
        dtype = ys[0].dtype
        out = ys[0].new_zeros((T, ys[0].shape[1]), dtype=_acc_dtype(dtype))
        for b in range(R // N):
            node = range(b * N, b * N + N)
            if b == s // N:
                for d in node:
                    out = out.index_add(0, toks[d], parts[d][s].to(out.dtype))
                continue
            node_sum = torch.zeros_like(out)
            for d in node:
                node_sum = node_sum.index_add(0, toks[d], plain[d][s].to(out.dtype))
            hit = torch.zeros(T, dtype=torch.bool)
            for d in node:
                hit[toks[d]] = True
            rows = hit.nonzero().flatten()
            sent = dequantize_fp8(*quantize_fp8(node_sum[rows])) if fp8 else \
                node_sum[rows].to(dtype)
            out = out.index_add(0, rows, sent.to(out.dtype))
        outs.append(out.to(dtype))
    return outs


# ------------------------------------------------------------------ low-latency mode
@dataclass
class RefLowLatency:
    """One rank's low-latency receive: ``x`` [L, R*T_max, H] (valid rows [0, count[e])),
    ``x_scales`` or None, ``count`` [L], ``src_info`` / ``src_k`` [L, R*T_max] (-1 past count),
    ``x_global_scale`` (NVFP4) [L, R*T_max]."""

    x: torch.Tensor
    x_scales: torch.Tensor | None
    count: torch.Tensor
    src_info: torch.Tensor
    src_k: torch.Tensor
    x_global_scale: torch.Tensor | None = None


def low_latency_dispatch_all(xs, topk_idxs, *, num_experts: int, max_tokens: int,
                             fp8: bool = False, ue8m0: bool = False,
                             col_major_scales: bool = False,
                             dispatch_dtype: str | None = None,
                             global_scale=None) -> list[RefLowLatency]:
    """Reference ``low_latency_dispatch`` of every rank at once: each (token, expert) pair
    becomes a row of its expert, ordered by source rank, then token (``dispatch_dtype=
    "mxfp8"``: MXFP8 rows and E8M0 scales [L, R * T, H/32]; ``"nvfp4"``: packed rows
    [L, R * T, H/2], e4m3 scales [L, R * T, H/16] and global scales [L, R * T])."""
    R = len(xs)
    L, H, T = num_experts // R, xs[0].shape[1], max_tokens
    code = _scale_code(dispatch_dtype, ue8m0)
    fp8 = fp8 or code >= MXFP8_CODE
    rows = [_fp8_payload(x, code, global_scale) if fp8 else x for x in xs]
    out = []
    for d in range(R):
        x_out = rows[0].new_zeros((L, R * T, rows[0].shape[1]))
        src_info = torch.full((L, R * T), -1, dtype=torch.int32)
        src_k = torch.full((L, R * T), -1, dtype=torch.int32)
        count = torch.zeros(L, dtype=torch.int32)
        for s in range(R):
            idx = topk_idxs[s]
            t, k = ((idx >= d * L) & (idx < (d + 1) * L)).nonzero(as_tuple=True)  # token order
            e = idx[t, k] - d * L
            for le in range(L):
                sel = e == le
                n, first = int(sel.sum()), int(count[le])
                x_out[le, first:first + n] = rows[s][t[sel]]
                src_info[le, first:first + n] = (s * T + t[sel]).to(torch.int32)
                src_k[le, first:first + n] = k[sel].to(torch.int32)
                count[le] += n
        scales = None
        if fp8 and code == NVFP4_CODE:
            q, scales, gs = _split_nvfp4(x_out.reshape(L * R * T, -1), H)
            out.append(RefLowLatency(q.reshape(L, R * T, -1), scales.reshape(L, R * T, -1),
                                     count, src_info, src_k, gs.reshape(L, R * T)))
            continue
        if fp8:
            payload = x_out.reshape(L * R * T, -1)
            x_out = _dense(payload[:, :H]).view(torch.float8_e4m3fn).reshape(L, R * T, H)
            if code == MXFP8_CODE:
                scales = _dense(payload[:, H:]).view(torch.float8_e8m0fnu).reshape(L, R * T, -1)
                out.append(RefLowLatency(x_out, scales, count, src_info, src_k))
                continue
            scales = _dense(payload[:, H:]).view(torch.float32)
            scales = (pack_ue8m0(scales) if ue8m0 else scales).reshape(L, R * T, -1)
            if col_major_scales:
                scales = scales.transpose(1, 2).contiguous().transpose(1, 2)
        out.append(RefLowLatency(x_out, scales, count, src_info, src_k))
    return out


def low_latency_combine_all(ys, topk_idxs, topk_weights, received: list[RefLowLatency],
                            max_tokens: int, combine_dtype=None) -> list[torch.Tensor]:
    """Reference ``low_latency_combine`` of every rank: ``out[t] = sum_k w[t, k] * row(t, k)``
    accumulated in fp32 in choice order, rounded to the rows' dtype (``combine_dtype="fp8"``:
    each row quantized per 128 channels and dequantized first)."""
    fp8 = combine_dtype in ("fp8", torch.float8_e4m3fn)
    R = len(ys)
    L = ys[0].shape[0]
    outs = []
    for s in range(R):
        idx = topk_idxs[s]
        T, K = idx.shape
        acc = torch.zeros((T, ys[0].shape[2]), dtype=torch.float32)
        for k in range(K):
            for t in range(T):
                g = int(idx[t, k])
                if g < 0:
                    continue
                d, le = g // L, g % L
                hit = ((received[d].src_info[le] == s * max_tokens + t)
                       & (received[d].src_k[le] == k)).nonzero()
                v = ys[d][le, int(hit[0])].float()
                if fp8:
                    v = dequantize_fp8(*quantize_fp8(v[None]))[0]
                if topk_weights is not None:
                    v = v * topk_weights[s][t, k]
                acc[t] += v
        outs.append(acc.to(ys[0].dtype))
    return outs
