"""PickScore: a CLIP-H preference model; score = logit_scale.exp() * cos(text, image) / 26.

Applied to the whole grid with the full prompt (CLIP truncates to 77 tokens, which keeps the
leading global description). PickScore_v1 for real runs, a random tiny CLIP with `tiny: true`.
"""
from __future__ import annotations

import torch

from paco_ds.rewards.base import Count, FullSizeReward, Reward, RewardResult, model_dtype

PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
MODEL = "yuvalkirstain/PickScore_v1"
BATCH_SIZE = 16

# PickScore_v1's CLIPModel (the laion CLIP-ViT-H-14 architecture), for the GPU plan (`full_size`).
CLIP_H_TEXT = {"vocab_size": 49408, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
               "num_attention_heads": 16, "max_position_embeddings": 77, "hidden_act": "gelu",
               "bos_token_id": 49406, "eos_token_id": 49407, "pad_token_id": 1}
CLIP_H_VISION = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 16,
                 "image_size": 224, "patch_size": 14, "hidden_act": "gelu"}
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


class PickScore(Reward):
    name = "pickscore"
    video = "frames"  # a video: each frame against the prompt, the mean over its frames

    def __init__(self, model: str = MODEL, processor: str = PROCESSOR, tiny: bool = False, device: str = "cpu",
                 batch_size: Count = BATCH_SIZE):
        if tiny:
            from paco_ds.models.tiny.clip import tiny_clip_model

            clip, proc = tiny_clip_model()
        else:
            from transformers import AutoProcessor, CLIPModel

            proc = AutoProcessor.from_pretrained(processor)
            clip = CLIPModel.from_pretrained(model)
        self._hold(clip, proc, device, batch_size)
        self.model.to(self.device, self.dtype).eval().requires_grad_(False)

    def _hold(self, model, processor, device, batch_size: int) -> None:
        self.model, self.processor = model, processor
        self.device = torch.device(device)
        self.dtype = model_dtype(self.device)
        self.batch_size = batch_size

    @classmethod
    def full_size(cls, device, batch_size: int = BATCH_SIZE, **_) -> FullSizeReward:
        """PickScore_v1's CLIP-H on meta, with a processor of its geometry (the offline CLIP tokenizer)."""
        from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

        from paco_ds.models.full_size import empty
        from paco_ds.models.tiny import clip_tokenizer

        config = CLIPConfig(text_config=CLIP_H_TEXT, vision_config=CLIP_H_VISION, projection_dim=1024)
        image_processor = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                                             image_mean=CLIP_MEAN, image_std=CLIP_STD)
        reward = cls.__new__(cls)
        reward._hold(empty(lambda: CLIPModel(config)),
                     CLIPProcessor(image_processor=image_processor, tokenizer=clip_tokenizer()), device, batch_size)
        return FullSizeReward(reward, [(reward.model, reward.dtype)])

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
