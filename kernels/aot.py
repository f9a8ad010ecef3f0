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
import concurrent.futures
import multiprocessing
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


def compile_report(index: int, arch: int) -> tuple[bool, str]:
    """Compiles variant ``index`` for ``arch``; returns (ok, one line of report)."""
    kernel, signature, constexprs = variants()[index]
    flags = ",".join(f"{k}={int(v)}" for k, v in constexprs.items()
                     if isinstance(v, bool) or k == "TRANSPORT")
    dtype = next(iter(signature.values()))
    start = time.perf_counter()
    try:
        compiled = compile_variant(kernel, signature, constexprs, arch)
        cubin = len(compiled.asm["cubin"])
        signals = len(re.findall(r"atom\.global\.sys\.release\.", compiled.asm["ptx"]))
        ok, status = True, (f"ok  cubin {cubin:>7d} B  shared memory "
                            f"{compiled.metadata.shared} B  sys-release atomics {signals}")
    except Exception as error:  # report every failure, then fail
        ok, status = False, f"FAILED {type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return ok, (f"sm_{arch} {kernel.__name__:<24} {dtype:<6} {flags:<40} "
                f"{time.perf_counter() - start:5.1f} s  {status}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 100])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="compiles in parallel (processes)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is on: run with TRITON_INTERPRET=0 to compile for GPU targets",
              file=sys.stderr)
        return 2
    work = [(i, arch) for arch in args.arch for i in range(len(variants()))]
    if args.jobs > 1:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            results = list(pool.map(compile_report, *zip(*work)))
    else:
        results = [compile_report(i, arch) for i, arch in work]
    for _, line in results:
        print(line, flush=True)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
