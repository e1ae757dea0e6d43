"""The open_clip rewards' shared part (clip_i, subfig_clipT): the model they score with (ViT-H-14,
laion2b_s32b_b79k, for real runs; a random tiny CLIP built offline with `tiny: true`; the full-size
model on the meta device for the GPU plan), its batch size and its cache of computed scores."""
from __future__ import annotations

import torch

from paco_ds.rewards.base import Count, FullSizeReward, LRUCache, Reward, model_dtype

BATCH_SIZE, CACHE_SIZE = 32, 4096


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


class OpenClipReward(Reward):
    """A reward computed with an open_clip model, `batch_size` images per forward, its results
    cached (`cache_size` entries) since a group's samples repeat references and prompts."""

    def __init__(self, model: str = "ViT-H-14", pretrained: str = "laion2b_s32b_b79k", tiny: bool = False,
                 device: str = "cpu", batch_size: Count = BATCH_SIZE, cache_size: Count = CACHE_SIZE):
        clip, preprocess, model = load_open_clip(model, pretrained, tiny)
        self._hold(clip, preprocess, model, device, batch_size, cache_size)
        self.model.to(self.device, self.dtype).eval().requires_grad_(False)

    def _hold(self, clip, preprocess, name: str, device, batch_size: int, cache_size: int) -> None:
        import open_clip

        self.model, self.preprocess, self.tokenizer = clip, preprocess, open_clip.get_tokenizer(name)
        self.device = torch.device(device)
        self.dtype = model_dtype(self.device)
        self.batch_size = batch_size
        self.cache = LRUCache(cache_size)

    @classmethod
    def full_size(cls, device, model: str = "ViT-H-14", batch_size: int = BATCH_SIZE, cache_size: int = CACHE_SIZE,
                  **_) -> FullSizeReward:
        """The open_clip `model` on meta, from open_clip's bundled config (no weights)."""
        import open_clip

        from paco_ds.models.full_size import empty

        clip, _, preprocess = empty(lambda: open_clip.create_model_and_transforms(model, pretrained=None,
                                                                                 device="meta"))
        reward = cls.__new__(cls)
        reward._hold(clip, preprocess, model, device, batch_size, cache_size)
        return FullSizeReward(reward, [(clip, reward.dtype)])
