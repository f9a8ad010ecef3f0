"""Communication primitives: puts through the peer-pointer table, epoch signals, bounded waits.

Signalling protocol (one int64 word per (channel, source rank) on every rank, see
``moe_comm.workspace``):

* **publish** (sender, after all its puts of call ``n`` to rank ``d`` are issued): a
  ``release``, system-scope exchange of ``n`` into ``signals[channel, me]`` on rank ``d``.
  Epochs only grow, so a word is never reset and a late reader can never see an old call's
  value as new.
* **wait** (receiver): ``signals[channel, s] >= n`` for every source ``s``, read with acquire
  ordering, bounded by a timeout whose error names this rank, the missing peer, and the expected
  and observed epochs.
* **last program publishes**: the programs of one send launch each add 1 to a local, monotonic
  ticket counter (acq_rel) after their puts; the program that draws ticket ``base + grid - 1``
  has observed every other program's puts and publishes for the whole launch. No program ever
  waits for another program of its launch.

On CPU ranks the wait is a host-side poll of the local signal words (the waiting process sleeps
instead of spinning an interpreted loop, which leaves the cores to the ranks it waits for).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .nvshmem import globaltimer_ns, signal_set


@triton.jit
def peer_ptr(peer_ptrs, peer, byte_offset, dtype: tl.constexpr):
    """Typed pointer to ``byte_offset`` in rank ``peer``'s segment; ``peer_ptrs``: [R] int64."""
    addr = tl.load(peer_ptrs + peer) + byte_offset
    return addr.to(tl.pointer_type(dtype))


@triton.jit
def publish_epoch(peer_ptrs, peer, signal_byte_offset, epoch):
    """Release-store ``epoch`` into the int64 word at ``signal_byte_offset`` on rank ``peer``."""
    word = peer_ptr(peer_ptrs, peer, signal_byte_offset, tl.int64)
    tl.atomic_xchg(word, tl.cast(epoch, tl.int64), sem="release", scope="sys")


@triton.jit
def draw_last_ticket(ticket_ptr, last_ticket):
    """True in exactly one program of a launch: the one that finishes last."""
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="sys")
    return ticket == last_ticket


@triton.jit
def draw_last_of(ticket_ptr, programs):
    """:func:`draw_last_ticket` for launches whose grid never changes (``programs`` programs):
    the counter only grows, so the last program of every launch draws ``programs - 1`` modulo
    ``programs`` and no per-call scalar is needed (CUDA-graph safe)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="sys")
    return ticket % programs == programs - 1


class PeerTimeoutError(RuntimeError):
    """A peer did not publish the expected epoch in time."""

    def __init__(self, rank: int, peer: int, channel: str, expected: int, observed: int,
                 timeout_s: float):
        self.rank, self.peer, self.channel = rank, peer, channel
        self.expected, self.observed = expected, observed
        super().__init__(
            f"moe_comm rank {rank}: timed out after {timeout_s:g} s waiting for rank {peer} on "
            f"the {channel} channel: expected epoch >= {expected}, observed {observed} "
            f"(did rank {peer} skip a call, fail, or call a different op?)")


def wait_for_epochs(observe, expected: int, *, timeout_s: float, rank: int,
                    channel: str) -> list[float]:
    """Blocks until ``observe()[s] >= expected`` for every source ``s``; returns, per source,
    the seconds it took to arrive (0 for those already there).

    ``observe`` returns the epochs the peers have published (host memory on CPU ranks). Raises
    :class:`PeerTimeoutError` naming the first source still behind after ``timeout_s``.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    sleep_s = 2e-5
    arrived: dict[int, float] = {}
    while True:
        observed = observe()
        now = time.monotonic()
        for s, v in enumerate(observed):
            if v >= expected and s not in arrived:
                arrived[s] = now - start
        if len(arrived) == len(observed):
            return [arrived[s] for s in range(len(observed))]
        if now > deadline:
            s = next(s for s, v in enumerate(observed) if v < expected)
            raise PeerTimeoutError(rank, s, channel, expected, observed[s], timeout_s)
        time.sleep(sleep_s)
        sleep_s = min(sleep_s * 2, 2e-3)


def wait_epochs(signals: torch.Tensor, expected: int, *, timeout_s: float, rank: int,
                channel: str) -> list[float]:
    """:func:`wait_for_epochs` on local signal words ``signals`` [R] int64."""
    if signals.device.type != "cpu":
        raise TypeError(f"wait_epochs polls host memory; got signal words on {signals.device}")
    return wait_for_epochs(signals.tolist, expected, timeout_s=timeout_s, rank=rank,
                           channel=channel)


