"""Tiny random-weight models and offline tokenizers, built from configs (no hub access).

They have the real architectures (FluxTransformer2DModel, AutoencoderKL, CLIP, T5) at toy sizes,
so every code path that runs on FLUX.1-dev runs here on a CPU in milliseconds. Weights come from
a fixed seed, so every process and every run builds the same model.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import gzip
from pathlib import Path
from typing import Iterator

import torch

from paco_ds.config import TinyModelConfig
from paco_ds.serving.tiny_judge import TINY_JUDGE_HEAD_DIM

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

# FLUX.1's scheduler constants, so the tiny model's sigma schedule at a given image size is the
# real one (the tiny autoencoder also downsamples 8x and the transformer packs 2x2 patches).
FLUX_SCHEDULER_CONFIG = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5,
                         "max_shift": 1.15, "use_dynamic_shifting": True, "shift": 3.0}


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Deterministic construction without disturbing the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


# ----------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------
def _bytes_to_unicode() -> list[str]:
    """GPT-2/CLIP's reversible byte -> printable-character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def clip_tokenizer():
    """The real CLIP BPE tokenizer (49408 tokens), rebuilt from open_clip's bundled merges.

    Each call returns its own copy: a tokenizer keeps padding and truncation state, so the policy's
    text encoder and a tiny CLIP reward scoring in another thread must not share one (a prompt could
    be padded to the other's length mid-rollout)."""
    return copy.deepcopy(_clip_tokenizer_built())


@functools.lru_cache(maxsize=1)
def _clip_tokenizer_built():
    import open_clip
    from transformers import CLIPTokenizer

    path = Path(open_clip.__file__).parent / "bpe_simple_vocab_16e6.txt.gz"
    merges = gzip.open(path).read().decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]
    base = _bytes_to_unicode()
    tokens = base + [t + "</w>" for t in base] + ["".join(m.split()) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split()) for m in merges],
                         model_max_length=77)


def t5_tokenizer():
    """A small T5-style Unigram tokenizer (359 pieces, trained once on the shipped prompts).

    The vocabulary is a file, not trained at start-up: Unigram training is not reproducible across
    processes, and every rank (and every run) must map a prompt to the same ids. Each call returns
    its own copy, as clip_tokenizer does.
    """
    return copy.deepcopy(_t5_tokenizer_built())


@functools.lru_cache(maxsize=1)
def _t5_tokenizer_built():
    import json

    from transformers import T5TokenizerFast

    vocab = [tuple(x) for x in json.loads((CONFIG_DIR / "tiny-t5-unigram.json").read_text())]
    return T5TokenizerFast(vocab=vocab, extra_ids=0)


# ----------------------------------------------------------------------------------------------
# FLUX components
# ----------------------------------------------------------------------------------------------
def tiny_flux_components(spec: TinyModelConfig | None = None, seed: int = 0) -> dict:
    """transformer, vae, text_encoder (CLIP), text_encoder_2 (T5), tokenizers, scheduler config."""
    from diffusers import AutoencoderTiny, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    spec = spec or TinyModelConfig()
    tok, tok2 = clip_tokenizer(), t5_tokenizer()
    d = spec.text_dim
    head = spec.attention_head_dim
    rope = (head // 4, head // 4, head - 2 * (head // 4))
    with seeded(seed):
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=4 * spec.latent_channels, num_layers=spec.num_layers,
            num_single_layers=spec.num_single_layers, attention_head_dim=head,
            num_attention_heads=spec.num_attention_heads, joint_attention_dim=d, pooled_projection_dim=d,
            guidance_embeds=True, axes_dims_rope=rope)
        # FLUX's tiny autoencoder architecture (TAEF1: AutoencoderTiny, 8x like the real VAE). A random
        # AutoencoderKL's GroupNorms make its images nearly independent of the latents, which leaves
        # a tiny policy nothing to learn from image rewards; this decoder (no norms) keeps the link.
        vae = AutoencoderTiny(
            in_channels=3, out_channels=3, latent_channels=spec.latent_channels,
            encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
            num_encoder_blocks=(1, 1, 1, 1), num_decoder_blocks=(1, 1, 1, 1), scaling_factor=spec.latent_scaling)
        with torch.no_grad():
            for part, gain in ((vae.decoder, spec.decoder_gain), (vae.encoder, spec.encoder_gain)):
                for m in part.modules():
                    if isinstance(m, torch.nn.Conv2d):
                        m.weight.mul_(gain)
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tok), hidden_size=d, intermediate_size=2 * d, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=77, projection_dim=d, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(tok2), d_model=d, d_kv=d // 2, d_ff=2 * d, num_layers=1, num_heads=2,
            pad_token_id=tok2.pad_token_id, eos_token_id=tok2.eos_token_id, decoder_start_token_id=0))
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "text_encoder_2": text_encoder_2,
            "tokenizer": tok, "tokenizer_2": tok2, "scheduler_config": dict(FLUX_SCHEDULER_CONFIG)}


