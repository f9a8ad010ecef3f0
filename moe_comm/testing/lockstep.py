"""Drive the virtual ranks of ``Buffer.loopback`` through whole ops (forward only, no autograd).

Each op runs its send phase on every virtual rank, then its receive phase on every virtual rank,
so every wait finds its epochs already published; a Buffer whose calls run in rounds
(``staging_bytes``) takes each round the same way: every rank's send of round i, then every
rank's receive of it (the receive phases are generators of steps, ``moe_comm.normal_mode``).
Equivalent to calling ``buf.dispatch`` / ``buf.combine`` on R real ranks at once.
"""
from __future__ import annotations

import torch

from ..ops import wrap_dispatch_outputs
from ..types import DispatchResult
from ..validation import (
    check_cached_rows,
    combine_is_fp8,
    scale_code,
)


def in_lockstep(steps: list) -> list:
    """Runs generators of steps side by side, one step of each in turn, to their ends; returns
    what each returned."""
    results: list = [None] * len(steps)
    running = list(range(len(steps)))
    while running:
        still = []
        for i in running:
            try:
                next(steps[i])
                still.append(i)
            except StopIteration as stop:
                results[i] = stop.value
        running = still
    return results


def dispatch(buffers, xs, topk_idxs, topk_weights=None, expert_alignment: int = 1, *,
             fp8: bool | None = None, ue8m0: bool = False, col_major_scales: bool = False,
             max_recv_rows: int | None = None, dispatch_dtype: str | None = None,
             global_scale=None, by_slot: bool = False) -> list[DispatchResult]:
    """``[buf.dispatch(x, idx, w, expert_alignment, ...) for each virtual rank]``, in lockstep
    (``by_slot``: ``buf.dispatch_by_slot``'s rows, here with ``max_recv_rows`` too: a row for
    every slot a source may fill, zero past the count)."""
    topk_weights = topk_weights if topk_weights is not None else [None] * len(buffers)
    ue8m0 = scale_code(dispatch_dtype, ue8m0)
    prepared = []
    for buf, x, idx, w in zip(buffers, xs, topk_idxs, topk_weights, strict=True):
        buf._checked("an earlier call")
        prepared.append(buf._dispatch_inputs(x, idx, w, expert_alignment, fp8, ue8m0,
                                             col_major_scales, max_recv_rows, global_scale))
    pending = [buf.normal_engine.dispatch_send(rows, idx, w, scales, mode, ue8m0,
                                               expert_alignment)
               for buf, (rows, scales, mode), idx, w
               in zip(buffers, prepared, topk_idxs, topk_weights)]
    outs = in_lockstep([buf.normal_engine.dispatch_recv_steps(p, expert_alignment,
                                                              col_major_scales, max_recv_rows,
                                                              by_slot)
                        for buf, p in zip(buffers, pending)])
    results = [wrap_dispatch_outputs(buf, out, idx.shape[1], w is not None, mode, ue8m0, idx)
               for buf, out, idx, w, (_, _, mode)
               in zip(buffers, outs, topk_idxs, topk_weights, prepared)]
    errors = []
    for buf in buffers:  # every rank's record is read (and cleared); the first error raises
        try:
            buf._raise_input_errors("dispatch")
        except (ValueError, RuntimeError) as error:
            errors.append(error)
    if errors:
        raise errors[0]
    return results


def combine(buffers, ys, handles, weights=None, *, combine_dtype=None) -> list[torch.Tensor]:
    """``[buf.combine(y, handle, w, combine_dtype=...) for each virtual rank]``, in lockstep."""
    weights = weights if weights is not None else [None] * len(buffers)
    fp8 = combine_is_fp8(combine_dtype, dtype=buffers[0].dtype, hidden=buffers[0].hidden,
                         ep_invariant=buffers[0].ep_invariant)
    for buf, y, h, w in zip(buffers, ys, handles, weights, strict=True):
        buf._checked("an earlier call")
        buf._combine_inputs(y, h, w)
    pending = [buf.normal_engine.combine_send(y, w, None, h.slot_rows, h.recv_slot_offsets,
                                              *h.node_tensors()[1:], fp8=fp8,
                                              src_token=h.src_token)
               for buf, y, h, w in zip(buffers, ys, handles, weights)]
    return [out for out, _ in in_lockstep(
        [buf.normal_engine.combine_recv_steps(p, h.slot_of, want_pair=False,
                                              node_slot_of=h.node_tensors()[0],
                                              topk_idx=h.topk_idx)
         for buf, p, h in zip(buffers, pending, handles)])]


def dispatch_cached(buffers, xs, handles) -> list[torch.Tensor]:
    """Every virtual rank's dispatch of the cached layout of ``handles`` (the backward of
    combine): rows [num_rows, H] per rank."""
    for buf, x, h in zip(buffers, xs, handles, strict=True):
        check_cached_rows(x, h.slot_of, hidden=buf.hidden, dtype=buf.dtype)
    pending = [buf.normal_engine.dispatch_cached_send(x, h.slot_of, h.node_tensors()[0])
               for buf, x, h in zip(buffers, xs, handles, strict=True)]
    return in_lockstep([buf.normal_engine.dispatch_cached_recv_steps(
        p, h.slot_rows, h.recv_slot_offsets, h.tokens_per_expert, h.expert_offsets, h.num_rows,
        *h.node_tensors()[1:]) for buf, p, h in zip(buffers, pending, handles)])


def combine_with_pairs(buffers, ys, handles, pair_values) -> list[tuple]:
    """Every virtual rank's combine carrying per-row values home (the backward of dispatch:
    ``pair_values`` [rows] float32 per rank): ``(out [T, H], pair_out [T, K])`` per rank."""
    pending = [buf.normal_engine.combine_send(y, None, v, h.slot_rows, h.recv_slot_offsets,
                                              *h.node_tensors()[1:], src_token=h.src_token)
               for buf, y, h, v in zip(buffers, ys, handles, pair_values, strict=True)]
    return in_lockstep([buf.normal_engine.combine_recv_steps(p, h.slot_of, want_pair=True,
                                                             node_slot_of=h.node_tensors()[0],
                                                             topk_idx=h.topk_idx)
                        for buf, p, h in zip(buffers, pending, handles)])


def low_latency_dispatch(buffers, xs, topk_idxs, **kwargs) -> list:
    """Every virtual rank's ``low_latency_dispatch`` (sends first, then the hooks)."""
    sent = [buf.low_latency_dispatch(x, idx, return_hook=True, **kwargs)
            for buf, x, idx in zip(buffers, xs, topk_idxs, strict=True)]
    for _, hook in sent:
        hook()
    return [recv for recv, _ in sent]


def low_latency_combine(buffers, ys, topk_idxs, topk_weights, handles, **kwargs
                        ) -> list[torch.Tensor]:
    """Every virtual rank's ``low_latency_combine`` (sends first, then the hooks)."""
    topk_weights = topk_weights if topk_weights is not None else [None] * len(buffers)
    sent = [buf.low_latency_combine(y, idx, w, h, return_hook=True, **kwargs)
            for buf, y, idx, w, h in zip(buffers, ys, topk_idxs, topk_weights, handles,
                                         strict=True)]
    for _, hook in sent:
        hook()
    return [out for out, _ in sent]
