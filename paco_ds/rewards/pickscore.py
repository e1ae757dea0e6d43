"""PickScore: a CLIP-H preference model; score = logit_scale.exp() * cos(text, image) / 26.

Applied to the whole grid with the full prompt (CLIP truncates to 77 tokens, which keeps the
leading global description). PickScore_v1 for real runs, a random tiny CLIP with `tiny: true`.
"""
from __future__ import annotations

import torch

from paco_ds.rewards.base import Count, Reward, RewardResult, model_dtype

PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
MODEL = "yuvalkirstain/PickScore_v1"


class PickScore(Reward):
    name = "pickscore"

    def __init__(self, model: str = MODEL, processor: str = PROCESSOR, tiny: bool = False, device: str = "cpu",
                 batch_size: Count = 16):
        if tiny:
            from paco_ds.models.tiny.clip import tiny_clip_model

            self.model, self.processor = tiny_clip_model()
        else:
            from transformers import AutoProcessor, CLIPModel

            self.processor = AutoProcessor.from_pretrained(processor)
            self.model = CLIPModel.from_pretrained(model)
        self.device = torch.device(device)
        self.dtype = model_dtype(self.device)
        self.model.to(self.device, self.dtype).eval().requires_grad_(False)
        self.batch_size = batch_size

    @torch.no_grad()
    def score(self, images, prompts, metadata, ref_images=None) -> RewardResult:
        out: list[float] = []
        for i in range(0, len(images), self.batch_size):
            ims, txt = images[i:i + self.batch_size], prompts[i:i + self.batch_size]
            pix = self.processor(images=ims, return_tensors="pt")["pixel_values"].to(self.device, self.dtype)
            tok = self.processor(text=txt, padding=True, truncation=True, max_length=77, return_tensors="pt").to(self.device)
            fi = self.model.get_image_features(pixel_values=pix)
            ft = self.model.get_text_features(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"])
            fi = _features(fi)
            ft = _features(ft)
            cos = (torch.nn.functional.normalize(fi.float(), dim=-1) * torch.nn.functional.normalize(ft.float(), dim=-1)).sum(-1)
            out += (self.model.logit_scale.exp().float() * cos / 26).tolist()
        return RewardResult.ok(out)


def _features(x):
    """transformers 5 may return a model output instead of a tensor from get_*_features."""
    if isinstance(x, torch.Tensor):
        return x
    return getattr(x, "pooler_output", None) if getattr(x, "pooler_output", None) is not None else x[0]
