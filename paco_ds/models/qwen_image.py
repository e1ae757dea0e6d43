"""Qwen-Image as a `Policy`: text-to-image with Qwen2.5-VL as the prompt encoder, and the part of
Qwen-Image-Edit (qwen_image_edit.py, which extends `QwenImagePolicy`) that both share.

The components are driven directly, as diffusers' `QwenImagePipeline` drives them:

- prompts: the pipeline's template (a system turn asking for a detailed description, the prompt as
  the user turn), tokenized up to 1024 tokens after the template's prefix, one VL forward for the
  batch; the last hidden states of the valid tokens without the template's system prefix (34 tokens
  with Qwen's tokenizer, counted from the tokenizer, so a tiny tokenizer drops its own prefix), cut
  to `model.max_sequence_length` (512 in the pipeline, at most 1024), right-padded, with their mask.
  Encoded once per sample at rollout and reused by every training forward.
- latents: 16-channel latents of the 8x VAE packed as 2x2 patches (64 features per token), the
  transformer reading `img_shapes` [(1, h/2, w/2)] and timestep = sigma; the VAE decodes them
  after undoing its per-channel latent normalisation (`latents_mean`, `latents_std`).
- schedule: FlowMatchEulerDiscreteScheduler with Qwen-Image's config: linspace(1, 1/N, N), the
  exponential shift by mu of the image's tokens, stretched so the last non-zero sigma is 0.02.
- guidance: the transformer has no guidance embedding; the pipeline's `true_cfg_scale` acts only
  with a negative prompt, and none is configurable here, so `sample.guidance_scale` is unused: one
  transformer forward per step, as the pipeline without a negative prompt.
"""
from __future__ import annotations

import logging
import math

import torch
from torch import nn

from paco_ds.recipe.schema import ModelConfig
from paco_ds.models.base import DOUBLE_STREAM_ATTENTION, Condition, PackedPolicy, Part, TextEmbeds, to_uint8
from paco_ds.models.full_size import FullSize, empty, qwen_vl_config
from paco_ds.models.schedule import ShiftConfig, calculate_mu
from paco_ds.models.sequence import pad_prompt

log = logging.getLogger(__name__)

# diffusers' QwenImagePipeline.prompt_template_encode; its prefix up to the prompt is dropped.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n")
TOKENIZER_MAX_LENGTH = 1024  # the pipeline's tokenizer_max_length, and its limit on max_sequence_length

