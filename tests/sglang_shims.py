"""What sglang 0.5.21's DeepEP token dispatcher needs to run on CPU ranks over
``moe_comm.deep_ep.install()``.

Used inside the rank jobs (the worker processes of the test's own RankPool). The dispatcher is
SGLang's own ``sglang.srt.layers.moe.token_dispatcher.deepep``, built by SGLang's own
``create_moe_dispatcher`` (what ``--moe-a2a-backend deepep`` builds for every MoE layer) over
SGLang's own parallel state (``initialize_model_parallel`` on the pool's gloo world); only the
pieces below stand in for CUDA-only ones.

Stand-ins while SGLang is imported (``import_sglang``; gone from ``sys.modules`` afterwards),
one line per name:

* ``torchvision`` -> three empty modules (``torchvision``, ``.transforms``,
  ``.transforms.functional``) whose attributes are placeholders that raise when called: the
  only torchvision wheel for torch 2.13.0 (0.28.0) is a CUDA build (its ops library needs
  ``libtorch_cuda.so``), so ``import torchvision`` fails on CPU torch. SGLang imports it at
  module level for VLM image preprocessing (``sglang.srt.multimodal.internvl_utils``,
  ``sglang.srt.configs.deepseek_ocr``), reached from the dispatcher through
  ``eplb.expert_distribution -> model_executor.forward_batch_info -> configs``; nothing
  here preprocesses an image. transformers is asked first (``is_torchvision_available()``,
  cached), so it still sees no torchvision;
* ``sglang.srt.configs.utils.register_image_processor`` -> a no-op: at import
  ``sglang.srt.configs.janus_pro`` registers its image processor with transformers'
  ``AutoImageProcessor``, which transformers 5 refuses without torchvision.

Stand-ins while a job runs (``sglang_cpu_shims``, undone on exit), one line per name:

* ``torch.cuda.get_device_properties`` -> an object with ``multi_processor_count = 132``
  (an H100 SXM): ``DeepEPBuffer.get_deepep_buffer`` reads the SM count to warn when DeepEP
  gets fewer than half of them (the number changes nothing else);
* ``sglang.srt.layers.deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM = True``,
  ``DEEPGEMM_BLACKWELL = False``, ``DEEPGEMM_SCALE_UE8M0 = False``: DeepGEMM on an sm_90 GPU,
  the expert runner SGLang pairs with DeepEP. The normal-mode ``combine_a`` raises
  ``NotImplementedError`` without it (SGLang's Triton runner path for DeepEP normal mode is
  disabled), and it makes the normal dispatch quantize to FP8 and align each expert's rows
  to 128 (``expert_alignment=128``), as on a GPU;
* ``sglang.srt.layers.moe.token_dispatcher.deepep.sglang_per_token_group_quant_fp8`` -> the
  same per-token, per-128-channel FP8 cast in PyTorch (``fp8_group_quant`` below): SGLang's
  is a CUDA JIT kernel (``per_token_group_quant``, imported only when CUDA is present). It is
  called by the normal-mode ``dispatch_a`` when the dispatch output dtype is FP8.

Everything else runs as SGLang ships it: its server arguments (``ServerArgs``, ``publish``),
``initialize_moe_config``, ``initialize_model_parallel`` (gloo groups), ``create_moe_dispatcher``
-> ``MaybeTboDeepEPDispatcher`` -> ``DeepEPDispatcher`` with ``async_finish=True,
return_recv_hook=True``, ``DeepEPBuffer`` sizing (``Buffer.get_dispatch_config``,
``get_low_latency_rdma_size_hint``) and the mode switch of ``--deepep-mode auto``.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types

import torch

from framework_shims import patched

SGLANG_VERSION = "0.5.21"
H100_SMS = 132
FP8_MAX = 448.0
FP8_EPS = 1e-10  # SGLang's per_token_group_quant absmax floor


class _Unavailable:
    """A torchvision name: any attribute is another placeholder, a call raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is a stand-in here (no CPU wheel for "
                           "torch 2.13.0); image preprocessing is not available")


