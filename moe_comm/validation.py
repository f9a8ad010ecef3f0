"""Input checks run on the host before any kernel launch; each error says how to fix the call.

A failed check raises ``TypeError`` or ``ValueError`` and leaves the Buffer untouched (no epoch
advanced, nothing sent), so the caller may fix the input and call again. Peers that did make the
call time out naming this rank, as with any missing call.

The checks read no tensor data (types, shapes, devices, sizes): nothing here synchronises with a
GPU. The values of ``topk_idx`` (ids in range, no expert twice in a row) are checked by the
kernels themselves (``kernels.layout.checked_ids``), which send a bad row nowhere and record it
for the host to raise.
"""
from __future__ import annotations

import torch

from .kernels.quant import MXFP8  # the ``ue8m0`` code of MXFP8: E8M0 bytes per 32 channels
from .types import DispatchHandle

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_tensor(name: str, t, *, dtype, ndim: int, device: torch.device) -> None:
    """``dtype``: a torch dtype or a tuple of the ones allowed."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    allowed = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in allowed:
        raise TypeError(f"{name} must be {' or '.join(map(str, allowed))}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; this Buffer's workspace is on {device}")


def check_dispatch_inputs(x, topk_idx, topk_weights, expert_alignment, *, hidden: int,
                          max_tokens: int, max_topk: int, dtype: torch.dtype,
                          device: torch.device, max_recv_rows: int | None = None) -> None:
    """Types, shapes and sizes of ``Buffer.dispatch`` (no tensor data is read)."""
    check_tensor("x", x, dtype=dtype, ndim=2, device=device)
    T, H = x.shape
    if H != hidden:
        raise ValueError(f"x has hidden size {H}; this Buffer was built for hidden={hidden}")
    if T > max_tokens:
        raise ValueError(f"x has {T} tokens, more than max_tokens_per_rank={max_tokens}; "
                         "split the batch or build the Buffer with a larger max_tokens_per_rank")
    check_tensor("topk_idx", topk_idx, dtype=torch.int64, ndim=2, device=device)
    if topk_idx.shape[0] != T:
        raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows but x has {T} tokens")
    K = topk_idx.shape[1]
    if not 1 <= K <= max_topk:
        raise ValueError(f"top-k is {K}; this Buffer supports 1..{max_topk} (max_topk)")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, dtype=torch.float32, ndim=2, device=device)
        if topk_weights.shape != topk_idx.shape:
            raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}, "
                             f"topk_idx has {tuple(topk_idx.shape)}")
    if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, int) \
            or expert_alignment < 1:
        raise ValueError(f"expert_alignment must be an int >= 1, got {expert_alignment!r}")
    if max_recv_rows is not None and (isinstance(max_recv_rows, bool)
                                      or not isinstance(max_recv_rows, int)
                                      or max_recv_rows < 0):
        raise ValueError(f"max_recv_rows must be None or an int >= 0, got {max_recv_rows!r}")


def check_combine_inputs(y, handle, weights, *, buffer_id: int, latest_serial: int,
                         hidden: int, dtype: torch.dtype, device: torch.device) -> None:
    """``y`` rows and ``weights`` must match the handle of this Buffer's latest dispatch."""
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle must be the DispatchResult.handle of a dispatch, "
                        f"got {type(handle).__name__}")
    if handle.buffer_id != buffer_id:
        raise ValueError("handle comes from another Buffer; combine with the Buffer that "
                         "dispatched")
    if handle.serial != latest_serial:
        raise ValueError(f"handle comes from an older dispatch (call {handle.serial}; the latest "
                         f"is call {latest_serial}); combine the rows of the latest dispatch")
    check_tensor("y", y, dtype=dtype, ndim=2, device=device)
    if y.shape != (handle.num_rows, hidden):
        raise ValueError(f"y has shape {tuple(y.shape)}; the dispatch produced "
                         f"[{handle.num_rows}, {hidden}] (rows must match res.x)")
    if weights is not None:
        check_tensor("weights", weights, dtype=torch.float32, ndim=1, device=device)
        if weights.shape[0] != handle.num_rows:
            raise ValueError(f"weights has {weights.shape[0]} entries; y has {handle.num_rows} "
                             "rows")


