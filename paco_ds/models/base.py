"""The `Policy` interface: what the rollout and the trainer need from an image generator.

One file per model family implements it (flux.py, ...). The trainer never imports a diffusers
pipeline: it encodes prompts once, prepares latents, asks for velocities through whichever module
it is given (the bare transformer, or the DeepSpeed engine that wraps it), and decodes once.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Literal

import torch
from torch import nn

from paco_ds.models.full_size import FullSize
from paco_ds.models.schedule import ShiftConfig, flux_sigmas

if TYPE_CHECKING:
    from paco_ds.recipe.schema import ModelConfig, TinyModelConfig

log = logging.getLogger(__name__)


def revision_kwargs(revision: str | None) -> dict:
    """`from_pretrained`'s keyword for a checkpoint revision (none: the library's default branch)."""
    return {"revision": revision} if revision else {}


def import_class(path: str):
    """'library:Name' (diffusers, transformers, or any module) -> the class."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Part:
    """A component of a family's checkpoint, loaded by its class (`library:Class`) from the subfolder
    named like the component. `dtype`: "model" (the recipe's model dtype), "fp32" (loaded and kept in
    fp32 whatever the model dtype is), or None (no weights: a tokenizer or processor). A part with
    weights is frozen: no gradients, eval mode, held on the policy's device (`Policy.hold_frozen`)."""

    cls: str
    dtype: Literal["model", "fp32"] | None = "model"
    # Classes of the same library the checkpoint may hold instead: the one its subfolder's config
    # names (`_class_name`) is loaded, and any other is refused (SD3's VAE: AutoencoderKL or TAESD3's
    # AutoencoderTiny, which decodes the same latents).
    choices: tuple[str, ...] = ()

    def load(self, path: str, subfolder: str, dtype: torch.dtype, kw: dict):
        klass = import_class(self.cls)
        if self.choices:
            library, _, default = self.cls.partition(":")
            named = klass.load_config(path, subfolder=subfolder, **kw).get("_class_name", default)
            if named not in self.choices:
                raise ValueError(f"{path}/{subfolder}: {named} is not one of {', '.join(self.choices)}")
            klass = import_class(f"{library}:{named}")
        if self.dtype is None:
            return klass.from_pretrained(path, subfolder=subfolder, **kw)
        key = "torch_dtype" if self.cls.startswith("diffusers:") else "dtype"
        return klass.from_pretrained(path, subfolder=subfolder, **{key: self.torch_dtype(dtype)}, **kw)

    def torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.dtype == "fp32" else model_dtype


class ModelSource:
    """Where a policy's modules come from, and where its transformer is placed: the recipe's
    checkpoint (or its tiny twin, `model.tiny`) here; the GPU plan's full-size model on a fake
    device is another source (paco_ds/gpu_plan/source.py), so the plan builds its policy through the
    trainer's own functions."""

    def parts(self, policy_cls: type["Policy"], cfg: "ModelConfig", dtype: torch.dtype,
              ds_config: dict | None) -> dict:
        """The constructor's components, its options (`Policy.options`) aside."""
        if cfg.tiny:
            return policy_cls.tiny_parts(cfg.tiny_spec)
        return policy_cls.from_pretrained(cfg.path or policy_cls.default_path, cfg.revision, dtype, ds_config=ds_config)

    def place(self, transformer: nn.Module, device: torch.device, dtype: torch.dtype, cfg: "ModelConfig",
              ds_config: dict | None) -> None:
        """The transformer onto the policy's device. Under ZeRO-3 a loaded one is already partitioned
        there (zero_load.py); the tiny one is always built whole."""
        from paco_ds.models.zero_load import is_zero3

        if not is_zero3(ds_config) or cfg.tiny:
            move_module(transformer, device, dtype)

    def constructing(self) -> contextlib.AbstractContextManager:
        """What the policy's constructor runs under (a constructor may encode a prompt on the device)."""
        return contextlib.nullcontext()


def _opt(x, fn):
    return None if x is None else fn(x)


