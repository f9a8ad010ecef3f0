"""How the GPU checks compare with ``moe_comm.reference`` (tests/test_gpu.py, bench/gpu_bench.py).

* Byte for byte where a GPU computes exactly what the reference computes: dispatched rows, FP8
  codes and scales, counts, expert offsets, weights and source info (:func:`same_bytes`).
* Within one unit in the last place (ulp) where a GPU may fuse a multiply and an add: the
  weighted sums of combine (:func:`assert_within_one_ulp`). A fused multiply-add changes an fp32
  sum by a few fp32 ulps of its terms, which can move the final rounding to bf16/fp16 by one
  ulp. Two error terms come on top, passed as ``slack``:

  - the fp32 accumulation itself, ``K * 2**-21 * sum |w * y|`` per element (a fused and an
    unfused sum of K terms differ by at most about ``2 K 2**-24 sum |terms|``; 4x margin). It is
    below one ulp of the result unless the terms cancel, so it only matters near zero;
  - in normal mode, the partial sum per (token, expert rank) is rounded to the data type before
    it travels (as DeepEP does) and the home rank adds the partials: a partial one ulp off moves
    the result by one ulp *of the partial*, which is more than one ulp of the result where
    partials of opposite signs cancel (:func:`normal_combine_slack`).

Every helper works on CPU and CUDA tensors (``got`` is moved to ``want``'s device).
"""
from __future__ import annotations

import torch

from moe_comm import reference

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
MIN_NORMAL_EXPONENT = {torch.bfloat16: -126, torch.float16: -14}
FP32_SLACK_PER_TERM = 2.0 ** -21


# ------------------------------------------------------------------------------ primitives
def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a flat uint8 tensor (canonical strides first)."""
    t = t.detach()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def same_bytes(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """AssertionError unless ``got`` and ``want`` have the same dtype, shape and bytes (NaN
    payloads and the sign of zero included)."""
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} "
                             f"{tuple(want.shape)}")
    a, b = _raw(got.to(want.device)), _raw(want)
    if torch.equal(a, b):
        return
    size = max(1, want.element_size())
    differ = (a.view(-1, size) != b.view(-1, size)).any(1)
    count, first = int(differ.sum()), int(differ.nonzero()[0])
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), want.shape)) \
        if want.dim() else ()

    def element(t):
        return bytes(t.view(-1, size)[first].cpu().tolist()).hex()

    raise AssertionError(f"{what}: {count} of {want.numel()} elements differ; first at {where}: "
                         f"got 0x{element(a)}, want 0x{element(b)} (little-endian bytes)")


def zero_bytes(t: torch.Tensor, what: str = "") -> None:
    """AssertionError unless every byte of ``t`` is 0 (padding rows)."""
    if t.numel() and bool(_raw(t).any()):
        raise AssertionError(f"{what}: {int((_raw(t) != 0).sum())} nonzero bytes where padding "
                             "must be zero")


def ulp(t: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each element of the bf16/fp16 tensor ``t``, as float64:
    ``2**(floor(log2|t|) - mantissa bits)``, and the subnormal spacing (bf16 ``2**-133``, fp16
    ``2**-24``) for subnormals and zeros."""
    if t.dtype not in MANTISSA_BITS:
        raise TypeError(f"ulp is defined here for bf16 and fp16, got {t.dtype}")
    wide = t.detach().double()
    _, exponent = torch.frexp(wide)  # |t| = m * 2**exponent, m in [0.5, 1)
    low = MIN_NORMAL_EXPONENT[t.dtype]
    floor_log2 = torch.where(wide == 0, low, (exponent - 1).clamp(min=low))
    power = (floor_log2 - MANTISSA_BITS[t.dtype]).to(torch.int64)
    return ((power + 1023) << 52).view(torch.float64)  # 2**power, built from its bits


def assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor,
                          slack: torch.Tensor | None = None, what: str = "") -> None:
    """AssertionError unless ``|got - want| <= ulp(want) + slack`` elementwise (``slack``: a
    float64 error budget that broadcasts to ``want``, see the module docstring; None: 0). Both
    must be finite bf16 or fp16 tensors of one shape."""
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} "
                             f"{tuple(want.shape)}")
    got = got.detach().to(want.device)
    for name, t in (("got", got), ("want", want)):
        if not bool(torch.isfinite(t).all()):
            raise AssertionError(f"{what}: {name} has {int((~torch.isfinite(t)).sum())} "
                                 "non-finite values (the inputs are finite)")
    diff = (got.double() - want.double()).abs()
    tolerance = ulp(want)
    if slack is not None:
        tolerance = tolerance + slack.to(device=want.device, dtype=torch.float64)
    bad = diff > tolerance
    if not bool(bad.any()):
        return
    count = int(bad.sum())
    first = tuple(int(i) for i in bad.nonzero()[0])
    worst = float((diff / ulp(want))[bad].max())
    raise AssertionError(
        f"{what}: {count} of {want.numel()} elements differ by more than one ulp (+ slack); "
        f"first at {first}: got {float(got[first])}, want {float(want[first])}, tolerance "
        f"{float(tolerance[first]):.3g}; worst {worst:.1f} ulps")