# ----------------------------------------------------------------------------------------------
# Reward-model backbones
# ----------------------------------------------------------------------------------------------
TINY_OPEN_CLIP = "paco-tiny-clip"


def register_tiny_open_clip() -> str:
    """Register a tiny open_clip architecture (random weights, bundled tokenizer)."""
    import open_clip

    if TINY_OPEN_CLIP not in open_clip.list_models():
        open_clip.add_model_config(CONFIG_DIR / f"{TINY_OPEN_CLIP}.json")
    return TINY_OPEN_CLIP


def tiny_clip_model(seed: int = 0):
    """A tiny transformers CLIPModel and a CLIPProcessor (the PickScore architecture)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tok = clip_tokenizer()
    config = CLIPConfig(
        text_config={"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "max_position_embeddings": 77, "bos_token_id": tok.bos_token_id,
                     "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 8},
        projection_dim=32)
    with seeded(seed):
        model = CLIPModel(config)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return model, CLIPProcessor(image_processor=image_processor, tokenizer=tok)


# ----------------------------------------------------------------------------------------------
# Qwen2.5-VL (the PaCo-Reward architecture)
# ----------------------------------------------------------------------------------------------
QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]

# The qwen2_vl conversation format (LLaMA-Factory's qwen2_vl template, as PaCo-Reward trains with): a
# default system turn, images as <|vision_start|><|image_pad|><|vision_end|> in place, text parts
# verbatim.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.lru_cache(maxsize=1)
def qwen_tokenizer():
    """A byte-level Qwen2 tokenizer: 256 byte tokens, 'Yes' and 'No' as single tokens, Qwen's specials."""
    from transformers import Qwen2Tokenizer

    base = _bytes_to_unicode()
    merges = [("Y", "e"), ("Ye", "s"), ("N", "o")]
    vocab = {t: i for i, t in enumerate(base + ["Ye", "Yes", "No"])}
    for s in QWEN_SPECIAL_TOKENS:
        vocab[s] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS})
    return tok


