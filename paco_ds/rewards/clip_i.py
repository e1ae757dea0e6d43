"""CLIP-I for editing: cosine similarity between the CLIP embeddings of the reference image and
the edit (how much of the original survives; no logit scale, so the score lies in [-1, 1]).

open_clip ViT-H-14 (laion2b_s32b_b79k) by default, as subfig_clipT; `tiny: true` builds a random
tiny CLIP offline. Embeddings are cached by image content: the k samples of a group share one
reference, which is embedded once. Without reference images it is a RewardError.
"""
from __future__ import annotations

import torch

from paco_ds.rewards.openclip import load_open_clip, open_clip_on_meta
from paco_ds.rewards.base import (Count, FullSizeReward, LRUCache, Reward, RewardResult, image_digest, model_dtype,
                                  reference_images)


BATCH_SIZE, CACHE_SIZE = 32, 4096


class ClipI(Reward):
    name = "clip_i"

    def __init__(self, model: str = "ViT-H-14", pretrained: str = "laion2b_s32b_b79k", tiny: bool = False,
                 device: str = "cpu", batch_size: Count = BATCH_SIZE, cache_size: Count = CACHE_SIZE):
        clip, preprocess, model = load_open_clip(model, pretrained, tiny)
        self._hold(clip, preprocess, device, batch_size, cache_size)
        self.model.to(self.device, self.dtype).eval().requires_grad_(False)

    def _hold(self, model, preprocess, device, batch_size: int, cache_size: int) -> None:
        self.model, self.preprocess = model, preprocess
        self.device = torch.device(device)
        self.dtype = model_dtype(self.device)
        self.batch_size = batch_size
        self.cache = LRUCache(cache_size)  # image digest -> normalised embedding (CPU)

    @classmethod
    def full_size(cls, device, model: str = "ViT-H-14", batch_size: int = BATCH_SIZE, cache_size: int = CACHE_SIZE,
                  **_) -> FullSizeReward:
        """The open_clip `model` on meta, from open_clip's bundled config (no weights)."""
        clip, preprocess = open_clip_on_meta(model)
        reward = cls.__new__(cls)
        reward._hold(clip, preprocess, device, batch_size, cache_size)
        return FullSizeReward(reward, [(clip, reward.dtype)])

    @torch.no_grad()
    def _embed(self, images) -> list[torch.Tensor]:
        out = []
        for i in range(0, len(images), self.batch_size):
            x = torch.stack([self.preprocess(im) for im in images[i:i + self.batch_size]]).to(self.device, self.dtype)
            out += list(torch.nn.functional.normalize(self.model.encode_image(x).float(), dim=-1).cpu())
        return out

    def score(self, images, prompts, metadata, ref_images=None) -> RewardResult:
        refs = reference_images(ref_images, len(images), self.name)
        digests: dict[int, str] = {}

        def digest(im) -> str:
            if id(im) not in digests:
                digests[id(im)] = image_digest(im)
            return digests[id(im)]

        pairs = [(digest(r), digest(e)) for r, e in zip(refs, images)]
        known, todo = {}, {}
        for im in [*refs, *images]:
            d = digest(im)
            if d in known or d in todo:
                continue
            hit = self.cache.get(d)
            if hit is None:
                todo[d] = im
            else:
                known[d] = hit
        for d, emb in zip(todo, self._embed(list(todo.values())) if todo else []):
            known[d] = emb
            self.cache.put(d, emb)
        return RewardResult.ok([float((known[a] * known[b]).sum()) for a, b in pairs])
