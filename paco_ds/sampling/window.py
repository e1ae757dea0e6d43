"""The SDE window: which steps of a rollout are stochastic, log-probbed and trained.

Without `sample.sde_window` the recipe's fixed `noise_steps` (and `train.timesteps`) hold, as the
epoch's SamplingSpec has them. With it, `size` consecutive steps starting at an index in
[range[0], range[1] - size] are the SDE steps and the trained steps; every other step is an ODE step.
- `schedule: random` (Flow-GRPO-Fast): the start is drawn from a generator keyed by (seed, epoch)
  or (seed, epoch, prompt group), so a resumed run draws the same windows without storing them, and
  a sample's window does not depend on the world size or its batch.
- `schedule: sliding` (MixGRPO, arXiv 2507.21802): the start moves `stride` steps every
  `shift_every` epochs, from early (noisy, hard) steps to late ones; a function of the epoch alone.
"""
from __future__ import annotations

import torch

from paco_ds.recipe.schema import Config
from paco_ds.sampling.spec import SamplingSpec
from paco_ds.sampling.trajectory import make_generator


def window_start(cfg: Config, epoch: int, group: int | None = None) -> int:
    win = cfg.sample.sde_window
    lo, hi = win.range
    if win.schedule == "sliding":
        return sliding_start(lo, hi - win.size, epoch // win.shift_every, win.stride, win.roll_back)
    keys = (cfg.seed, "sde_window", epoch) if group is None else (cfg.seed, "sde_window", epoch, group)
    return lo + int(torch.randint(hi - win.size - lo + 1, (1,), generator=make_generator(*keys)))


def rollout_steps(cfg: Config, spec: SamplingSpec, epoch: int, groups: list[int]):
    """(noise_steps, train_steps) for a rollout batch of these prompt groups: the spec's (the
    recipe's), or the window's, shared or one list per sample when the window is drawn per group. No
    train steps where the spec keeps no log-probs."""
    win = cfg.sample.sde_window
    if win is None:
        return list(spec.noise_steps), list(spec.train_steps)
    if win.per == "epoch":
        s = window_start(cfg, epoch)
        steps = list(range(s, s + win.size))
        return steps, steps if spec.keep_log_probs else []
    per = [list(range(s, s + win.size)) for s in (window_start(cfg, epoch, g) for g in groups)]
    return per, per if spec.keep_log_probs else []


def sliding_start(first: int, last: int, moves: int, stride: int, roll_back: bool) -> int:
    """MixGRPO's window start after `moves` moves of `stride` from `first`: it stops at `last` (the
    window keeps its size), or with `roll_back` starts over at `first` once a move would pass it."""
    if roll_back:
        return first + stride * (moves % ((last - first) // stride + 1))
    return min(first + stride * moves, last)
