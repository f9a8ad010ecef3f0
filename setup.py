"""Install moe_comm; kernels/ is installed as the package moe_comm.kernels."""
from setuptools import find_packages, setup

setup(
    name="moe_comm",
    version="0.1.0",
    description="Expert-parallel MoE dispatch/combine over symmetric memory, Triton kernels",
    python_requires=">=3.10",
    packages=find_packages(include=["moe_comm", "moe_comm.*"]) + ["moe_comm.kernels"],
    package_dir={"moe_comm.kernels": "kernels"},
    install_requires=["torch>=2.6", "triton>=3.4", "numpy"],
    extras_require={
        "test": ["pytest>=7", "matplotlib"],
    },
)
