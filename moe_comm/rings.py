"""How many staging slots per source a Buffer's normal mode takes: what its budget pays for
and, where its rounds run as persistent launches, what one such launch can run a round of.

The budget (``staging_bytes``, ``workspace.ring_slots_for``) gives ``W`` slots per source and
parity; where ``W < max_tokens_per_rank`` every call runs in ``ceil(T / W)`` rounds
(``moe_comm.normal_mode``). On GPUs, with a process per rank, one node (or across hosts over
NVSHMEM) and waits in the kernels (fault tolerance too), a call's rounds run in one launch per op
(``kernels.dispatch_rounds``, ``kernels.combine_rounds``, ``kernels.invariant_rounds``) on
``num_sms`` programs, but only where a round's serial trips on them stay within the gate's
``MAX_TRIPS``; a larger ring launches per round (a send, a wait and an expand or reduce a
round). There the ring is cut to the largest one every format's one launch fits
(:func:`one_launch_ring_slots`): more rounds of fewer slots, the same bytes on the link but the
rounds' signal words, less memory, and launches per op within a call of one round's. At
DeepSeek-V3 sizes on 20 programs (H 7168, bf16, top-8, 4096 tokens per rank) the default
budget's rings of 2176 slots at EP 16 (2 rounds, a workspace of 1.87 GiB), 1088 at EP 32 (4
rounds, 1.87 GiB) and 544 at EP 64 (8 rounds, 1.87 GiB) become 640 (7 rounds, 0.55 GiB), 576 (8
rounds, 0.99 GiB) and 512 (8 rounds, 1.76 GiB); from EP 128 up the budget's rings already fit;
at EP 8 the budget stages the whole batch (one round), but with ``ep_invariant`` 2912 slots (2
rounds) become 656 (7 rounds, 0.42 GiB). Across hosts over NVSHMEM (nodes of 8), where a
send that quantizes runs in tiles of 4 tokens: EP 16's 1424 slots become 560, EP 32's 720
512. Equivalent Python::

    W = ring_slots_for(staging_bytes, R, T, H, K, dtype)          # the budget's
    if W < T and one_launch_sms is not None:                        # rounds in one launch
        W = max(w for w in range(16, W + 1, 16) if every format's one launch fits w) \
            if any fits at 16 else W
"""
from __future__ import annotations

import torch

from .kernels.combine_rounds import fits_one_launch as fits_combine_rounds
from .kernels.comm import Flavour
from .kernels.dispatch_rounds import fits_one_launch as fits_dispatch_rounds
from .kernels.invariant_rounds import fits_one_launch as fits_invariant_rounds
from .kernels.quant import NVFP4
from .workspace import RING_SLOT_MULTIPLE, ring_slots_for

DEFAULT_GPU_SMS = 20  # persistent send grids on GPUs (DeepEP uses 20-24 SMs)
_COMPILED = Flavour(device_wait=True, compiled=True)  # what the fits ask: a GPU's launch
_COMPILED_NVSHMEM = Flavour(transport=1, device_wait=True, compiled=True)  # (across hosts)


def checked_num_sms(num_sms) -> int | None:
    """``num_sms`` if it is a positive int or None, else ValueError."""
    if num_sms is not None and (isinstance(num_sms, bool) or not isinstance(num_sms, int)
                                or num_sms < 1):
        raise ValueError(f"num_sms must be a positive int or None, got {num_sms!r}")
    return num_sms


def one_launch_sms(device_type: str, proxy: bool, num_sms: int | None) -> int | None:
    """The programs of a Buffer's rounds in one launch (``num_sms``, ``DEFAULT_GPU_SMS`` if
    None), for a Buffer of its own process on a GPU without the proxy (one node, or across
    hosts over NVSHMEM); None for any other (CPU ranks run every round in one
    launch of one program, or per round; the proxy's dispatch launches per round)."""
    if device_type != "cuda" or proxy:
        return None
    return DEFAULT_GPU_SMS if num_sms is None else num_sms


def one_launch_fits(ring_slots: int, world_size: int, hidden: int, max_topk: int,
                    elem_bytes: int, num_sms: int, flavour: Flavour,
                    invariant: bool = False) -> tuple[dict, dict]:
    """``(dispatch, combine)``: whether rounds of ``ring_slots`` slots run in one launch on
    ``num_sms`` programs of ``flavour``, per format the Buffer may call (the one table of them):
    ``dispatch[fp8, ue8m0, elem]`` for the dispatch's (its rows or bytes, FP8, MXFP8 and NVFP4,
    quantized by the send or given quantized), ``combine[fp8, pair]`` for the combine's (exact
    or FP8 partials, with values per row or without; with ``invariant`` the EP-invariant
    combine's, which has no FP8 partials)."""
    args = (world_size, ring_slots, hidden, max_topk, num_sms, flavour)
    dispatch = {(fp8, ue8m0, elem): fits_dispatch_rounds(*args, fp8, ue8m0, elem)
                for fp8, ue8m0, elem in dispatch_formats(elem_bytes)}
    combine = {(fp8, pair): (not fp8 and fits_invariant_rounds(*args, elem_bytes)) if invariant
               else fits_combine_rounds(*args, elem_bytes, fp8, pair)
               for fp8, pair in COMBINE_FORMATS}
    return dispatch, combine


