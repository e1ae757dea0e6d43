"""The reward-model SFT recipe: a typed schema loaded with paco_ds.recipe.loader.load_recipe.

`load_config(path, overrides, schema=SFTConfig)` gives the GRPO recipes' machinery: `extends:`,
`--set a.b=c`, file:line error messages and unknown-key suggestions. Defaults are the reference
values of PaCo-Reward (PaCo-RL/PaCo-Reward/config/paco_reward_lora.yaml: LLaMA-Factory's LoRA SFT of
Qwen2.5-VL-7B-Instruct).
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from paco_ds.recipe.schema import DeepSpeedSection, KernelsConfig, Recipe, Section, WandbConfig, wandb_boolean_form
from paco_ds.recipe.loader import load_recipe

QWEN_2_5_VL_7B = "Qwen/Qwen2.5-VL-7B-Instruct"


class SFTModelConfig(Section):
    path: str = QWEN_2_5_VL_7B  # hub id or local directory (a Qwen2.5-VL checkpoint)
    revision: str | None = None
    tiny: bool = False  # a tiny random-weight Qwen2.5-VL built offline (written to <run>/tiny_base)
    # auto: bf16 on GPU, fp32 on CPU; with bf16 DeepSpeed keeps fp32 master weights of the LoRA
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    # transformers' attention implementation, checked as the judge's (paco_ds/models/attention.py):
    # e.g. "flash_attention_2" (the `flash` extra); None: transformers' default (sdpa)
    attn_implementation: str | None = None
    image_max_pixels: int = Field(2 * 1024**2, gt=0)  # the reference's image_max_pixels
    image_min_pixels: int = Field(32 * 32, gt=0)  # LLaMA-Factory's default image_min_pixels
    freeze_vision_tower: bool = True
    freeze_multi_modal_projector: bool = True
    gradient_checkpointing: bool = False

    @field_validator("attn_implementation")
    @classmethod
    def _attention_runs_here(cls, v: str | None) -> str | None:
        from paco_ds.models.attention import attn_implementation_field

        return attn_implementation_field(v)

    @model_validator(mode="after")
    def _pixels(self) -> "SFTModelConfig":
        if self.image_min_pixels > self.image_max_pixels:
            raise ValueError(f"image_min_pixels={self.image_min_pixels} exceeds "
                             f"image_max_pixels={self.image_max_pixels}")
        return self


class SFTLoraConfig(Section):
    rank: int = Field(32, gt=0)
    alpha: float = Field(64, gt=0)  # LLaMA-Factory's default: 2 * rank
    dropout: float = Field(0.0, ge=0, lt=1)
    # "all": every linear layer of the language model (plus the vision tower / projector when they
    # are not frozen), as LLaMA-Factory's lora_target: all; or a list of module-name suffixes.
    target_modules: Union[Literal["all"], list[str]] = "all"
    path: str | None = None  # a peft adapter directory to start from


class SyntheticDataConfig(Section):
    """A pairwise dataset drawn from code (shapes and colours) into <run>/data; nothing is downloaded."""

    num_train: int = Field(64, ge=1)
    num_eval: int = Field(16, ge=1)
    image_size: int = Field(64, ge=16)
    seed: int = 0


class SFTDataConfig(Section):
    # sharegpt-style JSON (a list) or JSONL files, as LLaMA-Factory reads them (see paco_ds/sft/data.py)
    train_files: list[str] = Field(default_factory=list)
    eval_files: list[str] = Field(default_factory=list)
    image_dir: str | None = None  # relative image paths resolve here; default: each data file's directory
    synthetic: SyntheticDataConfig | None = None  # generate the data instead of reading files
    cutoff_len: int = Field(16384, gt=1)
    max_samples: int | None = Field(None, gt=0)  # per file, as LLaMA-Factory's max_samples
    num_workers: int = Field(0, ge=0)  # DataLoader workers that decode and resize the images

    @model_validator(mode="after")
    def _one_source(self) -> "SFTDataConfig":
        if self.synthetic is None and not self.train_files:
            raise ValueError("give train_files (sharegpt JSON/JSONL) or synthetic: {...}")
        if self.synthetic is not None and (self.train_files or self.eval_files):
            raise ValueError("give either train_files/eval_files or synthetic, not both")
        return self


class SFTTrainConfig(Section):
    first_token_weight: float | None = Field(0.1, ge=0, le=1)  # None: plain mean cross-entropy
    # "exact": the reference's formula; "share": alpha as the first token's share (paco_ds/sft/loss.py)
    first_token_weight_mode: Literal["exact", "share"] = "exact"
    batch_size: int = Field(8, ge=1)  # per process
    gradient_accumulation_steps: int = Field(4, ge=1)
    learning_rate: float = Field(2e-4, gt=0)
    num_epochs: int = Field(2, ge=1)
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"  # after a linear warm-up
    warmup_ratio: float = Field(0.1, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = Field(1.0, ge=0)  # DeepSpeed gradient_clipping (0 disables)
    loss_chunk_size: int = Field(0, ge=0)  # rows per chunk of the fused LM head + loss; 0: auto
    log_every: int = Field(10, ge=1)  # optimizer steps between printed lines (metrics.jsonl has every step)


class SFTEvalConfig(Section):
    batch_size: int = Field(8, ge=1)  # per process
    every_epochs: int = Field(1, ge=0)  # 0 disables
    at_start: bool = False  # also evaluate the model before training


class SFTCheckpointConfig(Section):
    every_epochs: int = Field(1, ge=0)  # the reference's save_strategy: epoch; 0 disables
    every_steps: int = Field(0, ge=0)  # also every N optimizer steps; 0 disables
    keep_last: int = Field(3, ge=1)


class SFTWandbConfig(WandbConfig):
    project: str = "paco_reward"


class SFTLoggingConfig(Section):
    tensorboard: bool = True
    wandb: SFTWandbConfig | None = None  # as GRPO's logging.wandb (paco_ds/recipe/schema.py)

    @model_validator(mode="before")
    @classmethod
    def _boolean_form(cls, data: Any) -> Any:
        return wandb_boolean_form(data, SFTWandbConfig.model_fields["project"].default)


class SFTConfig(Recipe):
    run_name: str = "paco_reward_sft"
    model: SFTModelConfig = Field(default_factory=SFTModelConfig)
    lora: SFTLoraConfig = Field(default_factory=SFTLoraConfig)
    data: SFTDataConfig
    train: SFTTrainConfig = Field(default_factory=SFTTrainConfig)
    eval: SFTEvalConfig = Field(default_factory=SFTEvalConfig)
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection)
    logging: SFTLoggingConfig = Field(default_factory=SFTLoggingConfig)
    checkpoint: SFTCheckpointConfig = Field(default_factory=SFTCheckpointConfig)
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)


def load_sft_config(path, overrides: list[str] | None = None) -> SFTConfig:
    return load_recipe(path, overrides, SFTConfig)
