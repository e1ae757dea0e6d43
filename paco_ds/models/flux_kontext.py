"""FLUX.1-Kontext-dev as an editing `Policy`: FLUX, plus a reference image read beside the noisy latents.

Everything FLUX has (CLIP + T5 text, packed 2x2 latents, guidance embedding, VAE scaling, ZeRO-3
loading) comes from `FluxPolicy`; what Kontext adds (diffusers' pipeline_flux_kontext.py) is:

- `encode_condition`: each reference image is resized to the target size (which keeps the
  reference's aspect ratio, `Policy.target_size`; the reference implementation squashes it to a square,
  PaCo-RL/PaCo-GRPO/scripts/train_flux_kontext.py), VAE-encoded once (the mode of the latent
  distribution, then `(z - shift) * scale`) and packed like the target latents. The Condition keeps the
  original images for the rewards and the packed latents for every forward.
- `velocity`: the condition tokens are concatenated after the noisy ones on the sequence axis, with
  their own image ids (`ids[..., 0] = 1`); one transformer forward; the prediction is cut back to
  the target tokens, so the SDE step and its log-prob see the target only.
- The schedule's shift uses the target's token count (`latent_seq_len` is FluxPolicy's).

The checkpoint must be FLUX.1-Kontext-dev: the reference's Kontext recipe loads FLUX.1-dev
(PaCo-RL/PaCo-GRPO/config/grpo.py, kontext_editing), which runs without error and silently trains the
wrong model, so `load` refuses known non-Kontext checkpoints.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from torch import nn

from paco_ds.recipe.schema import ModelConfig
from paco_ds.models.base import Condition, TextEmbeds
from paco_ds.models.flux import FluxPolicy

log = logging.getLogger(__name__)

KONTEXT_PATH = "black-forest-labs/FLUX.1-Kontext-dev"
# Hub ids of FLUX checkpoints that were not trained to read condition tokens.
NOT_KONTEXT = ("black-forest-labs/FLUX.1-dev", "black-forest-labs/FLUX.1-schnell")


def kontext_path(cfg: ModelConfig) -> str:
    """The checkpoint to load: `model.path` when the recipe sets it, FLUX.1-Kontext-dev otherwise.
    Refuses checkpoints known not to be Kontext: a hub id of FLUX.1-dev/schnell, or a local folder
    whose model_index.json names another pipeline."""
    path = cfg.path or KONTEXT_PATH
    if path.rstrip("/") in NOT_KONTEXT:
        raise ValueError(f"model.family flux_kontext needs FLUX.1-Kontext weights, not {path}: "
                         f"set model.path: {KONTEXT_PATH} (or a local copy of it)")
    index = Path(path).expanduser() / "model_index.json"
    if index.is_file():
        pipeline = json.loads(index.read_text()).get("_class_name")
        if pipeline and pipeline != "FluxKontextPipeline":
            raise ValueError(f"{path} holds a {pipeline} checkpoint; model.family flux_kontext needs "
                             f"FLUX.1-Kontext weights (a FluxKontextPipeline folder such as {KONTEXT_PATH})")
    return path


def resize_to(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [3, H, W] -> float [1, 3, height, width] in [-1, 1]: a Lanczos resize, as diffusers'
    VaeImageProcessor does for the Kontext pipeline (to exactly this size: no square squash, no
    snapping to preferred resolutions)."""
    import numpy as np
    from PIL import Image

    if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[0] != 3:
        raise ValueError(f"a reference image is uint8 [3, H, W], got {image.dtype} {list(image.shape)}")
    if tuple(image.shape[1:]) != (height, width):
        pil = Image.fromarray(image.permute(1, 2, 0).cpu().numpy()).resize((width, height), Image.LANCZOS)
        image = torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1)
    return (image.float()[None] / 127.5 - 1.0).clamp(-1, 1)


def _digest(image: torch.Tensor) -> tuple:
    return tuple(image.shape), hashlib.sha1(image.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


class KontextPolicy(FluxPolicy):
    default_path = KONTEXT_PATH  # the same transformer class as FLUX.1-dev, so the same LoRA targets

    @classmethod
    def load(cls, cfg: ModelConfig, device: torch.device, ds_config: dict | None = None,
             source=None) -> "KontextPolicy":
        """FluxPolicy's loading (the same component classes: a FluxTransformer2DModel with guidance
        embeddings, AutoencoderKL, CLIP, T5; partitioned under ZeRO-3) from a Kontext checkpoint.
        The tiny model already has guidance embeddings (and an AutoencoderTiny)."""
        if not cfg.tiny:
            cfg = cfg.model_copy(update={"path": kontext_path(cfg)})
        return super().load(cfg, device, ds_config=ds_config, source=source)

    # ------------------------------------------------------------------ condition
    @torch.no_grad()
    def encode_vae(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels [B, 3, H, W] in [-1, 1] -> scaled latents, as the pipeline's `_encode_vae_image`:
        the mode of the latent distribution (AutoencoderKL) or the latents (AutoencoderTiny)."""
        out = self.vae.encode(pixels.to(self.device, self.dtype))
        z = out.latent_dist.mode() if hasattr(out, "latent_dist") else out.latents
        return (z - (self.vae.config.shift_factor or 0.0)) * self.vae.config.scaling_factor

    @torch.no_grad()
    def encode_condition(self, images: list[torch.Tensor], height: int, width: int) -> Condition:
        """One row per image, encoded at the target size (height x width). Each distinct image is
        encoded once and one at a time (a group's k copies of a reference share one encode, and a
        sample's latents do not depend on the batch it came in)."""
        self.latent_hw(height, width)  # the size must pack
        encoded: dict[tuple, torch.Tensor] = {}
        rows = []
        for image in images:
            key = _digest(image)
            if key not in encoded:
                encoded[key] = self.pack(self.encode_vae(resize_to(image, height, width)))
            rows.append(encoded[key])
        return Condition(images=list(images), latents=torch.cat(rows), size=(height, width))

    def condition_ids(self, height: int, width: int) -> torch.Tensor:
        """The condition tokens' ids: the latent grid's, with the first axis set to 1."""
        ids = self.image_ids(height, width).clone()
        ids[:, 0] = 1
        return ids

    # ------------------------------------------------------------------ transformer
    def velocity(self, module: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, embeds: TextEmbeds,
                 height: int, width: int, guidance: float, condition: Condition | None = None) -> torch.Tensor:
        if condition is None or condition.latents is None:
            raise ValueError("FLUX.1-Kontext edits a reference image: velocity needs the Condition "
                             "from encode_condition")
        b, n = latents.shape[:2]
        cond = condition.latents.to(self.device, self.dtype)
        if cond.shape[0] != b:
            if cond.shape[0] != 1:
                raise ValueError(f"{cond.shape[0]} condition rows for a batch of {b}")
            cond = cond.expand(b, -1, -1)
        img_ids = torch.cat([self.image_ids(height, width), self.condition_ids(*(condition.size or (height, width)))])
        out = self._forward(module, torch.cat([latents.to(self.dtype), cond], dim=1), img_ids, sigma, embeds, guidance)
        return out[:, :n]
