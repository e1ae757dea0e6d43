"""The GPU plan's model source: the policy's full-size model (its `full_size`, the real classes on the
meta device), its frozen parts turned into fake CUDA tensors, so that the plan loads the policy
through the trainer's own build path (`paco_ds.grpo.build.adapted_policy`, `Policy.load`).

The transformer stays on meta until the recipe's LoRA is on it (peft cannot add adapters to fake
modules); `place_adapted` then puts the adapted transformer on the fake device, its LoRA counted
apart. The policy's constructor runs under the fake mode: a constructor may encode a prompt on the
device (the negative prompt of SD3, Z-Image and FLUX.2 [klein]).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from paco_ds.gpu_plan.fake import FakeCuda, to_fake_cuda
from paco_ds.models.base import ModelSource


class FullSizeOnFakeCuda(ModelSource):
    def __init__(self, mode: FakeCuda):
        self.mode = mode

    def parts(self, policy_cls, cfg, dtype: torch.dtype, ds_config: dict | None) -> dict:
        full = policy_cls.full_size.of(cfg.path)  # the checkpoint's own shape where the family has several
        parts = {"transformer": full.transformer(), **full.components(cfg)}
        for name, module in parts.items():
            if isinstance(module, nn.Module) and name != "transformer":
                to_fake_cuda(self.mode, module, torch.float32 if name in full.fp32 else dtype)
                self.mode.track_module(module, "vae" if name == "vae" else "text encoders")
        return parts

    def place(self, transformer, device, dtype, cfg, ds_config) -> None:
        """Nothing yet: the adapted transformer is placed by `place_adapted`."""

    def constructing(self) -> contextlib.AbstractContextManager:
        return self.mode

    def place_adapted(self, transformer: nn.Module, dtype: torch.dtype) -> None:
        """The transformer with its LoRA on the fake device in the model dtype: the adapter's weights
        counted as "lora", the base's as "transformer"."""
        to_fake_cuda(self.mode, transformer, dtype)
        with self.mode.tagged("lora"):
            for p in transformer.parameters():
                if p.requires_grad:
                    self.mode._track(p)
        self.mode.track_module(transformer, "transformer")
