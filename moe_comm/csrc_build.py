"""Build ``csrc/`` into cubins that are loaded at run time (no torch extension, no GPU needed).

Per target architecture ``sm_XX`` (default sm_90 and sm_100), two nvcc steps::

    nvcc -arch=sm_XX -rdc=true -std=c++17 -O3 -I<nvshmem>/include -c csrc/low_latency.cu -o ll.o
    nvcc -arch=sm_XX -dlink -cubin ll.o <nvshmem>/lib/libnvshmem_device.a -o low_latency_smXX.cubin

The device link resolves the NVSHMEM device functions, so the cubin loads with
``cuda.core.ObjectCode.from_cubin`` or ``cupy.RawModule(path=...)``; ``moe_comm.csrc_kernels``
then initialises it for NVSHMEM (``nvshmem.core.library_init`` / ``module_init``).

Where things are found (the way nvshmem4py and ``cuda.pathfinder`` find them):

* nvcc: ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``, the ``nvidia-cuda-nvcc`` wheel, ``PATH``,
  ``/usr/local/cuda/bin``.
* NVSHMEM headers: ``$NVSHMEM_HOME/include`` (or ``src/include``), else
  ``cuda.pathfinder.find_nvidia_header_directory("nvshmem")`` (the ``nvidia-nvshmem-cu12/13``
  wheel), else the ``nvidia.nvshmem`` package directory.
* ``libnvshmem_device.a``: ``$NVSHMEM_LIB_DIR``, else ``$NVSHMEM_HOME/lib`` (or ``lib64``), else
  ``../lib`` next to the headers.

Built cubins are cached under ``$MOE_COMM_CACHE_DIR`` (default ``~/.cache/moe_comm``) in
``csrc/<key>/``, where the key hashes the sources, the flags, the architecture, nvcc's version and
the NVSHMEM headers and library: an unchanged tree never compiles twice. ``MOE_COMM_BUILD_CUDA``
steers the build at install time (:func:`build_for_install`): ``0`` skips it, ``1`` requires it,
unset builds where CUDA torch, nvcc and NVSHMEM are all present.

Pure Python on purpose: ``setup.py`` loads this file by path, before moe_comm is importable.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SOURCES = ("low_latency.cu",)  # translation units, linked into one cubin per architecture
HEADERS = ("common.cuh", "fp8.cuh")
MODULE_NAME = "low_latency"
DEFAULT_ARCHS = (90, 100)
COMPILE_FLAGS = ("-rdc=true", "-std=c++17", "-O3", "-lineinfo")
DEVICE_LIB = "libnvshmem_device.a"
BUILD_ENV = "MOE_COMM_BUILD_CUDA"
CACHE_ENV = "MOE_COMM_CACHE_DIR"
PACKAGED_DIR = "_cubins"  # inside the installed package (non-editable installs)


class CsrcBuildError(RuntimeError):
    """nvcc, the NVSHMEM headers or library are missing, or a compile step failed."""


@dataclass(frozen=True)
class NvshmemPaths:
    include: Path  # holds nvshmem.h
    lib: Path  # holds libnvshmem_device.a

    @property
    def device_lib(self) -> Path:
        return self.lib / DEVICE_LIB


@dataclass
class BuildResult:
    cubins: dict[int, Path]  # architecture -> cubin
    commands: list[list[str]] = field(default_factory=list)  # the nvcc runs (empty: cached)
    seconds: float = 0.0


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


# --------------------------------------------------------------------------------- locations
def source_dir() -> Path | None:
    """``csrc/`` of a source checkout (also an editable install), None in an installed wheel."""
    path = Path(__file__).resolve().parent.parent / "csrc"
    return path if (path / SOURCES[0]).is_file() else None


def packaged_dir() -> Path:
    """Where a non-editable install keeps the cubins that setup.py built."""
    return Path(__file__).resolve().parent / PACKAGED_DIR


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$MOE_COMM_CACHE_DIR``, default ``~/.cache/moe_comm``."""
    raw = _env(env).get(CACHE_ENV, "")
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "moe_comm"


def build_mode(env: Mapping[str, str] | None = None) -> str:
    """``MOE_COMM_BUILD_CUDA``: ``"off"`` (0), ``"on"`` (1) or ``"auto"`` (unset)."""
    raw = _env(env).get(BUILD_ENV, "").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw in ("0", "false", "no", "off"):
        return "off"
    if raw in ("1", "true", "yes", "on"):
        return "on"
    raise ValueError(f"{BUILD_ENV}={raw!r}: use 0 (skip the CUDA build), 1 (require it) or leave "
                     "it unset (build where CUDA torch, nvcc and NVSHMEM are present)")


def wheel_nvcc() -> Path | None:
    """nvcc of the ``nvidia-cuda-nvcc`` wheel (``site-packages/nvidia/cu13/bin``; it finds its
    headers, cicc and ptxas relative to itself), else None."""
    try:
        import nvidia
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for cuda in ("cu13", "cu12"):
            path = Path(root) / cuda / "bin" / "nvcc"
            if path.is_file():
                return path
    return None


