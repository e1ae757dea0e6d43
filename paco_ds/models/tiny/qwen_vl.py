"""A tiny random-weight Qwen2.5-VL, built from a config (no hub access).

Qwen2_5_VLForConditionalGeneration at toy size with its processor: the PaCo-Reward judge's
architecture (the tiny judge served by the hf engine and vLLM, the reward SFT) and the prompt
encoder of the tiny Qwen-Image-Edit. Its tokenizer is the byte-level one of this package, with
'Yes' and 'No' as single tokens.
"""
from __future__ import annotations

from pathlib import Path

from paco_ds.models.tiny import QWEN_SPECIAL_TOKENS, qwen_tokenizer, seeded
from paco_ds.recipe.tiny_judge import TINY_JUDGE_HEAD_DIM

# The qwen2_vl conversation format (LLaMA-Factory's qwen2_vl template, as PaCo-Reward trains with): a
# default system turn, images as <|vision_start|><|image_pad|><|vision_end|> in place, text parts
# verbatim.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_qwen2_5_vl(seed: int = 0, max_pixels: int = 56 * 56):
    """A tiny Qwen2_5_VLForConditionalGeneration and its processor (2 text layers of 2 heads of
    TINY_JUDGE_HEAD_DIM with one key/value head, as the real model groups its queries; 1 vision block)."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLImageProcessor, Qwen2VLVideoProcessor)

    tok = qwen_tokenizer()
    ids = {n: tok.convert_tokens_to_ids(n) for n in QWEN_SPECIAL_TOKENS}
    heads = 2
    hidden = heads * TINY_JUDGE_HEAD_DIM
    pixels = {"min_pixels": 28 * 28, "max_pixels": max_pixels}
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=14, temporal_patch_size=2, merge_size=2, **pixels),
        video_processor=Qwen2VLVideoProcessor(**pixels), tokenizer=tok, chat_template=QWEN2_VL_CHAT_TEMPLATE)
    config = Qwen2_5_VLConfig(
        # mrope_section splits the rotary half-dimension (16) among time, height and width as the
        # real model's [16, 24, 24] splits 64.
        text_config={"vocab_size": len(tok), "hidden_size": hidden, "intermediate_size": 2 * hidden,
                     "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": 1,
                     "max_position_embeddings": 4096,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
                     "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
                     "pad_token_id": ids["<|endoftext|>"]},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": hidden,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                       "fullatt_block_indexes": [0]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    with seeded(seed):
        model = Qwen2_5_VLForConditionalGeneration(config)
    return model.eval(), processor


def save_tiny_qwen2_5_vl(path: str | Path, seed: int = 0) -> Path:
    """Write a tiny Qwen2.5-VL checkpoint directory (model + processor) that from_pretrained loads."""
    path = Path(path)
    model, processor = tiny_qwen2_5_vl(seed)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path
