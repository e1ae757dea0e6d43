"""The full-size models of the recipes, built from configs written here (nothing is downloaded).

The values are those of the published checkpoints' config files (model_index / config.json of
black-forest-labs/FLUX.1-dev and FLUX.1-Kontext-dev, Qwen/Qwen-Image-Edit,
stabilityai/stable-diffusion-3.5-medium, google T5-XXL v1.1 as FLUX and SD3.5 ship it, openai CLIP ViT-L/14 text tower, Qwen2.5-VL-7B-Instruct, laion CLIP-ViT-H-14 for
PickScore_v1, open_clip's bundled ViT-H-14). Each is built on the meta device (no memory) and
turned into fake CUDA tensors (fake.py); the tokenizers are the offline ones of models/tiny/,
padded to the real lengths, so every tensor on the device path has its real shape.
"""
from __future__ import annotations

import torch
from torch import nn

from paco_ds.gpu_plan.fake import FakeCuda, to_fake_cuda

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
CLIP_L_TEXT = {  # FLUX's text_encoder
    "vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu", "projection_dim": 768,
    "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1,
}
T5_XXL = {  # FLUX's text_encoder_2 (T5 v1.1 XXL encoder)
    "vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "feed_forward_proj": "gated-gelu",
    "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1,
    "decoder_start_token_id": 0,
}
SD35_MEDIUM_TRANSFORMER = {  # stabilityai/stable-diffusion-3.5-medium: MMDiT-X, 2,243,171,520 parameters
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 24,
    "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096, "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048, "pos_embed_max_size": 384, "dual_attention_layers": tuple(range(13)),
    "qk_norm": "rms_norm",
}
SD35_VAE = FLUX_VAE | {"scaling_factor": 1.5305, "shift_factor": 0.0609}  # same autoencoder shape as FLUX's
SD35_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}
CLIP_L_PROJ = CLIP_L_TEXT | {"pad_token_id": 1}  # SD3.5's text_encoder: CLIP-L with its projection (768)
CLIP_G_PROJ = {  # SD3.5's text_encoder_2: OpenCLIP bigG/14's text tower with its projection (1280)
    "vocab_size": 49408, "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
    "num_attention_heads": 20, "max_position_embeddings": 77, "hidden_act": "gelu", "projection_dim": 1280,
    "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1,
}
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
QWEN2_5_VL_7B_TEXT = {
    "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
    "tie_word_embeddings": False,
}
QWEN2_5_VL_7B_VISION = {
    "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584,
    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "hidden_act": "silu",
}
QWEN_VL_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280}
CLIP_H_TEXT = {"vocab_size": 49408, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
               "num_attention_heads": 16, "max_position_embeddings": 77, "hidden_act": "gelu",
               "bos_token_id": 49406, "eos_token_id": 49407, "pad_token_id": 1}
CLIP_H_VISION = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 16,
                 "image_size": 224, "patch_size": 14, "hidden_act": "gelu"}


def _empty(build):
    """Build on the meta device; small buffers (rope tables, position ids) stay real on the host."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return build()


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def flux_transformer() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    return _empty(lambda: FluxTransformer2DModel(**FLUX_TRANSFORMER))


def qwen_image_transformer() -> nn.Module:
    from diffusers import QwenImageTransformer2DModel

    return _empty(lambda: QwenImageTransformer2DModel(**QWEN_IMAGE_TRANSFORMER))


def t5_xxl() -> nn.Module:
    """T5-XXL's encoder with its token embedding once: the checkpoints tie `encoder.embed_tokens`
    to `shared`, which a model built on meta here does not (131,596,288 parameters counted twice);
    one module under both names stays one tensor through `to_fake_cuda`."""
    from transformers import T5Config, T5EncoderModel

    model = _empty(lambda: T5EncoderModel(T5Config(**T5_XXL)))
    model.encoder.embed_tokens = model.shared
    return model


def sd3_transformer() -> nn.Module:
    from diffusers import SD3Transformer2DModel

    return _empty(lambda: SD3Transformer2DModel(**SD35_MEDIUM_TRANSFORMER))


def transformer_for(family: str) -> nn.Module:
    if family == "sd3":
        return sd3_transformer()
    return qwen_image_transformer() if family == "qwen_image_edit" else flux_transformer()


def flux_parts(mode: FakeCuda, dtype: torch.dtype) -> dict:
    """FluxPolicy's other components (VAE, CLIP-L, T5-XXL) on fake CUDA, frozen models tagged."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel

    from paco_ds.models.tiny import clip_tokenizer, t5_tokenizer

    parts = {
        "vae": _empty(lambda: AutoencoderKL(**FLUX_VAE)),
        "text_encoder": _empty(lambda: CLIPTextModel(CLIPTextConfig(**CLIP_L_TEXT))),
        "text_encoder_2": t5_xxl(),
    }
    for name, m in parts.items():
        to_fake_cuda(mode, m, dtype)
        mode.track_module(m, "vae" if name == "vae" else "text encoders")
    tok2 = t5_tokenizer()
    return parts | {"tokenizer": clip_tokenizer(), "tokenizer_2": tok2, "scheduler_config": dict(FLUX_SCHEDULER)}


