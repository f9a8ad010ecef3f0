"""Across nodes on CPU ranks: cross-node bytes of the flat and hierarchical normal modes.

    python bench/dispatch_bench.py --nodes 2 --ranks 4        # (delegates here)

One row per model config and mode (flat: a token once per destination rank on another node;
hier: once per destination node, forwarded inside it):

* x-node MB: data bytes the NIXL proxy was asked to move during one dispatch (rows, metadata,
  counts) and one combine, summed over ranks (counted at the transport);
* min MB: per token, one row (and its metadata) per other node it has experts on;
* rows/tok: cross-node rows per token, measured, next to the model's expectation for uniform
  routing (``moe_comm.perfmodel``: distinct destination nodes per token, minus the chance the
  token's own node is one of them);
* proxy/bare: the proxy's transfer time (post to completion, summed over its WRITEs) over a
  bare NIXL WRITE of the same bytes between the same processes (fresh agents configured like
  the proxy's, without NIXL's progress thread; one WRITE per peer); both CPU numbers, never
  GPU or NIC performance;
* ref: every rank's dispatch rows and combine output equal the reference bit for bit.
"""
from __future__ import annotations

import math
import time

import torch

ROW_FIELDS = ("config", "mode", "xnode_MB", "min_MB", "rows_per_token", "model_rows_per_token",
              "proxy_over_bare", "matches_reference")


class BareNixl:
    """Fresh NIXL agents (one per rank, made once) for the bare comparison."""

    def __init__(self, rank: int, world_size: int, nbytes: int):
        import torch.distributed as dist
        from nixl_cu13 import nixl_agent, nixl_agent_config

        self.rank, self.world_size = rank, world_size
        self.src = torch.ones(nbytes, dtype=torch.uint8)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        self.agent = nixl_agent(f"bare-{rank}-{time.monotonic_ns()}",
                                nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.agent.register_memory(self.src)
        self.agent.register_memory(self.dst)
        infos: list = [None] * world_size
        dist.all_gather_object(infos, (self.agent.get_agent_metadata(), self.dst.data_ptr()))
        self.dst_addr = [i[1] for i in infos]
        self.names = {p: self.agent.add_remote_agent(infos[p][0]) for p in range(world_size)
                      if p != rank}

    def seconds(self, per_peer: list[int]) -> float:
        """One WRITE (with a notification) of ``per_peer[p]`` bytes to each peer; the seconds
        until this rank's WRITEs are done and every peer's have arrived here."""
        import torch.distributed as dist

        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, per_peer)
        incoming = sum(1 for p in range(self.world_size)
                       if p != self.rank and everyone[p][self.rank])
        dist.barrier()
        start = time.perf_counter()
        handles = []
        for p, nbytes in enumerate(per_peer):
            if nbytes and p != self.rank:
                h = self.agent.initialize_xfer(
                    "WRITE", self.agent.get_xfer_descs([(self.src.data_ptr(), nbytes, 0)], "DRAM"),
                    self.agent.get_xfer_descs([(self.dst_addr[p], nbytes, 0)], "DRAM"),
                    self.names[p], b"bare")
                self.agent.transfer(h)
                handles.append(h)
        arrived, deadline = 0, time.monotonic() + 60
        while (handles or arrived < incoming) and time.monotonic() < deadline:
            handles = [h for h in handles if self.agent.check_xfer_state(h) == "PROC"]
            arrived += sum(len(v) for v in self.agent.get_new_notifs().values())
            time.sleep(2e-5)
        seconds = time.perf_counter() - start
        dist.barrier()
        if handles or arrived < incoming:
            raise RuntimeError(f"rank {self.rank}: bare NIXL transfers unfinished after 60 s")
        return seconds


