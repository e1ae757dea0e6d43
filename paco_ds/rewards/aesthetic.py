"""`aesthetic`: the LAION aesthetic predictor, an MLP on CLIP ViT-L/14's normalised image embedding.

As Flow-GRPO scores it (yifan123/flow_grpo, flow_grpo/aesthetic_scorer.py, after
christophschuhmann/improved-aesthetic-predictor, simple_inference.py): transformers' CLIPModel
`openai/clip-vit-large-patch14` and its processor, the image embedding divided by its L2 norm, then
the linear MLP 768 -> 1024 -> 128 -> 64 -> 16 -> 1 (dropouts between, no activations) trained on
SAC + LOGOS + AVA (`sac+logos+ava1-l14-linearMSE.pth`, released in the predictor's repository). The
score is the head's output, about 1-10. The prompt is not used.

`head` is a local file or an http(s) URL of the head's state dict (a URL is fetched once into torch
hub's cache; the default is the predictor repository's file). With `tiny: true`, the repository's
tiny CLIP (models/tiny/clip.py) and a random head of the same shape as the real one on its embedding size.
"""
from __future__ import annotations

import torch

from paco_ds.errors import ConfigError
from paco_ds.rewards.base import Reward, RewardResult
from paco_ds.rewards.pickscore import _features

CLIP = "openai/clip-vit-large-patch14"
HEAD = ("https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/"
        "sac%2Blogos%2Bava1-l14-linearMSE.pth")


def torch_dtype(name: str, reward: str) -> torch.dtype:
    """The model's dtype: float32 by default, as Flow-GRPO runs its aesthetic and ImageReward scorers."""
    if name not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"{reward}.dtype: '{name}' (use float32, bfloat16 or float16)")
    return getattr(torch, name)


class AestheticHead(torch.nn.Module):
    """The predictor's MLP, with its state-dict names (layers.0, .2, .4, .6, .7)."""

    def __init__(self, dim: int = 768):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(dim, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128), torch.nn.Dropout(0.2),
            torch.nn.Linear(128, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))

    def forward(self, embed: torch.Tensor) -> torch.Tensor:
        return self.layers(embed).squeeze(-1)


def load_head(head: str, dim: int) -> AestheticHead:
    mlp = AestheticHead(dim)
    if head.startswith(("http://", "https://")):
        state = torch.hub.load_state_dict_from_url(head, map_location="cpu", weights_only=True)
    else:
        try:
            state = torch.load(head, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise ConfigError(f"aesthetic.head: no file '{head}' (a path or an http(s) URL of the predictor's "
                              "state dict)") from None
    try:
        mlp.load_state_dict(state)
    except RuntimeError as err:
        raise ConfigError(f"aesthetic.head: '{head}' is not the aesthetic MLP on a {dim}-d embedding: "
                          f"{str(err).splitlines()[0]}") from None
    return mlp


class Aesthetic(Reward):
    name = "aesthetic"

    def __init__(self, model: str = CLIP, head: str = HEAD, tiny: bool = False, device: str = "cpu",
                 batch_size: int = 32, dtype: str = "float32"):
        if tiny:
            from paco_ds.models.tiny import seeded
            from paco_ds.models.tiny.clip import tiny_clip_model

            self.model, self.processor = tiny_clip_model()
            with seeded(1):
                self.head = AestheticHead(self.model.config.projection_dim)
        else:
            from transformers import CLIPModel, CLIPProcessor

            self.model = CLIPModel.from_pretrained(model)
            self.processor = CLIPProcessor.from_pretrained(model)
            self.head = load_head(head, self.model.config.projection_dim)
        self.device = torch.device(device)
        self.dtype = torch_dtype(dtype, self.name)
        self.model.to(self.device, self.dtype).eval().requires_grad_(False)
        # The head stays fp32: it is tiny, and its output is the score.
        self.head.to(self.device).eval().requires_grad_(False)
        self.batch_size = batch_size

    @torch.no_grad()
    def score(self, images, prompts, metadata, ref_images=None) -> RewardResult:
        out: list[float] = []
        for i in range(0, len(images), self.batch_size):
            pix = self.processor(images=images[i:i + self.batch_size], return_tensors="pt")["pixel_values"]
            embed = _features(self.model.get_image_features(pixel_values=pix.to(self.device, self.dtype))).float()
            embed = embed / torch.linalg.vector_norm(embed, dim=-1, keepdim=True)
            out += self.head(embed).tolist()
        return RewardResult.ok(out)
