"""csrc/: the CUDA C++ low-latency kernels, their build and their host launcher.

* compile: nvcc -arch=sm_XX -rdc=true against the NVSHMEM wheel's headers, device-linked with
  libnvshmem_device.a into a cubin (sm_90, sm_100); cached by source hash in MOE_COMM_CACHE_DIR.
* host logic with fakes: locating nvcc / NVSHMEM, cache keys, MOE_COMM_BUILD_CUDA, argument
  packing against the kernels' C signatures, the launcher's checks and grids.
* GPU (``-m gpu``, skipped without CUDA): the kernels on loopback virtual ranks against
  moe_comm.reference, directly and through ``Buffer(kernel_impl="cuda")``.
"""
import inspect
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moe_comm
from cases import Case, make_inputs
from moe_comm import csrc_build, csrc_kernels, reference
from moe_comm.call_descriptor import combine_descriptor
from moe_comm.kernels import comm
from moe_comm.kernels.comm import PeerTimeoutError
from moe_comm.testing import lockstep
from moe_comm.workspace import COMBINE, DISPATCH

CSRC = Path(__file__).resolve().parent.parent / "csrc"
KERNELS = tuple(csrc_kernels.SIGNATURES)


# ============================================================================ compile (nvcc)
def _toolchain_or_skip():
    nvcc = csrc_build.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda)")
    nvshmem = csrc_build.find_nvshmem()
    if nvshmem is None:
        pytest.skip("NVSHMEM headers / libnvshmem_device.a not found (pip install "
                    "nvidia-nvshmem-cu13, or set NVSHMEM_HOME / NVSHMEM_LIB_DIR)")
    return nvcc, nvshmem


def _elf_symbols(data: bytes) -> dict[str, tuple[int, int]]:
    """name -> (section index, symbol type) of a 64-bit little-endian ELF (a cubin)."""
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not a 64-bit LE ELF"
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    symbols = {}
    for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
        if sh_type != 2:  # SHT_SYMTAB
            continue
        strtab_offset = sections[link][4]
        for at in range(offset, offset + size, entsize):
            name_at, info, _, shndx = struct.unpack_from("<IBBH", data, at)
            end = data.index(b"\0", strtab_offset + name_at)
            name = data[strtab_offset + name_at:end].decode()
            if name:
                symbols[name] = (shndx, info & 0xF)
    return symbols


@pytest.mark.parametrize("arch", [90, 100])
def test_csrc_compiles_and_device_links(arch):
    """nvcc -arch=sm_XX -rdc=true -c, then -dlink -cubin with libnvshmem_device.a."""
    nvcc, nvshmem = _toolchain_or_skip()
    result = csrc_build.build((arch,), nvcc=nvcc, nvshmem=nvshmem)
    for cmd in result.commands:  # empty when the cache had it
        assert f"-arch=sm_{arch}" in cmd
    cubin = result.cubins[arch]
    symbols = _elf_symbols(cubin.read_bytes())
    for name in KERNELS:
        assert name in symbols and symbols[name] == (symbols[name][0], 2), name  # STT_FUNC
        assert symbols[name][0] != 0, f"{name} is undefined"
    # NVSHMEM's device state is defined: the device link pulled in libnvshmem_device.a
    assert symbols.get("nvshmemi_device_state_d", (0, 0))[0] != 0
    undefined = {n for n, (shndx, _) in symbols.items() if shndx == 0}
    assert {n for n in undefined if n != "vprintf" and not n.startswith(".nv.reservedSmem")} \
        == set(), undefined
    again = csrc_build.build((arch,), nvcc=nvcc, nvshmem=nvshmem)  # now from the cache
    assert again.commands == [] and again.cubins[arch] == cubin
    assert csrc_build.locate_cubin(arch) == cubin  # what the launcher loads on a GPU


def test_every_csrc_kernel_waits_with_a_system_scope_acquire(tmp_path):
    """Each kernel of csrc/ waits (acknowledgements or signals) before it reads or reuses what
    peers wrote: its PTX (sm_90, the build's own flags) holds an ``ld.acquire.sys``."""
    nvcc, nvshmem = _toolchain_or_skip()
    cmd = csrc_build.compile_commands(nvcc, nvshmem, 90, CSRC, tmp_path)[0]
    cmd[cmd.index("-c")] = "-ptx"
    cmd[cmd.index("-o") + 1] = str(tmp_path / "ll.ptx")
    subprocess.run(cmd, check=True, capture_output=True)
    bodies = re.split(r"\.entry\s+", (tmp_path / "ll.ptx").read_text())[1:]
    acquires = {b.split("(", 1)[0].strip(): len(re.findall(r"\bld\.acquire\.sys\.", b))
                for b in bodies}
    assert set(acquires) == set(KERNELS) and all(acquires.values()), acquires


def test_compile_commands_are_the_documented_ones(tmp_path):
    paths = csrc_build.NvshmemPaths(tmp_path / "include", tmp_path / "lib")
    cmds = csrc_build.compile_commands(Path("/cuda/bin/nvcc"), paths, 90, CSRC, tmp_path)
    compile_cmd, link_cmd = cmds
    assert compile_cmd[:3] == ["/cuda/bin/nvcc", "-arch=sm_90", "-rdc=true"]
    assert "-c" in compile_cmd and f"-I{tmp_path / 'include'}" in compile_cmd
    assert compile_cmd[compile_cmd.index("-c") + 1] == str(CSRC / "low_latency.cu")
    assert link_cmd[1:4] == ["-arch=sm_90", "-dlink", "-cubin"]
    assert str(tmp_path / "lib" / "libnvshmem_device.a") in link_cmd
    assert link_cmd[-1] == str(tmp_path / "low_latency_sm90.cubin")


# ============================================================================ build host logic
def _fake_nvshmem(root: Path, include="include", lib="lib") -> Path:
    (root / include).mkdir(parents=True)
    (root / include / "nvshmem.h").write_text("// fake\n")
    (root / lib).mkdir(parents=True, exist_ok=True)
    (root / lib / "libnvshmem_device.a").write_bytes(b"!<arch>\n")
    return root


def _fake_paths(root: Path) -> csrc_build.NvshmemPaths:
    root = _fake_nvshmem(root)
    return csrc_build.NvshmemPaths(root / "include", root / "lib")


def test_find_nvshmem_orders_home_lib_dir_and_pathfinder(tmp_path):
    wheel = _fake_nvshmem(tmp_path / "wheel")
    home = _fake_nvshmem(tmp_path / "home", lib="lib64")
    libdir = tmp_path / "custom"
    libdir.mkdir()
    (libdir / "libnvshmem_device.a").write_bytes(b"!<arch>\n")
    finder = lambda: str(wheel / "include")  # noqa: E731

    found = csrc_build.find_nvshmem({}, header_dir=finder)  # the wheel, lib next to include
    assert found == csrc_build.NvshmemPaths(wheel / "include", wheel / "lib")
    found = csrc_build.find_nvshmem({"NVSHMEM_HOME": str(home)}, header_dir=finder)
    assert found == csrc_build.NvshmemPaths(home / "include", home / "lib64")
    found = csrc_build.find_nvshmem({"NVSHMEM_LIB_DIR": str(libdir)}, header_dir=finder)
    assert found == csrc_build.NvshmemPaths(wheel / "include", libdir)
    found = csrc_build.find_nvshmem({"NVSHMEM_HOME": str(home), "NVSHMEM_LIB_DIR": str(libdir)},
                                    header_dir=finder)
    assert found == csrc_build.NvshmemPaths(home / "include", libdir)
    other = _fake_nvshmem(tmp_path / "other")  # NVSHMEM_LIB_DIR brings its own headers
    found = csrc_build.find_nvshmem({"NVSHMEM_LIB_DIR": str(other / "lib")}, header_dir=finder)
    assert found == csrc_build.NvshmemPaths(other / "include", other / "lib")
    assert csrc_build.find_nvshmem({}, header_dir=lambda: None) is None
    (wheel / "lib" / "libnvshmem_device.a").unlink()
    assert csrc_build.find_nvshmem({}, header_dir=finder) is None  # headers without the library


