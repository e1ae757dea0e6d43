"""FLUX.2 [klein] as a `Policy`: FLUX.2's transformer at 9B (or 4B) with a Qwen3 prompt encoder.

`Flux2Policy` (flux2.py) with the parts diffusers' `Flux2KleinPipeline`
(pipelines/flux2/pipeline_flux2_klein.py, diffusers 0.42.1) drives differently:

- prompts: each prompt as one user turn of the tokenizer's chat template (Qwen3's, with the
  generation prompt and `enable_thinking=False`), padded and cut to `model.max_sequence_length`
  tokens (512); the hidden states of Qwen3's layers 9, 18 and 27 stacked per token (Qwen3-8B:
  3 x 4096 = the 9B transformer's 12288 inputs). As for dev, no mask reaches the transformer.
- guidance: klein's transformer has no guidance embedding (`guidance=None`). The base checkpoints
  (`is_distilled: false` in model_index.json, the default `FLUX.2-klein-base-9B`) use classifier-free
  guidance with the empty negative prompt when `sample.guidance_scale` > 1: v = v_u + g (v_c - v_u),
  the pipeline's formula; here cond and uncond run in one transformer call (batch [cond | uncond]),
  v_u detached while training as SD3's is. The step-distilled checkpoints (`is_distilled: true`)
  ignore the scale, as the pipeline does: one forward.

The latents, positions, schedule (`compute_empirical_mu`) and decoding are FLUX.2-dev's. Text-to-image
only, as for dev.
"""
from __future__ import annotations


import torch
from torch import nn

from paco_ds.recipe.schema import ModelConfig
from paco_ds.models.tiny.flux2 import TINY_TEXT_POSITIONS
from paco_ds.models.base import Part, TextEmbeds
from paco_ds.models.flux2 import FLUX2_DEV_TRANSFORMER, FLUX2_SCHEDULER, FLUX2_VAE, Flux2Policy
from paco_ds.models.full_size import FullSize, empty

# black-forest-labs/FLUX.2-klein-base-9B's transformer config (FLUX.2-klein-9B, distilled, the same)
FLUX2_KLEIN_9B_TRANSFORMER = dict(FLUX2_DEV_TRANSFORMER, num_layers=8, num_single_layers=24, num_attention_heads=32,
                                  joint_attention_dim=12288, guidance_embeds=False)
QWEN3_8B = {  # its text_encoder (Qwen3ForCausalLM)
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "tie_word_embeddings": False,
}


def full_size_transformer() -> nn.Module:
    from diffusers import Flux2Transformer2DModel

    return empty(lambda: Flux2Transformer2DModel(**FLUX2_KLEIN_9B_TRANSFORMER))


def full_size_components(cfg: ModelConfig) -> dict:
    """FLUX.2's autoencoder and Qwen3-8B on meta, with the offline byte-level tokenizer carrying
    Qwen3's chat template."""
    from diffusers import AutoencoderKLFlux2
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from paco_ds.models.tiny.flux2 import klein_tokenizer

    tok = klein_tokenizer()
    config = Qwen3Config(**QWEN3_8B, bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return {"vae": empty(lambda: AutoencoderKLFlux2(**FLUX2_VAE)), "text_encoder": empty(lambda: Qwen3ForCausalLM(config)),
            "tokenizer": tok, "scheduler_config": dict(FLUX2_SCHEDULER), "is_distilled": False}


class Flux2KleinPolicy(Flux2Policy):
    display_name = "FLUX.2 [klein]"
    # The checkpoint Flux2KleinPipeline's docstring names: the undistilled 9B base (50 steps, CFG 4);
    # the distilled FLUX.2-klein-9B / -4B and klein-base-4B load with the same code (model.path).
    default_path = "black-forest-labs/FLUX.2-klein-base-9B"
    max_sequence_length_limit = QWEN3_8B["max_position_embeddings"]
    tiny_max_sequence_length_limit = TINY_TEXT_POSITIONS
    text_encoder_out_layers = (9, 18, 27)
    full_size = FullSize(full_size_transformer, full_size_components)
    parts = {"vae": Part("diffusers:AutoencoderKLFlux2"), "text_encoder": Part("transformers:Qwen3ForCausalLM"),
             "tokenizer": Part("transformers:AutoTokenizer", None)}
    tiny_builder = "paco_ds.models.tiny.flux2:tiny_flux2_klein_components"

    def __init__(self, transformer: nn.Module, vae: nn.Module, text_encoder: nn.Module, tokenizer,
                 scheduler_config: dict, device: torch.device, dtype: torch.dtype, max_sequence_length: int = 512,
                 is_distilled: bool = False):
        super().__init__(transformer, vae, text_encoder, tokenizer, scheduler_config, device, dtype,
                         max_sequence_length)
        self.is_distilled = is_distilled
        # The negative prompt of guidance, encoded once (kept on the CPU; a device copy is made once).
        self.negative = None if is_distilled else self.encode_prompts([""]).to("cpu")

    # ------------------------------------------------------------------ construction
    @classmethod
    def checkpoint_extras(cls, path: str, dtype: torch.dtype, kw: dict) -> dict:
        """`is_distilled`, from the checkpoint's model_index.json (the undistilled base: guidance is CFG)."""
        from diffusers import DiffusionPipeline

        return {"is_distilled": bool(DiffusionPipeline.load_config(path, **kw).get("is_distilled", False))}

    # ------------------------------------------------------------------ prompts
    def _prompt_inputs(self, prompts: list[str]) -> dict:
        """As `_get_qwen3_prompt_embeds`: each prompt in the chat template (no thinking), tokenized
        padded to the length one by one, then stacked."""
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                    add_generation_prompt=True, enable_thinking=False) for p in prompts]
        rows = [self.tokenizer(t, return_tensors="pt", padding="max_length", truncation=True,
                               max_length=self.max_sequence_length) for t in texts]
        return {"input_ids": torch.cat([r["input_ids"] for r in rows]),
                "attention_mask": torch.cat([r["attention_mask"] for r in rows])}

    # ------------------------------------------------------------------ transformer
    def guided(self, guidance: float) -> bool:
        """Whether a step runs classifier-free guidance (the pipeline's do_classifier_free_guidance)."""
        return guidance > 1 and not self.is_distilled

    def velocity(self, module: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, embeds: TextEmbeds,
                 height: int, width: int, guidance: float, condition=None) -> torch.Tensor:
        """The (guided) velocity: one transformer call, on [cond | uncond] when guiding."""
        self._no_condition(condition)
        b = latents.shape[0]
        x, t, text = latents.to(self.device), self._timestep(sigma, b), embeds.prompt_embeds.to(self.device)
        if not self.guided(guidance):
            return self._call(module, x, t, text, None, height, width)
        negative = self.negative_here().prompt_embeds.expand(b, -1, -1)
        out = self._call(module, torch.cat([x, x]), torch.cat([t, t]), torch.cat([text.to(self.dtype), negative]),
                         None, height, width)
        cond, uncond = out.chunk(2)
        uncond = uncond.detach()  # compute_log_prob's stop-gradient (no-op while sampling)
        return uncond + guidance * (cond - uncond)
