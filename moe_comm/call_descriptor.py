"""The call descriptor: what the ranks of a normal dispatch must agree on, sent with its counts.

Every rank of a dispatch publishes, with each destination's counts, a descriptor of its call
in the high bits of the counts row's last word (``kernels.comm.SLOT_BITS``; the low bits are
the slots it filled). The word travels wherever the counts go: peer stores on one node, the
proxy's outboxes, NVSHMEM puts, every round. Each receiver compares every source's
descriptor with its own (``kernels.comm.check_descriptors``) and records the first that
differs; the host raises it once the call is complete, on every rank (each sees at least one
other descriptor when they are not all equal), so the Buffer stays usable. Equivalent to::

    mine = descriptor(my call)
    for s in sources:                               # in rank order, those that arrived
        if descriptor(s's call) != mine:
            raise PeerInputError(...)               # after the call: names s and the option

Bits of a descriptor (13 of the 14 above a dispatch's slots):

=========  ===================================================================================
bits 0-2   the rows' format on the link: 0 the Buffer's dtype, else 1 + the scale code (FP8
           with float32 scales, UE8M0-packed scales, MXFP8, NVFP4): the receiver reads every
           source's rows in its own format
bit 3      weights given (a rank without them would send weight 0 for its rows)
bits 4-10  top-k (the receiver reads that many choices of each source's metadata)
bit 11     a refusal: bits 0-10 say which argument was bad (``REFUSAL_REASONS``); the rank
           takes part in the call's protocol with no rows and raises its own error
bit 12     a combine's descriptor (bit 0 its rows' format), not a dispatch's
bit 13     set by a hierarchical combine's forwarder: the ranks of its node sent other
           descriptors (it passes on the first that differs from its own)
=========  ===================================================================================

Options that shape only the receiver's own output (expert alignment, the scales' memory
layout, ``max_recv_rows``) need no agreement and are not sent.

A low-latency dispatch does the same with the signal word of each (expert, source): ``epoch <<
32 | descriptor << SLOT_BITS | pairs``, the descriptor its format or a refusal
(:func:`low_latency_descriptor`); every receive program of an expert's first source block
compares them (the Triton and the csrc/ receive alike), and the hook raises.

A combine sends its descriptor (:func:`combine_descriptor`: bit 12 set, bit 0 the rows'
format: the Buffer's dtype or FP8 per 128 channels; or a refusal with bit 12 set) in the signal
word each expert rank publishes to every home rank, ``epoch << 32 | descriptor << SLOT_BITS``
(``kernels.comm.signal_word``); the home's wait compares them (a wait kernel's one program, a
round's program 0, the host after its wait; the low-latency receive's first program), and the
call (the hook) raises. A hierarchical forwarder passes on the first refusal of its node's
ranks, or the first descriptor that differs from its own with bit 13 set.
"""
from __future__ import annotations

import functools

import torch

from .kernels import comm

FORMAT_MASK, WEIGHTS_BIT, TOPK_SHIFT, TOPK_BITS, COMBINE_BIT = 7, 3, 4, 7, 12
REFUSED_BIT = comm.REFUSED_BIT.value  # (the kernels read it: a refused call sends no rows)
MIXED_BIT = comm.MIXED_BIT.value  # (a hierarchical forwarder's: its node's ranks differ)
MAX_TOPK = (1 << TOPK_BITS) - 1
# the argument a refusal names, by the first word of the refusing rank's error message
REFUSAL_REASONS = ("an input", "x", "x_scales", "topk_idx", "topk_weights", "expert_alignment",
                   "max_recv_rows", "dispatch_dtype", "scale_layout", "global_scale", "top-k",
                   "ue8m0", "fp8", "y", "handle", "combine_dtype", "renormalize=True",
                   "out", "weights")
_FORMATS = ("rows in the Buffer's dtype", "FP8 rows with float32 scales",
            "FP8 rows with UE8M0 scales", "MXFP8 rows", "NVFP4 rows")


class PeerInputError(ValueError):
    """A peer refused the call (its input was bad) or made it with other options: raised on
    every rank once the call is complete; the Buffer stays usable. ``peer``: the rank."""

    def __init__(self, message: str, peer: int):
        super().__init__(message)
        self.peer = peer


