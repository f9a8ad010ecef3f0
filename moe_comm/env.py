"""Environment variables read by moe_comm (all listed in the README's table)."""
from __future__ import annotations

import os

DEFAULT_TIMEOUT_S = 120.0


def timeout_s() -> float:
    """``MOE_COMM_TIMEOUT_S``: seconds a rank waits for a peer before failing (default 120)."""
    raw = os.environ.get("MOE_COMM_TIMEOUT_S", "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"MOE_COMM_TIMEOUT_S={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"MOE_COMM_TIMEOUT_S must be positive, got {raw!r}")
    return value


def check_inputs() -> bool:
    """``MOE_COMM_CHECK_INPUTS``: 0 skips the value checks of topk_idx (range, duplicates)."""
    return os.environ.get("MOE_COMM_CHECK_INPUTS", "1") != "0"
