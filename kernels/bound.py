"""Launches whose arguments are bound once: later calls skip Triton's argument binding.

A Triton launch ``kernel[grid](*args, **constexprs)`` binds and specialises every argument on
every call (its binder, its cache key, its check of the kernel's globals, its launch metadata):
tens of microseconds of host time for kernels of 20-60 arguments, on every op. Most of a
Buffer's arguments never change (staging pointers and offsets, sizes, tiles, the flavour's
words); a few do (the caller's tensors, the outputs made per call, the token count).

A :class:`BoundLaunch` keeps the compiled kernel of the first launch, its grid and its whole
argument list, and launches a later call through the compiled kernel's own launcher (what
Triton's ``JITFunction.run`` ends in), with only the arguments named *varying* replaced::

    if not call_bound(launches, key, (x, topk_idx, T)):     # the varying values, in order
        launch(launches, key, kernel, grid, args, kwargs, varying=("x", "topk_idx", "T"))

is ``kernel[grid](*args, **kwargs)`` with ``x, topk_idx, T`` in place of the first call's.
``key`` must hold everything the fixed arguments, the constexprs and the grid depend on (the
owner's tensors by ``id``: a bound launch holds them, so no other tensor can take their id),
and each varying int's value that Triton specialises on. What Triton specialises the varying
tensors on, each one's dtype and whether its address is 16-byte aligned (:func:`specs`), the
bound launch keeps: a call whose tensors differ there takes Triton's path, which binds the key
again. The stream and device
are read per call, as Triton does (a CUDA-graph capture launches on its own stream), and so
are the launch hooks (profilers; the launch metadata is built only while one is installed); a
call made while another device is current takes Triton's path (its kernel for that device).

Where nothing is compiled (the interpreter on CPU ranks, the gate's recording) the first launch
returns no compiled kernel: nothing is bound and every call takes Triton's path.
``MOE_COMM_BOUND_LAUNCHES=0`` (:data:`ENABLED`) sends every call through Triton's path.

:data:`VERIFY` (``MOE_COMM_VERIFY_BOUND=1``: tests, and the GPU check's first pass) sends every
call through Triton's path and then checks that the bound launch would have made the same
launch: the same compiled kernel (the same specialisation), grid, and every argument (tensors
by storage, offset, dtype, shape and strides). It raises :class:`BoundLaunchMismatch` naming
the argument otherwise.
"""
from __future__ import annotations

import os

import torch
from triton import knobs
from triton.knobs import HookChain
from triton.runtime.driver import driver

VERIFY = os.environ.get("MOE_COMM_VERIFY_BOUND", "0") not in ("", "0")
ENABLED = os.environ.get("MOE_COMM_BOUND_LAUNCHES", "1") not in ("", "0")  # 0: Triton's path
MAX_BOUND = 512  # bound launches kept per owner; past it the oldest is dropped


class BoundLaunchMismatch(AssertionError):
    """A bound launch would not have launched what Triton's path launched (``VERIFY``)."""


def specs(values) -> tuple:
    """What Triton specialises each of ``values`` on where it is a tensor: its dtype and
    whether its address is 16-byte aligned; None for anything else."""
    out = []
    for v in values:
        out.append((v.dtype, v.data_ptr() % 16 == 0) if isinstance(v, torch.Tensor) else None)
    return tuple(out)


def _compiled(result) -> bool:
    """Whether a launch returned a compiled kernel that can be launched again directly."""
    return (result is not None and hasattr(result, "packed_metadata")
            and hasattr(result, "launch_metadata") and hasattr(result, "function"))


def _signature_args(kernel, args: tuple, kwargs: dict) -> list:
    """The kernel's parameters in signature order, as Triton's binder gives them to the
    launcher (positional, then keywords, then defaults)."""
    values = list(args)
    for param in kernel.params[len(args):]:
        if param.name in kwargs:
            values.append(kwargs[param.name])
        elif param.has_default:
            values.append(param.default)
        else:
            raise TypeError(f"{kernel.fn.__name__}: no value for parameter {param.name!r}")
    return values


def _grid3(grid) -> tuple:
    """A launch grid as its three axes."""
    return tuple(grid) + (1,) * (3 - len(grid))


