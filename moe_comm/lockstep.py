"""Drive the virtual ranks of ``Buffer.loopback`` through whole ops (forward only, no autograd).

Each op runs its send phase on every virtual rank, then its receive phase on every virtual rank,
so every wait finds its epochs already published. Equivalent to calling ``buf.dispatch`` /
``buf.combine`` on R real ranks at once.
"""
from __future__ import annotations

import torch

from .types import DispatchHandle, DispatchResult
from .validation import check_combine_inputs, check_dispatch_inputs


def dispatch(buffers, xs, topk_idxs, topk_weights=None, expert_alignment: int = 1
             ) -> list[DispatchResult]:
    """``[buf.dispatch(x, idx, w, expert_alignment) for each virtual rank]``, run in lockstep."""
    topk_weights = topk_weights if topk_weights is not None else [None] * len(buffers)
    for buf, x, idx, w in zip(buffers, xs, topk_idxs, topk_weights, strict=True):
        buf._check_usable()
        check_dispatch_inputs(x, idx, w, expert_alignment, hidden=buf.hidden,
                              num_experts=buf.num_experts, max_tokens=buf.max_tokens_per_rank,
                              max_topk=buf.max_topk, dtype=buf.dtype, device=buf.device)
    pending = [buf.dispatch_send(x, idx, w)
               for buf, x, idx, w in zip(buffers, xs, topk_idxs, topk_weights)]
    results = []
    for buf, p, idx, w in zip(buffers, pending, topk_idxs, topk_weights):
        x_out, w_out, src_rank, src_token, tpe, offsets, slot_of, slot_rows, slot_off = \
            buf.dispatch_recv(p, expert_alignment)
        handle = DispatchHandle(buf.id, buf.dispatch_serial, slot_of, slot_rows, slot_off,
                                x_out.shape[0], idx.shape[1])
        results.append(DispatchResult(x_out, w_out if w is not None else None, src_rank,
                                      src_token, tpe, offsets, handle))
    return results


def combine(buffers, ys, handles, weights=None) -> list[torch.Tensor]:
    """``[buf.combine(y, handle, w) for each virtual rank]``, run in lockstep."""
    weights = weights if weights is not None else [None] * len(buffers)
    for buf, y, h, w in zip(buffers, ys, handles, weights, strict=True):
        buf._check_usable()
        check_combine_inputs(y, h, w, buffer_id=buf.id, latest_serial=buf.dispatch_serial,
                             hidden=buf.hidden, dtype=buf.dtype, device=buf.device)
    pending = [buf.combine_send(y, w, None, h.slot_rows, h.recv_slot_offsets)
               for buf, y, h, w in zip(buffers, ys, handles, weights)]
    return [buf.combine_recv(p, h.slot_of, want_pair=False)[0]
            for buf, p, h in zip(buffers, pending, handles)]