def internode_job(rank, world_size, cfg, nodes: int, tokens: int, dtype, seed: int,
                  ring_slots: int = 0) -> dict:
    """Flat and hierarchical: one dispatch and combine against the reference, the bytes across
    nodes, the proxy's and bare NIXL's seconds (``ring_slots``: each Buffer's staging holds
    that many slots per source, its calls in rounds)."""
    import torch.distributed as dist
    from dispatch_bench import make_routing

    import moe_comm
    from moe_comm import reference
    from moe_comm.workspace import staging_slot_bytes

    N = world_size // nodes
    xs, idxs, ws = make_routing(cfg, world_size, tokens, "uniform", seed)
    xs = [x.to(dtype) for x in xs]
    L = cfg.experts // world_size
    out = {}
    row_bytes = cfg.hidden * xs[0].element_size() + 4 * (1 + 3 * cfg.topk + N) + 4 * cfg.topk
    bare = BareNixl(rank, world_size, 2 * tokens * row_bytes + (1 << 16))
    for hier in (False, True):
        budget = ring_slots * staging_slot_bytes(world_size, cfg.hidden, cfg.topk, dtype,
                                                 outboxes=True, ranks_per_node=N if hier
                                                 else None) if ring_slots else None
        buf = moe_comm.Buffer(dist.group.WORLD, hidden=cfg.hidden, num_experts=cfg.experts,
                              max_tokens_per_rank=tokens, dtype=dtype, max_topk=cfg.topk,
                              ranks_per_node=N, transport="nixl", hierarchical=hier,
                              staging_bytes=budget)
        rounds = buf.rounds
        res = buf.dispatch(xs[rank], idxs[rank], ws[rank])
        y = res.x
        combined = buf.combine(y, res.handle, weights=res.weights)
        per_peer = buf.internode_bytes()
        proxy_s = buf.proxy.transfer_seconds
        stats = buf.stats()
        buf.close()
        ref = reference.dispatch_all(xs, idxs, ws, num_experts=cfg.experts)
        ref_out = reference.combine_all([r.x for r in ref], [r.handle for r in ref],
                                        [r.weights for r in ref],
                                        hierarchical_nodes=N if hier else None)
        sent = [a + b for a, b in zip(per_peer["dispatch"], per_peer["combine"])]
        out[hier] = {
            "bytes": stats["internode_dispatch_bytes"] + stats["internode_combine_bytes"],
            "proxy_s": proxy_s, "bare_s": bare.seconds(sent), "rounds": rounds,
            "ok": bool(torch.equal(res.x, ref[rank].x) and torch.equal(combined,
                                                                      ref_out[rank]))}
    node = rank // N
    other_nodes = sum(len({int(e) // (L * N) for e in row if e >= 0} - {node})
                      for row in idxs[rank].tolist())
    row = cfg.hidden * xs[0].element_size()
    out["min_bytes"] = 2 * other_nodes * row + other_nodes * 4 * (1 + 3 * cfg.topk + N)
    out["other_nodes"] = other_nodes
    return out


def model_rows_per_token(cfg, world_size: int, nodes: int, tokens: int) -> float:
    """The model's cross-node rows per token under uniform routing."""
    from moe_comm.perfmodel import predict

    N = world_size // nodes
    p = predict("h800", "normal", ep=world_size, tokens_per_rank=tokens, hidden=cfg.hidden,
                topk=cfg.topk, num_experts=cfg.experts, gpus_per_node=N, routing="uniform")
    per_node = cfg.experts // nodes
    own = 1 - math.comb(cfg.experts - per_node, cfg.topk) / math.comb(cfg.experts, cfg.topk)
    return p.nodes_per_token - own


def run(pool, world_size: int, configs, nodes: int, tokens: int, dtype,
        seed: int, ring_slots: int = 0) -> list[dict]:
    rows = []
    for cfg in configs:
        reps = pool.run(internode_job, cfg, nodes, tokens, dtype, seed, ring_slots)
        min_mb = sum(r["min_bytes"] for r in reps) / 1e6
        crossing = sum(r["other_nodes"] for r in reps) / (tokens * world_size)
        for hier in (False, True):
            proxy = sum(r[hier]["proxy_s"] for r in reps)
            bare = sum(r[hier]["bare_s"] for r in reps)
            xnode = sum(r[hier]["bytes"] for r in reps) / 1e6
            rows.append({"config": cfg.name, "mode": "hier" if hier else "flat",
                         "rounds": reps[0][hier]["rounds"],
                         "xnode_MB": xnode, "min_MB": min_mb,
                         "rows_per_token": (crossing if hier else float("nan")),
                         "model_rows_per_token": model_rows_per_token(cfg, world_size, nodes,
                                                                      tokens),
                         "proxy_over_bare": proxy / bare if bare else float("nan"),
                         "matches_reference": all(r[hier]["ok"] for r in reps)})
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'config':<18}{'mode':<6}{'rounds':>7}{'x-node MB':>10}{'min MB':>9}"
             f"{'rows/tok':>10}{'model':>8}{'proxy/bare':>12}{'ref':>5}"]
    for r in rows:
        measured = "" if math.isnan(r["rows_per_token"]) else f"{r['rows_per_token']:.3f}"
        lines.append(f"{r['config']:<18}{r['mode']:<6}{r['rounds']:>7}{r['xnode_MB']:>10.3f}"
                     f"{r['min_MB']:>9.3f}"
                     f"{measured:>10}{r['model_rows_per_token']:>8.3f}"
                     f"{r['proxy_over_bare']:>12.2f}{'ok' if r['matches_reference'] else 'NO':>5}")
    return "\n".join(lines)
