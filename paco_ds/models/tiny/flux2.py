"""Tiny random-weight FLUX.2 parts, built offline from a seed (no hub access).

The real classes at toy sizes: `Flux2Transformer2DModel` (double- and single-stream blocks, the
4-axis rope, with FLUX.2-dev's guidance embedding or without it as klein has), an
`AutoencoderKLFlux2` with the real 8x downsampling and its batch-norm statistics of the 2x2-patched
latents (seeded, not the identity, so the normalisation matters), and the prompt encoders:

- FLUX.2-dev: a `Mistral3ForConditionalGeneration` (a one-layer Pixtral vision tower that a
  text-only prompt never reaches, and a 31-layer Mistral language model, so the hidden states the
  pipeline reads, layers 10, 20 and 30 of 40, exist and are not the last) with a byte-level
  tokenizer carrying the part of Mistral-Small-3.1's chat template the pipeline reaches
  (paco_ds/models/tiny/configs/mistral3-chat-template.jinja);
- FLUX.2 [klein]: a 28-layer `Qwen3ForCausalLM` (layers 9, 18, 27 of 36) with the byte-level Qwen
  tokenizer and Qwen3's chat template (z_image.py's).

The scheduler config is FLUX.2's (exponential dynamic shift; the pipelines pass their own mu).
"""
from __future__ import annotations

import copy

import torch

from paco_ds.recipe.schema import TinyModelConfig
from paco_ds.models.tiny import CONFIG_DIR, _bytes_to_unicode, seeded

# black-forest-labs/FLUX.2-dev (and klein) scheduler/scheduler_config.json: dynamic exponential shift.
FLUX2_SCHEDULER_CONFIG = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5,
                          "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
                          "use_dynamic_shifting": True, "time_shift_type": "exponential"}
MISTRAL_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                          "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
MISTRAL_LAYERS, QWEN3_LAYERS = 31, 28  # the text encoders' depths here: past the last layer each pipeline reads


# The tiny text encoders' position tables (Mistral3 for dev, Qwen3 for klein): model.max_sequence_length
# beyond it is refused by --dry-run for the tiny twins (Flux2Policy.tiny_max_sequence_length_limit).
TINY_TEXT_POSITIONS = 4096

def mistral_tokenizer():
    """A byte-level BPE tokenizer (Mistral's Tekken is one too) with Mistral's special tokens and the
    text part of Mistral-Small-3.1's chat template; a fresh copy each call."""
    from transformers import Qwen2Tokenizer

    vocab = {t: i for i, t in enumerate(MISTRAL_SPECIAL_TOKENS)}
    for t in _bytes_to_unicode():
        vocab[t] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                         pad_token="<pad>")
    tok.add_special_tokens({"additional_special_tokens": MISTRAL_SPECIAL_TOKENS[4:]})
    tok.chat_template = (CONFIG_DIR / "mistral3-chat-template.jinja").read_text()
    return tok


def klein_tokenizer():
    """The byte-level Qwen tokenizer with Qwen3's chat template (what Z-Image's twin reads too)."""
    from paco_ds.models.tiny.z_image import z_image_tokenizer

    return z_image_tokenizer()


def _rope_axes(head_dim: int) -> tuple[int, int, int, int]:
    """Four equal even rope axes (T, H, W, L), as FLUX.2's 32 x 4 of 128."""
    q = head_dim // 4 // 2 * 2
    return (head_dim - 3 * q, q, q, q)


def _transformer_and_vae(spec: TinyModelConfig, text_dim: int, guidance_embeds: bool):
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    z = spec.latent_channels
    head = spec.attention_head_dim
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * z, num_layers=spec.num_layers, num_single_layers=spec.num_single_layers,
        attention_head_dim=head, num_attention_heads=spec.num_attention_heads, joint_attention_dim=3 * text_dim,
        timestep_guidance_channels=32, axes_dims_rope=_rope_axes(head), guidance_embeds=guidance_embeds)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=z,
                             norm_num_groups=4, sample_size=64)
    with torch.no_grad():  # the checkpoint's latent statistics, here seeded (not 0 and 1)
        vae.bn.running_mean.normal_(0.0, 0.2)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return transformer, vae.eval()


def tiny_flux2_components(spec: TinyModelConfig | None = None, seed: int = 0) -> dict:
    """FLUX.2-dev's parts: transformer (with guidance embedding), vae, text_encoder (Mistral3),
    tokenizer, scheduler_config."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    spec = spec or TinyModelConfig()
    tok = mistral_tokenizer()
    d = spec.text_dim
    config = Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": len(tok), "hidden_size": d, "intermediate_size": 2 * d,
                     "num_hidden_layers": MISTRAL_LAYERS, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "head_dim": 16, "max_position_embeddings": TINY_TEXT_POSITIONS, "bos_token_id": tok.bos_token_id,
                     "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 56, "patch_size": 14},
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), tie_word_embeddings=False)
    with seeded(seed):
        transformer, vae = _transformer_and_vae(spec, d, guidance_embeds=True)
        text_encoder = Mistral3ForConditionalGeneration(config)
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder.eval(), "tokenizer": tok,
            "scheduler_config": dict(FLUX2_SCHEDULER_CONFIG)}


def tiny_flux2_klein_components(spec: TinyModelConfig | None = None, seed: int = 0, is_distilled: bool = False) -> dict:
    """FLUX.2 [klein]'s parts: transformer (no guidance embedding), vae, text_encoder (Qwen3),
    tokenizer, scheduler_config, is_distilled (the base checkpoint's False: guidance is CFG)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    spec = spec or TinyModelConfig()
    tok = klein_tokenizer()
    d = spec.text_dim
    config = Qwen3Config(vocab_size=len(tok), hidden_size=d, intermediate_size=2 * d, num_hidden_layers=QWEN3_LAYERS,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=TINY_TEXT_POSITIONS,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
                         bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    with seeded(seed):
        transformer, vae = _transformer_and_vae(spec, d, guidance_embeds=False)
        text_encoder = Qwen3ForCausalLM(config)
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder.eval(), "tokenizer": tok,
            "scheduler_config": dict(FLUX2_SCHEDULER_CONFIG), "is_distilled": is_distilled}


def tiny_flux2_pipeline(spec: TinyModelConfig | None = None, seed: int = 0, parts: dict | None = None):
    """A diffusers `Flux2Pipeline` assembled from the tiny parts (or the given ones)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline

    parts = dict(parts or tiny_flux2_components(spec, seed))
    scheduler = FlowMatchEulerDiscreteScheduler(**parts.pop("scheduler_config"))
    return Flux2Pipeline(scheduler=scheduler, **parts)


def tiny_flux2_klein_pipeline(spec: TinyModelConfig | None = None, seed: int = 0, parts: dict | None = None):
    """A diffusers `Flux2KleinPipeline` assembled from the tiny klein parts (or the given ones)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline

    parts = dict(parts or tiny_flux2_klein_components(spec, seed))
    scheduler = FlowMatchEulerDiscreteScheduler(**parts.pop("scheduler_config"))
    return Flux2KleinPipeline(scheduler=scheduler, **parts)
