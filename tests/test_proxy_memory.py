"""The proxy's two memories (``moe_comm.transport.memory``): what its thread does with a segment
in host memory and in device memory, checked without a GPU (the device half's CUDA calls are
stood in for, its bookkeeping is real); tests/test_gpu_processes.py runs it on a GPU."""
import contextlib
import types

import pytest
import torch

from moe_comm.transport import memory
from moe_comm.transport.nixl import _NOTIF, NixlProxy


class _Stream:
    def __init__(self, events):
        self.events = events

    def synchronize(self):
        self.events.append("synchronize")


def _device_memory(monkeypatch, words: torch.Tensor, events: list) -> memory.DeviceMemory:
    """A DeviceMemory over ``words`` (a CPU tensor standing for device memory) whose stream
    records its synchronisations; every copy inside runs on that stream."""
    monkeypatch.setattr(memory.torch.cuda, "stream",
                        lambda s: events.append("on proxy stream") or contextlib.nullcontext())
    mem = memory.DeviceMemory.__new__(memory.DeviceMemory)
    mem.device_id, mem._words, mem._stream = 3, words, _Stream(events)
    mem._value, mem._known = torch.empty(1, dtype=torch.int64), {}
    return mem


def test_device_signals_only_rise_and_each_write_completes_before_the_next(monkeypatch):
    events = []
    words = torch.tensor([0, 5, 1 << 62, 0], dtype=torch.int64)
    mem = _device_memory(monkeypatch, words, events)
    assert mem.raise_to(1, 7) is True  # first touch: read, then write, each waited for
    assert events == ["on proxy stream", "synchronize", "synchronize"]
    assert words.tolist() == [0, 7, 1 << 62, 0]
    del events[:]
    assert mem.raise_to(1, 6) is False and mem.raise_to(1, 7) is False  # never lower
    assert events == ["on proxy stream", "on proxy stream"]  # known: no device read
    assert mem.raise_to(2, 3) is False  # a word never signalled in this mode stays so
    assert mem.raise_to(3, 2) and mem.raise_to(3, 9) and words.tolist() == [0, 7, 1 << 62, 9]
    mem.close()


def test_host_signals_only_rise():
    seg = torch.zeros(32, dtype=torch.uint8)
    mem = memory.segment_memory(seg)
    assert (mem.kind, mem.device_id) == ("DRAM", 0)
    assert mem.raise_to(2, 4) and not mem.raise_to(2, 3)
    assert seg.view(torch.int64).tolist() == [0, 0, 4, 0]
    assert mem.new_ring(6).tolist() == [0] * 6
    with pytest.raises(ValueError, match="host or CUDA memory"):
        memory.segment_memory(torch.empty(8, dtype=torch.uint8, device="meta"))


def test_device_segments_go_as_vram_between_the_ranks_gpus(monkeypatch):
    """A descriptor's segments become NIXL descriptors of device memory on this rank's GPU
    (source) and the peer's (destination), contiguous rows as one entry, strided rows each on
    their own; its notification carries the signal; a notification raises the word."""
    calls, received = [], []
    agent = types.SimpleNamespace(
        get_xfer_descs=lambda descs, kind: (kind, list(descs)),
        initialize_xfer=lambda op, local, remote, name, notif: calls.append(
            (op, local, remote, name, notif)) or "handle",
        transfer=lambda handle: "PROC",
        get_new_notifs=lambda: {"peer": received})
    proxy = NixlProxy.__new__(NixlProxy)
    events = []
    words = torch.zeros(8, dtype=torch.int64)
    proxy._memory = _device_memory(monkeypatch, words, events)
    proxy._agent, proxy._segment = agent, types.SimpleNamespace(data_ptr=lambda: 1000)
    proxy._peer_name, proxy._peer_base, proxy._peer_device = {1: "peer"}, {1: 5000}, {1: 0}
    proxy.lost, proxy.messages_to, proxy._labels = {}, [0, 0], {}
    proxy._bytes, proxy._posted, proxy._inflight, proxy._peers_closing = \
        {"other": [0, 0]}, 0, [], set()
    proxy._post(1, 48, 9, [(16, 32, 8, 8, 2), (64, 96, 4, 16, 2)])
    (op, local, remote, name, notif), = calls
    assert op == "WRITE" and name == "peer"
    assert local == ("VRAM", [(1016, 16, 3), (1064, 4, 3), (1080, 4, 3)])
    assert remote == ("VRAM", [(5032, 16, 0), (5096, 4, 0), (5112, 4, 0)])
    assert proxy._bytes["other"][1] == 24 and proxy._inflight[0][1] == 1
    assert _NOTIF.unpack(notif) == (48, 9)
    received.append(notif)  # what the peer's proxy receives once the rows are there
    assert proxy._apply_notifications() and words.tolist() == [0] * 6 + [9, 0]
