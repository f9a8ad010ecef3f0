"""What vLLM 0.33.0's DeepEP prepare/finalize classes need to run on CPU ranks over
``moe_comm.deep_ep``.

Used inside the rank jobs (``vllm_jobs``). ``vllm_cpu`` is a context manager that restores
everything it changed on exit, except the facade's ``sys.modules["deep_ep"]`` entry (vLLM's
modules keep a reference to it once imported).

Configuration (vLLM's own switches, no code replaced):

* ``VLLM_TARGET_DEVICE=cpu`` before vLLM is imported: vLLM's CPU platform. The wheel is the
  CUDA build and finds no GPU; without this it picks ``UnspecifiedPlatform``, whose empty
  ``device_type`` makes ``VllmConfig()`` raise "Failed to infer device type";
* ``set_current_vllm_config(VllmConfig())``: ``DeepEPLLAll2AllManager.__init__`` reads
  ``get_current_vllm_config().parallel_config.enable_fault_tolerance`` (False by default);
* ``moe_comm.deep_ep.install()`` before vLLM's ``deepep_ht`` / ``deepep_ll`` modules are
  imported: their ``import deep_ep`` finds the facade.

Stand-ins, one line per replaced name, each for one call site:

* ``all2all_utils.DeepEPHTPrepareAndFinalize`` / ``DeepEPLLPrepareAndFinalize`` /
  ``DEEPEP_QUANT_BLOCK_SHAPE`` -> the same names from vLLM's ``deepep_ht`` / ``deepep_ll``
  modules: ``maybe_make_prepare_finalize``'s module imports them only under
  ``current_platform.is_cuda_alike()`` (NameError on the CPU platform otherwise); bound here as
  that import binds them;
* ``vllm.distributed.parallel_state._DP`` / ``._TP`` -> records with ``rank_in_group`` and
  ``world_size`` (DP = the EP ranks, TP = 1): ``All2AllManagerBase.__init__`` reads the DP
  group's rank and size and keeps the TP group. vLLM's real coordinators on the CPU platform
  are built by ``CpuCommunicator``, which refuses the DeepEP backends (it logs "all2all manager
  is not supported on CPU" and builds ``AgRsAll2AllManager``), so the jobs build
  ``DeepEPHTAll2AllManager`` / ``DeepEPLLAll2AllManager`` directly, as ``CudaCommunicator``
  does, over the gloo group;
* ``vllm._custom_ops.moe_sum`` -> a PyTorch sum over the top-k axis: the real one calls
  ``torch.ops._moe_C.moe_sum``, which only the CUDA extension registers (on CPU:
  "'_moe_C' object has no attribute 'moe_sum'"). ``TopKWeightAndReduceContiguous`` calls it in
  the high-throughput finalize and in vLLM's path without EP. The stand-in adds the choices in
  order in the activation dtype, as the CUDA kernel's ``scalar_t`` accumulator does, and skips
  choices whose expert ``expert_map`` maps to -1.
"""
from __future__ import annotations

import contextlib
import os
import types

import torch


def moe_sum(input: torch.Tensor, output: torch.Tensor, topk_ids: torch.Tensor | None = None,
            expert_map: torch.Tensor | None = None) -> None:
    """``output[m] = sum_k input[m, k]`` in ``input``'s dtype, choice order; with ``topk_ids``
    and ``expert_map``, choices whose expert maps to -1 are left out."""
    acc = torch.zeros_like(output)
    for k in range(input.shape[1]):
        term = input[:, k]
        if topk_ids is not None and expert_map is not None:
            keep = expert_map[topk_ids[:, k].long()] >= 0
            term = torch.where(keep[:, None], term, torch.zeros_like(term))
        acc = acc + term
    output.copy_(acc)


@contextlib.contextmanager
def _environ(name: str, value: str):
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


@contextlib.contextmanager
def _attribute(obj, name: str, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


@contextlib.contextmanager
def _bound(module, name: str, value):
    """``module.name = value`` for the block; afterwards as it was (absent, or its value)."""
    missing = object()
    saved = getattr(module, name, missing)
    setattr(module, name, value)
    try:
        yield
    finally:
        if saved is missing:
            delattr(module, name)
        else:
            setattr(module, name, saved)


@contextlib.contextmanager
def vllm_cpu(rank: int, world_size: int):
    """vLLM on this CPU rank: its CPU platform, a default ``VllmConfig``, the DeepEP facade as
    ``deep_ep``, and the stand-ins above, for an expert-parallel group of ``world_size`` DP
    ranks with TP = 1."""
    import moe_comm.deep_ep

    moe_comm.deep_ep.install()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_environ("VLLM_TARGET_DEVICE", "cpu"))
        import vllm._custom_ops as ops
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import parallel_state
        from vllm.platforms import current_platform

        if current_platform.device_type != "cpu":
            raise RuntimeError(f"vLLM chose {type(current_platform).__name__}, not its CPU "
                               "platform: VLLM_TARGET_DEVICE was read before this")
        dp = types.SimpleNamespace(rank_in_group=rank, world_size=world_size)
        tp = types.SimpleNamespace(rank_in_group=0, world_size=1)
        stack.enter_context(_attribute(parallel_state, "_DP", dp))
        stack.enter_context(_attribute(parallel_state, "_TP", tp))
        stack.enter_context(_attribute(ops, "moe_sum", moe_sum))
        from vllm.model_executor.layers.fused_moe import all2all_utils
        from vllm.model_executor.layers.fused_moe.prepare_finalize import deepep_ht, deepep_ll

        for module, name in ((deepep_ht, "DeepEPHTPrepareAndFinalize"),
                             (deepep_ll, "DeepEPLLPrepareAndFinalize"),
                             (deepep_ll, "DEEPEP_QUANT_BLOCK_SHAPE")):
            stack.enter_context(_bound(all2all_utils, name, getattr(module, name)))
        stack.enter_context(set_current_vllm_config(VllmConfig()))
        yield
