"""flashfsdp: Fully Sharded Data Parallel for PyTorch with Triton kernels and NCCL through CuPy."""

from setuptools import find_packages, setup

# tests/clients: client libraries run on flashfsdp with the import swapped (pinned: their FSDP2 paths change).
# torchtitan has its own extra, outside test: torchtitan 0.3.0 requires datasets<4.8 (and so an older
# huggingface_hub), which would downgrade the suite's. torchao 0.18.0 has no dependencies (its NF4Tensor
# lives in torchao.quantization.quantize_.workflows.nf4 from this version on; its CUDA extensions print
# that they cannot load on CPU, and its Python parts, NF4 and float8 training, run).
CLIENTS = ["peft==0.21.2", "lightning==2.6.6", "torchao==0.18.0"]

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
    # The library, and its command lines' torch-free parsers; benchmarks/ runs from a checkout
    # (python -m benchmarks.step) and is not installed, nor is flashfsdp_dev/ (what the tests and
    # the benchmarks share: the rank spawner).
    packages=find_packages(include=["flashfsdp", "flashfsdp.*", "flashfsdp_cli", "flashfsdp_cli.*"]),
    # torch >= 2.6: flashfsdp/_torch_private.py (MIN_TORCH). Triton (triton.knobs: >= 3.4) only where the kernels
    # run: the GPU extras, and the tests (the interpreter on CPU); the CPU install uses the reference kernels.
    # tomli: --config FILE.toml on Python 3.10 (tomllib is in the standard library from 3.11).
    install_requires=["torch>=2.6", "numpy", "tqdm", "tomli; python_version < '3.11'"],
    extras_require={
        "cuda12": ["cupy-cuda12x", "nvidia-nccl-cu12", "triton>=3.4"],
        "cuda13": ["cupy-cuda13x", "nvidia-nccl-cu13", "triton>=3.4"],
        "test": ["triton>=3.4", "pytest", "pytest-timeout", "hypothesis", "matplotlib", "expecttest",
                 "transformers>=5", "safetensors", "tensorboard", "tokenizers", "datasets", "wandb", *CLIENTS],
        # flashfsdp-train's loss.png, --tensorboard and --tokenizer (--wandb: pip install wandb)
        "train": ["matplotlib", "tensorboard", "tokenizers"],
        "hf": ["transformers>=5", "safetensors"],  # flashfsdp.save_pretrained, flashfsdp-train export
        "bench": ["matplotlib"],  # the benchmarks' plots (python -m benchmarks...)
        "clients": CLIENTS,
        "titan": ["torchtitan==0.3.0"],  # tests/clients/test_torchtitan.py
    },
    entry_points={"console_scripts": ["flashfsdp-train=flashfsdp_cli.train:main"]},
)
