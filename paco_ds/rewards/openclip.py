"""The open_clip models the CLIP rewards score with (clip_i, subfig_clipT): the released weights, a
tiny random twin built offline (`tiny: true`), or the full-size model on the meta device for the
GPU plan."""
from __future__ import annotations


def load_open_clip(model: str, pretrained: str | None, tiny: bool):
    """(model, preprocess, model name): the named open_clip model with `pretrained` weights, or the
    tiny twin (seeded, so every rank and run builds the same one)."""
    import open_clip

    if not tiny:
        clip, _, preprocess = open_clip.create_model_and_transforms(model, pretrained=pretrained)
        return clip, preprocess, model
    from paco_ds.models.tiny import seeded
    from paco_ds.models.tiny.clip import register_tiny_open_clip

    name = register_tiny_open_clip()
    with seeded(0):
        clip, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=None)
    return clip, preprocess, name


def open_clip_on_meta(model: str):
    """(model, preprocess): the open_clip `model` on meta, from open_clip's bundled config (no weights)."""
    import open_clip

    from paco_ds.models.full_size import empty

    clip, _, preprocess = empty(lambda: open_clip.create_model_and_transforms(model, pretrained=None, device="meta"))
    return clip, preprocess