def test_find_nvshmem_default_finds_the_installed_wheel():
    nvshmem_spec = __import__("importlib").util.find_spec("nvidia.nvshmem")
    if nvshmem_spec is None:
        pytest.skip("nvidia-nvshmem wheel not installed")
    found = csrc_build.find_nvshmem({})
    assert found is not None and (found.include / "nvshmem.h").is_file()
    assert found.device_lib.is_file()


def test_find_nvcc_prefers_cuda_home(tmp_path):
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text("#!/bin/sh\n")
    on_path = tmp_path / "path-nvcc"
    on_path.write_text("#!/bin/sh\n")
    wheel = tmp_path / "wheel-nvcc"
    wheel.write_text("#!/bin/sh\n")
    assert csrc_build.find_nvcc({"CUDA_HOME": str(home)}, which=lambda _: str(on_path),
                                wheel=lambda: wheel) == home / "bin" / "nvcc"
    assert csrc_build.find_nvcc({"CUDA_HOME": str(tmp_path / "none")},
                                which=lambda _: str(on_path), wheel=lambda: wheel) == wheel
    assert csrc_build.find_nvcc({"CUDA_HOME": str(tmp_path / "none")},
                                which=lambda _: str(on_path), wheel=lambda: None) == on_path


def test_the_nvcc_wheel_is_found_where_make_installs_it():
    """``make test`` installs nvcc from PyPI (setup.py's test extra); CI never falls back to a
    compiler that happens to be on the machine."""
    nvcc = csrc_build.wheel_nvcc()
    if nvcc is None:
        pytest.skip("the nvidia-cuda-nvcc wheel is not installed (pip install -e '.[test]')")
    assert csrc_build.find_nvcc({}) == nvcc


def test_build_mode_and_cache_dir(tmp_path):
    assert csrc_build.build_mode({}) == "auto"
    assert csrc_build.build_mode({"MOE_COMM_BUILD_CUDA": "0"}) == "off"
    assert csrc_build.build_mode({"MOE_COMM_BUILD_CUDA": "1"}) == "on"
    with pytest.raises(ValueError, match="MOE_COMM_BUILD_CUDA"):
        csrc_build.build_mode({"MOE_COMM_BUILD_CUDA": "maybe"})
    assert csrc_build.cache_dir({"MOE_COMM_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert csrc_build.cache_dir({}) == Path.home() / ".cache" / "moe_comm"


class FakeNvcc:
    """Stands in for subprocess.run: records nvcc runs, writes the files they would write."""

    def __init__(self, fail_on: str | None = None):
        self.runs: list[list[str]] = []
        self.fail_on = fail_on

    def __call__(self, cmd, capture_output=True, text=True, check=False):
        self.runs.append(cmd)
        if cmd[1:] == ["--version"]:
            return subprocess.CompletedProcess(cmd, 0, "Cuda compilation tools, release 13.0", "")
        if self.fail_on and self.fail_on in " ".join(cmd):
            return subprocess.CompletedProcess(cmd, 2, "", "error: fake failure")
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"\x7fELF fake " + " ".join(cmd).encode())
        return subprocess.CompletedProcess(cmd, 0, "", "")


def _fake_src(root: Path) -> Path:
    root.mkdir()
    for name in csrc_build.SOURCES + csrc_build.HEADERS:
        (root / name).write_text(f"// {name}\n")
    return root


def test_build_caches_by_source_hash(tmp_path):
    src = _fake_src(tmp_path / "csrc")
    nvshmem = _fake_paths(tmp_path / "nv")
    env = {"MOE_COMM_CACHE_DIR": str(tmp_path / "cache")}
    nvcc = FakeNvcc()
    first = csrc_build.build((90, 100), env=env, nvcc=Path("nvcc"), nvshmem=nvshmem, src=src,
                             runner=nvcc)
    assert sorted(first.cubins) == [90, 100] and all(p.is_file() for p in first.cubins.values())
    assert len(first.commands) == 4  # compile + device link, per architecture
    assert all(p.parent.parent == tmp_path / "cache" / "csrc" for p in first.cubins.values())
    assert not list(first.cubins[90].parent.glob(".sm*"))  # scratch directories are gone
    before = len(nvcc.runs)
    again = csrc_build.build((90, 100), env=env, nvcc=Path("nvcc"), nvshmem=nvshmem, src=src,
                             runner=nvcc)
    assert again.cubins == first.cubins and again.commands == []
    assert nvcc.runs[before:] == [["nvcc", "--version"]]  # only the version, for the key
    (src / "fp8.cuh").write_text("// changed\n")
    changed = csrc_build.build((90,), env=env, nvcc=Path("nvcc"), nvshmem=nvshmem, src=src,
                               runner=nvcc)
    assert changed.cubins[90] != first.cubins[90] and len(changed.commands) == 2


def test_cache_key_covers_sources_nvcc_and_nvshmem(tmp_path):
    src = _fake_src(tmp_path / "csrc")
    nvshmem = _fake_paths(tmp_path / "nv")
    key = csrc_build.cache_key(src, nvshmem, "nvcc 13.0")
    assert key == csrc_build.cache_key(src, nvshmem, "nvcc 13.0")
    assert key != csrc_build.cache_key(src, nvshmem, "nvcc 12.8")
    nvshmem.device_lib.write_bytes(b"!<arch>\nother")
    key2 = csrc_build.cache_key(src, nvshmem, "nvcc 13.0")
    assert key2 != key
    (src / "common.cuh").write_text("// edited\n")
    assert csrc_build.cache_key(src, nvshmem, "nvcc 13.0") != key2


def test_build_failure_names_the_command(tmp_path):
    src = _fake_src(tmp_path / "csrc")
    nvshmem = _fake_paths(tmp_path / "nv")
    env = {"MOE_COMM_CACHE_DIR": str(tmp_path / "cache")}
    with pytest.raises(csrc_build.CsrcBuildError, match=r"-dlink(.|\n)*fake failure"):
        csrc_build.build((90,), env=env, nvcc=Path("nvcc"), nvshmem=nvshmem, src=src,
                         runner=FakeNvcc(fail_on="-dlink"))
    assert not list((tmp_path / "cache").rglob("*.cubin"))


def test_build_names_what_is_missing(tmp_path, monkeypatch):
    src = _fake_src(tmp_path / "csrc")
    monkeypatch.setattr(csrc_build, "find_nvcc", lambda env=None: None)
    with pytest.raises(csrc_build.CsrcBuildError, match="nvcc not found"):
        csrc_build.build((90,), env={}, src=src)
    monkeypatch.setattr(csrc_build, "find_nvshmem", lambda env=None: None)
    with pytest.raises(csrc_build.CsrcBuildError, match="NVSHMEM headers"):
        csrc_build.build((90,), env={}, src=src, nvcc=Path("nvcc"), runner=FakeNvcc())
    with pytest.raises(csrc_build.CsrcBuildError, match="sources are not available"):
        monkeypatch.setattr(csrc_build, "source_dir", lambda: None)
        csrc_build.build((90,), env={})


def test_build_for_install_honours_moe_comm_build_cuda(tmp_path):
    src = _fake_src(tmp_path / "csrc")
    nvshmem = _fake_paths(tmp_path / "nv")
    env = {"MOE_COMM_CACHE_DIR": str(tmp_path / "cache")}
    kw = dict(nvcc=Path("nvcc"), nvshmem=nvshmem, src=src)

    off = csrc_build.build_for_install({**env, "MOE_COMM_BUILD_CUDA": "0"},
                                       has_cuda_torch=lambda: True, runner=FakeNvcc(), **kw)
    assert not off.built and "MOE_COMM_BUILD_CUDA=0" in off.reason
    cpu = csrc_build.build_for_install(env, has_cuda_torch=lambda: False, runner=FakeNvcc(),
                                       **kw)
    assert not cpu.built and "torch with CUDA" in cpu.reason
    with pytest.raises(csrc_build.CsrcBuildError, match="torch with CUDA"):
        csrc_build.build_for_install({**env, "MOE_COMM_BUILD_CUDA": "1"},
                                     has_cuda_torch=lambda: False, runner=FakeNvcc(), **kw)
    failed = csrc_build.build_for_install(env, has_cuda_torch=lambda: True,
                                          runner=FakeNvcc(fail_on="-c"), **kw)
    assert not failed.built and "build failed" in failed.reason
    with pytest.raises(csrc_build.CsrcBuildError):
        csrc_build.build_for_install({**env, "MOE_COMM_BUILD_CUDA": "1"},
                                     has_cuda_torch=lambda: True, runner=FakeNvcc(fail_on="-c"),
                                     **kw)
    ok = csrc_build.build_for_install(env, has_cuda_torch=lambda: True, runner=FakeNvcc(), **kw)
    assert ok.built and sorted(ok.result.cubins) == [90, 100]


def test_build_for_install_reports_missing_toolchain(tmp_path):
    env = {"MOE_COMM_CACHE_DIR": str(tmp_path), "NVSHMEM_HOME": str(tmp_path / "none"),
           "NVSHMEM_LIB_DIR": str(tmp_path / "none")}
    decision = csrc_build.build_for_install(env, has_cuda_torch=lambda: False)
    assert not decision.built
    assert "torch with CUDA" in decision.reason and "NVSHMEM" in decision.reason


def test_this_machine_skips_the_install_build_without_cuda_torch():
    if torch.version.cuda is not None:
        pytest.skip("torch has CUDA here")
    decision = csrc_build.build_for_install({})
    assert not decision.built and "torch with CUDA" in decision.reason


# ============================================================================ launcher host logic
def _c_signatures(source: str) -> dict[str, list[tuple[str, str]]]:
    """name -> [(parameter, kind)] of every extern "C" __global__ kernel in ``source``."""
    source = re.sub(r"//[^\n]*", "", source)
    out = {}
    pattern = r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(([^)]*)\)'
    for name, params in re.findall(pattern, source):
        parsed = []
        for p in params.split(","):
            p = " ".join(p.split())
            ptype, pname = p.rsplit(" ", 1)
            if "*" in ptype or pname.startswith("*"):
                kind = "ptr"
            elif ptype in ("int32_t", "int"):
                kind = "i32"
            elif ptype == "int64_t":
                kind = "i64"
            else:
                raise AssertionError(f"{name}: parameter type {ptype!r} has no kind")
            parsed.append((pname.lstrip("*"), kind))
        out[name] = parsed
    return out


