"""Qwen-Image-Edit as a `Policy`: the reference image enters twice, once through the Qwen2.5-VL
prompt encoder (with the instruction) and once as VAE latents beside the noisy ones.

The components are driven directly, not through `QwenImageEditPipeline.__call__` (which resizes
every reference to about 1024x1024 pixels). Per sample and rollout:

- `encode_condition` resizes the original reference once to the condition size, which keeps the
  reference's aspect ratio (no square squash; the reference implementation resized to res x res),
  and VAE-encodes and packs it. The originals stay in the Condition for the rewards.
- `encode_prompts` runs the VL encoder once on diffusers' edit template with the reference. The
  template's system prefix is dropped from the hidden states as diffusers does (64 tokens with
  Qwen's tokenizer; counted from the tokenizer, so a tiny tokenizer drops its own prefix), the
  vision tokens stay. The padded embeddings keep their mask.
- Both are kept in the Trajectory: training forwards reuse them (the reference re-ran the VL
  encoder and re-encoded the reference three times per micro-step).

Sizes: the target and the condition are multiples of 16 (VAE 8x, 2x2 patches). The VL encoder
sees the reference at the condition size rounded to the nearest multiples of 28 (its 14-pixel
patches merged 2x2), resized once from the original: the same size diffusers' processor would snap
the condition image to, without resampling twice. At 384x384 that is 392x392 (196 image tokens).

Guidance: Qwen-Image-Edit has no guidance embedding; the pipeline's `true_cfg_scale` only acts
with a negative prompt, which the reference never passed (its "CFG 4.0" was inactive). No negative
prompt is configurable here, so `guidance` is unused: one transformer forward per step, as in the
reference's effective behaviour.

The transformer, VAE, schedule, latent packing and decoding are Qwen-Image's (qwen_image.py,
`QwenImagePolicy`, which this class extends with the reference image).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from paco_ds.recipe.schema import ModelConfig
from paco_ds.models.base import Condition, Part, TextEmbeds
from paco_ds.models.full_size import FullSize
from paco_ds.models.qwen_image import QwenImagePolicy, full_size_transformer
from paco_ds.models.qwen_image import full_size_components as qwen_image_components

DEFAULT_PATH = "Qwen/Qwen-Image-Edit"

# diffusers' QwenImageEditPipeline.prompt_template_encode (the image placeholder in the user turn).
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n")
VL_MULTIPLE = 28  # Qwen2-VL patch 14 x spatial merge 2
QWEN_VL_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280}


def full_size_components(cfg: ModelConfig) -> dict:
    """Qwen-Image's full-size components (qwen_image.full_size_components) with a processor of the
    real image geometry around the offline tokenizer, which also reads the reference image."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    from paco_ds.models.tiny.qwen_vl import QWEN2_VL_CHAT_TEMPLATE

    parts = qwen_image_components(cfg)
    parts["processor"] = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=14, temporal_patch_size=2, merge_size=2, **QWEN_VL_PIXELS),
        video_processor=Qwen2VLVideoProcessor(**QWEN_VL_PIXELS), tokenizer=parts.pop("tokenizer"),
        chat_template=QWEN2_VL_CHAT_TEMPLATE)
    return parts


def _resize(image: torch.Tensor, height: int, width: int):
    """uint8 [3, H, W] -> an RGB PIL image of height x width (Lanczos, as diffusers' resize)."""
    from PIL import Image

    pil = Image.fromarray(image.permute(1, 2, 0).contiguous().cpu().numpy())
    return pil if pil.size == (width, height) else pil.resize((width, height), Image.LANCZOS)


