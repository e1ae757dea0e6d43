"""`imagereward`: ImageReward, a BLIP text-image encoder with an MLP head trained on human preferences.

The score, as the released model computes it (THUDM/ImageReward, ImageReward/ImageReward.py, `score`;
Flow-GRPO calls it through `inference_rank`, yifan123/flow_grpo, flow_grpo/imagereward_scorer.py):
the image (resized bicubic to 224, centre-cropped, CLIP's normalisation) goes through BLIP's ViT; the
prompt (BERT tokens, padded and truncated to 35) goes through BLIP's text encoder with
cross-attention to the image tokens; the first token's output goes through an MLP
(768 -> 1024 -> 128 -> 64 -> 16 -> 1, the aesthetic predictor's shape) and is standardised with the
model's constants, (r - 0.16717362830052426) / 1.0333394966054072. Here it runs batched.

Real loading path: the released checkpoint (`ImageReward.pt` of the hub repository THUDM/ImageReward,
the file the `image-reward` package downloads, or a local copy: `model:`) is loaded into transformers'
BLIP vision model and text encoder, which are the same networks under other parameter names (BLIP's
timm-style ViT-L/16 and its cross-attending BERT, salesforce/BLIP models/vit.py and models/med.py);
`convert_checkpoint` renames them. The tokenizer is bert-base-uncased, as BLIP's `init_tokenizer`
loads it (its two added special tokens do not occur in prompts). No `image-reward` package is needed
(its pins, timm 0.6.13, and its imports do not install beside transformers 5). With `tiny: true`: the
same transformers modules at toy size from a config, the repository's offline CLIP tokenizer and a
random head, through the same computation.
"""
from __future__ import annotations

import torch

from paco_ds.errors import ConfigError
from paco_ds.rewards.aesthetic import AestheticHead, torch_dtype
from paco_ds.rewards.base import Count, FullSizeReward, Reward, RewardResult

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
                       "initializer_range": 0.02, "layer_norm_eps": 1e-6},  # BLIP's ViT: timm's eps
        text_config={"vocab_size": len(tok), "hidden_size": 32, "encoder_hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64,
                     "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
                     "eos_token_id": tok.eos_token_id, "sep_token_id": tok.eos_token_id},
        projection_dim=32)
    with seeded(seed):
        blip = BlipForImageTextRetrieval(config)
        head = AestheticHead(32)
    return blip.vision_model, blip.text_encoder, tok, head, 32


# ImageReward-v1.0's networks: BLIP's ViT-L/16 at 224 (timm's LayerNorm eps 1e-6) and BERT-base with
# cross-attention (THUDM/ImageReward, ImageReward/ImageReward.py builds BLIP_Pretrain(vit='large')).
IMAGE_SIZE, VISION_HEADS, TEXT_HEADS = 224, 16, 12


def load_checkpoint(model: str) -> dict:
    import os

    if os.path.isfile(model):
        path = model
    else:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(model, "ImageReward.pt")
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state.get("state_dict", state) if isinstance(state, dict) else state


def _vision_name(key: str) -> str:
    """BLIP's ViT parameter name -> transformers' BlipVisionModel's."""
    fixed = {"cls_token": "embeddings.class_embedding", "pos_embed": "embeddings.position_embedding",
             "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
             "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
             "norm.weight": "post_layernorm.weight", "norm.bias": "post_layernorm.bias"}
    if key in fixed:
        return fixed[key]
    for old, new in (("blocks.", "encoder.layers."), (".norm1.", ".layer_norm1."), (".norm2.", ".layer_norm2."),
                     (".attn.qkv.", ".self_attn.qkv."), (".attn.proj.", ".self_attn.projection.")):
        key = key.replace(old, new)
    return key


def convert_checkpoint(state: dict) -> tuple[dict, dict, dict]:
    """ImageReward's state dict -> (vision, text encoder, head) state dicts under transformers' names.
    BLIP's text encoder already uses BERT's names, which transformers' BlipTextModel keeps."""
    vision, text, head = {}, {}, {}
    for key, value in state.items():
        if key.startswith("blip.visual_encoder."):
            vision[_vision_name(key.removeprefix("blip.visual_encoder."))] = value
        elif key.startswith("blip.text_encoder."):
            name = key.removeprefix("blip.text_encoder.")
            if name != "embeddings.position_ids":  # a buffer, rebuilt by the module
                text[name] = value
        elif key.startswith("mlp."):
            head[key.removeprefix("mlp.")] = value
    if not (vision and text and head):
        raise ConfigError("imagereward.model: the checkpoint has no blip.visual_encoder / blip.text_encoder / mlp "
                          "weights (is it ImageReward.pt?)")
    return vision, text, head