def test_signatures_match_the_cuda_source():
    found = _c_signatures((CSRC / "low_latency.cu").read_text())
    assert set(found) == set(KERNELS)
    for name in KERNELS:
        assert found[name] == list(csrc_kernels.SIGNATURES[name]), name


def test_constants_match_the_cuda_headers():
    common = (CSRC / "common.cuh").read_text()

    def constexpr(name):
        return int(re.search(rf"constexpr int {name} = (\d+);", common).group(1))

    assert constexpr("kThreads") == csrc_kernels.THREADS
    assert constexpr("kSlotBits") == comm.SLOT_BITS.value  # a count word's slots
    assert constexpr("kRefusedBit") == comm.REFUSED_BIT.value  # a refused call sends no rows
    assert int(re.search(r"constexpr int64_t kCallDiffers = (\d+);", common).group(1)) == \
        comm.CALL_DIFFERS.value
    assert 2 ** (constexpr("kFailShift") - constexpr("kTicketShift")) - 1 == \
        csrc_kernels.MAX_GRID
    assert int(re.search(r"constexpr int kMaxTopk = (\d+);",
                         (CSRC / "low_latency.cu").read_text()).group(1)) == \
        csrc_kernels.MAX_TOPK
    codes = dict(re.findall(r"k(BF16|F16|F32|F64) = (\d)", common))
    assert {"BF16": 0, "F16": 1, "F32": 2, "F64": 3} == {k: int(v) for k, v in codes.items()}
    assert csrc_kernels.DTYPE_CODES == {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2,
                                        torch.float64: 3}


def test_pack_args_orders_types_and_checks():
    values = {name: 0 for name, _ in csrc_kernels.SIGNATURES["ll_combine_recv"]}
    values.update(T=5, H=256, staging=torch.zeros(2), timeout_ns=2**40, topk_weights=None)
    packed = csrc_kernels.pack_args("ll_combine_recv", **values)
    kinds = dict(csrc_kernels.SIGNATURES["ll_combine_recv"])
    names = [n for n, _ in csrc_kernels.SIGNATURES["ll_combine_recv"]]
    for name, v in zip(names, packed):
        assert v.dtype.itemsize == {"ptr": 8, "i32": 4, "i64": 8}[kinds[name]], name
    assert int(packed[names.index("T")]) == 5 and int(packed[names.index("topk_weights")]) == 0
    assert int(packed[names.index("staging")]) == values["staging"].data_ptr()
    with pytest.raises(TypeError, match="missing"):
        csrc_kernels.pack_args("ll_combine_recv", T=1)
    with pytest.raises(TypeError, match="unknown"):
        csrc_kernels.pack_args("ll_combine_recv", **values, extra=1)
    with pytest.raises(OverflowError, match="H"):
        csrc_kernels.pack_args("ll_combine_recv", **{**values, "H": 2**31})
    with pytest.raises(TypeError, match="integer"):
        csrc_kernels.pack_args("ll_combine_recv", **{**values, "K": 1.5})


def test_grids_cover_the_work_up_to_the_ticket_field():
    """A warp per token of the send, a block per (expert, source) of the receive and the
    combine send, a block per token of the combine receive; past MAX_GRID blocks the kernels
    loop."""
    g = csrc_kernels.launch_grids(world_size=8, num_local_experts=32, max_tokens=128)
    assert g == {"ll_dispatch_send": 16, "ll_dispatch_recv": 256, "ll_combine_send": 256,
                 "ll_combine_recv": 128}
    g = csrc_kernels.launch_grids(world_size=2, num_local_experts=1, max_tokens=3)
    assert g == {"ll_dispatch_send": 1, "ll_dispatch_recv": 2, "ll_combine_send": 2,
                 "ll_combine_recv": 3}
    g = csrc_kernels.launch_grids(world_size=64, num_local_experts=64, max_tokens=4096)
    assert g["ll_dispatch_recv"] == csrc_kernels.MAX_GRID and g["ll_dispatch_send"] == 512


