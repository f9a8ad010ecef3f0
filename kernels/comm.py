"""Communication primitives: puts through the peer-pointer table, epoch signals, bounded waits.

Signalling protocol (one int64 word per (channel, source rank) on every rank, see
``moe_comm.workspace``):

* **publish** (sender, after all its puts of call ``n`` to rank ``d`` are issued): a
  ``release``, system-scope exchange of ``n`` into ``signals[channel, me]`` on rank ``d``.
  Epochs only grow, so a word is never reset and a late reader can never see an old call's
  value as new.
* **wait** (receiver): ``signals[channel, s] >= n`` for every source ``s``, all sources at once:
  each poll reads every source's word (one lane each, device memory), the clock is read every
  ``SPIN_BUDGET`` polls, and the wait ends in a system-scope acquire of every word; bounded by a
  timeout whose error names this rank, the first missing peer, and the expected and observed
  epochs.
* **last program publishes**: the programs of one send launch each add 1 to a local, monotonic
  ticket counter (acq_rel, after a barrier) once their puts are issued; the program that draws
  the launch's last ticket (grids never change, so it is ``programs - 1`` modulo the grid) has
  observed every other program's puts and publishes for the whole launch, then advances the
  channel's epoch word in device memory (the next launch's epoch: no per-call scalar). No
  program ever waits for another program of its launch. It publishes only if no
  wait of this rank has timed out (the error record is clear), so a peer never consumes what a
  failed call left half written.

Scalar Triton code runs in every thread of a program. A wait therefore decides from values
every thread agrees on (reductions over the lanes' loads; ``uniform_load``: one lane reads, a
reduction broadcasts), so all threads leave a spin loop together and a branch on its outcome
is uniform; a thread-scoped NVSHMEM call is issued by one thread (``one_thread``), a
block-scoped one by the whole program.

The error record (``ERRORS_WORDS`` int64, pinned host memory on GPUs) has two parts, each
claimed once with a compare-and-swap (0 -> -1), filled, then marked complete (1):
``[0:4]`` the first timeout (flag, peer, expected, observed) and ``[4:8]`` the first bad input
(flag, code, token, value).

Fault tolerance (``moe_comm.fault``): every segment holds one mask word per rank (0: active).
A fault-tolerant wait (:func:`wait_all_or_exclude`) also stops waiting for a source whose word
is set, and at the deadline sets it on every rank for each source still silent (the same
release stores as a publish) instead of failing.

On CPU ranks the waits run on the host by default: the waiting process polls the local signal
words and sleeps in between, leaving the cores to the ranks it waits for. The kernels' own
waits also run in the interpreter (``Flavour.device_wait`` on CPU ranks), where the clock is the
host's and every clock read yields the CPU for a moment.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl

from .nvshmem import signal_set

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
ERRORS_WORDS = 8
TIMEOUT_RECORD = tl.constexpr(0)  # first word of each part of the error record
INPUT_RECORD = tl.constexpr(4)
BAD_EXPERT_ID = tl.constexpr(1)  # input error codes
REPEATED_EXPERT = tl.constexpr(2)
TOO_MANY_ROWS = tl.constexpr(3)
CALL_DIFFERS = tl.constexpr(4)  # a source's call descriptor is not this rank's (below)
# The last word of a dispatch's counts row (``dispatch_counts[p, s, L]``) carries the slots
# source s filled in its low SLOT_BITS bits and the source's call descriptor above them
# (``moe_comm.call_descriptor``): the options every rank must agree on, or a refusal. The
# word travels wherever the counts go (peer stores, the proxy's outboxes, NVSHMEM puts).
SLOT_BITS = tl.constexpr(18)
SLOT_MASK = tl.constexpr((1 << 18) - 1)
REFUSED_BIT = tl.constexpr(11)  # of a descriptor: the call was refused (it sends no rows)
MIXED_BIT = tl.constexpr(13)  # of a forwarded one: the ranks of its node sent other descriptors
MIXED = tl.constexpr(1 << 13)
# A combine's signal words (normal mode: ``signals[1]``, ``hc_signals``; low-latency:
# ``ll_combine_signals``) carry ``epoch << EPOCH_SHIFT | descriptor << SLOT_BITS``: its waits
# compare the epoch above EPOCH_SHIFT, its receivers the descriptors (``check_signal_words``)
EPOCH_SHIFT = tl.constexpr(32)
_INTERPRETER_SPIN_S = 1e-4
# polls of a spin between two reads of the clock (the interpreter's clock read is what yields
# the CPU to the ranks it waits for: there every poll reads it)
SPIN_BUDGET = tl.constexpr(1 if INTERPRETED else 32)


def _host_clock_ns() -> int:
    """The interpreter's %globaltimer: the host's monotonic clock; yields the CPU briefly, so a
    spinning interpreted program leaves the cores to the ranks it waits for."""
    time.sleep(_INTERPRETER_SPIN_S)
    return time.monotonic_ns()


_host_clock_ns.__triton_builtin__ = True  # reached only when INTERPRETED (never compiled)


# ------------------------------------------------------------------------------- threads, time
@triton.jit
def one_thread():
    """True in thread 0 of the program only (the interpreter runs a program as one thread).
    Guard thread-scoped calls with it; never put a barrier or a reduction under it."""
    if INTERPRETED:
        first = True
    else:
        tid = tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32,
                                        is_pure=True, pack=1)
        first = tid == 0
    return first


@triton.jit
def uniform_now_ns(NUM_THREADS: tl.constexpr):
    """The GPU's %globaltimer (ns), the same value in every thread of the program."""
    if INTERPRETED:
        now = tl.full([], _host_clock_ns(), tl.int64)
    else:
        lanes = tl.arange(0, NUM_THREADS)
        now = tl.max(tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [lanes],
                                               dtype=tl.int64, is_pure=False, pack=1), axis=0)
    return now


