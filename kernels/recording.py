"""Record the kernel launches a piece of code makes, without a GPU and without running them.

    with recording(arch=90) as launches:
        some_launcher(meta_tensors...)        # kernel[grid](...) calls are recorded, not run
    launches[0].signature, .constexprs, .attrs, .options, .key, .grid, .scalars

Inside the block Triton's runtime believes it drives a GPU of ``sm_<arch>`` (a stand-in driver)
and its cache hook turns every launch into a record: the signature, constants and divisibility
attributes Triton itself derives from the real arguments (so ``do_not_specialize``, value-1
constants and 16-byte alignment facts are exactly those of a real launch), and the options the
launcher passed (warps, NVSHMEM's bitcode). Pass tensors on the ``meta`` device: they carry
shapes, dtypes and aligned addresses, and no memory. Needs ``TRITON_INTERPRET`` off. Each
record also keeps the launch's grid and the values of its scalar arguments (what the gate's
grid and serial-trip rules read).
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field

import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction


@dataclass(frozen=True)
class Launch:
    """One recorded launch: what ``triton.compile`` needs to build exactly that kernel."""

    kernel: object = field(compare=False)  # the JITFunction
    signature: dict = field(compare=False)
    constexprs: dict = field(compare=False)
    attrs: dict = field(compare=False)
    options: dict = field(compare=False)
    key: str  # Triton's cache key of the specialisation (the same key: the same binary)
    grid: tuple = field(default=(1, 1, 1), compare=False)  # programs per grid axis
    scalars: dict = field(default_factory=dict, compare=False)  # int/float/bool arguments

    @property
    def programs(self) -> int:
        """Programs of the launch (the grid's product)."""
        n = 1
        for g in self.grid:
            n *= g
        return n

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    @property
    def uses_nvshmem(self) -> bool:
        return "libnvshmem_device" in dict(self.options.get("extern_libs") or ())

    def flags(self) -> dict:
        """The launch's constexpr parameters by name (the variant: modes, tiles)."""
        names = list(self.signature)
        return {names[path[0]]: value for path, value in self.constexprs.items()
                if len(path) == 1}


class _StandInDriver:
    """What Triton's launch path asks of a driver before it compiles."""

    def __init__(self, arch: int):
        self._target = GPUTarget("cuda", arch, 32)

    def is_active(self) -> bool:
        return True

    def get_current_device(self) -> int:
        """Not a real device's index: Triton keeps the kernels it compiled per device, and a
        kernel this process already compiled for its GPU (device 0) would be found there and
        launched with the recording's meta tensors instead of being recorded."""
        return -self._target.arch

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self._target


def _key(compile: dict) -> str:
    return str(compile["key"])


def _options(compile: dict) -> dict:
    """Every compile option of the launch (warps, maxnreg, NVSHMEM's bitcode, ...), as the
    runtime parsed them: compiling with these gives the binary (and cache key) of a real run."""
    options = json.loads(compile["specialization_data"])["options"]
    return {k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list)
            else v for k, v in options.items()}


def post_compile_hook_finds_the_kernel(arch: int = 90) -> str:
    """Compiles a small kernel (Triton's ``warmup``, under the stand-in driver) with a
    ``jit_post_compile_hook`` that looks the compiled kernel up the way the NVSHMEM module
    initialisation does (``nvshmem.compiled_kernel_of``); returns what it found, raises if the
    lookup fails on this Triton."""
    import torch
    import triton.language as tl

    from .nvshmem import compiled_kernel_of

    @triton.jit
    def probe(out, n, BLOCK: tl.constexpr):
        lanes = tl.arange(0, BLOCK)
        tl.store(out + lanes, lanes.to(tl.float32), mask=lanes < n)

    found = []

    def hook(*, key, fn, compile, **kwargs):
        found.append(compiled_kernel_of(fn, compile, key))

    previous_hook = triton.knobs.runtime.jit_post_compile_hook
    previous_driver = getattr(driver, "_active", None)
    driver.set_active(_StandInDriver(arch))
    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        probe.warmup(torch.empty(16, device="meta"), 5, BLOCK=16, grid=(1,))
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous_hook
        driver.set_active(previous_driver)
    if len(found) != 1 or "cubin" not in found[0].asm:
        raise RuntimeError(f"Triton {triton.__version__}: the post-compile hook found {found}, "
                           "not the compiled kernel; NVSHMEM modules would not be initialised")
    return f"Triton {triton.__version__}: the post-compile hook finds the compiled kernel"


