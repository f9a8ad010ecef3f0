"""Per-rank traffic of one dispatch: the load of the mean rank and of the most loaded rank.

The slowest rank sets the time of a collective call, so the cost model needs, for every kind
of traffic, the expected load of the most loaded rank. Loads are counted in rows (one token to
one destination) or pairs (one token to one expert) and turned into bytes by the model.

| class            | unit  | one rank counts                                                  |
|------------------|-------|------------------------------------------------------------------|
| ll_send_self     | pairs | its tokens' picks of its own experts                             |
| ll_send_nvl      | pairs | its tokens' picks of experts on the other ranks of its node      |
| ll_send_rdma     | pairs | its tokens' picks of experts on other nodes                      |
| ll_recv_nvl      | pairs | picks of its experts by tokens of the other ranks of its node    |
| ll_recv_rdma     | pairs | picks of its experts by tokens of other nodes                    |
| rank_send_self   | rows  | its tokens that pick at least one of its own experts             |
| rank_send_nvl    | rows  | (token, other rank of its node) with >= 1 pick there             |
| rank_recv_nvl    | rows  | (token of another rank of its node, itself) with >= 1 pick       |
| rank_send_rdma   | rows  | (its token, rank of another node) with >= 1 pick there (flat)    |
| rank_recv_rdma   | rows  | (token of a rank of another node, itself) with >= 1 pick (flat)  |
| node_send_rdma   | rows  | (its token, other node) with >= 1 pick there                     |
| node_recv_rdma   | rows  | same, received as the rail peer (same local index) of the sender |
| fwd_send_nvl     | rows  | rows it forwards over NVLink: tokens arriving from its rail      |
|                  |       | peers (and itself) to each other rank of its node they pick      |
| fwd_recv_nvl     | rows  | forwarded rows it receives from the other ranks of its node      |

A "node" is the NVLink domain used by the algorithm (gpus_per_node GPUs). Expected maxima:

* uniform routing: exact per-token pmfs (routing.designated_pmf), the pmf of a rank's load as
  an n-fold convolution (FFT on a window around the mean), and E[max of ep i.i.d. loads] from
  its CDF. Ranks are treated as independent (they are weakly negatively correlated, so this
  errs slightly high). Cost does not depend on ep.
* group_limited routing: the same, with per-token pmfs pooled from a seeded Monte Carlo sample
  (all ranks are equivalent under that routing).
* zipf routing and a sample routing tensor: ranks differ, so each rank's load is a normal law
  with its own mean (from per-expert inclusion probabilities) and variance, and the maximum
  is averaged over seeded Monte Carlo draws of all ep ranks: O(ep) work.
* a global routing tensor ([ep*T, k]): loads counted exactly; max is the real slowest rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .routing import (
    RoutingSpec,
    blocks_reached_pmf,
    expected_fanout,
    inclusion_probabilities,
    picks_in_block_pmf,
    prob_block_untouched,
    sample_group_limited,
    sample_weighted_distinct,
    zipf_weights,
)

LL_CLASSES = ("ll_send_self", "ll_send_nvl", "ll_send_rdma", "ll_recv_nvl", "ll_recv_rdma")
INTRANODE_CLASSES = ("rank_send_self", "rank_send_nvl", "rank_recv_nvl")
INTERNODE_CLASSES = ("rank_send_self", "node_send_rdma", "node_recv_rdma", "fwd_send_nvl",
                     "fwd_recv_nvl")
FLAT_CLASSES = ("rank_send_self", "rank_send_nvl", "rank_recv_nvl", "rank_send_rdma",
                "rank_recv_rdma")
MC_REPLICAS = 16  # Monte Carlo draws of all ranks' loads for the heterogeneous maximum


@dataclass(frozen=True)
class Layout:
    """Ranks and experts: ep ranks, gpn per node (NVLink domain), m experts per rank."""

    ep: int
    gpn: int
    m: int

    @property
    def nodes(self) -> int:
        return self.ep // self.gpn

    @property
    def num_experts(self) -> int:
        return self.ep * self.m


@dataclass(frozen=True)
class LoadStat:
    """One traffic class: mean over ranks and expected load of the most loaded rank."""

    mean: float
    max: float


@dataclass(frozen=True)
class Loads:
    """Loads of every requested class, plus per-token means for the bandwidth conventions."""

    stats: dict = field(default_factory=dict)   # class name -> LoadStat
    pairs_per_token: float = 0.0   # valid (token, expert) pairs per token
    ranks_per_token: float = 0.0   # distinct destination ranks per token, own rank included
    nodes_per_token: float = 0.0   # distinct destination nodes per token, own node included
    method: str = ""               # "closed form", "simulated (N tokens)", "counted"

    def __getitem__(self, name: str) -> LoadStat:
        return self.stats[name]


def compute_loads(layout: Layout, T: int, k: int, spec: RoutingSpec, classes,
                  rng: np.random.Generator, sim_tokens: int) -> Loads:
    """Loads for `classes` (names from the table above) of T tokens per rank."""
    classes = tuple(dict.fromkeys(classes))
    if spec.kind == "uniform":
        return _iid_loads(layout, T, _uniform_pmfs(layout, k), classes, "closed form",
                          _uniform_means(layout, k))
    if spec.kind == "balanced":
        return _balanced_loads(layout, T, k, classes)
    if spec.kind == "group_limited":
        E = layout.num_experts
        cost = 2 * spec.groups + spec.topk_groups * min(k, E // spec.groups)
        budget = max(256, min(sim_tokens, (1 << 24) // cost))
        ids = sample_group_limited(rng, budget, E, k, spec.groups, spec.topk_groups)
        pmfs, means = _pooled_pmfs(layout, ids, k)
        return _iid_loads(layout, T, pmfs, classes, f"simulated ({budget} tokens)", means)
    if spec.kind == "zipf":
        weights = zipf_weights(layout.num_experts, spec.alpha, rng)
        pi = inclusion_probabilities(weights, k)
        n = max(256, min(sim_tokens, (1 << 22) // k))
        ids = sample_weighted_distinct(rng, n, weights, k)
        return _hetero_loads(layout, T, pi, None, None, ids, classes, rng,
                             f"simulated ({n} tokens)")
    given = spec.expert_ids
    assert given is not None, "a tensor routing spec carries its expert ids"
    if given.shape[0] == layout.ep * T:
        return _counted_loads(layout, T, given, classes)
    return _tensor_sample_loads(layout, T, given, classes, rng)


# ----------------------------------------------------------------------------------------
# i.i.d. ranks: per-token pmf -> pmf of a sum -> expected maximum over ep ranks
# ----------------------------------------------------------------------------------------
def sum_and_max(pmf: np.ndarray, n: int, ranks: int) -> LoadStat:
    """Mean of the sum of n i.i.d. draws of `pmf` (support 0..K) and the expected maximum of
    `ranks` independent such sums. Exact up to the window, which spans the mean +- 16 sd."""
    pmf = np.asarray(pmf, dtype=np.float64)
    K = pmf.size - 1
    support = np.arange(K + 1)
    mu1 = float(support @ pmf)
    var1 = max(float((support ** 2) @ pmf) - mu1 * mu1, 0.0)
    mean = n * mu1
    if n == 0:
        return LoadStat(0.0, 0.0)
    if var1 <= 1e-15 or ranks <= 1:
        return LoadStat(mean, mean)
    sd = (n * var1) ** 0.5
    full = n * K + 1
    half = 16.0 * sd + 2 * K + 8
    lo = 0 if full <= 4 * half + 64 else max(0, int(mean - half))
    hi = full - 1 if full <= 4 * half + 64 else min(full - 1, int(mean + half) + 1)
    L = 1 << int(np.ceil(np.log2(max(hi - lo + 1, K + 1, 2))))
    phi = np.fft.fft(pmf, L)
    shift = np.exp(2j * np.pi * np.arange(L) * (lo % L) / L)
    dist = np.fft.ifft(np.power(phi, n) * shift).real[: hi - lo + 1]
    dist = np.clip(dist, 0.0, None)
    dist /= dist.sum()
    tail = np.cumsum(dist[::-1])[::-1]          # tail[i] = P(X >= lo + i)
    survival = np.append(tail[1:], 0.0)         # P(X > lo + i)
    # E[max] = sum_{x>=0} P(max > x) = lo + sum_{x=lo}^{hi} (1 - F(x)^ranks)
    cdf_pow = np.exp(ranks * np.log1p(-np.minimum(survival, 1.0 - 2.0 ** -52)))
    return LoadStat(mean, lo + float(np.sum(1.0 - cdf_pow)))


def _bern(q: float) -> np.ndarray:
    return np.array([1.0 - q, q])


def _terms(layout: Layout, T: int) -> dict:
    """How many independent source tokens add up into one rank's load, per class."""
    ep, gpn, nodes = layout.ep, layout.gpn, layout.nodes
    return {"ll_send_self": T, "ll_send_nvl": T, "ll_send_rdma": T,
            "ll_recv_nvl": (gpn - 1) * T, "ll_recv_rdma": (ep - gpn) * T,
            "rank_send_self": T, "rank_send_nvl": T, "rank_recv_nvl": (gpn - 1) * T,
            "rank_send_rdma": T, "rank_recv_rdma": (ep - gpn) * T,
            "node_send_rdma": T, "node_recv_rdma": (nodes - 1) * T,
            "fwd_send_nvl": nodes * T, "fwd_recv_nvl": (gpn - 1) * nodes * T}


