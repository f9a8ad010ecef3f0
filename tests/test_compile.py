"""torch.compile: an MoE layer over a Buffer compiled with ``fullgraph=True`` by inductor (the
CPU backend here, dynamic shapes), forward and backward, on 2 and 4 CPU ranks: its output and
every gradient bit for bit against the same layer run eagerly, zero graph breaks
(``torch._dynamo.explain``), one graph, and no recompilation when the token count changes
(``error_on_recompile``); the same for the FP8 and NVFP4 dispatch (the router weights'
gradient; quantized rows carry none) and, through ``aot_eager``, MXFP8 (inductor's CPU code
generator has no float8_e8m0fnu type). The low-latency pair as the four ops of
``moe_comm.ll_ops``: two micro-batches in flight with matmuls between each send and its
receive, bit for bit against eager and against the Buffer's own calls and hooks, in bf16 and
FP8. The jobs: tests/compile_jobs.py."""
import os

import pytest
import torch
from compile_jobs import compiled_layer, ll_compiled_layer

import moe_comm
from cases import Case
from moe_comm.testing.launch import RankPool


@pytest.fixture(scope="module")
def compile_ranks():
    """Pools whose compiled graphs go to the kernels' cache folder (not /tmp)."""
    cache = os.path.join(os.environ.get("MOE_COMM_CACHE_DIR")
                         or os.path.expanduser("~/.cache/moe_comm"), "inductor")
    pools = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size, env={"TORCHINDUCTOR_CACHE_DIR": cache})
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.mark.parametrize("world_size, fmt, backend", [
    (4, None, "inductor"), (2, "fp8", "inductor"), (2, "nvfp4", "inductor"),
    (2, "mxfp8", "aot_eager")],
    ids=["bf16-4", "fp8-2", "nvfp4-2", "mxfp8-2-aot_eager"])
def test_compiled_layer_matches_eager_bit_for_bit(compile_ranks, world_size, fmt, backend):
    """bf16 (the output and every gradient, x's too) on 4 ranks; the quantized formats (the
    output and the router weights' gradient) on 2 ranks."""
    case = Case(world_size, 4 * world_size, 256, 4, (0,) * world_size, torch.bfloat16, "zipf",
                1, seed=70 + world_size)
    reports = compile_ranks(world_size).run(compiled_layer, case, (17, 29), fmt, True, backend,
                                            timeout_s=900)
    values = 3 if fmt is None else 2  # output, x's gradient (unquantized), the weights'
    for rank, rep in enumerate(reports):
        assert rep["values"] == values, (rank, rep)
        assert rep["exact"] == [[True] * (values + 1)] * 2, (rank, rep)
        assert not rep["recompiled"], (rank, rep)
        assert rep["graph_breaks"] == 0 and rep["graphs"] == 1, (rank, rep)


@pytest.mark.parametrize("world_size, fp8s, dynamic, token_counts", [
    (2, (False, False), None, (24, 24, 13, 7)), (2, (True, True), True, (24, 13)),
    (4, (True, False), True, (12, 5))],
    ids=["bf16-2", "fp8-2", "fp8+bf16-4"])
def test_compiled_low_latency_matches_eager_bit_for_bit(compile_ranks, world_size, fp8s,
                                                        dynamic, token_counts):
    """Two micro-batches in flight through the low-latency pair of ``moe_comm.ll_ops``, with
    matmuls between each send and its receive (given to the receive as ``after``; compiled
    with ``reorder_for_peak_memory`` off), against the same function eager and against the
    Buffer's own calls and hooks: same bits, no graph break, one graph, the matmuls between
    the sends and the receives in inductor's code. Token counts below T_max run through the
    same graph where it was compiled dynamic; otherwise the first new count compiles once more
    (dynamo's automatic dynamic shapes) and later counts reuse that graph."""
    case = Case(world_size, 4 * world_size, 256, 4, (0,) * world_size, torch.bfloat16, "zipf",
                seed=90 + world_size)
    reports = compile_ranks(world_size).run(ll_compiled_layer, case, token_counts, fp8s,
                                            dynamic, timeout_s=900)
    recompiled = [False] * len(token_counts)
    if dynamic is None:
        recompiled[2] = True
    one_pass = (["dispatch_send"] * 2 + ["mm"] + ["dispatch_recv"] * 2
                + ["combine_send"] * 2 + ["mm"] + ["combine_recv"] * 2)
    for rank, rep in enumerate(reports):
        assert all(all(row) for row in rep["exact"]), (rank, rep["exact"])
        assert rep["recompiled"] == recompiled, (rank, rep)
        assert rep["graph_breaks"] == 0 and rep["graphs"] == 1, (rank, rep)
        assert rep["orders"] and all(order == one_pass for order in rep["orders"]), (rank, rep)


def test_low_latency_ops_refuse_a_receive_without_its_send():
    """The receive ops find their send by the ticket's serial: two sends in flight are
    received each by its own ticket; a ticket received twice, a made-up one, one of the other
    channel or a format other than the send's raise, naming the problem (the refused receive
    leaves the send waiting, to be received right)."""
    from moe_comm import ll_ops

    buf = moe_comm.Buffer.loopback(1, 128, 2, 4, torch.bfloat16, low_latency=True)[0]
    x = torch.randn(4, 128).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, -1], [0, -1], [1, 0]])
    w = torch.rand(4, 2)
    want, _ = buf.low_latency_dispatch(x, idx, fp8=False)
    first = ll_ops.dispatch_send(buf, x, idx, fp8=False)
    second = ll_ops.dispatch_send(buf, x, idx, fp8=True)
    with pytest.raises(RuntimeError, match="were waiting for their hooks"):
        ll_ops.dispatch_send(buf, x, idx, fp8=False)
    with pytest.raises(ValueError, match=r"given \(fp8, ue8m0"):
        torch.ops.moe_comm.ll_dispatch_recv(buf.id, first.ticket, [], True)
    recv = ll_ops.dispatch_recv(buf, first)
    assert torch.equal(recv.count, want.count) and recv.x_scales is None
    with pytest.raises(RuntimeError, match="no low-latency dispatch send with serial"):
        ll_ops.dispatch_recv(buf, first)
    with pytest.raises(RuntimeError, match="no low-latency dispatch send with serial 99"):
        torch.ops.moe_comm.ll_dispatch_recv(buf.id, torch.tensor([0, 99]), [], False)
    fp8_recv = ll_ops.dispatch_recv(buf, second)
    assert fp8_recv.x.dtype == torch.float8_e4m3fn and fp8_recv.x_scales is not None
    out_want, _ = buf.low_latency_combine(recv.x, idx, w, want.handle)
    sent = ll_ops.combine_send(buf, recv.x, idx, w, recv.handle)
    with pytest.raises(ValueError, match="got a ticket of ll_combine_send"):
        ll_ops.dispatch_recv(buf, first._replace(ticket=sent.ticket))
    assert torch.equal(ll_ops.combine_recv(buf, sent), out_want)
    with pytest.raises(RuntimeError, match="no low-latency combine send with serial"):
        ll_ops.combine_recv(buf, sent)
    buf.close()
