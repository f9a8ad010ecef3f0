"""Compile every kernel specialization for GPU targets on any machine (no GPU or driver needed).

    python -m moe_comm.kernels.aot --arch 90 100

Uses ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``, which builds PTX
and a cubin without a driver; prints one line per specialization. Must run with
``TRITON_INTERPRET`` unset or 0 (the interpreter replaces ``@triton.jit`` kernels). Compiled
results land in Triton's cache (``TRITON_CACHE_DIR``), keyed by source and options, so repeated
runs are fast.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time


def variants():
    """(kernel, signature, constexprs) for every specialization of every kernel module."""
    from . import combine, comm, dispatch, layout, low_latency, quant

    return (layout.COMPILE_VARIANTS + quant.COMPILE_VARIANTS + comm.COMPILE_VARIANTS
            + dispatch.COMPILE_VARIANTS + combine.COMPILE_VARIANTS
            + low_latency.COMPILE_VARIANTS)


def compile_variant(kernel, signature: dict, constexprs: dict, arch: int):
    """Returns the compiled kernel (read ``.asm`` and ``.metadata`` only; never ``.run``).

    Variants with ``TRANSPORT=1`` call NVSHMEM and are linked against its device bitcode.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .nvshmem import device_bitcode

    full = dict(signature)
    full.update({name: "constexpr" for name in constexprs})
    src = ASTSource(fn=kernel, signature=full, constexprs=dict(constexprs))
    options = {}
    if constexprs.get("TRANSPORT") == 1:
        options["extern_libs"] = (("libnvshmem_device", device_bitcode(arch)),)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 100])
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is on: run with TRITON_INTERPRET=0 to compile for GPU targets",
              file=sys.stderr)
        return 2
    failures = 0
    for arch in args.arch:
        for kernel, signature, constexprs in variants():
            flags = ",".join(f"{k}={int(v)}" for k, v in constexprs.items()
                             if isinstance(v, bool) or k == "TRANSPORT")
            dtype = next(iter(signature.values()))
            start = time.perf_counter()
            try:
                compiled = compile_variant(kernel, signature, constexprs, arch)
                cubin = len(compiled.asm["cubin"])
                signals = len(re.findall(r"atom\.global\.sys\.release\.", compiled.asm["ptx"]))
                status = (f"ok  cubin {cubin:>7d} B  shared memory {compiled.metadata.shared} B"
                          f"  sys-release atomics {signals}")
            except Exception as error:  # report every failure, then fail
                failures += 1
                status = f"FAILED {type(error).__name__}: {str(error).splitlines()[0][:200]}"
            print(f"sm_{arch} {kernel.__name__:<24} {dtype:<6} {flags:<40} "
                  f"{time.perf_counter() - start:5.1f} s  {status}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
