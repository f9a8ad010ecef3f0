"""Input checks run on the host before any kernel launch; each error says how to fix the call.

A failed check raises ``TypeError`` or ``ValueError`` before any kernel reads the input, so the
caller may fix it and call again. In a dispatch on several ranks the Buffer first takes part in
the call with no rows and a refusal (``moe_comm.call_descriptor``): its peers raise
``PeerInputError`` naming this rank within the call. Peers of a combine that fails here wait
for it and time out naming this rank, as with any missing call.

The checks read no tensor data (types, shapes, devices, sizes): nothing here synchronises with a
GPU. The values of ``topk_idx`` (ids in range, no expert twice in a row) are checked by the
kernels themselves (``kernels.layout.checked_ids``), which send a bad row nowhere and record it
for the host to raise.
"""
from __future__ import annotations

import torch

from .kernels.quant import MXFP8, NVFP4  # the ``ue8m0`` codes of the block-scaled formats
from .microscale import nvfp4_global_scale
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


def _bounded(name: str, t, shape: tuple, itemsize: int) -> None:
    """``t`` a tensor of ``shape`` (None: any size there) with elements of ``itemsize``
    bytes."""
    if not isinstance(t, torch.Tensor) or t.dim() != len(shape) or t.element_size() != itemsize \
            or any(n is not None and m != n for m, n in zip(t.shape, shape)):
        got = (f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor)
               else type(t).__name__)
        want = ", ".join("*" if n is None else str(n) for n in shape)
        raise ValueError(f"{name} must be [{want}] of {itemsize}-byte elements, got {got}")


def check_dispatch_bounds(x, topk_idx, topk_weights, *, hidden: int, max_tokens: int,
                          max_topk: int, itemsize: int) -> None:
    """The sizes that keep a dispatch's kernels inside their buffers, checked even with
    ``MOE_COMM_CHECK_INPUTS=0`` (shapes only, no tensor data): ``x`` [T, hidden] with
    ``T <= max_tokens``, ``topk_idx`` [T, K] 8-byte with ``1 <= K <= max_topk``, weights
    [T, K] 4-byte or None. The expert ids themselves are bounded by the kernels."""
    _bounded("x", x, (None, hidden), itemsize)
    if x.shape[0] > max_tokens:
        raise ValueError(f"x has {x.shape[0]} tokens, more than max_tokens_per_rank="
                         f"{max_tokens}; split the batch or build the Buffer with a larger "
                         "max_tokens_per_rank")
    _bounded("topk_idx", topk_idx, (x.shape[0], None), 8)
    if not 1 <= topk_idx.shape[1] <= max_topk:
        raise ValueError(f"top-k is {topk_idx.shape[1]}; this Buffer supports 1..{max_topk} "
                         "(max_topk)")
    if topk_weights is not None:
        _bounded("topk_weights", topk_weights, tuple(topk_idx.shape), 4)


def check_combine_bounds(y, handle, weights, *, buffer_id: str, hidden: int,
                         itemsize: int) -> None:
    """What keeps a combine's kernels inside their buffers, checked even with
    ``MOE_COMM_CHECK_INPUTS=0``: a handle of this Buffer (its slots index this workspace),
    ``y`` [handle.num_rows, hidden], weights [handle.num_rows] 4-byte or None."""
    if not isinstance(handle, DispatchHandle) or handle.buffer_id != buffer_id:
        raise ValueError("handle must be the DispatchResult.handle of a dispatch of this "
                         "Buffer")
    _bounded("y", y, (handle.num_rows, hidden), itemsize)
    if weights is not None:
        _bounded("weights", weights, (handle.num_rows,), 4)


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


