"""NVSHMEM device calls for Triton kernels (GPU flavour), and where the device library lives.

Each wrapper is an ``extern`` call into ``libnvshmem_device_sm_XX.bc`` (from the
``nvidia-nvshmem-cu13`` or ``-cu12`` wheel), linked by ``triton.compile(..., options=
{"extern_libs": ...})``. The signatures follow the C prototypes of NVSHMEM 3.x exactly
(pointers as int64, ``size_t`` as int64, PEs and enums as int32; void functions declared as
returning int32, which is never read). A module that calls them must be initialised for NVSHMEM
after it is loaded (``nvshmemx_cumodule_init``; nvshmem4py's ``module_init``).

Under the Triton interpreter the same names are ``kernels.emulated_puts``' copies into the
peers' mappings, so CPU ranks across nodes over NVSHMEM run these kernels as they are.

Constants are the header values (``device_host_transport/nvshmem_common_transport.h``,
``nvshmem_constants.h``), not the ones some docstrings quote.
"""
from __future__ import annotations

import glob
import os
import re

import triton
import triton.language as tl
from triton.language import core

NVSHMEM_SIGNAL_SET = tl.constexpr(9)
NVSHMEM_SIGNAL_ADD = tl.constexpr(10)
NVSHMEM_CMP_GE = tl.constexpr(5)

_I32, _I64 = core.dtype("int32"), core.dtype("int64")


@core.extern
def putmem_nbi_block(dest, source, nbytes, pe, _semantic=None):
    """``nvshmemx_putmem_nbi_block(void *dest, const void *src, size_t nbytes, int pe)``."""
    return core.extern_elementwise(
        "", "", [dest, source, nbytes, pe],
        {(_I64, _I64, _I64, _I32): ("nvshmemx_putmem_nbi_block", _I32)},
        is_pure=False, _semantic=_semantic)


@core.extern
def int_p(dest, value, pe, _semantic=None):
    """``nvshmem_int_p(int *dest, int value, int pe)``: one 4-byte put."""
    return core.extern_elementwise(
        "", "", [dest, value, pe], {(_I64, _I32, _I32): ("nvshmem_int_p", _I32)},
        is_pure=False, _semantic=_semantic)


@core.extern
def signal_op(sig_addr, signal, sig_op, pe, _semantic=None):
    """``nvshmemx_signal_op(uint64_t *sig_addr, uint64_t signal, int sig_op, int pe)``."""
    return core.extern_elementwise(
        "", "", [sig_addr, signal, sig_op, pe],
        {(_I64, _I64, _I32, _I32): ("nvshmemx_signal_op", _I32)},
        is_pure=False, _semantic=_semantic)


@core.extern
def fence(_semantic=None):
    """``nvshmem_fence()``: puts to one PE are delivered before later puts to it."""
    return core.extern_elementwise("", "", [], {(): ("nvshmem_fence", _I32)}, is_pure=False,
                                   _semantic=_semantic)


@core.extern
def quiet(_semantic=None):
    """``nvshmem_quiet()``: every put this thread issued has completed."""
    return core.extern_elementwise("", "", [], {(): ("nvshmem_quiet", _I32)}, is_pure=False,
                                   _semantic=_semantic)


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # CPU ranks: kernels.emulated_puts
    from .emulated_puts import (  # noqa: F401, F811 (kernels import them from here)
        fence,
        int_p,
        putmem_nbi_block,
        quiet,
        signal_op,
    )


@triton.jit
def put_bytes(local_base, dst_offset, src_offset, nbytes, pe):
    """Non-blocking put of ``nbytes`` from this PE's ``local_base + src_offset`` to
    ``local_base + dst_offset`` on ``pe`` (symmetric addresses; the whole program calls it)."""
    putmem_nbi_block(tl.cast(local_base + dst_offset, tl.int64),
                     tl.cast(local_base + src_offset, tl.int64), tl.cast(nbytes, tl.int64),
                     tl.cast(pe, tl.int32))


@triton.jit
def signal_set(local_base, sig_offset, value, pe):
    """Orders the earlier puts to ``pe``, then sets the int64 word at ``sig_offset`` there."""
    fence()
    signal_op(tl.cast(local_base + sig_offset, tl.int64), tl.cast(value, tl.int64),
              NVSHMEM_SIGNAL_SET, tl.cast(pe, tl.int32))


def _wheel_lib_dirs() -> list[str]:
    try:
        import nvidia.nvshmem as wheel
    except ImportError:
        return []
    return [os.path.join(p, "lib") for p in wheel.__path__]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def nvshmem_version(lib_dir: str) -> tuple[int, ...] | None:
    """The NVSHMEM release of the library folder ``lib_dir``: from ``../include/non_abi/
    nvshmem_version.h`` (a toolkit or wheel layout), else None."""
    header = os.path.join(os.path.dirname(lib_dir.rstrip("/")), "include", "non_abi",
                          "nvshmem_version.h")
    try:
        text = open(header).read()
    except OSError:
        return None
    parts = [re.search(rf"#define\s+NVSHMEM_VENDOR_{name}_VERSION\s+(\d+)", text)
             for name in ("MAJOR", "MINOR", "PATCH")]
    return tuple(int(p.group(1)) for p in parts) if all(parts) else None


