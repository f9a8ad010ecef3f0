"""Device half of the proxy transport: a kernel posts a transfer, a host thread performs it.

The ring is ``RING_HEADER + slots * DESC_WORDS`` int64 words in host-visible memory (pinned and
mapped on GPUs, plain memory on CPU ranks): word 0 counts the descriptors claimed, word 1 the
descriptors the proxy has taken (``moe_comm.transport``). A descriptor asks the proxy to copy up
to ``MAX_SEGMENTS`` strided segments of this rank's segment into a peer's segment and, once they
are in place there, to raise the int64 word at ``signal`` on the peer to ``value`` (never lower).

=====  ==========================================================================================
word   contents
=====  ==========================================================================================
0      sequence: ``i + 1`` for the ``i``-th descriptor, stored last (release): the proxy takes a
       slot only when its sequence is the one it expects
1      peer rank
2, 3   signal: byte offset in the peer's segment, value
4      number of segments
5+5s   segment ``s``: source byte offset here, destination byte offset there, bytes per row,
       row stride (bytes, the same on both sides), rows
=====  ==========================================================================================

Equivalent Python, for descriptor ``d`` to peer ``p``::

    for src, dst, nbytes, stride, rows in d.segments:
        for r in range(rows):
            peer_segment[dst + r * stride:][:nbytes] = my_segment[src + r * stride:][:nbytes]
    peer_word[d.signal] = max(peer_word[d.signal], d.value)   # after the data is there

A descriptor without segments (``post_signal``) is a fence as well: its signal is raised only
after every transfer posted to ``p`` before it is complete (the low-latency mode posts one
descriptor per (token, expert) pair with a no-op signal, then one such signal per expert).

One thread of one program posts (claims with an atomic add, waits boundedly for a free slot,
fills it, publishes the sequence); a full ring past the timeout is recorded as a timeout on the
peer and nothing is posted.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .comm import INTERPRETED, TIMEOUT_RECORD, _host_clock_ns, record_error

RING_HEADER = 2
DESC_WORDS = 24
MAX_SEGMENTS = 3
_HEADER = tl.constexpr(RING_HEADER)  # the same, for the kernels (compiled code reads only
_DESC = tl.constexpr(DESC_WORDS)  # constexpr globals)


@triton.jit
def _scalar_now_ns():
    """%globaltimer read by the calling thread (call under ``one_thread``)."""
    if INTERPRETED:
        now = tl.full([], _host_clock_ns(), tl.int64)
    else:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                        is_pure=False, pack=1)
    return now


@triton.jit
def post_transfer(ring_addr, slots, peer, signal_off, value, nseg,
                  src0, dst0, bytes0, stride0, rows0,
                  src1, dst1, bytes1, stride1, rows1,
                  src2, dst2, bytes2, stride2, rows2,
                  errors, timeout_ns):
    """Posts one descriptor (call from one thread: ``if one_thread(): post_transfer(...)``);
    segments past ``nseg`` are ignored. Returns whether it was posted."""
    ring = ring_addr.to(tl.pointer_type(tl.int64))
    i = tl.atomic_add(ring, 1, sem="relaxed", scope="sys")
    deadline = _scalar_now_ns() + timeout_ns
    taken = tl.load(ring + 1, volatile=True)
    while (i - taken >= slots) & (_scalar_now_ns() < deadline):
        taken = tl.load(ring + 1, volatile=True)
    posted = i - taken < slots
    if posted:
        d = ring + _HEADER + (i % slots) * _DESC
        tl.store(d + 1, tl.cast(peer, tl.int64))
        tl.store(d + 2, tl.cast(signal_off, tl.int64))
        tl.store(d + 3, tl.cast(value, tl.int64))
        tl.store(d + 4, tl.cast(nseg, tl.int64))
        tl.store(d + 5, tl.cast(src0, tl.int64))
        tl.store(d + 6, tl.cast(dst0, tl.int64))
        tl.store(d + 7, tl.cast(bytes0, tl.int64))
        tl.store(d + 8, tl.cast(stride0, tl.int64))
        tl.store(d + 9, tl.cast(rows0, tl.int64))
        tl.store(d + 10, tl.cast(src1, tl.int64))
        tl.store(d + 11, tl.cast(dst1, tl.int64))
        tl.store(d + 12, tl.cast(bytes1, tl.int64))
        tl.store(d + 13, tl.cast(stride1, tl.int64))
        tl.store(d + 14, tl.cast(rows1, tl.int64))
        tl.store(d + 15, tl.cast(src2, tl.int64))
        tl.store(d + 16, tl.cast(dst2, tl.int64))
        tl.store(d + 17, tl.cast(bytes2, tl.int64))
        tl.store(d + 18, tl.cast(stride2, tl.int64))
        tl.store(d + 19, tl.cast(rows2, tl.int64))
        tl.atomic_xchg(d, i + 1, sem="release", scope="sys")  # gate: publish
    else:  # the proxy took nothing for the whole timeout: it is gone or stuck
        record_error(errors, TIMEOUT_RECORD, peer, i, taken)
    return posted


@triton.jit
def post_signal(ring_addr, slots, peer, signal_off, value, errors, timeout_ns):
    """Posts a descriptor without data (one thread): the proxy raises ``signal_off`` on ``peer``
    to ``value`` once every transfer posted to ``peer`` before it is complete there."""
    return post_transfer(ring_addr, slots, peer, signal_off, value, 0,
                         0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, errors, timeout_ns)


@triton.jit
def post_signal_to_remote(peer_ptrs, word_offset, me, value, R, ring_addr, slots, errors,
                          timeout_ns):
    """Word ``me`` of the int64 array at ``word_offset`` raised to ``value`` on every rank that
    has no pointer (another node), through the proxy (call from one thread); the ranks with a
    pointer are the caller's to store to."""
    for r in range(R):
        if tl.load(peer_ptrs + r) == 0:
            post_signal(ring_addr, slots, r, word_offset + me * 8, value, errors, timeout_ns)
