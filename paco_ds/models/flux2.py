"""FLUX.2 [dev] as a `Policy`: Black Forest Labs' 32B MMDiT with Mistral-Small-3.1 as the prompt encoder.

The components are driven directly, as diffusers' `Flux2Pipeline` (pipelines/flux2/pipeline_flux2.py,
diffusers 0.42.1) drives them for text-to-image:

- prompts: each prompt as a chat of the pipeline's system message (`SYSTEM_MESSAGE`) and one user
  turn (its `format_input`), through the processor's chat template without a generation prompt,
  padded and cut to `model.max_sequence_length` tokens (512 in the pipeline); the hidden states of
  Mistral-Small-3.1's layers 10, 20 and 30 stacked per token ([B, S, 3 x 5120] = the transformer's
  15360 inputs). No attention mask reaches the transformer: the padding is read as the pipeline
  reads it. Encoded once per sample at rollout and reused by every training forward.
- positions: 4-axis ids (T, H, W, L): a prompt's tokens at (0, 0, 0, l), the image's at (0, h, w, 0).
- latents: 32 channels of the FLUX.2 autoencoder (8x), patchified 2x2 into 128 channels and
  normalised by the autoencoder's batch-norm statistics (running mean and variance of the patched
  latents, `batch_norm_eps`); the transformer reads them as (h/2)(w/2) tokens of 128. The channel
  order of the pipeline's patchify-then-pack is `pack_2x2`'s, so the policy keeps its packed layout.
  Decoding undoes the normalisation and the patches, as the pipeline does.
- schedule: linspace(1, 1/N, N) shifted exponentially by the pipeline's `compute_empirical_mu` of the
  image's tokens and the number of steps (not FLUX.1's linear mu of the tokens alone), then 0.
- time: the transformer reads the scheduler's timestep / 1000 (1000 sigma in the model's dtype,
  divided back), and predicts the flow-matching velocity.
- guidance: FLUX.2-dev is guidance-distilled: `sample.guidance_scale` goes into its guidance
  embedding (the pipeline's `guidance_scale`, 4.0 by default), one transformer forward per step.

Text-to-image only: the pipeline's reference images (their latents at time offsets 10, 20, ... of
the T axis) and caption upsampling are not driven here.

`Flux2KleinPolicy` (flux2_klein.py) is this class with klein's Qwen3 prompt encoder and its
classifier-free guidance; the transformer, latents, schedule and decoding are this file's.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from paco_ds.recipe.schema import ModelConfig
from paco_ds.models.tiny.flux2 import TINY_TEXT_POSITIONS
from paco_ds.models.base import PackedPolicy, Part, TextEmbeds, to_uint8
from paco_ds.models.full_size import FullSize, empty
from paco_ds.models.schedule import ShiftConfig

# The full-size model (models/full_size.py), from black-forest-labs/FLUX.2-dev's config files.
FLUX2_DEV_TRANSFORMER = {
    "patch_size": 1, "in_channels": 128, "num_layers": 8, "num_single_layers": 48, "attention_head_dim": 128,
    "num_attention_heads": 48, "joint_attention_dim": 15360, "timestep_guidance_channels": 256, "mlp_ratio": 3.0,
    "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 2000, "eps": 1e-6, "guidance_embeds": True,
}
FLUX2_VAE = {  # FLUX.2-dev's and klein's autoencoder
    "in_channels": 3, "out_channels": 3, "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4, "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2,
    "act_fn": "silu", "latent_channels": 32, "norm_num_groups": 32, "sample_size": 1024, "use_quant_conv": True,
    "use_post_quant_conv": True, "mid_block_add_attention": True, "batch_norm_eps": 1e-4, "batch_norm_momentum": 0.1,
    "patch_size": [2, 2],
}
FLUX2_SCHEDULER = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15,
                   "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
                   "time_shift_type": "exponential"}
# mistralai/Mistral-Small-3.1-24B-Instruct-2503 (FLUX.2-dev's text_encoder, Mistral3ForConditionalGeneration)
MISTRAL_SMALL_3_1_TEXT = {
    "vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 32768, "num_hidden_layers": 40,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e9}, "sliding_window": None,
    "tie_word_embeddings": False,
}
MISTRAL_SMALL_3_1_VISION = {
    "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
    "image_size": 1540, "patch_size": 14, "num_channels": 3, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
}


def full_size_transformer() -> nn.Module:
    from diffusers import Flux2Transformer2DModel

    return empty(lambda: Flux2Transformer2DModel(**FLUX2_DEV_TRANSFORMER))


def full_size_components(cfg: ModelConfig) -> dict:
    """FLUX.2's autoencoder and Mistral-Small-3.1 (vision tower included, as the checkpoint ships it)
    on meta, with the offline byte-level tokenizer carrying Mistral's chat template."""
    from diffusers import AutoencoderKLFlux2
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from paco_ds.models.tiny.flux2 import mistral_tokenizer

    tok = mistral_tokenizer()
    config = Mistral3Config(
        text_config=dict(MISTRAL_SMALL_3_1_TEXT, model_type="mistral", bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        vision_config=dict(MISTRAL_SMALL_3_1_VISION, model_type="pixtral"),
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2, tie_word_embeddings=False)
    return {"vae": empty(lambda: AutoencoderKLFlux2(**FLUX2_VAE)),
            "text_encoder": empty(lambda: Mistral3ForConditionalGeneration(config)),
            "tokenizer": tok, "scheduler_config": dict(FLUX2_SCHEDULER)}


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """The pipelines' shift (`compute_empirical_mu` of pipeline_flux2.py and pipeline_flux2_klein.py,
    from Black Forest Labs' flux2 sampling code): diffusers' own function."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    return compute_empirical_mu(image_seq_len=image_seq_len, num_steps=num_steps)


class Flux2Policy(PackedPolicy):
    display_name = "FLUX.2-dev"
    default_path = "black-forest-labs/FLUX.2-dev"
    attention_dispatch = True  # Flux2AttnProcessor and Flux2ParallelSelfAttnProcessor dispatch
    # Mistral-Small-3.1's position table (the transformer's text rope has no table: any length runs)
    max_sequence_length_limit = MISTRAL_SMALL_3_1_TEXT["max_position_embeddings"]
    tiny_max_sequence_length_limit = TINY_TEXT_POSITIONS
    # The hidden states the pipeline stacks (`text_encoder_out_layers`, its default)
    text_encoder_out_layers: tuple[int, ...] = (10, 20, 30)
    # FLUX's targets (PaCo-RL's: attention and MLP of both streams of the double blocks) in FLUX.2's
    # names (its MLPs are SwiGLU `linear_in` / `linear_out`), and the single blocks' fused
    # QKV + MLP-in projection, as FLUX's list reaches the single blocks' q, k, v. The single blocks'
    # output projection (`attn.to_out`, a Linear there) is left out: the name also matches the
    # double blocks' `to_out` ModuleList, which peft cannot adapt.
    lora_targets = (
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
        "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
        "attn.to_qkv_mlp_proj",
    )
    full_size = FullSize(full_size_transformer, full_size_components)
    transformer_class = "diffusers:Flux2Transformer2DModel"
    parts = {"vae": Part("diffusers:AutoencoderKLFlux2"),
             "text_encoder": Part("transformers:Mistral3ForConditionalGeneration"),
             "tokenizer": Part("transformers:AutoProcessor", None)}
    tiny_builder = "paco_ds.models.tiny.flux2:tiny_flux2_components"
    # The tiny text encoders read long prompts too (with the byte-level tokenizer dev's system message
    # and its tags alone are 173 tokens).
    tiny_prompt_cap = None

    def __init__(self, transformer: nn.Module, vae: nn.Module, text_encoder: nn.Module, tokenizer,
                 scheduler_config: dict, device: torch.device, dtype: torch.dtype, max_sequence_length: int = 512):
        self.shift = ShiftConfig.of_scheduler(scheduler_config, self.display_name, unsupported=("use_flow_sigmas",))
        self.num_train_timesteps = int(scheduler_config.get("num_train_timesteps", 1000))
        self.max_sequence_length = max_sequence_length
        self.use_vae(vae)  # 2x2 patches of its latents
        self.take(device, dtype, transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)

    # ------------------------------------------------------------------ prompts
    def _no_condition(self, condition) -> None:
        if condition is not None:
            raise ValueError(f"{self.display_name} is driven for text-to-image only: it takes no condition images")

    def _prompt_inputs(self, prompts: list[str]) -> dict:
        """Token ids and attention mask of the prompts, as `_get_mistral_3_small_prompt_embeds`
        makes them: the system message and the prompt in the chat template, padded to the length."""
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        return self.tokenizer.apply_chat_template(
            format_input(prompts=list(prompts), system_message=SYSTEM_MESSAGE), add_generation_prompt=False,
            tokenize=True, return_dict=True, return_tensors="pt", padding="max_length", truncation=True,
            max_length=self.max_sequence_length)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], condition=None) -> TextEmbeds:
        """One text-encoder forward for the batch; the chosen layers' hidden states side by side per
        token. The language model alone is run (its output head's logits are not read)."""
        self._no_condition(condition)
        inputs = self._prompt_inputs(prompts)
        out = self.text_encoder.model(input_ids=inputs["input_ids"].to(self.device),
                                      attention_mask=inputs["attention_mask"].to(self.device),
                                      output_hidden_states=True, use_cache=False)
        hidden = torch.stack([out.hidden_states[k] for k in self.text_encoder_out_layers], dim=1)
        b, n, s, d = hidden.shape
        return TextEmbeds(prompt_embeds=hidden.permute(0, 2, 1, 3).reshape(b, s, n * d).to(self.dtype))

    # ------------------------------------------------------------------ positions and schedule
    def text_ids(self, length: int) -> torch.Tensor:
        """(T, H, W, L) = (0, 0, 0, l) for each prompt token (the pipeline's `_prepare_text_ids`)."""
        ids = torch.zeros(length, 4, dtype=torch.long)
        ids[:, 3] = torch.arange(length)
        return ids.to(self.device)

    def image_ids(self, height: int, width: int) -> torch.Tensor:
        """(0, h, w, 0) for each 2x2 patch, row-major (the pipeline's `_prepare_latent_ids`)."""
        h, w = self.latent_hw(height, width)
        return torch.cartesian_prod(torch.arange(1), torch.arange(h // 2), torch.arange(w // 2),
                                    torch.arange(1)).to(self.device)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """The pipelines' schedule: linspace(1, 1/N, N), shifted by e^mu / (e^mu + 1/s - 1) with mu =
        compute_empirical_mu(image tokens, N) (or a fixed shift if the scheduler has no dynamic one), then 0."""
        raw = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)
        if self.shift.use_dynamic_shifting:
            e = math.exp(empirical_mu(self.latent_seq_len(height, width), num_steps))
            shifted = e / (e + (1.0 / raw - 1.0))
        else:
            shifted = self.shift.shift * raw / (1 + (self.shift.shift - 1) * raw)
        return torch.cat([shifted, torch.zeros(1, dtype=torch.float64)]).to(torch.float32)

    # ------------------------------------------------------------------ transformer / VAE
    def _timestep(self, sigma, b: int) -> torch.Tensor:
        """What the pipeline hands the transformer: its timestep 1000 sigma in the model's dtype, / 1000."""
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(b)
        n = self.num_train_timesteps
        return (sigma * n).to(self.dtype) / n

    def _call(self, module: nn.Module, latents: torch.Tensor, t: torch.Tensor, text: torch.Tensor,
              guidance: torch.Tensor | None, height: int, width: int) -> torch.Tensor:
        """One transformer call on packed latents [B, L, C] and prompt embeddings [B, S, D]. The ids go
        with a batch dimension of one, as the pipeline passes them: the transformer reads the first row,
        and sequence parallelism splits ids of that shape with the tokens (its `_cp_plan`)."""
        return module(hidden_states=latents.to(self.dtype), timestep=t, guidance=guidance,
                      encoder_hidden_states=text.to(self.device, self.dtype),
                      txt_ids=self.text_ids(text.shape[1])[None], img_ids=self.image_ids(height, width)[None],
                      return_dict=False)[0]

    def velocity(self, module: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, embeds: TextEmbeds,
                 height: int, width: int, guidance: float, condition=None) -> torch.Tensor:
        """The velocity, packed like `latents`: one forward with the guidance embedding at `guidance`."""
        self._no_condition(condition)
        b = latents.shape[0]
        g = torch.full((b,), guidance, device=self.device, dtype=torch.float32)
        return self._call(module, latents.to(self.device), self._timestep(sigma, b), embeds.prompt_embeds, g,
                          height, width)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Undo the batch-norm normalisation on the packed tokens' 128 channels, unpatchify, decode."""
        x = latents.to(self.device, self.dtype)
        bn = self.vae.bn
        mean = bn.running_mean.to(x.device, x.dtype)
        std = torch.sqrt(bn.running_var + self.vae.config.batch_norm_eps).to(x.device, x.dtype)
        x = self.unpack(x * std + mean, height, width)
        images = self.vae.decode(x, return_dict=False)[0]
        return to_uint8(images)
