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
from paco_ds.rewards.base import FullSizeReward, Reward, RewardResult
from paco_ds.rewards.pickscore import CLIP_MEAN, CLIP_STD, _features

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


# openai/clip-vit-large-patch14's vision tower, for the GPU plan (`Aesthetic.full_size`; its text
# tower is models/full_size.py's CLIP_L_TEXT).
CLIP_L14_VISION = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                   "image_size": 224, "patch_size": 14, "hidden_act": "quick_gelu"}
BATCH_SIZE = 32


class Aesthetic(Reward):
    name = "aesthetic"
    video = "frames"  # a video: each frame against the prompt, the mean over its frames

    def __init__(self, model: str = CLIP, head: str = HEAD, tiny: bool = False, device: str = "cpu",
                 batch_size: int = BATCH_SIZE, dtype: str = "float32"):
        if tiny:
            from paco_ds.models.tiny import seeded
            from paco_ds.models.tiny.clip import tiny_clip_model

            clip, processor = tiny_clip_model()
            with seeded(1):
                mlp = AestheticHead(clip.config.projection_dim)
        else:
            from transformers import CLIPModel, CLIPProcessor

            clip = CLIPModel.from_pretrained(model)
            processor = CLIPProcessor.from_pretrained(model)
            mlp = load_head(head, clip.config.projection_dim)
        self._hold(clip, processor, mlp, device, batch_size, dtype)
        self.model.to(self.device, self.dtype).eval().requires_grad_(False)
        # The head stays fp32: it is tiny, and its output is the score.
        self.head.to(self.device).eval().requires_grad_(False)

    def _hold(self, model, processor, head, device, batch_size: int, dtype: str) -> None:
        self.model, self.processor, self.head = model, processor, head
        self.device = torch.device(device)
        self.dtype = torch_dtype(dtype, self.name)
        self.batch_size = batch_size

    @classmethod
    def full_size(cls, device, batch_size: int = BATCH_SIZE, dtype: str = "float32", **_) -> FullSizeReward:
        """CLIP ViT-L/14 and the MLP head on meta, with a processor of CLIP's geometry (the offline
        CLIP tokenizer; the prompt is not used)."""
        from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

        from paco_ds.models.full_size import CLIP_L_TEXT, empty
        from paco_ds.models.tiny import clip_tokenizer

        config = CLIPConfig(text_config=CLIP_L_TEXT, vision_config=CLIP_L14_VISION, projection_dim=768)
        image_processor = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                                             image_mean=CLIP_MEAN, image_std=CLIP_STD)
        reward = cls.__new__(cls)
        reward._hold(empty(lambda: CLIPModel(config)),
                     CLIPProcessor(image_processor=image_processor, tokenizer=clip_tokenizer()),
                     empty(lambda: AestheticHead(config.projection_dim)), device, batch_size, dtype)
        return FullSizeReward(reward, [(reward.model, reward.dtype), (reward.head, torch.float32)])

    @torch.no_grad()
    def score(self, images, prompts, metadata, ref_images=None) -> RewardResult:
        out: list[float] = []
        for i in range(0, len(images), self.batch_size):
            pix = self.processor(images=images[i:i + self.batch_size], return_tensors="pt")["pixel_values"]
            embed = _features(self.model.get_image_features(pixel_values=pix.to(self.device, self.dtype))).float()
            embed = embed / torch.linalg.vector_norm(embed, dim=-1, keepdim=True)
            out += self.head(embed).tolist()
        return RewardResult.ok(out)
