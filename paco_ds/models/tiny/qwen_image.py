"""Tiny random-weight Qwen-Image and Qwen-Image-Edit parts, built offline from a seed (no hub access).

The real architectures at toy sizes: `QwenImageTransformer2DModel` (patch 2, as the real one),
`AutoencoderKLQwenImage` with the real 8x downsampling (three spatial downsamples, causal 3D
convolutions on one frame), and the tiny Qwen2.5-VL of qwen_vl.py with its processor
(patches 14, 2x2 merge: 28-pixel units) as the prompt-and-image encoder. The scheduler config is
Qwen-Image's own, so the tiny policy's sigma schedule at a given image size is the real one.
Qwen-Image (text-to-image) uses the same parts, its VL encoder reading text only through the
processor's tokenizer, as Qwen-Image's checkpoint ships a tokenizer and no processor.
Qwen-Image-Edit-2509/2511 (multi-image editing) uses them too, its transformer with 2511's
`zero_cond_t` (the input images' tokens modulated at t = 0).
"""
from __future__ import annotations

from paco_ds.recipe.schema import TinyModelConfig
from paco_ds.models.tiny import seeded
from paco_ds.models.tiny.qwen_vl import tiny_qwen2_5_vl

# Qwen/Qwen-Image(-Edit) scheduler/scheduler_config.json: exponential dynamic shift between 0.5
# (256 tokens) and 0.9 (8192 tokens), and the schedule stretched so its last non-zero sigma is 0.02.
QWEN_IMAGE_SCHEDULER_CONFIG = {
    "base_image_seq_len": 256, "max_image_seq_len": 8192, "base_shift": 0.5, "max_shift": 0.9,
    "use_dynamic_shifting": True, "shift": 1.0, "shift_terminal": 0.02, "time_shift_type": "exponential",
    "num_train_timesteps": 1000, "invert_sigmas": False, "stochastic_sampling": False,
    "use_karras_sigmas": False, "use_exponential_sigmas": False, "use_beta_sigmas": False,
}

# Large enough that the VL processor never shrinks a tiny run's reference (it snaps to 28 only).
TINY_VL_MAX_PIXELS = 512 * 512


def tiny_qwen_edit_components(spec: TinyModelConfig | None = None, seed: int = 0, zero_cond_t: bool = False) -> dict:
    """transformer, vae, text_encoder (Qwen2.5-VL), processor, scheduler_config. `zero_cond_t`:
    Qwen-Image-Edit-2511's transformer option (no weights of its own: same seed, same weights)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    spec = spec or TinyModelConfig()
    text_encoder, processor = tiny_qwen2_5_vl(seed, max_pixels=TINY_VL_MAX_PIXELS)
    text_dim = text_encoder.config.text_config.hidden_size  # the transformer reads the VL's hidden states
    head = spec.attention_head_dim
    rope = (head - 2 * (head // 4), head // 4, head // 4)  # frame, height, width; sums to the head dim
    z = spec.latent_channels
    # Qwen-Image has double-stream blocks only: the spec's single-stream blocks become double ones,
    # so the tiny model is as deep as the tiny FLUX.
    with seeded(seed):
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=4 * z, out_channels=z, num_layers=spec.num_layers + spec.num_single_layers,
            attention_head_dim=head, num_attention_heads=spec.num_attention_heads, joint_attention_dim=text_dim,
            guidance_embeds=False, axes_dims_rope=rope, zero_cond_t=zero_cond_t)
        vae = AutoencoderKLQwenImage(
            base_dim=8, z_dim=z, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
            latents_mean=[0.0] * z, latents_std=[1.0] * z)
    return {"transformer": transformer, "vae": vae.eval(), "text_encoder": text_encoder.eval(),
            "processor": processor, "scheduler_config": dict(QWEN_IMAGE_SCHEDULER_CONFIG)}


def tiny_qwen_edit_pipeline(spec: TinyModelConfig | None = None, seed: int = 0, parts: dict | None = None):
    """A diffusers `QwenImageEditPipeline` assembled from the tiny parts (or the given ones)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline

    parts = dict(parts or tiny_qwen_edit_components(spec, seed))
    scheduler = FlowMatchEulerDiscreteScheduler(**parts.pop("scheduler_config"))
    processor = parts.pop("processor")
    return QwenImageEditPipeline(scheduler=scheduler, tokenizer=processor.tokenizer, processor=processor, **parts)


def tiny_qwen_edit_plus_pipeline(spec: TinyModelConfig | None = None, seed: int = 0, parts: dict | None = None):
    """A diffusers `QwenImageEditPlusPipeline` (Qwen-Image-Edit-2509/2511) from the tiny parts (or
    the given ones): the 2511 transformer (`zero_cond_t`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline

    parts = dict(parts or tiny_qwen_edit_components(spec, seed, zero_cond_t=True))
    scheduler = FlowMatchEulerDiscreteScheduler(**parts.pop("scheduler_config"))
    processor = parts.pop("processor")
    return QwenImageEditPlusPipeline(scheduler=scheduler, tokenizer=processor.tokenizer, processor=processor, **parts)


def tiny_qwen_image_components(spec: TinyModelConfig | None = None, seed: int = 0) -> dict:
    """Qwen-Image's tiny parts: the edit parts with the processor's tokenizer in its place."""
    parts = tiny_qwen_edit_components(spec, seed)
    parts["tokenizer"] = parts.pop("processor").tokenizer
    return parts


def tiny_qwen_image_pipeline(spec: TinyModelConfig | None = None, seed: int = 0, parts: dict | None = None):
    """A diffusers `QwenImagePipeline` assembled from the tiny parts (or the given ones)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    parts = dict(parts or tiny_qwen_image_components(spec, seed))
    scheduler = FlowMatchEulerDiscreteScheduler(**parts.pop("scheduler_config"))
    return QwenImagePipeline(scheduler=scheduler, **parts)
