"""Host logic of the heaps and the GPU paths that can be checked without a GPU.

What needs a GPU (and is only compile-checked here): CudaHeap and NvshmemHeap past their
checks, the GPU flavours of the kernels (tests/test_gate.py compiles and reads them), and
``pytest -m gpu`` in tests/test_gpu.py.
"""
import os

import pytest
import torch

import moe_comm
from cases import Case, make_inputs
from moe_comm.kernels.nvshmem import device_bitcode
from moe_comm.symm.select import choose_backend

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize("requested, device, nodes, expected", [
    ("auto", CPU, 1, "shm"), ("auto", GPU, 1, "cuda"), ("auto", GPU, 4, "nvshmem"),
    ("nvshmem", GPU, 1, "nvshmem"), ("cuda", GPU, 1, "cuda"), ("shm", CPU, 1, "shm"),
])
def test_backend_choice(requested, device, nodes, expected):
    assert choose_backend(requested, device, nodes) == expected


@pytest.mark.parametrize("requested, device, nodes, message", [
    ("shm", GPU, 1, "holds CPU tensors"), ("cuda", CPU, 1, "needs a CUDA device"),
    ("cuda", GPU, 2, "spans 2 hosts"), ("shm", CPU, 3, "spans one host"),
    ("loopback", CPU, 1, "backend must be one of"), ("ib", GPU, 2, "backend must be one of"),
])
def test_backend_choice_errors(requested, device, nodes, message):
    with pytest.raises(ValueError, match=message):
        choose_backend(requested, device, nodes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a CPU-only torch")
def test_gpu_heaps_say_what_is_missing():
    from moe_comm.symm.cuda import CudaHeap
    from moe_comm.symm.nvshmem import NvshmemHeap

    for heap in (CudaHeap, NvshmemHeap):
        with pytest.raises(RuntimeError, match="CUDA build of torch"):
            heap(None, 1024, GPU)


def test_nvshmem_unique_id_round_trip():
    core = pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed")
    from moe_comm.symm.nvshmem import decode_unique_id, encode_unique_id

    uid = core.get_unique_id()
    payload = encode_unique_id(uid)
    assert len(payload) > 8 and any(payload)
    assert encode_unique_id(decode_unique_id(core, payload)) == payload


def test_device_bitcode_lookup(tmp_path, monkeypatch):
    pytest.importorskip("nvidia.nvshmem", reason="the nvidia-nvshmem wheel is not installed")
    for arch in (90, 100):
        path = device_bitcode(arch)
        assert path.endswith((f"libnvshmem_device_sm_{arch}.bc", "libnvshmem_device.bc"))
        assert os.path.getsize(path) > 1_000_000
    override = tmp_path / "libnvshmem_device_sm_90.bc"
    override.write_bytes(b"BC")
    monkeypatch.setenv("NVSHMEM_LIB_DIR", str(tmp_path))
    assert device_bitcode(90) == str(override)


def test_device_bitcode_missing_names_what_it_tried(tmp_path, monkeypatch):
    monkeypatch.setenv("NVSHMEM_LIB_DIR", str(tmp_path))
    monkeypatch.setattr("moe_comm.kernels.nvshmem._wheel_lib_dirs", lambda: [])
    with pytest.raises(FileNotFoundError, match="libnvshmem_device_sm_77.bc"):
        device_bitcode(77)


def test_cpu_buffers_use_the_cpu_flavour_and_validate_knobs():
    buf = moe_comm.Buffer.loopback(2, 128, 4, 8, low_latency=True)[0]
    flavour = buf.flavour
    assert (flavour.transport, flavour.device_wait, flavour.compiled) == (0, False, False)
    assert flavour.errors_addr == buf.errors.address and flavour.row_align == 16
    assert buf.num_sms is None and buf.kernel_impl == "triton"
    with pytest.raises(ValueError, match="kernel_impl='cuda'"):
        moe_comm.Buffer.loopback(2, 128, 4, 8, low_latency=True, kernel_impl="cuda")
    with pytest.raises(ValueError, match="kernel_impl must be one of"):
        moe_comm.Buffer.loopback(2, 128, 4, 8, kernel_impl="cutlass")
    with pytest.raises(ValueError, match="num_sms"):
        moe_comm.Buffer.loopback(2, 128, 4, 8, num_sms=0)


def test_low_latency_grids_cover_every_tile():
    """num_sms=1, the normal mode's budget, which the low-latency grids do not take: T=150 is
    three 64-token tiles of the send over two 128-token passes of its pair positions (the
    tile past the first pass counts the pairs of the pass before it once), the 8 (expert,
    source) blocks a program each, and every token tile of the combine receive."""
    case = Case(2, 8, 128, 4, (150, 70), seed=31)
    xs, idxs, ws = make_inputs(case)
    bufs = moe_comm.Buffer.loopback(2, 128, 8, 150, low_latency=True, num_sms=1)
    for call in range(2):  # both parities
        got = moe_comm.testing.lockstep.low_latency_dispatch(bufs, xs, idxs, fp8=False)
        want = moe_comm.reference.low_latency_dispatch_all(xs, idxs, num_experts=8,
                                                           max_tokens=150)
        for r in range(2):
            assert torch.equal(got[r].count, want[r].count)
            for e, n in enumerate(want[r].count.tolist()):
                assert torch.equal(got[r].x[e, :n], want[r].x[e, :n])
        ys = [(r.x.float() * (call + 1.5)).to(r.x.dtype) for r in got]
        outs = moe_comm.testing.lockstep.low_latency_combine(bufs, ys, idxs, ws,
                                                     [r.handle for r in got])
        wants = moe_comm.reference.low_latency_combine_all(ys, idxs, ws, want, max_tokens=150)
        for r in range(2):
            assert torch.equal(outs[r], wants[r]), (call, r)


def test_combine_buffer_is_a_plain_tensor_without_rdma():
    buf = moe_comm.Buffer.loopback(2, 128, 4, 8, low_latency=True)[0]
    y = buf.low_latency_combine_buffer()
    assert y.shape == (2, 16, 128) and y.dtype == buf.dtype


def test_nvshmem_module_init_hook_initialises_only_nvshmem_kernels(monkeypatch):
    """The post-compile hook loads a kernel's module and hands it to nvshmemx_cumodule_init
    when NVSHMEM's bitcode was linked; it keeps a hook installed before it."""
    import sys
    import types

    import triton

    from moe_comm.kernels.nvshmem import install_module_init_hook

    inits, earlier = [], []

    class Kernel:
        module = 1234

        def _init_handles(self):
            inits.append("loaded")

    bindings = types.SimpleNamespace(cumodule_init=lambda module: inits.append(module) or 0)
    monkeypatch.setitem(sys.modules, "nvshmem.bindings", bindings)
    monkeypatch.setitem(sys.modules, "nvshmem", types.SimpleNamespace(bindings=bindings))
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook",
                        lambda **kw: earlier.append(kw["key"]))
    install_module_init_hook()
    install_module_init_hook()  # idempotent
    hook = triton.knobs.runtime.jit_post_compile_hook
    fn = types.SimpleNamespace(jit_function=types.SimpleNamespace(
        device_caches={0: ({"k": Kernel()},)}, fn=types.SimpleNamespace(__name__="kernel")))
    hook(key="k", fn=fn, compile={"device": 0, "extern_libs": (("libnvshmem_device", "x"),)},
         repr="", is_manual_warmup=False, already_compiled=False)
    hook(key="k", fn=fn, compile={"device": 0, "extern_libs": None}, repr="",
         is_manual_warmup=False, already_compiled=False)
    assert earlier == ["k", "k"] and inits == ["loaded", 1234]


