"""CLIP-I for editing: cosine similarity between the CLIP embeddings of the reference image and
the edit (how much of the original survives; no logit scale, so the score lies in [-1, 1]).

open_clip ViT-H-14 (laion2b_s32b_b79k) by default, as subfig_clipT; `tiny: true` builds a random
tiny CLIP offline. Embeddings are cached by image content: the k samples of a group share one
reference, which is embedded once. Without reference images it is a RewardError. A multi-image
edit scores its similarity to each input image and keeps the weakest (the minimum, as
consistency_for_editing; docs/editing.md), logging each input's as part `input<i>`.
"""
from __future__ import annotations

import torch

from paco_ds.rewards.base import RewardResult, image_digest, per_input_parts, reference_sets, weakest_input
from paco_ds.rewards.openclip import OpenClipReward


class ClipI(OpenClipReward):
    name = "clip_i"

    @torch.no_grad()
    def _embed(self, images) -> list[torch.Tensor]:
        out = []
        for i in range(0, len(images), self.batch_size):
            x = torch.stack([self.preprocess(im) for im in images[i:i + self.batch_size]]).to(self.device, self.dtype)
            out += list(torch.nn.functional.normalize(self.model.encode_image(x).float(), dim=-1).cpu())
        return out

    def score(self, images, prompts, metadata, ref_images=None) -> RewardResult:
        ref_sets = reference_sets(ref_images, len(images), self.name)
        refs = [r for rs in ref_sets for r in rs]
        digests: dict[int, str] = {}

        def digest(im) -> str:
            if id(im) not in digests:
                digests[id(im)] = image_digest(im)
            return digests[id(im)]

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
        terms = [[float((known[digest(r)] * known[digest(e)]).sum()) for r in rs] for rs, e in zip(ref_sets, images)]
        return RewardResult.ok([t[weakest_input(t)] for t in terms], per_input_parts(terms))