def find_nvcc(env: Mapping[str, str] | None = None,
              which: Callable[[str], str | None] = shutil.which,
              wheel: Callable[[], Path | None] = wheel_nvcc) -> Path | None:
    """nvcc from ``$CUDA_HOME``, ``$CUDA_PATH``, the ``nvidia-cuda-nvcc`` wheel, ``PATH`` or
    ``/usr/local/cuda``, else None (``make test`` installs the wheel: CI does not depend on a
    system CUDA)."""
    env = _env(env)
    candidates = [Path(env[v]) / "bin" / "nvcc" for v in ("CUDA_HOME", "CUDA_PATH") if env.get(v)]
    from_wheel = wheel()
    if from_wheel is not None:
        candidates.append(from_wheel)
    found = which("nvcc")
    if found:
        candidates.append(Path(found))
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    return next((c for c in candidates if c.is_file()), None)


def _default_header_dir() -> str | None:
    """The NVSHMEM include directory as nvshmem4py finds it (cuda.pathfinder), else the wheel's."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        find_nvidia_header_directory = None
    if find_nvidia_header_directory is not None:
        try:
            found = find_nvidia_header_directory("nvshmem")
        except Exception:  # an unknown name or a broken install: fall through to the wheel
            found = None
        if found:
            return str(found)
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        include = Path(location) / "include"
        if (include / "nvshmem.h").is_file():
            return str(include)
    return None


def find_nvshmem(env: Mapping[str, str] | None = None,
                 header_dir: Callable[[], str | None] = _default_header_dir
                 ) -> NvshmemPaths | None:
    """NVSHMEM headers and the directory of ``libnvshmem_device.a``, or None if either is missing.

    ``NVSHMEM_HOME`` overrides both, ``NVSHMEM_LIB_DIR`` the library (and the headers, when
    ``NVSHMEM_LIB_DIR/../include`` has them)."""
    env = _env(env)
    include = lib = None
    home = env.get("NVSHMEM_HOME")
    if home:
        include = next((Path(home) / d for d in ("include", "src/include")
                        if (Path(home) / d / "nvshmem.h").is_file()), None)
        lib = next((Path(home) / d for d in ("lib", "lib64")
                    if (Path(home) / d / DEVICE_LIB).is_file()), None)
    lib_dir = env.get("NVSHMEM_LIB_DIR")
    if lib_dir:
        lib = Path(lib_dir)
        sibling = lib.parent / "include"
        if include is None and (sibling / "nvshmem.h").is_file():
            include = sibling
    if include is None:
        found = header_dir()
        include = Path(found) if found else None
    if include is None or not (include / "nvshmem.h").is_file():
        return None
    if lib is None:
        lib = include.parent / "lib"
    if not (lib / DEVICE_LIB).is_file():
        return None
    return NvshmemPaths(include, lib)


# --------------------------------------------------------------------------------- commands
def compile_commands(nvcc: Path, nvshmem: NvshmemPaths, arch: int, src: Path, out: Path
                     ) -> list[list[str]]:
    """The nvcc runs that turn ``src`` (csrc/) into ``out/low_latency_sm{arch}.cubin``."""
    objects = [out / f"{Path(s).stem}_sm{arch}.o" for s in SOURCES]
    cmds = [[str(nvcc), f"-arch=sm_{arch}", *COMPILE_FLAGS, f"-I{nvshmem.include}", "-c",
             str(src / s), "-o", str(o)] for s, o in zip(SOURCES, objects)]
    cmds.append([str(nvcc), f"-arch=sm_{arch}", "-dlink", "-cubin", *map(str, objects),
                 str(nvshmem.device_lib), "-o", str(out / cubin_name(arch))])
    return cmds


def cubin_name(arch: int) -> str:
    return f"{MODULE_NAME}_sm{arch}.cubin"


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_key(src: Path, nvshmem: NvshmemPaths, nvcc_version: str) -> str:
    """Hash of everything that decides the cubins' bytes (the architecture is in the name)."""
    h = hashlib.sha256()
    for name in sorted(SOURCES + HEADERS):
        h.update(name.encode() + b"\0" + (src / name).read_bytes() + b"\0")
    h.update(" ".join(COMPILE_FLAGS).encode() + b"\0" + nvcc_version.encode() + b"\0")
    version_h = nvshmem.include / "non_abi" / "nvshmem_version.h"
    if version_h.is_file():
        h.update(version_h.read_bytes())
    h.update(_file_digest(nvshmem.device_lib).encode())
    return h.hexdigest()[:20]