def test_normal_dispatch_send_grid_is_persistent():
    """num_sms=1: one send program walks every token tile (T=150: three 64-token tiles)."""
    case = Case(2, 8, 128, 2, (150, 40), seed=33)
    xs, idxs, ws = make_inputs(case)
    bufs = moe_comm.Buffer.loopback(2, 128, 8, 150, num_sms=1)
    got = moe_comm.testing.lockstep.dispatch(bufs, xs, idxs, ws)
    want = moe_comm.reference.dispatch_all(xs, idxs, ws, num_experts=8)
    for g, w in zip(got, want):
        assert torch.equal(g.x, w.x) and torch.equal(g.src_token, w.src_token)
    outs = moe_comm.testing.lockstep.combine(bufs, [g.x for g in got], [g.handle for g in got],
                                     [g.weights for g in got])
    ref = moe_comm.reference.combine_all([w.x for w in want], [w.handle for w in want],
                                         [w.weights for w in want])
    assert all(torch.equal(o, r) for o, r in zip(outs, ref))


def test_cuda_heap_close_waits_for_every_rank_before_unmapping(monkeypatch):
    """CudaHeap.close synchronises the device and barriers the group before it drops the
    mapping: a peer may still be storing into this segment until every rank got there."""
    import types

    from moe_comm.symm import cuda as cuda_heap

    events = []
    monkeypatch.setattr(cuda_heap.torch.cuda, "synchronize",
                        lambda device=None: events.append("synchronize"))
    monkeypatch.setattr(cuda_heap.dist, "barrier", lambda group=None: events.append("barrier"))
    heap = cuda_heap.CudaHeap.__new__(cuda_heap.CudaHeap)
    heap._group, heap._handle = object(), types.SimpleNamespace()
    heap.local = torch.zeros(16, dtype=torch.uint8)
    heap.peer_ptrs = torch.tensor([1, 2], dtype=torch.int64)

    class Handle:  # dropping the last reference unmaps the peers' memory
        def __del__(self):
            events.append("unmapped")

    heap._handle = Handle()
    heap.close()
    assert events == ["synchronize", "barrier", "unmapped"]
    assert heap.peer_ptrs.tolist() == [0, 0]
    heap.close()  # a second close is a no-op
    assert events == ["synchronize", "barrier", "unmapped"]


