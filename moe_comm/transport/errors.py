"""The error a transport raises: a PeerTimeoutError that names the peer (and the cause)."""
from __future__ import annotations

from ..kernels.comm import PeerTimeoutError


class TransportError(PeerTimeoutError):
    """The transport failed towards ``peer`` (a NIXL error, a transfer or a full ring past the
    timeout, or this rank's proxy thread stopped)."""

    def __init__(self, rank: int, peer: int, what: str, timeout_s: float):
        self.what = what
        RuntimeError.__init__(
            self, f"moe_comm rank {rank}: the transport to rank {peer} failed: {what} "
            f"(timeout {timeout_s:g} s)")
        self.rank, self.peer, self.channel, self.via = rank, peer, "transport", None
        self.expected = self.observed = -1