# Bitcode a Triton release's LLVM cannot read (seen, not guessed): Triton 3.6 fails to parse
# NVSHMEM 3.8.0's bitcode (LLVM 22.1); NVSHMEM 3.4.5's (LLVM 18, the release PyTorch's CUDA wheels
# pin) links under Triton 3.6 and 3.9, and 3.8.0's under 3.9.
OLDEST_TRITON_FOR_NEW_BITCODE = (3, 7)
NEWEST_NVSHMEM_FOR_OLD_TRITON = (3, 4, 99)


def check_bitcode_readable(path: str, triton_version: str = triton.__version__) -> None:
    """Raises a RuntimeError that says what to install where this Triton cannot link the
    NVSHMEM bitcode at ``path`` (device bitcode and host library must be one release, so the
    fix is an NVSHMEM that both this Triton and the job can use)."""
    release = nvshmem_version(os.path.dirname(path))
    if release is None or _version(triton_version) >= OLDEST_TRITON_FOR_NEW_BITCODE:
        return
    if release > NEWEST_NVSHMEM_FOR_OLD_TRITON:
        raise RuntimeError(
            f"Triton {triton_version} cannot read the device bitcode of NVSHMEM "
            f"{'.'.join(map(str, release))} ({path}): its LLVM is older than the one that wrote "
            "it. Install nvidia-nvshmem-cu13==3.4.5 (the release PyTorch's CUDA wheels pin; its "
            "bitcode links under Triton 3.6 to 3.9) for both the kernels and the job, or a newer "
            "Triton, or set NVSHMEM_LIB_DIR to an NVSHMEM <= 3.4 lib folder.")


def device_bitcode(arch: int) -> str:
    """Path of ``libnvshmem_device_sm_<arch>.bc`` (or a single ``libnvshmem_device.bc``) that
    this Triton can link (:func:`check_bitcode_readable`).

    Looked up in ``$NVSHMEM_LIB_DIR``, then ``$NVSHMEM_HOME/lib``, then the ``nvidia/nvshmem/lib``
    folder of the installed ``nvidia-nvshmem`` wheel (where nvshmem4py finds it too).
    """
    folders = [os.environ.get("NVSHMEM_LIB_DIR", "")]
    if os.environ.get("NVSHMEM_HOME"):
        folders.append(os.path.join(os.environ["NVSHMEM_HOME"], "lib"))
    folders += _wheel_lib_dirs()
    tried = []
    for folder in filter(None, folders):
        for name in (f"libnvshmem_device_sm_{arch}.bc", "libnvshmem_device.bc"):
            path = os.path.join(folder, name)
            tried.append(path)
            if os.path.exists(path):
                check_bitcode_readable(path)
                return path
    seen = sorted(os.path.basename(p) for f in filter(None, folders)
                  for p in glob.glob(os.path.join(f, "*.bc")))
    raise FileNotFoundError(f"no NVSHMEM device bitcode for sm_{arch}: tried {tried}; "
                            f"install nvidia-nvshmem-cu13 or set NVSHMEM_LIB_DIR (seen: {seen})")


def compiled_kernel_of(fn, compile: dict, key):
    """The CompiledKernel a ``jit_post_compile_hook`` call is about: Triton 3.6 to 3.9 file it
    in ``device_caches[device][0]`` under the hook's ``key`` before calling the hook
    (``moe_comm.testing.gate`` checks this on the Triton it runs under)."""
    return fn.jit_function.device_caches[compile["device"]][0][key]


def install_module_init_hook() -> None:
    """Initialises for NVSHMEM (``nvshmemx_cumodule_init``) every module Triton compiles with
    NVSHMEM's bitcode linked in, right after it is compiled and before its first launch.

    Installed as ``triton.knobs.runtime.jit_post_compile_hook``; a hook already there (torch
    installs one for its own NVSHMEM kernels) is kept and called first. Idempotent.
    """
    previous = triton.knobs.runtime.jit_post_compile_hook
    if getattr(previous, "moe_comm_nvshmem", False):
        return

    def hook(*, key, fn, compile, **kwargs):
        result = previous(key=key, fn=fn, compile=compile, **kwargs) if previous else None
        if "libnvshmem_device" in dict(compile.get("extern_libs") or ()):
            kernel = compiled_kernel_of(fn, compile, key)
            kernel._init_handles()  # loads the module
            from nvshmem import bindings

            status = bindings.cumodule_init(int(kernel.module))
            if status:
                raise RuntimeError(f"nvshmemx_cumodule_init failed ({status}) for "
                                   f"{fn.jit_function.fn.__name__}")
        return result

    hook.moe_comm_nvshmem = True
    triton.knobs.runtime.jit_post_compile_hook = hook