class BoundLaunch:
    """One kernel launch with every argument but the varying ones fixed (module docstring)."""

    __slots__ = ("kernel", "compiled", "device", "options", "grid", "args", "slots", "name",
                 "names", "specs")

    def __init__(self, kernel, compiled, grid: tuple, args: list, varying: tuple[str, ...],
                 options: dict):
        names = kernel.arg_names
        missing = [v for v in varying if v not in names]
        if missing:
            raise ValueError(f"{kernel.fn.__name__} has no parameters {missing}")
        self.kernel, self.compiled, self.options = kernel, compiled, options
        self.device = driver.active.get_current_device()  # the compiled kernel's device
        self.grid = _grid3(grid)
        self.slots = tuple(names.index(v) for v in varying)
        self.specs = specs([args[slot] for slot in self.slots])  # what a call must match
        # the first call's varying values are not kept: they may be large tensors that are
        # the caller's to free (outputs, inputs); every call brings its own
        self.args = [None if i in self.slots else a for i, a in enumerate(args)]
        self.name = kernel.fn.__name__
        self.names = names

    def arguments(self, values: tuple) -> list:
        """The whole argument list with ``values`` in the varying slots."""
        args = self.args.copy()
        for slot, value in zip(self.slots, values):
            args[slot] = value
        return args

    def __call__(self, *values) -> None:
        args = self.args.copy()  # (self.arguments inline: this runs on every launch)
        for slot, value in zip(self.slots, values):
            args[slot] = value
        device = driver.active.get_current_device()
        if device != self.device:  # another current device: Triton's path, its own kernel
            self.kernel[self.grid](*args, **self.options)
            return
        stream = driver.active.get_current_stream(device)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        kernel = self.compiled
        hooked = enter is not None and (not isinstance(enter, HookChain) or bool(enter.calls))
        metadata = kernel.launch_metadata(self.grid, stream, *args) if hooked else None
        g0, g1, g2 = self.grid
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, metadata, enter,
                   leave, *args)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return (a.untyped_storage()._cdata == b.untyped_storage()._cdata
                and a.storage_offset() == b.storage_offset() and a.dtype == b.dtype
                and a.shape == b.shape and a.stride() == b.stride())
    return type(a) is type(b) and a == b


class BoundLaunches:
    """An owner's (a Buffer's) bound launches by key."""

    def __init__(self):
        self._bound: dict = {}
        self._offered: dict = {}  # VERIFY: key -> the varying values the caller offered
        self.bound_calls = 0  # launches made through a bound launch (tests count them)

    def __len__(self) -> int:
        return len(self._bound)

    def launch(self, key, kernel, grid, args: tuple, kwargs: dict, varying: tuple[str, ...]):
        """``kernel[grid](*args, **kwargs)`` through Triton's path; binds it to ``key`` when it
        returned a compiled kernel (under :data:`VERIFY`: checks it against the bound launch of
        ``key`` first)."""
        compiled = kernel[grid](*args, **kwargs)
        if not ENABLED or not _compiled(compiled):
            return compiled
        params = _signature_args(kernel, args, kwargs)
        bound = self._bound.get(key)
        if bound is not None and bound.specs != specs([params[s] for s in bound.slots]):
            del self._bound[key]  # its tensors specialised otherwise: bound again
            bound = None
        if bound is None:
            self._offered.pop(key, None)
            if len(self._bound) >= MAX_BOUND:
                self._bound.pop(next(iter(self._bound)))
            options = {k: v for k, v in kwargs.items() if k not in kernel.arg_names}
            self._bound[key] = BoundLaunch(kernel, compiled, grid, params, varying, options)
        elif VERIFY:
            _verify(bound, compiled, grid, params, self._offered.pop(key, None))
        return compiled  # (bound, not VERIFY: a miss of another key of the caller's group)


def _verify(bound: BoundLaunch, compiled, grid, params: list, offered: tuple | None) -> None:
    values = tuple(params[slot] for slot in bound.slots)
    if offered is None or len(offered) != len(values):
        raise BoundLaunchMismatch(f"{bound.name}: the caller offered {offered!r} for the "
                                  f"varying arguments {[bound.names[i] for i in bound.slots]}")
    for slot, a, b in zip(bound.slots, offered, values):
        if not _same(a, b):
            raise BoundLaunchMismatch(f"{bound.name}: varying argument {bound.names[slot]!r} "
                                      f"offered {a!r}, Triton's path passed {b!r}")
    if compiled is not bound.compiled:
        raise BoundLaunchMismatch(f"{bound.name}: the key took another specialisation")
    if _grid3(grid) != bound.grid:
        raise BoundLaunchMismatch(f"{bound.name}: grid {tuple(grid)}, bound {bound.grid}")
    for name, a, b in zip(bound.names, bound.arguments(values), params):
        if not _same(a, b):
            raise BoundLaunchMismatch(f"{bound.name}: argument {name!r} would be {a!r}, "
                                      f"Triton's path passed {b!r}")


def call_bound(launches: BoundLaunches | None, key, values: tuple, *more) -> bool:
    """Launches ``values`` through the bound launch of ``key`` (then each further ``(key,
    values)`` pair of ``more`` through its own) if every one is bound; whether it did (if not,
    nothing was launched)."""
    if launches is None or not ENABLED:
        return False
    if VERIFY:
        launches._offered.update(((key, values),) + more)
        return False
    table = launches._bound
    pairs = []  # every one bound and its tensors specialised alike, or none launched
    for k, vs in ((key, values), *more):  # (loops: no function's frame per op)
        bound = table.get(k)
        if bound is None:
            return False
        got = []  # specs(vs), inline
        for v in vs:
            got.append((v.dtype, v.data_ptr() % 16 == 0) if isinstance(v, torch.Tensor)
                       else None)
        if tuple(got) != bound.specs:
            return False
        pairs.append((bound, vs))
    for bound, vs in pairs:
        bound(*vs)
    launches.bound_calls += len(pairs)
    return True


def launch(launches: BoundLaunches | None, key, kernel, grid, args: tuple, kwargs: dict,
           varying: tuple[str, ...]):
    """``kernel[grid](*args, **kwargs)``, bound to ``key`` in ``launches`` (if given)."""
    if launches is None:
        return kernel[grid](*args, **kwargs)
    return launches.launch(key, kernel, grid, args, kwargs, varying)