# The full-size model (models/full_size.py), from Qwen/Qwen-Image's config files (Qwen-Image-Edit
# ships the same transformer, VAE and scheduler configs); its prompt encoder is
# Qwen2.5-VL-7B-Instruct (full_size.qwen_vl_config).
QWEN_IMAGE_TRANSFORMER = {
    "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False, "axes_dims_rope": [16, 56, 56],
}
QWEN_IMAGE_VAE = {
    "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True], "dropout": 0.0,
    "latents_mean": [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
                     -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    "latents_std": [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
                    1.6382, 1.1253, 2.8251, 1.916],
}
QWEN_IMAGE_SCHEDULER = {"base_image_seq_len": 256, "max_image_seq_len": 8192, "base_shift": 0.5, "max_shift": 0.9,
                        "use_dynamic_shifting": True, "shift": 1.0, "shift_terminal": 0.02,
                        "time_shift_type": "exponential"}


def full_size_transformer() -> nn.Module:
    from diffusers import QwenImageTransformer2DModel

    return empty(lambda: QwenImageTransformer2DModel(**QWEN_IMAGE_TRANSFORMER))


def full_size_components(cfg: ModelConfig) -> dict:
    """The Qwen-Image VAE and the Qwen2.5-VL-7B prompt encoder on meta, with the offline byte-level
    tokenizer (whose special token ids the model config takes; the vocabulary keeps its real size)."""
    from diffusers import AutoencoderKLQwenImage
    from transformers import Qwen2_5_VLForConditionalGeneration

    tok, config = qwen_vl_config()
    return {"vae": empty(lambda: AutoencoderKLQwenImage(**QWEN_IMAGE_VAE)),
            "text_encoder": empty(lambda: Qwen2_5_VLForConditionalGeneration(config)),
            "tokenizer": tok, "scheduler_config": dict(QWEN_IMAGE_SCHEDULER)}


class QwenImagePolicy(PackedPolicy):
    display_name = "Qwen-Image"
    default_path = "Qwen/Qwen-Image"
    attention_dispatch = True  # QwenDoubleStreamAttnProcessor2_0 dispatches
    text_attention_mask = True  # encoder_hidden_states_mask: prompts of a batch padded to one length
    max_sequence_length_limit = TOKENIZER_MAX_LENGTH
    # Attention and MLP of both streams in Qwen-Image's own names: its MLPs are img_mlp/txt_mlp,
    # so FLUX's ff/ff_context names would leave them without LoRA.
    lora_targets = DOUBLE_STREAM_ATTENTION + ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                                              "txt_mlp.net.2")
    full_size = FullSize(full_size_transformer, full_size_components)
    transformer_class = "diffusers:QwenImageTransformer2DModel"
    parts = {"vae": Part("diffusers:AutoencoderKLQwenImage"),
             "text_encoder": Part("transformers:Qwen2_5_VLForConditionalGeneration"),
             "tokenizer": Part("transformers:Qwen2Tokenizer", None)}
    tiny_builder = "paco_ds.models.tiny.qwen_image:tiny_qwen_image_components"
    tiny_prompt_cap = None  # the tiny VL encoder reads long prompts too (no 64-token cap as for the tiny T5s)
    prompt_template = PROMPT_TEMPLATE
    template_prefix_end = "{}"  # the template's dropped prefix ends where this begins

    def __init__(self, transformer: nn.Module, vae: nn.Module, text_encoder: nn.Module, tokenizer,
                 scheduler_config: dict, device: torch.device, dtype: torch.dtype,
                 max_sequence_length: int | None = 512):
        if max_sequence_length is not None and max_sequence_length > TOKENIZER_MAX_LENGTH:
            raise ValueError(f"model.max_sequence_length is at most {TOKENIZER_MAX_LENGTH} for {self.display_name}, "
                             f"got {max_sequence_length}")
        self.max_sequence_length = max_sequence_length
        self.shift = ShiftConfig.from_scheduler_config(scheduler_config)
        # Qwen-Image stretches its shifted schedule so the last non-zero sigma is this (0.02);
        # ShiftConfig has no such field, so `sigmas` applies it.
        self.shift_terminal = scheduler_config.get("shift_terminal")
        if scheduler_config.get("time_shift_type", "exponential") != "exponential":
            raise ValueError(f"unsupported time_shift_type {scheduler_config['time_shift_type']!r}")
        self.vae_scale_factor = 2 ** len(vae.temperal_downsample)
        self.size_multiple = self.vae_scale_factor * 2  # 2x2 packing of the latents
        self.latent_channels = vae.config.z_dim
        prefix = self.prompt_template.split(self.template_prefix_end)[0]
        self.template_drop = len(tokenizer(prefix)["input_ids"])
        self._warned_guidance = False
        self.take(device, dtype, transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)

    # ------------------------------------------------------------------ schedule
    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """FlowMatchEulerDiscreteScheduler.set_timesteps with Qwen's config: linspace(1, 1/N, N),
        exponential shift by mu(target tokens), stretched to end at `shift_terminal`, then 0."""
        raw = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)
        if self.shift.use_dynamic_shifting:
            e = math.exp(calculate_mu(self.latent_seq_len(height, width), self.shift))
            s = e / (e + (1.0 / raw - 1.0))
        else:
            s = self.shift.shift * raw / (1 + (self.shift.shift - 1) * raw)
        if self.shift_terminal:
            one_minus = 1.0 - s
            s = 1.0 - one_minus / (one_minus[-1] / (1.0 - self.shift_terminal))
        return torch.cat([s, torch.zeros(1, dtype=torch.float64)]).to(torch.float32)

    def _latent_stats(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, self.latent_channels, 1, 1, 1)
        mean = torch.tensor(self.vae.config.latents_mean).view(shape).to(self.device, dtype)
        std = torch.tensor(self.vae.config.latents_std).view(shape).to(self.device, dtype)
        return mean, std

    # ------------------------------------------------------------------ prompts
    def prompt_embeds(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> TextEmbeds:
        """The VL encoder's last hidden states of each row's valid tokens without the template's
        prefix (and at most `max_sequence_length` of them), right-padded, with their mask."""
        mask = attention_mask.to(self.device).bool()
        rows = [h[m][self.template_drop:][:self.max_sequence_length] for h, m in zip(hidden, mask)]
        width = max(r.shape[0] for r in rows)
        embeds = torch.stack([nn.functional.pad(r, (0, 0, 0, width - r.shape[0])) for r in rows])
        valid = torch.stack([torch.arange(width, device=self.device) < r.shape[0] for r in rows]).long()
        return TextEmbeds(prompt_embeds=embeds.to(self.dtype), mask=valid)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], condition: Condition | None = None) -> TextEmbeds:
        """One VL forward for the batch (each sample encoded once), as QwenImagePipeline encodes."""
        if condition is not None:
            raise ValueError(f"{self.display_name} generates from text alone: it takes no condition images")
        inputs = self.tokenizer([self.prompt_template.format(p) for p in prompts], padding=True, truncation=True,
                                max_length=TOKENIZER_MAX_LENGTH + self.template_drop, return_tensors="pt")
        hidden = self.text_encoder(input_ids=inputs["input_ids"].to(self.device),
                                   attention_mask=inputs["attention_mask"].to(self.device),
                                   output_hidden_states=True).hidden_states[-1]
        return self.prompt_embeds(hidden, inputs["attention_mask"])

    # ------------------------------------------------------------------ transformer / VAE
    def transformer_forward(self, module: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, embeds: TextEmbeds,
                            height: int, width: int, guidance: float, extra: torch.Tensor | None = None,
                            extra_sizes: list[tuple[int, int]] = ()) -> torch.Tensor:
        """One forward on the noisy tokens, followed by `extra` tokens: an edit's input images, one
        after another, of `extra_sizes` pixels each (img_shapes lists the target, then each input,
        so the RoPE gives each its own frame index); returns the velocity of the noisy tokens."""
        if guidance > 1 and not self._warned_guidance:
            log.warning("guidance_scale %s is unused: %s has no guidance embedding and true CFG needs a negative "
                        "prompt (none is configured)", guidance, self.display_name)
            self._warned_guidance = True
        b, n = latents.shape[:2]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(b)
        h, w = self.latent_hw(height, width)
        tokens, shapes = latents.to(self.dtype), [(1, h // 2, w // 2)]
        if extra is not None:
            tokens = torch.cat([tokens, extra.to(self.device, self.dtype)], dim=1)
            for size in extra_sizes:
                eh, ew = self.latent_hw(*size)
                shapes.append((1, eh // 2, ew // 2))
        text, mask = embeds.prompt_embeds.to(self.device, self.dtype), embeds.mask
        if mask is not None:  # drop the columns no row uses; no mask at all when none is padded
            mask = mask.to(self.device).bool()
            used = int(mask.sum(dim=1).max())
            text, mask = text[:, :used], mask[:, :used]
            if bool(mask.all()):
                mask = None
        text, mask = pad_prompt(text, mask, self.sequence_degree)  # parallel.sequence: split over its ranks
        out = module(hidden_states=tokens, timestep=sigma.to(self.dtype), encoder_hidden_states=text,
                     encoder_hidden_states_mask=mask, img_shapes=[shapes] * b, return_dict=False)[0]
        return out[:, :n]

    def velocity(self, module: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, embeds: TextEmbeds,
                 height: int, width: int, guidance: float, condition: Condition | None = None) -> torch.Tensor:
        if condition is not None:
            raise ValueError(f"{self.display_name} generates from text alone: it takes no condition images")
        return self.transformer_forward(module, latents, sigma, embeds, height, width, guidance)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        x = self.unpack(latents.to(self.device, self.dtype), height, width).unsqueeze(2)
        mean, std = self._latent_stats(x.dtype)
        images = self.vae.decode(x * std + mean, return_dict=False)[0][:, :, 0]
        return to_uint8(images)
