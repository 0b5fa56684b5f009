"""flashfsdp: Fully Sharded Data Parallel for PyTorch with Triton kernels and NCCL through CuPy."""

from setuptools import find_packages, setup

setup(
    name="flashfsdp",
    version="0.1.0",
    description=(
        "Fully Sharded Data Parallel (ZeRO-3) for PyTorch: flat units with zero-copy unshard, "
        "Triton kernels on the hot paths, NCCL through CuPy on dedicated streams."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["flashfsdp", "flashfsdp.*", "benchmarks", "benchmarks.*"]),
    install_requires=["torch>=2.6", "triton>=3.4", "numpy", "tqdm"],  # triton.knobs (kernels/triton_support.py)
    extras_require={
        "cuda12": ["cupy-cuda12x", "nvidia-nccl-cu12"],
        "cuda13": ["cupy-cuda13x", "nvidia-nccl-cu13"],
        "test": ["pytest", "pytest-timeout", "hypothesis", "matplotlib", "expecttest"],
        "bench": ["matplotlib"],
    },
    entry_points={"console_scripts": ["flashfsdp-train=flashfsdp.train:main"]},
)
