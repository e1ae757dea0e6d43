"""Tiny random-weight models and offline tokenizers, built from configs (no hub access).

They have the real architectures at toy sizes, so every code path that runs on a full-size
checkpoint runs here on a CPU in milliseconds, with nothing downloaded. Weights come from a fixed
seed, so every process and every run builds the same model. The policies (paco_ds/models/*.py)
build their tiny twins from here when a recipe sets `model.tiny`; one module per family:

- flux.py: FLUX.1 (Kontext uses the same parts), and the reduced-depth, full-width FLUX folder
  of the benchmarks;
- flux2.py: FLUX.2 [dev] (Mistral3) and [klein] (Qwen3);
- sd3.py: Stable Diffusion 3.5;
- qwen_image.py: Qwen-Image and Qwen-Image-Edit;
- qwen_vl.py: Qwen2.5-VL, the PaCo-Reward judge's architecture (and Qwen-Image's text encoder);
- clip.py: the CLIP backbones of the local rewards.

This module holds what they share: the seeded construction, the offline tokenizers (CLIP's BPE,
a T5 Unigram, a byte-level Qwen2) and the tiny 8x autoencoder; configs/ holds the files they read.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import gzip
from pathlib import Path
from typing import Iterator

import torch

from paco_ds.recipe.schema import TinyModelConfig

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


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

    Each call builds its own: a tokenizer keeps padding and truncation state, so the policy's text
    encoder and a tiny CLIP reward scoring in another thread must not share one (a prompt could be
    padded to the other's length mid-rollout). Building from the cached vocabulary takes 0.05 s where
    a deep copy of a built one took 0.8 s (the copy walks 49k merges)."""
    from transformers import CLIPTokenizer

    vocab, merges = _clip_vocabulary()
    return CLIPTokenizer(vocab=dict(vocab), merges=list(merges), model_max_length=77)


@functools.lru_cache(maxsize=1)
def _clip_vocabulary() -> tuple[dict, list]:
    import open_clip

    path = Path(open_clip.__file__).parent / "bpe_simple_vocab_16e6.txt.gz"
    merges = gzip.open(path).read().decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]
    base = _bytes_to_unicode()
    tokens = base + [t + "</w>" for t in base] + ["".join(m.split()) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}, [tuple(m.split()) for m in merges]


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


QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]


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


# ----------------------------------------------------------------------------------------------
# Autoencoder
# ----------------------------------------------------------------------------------------------
def tiny_autoencoder(spec: TinyModelConfig):
    """FLUX's tiny autoencoder architecture (TAEF1: AutoencoderTiny, 8x like the real VAEs) at toy
    width, its convolutions scaled by the spec's gains. Build it inside `seeded`.

    A random AutoencoderKL's GroupNorms make its images nearly independent of the latents, which
    leaves a tiny policy nothing to learn from image rewards; this decoder (no norms) keeps the link."""
    from diffusers import AutoencoderTiny

    vae = AutoencoderTiny(
        in_channels=3, out_channels=3, latent_channels=spec.latent_channels,
        encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
        num_encoder_blocks=(1, 1, 1, 1), num_decoder_blocks=(1, 1, 1, 1), scaling_factor=spec.latent_scaling)
    with torch.no_grad():
        for part, gain in ((vae.decoder, spec.decoder_gain), (vae.encoder, spec.encoder_gain)):
            for m in part.modules():
                if isinstance(m, torch.nn.Conv2d):
                    m.weight.mul_(gain)
    return vae