def _torchvision_stand_in() -> dict[str, types.ModuleType]:
    modules = {}
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        module.__getattr__ = (lambda prefix: lambda attr: _Unavailable(f"{prefix}.{attr}")
                              if not attr.startswith("__") else _raise_attribute(attr))(name)
        modules[name] = module
    modules["torchvision"].transforms = modules["torchvision.transforms"]
    modules["torchvision.transforms"].functional = modules["torchvision.transforms.functional"]
    return modules


def _raise_attribute(name: str):
    raise AttributeError(name)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after the real module ``name`` executed."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader, patch = spec.loader, self.patch

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                patch(module)

        spec.loader = Loader()
        return spec


def _no_image_processor_registration(module) -> None:
    module.register_image_processor = lambda config, image_processor: None


def import_sglang():
    """Imports what the jobs use from SGLang (once per process) with ``deep_ep`` resolving to
    ``moe_comm.deep_ep``; returns the dispatcher module. The import-time stand-ins exist only
    during the import."""
    done = sys.modules.get("sglang.srt.layers.moe.token_dispatcher.deepep")
    if done is not None:
        return done
    import moe_comm.deep_ep

    moe_comm.deep_ep.install()
    import transformers.utils.import_utils as hf_imports

    if hf_imports.is_torchvision_available():  # a CPU torchvision after all: use it
        stand_ins = {}
    else:
        stand_ins = _torchvision_stand_in()
    finder = _PatchAfterImport("sglang.srt.configs.utils", _no_image_processor_registration)
    sys.meta_path.insert(0, finder)
    absent = [name for name in stand_ins if name not in sys.modules]
    sys.modules.update({name: stand_ins[name] for name in absent})
    try:
        import sglang  # noqa: F401
        from sglang.srt.layers.moe.fused_moe_triton import layer  # noqa: F401
        from sglang.srt.layers.moe.token_dispatcher import deepep
    finally:
        sys.meta_path.remove(finder)
        for name in absent:
            sys.modules.pop(name, None)
    assert deepep.use_deepep and deepep.Buffer is moe_comm.deep_ep.Buffer, \
        "SGLang's dispatcher did not import deep_ep from moe_comm.deep_ep"
    return deepep


def fp8_group_quant(x: torch.Tensor, group_size: int, eps: float = FP8_EPS,
                    column_major_scales: bool = False, scale_tma_aligned: bool = False,
                    scale_ue8m0: bool = False, **unused):
    """SGLang's ``sglang_per_token_group_quant_fp8`` (row-major float32 scales, as on sm_90):
    ``scale = max(amax of the group, 1e-10) / 448``, ``q = clamp(x / scale, -448, 448)`` in
    float8_e4m3fn. ``(q [T, H], scales [T, H / group_size])``."""
    if column_major_scales or scale_tma_aligned or scale_ue8m0 or unused:
        raise NotImplementedError("the stand-in casts with row-major float32 scales only "
                                  "(DEEPGEMM_SCALE_UE8M0 is False on sm_90)")
    T, H = x.shape
    g = x.float().reshape(T, H // group_size, group_size)
    scale = g.abs().amax(-1).clamp(min=eps) / FP8_MAX
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).reshape(T, H)
    return q.to(torch.float8_e4m3fn), scale


class _DeviceProperties:
    multi_processor_count = H100_SMS


@contextlib.contextmanager
def sglang_cpu_shims():
    """The job-time stand-ins listed in the module doc, undone on exit."""
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.moe.token_dispatcher import deepep

    patches = [
        (torch.cuda, "get_device_properties", lambda device=None: _DeviceProperties()),
        (deep_gemm_wrapper, "ENABLE_JIT_DEEPGEMM", True),
        (deep_gemm_wrapper, "DEEPGEMM_BLACKWELL", False),
        (deep_gemm_wrapper, "DEEPGEMM_SCALE_UE8M0", False),
        (deepep, "sglang_per_token_group_quant_fp8", fp8_group_quant),
    ]
    with patched(patches):
        yield
