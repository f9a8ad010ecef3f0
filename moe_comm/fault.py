"""Fault tolerance: the active-rank mask, and calls that complete on the survivors.

``Buffer.fault`` (a :class:`FaultPolicy`; built with ``fault_tolerant=True``)::

    buf = moe_comm.Buffer(group, ..., fault_tolerant=True)
    res = buf.dispatch(x, topk_idx, w)     # a rank silent for timeout_s is excluded, the
    out = buf.combine(y, res.handle, res.weights)   # call completes on the others
    buf.active_ranks()                     # bool [R], True = active
    buf.clean_mask()                       # collective over the live ranks: one mask again

**The mask.** Every segment holds one int64 word per rank (``ft_mask``): 0 while the rank is
active, else 1 + the rank that excluded it. Excluding a rank writes its word on *every* rank
(stores through the peer pointers, the same path as the signals), so every rank learns it at
its next wait, not only the one that timed out. A wait never waits for an excluded rank; a
wait that times out on rank ``p`` excludes ``p`` and the call goes on (on CPU ranks from the
host, on GPUs inside the kernels: ``kernels.comm.wait_or_exclude``). Polarity: True / 1 =
active, as NCCL EP's ``ncclEpMaskQuery``, Mooncake's ``active_ranks`` and FlashInfer's
``query_active_mask``; DeepEP's ``low_latency_query_mask_buffer`` and NIXL-EP's mask buffer
hold the opposite (1 = masked): ``~buf.active_ranks()``.

**Dead processes on this node** (host waits): a peer whose process has ended is excluded at
the next poll, without waiting for the timeout; a silent live peer, a peer on another node, and
every in-kernel wait (GPUs) take the timeout.

**What a call computes.** Equivalent PyTorch, with ``live[s]``: rank ``s`` published this call's
epoch before it was excluded (``alive`` at send time: not excluded when the send began)::

    dispatch:  topk_idx_s[t, k] := -1 where rank_of(topk_idx_s[t, k]) is not alive
               rows from source s only if live[s]; tokens_per_expert counts what arrived
    combine:   out[t] = sum(w[t, k] * y(t, k) for k if live[rank_of(topk_idx[t, k])])
               renormalize=True: out[t] *= sum_k w[t, k] / sum_live_k w[t, k] (0 if none)

A token whose experts are all on excluded ranks comes back as zeros: add the residual (or the
shared expert) as usual, it is the only part left. Weights are not renormalised by default.

**In rounds** (bounded staging, ``moe_comm.normal_mode``; one node, or flat across nodes
through the proxy) each round's wait
excludes on its own, so ``live_i[s]``: rank ``s`` published round ``i``'s epoch. A dispatch
places every row by round 0's layout (the call's per-expert counts of the sources of
``live_0``); a later round takes the rows of the sources in ``live_i`` and ``live_0``, so the
rows of a source that stops after round ``j`` of the window ``[i * W, (i + 1) * W)``, ``i >
j``, stay as padding rows are (zero, ``src_rank`` / ``src_token`` -1, weight 0) and
``tokens_per_expert`` still counts them. A combine sums the tokens of window ``i`` over
``live_i`` (``renormalize=True`` likewise, per token); where a call's rounds run in one
launch (a process per rank, waits in the kernels, one node or flat through the proxy; a
dispatch's after its round 0, whose send decides ``live_0``) the first program of each round
decides ``live_i`` for every program (``kernels.comm.wait_or_exclude_once``; through the proxy
its exclusion reaches the ranks of its node, and a rank on another node excludes the same
silent source at its own deadline, as the per-round wait kernel does there)::

    dispatch:  rows of (s, t) arrive iff live_0[s] and live_{t // W}[s]; the others zero
    combine:   out[t] = sum(w[t, k] * y(t, k) for k if live_{t // W}[rank_of(topk_idx[t, k])])

A rank's own exclusion still ends its calls: each round's wait checks it, as a call's wait
does.

**Stale writes** (a rank that was only slow). Fence: every send of a fault-tolerant Buffer
first checks this rank's own mask word (CPU ranks: the host, before the launch; GPUs: the
layout kernel and the low-latency sends' waits, on the device); an excluded rank writes no row
and its calls raise :class:`RankExcludedError` until ``clean_mask(readmit=True)``; so does a
receive that finds it excluded by its end (what it got may be a later call's). Where a late write
can still land (a rank stalled for longer than the timeout between that check and its last
store), the layout keeps it harmless in the normal mode and the low-latency dispatch: staging is
per source rank, and a receive reads a source's slice only under this call's epoch (normal
mode: the source's signal, which the others no longer wait for or read once it is excluded;
low latency: the count word carries the epoch). The low-latency combine stages one row per
(token, choice) on the home rank, so there the check is the only fence. Tested on CPU ranks: a
rank stopped right after its check writes its rows late while the others go on.

**Across nodes** (the proxy, flat mode): the proxy of a fault-tolerant Buffer keeps a failure
towards one peer to that peer (drops what is posted to it, serves the others), and the mask and
``clean_mask`` words reach the other nodes as notifications (raised to at least the value).

**clean_mask.** Collective over the live ranks through the symmetric memory (a process group
may hold dead members): each announces itself, waits (bounded) for the ranks it believes
active (``readmit=True``: for every rank), and the mask becomes, on every participant, exactly
"excluded = did not announce". Epochs are set to the largest any participant reached, so a
readmitted rank rejoins the next call. No call may be in flight.
"""
from __future__ import annotations

