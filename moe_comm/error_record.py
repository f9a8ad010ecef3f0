"""The error record the kernels write and the host raises from, without a synchronisation.

``ERRORS_WORDS`` int64 words (layout in ``moe_comm.kernels.comm``): ``[0:4]`` the first timeout
of a bounded wait (flag, peer, expected epoch, observed epoch), ``[4:8]`` the first bad input a
kernel found (flag, code, token or rows, value). A flag reads -1 while a kernel fills its part
and 1 once it is complete. On GPUs the record is pinned host memory that the kernels reach by
unified addressing, so the host reads it at any time without waiting for the device: an error
is raised by the first check after the kernel wrote it (the call itself on CPU ranks, where
kernels finish before the launch returns; on GPUs the next call or hook, or the one host
synchronisation of a normal dispatch). Reading goes through a numpy view: no tensor is read.
"""
from __future__ import annotations

import numpy as np
import torch

from .call_descriptor import REFUSED_BIT, PeerInputError, call_name, describe
from .kernels import comm
from .kernels.comm import ERRORS_WORDS, PeerTimeoutError

TIMEOUT_RECORD, INPUT_RECORD = comm.TIMEOUT_RECORD.value, comm.INPUT_RECORD.value
BAD_EXPERT_ID, REPEATED_EXPERT = comm.BAD_EXPERT_ID.value, comm.REPEATED_EXPERT.value
TOO_MANY_ROWS, CALL_DIFFERS = comm.TOO_MANY_ROWS.value, comm.CALL_DIFFERS.value
SLOT_BITS, EPOCH_SHIFT = comm.SLOT_BITS.value, comm.EPOCH_SHIFT.value


class ErrorRecord:
    """One Buffer's record: ``tensor`` (what kernels get the address of) and the checks."""

    def __init__(self, device: torch.device):
        pinned = device.type == "cuda"
        self.tensor = torch.zeros(ERRORS_WORDS, dtype=torch.int64, pin_memory=pinned)
        # the host's view: every op reads its flags (words[TIMEOUT_RECORD], words[INPUT_RECORD])
        self.words: np.ndarray = self.tensor.numpy()

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()

    @property
    def timeout_part(self) -> torch.Tensor:
        """The [4] timeout words (the record the csrc/ kernels write)."""
        return self.tensor[TIMEOUT_RECORD:TIMEOUT_RECORD + 4]

    @property
    def input_part(self) -> torch.Tensor:
        """The [4] input words (a source's other call descriptor, from the csrc/ receive)."""
        return self.tensor[INPUT_RECORD:INPUT_RECORD + 4]

    def timed_out(self) -> bool:
        return bool(self.words[TIMEOUT_RECORD] == 1)

    def raise_timeout(self, *, rank: int, channel: str, timeout_s: float) -> None:
        """PeerTimeoutError if a wait recorded a timeout (the record stays: the Buffer is
        unusable from then on)."""
        flag, peer, expected, observed = self.words[TIMEOUT_RECORD:TIMEOUT_RECORD + 4].tolist()
        if flag == 1:
            raise PeerTimeoutError(rank, peer, channel, expected, observed, timeout_s)

    def check_signal_words(self, words, epoch: int, me: int) -> None:
        """The host's ``kernels.comm.check_signal_words``: of a combine's signal words
        ``words`` (word i published for rank i; ``epoch << 32 | descriptor << 18``), those of
        ``epoch``, the first whose descriptor is not this rank's is recorded in the input part
        (unless it holds an error)."""
        values = [int(w) for w in words]
        mine = (values[me] & 0xFFFFFFFF) >> SLOT_BITS
        for rank, word in enumerate(values):
            theirs = (word & 0xFFFFFFFF) >> SLOT_BITS
            if word >> EPOCH_SHIFT == epoch and theirs != mine:
                part = self.words[INPUT_RECORD:INPUT_RECORD + 4]
                if int(part[0]) == 0:
                    part[1:] = (CALL_DIFFERS, rank, theirs | mine << 16 | epoch << 32)
                    part[0] = 1
                return

    def take_self_exclusion(self, rank: int) -> bool:
        """True, and the timeout part cleared, if the recorded timeout names ``rank`` itself:
        a fault-tolerant kernel's way of saying this rank found itself excluded."""
        part = self.words[TIMEOUT_RECORD:TIMEOUT_RECORD + 4]
        if int(part[0]) != 1 or int(part[1]) != rank:
            return False
        part[:] = 0
        return True

    def raise_input_error(self, *, rank: int, what: str) -> None:
        """ValueError (bad expert id, repeated expert; PeerInputError: a source refused the
        call or sent another call descriptor) or RuntimeError (too many rows) if a
        kernel recorded one; the part is cleared first, so the Buffer stays usable (every rank
        completed the call)."""
        if self.words[INPUT_RECORD] != 1:
            return
        part = self.words[INPUT_RECORD:INPUT_RECORD + 4]
        flag, code, a, b = part.tolist()
        part[:] = 0
        if code == BAD_EXPERT_ID:
            raise ValueError(f"moe_comm rank {rank}: {what}: topk_idx row {a} holds expert id "
                             f"{b}; ids must be in [0, num_experts) or -1 for an unused choice "
                             "(the row was sent nowhere)")
        if code == REPEATED_EXPERT:
            raise ValueError(f"moe_comm rank {rank}: {what}: topk_idx row {a} picks expert {b} "
                             "twice; each row must name distinct experts or -1 (the row was "
                             "sent nowhere)")
        if code == TOO_MANY_ROWS:
            raise RuntimeError(f"moe_comm rank {rank}: {what}: {a} rows arrived but "
                               f"max_recv_rows={b}; the rows past it were dropped. Pass a "
                               "larger max_recv_rows (or None: exact size, one host sync)")
        if code == CALL_DIFFERS:  # b: theirs | mine << 16 | epoch << 32
            theirs, mine, epoch = b & 0xFFFF, b >> 16 & 0xFFFF, b >> 32
            call = f"the {call_name(mine)} of epoch {epoch}"
            did = (f"refused {call}" if theirs >> REFUSED_BIT & 1 else
                   f"made {call} with other options")
            raise PeerInputError(f"moe_comm rank {rank}: {what}: rank {a} {did}: "
                                 f"{describe(theirs, mine)}. Every rank completed the call; "
                                 "the Buffer stays usable", a)
        raise RuntimeError(f"moe_comm rank {rank}: {what}: unknown error code {code} "
                           f"({a}, {b})")
