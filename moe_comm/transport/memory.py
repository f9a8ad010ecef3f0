"""Where the proxy's segment lives: the host (CPU ranks) or a GPU. The proxy thread asks three
things of it: the memory kind of its NIXL descriptors, a ring the kernels can post to, and the
raising of a signal word once a notification says its data landed.

=======================  ==================================  ===================================
                         ``HostMemory`` (CPU ranks)          ``DeviceMemory`` (GPUs)
=======================  ==================================  ===================================
descriptors              ``DRAM``, device id 0               ``VRAM``, the segment's GPU
ring                     plain host memory                   pinned host memory (the kernels
                                                             reach it by its host address: UVA)
raising a signal word    a store through a numpy view        an 8-byte copy from pinned memory
                                                             on the proxy's own non-blocking
                                                             stream, waited for before the next
=======================  ==================================  ===================================

Either way a word is only ever raised (``word = max(word, value)``), and only after NIXL
delivered the notification, which it does once the transfer's data is in place: a kernel that
sees the value (an acquire load on GPUs) sees the rows. On a GPU the copy runs on a stream that
does not wait for the kernels, which may be spinning on that very word.
"""
from __future__ import annotations

import torch


class HostMemory:
    """A segment in host memory (CPU ranks)."""

    kind, device_id = "DRAM", 0

    def __init__(self, segment: torch.Tensor):
        self._words = segment.view(torch.int64).numpy()  # signal words (8-byte aligned)

    def new_ring(self, words: int) -> torch.Tensor:
        return torch.zeros(words, dtype=torch.int64)

    def raise_to(self, word: int, value: int) -> bool:
        """``words[word] = max(words[word], value)``; whether it rose."""
        if self._words[word] >= value:
            return False
        self._words[word] = value
        return True

    def close(self) -> None:
        self._words = None


class DeviceMemory:
    """A segment in a GPU's memory. The words it raises are written by this proxy alone (the
    signals of peers on other nodes), so it keeps what it last wrote to each and reads a word
    from the device only the first time."""

    kind = "VRAM"

    def __init__(self, segment: torch.Tensor):
        self.device_id = segment.device.index if segment.device.index is not None \
            else torch.cuda.current_device()
        self._words = segment.view(torch.int64)
        self._stream = torch.cuda.Stream(segment.device)  # non-blocking: kernels may spin
        self._value = torch.empty(1, dtype=torch.int64, pin_memory=True)
        self._known: dict[int, int] = {}

    def new_ring(self, words: int) -> torch.Tensor:
        return torch.zeros(words, dtype=torch.int64, pin_memory=True)

    def raise_to(self, word: int, value: int) -> bool:
        """``words[word] = max(words[word], value)`` in device memory, complete on return."""
        with torch.cuda.stream(self._stream):
            if word not in self._known:
                now = self._words[word:word + 1].to("cpu", non_blocking=True)
                self._stream.synchronize()
                self._known[word] = int(now[0])
            if self._known[word] >= value:
                return False
            self._value[0] = value
            self._words[word:word + 1].copy_(self._value, non_blocking=True)
            self._stream.synchronize()
        self._known[word] = value
        return True

    def close(self) -> None:
        self._words = None


def segment_memory(segment: torch.Tensor):
    """The :class:`HostMemory` or :class:`DeviceMemory` of ``segment``."""
    if segment.device.type == "cpu":
        return HostMemory(segment)
    if segment.device.type == "cuda":
        return DeviceMemory(segment)
    raise ValueError(f"the proxy moves host or CUDA memory, got a segment on {segment.device}")