@contextlib.contextmanager
def recording(arch: int = 90):
    """Collects a :class:`Launch` for every ``kernel[grid](...)`` inside the block; nothing is
    compiled or run. Restores Triton's driver and hook afterwards."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("recording launches needs compiled kernels: set TRITON_INTERPRET=0 "
                           "before triton is imported")
    launches: list[Launch] = []
    calls: list[tuple] = []  # (grid, scalars) of the launch in progress

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        grid, scalars = calls[-1] if calls else ((1, 1, 1), {})
        launches.append(Launch(fn.jit_function, dict(compile["signature"]),
                               dict(compile["constants"]), dict(compile["configs"][0]),
                               _options(compile), _key(compile), grid, scalars))
        return True  # handled: Triton compiles and launches nothing

    run = JITFunction.run

    def recorded_run(self, *args, grid, warmup, **kwargs):
        values = dict(zip(self.arg_names, args))
        values.update((k, v) for k, v in kwargs.items() if k in self.arg_names)
        scalars = {k: v for k, v in values.items() if isinstance(v, (bool, int, float))}
        if callable(grid):
            grid = grid(values)
        calls.append((tuple(grid) + (1,) * (3 - len(grid)), scalars))
        try:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            calls.pop()

    previous_hook = triton.knobs.runtime.jit_cache_hook
    previous_driver = getattr(driver, "_active", None)  # None: chosen lazily (none here)
    driver.set_active(_StandInDriver(arch))
    triton.knobs.runtime.jit_cache_hook = hook
    JITFunction.run = recorded_run
    try:
        yield launches
    finally:
        JITFunction.run = run
        triton.knobs.runtime.jit_cache_hook = previous_hook
        driver.set_active(previous_driver)


@dataclass
class LaunchCall:
    """One launch a :class:`StandInKernel` received: what a compiled kernel's launcher gets."""

    kernel: object
    grid: tuple
    stream: int
    args: tuple


class StandInKernel:
    """What a compile returns inside :func:`compiled_stand_ins`: a compiled kernel whose
    launcher records its launches instead of running them."""

    def __init__(self, name: str, key: str, log: list, runtime_args: tuple[str, ...] = ()):
        self.name, self.key = name, key
        self.function = id(self)  # a handle distinct per kernel
        self.packed_metadata = ()
        self.runtime_args = runtime_args  # the compiled kernel's parameters a launch passes
        self._log = log

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, g0, g1, g2, stream, function, packed_metadata, metadata, enter_hook,
            exit_hook, *args):
        if function != self.function:
            raise RuntimeError(f"{self.name}: launched with another kernel's handle")
        self._log.append(LaunchCall(self, (g0, g1, g2), stream, args))


def runtime_args(signature: dict, constexprs: dict) -> tuple[str, ...]:
    """The parameters a compiled kernel takes at run time, in order: those of ``signature``
    (name -> type, as a compile gets it) neither declared ``tl.constexpr`` nor specialised to a
    constant by the launch (an int equal to 1, a None: ``constexprs`` holds them by path)."""
    return tuple(name for i, (name, ty) in enumerate(signature.items())
                 if ty != "constexpr" and (i,) not in constexprs)


@contextlib.contextmanager
def compiled_stand_ins(arch: int = 90):
    """Inside the block Triton believes it drives a GPU of ``sm_<arch>`` (as in
    :func:`recording`) and every compile returns a :class:`StandInKernel`, cached like a real
    compiled kernel, so each launch takes Triton's whole launch path (binder, cache key, the
    check of globals) or a bound one (``kernels.bound``) and ends in the stand-in's launcher.
    Yields the list of :class:`LaunchCall` s. Needs ``TRITON_INTERPRET`` off."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compiled stand-ins need TRITON_INTERPRET=0 before triton is "
                           "imported")
    calls: list[LaunchCall] = []
    compile_ = JITFunction._do_compile

    def stand_in(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = StandInKernel(self.fn.__name__, key, calls, runtime_args(signature, constexprs))
        self.device_caches[device][0][key] = kernel
        cached.append((self, device, key))
        return kernel

    previous_driver = getattr(driver, "_active", None)
    driver.set_active(_StandInDriver(arch))
    JITFunction._do_compile = stand_in
    cached = []  # (kernel, device, key): dropped afterwards, so no real launch finds them
    try:
        yield calls
    finally:
        JITFunction._do_compile = compile_
        driver.set_active(previous_driver)
        for fn, device, key in cached:
            fn.device_caches[device][0].pop(key, None)
