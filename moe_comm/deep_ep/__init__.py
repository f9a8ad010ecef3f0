"""``moe_comm.deep_ep``: DeepEP's ``deep_ep.Buffer`` API (V1, the legacy buffer) over moe_comm.

Code written for DeepEP runs on moe_comm unchanged once the module stands in for ``deep_ep``::

    import moe_comm.deep_ep
    moe_comm.deep_ep.install()          # sys.modules["deep_ep"] is this module (opt-in)
    from deep_ep import Buffer          # what Megatron-Core's flex dispatcher, SGLang and
                                        # vLLM import

Everything DeepEP documents for its normal and low-latency modes is either honoured or refused
with ``NotImplementedError`` and a sentence (``python -m moe_comm.deep_ep --check`` lists which).
The semantics, layouts and sizing are in :mod:`moe_comm.deep_ep.buffer`.
"""
from __future__ import annotations

import sys

from .buffer import Buffer, Config
from .utils import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "install"]


def install() -> None:
    """Registers this module as ``deep_ep`` (and ``deep_ep.utils``) in ``sys.modules``, so that
    ``import deep_ep`` finds it. Refuses if a different ``deep_ep`` is already imported."""
    here = sys.modules[__name__]
    present = sys.modules.get("deep_ep")
    if present is not None and present is not here:
        where = getattr(present, "__file__", present)
        raise RuntimeError(f"a deep_ep module is already imported ({where}); "
                           "moe_comm.deep_ep.install() would shadow it: call it before anything "
                           "imports deep_ep, or use that DeepEP")
    sys.modules["deep_ep"] = here
    sys.modules["deep_ep.utils"] = sys.modules[f"{__name__}.utils"]
