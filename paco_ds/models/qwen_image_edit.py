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
"""
from __future__ import annotations

import logging
import math

import numpy as np
import torch
from torch import nn

from paco_ds.config import ModelConfig
from paco_ds.models.base import Condition, PackedPolicy, TextEmbeds, move_module
from paco_ds.models.full_size import FullSize, empty, qwen_vl_config
from paco_ds.models.zero_load import load_transformer
from paco_ds.models.schedule import ShiftConfig, calculate_mu

log = logging.getLogger(__name__)

DEFAULT_PATH = "Qwen/Qwen-Image-Edit"

# diffusers' QwenImageEditPipeline.prompt_template_encode (the image placeholder in the user turn).
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n")
VL_MULTIPLE = 28  # Qwen2-VL patch 14 x spatial merge 2

# The full-size model (models/full_size.py), from Qwen/Qwen-Image-Edit's config files; its prompt
# encoder is Qwen2.5-VL-7B-Instruct (full_size.qwen_vl_config).
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
QWEN_VL_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280}


def full_size_transformer() -> nn.Module:
    from diffusers import QwenImageTransformer2DModel

    return empty(lambda: QwenImageTransformer2DModel(**QWEN_IMAGE_TRANSFORMER))


def full_size_components(cfg: ModelConfig) -> dict:
    """The Qwen-Image VAE and the Qwen2.5-VL-7B prompt encoder on meta, with a processor of the real
    image geometry (the offline byte-level tokenizer, whose special token ids the model config
    takes; the vocabulary keeps its real size)."""
    from diffusers import AutoencoderKLQwenImage
    from transformers import (Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, Qwen2VLImageProcessor,
                              Qwen2VLVideoProcessor)

    from paco_ds.models.tiny.qwen_vl import QWEN2_VL_CHAT_TEMPLATE

    tok, config = qwen_vl_config()
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=14, temporal_patch_size=2, merge_size=2, **QWEN_VL_PIXELS),
        video_processor=Qwen2VLVideoProcessor(**QWEN_VL_PIXELS), tokenizer=tok, chat_template=QWEN2_VL_CHAT_TEMPLATE)
    return {"vae": empty(lambda: AutoencoderKLQwenImage(**QWEN_IMAGE_VAE)),
            "text_encoder": empty(lambda: Qwen2_5_VLForConditionalGeneration(config)),
            "processor": processor, "scheduler_config": dict(QWEN_IMAGE_SCHEDULER)}


def _resize(image: torch.Tensor, height: int, width: int):
    """uint8 [3, H, W] -> an RGB PIL image of height x width (Lanczos, as diffusers' resize)."""
    from PIL import Image

    pil = Image.fromarray(image.permute(1, 2, 0).contiguous().cpu().numpy())
    return pil if pil.size == (width, height) else pil.resize((width, height), Image.LANCZOS)


class QwenEditPolicy(PackedPolicy):
    default_path = DEFAULT_PATH
    attention_dispatch = True  # QwenDoubleStreamAttnProcessor2_0 dispatches
    # Attention and MLP of both streams in Qwen-Image's own names: its MLPs are img_mlp/txt_mlp,
    # so FLUX's ff/ff_context names would leave them without LoRA.
    lora_targets = (
        "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
    )
    full_size = FullSize(full_size_transformer, full_size_components)

    def __init__(self, transformer: nn.Module, vae: nn.Module, text_encoder: nn.Module, processor,
                 scheduler_config: dict, device: torch.device, dtype: torch.dtype):
        self.transformer = transformer
        self.vae, self.text_encoder, self.processor = vae, text_encoder, processor
        self.shift = ShiftConfig.from_scheduler_config(scheduler_config)
        # Qwen-Image stretches its shifted schedule so the last non-zero sigma is this (0.02);
        # ShiftConfig has no such field, so `sigmas` applies it.
        self.shift_terminal = scheduler_config.get("shift_terminal")
        if scheduler_config.get("time_shift_type", "exponential") != "exponential":
            raise ValueError(f"unsupported time_shift_type {scheduler_config['time_shift_type']!r}")
        self.device, self.dtype = device, dtype
        self.vae_scale_factor = 2 ** len(vae.temperal_downsample)
        self.size_multiple = self.vae_scale_factor * 2  # 2x2 packing of the latents
        self.latent_channels = vae.config.z_dim
        self.template_drop = len(processor.tokenizer(PROMPT_TEMPLATE.split("<|vision_start|>")[0])["input_ids"])
        self._warned_guidance = False
        for m in (vae, text_encoder):
            m.requires_grad_(False).eval()
            move_module(m, device, dtype)

    # ------------------------------------------------------------------ construction
    @classmethod
    def tiny_parts(cls, spec) -> dict:
        from paco_ds.models.tiny.qwen_image import tiny_qwen_edit_components

        return tiny_qwen_edit_components(spec, seed=spec.seed)

    @classmethod
    def options(cls, cfg) -> dict:
        return {}  # the VL encoder reads the whole prompt (and the reference image)

    @staticmethod
    def from_pretrained(path: str, revision: str | None, dtype: torch.dtype, ds_config: dict | None = None) -> dict:
        """Only runs where the weights are. Under ZeRO-3 the transformer (20B) is loaded
        partitioned; the VL encoder (7B) and the VAE are loaded whole on every rank."""
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLProcessor

        kw = {"revision": revision} if revision else {}
        log.info("loading Qwen-Image-Edit components from %s", path)
        transformer = load_transformer(QwenImageTransformer2DModel, path, revision, dtype, ds_config)
        return {
            "transformer": transformer,
            "vae": AutoencoderKLQwenImage.from_pretrained(path, subfolder="vae", torch_dtype=dtype, **kw),
            "text_encoder": Qwen2_5_VLForConditionalGeneration.from_pretrained(path, subfolder="text_encoder",
                                                                               dtype=dtype, **kw),
            "processor": Qwen2VLProcessor.from_pretrained(path, subfolder="processor", **kw),
            "scheduler_config": dict(FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler", **kw)),
        }

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

    def _latent_stats(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, self.latent_channels, 1, 1, 1)
        mean = torch.tensor(self.vae.config.latents_mean).view(shape).to(self.device, dtype)
        std = torch.tensor(self.vae.config.latents_std).view(shape).to(self.device, dtype)
        return mean, std

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
        pixels = torch.stack([torch.from_numpy(np.asarray(_resize(im, ch, cw)).copy()).permute(2, 0, 1)
                              for im in images]).to(self.device, self.dtype)
        x = (pixels / 127.5 - 1.0).unsqueeze(2)  # [B, 3, 1, H, W] in [-1, 1]
        lat = self.vae.encode(x).latent_dist.mode()
        mean, std = self._latent_stats(lat.dtype)
        lat = ((lat - mean) / std)[:, :, 0]
        return Condition(images=list(images), latents=self.pack(lat).to(self.dtype), size=(ch, cw))

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], condition: Condition | None = None) -> TextEmbeds:
        """One VL forward for the batch (each sample encoded once): template + reference image ->
        last hidden states without the template prefix, right-padded, with their mask."""
        if condition is None or len(condition) != len(prompts):
            raise ValueError("Qwen-Image-Edit encodes each prompt together with its reference image: "
                             "pass the batch's Condition")
        vh, vw = self.vl_size(*condition.size)
        images = [_resize(im, vh, vw) for im in condition.images]
        inputs = self.processor(text=[PROMPT_TEMPLATE.format(p) for p in prompts], images=images, padding=True,
                                return_tensors="pt")
        kwargs = {k: inputs[k].to(self.device) for k in ("input_ids", "attention_mask", "image_grid_thw")}
        kwargs["pixel_values"] = inputs["pixel_values"].to(self.device, self.dtype)
        if "mm_token_type_ids" in inputs:
            # transformers 5 computes Qwen2.5-VL's 3D (mrope) positions for image tokens only when
            # given these; without them the image tokens get text positions.
            kwargs["mm_token_type_ids"] = inputs["mm_token_type_ids"].to(self.device)
        hidden = self.text_encoder(**kwargs, output_hidden_states=True).hidden_states[-1]
        mask = inputs["attention_mask"].to(self.device).bool()
        rows = [h[m][self.template_drop:] for h, m in zip(hidden, mask)]
        width = max(r.shape[0] for r in rows)
        embeds = torch.stack([nn.functional.pad(r, (0, 0, 0, width - r.shape[0])) for r in rows])
        valid = torch.stack([torch.arange(width, device=self.device) < r.shape[0] for r in rows]).long()
        return TextEmbeds(prompt_embeds=embeds.to(self.dtype), mask=valid)

    # ------------------------------------------------------------------ transformer / VAE
    def velocity(self, module: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, embeds: TextEmbeds,
                 height: int, width: int, guidance: float, condition: Condition | None = None) -> torch.Tensor:
        """One forward on [noisy target tokens | condition tokens]; returns the target's part."""
        if condition is None or condition.latents is None:
            raise ValueError("Qwen-Image-Edit needs the reference's Condition for every forward")
        if guidance > 1 and not self._warned_guidance:
            log.warning("guidance_scale %s is unused: Qwen-Image-Edit has no guidance embedding and true CFG "
                        "needs a negative prompt (none is configured; the reference's was inactive too)", guidance)
            self._warned_guidance = True
        b, n = latents.shape[:2]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(b)
        h, w = self.latent_hw(height, width)
        ch, cw = self.latent_hw(*condition.size)
        cond = condition.latents.to(self.device, self.dtype)
        if cond.shape[0] != b or cond.shape[1] != (ch // 2) * (cw // 2):
            raise ValueError(f"condition latents {tuple(cond.shape)} do not match batch {b} at {condition.size}")
        text, mask = embeds.prompt_embeds.to(self.device, self.dtype), embeds.mask
        if mask is not None:  # drop the columns no row uses; no mask at all when none is padded
            mask = mask.to(self.device).bool()
            used = int(mask.sum(dim=1).max())
            text, mask = text[:, :used], mask[:, :used]
            if bool(mask.all()):
                mask = None
        out = module(hidden_states=torch.cat([latents.to(self.dtype), cond], dim=1), timestep=sigma.to(self.dtype),
                     encoder_hidden_states=text, encoder_hidden_states_mask=mask,
                     img_shapes=[[(1, h // 2, w // 2), (1, ch // 2, cw // 2)]] * b, return_dict=False)[0]
        return out[:, :n]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        x = self.unpack(latents.to(self.device, self.dtype), height, width).unsqueeze(2)
        mean, std = self._latent_stats(x.dtype)
        images = self.vae.decode(x * std + mean, return_dict=False)[0][:, :, 0]
        return ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()
