"""Z-Image as a `Policy`: Tongyi-MAI's 6B single-stream DiT with Qwen3-4B as the prompt encoder.

The components are driven directly, as diffusers' `ZImagePipeline` (pipeline_z_image.py) drives them:

- prompts: each prompt as one user turn of the tokenizer's own chat template (Qwen3's), with the
  assistant's generation prompt and `enable_thinking=True`; tokenized padded and cut to
  `model.max_sequence_length` tokens (the template included; 512 in the pipeline); the
  second-to-last hidden states of Qwen3 at the valid tokens. The transformer reads each prompt's
  tokens as a list of its own length; here they are kept right-padded with their mask, encoded once
  per sample at rollout and reused by every training forward.
- latents: 16-channel latents of FLUX.1's 8x autoencoder, scaled and shifted as FLUX's. The
  transformer patchifies [C, 1, h, w] latents itself (2x2 patches); here they are kept packed as 2x2
  patches [B, L, 4C] like every other family's, so the trainer, the SDE step and the kernels see one
  layout, and unpacked for each forward.
- time: the transformer reads t = (1000 - 1000 sigma) / 1000, i.e. 1 - sigma (0 is noise, 1 clean),
  and predicts the negative of the flow-matching velocity: the velocity is minus its output.
- schedule: FlowMatchEulerDiscreteScheduler with the checkpoint's config: linspace(1, 1/N, N)
  shifted by s -> shift s / (1 + (shift - 1) s) (Z-Image-Turbo: shift 3, no resolution shift; a
  dynamic shift, if a checkpoint sets one, is FLUX's exponential one by mu of the image's tokens),
  then 0 (`Policy.sigmas`).
- guidance: `sample.guidance_scale` is the pipeline's `guidance_scale`: 0 (Z-Image-Turbo, distilled
  without guidance) is one transformer forward per step; above 0 (the undistilled Z-Image) the
  negative prompt is the empty string, encoded once, the forward runs on [cond | uncond] in one
  call and v = v_c + g (v_c - v_u) (the pipeline's defaults: no normalisation, no truncation).
  With gradients on, v_u is detached, as Flow-GRPO's `compute_log_prob` does for SD3.
"""
from __future__ import annotations

import torch
from torch import nn

from paco_ds.recipe.schema import ModelConfig
from paco_ds.models.base import PackedPolicy, Part, TextEmbeds
from paco_ds.models.flux import FLUX_VAE
from paco_ds.models.full_size import FullSize, empty
from paco_ds.models.schedule import ShiftConfig

SEQ_MULTI_OF = 32  # the transformer pads each prompt's tokens to a multiple of this (transformer_z_image.py)

# The full-size model (models/full_size.py), from Tongyi-MAI/Z-Image-Turbo's config files: the
# transformer (the undistilled Tongyi-MAI/Z-Image has the same), FLUX.1's autoencoder (FLUX_VAE, the
# same config) and Qwen3-4B's text model (the checkpoint's text_encoder, loaded as Qwen3Model).
Z_IMAGE_TRANSFORMER = {
    "all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 3840, "n_layers": 30,
    "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "norm_eps": 1e-5, "qk_norm": True, "cap_feat_dim": 2560,
    "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [32, 48, 48], "axes_lens": [1536, 512, 512],
}
QWEN3_4B = {
    "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "tie_word_embeddings": True,
}
Z_IMAGE_TURBO_SCHEDULER = {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 3.0}


def full_size_transformer() -> nn.Module:
    from diffusers import ZImageTransformer2DModel

    return empty(lambda: ZImageTransformer2DModel(**Z_IMAGE_TRANSFORMER))


