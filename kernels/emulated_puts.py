"""NVSHMEM's device calls under the Triton interpreter: CPU ranks run the NVSHMEM flavour's
kernels (``TRANSPORT`` 1) as they are.

On CPU ranks across nodes over NVSHMEM (``Buffer(..., transport="nvshmem")``) a peer on another
node has no pointer in ``peer_ptrs`` (0, as on a GPU), so the kernels take the NVSHMEM branch of
every send: rows into the outboxes, a block put per row, the signals by ``signal_set``. Each
process maps every segment of the job (``moe_comm.symm.shm``) and registers, for its own
segment, where each rank's segment lies in this process (:func:`register`). A put to ``pe``
then copies into that mapping, at the same offset from the segment's start as the symmetric
address has from this rank's::

    putmem_nbi_block(dest, src, n, pe):   pending += memmove(bases[pe] + (dest - local), src, n)
    int_p(dest, v, pe):                   pending += int32 at bases[pe] + (dest - local) = v
    fence(), quiet():                     run every pending put, in order
    signal_op(addr, v, SET, pe):          fence(); int64 at bases[pe] + (addr - local) = v

A non-blocking put reads its source when it completes, not when it is issued, as NVSHMEM
allows: a kernel that rewrote a source before its ``quiet`` (or a receiver that read rows
before their signal) would see it here too. Completing every pending put at a ``fence`` is one
of the orders NVSHMEM allows. The signal is an atomic exchange with release semantics (the
interpreter's own atomics), so a waiting process that reads it with acquire sees the rows put
before it. Scalar code of an interpreted program runs once, so each call is one put, as the
block-scoped call of a GPU program is.
"""
from __future__ import annotations

import collections
import ctypes
import threading

import numpy as np

_lock = threading.Lock()
_SEGMENTS: dict[int, tuple[int, tuple[int, ...]]] = {}  # local base -> (bytes, bases per PE)
_MOVED: collections.Counter = collections.Counter()  # (kind, pe) -> bytes put
_PENDING: list = []  # puts issued, not complete: (segment, destination here, source, bytes)


def register(local_base: int, nbytes: int, bases: list[int]) -> None:
    """This process's segment at ``local_base`` (``nbytes``) and where every PE's segment is
    mapped here (``bases[pe]``), for the puts the interpreted kernels issue."""
    if any(b == 0 for b in bases):
        raise ValueError("every PE's segment must be mapped in this process for emulated puts")
    with _lock:
        _SEGMENTS[int(local_base)] = (int(nbytes), tuple(int(b) for b in bases))


def forget(local_base: int) -> None:
    """The segment at ``local_base`` is going away: no put reaches it, or its peers', from
    here (a put it issued still pending is dropped: no op leaves one, ``pending``; another
    segment's stay)."""
    with _lock:
        _SEGMENTS.pop(int(local_base), None)
        _PENDING[:] = [put for put in _PENDING if put[0] != int(local_base)]


def registered() -> int:
    """How many segments this process has registered (tests: none is left behind)."""
    return len(_SEGMENTS)


def moved() -> dict:
    """Bytes this process has put since it started, ``{(kind, pe): bytes}`` with kind ``rows``
    (``putmem_nbi_block``), ``words`` (``int_p``) or ``signals`` (``signal_op``)."""
    return dict(_MOVED)


def _ints(value) -> np.ndarray:
    data = getattr(getattr(value, "handle", None), "data", value)
    return np.ravel(np.asarray(data)).astype(np.int64)


def _remote(address: int, nbytes: int, pe: int) -> tuple[int, int]:
    """``(segment, address)``: the registered segment (its local base) that symmetric address
    ``address`` lies in, and the address in this process of ``address`` on ``pe``."""
    for local, (size, bases) in _SEGMENTS.items():
        if local <= address and address + nbytes <= local + size:
            if not 0 <= pe < len(bases):
                raise ValueError(f"a put to PE {pe}: the job has {len(bases)}")
            return local, bases[pe] + (address - local)
    raise ValueError(f"a put at {address:#x} ({nbytes} bytes) outside every registered segment")


def putmem_nbi_block(dest, source, nbytes, pe):
    """``nvshmemx_putmem_nbi_block``: ``nbytes`` from ``source`` (this process) to symmetric
    ``dest`` on ``pe``, pending until the next :func:`fence`."""
    for d, s, n, p in zip(*np.broadcast_arrays(_ints(dest), _ints(source), _ints(nbytes),
                                               _ints(pe))):
        if n > 0:
            _PENDING.append((*_remote(int(d), int(n), int(p)), int(s), int(n)))
            _MOVED["rows", int(p)] += int(n)


def int_p(dest, value, pe):
    """``nvshmem_int_p``: the int32 ``value`` to symmetric ``dest`` on ``pe``, pending until
    the next :func:`fence`."""
    for d, v, p in zip(*np.broadcast_arrays(_ints(dest), _ints(value), _ints(pe))):
        _PENDING.append((*_remote(int(d), 4, int(p)), ctypes.c_int32(int(v)), 4))
        _MOVED["words", int(p)] += 4


def signal_op(sig_addr, signal, sig_op, pe):
    """``nvshmemx_signal_op`` with ``NVSHMEM_SIGNAL_SET``: every pending put completes, then the
    int64 word at symmetric ``sig_addr`` on ``pe`` becomes ``signal`` (release)."""
    from triton._C.libtriton import interpreter as native

    if int(getattr(sig_op, "value", sig_op)) != 9:  # NVSHMEM_SIGNAL_SET, the only one sent
        raise NotImplementedError(f"emulated signal_op {sig_op}")
    fence()
    for a, v, p in zip(*np.broadcast_arrays(_ints(sig_addr), _ints(signal), _ints(pe))):
        _, word = _remote(int(a), 8, int(p))
        native.atomic_rmw(native.RMW_OP.XCHG, np.array([word], np.uint64),
                          np.array([v], np.int64), np.array([True]),
                          native.MEM_SEMANTIC.RELEASE)
        _MOVED["signals", int(p)] += 8


def fence():
    """``nvshmem_fence``: here, every pending put completes, in the order issued."""
    while _PENDING:
        _, dest, source, nbytes = _PENDING.pop(0)
        if isinstance(source, ctypes.c_int32):
            source = ctypes.addressof(source)
        ctypes.memmove(dest, source, nbytes)


def quiet():
    """``nvshmem_quiet``: every pending put completes."""
    fence()


def pending() -> int:
    """Puts issued and not yet complete (tests: none is left after an op)."""
    return len(_PENDING)