@triton.jit
def uniform_load(ptr, NUM_THREADS: tl.constexpr):
    """``*ptr`` (int64, volatile) read by one lane of the program; the same value in every
    thread (a reduction broadcasts it)."""
    lanes = tl.arange(0, NUM_THREADS)
    return tl.sum(tl.load(ptr + lanes * 0, mask=lanes == 0, other=0, volatile=True), axis=0)


# ------------------------------------------------------------------------------- error record
@triton.jit
def record_error(errors, part, a, b, c):
    """Fills part ``part`` (TIMEOUT_RECORD or INPUT_RECORD) of the error record with (a, b, c)
    unless it holds an error already: claim (0 -> -1), fields, then flag 1 (release)."""
    flag = errors + part
    if tl.atomic_cas(flag, tl.cast(0, tl.int64), tl.cast(-1, tl.int64), sem="relaxed",
                     scope="sys") == 0:
        tl.store(flag + 1, tl.cast(a, tl.int64))
        tl.store(flag + 2, tl.cast(b, tl.int64))
        tl.store(flag + 3, tl.cast(c, tl.int64))
        tl.atomic_xchg(flag, tl.cast(1, tl.int64), sem="release", scope="sys")


@triton.jit
def slots_in(word):
    """The slots a counts row's last word holds (its low SLOT_BITS bits)."""
    return word & SLOT_MASK


@triton.jit
def check_descriptors(words, keep, src, me, epoch, errors_addr):
    """Compares the call descriptors of the sources ``src`` (the high bits of the last word of
    each counts row, ``words`` [BLOCK_R] int64) with this rank's own (``src == me``): the first
    source in ``keep`` whose descriptor differs is recorded in the input part of the error
    record (at ``errors_addr``, int64) as (CALL_DIFFERS, source, theirs | mine << 16 | epoch <<
    32); raised once the call is complete on this rank (``moe_comm.error_record``)."""
    desc = words >> SLOT_BITS
    mine = tl.sum(tl.where(src == me, desc, 0), axis=0)
    none = 1 << 30
    first = tl.min(tl.where(keep & (desc != mine), src, none), axis=0)
    if first < none:  # gate: cold
        theirs = tl.sum(tl.where(src == first, desc, 0), axis=0)
        record_error(errors_addr.to(tl.pointer_type(tl.int64)), INPUT_RECORD, CALL_DIFFERS,
                     first, theirs | (mine << 16) | (epoch.to(tl.int64) << 32))


@triton.jit
def signal_word(epoch, descriptor):
    """A combine's signal word: ``epoch << EPOCH_SHIFT | descriptor << SLOT_BITS`` (int64)."""
    return (tl.cast(epoch, tl.int64) << EPOCH_SHIFT) | (tl.cast(descriptor, tl.int64)
                                                        << SLOT_BITS)


@triton.jit
def check_signal_words(words, src, valid, me, epoch, errors_addr):
    """:func:`check_descriptors` of a combine's signal words ``words`` [BLOCK] (published for
    the ranks ``src``, ``valid`` lanes): those of this call's ``epoch`` only (a word set
    above every epoch, one no source publishes, or an excluded source's old one is left out);
    this rank's own is the one of ``src == me``."""
    keep = valid & ((words >> EPOCH_SHIFT) == epoch)
    check_descriptors(words & 0xFFFFFFFF, keep, src, me, epoch, errors_addr)


@triton.jit
def timed_out(errors, NUM_THREADS: tl.constexpr):
    """True (uniformly) once any wait of this rank has recorded a timeout: one lane reads the
    error record (host memory on GPUs: the kernels read it once, in the program that
    publishes; the low-latency kernels' waits check a device flag instead)."""
    return uniform_load(errors + TIMEOUT_RECORD, NUM_THREADS) != 0


