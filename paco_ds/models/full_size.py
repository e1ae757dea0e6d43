"""A family's full-size model without weights: what `--gpu-memory` plans (paco_ds/gpu_plan).

Each policy declares its own `full_size` (a `FullSize`) beside its other family defaults
(`default_path`, `lora_targets`): the real diffusers and transformers classes built on the meta
device (no memory, nothing downloaded) from the values of the published checkpoints' config files,
written in the policy's file. A policy without one is not planned (`Policy.full_size` is None).
The tokenizers are the offline ones of models/tiny/, padded to the real lengths, so every tensor
the plan puts on the device has its real shape.

Here: the building helpers, and the published configs more than one family (or the judge) shares:
google T5-XXL v1.1's encoder as FLUX and SD3.5 ship it, openai CLIP ViT-L/14's text tower, and
Qwen2.5-VL-7B-Instruct (Qwen-Image-Edit's prompt encoder; the PaCo-Reward-7B judge's architecture).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn


@dataclass(frozen=True)
class FullSize:
    """How a policy builds its full-size model on the meta device.

    `transformer()`: the transformer, from the checkpoint's config (about a second: LoRA target
    checks build it too). `components(model_cfg)`: the policy constructor's other components (its
    frozen modules on meta, tokenizers or processor, scheduler config); its options from the
    recipe's `model` section are `Policy.options`', as for any load. The `vae` component is the VAE,
    every other module a text encoder; `fp32` names the components the policy keeps in fp32
    whatever `model.dtype` is."""

    transformer: Callable[[], nn.Module]
    components: Callable[[Any], dict]
    fp32: tuple[str, ...] = ()
    # Other published checkpoints the family loads by `model.path` with another shape (Wan2.1's 1.3B
    # beside its 14B): checkpoint id -> its FullSize. `of(path)` picks it.
    variants: dict[str, "FullSize"] = field(default_factory=dict, hash=False, compare=False)

    def of(self, path: str | None) -> "FullSize":
        """The full-size model of checkpoint `path` (a hub id, or a local folder named like one),
        the family's default where it is none of the variants."""
        if not path:
            return self
        name = str(path).rstrip("/").rsplit("/", 1)[-1]
        return next((v for key, v in self.variants.items() if key == path or key.rsplit("/", 1)[-1] == name), self)


def empty(build: Callable[[], nn.Module]) -> nn.Module:
    """Build on the meta device; small buffers (rope tables, position ids) stay real on the host."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return build()


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


CLIP_L_TEXT = {  # FLUX's text_encoder (and SD3.5's, with its projection)
    "vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu", "projection_dim": 768,
    "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1,
}
T5_XXL = {  # FLUX's text_encoder_2 and SD3.5's text_encoder_3 (T5 v1.1 XXL encoder)
    "vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "feed_forward_proj": "gated-gelu",
    "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1,
    "decoder_start_token_id": 0,
}
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


def t5_xxl() -> nn.Module:
    """T5-XXL's encoder with its token embedding once: the checkpoints tie `encoder.embed_tokens`
    to `shared`, which a model built on meta here does not (131,596,288 parameters counted twice);
    one module under both names stays one tensor on the plan's fake device."""
    from transformers import T5Config, T5EncoderModel

    model = empty(lambda: T5EncoderModel(T5Config(**T5_XXL)))
    model.encoder.embed_tokens = model.shared
    return model


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
