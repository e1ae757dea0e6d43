"""FLUX.1-dev as a `Policy`: CLIP + T5 text conditioning, packed 2x2 latents, guidance embedding.

`FluxPolicy.load(cfg, device, ds_config)` loads the real model from a hub id or a local directory
(the transformer partitioned from the start under ZeRO-3), or builds the tiny offline one when
`model.tiny` is true. The math of the pipeline (prompt encoding, latent packing and ids, VAE
scaling) is written out here so rollouts can keep exactly what training needs.
"""
from __future__ import annotations

import torch
from torch import nn

from paco_ds.recipe.schema import ModelConfig
from paco_ds.models.base import DOUBLE_STREAM_ATTENTION, PackedPolicy, Part, TextEmbeds
from paco_ds.models.full_size import CLIP_L_TEXT, FullSize, empty, t5_xxl
from paco_ds.models.schedule import ShiftConfig

# The full-size model (models/full_size.py), from black-forest-labs/FLUX.1-dev's config files.
FLUX_TRANSFORMER = {  # FLUX.1-dev and FLUX.1-Kontext-dev share it: 11,901,408,320 parameters
    "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}
FLUX_VAE = {
    "in_channels": 3, "out_channels": 3, "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4, "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2,
    "act_fn": "silu", "latent_channels": 16, "norm_num_groups": 32, "sample_size": 1024, "scaling_factor": 0.3611,
    "shift_factor": 0.1159, "use_quant_conv": False, "use_post_quant_conv": False,
}
FLUX_SCHEDULER = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15,
                  "use_dynamic_shifting": True, "shift": 3.0}


def full_size_transformer() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    return empty(lambda: FluxTransformer2DModel(**FLUX_TRANSFORMER))


def full_size_components(cfg: ModelConfig) -> dict:
    """The VAE, CLIP-L and T5-XXL on meta, with the offline CLIP and T5 tokenizers."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel

    from paco_ds.models.tiny import clip_tokenizer, t5_tokenizer

    return {"vae": empty(lambda: AutoencoderKL(**FLUX_VAE)),
            "text_encoder": empty(lambda: CLIPTextModel(CLIPTextConfig(**CLIP_L_TEXT))),
            "text_encoder_2": t5_xxl(),
            "tokenizer": clip_tokenizer(), "tokenizer_2": t5_tokenizer(), "scheduler_config": dict(FLUX_SCHEDULER)}


class FluxPolicy(PackedPolicy):
    default_path = "black-forest-labs/FLUX.1-dev"
    attention_dispatch = True  # FluxAttnProcessor dispatches (diffusers' attention_dispatch)
    # PaCo-RL's targets (scripts/train_flux.py in github.com/X-GenGroup/PaCo-RL): attention and MLP
    # of both streams of the double blocks; the names that also exist in single blocks match there.
    lora_targets = DOUBLE_STREAM_ATTENTION + ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
    full_size = FullSize(full_size_transformer, full_size_components)
    transformer_class = "diffusers:FluxTransformer2DModel"
    parts = {"vae": Part("diffusers:AutoencoderKL"), "text_encoder": Part("transformers:CLIPTextModel"),
             "text_encoder_2": Part("transformers:T5EncoderModel"), "tokenizer": Part("transformers:CLIPTokenizer", None),
             "tokenizer_2": Part("transformers:T5TokenizerFast", None)}
    tiny_builder = "paco_ds.models.tiny.flux:tiny_flux_components"

    def __init__(self, transformer: nn.Module, vae: nn.Module, text_encoder: nn.Module, text_encoder_2: nn.Module,
                 tokenizer, tokenizer_2, scheduler_config: dict, device: torch.device, dtype: torch.dtype,
                 max_sequence_length: int = 512):
        self.shift = ShiftConfig.from_scheduler_config(scheduler_config)
        self.max_sequence_length = max_sequence_length
        self.use_vae(vae)  # 2x2 patches of its latents
        # the VAE and text encoders held in the model dtype (fp32 on a CPU)
        self.take(device, dtype, transformer=transformer, vae=vae, text_encoder=text_encoder,
                  text_encoder_2=text_encoder_2, tokenizer=tokenizer, tokenizer_2=tokenizer_2)

    # ------------------------------------------------------------------ text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], condition=None) -> TextEmbeds:
        clip_ids = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                                  truncation=True, return_tensors="pt").input_ids
        pooled = self.text_encoder(clip_ids.to(self.device), output_hidden_states=False).pooler_output
        t5_ids = self.tokenizer_2(prompts, padding="max_length", max_length=self.max_sequence_length,
                                  truncation=True, return_tensors="pt").input_ids
        embeds = self.text_encoder_2(t5_ids.to(self.device), output_hidden_states=False)[0]
        return TextEmbeds(prompt_embeds=embeds.to(self.dtype), pooled=pooled.to(self.dtype))

    # ------------------------------------------------------------------ latents
    def image_ids(self, height: int, width: int) -> torch.Tensor:
        h, w = self.latent_hw(height, width)
        ids = torch.zeros(h // 2, w // 2, 3)
        ids[..., 1] += torch.arange(h // 2)[:, None]
        ids[..., 2] += torch.arange(w // 2)[None, :]
        return ids.reshape(-1, 3).to(self.device, self.dtype)

    # ------------------------------------------------------------------ transformer / VAE
    def velocity(self, module: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, embeds: TextEmbeds,
                 height: int, width: int, guidance: float, condition=None) -> torch.Tensor:
        return self._forward(module, latents, self.image_ids(height, width), sigma, embeds, guidance)

    def _forward(self, module: nn.Module, hidden: torch.Tensor, img_ids: torch.Tensor, sigma: torch.Tensor,
                 embeds: TextEmbeds, guidance: float) -> torch.Tensor:
        """One transformer call on packed image tokens `hidden` [B, L, C] with their ids [L, 3]."""
        b = hidden.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(b)
        txt_ids = torch.zeros(embeds.prompt_embeds.shape[1], 3, device=self.device, dtype=self.dtype)
        guidance_t = torch.full((b,), guidance, device=self.device, dtype=torch.float32)
        return module(hidden_states=hidden.to(self.dtype), timestep=sigma.to(self.dtype),
                      guidance=guidance_t, pooled_projections=embeds.pooled.to(self.device, self.dtype),
                      encoder_hidden_states=embeds.prompt_embeds.to(self.device, self.dtype), txt_ids=txt_ids,
                      img_ids=img_ids, return_dict=False)[0]
