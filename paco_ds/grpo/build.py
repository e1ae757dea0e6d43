"""The trainer's parts from a recipe: its prompts, the DeepSpeed config of its epoch plan, the
policy with its adapter, the rewards and the rollouts. The trainer (paco_ds/grpo/trainer.py) builds them after
seeding every rank alike, in its order: the adapter's initial weights depend on it."""
from __future__ import annotations

import torch

from paco_ds.recipe.schema import Config
from paco_ds.data import PromptItem, load_prompts
from paco_ds.runtime.distributed import DistInfo
from paco_ds.runtime.dtypes import resolve_dtype
from paco_ds.runtime.engine import build_ds_config, gathers_per_step, load_ds_config, run_zero_stage, zero_stage
from paco_ds.grpo.plan import EpochPlan
from paco_ds.sampling.rollouts import Rollouts
from paco_ds.models import build_policy
from paco_ds.models.attention import set_attention_backend
from paco_ds.models.compile import compile_blocks
from paco_ds.models.lora import add_lora
from paco_ds.models.sequence import shard_sequence
from paco_ds.rewards.runner import RewardRunner
from paco_ds.serving.manager import endpoints_for_run


def prompts(cfg: Config) -> tuple[list[PromptItem], list[PromptItem]]:
    """The train prompts and the test prompts (data.max_test_prompts of them when set)."""
    train = load_prompts(cfg.resolve_path(cfg.data.train_file), cfg.data.format, "data.train_file")
    test = load_prompts(cfg.resolve_path(cfg.data.test_file), cfg.data.format, "data.test_file") \
        if cfg.data.test_file else []
    return train, test[:cfg.data.max_test_prompts] if cfg.data.max_test_prompts else test


def ds_config(cfg: Config, plan: EpochPlan, dist: DistInfo) -> dict:
    """The recipe's DeepSpeed config with what the plan fills in: micro-batch, accumulation, clipping."""
    return build_ds_config(
        load_ds_config(cfg.resolve_path(cfg.deepspeed.config)), micro_batch=cfg.train.batch_size,
        grad_accum=plan.grad_accum_steps, world_size=dist.world_size, grad_clip=cfg.train.max_grad_norm,
        bf16=resolve_dtype(cfg.model.dtype, dist.device) == torch.bfloat16,
        zero_stage=run_zero_stage(cfg, dist.world_size), overrides=cfg.deepspeed.overrides)


def adapted_policy(cfg: Config, device: torch.device, ds: dict, source=None, sequence_mesh=None):
    """The policy with the recipe's LoRA: frozen encoders/VAE per rank; the transformer goes into the
    engine. Under ZeRO-3 it is built partitioned: no rank ever holds the whole transformer. `source`
    (a paco_ds.models.base.ModelSource): where the modules come from when not the recipe's checkpoint
    or tiny twin (the GPU plan's full-size model on a fake device, paco_ds/gpu_plan/source.py).
    `sequence_mesh` (parallel.sequence, paco_ds/runtime/sequence.py): the transformer's tokens are split
    over the ranks of its sequence groups."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.model.allow_tf32
    policy = build_policy(cfg.model, device, ds, source)
    add_lora(policy.transformer, cfg.model.lora)
    set_attention_backend(policy.transformer, cfg.model.attention_backend)  # checked at start-up (run.py)
    if sequence_mesh is not None:  # after the backend: its processors take the group
        shard_sequence(policy, sequence_mesh)
    if cfg.model.gradient_checkpointing:  # recompute activations in backward: memory for time
        policy.transformer.enable_gradient_checkpointing()
    if cfg.model.compile:  # after LoRA: the compiled blocks trace the adapted layers
        compile_blocks(policy.transformer, gathered_phases_only=zero_stage(ds) == 3)
    return policy


def rewards(cfg: Config, dist: DistInfo) -> tuple[RewardRunner, RewardRunner]:
    """The train and the test rewards; they share the reward models both use."""
    shared: dict = {}
    ctx = reward_context(cfg, dist)
    train = train_rewards(cfg, ctx, shared)
    test = RewardRunner(cfg.rewards.eval, "rewards.test.terms" if cfg.rewards.test else "rewards.train.terms",
                        shared, batches_in_flight=cfg.rewards.batches_in_flight, **ctx)
    return train, test


def train_rewards(cfg: Config, context: dict, shared: dict | None = None) -> RewardRunner:
    """The train rewards (alone: an async run's samplers score, the trainers evaluate); `context`:
    reward_context's."""
    return RewardRunner(cfg.rewards.train, "rewards.train.terms", shared, cfg.rewards.overlap,
                        cfg.rewards.batches_in_flight, **context)


def reward_context(cfg: Config, dist: DistInfo) -> dict:
    """What a reward is built with: this process's device, the run directory, the judges' endpoints."""
    return {"device": str(dist.device), "run_dir": cfg.run_dir,
            "reward_endpoints": endpoints_for_run(cfg.reward_servers, cfg.run_dir)}


def rollouts(cfg: Config, policy, loss, engine, ds: dict) -> Rollouts:
    """Rollouts sample with the loss's SDE step and keep what the loss needs, through the engine (or,
    under ZeRO-3, the transformer gathered once per sampling phase). A shared group prefix makes
    ranks run different numbers of forwards: only where a forward needs no collective (not where
    ZeRO-3 gathers in every forward, `gathers_per_step`)."""
    per_step = gathers_per_step(cfg)
    return Rollouts(cfg, policy, loss.sde, module=engine, gather_once=zero_stage(ds) == 3 and not per_step,
                    needs=loss.needs, share_prefix=not per_step)