def test_post_compile_hook_finds_the_kernel_on_this_triton():
    """The NVSHMEM module initialisation looks the compiled kernel up in Triton's caches; the
    gate checks the lookup on the Triton it runs under (3.9 here, 3.6 in make test)."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    code = ("from moe_comm.kernels.recording import post_compile_hook_finds_the_kernel as f; "
            "print(f())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "finds the compiled kernel" in proc.stdout


class _FakeCupy:
    """The cupy calls of CudaHeap's CUDA IPC mapping, recorded (addresses are plain ints)."""

    def __init__(self, events: list, rank: int):
        import contextlib
        import types

        self.events = events
        runtime = types.SimpleNamespace(
            malloc=lambda n: events.append(("malloc", n)) or 1000 + rank,
            ipcGetMemHandle=lambda ptr: b"handle-of-%d" % ptr,
            ipcOpenMemHandle=lambda h: events.append(("open", h)) or 5000 + int(h[10:]),
            ipcCloseMemHandle=lambda ptr: events.append(("close", ptr)),
            free=lambda ptr: events.append(("free", ptr)))
        self.cuda = types.SimpleNamespace(
            runtime=runtime, Device=lambda index: contextlib.nullcontext(),
            UnownedMemory=lambda ptr, size, owner: (ptr, size),
            MemoryPointer=lambda memory, offset: memory)
        self.uint8 = "uint8"
        self.ndarray = lambda shape, dtype, memptr: ("array", shape, memptr)


