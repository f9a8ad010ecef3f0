"""``nixl``: the proxy transport. One host thread per rank moves what the kernels post.

Construction (collective over the torch group): every rank starts a NIXL agent, registers its
whole symmetric segment once, and the agents' metadata and segment addresses go round with
``all_gather_object``; each rank adds the agents of the peers it sends to or hears from (other
nodes only: peers on its own node have pointers).

The thread loops, never blocking on anything but short sleeps when idle:

1. **drain the ring** (``moe_comm.kernels.proxy``): for each published descriptor, one NIXL
   WRITE of its segments into the peer's segment, with a notification that carries (signal
   offset, value); a descriptor without data sends the notification alone, once every
   transfer posted to that peer before it is complete (a fence: the low-latency mode's
   per-expert signals follow the per-pair transfers they count);
2. **complete transfers**: ``check_xfer_state``; ``ERR``, or one still running after the
   timeout, fails the transport towards that peer;
3. **apply notifications** (``get_new_notifs``, which also progresses the backend: the agent
   runs without NIXL's own progress thread, which on CPU ranks polled its sockets without
   rest, about half a core per idle rank); NIXL delivers a notification only after its
   transfer's data is in place, so raising the local signal word then (to the larger of the
   two values) is the release: a waiter that sees the epoch sees the rows.

The segment may be host memory (CPU ranks) or device memory (GPUs: NIXL moves device memory to
device memory, the ring is pinned host memory the kernels post to, and a signal word is raised
by a copy on the proxy's own stream; ``moe_comm.transport.memory``).

Failures are kept (``failure``) and raised as :class:`TransportError` naming the peer by
:meth:`check`, which the Buffer's waits call; a stopped thread is a failure too. A ``tolerant``
proxy (a fault-tolerant Buffer) keeps a failure towards one peer to that peer: the peer is
``lost``, whatever is posted to it is dropped, and the others are served on (the Buffer's
waits time out on the peer and exclude it). ``notify`` sends a notification from the host
(fenced after the transfers posted to that peer before it): how a Buffer writes its mask and
``clean_mask`` words on other nodes. ``close`` waits
(bounded) for the transfers in flight, tells every peer it is closing and waits (bounded) until
every peer said so too, so no rank drops its agent while a peer may still send to it (the
last acknowledgements of the low-latency mode go out after a rank's last wait); then it stops
the thread, deregisters and drops the agent.

Counted here (the bytes NIXL is asked to move): data bytes written into each peer, per channel
(:meth:`bytes_by_label`), and ``messages_to[p]`` transfers (each also carries a 16-byte
notification).
"""
from __future__ import annotations

import os
import queue
import struct
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from ..kernels.proxy import DESC_WORDS, MAX_SEGMENTS, RING_HEADER
from .errors import TransportError
from .memory import segment_memory
from .select import nixl_backend

_NOTIF = struct.Struct("<qq")  # (signal byte offset, value)
_CLOSING = -1  # a notification with this offset: the sender (value) is closing
_IDLE_S = (2e-5, 1e-3)  # sleep between idle polls: from, doubling up to
_CLOSE_DRAIN_S = 5.0


def _import_nixl():
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        from nixl_cu13 import nixl_agent, nixl_agent_config
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError("transport='nixl' needs the nixl-cu13 package "
                          "(pip install nixl-cu13)") from exc
    return nixl_agent, nixl_agent_config


