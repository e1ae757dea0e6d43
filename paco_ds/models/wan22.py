"""Wan2.2-T2V-A14B as a `Policy`: two 14B experts of Wan2.1-14B's shape that share one denoising
trajectory, switching at the pipeline's boundary timestep.

diffusers' `WanPipeline` with `transformer_2` and `boundary_ratio` (0.875 in the checkpoint's
model_index.json) runs `transformer`, the high-noise expert, at every step whose timestep is at least
boundary_ratio x 1000, and `transformer_2`, the low-noise expert, below it (`guidance_scale_2`, the
low-noise expert's guidance, defaults to `guidance_scale`; here both use `sample.guidance_scale`).
Everything else (prompts, latents, autoencoder, schedule) is Wan2.1's (wan.py).

Here the two experts are one module (`WanExperts`), which the DeepSpeed engine wraps as any family's
transformer: both are partitioned under ZeRO-3 (built partitioned from their folders, transformer/
and transformer_2/), every forward names its expert (`expert=`), and ZeRO-3 gathers only the called
expert's weights. A step belongs to one expert, chosen from its timestep exactly as the pipeline
chooses (the scheduler's integer timestep against boundary_ratio x 1000), in sampling and in the
training recomputation alike.

Both experts carry the LoRA (the recipe's targets in each): a trained step's gradient reaches the
adapter of the expert its timestep selects, so a recipe that trains steps on both sides of the
boundary trains both experts, each its own adapter, and one that trains only early (noisy) steps,
as PaCo-GRPO's step 1 of 10, trains the high-noise expert's, while the low-noise adapter keeps its
initial B = 0 (no gradient ever reaches it, and AdamW moves nothing without one). The export writes
the high-noise expert's adapter where `WanPipeline.load_lora_weights(dir)` reads it and the
low-noise expert's in `transformer_2/` for `load_lora_weights(dir/transformer_2,
load_into_transformer_2=True)` (diffusers' `WanLoraLoaderMixin`).

A micro-step is one transformer call, so the samples of a batch must share their expert: a
Flow-GRPO-Fast window drawn per prompt group (`sample.sde_window.per: group`) is refused (`check_recipe`).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from paco_ds.models.full_size import FullSize
from paco_ds.models.wan import WAN21_14B_TRANSFORMER, WAN21_VAE, WanPolicy, wan_components, wan_transformer

BOUNDARY_RATIO = 0.875  # Wan-AI/Wan2.2-T2V-A14B-Diffusers model_index.json
EXPERT_FOLDER = "transformer_2"  # where the export writes the low-noise expert's adapter


def experts_class():
    """WanExperts, defined on first use (diffusers imports stay lazy, as in every family file)."""
    global _EXPERTS
    if _EXPERTS is None:
        from diffusers.configuration_utils import ConfigMixin, register_to_config
        from diffusers.loaders.peft import PeftAdapterMixin
        from diffusers.models.modeling_utils import ModelMixin

        class WanExperts(ModelMixin, ConfigMixin, PeftAdapterMixin):
            """Wan2.2's two experts as one module: `transformer` (high noise) and `transformer_2`
            (low noise). `forward(..., expert=0|1)` runs one of them. The diffusers mixins give it
            what the trainer asks of a transformer: LoRA through peft (into both experts), the
            attention backend, gradient checkpointing and regional compilation of the blocks."""

            _supports_gradient_checkpointing = True
            _repeated_blocks = ["WanTransformerBlock"]
            _no_split_modules = ["WanTransformerBlock"]

            @register_to_config
            def __init__(self, boundary_ratio: float = BOUNDARY_RATIO):
                super().__init__()

            @classmethod
            def of(cls, transformer: nn.Module, transformer_2: nn.Module, boundary_ratio: float) -> "WanExperts":
                experts = cls(boundary_ratio=boundary_ratio)
                experts.transformer, experts.transformer_2 = transformer, transformer_2
                return experts

            def forward(self, *args, expert: int, **kwargs):
                out = (self.transformer, self.transformer_2)[expert](*args, **kwargs)
                idle = [p for p in (self.transformer_2, self.transformer)[expert].parameters() if p.requires_grad]
                if not (torch.is_grad_enabled() and idle):
                    return out
                # The idle expert's adapter gets a zero gradient in every backward, not none: ZeRO-3
                # overwrites a parameter's gradient partition at the first micro-step of an accumulation
                # window only for parameters that have a gradient, so one without would step with the
                # gradient it kept from the previous window (and a resumed run, whose buffers start at
                # zero, would train differently). Its weights are gathered for that (register_idle).
                zero = sum(p.sum() for p in idle) * 0.0
                first = out[0] if isinstance(out, tuple) else out.sample
                return (first + zero.to(first.dtype), *out[1:]) if isinstance(out, tuple) else \
                    type(out)(sample=first + zero.to(first.dtype))

            def add_adapter(self, adapter_config, adapter_name: str = "default") -> None:
                super().add_adapter(adapter_config, adapter_name)
                self.register_idle()

            def register_idle(self) -> None:
                """Under ZeRO-3, every forward of this module gathers both experts' adapters (the
                idle one for its zero gradient, above); a no-op elsewhere."""
                from deepspeed.runtime.zero.partition_parameters import register_external_parameter

                for p in self.parameters():
                    if p.requires_grad:
                        register_external_parameter(self, p)

            def load_lora_adapter(self, pretrained_model_name_or_path_or_dict, prefix="transformer", **kwargs):
                """An exported adapter (model.lora.path): the high-noise expert's from the folder, the
                low-noise expert's from its transformer_2/ (where the export writes it)."""
                folder = Path(pretrained_model_name_or_path_or_dict)
                self.transformer.load_lora_adapter(str(folder), prefix=prefix, **kwargs)
                second = folder / EXPERT_FOLDER
                if not second.is_dir():
                    raise ValueError(f"model.lora.path {folder}: a Wan2.2-A14B adapter has the low-noise expert's in "
                                     f"{EXPERT_FOLDER}/, which is not there")
                self.transformer_2.load_lora_adapter(str(second), prefix=prefix, **kwargs)
                self.peft_config = dict(self.transformer.peft_config)
                self._hf_peft_config_loaded = True
                for name, p in self.named_parameters():  # trained from here, as add_lora marks them
                    if "lora_" in name:
                        p.requires_grad_(True)
                self.register_idle()

        _EXPERTS = WanExperts
    return _EXPERTS


