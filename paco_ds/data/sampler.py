"""The distributed k-repeat sampler: m prompts x k copies per epoch, shared out over ranks.

Every rank computes the same global plan from `seed + epoch` (no communication), takes its
slices, and knows each sample's group (the prompt's dataset index) and global position, so
advantages can be computed from an all-gather in any order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RankBatch:
    indices: tuple[int, ...]  # dataset indices (= group ids: one prompt per group per epoch)
    positions: tuple[int, ...]  # global positions in the epoch plan (0 .. m*k-1)


class KRepeatSampler:
    def __init__(self, num_prompts: int, group_size: int, prompts_per_epoch: int, world_size: int,
                 rank: int, batch_size: int, seed: int):
        if prompts_per_epoch > num_prompts:
            raise ValueError(f"prompts_per_epoch={prompts_per_epoch} > dataset size {num_prompts}")
        total = prompts_per_epoch * group_size
        if total % (world_size * batch_size):
            raise ValueError(f"m*k={total} is not divisible by world_size*batch_size={world_size * batch_size}")
        self.num_prompts, self.k, self.m = num_prompts, group_size, prompts_per_epoch
        self.world_size, self.rank, self.batch_size, self.seed = world_size, rank, batch_size, seed

    def epoch_plan(self, epoch: int) -> torch.Tensor:
        """Dataset index of every sample of the epoch, in global order (m*k entries)."""
        g = torch.Generator().manual_seed(self.seed + epoch)
        chosen = torch.randperm(self.num_prompts, generator=g)[: self.m]
        repeated = chosen.repeat_interleave(self.k)
        return repeated[torch.randperm(len(repeated), generator=g)]

    def rank_batches(self, epoch: int) -> list[RankBatch]:
        plan = self.epoch_plan(epoch).tolist()
        step = self.world_size * self.batch_size
        out = []
        for start in range(0, len(plan), step):
            lo = start + self.rank * self.batch_size
            pos = tuple(range(lo, lo + self.batch_size))
            out.append(RankBatch(indices=tuple(plan[p] for p in pos), positions=pos))
        return out

    def __len__(self) -> int:
        return self.m * self.k // (self.world_size * self.batch_size)