import time
import warnings

import numpy as np
import torch
import triton

from .kernels.comm import set_word_on_all_kernel, wait_for_live_epochs
from .symm.shm import pid_alive


def renormalized(out: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 reached: torch.Tensor) -> torch.Tensor:
    """``out[t] * sum_k w[t, k] / sum_k w[t, k] * reached[t, k]`` over the used choices
    (``topk_idx >= 0``; 0 where nothing reached), in fp32, rounded to ``out.dtype``;
    ``reached`` [T, K] bool: the choice's expert rank contributed. Differentiable in ``out`` and
    ``topk_weights``."""
    w = topk_weights.float() * (topk_idx >= 0)
    total = w.sum(1)
    surviving = (w * reached).sum(1)
    factor = torch.where(surviving != 0, total / torch.where(surviving != 0, surviving, 1), 0)
    return (out.float() * factor[:, None]).to(out.dtype)


class RankExcludedError(RuntimeError):
    """This rank was excluded from the expert-parallel group (it was silent for longer than the
    timeout, or was masked on purpose). Its calls are refused, and the Buffer stays usable:
    ``clean_mask(readmit=True)`` on every live rank takes it back."""

    def __init__(self, rank: int, by: int):
        self.rank, self.by = rank, by
        super().__init__(
            f"moe_comm rank {rank} was excluded from the expert-parallel group by rank {by} "
            f"(rank {rank} was silent for longer than the timeout, or was masked on purpose); "
            "its calls are refused until every live rank calls clean_mask(readmit=True)")


def reached(topk_idx: torch.Tensor, rank_contributed: torch.Tensor, num_local_experts: int,
            num_experts: int) -> torch.Tensor:
    """[T, K] bool: the choice is used and its expert's rank contributed (``rank_contributed``
    [R] bool, or [T, R] bool: per token)."""
    owner = (topk_idx.clamp(min=0) // num_local_experts).clamp(
        max=rank_contributed.shape[-1] - 1)
    contributed = (rank_contributed[owner] if rank_contributed.dim() == 1
                   else rank_contributed.gather(1, owner))
    return (topk_idx >= 0) & (topk_idx < num_experts) & contributed