def nvcc_version(nvcc: Path, runner=subprocess.run) -> str:
    proc = runner([str(nvcc), "--version"], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise CsrcBuildError(f"{nvcc} --version failed: {proc.stderr.strip()[-500:]}")
    return proc.stdout.strip()


# --------------------------------------------------------------------------------- building
def _run(cmd: list[str], runner) -> None:
    proc = runner(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-4000:]
        raise CsrcBuildError(f"nvcc failed (exit {proc.returncode}):\n  {' '.join(cmd)}\n{tail}")


def _build_arch(nvcc: Path, nvshmem: NvshmemPaths, arch: int, src: Path, target: Path,
                runner) -> list[list[str]]:
    """Compiles into a scratch directory, then moves the cubin into place atomically."""
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target, prefix=f".sm{arch}-") as scratch:
        cmds = compile_commands(nvcc, nvshmem, arch, src, Path(scratch))
        for cmd in cmds:
            _run(cmd, runner)
        os.replace(Path(scratch) / cubin_name(arch), target / cubin_name(arch))
    return cmds


def build(archs: Sequence[int] = DEFAULT_ARCHS, *, env: Mapping[str, str] | None = None,
          nvcc: Path | None = None, nvshmem: NvshmemPaths | None = None,
          src: Path | None = None, runner=subprocess.run) -> BuildResult:
    """Cubins of csrc/ for ``archs``, from the cache or compiled (architectures in parallel).

    Raises :class:`CsrcBuildError` naming what is missing or the failing nvcc command."""
    src = src or source_dir()
    if src is None:
        raise CsrcBuildError("csrc/ sources are not available (installed without them); use the "
                             "cubins setup.py built, or install from a source checkout")
    nvcc = nvcc or find_nvcc(env)
    if nvcc is None:
        raise CsrcBuildError("nvcc not found: install the CUDA toolkit or set CUDA_HOME")
    nvshmem = nvshmem or find_nvshmem(env)
    if nvshmem is None:
        raise CsrcBuildError("NVSHMEM headers or libnvshmem_device.a not found: pip install "
                             "nvidia-nvshmem-cu13 (or -cu12), or set NVSHMEM_HOME / "
                             "NVSHMEM_LIB_DIR")
    target = cache_dir(env) / "csrc" / cache_key(src, nvshmem, nvcc_version(nvcc, runner))
    cubins = {a: target / cubin_name(a) for a in archs}
    missing = [a for a, p in cubins.items() if not p.is_file()]
    start = time.perf_counter()
    commands: list[list[str]] = []
    if missing:
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(missing)) as pool:
            for cmds in pool.map(lambda a: _build_arch(nvcc, nvshmem, a, src, target, runner),
                                 missing):
                commands += cmds
        seconds = time.perf_counter() - start
        (target / f"build-{'-'.join(map(str, missing))}.json").write_text(json.dumps(
            {"commands": commands, "seconds": round(seconds, 2)}, indent=1))
    return BuildResult(cubins, commands, time.perf_counter() - start)


def locate_cubin(arch: int, env: Mapping[str, str] | None = None) -> Path:
    """The cubin for ``sm_{arch}``: built (or cached) from csrc/ in a source checkout, else the one
    a non-editable install shipped."""
    if source_dir() is not None:
        return build((arch,), env=env).cubins[arch]
    packaged = packaged_dir() / cubin_name(arch)
    if packaged.is_file():
        return packaged
    raise CsrcBuildError(f"no csrc cubin for sm_{arch}: this install has neither the sources nor "
                         f"a prebuilt {cubin_name(arch)}; reinstall with CUDA torch, nvcc and "
                         f"NVSHMEM present (and {BUILD_ENV} unset or 1)")


# --------------------------------------------------------------------------------- setup.py
@dataclass
class InstallDecision:
    built: bool
    reason: str
    result: BuildResult | None = None


def torch_has_cuda() -> bool:
    """True when the installed torch was built with CUDA (a GPU need not be present)."""
    try:
        import torch
    except ImportError:
        return False
    return getattr(torch.version, "cuda", None) is not None


def build_for_install(env: Mapping[str, str] | None = None, *,
                      has_cuda_torch: Callable[[], bool] = torch_has_cuda,
                      archs: Sequence[int] = DEFAULT_ARCHS, **build_kwargs) -> InstallDecision:
    """What setup.py does: build where CUDA torch, nvcc and NVSHMEM are present.

    ``MOE_COMM_BUILD_CUDA=0`` skips; ``=1`` turns every missing piece and failure into an error;
    unset, a missing piece or a failed compile only skips (the kernels build on first use)."""
    mode = build_mode(env)
    if mode == "off":
        return InstallDecision(False, f"{BUILD_ENV}=0")
    missing = []
    if not has_cuda_torch():
        missing.append("torch with CUDA")
    if build_kwargs.get("nvcc") is None and find_nvcc(env) is None:
        missing.append("nvcc")
    if build_kwargs.get("nvshmem") is None and find_nvshmem(env) is None:
        missing.append("NVSHMEM headers and libnvshmem_device.a")
    if missing:
        reason = "missing " + ", ".join(missing)
        if mode == "on":
            raise CsrcBuildError(f"{BUILD_ENV}=1 but {reason}")
        return InstallDecision(False, reason)
    try:
        result = build(archs, env=env, **build_kwargs)
    except CsrcBuildError as exc:
        if mode == "on":
            raise
        return InstallDecision(False, f"build failed: {exc}")
    return InstallDecision(True, f"built sm_{', sm_'.join(map(str, archs))}", result)
