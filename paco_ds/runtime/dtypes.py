"""One rule for the recipes' `dtype` keys (policy, judge, reward-model SFT)."""
from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """`auto` is bf16 on an accelerator and fp32 on CPU (bf16 matmuls are slow on most CPUs)."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return DTYPES[name]