@dataclass
class TextEmbeds:
    """Cached text conditioning, one row per sample (stored with rollouts, reused in training).
    `pooled` is FLUX's CLIP vector; `mask` marks the valid tokens of padded embeddings (Qwen)."""

    prompt_embeds: torch.Tensor  # [B, S, D]
    pooled: torch.Tensor | None = None  # [B, P]
    mask: torch.Tensor | None = None  # [B, S]

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    def to(self, device=None, dtype=None) -> "TextEmbeds":
        return TextEmbeds(self.prompt_embeds.to(device=device, dtype=dtype),
                          _opt(self.pooled, lambda t: t.to(device=device, dtype=dtype)),
                          _opt(self.mask, lambda t: t.to(device=device)))

    def select(self, idx) -> "TextEmbeds":
        return TextEmbeds(self.prompt_embeds[idx], _opt(self.pooled, lambda t: t[idx]), _opt(self.mask, lambda t: t[idx]))

    @staticmethod
    def cat(items: list["TextEmbeds"]) -> "TextEmbeds":
        """Stack rows; padded embeddings of different lengths are right-padded (mask 0) to the longest."""
        width = max(e.prompt_embeds.shape[1] for e in items)
        embeds, masks = [], []
        for e in items:
            pad = width - e.prompt_embeds.shape[1]
            embeds.append(torch.nn.functional.pad(e.prompt_embeds, (0, 0, 0, pad)))
            if e.mask is not None:
                masks.append(torch.nn.functional.pad(e.mask, (0, pad)))
        pooled = None if items[0].pooled is None else torch.cat([e.pooled for e in items])
        return TextEmbeds(torch.cat(embeds), pooled, torch.cat(masks) if masks else None)


@dataclass
class Condition:
    """An editing policy's reference images, encoded once per sample at rollout time and carried in
    the Trajectory: the latents to every training forward (no re-encoding per step), the original
    images to the rewards (`ref_images`), which compare against them, not a resized copy."""

    # the originals, one entry per sample: a uint8 [3, H_i, W_i] tensor (sizes may differ), or for a
    # multi-image edit a tuple of them, its input images in order
    images: list[torch.Tensor | tuple[torch.Tensor, ...]]
    latents: torch.Tensor | None = None  # packed [B, Lc, C] at `size`, what the transformer reads
    # (height, width) in pixels the condition was encoded at; a multi-image condition's policy
    # keeps one per input image (a tuple of them), its latents concatenated in that order
    size: tuple | None = None

    def __len__(self) -> int:
        return len(self.images)

    def to(self, device=None) -> "Condition":
        return Condition(self.images, _opt(self.latents, lambda t: t.to(device)), self.size)

    def select(self, idx) -> "Condition":
        rows = list(range(len(self.images)))[idx] if isinstance(idx, slice) else [int(i) for i in idx]
        return Condition([self.images[i] for i in rows], _opt(self.latents, lambda t: t[rows]), self.size)

    @staticmethod
    def cat(items: list["Condition"]) -> "Condition":
        if len({c.size for c in items}) > 1:
            raise ValueError("a batch mixes condition sizes; use train.batch_size 1 for mixed-size data")
        latents = None if items[0].latents is None else torch.cat([c.latents for c in items])
        return Condition([im for c in items for im in c.images], latents, items[0].size)


# The attention projections of both streams of a double-stream (MMDiT) block in diffusers' names, in
# the order PaCo-RL lists them (scripts/train_flux.py in github.com/X-GenGroup/PaCo-RL): FLUX.1's and
# Qwen-Image's LoRA targets start with them and add their own MLP names.
DOUBLE_STREAM_ATTENTION = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
                           "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out")


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """A VAE's [-1, 1] output -> uint8 images on the CPU."""
    return ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()