def test_error_record_raises_peer_timeout():
    record = torch.zeros(4, dtype=torch.int64)
    csrc_kernels.raise_if_timed_out(record, rank=0, channel="low-latency dispatch", timeout_s=1)
    record.copy_(torch.tensor([1, 3, 7, 5]))
    with pytest.raises(PeerTimeoutError, match="rank 3") as info:
        csrc_kernels.raise_if_timed_out(record, rank=1, channel="low-latency dispatch",
                                        timeout_s=1)
    assert (info.value.peer, info.value.expected, info.value.observed) == (3, 7, 5)
    record[0] = -1
    with pytest.raises(RuntimeError, match="being written"):
        csrc_kernels.raise_if_timed_out(record, rank=1, channel="x", timeout_s=1)
    csrc_kernels.raise_if_timed_out(record, rank=1, channel="x", timeout_s=1, in_flight=True)


class FakeModule:
    def __init__(self):
        self.calls = []

    def launch(self, name, grid, block, shared_bytes, args, stream):
        self.calls.append((name, grid, block, shared_bytes, args, stream))


def _decode(call):
    name, grid, block, shared, args, _ = call
    return name, grid, block, shared, dict(zip((n for n, _ in csrc_kernels.SIGNATURES[name]),
                                               (int(a) for a in args)))


def test_launcher_passes_what_the_buffer_would_pass():
    """The four launches of one low-latency round trip on CPU loopback buffers (fake module)."""
    R, E, H, T, K = 2, 4, 256, 6, 2
    bufs = moe_comm.Buffer.loopback(R, H, E, T, torch.bfloat16, low_latency=True, max_topk=K)
    buf, lay = bufs[1], bufs[1].layout
    fake = FakeModule()
    kernels = csrc_kernels.CsrcLowLatencyKernels("cpu", timeout_s=0.5, module=fake)
    xs, idxs, ws = make_inputs(Case(R, E, H, K, (T, 4), seed=3))

    def offs(name):
        return lay[name].offset, lay.parity_stride(name)

    def acks(channel):
        first = lay.offset("ll_acks", channel, 0)
        return first, lay.offset("ll_acks", channel, 1) - first

    error = csrc_kernels.new_error_record("cpu")
    kernels.ll_dispatch_send(
        xs[1], idxs[1], buf.heap.peer_ptrs, buf.ll_engine.state, buf._stats,
        offsets={n: offs(f"ll_dispatch_{n}") for n in ("rows", "meta", "signals")}, rank=1,
        num_local_experts=2, num_experts=E, max_tokens=T, slot_bytes=lay.ll_slot_bytes,
        fp8=True, ue8m0=True, acks=acks(DISPATCH), outbox_offset=12345, error=error,
        block_t=64, block_h=256, descriptor=0b101)
    name, grid, block, shared, a = _decode(fake.calls[-1])
    assert (name, grid, block, shared) == ("ll_dispatch_send", 1, 256, 4 * E)
    assert (a["T"], a["H"], a["K"], a["R"], a["L"], a["E"], a["me"], a["TMAX"]) == \
        (4, H, K, R, 2, E, 1, T)
    assert (a["rows_off"], a["rows_parity_stride"]) == offs("ll_dispatch_rows")
    assert (a["acks_off"], a["acks_parity_stride"]) == acks(DISPATCH)
    assert a["outbox_off"] == 12345 and a["fp8"] == 1 and a["ue8m0"] == 1
    assert a["x_dtype"] == 0 and a["timeout_ns"] == 500_000_000
    assert a["err"] == error.data_ptr() and a["pes"] == 0 and a["descriptor"] == 0b101
    assert a["peer_ptrs"] == buf.heap.peer_ptrs.data_ptr()

    L, rows = 2, R * T
    out = torch.empty((L, rows, H), dtype=torch.float8_e4m3fn)
    scales = torch.zeros((L, rows, 1), dtype=torch.int32)
    count = torch.empty(L, dtype=torch.int32)
    src_info, src_k = (torch.empty((L, rows), dtype=torch.int32) for _ in range(2))
    layout = torch.empty((L, R, 2), dtype=torch.int32)
    stats = torch.zeros(L, dtype=torch.int64)
    kernels.ll_dispatch_recv(
        lay.view(buf.heap, "ll_dispatch_rows"), lay.view(buf.heap, "ll_dispatch_meta"),
        lay.view(buf.heap, "ll_dispatch_signals"), buf.heap.peer_ptrs, buf.ll_engine.state, out,
        scales, count, src_info, src_k, layout, stats, acks=acks(DISPATCH), rank=1,
        scale_strides=(rows, 1, 1), ue8m0=True, input_error=buf.errors.input_part)
    name, grid, _, shared, a = _decode(fake.calls[-1])
    assert (name, grid, shared) == ("ll_dispatch_recv", 2 * R, 4 * R)
    assert a["input_err"] == buf.errors.input_part.data_ptr() == buf.errors.address + 32
    assert a["slot_bytes"] == lay.ll_slot_bytes and a["row_bytes"] == H and a["fp8"] == 1
    assert (a["scale_expert_stride"], a["scale_row_stride"], a["scale_group_stride"]) == \
        (rows, 1, 1)
    assert a["recv_stats"] == stats.data_ptr() and a["recv_stats_int64"] == 1
    assert a["err"] == 0  # no record: the kernel only stops

    y = torch.zeros((L, rows, H), dtype=torch.bfloat16)
    kernels.ll_combine_send(
        y, layout, src_info, src_k, buf.heap.peer_ptrs, buf.ll_engine.state, buf._stats,
        offsets={"rows": offs("ll_combine_rows"), "signals": offs("ll_combine_signals")},
        rank=1, max_tokens=T, max_topk=K, acks=acks(COMBINE), outbox_offset=777,
        descriptor=combine_descriptor(False))
    name, grid, _, shared, a = _decode(fake.calls[-1])
    assert (name, grid, shared, a["row_bytes"], a["KMAX"]) == ("ll_combine_send", 2 * R, 0,
                                                                 2 * H, K)
    assert (a["acks_off"], a["acks_parity_stride"]) == acks(COMBINE) and a["outbox_off"] == 777
    assert a["descriptor"] == combine_descriptor(False) == 1 << 12

    out2 = torch.empty((4, H), dtype=torch.bfloat16)
    kernels.ll_combine_recv(
        lay.view(buf.heap, "ll_combine_rows"), idxs[1], ws[1], out2, buf.heap.peer_ptrs,
        buf.ll_engine.state, acks=acks(COMBINE), rank=1,
        signals=lay.view(buf.heap, "ll_combine_signals"), input_error=buf.errors.input_part)
    name, grid, _, _, a = _decode(fake.calls[-1])
    assert (name, grid, a["T"], a["K"], a["KMAX"], a["dtype"]) == ("ll_combine_recv", T, 4, K,
                                                                   K, 0)
    assert a["input_err"] == buf.errors.input_part.data_ptr()
    assert [c[:2] for c in fake.calls] == [("ll_dispatch_send", 1), ("ll_dispatch_recv", 2 * R),
                                           ("ll_combine_send", 2 * R), ("ll_combine_recv", T)]
    assert kernels.launches == {name: 1 for name in KERNELS}


