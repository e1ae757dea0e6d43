"""Per-prompt GRPO advantages over an epoch's gathered rewards, and the stat tracker.

Steps: drop masked samples (a failed reward is never a 0) -> aggregate the rewards that apply to
each sample (a reward that does not apply by construction, as a pairwise judge to a one-panel image,
is left out of that sample's aggregate rather than scored 0; see
rewards/aggregate.py) -> rank transform for rank-GRPO -> normalise within each prompt group
(global or per-group std, floored) -> clip. Groups are identified by the prompt's dataset index,
not by a decoded string (the reference decodes T5 ids back to text, PaCo-RL/PaCo-GRPO/scripts/train_flux.py).

One path, in torch (fp64) on the trainer's device: the normalisation and clip are
`kernels.grpo_advantages` of the aggregated reward (one Triton launch on CUDA tensors, torch
elsewhere; tests/kernel_checks.py holds the two together). The step costs well under a
millisecond per epoch on CPU, so nothing chooses between implementations; numpy remains only at
the edges (the gathered rewards arrive as arrays, the results leave as arrays) and for a user's
own `module:function` aggregation. Masking, zero-std dropping and the group statistics run on the
host, where the arrays are.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from paco_ds.recipe.schema import AdvantageConfig, AggregationConfig
from paco_ds.rewards.aggregate import aggregate, group_normalize

ZERO_STD = 1e-5  # a group whose std is below this carries no learning signal


@dataclass
class EpochRewards:
    """Every rank's rewards of an epoch in the epoch's sample order (the same arrays on every
    rank), and where this rank's own samples sit in that order."""

    groups: np.ndarray  # [N] prompt group of each sample
    valid: np.ndarray  # [N] bool: every reward that applies to the sample scored it
    scores: dict[str, np.ndarray]  # reward name -> [N]; NaN where failed or not applicable
    parts: dict[str, np.ndarray]  # a reward's parts (e.g. consistency and following) -> [N]
    latency_s: list[list[float]]  # each rank's judge request latencies
    mine: np.ndarray  # [n] this rank's samples' indices in the order above, in its own order
    applicable: dict[str, np.ndarray] = field(default_factory=dict)  # reward name -> [N] bool

    @classmethod
    def gather(cls, positions: np.ndarray, groups: np.ndarray, valid: np.ndarray, scores: dict[str, np.ndarray],
               parts: dict[str, np.ndarray], latency_s: list[float],
               applicable: dict[str, np.ndarray] | None = None, scored: bool = True) -> "EpochRewards":
        """Collective: each rank's samples (their epoch positions, groups and rewards), sorted by
        position, so that a group's statistics do not depend on which rank sampled what.
        `applicable`: per reward, which samples it applies to (None: all). `scored`: whether this rank
        scored its samples; a rank of a sequence group other than its first holds the same samples
        and sends only their positions, to find its own in the order (parallel.sequence)."""
        from paco_ds.runtime.distributed import all_gather_object

        applicable = applicable if applicable is not None else {n: np.ones(len(positions), bool) for n in scores}
        everyone = all_gather_object({"positions": positions, "groups": groups, "valid": valid, "scores": scores,
                                      "parts": parts, "latency_s": latency_s, "applicable": applicable,
                                      "scored": scored})
        everyone = [e for e in everyone if e["scored"]]
        pos = np.concatenate([e["positions"] for e in everyone])
        order = np.argsort(pos)

        def joined(get) -> np.ndarray:
            return np.concatenate([get(e) for e in everyone])[order]

        return cls(groups=joined(lambda e: e["groups"]), valid=joined(lambda e: e["valid"]),
                   scores={name: joined(lambda e, n=name: e["scores"][n]) for name in scores},
                   # a part one rank's samples lack (a multi-image edit's input2 where that rank drew
                   # single-image edits only) is NaN there, as RewardRunner joins batches
                   parts={name: joined(lambda e, n=name: e["parts"].get(n, np.full(len(e["positions"]), np.nan)))
                          for name in dict.fromkeys(n for e in everyone for n in e["parts"])},
                   latency_s=[e["latency_s"] for e in everyone],
                   mine=np.searchsorted(pos[order], positions),
                   applicable={name: joined(lambda e, n=name: e["applicable"][n]) for name in scores})

    def split(self, values: np.ndarray, sizes: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
        """This rank's share of a per-sample array over the epoch, one tensor per rollout batch."""
        out, start = [], 0
        for n in sizes:
            out.append(torch.as_tensor(values[self.mine[start:start + n]], dtype=dtype))
            start += n
        return out

    def metrics(self, adv: AdvantageResult) -> dict[str, float]:
        """The epoch's advantage statistics, each reward's (and reward part's) mean and std over the
        samples it scored, the aggregated reward's mean and the masked samples' count."""
        metrics = {f"adv/{k}": v for k, v in adv.stats.items()}
        for name, part in self.parts.items():
            metrics[f"reward/{name}/mean"] = float(np.nanmean(part)) if np.isfinite(part).any() else float("nan")
        for name, s in self.scores.items():
            ok = self.valid & np.isfinite(s)
            metrics[f"reward/{name}/mean"] = float(s[ok].mean()) if ok.any() else float("nan")
            metrics[f"reward/{name}/std"] = float(s[ok].std()) if ok.any() else float("nan")
            applies = self.applicable.get(name)
            if applies is not None and not applies.all():  # e.g. one-panel images for a pairwise judge
                metrics[f"reward/{name}/not_applicable"] = float((~applies).sum())
        finite = np.isfinite(adv.combined)
        metrics["reward/combined/mean"] = float(adv.combined[finite].mean()) if finite.any() else float("nan")
        metrics["reward/masked"] = float((~self.valid).sum())
        return metrics


def judge_latency_metrics(per_rank: list[list[float]]) -> dict[str, float]:
    """judge/latency_ms_p50 and _p90 over every rank's requests, and the slowest rank's median
    (a rank routed to a far or overloaded judge shows there); {} without remote rewards."""
    pooled = np.concatenate([np.asarray(r, dtype=np.float64) for r in per_rank]) * 1000
    if not pooled.size:
        return {}
    return {"judge/latency_ms_p50": float(np.percentile(pooled, 50)),
            "judge/latency_ms_p90": float(np.percentile(pooled, 90)),
            "judge/latency_ms_slowest_rank": float(max(np.median(r) for r in per_rank if len(r)) * 1000)}


@dataclass
class AdvantageResult:
    advantages: np.ndarray  # [N]; 0 where not kept
    combined: np.ndarray  # aggregated reward per sample; NaN where masked
    keep: np.ndarray  # bool [N]: the sample is trained
    stats: dict[str, float] = field(default_factory=dict)


def group_ranks(values, group_ids) -> torch.Tensor:
    """Within-group rank / max(n - 1, 1); ties share their average rank (so equal rewards stay equal)."""
    values = torch.as_tensor(values, dtype=torch.float64)
    ids = torch.as_tensor(group_ids, device=values.device)
    out = torch.zeros_like(values)
    for g in torch.unique(ids):
        sel = ids == g
        v = values[sel]
        below = (v[None, :] < v[:, None]).sum(1).double()
        equal = (v[None, :] == v[:, None]).sum(1).double()
        out[sel] = (below + (equal - 1) / 2) / max(len(v) - 1, 1)  # 0-based average rank
    return out


class StatTracker:
    """Computes each epoch's advantages and keeps what spans epochs (prompts seen so far)."""

    def __init__(self, adv: AdvantageConfig, agg: AggregationConfig, weights: dict[str, float],
                 where: str = "rewards.train.aggregation.fn", *, backend: str = "auto"):
        """`backend`: the kernels backend of the normalisation (config key kernels.backend)."""
        self.adv, self.agg, self.weights, self.where = adv, agg, dict(weights), where
        self.backend = backend
        self.seen_groups: set[int] = set()

    def compute(self, rewards: dict[str, np.ndarray], group_ids, valid: np.ndarray | None = None,
                device="cpu", applicable: dict[str, np.ndarray] | None = None) -> AdvantageResult:
        """Advantages of one epoch's gathered rewards (host arrays in, host arrays out); `device`:
        where the advantages are computed (the trainer's device). `applicable`: per reward, the
        samples it applies to (None: all); elsewhere it is NaN and left out of the aggregate, and a
        sample no reward applies to is not trained."""
        ids = torch.as_tensor(np.asarray(group_ids))
        n = len(ids)
        r = {k: torch.as_tensor(np.asarray(v), dtype=torch.float64) for k, v in rewards.items()}
        ok = torch.ones(n, dtype=torch.bool) if valid is None else torch.as_tensor(np.asarray(valid), dtype=torch.bool)
        applies = {k: torch.ones(n, dtype=torch.bool) if applicable is None or k not in applicable
                   else torch.as_tensor(np.asarray(applicable[k]), dtype=torch.bool) for k in r}
        for k, v in r.items():
            ok = ok & (torch.isfinite(v) | ~applies[k])
            r[k] = torch.where(applies[k], v, torch.tensor(float("nan"), dtype=torch.float64))
        if r:
            ok = ok & torch.stack(list(applies.values())).any(0)  # at least one reward judges it
        adv = torch.zeros(n, dtype=torch.float64)
        combined = torch.full((n,), float("nan"), dtype=torch.float64)
        keep = ok.clone()
        stats: dict[str, float] = {"masked": float((~ok).sum())}
        idx = ok.nonzero().flatten()
        if idx.numel():
            g = ids[idx]
            groups, inverse = torch.unique(g, return_inverse=True)
            values, a, info = self._advantages({k: v[idx].to(device) for k, v in r.items()}, g.to(device),
                                               len(groups) == len(g))
            combined[idx], adv[idx] = values.cpu(), a.cpu()
            stats.update(info)
            group_std, group_stats = self._group_stats(combined[idx], groups, inverse)
            stats.update(group_stats)
            self.seen_groups.update(groups.tolist())
            if self.adv.drop_zero_std_groups:
                keep[idx[group_std[inverse] < ZERO_STD]] = False
        adv[~keep] = 0.0
        stats["dropped"] = float((ok & ~keep).sum())
        stats["adv_abs_mean"] = float(adv[keep].abs().mean()) if keep.any() else 0.0
        stats["trained_prompt_num"] = float(len(self.seen_groups))
        return AdvantageResult(adv.numpy(), combined.numpy(), keep.numpy(), stats)

    def _advantages(self, rewards: dict[str, torch.Tensor], g: torch.Tensor, singletons: bool):
        """(aggregated rewards, clipped advantages, aggregation statistics) of the unmasked samples,
        with group ids `g`; `singletons`: every group has one sample (k = 1)."""
        agg = aggregate(rewards, self.weights, self.agg.fn, g, threshold=self.agg.threshold,
                        global_std=self.adv.global_std, std_floor=self.adv.std_floor, center=self.agg.center,
                        where=self.where, backend=self.backend)
        clip = self.adv.clip
        # Uncentred (the reference's use of an aggregation function's output as the advantage);
        # its default weighted sum was always normalised, so compat mode normalises it too.
        if agg.is_advantage or (not self.agg.center and self.agg.fn != "weighted_sum"):
            return agg.values, agg.values.clamp(-clip, clip), agg.info
        values = group_ranks(agg.values, g) if self.adv.method == "rank_grpo" else agg.values
        if singletons:  # k = 1: normalise over the batch instead
            a = group_normalize(values, torch.zeros_like(g), True, self.adv.std_floor, clip, self.backend)
        else:
            a = group_normalize(values, g, self.adv.global_std, self.adv.std_floor, clip, self.backend)
        return agg.values, a, agg.info

    @staticmethod
    def _group_stats(values: torch.Tensor, groups: torch.Tensor, inverse: torch.Tensor):
        """(std of each group, statistics) of the samples' values; `inverse`: each one's group index."""
        sizes = torch.bincount(inverse).double()
        mean = torch.zeros(len(groups), dtype=torch.float64).index_add_(0, inverse, values) / sizes
        stds = (torch.zeros(len(groups), dtype=torch.float64).index_add_(0, inverse, (values - mean[inverse]) ** 2)
                / sizes).sqrt()
        return stds, {
            "num_groups": float(len(groups)), "avg_group_size": float(sizes.mean()),
            "avg_group_std": float(stds.mean()), "global_std": float(values.std(unbiased=False)),
            "zero_std_ratio": float((stds < ZERO_STD).double().mean())}

    def state_dict(self) -> dict:
        return {"seen_groups": sorted(self.seen_groups)}

    def load_state_dict(self, state: dict) -> None:
        self.seen_groups = set(state.get("seen_groups", []))
