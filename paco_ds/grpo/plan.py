"""A GRPO recipe, loaded and planned for a world size.

`load_config` validates a recipe against the schema (paco_ds/config.py) and the registries above
it: model families (paco_ds/models), losses (paco_ds/grpo/losses/), rewards and aggregations,
so a name without an implementation is one line and exit 2 at load and in `--dry-run`.
`derive` is the batch arithmetic of an epoch for the real world size; `check_recipe` and
`describe` are `launch/train.py --dry-run`: the recipe, its data and the epoch plan, without
building a model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from paco_ds.config import Config
from paco_ds.data import load_prompts
from paco_ds.errors import ConfigError
from paco_ds.recipe import load_recipe


def registries() -> dict[str, list[str]]:
    """The names a GRPO recipe may use, for the schema's validators."""
    from paco_ds.grpo.losses import LOSSES
    from paco_ds.models import POLICIES
    from paco_ds.rewards.aggregate import BUILTIN
    from paco_ds.rewards.registry import REWARDS

    return {"policies": list(POLICIES), "losses": list(LOSSES), "rewards": list(REWARDS),
            "aggregations": list(BUILTIN)}


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """The recipe, with `model.path` and `model.lora.target_modules` the family's own where unset."""
    from paco_ds.models import with_family_defaults

    cfg = load_recipe(path, overrides, grpo_schema, context=registries())
    cfg.model = with_family_defaults(cfg.model)
    return cfg


def grpo_schema(data: dict) -> type[Config]:
    """The schema of a merged recipe: Config with the losses' own sections (the built-in ones, and
    the recipe's own loss when train.loss is an import path)."""
    from paco_ds.config import compose_schema
    from paco_ds.grpo.losses import DEFAULT_LOSS, loss_sections

    train = data.get("train")
    loss = train.get("loss") if isinstance(train, dict) else None
    return compose_schema(loss_sections(loss if isinstance(loss, str) else DEFAULT_LOSS), DEFAULT_LOSS)


@dataclass(frozen=True)
class EpochPlan:
    """Batch arithmetic of one GRPO epoch for a given number of training processes."""

    world_size: int
    group_size: int  # k
    prompts_per_epoch: int  # m, after rounding
    samples_per_epoch: int  # m * k, over all ranks
    samples_per_rank: int
    sample_batches_per_rank: int  # rollout batches of sample.batch_size
    train_timesteps: tuple[int, ...]
    micro_steps_per_rank: int  # (train micro-batches) x (trained timesteps) x inner epochs
    grad_accum_steps: int  # micro-steps per optimizer step
    optimizer_steps_per_epoch: int


