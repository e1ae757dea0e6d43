"""Tiny random-weight Stable Diffusion 3.5 parts, built from configs (no hub access).

The real classes at toy sizes: SD3Transformer2DModel (2 joint blocks, the first with SD3.5-M's
second image attention, RMS query/key norm), two CLIPTextModelWithProjection of different widths
(CLIP-L and CLIP-G, two layers each so the penultimate hidden states are a real layer's), a T5
encoder wider than both CLIPs together (their features are zero-padded to its width), the offline
tokenizers of this package and SD3.5's scheduler config. The autoencoder is the tiny 8x one the
FLUX parts use (a random AutoencoderKL's images hardly depend on the latents; see
`tiny_autoencoder`).
"""
from __future__ import annotations

import json
from pathlib import Path

from paco_ds.recipe.schema import TinyModelConfig
from paco_ds.models.tiny import clip_tokenizer, seeded, t5_tokenizer, tiny_autoencoder

# stabilityai/stable-diffusion-3.5-medium, scheduler/scheduler_config.json
SD3_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0}


def tiny_sd3_components(spec: TinyModelConfig | None = None, seed: int = 0) -> dict:
    """transformer, vae, text_encoder (CLIP-L), text_encoder_2 (CLIP-G), text_encoder_3 (T5),
    tokenizer .. tokenizer_3, scheduler_config: the keyword arguments of SD3Policy (and, with a
    scheduler, of StableDiffusion3Pipeline)."""
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    spec = spec or TinyModelConfig()
    # One tokenizer per encoder, as SD3.5 ships them (each call returns its own copy).
    tok, tok2, tok3 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()
    d = spec.text_dim
    width_l, width_g, width_t5 = d // 2, d, 2 * d  # CLIP-L < CLIP-G, T5 wider than both together

    def clip(width: int):
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tok), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=77, projection_dim=width, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))

    with seeded(seed):
        transformer = SD3Transformer2DModel(
            sample_size=32, patch_size=2, in_channels=spec.latent_channels, num_layers=2,
            attention_head_dim=spec.attention_head_dim, num_attention_heads=spec.num_attention_heads,
            joint_attention_dim=width_t5, caption_projection_dim=spec.attention_head_dim * spec.num_attention_heads,
            pooled_projection_dim=width_l + width_g, out_channels=spec.latent_channels, pos_embed_max_size=32,
            dual_attention_layers=(0,), qk_norm="rms_norm")
        vae = tiny_autoencoder(spec)
        text_encoder, text_encoder_2 = clip(width_l), clip(width_g)
        text_encoder_3 = T5EncoderModel(T5Config(
            vocab_size=len(tok3), d_model=width_t5, d_kv=width_t5 // 2, d_ff=2 * width_t5, num_layers=1, num_heads=2,
            pad_token_id=tok3.pad_token_id, eos_token_id=tok3.eos_token_id, decoder_start_token_id=0))
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "text_encoder_2": text_encoder_2,
            "text_encoder_3": text_encoder_3, "tokenizer": tok, "tokenizer_2": tok2, "tokenizer_3": tok3,
            "scheduler_config": dict(SD3_SCHEDULER_CONFIG)}


def save_sd3_folder(path: str | Path, spec: TinyModelConfig | None = None, seed: int = 0,
                    max_shard_size: str | None = None) -> Path:
    """Write the tiny parts as a model folder in diffusers' layout (what SD3Policy.load reads for a
    real checkpoint: transformer, vae, text_encoder .. text_encoder_3, tokenizer .. tokenizer_3,
    scheduler). `max_shard_size` shards the transformer's safetensors with an index file."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    path = Path(path)
    parts = tiny_sd3_components(spec, seed)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        shard = {"max_shard_size": max_shard_size} if max_shard_size and name == "transformer" else {}
        parts[name].save_pretrained(path / name, **shard)
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        parts[name].save_pretrained(path / name)
    FlowMatchEulerDiscreteScheduler(**parts["scheduler_config"]).save_config(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    return path
