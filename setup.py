"""paco_ds: PaCo-RL (PaCo-GRPO + PaCo-Reward) on DeepSpeed."""
from setuptools import find_packages, setup

DATA = {  # data folder -> the files it ships
    "paco_ds.data.prompts": ["*.jsonl"],  # the tiny T2IS prompts
    "paco_ds.data.prompts.tiny_edit": ["*.jsonl"],  # the tiny editing set
    "paco_ds.data.prompts.tiny_edit.images": ["*.png"],
    "paco_ds.models.tiny.configs": ["*.json"],  # tiny model configs and tokenizer vocabularies
}

setup(
    name="paco_ds",
    version="0.1.0",
    description="GRPO for flow-matching image generators on consistency rewards, on DeepSpeed ZeRO-3",
    python_requires=">=3.10",
    # The data folders (no __init__.py) are listed as packages of their own, so setuptools installs
    # their files as package data of those packages instead of warning that it would ignore them.
    packages=find_packages(include=["paco_ds", "paco_ds.*", "kernels", "kernels.*"]) + list(DATA),
    package_data=DATA,
    include_package_data=True,
    install_requires=[
        # Ranges, not pins: the GPU image has torch 2.11 / triton 3.6 / transformers 5.17,
        # the CPU recipe in the Makefile pins the measured torch 2.14.1 + torchvision 0.29.1 pair.
        # Only what the code imports is listed; tokenizers and safetensors come with transformers
        # (every tokenizer the code builds or loads is a tokenizers-backed one: no sentencepiece).
        "torch>=2.4",
        "torchvision>=0.19",
        "triton>=3.0; platform_system == 'Linux'",
        "deepspeed>=0.16,<0.21",
        "diffusers>=0.35,<0.50",
        "transformers>=4.57,<6",
        "peft>=0.17,<0.30",
        "open_clip_torch>=2.24,<4",
        "pydantic>=2.6,<3",
        "pyyaml>=6",
        "numpy>=1.24",
        "pillow>=10",
        "tqdm>=4.66",
        "tensorboard>=2.14",
        "matplotlib>=3.7",
        "scipy>=1.10",
        "pyarrow>=14",  # editing data in .parquet/.arrow (data.format: edit)
        "openai>=1.40",
        "httpx>=0.27",
        "psutil>=5.9",  # paco_ds/runtime/processes.py: the judges, ranks and hosts a run watches and stops
        "fastapi>=0.110",
        "starlette>=0.36",  # imported directly (run_in_threadpool); fastapi's own dependency
        # paco_ds/serving/protocol.py subclasses uvicorn's H11Protocol (private) for the client-side
        # timeouts; tests/serving/test_hostile_clients.py proves them on the version this range allows.
        "uvicorn>=0.54,<0.55",
        # The OCR reward's recogniser: PP-OCRv4 as ONNX, the models inside the wheel (runs offline).
        "rapidocr_onnxruntime>=1.3,<2; python_version < '3.13'",
    ],
    extras_require={
        "serve": ["vllm>=0.8"],
        "flash": ["flash-attn>=2.6.3"],  # model.attention_backend: flash (diffusers requires 2.6.3)
        "wandb": ["wandb"],
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "ninja", "wandb"],
    },
)