def full_size_components(cfg: ModelConfig) -> dict:
    """FLUX.1's autoencoder and Qwen3-4B on meta, with the offline byte-level tokenizer carrying
    Qwen3's chat template (whose special token ids the config takes; the vocabulary keeps its size)."""
    from diffusers import AutoencoderKL
    from transformers import Qwen3Config, Qwen3Model

    from paco_ds.models.tiny.z_image import z_image_tokenizer

    tok = z_image_tokenizer()
    config = Qwen3Config(**QWEN3_4B, bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return {"vae": empty(lambda: AutoencoderKL(**FLUX_VAE)), "text_encoder": empty(lambda: Qwen3Model(config)),
            "tokenizer": tok, "scheduler_config": dict(Z_IMAGE_TURBO_SCHEDULER)}


class ZImagePolicy(PackedPolicy):
    display_name = "Z-Image"
    # The distilled model diffusers' Z-Image documentation names (8 steps, no guidance); the
    # undistilled Tongyi-MAI/Z-Image loads with the same code (model.path, with guidance_scale > 0).
    default_path = "Tongyi-MAI/Z-Image-Turbo"
    attention_dispatch = True  # ZSingleStreamAttnProcessor calls diffusers' dispatch_attention_fn
    text_attention_mask = True  # the transformer pads each sample's prompt and image tokens, with a mask
    # what the released rope table allows (checked again against a loaded checkpoint's config below)
    max_sequence_length_limit = (Z_IMAGE_TRANSFORMER["axes_lens"][0] - 2) // SEQ_MULTI_OF * SEQ_MULTI_OF
    # Attention and MLP of every block (refiners and joint blocks) in Z-Image's own names: one stream,
    # so no add_*/ff_context names; the MLP is a SwiGLU (w1, w3 in, w2 out).
    lora_targets = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    full_size = FullSize(full_size_transformer, full_size_components)
    transformer_class = "diffusers:ZImageTransformer2DModel"
    parts = {"vae": Part("diffusers:AutoencoderKL"), "text_encoder": Part("transformers:Qwen3Model"),
             "tokenizer": Part("transformers:Qwen2Tokenizer", None)}
    tiny_builder = "paco_ds.models.tiny.z_image:tiny_z_image_components"
    tiny_prompt_cap = None  # the tiny Qwen3 reads long prompts too (no 64-token cap as for the tiny T5s)

    def __init__(self, transformer: nn.Module, vae: nn.Module, text_encoder: nn.Module, tokenizer,
                 scheduler_config: dict, device: torch.device, dtype: torch.dtype, max_sequence_length: int = 512):
        self.shift = ShiftConfig.of_scheduler(scheduler_config, self.display_name)
        # Caption positions run along the first rope axis, padded to SEQ_MULTI_OF, and the image sits
        # after them: a longer prompt would index past the rope table.
        first_axis = transformer.config.axes_lens[0]
        if -(-max_sequence_length // SEQ_MULTI_OF) * SEQ_MULTI_OF + 1 >= first_axis:
            raise ValueError(f"model.max_sequence_length is at most {(first_axis - 2) // SEQ_MULTI_OF * SEQ_MULTI_OF} "
                             f"for {self.display_name} (its rope table has {first_axis} positions), got "
                             f"{max_sequence_length}")
        self.num_train_timesteps = int(scheduler_config.get("num_train_timesteps", 1000))
        self.max_sequence_length = max_sequence_length
        self.use_vae(vae)  # 2x2 patches of its latents
        self.take(device, dtype, transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)
        # The negative prompt of guidance, encoded once (kept on the CPU; a device copy is made once).
        self.negative = self.encode_prompts([""]).to("cpu")

    # ------------------------------------------------------------------ prompts
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], condition=None) -> TextEmbeds:
        """One Qwen3 forward for the batch, as ZImagePipeline._encode_prompt; the valid tokens'
        second-to-last hidden states, right-padded to the longest prompt, with their mask."""
        if condition is not None:
            raise ValueError(f"{self.display_name} generates from text alone: it takes no condition images")
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                    add_generation_prompt=True, enable_thinking=True) for p in prompts]
        inputs = self.tokenizer(texts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                                return_tensors="pt")
        mask = inputs.attention_mask.to(self.device).bool()
        hidden = self.text_encoder(input_ids=inputs.input_ids.to(self.device), attention_mask=mask,
                                   output_hidden_states=True).hidden_states[-2]
        rows = [h[m] for h, m in zip(hidden, mask)]
        width = max(r.shape[0] for r in rows)
        embeds = torch.stack([nn.functional.pad(r, (0, 0, 0, width - r.shape[0])) for r in rows])
        valid = torch.stack([torch.arange(width, device=self.device) < r.shape[0] for r in rows]).long()
        return TextEmbeds(prompt_embeds=embeds.to(self.dtype), mask=valid)

    # ------------------------------------------------------------------ transformer / VAE
    def velocity(self, module: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, embeds: TextEmbeds,
                 height: int, width: int, guidance: float, condition=None) -> torch.Tensor:
        """The (guided) velocity, packed like `latents`: one transformer call on the batch's latents
        and prompts as lists, on [cond | uncond] when guidance > 0."""
        if condition is not None:
            raise ValueError(f"{self.display_name} generates from text alone: it takes no condition images")
        b = latents.shape[0]
        x = list(self.unpack(latents.to(self.device, self.dtype), height, width).unsqueeze(2).unbind(0))
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(b)
        n = self.num_train_timesteps  # the scheduler's timestep 1000 sigma, turned as the pipeline turns it
        t = (n - sigma * n) / n
        text = embeds.prompt_embeds.to(self.device, self.dtype)
        caps = [e[m] for e, m in zip(text, embeds.mask.to(self.device).bool())]
        cfg = guidance > 0
        if cfg:
            x, t = x + x, torch.cat([t, t])
            caps = caps + [self.negative_here().prompt_embeds[0]] * b
        out = torch.stack(module(x, t, caps, return_dict=False)[0]).squeeze(2).float()
        if cfg:
            cond, uncond = out.chunk(2)
            uncond = uncond.detach()  # compute_log_prob's stop-gradient (no-op while sampling)
            out = cond + guidance * (cond - uncond)
        return self.pack(-out).to(self.dtype)
