"""A GRPO recipe, loaded and planned for a world size.

`load_config` validates a recipe against the schema (paco_ds/recipe/schema.py) and the registries above
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
from typing import NamedTuple

from paco_ds.recipe.schema import Config
from paco_ds.data import load_prompts
from paco_ds.errors import ConfigError
from paco_ds.recipe.loader import load_recipe


def registries() -> dict:
    """The names a GRPO recipe may use, for the schema's validators, and the check of the judge
    servers' attention implementation (the schema names no model code)."""
    from paco_ds.grpo.losses import LOSSES
    from paco_ds.models import POLICIES
    from paco_ds.rewards.aggregate import BUILTIN
    from paco_ds.rewards.registry import REWARDS
    from paco_ds.serving.config import servers_context

    return {"policies": list(POLICIES), "losses": list(LOSSES), "rewards": list(REWARDS),
            "aggregations": list(BUILTIN), **servers_context()}


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """The recipe, with `model.path` and `model.lora.target_modules` the family's own where unset."""
    from paco_ds.models import with_family_defaults

    cfg = load_recipe(path, overrides, grpo_schema, context=registries())
    cfg.model = with_family_defaults(cfg.model)
    return cfg


def grpo_schema(data: dict) -> type[Config]:
    """The schema of a merged recipe: Config with the losses' own sections (the built-in ones, and
    the recipe's own loss when train.loss is an import path)."""
    from paco_ds.recipe.schema import compose_schema
    from paco_ds.grpo.losses import DEFAULT_LOSS, loss_sections

    train = data.get("train")
    loss = train.get("loss") if isinstance(train, dict) else None
    return compose_schema(loss_sections(loss if isinstance(loss, str) else DEFAULT_LOSS), DEFAULT_LOSS)


@dataclass(frozen=True)
class EpochPlan:
    """Batch arithmetic of one GRPO epoch for a given number of data-parallel ranks (the training
    processes, or their sequence groups under parallel.sequence)."""

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
    step = _prompt_step(world_size, k, cfg.sample.batch_size, cfg.train.batch_size, steps)  # m: a multiple of it
    if m % step:
        if not cfg.sample.round_prompts_per_epoch:
            raise ConfigError(
                f"sample.group_size={k} x sample.prompts_per_epoch={m} = {k * m} samples cannot be split evenly "
                f"over world size {world_size} (sample.batch_size={cfg.sample.batch_size}, train.batch_size="
                f"{cfg.train.batch_size}, {steps} optimizer steps per epoch): use prompts_per_epoch a multiple "
                f"of {step}, or set sample.round_prompts_per_epoch: true")
        m = math.ceil(m / step) * step
    if dataset_size is not None and m > dataset_size:
        _too_few_prompts_for_batches(cfg, world_size, m, dataset_size)
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


class RecipeCheck(NamedTuple):
    """What `check_recipe` found: the epoch plan, the prompt counts, and the lines saying which
    records a reward does not apply to (preflight.unjudged_records)."""

    plan: EpochPlan
    n_train: int
    n_test: int | None
    unjudged: list[str]
    video: list[str] = []  # a video recipe's frames and judge requests per video (preflight.video_lines)


def _prompt_step(world_size: int, k: int, sample_batch: int, train_batch: int, steps: int) -> int:
    """What sample.prompts_per_epoch must be a multiple of: k x m samples split into whole rollout batches
    and whole training micro-batches of every optimizer step, on every rank."""
    unit = math.lcm(world_size * sample_batch, world_size * train_batch * steps)
    return unit // math.gcd(k, unit)


