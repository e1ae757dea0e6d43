"""An epoch's values: its samples once scored (`EpochSamples`) and its printed line."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paco_ds.sampling.rollout import Trajectory, TrainingBatch, training_batch


@dataclass
class EpochSamples:
    """The epoch's rollout batches and, once scored, each sample's advantage and whether it trains
    (one [B] tensor per rollout batch)."""
    trajectories: list[Trajectory] = field(default_factory=list)
    advantages: list[torch.Tensor] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)
    transformer_calls: int = 0  # rows x steps the rollouts ran the transformer for (this rank)

    def batch(self, entries: list[tuple[int, int]], fillers: list[bool]) -> TrainingBatch:
        """The training batch of these (rollout batch, sample) entries; a filler trains nothing
        (advantage 0, not kept)."""
        off = torch.tensor(fillers, dtype=torch.bool)
        adv = torch.stack([self.advantages[k][i] for k, i in entries]).masked_fill(off, 0.0)
        keep = torch.stack([self.keep[k][i] for k, i in entries]) & ~off
        return training_batch([(self.trajectories[k], i) for k, i in entries], adv, keep)


def epoch_line(m: dict, headline: dict[str, str]) -> str:
    """An epoch's one line: its rewards, the loss and the statistics the loss declares (`headline`:
    name -> format), the time."""
    rewards = " ".join(f"{k[len('reward/'):-len('/mean')]}={m[k]:.4g}" for k in m
                       if k.startswith("reward/") and k.endswith("/mean"))
    report = "".join(f" {k}={m.get(f'train/{k}', float('nan')):{fmt}}" for k, fmt in headline.items())
    return f"epoch {m['epoch']:4d} | {rewards} | loss={m.get('train/loss', float('nan')):.4g}{report} | {m['time/epoch']:.1f}s"
