"""One rank's workspace as its two channels (dispatch, combine) see it: the regions, the epoch
each channel issued last, its signal, ticket and epoch words, and where its sends write on
every peer. Views are made once (the segment never moves, so a bound launch finds the same
tensors on every call); nothing here launches or waits.

Equivalent to, for a channel ``c`` (``workspace.DISPATCH`` or ``COMBINE``) of rank ``me``::

    region(name)      = layout.view(heap, name)           # [P, R, ...] over this rank's segment
    epochs[c] += 1                                          # a call's epoch; parity = epoch % 2
    words[c]          = (tickets[c:c+1], epoch_words[c:c+1])
    signals_of[c]     = signals[c]                          # [R] int64, one word per source
    staging(c)        = (region(f"{name}_rows"), region(f"{name}_meta"))
    staging_of[c]     = staging(c)                          # made at set-up
    dispatch_counts   = region("dispatch_counts")           # made at set-up
    send_offsets(c)   = {"rows": (offset of me's slice in parity 0, bytes per parity), ...}
"""
from __future__ import annotations

import torch

from .workspace import COMBINE, DISPATCH, WorkspaceLayout

CHANNEL_NAMES = {DISPATCH: "dispatch", COMBINE: "combine"}


class Channels:
    """``heap`` (a ``symm.SymmetricHeap``) laid out as ``layout``. ``epochs`` and
    ``ll_epochs``: the last epoch issued per channel by the normal and the low-latency mode
    (host mirrors of the device's words); ``signals`` [2, R] int64, ``signal_words`` the same
    as numpy on CPU ranks (host polls; None on GPUs); ``tickets`` and ``epoch_words``: the
    kernels' ticket and epoch words."""

    def __init__(self, heap, layout: WorkspaceLayout):
        self.heap, self.layout, self.rank = heap, layout, heap.rank
        self.epochs = [0, 0]
        self.ll_epochs = [0, 0]
        self.signals = layout.view(heap, "signals")
        self.signal_words = self.signals.numpy() if heap.device.type == "cpu" else None
        self.tickets = layout.view(heap, "tickets")
        self.epoch_words = layout.view(heap, "epochs")
        # per channel, made once (a bound launch finds a view by its id): its (ticket word,
        # epoch word) [1] int64 views the kernels update, and its [R] int64 signal words
        self.words = tuple((self.tickets[c:c + 1], self.epoch_words[c:c + 1])
                           for c in (DISPATCH, COMBINE))
        self.signals_of = tuple(self.signals[c] for c in (DISPATCH, COMBINE))
        self.regions: dict[str, torch.Tensor] = {}
        self._views: dict = {}
        # what every normal-mode call reads, made once (attributes: no call per op)
        self.staging_of = tuple(self.staging(c) for c in (DISPATCH, COMBINE))
        self.dispatch_counts = self.region("dispatch_counts")

    def region(self, name: str) -> torch.Tensor:
        """The workspace region ``name`` over this rank's segment, made once."""
        view = self.regions.get(name)
        if view is None:
            view = self.regions[name] = self.layout.view(self.heap, name)
        return view

    def staging(self, channel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The channel's whole staging regions (rows, meta) [P, R, T_max, ...]: the receive
        kernels pick the parity from the epoch on the device."""
        name = CHANNEL_NAMES[channel]
        return self.region(f"{name}_rows"), self.region(f"{name}_meta")

    def send_offsets(self, channel: int) -> dict:
        """Where this rank's sends of ``channel`` write on every peer: name -> (byte offset of
        this rank's slice in parity 0, bytes per parity); ``signal`` -> byte offset. The
        kernels add the parity of the epoch they read on the device."""
        offsets = self._views.get(("send", channel))
        if offsets is None:
            lay, me = self.layout, self.rank
            name = CHANNEL_NAMES[channel]
            regions = [f"{name}_rows", f"{name}_meta"] + (["dispatch_counts"]
                                                           if channel == DISPATCH else [])
            offsets = {r.split("_", 1)[1]: (lay.offset(r, 0, me), lay.parity_stride(r))
                       for r in regions}
            offsets["signal"] = lay.offset("signals", channel, me)
            self._views[("send", channel)] = offsets
        return offsets