def from_checkpoint(state: dict, vision_heads: int = VISION_HEADS, text_heads: int = TEXT_HEADS,
                    image_size: int = IMAGE_SIZE):
    """(vision model, text encoder, head) with the checkpoint's weights; sizes read from its shapes."""
    from transformers import BlipTextConfig, BlipVisionConfig
    from transformers.models.blip.modeling_blip import BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    vision_sd, text_sd, head_sd = convert_checkpoint(state)
    width = vision_sd["embeddings.class_embedding"].shape[-1]
    patch = vision_sd["embeddings.patch_embedding.weight"].shape[-1]
    vocab, hidden = text_sd["embeddings.word_embeddings.weight"].shape
    vision = BlipVisionModel(BlipVisionConfig(
        hidden_size=width, intermediate_size=vision_sd["encoder.layers.0.mlp.fc1.weight"].shape[0],
        num_hidden_layers=1 + max(int(k.split(".")[2]) for k in vision_sd if k.startswith("encoder.layers.")),
        num_attention_heads=vision_heads, image_size=image_size, patch_size=patch, layer_norm_eps=1e-6))
    text = BlipTextModel(BlipTextConfig(
        vocab_size=vocab, hidden_size=hidden, encoder_hidden_size=width,
        intermediate_size=text_sd["encoder.layer.0.intermediate.dense.weight"].shape[0],
        num_hidden_layers=1 + max(int(k.split(".")[2]) for k in text_sd if k.startswith("encoder.layer.")),
        num_attention_heads=text_heads, max_position_embeddings=text_sd["embeddings.position_embeddings.weight"].shape[0],
        layer_norm_eps=1e-12), add_pooling_layer=False)
    head = AestheticHead(hidden)
    for module, sd, what in ((vision, vision_sd, "vision"), (text, text_sd, "text encoder"), (head, head_sd, "head")):
        missing, unexpected = module.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.endswith("position_ids")]
        if missing or unexpected:
            raise ConfigError(f"imagereward.model: the checkpoint's {what} does not match BLIP's "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return vision, text, head


# ImageReward-v1.0's networks at full size, for the GPU plan (`ImageReward.full_size`): BLIP's ViT-L/16
# and its BERT-base text encoder (bert-base-uncased's vocabulary and BLIP's two added tokens) with
# cross-attention to the ViT's 1024-d tokens, as `from_checkpoint` reads them from ImageReward.pt.
BLIP_VISION = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
               "num_attention_heads": VISION_HEADS, "image_size": IMAGE_SIZE, "patch_size": 16, "layer_norm_eps": 1e-6}
BLIP_TEXT = {"vocab_size": 30524, "hidden_size": 768, "encoder_hidden_size": 1024, "intermediate_size": 3072,
             "num_hidden_layers": 12, "num_attention_heads": TEXT_HEADS, "max_position_embeddings": 512,
             "layer_norm_eps": 1e-12}
BATCH_SIZE = 16


class ImageReward(Reward):
    name = "imagereward"

    def __init__(self, model: str = "THUDM/ImageReward", tokenizer: str = "bert-base-uncased", tiny: bool = False,
                 device: str = "cpu", batch_size: Count = BATCH_SIZE, dtype: str = "float32"):
        """`model`: a hub repository holding ImageReward.pt, or a local checkpoint file."""
        torch_dtype(dtype, self.name)  # a bad dtype is one line before anything loads
        if tiny:
            vision, text, tok, head, size = tiny_blip()
        else:
            from transformers import AutoTokenizer

            vision, text, head = from_checkpoint(load_checkpoint(model))
            tok, size = AutoTokenizer.from_pretrained(tokenizer), IMAGE_SIZE
        self._hold(vision, text, head, tok, size, device, batch_size, dtype)
        for m in self.modules:
            m.to(self.device, self.dtype).eval().requires_grad_(False)
        self.head.to(self.device).float().eval().requires_grad_(False)  # fp32: its output is the score

    def _hold(self, vision, text, head, tokenizer, size: int, device, batch_size: int, dtype: str) -> None:
        self.device = torch.device(device)
        self.dtype = torch_dtype(dtype, self.name)
        self.vision = lambda pix: vision(pixel_values=pix).last_hidden_state
        self.text, self.head, self.tokenizer = text, head, tokenizer
        self.modules = [vision, text]
        self.preprocess = blip_transform(size)
        self.batch_size = batch_size

    @classmethod
    def full_size(cls, device, batch_size: int = BATCH_SIZE, dtype: str = "float32", **_) -> FullSizeReward:
        """BLIP's ViT-L/16, its text encoder and the MLP head on meta; the offline CLIP tokenizer
        stands in for bert-base-uncased (prompts are padded to the same 35 tokens)."""
        from transformers import BlipTextConfig, BlipVisionConfig
        from transformers.models.blip.modeling_blip import BlipVisionModel
        from transformers.models.blip.modeling_blip_text import BlipTextModel

        from paco_ds.models.full_size import empty
        from paco_ds.models.tiny import clip_tokenizer

        vision = empty(lambda: BlipVisionModel(BlipVisionConfig(**BLIP_VISION)))
        text = empty(lambda: BlipTextModel(BlipTextConfig(**BLIP_TEXT), add_pooling_layer=False))
        reward = cls.__new__(cls)
        reward._hold(vision, text, empty(lambda: AestheticHead(BLIP_TEXT["hidden_size"])), clip_tokenizer(),
                     IMAGE_SIZE, device, batch_size, dtype)
        return FullSizeReward(reward, [(vision, reward.dtype), (text, reward.dtype), (reward.head, torch.float32)])

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