# ------------------------------------------------------------------------------- peers, puts
@triton.jit
def aligned_ptr(addr, dtype: tl.constexpr, ALIGN: tl.constexpr):
    """The int64 address ``addr`` as a typed pointer known to be a multiple of ``ALIGN`` bytes
    (the caller vouches for it). The fact must sit on the pointer itself: Triton drops
    divisibility hints on integers across the int-to-pointer cast."""
    return tl.multiple_of(addr.to(tl.pointer_type(dtype)), ALIGN)


@triton.jit
def peer_ptr(peer_ptrs, peer, byte_offset, dtype: tl.constexpr, ALIGN: tl.constexpr):
    """Typed pointer to ``byte_offset`` in rank ``peer``'s segment; ``peer_ptrs``: [R] int64.

    ``ALIGN``: bytes the address is known to be a multiple of (segments are 128-byte aligned;
    the caller vouches for ``byte_offset``; :func:`aligned_ptr`)."""
    return aligned_ptr(tl.load(peer_ptrs + peer) + byte_offset, dtype, ALIGN)


@triton.jit
def local_ptr(local_base, byte_offset, dtype: tl.constexpr, ALIGN: tl.constexpr):
    """Typed pointer to ``byte_offset`` in this rank's own segment at ``local_base``."""
    return tl.multiple_of((local_base + byte_offset).to(tl.pointer_type(dtype)), ALIGN)


@triton.jit
def by_stores(peer_ptrs, peer, mask, TRANSPORT: tl.constexpr):
    """``mask`` restricted to the lanes whose ``peer`` is reached by stores: all of them unless
    a transport reaches the peers with a 0 pointer (1: NVSHMEM puts, 2: the proxy)."""
    if TRANSPORT != 0:
        mask = mask & (tl.load(peer_ptrs + peer, mask=mask, other=0) != 0)
    return mask


@triton.jit
def publish_epoch(peer_ptrs, peer, signal_byte_offset, epoch):
    """Release-store ``epoch`` into the int64 word at ``signal_byte_offset`` on rank ``peer``."""
    word = peer_ptr(peer_ptrs, peer, signal_byte_offset, tl.int64, 8)
    tl.atomic_xchg(word, tl.cast(epoch, tl.int64), sem="release", scope="sys")  # gate: publish


@triton.jit
def publish_epoch_to(peer_ptrs, peer, signal_byte_offset, epoch, local_base,
                     TRANSPORT: tl.constexpr):
    """:func:`publish_epoch`, or where ``peer`` has no pointer an NVSHMEM signal (one thread;
    TRANSPORT 1) or nothing (TRANSPORT 2: the proxy raises it after the data, see
    ``moe_comm.kernels.proxy``)."""
    if TRANSPORT == 1:
        if tl.load(peer_ptrs + peer) == 0:
            if one_thread():
                signal_set(local_base, signal_byte_offset, epoch, peer)
        else:
            publish_epoch(peer_ptrs, peer, signal_byte_offset, epoch)
    elif TRANSPORT == 2:
        if tl.load(peer_ptrs + peer) != 0:
            publish_epoch(peer_ptrs, peer, signal_byte_offset, epoch)
    else:
        publish_epoch(peer_ptrs, peer, signal_byte_offset, epoch)


@triton.jit
def publish_to_all(peer_ptrs, word_offset, me, value, R, local_base, BLOCK_R: tl.constexpr,
                   TRANSPORT: tl.constexpr):
    """Sets int64 word ``me`` of the array at ``word_offset`` on every rank to ``value``: a
    release store through the peer pointer, or an NVSHMEM signal where the pointer is 0."""
    ranks = tl.arange(0, BLOCK_R)
    live = ranks < R
    d = tl.where(live, ranks, 0)
    word = peer_ptr(peer_ptrs, d, word_offset, tl.int64, 8) + me
    tl.atomic_xchg(word, value + tl.zeros([BLOCK_R], tl.int64),  # gate: publish
                   mask=by_stores(peer_ptrs, d, live, TRANSPORT), sem="release", scope="sys")
    if TRANSPORT == 1:
        if one_thread():
            for r in range(R):
                if tl.load(peer_ptrs + r) == 0:
                    signal_set(local_base, word_offset + me * 8, value, r)