def _too_few_prompts_for_batches(cfg: Config, world_size: int, m: int, dataset_size: int) -> None:
    """When the prompts asked for fit the data and only the rounding for the batch sizes does not, the
    error names the batch keys that force it (the user set those, not prompts_per_epoch)."""
    asked, k = cfg.sample.prompts_per_epoch, cfg.sample.group_size
    if asked > dataset_size:
        return
    sizes = {"sample.batch_size": cfg.sample.batch_size, "train.batch_size": cfg.train.batch_size,
             "train.optimizer_steps_per_epoch": cfg.train.optimizer_steps_per_epoch}
    culprits = []
    for key in sizes:
        trial = {**sizes, key: 1}
        step = _prompt_step(world_size, k, *trial.values())
        if math.ceil(asked / step) * step <= dataset_size and sizes[key] > 1:
            culprits.append(key)
    if culprits:
        named = ", ".join(f"{key}={sizes[key]}" for key in culprits)
        raise ConfigError(
            f"config key '{culprits[0]}': {named} with sample.group_size={k} over world size {world_size} needs "
            f"sample.prompts_per_epoch rounded up from {asked} to {m} (whole batches on every rank), more than the "
            f"{dataset_size} prompts in data.train_file: lower {' or '.join(culprits)}")


def check_recipe(cfg: Config, world_size: int) -> RecipeCheck:
    """The recipe and its data for `world_size` processes; the epoch plan is for their data-parallel
    ranks (a sequence group of parallel.sequence ranks is one)."""
    from paco_ds.runtime.sequence import data_world

    train = load_prompts(cfg.resolve_path(cfg.data.train_file), cfg.data.format, "data.train_file")
    test = load_prompts(cfg.resolve_path(cfg.data.test_file), cfg.data.format, "data.test_file") \
        if cfg.data.test_file else None
    plan = derive(cfg, data_world(world_size, cfg.parallel.sequence), dataset_size=len(train))
    from paco_ds.grpo.preflight import preflight, unjudged_records, video_lines

    preflight(cfg, train, test)  # what a run checks before its first step
    return RecipeCheck(plan, len(train), (len(test) if test is not None else None),
                       unjudged_records(cfg, train, test), video_lines(cfg, train))


def rollout_line(cfg: Config) -> str:
    """How a training rollout walks its steps: transformer calls per image, and what saves some."""
    from paco_ds.models import policy_class
    from paco_ds.sampling.solver import ode_stretches, plan_for

    s = cfg.sample
    win = s.sde_window
    k = policy_class(cfg.model.family).calls_per_step(s.guidance_scale)  # 2: guidance's unconditional call apart
    each = f" ({k} per step: classifier-free guidance's unconditional velocity is a call of its own)" if k > 1 else ""
    if win is not None and win.schedule == "sliding":  # the plan moves with the window: each place it can be
        calls = sorted({k * len(plan_for(cfg, at)) for at in range(win.range[0], win.range[1] - win.size + 1)})
        out = f"{calls[0]}-{calls[-1]}" if len(calls) > 1 else f"{calls[0]}"
        out += f" transformer calls per image of {s.num_steps} steps (by where the sliding window is){each}"
    elif s.tree is not None:
        from paco_ds.sampling.tree import calls_per_tree

        per_tree = k * calls_per_tree(s.num_steps, list(s.noise_steps), s.tree.branches)
        out = (f"{per_tree / s.group_size:.3g} transformer calls per image of {s.num_steps} steps: a tree of "
               f"{s.group_size} leaves splitting in {s.tree.branches} at {list(s.noise_steps)} ({per_tree} calls, "
               f"{s.group_size * s.num_steps * k} unshared; more where a group's leaves are on several ranks){each}")
        return out
    else:
        out = f"{k * len(plan_for(cfg))} transformer calls per image of {s.num_steps} steps{each}"
    if s.ode_steps is not None:
        out += f" (ODE-only stretches in <= {s.ode_steps} {s.ode_solver} steps)"
    head = ode_stretches(cfg)[:1]
    if s.same_latent and s.share_prefix and head and head[0][0] == 0:
        from paco_ds.runtime.engine import gathers_per_step

        if gathers_per_step(cfg):
            # the trainer turns the sharing off there: each step gathers its own parameters (build.py)
            out += "; sample.share_prefix is off under deepspeed.rollout_gather: per_step (ZeRO-3)"
        else:
            out += "; a group's steps before its first SDE step once per rank (sample.share_prefix)"
    return out