def _uniform_means(layout: Layout, k: int) -> tuple:
    E = layout.num_experts
    return float(k), expected_fanout(E, k, layout.ep), expected_fanout(E, k, layout.nodes)


def _uniform_pmfs(layout: Layout, k: int) -> dict:
    """Exact per-source-token pmfs of every class under uniform top-k routing."""
    E, m, gpn, nodes = layout.num_experts, layout.m, layout.gpn, layout.nodes
    q_rank = 1.0 - prob_block_untouched(E, k, m)
    q_node = 1.0 - prob_block_untouched(E, k, gpn * m)
    own = picks_in_block_pmf(E, k, m)
    return {"ll_send_self": own,
            "ll_send_nvl": picks_in_block_pmf(E, k, (gpn - 1) * m),
            "ll_send_rdma": picks_in_block_pmf(E, k, E - gpn * m),
            "ll_recv_nvl": own, "ll_recv_rdma": own,
            "rank_send_self": _bern(q_rank),
            "rank_send_nvl": blocks_reached_pmf(E, k, gpn - 1, m),
            "rank_recv_nvl": _bern(q_rank),
            "rank_send_rdma": blocks_reached_pmf(E, k, E // m - gpn, m),
            "rank_recv_rdma": _bern(q_rank),
            "node_send_rdma": blocks_reached_pmf(E, k, nodes - 1, gpn * m),
            "node_recv_rdma": _bern(q_node),
            "fwd_send_nvl": blocks_reached_pmf(E, k, gpn - 1, m),
            "fwd_recv_nvl": _bern(q_rank)}


def _scaled(pmf: np.ndarray, c: int) -> np.ndarray:
    """pmf of c * X for X ~ pmf (support 0..K -> 0..cK)."""
    out = np.zeros((pmf.size - 1) * c + 1)
    out[::c] = pmf
    return out


def _balanced_loads(layout: Layout, T: int, k: int, classes) -> Loads:
    """"balanced": r = min(k, ep) distinct ranks uniformly, k / r experts on each. Rank-level
    classes are those of uniform routing with one expert per rank and r picks; pair classes
    scale by k / r."""
    ep = layout.ep
    r = min(k, ep)
    if k % r or k // r > layout.m:
        raise ValueError(f"balanced routing needs topk={k} to be a multiple of min(topk, ep)="
                         f"{r} and at most {layout.m} experts per rank")
    ranks = Layout(ep=ep, gpn=layout.gpn, m=1)
    pmfs = _uniform_pmfs(ranks, r)
    for c in LL_CLASSES:
        pmfs[c] = _scaled(pmfs[c], k // r)
    return _iid_loads(layout, T, pmfs, classes, "closed form",
                      (float(k), float(r), expected_fanout(ep, r, layout.nodes)))


def _iid_loads(layout, T, pmfs, classes, method, means) -> Loads:
    terms = _terms(layout, T)
    stats = {c: sum_and_max(pmfs[c], terms[c], layout.ep) for c in classes}
    pairs, ranks, nodes = means
    return Loads(stats, pairs, ranks, nodes, method)


# ----------------------------------------------------------------------------------------
# Samples of routed tokens
# ----------------------------------------------------------------------------------------
def _unique_rows(ids: np.ndarray, div: int):
    """Distinct (token, ids // div) pairs of an [S, k] id array: (token index, value, count)."""
    vals = np.where(ids >= 0, ids // div, -1)
    srt = np.sort(vals, axis=1)
    S, k = srt.shape
    tok = np.repeat(np.arange(S), k)
    flat = srt.ravel()
    keep = flat >= 0
    tok, flat = tok[keep], flat[keep]
    width = int(flat.max()) + 1 if flat.size else 1
    key, count = np.unique(tok * width + flat, return_counts=True)
    return key // width, key % width, count


def _sender_positions(layout: Layout) -> np.ndarray:
    """Up to 8 sender ranks spread over the job (distinct nodes where possible)."""
    return np.unique(np.linspace(0, layout.ep - 1, min(layout.ep, 8)).round().astype(np.int64))


def _sender_counts(layout: Layout, ids: np.ndarray) -> list:
    """Per-token counts of the sender classes, one {class: [S] array} per sender position."""
    m, gpn = layout.m, layout.gpn
    S = ids.shape[0]
    rank = np.where(ids >= 0, ids // m, -1)
    node = np.where(rank >= 0, rank // gpn, -1)
    tok_r, r, _ = _unique_rows(ids, m)
    tok_n, n, _ = _unique_rows(ids, m * gpn)
    out = []
    for g in _sender_positions(layout):
        home = g // gpn
        in_node = (r // gpn == home) & (r != g)
        out.append({"ll_send_self": (rank == g).sum(axis=1),
                    "ll_send_nvl": ((node == home) & (rank != g)).sum(axis=1),
                    "ll_send_rdma": ((rank >= 0) & (node != home)).sum(axis=1),
                    "rank_send_self": (rank == g).any(axis=1).astype(np.int64),
                    "rank_send_nvl": np.bincount(tok_r[in_node], minlength=S),
                    "rank_send_rdma": np.bincount(tok_r[r // gpn != home], minlength=S),
                    "node_send_rdma": np.bincount(tok_n[n != home], minlength=S)})
    return out


def _pooled_pmfs(layout: Layout, ids: np.ndarray, k: int):
    """Per-token pmfs of every class from a sample, pooled over ranks (symmetric routing)."""
    ep, gpn, m, nodes = layout.ep, layout.gpn, layout.m, layout.nodes
    S = ids.shape[0]
    tok_r, r, cnt = _unique_rows(ids, m)
    tok_n, _, _ = _unique_rows(ids, m * gpn)
    q_rank = tok_r.size / (S * ep)
    q_node = tok_n.size / (S * nodes)
    recv_pairs = np.bincount(cnt, minlength=k + 1).astype(np.float64)
    recv_pairs[0] += S * ep - tok_r.size
    # ranks reached per (token, node); a forwarder g of that node forwards to d - [g reached]
    key, d = np.unique(tok_r * nodes + r // gpn, return_counts=True)
    fwd = np.zeros(min(k, gpn) + 1)
    np.add.at(fwd, d - 1, d.astype(np.float64))
    np.add.at(fwd, d, (gpn - d).astype(np.float64))
    fwd[0] += (S * nodes - key.size) * gpn
    pmfs = {"ll_recv_nvl": recv_pairs / recv_pairs.sum(),
            "ll_recv_rdma": recv_pairs / recv_pairs.sum(),
            "rank_recv_nvl": _bern(q_rank), "node_recv_rdma": _bern(q_node),
            "rank_recv_rdma": _bern(q_rank),
            "fwd_recv_nvl": _bern(q_rank), "fwd_send_nvl": fwd / fwd.sum()}
    per_sender = _sender_counts(layout, ids)
    for c in per_sender[0]:
        counts = np.concatenate([p[c] for p in per_sender])
        pmfs[c] = np.bincount(counts, minlength=k + 1) / counts.size
    pairs = float((ids >= 0).sum()) / S
    return pmfs, (pairs, q_rank * ep, q_node * nodes)


# ----------------------------------------------------------------------------------------
# Heterogeneous ranks: per-rank normal laws, maximum by seeded Monte Carlo
# ----------------------------------------------------------------------------------------
def _mc_max(mean: np.ndarray, var: np.ndarray, rng: np.random.Generator) -> LoadStat:
    sd = np.sqrt(np.clip(var, 0.0, None))
    best = 0.0
    for _ in range(MC_REPLICAS):
        best += float(np.max(np.clip(mean + sd * rng.standard_normal(mean.size), 0.0, None)))
    return LoadStat(float(mean.mean()), max(best / MC_REPLICAS, float(mean.max())))


def _reach_probabilities(pi: np.ndarray, blocks: int, target: float) -> np.ndarray:
    """P(a token reaches each of `blocks` contiguous expert blocks), from per-expert inclusion
    probabilities pi. Independent inclusions would give 1 - exp(-L_b) with
    L_b = -sum_b log(1 - pi_e); picks of one token are negatively correlated (exactly k of
    them), which makes that too small, so L is scaled by the one factor c that makes
    sum_b (1 - exp(-c L_b)) equal `target`, the blocks per token seen in a Monte Carlo sample.
    """
    L = -np.log1p(-np.clip(pi, 0.0, 1.0 - 1e-12)).reshape(blocks, -1).sum(axis=1)
    if target >= blocks * (1 - 1e-12):
        return np.ones(blocks)
    lo, hi = 0.0, 1.0
    while np.sum(-np.expm1(-hi * L)) < target and hi < 1e12:
        hi *= 2.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if np.sum(-np.expm1(-mid * L)) < target else (lo, mid)
    return -np.expm1(-0.5 * (lo + hi) * L)


def _hetero_loads(layout, T, pi, q_rank, q_node, ids, classes, rng, method) -> Loads:
    """pi: [E] P(expert picked by a token); q_rank [ep] / q_node [nodes]: P(token reaches it),
    derived from pi and the sample when None; ids: a token sample, for the per-token variances
    of the sender classes and the mean number of ranks and nodes a token reaches."""
    ep, gpn, m, nodes = layout.ep, layout.gpn, layout.m, layout.nodes
    by_rank = pi.reshape(ep, m)
    S = ids.shape[0]
    if q_rank is None:
        q_rank = _reach_probabilities(pi, ep, _unique_rows(ids, m)[0].size / S)
    if q_node is None:
        q_node = _reach_probabilities(pi, nodes, _unique_rows(ids, m * gpn)[0].size / S)
    pi_r = by_rank.sum(axis=1)
    vp_r = (by_rank * (1.0 - by_rank)).sum(axis=1)
    home = np.arange(ep) // gpn
    pi_node = pi_r.reshape(nodes, gpn).sum(axis=1)[home]
    q_in_node = q_rank.reshape(nodes, gpn).sum(axis=1)[home]
    vq_in_node = (q_rank * (1 - q_rank)).reshape(nodes, gpn).sum(axis=1)[home]
    k_eff = float(pi.sum())
    per_sender = _sender_counts(layout, ids)
    svar = {c: float(np.mean([p[c].var() for p in per_sender])) for c in per_sender[0]}
    n = _terms(layout, T)
    qq = q_rank * (1 - q_rank)
    law = {  # class -> (mean per source token [ep], variance per source token [ep])
        "ll_send_self": (pi_r, vp_r),
        "ll_send_nvl": (pi_node - pi_r, np.full(ep, svar["ll_send_nvl"])),
        "ll_send_rdma": (k_eff - pi_node, np.full(ep, svar["ll_send_rdma"])),
        "ll_recv_nvl": (pi_r, vp_r), "ll_recv_rdma": (pi_r, vp_r),
        "rank_send_self": (q_rank, qq),
        "rank_send_nvl": (q_in_node - q_rank, np.full(ep, svar["rank_send_nvl"])),
        "rank_recv_nvl": (q_rank, qq),
        "rank_send_rdma": (q_rank.sum() - q_in_node, np.full(ep, svar["rank_send_rdma"])),
        "rank_recv_rdma": (q_rank, qq),
        "node_send_rdma": (q_node.sum() - q_node[home], np.full(ep, svar["node_send_rdma"])),
        "node_recv_rdma": (q_node[home], q_node[home] * (1 - q_node[home])),
        "fwd_send_nvl": (q_in_node - q_rank, vq_in_node - qq),
        "fwd_recv_nvl": (q_rank, qq)}
    stats = {}
    for c in classes:
        mu, var = law[c]
        stats[c] = _mc_max(n[c] * np.clip(mu, 0.0, None), n[c] * var, rng) if n[c] else \
            LoadStat(0.0, 0.0)
    return Loads(stats, k_eff, float(q_rank.sum()), float(q_node.sum()), method)


def _tensor_sample_loads(layout, T, ids, classes, rng) -> Loads:
    """Every rank draws its T tokens from the rows of `ids`: exact empirical probabilities."""
    ep, m, gpn, nodes = layout.ep, layout.m, layout.gpn, layout.nodes
    S = ids.shape[0]
    valid = ids[ids >= 0]
    pi = np.bincount(valid, minlength=ep * m) / S
    _tok_r, r, _ = _unique_rows(ids, m)
    _tok_n, n, _ = _unique_rows(ids, m * gpn)
    q_rank = np.bincount(r, minlength=ep) / S
    q_node = np.bincount(n, minlength=nodes) / S
    return _hetero_loads(layout, T, pi, q_rank, q_node, ids, classes, rng,
                         f"sampled from {S} routing rows")


# ----------------------------------------------------------------------------------------
# A global routing tensor: count every rank's load exactly
# ----------------------------------------------------------------------------------------
def _counted_loads(layout: Layout, T: int, ids: np.ndarray, classes) -> Loads:
    ep, m, gpn = layout.ep, layout.m, layout.gpn
    src = np.repeat(np.arange(ep), T)
    src_node = src // gpn
    rank = np.where(ids >= 0, ids // m, -1)
    node = np.where(rank >= 0, rank // gpn, -1)
    valid = rank >= 0
    self_pair = valid & (rank == src[:, None])
    nvl_pair = valid & (node == src_node[:, None]) & ~self_pair
    rdma_pair = valid & (node != src_node[:, None])
    tok_r, dst, _ = _unique_rows(ids, m)
    tok_n, dnode, _ = _unique_rows(ids, m * gpn)
    s_r, s_n = src[tok_r], src[tok_n]
    same_node = (dst // gpn == s_r // gpn) & (dst != s_r)
    fwd_r = (dst // gpn) * gpn + s_r % gpn       # rail peer of the sender in dst's node
    remote_n = dnode != s_n // gpn
    per_rank = {
        "ll_send_self": np.bincount(src, weights=self_pair.sum(1), minlength=ep),
        "ll_send_nvl": np.bincount(src, weights=nvl_pair.sum(1), minlength=ep),
        "ll_send_rdma": np.bincount(src, weights=rdma_pair.sum(1), minlength=ep),
        "ll_recv_nvl": np.bincount(rank[nvl_pair], minlength=ep),
        "ll_recv_rdma": np.bincount(rank[rdma_pair], minlength=ep),
        "rank_send_self": np.bincount(s_r[dst == s_r], minlength=ep),
        "rank_send_nvl": np.bincount(s_r[same_node], minlength=ep),
        "rank_recv_nvl": np.bincount(dst[same_node], minlength=ep),
        "rank_send_rdma": np.bincount(s_r[dst // gpn != s_r // gpn], minlength=ep),
        "rank_recv_rdma": np.bincount(dst[dst // gpn != s_r // gpn], minlength=ep),
        "node_send_rdma": np.bincount(s_n[remote_n], minlength=ep),
        "node_recv_rdma": np.bincount((dnode * gpn + s_n % gpn)[remote_n], minlength=ep),
        "fwd_send_nvl": np.bincount(fwd_r[dst != fwd_r], minlength=ep),
        "fwd_recv_nvl": np.bincount(dst[dst != fwd_r], minlength=ep)}
    stats = {c: LoadStat(float(per_rank[c].mean()), float(per_rank[c].max())) for c in classes}
    N = ids.shape[0]
    return Loads(stats, float(valid.sum()) / N, tok_r.size / N, tok_n.size / N, "counted")
