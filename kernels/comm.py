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

import torch
import triton
import triton.language as tl


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