@pytest.mark.parametrize("refusal", [True, False])
def test_cuda_heap_maps_by_ipc_where_ranks_share_a_gpu(monkeypatch, refusal):
    """Rank 1 of 3, all on one GPU of one host. Without the overlap variable, or where torch
    symmetric memory refuses, each rank's own allocation goes to the others by its IPC handle:
    the table holds its own base and every peer's opened address; close waits for every rank,
    unmaps the peers, waits again, then frees its own allocation (no peer maps it any more)."""
    import sys
    import types

    from moe_comm.symm import cuda as cuda_heap

    events = []
    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy(events, rank=1))
    monkeypatch.setattr(cuda_heap.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_heap.torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cuda_heap.torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(uuid="GPU-0"))
    monkeypatch.setattr(cuda_heap.dist, "get_rank", lambda group: 1)
    monkeypatch.setattr(cuda_heap.dist, "get_world_size", lambda group: 3)
    monkeypatch.setattr(cuda_heap.dist, "barrier", lambda group=None: events.append("barrier"))

    def all_gather_object(out, obj, group=None):
        out[:] = [b"handle-of-%d" % (1000 + r) if isinstance(obj, bytes) else obj
                  for r in range(len(out))]
        events.append(("gather", type(obj).__name__))

    monkeypatch.setattr(cuda_heap.dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(cuda_heap.torch, "as_tensor",
                        lambda array, device: torch.full((array[1][0],), 7, dtype=torch.uint8))
    monkeypatch.setattr(cuda_heap, "peer_table",
                        lambda addresses, n, device: torch.tensor(addresses, dtype=torch.int64))
    symm = pytest.importorskip("torch.distributed._symmetric_memory")
    if refusal:
        monkeypatch.setenv(cuda_heap.OVERLAP_ENV, "1")

        def refuse(*args, **kwargs):
            events.append("symmetric memory asked")
            raise RuntimeError("two ranks on one device")

        monkeypatch.setattr(symm, "empty", refuse)
    else:
        monkeypatch.delenv(cuda_heap.OVERLAP_ENV, raising=False)
        monkeypatch.setattr(symm, "empty", lambda *a, **k: pytest.fail("not to be asked"))

    heap = cuda_heap.CudaHeap(object(), 256, torch.device("cuda", 0))
    assert heap.peer_ptrs.tolist() == [5000 + 1000, 1001, 5000 + 1002]
    # nodes that split the host (the proxy between them): only this rank's node is mapped
    split = cuda_heap.CudaHeap(object(), 256, torch.device("cuda", 0), ranks_per_node=1)
    assert split.peer_ptrs.tolist() == [0, 1001, 0]
    del events[len(events) // 2:]  # (the second heap's exchange, as the first's)
    assert heap.local.numel() == 256 and not heap.local.any()  # zeroed before anyone writes
    assert heap.mapping.startswith("cuda ipc")
    assert ("two ranks on one device" in heap.mapping) == refusal
    opened = [("open", b"handle-of-1000"), ("open", b"handle-of-1002")]
    assert events == [("gather", "tuple")] + (["symmetric memory asked"] if refusal else []) \
        + [("malloc", 256), ("gather", "bytes"), *opened, "barrier"]
    del events[:]
    heap.close()
    assert events == ["barrier", ("close", 6000), ("close", 6002), "barrier", ("free", 1001)]
    assert heap.peer_ptrs.tolist() == [0, 0, 0]
    heap.close()  # a second close is a no-op
    assert len(events) == 5


def test_gpu_nodes_split_a_host_only_over_nvshmem():
    """On GPUs the nodes are the hosts; the NVSHMEM heap may split a host into nodes (several
    processes of one GPU run the NVSHMEM path as nodes on different hosts would)."""
    from moe_comm.nodes import Nodes

    hosts = ["a"] * 4
    assert Nodes.of(4, None, hosts, GPU) == Nodes(4, 1, 1)
    assert Nodes.of(4, 2, hosts, GPU, split_hosts=True) == Nodes(2, 2, 1)
    assert Nodes.of(4, 1, hosts, GPU, split_hosts=True) == Nodes(1, 4, 1)
    with pytest.raises(ValueError, match="on GPUs the nodes are the hosts"):
        Nodes.of(4, 2, hosts, GPU)
    with pytest.raises(ValueError, match="must share a host"):  # a split, not a merge
        Nodes.of(4, 4, ["a", "a", "b", "b"], GPU, split_hosts=True)
    assert Nodes.of(4, 2, hosts, CPU) == Nodes(2, 2, 1)  # CPU ranks: any split


@pytest.mark.parametrize("ranks_per_node, expected", [
    (None, [7000, 7001, 7002, 7003]), (2, [0, 0, 7002, 7003]), (1, [0, 0, 7002, 0])])
def test_nvshmem_heap_maps_only_its_own_node(monkeypatch, ranks_per_node, expected):
    """Rank 2 of 4 PEs that NVSHMEM could all map (one host): the pointer table keeps the
    ranks of its node and holds 0 for the others, whose rows the kernels then put through
    NVSHMEM; close waits for every rank before it frees the symmetric segment."""
    import types

    from moe_comm.symm import nvshmem as heap_module

    events = []
    local = torch.ones(64, dtype=torch.uint8)
    core = types.SimpleNamespace(tensor=lambda shape, dtype: local,
                                 free_tensor=lambda t: events.append("free"))
    bindings = types.SimpleNamespace(ptr=lambda base, pe: 7000 + pe)
    monkeypatch.setattr(heap_module, "_import_nvshmem", lambda: (core, bindings))
    monkeypatch.setattr(heap_module, "init_nvshmem", lambda group, device: None)
    monkeypatch.setattr(heap_module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(heap_module.torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(heap_module.dist, "get_rank", lambda group: 2)
    monkeypatch.setattr(heap_module.dist, "get_world_size", lambda group: 4)
    monkeypatch.setattr(heap_module.dist, "barrier", lambda group=None: events.append("barrier"))
    monkeypatch.setattr(heap_module, "peer_table",
                        lambda addresses, n, device: torch.tensor(addresses, dtype=torch.int64))
    heap = heap_module.NvshmemHeap(object(), 64, GPU, ranks_per_node)
    assert heap.peer_ptrs.tolist() == expected
    assert not heap.local.any()  # zeroed before anyone writes into it
    assert heap.rdma_peers == [p for p, a in enumerate(expected) if a == 0]
    heap.close()
    assert events == ["barrier", "barrier", "free"]