class FaultPolicy:
    """What a Buffer does about silent ranks: the exclusion mask in its workspace (``mask``
    [R] int64 over ``ft_mask``; ``mask_words`` the same as numpy on CPU ranks, None on GPUs),
    host waits that exclude a peer silent for the timeout (:meth:`wait`), and the two rounds by
    which the live ranks agree on the mask and the epochs (:meth:`agree`, ``clean_mask``'s).
    ``enabled``: the Buffer was built with ``fault_tolerant=True`` (else only :meth:`require`
    and :meth:`active_ranks` are called). ``observe_through(observe)``: ``observe`` as a host
    wait calls it (through the proxy: a transport failure raises first). ``launches``: the
    Buffer's launch counts (an exclusion is one launch)."""

    def __init__(self, channels, flavour, proxy, *, enabled: bool, timeout_s: float,
                 launches, observe_through):
        self.channels, self.flavour, self.proxy = channels, flavour, proxy
        self.heap, self.layout = channels.heap, channels.layout
        self.rank, self.world_size = channels.heap.rank, channels.heap.world_size
        self.enabled, self.timeout_s = bool(enabled), timeout_s
        self.launches, self._observe_through = launches, observe_through
        self.mask = channels.region("ft_mask")
        self.mask_words = self.mask.numpy() if self.heap.device.type == "cpu" else None
        self.clean_serial = 0
        self.peer_pids: dict[int, int] = {}  # peers on this node: rank -> process id
        self._pids_checked = 0.0
        self.exclusions: list[tuple[int, str, float]] = []  # (rank, channel, seconds waited)

    def require(self, what: str) -> None:
        if not self.enabled:
            raise RuntimeError(f"{what} needs a Buffer built with fault_tolerant=True")

    def active_ranks(self) -> torch.Tensor:
        """bool [R]: True where the rank is active in this rank's view."""
        return self.mask == 0

    def set_on_all(self, word_off: int, index: int, value: int) -> None:
        """Word ``index`` of the int64 array at ``word_off`` := ``value`` on every rank (through
        the proxy on other nodes: raised to at least ``value``)."""
        set_word_on_all_kernel[(1,)](self.heap.peer_ptrs, word_off, index, value,
                                     self.world_size, self.heap.local.data_ptr(),
                                     BLOCK_R=triton.next_power_of_2(self.world_size),
                                     TRANSPORT=self.flavour.transport)
        if self.proxy is not None:
            self.proxy.notify(self.proxy.peers, word_off + 8 * index, value)

    def exclude(self, peer: int) -> None:
        """Word ``peer`` of every rank's mask := this rank + 1 (one small launch)."""
        self.set_on_all(self.layout["ft_mask"].offset, peer, self.rank + 1)
        self.launches["exclude"] += 1

    def check_self(self) -> None:
        """Raises RankExcludedError if this rank is excluded (CPU ranks read the word from
        host memory; on GPUs the kernels check it and write nothing)."""
        if self.enabled and self.mask_words is not None:
            by = int(self.mask_words[self.rank])
            if by:
                raise RankExcludedError(self.rank, by - 1)

    def wait(self, observe, expected: int, channel: str,
             peers: list[int] | None = None) -> list[float | None]:
        """Host wait of a fault-tolerant Buffer: ``observe()[i]`` (published for rank
        ``peers[i]``, default i) reaches ``expected`` or that rank is excluded; ranks silent
        for the timeout are excluded on every rank. Returns the seconds each took, None for
        those that did not arrive. Raises RankExcludedError if this rank was excluded by the
        end of the wait (a rank cut off from everyone is the one excluded, and what it received
        may belong to calls the others made without it)."""
        peers = list(range(self.world_size)) if peers is None else peers
        index = np.asarray(peers)
        words = self.mask_words

        def excluded():
            self._exclude_dead_processes(channel)
            return words[index] != 0

        seconds, behind = wait_for_live_epochs(
            self._observe_through(observe), expected, excluded, timeout_s=self.timeout_s)
        self.check_self()  # excluded meanwhile: what arrived may be a later call's
        if behind:
            for i in behind:
                warnings.warn(f"moe_comm rank {self.rank}: rank {peers[i]} was silent for "
                              f"{self.timeout_s:g} s on the {channel} channel (expected epoch "
                              f">= {expected}); it is excluded and the call goes on without it",
                              RuntimeWarning, stacklevel=3)
                self.exclude(peers[i])
                self.exclusions.append((peers[i], channel, self.timeout_s))
        return seconds

    def _exclude_dead_processes(self, channel: str) -> None:
        """Peers on this node whose process has ended (or is a zombie) are excluded at once,
        without waiting for the timeout (checked at most every 20 ms; a live but silent peer
        still takes the timeout)."""
        now = time.monotonic()
        if not self.peer_pids or now - self._pids_checked < 0.02:
            return
        self._pids_checked = now
        for peer, pid in self.peer_pids.items():
            if self.mask_words[peer] == 0 and not pid_alive(pid):
                warnings.warn(f"moe_comm rank {self.rank}: the process of rank {peer} (pid "
                              f"{pid}) has ended; it is excluded and the call goes on without "
                              "it", RuntimeWarning, stacklevel=4)
                self.exclude(peer)
                self.exclusions.append((peer, channel, 0.0))

    def agree(self, readmit: bool) -> list[int]:
        """``clean_mask``'s collective (no call in flight, every earlier kernel done): every
        participant announces itself and its epochs on every rank, two bounded rounds decide
        who came (``readmit``: every rank is waited for and those that come are taken back);
        returns the largest epoch of each channel (normal dispatch, combine, then the
        low-latency ones) over the ranks that came and are active."""
        # the serial every participant agrees on: one past the last clean any rank finished
        # (its second round's words reach every rank, excluded ones too)
        done = self.channels.region("ft_clean")[1]
        self.clean_serial = max(self.clean_serial, int(done.max())) + 1
        serial, me, R = self.clean_serial, self.rank, self.world_size
        if readmit:
            self.mask.zero_()  # this rank's view; the rounds exclude who does not come
        for j, epoch in enumerate([*self.channels.epochs, *self.channels.ll_epochs]):
            self.set_on_all(self.layout.offset("ft_epochs", me, j), 0, epoch)
        joined = self._clean_round(0, serial, list(range(R)) if readmit else None)
        joined = self._clean_round(1, serial, [s for s in range(R) if joined[s]])
        if readmit:  # a mark another rank set before its own clean_mask may have landed here
            for s in range(R):  # after this one began: every rank that came is taken back
                if joined[s]:
                    self.mask[s] = 0
        table = self.channels.region("ft_epochs").cpu()
        active = (self.mask == 0).cpu()
        return table[torch.tensor(joined) & active].amax(0).tolist()

    def _clean_round(self, i: int, serial: int, waited: list[int] | None) -> list[bool]:
        """Announces ``serial`` in ``ft_clean[i]`` on every rank and waits (bounded) for
        ``waited`` (default: the ranks active in this rank's view); excludes on every rank
        those that do not come. Returns who came."""
        R = self.world_size
        self.set_on_all(self.layout.offset("ft_clean", i), self.rank, serial)
        if waited is None:
            waited = [s for s in range(R) if int(self.mask[s]) == 0]
        words = self.channels.region("ft_clean")[i]
        seconds, behind = wait_for_live_epochs(
            lambda: words[waited].tolist(), serial, None,
            timeout_s=self.timeout_s)
        for j in behind:
            self.exclude(waited[j])
        joined = [False] * R
        for s, t in zip(waited, seconds):
            joined[s] = t is not None
        joined[self.rank] = True
        return joined
