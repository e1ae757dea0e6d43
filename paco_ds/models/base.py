"""The `Policy` interface: what the rollout and the trainer need from an image generator.

One file per model family implements it (flux.py, ...). The trainer never imports a diffusers
pipeline: it encodes prompts once, prepares latents, asks for velocities through whichever module
it is given (the bare transformer, or the DeepSpeed engine that wraps it), and decodes once.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from paco_ds.sampling.schedule import ShiftConfig, flux_sigmas


@dataclass
class TextEmbeds:
    """Cached text conditioning, one row per sample (stored with rollouts, reused in training)."""

    prompt_embeds: torch.Tensor  # [B, S, D]
    pooled: torch.Tensor  # [B, P]

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    def to(self, device=None, dtype=None) -> "TextEmbeds":
        return TextEmbeds(self.prompt_embeds.to(device=device, dtype=dtype), self.pooled.to(device=device, dtype=dtype))

    def select(self, idx) -> "TextEmbeds":
        return TextEmbeds(self.prompt_embeds[idx], self.pooled[idx])

    @staticmethod
    def cat(items: list["TextEmbeds"]) -> "TextEmbeds":
        return TextEmbeds(torch.cat([e.prompt_embeds for e in items]), torch.cat([e.pooled for e in items]))


class Policy(ABC):
    """A flow-matching generator: frozen encoders and VAE, a transformer that carries the LoRA."""

    transformer: nn.Module
    shift: ShiftConfig
    device: torch.device
    dtype: torch.dtype

    @abstractmethod
    def encode_prompts(self, prompts: list[str]) -> TextEmbeds: ...

    @abstractmethod
    def latent_seq_len(self, height: int, width: int) -> int:
        """Number of image tokens the transformer sees (drives the schedule shift)."""

    @abstractmethod
    def initial_latents(self, batch: int, height: int, width: int, generators: list[torch.Generator]) -> torch.Tensor:
        """Packed Gaussian latents [B, L, C], one generator per sample (CPU generators)."""

    @abstractmethod
    def velocity(self, module: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, embeds: TextEmbeds,
                 height: int, width: int, guidance: float) -> torch.Tensor:
        """One transformer forward through `module` (the transformer or its engine)."""

    @abstractmethod
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents -> uint8 images [B, 3, H, W] on CPU."""

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        return flux_sigmas(num_steps, self.latent_seq_len(height, width), self.shift)

    @contextlib.contextmanager
    def adapter_disabled(self, module: nn.Module | None = None) -> Iterator[None]:
        """The base model (LoRA off): the KL reference policy."""
        model = getattr(module, "module", module) or self.transformer
        model.disable_adapters()
        try:
            yield
        finally:
            model.enable_adapters()
