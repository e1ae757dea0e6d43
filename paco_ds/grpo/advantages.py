"""Per-prompt GRPO advantages over an epoch's gathered rewards, and the stat tracker.

Steps: drop masked samples (a failed reward is never a 0) -> aggregate the rewards (see
rewards/aggregate.py) -> rank transform for rank-GRPO -> normalise within each prompt group
(global or per-group std, floored) -> clip. Groups are identified by the prompt's dataset index,
not by a decoded string (REFERENCE.md §12.13).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from paco_ds.config import AdvantageConfig, AggregationConfig
from paco_ds.rewards.aggregate import aggregate, group_normalize

ZERO_STD = 1e-5  # a group whose std is below this carries no learning signal


@dataclass
class AdvantageResult:
    advantages: np.ndarray  # [N]; 0 where not kept
    combined: np.ndarray  # aggregated reward per sample; NaN where masked
    keep: np.ndarray  # bool [N]: the sample is trained
    stats: dict[str, float] = field(default_factory=dict)


def group_ranks(values: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """Within-group rank / max(n - 1, 1); ties share their average rank (so equal rewards stay equal)."""
    from scipy.stats import rankdata

    out = np.zeros_like(values, dtype=np.float64)
    for g in np.unique(group_ids):
        sel = group_ids == g
        out[sel] = (rankdata(values[sel], method="average") - 1) / max(sel.sum() - 1, 1)
    return out


class StatTracker:
    """Computes each epoch's advantages and keeps what spans epochs (prompts seen so far)."""

    def __init__(self, adv: AdvantageConfig, agg: AggregationConfig, weights: dict[str, float],
                 where: str = "rewards.train.aggregation.fn"):
        self.adv, self.agg, self.weights, self.where = adv, agg, dict(weights), where
        self.seen_groups: set[int] = set()

    def compute(self, rewards: dict[str, np.ndarray], group_ids, valid: np.ndarray | None = None) -> AdvantageResult:
        group_ids = np.asarray(group_ids)
        n = len(group_ids)
        rewards = {k: np.asarray(v, dtype=np.float64) for k, v in rewards.items()}
        ok = np.ones(n, dtype=bool) if valid is None else np.asarray(valid, dtype=bool).copy()
        for v in rewards.values():
            ok &= np.isfinite(v)
        adv = np.zeros(n)
        combined = np.full(n, np.nan)
        stats: dict[str, float] = {"masked": float((~ok).sum())}
        idx = np.flatnonzero(ok)
        if idx.size:
            g = group_ids[idx]
            agg = aggregate({k: v[idx] for k, v in rewards.items()}, self.weights, self.agg.fn, g,
                            threshold=self.agg.threshold, global_std=self.adv.global_std,
                            std_floor=self.adv.std_floor, where=self.where)
            combined[idx] = agg.values
            stats.update(agg.info)
            if agg.is_advantage or not self.agg.center:
                a = agg.values
            else:
                values = group_ranks(agg.values, g) if self.adv.method == "rank_grpo" else agg.values
                if len(np.unique(g)) == len(g):
                    # Every group has one sample (k = 1): normalise over the batch instead.
                    a = group_normalize(values, np.zeros_like(g), True, self.adv.std_floor)
                else:
                    a = group_normalize(values, g, self.adv.global_std, self.adv.std_floor)
            adv[idx] = np.clip(a, -self.adv.clip, self.adv.clip)
            stats.update(self._group_stats(agg.values, g))
            self.seen_groups.update(int(x) for x in np.unique(g))
        keep = ok.copy()
        if self.adv.drop_zero_std_groups and idx.size:
            for gid in np.unique(group_ids[idx]):
                sel = ok & (group_ids == gid)
                if combined[sel].std() < ZERO_STD:
                    keep[sel] = False
        adv[~keep] = 0.0
        stats["dropped"] = float((ok & ~keep).sum())
        stats["adv_abs_mean"] = float(np.abs(adv[keep]).mean()) if keep.any() else 0.0
        stats["trained_prompt_num"] = float(len(self.seen_groups))
        return AdvantageResult(adv, combined, keep, stats)

    @staticmethod
    def _group_stats(values: np.ndarray, g: np.ndarray) -> dict[str, float]:
        groups = np.unique(g)
        stds = np.array([values[g == x].std() for x in groups])
        sizes = np.array([(g == x).sum() for x in groups])
        return {"num_groups": float(len(groups)), "avg_group_size": float(sizes.mean()),
                "avg_group_std": float(stds.mean()), "global_std": float(values.std()),
                "zero_std_ratio": float((stds < ZERO_STD).mean())}

    def state_dict(self) -> dict:
        return {"seen_groups": sorted(self.seen_groups)}

    def load_state_dict(self, state: dict) -> None:
        self.seen_groups = set(state.get("seen_groups", []))