def test_launcher_rejects_bad_calls_before_launching():
    R, E, H, T = 2, 4, 256, 4
    bufs = moe_comm.Buffer.loopback(R, H, E, T, torch.bfloat16, low_latency=True)
    buf, lay = bufs[0], bufs[0].layout
    fake = FakeModule()
    kernels = csrc_kernels.CsrcLowLatencyKernels("cpu", module=fake)
    offsets = {n: (lay[f"ll_dispatch_{n}"].offset, lay.parity_stride(f"ll_dispatch_{n}"))
               for n in ("rows", "meta", "signals")}
    kw = dict(offsets=offsets, rank=0, num_local_experts=2, num_experts=E, max_tokens=T,
              slot_bytes=lay.ll_slot_bytes, fp8=False, ue8m0=False, acks=(0, 16),
              outbox_offset=0)
    x = torch.zeros((T, H), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K <= 32"):
        kernels.ll_dispatch_send(x, torch.zeros((T, 33), dtype=torch.int64), buf.heap.peer_ptrs,
                                 buf.ll_engine.state, buf._stats, **kw)
    with pytest.raises(TypeError, match="topk_idx must be"):
        kernels.ll_dispatch_send(x, torch.zeros((T, 2), dtype=torch.int32), buf.heap.peer_ptrs,
                                 buf.ll_engine.state, buf._stats, **kw)
    with pytest.raises(ValueError, match="FP8"):
        kernels.ll_dispatch_send(torch.zeros((T, 200), dtype=torch.bfloat16),
                                 torch.zeros((T, 2), dtype=torch.int64), buf.heap.peer_ptrs,
                                 buf.ll_engine.state, buf._stats, **{**kw, "fp8": True})
    with pytest.raises(ValueError, match="rank 5"):
        kernels.ll_dispatch_send(x, torch.zeros((T, 2), dtype=torch.int64), buf.heap.peer_ptrs,
                                 buf.ll_engine.state, buf._stats, **{**kw, "rank": 5})
    with pytest.raises(ValueError, match="error"):
        kernels.ll_dispatch_send(x, torch.zeros((T, 2), dtype=torch.int64), buf.heap.peer_ptrs,
                                 buf.ll_engine.state, buf._stats, **kw,
                                 error=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_experts=6"):
        kernels.ll_dispatch_send(x, torch.zeros((T, 2), dtype=torch.int64), buf.heap.peer_ptrs,
                                 buf.ll_engine.state, buf._stats, **{**kw, "num_experts": 6})
    with pytest.raises(ValueError, match="slot_bytes"):
        kernels.ll_dispatch_send(x, torch.zeros((T, 2), dtype=torch.int64), buf.heap.peer_ptrs,
                                 buf.ll_engine.state, buf._stats, **{**kw, "slot_bytes": 500})
    with pytest.raises(ValueError, match="contiguous"):
        kernels.ll_dispatch_send(torch.zeros((H, T), dtype=torch.bfloat16).t(),
                                 torch.zeros((T, 2), dtype=torch.int64), buf.heap.peer_ptrs,
                                 buf.ll_engine.state, buf._stats, **kw)
    with pytest.raises(ValueError, match="state must have 9"):
        kernels.ll_dispatch_send(x, torch.zeros((T, 2), dtype=torch.int64), buf.heap.peer_ptrs,
                                 buf._stats, buf._stats, **kw)
    L, rows = 2, R * T
    recv_args = [lay.view(buf.heap, "ll_dispatch_rows"), lay.view(buf.heap, "ll_dispatch_meta"),
                 lay.view(buf.heap, "ll_dispatch_signals"), buf.heap.peer_ptrs, buf.ll_engine.state,
                 torch.empty((L, rows, H), dtype=torch.float8_e4m3fn), None,
                 torch.empty(L, dtype=torch.int32),
                 *(torch.empty((L, rows), dtype=torch.int32) for _ in range(2)),
                 torch.empty((L, R, 2), dtype=torch.int32), None]
    recv_kw = dict(acks=(0, 16), rank=0, scale_strides=(0, 0, 0), ue8m0=False)
    with pytest.raises(ValueError, match="out_scales"):
        kernels.ll_dispatch_recv(*recv_args, **recv_kw)
    bad_out = [*recv_args[:5], torch.empty((L, rows + 1, H)), *recv_args[6:]]
    with pytest.raises(ValueError, match="out "):
        kernels.ll_dispatch_recv(*bad_out, **recv_kw)
    with pytest.raises(ValueError, match="staging must have 5 dimensions"):
        kernels.ll_dispatch_recv(recv_args[0][0], *recv_args[1:], **recv_kw)
    with pytest.raises(ValueError, match="y "):
        kernels.ll_combine_send(torch.zeros((L, rows + 1, H), dtype=torch.bfloat16),
                                *recv_args[-4:-1], buf.heap.peer_ptrs, buf.ll_engine.state,
                                buf._stats, offsets={}, rank=0, max_tokens=T, max_topk=2,
                                acks=(0, 16), outbox_offset=0)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.ll_combine_recv(lay.view(buf.heap, "ll_combine_rows"),
                                torch.zeros((T + 1, 2), dtype=torch.int64), None,
                                torch.empty((T + 1, H), dtype=torch.bfloat16),
                                buf.heap.peer_ptrs, buf.ll_engine.state, acks=(0, 16), rank=0,
                                signals=lay.view(buf.heap, "ll_combine_signals"))
    assert fake.calls == []
    with pytest.raises(RuntimeError, match="CUDA devices"):
        csrc_kernels.CsrcLowLatencyKernels("cpu")


def test_locate_cubin_without_sources_or_prebuilt(monkeypatch, tmp_path):
    monkeypatch.setattr(csrc_build, "source_dir", lambda: None)
    monkeypatch.setattr(csrc_build, "packaged_dir", lambda: tmp_path)
    with pytest.raises(csrc_build.CsrcBuildError, match="neither the sources"):
        csrc_build.locate_cubin(90)
    (tmp_path / "low_latency_sm90.cubin").write_bytes(b"\x7fELF")
    assert csrc_build.locate_cubin(90) == tmp_path / "low_latency_sm90.cubin"


# ============================================================================ GPU
GPU_CASES = [  # (case, fp8, ue8m0, col_major)
    (Case(2, 8, 2048, 8, (5, 3), seed=21), True, False, False),
    (Case(2, 4, 7168, 2, (2, 1), seed=22), True, True, False),
    (Case(4, 16, 128, 16, (7, 0, 4, 9), seed=23), False, False, False),
    (Case(4, 32, 256, 8, (8, 8, 2, 6), routing="empty_rank", seed=24), True, False, True),
    (Case(8, 16, 128, 2, (3, 1, 0, 4, 2, 5, 1, 3), routing="zipf", seed=25), True, True, True),
    (Case(8, 64, 7168, 8, (128,) * 8, seed=26), True, False, False),
    (Case(8, 32, 1024, 4, (16,) * 8, dtype=torch.float16, seed=27), False, False, False),
]
GPU_IDS = [f"{c}-fp8{int(f)}-ue{int(u)}-cm{int(m)}" for c, f, u, m in GPU_CASES]


def _check_dispatch(got, want, fp8):
    for r, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g.count.cpu(), w.count), r
        for e, n in enumerate(w.count.tolist()):
            a, b = g.x[e, :n].cpu(), w.x[e, :n]
            assert torch.equal(a.view(torch.uint8) if fp8 else a,
                               b.view(torch.uint8) if fp8 else b), (r, e)
            assert torch.equal(g.src_info[e, :n].cpu(), w.src_info[e, :n]), (r, e)
            if fp8:
                assert torch.equal(g.x_scales[e, :n].cpu(), w.x_scales[e, :n]), (r, e)


def _csrc_round_trip(bufs, kernels, xs, idxs, ws, fp8, ue8m0, col_major):
    """One low-latency dispatch + combine on every virtual rank, launched straight through
    CsrcLowLatencyKernels (what Buffer(kernel_impl="cuda") does), sends before receives."""
    from moe_comm.low_latency import LowLatencyRecv, _ll_scales_out

    R, lay = len(bufs), bufs[0].layout
    L, T, H, dev = lay.num_local_experts, lay.max_tokens, lay.hidden, bufs[0].device

    def offs(name):
        return lay[name].offset, lay.parity_stride(name)

    def acks(channel):
        first = lay.offset("ll_acks", channel, 0)
        return first, lay.offset("ll_acks", channel, 1) - first

    errors = [csrc_kernels.new_error_record(dev) for _ in bufs]
    for r, buf in enumerate(bufs):
        kernels.ll_dispatch_send(
            xs[r], idxs[r], buf.heap.peer_ptrs, buf.ll_engine.state, buf._stats,
            offsets={n: offs(f"ll_dispatch_{n}") for n in ("rows", "meta", "signals")}, rank=r,
            num_local_experts=L, num_experts=buf.num_experts, max_tokens=T,
            slot_bytes=lay.ll_slot_bytes, fp8=fp8, ue8m0=ue8m0, acks=acks(DISPATCH),
            outbox_offset=0, error=errors[r])
    recvs = []
    for r, buf in enumerate(bufs):
        rows = R * T
        x = torch.empty((L, rows, H), device=dev,
                        dtype=torch.float8_e4m3fn if fp8 else lay.dtype)
        scales, memory, strides = None, None, (0, 0, 0)
        if fp8:
            scales, memory, strides = _ll_scales_out(L, rows, H // 128, ue8m0, col_major, dev)
            if ue8m0:
                memory.zero_()
        count = torch.empty(L, dtype=torch.int32, device=dev)
        src_info, src_k = (torch.empty((L, rows), dtype=torch.int32, device=dev)
                           for _ in range(2))
        layout = torch.empty((L, R, 2), dtype=torch.int32, device=dev)
        staging = lay.view(buf.heap, "ll_dispatch_rows")
        kernels.ll_dispatch_recv(
            staging if fp8 else staging.view(lay.dtype), lay.view(buf.heap, "ll_dispatch_meta"),
            lay.view(buf.heap, "ll_dispatch_signals"), buf.heap.peer_ptrs, buf.ll_engine.state, x,
            memory, count, src_info, src_k, layout, None, acks=acks(DISPATCH), rank=r,
            scale_strides=strides, ue8m0=ue8m0, error=errors[r])
        recvs.append((LowLatencyRecv(x, scales, count, src_info, None), layout, src_k))
    ys = [torch.randn((L, R * T, H), device=dev).to(lay.dtype) for _ in bufs]
    outs = [torch.empty((idx.shape[0], H), dtype=lay.dtype, device=dev) for idx in idxs]
    for r, (buf, (_, layout, src_k)) in enumerate(zip(bufs, recvs)):
        kernels.ll_combine_send(
            ys[r], layout, recvs[r][0].src_info, src_k, buf.heap.peer_ptrs, buf.ll_engine.state,
            buf._stats, offsets={"rows": offs("ll_combine_rows"),
                                 "signals": offs("ll_combine_signals")},
            rank=r, max_tokens=T, max_topk=lay.max_topk, acks=acks(COMBINE), outbox_offset=0,
            error=errors[r])
    for r, buf in enumerate(bufs):
        kernels.ll_combine_recv(
            lay.view(buf.heap, "ll_combine_rows"), idxs[r], ws[r] if ws else None, outs[r],
            buf.heap.peer_ptrs, buf.ll_engine.state, acks=acks(COMBINE), rank=r,
            signals=lay.view(buf.heap, "ll_combine_signals"), error=errors[r])
    torch.cuda.synchronize(dev)
    for r, err in enumerate(errors):
        csrc_kernels.raise_if_timed_out(err, rank=r, channel="low-latency", timeout_s=10)
    return [rv for rv, _, _ in recvs], ys, outs


def _expected_stats(idxs, rank, L, H, b, fp8, ue8m0):
    """Bytes one call stores (dispatch to peers, to itself, combine to peers, to itself), as
    the Triton kernels count them: payload + meta per pair, one row per pair back, signals."""
    R = len(idxs)
    payload = H + (H // 128) * (1 if ue8m0 else 4) if fp8 else H * b
    out = [8 * (R - 1) * L, 8 * L, 8 * (R - 1), 8]
    for s, idx in enumerate(idxs):
        dest = idx[idx >= 0] // L
        if s == rank:
            out[0] += int((dest != rank).sum()) * (payload + 4)
            out[1] += int((dest == rank).sum()) * (payload + 4)
        out[2 if s != rank else 3] += int((dest == rank).sum()) * H * b
    return out


@pytest.mark.parametrize("fp8, ue8m0", [(True, True), (False, False)])
def test_expected_stats_is_how_the_triton_kernels_count(fp8, ue8m0):
    """The byte accounting the GPU test demands of the CUDA kernels, checked on the Triton ones
    (interpreter, CPU loopback)."""
    case = Case(2, 4, 128, 2, (3, 2), seed=9)
    bufs = moe_comm.Buffer.loopback(2, 128, 4, 3, torch.bfloat16, low_latency=True)
    xs, idxs, ws = make_inputs(case)
    got = lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=fp8, ue8m0=ue8m0)
    lockstep.low_latency_combine(bufs, [torch.zeros_like(g.x, dtype=torch.bfloat16)
                                        for g in got], idxs, ws, [g.handle for g in got])
    for r, buf in enumerate(bufs):
        assert buf._stats.tolist() == _expected_stats(idxs, r, 2, 128, 2, fp8, ue8m0), r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case, fp8, ue8m0, col_major", GPU_CASES, ids=GPU_IDS)
def test_gpu_csrc_kernels_match_reference(case, fp8, ue8m0, col_major):
    iterations = 3  # both parities, and the in-kernel wait for the acks of a reused one
    R, T = case.world_size, case.max_tokens
    bufs = moe_comm.Buffer.loopback(R, case.hidden, case.num_experts, T, case.dtype,
                                    low_latency=True, device="cuda")
    kernels = csrc_kernels.CsrcLowLatencyKernels("cuda", timeout_s=10)
    b = torch.empty((), dtype=case.dtype).element_size()
    stats = [[0] * 4 for _ in bufs]
    for it in range(iterations):
        xs, idxs, ws = make_inputs(case, it)
        got, ys, outs = _csrc_round_trip(bufs, kernels, [x.cuda() for x in xs],
                                         [i.cuda() for i in idxs], [w.cuda() for w in ws],
                                         fp8, ue8m0, col_major)
        want = reference.low_latency_dispatch_all(xs, idxs, num_experts=case.num_experts,
                                                  max_tokens=T, fp8=fp8, ue8m0=ue8m0,
                                                  col_major_scales=col_major)
        _check_dispatch(got, want, fp8)
        ref = reference.low_latency_combine_all([y.cpu() for y in ys], idxs, ws, want, T)
        for r in range(R):
            assert torch.equal(outs[r].cpu(), ref[r]), r
            want_bytes = _expected_stats(idxs, r, case.num_experts // R, case.hidden, b, fp8,
                                         ue8m0)
            stats[r] = [a + w for a, w in zip(stats[r], want_bytes)]
            assert bufs[r]._stats.cpu().tolist() == stats[r], (it, r)
    for buf in bufs:  # epochs advanced once per call; ticket words back to 0; the Triton
        # waits' timed-out flag (kernels.low_latency.TIMED_OUT), which csrc/ leaves alone
        assert buf.ll_engine.state.cpu().tolist() == [iterations] * 4 + [0] * 4 + [0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_receive_without_sender_times_out_and_returns():
    bufs = moe_comm.Buffer.loopback(2, 128, 4, 4, torch.bfloat16, low_latency=True,
                                    device="cuda")
    buf, lay = bufs[0], bufs[0].layout
    kernels = csrc_kernels.CsrcLowLatencyKernels("cuda", timeout_s=0.05)
    error = csrc_kernels.new_error_record("cuda")
    first = lay.offset("ll_acks", COMBINE, 0)
    kernels.ll_combine_recv(
        lay.view(buf.heap, "ll_combine_rows"), torch.zeros((2, 2), dtype=torch.int64,
                                                           device="cuda"),
        None, torch.empty((2, 128), dtype=torch.bfloat16, device="cuda"), buf.heap.peer_ptrs,
        buf.ll_engine.state, acks=(first, lay.offset("ll_acks", COMBINE, 1) - first), rank=0,
        signals=lay.view(buf.heap, "ll_combine_signals"), error=error)
    torch.cuda.synchronize()
    flag, peer, expected, observed = error.tolist()
    assert (flag, expected, observed) == (1, 1, 0) and peer in (0, 1)
    with pytest.raises(PeerTimeoutError):
        csrc_kernels.raise_if_timed_out(error, rank=0, channel="low-latency combine",
                                        timeout_s=0.05)
    # nothing published, ticket restored; the Triton waits' timed-out flag is not csrc/'s
    assert buf.ll_engine.state.cpu().tolist() == [0] * 8 + [0]


def _on_gpu_with_compiled_triton(test):
    """GPU tests that launch compiled Triton kernels beside the csrc/ ones."""
    for mark in (pytest.mark.gpu,
                 pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
                 pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1",
                                    reason="compiled Triton kernels needed (run with "
                                           "TRITON_INTERPRET=0)")):
        test = mark(test)
    return test


def _buffer_api_or_skip():
    if "kernel_impl" not in inspect.signature(moe_comm.Buffer.loopback).parameters:
        pytest.skip("Buffer.loopback(kernel_impl=...) is not available yet")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("fp8, ue8m0", [(True, False), (True, True), (False, False)])
def test_gpu_buffer_kernel_impl_cuda_matches_reference(world_size, fp8, ue8m0):
    _buffer_api_or_skip()
    case = Case(world_size, 4 * world_size, 2048, 4, tuple(range(3, 3 + world_size)),
                seed=30 + world_size)
    T = case.max_tokens
    bufs = moe_comm.Buffer.loopback(world_size, case.hidden, case.num_experts, T, case.dtype,
                                    low_latency=True, device="cuda", kernel_impl="cuda")
    for it in range(3):
        xs, idxs, ws = make_inputs(case, it)
        got = lockstep.low_latency_dispatch(bufs, [x.cuda() for x in xs],
                                            [i.cuda() for i in idxs], fp8=fp8, ue8m0=ue8m0)
        want = reference.low_latency_dispatch_all(xs, idxs, num_experts=case.num_experts,
                                                  max_tokens=T, fp8=fp8, ue8m0=ue8m0)
        _check_dispatch(got, want, fp8)
        ys = [torch.randn(g.x.shape, device="cuda").to(case.dtype) for g in got]
        outs = lockstep.low_latency_combine(bufs, ys, [i.cuda() for i in idxs],
                                            [w.cuda() for w in ws], [g.handle for g in got])
        ref = reference.low_latency_combine_all([y.cpu() for y in ys], idxs, ws, want, T)
        for r in range(world_size):
            assert torch.equal(outs[r].cpu(), ref[r]), r


@_on_gpu_with_compiled_triton
def test_gpu_triton_and_cuda_ranks_interoperate_call_by_call():
    """Ranks switch implementation on every call; both write the same slots and signals."""
    _buffer_api_or_skip()
    bench = str(Path(__file__).resolve().parent.parent / "bench")
    if bench not in sys.path:
        sys.path.append(bench)
    from gpu_compare import assert_within_one_ulp, ll_combine_slack
    case = Case(4, 16, 1024, 4, (6, 5, 0, 7), seed=41)
    T = case.max_tokens
    bufs = moe_comm.Buffer.loopback(4, case.hidden, case.num_experts, T, case.dtype,
                                    low_latency=True, device="cuda", kernel_impl="cuda")
    for it in range(4):
        for r, buf in enumerate(bufs):
            buf.ll_engine.kernel_impl = "cuda" if (r + it) % 2 else "triton"
        xs, idxs, ws = make_inputs(case, it)
        got = lockstep.low_latency_dispatch(bufs, [x.cuda() for x in xs],
                                            [i.cuda() for i in idxs], fp8=True)
        want = reference.low_latency_dispatch_all(xs, idxs, num_experts=case.num_experts,
                                                  max_tokens=T, fp8=True)
        _check_dispatch(got, want, True)
        ys = [torch.randn(g.x.shape, device="cuda").to(case.dtype) for g in got]
        outs = lockstep.low_latency_combine(bufs, ys, [i.cuda() for i in idxs],
                                            [w.cuda() for w in ws], [g.handle for g in got])
        ys_cpu = [y.cpu() for y in ys]
        ref = reference.low_latency_combine_all(ys_cpu, idxs, ws, want, T)
        # the compiled Triton combine may fuse multiply-adds (TRITON_DEFAULT_FP_FUSION=1, as
        # bench/gpu_check.sh runs): within one ulp, as tests/test_gpu.py checks it
        slack = ll_combine_slack(ys_cpu, [w.count for w in want], idxs, ws)
        for r in range(4):
            assert_within_one_ulp(outs[r], ref[r], slack[r], what=f"call {it} combine rank {r}")


def _bad_rows_are_sent_nowhere_and_raised(device: str, kernel_impl: str) -> None:
    """Bad rows of topk_idx (an id out of range on rank 0, an expert twice on rank 3) reach
    nobody and combine to zeros; the dispatch hooks of those ranks raise naming the row (the
    combine, given the same ids, says nothing again); the other ranks and the next call are
    right."""
    case = Case(4, 16, 1024, 4, (6, 5, 0, 7), seed=44)
    T = case.max_tokens
    bufs = moe_comm.Buffer.loopback(4, case.hidden, case.num_experts, T, case.dtype,
                                    low_latency=True, device=device, kernel_impl=kernel_impl)
    xs, idxs, ws = make_inputs(case, 0)
    bad = [i.clone() for i in idxs]
    assert (bad[3][3] >= 0).all()  # four experts: one repeated makes the row bad
    bad[0][1, 0] = case.num_experts  # out of range
    bad[3][3, 1] = bad[3][3, 0]  # an expert twice
    clean = [i.clone() for i in bad]
    clean[0][1] = -1
    clean[3][3] = -1
    want = reference.low_latency_dispatch_all(xs, clean, num_experts=case.num_experts,
                                              max_tokens=T, fp8=True)

    def hooks(sent, raising):
        if device == "cuda":
            torch.cuda.synchronize()
        errors = {}
        for r, (_, hook) in enumerate(sent):
            try:
                hook()
            except ValueError as error:
                errors[r] = str(error)
        assert sorted(errors) == raising, errors
        if raising:
            assert "row 1 holds expert id 16" in errors[0] and "row 3 picks expert" in errors[3]
        return [result for result, _ in sent]

    got = hooks([b.low_latency_dispatch(x.to(device), i.to(device), fp8=True, return_hook=True)
                 for b, x, i in zip(bufs, xs, bad)], [0, 3])
    _check_dispatch(got, want, True)
    ys = [torch.randn(g.x.shape).to(case.dtype).to(device) for g in got]
    outs = hooks([b.low_latency_combine(y, i.to(device), w.to(device), g.handle,
                                        return_hook=True)
                  for b, y, i, w, g in zip(bufs, ys, bad, ws, got)], [])  # told at dispatch
    ref = reference.low_latency_combine_all([y.cpu() for y in ys], clean, ws, want, T)
    for r in range(4):
        assert torch.equal(outs[r].cpu(), ref[r]), r
    assert not outs[0][1].any() and not outs[3][3].any()
    got = lockstep.low_latency_dispatch(bufs, [x.to(device) for x in xs],
                                        [i.to(device) for i in idxs], fp8=True)
    _check_dispatch(got, reference.low_latency_dispatch_all(
        xs, idxs, num_experts=case.num_experts, max_tokens=T, fp8=True), True)


def test_bad_rows_are_sent_nowhere_and_raised_by_the_triton_kernels():
    """What the csrc/ kernels are held to below, on CPU ranks with the Triton kernels."""
    _bad_rows_are_sent_nowhere_and_raised("cpu", "triton")


@_on_gpu_with_compiled_triton
def test_gpu_cuda_kernels_send_bad_rows_nowhere_and_raise():
    """csrc/ kernels get topk_idx with bad rows cleared (one checking launch per op)."""
    _buffer_api_or_skip()
    _bad_rows_are_sent_nowhere_and_raised("cuda", "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_cuda_graph_replays_the_low_latency_pair():
    """Capture dispatch + combine of every virtual rank once, replay with new inputs."""
    _buffer_api_or_skip()
    case = Case(2, 8, 2048, 4, (8, 8), seed=51)
    T = case.max_tokens
    bufs = moe_comm.Buffer.loopback(2, case.hidden, case.num_experts, T, case.dtype,
                                    low_latency=True, device="cuda", kernel_impl="cuda")
    xs, idxs, ws = make_inputs(case, 0)
    x_in = [x.cuda() for x in xs]
    i_in = [i.cuda() for i in idxs]
    w_in = [w.cuda() for w in ws]
    y_in = [torch.zeros((case.num_experts // 2, 2 * T, case.hidden), device="cuda",
                        dtype=case.dtype) for _ in bufs]
    lockstep.low_latency_dispatch(bufs, x_in, i_in, fp8=True)  # warm-up (loads the module)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = lockstep.low_latency_dispatch(bufs, x_in, i_in, fp8=True)
        outs = lockstep.low_latency_combine(bufs, y_in, i_in, w_in, [g.handle for g in got])
    for it in range(1, 4):
        xs, idxs, ws = make_inputs(case, it)
        for dst, src in zip(x_in + i_in + w_in, [x.cuda() for x in xs] + [i.cuda() for i in idxs]
                            + [w.cuda() for w in ws]):
            dst.copy_(src)
        for y in y_in:
            y.normal_()
        graph.replay()
        torch.cuda.synchronize()
        want = reference.low_latency_dispatch_all(xs, idxs, num_experts=case.num_experts,
                                                  max_tokens=T, fp8=True)
        _check_dispatch(got, want, True)
        ref = reference.low_latency_combine_all([y.cpu() for y in y_in], idxs, ws, want, T)
        for r in range(2):
            assert torch.equal(outs[r].cpu(), ref[r]), (it, r)


def test_kernel_impl_auto_takes_the_faster_of_the_last_gpu_run(monkeypatch):
    """``kernel_impl="auto"`` (the default): on a GPU the low-latency ops take the faster
    implementation of the last measured run (``FASTER_ON_GPU``: Triton since 2026-12-04); where
    that is csrc/, csrc/ where it can serve the Buffer and its cubin loads; everything else
    runs the Triton kernels."""
    from moe_comm import buffer
    from moe_comm.buffer import check_kernel_impl

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")

    def loads(device):
        return True

    assert buffer.FASTER_ON_GPU == {"low_latency": "triton", "normal": "triton"}
    assert check_kernel_impl("auto", gpu, True, csrc_loads=loads) == "triton"
    monkeypatch.setitem(buffer.FASTER_ON_GPU, "low_latency", "cuda")  # a run where csrc/ wins
    assert check_kernel_impl("auto", cpu, True, csrc_loads=loads) == "triton"
    assert check_kernel_impl("auto", gpu, False, csrc_loads=loads) == "triton"  # normal mode
    assert check_kernel_impl("auto", gpu, True, csrc_loads=loads) == "cuda"
    assert check_kernel_impl("auto", gpu, True, csrc_loads=lambda d: False) == "triton"
    assert check_kernel_impl("auto", gpu, True, True, csrc_loads=loads) == "triton"  # FT
    assert check_kernel_impl("auto", gpu, True, proxy=True, csrc_loads=loads) == "triton"
    assert check_kernel_impl("triton", gpu, True) == "triton"
    assert check_kernel_impl("cuda", gpu, True) == "cuda"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        check_kernel_impl("cuda", cpu, True)
    with pytest.raises(ValueError, match="kernel_impl must be one of"):
        check_kernel_impl("cupy", gpu, True)
    # a CPU Buffer resolves to Triton
    assert moe_comm.Buffer.loopback(2, 64, 4, 4, low_latency=True)[0].kernel_impl == "triton"


def test_an_automatic_csrc_leaves_what_it_lacks_to_triton():
    """Per call: csrc/ chosen by ``auto`` hands MXFP8, NVFP4 and FP8 combines to the Triton
    kernels; asked for by name it keeps them (and the call raises, naming Triton)."""
    from types import SimpleNamespace

    from moe_comm.low_latency import LowLatencyEngine

    auto = SimpleNamespace(kernel_impl="cuda", kernel_impl_auto=True)
    named = SimpleNamespace(kernel_impl="cuda", kernel_impl_auto=False)
    triton_buf = SimpleNamespace(kernel_impl="triton", kernel_impl_auto=True)
    assert LowLatencyEngine._impl(auto, True) == "cuda"
    assert LowLatencyEngine._impl(auto, False) == "triton"
    assert LowLatencyEngine._impl(named, False) == "cuda"
    assert LowLatencyEngine._impl(triton_buf, True) == "triton"
