"""Stable Diffusion 3.5 as a `Policy`: three text encoders (CLIP-L, CLIP-G, T5), classifier-free
guidance in one batched forward, and the SD3 scheduler's sigma schedule.

Follows Flow-GRPO's SD3 code (github.com/yifan123/flow_grpo):

- prompts: flow_grpo/diffusers_patch/train_dreambooth_lora_sd3.py `encode_prompt`. Each CLIP gives
  its penultimate hidden states (77 tokens, padded to max length) and its projected pooled vector;
  the two CLIP sequences are concatenated on the feature axis, zero-padded to T5's width and put in
  front of T5's `max_sequence_length` tokens; the pooled vectors are concatenated (768 + 1280). The
  embeddings are computed once per sample at rollout time and cached in the Trajectory, as for FLUX.
- guidance: the negative prompt is the empty string, encoded once (scripts/train_sd3.py,
  `neg_prompt_embed`). With guidance > 1 every velocity is one transformer call on the batch
  doubled as [uncond | cond] (flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py while
  sampling, scripts/train_sd3.py `compute_log_prob` while training), then
  v = v_u + g (v_c - v_u). With gradients on, v_u is detached, as `compute_log_prob` does: the
  policy gradient flows through the conditional branch only.
- schedule: FlowMatchEulerDiscreteScheduler with SD3.5's config (shift 3, no dynamic shifting) and
  no explicit sigmas, as the pipeline calls it: N sigmas evenly spaced in t between the training
  schedule's first and last, shifted by s -> shift s / (1 + (shift - 1) s), then 0. The
  transformer reads timestep = 1000 sigma.
- SDE: flow_grpo/diffusers_patch/sd3_sde_with_logprob.py is the project's `flow_grpo` SDE type
  (kernels/sde_reference.py, same mean, std and per-element-averaged Gaussian log-prob, the same
  sigma == 1 guard with sigmas[1]); tests/models/test_sd3.py checks it against a transcription of that file.

Latents are kept packed as 2x2 patches [B, L, 4C] like FLUX's, so every part of the trainer sees
the same layout; they are unpacked to [B, C, H, W] for the transformer (which patchifies itself)
and the VAE. The VAE runs in fp32, as Flow-GRPO keeps it.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from paco_ds.recipe.schema import ModelConfig
from paco_ds.models.base import PackedPolicy, Part, TextEmbeds
from paco_ds.models.flux import FLUX_VAE
from paco_ds.models.full_size import CLIP_L_TEXT, FullSize, empty, t5_xxl
from paco_ds.models.schedule import ShiftConfig

CLIP_MAX_LENGTH = 77

# The full-size model (models/full_size.py), from stabilityai/stable-diffusion-3.5-medium's config files.
SD35_MEDIUM_TRANSFORMER = {  # MMDiT-X, 2,243,171,520 parameters
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 24,
    "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096, "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048, "pos_embed_max_size": 384, "dual_attention_layers": tuple(range(13)),
    "qk_norm": "rms_norm",
}
SD35_VAE = FLUX_VAE | {"scaling_factor": 1.5305, "shift_factor": 0.0609}  # same autoencoder shape as FLUX's
SD35_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}
CLIP_L_PROJ = CLIP_L_TEXT | {"pad_token_id": 1}  # text_encoder: CLIP-L with its projection (768)
CLIP_G_PROJ = {  # text_encoder_2: OpenCLIP bigG/14's text tower with its projection (1280)
    "vocab_size": 49408, "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
    "num_attention_heads": 20, "max_position_embeddings": 77, "hidden_act": "gelu", "projection_dim": 1280,
    "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1,
}


def full_size_transformer() -> nn.Module:
    from diffusers import SD3Transformer2DModel

    return empty(lambda: SD3Transformer2DModel(**SD35_MEDIUM_TRANSFORMER))


def full_size_components(cfg: ModelConfig) -> dict:
    """The VAE (fp32, as the policy keeps it: `full_size.fp32`), CLIP-L and CLIP-G with their
    projections and T5-XXL on meta, each with its own offline tokenizer (SD3.5 ships one per encoder)."""
    import copy

    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from paco_ds.models.tiny import clip_tokenizer, t5_tokenizer

    return {"vae": empty(lambda: AutoencoderKL(**SD35_VAE)),
            "text_encoder": empty(lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_L_PROJ))),
            "text_encoder_2": empty(lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_G_PROJ))),
            "text_encoder_3": t5_xxl(),
            "tokenizer": copy.deepcopy(clip_tokenizer()), "tokenizer_2": copy.deepcopy(clip_tokenizer()),
            "tokenizer_3": copy.deepcopy(t5_tokenizer()), "scheduler_config": dict(SD35_SCHEDULER)}


def sd3_sigmas(num_steps: int, shift: float, num_train_timesteps: int = 1000) -> torch.Tensor:
    """num_steps + 1 sigmas (float32) of FlowMatchEulerDiscreteScheduler.set_timesteps(num_steps)
    without dynamic shifting: the training schedule's extremes (computed in float32 as the scheduler
    builds them), N times evenly spaced between them (float64), shifted, cast, terminal 0."""
    train = torch.arange(num_train_timesteps, 0, -1, dtype=torch.float32) / num_train_timesteps
    train = shift * train / (1 + (shift - 1) * train)
    t_max, t_min = train[0].item() * num_train_timesteps, train[-1].item() * num_train_timesteps
    s = np.linspace(t_max, t_min, num_steps) / num_train_timesteps
    s = shift * s / (1 + (shift - 1) * s)
    return torch.cat([torch.from_numpy(s).to(torch.float32), torch.zeros(1)])


class SD3Policy(PackedPolicy):
    default_path = "stabilityai/stable-diffusion-3.5-medium"
    # Flow-GRPO's LoRA targets for SD3.5 (scripts/train_sd3.py): the joint attention's projections of
    # both streams. As peft suffixes they match `attn.*` only, not SD3.5-M's second image
    # attention `attn2.*`, exactly as in Flow-GRPO.
    lora_targets = (
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
    )
    full_size = FullSize(full_size_transformer, full_size_components, fp32=("vae",))
    transformer_class = "diffusers:SD3Transformer2DModel"
    parts = {"vae": Part("diffusers:AutoencoderKL", "fp32", choices=("AutoencoderKL", "AutoencoderTiny")),
             "text_encoder": Part("transformers:CLIPTextModelWithProjection"),
             "text_encoder_2": Part("transformers:CLIPTextModelWithProjection"),
             "text_encoder_3": Part("transformers:T5EncoderModel"),
             "tokenizer": Part("transformers:CLIPTokenizer", None), "tokenizer_2": Part("transformers:CLIPTokenizer", None),
             "tokenizer_3": Part("transformers:T5TokenizerFast", None)}
    tiny_builder = "paco_ds.models.tiny.sd3:tiny_sd3_components"

    def __init__(self, transformer: nn.Module, vae: nn.Module, text_encoder: nn.Module, text_encoder_2: nn.Module,
                 text_encoder_3: nn.Module, tokenizer, tokenizer_2, tokenizer_3, scheduler_config: dict,
                 device: torch.device, dtype: torch.dtype, max_sequence_length: int = 128):
        if scheduler_config.get("use_dynamic_shifting") or any(
                scheduler_config.get(k) for k in ("shift_terminal", "use_karras_sigmas", "use_exponential_sigmas",
                                                  "use_beta_sigmas", "invert_sigmas")):
            raise ValueError(f"unsupported SD3 scheduler config {scheduler_config}: only a fixed shift is implemented")
        self.num_train_timesteps = int(scheduler_config.get("num_train_timesteps", 1000))
        self.shift = ShiftConfig(use_dynamic_shifting=False, shift=float(scheduler_config.get("shift", 1.0)))
        self.max_sequence_length = max_sequence_length
        self.use_vae(vae)  # 2x2 patches of its latents
        # the VAE held in fp32, the text encoders in the model dtype
        self.take(device, dtype, transformer=transformer, vae=vae, text_encoder=text_encoder,
                  text_encoder_2=text_encoder_2, text_encoder_3=text_encoder_3, tokenizer=tokenizer,
                  tokenizer_2=tokenizer_2, tokenizer_3=tokenizer_3)
        # The negative prompt of classifier-free guidance, encoded once (kept on the CPU; a copy on
        # the device is made once, not at every forward: negative_here).
        self.negative = self.encode_prompts([""]).to("cpu")

    def text_encoders(self) -> list[nn.Module]:
        return [self.text_encoder, self.text_encoder_2, self.text_encoder_3]

    # ------------------------------------------------------------------ text
    def _clip(self, encoder: nn.Module, tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = tokenizer(prompts, padding="max_length", max_length=CLIP_MAX_LENGTH, truncation=True,
                        return_tensors="pt").input_ids
        out = encoder(ids.to(encoder.device), output_hidden_states=True)
        return out.hidden_states[-2], out.text_embeds  # penultimate layer; projected pooled vector

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], condition=None) -> TextEmbeds:
        seq_l, pooled_l = self._clip(self.text_encoder, self.tokenizer, prompts)
        seq_g, pooled_g = self._clip(self.text_encoder_2, self.tokenizer_2, prompts)
        ids = self.tokenizer_3(prompts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                               add_special_tokens=True, return_tensors="pt").input_ids
        t5 = self.text_encoder_3(ids.to(self.text_encoder_3.device))[0]
        clip = torch.cat([seq_l, seq_g], dim=-1)
        clip = nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        embeds = torch.cat([clip.to(t5.dtype), t5], dim=-2)
        pooled = torch.cat([pooled_l, pooled_g], dim=-1)
        return TextEmbeds(prompt_embeds=embeds.to(self.dtype), pooled=pooled.to(self.dtype))

    # ------------------------------------------------------------------ schedule and latents
    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        return sd3_sigmas(num_steps, self.shift.shift, self.num_train_timesteps)

    # ------------------------------------------------------------------ transformer / VAE
    def velocity(self, module: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, embeds: TextEmbeds,
                 height: int, width: int, guidance: float, condition=None) -> torch.Tensor:
        """The guided velocity (packed like `latents`): one transformer call, on [uncond | cond]
        when guidance > 1."""
        b = latents.shape[0]
        x = self.unpack(latents.to(self.dtype), height, width)
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(b)
        # The scheduler's timesteps: float32 sigma x 1000, as the pipeline hands them over.
        t = sigma * self.num_train_timesteps
        text = embeds.prompt_embeds.to(self.device, self.dtype)
        pooled = embeds.pooled.to(self.device, self.dtype)
        cfg = guidance > 1
        if cfg:
            neg = self.negative_here()
            x, t = torch.cat([x, x]), torch.cat([t, t])
            text = torch.cat([neg.prompt_embeds.expand(b, -1, -1), text])
            pooled = torch.cat([neg.pooled.expand(b, -1), pooled])
        # float32 like the pipeline's: 1000 sigma in bf16 would be rounded to steps of 4.
        out = module(hidden_states=x, timestep=t, encoder_hidden_states=text,
                     pooled_projections=pooled, return_dict=False)[0]
        if cfg:
            uncond, cond = out.chunk(2)
            uncond = uncond.detach()  # compute_log_prob's stop-gradient (no-op while sampling)
            out = uncond + guidance * (cond - uncond)
        return self.pack(out)
