"""An epoch's values: its samples once scored (`EpochSamples`) and their micro-batches, how far its
training got (`EpochProgress`, what a mid-epoch checkpoint holds), and its printed line."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from paco_ds.sampling.rollouts import Pick
from paco_ds.sampling.trajectory import Trajectory, TrainingBatch, training_batch


@dataclass
class EpochSamples:
    """The epoch's rollout batches and, once scored, each sample's advantage and whether it trains
    (one [B] tensor per rollout batch; advantages [B, T] under tree rollouts, one per trained step)."""
    trajectories: list[Trajectory] = field(default_factory=list)
    advantages: list[torch.Tensor] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)
    transformer_calls: int = 0  # rows x steps the rollouts ran the transformer for (this rank)
    # Scored in other processes (rollout.mode: async, paco_ds/grpo/async_rollouts.py): each reward's
    # results over the epoch, the judge's latencies, the reward failures counted so far on this rank's
    # batches; None where this process scored its samples itself.
    rewards: dict | None = None
    judge_latency_s: list[float] | None = None
    reward_failures: int | None = None
    metrics: dict = field(default_factory=dict)  # what the epoch's sampling adds to its metrics

    def batch(self, entries: list[tuple[int, int]], fillers: list[bool]) -> TrainingBatch:
        """The training batch of these (rollout batch, sample) entries; a filler trains nothing
        (advantage 0, not kept)."""
        off = torch.tensor(fillers, dtype=torch.bool)
        adv = torch.stack([self.advantages[k][i] for k, i in entries])  # [B], or [B, T] per trained step (a tree)
        adv = adv.masked_fill(off.view(-1, *[1] * (adv.dim() - 1)), 0.0)
        keep = torch.stack([self.keep[k][i] for k, i in entries]) & ~off
        return training_batch([(self.trajectories[k], i) for k, i in entries], adv, keep)


@dataclass
class EpochProgress:
    """An epoch from its scoring to its last micro-step: everything a mid-epoch (preemption)
    checkpoint keeps so that the resumed run finishes the epoch exactly as it would have. Its
    fields are the checkpoint's pieces (`to_state`, `from_state`), in `REQUIRED`'s order."""
    samples: EpochSamples  # the rollouts, advantages and keep flags
    metrics: dict  # the epoch's metrics before training (sampling, rewards, advantages)
    forwards: int = 0  # transformer forwards of the epoch's training: one per trained sample and step
    loss_epoch: dict | None = None  # the loss's epoch state (e.g. NFT's visits) when saved; None before
    stats: dict[str, list[float]] = field(default_factory=dict)  # each micro-step's statistics
    first: dict[str, float] = field(default_factory=dict)  # the loss's `first_of_epoch` ones, at its first
    done: int = 0  # micro-steps taken
    micro_step_id: int = 0  # micro-steps accumulated since the last optimizer step (ZeRO-3), when saved
    grads: list[torch.Tensor] | None = None  # and their gradients: this rank's partition

    REQUIRED: ClassVar[tuple[str, ...]] = ("samples", "metrics", "forwards", "loss_epoch", "stats", "first", "done",
                                           "micro_step_id", "grads")

    def record(self, step_stats: dict[str, float], first_of_epoch) -> None:
        """One micro-step taken: its statistics, and the `first_of_epoch` ones if it is the first."""
        for key in first_of_epoch:
            if key in step_stats:
                self.first.setdefault(key, step_stats[key])
        for key, v in step_stats.items():
            self.stats.setdefault(key, []).append(v)
        self.done += 1

    def to_state(self) -> dict:
        return {name: getattr(self, name) for name in self.REQUIRED}

    @classmethod
    def from_state(cls, state: dict) -> EpochProgress:
        return cls(**{name: state[name] for name in cls.REQUIRED})

    @classmethod
    def missing(cls, state: dict) -> list[str]:
        """The pieces a mid-epoch checkpoint's `state` lacks, each named (an older layout)."""
        return [f"mid-epoch '{name}'" for name in cls.REQUIRED if name not in state]


def rank_batch_picks(items: list, rank_batch, member) -> list[Pick]:
    """The samples of one rank batch of the epoch plan (data.KRepeatSampler): each prompt item, its group,
    its position and (`member`, by position) its leaf in its group."""
    return [Pick(items[i], i, p, int(member[p])) for i, p in zip(rank_batch.indices, rank_batch.positions)]


def micro_batches(pool: list[tuple[int, int]], n_micro: int, batch_size: int,
                  generator: torch.Generator) -> list[tuple[list[tuple[int, int]], list[bool]]]:
    """An inner epoch's shuffle of `pool` ((rollout batch, sample) entries) in `n_micro` micro-batches
    of (entries, fillers); a rank short of samples pads with fillers: samples of the pool that
    train nothing (EpochSamples.batch)."""
    order = [pool[i] for i in torch.randperm(len(pool), generator=generator).tolist()]
    padded = order + [None] * (n_micro * batch_size - len(order))  # None: a zero-advantage filler
    chunks = [padded[m * batch_size:(m + 1) * batch_size] for m in range(n_micro)]
    return [([e if e is not None else pool[j % len(pool)] for j, e in enumerate(chunk)], [e is None for e in chunk])
            for chunk in chunks]


def epoch_line(m: dict, headline: dict[str, str]) -> str:
    """An epoch's one line: its rewards, the loss and the statistics the loss declares (`headline`:
    name -> format), the time."""
    rewards = " ".join(f"{k[len('reward/'):-len('/mean')]}={m[k]:.4g}" for k in m
                       if k.startswith("reward/") and k.endswith("/mean"))
    report = "".join(f" {k}={m.get(f'train/{k}', float('nan')):{fmt}}" for k, fmt in headline.items())
    return f"epoch {m['epoch']:4d} | {rewards} | loss={m.get('train/loss', float('nan')):.4g}{report} | {m['time/epoch']:.1f}s"
