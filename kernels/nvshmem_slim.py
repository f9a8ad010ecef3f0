"""The NVSHMEM device functions the kernels call, cut out of the device bitcode into a small
library of LLVM IR that compiles to the same code in a fraction of the time.

``libnvshmem_device.bc`` holds 31 MB of bitcode, and every compile that links it parses it
whole: about 5 s of a compile that otherwise takes under one (the static gate compiles dozens
of NVSHMEM variants under two Tritons). The kernels call five of its functions
(``kernels.nvshmem``). :func:`slim_bitcode` compiles a stub kernel that calls each once, keeps
the module Triton links for it, and writes that module's library part as text (``.ll``, which
``link_extern_libs`` reads like bitcode): the five functions made linkable again, everything
they reach (helpers, the device state, its version word), nothing of the stub. Triton's linker
takes only what a kernel needs from either file, so a kernel links the same functions from
both. Built once per (library, Triton release, arch) and kept under ``$MOE_COMM_CACHE_DIR``
(else ``~/.cache/moe_comm``); any failure falls back to the whole library. Equivalent::

    linked = the stub's module after link_extern_libs(stub, [libdevice, nvshmem])
    slim   = linked - the stub - the stub's debug info and module flags,
             with `define internal` -> `define` for the five entry points
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile

import triton
import triton.language as tl

from . import nvshmem

ENTRY_POINTS = ("nvshmemx_putmem_nbi_block", "nvshmem_int_p", "nvshmemx_signal_op",
                "nvshmem_fence", "nvshmem_quiet")
_STUB_FLAGS = ('"Debug Info Version"', '"nvvm-reflect-ftz"')  # the stub's, not the library's


@triton.jit
def _every_entry_point(p, pe):
    nvshmem.putmem_nbi_block(tl.load(p), tl.load(p + 1), tl.load(p + 2), pe)
    nvshmem.int_p(tl.load(p), 1, pe)
    nvshmem.signal_op(tl.load(p), tl.load(p + 1), nvshmem.NVSHMEM_SIGNAL_SET, pe)
    nvshmem.fence()
    nvshmem.quiet()


def _cache_dir() -> str:
    root = os.environ.get("MOE_COMM_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "moe_comm")
    return os.path.join(root, "nvshmem_slim")


def _file_hash(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _linked_module(full: str, arch: int) -> str:
    """The stub's LLVM module right after Triton linked ``full`` into it, as text."""
    from triton._C.libtriton import llvm
    from triton.backends.compiler import GPUTarget

    captured = []
    link = llvm.link_extern_libs

    def link_and_keep(module, paths):
        link(module, paths)
        captured.append(str(module))

    llvm.link_extern_libs = link_and_keep
    cache = os.environ.get("TRITON_CACHE_DIR")
    try:
        with tempfile.TemporaryDirectory() as fresh:  # a cached stub would link nothing
            os.environ["TRITON_CACHE_DIR"] = fresh
            src = triton.compiler.ASTSource(fn=_every_entry_point,
                                            signature={"p": "*i64", "pe": "i32"}, constexprs={})
            triton.compile(src, target=GPUTarget("cuda", arch, 32),
                           options={"extern_libs": (("libnvshmem_device", full),)})
    finally:
        llvm.link_extern_libs = link
        if cache is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = cache
    if len(captured) != 1:
        raise RuntimeError(f"the stub's compile linked {len(captured)} modules, not 1")
    return captured[0]


def library_text(linked: str) -> str:
    """The library part of the stub's linked module (module docstring)."""
    out, skipping = [], False
    for line in linked.splitlines():
        if skipping:
            skipping = line != "}"
            continue
        if line.startswith("define ") and "ptx_kernel" in line.split("@", 1)[0]:
            skipping = True  # the stub, up to its closing brace
            continue
        if line.startswith(("@global_smem ", "!llvm.dbg.cu ")):
            continue
        match = re.match(r"define internal (.*?)@([\w.$]+)\(", line)
        if match and match.group(2) in ENTRY_POINTS:
            line = line.replace("define internal ", "define ", 1)
        if line.startswith("!llvm.module.flags = "):
            keep = [node for node in re.findall(r"!\d+", line.split("=", 1)[1])
                    if not _is_stub_flag(node, linked)]
            if not keep:
                continue
            line = "!llvm.module.flags = !{" + ", ".join(keep) + "}"
        out.append(line)
    text = "\n".join(out) + "\n"
    missing = [name for name in ENTRY_POINTS
               if not re.search(rf"^define (?!internal )[^\n]*@{name}\(", text, re.M)]
    if missing:
        raise RuntimeError(f"entry points missing from the linked module: {missing}")
    return text


def _is_stub_flag(node: str, linked: str) -> bool:
    match = re.search(rf"^{re.escape(node)} = (.*)$", linked, re.M)
    return bool(match) and any(flag in match.group(1) for flag in _STUB_FLAGS)


def slim_bitcode(arch: int) -> str:
    """Path of the slim library for ``kernels.nvshmem.device_bitcode(arch)`` under this Triton
    (built on first use); the whole library's path where it cannot be built."""
    full = nvshmem.device_bitcode(arch)
    folder = _cache_dir()
    path = os.path.join(folder, f"{_file_hash(full)}-triton{triton.__version__}-sm{arch}.ll")
    if os.path.exists(path):
        return path
    try:
        text = library_text(_linked_module(full, arch))
    except Exception:  # noqa: BLE001 (any failure: the whole library still links)
        return full
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # (concurrent builders write the same text)
    return path


def with_library(options: dict, path: str) -> dict:
    """``options`` (a launch's compile options) linking ``path`` as the NVSHMEM device library
    where they link one (unchanged otherwise)."""
    libs = dict(options.get("extern_libs") or ())
    if "libnvshmem_device" not in libs:
        return options
    libs["libnvshmem_device"] = path
    return {**options, "extern_libs": tuple(libs.items())}
