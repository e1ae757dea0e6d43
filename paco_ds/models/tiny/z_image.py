"""Tiny random-weight Z-Image parts, built offline from a seed (no hub access).

The real classes at toy sizes: `ZImageTransformer2DModel` (the single-stream DiT: noise and context
refiners, then the joint blocks; 2x2 patches, Z-Image's 3-axis rope with its real table lengths),
an `AutoencoderKL` with the real 8x downsampling and FLUX's latent scaling and shift (Z-Image ships
FLUX.1's autoencoder), and a two-layer `Qwen3Model` as the prompt encoder (the real one is
Qwen3-4B, whose second-to-last hidden states the transformer reads), with the package's byte-level
Qwen tokenizer carrying Qwen3's chat template
(paco_ds/models/tiny/configs/qwen3-chat-template.jinja). The scheduler
config is Z-Image-Turbo's own, so the tiny policy's sigma schedule is the real one.
"""
from __future__ import annotations

import copy

from paco_ds.recipe.schema import TinyModelConfig
from paco_ds.models.tiny import CONFIG_DIR, qwen_tokenizer, seeded

# Tongyi-MAI/Z-Image-Turbo scheduler/scheduler_config.json: a fixed shift of 3, no resolution shift.
Z_IMAGE_TURBO_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 3.0}
# Z-Image-Turbo's vae/config.json values for the latents (FLUX.1's autoencoder).
FLUX_LATENT_SCALING, FLUX_LATENT_SHIFT = 0.3611, 0.1159
# transformer/config.json axes_lens: rope table lengths per axis (caption + image positions on the
# first axis, so a 512-token prompt fits; height and width in 2x2 patches).
Z_IMAGE_AXES_LENS = (1536, 512, 512)


def z_image_tokenizer():
    """The byte-level Qwen tokenizer with Qwen3's chat template (a copy: the shared one stays as it is)."""
    tok = copy.deepcopy(qwen_tokenizer())
    tok.chat_template = (CONFIG_DIR / "qwen3-chat-template.jinja").read_text()
    return tok


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Frame, height and width rope dimensions in Z-Image's proportions (32, 48, 48 of 128), each even."""
    hw = (3 * head_dim // 8) // 2 * 2
    return head_dim - 2 * hw, hw, hw


def tiny_z_image_components(spec: TinyModelConfig | None = None, seed: int = 0) -> dict:
    """transformer, vae, text_encoder (Qwen3), tokenizer, scheduler_config."""
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    spec = spec or TinyModelConfig()
    tok = z_image_tokenizer()
    head, heads, z = spec.attention_head_dim, spec.num_attention_heads, spec.latent_channels
    text = Qwen3Config(vocab_size=len(tok), hidden_size=spec.text_dim, intermediate_size=2 * spec.text_dim,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                       bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    with seeded(seed):
        # Z-Image has single-stream blocks only: the spec's double and single blocks are all joint
        # blocks here, so the tiny model is as deep as the tiny FLUX; one refiner block of each kind.
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=z, dim=heads * head,
            n_layers=spec.num_layers + spec.num_single_layers, n_refiner_layers=1, n_heads=heads, n_kv_heads=heads,
            cap_feat_dim=spec.text_dim, axes_dims=list(rope_axes(head)), axes_lens=list(Z_IMAGE_AXES_LENS))
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=z, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False,
            scaling_factor=FLUX_LATENT_SCALING, shift_factor=FLUX_LATENT_SHIFT)
        text_encoder = Qwen3Model(text)
    return {"transformer": transformer, "vae": vae.eval(), "text_encoder": text_encoder.eval(), "tokenizer": tok,
            "scheduler_config": dict(Z_IMAGE_TURBO_SCHEDULER_CONFIG)}


def tiny_z_image_pipeline(spec: TinyModelConfig | None = None, seed: int = 0, parts: dict | None = None):
    """A diffusers `ZImagePipeline` assembled from the tiny parts (or the given ones)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    parts = dict(parts or tiny_z_image_components(spec, seed))
    scheduler = FlowMatchEulerDiscreteScheduler(**parts.pop("scheduler_config"))
    return ZImagePipeline(scheduler=scheduler, **parts)
