"""Buffers by id, so that torch.library ops (which take only tensors and scalars) can find them."""
from __future__ import annotations

import weakref

_buffers: dict[str, weakref.ref] = {}


def register(buffer) -> None:
    _buffers[buffer.id] = weakref.ref(buffer)


def unregister(buffer) -> None:
    _buffers.pop(buffer.id, None)


def lookup(buffer_id: str):
    ref = _buffers.get(buffer_id)
    buffer = ref() if ref is not None else None
    if buffer is None:
        raise RuntimeError(f"moe_comm Buffer {buffer_id} was closed or garbage-collected")
    return buffer