class NixlProxy:
    """The proxy of one rank. ``peers``: the ranks this rank exchanges data with through the
    transport (a rank may only post to those)."""

    _serial = 0

    def __init__(self, group: dist.ProcessGroup, segment: torch.Tensor, rank: int,
                 world_size: int, peers: list[int], *, timeout_s: float,
                 backend: str | None = None, slots: int | None = None,
                 labels: dict[int, str] | None = None, tolerant: bool = False):
        memory = segment_memory(segment)  # host (CPU ranks) or device memory (GPUs)
        nixl_agent, nixl_agent_config = _import_nixl()
        self.rank, self.world_size = rank, world_size
        self.peers = sorted(set(peers))
        self.timeout_s = timeout_s
        self.backend = nixl_backend(backend)
        self.slots = slots or max(8, 4 * len(self.peers))
        self._memory = memory
        self.ring = memory.new_ring(RING_HEADER + self.slots * DESC_WORDS)
        self._ring = self.ring.numpy()
        self._segment = segment
        self._labels = dict(labels or {})
        self._bytes = {label: np.zeros(world_size, dtype=np.int64)
                       for label in [*self._labels.values(), "other"]}
        self.messages_to = np.zeros(world_size, dtype=np.int64)
        self.transfer_seconds = 0.0  # summed from posting each WRITE to seeing it DONE
        self.failure: tuple[int, str] | None = None
        self.tolerant = tolerant
        self.lost: dict[int, str] = {}  # tolerant: peer -> what failed towards it
        self._host_notifs: queue.SimpleQueue = queue.SimpleQueue()  # (peer, notification)
        NixlProxy._serial += 1
        name = f"moe_comm-{os.getpid()}-{NixlProxy._serial}-r{rank}"
        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False,
                                                         backends=[self.backend]))
        self._registered = self._agent.register_memory(segment)
        infos: list = [None] * world_size
        dist.all_gather_object(infos, (self._agent.get_agent_metadata(), segment.data_ptr(),
                                       memory.kind, memory.device_id), group=group)
        kinds = {info[2] for info in infos}
        if kinds != {memory.kind}:
            raise ValueError(f"the ranks' segments are of different kinds {sorted(kinds)}: the "
                             "proxy moves host to host or device to device memory")
        self._peer_name: dict[int, str] = {}
        self._peer_base: dict[int, int] = {}
        self._peer_device: dict[int, int] = {}
        for p in self.peers:
            self._peer_name[p] = self._agent.add_remote_agent(infos[p][0])
            self._peer_base[p] = int(infos[p][1])
            self._peer_device[p] = int(infos[p][3])
        self._rank_of = {n: p for p, n in self._peer_name.items()}
        self._inflight: list[tuple[object, int, float, int]] = []  # handle, peer, start, seq
        self._posted = 0  # transfers posted so far (their sequence numbers)
        self._fenced: list[tuple[int, bytes, int]] = []  # peer, notification, after seq
        self._closing = False  # close() asked the thread to say so to every peer
        self._said_closing = False
        self._peers_closing: set[int] = set()
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"moe_comm-proxy-r{rank}",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ kernels' side
    @property
    def ring_addr(self) -> int:
        return self.ring.data_ptr()

    def bytes_by_label(self) -> dict[str, np.ndarray]:
        """Data bytes posted so far per label of the signal raised after them (the channel:
        ``labels`` maps signal offsets to names) and per destination rank (copies). Counts
        every descriptor the kernels published: waits (bounded) for the thread to take those
        still in the ring."""
        deadline = time.monotonic() + min(self.timeout_s, _CLOSE_DRAIN_S)
        while self._pending() and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(1e-4)
        return {label: b.copy() for label, b in self._bytes.items()
                if label != "other" or b.any()}

    def notify(self, peers, signal_off: int, value: int) -> None:
        """Raises the int64 word at ``signal_off`` to at least ``value`` on each of ``peers``
        (a notification, fenced after what was posted to that peer before; sent by the
        thread)."""
        notif = _NOTIF.pack(signal_off, value)
        for peer in peers:
            self._host_notifs.put((peer, notif))

    # ------------------------------------------------------------------ health
    def check(self) -> None:
        """Raises TransportError if a transfer failed or the proxy thread stopped."""
        if self.failure is not None:
            peer, what = self.failure
            raise TransportError(self.rank, peer, what, self.timeout_s)
        if not self._thread.is_alive() and not self._closed:
            raise TransportError(self.rank, self.rank, "this rank's proxy thread stopped, so "
                                 "nothing moves to or from other nodes", self.timeout_s)

    def stop_thread(self) -> None:
        """Stops the thread and leaves everything else as it is (what a crashed proxy leaves:
        tests use it)."""
        self._stop.set()
        self._thread.join(timeout=10)

    def close(self, wait_for_peers: bool = True, gone=()) -> None:
        """Stops the thread after the transfers in flight complete and, with
        ``wait_for_peers``, every peer closes too (each bounded; not the lost ones, nor those in
        ``gone``), then drops the agent and its registration. No thread is left."""
        if self._closed:
            return
        deadline = time.monotonic() + min(self.timeout_s, _CLOSE_DRAIN_S)
        while (self._inflight or self._fenced or self._pending()) and self._thread.is_alive() \
                and time.monotonic() < deadline:
            time.sleep(1e-3)
        self._closing = True
        deadline = time.monotonic() + (self.timeout_s if wait_for_peers else 1.0)
        while self._thread.is_alive() and self.failure is None and time.monotonic() < deadline \
                and not (self._said_closing and (
                    not wait_for_peers
                    or self._peers_closing >= set(self.peers) - set(self.lost) - set(gone))):
            time.sleep(1e-3)
        self._stop.set()
        self._thread.join(timeout=10)
        if not self._said_closing:  # the thread failed or was stopped: tell the peers anyway
            self._say_closing()
        self._closed = True
        for h, *_ in self._inflight:
            try:
                self._agent.release_xfer_handle(h)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        self._inflight, self._fenced = [], []
        try:
            self._agent.deregister_memory(self._registered)
            for name in self._peer_name.values():
                self._agent.remove_remote_agent(name)
        except Exception:  # noqa: BLE001 - a peer may be gone already
            pass
        self._agent = None
        self._segment = None
        self._memory.close()

    # ------------------------------------------------------------------ the thread
    def _pending(self) -> bool:
        taken = int(self._ring[1])
        return int(self._ring[RING_HEADER + (taken % self.slots) * DESC_WORDS]) == taken + 1

    def _run(self) -> None:
        idle = _IDLE_S[0]
        try:
            while not self._stop.is_set() and self.failure is None:
                busy = self._drain_host_notifs()
                busy |= self._drain_ring()
                busy |= self._complete()
                busy |= self._send_fenced()
                busy |= self._apply_notifications()
                if self._closing and not self._said_closing and not (
                        self._fenced or self._inflight or self._pending()):
                    self._say_closing()
                if busy:
                    idle = _IDLE_S[0]
                else:
                    time.sleep(idle)
                    idle = min(2 * idle, _IDLE_S[1])
        except Exception as exc:  # noqa: BLE001 - kept and raised on the Buffer's side
            self._fail(self.rank, f"the proxy thread failed: {exc!r}")

    def _fail(self, peer: int, what: str) -> None:
        if self.tolerant and peer != self.rank and peer in self._peer_name:
            self.lost.setdefault(peer, what)
            return
        if self.failure is None:
            self.failure = (peer, what)

    def _drain_host_notifs(self) -> bool:
        busy = False
        while not self._host_notifs.empty():
            peer, notif = self._host_notifs.get()
            if peer not in self.lost:
                self._fenced.append((peer, notif, self._posted))
            busy = True
        if busy:
            self._send_fenced()
        return busy

    def _drain_ring(self) -> bool:
        busy = False
        while self._pending():
            taken = int(self._ring[1])
            d = self._ring[RING_HEADER + (taken % self.slots) * DESC_WORDS:][:DESC_WORDS]
            peer, signal_off, value, nseg = (int(v) for v in d[1:5])
            segments = [tuple(int(v) for v in d[5 + 5 * s:10 + 5 * s])
                        for s in range(min(nseg, MAX_SEGMENTS))]
            self._post(peer, signal_off, value, segments)
            self._ring[1] = taken + 1
            busy = True
        return busy

    def _post(self, peer: int, signal_off: int, value: int, segments: list[tuple]) -> None:
        if peer not in self._peer_name:
            self._fail(peer, f"a kernel posted to rank {peer}, which this rank's transport "
                             "does not reach")
            return
        if peer in self.lost:  # tolerant: nothing more goes to a peer the transport lost
            return
        local_base, peer_base = self._segment.data_ptr(), self._peer_base[peer]
        here, there = self._memory.device_id, self._peer_device[peer]
        local, remote, total = [], [], 0
        for src, dst, nbytes, stride, rows in segments:
            if nbytes <= 0 or rows <= 0:
                continue
            total += nbytes * rows
            if nbytes == stride:  # contiguous rows: one entry
                local.append((local_base + src, nbytes * rows, here))
                remote.append((peer_base + dst, nbytes * rows, there))
                continue
            for r in range(rows):
                local.append((local_base + src + r * stride, nbytes, here))
                remote.append((peer_base + dst + r * stride, nbytes, there))
        notif = _NOTIF.pack(signal_off, value)
        name = self._peer_name[peer]
        self.messages_to[peer] += 1
        self._bytes[self._labels.get(signal_off, "other")][peer] += total
        try:
            if not local:  # a fence: after every transfer posted to this peer so far
                self._fenced.append((peer, notif, self._posted))
                self._send_fenced()
                return
            handle = self._agent.initialize_xfer(
                "WRITE", self._agent.get_xfer_descs(local, self._memory.kind),
                self._agent.get_xfer_descs(remote, self._memory.kind), name, notif)
            state = self._agent.transfer(handle)
        except Exception as exc:  # noqa: BLE001 - NIXL raises for a lost peer
            self._fail(peer, f"NIXL: {exc!r}")
            return
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            self._fail(peer, "NIXL reported an error posting a transfer")
            return
        self._posted += 1
        self._inflight.append((handle, peer, time.monotonic(), self._posted))

    def _send_fenced(self) -> bool:
        """Sends the fenced notifications whose earlier transfers to their peer are complete
        (in posting order per peer)."""
        if not self._fenced:
            return False
        oldest: dict[int, int] = {}  # per peer, the oldest transfer still in flight
        for _, peer, _, seq in self._inflight:
            oldest[peer] = min(seq, oldest.get(peer, seq))
        keep, held, sent = [], set(), False
        for peer, notif, after in self._fenced:
            if peer in self.lost:
                continue
            if peer in held or oldest.get(peer, after + 1) <= after:
                held.add(peer)
                keep.append((peer, notif, after))
                continue
            try:
                self._agent.send_notif(self._peer_name[peer], notif)
            except Exception as exc:  # noqa: BLE001 - NIXL raises for a lost peer
                self._fail(peer, f"NIXL: {exc!r}")
            sent = True
        self._fenced = keep
        return sent

    def _say_closing(self) -> None:
        notif = _NOTIF.pack(_CLOSING, self.rank)
        for name in self._peer_name.values():
            try:
                self._agent.send_notif(name, notif)
            except Exception:  # noqa: BLE001 - a peer may be gone: nothing more to tell it
                pass
        self._said_closing = True

    def _complete(self) -> bool:
        if not self._inflight:
            return False
        still, now = [], time.monotonic()
        for handle, peer, start, seq in self._inflight:
            if peer in self.lost:  # tolerant: its transfers are given up
                try:
                    self._agent.release_xfer_handle(handle)
                except Exception:  # noqa: BLE001 - the peer is gone
                    pass
                continue
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as exc:  # noqa: BLE001 - NIXL raises for a lost peer
                state = "ERR"
                self._fail(peer, f"NIXL: {exc!r}")
            if state == "PROC":
                if now - start > self.timeout_s:
                    self._fail(peer, f"a transfer did not complete in {self.timeout_s:g} s")
                still.append((handle, peer, start, seq))
                continue
            self._agent.release_xfer_handle(handle)
            self.transfer_seconds += now - start
            if state == "ERR":
                self._fail(peer, "NIXL reported a failed transfer (is the peer gone?)")
        busy = len(still) != len(self._inflight)
        self._inflight = still
        return busy

    def _apply_notifications(self) -> bool:
        notifs = self._agent.get_new_notifs()
        busy = False
        for messages in notifs.values():
            for msg in messages:
                signal_off, value = _NOTIF.unpack(msg)
                if signal_off == _CLOSING:
                    self._peers_closing.add(value)
                    busy = True
                    continue
                self._memory.raise_to(signal_off // 8, value)
                busy = True
        return busy
