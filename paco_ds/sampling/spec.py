"""What a rollout samples, in two typed records.

`SamplingSpec`: how every batch of an epoch's rollouts (or of an evaluation) samples, built once
from the recipe (`training`, `evaluation`): the schedule's length, guidance, the SDE (its noise
level, type and step function), the step plan, the recipe's noise steps and trained steps, and what
a rollout keeps (log-probs, transition means, clean latents).

`RolloutBatch`: one batch's samples (prompts, embeddings, condition, size, metadata, positions,
groups, generators, initial latents) and the steps they take: the noise and trained steps
(`paco_ds/sampling/window.py` selects them from the spec), the schedule index the latents are at
and, for a tree leaf, where its SDE noise comes from.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch

from kernels.sde_reference import sde_step
from paco_ds.models.base import Condition, TextEmbeds
from paco_ds.recipe.schema import Config
from paco_ds.sampling.solver import Step, plan_for, unit_steps


@dataclass(frozen=True, kw_only=True)
class SamplingSpec:
    """How a rollout samples, the same for every batch of an epoch (or of an evaluation)."""

    num_steps: int
    guidance: float
    noise_level: float = 0.0  # 0: every step is an ODE step
    sde_type: str = "flow_grpo"
    sde_fn: Callable = sde_step  # the SDE step (the loss's, so that log pi_old and training's agree)
    plan: tuple[Step, ...] = ()  # the steps walked (paco_ds/sampling/solver.py); empty: one per schedule step
    noise_steps: tuple[int, ...] = ()  # the recipe's SDE steps (an SDE window replaces them per batch)
    train_steps: tuple[int, ...] = ()  # the recipe's trained steps (Config.train_timesteps), when log-probs are kept
    keep_log_probs: bool = False  # x_j, x_{j+1}, sigmas and log pi_old of the trained steps
    keep_mean: bool = False  # the SDE transition mean of the trained steps (needs an sde_fn returning it)
    keep_final: bool = False  # the clean final latents (losses on the forward process)

    def __post_init__(self):
        object.__setattr__(self, "plan", tuple(self.plan) or tuple(unit_steps(self.num_steps)))

    @classmethod
    def training(cls, cfg: Config, sde_fn: Callable, needs, window_at: int | None = None) -> "SamplingSpec":
        """An epoch's training rollouts: the recipe's SDE steps and what the loss `needs` (its
        RolloutNeeds); `window_at`: where a sliding SDE window starts this epoch (the plan's ODE
        stretches lie around it)."""
        s = cfg.sample
        return cls(num_steps=s.num_steps, guidance=s.guidance_scale, noise_level=s.noise_level, sde_type=s.sde_type,
                   sde_fn=sde_fn, plan=tuple(plan_for(cfg, window_at)), noise_steps=tuple(s.noise_steps),
                   train_steps=tuple(cfg.train_timesteps) if needs.log_probs else (), keep_log_probs=needs.log_probs,
                   keep_mean=needs.mean_old, keep_final=needs.clean_latents)

    @classmethod
    def evaluation(cls, cfg: Config, sde_fn: Callable) -> "SamplingSpec":
        """The test prompts' sampling: ODE steps (test.num_steps), nothing kept but the images."""
        return cls(num_steps=cfg.test.num_steps, guidance=cfg.sample.guidance_scale, sde_fn=sde_fn)


@dataclass(frozen=True, kw_only=True)
class RolloutBatch:
    """Same-size samples sampled together. `noise_steps` / `train_steps` may hold one list per
    sample (Flow-GRPO-Fast windows per prompt group): a step is then stochastic for the samples whose
    list has it and ODE for the others. `metadata`, `positions`, `group_ids`: each sample's (default:
    no metadata, its own group at its index in the batch)."""

    prompts: list[str]
    embeds: TextEmbeds
    height: int
    width: int
    condition: Condition | None = None  # editing: the reference images and their latents
    metadata: list[dict] | None = None
    positions: list[int] | None = None
    group_ids: list[int] | None = None
    generators: Sequence[torch.Generator] = ()  # one per sample: its initial latent (if not given) and SDE noise
    initial_latents: torch.Tensor | None = None  # [B, L, C] at schedule index `start`
    noise_steps: list = field(default_factory=list)
    train_steps: list = field(default_factory=list)
    start: int = 0  # the schedule index the latents are at (a group's shared prefix already walked)
    noise_fn: Callable[[int, int], torch.Tensor] | None = None  # (r, i): sample r's SDE noise at step i

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def per_sample_steps(self) -> bool:
        return bool(self.noise_steps) and isinstance(self.noise_steps[0], (list, tuple))

    def select(self, rows: list[int]) -> "RolloutBatch":
        """The batch of these rows (the per-sample steps of each, if per sample)."""
        pick = (lambda v: None if v is None else [v[r] for r in rows])
        per = self.per_sample_steps
        return replace(self, prompts=pick(self.prompts), embeds=self.embeds.select(rows),
                       condition=self.condition.select(rows) if self.condition is not None else None,
                       metadata=pick(self.metadata), positions=pick(self.positions), group_ids=pick(self.group_ids),
                       generators=pick(self.generators) if self.generators else self.generators,
                       initial_latents=self.initial_latents[rows] if self.initial_latents is not None else None,
                       noise_steps=pick(self.noise_steps) if per else self.noise_steps,
                       train_steps=pick(self.train_steps) if per and self.train_steps else self.train_steps,
                       noise_fn=(lambda r, i: self.noise_fn(rows[r], i)) if self.noise_fn is not None else None)
