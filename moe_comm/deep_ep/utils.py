"""``deep_ep.utils`` equivalents: events that order work between streams.

DeepEP returns an ``EventOverlap`` from every call: with ``async_finish=True`` the call's work
runs on a communication stream and the caller waits with ``event.current_stream_wait()`` (or
uses it as a context manager around work that overlaps it). moe_comm runs every op on the
caller's current stream, so the work is ordered already: the events here record a CUDA event on
GPUs (``current_stream_wait`` makes the current stream wait for it) and are no-ops on CPU ranks.
``extra_tensors`` keeps tensors alive until the event is waited for, as DeepEP's does.
"""
from __future__ import annotations

import torch


class EventHandle:
    """A point on the current stream (DeepEP: ``EventHandle()`` records one)."""

    def __init__(self):
        self.event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record()

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """What every DeepEP call returns as its event: ``current_stream_wait()``, and a context
    manager (``with event: ...`` overlaps the block with the event's work, then waits)."""

    def __init__(self, event: EventHandle | None = None,
                 extra_tensors: tuple[torch.Tensor, ...] | None = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            self.event.current_stream_wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()
