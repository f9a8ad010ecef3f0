"""Device-function calls under the Triton interpreter without re-patching ``triton.language``.

On CPU ranks the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``). A launch there
replaces the builtins of ``triton.language`` (``tl.load``, ``tl.sum``, ...) with interpreted
ones for the length of the launch and restores them after; Triton 3.6 to 3.9 also redo that
whole replacement (an ``inspect.getmembers`` walk of ``tl``, ``tl.tensor`` and ``tl.math``) on
every call of a ``@triton.jit`` helper from inside the kernel, milliseconds a call. The
low-latency kernels call helpers per pair and per tile, so at 8 ranks a third or more of a
rank's time went to these walks, patching what was already patched.

:func:`install` makes a helper call inside a running launch skip the walk when the language
modules the helper sees are among those its launch patched, and keeps Triton's own path
otherwise (outside a launch, or a helper that sees a module the launch did not patch). The
semantics are Triton's, equivalent to::

    def helper_call(self, *args, **kwargs):      # InterpretedFunction.__call__
        if not patched_by_this_launch(self.fn):  # Triton: always
            _patch_lang(self.fn)
        return self.rewrite()(*args, **kwargs)

It also gives the interpreter's dtype lookup (``_get_np_dtype``, called by every load, cast,
splat and binary operation, which builds a 19-entry dict of Triton dtypes on each call) a
memo per element type, with the same results::

    def np_dtype(tt):                            # _get_np_dtype
        elem = tt.element_ty if isinstance(tt, tl.block_type) else tt
        return uint64 if isinstance(elem, tl.pointer_type) else NP_TYPES[elem]

And it makes the block types of a running launch once per (element type, shape): the
interpreter builds a ``tl.block_type`` for every value an operation makes (``get_block_ty``,
``with_element_ty``: about a tenth of a rank's time in the low-latency and loopback tests),
each computing its name and checking its shape again. Types compare by value (the element
type and the shape), and nothing changes one after it is made, so one object per value serves
every operation::

    def block_type(element_ty, shape):           # get_block_ty, with_element_ty in a launch
        return made.setdefault((element_ty, shape), tl.block_type(element_ty, shape))

It changes nothing on a GPU (compiled kernels never reach the interpreter, and outside a launch
``with_element_ty`` makes a new type as before) and is a no-op on a Triton whose interpreter
lacks the names it wraps.
"""
import inspect
import threading

import triton.language as tl

try:
    from triton.runtime import interpreter as _interp
except ImportError:  # pragma: no cover - a Triton without the interpreter
    _interp = None

_NAMES = ("GridExecutor", "InterpretedFunction", "_patch_lang", "InterpreterError",
          "_get_np_dtype", "InterpreterBuilder")
_launch = threading.local()  # .langs: the language modules the running launch patched
_langs_of: dict[int, frozenset] = {}  # id(fn.__globals__) -> its language modules


def _languages(fn) -> frozenset:
    """The modules ``_patch_lang(fn)`` patches: ``tl`` and ``tl.core`` where ``fn`` sees them."""
    key = id(fn.__globals__)
    langs = _langs_of.get(key)
    if langs is None:
        langs = frozenset(id(v) for v in list(fn.__globals__.values())
                          if inspect.ismodule(v) and v in (tl, tl.core))
        _langs_of[key] = langs
    return langs


def _wrap_launch(launch):
    def grid_call(self, *args, **kwargs):
        outer = getattr(_launch, "langs", None)
        _launch.langs = _languages(self.fn)
        try:
            return launch(self, *args, **kwargs)
        finally:
            _launch.langs = outer
    grid_call.__wrapped__ = launch
    return grid_call


def _helper_call(self, *args, **kwargs):
    langs = getattr(_launch, "langs", None)
    needed = _languages(self.fn)
    if langs is None or not needed <= langs:
        _interp._patch_lang(self.fn)
        if langs is not None:
            _launch.langs = langs | needed
    fn = self.rewrite()
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise _interp.InterpreterError(repr(e)) from e


def _memo_np_dtype(lookup):
    """``lookup`` (Triton's ``_get_np_dtype``) remembered per element dtype."""
    memo: dict = {}
    u64 = lookup(tl.pointer_type(tl.int8))

    def np_dtype(tt_dtype):
        elem = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(elem, tl.pointer_type):
            return u64
        found = memo.get(elem)
        if found is None:
            found = memo[elem] = lookup(elem)
        return found
    np_dtype.__moe_comm__ = True
    np_dtype.__wrapped__ = lookup
    return np_dtype


def _type_key(ty):
    """Equal for equal element types: a ``tl.dtype`` compares by its name, a pointer by its
    element, address space and constness."""
    if isinstance(ty, tl.pointer_type):
        return ("pointer", _type_key(ty.element_ty), ty.address_space, ty.const)
    return ty.name


_block_types: dict = {}  # (element type key, shape) -> the one block type of that value


def _block_type(element_ty, shape):
    """``tl.block_type(element_ty, shape)``, made once per value (a shape of plain ints)."""
    if not all(type(n) is int for n in shape):
        return tl.block_type(element_ty, shape)
    key = (_type_key(element_ty), tuple(shape))
    found = _block_types.get(key)
    if found is None:
        found = _block_types[key] = tl.block_type(element_ty, shape)
    return found


def _get_block_ty(self, dtype, shape):  # InterpreterBuilder.get_block_ty
    return _block_type(dtype, shape)


def _memo_with_element_ty(method):
    """``block_type.with_element_ty`` made once per value inside a launch (as before outside)."""
    def with_element_ty(self, scalar_ty):
        if getattr(_launch, "langs", None) is None:
            return method(self, scalar_ty)
        return _block_type(scalar_ty, self.shape)
    with_element_ty.__moe_comm__ = True
    with_element_ty.__wrapped__ = method
    return with_element_ty


def install() -> bool:
    """Applies the patch once per process; returns whether it is in place."""
    if _interp is None or not all(hasattr(_interp, n) for n in _NAMES) \
            or not hasattr(_interp.InterpretedFunction, "rewrite"):
        return False
    executor, function = _interp.GridExecutor, _interp.InterpretedFunction
    if getattr(function.__call__, "__moe_comm__", False):
        return True
    executor.__call__ = _wrap_launch(executor.__call__)
    _interp._get_np_dtype = _memo_np_dtype(_interp._get_np_dtype)
    _get_block_ty.__wrapped__ = _interp.InterpreterBuilder.get_block_ty
    _interp.InterpreterBuilder.get_block_ty = _get_block_ty
    tl.block_type.with_element_ty = _memo_with_element_ty(tl.block_type.with_element_ty)
    _helper_call.__moe_comm__ = True
    _helper_call.__wrapped__ = function.__call__
    function.__call__ = _helper_call
    return True