class QwenEditPolicy(QwenImagePolicy):
    display_name = "Qwen-Image-Edit"
    default_path = DEFAULT_PATH
    full_size = FullSize(full_size_transformer, full_size_components)
    max_sequence_length_limit = None  # model.max_sequence_length does not apply (options: the whole prompt)
    prompt_template = PROMPT_TEMPLATE
    template_prefix_end = "<|vision_start|>"  # the vision tokens stay
    # The processor (the tokenizer and the reference image's geometry) instead of Qwen-Image's tokenizer.
    parts = {**{k: v for k, v in QwenImagePolicy.parts.items() if k != "tokenizer"},
             "processor": Part("transformers:Qwen2VLProcessor", None)}
    tiny_builder = "paco_ds.models.tiny.qwen_image:tiny_qwen_edit_components"
    takes_max_sequence_length = False  # the VL encoder reads the whole prompt (and the reference image)

    def __init__(self, transformer: nn.Module, vae: nn.Module, text_encoder: nn.Module, processor,
                 scheduler_config: dict, device: torch.device, dtype: torch.dtype):
        super().__init__(transformer, vae, text_encoder, processor.tokenizer, scheduler_config, device, dtype,
                         max_sequence_length=None)
        self.processor = processor

    # ------------------------------------------------------------------ sizes and latents
    def condition_size(self, ref_height: int, ref_width: int, height: int, width: int) -> tuple[int, int]:
        """Where a reference is encoded for a height x width target: the target itself when it has
        the reference's aspect ratio up to rounding each side to `size_multiple` (targets derived
        with `target_size`), else the reference's aspect ratio at the target's area."""
        half = self.size_multiple / 2
        aspect = ref_width / ref_height
        if abs(width / height - aspect) / aspect <= half / height + half / width:
            return height, width
        return self.target_size(ref_height, ref_width, round(math.sqrt(height * width)))

    @staticmethod
    def vl_size(height: int, width: int) -> tuple[int, int]:
        """The VL encoder's image size: the nearest multiples of 28."""
        return (max(VL_MULTIPLE, round(height / VL_MULTIPLE) * VL_MULTIPLE),
                max(VL_MULTIPLE, round(width / VL_MULTIPLE) * VL_MULTIPLE))

    # ------------------------------------------------------------------ condition and prompts
    @torch.no_grad()
    def encode_condition(self, images: list[torch.Tensor], height: int, width: int) -> Condition:
        """VAE latents (mode, normalised by the VAE's latent mean/std, packed) of each reference
        resized once from its original to the condition size; the originals are kept untouched."""
        sizes = {self.condition_size(int(im.shape[1]), int(im.shape[2]), height, width) for im in images}
        if len(sizes) > 1:
            raise ValueError(f"references of one batch need different condition sizes {sorted(sizes)} for a "
                             f"{height}x{width} target; use sample.batch_size 1 for such data")
        ch, cw = sizes.pop()
        return Condition(images=list(images), latents=self.vae_tokens(images, ch, cw), size=(ch, cw))

    def vae_tokens(self, images: list[torch.Tensor], height: int, width: int) -> torch.Tensor:
        """The packed, normalised VAE latents [B, L, C] of uint8 images resized to height x width."""
        pixels = torch.stack([torch.from_numpy(np.asarray(_resize(im, height, width)).copy()).permute(2, 0, 1)
                              for im in images]).to(self.device, self.dtype)
        x = (pixels / 127.5 - 1.0).unsqueeze(2)  # [B, 3, 1, H, W] in [-1, 1]
        lat = self.vae.encode(x).latent_dist.mode()
        mean, std = self._latent_stats(lat.dtype)
        lat = ((lat - mean) / std)[:, :, 0]
        return self.pack(lat).to(self.dtype)

    def condition_sizes(self, condition: Condition) -> list[tuple[int, int]]:
        """The pixel size of each input image the condition's latents hold, in order."""
        return [condition.size]

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], condition: Condition | None = None) -> TextEmbeds:
        """One VL forward for the batch (each sample encoded once): template + reference image ->
        last hidden states without the template prefix, right-padded, with their mask."""
        if condition is None or len(condition) != len(prompts):
            raise ValueError(f"{self.display_name} encodes each prompt together with its reference image: "
                             "pass the batch's Condition")
        vh, vw = self.vl_size(*condition.size)
        images = [_resize(im, vh, vw) for im in condition.images]
        return self.vl_embeds([self.prompt_template.format(p) for p in prompts], images)

    def vl_embeds(self, texts: list[str], images: list) -> TextEmbeds:
        """The VL encoder on the batch's texts with their images (PIL, in the order the texts'
        image placeholders name them): the prompt embeddings without the template prefix."""
        inputs = self.processor(text=texts, images=images, padding=True, return_tensors="pt")
        kwargs = {k: inputs[k].to(self.device) for k in ("input_ids", "attention_mask", "image_grid_thw")}
        kwargs["pixel_values"] = inputs["pixel_values"].to(self.device, self.dtype)
        if "mm_token_type_ids" in inputs:
            # transformers 5 computes Qwen2.5-VL's 3D (mrope) positions for image tokens only when
            # given these; without them the image tokens get text positions.
            kwargs["mm_token_type_ids"] = inputs["mm_token_type_ids"].to(self.device)
        hidden = self.text_encoder(**kwargs, output_hidden_states=True).hidden_states[-1]
        return self.prompt_embeds(hidden, inputs["attention_mask"])

    # ------------------------------------------------------------------ transformer / VAE
    def velocity(self, module: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, embeds: TextEmbeds,
                 height: int, width: int, guidance: float, condition: Condition | None = None) -> torch.Tensor:
        """One forward on [noisy target tokens | condition tokens]; returns the target's part."""
        if condition is None or condition.latents is None:
            raise ValueError(f"{self.display_name} needs the reference's Condition for every forward")
        sizes = self.condition_sizes(condition)
        expected = sum((h // 2) * (w // 2) for h, w in (self.latent_hw(*size) for size in sizes))
        cond = condition.latents
        b = latents.shape[0]
        if cond.shape[0] != b or cond.shape[1] != expected:
            raise ValueError(f"condition latents {tuple(cond.shape)} do not match batch {b} at {condition.size}")
        return self.transformer_forward(module, latents, sigma, embeds, height, width, guidance, extra=cond,
                                        extra_sizes=sizes)