def dispatch_formats(elem_bytes: int) -> list[tuple[int, int, int]]:
    """A dispatch's formats as the one-launch table keys them: ``(fp8, ue8m0, the rows'
    element bytes)`` (fp8 0: rows as they are, 1: quantized by the send, 2: given quantized)."""
    return [(fp8, ue8m0, elem) for fp8 in (0, 1, 2) for ue8m0 in range(NVFP4 + 1)
            for elem in sorted({elem_bytes, 1})]


# a combine's formats as the one-launch table keys them: (FP8 partials, values per row)
COMBINE_FORMATS = ((False, False), (False, True), (True, False), (True, True))


def fits_every_format(ring_slots: int, world_size: int, hidden: int, max_topk: int,
                      elem_bytes: int, num_sms: int, invariant: bool,
                      nvshmem: bool = False) -> bool:
    """Whether rounds of ``ring_slots`` slots run in one launch on ``num_sms`` programs of a GPU
    in every format of :func:`one_launch_fits`, the combine's exact and FP8 partials both, and
    with ``invariant`` the EP-invariant combine too; ``nvshmem``: the launches across hosts over
    NVSHMEM (some of their tiles are their own)."""
    flavour = _COMPILED_NVSHMEM if nvshmem else _COMPILED
    dispatch, combine = one_launch_fits(ring_slots, world_size, hidden, max_topk, elem_bytes,
                                        num_sms, flavour)
    return (all(dispatch.values()) and all(combine.values())
            and (not invariant or fits_invariant_rounds(world_size, ring_slots, hidden,
                                                        max_topk, num_sms, flavour,
                                                        elem_bytes)))


def one_launch_ring_slots(ring_slots: int, world_size: int, hidden: int, max_topk: int,
                          dtype: torch.dtype, num_sms: int, invariant: bool = False,
                          nvshmem: bool = False) -> int:
    """The largest multiple of ``RING_SLOT_MULTIPLE`` up to ``ring_slots`` that
    :func:`fits_every_format` on ``num_sms`` programs (the fits grow with the ring, so a
    bisection over the multiples finds it); ``ring_slots`` itself where it fits or where not
    even the smallest does."""
    elem = torch.empty((), dtype=dtype).element_size()

    def fits(slots: int) -> bool:
        return fits_every_format(slots, world_size, hidden, max_topk, elem, num_sms, invariant,
                                 nvshmem)

    if fits(ring_slots) or not fits(RING_SLOT_MULTIPLE):
        return ring_slots
    lo, hi = 1, ring_slots // RING_SLOT_MULTIPLE  # multiples: lo fits, hi * 16 does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * RING_SLOT_MULTIPLE) else (lo, mid)
    return lo * RING_SLOT_MULTIPLE


def staging_ring_slots(staging_bytes: int | None, world_size: int, max_tokens: int,
                       hidden: int, max_topk: int, dtype: torch.dtype, *,
                       outboxes: bool = False, ranks_per_node: int | None = None,
                       rdma: bool = False, invariant: bool = False,
                       one_launch_sms: int | None = None) -> int | None:
    """Ring slots per source of the normal mode's staging for a budget of ``staging_bytes``
    (``workspace.ring_slots_for``; None: the whole batch, one round). ``outboxes``: the budget
    pays for the outboxes of a Buffer across nodes through the proxy as well, and with
    ``ranks_per_node`` (hierarchical) for the forwarders' regions; ``rdma``: for the outboxes
    of a Buffer across hosts over NVSHMEM; ``invariant``: for the EP-invariant combine's rows.
    ``one_launch_sms`` (:func:`one_launch_sms`): a ring of several rounds is cut to what one
    launch of that many programs runs a round of (:func:`one_launch_ring_slots`; with
    ``rdma``, the launches across hosts over NVSHMEM)."""
    slots = ring_slots_for(staging_bytes, world_size, max_tokens, hidden, max_topk, dtype,
                           outboxes, ranks_per_node, rdma, invariant)
    if slots == max_tokens:
        return None
    if one_launch_sms is not None:
        slots = one_launch_ring_slots(slots, world_size, hidden, max_topk, dtype, one_launch_sms,
                                      invariant, rdma)
    return slots