def dispatch_signature(x, topk_idx, topk_weights, expert_alignment, max_recv_rows,
                       hidden: int, dtype: torch.dtype) -> tuple | None:
    """Everything :func:`check_dispatch_inputs` reads of these arguments (the tensors' types,
    dtypes, shapes and devices, the ints; no data), a key under which inputs that passed pass
    again; None where one is not a plain tensor or int (those are checked on every call)."""
    tensor = torch.Tensor
    if type(x) is not tensor or type(topk_idx) is not tensor or not (
            topk_weights is None or type(topk_weights) is tensor) or type(
            expert_alignment) is not int or not (
            max_recv_rows is None or type(max_recv_rows) is int):
        return None
    weights = None if topk_weights is None else (topk_weights.dtype, topk_weights.shape,
                                                 topk_weights.device)
    return (x.dtype, x.shape, x.device, topk_idx.dtype, topk_idx.shape, topk_idx.device,
            weights, expert_alignment, max_recv_rows, hidden, dtype)


def check_cached_rows(x, slot_of: torch.Tensor, *, hidden: int, dtype) -> None:
    """A cached dispatch moves the rows of the dispatch that made its layout (``slot_of``
    [T, R]): ``x`` [T, hidden] of the Buffer's dtype, else ValueError before anything is
    sent."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or tuple(x.shape) != (slot_of.shape[0], hidden) or x.dtype != dtype:
        raise ValueError(f"a cached dispatch moves the rows of the dispatch that made the "
                         f"handle: x must be [{slot_of.shape[0]}, {hidden}] {dtype}, got "
                         f"{list(x.shape)} {x.dtype}")


def check_combine_inputs(y, handle, weights, *, buffer_id: str, latest_serial: int,
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


def combine_is_fp8(combine_dtype, *, dtype: torch.dtype, hidden: int,
                   ep_invariant: bool = False) -> bool:
    """Whether a combine sends FP8 partials: ``combine_dtype`` None or the Buffer's dtype (the
    partials travel in it), or ``"fp8"`` / ``torch.float8_e4m3fn`` (per token and 128
    channels; needs hidden % 128 == 0 and a 16/32-bit dtype; not with ``ep_invariant``)."""
    if combine_dtype is None or combine_dtype == dtype:
        return False
    if ep_invariant:
        raise ValueError(f"combine_dtype={combine_dtype!r}: an EP-invariant Buffer's combine "
                         f"returns the rows in the Buffer's dtype ({dtype}); pass None")
    if combine_dtype not in ("fp8", torch.float8_e4m3fn):
        raise ValueError(f"combine_dtype must be None, the Buffer's dtype ({dtype}) or 'fp8', "
                         f"got {combine_dtype!r}")
    if hidden % 128 or dtype == torch.float64:
        raise ValueError(f"an FP8 combine needs hidden % 128 == 0 and a 16/32-bit dtype, got "
                         f"hidden={hidden}, dtype={dtype}")
    return True


SCALE_FORMATS = {"fp8": None, "mxfp8": MXFP8, "nvfp4": NVFP4}
_BLOCK_SCALED = {MXFP8: ("MXFP8", 32, "E8M0", torch.float8_e8m0fnu),
                 NVFP4: ("NVFP4", 16, "e4m3", torch.float8_e4m3fn)}


def scale_code(dispatch_dtype: str | None, ue8m0: bool, scale_layout: str = "row_major") -> int:
    """The kernels' scale code of a dispatch: 0 float32 per 128 channels, 1 power-of-two per
    128 (``ue8m0``), 2 MXFP8 (``dispatch_dtype="mxfp8"``: E8M0 per 32), 3 NVFP4 (e4m3 per 16
    and a float32 global scale); then ``scale_layout`` checked against it
    (:func:`check_scale_layout`)."""
    if dispatch_dtype is not None and dispatch_dtype not in SCALE_FORMATS:
        raise ValueError(f"dispatch_dtype must be one of {tuple(SCALE_FORMATS)} or None, got "
                         f"{dispatch_dtype!r}")
    code = SCALE_FORMATS.get(dispatch_dtype)
    if code is not None:
        name, _, scale, _ = _BLOCK_SCALED[code]
        if ue8m0:
            raise ValueError(f"{name} scales are {scale} by definition; drop ue8m0=True")
    else:
        code = int(bool(ue8m0))
    if scale_layout != "row_major":  # (the default needs no check: no call on every op)
        check_scale_layout(scale_layout, code)
    return code


def check_block_scaled_options(code: int, quantizes: bool, col_major_scales: bool) -> None:
    """The options MXFP8 and NVFP4 refuse, in both modes: no quantization, column-major
    scales."""
    name, group, _, _ = _BLOCK_SCALED[code]
    if not quantizes:
        raise ValueError(f"dispatch_dtype={name.lower()!r} quantizes; it cannot go with "
                         "fp8=False")
    if col_major_scales:
        raise ValueError(f"{name} scales come row-major [rows, H/{group}], or with "
                         "scale_layout='swizzled' in the 128x4 layout of block-scaled GEMMs "
                         "(moe_comm.microscale.swizzle_128x4)")


def check_scale_layout(scale_layout: str, code: int) -> None:
    if scale_layout not in ("row_major", "swizzled"):
        raise ValueError(f"scale_layout must be 'row_major' or 'swizzled', got "
                         f"{scale_layout!r}")
    if scale_layout == "swizzled" and code not in _BLOCK_SCALED:
        raise ValueError("scale_layout='swizzled' is for the block scales of "
                         "dispatch_dtype='mxfp8' or 'nvfp4'")


def sent_rows_check(mode: int, code: int, hidden: int, dtype: torch.dtype):
    """``(dtype, width)`` the rows handed to the send must have: the Buffer's, float8 for a
    quantized pair, uint8 [T, H/2] for quantized NVFP4."""
    if mode != 2:
        return dtype, hidden
    if code == NVFP4:
        return torch.uint8, hidden // 2
    return torch.float8_e4m3fn, hidden


def _nvfp4_global(g, device: torch.device, tokens: int | None) -> torch.Tensor:
    """A given NVFP4 global scale: float32 [1] (or, in a quantized x, [T]: one per row)."""
    ndim = g.dim() if isinstance(g, torch.Tensor) else 1
    check_tensor("global_scale", g, dtype=torch.float32, ndim=ndim, device=device)
    if g.numel() != 1 and (tokens is None or g.numel() != tokens):
        per_row = "" if tokens is None else f" or {tokens} (one per row)"
        raise ValueError(f"an NVFP4 global scale has 1 element{per_row}, got shape "
                         f"{tuple(g.shape)}")
    return g.reshape(-1)


def nvfp4_send_global(x, global_scale, code: int, device: torch.device):
    """NVFP4 (``code == 3``): the global scale [1] float32 a send reads, ``global_scale`` checked
    or computed from ``x`` on its device (no host read); else None (and ``global_scale`` must
    be None)."""
    if code != NVFP4:
        if global_scale is not None:
            raise ValueError("global_scale is NVFP4's; pass dispatch_dtype='nvfp4'")
        return None
    if global_scale is not None:
        return _nvfp4_global(global_scale, device, None)
    return nvfp4_global_scale(x)


def resolve_fp8(x, fp8, ue8m0: int, col_major_scales: bool, *, default_fp8: bool, hidden: int,
                device: torch.device, global_scale=None):
    """Splits the FP8 options of ``dispatch``: returns ``(rows, scales or None, mode)`` with
    mode 0 (rows as they are), 1 (the send kernel quantizes), 2 (``x`` is quantized).
    ``ue8m0``: a :func:`scale_code`. NVFP4 (3): ``scales`` is what the send kernel reads
    (``kernels.rows``): with mode 1 the global scale [1] float32 (``global_scale``, or
    computed on the device from ``x``: ``microscale.nvfp4_global_scale``); with mode 2, for
    ``x = (values [T, H/2], scales [T, H/16] e4m3, global [1] or [T] float32)``, each row's
    scale bytes followed by its global scale's four bytes, [T, H/16 + 4] uint8. Building those
    launches small PyTorch ops after every check passed; nothing is read back."""
    block = _BLOCK_SCALED.get(ue8m0)
    name, group, _, scale_dtype = block if block else ("FP8", 128, None, torch.float32)
    nv = ue8m0 == NVFP4
    if global_scale is not None and not nv:
        nvfp4_send_global(x, global_scale, ue8m0, device)  # raises
    if isinstance(x, (tuple, list)):
        want = ("(values [T, H/2] uint8 or float4_e2m1fn_x2, scales [T, H/16] float8_e4m3fn, "
                "global_scale [1] float32)" if nv else
                f"(x_fp8 [T, H] float8_e4m3fn, scales [T, H/{group}] {scale_dtype})")
        if len(x) != (3 if nv else 2):
            raise TypeError(f"x must be a torch.Tensor [T, H] or a quantized {name} tuple "
                            f"{want}, got a {type(x).__name__} of {len(x)} items")
        rows, scales = x[0], x[1]
        if nv:
            check_tensor("x[0] (values)", rows, dtype=(torch.uint8, torch.float4_e2m1fn_x2),
                         ndim=2, device=device)
            rows = rows.view(torch.uint8)
            if rows.shape[1] * 2 != hidden:
                raise ValueError(f"x[0] has {rows.shape[1]} bytes per row; NVFP4 rows of "
                                 f"hidden={hidden} have {hidden // 2}")
            if global_scale is not None:
                raise ValueError("a quantized NVFP4 x carries its global scale (x[2]); drop "
                                 "global_scale")
        else:
            check_tensor("x[0]", rows, dtype=torch.float8_e4m3fn, ndim=2, device=device)
        allowed = (scale_dtype, torch.uint8) if block else scale_dtype
        check_tensor("x[1] (scales)", scales, dtype=allowed, ndim=2, device=device)
        if scales.shape != (rows.shape[0], hidden // group):
            raise ValueError(f"scales have shape {tuple(scales.shape)}; expected "
                             f"[{rows.shape[0]}, {hidden // group}] (one per {group} channels)")
        if fp8 is False:
            raise ValueError("a quantized x was passed with fp8=False")
        if ue8m0 == 1:
            raise ValueError("ue8m0 rounds scales when the kernel quantizes; a quantized pair "
                             "travels with its own float32 scales")
        mode = 2
        if block:
            check_block_scaled_options(ue8m0, True, col_major_scales)
        if nv:
            glob = _nvfp4_global(x[2], device, rows.shape[0])
    else:
        rows, scales = x, None
        mode = int(default_fp8 or bool(block) if fp8 is None else bool(fp8))
        if block:
            check_block_scaled_options(ue8m0, mode != 0, col_major_scales)
        if mode == 0 and (ue8m0 or col_major_scales):
            raise ValueError("ue8m0 and col_major_scales shape FP8 scales; pass fp8=True")
        if mode == 1 and isinstance(rows, torch.Tensor) and rows.requires_grad:
            raise ValueError("FP8 dispatch carries no gradient to x (the rows are quantized); "
                             "dispatch in the Buffer's dtype for training, or pass x.detach()")
    if mode and hidden % group:
        raise ValueError(f"{name} dispatch needs hidden % {group} == 0, got hidden={hidden}")
    if nv and mode == 2:  # each row's scale bytes, then its global scale's
        per_row = (torch.zeros(rows.shape[0], device=device) + glob).view(torch.uint8)
        scales = torch.cat([scales.view(torch.uint8), per_row.reshape(-1, 4)], dim=1)
    elif nv and mode == 1 and isinstance(rows, torch.Tensor):  # (else the input checks raise)
        scales = nvfp4_send_global(rows, global_scale, ue8m0, device)
    return rows, scales, mode
