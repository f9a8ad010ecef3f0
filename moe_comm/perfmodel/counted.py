"""Exact bytes of this package's kernels for a given routing, in the counters they keep.

For a global routing ``ids`` [ep * T, K] (rank r owns rows [r*T, (r+1)*T), -1 = no expert),
`moe_comm_counters` returns, for every rank, what ``Buffer.stats()`` and
``Buffer.internode_bytes()`` report after one dispatch and one combine, from the message
formats of `moe_comm.perfmodel.formats.MOE_COMM` alone (no kernel runs). tests/test_perfmodel.py
runs the kernels on CPU ranks over a grid of shapes and checks every counter equal.

Counters per phase (bytes unless the name says otherwise):

| key                        | what the kernels count                                          |
|----------------------------|-----------------------------------------------------------------|
| dispatch_bytes_to_peers    | stores into other ranks' memory (rows, metadata, signals); low- |
|                            | latency mode across nodes also the rows staged for the NIC      |
| dispatch_bytes_to_self     | the same, into the rank's own receive slots                     |
| dispatch_bytes_to_outbox   | rows written into the outbox the transport reads (across nodes) |
| dispatch_bytes_forwarded   | rows a forwarder stores into its node's ranks (hierarchical)    |
| combine_bytes_to_peers / _to_self / _to_outbox / _to_forwarders: the combine's mirror images |
| per_peer[channel][d]       | data bytes the transport was asked to move to rank d            |
"""
from __future__ import annotations

import numpy as np

from .formats import MOE_COMM

STAT_KEYS = ("dispatch_bytes_to_peers", "dispatch_bytes_to_self", "combine_bytes_to_peers",
             "combine_bytes_to_self")
NODE_KEYS = ("dispatch_bytes_to_outbox", "combine_bytes_to_outbox", "dispatch_bytes_forwarded",
             "combine_bytes_to_forwarders")


