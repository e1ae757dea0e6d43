"""Tiny random-weight FLUX.1 parts, built from configs (no hub access).

`tiny_flux_components` is the toy-size FLUX.1 (FluxTransformer2DModel, the tiny 8x autoencoder,
one-layer CLIP and T5 text encoders, the offline tokenizers, FLUX.1's scheduler config) that
FluxPolicy and KontextPolicy load for `model.tiny`. `save_flux_folder` writes a random-weight FLUX
folder in diffusers' layout (by default the reduced-depth, full-width transformer) for the
benchmarks of loading and of the GRPO epoch.
"""
from __future__ import annotations

from pathlib import Path

import torch

from paco_ds.recipe.schema import TinyModelConfig
from paco_ds.models.tiny import clip_tokenizer, seeded, t5_tokenizer, tiny_autoencoder

# FLUX.1's scheduler constants, so the tiny model's sigma schedule at a given image size is the
# real one (the tiny autoencoder also downsamples 8x and the transformer packs 2x2 patches).
FLUX_SCHEDULER_CONFIG = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5,
                         "max_shift": 1.15, "use_dynamic_shifting": True, "shift": 3.0}


def tiny_flux_components(spec: TinyModelConfig | None = None, seed: int = 0) -> dict:
    """transformer, vae, text_encoder (CLIP), text_encoder_2 (T5), tokenizers, scheduler config."""
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    spec = spec or TinyModelConfig()
    tok, tok2 = clip_tokenizer(), t5_tokenizer()
    d = spec.text_dim
    head = spec.attention_head_dim
    rope = (head // 4, head // 4, head - 2 * (head // 4))
    with seeded(seed):
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=4 * spec.latent_channels, num_layers=spec.num_layers,
            num_single_layers=spec.num_single_layers, attention_head_dim=head,
            num_attention_heads=spec.num_attention_heads, joint_attention_dim=d, pooled_projection_dim=d,
            guidance_embeds=True, axes_dims_rope=rope)
        vae = tiny_autoencoder(spec)
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tok), hidden_size=d, intermediate_size=2 * d, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=77, projection_dim=d, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(tok2), d_model=d, d_kv=d // 2, d_ff=2 * d, num_layers=1, num_heads=2,
            pad_token_id=tok2.pad_token_id, eos_token_id=tok2.eos_token_id, decoder_start_token_id=0))
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "text_encoder_2": text_encoder_2,
            "tokenizer": tok, "tokenizer_2": tok2, "scheduler_config": dict(FLUX_SCHEDULER_CONFIG)}


# The benchmarks' FLUX (loading, the GRPO epoch): FLUX.1-dev's transformer at full width (3072 =
# 24 heads x 128, T5 width 4096, CLIP pooled 768, 64 packed latent channels) with 1 double + 2
# single blocks instead of 19 + 38: about 0.67B parameters, so loading and per-token costs are
# the real ones per block on a CPU machine.
REDUCED_FLUX_TRANSFORMER = {
    "patch_size": 1, "in_channels": 64, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}


def save_flux_folder(path: str | Path, transformer: dict | None = None, seed: int = 0,
                     dtype: torch.dtype = torch.bfloat16, max_shard_size: str | None = None) -> Path:
    """Write a random-weight FLUX folder in diffusers' layout, which `FluxPolicy.load` reads like
    FLUX.1-dev: the given transformer config (default: the reduced full-width one), a small
    AutoencoderKL with in_channels / 4 latent channels, CLIP (hidden = pooled_projection_dim) and
    T5 (d_model = joint_attention_dim) text encoders of one thin layer each, the offline tokenizers
    and FLUX's scheduler config. `max_shard_size` (e.g. "200KB") shards the transformer's
    safetensors with an index file, as FLUX.1-dev's are. Written once: a complete folder written
    with the same arguments is reused; one written with others is an error (delete it first)."""
    import json

    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    path = Path(path)
    tconf = dict(transformer or REDUCED_FLUX_TRANSFORMER)
    stamp = json.dumps({"transformer": tconf, "seed": seed, "dtype": str(dtype), "max_shard_size": max_shard_size},
                       sort_keys=True)
    done = path / ".complete"
    if done.is_file():
        if done.read_text().strip() != stamp:
            raise ValueError(f"{path} holds a FLUX folder written with other arguments ({done.read_text().strip()})")
        return path
    tok, tok2 = clip_tokenizer(), t5_tokenizer()
    parts = {}
    with seeded(seed):
        parts["transformer"] = FluxTransformer2DModel(**tconf)
        parts["vae"] = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=tconf["in_channels"] // 4,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(32, 32, 32, 32), layers_per_block=1, norm_num_groups=32,
            scaling_factor=0.3611, shift_factor=0.1159)
        parts["text_encoder"] = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tok), hidden_size=tconf["pooled_projection_dim"], intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77,
            projection_dim=tconf["pooled_projection_dim"], bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
        parts["text_encoder_2"] = T5EncoderModel(T5Config(
            vocab_size=len(tok2), d_model=tconf["joint_attention_dim"], d_kv=32, d_ff=64, num_layers=1,
            num_heads=2, pad_token_id=tok2.pad_token_id, eos_token_id=tok2.eos_token_id,
            decoder_start_token_id=0))
    for name, module in parts.items():
        # Cast parameter by parameter: ModelMixin.to(dtype) warns about fp32-kept modules.
        for p in module.parameters():
            p.data = p.data.to(dtype)
        shard = {"max_shard_size": max_shard_size} if max_shard_size and name == "transformer" else {}
        module.save_pretrained(path / name, **shard)
        parts[name] = None  # free each part once written (the default transformer is 2.7 GB in fp32)
        del module
    tok.save_pretrained(path / "tokenizer")
    tok2.save_pretrained(path / "tokenizer_2")
    FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER_CONFIG).save_config(path / "scheduler")
    done.write_text(stamp + "\n")
    return path
