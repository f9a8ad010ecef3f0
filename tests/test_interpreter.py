"""The interpreter patch of kernels/interpreter.py: one patch of triton.language per launch,
the same results, Triton's own path where a helper sees a module the launch did not patch."""
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton.language import core

import moe_comm.kernels  # noqa: F401  (installs the patch)
from moe_comm.kernels import interpreter

_interp = interpreter._interp


@triton.jit
def _twice(v):
    return v * 2


@triton.jit
def _plus(v, c):
    return _twice(v) + c


@triton.jit
def _helpers_kernel(x, out, N: tl.constexpr, CALLS: tl.constexpr):
    offs = tl.arange(0, N)
    v = tl.load(x + offs)
    for i in range(CALLS):  # a helper (calling a helper) per trip, as the kernels do per pair
        v = _plus(v, i) - v
    tl.store(out + offs, v)


def _reference(x: torch.Tensor, calls: int) -> torch.Tensor:
    v = x.clone()
    for i in range(calls):
        v = v * 2 + i - v
    return v


@pytest.fixture
def patches(monkeypatch):
    """Counts the calls of the interpreter's ``_patch_lang``."""
    calls = []
    real = _interp._patch_lang

    def counted(fn):
        calls.append(fn.__name__)
        return real(fn)
    monkeypatch.setattr(_interp, "_patch_lang", counted)
    return calls


def test_the_patch_is_installed_and_idempotent():
    assert interpreter.install()
    assert interpreter.install()
    call = _interp.InterpretedFunction.__call__
    assert call.__moe_comm__ and not getattr(call.__wrapped__, "__moe_comm__", False)
    assert not hasattr(_interp.GridExecutor.__call__.__wrapped__, "__wrapped__")


def test_one_patch_per_launch_and_the_same_results(patches):
    x = torch.arange(16, dtype=torch.float32) - 5.0
    for calls in (0, 1, 7):
        out = torch.empty_like(x)
        patches.clear()
        _helpers_kernel[(2,)](x, out, N=16, CALLS=calls)
        assert patches == ["_helpers_kernel"], patches  # Triton alone: 1 + 2 * 2 * calls
        assert torch.equal(out, _reference(x, calls))
    assert core.is_builtin(tl.load) and core.is_builtin(tl.tensor.__add__)  # restored


def test_a_helper_that_sees_another_language_module_is_patched(monkeypatch):
    """Inside a launch that patched ``tl`` only, a helper whose module sees ``tl.core`` takes
    Triton's path (once), and outside a launch every helper call does."""
    patches = []
    monkeypatch.setattr(_interp, "_patch_lang", lambda fn: patches.append(fn.__name__))
    only_tl = SimpleNamespace(__globals__={"tl": tl}, __name__="only_tl")
    with_core = SimpleNamespace(__globals__={"tl": tl, "core": core}, __name__="with_core")
    stub = SimpleNamespace(rewrite=lambda: (lambda: 7))
    interpreter._launch.langs = interpreter._languages(only_tl)
    try:
        stub.fn = only_tl
        assert interpreter._helper_call(stub) == 7 and patches == []
        stub.fn = with_core
        assert interpreter._helper_call(stub) == 7 and patches == ["with_core"]
        assert interpreter._helper_call(stub) == 7 and patches == ["with_core"]
    finally:
        interpreter._launch.langs = None
    assert interpreter._helper_call(stub) == 7 and patches == ["with_core", "with_core"]


def test_the_dtype_memo_gives_the_interpreters_answers():
    """Every Triton dtype, as a scalar, a block and a pointer, maps to the numpy dtype Triton's
    own lookup gives; a dtype Triton does not know raises as it does."""
    memo, real = _interp._get_np_dtype, _interp._get_np_dtype.__wrapped__
    assert memo.__moe_comm__ and not hasattr(real, "__moe_comm__")
    scalars = [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16,
               tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5,
               tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15]
    kinds = scalars + [tl.pointer_type(t) for t in scalars]
    for tt in kinds + [core.block_type(t, [4, 8]) for t in kinds]:
        for _ in range(2):  # the second answer comes from the memo
            assert memo(tt) == real(tt), tt
    assert {memo(t) for t in scalars[-5:]} == {memo(tl.uint8)}  # FP8 as bytes
    for lookup in (real, memo):
        with pytest.raises(KeyError):
            lookup(tl.void)


def test_block_types_are_made_once_per_value_in_a_launch():
    """Inside a launch the builder's and ``with_element_ty``'s block types are one object per
    (element type, shape), equal to what Triton makes; pointers differ by element, address
    space and constness; outside a launch ``with_element_ty`` makes a new one as before."""
    builder = _interp.InterpreterBuilder()
    kinds = [tl.float32, tl.bfloat16, tl.int32, tl.pointer_type(tl.float32),
             tl.pointer_type(tl.float32, 1), tl.pointer_type(tl.float32, const=True),
             tl.pointer_type(tl.pointer_type(tl.int8))]
    made = {}
    for i, kind in enumerate(kinds):
        for shape in ([4], [4, 8], [8, 4]):
            ty = builder.get_block_ty(kind, shape)
            assert ty == core.block_type(kind, shape) and ty is builder.get_block_ty(kind, shape)
            made[(i, tuple(shape))] = ty
    assert len({id(t) for t in made.values()}) == len(made)  # distinct values, distinct types
    base = core.block_type(tl.int8, [4, 8])
    interpreter._launch.langs = frozenset()
    try:
        for i, kind in enumerate(kinds):
            assert base.with_element_ty(kind) is made[(i, (4, 8))]
    finally:
        interpreter._launch.langs = None
    fresh = base.with_element_ty(tl.float32)
    assert fresh == made[(0, (4, 8))] and fresh is not made[(0, (4, 8))]
