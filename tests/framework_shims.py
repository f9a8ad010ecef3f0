"""What megatron-core 0.16.1 and DeepSpeed 0.19.8 need to run their MoE layers on CPU ranks.

Used inside the rank jobs (the worker processes), not only in the pytest process. Each shim is
a context manager that restores everything on exit, so a worker that ran a framework job is
unchanged for the next job.

Megatron (``megatron_cpu_shims``), one line per patched name, each for one call site:

* ``torch.cuda.current_device`` -> ``torch.device("cpu")``: ``TopKRouter.gating`` moves its
  weight to the current CUDA device, and Megatron's ``_AllToAll`` allocates its output there;
* ``torch.cuda.Stream`` -> a do-nothing stream: ``MoEAlltoAllTokenDispatcher.__init__`` creates
  a side stream for its device-to-host copies (Megatron's own dispatcher only);
* ``torch.cuda.current_stream`` -> that stream: compared with the side stream before each copy
  (Megatron's own dispatcher only);
* ``torch.cuda.stream`` -> ``contextlib.nullcontext``: enters the side stream (Megatron's own
  dispatcher only);
* ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` -> ``None``: 0.16.1 refers to it
  in the router's gating GEMM without Transformer Engine installed (NameError otherwise);
* ``torch.distributed.all_to_all_single``: split sizes given as tensors become lists. Megatron
  moves split sizes to host numpy arrays only when they are CUDA tensors; gloo rejects tensors
  (Megatron's own dispatcher only).

DeepSpeed (``deepspeed_cpu_env``) needs no patch, only configuration: ``DS_ACCELERATOR=cpu``
before ``import deepspeed``, and ``deepspeed.comm`` joined to the already initialised gloo
group. One switch saves time, not correctness: ``deepspeed_shm_comm`` is marked incompatible so
that joining does not JIT-build DeepSpeed's shared-memory all-reduce kernel (about 50 s on 2
cores the first time on a machine); the MoE layers never use it, gloo carries every collective.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist


class _NullStream:
    """Stands in for ``torch.cuda.Stream`` and the events it records; every call does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, event=None) -> _NullStream:
        return self

    def synchronize(self) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


_NULL_STREAM = _NullStream()


def _as_list(sizes):
    return sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes


def _all_to_all_single_with_list_splits(original):
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        return original(output, input, output_split_sizes=_as_list(output_split_sizes),
                        input_split_sizes=_as_list(input_split_sizes), group=group,
                        async_op=async_op)

    all_to_all_single.shimmed = True
    return all_to_all_single


@contextlib.contextmanager
def patched(patches: list[tuple]):
    """``setattr(obj, name, value)`` for each ``(obj, name, value)`` while the block runs; each
    attribute is put back (or removed, where it did not exist) afterwards, in reverse order."""
    missing = object()
    saved = [(obj, name, getattr(obj, name, missing)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


@contextlib.contextmanager
def megatron_cpu_shims():
    """The patches listed in the module doc, undone on exit."""
    from megatron.core.transformer.moe import moe_utils

    patches = [
        (torch.cuda, "current_device", lambda: torch.device("cpu")),
        (torch.cuda, "Stream", _NullStream),
        (torch.cuda, "current_stream", lambda device=None: _NULL_STREAM),
        (torch.cuda, "stream", lambda stream: contextlib.nullcontext()),
        (moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None)),
        (dist, "all_to_all_single",
         dist.all_to_all_single if getattr(dist.all_to_all_single, "shimmed", False)
         else _all_to_all_single_with_list_splits(dist.all_to_all_single)),
    ]
    with patched(patches):
        yield


@contextlib.contextmanager
def megatron_parallel_state(expert_model_parallel_size: int):
    """Megatron's model-parallel groups over the pool's gloo world (TP = PP = 1), destroyed on
    exit so the next job can build its own. Megatron's ``destroy_model_parallel`` only forgets
    its groups; c10d keeps them, and with them each gloo group's threads polling in the pool's
    worker for the rest of the session, so the groups it made are destroyed here too."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    groups = dist.distributed_c10d._world.pg_map
    before = set(groups)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             expert_model_parallel_size=expert_model_parallel_size)
    try:
        yield parallel_state
    finally:
        parallel_state.destroy_model_parallel()
        for group in [g for g in groups if g not in before]:
            dist.destroy_process_group(group)


def deepspeed_cpu_env():
    """``import deepspeed`` on the CPU accelerator, its comm layer on the existing gloo group."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.comm
    import deepspeed.ops

    if not deepspeed.comm.is_initialized():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    return deepspeed
