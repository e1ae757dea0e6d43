"""Tiny random-weight CLIP backbones of the local rewards, built from configs (no hub access).

`register_tiny_open_clip` adds a toy open_clip architecture
(paco_ds/models/tiny/configs/paco-tiny-clip.json; the CLIP-I and sub-figure CLIP-T rewards create
it with random weights); `tiny_clip_model` is a toy transformers CLIPModel with its processor (the
PickScore and aesthetic rewards' architecture).
"""
from __future__ import annotations

from paco_ds.models.tiny import CONFIG_DIR, clip_tokenizer, seeded

TINY_OPEN_CLIP = "paco-tiny-clip"


def register_tiny_open_clip() -> str:
    """Register a tiny open_clip architecture (random weights, bundled tokenizer)."""
    import open_clip

    if TINY_OPEN_CLIP not in open_clip.list_models():
        open_clip.add_model_config(CONFIG_DIR / f"{TINY_OPEN_CLIP}.json")
    return TINY_OPEN_CLIP


def tiny_clip_model(seed: int = 0):
    """A tiny transformers CLIPModel and a CLIPProcessor (the PickScore architecture)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tok = clip_tokenizer()
    config = CLIPConfig(
        text_config={"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "max_position_embeddings": 77, "bos_token_id": tok.bos_token_id,
                     "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 8},
        projection_dim=32)
    with seeded(seed):
        model = CLIPModel(config)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return model, CLIPProcessor(image_processor=image_processor, tokenizer=tok)