# ------------------------------------------------------------------------------ normal mode
def check_normal_dispatch(got, want, what: str = "") -> None:
    """One rank's ``Buffer.dispatch`` result against ``reference.dispatch_all``'s entry: every
    field byte for byte; rows past the reference's (``max_recv_rows`` padding) must be zero,
    with source -1."""
    n, rows = want.x.shape[0], got.x.shape[0]
    same_bytes(got.tokens_per_expert, want.tokens_per_expert, f"{what} tokens_per_expert")
    same_bytes(got.expert_offsets, want.expert_offsets, f"{what} expert_offsets")
    if rows < n:
        raise AssertionError(f"{what}: {rows} rows returned, the reference received {n}")
    same_bytes(got.x[:n], want.x, f"{what} rows")
    zero_bytes(got.x[n:], f"{what} rows past the count")
    for name, label in (("x_scales", "FP8 scales"), ("weights", "weights")):  # optional fields
        g, w = getattr(got, name), getattr(want, name)
        if (g is None) != (w is None):
            raise AssertionError(f"{what}: {name} is {g is not None}, want {w is not None}")
        if w is not None:
            same_bytes(g[:n], w, f"{what} {label}")
            zero_bytes(g[n:], f"{what} {label} past the count")
    for name in ("src_rank", "src_token"):
        g = getattr(got, name)
        same_bytes(g[:n], getattr(want, name), f"{what} {name}")
        if rows > n and not bool((g[n:] == -1).all()):
            raise AssertionError(f"{what}: {name} past the count is not -1")


def normal_combine_slack(ys, handles, weights=None) -> list[torch.Tensor]:
    """Per home rank, the ``slack`` of :func:`assert_within_one_ulp` for ``combine_all(ys,
    handles, weights)`` (reference handles): two ulps of every partial the token's expert ranks
    sent (each rounded to the dtype, possibly the other way on a GPU), plus the fp32 budget
    ``K * 2**-21 * sum |w * y|``. float64 [T, H] on ``ys``' device."""
    R = len(ys)
    weights = weights if weights is not None else [None] * R
    K = max((rows.shape[1] for h in handles for rows in h.recv_rows), default=1)
    parts = [reference.partials(ys[d], weights[d], handles[d].recv_rows) for d in range(R)]
    sizes = reference.combine_all([y.abs() for y in ys], handles,
                                  [None if w is None else w.abs() for w in weights])
    out = []
    for s in range(R):
        h = handles[s]
        partial_ulps = torch.zeros((h.num_tokens, ys[s].shape[1]), dtype=torch.float64,
                                   device=ys[s].device)
        for d in range(R):
            partial_ulps.index_add_(0, h.send_tokens[d], ulp(parts[d][s]))
        out.append(2 * partial_ulps + K * FP32_SLACK_PER_TERM * sizes[s].double())
    return out


# ------------------------------------------------------------------------------ low latency
def check_ll_dispatch(got, want, what: str = "") -> None:
    """One rank's ``low_latency_dispatch`` receive against ``reference.low_latency_dispatch_all``
    's entry: counts, and per local expert the valid rows, FP8 scales, source info and top-k
    choice, byte for byte."""
    same_bytes(got.count, want.count, f"{what} count")
    for e, n in enumerate(want.count.tolist()):
        same_bytes(got.x[e, :n], want.x[e, :n], f"{what} expert {e} rows")
        if want.x_scales is not None:
            same_bytes(got.x_scales[e, :n], want.x_scales[e, :n], f"{what} expert {e} scales")
        same_bytes(got.src_info[e, :n], want.src_info[e, :n], f"{what} expert {e} src_info")
        same_bytes(got.handle.src_k[e, :n], want.src_k[e, :n], f"{what} expert {e} src_k")


def ll_combine_slack(ys, counts, topk_idxs, topk_weights=None) -> list[torch.Tensor]:
    """Per rank, the fp32 ``slack`` of :func:`assert_within_one_ulp` for
    ``low_latency_combine_all``: ``K * 2**-21 * (sum_k |w_tk|) * max |valid row|`` ([T, 1]
    float64; only rows below each expert's count are read, the others may hold anything)."""
    biggest = 0.0
    for y, count in zip(ys, counts):
        for e, n in enumerate(count.tolist()):
            if n:
                biggest = max(biggest, float(y[e, :n].abs().max()))
    out = []
    for r, idx in enumerate(topk_idxs):
        valid = idx >= 0
        if topk_weights is None:
            w_sum = valid.sum(1).double()
        else:
            w_sum = (topk_weights[r].abs().double() * valid).sum(1)
        out.append((idx.shape[1] * FP32_SLACK_PER_TERM * biggest * w_sum)[:, None])
    return out


# ------------------------------------------------------------------------------ buffers
def settle(buffers, what: str) -> None:
    """Waits for the device, then raises what the kernels recorded for any virtual rank: a
    timeout of a bounded wait (PeerTimeoutError) or a bad input. On a GPU both are written to
    pinned memory and would otherwise surface only at the next call."""
    if any(b.device.type == "cuda" for b in buffers):
        torch.cuda.synchronize()
    for b in buffers:
        b._check_usable(what)
        b._raise_input_errors(what)