def zero_line(cfg: Config, world_size: int) -> str:
    from paco_ds.runtime.engine import recipe_zero_stage, run_zero_stage

    stage, recipe = run_zero_stage(cfg, world_size), recipe_zero_stage(cfg)
    if stage == recipe:
        return str(stage)
    return f"{stage} (the recipe's {recipe} partitions nothing on one process)"


def loss_line(cfg: Config) -> str:
    """The loss that trains and its settings (its own section, the KL weight, the optimizer's)."""
    section = cfg.train.loss_section
    name = cfg.train.SECTION_OF.get(cfg.train.loss)
    keys = section.model_dump(mode="json") if section is not None else {}
    settings = ", ".join(f"train.{name}.{k}={v}" for k, v in keys.items())
    common = (f"train.kl_beta={cfg.train.kl_beta:g}, train.learning_rate={cfg.train.learning_rate:g}, "
              f"train.max_grad_norm={cfg.train.max_grad_norm:g}")
    return f"{cfg.train.loss}" + (f" ({settings})" if settings else "") + f"; {common}"


def _resolution(value) -> str:
    return str(value) if isinstance(value, int) else f"{value[0]}x{value[1]}"


def placement_line(cfg: Config, trainers: int) -> str:
    """Who samples: every rank between its training phases, or (rollout.mode: async) sampler ranks of their own."""
    r = cfg.rollout
    if r.mode != "async":
        return "colocated: every rank samples, then every rank trains"
    return (f"async: {r.samplers} sampler rank(s) after the {trainers} trainer rank(s) (world size above), a sample "
            f"at most {r.max_staleness} adapter version(s) older than its epoch's training start, decoupled PPO "
            f"(behaviour weight capped at {r.behaviour_weight_cap:g}), scoring {r.scoring.replace('_', ' ')}")


def describe(cfg: Config, plan: EpochPlan, n_train: int, n_test: int | None, unjudged: list[str] = (),
             video: list[str] = ()) -> str:
    rows = [
        ("recipe", cfg.source),
        ("model", f"{cfg.model.family}: " + ("tiny (offline)" if cfg.model.tiny else str(cfg.model.path))),
        ("LoRA targets", ", ".join(cfg.model.lora.target_modules or [])),
        ("train prompts", n_train), ("test prompts", n_test if n_test is not None else "-"),
        ("world size", plan.world_size * cfg.parallel.sequence),
        ("rollouts", placement_line(cfg, plan.world_size * cfg.parallel.sequence)), ("group size k", plan.group_size),
        *((("sequence parallel", f"parallel.sequence={cfg.parallel.sequence}: {plan.world_size} groups of "
            f"{cfg.parallel.sequence} ranks, each rank holding 1/{cfg.parallel.sequence} of a sample's tokens; "
            "a group samples and trains its samples together (per rank below: per group)"),)
          if cfg.parallel.sequence > 1 else ()),
        ("prompts per epoch m", f"{plan.prompts_per_epoch} (asked {cfg.sample.prompts_per_epoch})"),
        ("samples per epoch", plan.samples_per_epoch), ("samples per rank", plan.samples_per_rank),
        ("loss", loss_line(cfg)),
        ("ZeRO stage", zero_line(cfg, plan.world_size)),
        ("trained steps", list(plan.train_timesteps)), ("rollout", rollout_line(cfg)),
        ("micro-steps per rank", plan.micro_steps_per_rank),
        ("gradient accumulation", plan.grad_accum_steps), ("optimizer steps per epoch", plan.optimizer_steps_per_epoch),
        ("train / test resolution", f"{_resolution(cfg.train.resolution)} / {_resolution(cfg.test.resolution)} "
                                    "(items' own sizes first)"),
        ("rewards (train)", ", ".join(f"{k}x{v.weight:g}" for k, v in cfg.rewards.train.terms.items())),
        ("rewards (test)", ", ".join(f"{k}x{v.weight:g}" for k, v in cfg.rewards.eval.terms.items())),
        *(("not judged", line) for line in unjudged),
        *(("video", line) for line in video),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