SCALE_FORMATS = {"fp8": None, "mxfp8": MXFP8}


def scale_code(dispatch_dtype: str | None, ue8m0: bool) -> int:
    """The kernels' scale code of a dispatch: 0 float32 per 128 channels, 1 power-of-two per
    128 (``ue8m0``), 2 MXFP8 (``dispatch_dtype="mxfp8"``: E8M0 per 32)."""
    if dispatch_dtype is not None and dispatch_dtype not in SCALE_FORMATS:
        raise ValueError(f"dispatch_dtype must be one of {tuple(SCALE_FORMATS)} or None, got "
                         f"{dispatch_dtype!r} (NVFP4 dispatch is not available yet)")
    if dispatch_dtype == "mxfp8":
        if ue8m0:
            raise ValueError("MXFP8 scales are E8M0 by definition; drop ue8m0=True")
        return MXFP8
    return int(bool(ue8m0))


def check_mxfp8_options(quantizes: bool, col_major_scales: bool) -> None:
    """The options MXFP8 refuses, in both modes: no quantization, column-major scales."""
    if not quantizes:
        raise ValueError("dispatch_dtype='mxfp8' quantizes; it cannot go with fp8=False")
    if col_major_scales:
        raise ValueError("MXFP8 scales come row-major [rows, H/32]; for the 128x4 layout of "
                         "block-scaled GEMMs use moe_comm.microscale.swizzle_128x4")


def resolve_fp8(x, fp8, ue8m0: int, col_major_scales: bool, *, default_fp8: bool, hidden: int,
                device: torch.device):
    """Splits the FP8 options of ``dispatch``: returns ``(rows, scales or None, mode)`` with
    mode 0 (rows as they are), 1 (the send kernel quantizes), 2 (``x`` is a quantized pair).
    ``ue8m0``: a :func:`scale_code` (MXFP8 == 2: one E8M0 scale per 32 channels)."""
    mx = ue8m0 == MXFP8
    group = 32 if mx else 128
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise TypeError("a quantized x is a pair (x_fp8 [T, H] float8_e4m3fn, "
                            + ("scales [T, H/32] float8_e8m0fnu)" if mx
                               else "scales [T, H/128] float32)"))
        rows, scales = x
        check_tensor("x[0]", rows, dtype=torch.float8_e4m3fn, ndim=2, device=device)
        if mx:
            check_tensor("x[1] (scales)", scales, dtype=(torch.float8_e8m0fnu, torch.uint8),
                         ndim=2, device=device)
        else:
            check_tensor("x[1] (scales)", scales, dtype=torch.float32, ndim=2, device=device)
        if scales.shape != (rows.shape[0], hidden // group):
            raise ValueError(f"scales have shape {tuple(scales.shape)}; expected "
                             f"[{rows.shape[0]}, {hidden // group}] (one per {group} channels)")
        if fp8 is False:
            raise ValueError("a quantized (x_fp8, scales) pair was passed with fp8=False")
        if ue8m0 and not mx:
            raise ValueError("ue8m0 rounds scales when the kernel quantizes; a quantized pair "
                             "travels with its own float32 scales")
        mode = 2
        if mx:
            check_mxfp8_options(True, col_major_scales)
    else:
        rows, scales = x, None
        mode = int(default_fp8 or mx if fp8 is None else bool(fp8))
        if mx:
            check_mxfp8_options(mode != 0, col_major_scales)
        if mode == 0 and (ue8m0 or col_major_scales):
            raise ValueError("ue8m0 and col_major_scales shape FP8 scales; pass fp8=True")
        if mode == 1 and isinstance(rows, torch.Tensor) and rows.requires_grad:
            raise ValueError("FP8 dispatch carries no gradient to x (the rows are quantized); "
                             "dispatch in the Buffer's dtype for training, or pass x.detach()")
    if mode and hidden % group:
        raise ValueError(f"{'MXFP8' if mx else 'FP8'} dispatch needs hidden % {group} == 0, "
                         f"got hidden={hidden}")
    return rows, scales, mode