@functools.cache  # (a hit runs no Python frame: the dispatch's host path stays as lean)
def dispatch_descriptor(fp8: int, ue8m0: int, has_weights: bool, topk: int) -> int:
    """The descriptor of a dispatch: ``fp8`` (0: rows as they are, else FP8 or finer, as
    ``normal_mode.PendingSend``) with scale code ``ue8m0``, weights given, top-k."""
    return (low_latency_descriptor(fp8, ue8m0) | int(has_weights) << WEIGHTS_BIT
            | min(topk, MAX_TOPK) << TOPK_SHIFT)


@functools.cache
def low_latency_descriptor(fp8: int, ue8m0: int) -> int:
    """The descriptor of a low-latency dispatch: the rows' format alone (the receive takes no
    weights, and each pair's meta word carries its own choice), published above each expert's
    count in the signal word (``kernels.low_latency``); a normal dispatch's low bits."""
    return 1 + ue8m0 if fp8 else 0


@functools.cache
def combine_descriptor(fp8: bool) -> int:
    """The descriptor of a low-latency combine: bit 12 (a combine) and the rows' format (0 the
    Buffer's dtype, 1 FP8 per 128 channels with float32 scales, ``combine_dtype="fp8"``)."""
    return 1 << COMBINE_BIT | int(fp8)


def call_name(descriptor: int) -> str:
    """Which call a descriptor describes: "combine" (bit 12) or "dispatch"."""
    return "combine" if descriptor >> COMBINE_BIT & 1 else "dispatch"


def refusal_inputs(buf):
    """``(x [0, H], topk_idx [0, 1])`` of ``buf``'s dtype and device, for a refused call that
    takes part with no rows; None where no peer waits for this rank's call from here (one
    rank; virtual ranks, whose calls run in lockstep; a ``torch.compile`` trace)."""
    if buf.world_size == 1 or buf.backend == "loopback" or torch.compiler.is_compiling():
        return None
    return (torch.empty((0, buf.hidden), dtype=buf.dtype, device=buf.device),
            torch.empty((0, 1), dtype=torch.int64, device=buf.device))


def refusal(error: BaseException, combine: bool = False) -> int:
    """The descriptor of a refused call (``combine``: a combine's, bit 12 set): which argument
    ``error`` (the refusing rank's own, a ValueError or TypeError naming the argument first)
    is about."""
    word = str(error).split(" ", 1)[0].split("[", 1)[0]
    code = REFUSAL_REASONS.index(word) if word in REFUSAL_REASONS else 0
    return 1 << REFUSED_BIT | int(combine) << COMBINE_BIT | code


def describe(theirs: int, mine: int) -> str:
    """What differs between a source's descriptor and this rank's, in words."""
    if theirs >> REFUSED_BIT & 1:
        code = theirs & ((1 << REFUSED_BIT) - 1)
        reason = REFUSAL_REASONS[code] if code < len(REFUSAL_REASONS) else REFUSAL_REASONS[0]
        return f"its {reason} was bad; it raised the cause and sent no rows"
    if mine >> REFUSED_BIT & 1:
        return "this rank's input was bad"
    fields = []
    if theirs >> MIXED_BIT & 1:
        fields.append("the ranks of its node (whose sums it forwards) made it with other "
                      "options")
        theirs &= ~(1 << MIXED_BIT)
    fmt = (theirs & FORMAT_MASK, mine & FORMAT_MASK)
    if fmt[0] != fmt[1]:
        name = [_FORMATS[f] if f < len(_FORMATS) else f"format {f}" for f in fmt]
        agree = ("combine_dtype" if call_name(mine) == "combine" else
                 "fp8 / dispatch_dtype / ue8m0")
        fields.append(f"it sent {name[0]}, this rank {name[1]} ({agree} must agree)")
    weights = (theirs >> WEIGHTS_BIT & 1, mine >> WEIGHTS_BIT & 1)
    if weights[0] != weights[1]:
        given = ["given" if w else "None" for w in weights]
        fields.append(f"its topk_weights {given[0]}, this rank's {given[1]}")
    topk = (theirs >> TOPK_SHIFT & MAX_TOPK, mine >> TOPK_SHIFT & MAX_TOPK)
    if topk[0] != topk[1]:
        fields.append(f"its top-k {topk[0]}, this rank's {topk[1]}")
    return "; ".join(fields) or f"descriptor {theirs:#x}, this rank's {mine:#x}"
