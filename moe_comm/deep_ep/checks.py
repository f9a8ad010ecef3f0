"""The facade's checks of its arguments, before anything runs: a wrong type, dtype or shape
raises TypeError or ValueError naming the argument (as DeepEP's callers pass them: ``topk_idx``
int64, or int32 as some engines keep it, converted; weights float32). They read no tensor data
(no host synchronisation); an expert id outside ``[-1, num_experts)`` is the dispatch's to
report (its kernels check every id, and it raises once the call is complete)."""
from __future__ import annotations

import torch

_INDEX_DTYPES = (torch.int64, torch.int32)


def _tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def topk_idx(value, name: str = "topk_idx") -> torch.Tensor:
    """``[T, K]`` int64 or int32 expert ids (-1: no expert); returned as int64."""
    t = _tensor(name, value)
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be int64 (or int32) expert ids, got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be [num_tokens, num_topk], got shape {tuple(t.shape)}")
    return t.to(torch.int64)


def flag(value, name: str) -> bool:
    """A bool option of the Buffer (``ep_invariant``): True or False, nothing else."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def positive_int(value, name: str) -> int:
    """A positive int option of the Buffer (``ranks_per_node``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def whole_nodes(group_size: int, ranks_per_node: int) -> None:
    """Across nodes the group is whole nodes of ``ranks_per_node`` ranks (as DeepEP's group is
    whole nodes of 8)."""
    if group_size % ranks_per_node:
        raise ValueError(f"the group's {group_size} ranks are not whole nodes of "
                         f"{ranks_per_node} ranks (ranks_per_node, or MOE_COMM_RANKS_PER_NODE; "
                         "default 8 as DeepEP's)")


def num_experts(value, group_size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TypeError(f"num_experts must be a positive int, got {value!r}")
    if value % group_size:
        raise ValueError(f"num_experts={value} is not divisible by the {group_size} ranks")
    return value


def rows(value, name: str = "x") -> torch.Tensor:
    """``[T, H]`` rows, or an FP8 pair ``(rows, scales)``: the rows."""
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError(f"{name} as a tuple must be the FP8 pair (x_fp8, scales), got "
                             f"{len(value)} items")
        value = value[0]
    t = _tensor(name, value)
    if t.dim() != 2:
        raise ValueError(f"{name} must be [num_tokens, hidden], got shape {tuple(t.shape)}")
    return t


def weights(value, idx: torch.Tensor, name: str = "topk_weights") -> torch.Tensor | None:
    """``[T, K]`` floating weights like ``idx``, or None; returned as float32."""
    if value is None:
        return None
    t = _tensor(name, value)
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be floating point (float32), got {t.dtype}")
    if t.shape != idx.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, topk_idx {tuple(idx.shape)}: "
                         "they must match")
    return t.float()


def tokens_match(x: torch.Tensor, idx: torch.Tensor, name: str = "x") -> None:
    if x.shape[0] != idx.shape[0]:
        raise ValueError(f"{name} has {x.shape[0]} tokens, topk_idx {idx.shape[0]}: one row "
                         "of topk_idx per token")


def handle(value, kind: type, call: str):
    if not isinstance(value, kind):
        raise TypeError(f"handle must be the handle a {call} returned, got "
                        f"{type(value).__name__}")
    return value


def float_rows(t: torch.Tensor, dtypes: tuple, name: str = "x") -> None:
    """Rows of a dtype the Buffer moves (DeepEP's rows are bf16; int or FP8 rows only as the
    pair)."""
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be rows of one of {', '.join(map(str, dtypes))}, got "
                        f"{t.dtype}")


def cached_rows(t: torch.Tensor, tokens: int, hidden: int, dtype: torch.dtype,
                name: str = "x") -> None:
    """A cached dispatch's rows: the shape and dtype of the dispatch that made the handle."""
    if t.dtype != dtype:
        raise TypeError(f"{name} is {t.dtype}; the dispatch that made the handle moved {dtype}")
    if tuple(t.shape) != (tokens, hidden):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; the dispatch that made the handle "
                         f"moved [{tokens}, {hidden}] (a cached dispatch moves the same tokens)")


def out_rows(out, tokens: int, hidden: int, dtype: torch.dtype, device,
             name: str = "out") -> None:
    """An ``out=`` tensor for ``[tokens, hidden]`` rows of ``dtype`` on ``device``."""
    if out is None:
        return
    t = _tensor(name, out)
    if tuple(t.shape) != (tokens, hidden) or t.dtype != dtype or t.device != device:
        raise ValueError(f"{name} must be [{tokens}, {hidden}] {dtype} on {device}, got "
                         f"{list(t.shape)} {t.dtype} on {t.device}")
