"""Sub-figure CLIP-T: mean cosine similarity between each panel and its own panel prompt.

A prompt without panel markers is one panel: the whole image against the whole prompt (CLIP-T); a
video's per-frame form is that for each frame, averaged over the frames (paco_ds/rewards/base.py).

open_clip ViT-H-14 (laion2b_s32b_b79k) for real runs; `tiny: true` builds a random tiny CLIP
offline. Panel embeddings are cached by (panel content, text), since groups repeat prompts.
"""
from __future__ import annotations

import numpy as np
import torch

from paco_ds.images import grid_shape, split_panels, split_prompt
from paco_ds.rewards.base import RewardResult, image_digest
from paco_ds.rewards.openclip import OpenClipReward


class SubfigClipT(OpenClipReward):
    name = "subfig_clipT"
    video = "frames"  # a video: each frame against the prompt, the mean over its frames

    @torch.no_grad()
    def _similarities(self, panels, texts) -> list[float]:
        out = []
        for i in range(0, len(panels), self.batch_size):
            ims = torch.stack([self.preprocess(p) for p in panels[i:i + self.batch_size]]).to(self.device, self.dtype)
            toks = self.tokenizer(texts[i:i + self.batch_size]).to(self.device)
            fi = torch.nn.functional.normalize(self.model.encode_image(ims).float(), dim=-1)
            ft = torch.nn.functional.normalize(self.model.encode_text(toks).float(), dim=-1)
            out += (fi * ft).sum(-1).tolist()
        return out

    def score(self, images, prompts, metadata, ref_images=None) -> RewardResult:
        keys_per_image, known, todo = [], {}, {}
        for im, prompt, meta in zip(images, prompts, metadata):
            rows, cols = grid_shape(prompt, meta)
            panels = split_panels(im, rows, cols)
            subs = split_prompt(prompt)[1:]
            if not subs:  # no panel markers: the whole image against the whole prompt
                panels, subs = [im], [prompt]
            keys = []
            for panel, text in zip(panels, subs):  # zip: extra panels or prompts are ignored
                key = (image_digest(panel), text)
                keys.append(key)
                if key not in known and key not in todo:
                    hit = self.cache.get(key)
                    if hit is None:
                        todo[key] = (panel, text)
                    else:
                        known[key] = hit
            keys_per_image.append(keys)
        if todo:
            pairs = list(todo.values())
            sims = self._similarities([p for p, _ in pairs], [t for _, t in pairs])
            for key, sim in zip(todo, sims):
                known[key] = sim
                self.cache.put(key, sim)
        return RewardResult.ok([float(np.mean([known[k] for k in keys])) for keys in keys_per_image])
