"""Fewer solver steps where nothing is trained (MixGRPO's idea, arXiv 2507.21802).

A training rollout is an ODE except at its SDE steps. Only those steps are trained; the ODE-only
stretches before the first and after the last SDE step only carry the latent to the next SDE step
or to the image. `sample.ode_steps` walks each such stretch in at most that many steps, whose ends
land exactly on the schedule's sigmas (so every SDE step, its x_j, sigma_j and log-prob, is the one
the sampler would take anyway), and `sample.ode_solver` picks how:
- `euler`: x' = x + (s' - s) v, the sampler's own step;
- `ab2`: two-step Adams-Bashforth on the velocity, x' = x + h (v + h / (2 h_prev) (v - v_prev)),
  second order for one transformer call per step, like DPM-Solver++(2M) (arXiv 2211.01095). Each
  stretch starts with an Euler step, since the step before it (an SDE step, or none) leaves no
  velocity of this ODE's trajectory.

The stretches come from the recipe, not from the batch (the fixed noise steps, or the whole range an
SDE window may be drawn in), so a sample's steps do not depend on the other samples of its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from paco_ds.recipe.schema import Config


@dataclass(frozen=True)
class Step:
    i: int  # from sigma_i ...
    k: int  # ... to sigma_k of the schedule (k = i + 1 unless a stretch is walked in fewer steps)
    multistep: bool = False  # ab2 with the previous step's velocity (the previous Step is in the same stretch)


def unit_steps(num_steps: int) -> list[Step]:
    """One step per step of the schedule: the plain sampler."""
    return [Step(i, i + 1) for i in range(num_steps)]


def ode_stretches(cfg: Config, window_at: int | None = None) -> list[tuple[int, int]]:
    """The [start, end) step ranges of every training rollout that hold no SDE step; `window_at`:
    where the SDE window starts in every rollout of the epoch (a sliding window), if known."""
    n, s = cfg.sample.num_steps, cfg.sample
    if s.noise_level == 0 or (s.sde_window is None and not s.noise_steps):
        return [(0, n)]
    if s.sde_window is not None and window_at is not None:
        first, last = window_at, window_at + s.sde_window.size - 1
    elif s.sde_window is not None:  # a random window may lie anywhere in its range
        first, last = s.sde_window.range[0], s.sde_window.range[1] - 1
    else:
        first, last = min(s.noise_steps), max(s.noise_steps)
    return [(a, b) for a, b in ((0, first), (last + 1, n)) if b > a]


def step_plan(num_steps: int, stretches: list[tuple[int, int]], solver: str = "euler",
              ode_steps: int | None = None) -> list[Step]:
    """The rollout's steps: one per schedule step, except that each ODE-only stretch longer than
    `ode_steps` is walked in `ode_steps` steps between schedule indices spread evenly over it."""
    plan, at = [], 0
    for a, b in sorted(stretches) + [(num_steps, num_steps)]:
        plan += [Step(i, i + 1) for i in range(at, a)]
        m = b - a if ode_steps is None else min(ode_steps, b - a)
        ends = [a + q * (b - a) // m for q in range(m + 1)] if b > a else [a]
        plan += [Step(i, k, multistep=solver == "ab2" and q > 0) for q, (i, k) in enumerate(zip(ends, ends[1:]))]
        at = b
    return plan


def plan_for(cfg: Config, window_at: int | None = None) -> list[Step]:
    """A training rollout's steps under the recipe's sample.ode_solver and sample.ode_steps (around a
    window that starts at `window_at`, where every rollout's starts there)."""
    return step_plan(cfg.sample.num_steps, ode_stretches(cfg, window_at), cfg.sample.ode_solver,
                     cfg.sample.ode_steps)


def multistep_velocity(v: torch.Tensor, v_prev: torch.Tensor, h_prev: float, h: float) -> torch.Tensor:
    """The velocity whose Euler step over h is the two-step Adams-Bashforth step (in fp32), given
    the previous step's velocity and length."""
    return v.float() + (h / (2 * h_prev)) * (v.float() - v_prev.float())