# ------------------------------------------------------------------ GPU flavour: in-kernel waits
@triton.jit
def wait_at_least(word, expected, shift: tl.constexpr, deadline_ns, errors, peer):
    """Spins on the local int64 ``word`` until ``word >> shift >= expected`` or the deadline.

    GPU only (reads %globaltimer). Ends with an acquire load, so data published before the
    word is visible. On timeout records ``(1, peer, expected, observed)`` into ``errors``
    ([4] int64; the first timeout wins) and returns False; the host raises PeerTimeoutError.
    """
    observed = tl.load(word, volatile=True) >> shift
    while (observed < expected) & (globaltimer_ns() < deadline_ns):
        observed = tl.load(word, volatile=True) >> shift
    observed = tl.atomic_add(word, 0, sem="acquire", scope="sys") >> shift
    arrived = observed >= expected
    if not arrived:
        if tl.atomic_cas(errors, tl.cast(0, tl.int64), tl.cast(1, tl.int64), sem="relaxed",
                         scope="sys") == 0:
            tl.store(errors + 1, peer.to(tl.int64))
            tl.store(errors + 2, expected.to(tl.int64))
            tl.store(errors + 3, observed.to(tl.int64))
    return arrived


@triton.jit
def wait_epochs_kernel(
    signals,  # [R] int64 local signal words of one channel
    errors_addr,  # int64 address of the [4] int64 error record (host-mapped memory)
    expected, timeout_ns, R,
):
    """One program waits for ``signals[s] >= expected`` for every source (normal mode, GPU)."""
    errors = errors_addr.to(tl.pointer_type(tl.int64))
    deadline = globaltimer_ns() + timeout_ns
    for s in range(R):
        wait_at_least(signals + s, expected, 0, deadline, errors, s)


def raise_device_timeout(errors: torch.Tensor, *, rank: int, channel: str,
                         timeout_s: float) -> None:
    """Raises PeerTimeoutError if a kernel recorded a timeout in ``errors`` ([4] int64)."""
    flag, peer, expected, observed = errors.tolist()
    if flag:
        raise PeerTimeoutError(rank, peer, channel, expected, observed, timeout_s)


COMPILE_VARIANTS = [
    (wait_epochs_kernel, {"signals": "*i64", "errors_addr": "i64", "expected": "i64",
                          "timeout_ns": "i64", "R": "i32"}, {}),
]


@triton.jit
def by_stores(peer_ptrs, peer, mask, TRANSPORT: tl.constexpr):
    """``mask`` restricted to the lanes whose ``peer`` is reached by stores: all of them unless
    TRANSPORT == 1, where peers with a 0 pointer go through NVSHMEM instead."""
    if TRANSPORT == 1:
        mask = mask & (tl.load(peer_ptrs + peer, mask=mask, other=0) != 0)
    return mask


@triton.jit
def publish_to_all(peer_ptrs, word_offset, me, value, R, local_base, BLOCK_R: tl.constexpr,
                   TRANSPORT: tl.constexpr):
    """Sets int64 word ``me`` of the array at ``word_offset`` on every rank to ``value``: a
    release store through the peer pointer, or an NVSHMEM signal where the pointer is 0."""
    ranks = tl.arange(0, BLOCK_R)
    live = ranks < R
    d = tl.where(live, ranks, 0)
    word = peer_ptr(peer_ptrs, d, word_offset, tl.int64) + me
    tl.atomic_xchg(word, value + tl.zeros([BLOCK_R], tl.int64),
                   mask=by_stores(peer_ptrs, d, live, TRANSPORT), sem="release", scope="sys")
    if TRANSPORT == 1:
        for r in range(R):
            if tl.load(peer_ptrs + r) == 0:
                signal_set(local_base, word_offset + me * 8, value, r)


@dataclass(frozen=True)
class Flavour:
    """How a launch reaches its peers and waits for them. The default is CPU ranks: stores
    through the pointer table and waits on the host. GPUs wait in the kernels
    (``device_wait``); across nodes, peers whose pointer is 0 get NVSHMEM puts
    (``transport=1``) from this rank's symmetric segment at ``local_base``."""

    transport: int = 0
    device_wait: bool = False
    local_base: int = 0  # address of this rank's segment (NVSHMEM symmetric addresses)
    errors_addr: int = 0  # address of the [4] int64 error record (host-mapped on GPUs)
    timeout_ns: int = 0
    bitcode: str = ""  # transport 1: NVSHMEM's device bitcode for this GPU's architecture

    def args(self) -> tuple[int, int, int]:
        return self.local_base, self.errors_addr, self.timeout_ns

    def launch_options(self) -> dict:
        """Extra keywords of a launch: NVSHMEM's bitcode to link where kernels call it."""
        return {"extern_libs": {"libnvshmem_device": self.bitcode}} if self.bitcode else {}


CPU_RANKS = Flavour()


@triton.jit
def publish_epoch_to(peer_ptrs, peer, signal_byte_offset, epoch, local_base,
                     TRANSPORT: tl.constexpr):
    """:func:`publish_epoch`, or an NVSHMEM signal where ``peer`` has no pointer."""
    if TRANSPORT == 1:
        if tl.load(peer_ptrs + peer) == 0:
            signal_set(local_base, signal_byte_offset, epoch, peer)
        else:
            publish_epoch(peer_ptrs, peer, signal_byte_offset, epoch)
    else:
        publish_epoch(peer_ptrs, peer, signal_byte_offset, epoch)