def _rows(ids: np.ndarray, ep: int, m: int) -> np.ndarray:
    """[ep*T, ep] bool: token t has at least one expert on rank d."""
    hit = np.zeros((ids.shape[0], ep), dtype=bool)
    tok, col = np.nonzero(ids >= 0)
    hit[tok, ids[tok, col] // m] = True
    return hit


def _pairs(ids: np.ndarray, ep: int, m: int) -> np.ndarray:
    """[ep*T, ep] int: experts of rank d token t picked."""
    cnt = np.zeros((ids.shape[0], ep), dtype=np.int64)
    tok, col = np.nonzero(ids >= 0)
    np.add.at(cnt, (tok, ids[tok, col] // m), 1)
    return cnt


def moe_comm_counters(ids, *, ep: int, num_experts: int, hidden: int, gpus_per_node: int,
                      mode: str = "normal", hierarchical: bool = False,
                      dispatch_dtype: str = "bf16", combine_dtype: str = "bf16",
                      max_topk: int | None = None, dtype: str | None = None,
                      rounds: int = 1) -> list[dict]:
    """Per rank: {"dispatch": {counter: bytes, "per_peer": {channel: [ep]}}, "combine": ...}.

    ids: [ep*T, K] integer expert ids. gpus_per_node: ranks per node (= ep for one node).
    max_topk: the Buffer's max_topk (metadata has 3 words per slot of it; default K).
    dispatch_dtype: "bf16" | "fp16" | "fp32" | "fp8" (one fp32 scale per 128 elements) |
    "fp8-ue8m0" | "mxfp8" | "nvfp4" (``formats.MOE_COMM.payload``);
    combine_dtype: the Buffer's dtype, or "fp8" (``combine_dtype="fp8"``; hierarchical: the
    partials reach the forwarders in ``dtype``, the Buffer's, default bf16, and cross nodes
    as FP8).
    rounds: the Buffer's ``rounds`` (bounded staging, normal mode): every round publishes its
    epoch (and in a dispatch the counts) to every rank of the node, across nodes the counts in
    each round's message (flat: to every remote peer; hierarchical: to the rail peer of every
    other node, with the node's ranks' counts); the rows are the same.
    """
    ids = np.asarray(ids, dtype=np.int64)
    N, K = ids.shape
    if N % ep:
        raise ValueError(f"ids has {N} rows, not a multiple of ep={ep}")
    T, m, gpn = N // ep, num_experts // ep, gpus_per_node
    nodes = ep // gpn
    if rounds != 1 and mode != "normal":
        raise ValueError("rounds > 1 is the normal mode (bounded staging)")
    fmt = MOE_COMM
    k = K if max_topk is None else max_topk
    P = fmt.payload(dispatch_dtype, hidden)
    C = fmt.payload(combine_dtype, hidden)
    C_fwd = fmt.payload(dtype or ("bf16" if combine_dtype == "fp8" else combine_dtype), hidden)
    src = np.repeat(np.arange(ep), T)
    node_of = np.arange(ep) // gpn
    if mode == "low_latency":
        pairs = _pairs(ids, ep, m)
        sent = np.zeros((ep, ep), dtype=np.int64)          # [source, destination] pairs
        np.add.at(sent, src, pairs)
        return [_low_latency_rank(r, sent, P, C, m, node_of, nodes) for r in range(ep)]
    hit = _rows(ids, ep, m)
    rows = np.zeros((ep, ep), dtype=np.int64)               # [source, destination] rows
    np.add.at(rows, src, hit.astype(np.int64))
    meta = fmt.normal_meta_bytes(k)
    signal = fmt.normal_count_bytes(m) * rounds  # every round: the counts and an epoch
    epoch = fmt.epoch_signal_bytes * rounds
    out = []
    for r in range(ep):
        same = (node_of == node_of[r]) & (np.arange(ep) != r)
        other = node_of != node_of[r]
        d = {"dispatch_bytes_to_peers": int(rows[r, same].sum()) * (P + meta)
             + int(same.sum()) * (signal + epoch),
             "dispatch_bytes_to_self": int(rows[r, r]) * (P + meta) + signal + epoch}
        c = {"combine_bytes_to_peers": int(rows[same, r].sum()) * C + int(same.sum()) * epoch,
             "combine_bytes_to_self": int(rows[r, r]) * C + epoch}
        if nodes > 1:
            d_peer, c_peer = np.zeros(ep, dtype=np.int64), np.zeros(ep, dtype=np.int64)
            if hierarchical:
                _hierarchical_rank(r, hit, src, m, gpn, nodes, P, C, meta, d, c, d_peer,
                                   c_peer, C_fwd, rounds)
            else:
                d["dispatch_bytes_to_outbox"] = int(rows[r, other].sum()) * (P + meta)
                c["combine_bytes_to_outbox"] = int(rows[other, r].sum()) * C
                d_peer[other] = rows[r, other] * (P + meta) + signal
                c_peer[other] = rows[other, r] * C
                d["dispatch_bytes_forwarded"] = c["combine_bytes_to_forwarders"] = 0
            d["per_peer"] = {"dispatch": d_peer.tolist(), "combine": [0] * ep}
            c["per_peer"] = {"dispatch": [0] * ep, "combine": c_peer.tolist()}
        out.append({"dispatch": d, "combine": c})
    return out


def _hierarchical_rank(r, hit, src, m, gpn, nodes, P, C, meta, d, c, d_peer, c_peer, C_fwd,
                       rounds):
    """Rank r across nodes, hierarchical: one row per (token, other node) to the rail peer
    there, with the node's slots; the forwarder stores it into each picked rank of its node.
    Combine: expert ranks send rows of remote tokens to their forwarder (``C_fwd`` bytes
    each), which reduces them per (token, node) and sends one row home (``C``). Every round's
    message to a node carries that round's counts."""
    fmt = MOE_COMM
    ep = hit.shape[1]
    my_node, lane = r // gpn, r % gpn
    node_hit = hit.reshape(-1, nodes, gpn).any(axis=2)            # [tokens, nodes]
    mine = src == r
    fwd_meta = meta + fmt.node_slot_bytes * gpn
    to_node = node_hit[mine].sum(axis=0)                           # rows to each node
    for b in range(nodes):
        if b != my_node:
            d_peer[b * gpn + lane] = to_node[b] * (P + fwd_meta) \
                + rounds * fmt.node_count_bytes(m, gpn)
    d["dispatch_bytes_to_outbox"] = int(sum(to_node[b] for b in range(nodes) if b != my_node)) \
        * (P + fwd_meta)
    # rows this rank forwards: tokens of its rail peers on other nodes, to each picked rank of
    # this node (itself included)
    rail = (src % gpn == lane) & (src // gpn != my_node)
    d["dispatch_bytes_forwarded"] = int(hit[rail][:, my_node * gpn:(my_node + 1) * gpn].sum()) \
        * (P + meta)
    # combine: rows this rank's experts hold for tokens of other nodes go to their forwarder
    remote = src // gpn != my_node
    c["combine_bytes_to_forwarders"] = int(hit[remote, r].sum()) * C_fwd
    back = node_hit[rail, my_node]                                 # one row per token home
    home = src[rail][back]
    for s in range(ep):
        c_peer[s] = int((home == s).sum()) * C
    c["combine_bytes_to_outbox"] = int(back.sum()) * C


def _low_latency_rank(r, sent, P, C, m, node_of, nodes) -> dict:
    """Rank r in low-latency mode: one message per (token, expert) pair."""
    fmt = MOE_COMM
    ep = sent.shape[0]
    msg = P + fmt.ll_header_bytes
    others = np.arange(ep) != r
    remote = node_of != node_of[r]
    d = {"dispatch_bytes_to_peers": int(sent[r, others].sum()) * msg
         + int(others.sum()) * m * fmt.ll_count_bytes,
         "dispatch_bytes_to_self": int(sent[r, r]) * msg + m * fmt.ll_count_bytes}
    c = {"combine_bytes_to_peers": int(sent[others, r].sum()) * C
         + int(others.sum()) * fmt.epoch_signal_bytes,
         "combine_bytes_to_self": int(sent[r, r]) * C + fmt.epoch_signal_bytes}
    if nodes > 1:
        zero = [0] * ep
        d.update({k: 0 for k in ("dispatch_bytes_to_outbox", "dispatch_bytes_forwarded")})
        c.update({k: 0 for k in ("combine_bytes_to_outbox", "combine_bytes_to_forwarders")})
        d["per_peer"] = {"dispatch": zero, "combine": zero, "ll_dispatch":
                         np.where(remote, sent[r] * msg, 0).tolist(), "ll_combine": zero,
                         "ll_acks": zero}
        c["per_peer"] = {"dispatch": zero, "combine": zero, "ll_dispatch": zero,
                         "ll_combine": np.where(remote, sent[:, r] * C, 0).tolist(),
                         "ll_acks": zero}
    return {"dispatch": d, "combine": c}
