"""Helpers of bench/gpu_check.sh (one lent GPU, a fixed time budget); each step prints what it
found and never raises past its own exit status.

    python bench/gpu_prepare.py facts                  # versions and the device (before install)
    python bench/gpu_prepare.py toolchain --arch 90    # nvcc, NVSHMEM, its bitcode (installed)
    python bench/gpu_prepare.py csrc --arch 90         # the csrc/ cubin for one arch, timed
    python bench/gpu_prepare.py gate --arch 90 --jobs 16 --out F --no-nvshmem
    python bench/gpu_prepare.py results --ids F --log F --out F

``gate --no-nvshmem`` is the fallback when this Triton cannot link the image's NVSHMEM bitcode:
the gate then stops while recording (``kernels.nvshmem.device_bitcode`` refuses the bitcode), so
every other variant is compiled without the NVSHMEM flavour (all a one-GPU run launches).
``results`` turns a ``pytest -v`` log into one PASS/FAIL/SKIP line per collected test id (NOT RUN
where the log has none) and prints the ids without a result, for a rerun one by one.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
import time

DISTRIBUTIONS = ("torch", "triton", "nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12",
                 "nvshmem4py-cu13", "cupy-cuda13x", "cuda-core", "cuda-python", "mpi4py",
                 "numpy", "pytest", "pytest-timeout")


def facts(_args) -> int:
    print(f"python {platform.python_version()} ({sys.executable})")
    for dist in DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        print(f"  {dist:<22} {version}")
    nvcc = shutil.which("nvcc")
    if nvcc:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        print(f"nvcc {nvcc}: {out.strip().splitlines()[-1] if out.strip() else '?'}")
    else:
        print("nvcc: not on PATH")
    import torch

    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"cuda available: {torch.cuda.is_available()}")
    import triton

    print(f"triton {triton.__version__}")
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"GPU {i}: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
              f"{p.total_memory / 2**30:.0f} GiB")
    major, minor = torch.cuda.get_device_capability(0)
    print(f"arch={10 * major + minor}")
    return 0


def toolchain(args) -> int:
    """0 when the NVSHMEM bitcode for ``--arch`` is usable by this Triton, 3 when it is not."""
    from moe_comm import csrc_build
    from moe_comm.kernels import nvshmem

    print(f"csrc: nvcc {csrc_build.find_nvcc()}, NVSHMEM {csrc_build.find_nvshmem()}")
    try:
        path = nvshmem.device_bitcode(args.arch)
    except Exception as error:  # reported; the gate then runs without the NVSHMEM flavour
        print(f"NVSHMEM bitcode for sm_{args.arch}: unusable: {type(error).__name__}: {error}")
        return 3
    release = nvshmem.nvshmem_version(os.path.dirname(path))
    print(f"NVSHMEM bitcode for sm_{args.arch}: {path} (NVSHMEM "
          f"{'.'.join(map(str, release)) if release else 'release unknown'})")
    return 0


def csrc(args) -> int:
    """Builds (or finds cached) the csrc/ cubin of ``--arch``: 0 built, 2 toolchain missing,
    1 build failed."""
    from moe_comm import csrc_build

    if csrc_build.find_nvcc() is None or csrc_build.find_nvshmem() is None:
        print(f"csrc sm_{args.arch}: not built: nvcc {csrc_build.find_nvcc()}, NVSHMEM "
              f"{csrc_build.find_nvshmem()} (kernel_impl='cuda' tests skip or fail)")
        return 2
    start = time.perf_counter()
    try:
        result = csrc_build.build((args.arch,))
    except Exception as error:
        print(f"csrc sm_{args.arch}: build FAILED after {time.perf_counter() - start:.0f} s: "
              f"{type(error).__name__}: {error}")
        return 1
    how = "compiled" if result.commands else "cached"
    print(f"csrc sm_{args.arch}: {how} in {time.perf_counter() - start:.1f} s -> "
          f"{result.cubins[args.arch]}")
    return 0


def gate(args) -> int:
    from moe_comm.testing import gate as static_gate

    configs = [c for c in static_gate.CONFIGS if c.name in args.config]
    if args.no_nvshmem:
        configs = [dataclasses.replace(c, nvshmem=False) for c in configs]
        print("gate: without the NVSHMEM flavour (its bitcode cannot be used here)",
              flush=True)
    return static_gate.run([args.arch], args.jobs, args.out, configs)


RESULT = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
WORDS = {"PASSED": "PASS", "FAILED": "FAIL", "ERROR": "FAIL", "SKIPPED": "SKIP",
         "XFAIL": "XFAIL", "XPASS": "FAIL"}
RANK = {"PASS": 0, "XFAIL": 0, "SKIP": 1, "FAIL": 2}


def results(args) -> int:
    """Writes ``--out`` (one line per test id, then a summary line) and prints the ids the log
    has no result for; exit status 1 when any test failed or has no result."""
    ids = [line.strip() for line in open(args.ids) if "::" in line]
    found: dict[str, str] = {}
    for line in open(args.log, errors="replace"):
        m = RESULT.match(line)
        if m:
            word = WORDS[m.group(2)]
            if RANK[word] >= RANK.get(found.get(m.group(1), "PASS"), 0):
                found[m.group(1)] = word  # a teardown ERROR after PASSED counts as FAIL
    lines, counts, missing = [], {}, []
    for test_id in ids:
        word = found.get(test_id, "NOT RUN")
        if word == "NOT RUN":
            missing.append(test_id)
        counts[word] = counts.get(word, 0) + 1
        lines.append(f"{word:<7} {test_id}")
    summary = ", ".join(f"{n} {w}" for w, n in sorted(counts.items()))
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + f"\nsummary: {len(ids)} tests: {summary}\n")
    for test_id in missing:
        print(test_id)
    return 1 if counts.get("FAIL") or missing else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("facts")
    for name in ("toolchain", "csrc"):
        sub.add_parser(name).add_argument("--arch", type=int, default=90)
    g = sub.add_parser("gate")
    g.add_argument("--arch", type=int, default=90)
    g.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    g.add_argument("--out", required=True)
    g.add_argument("--config", nargs="+", default=["small", "dsv3-prefill", "dsv3-decode"])
    g.add_argument("--no-nvshmem", action="store_true")
    r = sub.add_parser("results")
    for name in ("--ids", "--log", "--out"):
        r.add_argument(name, required=True)
    args = parser.parse_args(argv)
    return {"facts": facts, "toolchain": toolchain, "csrc": csrc, "gate": gate,
            "results": results}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