_EXPERTS = None


def full_size_experts() -> nn.Module:
    """Both 14B experts on meta (Wan2.2-T2V-A14B's transformer configs are Wan2.1-14B's)."""
    build = wan_transformer(WAN21_14B_TRANSFORMER)
    return experts_class().of(build(), build(), BOUNDARY_RATIO)


def full_size_components(cfg) -> dict:
    return wan_components(WAN21_VAE, "WAN_SCHEDULER_CONFIG")(cfg) | {"boundary_ratio": BOUNDARY_RATIO}


class Wan22Policy(WanPolicy):
    display_name = "Wan2.2-T2V-A14B"
    default_path = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
    full_size = FullSize(full_size_experts, full_size_components, fp32=("vae",))
    tiny_options = {"experts": 2}

    @classmethod
    def check_experts(cls, boundary_ratio: float | None) -> None:
        if boundary_ratio is None:
            raise ValueError("the checkpoint has one transformer (no boundary_ratio in its model_index.json): it is "
                             "model.family wan's")

    @classmethod
    def tiny_parts(cls, spec) -> dict:
        return cls.joined(super().tiny_parts(spec))

    @classmethod
    def from_pretrained(cls, path: str, revision: str | None, dtype: torch.dtype, ds_config: dict | None = None) -> dict:
        """Wan2.1's parts and, beside the high-noise expert, the low-noise one from transformer_2/
        (partitioned under ZeRO-3 like the first)."""
        from paco_ds.models.base import import_class
        from paco_ds.models.zero_load import load_transformer

        parts = super().from_pretrained(path, revision, dtype, ds_config)
        parts["transformer_2"] = load_transformer(import_class(cls.transformer_class), path, revision, dtype, ds_config,
                                                  subfolder=EXPERT_FOLDER)
        return cls.joined(parts)

    @staticmethod
    def joined(parts: dict) -> dict:
        """The parts with `transformer` and `transformer_2` as one WanExperts module."""
        parts = dict(parts)
        second = parts.pop("transformer_2")
        parts["transformer"] = experts_class().of(parts["transformer"], second, parts["boundary_ratio"])
        return parts

    @classmethod
    def check_recipe(cls, cfg) -> None:
        from paco_ds.errors import ConfigError

        super().check_recipe(cfg)
        win = cfg.sample.sde_window
        if win is not None and win.per == "group":
            raise ConfigError("config key 'sample.sde_window.per': 'group' draws a window per prompt group, so one "
                              "training batch could hold steps of both Wan2.2 experts, and a micro-step calls one; "
                              "use per: epoch")

    @classmethod
    def lora_files(cls, state_dict: dict) -> dict[str, dict]:
        """The high-noise expert's adapter in the export's folder, the low-noise one's in transformer_2/,
        each in its transformer's own names."""
        out: dict[str, dict] = {"": {}, EXPERT_FOLDER: {}}
        for name, tensor in state_dict.items():
            expert, _, rest = name.partition(".")
            out["" if expert == "transformer" else EXPERT_FOLDER][rest] = tensor
        return out

    def expert_of(self, t: torch.Tensor) -> int:
        """0 (high noise) where the timesteps are at least the boundary, 1 below it, as the pipeline
        chooses; a batch whose rows straddle the boundary is refused (one call runs one expert)."""
        high = t >= self.boundary_ratio * self.num_train_timesteps
        if bool(high.any()) != bool(high.all()):
            raise ValueError(f"a batch mixes timesteps of both Wan2.2 experts ({t.tolist()}): one call runs one expert")
        return 0 if bool(high.all()) else 1

    def transformer_call(self, module: nn.Module, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return module(hidden_states=x, timestep=self.timestep_input(t, x), encoder_hidden_states=text,
                      expert=self.expert_of(t), return_dict=False)[0]