# ------------------------------------------------------------------------------- tickets
@triton.jit
def draw_last_of(ticket_ptr, programs):
    """True in exactly one program of a launch of ``programs`` programs: the one that finishes
    last. Every launch on a ticket word has the same grid and the counter only grows, so the
    last program of every launch draws ``programs - 1`` modulo ``programs``: no per-call scalar
    (CUDA-graph safe)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="sys")
    return ticket % programs == programs - 1


# ------------------------------------------------------------------------------- waits
@triton.jit
def acquire_word(word, mask=None):
    """``word[0]`` (or the words of a block of pointers, ``mask``: the lanes to read) read with
    system-scope acquire ordering: loads after it see what was published before the value it
    returns. The caller must use the value (Triton 3.6 drops an acquire whose result is unused,
    and with it the ordering); the waits use it to decide whether the word arrived. Signal
    words only grow while a wait runs, so this value is at least the one the spin saw."""
    return tl.atomic_add(word, 0, mask=mask, sem="acquire", scope="sys")  # gate: acquire


@triton.jit
def _behind(words, stride, i, im, expected, SHIFT: tl.constexpr, mask, FT: tl.constexpr):
    """[BLOCK] bool: the lanes whose word ``words[i * stride] >> SHIFT`` is below ``expected``
    (and, FT, whose rank ``i`` is not excluded in ``mask``); one volatile load per lane."""
    seen = tl.load(words + i * stride, mask=im, other=0, volatile=True) >> SHIFT
    behind = im & (seen < expected)
    if FT:
        behind = behind & (tl.load(mask + i, mask=im, other=0, volatile=True) == 0)
    return behind


@triton.jit
def _spin(words, stride, i, im, expected, SHIFT: tl.constexpr, deadline_ns, mask,
          FT: tl.constexpr, NUM_THREADS: tl.constexpr):
    """Spins until no lane is :func:`_behind` or the deadline; every poll reads all the words
    at once (device memory only), the clock is read once every SPIN_BUDGET polls. Returns the
    lanes still behind."""
    behind = _behind(words, stride, i, im, expected, SHIFT, mask, FT)
    while (tl.max(behind.to(tl.int32), axis=0) > 0) & (uniform_now_ns(NUM_THREADS) < deadline_ns):
        for _ in range(SPIN_BUDGET):
            if tl.max(behind.to(tl.int32), axis=0) > 0:
                behind = _behind(words, stride, i, im, expected, SHIFT, mask, FT)
    return behind


@triton.jit
def _record_timeout(errors, flag, peer, expected, observed, HAS_FLAG: tl.constexpr):
    """A timeout into the error record (host memory: the host raises from it) and, HAS_FLAG,
    the device flag the kernels check (``flag[0] := 1``)."""
    record_error(errors, TIMEOUT_RECORD, peer, expected, observed)
    if HAS_FLAG:
        tl.atomic_xchg(flag + tl.arange(0, 1), tl.full([1], 1, tl.int64), sem="release",
                       scope="gpu")


@triton.jit
def wait_all_at_least(words, stride, n, expected, SHIFT: tl.constexpr, deadline_ns, errors,
                      flag, BLOCK: tl.constexpr, NUM_THREADS: tl.constexpr,
                      HAS_FLAG: tl.constexpr):
    """Spins until ``words[i * stride] >> SHIFT >= expected`` for every ``i < n`` (local int64
    words, one per source; ``n <= BLOCK``) or the deadline, all sources at once (:func:`_spin`);
    returns whether all arrived, the same in every thread.

    Ends with a system-scope acquire of every word, whose values decide, and a barrier, so data
    published before the words is visible to every thread. On timeout records ``(first source
    behind, expected, observed)`` (the first timeout wins; the host raises PeerTimeoutError from
    it) and, HAS_FLAG, sets the device flag ``flag``."""
    return _wait_named(words, stride, n, expected, SHIFT, deadline_ns, errors, flag, 0, 1,
                       BLOCK, NUM_THREADS, HAS_FLAG)


@triton.jit
def _wait_named(words, stride, n, expected, SHIFT: tl.constexpr, deadline_ns, errors, flag,
                first_rank, rank_step, BLOCK: tl.constexpr, NUM_THREADS: tl.constexpr,
                HAS_FLAG: tl.constexpr):
    """:func:`wait_all_at_least` where word ``i`` is published for rank ``first_rank + i *
    rank_step`` (the rank a timeout names)."""
    i = tl.arange(0, BLOCK)
    im = i < n
    _spin(words, stride, i, im, expected, SHIFT, deadline_ns, words, False, NUM_THREADS)
    seen = acquire_word(words + i * stride, im) >> SHIFT
    late = im & (seen < expected)
    arrived = tl.max(late.to(tl.int32), axis=0) == 0
    if not arrived:  # gate: cold
        peer = tl.min(tl.where(late, i, BLOCK), axis=0)
        _record_timeout(errors, flag, first_rank + peer * rank_step, expected,
                        tl.sum(tl.where(i == peer, seen, 0), axis=0), HAS_FLAG)
    tl.debug_barrier()
    return arrived


@triton.jit
def wait_all_or_exclude(words, stride, n, expected, SHIFT: tl.constexpr, deadline_ns, errors,
                        flag, mask, me, peer_ptrs, mask_off, R, local_base,
                        BLOCK: tl.constexpr, NUM_THREADS: tl.constexpr,
                        TRANSPORT: tl.constexpr, HAS_FLAG: tl.constexpr):
    """:func:`wait_all_at_least` of a fault-tolerant Buffer: a source also stops being waited
    for once it is excluded (``mask[i] != 0``, ``mask``: this rank's local mask words), and at
    the deadline every source still behind is excluded on every rank (word ``i`` of the mask
    array at ``mask_off`` := ``me + 1``) instead of failing the call. Returns ``(arrived
    [BLOCK] bool, ok)``: which words arrived, and whether this rank may go on (uniform); a rank
    that finds itself excluded records a timeout naming itself (and sets the flag) and marks
    nobody (it is the one cut off)."""
    i = tl.arange(0, BLOCK)
    im = i < n
    _spin(words, stride, i, im, expected, SHIFT, deadline_ns, mask, True, NUM_THREADS)
    seen = acquire_word(words + i * stride, im) >> SHIFT
    arrived = im & (seen >= expected)
    excluded = tl.load(mask + i, mask=im, other=0, volatile=True) != 0
    cut_off = uniform_load(mask + me, NUM_THREADS) != 0
    if cut_off:  # gate: cold
        _record_timeout(errors, flag, me, expected, 0, HAS_FLAG)
    else:
        silent = im & ~arrived & ~excluded
        for p in range(n):
            if tl.sum(tl.where(i == p, silent.to(tl.int32), 0), axis=0) > 0:
                publish_to_all(peer_ptrs, mask_off, p, me + 1, R, local_base, BLOCK,
                               TRANSPORT)
    tl.debug_barrier()
    return arrived, not cut_off


@triton.jit
def wait_or_exclude_once(pid, words, expected, live, decided, deadline_ns, timeout_ns, errors,
                         mask, me, peer_ptrs, mask_off, R, local_base, BLOCK: tl.constexpr,
                         NUM_THREADS: tl.constexpr, TRANSPORT: tl.constexpr,
                         SHIFT: tl.constexpr = 0):
    """:func:`wait_all_or_exclude` taken once for every program of a launch, so that they all
    read the same sources: program 0 waits, writes which sources arrived into ``live`` [R]
    int32 and then release-stores ``decided := 2 * expected + ok`` (a local int64 word that
    only grows: epochs do); every other program waits, bounded (``deadline_ns`` plus
    ``timeout_ns``, program 0's own wait; a timeout names this rank), for ``decided >> 1 >=
    expected`` and takes ``ok`` from its low bit. Returns ``ok`` (this rank may go on).
    ``SHIFT``: the epoch's place in ``words`` (:func:`wait_all_at_least`)."""
    if pid == 0:
        arrived, ok = wait_all_or_exclude(words, 1, R, expected, SHIFT, deadline_ns, errors,
                                          words, mask, me, peer_ptrs, mask_off, R, local_base,
                                          BLOCK, NUM_THREADS, TRANSPORT, False)
        s = tl.arange(0, BLOCK)
        tl.store(live + s, arrived.to(tl.int32), mask=s < R)
        tl.debug_barrier()
        word = 2 * expected + ok * tl.full([1], 1, tl.int64)  # (ok: a bool, interpreted)
        tl.atomic_xchg(decided + tl.arange(0, 1), word, sem="release", scope="gpu")
        go = ok
    else:
        seen = _wait_named(decided, 1, 1, expected, 1, deadline_ns + timeout_ns, errors, words,
                           me, 0, BLOCK, NUM_THREADS, False)
        go = seen & ((tl.load(decided, volatile=True) & 1) != 0)
    return go


@triton.jit
def wait_round(pid, epoch, signals, errors, timeout_ns, live, decided, mask_off, local_base,
               peer_ptrs, R, me, FT: tl.constexpr, TRANSPORT: tl.constexpr,
               BLOCK_R: tl.constexpr, NUM_THREADS: tl.constexpr, COMBINE: tl.constexpr = False):
    """A round's wait in a launch of a call's rounds (``kernels.combine_rounds``,
    ``kernels.dispatch_rounds``, ``kernels.invariant_rounds``): every program waits, bounded,
    for every rank's ``epoch`` in ``signals``; returns whether all arrived (a timeout is
    recorded, naming the rank). ``FT``: :func:`wait_or_exclude_once` (program 0 excludes a
    source silent until the deadline and writes who arrived into ``live`` [R]; every program
    reads the same; an exclusion reaches the ranks it reaches by stores, ``TRANSPORT`` as
    :func:`publish_to_all`); returns whether this rank may go on. ``COMBINE``: the words are
    a combine's (the epoch above EPOCH_SHIFT), and program 0 compares their descriptors
    (:func:`check_signal_words`)."""
    deadline = uniform_now_ns(NUM_THREADS) + timeout_ns
    if FT:
        mask = local_ptr(local_base, mask_off, tl.int64, 8)
        ok = wait_or_exclude_once(pid, signals, epoch, live, decided, deadline, timeout_ns,
                                  errors, mask, me, peer_ptrs, mask_off, R, local_base,
                                  BLOCK_R, NUM_THREADS, TRANSPORT,
                                  EPOCH_SHIFT if COMBINE else 0)
    else:
        ok = wait_all_at_least(signals, 1, R, epoch, EPOCH_SHIFT if COMBINE else 0, deadline,
                               errors, signals, BLOCK_R, NUM_THREADS, False)
    if COMBINE:
        if ok & (pid == 0):  # gate: cold
            src = tl.arange(0, BLOCK_R)
            check_signal_words(tl.load(signals + src, mask=src < R, other=0), src, src < R, me,
                               epoch, errors)
    return ok


def check_round_words(fault_tolerant: bool, live, decided, rounds: int, world_size: int,
                      launch: str) -> None:
    """The arguments of a launch of a call's rounds (``launch`` names it): fault-tolerant, it
    takes ``live`` [rounds, R] int32 and its decision words ``decided`` (int64), and only then
    (ValueError before anything runs)."""
    if fault_tolerant != (live is not None) or (live is None) != (decided is None):
        raise ValueError(f"a fault-tolerant {launch} in one launch takes live and its decision "
                         "words, another neither")
    if live is not None and (tuple(live.shape) != (rounds, world_size)
                             or live.dtype != torch.int32 or decided.dtype != torch.int64):
        raise ValueError(f"live must be [rounds={rounds}, R={world_size}] int32 and the "
                         f"decision words int64, got {tuple(live.shape)} {live.dtype} and "
                         f"{decided.dtype}")


@triton.jit
def after_every_program(tickets, programs, word, value, deadline_ns, errors, me,
                        BLOCK: tl.constexpr, NUM_THREADS: tl.constexpr):
    """A barrier of the ``programs`` programs of one launch (resident together, as every
    persistent launch here): the last to draw a ticket from ``tickets`` (:func:`draw_last_of`)
    release-stores ``value`` into ``word`` (a local int64 word that only grows), every other
    waits for ``word >= value`` (bounded by ``deadline_ns``; a timeout names this rank ``me``).
    What a program stored before it drew is seen by every program after it. Returns whether
    this program may go on."""
    if draw_last_of(tickets, programs):
        tl.atomic_xchg(word + tl.arange(0, 1), value + tl.zeros([1], tl.int64), sem="release",
                       scope="gpu")
        done = value >= 0
    else:
        done = _wait_named(word, 1, 1, value, 0, deadline_ns, errors, word, me, 0, BLOCK,
                           NUM_THREADS, False)
    return done


@triton.jit(do_not_specialize=["index", "value"])
def set_word_on_all_kernel(peer_ptrs, word_off: tl.int64, index, value: tl.int64, R,
                           local_base: tl.int64, BLOCK_R: tl.constexpr,
                           TRANSPORT: tl.constexpr):
    """Word ``index`` of the int64 array at ``word_off`` := ``value`` on every rank (release):
    how the host excludes a rank, and how ``clean_mask`` announces itself."""
    publish_to_all(peer_ptrs, word_off, index, value, R, local_base, BLOCK_R, TRANSPORT)


@triton.jit(do_not_specialize=["errors_addr", "timeout_ns", "me"])
def wait_epochs_kernel(
    signals,  # [R] int64 local signal words of one channel
    epochs,  # [1] int64 local: the channel's epoch (this rank's send of the call is done)
    errors_addr: tl.int64,  # address of the error record (host-mapped memory on GPUs)
    timeout_ns: tl.int64, R: tl.int32, me: tl.int32,
    BLOCK_R: tl.constexpr, NUM_THREADS: tl.constexpr,
    COMBINE: tl.constexpr,  # a combine's words: the epoch above EPOCH_SHIFT, descriptors below
):
    """One program waits for ``signals[s] >= epochs[0]`` for every source at once (normal
    mode, kernel waits; :func:`wait_all_at_least`); a combine's then compares the sources'
    descriptors (:func:`check_signal_words`)."""
    deadline = uniform_now_ns(NUM_THREADS) + timeout_ns
    epoch = tl.load(epochs)
    ok = wait_all_at_least(signals, 1, R, epoch, EPOCH_SHIFT if COMBINE else 0, deadline,
                           errors_addr.to(tl.pointer_type(tl.int64)), signals, BLOCK_R,
                           NUM_THREADS, False)
    if COMBINE:
        if ok:  # gate: cold
            src = tl.arange(0, BLOCK_R)
            check_signal_words(tl.load(signals + src, mask=src < R, other=0), src, src < R, me,
                               epoch, errors_addr)


@triton.jit(do_not_specialize=["errors_addr", "timeout_ns", "first_rank"])
def wait_relayed_epochs_kernel(
    words,  # [n] int64 local signal words: a hierarchical forwarder's inputs
    epochs,  # [1] int64 local: the channel's epoch (this rank's send of the round is done)
    errors_addr: tl.int64, timeout_ns: tl.int64, n: tl.int32,
    first_rank: tl.int32, rank_step: tl.int32,  # word i is published for this rank
    BLOCK_R: tl.constexpr, NUM_THREADS: tl.constexpr,
    SHIFT: tl.constexpr,  # the epoch's place in the words (a combine's: EPOCH_SHIFT)
):
    """One program waits for ``words[i] >= epochs[0]`` for every ``i < n`` at once, and a
    timeout names rank ``first_rank + i * rank_step`` (a forwarder's node messages, ``node``
    ``a``'s from rank ``a * N + l``; its node's partials, rank ``b * N + i``)."""
    deadline = uniform_now_ns(NUM_THREADS) + timeout_ns
    wait_relayed(words, n, tl.load(epochs), deadline, errors_addr.to(tl.pointer_type(tl.int64)),
                 first_rank, rank_step, BLOCK_R, NUM_THREADS, SHIFT)


@triton.jit
def wait_relayed(words, n, expected, deadline_ns, errors, first_rank, rank_step,
                 BLOCK: tl.constexpr, NUM_THREADS: tl.constexpr, SHIFT: tl.constexpr = 0):
    """:func:`wait_all_at_least` of ``n`` local words where word ``i`` is published for rank
    ``first_rank + i * rank_step`` (the rank a timeout names; :func:`wait_relayed_epochs_kernel`
    and the forwarder's pass of a combine in one launch, ``kernels.internode.forward_round``)."""
    return _wait_named(words, 1, n, expected, SHIFT, deadline_ns, errors, words, first_rank,
                       rank_step, BLOCK, NUM_THREADS, False)


@triton.jit(do_not_specialize=["errors_addr", "timeout_ns", "me"])
def ft_wait_epochs_kernel(
    signals,  # [R] int64 local signal words of one channel
    epochs,  # [1] int64 local: the channel's epoch (this rank's send of the call is done)
    live,  # [R] int32 out: 1 where the source's epoch arrived, 0 where it was excluded
    peer_ptrs,  # [R] int64
    mask_off: tl.int64,  # byte offset of the mask words [R] int64 (every segment)
    local_base: tl.int64, errors_addr: tl.int64, timeout_ns: tl.int64,
    R: tl.int32, me: tl.int32,
    TRANSPORT: tl.constexpr, BLOCK_R: tl.constexpr, NUM_THREADS: tl.constexpr,
    COMBINE: tl.constexpr,  # a combine's words (as wait_epochs_kernel)
):
    """Fault-tolerant form of :func:`wait_epochs_kernel`: waits for every source not excluded
    (all at once; :func:`wait_all_or_exclude`) and says which arrived (a dispatch's received
    layout waits itself: ``kernels.dispatch.received_layout_kernel``)."""
    errors = errors_addr.to(tl.pointer_type(tl.int64))
    mask = local_ptr(local_base, mask_off, tl.int64, 8)
    deadline = uniform_now_ns(NUM_THREADS) + timeout_ns
    epoch = tl.load(epochs)
    arrived, ok = wait_all_or_exclude(signals, 1, R, epoch, EPOCH_SHIFT if COMBINE else 0,
                                      deadline, errors, signals, mask, me, peer_ptrs, mask_off,
                                      R, local_base, BLOCK_R, NUM_THREADS, TRANSPORT, False)
    s = tl.arange(0, BLOCK_R)
    tl.store(live + s, arrived.to(tl.int32), mask=s < R)
    if COMBINE:
        if ok:  # gate: cold
            check_signal_words(tl.load(signals + s, mask=s < R, other=0), s, arrived, me,
                               epoch, errors_addr)


# ------------------------------------------------------------------------------- host side
class PeerTimeoutError(RuntimeError):
    """A peer did not publish the expected epoch in time."""

    def __init__(self, rank: int, peer: int, channel: str, expected: int, observed: int,
                 timeout_s: float, via: int | None = None):
        self.rank, self.peer, self.channel, self.via = rank, peer, channel, via
        self.expected, self.observed = expected, observed
        relay = f" (forwarded by rank {via})" if via is not None and via != peer else ""
        super().__init__(
            f"moe_comm rank {rank}: timed out after {timeout_s:g} s waiting for rank {peer}"
            f"{relay} on the {channel} channel: expected epoch >= {expected}, observed "
            f"{observed} (did rank {peer} skip a call, fail, or call a different op?)")


def wait_for_epochs(observe, expected: int, *, timeout_s: float, rank: int,
                    channel: str) -> list[float]:
    """Blocks until ``observe()[s] >= expected`` for every source ``s``; returns, per source,
    the seconds it took to arrive (0 for those already there).

    ``observe`` returns the epochs the peers have published (host memory on CPU ranks). Raises
    :class:`PeerTimeoutError` naming the first source still behind after ``timeout_s``.
    """
    seconds, behind = wait_for_live_epochs(observe, expected, None, timeout_s=timeout_s)
    if behind:
        s = behind[0]
        raise PeerTimeoutError(rank, s, channel, expected, int(observe()[s]), timeout_s)
    return seconds


def wait_for_live_epochs(observe, expected: int, excluded, *, timeout_s: float
                         ) -> tuple[list[float | None], list[int]]:
    """Polls ``observe()`` until every source ``s`` reached ``expected`` or, for a
    fault-tolerant Buffer, ``excluded()[s]`` (an excluded source is never waited for;
    ``excluded=None``: none is), or ``timeout_s`` passed. Returns ``(seconds until each source
    arrived, None for those that did not; the sources still behind at the deadline)``."""
    start = time.monotonic()
    deadline = start + timeout_s
    sleep_s = 2e-5
    arrived: dict[int, float] = {}
    while True:
        observed = observe()
        out = excluded() if excluded is not None else [False] * len(observed)
        now = time.monotonic()
        for s, v in enumerate(observed):
            if v >= expected and s not in arrived:
                arrived[s] = now - start
        behind = [s for s in range(len(observed)) if s not in arrived and not out[s]]
        if not behind or now > deadline:
            return [arrived.get(s) for s in range(len(observed))], behind
        time.sleep(sleep_s)
        sleep_s = min(sleep_s * 2, 2e-3)


def epochs_of(words: np.ndarray, shift: int = 0):
    """``observe`` for a host wait on local signal words (a numpy view: polling it reads no
    tensor): the epochs they hold, above ``shift`` in a combine's (EPOCH_SHIFT,
    :func:`signal_word`)."""
    if not shift:
        return words.tolist
    return lambda: (words >> shift).tolist()


def wait_epochs(signals: np.ndarray, expected: int, *, timeout_s: float, rank: int,
                channel: str) -> list[float]:
    """:func:`wait_for_epochs` on local signal words ``signals`` [R] int64 in host memory (a
    numpy view: polling it reads no tensor)."""
    return wait_for_epochs(lambda: signals.tolist(), expected, timeout_s=timeout_s, rank=rank,
                           channel=channel)


@dataclass(frozen=True)
class Flavour:
    """How a launch reaches its peers and waits for them.

    ``compiled``: the kernels run compiled on a GPU (tiles fit registers) rather than in the
    interpreter; ``device_wait``: waits run inside the kernels (always on GPUs; on CPU ranks
    only when asked, to run the GPU protocol in the interpreter), otherwise the host waits;
    ``transport=1``: peers whose pointer is 0 get NVSHMEM puts from this rank's symmetric
    segment at ``local_base``; ``transport=2``: they get what the proxy moves from this rank's
    outboxes (descriptors posted into the ring at ``ring_addr``, ``ring_slots`` long);
    ``ranks_per_node`` / ``hierarchical``: the nodes, and whether a token crosses to a node
    once (through the rank with the same local index there); ``row_align``: bytes every row
    address is a multiple of; ``fault_tolerant``: a wait that times out excludes the peer (the
    mask words at ``mask_off``) and the call goes on without it."""

    transport: int = 0
    device_wait: bool = False
    compiled: bool = False
    local_base: int = 0  # address of this rank's segment (NVSHMEM symmetric addresses)
    errors_addr: int = 0  # address of the error record (host-mapped on GPUs)
    timeout_ns: int = 0
    bitcode: str = ""  # transport 1: NVSHMEM's device bitcode for this GPU's architecture
    row_align: int = 16
    ring_addr: int = 0  # transport 2: the proxy's descriptor ring (host-visible memory)
    ring_slots: int = 0
    ranks_per_node: int = 0  # 0: every rank on one node
    hierarchical: bool = False
    fault_tolerant: bool = False  # waits exclude silent peers (``moe_comm.fault``)
    mask_off: int = 0  # byte offset of the mask words in every segment
    # derived: whether a dispatch send fills the proxy's outboxes itself and posts their
    # descriptors (``kernels.dispatch.send_tokens``' ``PROXY_BOX``): through the proxy, flat;
    # hierarchical, ``kernels.internode.outbox_dispatch`` follows the send
    proxy_box: bool = field(init=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "proxy_box", self.transport == 2 and not self.hierarchical)

    def args(self) -> tuple[int, int, int]:
        return self.local_base, self.errors_addr, self.timeout_ns

    def launch_options(self, tile) -> dict:
        """Extra keywords of a launch with tiles ``tile``: warps (and on GPUs the register
        cap), and NVSHMEM's bitcode where kernels call it."""
        options = tile.launch_options()
        if self.bitcode:
            options["extern_libs"] = {"libnvshmem_device": self.bitcode}
        return options


CPU_RANKS = Flavour()
