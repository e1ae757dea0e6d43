"""`imagereward`: ImageReward, a BLIP text-image encoder with an MLP head trained on human preferences.

The score, as the released model computes it (THUDM/ImageReward, ImageReward/ImageReward.py, `score`;
Flow-GRPO calls it through `inference_rank`, yifan123/flow_grpo, flow_grpo/imagereward_scorer.py):
the image (resized bicubic to 224, centre-cropped, CLIP's normalisation) goes through BLIP's ViT; the
prompt (BERT tokens, padded and truncated to 35) goes through BLIP's text encoder with
cross-attention to the image tokens; the first token's output goes through an MLP
(768 -> 1024 -> 128 -> 64 -> 16 -> 1, the aesthetic predictor's shape) and is standardised with the
model's constants, (r - 0.16717362830052426) / 1.0333394966054072. Here it runs batched.

Real loading path: the `image-reward` package (`pip install image-reward`), `ImageReward.load(model)`
with `model: ImageReward-v1.0` (downloads THUDM/ImageReward's checkpoint and med_config), or a local
checkpoint path as that function takes it. With `tiny: true`: transformers' BLIP (the same ViT +
cross-attending BERT text encoder design) at toy size from a config, with the repository's offline
CLIP tokenizer and a random head, through the same computation.
"""
from __future__ import annotations

import torch

from paco_ds.errors import ConfigError
from paco_ds.rewards.aesthetic import AestheticHead, torch_dtype
from paco_ds.rewards.base import Reward, RewardResult

MEAN, STD = 0.16717362830052426, 1.0333394966054072  # ImageReward-v1.0's output standardisation
MAX_TOKENS = 35
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def blip_transform(size: int):
    from torchvision import transforms as T

    return T.Compose([T.Resize(size, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(size),
                      T.Lambda(lambda im: im.convert("RGB")), T.ToTensor(), T.Normalize(CLIP_MEAN, CLIP_STD)])


def tiny_blip(seed: int = 0):
    """(vision model, text encoder with cross-attention, tokenizer, head, image size): random, offline."""
    from transformers import BlipConfig, BlipForImageTextRetrieval

    from paco_ds.models.tiny import clip_tokenizer, seeded

    tok = clip_tokenizer()
    config = BlipConfig(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 8,
                       # BlipVisionConfig's default initializer_range is 1e-10, which leaves a random
                       # ViT's output about 0 and the score blind to the image; BERT's 0.02 instead.
                       "initializer_range": 0.02},
        text_config={"vocab_size": len(tok), "hidden_size": 32, "encoder_hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64,
                     "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
                     "eos_token_id": tok.eos_token_id, "sep_token_id": tok.eos_token_id},
        projection_dim=32)
    with seeded(seed):
        blip = BlipForImageTextRetrieval(config)
        head = AestheticHead(32)
    return blip.vision_model, blip.text_encoder, tok, head, 32


class ImageReward(Reward):
    name = "imagereward"

    def __init__(self, model: str = "ImageReward-v1.0", tiny: bool = False, device: str = "cpu",
                 batch_size: int = 16, dtype: str = "float32"):
        self.device = torch.device(device)
        self.dtype = torch_dtype(dtype, self.name)
        if tiny:
            vision, text, self.tokenizer, self.head, size = tiny_blip()
            self.vision = lambda pix: vision(pixel_values=pix).last_hidden_state
            self.text = text
            self.modules = [vision, text]
        else:
            try:
                import ImageReward as RM
            except ImportError as err:
                raise ConfigError("reward 'imagereward' needs the ImageReward package: pip install image-reward "
                                  f"({type(err).__name__}: {err})") from None
            released = RM.load(model, device="cpu")
            self.vision, self.text = released.blip.visual_encoder, released.blip.text_encoder
            self.tokenizer, self.head, size = released.blip.tokenizer, released.mlp, 224
            self.modules = [released.blip.visual_encoder, released.blip.text_encoder]
        self.preprocess = blip_transform(size)
        for m in self.modules:
            m.to(self.device, self.dtype).eval().requires_grad_(False)
        self.head.to(self.device).float().eval().requires_grad_(False)  # fp32: its output is the score
        self.batch_size = batch_size

    @torch.no_grad()
    def score(self, images, prompts, metadata, ref_images=None) -> RewardResult:
        out: list[float] = []
        for i in range(0, len(images), self.batch_size):
            pix = torch.stack([self.preprocess(im) for im in images[i:i + self.batch_size]])
            image_embeds = self.vision(pix.to(self.device, self.dtype))
            tok = self.tokenizer(prompts[i:i + self.batch_size], padding="max_length", truncation=True,
                                 max_length=MAX_TOKENS, return_tensors="pt").to(self.device)
            image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=self.device)
            txt = self.text(tok["input_ids"], attention_mask=tok["attention_mask"], encoder_hidden_states=image_embeds,
                            encoder_attention_mask=image_atts, return_dict=True).last_hidden_state[:, 0, :]
            r = self.head(txt.float())
            out += ((r.reshape(-1) - MEAN) / STD).tolist()
        return RewardResult.ok(out)