def tiny_qwen2_5_vl(seed: int = 0, max_pixels: int = 56 * 56):
    """A tiny Qwen2_5_VLForConditionalGeneration and its processor (2 text layers of 2 heads of
    TINY_JUDGE_HEAD_DIM with one key/value head, as the real model groups its queries; 1 vision block)."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLImageProcessor, Qwen2VLVideoProcessor)

    tok = qwen_tokenizer()
    ids = {n: tok.convert_tokens_to_ids(n) for n in QWEN_SPECIAL_TOKENS}
    heads = 2
    hidden = heads * TINY_JUDGE_HEAD_DIM
    pixels = {"min_pixels": 28 * 28, "max_pixels": max_pixels}
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=14, temporal_patch_size=2, merge_size=2, **pixels),
        video_processor=Qwen2VLVideoProcessor(**pixels), tokenizer=tok, chat_template=QWEN2_VL_CHAT_TEMPLATE)
    config = Qwen2_5_VLConfig(
        # mrope_section splits the rotary half-dimension (16) among time, height and width as the
        # real model's [16, 24, 24] splits 64.
        text_config={"vocab_size": len(tok), "hidden_size": hidden, "intermediate_size": 2 * hidden,
                     "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": 1,
                     "max_position_embeddings": 4096,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
                     "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
                     "pad_token_id": ids["<|endoftext|>"]},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": hidden,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                       "fullatt_block_indexes": [0]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    with seeded(seed):
        model = Qwen2_5_VLForConditionalGeneration(config)
    return model.eval(), processor


def save_tiny_qwen2_5_vl(path: str | Path, seed: int = 0) -> Path:
    """Write a tiny Qwen2.5-VL checkpoint directory (model + processor) that from_pretrained loads."""
    path = Path(path)
    model, processor = tiny_qwen2_5_vl(seed)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------------------------
# Reduced-depth, full-width FLUX on disk (benchmarks of loading and of the GRPO epoch)
# ----------------------------------------------------------------------------------------------
# FLUX.1-dev's transformer at full width (3072 = 24 heads x 128, T5 width 4096, CLIP pooled 768,
# 64 packed latent channels) with 1 double + 2 single blocks instead of 19 + 38: about 0.67B
# parameters, so loading and per-token costs are the real ones per block on a CPU machine.
REDUCED_FLUX_TRANSFORMER = {
    "patch_size": 1, "in_channels": 64, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}


def save_flux_folder(path: str | Path, transformer: dict | None = None, seed: int = 0,
                     dtype: torch.dtype = torch.bfloat16, max_shard_size: str | None = None) -> Path:
    """Write a random-weight FLUX folder in diffusers' layout, which `FluxPolicy.load` reads like
    FLUX.1-dev: the given transformer config (default: the reduced full-width one), a small
    AutoencoderKL with in_channels / 4 latent channels, CLIP (hidden = pooled_projection_dim) and
    T5 (d_model = joint_attention_dim) text encoders of one thin layer each, the offline tokenizers
    and FLUX's scheduler config. `max_shard_size` (e.g. "200KB") shards the transformer's
    safetensors with an index file, as FLUX.1-dev's are. Written once: a complete folder written
    with the same arguments is reused; one written with others is an error (delete it first)."""
    import json

    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    path = Path(path)
    tconf = dict(transformer or REDUCED_FLUX_TRANSFORMER)
    stamp = json.dumps({"transformer": tconf, "seed": seed, "dtype": str(dtype), "max_shard_size": max_shard_size},
                       sort_keys=True)
    done = path / ".complete"
    if done.is_file():
        if done.read_text().strip() != stamp:
            raise ValueError(f"{path} holds a FLUX folder written with other arguments ({done.read_text().strip()})")
        return path
    tok, tok2 = clip_tokenizer(), t5_tokenizer()
    parts = {}
    with seeded(seed):
        parts["transformer"] = FluxTransformer2DModel(**tconf)
        parts["vae"] = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=tconf["in_channels"] // 4,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(32, 32, 32, 32), layers_per_block=1, norm_num_groups=32,
            scaling_factor=0.3611, shift_factor=0.1159)
        parts["text_encoder"] = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tok), hidden_size=tconf["pooled_projection_dim"], intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77,
            projection_dim=tconf["pooled_projection_dim"], bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
        parts["text_encoder_2"] = T5EncoderModel(T5Config(
            vocab_size=len(tok2), d_model=tconf["joint_attention_dim"], d_kv=32, d_ff=64, num_layers=1,
            num_heads=2, pad_token_id=tok2.pad_token_id, eos_token_id=tok2.eos_token_id,
            decoder_start_token_id=0))
    for name, module in parts.items():
        # Cast parameter by parameter: ModelMixin.to(dtype) warns about fp32-kept modules.
        for p in module.parameters():
            p.data = p.data.to(dtype)
        shard = {"max_shard_size": max_shard_size} if max_shard_size and name == "transformer" else {}
        module.save_pretrained(path / name, **shard)
        parts[name] = None  # free each part once written (the default transformer is 2.7 GB in fp32)
        del module
    tok.save_pretrained(path / "tokenizer")
    tok2.save_pretrained(path / "tokenizer_2")
    FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER_CONFIG).save_config(path / "scheduler")
    done.write_text(stamp + "\n")
    return path