def derive(cfg: Config, world_size: int, dataset_size: int | None = None) -> EpochPlan:
    """Round m so that every rank gets whole rollout and training batches, and derive GA.

    The reference rounds m up to a multiple of P*bs/gcd(k, P*bs) with P read from
    CUDA_VISIBLE_DEVICES at load time; here P is the real world size, and the unit also makes
    the per-rank training micro-batches split evenly into the optimizer steps of an epoch.
    """
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1 (got {world_size})")
    k, m = cfg.sample.group_size, cfg.sample.prompts_per_epoch
    steps = cfg.train.optimizer_steps_per_epoch
    unit = math.lcm(world_size * cfg.sample.batch_size, world_size * cfg.train.batch_size * steps)
    step = unit // math.gcd(k, unit)  # m must be a multiple of this
    if m % step:
        if not cfg.sample.round_prompts_per_epoch:
            raise ConfigError(
                f"sample.group_size={k} x sample.prompts_per_epoch={m} = {k * m} samples cannot be split evenly "
                f"over world size {world_size} (sample.batch_size={cfg.sample.batch_size}, train.batch_size="
                f"{cfg.train.batch_size}, {steps} optimizer steps per epoch): use prompts_per_epoch a multiple "
                f"of {step}, or set sample.round_prompts_per_epoch: true")
        m = math.ceil(m / step) * step
    if dataset_size is not None and m > dataset_size:
        raise ConfigError(
            f"sample.prompts_per_epoch={m} (rounded for world size {world_size} and group size {k}) exceeds the "
            f"{dataset_size} prompts in data.train_file: lower it or use more prompts")
    samples = m * k
    per_rank = samples // world_size
    timesteps = tuple(cfg.train_timesteps)
    micro = (per_rank // cfg.train.batch_size) * len(timesteps) * cfg.train.num_inner_epochs
    ga = micro // (steps * cfg.train.num_inner_epochs)
    return EpochPlan(
        world_size=world_size, group_size=k, prompts_per_epoch=m, samples_per_epoch=samples,
        samples_per_rank=per_rank, sample_batches_per_rank=per_rank // cfg.sample.batch_size,
        train_timesteps=timesteps, micro_steps_per_rank=micro, grad_accum_steps=ga,
        optimizer_steps_per_epoch=steps * cfg.train.num_inner_epochs,
    )


def check_recipe(cfg: Config, world_size: int) -> tuple[EpochPlan, int, int | None]:
    train = load_prompts(cfg.resolve_path(cfg.data.train_file), cfg.data.format, "data.train_file")
    test = load_prompts(cfg.resolve_path(cfg.data.test_file), cfg.data.format, "data.test_file") \
        if cfg.data.test_file else None
    plan = derive(cfg, world_size, dataset_size=len(train))
    from paco_ds.grpo.preflight import preflight

    preflight(cfg, train, test)  # what a run checks before its first step
    return plan, len(train), (len(test) if test is not None else None)


def rollout_line(cfg: Config) -> str:
    """How a training rollout walks its steps: transformer calls per image, and what saves some."""
    from paco_ds.sampling.solver import ode_stretches, plan_for

    s = cfg.sample
    win = s.sde_window
    if win is not None and win.schedule == "sliding":  # the plan moves with the window: each place it can be
        calls = sorted({len(plan_for(cfg, at)) for at in range(win.range[0], win.range[1] - win.size + 1)})
        out = f"{calls[0]}-{calls[-1]}" if len(calls) > 1 else f"{calls[0]}"
        out += f" transformer calls per image of {s.num_steps} steps (by where the sliding window is)"
    elif s.tree is not None:
        from paco_ds.sampling.tree import calls_per_tree

        per_tree = calls_per_tree(s.num_steps, list(s.noise_steps), s.tree.branches)
        out = (f"{per_tree / s.group_size:.3g} transformer calls per image of {s.num_steps} steps: a tree of "
               f"{s.group_size} leaves splitting in {s.tree.branches} at {list(s.noise_steps)} ({per_tree} calls, "
               f"{s.group_size * s.num_steps} unshared; more where a group's leaves are on several ranks)")
        return out
    else:
        out = f"{len(plan_for(cfg))} transformer calls per image of {s.num_steps} steps"
    if s.ode_steps is not None:
        out += f" (ODE-only stretches in <= {s.ode_steps} {s.ode_solver} steps)"
    head = ode_stretches(cfg)[:1]
    if s.same_latent and s.share_prefix and head and head[0][0] == 0:
        from paco_ds.engine import recipe_zero_stage

        if recipe_zero_stage(cfg) == 3 and cfg.deepspeed.rollout_gather == "per_step":
            # the trainer turns the sharing off there: each step gathers its own parameters (trainer.py)
            out += "; sample.share_prefix is off under deepspeed.rollout_gather: per_step (ZeRO-3)"
        else:
            out += "; a group's steps before its first SDE step once per rank (sample.share_prefix)"
    return out


def describe(cfg: Config, plan: EpochPlan, n_train: int, n_test: int | None) -> str:
    rows = [
        ("recipe", cfg.source),
        ("model", f"{cfg.model.family}: " + ("tiny (offline)" if cfg.model.tiny else str(cfg.model.path))),
        ("LoRA targets", ", ".join(cfg.model.lora.target_modules or [])),
        ("train prompts", n_train), ("test prompts", n_test if n_test is not None else "-"),
        ("world size", plan.world_size), ("group size k", plan.group_size),
        ("prompts per epoch m", f"{plan.prompts_per_epoch} (asked {cfg.sample.prompts_per_epoch})"),
        ("samples per epoch", plan.samples_per_epoch), ("samples per rank", plan.samples_per_rank),
        ("trained steps", list(plan.train_timesteps)), ("rollout", rollout_line(cfg)),
        ("micro-steps per rank", plan.micro_steps_per_rank),
        ("gradient accumulation", plan.grad_accum_steps), ("optimizer steps per epoch", plan.optimizer_steps_per_epoch),
        ("train / test resolution", f"{cfg.train.resolution} / {cfg.test.resolution} (items' own sizes first)"),
        ("rewards (train)", ", ".join(f"{k}x{v.weight:g}" for k, v in cfg.rewards.train.terms.items())),
        ("rewards (test)", ", ".join(f"{k}x{v.weight:g}" for k, v in cfg.rewards.eval.terms.items())),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
