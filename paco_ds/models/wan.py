"""Wan as a `Policy`: text-to-video with Wan2.1 (1.3B and 14B: `model.path` chooses) and, as the
`wan22_ti2v` family, Wan2.2-TI2V-5B with its own autoencoder (48 latent channels, 16x in space).

The components are driven as diffusers' `WanPipeline` (pipelines/wan/pipeline_wan.py) drives them:

- prompts: the pipeline's `prompt_clean` (ftfy where installed, HTML unescaped, whitespace folded),
  UMT5 tokens padded and cut to `model.max_sequence_length` (512, the pipeline's default), the
  encoder's last hidden states of the valid tokens, zero-padded to `max_sequence_length` rows: the
  transformer reads the zero rows unmasked, as in the pipeline. They are cached per sample trimmed to
  the batch's longest prompt (with their mask) and padded again for every forward.
- latents: [B, C, F', H', W'] of `AutoencoderKLWan`, F' = (F - 1) / 4 + 1 and H' = H / 8 (16 for
  TI2V-5B's autoencoder), kept in that 5-D layout: the transformer patchifies (1, 2, 2) itself and
  the SDE step and the log-prob kernels reduce each sample over all its elements, whatever their
  shape. Decoding de-normalises with the autoencoder's `latents_mean` / `latents_std`, as the
  pipeline does, in fp32 (the autoencoder is held in fp32, as diffusers' Wan examples load it).
- schedule: the checkpoint's scheduler config. The published checkpoints ship UniPC with flow
  sigmas (`use_flow_sigmas`, `flow_shift` 3; 5 for TI2V-5B): its sigmas linspace(1, 1/1000, N + 1)
  without the last, shifted by s -> shift s / (1 + (shift - 1) s), the first lowered by 1e-6, then
  0; the transformer reads the scheduler's integer timesteps (1000 sigma, truncated, as its int64
  cast gives them). A FlowMatchEulerDiscreteScheduler config (a fixed shift) is also read (SD3's
  sigmas, timestep 1000 sigma). The rollout steps these sigmas with the ODE (Euler) or the SDE step;
  the pipeline's UniPC multistep corrector is not used: the SDE and its log-prob need one
  Gaussian transition per step.
- guidance: `sample.guidance_scale` above 1 is classifier-free guidance with the empty negative
  prompt (the pipeline's default negative), v = v_u + g (v_c - v_u), cond and uncond in two calls as
  the pipeline makes them; v_u runs without gradients (Flow-GRPO's `compute_log_prob` detaches it),
  so training keeps the activations of the conditional call only (`train/forwards_per_step` 2).
- TI2V-5B (`expand_timesteps` in its model_index.json): the timestep is given per latent token,
  as the pipeline does for text-to-video there (every token at t).

A checkpoint with two experts (Wan2.2-A14B's `transformer_2`) is the `wan22` family's (wan22.py).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from paco_ds.models.base import Part, Policy, TextEmbeds, to_uint8
from paco_ds.models.full_size import FullSize, empty
from paco_ds.models.schedule import ShiftConfig
from paco_ds.models.sd3 import sd3_sigmas
from paco_ds.recipe.schema import ModelConfig

# The full-size models (models/full_size.py), from the published diffusers checkpoints' configs
# (Wan-AI/Wan2.1-T2V-14B-Diffusers, -1.3B-Diffusers, Wan2.2-TI2V-5B-Diffusers; the values diffusers'
# scripts/convert_wan_to_diffusers.py writes).
WAN21_14B_TRANSFORMER = {
    "patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None, "added_kv_proj_dim": None,
    "rope_max_seq_len": 1024,
}
WAN21_1_3B_TRANSFORMER = WAN21_14B_TRANSFORMER | {"num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}
WAN22_TI2V_5B_TRANSFORMER = WAN21_14B_TRANSFORMER | {"num_attention_heads": 24, "ffn_dim": 14336, "num_layers": 30,
                                                      "in_channels": 48, "out_channels": 48}
WAN21_VAE: dict = {}  # AutoencoderKLWan's defaults are Wan2.1's autoencoder (base 96, 16 latent channels)
WAN22_VAE = {  # Wan2.2's residual autoencoder: 2x2 patchify, 16x in space, 48 latent channels
    "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "is_residual": True, "in_channels": 12, "out_channels": 12,
    "patch_size": 2, "scale_factor_temporal": 4, "scale_factor_spatial": 16,
    "latents_mean": [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813,
                     0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108,
                     -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313,
                     -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944,
                     0.3573, -0.0548, -0.1681, -0.0667],
    "latents_std": [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
                    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
                    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744],
}
UMT5_XXL = {  # google/umt5-xxl's encoder, the text_encoder of every Wan checkpoint
    "vocab_size": 256384, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "feed_forward_proj": "gated-gelu",
    "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1,
    "decoder_start_token_id": 0,
}


def umt5_xxl() -> nn.Module:
    """UMT5-XXL's encoder on meta with its token embedding once (the checkpoint ties
    `encoder.embed_tokens` to `shared`; a model built from its config holds a second 1.05B copy)."""
    from transformers import UMT5Config, UMT5EncoderModel

    model = empty(lambda: UMT5EncoderModel(UMT5Config(**UMT5_XXL)))
    model.encoder.embed_tokens = model.shared
    return model


def wan_transformer(config: dict):
    def build() -> nn.Module:
        from diffusers import WanTransformer3DModel

        return empty(lambda: WanTransformer3DModel(**config))
    return build


def wan_components(vae: dict, scheduler: str, expand_timesteps: bool = False):
    """The full-size parts beside the transformer: the autoencoder (fp32, as the policy holds it),
    UMT5-XXL with the offline T5 tokenizer (its ids fit UMT5's vocabulary), the published scheduler
    config and the pipeline's flags."""
    def build(cfg: ModelConfig) -> dict:
        from diffusers import AutoencoderKLWan

        from paco_ds.models.tiny import t5_tokenizer
        from paco_ds.models.tiny import wan as tiny_wan

        return {"vae": empty(lambda: AutoencoderKLWan(**vae)), "text_encoder": umt5_xxl(), "tokenizer": t5_tokenizer(),
                "scheduler_config": dict(getattr(tiny_wan, scheduler)), "boundary_ratio": None,
                "expand_timesteps": expand_timesteps}
    return build


def wan_sigmas(num_steps: int, config: dict) -> tuple[torch.Tensor, dict[float, float]]:
    """(num_steps + 1 sigmas in fp32, ending at 0; the transformer's timestep of each) of the
    checkpoint's scheduler config: UniPC's flow sigmas with its integer timesteps, or a fixed-shift
    FlowMatchEulerDiscreteScheduler's sigmas with timestep 1000 sigma."""
    n_train = int(config.get("num_train_timesteps", 1000))
    if config.get("use_flow_sigmas"):
        s = np.linspace(1, 1 / n_train, num_steps + 1)[:-1]
        shift = float(config.get("flow_shift", 1.0))
        s = shift * s / (1 + (shift - 1) * s)
        if abs(s[0] - 1) < 1e-6:  # the scheduler's own guard against log(0) in its multistep update
            s[0] -= 1e-6
        times = (s * n_train).astype(np.int64)  # the scheduler's int64 timesteps
        sigmas = torch.from_numpy(np.concatenate([s, [0.0]]).astype(np.float32))
        return sigmas, {float(v): float(t) for v, t in zip(sigmas[:-1].tolist(), times.tolist())}
    sigmas = sd3_sigmas(num_steps, float(config.get("shift", 1.0)), n_train)
    return sigmas, {float(v): float(v) * n_train for v in sigmas[:-1].tolist()}


def check_scheduler(config: dict, family: str) -> None:
    """Refuse a scheduler config whose sigmas `wan_sigmas` does not compute."""
    unsupported = ("use_dynamic_shifting", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                   "shift_terminal", "invert_sigmas")
    asks = [k for k in unsupported if config.get(k)]
    if config.get("final_sigmas_type", "zero") != "zero":
        asks.append("final_sigmas_type")
    if asks:
        raise ValueError(f"unsupported {family} scheduler config ({', '.join(asks)} in {config}): only UniPC's flow "
                         "sigmas with a fixed flow_shift, or FlowMatchEulerDiscreteScheduler with a fixed shift")


class WanPolicy(Policy):
    display_name = "Wan2.1"
    video = True
    default_path = "Wan-AI/Wan2.1-T2V-14B-Diffusers"  # Wan-AI/Wan2.1-T2V-1.3B-Diffusers loads with model.path
    default_num_frames = 81  # the pipeline's default (5 s at 16 fps)
    tiny_num_frames = 5  # two latent frames: the causal first frame and one group of four
    size_multiple = 16  # the autoencoder's 8x times the transformer's 2x2 patches
    frame_step = 4  # the autoencoder's temporal downsampling: F = 4k + 1 frames
    attention_dispatch = True  # WanAttnProcessor calls diffusers' dispatch_attention_fn
    # The attention (self and cross) and feed-forward of every block, in diffusers' names (Flow-Factory's
    # Wan targets, src/flow_factory/models/wan/wan2_t2v.py)
    lora_targets = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")
    full_size = FullSize(wan_transformer(WAN21_14B_TRANSFORMER), wan_components(WAN21_VAE, "WAN_SCHEDULER_CONFIG"),
                         fp32=("vae",), variants={"Wan-AI/Wan2.1-T2V-1.3B-Diffusers": FullSize(
                             wan_transformer(WAN21_1_3B_TRANSFORMER),
                             wan_components(WAN21_VAE, "WAN_SCHEDULER_CONFIG"), fp32=("vae",))})
    transformer_class = "diffusers:WanTransformer3DModel"
    parts = {"vae": Part("diffusers:AutoencoderKLWan", "fp32"), "text_encoder": Part("transformers:UMT5EncoderModel"),
             "tokenizer": Part("transformers:AutoTokenizer", None)}
    tiny_builder = "paco_ds.models.tiny.wan:tiny_wan_components"

    def __init__(self, transformer: nn.Module, vae: nn.Module, text_encoder: nn.Module, tokenizer,
                 scheduler_config: dict, device: torch.device, dtype: torch.dtype, max_sequence_length: int = 512,
                 num_frames: int = 81, boundary_ratio: float | None = None, expand_timesteps: bool = False):
        self.check_experts(boundary_ratio)
        check_scheduler(scheduler_config, self.display_name)
        why = self.check_num_frames(num_frames)
        if why:
            raise ValueError(f"model.num_frames: {why}")
        self.scheduler_config = dict(scheduler_config)
        self.num_train_timesteps = int(scheduler_config.get("num_train_timesteps", 1000))
        self.shift = ShiftConfig(use_dynamic_shifting=False, shift=float(
            scheduler_config.get("flow_shift", scheduler_config.get("shift", 1.0))))
        self.boundary_ratio, self.expand_timesteps = boundary_ratio, bool(expand_timesteps)
        self.max_sequence_length, self.num_frames = max_sequence_length, num_frames
        self.vae_scale_factor = int(vae.config.scale_factor_spatial)
        self.frame_step = int(vae.config.scale_factor_temporal)
        self.size_multiple = self.vae_scale_factor * 2  # the (1, 2, 2) patches
        self.latent_channels = int(vae.config.z_dim)
        self._timesteps: dict[float, float] = {}  # sigma -> the transformer's timestep, of the schedules made
        self.take(device, dtype, transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)
        self.negative = self.encode_prompts([""]).to("cpu")  # the pipeline's default negative prompt

    # ------------------------------------------------------------------ declarations
    @classmethod
    def check_num_frames(cls, n: int) -> str | None:
        if (n - 1) % cls.frame_step:
            lower = (n - 1) // cls.frame_step * cls.frame_step + 1
            return (f"{n} frames: the {cls.display_name} autoencoder compresses time {cls.frame_step}x after the first "
                    f"frame, so a video has {cls.frame_step}k + 1 frames (e.g. {max(lower, 1)} or "
                    f"{lower + cls.frame_step})")
        return None

    @classmethod
    def check_experts(cls, boundary_ratio: float | None) -> None:
        if boundary_ratio is not None:
            raise ValueError(f"the checkpoint has two experts (transformer and transformer_2, boundary_ratio "
                             f"{boundary_ratio}): it is model.family wan22's")

    @classmethod
    def from_pretrained(cls, path: str, revision: str | None, dtype: torch.dtype, ds_config: dict | None = None) -> dict:
        """The declared parts; a checkpoint of the other Wan family is refused before any weight loads."""
        from paco_ds.models.base import revision_kwargs

        cls.check_experts(cls.checkpoint_extras(path, dtype, revision_kwargs(revision))["boundary_ratio"])
        return super().from_pretrained(path, revision, dtype, ds_config)

    @classmethod
    def checkpoint_extras(cls, path: str, dtype: torch.dtype, kw: dict) -> dict:
        """The pipeline's flags from the checkpoint's model_index.json: Wan2.2's expert boundary and
        TI2V-5B's per-token timesteps."""
        from diffusers import WanPipeline

        index = WanPipeline.load_config(path, **kw)
        return {"boundary_ratio": index.get("boundary_ratio"), "expand_timesteps": bool(index.get("expand_timesteps"))}

    # ------------------------------------------------------------------ prompts
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], condition=None) -> TextEmbeds:
        """One UMT5 forward for the batch, as WanPipeline._get_t5_prompt_embeds: the valid tokens'
        last hidden states, zero after each prompt's end, trimmed to the longest, with their mask."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        if condition is not None:
            raise ValueError(f"{self.display_name} generates from text alone: it takes no condition images")
        inputs = self.tokenizer([prompt_clean(p) for p in prompts], padding="max_length",
                                max_length=self.max_sequence_length, truncation=True, add_special_tokens=True,
                                return_attention_mask=True, return_tensors="pt")
        mask = inputs.attention_mask.to(self.text_encoder.device)
        hidden = self.text_encoder(inputs.input_ids.to(self.text_encoder.device), mask).last_hidden_state
        lengths = mask.gt(0).sum(dim=1)
        width = int(lengths.max())
        valid = (torch.arange(width, device=hidden.device)[None] < lengths[:, None])
        embeds = hidden[:, :width] * valid[..., None].to(hidden.dtype)
        return TextEmbeds(prompt_embeds=embeds.to(self.dtype), mask=valid.long())

    def text_rows(self, embeds: TextEmbeds) -> torch.Tensor:
        """[B, max_sequence_length, D] on the device: the cached rows zero-padded as the pipeline pads them."""
        text = embeds.prompt_embeds.to(self.device, self.dtype)
        if embeds.mask is not None:
            text = text * embeds.mask.to(self.device)[..., None].to(text.dtype)
        return nn.functional.pad(text, (0, 0, 0, self.max_sequence_length - text.shape[1]))

    # ------------------------------------------------------------------ schedule and latents
    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        sigmas, times = wan_sigmas(num_steps, self.scheduler_config)
        self._timesteps.update(times)
        return sigmas

    def timesteps(self, sigma, batch: int) -> torch.Tensor:
        """[B] float32 host timesteps the transformer reads for these sigmas (the scheduler's own: an
        integer for UniPC's flow sigmas), one per row."""
        sigma = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1).expand(batch).cpu()
        n = self.num_train_timesteps
        return torch.tensor([self._timesteps.get(s, float(np.int64(s * n)) if self.scheduler_config.get(
            "use_flow_sigmas") else s * n) for s in sigma.tolist()], dtype=torch.float32)

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(C, F', H', W') of a sample of height x width pixels and `num_frames` frames."""
        m = self.size_multiple
        if height % m or width % m:
            raise ValueError(f"video size {height}x{width} must be a multiple of {m}")
        f = self.vae_scale_factor
        return self.latent_channels, (self.num_frames - 1) // self.frame_step + 1, height // f, width // f

    def latent_seq_len(self, height: int, width: int) -> int:
        _, frames, h, w = self.latent_shape(height, width)
        return frames * (h // 2) * (w // 2)

    def initial_latents(self, batch: int, height: int, width: int, generators: list[torch.Generator]) -> torch.Tensor:
        """[B, C, F', H', W'] Gaussian latents, one draw per sample from its own CPU generator (the
        pipeline's prepare_latents draws the same with that generator)."""
        shape = self.latent_shape(height, width)
        return torch.stack([torch.randn(shape, generator=g) for g in generators]).to(self.device, self.dtype)

    # ------------------------------------------------------------------ transformer / VAE
    @classmethod
    def calls_per_step(cls, guidance: float) -> int:
        return 2 if guidance > 1 else 1  # the unconditional velocity is a call of its own (velocity)

    def velocity(self, module: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, embeds: TextEmbeds,
                 height: int, width: int, guidance: float, condition=None) -> torch.Tensor:
        """The guided velocity, shaped like `latents`: one transformer call, and a second one for the
        unconditional velocity when guidance > 1 (`calls_per_step`)."""
        if condition is not None:
            raise ValueError(f"{self.display_name} generates from text alone: it takes no condition images")
        b = latents.shape[0]
        t = self.timesteps(sigma, b)
        x = latents.to(self.device, self.dtype)
        out = self.transformer_call(module, x, t, self.text_rows(embeds))
        if guidance > 1:
            # The unconditional velocity in a call of its own, as the pipeline makes it, and without
            # gradients (compute_log_prob's stop-gradient): its activations are not kept, which halves
            # a training forward's (a video's are the largest part of its memory), and sampling makes
            # the same two calls, so a training step recomputes the sampled log-prob exactly.
            with torch.no_grad():
                uncond = self.transformer_call(module, x, t, self.text_rows(self.negative_here()).expand(b, -1, -1))
            out = uncond + guidance * (out - uncond)
        return out

    def transformer_call(self, module: nn.Module, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """One transformer call through `module` at host timesteps `t` ([B])."""
        return module(hidden_states=x, timestep=self.timestep_input(t, x), encoder_hidden_states=text,
                      return_dict=False)[0]

    def timestep_input(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The timestep as the pipeline hands it over: [B] (an int64 tensor for UniPC's integer
        timesteps), or per token [B, F' H'/2 W'/2] with TI2V-5B's expand_timesteps."""
        if self.expand_timesteps:
            tokens = x.shape[2] * (x.shape[3] // 2) * (x.shape[4] // 2)
            return t.to(self.device)[:, None].expand(-1, tokens).contiguous()
        integer = self.scheduler_config.get("use_flow_sigmas") and bool((t == t.round()).all())
        return t.to(self.device, torch.int64 if integer else torch.float32)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """[B, C, F', H', W'] latents -> uint8 videos [B, F, 3, H, W] on the CPU: de-normalised with the
        autoencoder's latents_mean / latents_std and decoded in fp32, as WanPipeline does."""
        c = self.vae.config
        x = latents.to(self.device, torch.float32)
        mean = torch.tensor(c.latents_mean, dtype=x.dtype, device=x.device).view(1, c.z_dim, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(c.latents_std, dtype=x.dtype, device=x.device).view(1, c.z_dim, 1, 1, 1)
        video = self.vae.decode(x / inv_std + mean, return_dict=False)[0]  # [B, 3, F, H, W] in [-1, 1]
        return to_uint8(video.transpose(1, 2))


class WanTI2VPolicy(WanPolicy):
    """Wan2.2-TI2V-5B text-to-video: WanPolicy's code on its own checkpoint (Wan2.2's 48-channel
    autoencoder, per-token timesteps, flow_shift 5), with its own full-size model and tiny twin."""

    display_name = "Wan2.2-TI2V-5B"
    default_path = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
    default_num_frames = 121  # the model card's 5 s at 24 fps
    size_multiple = 32  # the 16x autoencoder times the 2x2 patches
    full_size = FullSize(wan_transformer(WAN22_TI2V_5B_TRANSFORMER),
                         wan_components(WAN22_VAE, "WAN_TI2V_SCHEDULER_CONFIG", expand_timesteps=True), fp32=("vae",))
    tiny_options = {"ti2v": True}