def sd3_parts(mode: FakeCuda, dtype: torch.dtype) -> dict:
    """SD3Policy's other components: the VAE (fp32, as the policy keeps it), CLIP-L and CLIP-G with
    their projections and T5-XXL, each with its own offline tokenizer (as SD3.5 ships one per encoder)."""
    import copy

    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from paco_ds.models.tiny import clip_tokenizer, t5_tokenizer

    encoders = {
        "text_encoder": _empty(lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_L_PROJ))),
        "text_encoder_2": _empty(lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_G_PROJ))),
        "text_encoder_3": t5_xxl(),
    }
    vae = _empty(lambda: AutoencoderKL(**SD35_VAE))
    to_fake_cuda(mode, vae, torch.float32)
    mode.track_module(vae, "vae")
    for m in encoders.values():
        to_fake_cuda(mode, m, dtype)
        mode.track_module(m, "text encoders")
    toks = {"tokenizer": copy.deepcopy(clip_tokenizer()), "tokenizer_2": copy.deepcopy(clip_tokenizer()),
            "tokenizer_3": copy.deepcopy(t5_tokenizer())}
    return encoders | toks | {"vae": vae, "scheduler_config": dict(SD35_SCHEDULER)}


def qwen_edit_parts(mode: FakeCuda, dtype: torch.dtype) -> dict:
    """QwenEditPolicy's other components: the Qwen-Image VAE and the Qwen2.5-VL-7B prompt encoder
    with a processor of the real image geometry (the offline byte-level tokenizer, whose special
    token ids the model config takes; the vocabulary keeps its real size)."""
    from diffusers import AutoencoderKLQwenImage
    from transformers import (Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, Qwen2VLImageProcessor,
                              Qwen2VLVideoProcessor)

    from paco_ds.models.tiny.qwen_vl import QWEN2_VL_CHAT_TEMPLATE

    tok, config = qwen_vl_config()
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=14, temporal_patch_size=2, merge_size=2, **QWEN_VL_PIXELS),
        video_processor=Qwen2VLVideoProcessor(**QWEN_VL_PIXELS), tokenizer=tok, chat_template=QWEN2_VL_CHAT_TEMPLATE)
    vae = _empty(lambda: AutoencoderKLQwenImage(**QWEN_IMAGE_VAE))
    text_encoder = _empty(lambda: Qwen2_5_VLForConditionalGeneration(config))
    to_fake_cuda(mode, vae, dtype)
    mode.track_module(vae, "vae")
    to_fake_cuda(mode, text_encoder, dtype)
    mode.track_module(text_encoder, "text encoders")
    return {"vae": vae, "text_encoder": text_encoder, "processor": processor,
            "scheduler_config": dict(QWEN_IMAGE_SCHEDULER)}


def qwen_vl_config():
    """The offline byte-level Qwen tokenizer and Qwen2.5-VL-7B's config with that tokenizer's special
    token ids (the vocabulary keeps its real size, so every weight has its real shape)."""
    from transformers import Qwen2_5_VLConfig

    from paco_ds.models.tiny import QWEN_SPECIAL_TOKENS, qwen_tokenizer

    tok = qwen_tokenizer()
    ids = {n: tok.convert_tokens_to_ids(n) for n in QWEN_SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config=dict(QWEN2_5_VL_7B_TEXT, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"]),
        vision_config=QWEN2_5_VL_7B_VISION, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    return tok, config


# ------------------------------------------------------------------------------------ reward models
def open_clip_h() -> tuple[nn.Module, object, object]:
    """open_clip ViT-H-14 (subfig_clipT), from open_clip's bundled config, no weights."""
    import open_clip

    model = _empty(lambda: open_clip.create_model("ViT-H-14", pretrained=None, device="meta"))
    preprocess = open_clip.image_transform(224, is_train=False)
    return model, preprocess, open_clip.get_tokenizer("ViT-H-14")


def pickscore_clip() -> tuple[nn.Module, object]:
    """PickScore_v1's CLIPModel (laion CLIP-ViT-H-14 architecture) and a processor of its geometry."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from paco_ds.models.tiny import clip_tokenizer

    config = CLIPConfig(text_config=CLIP_H_TEXT, vision_config=CLIP_H_VISION, projection_dim=1024)
    model = _empty(lambda: CLIPModel(config))
    image_processor = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                                         image_mean=[0.48145466, 0.4578275, 0.40821073],
                                         image_std=[0.26862954, 0.26130258, 0.27577711])
    return model, CLIPProcessor(image_processor=image_processor, tokenizer=clip_tokenizer())
