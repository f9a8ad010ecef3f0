"""torch.compile: an MoE layer over a Buffer compiled with ``fullgraph=True`` by inductor (the
CPU backend here, dynamic shapes), forward and backward, on 2 and 4 CPU ranks: its output and
every gradient bit for bit against the same layer run eagerly, zero graph breaks
(``torch._dynamo.explain``), one graph, and no recompilation when the token count changes
(``error_on_recompile``); the same for the FP8 and NVFP4 dispatch (the router weights'
gradient; quantized rows carry none) and, through ``aot_eager``, MXFP8 (inductor's CPU code
generator has no float8_e8m0fnu type). The jobs: tests/compile_jobs.py."""
import os

import pytest
import torch
from compile_jobs import compiled_layer

from cases import Case
from moe_comm.launch import RankPool


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
    (2, None, "inductor"), (4, None, "inductor"), (2, "fp8", "inductor"),
    (2, "nvfp4", "inductor"), (2, "mxfp8", "aot_eager")],
    ids=["bf16-2", "bf16-4", "fp8-2", "nvfp4-2", "mxfp8-2-aot_eager"])
def test_compiled_layer_matches_eager_bit_for_bit(compile_ranks, world_size, fmt, backend):
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
