"""Routing distributions: closed forms for uniform top-k, samplers for the skewed ones.

A token picks `k` distinct experts out of `E`. Experts are laid out contiguously: rank r holds
experts [r*m, (r+1)*m) with m = E / ep, and node n holds ranks [n*gpn, (n+1)*gpn). Everything
the cost model needs about routing is how many (token, expert) pairs, distinct ranks and
distinct nodes a token reaches, seen from a sender and from a receiver.

Routing specs (the `routing=` argument of `predict`):

| spec                          | meaning                                                     |
|-------------------------------|-------------------------------------------------------------|
| "uniform"                     | k distinct experts, uniformly at random (closed forms)      |
| "balanced"                    | a "perfect router": min(k, ep) distinct ranks uniformly at  |
|                               | random, k / min(k, ep) experts on each (closed forms)       |
| "zipf:<alpha>"                | expert popularity ~ 1/rank^alpha over a seeded random       |
|                               | placement; k distinct picks by successive sampling          |
| "group_limited:<g>:<tg>"      | DeepSeek-V3 node-limited gating: E experts in g contiguous  |
|                               | groups, each token keeps the tg groups whose two best       |
|                               | scores sum highest, then its top-k experts inside them;     |
|                               | scores i.i.d. uniform                                       |
| array/tensor [N, k] of ids    | explicit expert ids (-1 = no expert); N == ep*T means rank  |
|                               | r owns rows [r*T, (r+1)*T), any other N is a sample every   |
|                               | rank draws its tokens from                                  |
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

ROUTING_KINDS = ("uniform", "balanced", "zipf", "group_limited", "tensor")


@dataclass(frozen=True, eq=False)
class RoutingSpec:
    """A parsed routing argument. `expert_ids` is set only for kind == "tensor"."""

    kind: str
    alpha: float = 0.0
    groups: int = 0
    topk_groups: int = 0
    expert_ids: np.ndarray | None = None  # [N, k] int64, -1 = no expert

    def label(self) -> str:
        """Short text for tables: "uniform", "zipf:1.2", "group_limited:8:4", "tensor[N,k]"."""
        if self.kind == "zipf":
            return f"zipf:{self.alpha:g}"
        if self.kind == "group_limited":
            return f"group_limited:{self.groups}:{self.topk_groups}"
        if self.kind == "tensor" and self.expert_ids is not None:
            return f"tensor[{self.expert_ids.shape[0]},{self.expert_ids.shape[1]}]"
        return self.kind


def parse_routing(routing, num_experts: int, topk: int) -> RoutingSpec:
    """Validate a routing argument (string, numpy array or torch tensor) into a RoutingSpec."""
    if isinstance(routing, RoutingSpec):
        return routing
    if isinstance(routing, str):
        return _parse_routing_string(routing.strip(), num_experts, topk)
    if hasattr(routing, "detach"):  # a torch tensor; torch itself is never imported here
        routing = routing.detach().cpu().numpy()
    if isinstance(routing, (np.ndarray, list, tuple)):
        ids = np.asarray(routing)
        if ids.ndim != 2 or ids.shape[1] != topk or ids.shape[0] == 0:
            raise ValueError(f"routing tensor must have shape [tokens, topk={topk}] with at "
                             f"least one row, got {tuple(ids.shape)}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"routing tensor must hold integer expert ids, got {ids.dtype}")
        ids = ids.astype(np.int64)
        if ids.max() >= num_experts or ids.min() < -1:
            raise ValueError(f"routing tensor ids must be in [-1, {num_experts - 1}] "
                             f"(-1 = no expert), got range [{ids.min()}, {ids.max()}]")
        valid = np.sort(np.where(ids >= 0, ids, -1 - np.arange(topk)), axis=1)
        if (valid[:, 1:] == valid[:, :-1]).any():
            raise ValueError("routing tensor has a row that names the same expert twice")
        return RoutingSpec("tensor", expert_ids=ids)
    raise TypeError(f"routing must be a string, a numpy array or a torch tensor, "
                    f"got {type(routing).__name__}")


def _parse_routing_string(text: str, E: int, k: int) -> RoutingSpec:
    parts = text.split(":")
    kind = parts[0].lower()
    usage = ('routing strings are "uniform", "balanced", "zipf:<alpha>" (alpha >= 0) or '
             '"group_limited:<groups>:<topk_groups>"')
    try:
        if kind in ("uniform", "balanced") and len(parts) == 1:
            return RoutingSpec(kind)
        if kind == "zipf" and len(parts) == 2:
            alpha = float(parts[1])
            if not (alpha >= 0 and math.isfinite(alpha)):
                raise ValueError
            return RoutingSpec("zipf", alpha=alpha)
        if kind == "group_limited" and len(parts) == 3:
            groups, tg = int(parts[1]), int(parts[2])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"bad routing {text!r}: {usage}") from None
    if groups < 1 or E % groups:
        raise ValueError(f"group_limited: {groups} groups must divide num_experts={E}")
    if not 1 <= tg <= groups:
        raise ValueError(f"group_limited: topk_groups={tg} must be in [1, groups={groups}]")
    if k > tg * (E // groups):
        raise ValueError(f"group_limited: topk={k} exceeds the {tg * (E // groups)} experts "
                         f"of {tg} groups of {E // groups}")
    return RoutingSpec("group_limited", groups=groups, topk_groups=tg)


# ----------------------------------------------------------------------------------------
# Closed forms for uniform top-k routing
# ----------------------------------------------------------------------------------------
def prob_block_untouched(E: int, k: int, size: int) -> float:
    """P(a token's k uniform distinct picks out of E miss a given block of `size` experts).

    Equals C(E - size, k) / C(E, k), computed as prod_{i<k} (1 - size / (E - i)) in log space
    so that it stays exact for E in the millions.
    """
    if size <= 0:
        return 1.0
    if E - size < k:
        return 0.0
    i = np.arange(k, dtype=np.float64)
    return float(np.exp(np.sum(np.log1p(-size / (E - i)))))


def expected_fanout(E: int, k: int, groups: int) -> float:
    """Expected distinct groups a token reaches: G * (1 - C(E - E/G, k) / C(E, k)).

    With groups = ep this is destination ranks per token, with groups = nodes destination
    nodes per token (both counting the sender's own rank or node).
    """
    if E % groups:
        raise ValueError(f"num_experts={E} must be divisible by groups={groups}")
    return groups * (1.0 - prob_block_untouched(E, k, E // groups))


@lru_cache(maxsize=4096)
def designated_pmf(E: int, k: int, J: int, g: int) -> np.ndarray:
    """Joint pmf P[j, s] for k uniform distinct picks out of E experts, where J designated
    blocks of g experts each are singled out: j = designated blocks reached, s = picks that
    land inside designated blocks. Returns a read-only [k+1, k+1] float64 array.

    Exact Markov chain over the picks: after t picks with state (j, s), the next pick lands in
    an already reached designated block with prob (j*g - s)/(E - t), in a new designated block
    with (J - j)*g/(E - t), elsewhere with (E - J*g - (t - s))/(E - t).
    """
    if not (0 <= J * g <= E and 0 <= k <= E):
        raise ValueError(f"designated_pmf: bad sizes E={E} k={k} J={J} g={g}")
    P = np.zeros((k + 1, k + 1))
    P[0, 0] = 1.0
    j = np.arange(k + 1)[:, None].astype(np.float64)
    s = np.arange(k + 1)[None, :].astype(np.float64)
    for t in range(k):
        left = E - t
        p_old = np.clip(j * g - s, 0, None) / left
        p_new = np.clip((J - j) * g, 0, None) / left
        p_out = np.clip(E - J * g - (t - s), 0, None) / left
        nxt = P * p_out
        nxt[:, 1:] += (P * p_old)[:, :-1]
        nxt[1:, 1:] += (P * p_new)[:-1, :-1]
        P = nxt
    P.setflags(write=False)
    return P


def picks_in_block_pmf(E: int, k: int, size: int) -> np.ndarray:
    """pmf of how many of k uniform picks land in a block of `size` experts (hypergeometric)."""
    return np.asarray(designated_pmf(E, k, 1, size).sum(axis=0))


def blocks_reached_pmf(E: int, k: int, J: int, g: int) -> np.ndarray:
    """pmf of how many of J designated blocks (g experts each) a token's k picks reach."""
    return np.asarray(designated_pmf(E, k, J, g).sum(axis=1))


# ----------------------------------------------------------------------------------------
# Samplers (seeded numpy Generator in, [n, k] int64 expert ids out)
# ----------------------------------------------------------------------------------------
def zipf_weights(E: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """Popularity weights summing to 1: the expert at popularity rank i (0 = hottest) gets
    1/(i+1)^alpha; which expert id holds which rank is a seeded random permutation."""
    w_by_rank = 1.0 / np.arange(1, E + 1, dtype=np.float64) ** alpha
    w = np.empty(E)
    w[rng.permutation(E)] = w_by_rank
    return w / w.sum()


def sample_weighted_distinct(rng: np.random.Generator, n: int, weights: np.ndarray,
                             k: int) -> np.ndarray:
    """Successive sampling: k distinct experts per token, each pick proportional to weight
    among the experts not yet picked (the law of Gumbel top-k). Exact for any skew; cost
    O(n k^2 + n k log E), independent of how concentrated the weights are."""
    E = weights.size
    end = np.cumsum(weights)
    start = end - weights
    total = end[-1]
    out = np.full((n, k), -1, dtype=np.int64)
    taken_w = np.zeros(n)
    for step in range(k):
        todo = np.arange(n)
        for _ in range(8):  # re-draw the rare rows that rounding put on a taken expert
            u = rng.random(todo.size) * (total - taken_w[todo])
            x = u.copy()
            chosen = np.sort(out[todo, :step], axis=1)
            for c in range(step):  # map remaining-mass coordinate to the full axis
                e = chosen[:, c]
                x = np.where(start[e] <= x, x + weights[e], x)
            pick = np.minimum(np.searchsorted(end, x, side="right"), E - 1)
            clash = (out[todo, :step] == pick[:, None]).any(axis=1)
            good = ~clash
            out[todo[good], step] = pick[good]
            todo = todo[clash]
            if todo.size == 0:
                break
        for row in todo:  # pathological rounding: take the heaviest expert not yet picked
            free = np.setdiff1d(np.argsort(-weights)[: step + 1], out[row, :step])
            out[row, step] = free[0]
        taken_w += weights[out[:, step]]
    return out


def sample_distinct(rng: np.random.Generator, rows: int, n: int, r: int) -> np.ndarray:
    """[rows, r] distinct integers in [0, n) per row, in uniformly random order."""
    if r * r > n:  # duplicates would be frequent: rank random keys instead
        return np.argsort(rng.random((rows, n)), axis=1)[:, :r]
    out = rng.integers(0, n, size=(rows, r))
    while True:
        srt = np.sort(out, axis=1)
        bad = np.nonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))[0]
        if bad.size == 0:
            return out
        out[bad] = rng.integers(0, n, size=(bad.size, r))


def sample_group_limited(rng: np.random.Generator, n: int, E: int, k: int, groups: int,
                         topk_groups: int) -> np.ndarray:
    """DeepSeek-V3 node-limited gating with i.i.d. uniform scores.

    Only the best r = min(k, E/groups) scores of each group can matter, so they are drawn
    directly as order statistics (the largest of s uniforms is V^(1/s), the next is that times
    V'^(1/(s-1)), ...) and their positions inside the group are a random distinct draw: cost
    O(n * (2 * groups + topk_groups * k)) whatever the group size.
    """
    gs = E // groups
    r = min(k, gs)
    h = min(2, r)                  # the group score needs the two best scores of every group
    exps = 1.0 / (gs - np.arange(r, dtype=np.float64))
    best = np.cumprod(rng.random((n, groups, h)) ** exps[:h], axis=2)  # [n, groups, h]
    gscore = best.sum(axis=2)
    sel = np.argpartition(-gscore, topk_groups - 1, axis=1)[:, :topk_groups]  # [n, tg]
    top = np.take_along_axis(best, sel[:, :, None], axis=1)                  # [n, tg, h]
    if r > h:                      # continue the order statistics in the kept groups only
        more = np.cumprod(rng.random((n, topk_groups, r - h)) ** exps[h:], axis=2)
        top = np.concatenate([top, top[:, :, -1:] * more], axis=2)
    cand = top.reshape(n, topk_groups * r)
    pick = np.argpartition(-cand, k - 1, axis=1)[:, :k]                         # [n, k]
    slot, order = pick // r, pick % r
    group = np.take_along_axis(sel, slot, axis=1)
    pos = sample_distinct(rng, n * topk_groups, gs, r).reshape(n, topk_groups, r)
    within = pos[np.arange(n)[:, None], slot, order]
    return (group * gs + within).astype(np.int64)


# ----------------------------------------------------------------------------------------
# Inclusion probabilities for weighted top-k (used at scale for zipf)
# ----------------------------------------------------------------------------------------
def inclusion_probabilities(weights: np.ndarray, k: int) -> np.ndarray:
    """P(expert e is among a token's k picks) under successive sampling.

    Uses the Poisson approximation of successive sampling: pi_e = 1 - exp(-lam * w_e) with lam
    chosen so that sum(pi) = k (each expert's exponential clock rings before a common
    threshold). Exact for uniform weights in the large-E limit; the tests check it against
    Monte Carlo.
    """
    E = weights.size
    if k >= E:
        return np.ones(E)
    w = weights / weights.max()
    lo, hi = 0.0, 1.0
    while np.sum(-np.expm1(-hi * w)) < k and hi < 1e300:
        hi *= 2.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if np.sum(-np.expm1(-mid * w)) < k:
            lo = mid
        else:
            hi = mid
    return -np.expm1(-0.5 * (lo + hi) * w)
