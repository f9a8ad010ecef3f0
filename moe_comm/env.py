"""Environment variables read by moe_comm (all listed in the README's table)."""
from __future__ import annotations

import os

DEFAULT_TIMEOUT_S = 120.0


def _positive(name: str, default, convert, what: str):
    """The positive number in ``name`` (``convert``: float or int; ``what`` names its kind in
    the error), ``default`` where unset."""
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = convert(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {what}") from None
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    return value


def timeout_s() -> float:
    """``MOE_COMM_TIMEOUT_S``: seconds a rank waits for a peer before failing (default 120)."""
    return _positive("MOE_COMM_TIMEOUT_S", DEFAULT_TIMEOUT_S, float, "a number of seconds")


def check_inputs() -> bool:
    """``MOE_COMM_CHECK_INPUTS``: 0 skips the host-side checks of types, shapes, devices and
    handles, except the sizes that keep the kernels inside their buffers
    (``validation.check_dispatch_bounds``, ``check_combine_bounds``); none of them reads tensor
    data, and the kernels check the expert ids either way."""
    return os.environ.get("MOE_COMM_CHECK_INPUTS", "1") != "0"


def kernel_waits() -> bool:
    """``MOE_COMM_WAIT``: ``host`` (default) or ``kernel``. On CPU ranks, ``kernel`` runs the
    GPU flavour's bounded waits inside the (interpreted) kernels instead of polling from the
    host, so the GPU protocol, timeouts included, is exercised on any machine."""
    raw = os.environ.get("MOE_COMM_WAIT", "host")
    if raw not in ("host", "kernel"):
        raise ValueError(f"MOE_COMM_WAIT must be 'host' or 'kernel', got {raw!r}")
    return raw == "kernel"


def ranks_per_node(default: int) -> int:
    """``MOE_COMM_RANKS_PER_NODE``: ranks per node of ``moe_comm.deep_ep``'s internode mode
    (``default`` where unset)."""
    return _positive("MOE_COMM_RANKS_PER_NODE", default, int, "an int (ranks per node)")
