"""Framework plugins: moe_comm inside Megatron-Core and DeepSpeed MoE layers.

    from moe_comm.integrations import megatron, deepspeed
    megatron.apply_megatron()      # MoELayer(alltoall | flex) dispatches with moe_comm
    deepspeed.apply_deepspeed()    # deepspeed.moe.layer.MoE moves only the routed tokens

Each plugin imports its framework only when called (``import moe_comm.integrations.megatron``
works without megatron-core), is idempotent, and is also offered as a class to use directly
(``MoeCommTokenDispatcher`` / ``MoeCommMoELayer`` for a Megatron layer spec,
``MoeCommMOELayer`` for DeepSpeed). These modules use moe_comm's public API only; nothing in
moe_comm imports them.

Shared here: :class:`BufferCache`, the ``moe_comm.Buffer`` objects the plugins' layers share.

Every plugin takes ``ep_invariant`` (default False) in its ``apply_*`` function and its classes:
``True`` builds the layers' Buffers with ``moe_comm.Buffer(..., ep_invariant=True)`` (one
node): each token's expert output rows are summed in fp32 in the order of its choices and
rounded once (``moe_comm.reference.invariant_combine``), so the combined output depends on
those rows alone, not on the expert-parallel size or the expert placement. Invariant and
default layers never share a Buffer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import moe_comm

__all__ = ["BufferCache", "buffers"]

_MIN_TOKENS = 64  # smallest max_tokens_per_rank the cache allocates when it sizes by itself


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _check_ep_invariant(value, where: str = "ep_invariant") -> bool:
    """``value`` if it is a bool (the plugins' ``ep_invariant`` option), else ValueError."""
    if not isinstance(value, bool):
        raise ValueError(f"{where} must be True or False, got {value!r}")
    return value


class BufferCache:
    """``moe_comm.Buffer`` objects shared by the MoE layers of a model, one per
    (process group, hidden, num_experts, dtype, max_topk, ep_invariant).

    Layers of one model share a Buffer: a handle is only needed between a layer's dispatch and
    its combine, and backward passes keep their own routing tensors, so any number of layers
    (and micro-batches in flight) can use one workspace.

    Sizing (``max_tokens_per_rank``):

    * fixed (``max_tokens_per_rank=N`` here or in ``apply_*``): the Buffer holds N tokens per
      rank; a larger batch raises ``ValueError`` before anything is sent;
    * ``None`` (default): before each dispatch the ranks agree on the largest token count
      (one ``all_reduce(MAX)`` of one int64 over the group) and the cache allocates a Buffer
      for the next power of two (at least 64) when the current one is too small. Replaced
      Buffers stay open until :meth:`close`, because backward passes of earlier steps may
      still refer to them.

    ``ep_invariant=True`` gets a Buffer built with ``moe_comm.Buffer(..., ep_invariant=True)``
    (its combine sums each token's rows in choice order: the same bits at any EP size for the
    same rows); it is part of the key, so an invariant layer and a default one never share a Buffer.
    """

    def __init__(self) -> None:
        self._live: dict[tuple, moe_comm.Buffer] = {}
        self._retired: list[moe_comm.Buffer] = []

    def get(self, group, *, hidden: int, num_experts: int, dtype: torch.dtype, max_topk: int,
            num_tokens: int, max_tokens_per_rank: int | None = None,
            device: torch.device | str = "cpu", ep_invariant: bool = False) -> moe_comm.Buffer:
        """A Buffer for ``num_tokens`` tokens on this rank; collective over ``group``
        (``device``: where the size agreement's one-element tensor lives for the group's
        backend; ``ep_invariant``: as ``moe_comm.Buffer``'s)."""
        ep_invariant = _check_ep_invariant(ep_invariant)
        key = (group, hidden, num_experts, dtype, max_topk, ep_invariant)
        buf = self._live.get(key)
        if max_tokens_per_rank is not None:
            if num_tokens > max_tokens_per_rank:
                raise ValueError(
                    f"{num_tokens} tokens on this rank exceed max_tokens_per_rank="
                    f"{max_tokens_per_rank}; pass a larger value (or None to size by the batch)")
            need = max_tokens_per_rank
            if buf is not None and buf.max_tokens_per_rank == need:
                return buf
        else:
            most = torch.tensor([num_tokens], dtype=torch.int64, device=device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
            if buf is not None and int(most) <= buf.max_tokens_per_rank:
                return buf
            need = max(_MIN_TOKENS, _next_power_of_2(int(most)))
        if buf is not None:
            self._retired.append(buf)
        buf = moe_comm.Buffer(group, hidden=hidden, num_experts=num_experts,
                              max_tokens_per_rank=need, dtype=dtype, max_topk=max_topk,
                              ep_invariant=ep_invariant)
        self._live[key] = buf
        return buf

    def __len__(self) -> int:
        return len(self._live)

    def close(self) -> None:
        """Closes every Buffer (collective in spirit: call it on every rank at the same point,
        when no backward pass is pending)."""
        for buf in [*self._live.values(), *self._retired]:
            buf.close()
        self._live.clear()
        self._retired.clear()


buffers = BufferCache()
"""The cache the plugins use unless a layer is given its own."""