def pack_2x2(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] latents -> [B, H/2 * W/2, 4C] tokens of 2x2 patches (FLUX and Qwen-Image)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of pack_2x2 for latents of h x w."""
    b, _, ch = tokens.shape
    x = tokens.view(b, h // 2, w // 2, ch // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, ch // 4, h, w)


class Policy(ABC):
    """A flow-matching generator: frozen encoders and VAE, a transformer that carries the LoRA."""

    transformer: nn.Module
    shift: ShiftConfig
    device: torch.device
    dtype: torch.dtype

    size_multiple: int = 16  # image sides must be multiples of this (latent packing, VL processor)

    # The family's own defaults, used when a recipe leaves `model.path` or `model.lora.target_modules`
    # unset (paco_ds.models.with_family_defaults): each family names its checkpoint and the module
    # names of its own transformer, so no family inherits another's.
    default_path: str
    lora_targets: tuple[str, ...]
    # The family's full-size model without weights, which `--gpu-memory` plans (paco_ds/gpu_plan):
    # its real classes built on the meta device from the published configs (models/full_size.py).
    # None: the family is not planned (one line naming model.family).
    full_size: FullSize | None = None
    # How many input images an editing family conditions on per sample: data with more is refused
    # at load, naming the record (paco_ds/grpo/preflight.py). Several arrive as a tuple per sample.
    max_input_images: int = 1
    # Whether the transformer's attention goes through diffusers' attention dispatcher, so that
    # `model.attention_backend` can choose its kernel (paco_ds/models/attention.py).
    attention_dispatch: bool = False
    # Whether the transformer's attention takes a mask over padded prompt tokens (a backend without
    # mask support is refused for it: paco_ds/models/attention.py)
    text_attention_mask: bool = False
    # The longest prompt the family's text encoder reads (model.max_sequence_length is checked
    # against it before anything loads); None: no limit of its own. A tiny twin whose encoder holds a
    # shorter position table says so in `tiny_max_sequence_length_limit`.
    max_sequence_length_limit: int | None = None
    tiny_max_sequence_length_limit: int | None = None
    # A video family: `decode` gives uint8 [B, F, 3, H, W] (`num_frames` frames, `model.num_frames` or
    # the family's default, `tiny_num_frames` for its tiny twin) and rewards receive each sample as
    # its frames; an image family decodes [B, 3, H, W] and takes no model.num_frames.
    video: bool = False
    default_num_frames: int = 1
    tiny_num_frames: int = 1

    # ------------------------------------------------------------------ what a family declares
    # The checkpoint's transformer class ('diffusers:Name'), loaded partitioned under ZeRO-3, and its
    # other parts (component name = subfolder -> Part); every part with weights is frozen and held
    # on the device by `hold_frozen`. A family loads anything else (a flag of model_index.json, a
    # class the folder names) in `checkpoint_extras`.
    transformer_class: str = ""
    parts: dict[str, Part] = {}
    # The offline tiny twin's builder, 'module:function(spec, seed, **tiny_options)' (models/tiny/).
    tiny_builder: str = ""
    tiny_options: dict = {}
    # `model.max_sequence_length` as a constructor keyword: False for a family whose text encoder
    # reads the whole prompt; `tiny_prompt_cap` bounds it for tiny twins whose encoders are T5s
    # with short position tables (None: the tiny encoder reads long prompts too).
    takes_max_sequence_length: bool = True
    tiny_prompt_cap: int | None = 64
    # parallel.sequence: the ranks the transformer's tokens are split over (paco_ds/models/sequence.py
    # sets it); a family that masks its padded prompt tokens pads them to a multiple of it
    sequence_degree: int = 1
    # Per device: the empty prompt's embeddings, for families with classifier-free guidance (their
    # constructor encodes it once into `negative`; `negative_here` copies it to the device once).
    negative: "TextEmbeds | None" = None
    _negative_here: "TextEmbeds | None" = None

    @classmethod
    def calls_per_step(cls, guidance: float) -> int:
        """Transformer calls per sampling step at `guidance` (`sample.guidance_scale`): one, where a
        family guides on one batched call or not at all; a family that makes the unconditional call
        apart says so."""
        return 1

    @classmethod
    def sequence_length_limit(cls, tiny: bool) -> int | None:
        """model.max_sequence_length's limit for the full-size family, or for its tiny twin."""
        if tiny and cls.tiny_max_sequence_length_limit is not None:
            return cls.tiny_max_sequence_length_limit
        return cls.max_sequence_length_limit

    # ------------------------------------------------------------------ construction
    @classmethod
    def load(cls, cfg: "ModelConfig", device: torch.device, ds_config: dict | None = None,
             source: ModelSource | None = None) -> "Policy":
        """The family's checkpoint at `cfg.path` (hub id or local directory in diffusers' layout), or
        its tiny offline parts when `cfg.tiny` (`source`: where else the modules come from). With a
        ZeRO-3 `ds_config` the transformer is built and loaded partitioned (zero_load.py): each rank
        holds only its share from the start, bit-identical to a plain load once gathered. The tiny
        model is always built whole: it has no checkpoint to stream from and is small enough that
        `deepspeed.initialize` partitioning it afterwards costs nothing."""
        from paco_ds.runtime.dtypes import resolve_dtype

        source = source or ModelSource()
        dtype = resolve_dtype(cfg.dtype, device)
        parts = source.parts(cls, cfg, dtype, ds_config)
        source.place(parts["transformer"], device, dtype, cfg, ds_config)
        with source.constructing():
            return cls(device=device, dtype=dtype, **parts, **cls.options(cfg))

    @classmethod
    def tiny_parts(cls, spec: "TinyModelConfig") -> dict:
        """The constructor's components at toy size, built offline (paco_ds/models/tiny/)."""
        if not cls.tiny_builder:
            raise NotImplementedError(f"{cls.__name__} has no tiny model (model.tiny)")
        return import_class(cls.tiny_builder)(spec, seed=spec.seed, **cls.tiny_options)

    @classmethod
    def from_pretrained(cls, path: str, revision: str | None, dtype: torch.dtype, ds_config: dict | None = None) -> dict:
        """The constructor's components from a checkpoint in diffusers' layout, as the family declares
        them (`transformer_class`, `parts`, `checkpoint_extras`); only runs where the weights are.
        Under ZeRO-3 the transformer is loaded partitioned; the other parts whole on every rank."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        from paco_ds.models.zero_load import load_transformer

        kw = revision_kwargs(revision)
        log.info("loading %s components from %s", getattr(cls, "display_name", cls.__name__), path)
        out = {"transformer": load_transformer(import_class(cls.transformer_class), path, revision, dtype, ds_config)}
        out |= {name: part.load(path, name, dtype, kw) for name, part in cls.parts.items()}
        out["scheduler_config"] = dict(FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler", **kw))
        return out | cls.checkpoint_extras(path, dtype, kw)

    @classmethod
    def checkpoint_extras(cls, path: str, dtype: torch.dtype, kw: dict) -> dict:
        """Components beyond the declared parts, read from the checkpoint (default: none)."""
        return {}

    @classmethod
    def options(cls, cfg: "ModelConfig") -> dict:
        """Constructor keywords taken from the model section: the prompt length (capped at
        `tiny_prompt_cap` tokens for the tiny twins' short text encoders), a video family's frames."""
        out = {"num_frames": cls.frames(cfg)} if cls.video else {}
        if not cls.takes_max_sequence_length:
            return out
        cap = cls.tiny_prompt_cap if cfg.tiny else None
        return out | {"max_sequence_length": min(cfg.max_sequence_length, cap) if cap else cfg.max_sequence_length}

    @classmethod
    def frames(cls, cfg: "ModelConfig") -> int:
        """The frames of each sample under the model section: model.num_frames, else the family's own
        (its tiny twin's for model.tiny); 1 for an image family."""
        if not cls.video:
            return 1
        return cfg.num_frames or (cls.tiny_num_frames if cfg.tiny else cls.default_num_frames)

    @classmethod
    def check_recipe(cls, cfg) -> None:
        """The family's own checks of a recipe (`cfg`: the whole Config), before anything loads
        (preflight, --dry-run): one ConfigError naming the key. Here: model.num_frames is a video
        family's (`check_num_frames` holds its rule)."""
        from paco_ds.errors import ConfigError

        n = cfg.model.num_frames
        if n is not None and not cls.video:
            raise ConfigError(f"config key 'model.num_frames': model.family '{cfg.model.family}' draws images, "
                              "not videos; leave it unset")
        why = cls.check_num_frames(cls.frames(cfg.model)) if cls.video else None
        if why:
            raise ConfigError(f"config key 'model.num_frames': {why}")

    @classmethod
    def check_num_frames(cls, n: int) -> str | None:
        """Why a video family cannot draw `n` frames, or None."""
        return None

    @classmethod
    def lora_files(cls, state_dict: dict) -> dict[str, dict]:
        """The exported adapter's files: folder (relative to the export's, "" for itself) -> the LoRA
        weights written there. One file, which the family's pipeline reads with `load_lora_weights`;
        a family with two transformers writes the second one's beside it (Wan2.2-A14B)."""
        return {"": state_dict}

    def take(self, device: torch.device, dtype: torch.dtype, **modules) -> None:
        """Keep the constructor's transformer and parts (as attributes of the same names) for `device`
        and `dtype`, the frozen parts held there (`hold_frozen`)."""
        for name, module in modules.items():
            setattr(self, name, module)
        self.device, self.dtype = device, dtype
        self.hold_frozen()

    def hold_frozen(self) -> None:
        """The declared parts with weights: no gradients, eval mode, on the policy's device in the
        model dtype (or fp32 where the part says so)."""
        for name, part in self.parts.items():
            if part.dtype is not None:
                module = getattr(self, name)
                module.requires_grad_(False).eval()
                move_module(module, self.device, part.torch_dtype(self.dtype))

    def negative_here(self) -> "TextEmbeds":
        """The empty prompt's embeddings on the device: copied from `negative` once per device."""
        if self._negative_here is None:
            self._negative_here = self.negative.to(self.device, self.dtype)
        return self._negative_here

    def to_device(self, device: torch.device) -> None:
        """Work on `device` from now on (the GPU plan's training pass moves to fake meta tensors):
        what was copied to the old device is copied again."""
        self.device = device
        self._negative_here = None

    @abstractmethod
    def encode_prompts(self, prompts: list[str], condition: "Condition | None" = None) -> TextEmbeds:
        """Text conditioning, computed once per sample; an editing policy whose text encoder also
        reads the reference image (Qwen-Image-Edit) takes it from `condition`."""

    @abstractmethod
    def latent_seq_len(self, height: int, width: int) -> int:
        """Number of image tokens the transformer sees (drives the schedule shift)."""

    @abstractmethod
    def initial_latents(self, batch: int, height: int, width: int, generators: list[torch.Generator]) -> torch.Tensor:
        """Packed Gaussian latents [B, L, C], one generator per sample (CPU generators)."""

    @abstractmethod
    def velocity(self, module: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, embeds: TextEmbeds,
                 height: int, width: int, guidance: float, condition: Condition | None = None) -> torch.Tensor:
        """One transformer forward through `module` (the transformer or its engine); an editing
        policy reads its condition latents beside the noisy ones and returns the target part."""

    def encode_condition(self, images: list[torch.Tensor], height: int, width: int) -> Condition:
        """Reference images (uint8 [3, H_i, W_i] each, original sizes) -> a Condition for a target
        of height x width; editing policies override this."""
        raise NotImplementedError(f"{type(self).__name__} generates from text alone: it takes no condition images")

    @abstractmethod
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents -> uint8 images [B, 3, H, W] on CPU."""

    def target_size(self, ref_height: int, ref_width: int, resolution: int | tuple[int, int]) -> tuple[int, int]:
        """An edit's (height, width): the reference's aspect ratio at about resolution^2 pixels (a
        [height, width] resolution: its area), each side rounded to `size_multiple` (no square squash)."""
        if not isinstance(resolution, int):
            resolution = (resolution[0] * resolution[1]) ** 0.5
        m = self.size_multiple
        aspect = ref_width / ref_height
        h = max(m, round(resolution / aspect ** 0.5 / m) * m)
        w = max(m, round(resolution * aspect ** 0.5 / m) * m)
        return h, w

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        return flux_sigmas(num_steps, self.latent_seq_len(height, width), self.shift)

    def text_encoders(self) -> list[nn.Module]:
        """The frozen prompt encoders. Only sampling and evaluation run them: scoring and training
        read the embeddings each rollout cached."""
        return [m for m in (getattr(self, "text_encoder", None), getattr(self, "text_encoder_2", None)) if m is not None]

    def park_text_encoders(self, parked: bool) -> None:
        """Keep the text encoders in host memory while no prompt is encoded (parked), on the device
        otherwise. On a GPU this frees their memory for scoring and training (T5-XXL 8.9 GiB,
        Qwen2.5-VL-7B 15.4 GiB per rank, docs/gpu_plan.md); on a CPU there is nothing to move."""
        if self.device.type == "cpu":
            return
        target = torch.device("cpu") if parked else self.device
        for m in self.text_encoders():
            p = next(m.parameters(), None)
            if p is not None and p.device != target:  # moved only when elsewhere (no copy to where it is)
                m.to(target)

    @contextlib.contextmanager
    def adapter_disabled(self, module: nn.Module | None = None) -> Iterator[None]:
        """The base model (LoRA off): the KL reference policy."""
        model = getattr(module, "module", module) or self.transformer
        model.disable_adapters()
        try:
            yield
        finally:
            model.enable_adapters()


class PackedPolicy(Policy):
    """A policy whose transformer reads its latents as 2x2 patches (FLUX, SD3, Qwen-Image): image
    sides are multiples of twice the VAE's downsampling, and a height x width image is
    (h/2)(w/2) tokens of the h x w latent."""

    vae_scale_factor: int

    def use_vae(self, vae: nn.Module) -> None:
        """The latent geometry of an autoencoder that halves the image `len(block_out_channels) - 1`
        times: sides in multiples of twice its factor (the 2x2 patches), its latent channels."""
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.size_multiple = self.vae_scale_factor * 2
        self.latent_channels = vae.config.latent_channels

    def latent_hw(self, height: int, width: int) -> tuple[int, int]:
        """The unpacked latent's size (both even, for the 2x2 packing)."""
        f = self.size_multiple
        if height % f or width % f:
            raise ValueError(f"image size {height}x{width} must be a multiple of {f}")
        return height // self.vae_scale_factor, width // self.vae_scale_factor

    def latent_seq_len(self, height: int, width: int) -> int:
        """The generated image's tokens: they drive the time shift (an edit's condition tokens do not)."""
        h, w = self.latent_hw(height, width)
        return (h // 2) * (w // 2)

    latent_channels: int

    def initial_latents(self, batch: int, height: int, width: int, generators: list[torch.Generator]) -> torch.Tensor:
        """One draw per sample from its own CPU generator, so a sample's noise does not depend on
        the batch it lands in."""
        h, w = self.latent_hw(height, width)
        noise = torch.stack([torch.randn(self.latent_channels, h, w, generator=g) for g in generators])
        return self.pack(noise).to(self.device, self.dtype)

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return pack_2x2(latents)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """An AutoencoderKL's decode of the unpacked latents (scaled and shifted as its config says),
        in the dtype the VAE is held in."""
        vae_dtype = self.parts["vae"].torch_dtype(self.dtype) if "vae" in self.parts else self.dtype
        x = self.unpack(latents.to(self.device, vae_dtype), height, width)
        x = x / self.vae.config.scaling_factor + (self.vae.config.shift_factor or 0.0)
        return to_uint8(self.vae.decode(x, return_dict=False)[0])

    def unpack(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return unpack_2x2(latents, *self.latent_hw(height, width))


def move_module(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Move only when needed (diffusers warns on a no-op dtype cast)."""
    p = next(module.parameters(), None)
    if p is not None and (p.device != device or p.dtype != dtype):
        module.to(device=device, dtype=dtype)
