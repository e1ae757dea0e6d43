"""Per-prompt GRPO advantages over an epoch's gathered rewards, and the stat tracker.

Steps: drop masked samples (a failed reward is never a 0) -> aggregate the rewards (see
rewards/aggregate.py) -> rank transform for rank-GRPO -> normalise within each prompt group
(global or per-group std, floored) -> clip. Groups are identified by the prompt's dataset index,
not by a decoded string (the reference decodes T5 ids back to text, PaCo-RL/PaCo-GRPO/scripts/train_flux.py).

Two paths compute the same advantages in fp64:
  kernel  `kernels.grpo_advantages` on the trainer's device (one Triton launch on GPU, torch on
          CPU) for what it covers: centred weighted_sum or log_tame aggregation, GRPO, global or
          per-group std, clip.
  numpy   everything: the reference, and the only path for rank-GRPO, uncentred aggregations,
          geometric/harmonic means, weighted_advantage_sum, user functions and the fallback
          for epochs whose groups all have one sample (k = 1).
By default (`kernel="auto"`) the kernel runs where it covers the configuration and pays: on a GPU
always (one launch instead of host loops; not timed yet), on CPU from CPU_MIN_GROUPS prompt groups. The numpy path loops over groups, the torch one
has a fixed cost of about 0.1 ms. On CPU (1 thread; kernels/bench/results/advantages/cpu.json,
`python -m kernels.bench --ops advantages --no-compile`) the whole step for 672 samples x 3 rewards
in 42 groups takes 0.29 ms numpy / 0.21 ms kernel with log-tame and a global std (1.4x), 0.51 /
0.15 ms with a per-group std (3.5x); at 512 groups 4.2 / 0.93 ms (4.6x); at 8 groups of 8 the
kernel is slower (0.11 / 0.16 ms, log-tame), hence the threshold.
Both paths agree to 1e-12 (tests/test_advantages.py) but for one case: a group whose samples all
share a reward off the binary grid, under a per-group std, gets a rounding residue divided by
std_floor (about 1e-9 instead of 0) that each path rounds differently.
stats["kernel"] is 1.0 when the kernel ran, else 0.0. Masking, zero-std dropping and the group
statistics run in numpy after either path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from paco_ds.config import AdvantageConfig, AggregationConfig
from paco_ds.errors import RewardError
from paco_ds.rewards.aggregate import aggregate, group_normalize

KERNEL_AGGREGATIONS = ("weighted_sum", "log_tame")  # what kernels.grpo_advantages aggregates
CPU_MIN_GROUPS = 24  # below this many prompt groups the numpy path is faster on CPU (kernel="auto")

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
                 where: str = "rewards.train.aggregation.fn", *, kernel: bool | str = "auto",
                 backend: str = "auto"):
        """`kernel`: "auto" runs the kernel path where it covers the configuration and pays (see the
        module docstring), True wherever it covers it, False never. `backend`: the kernels backend
        of the kernel path (config key kernels.backend)."""
        if kernel not in (True, False, "auto"):
            raise ValueError(f"kernel must be True, False or 'auto', not {kernel!r}")
        self.adv, self.agg, self.weights, self.where = adv, agg, dict(weights), where
        self.kernel, self.backend = kernel, backend
        self.seen_groups: set[int] = set()

    def kernel_applies(self, group_ids: np.ndarray, device="cpu", n_groups: int | None = None) -> bool:
        """Whether the kernel path computes this epoch (its unmasked group ids) on `device`."""
        if n_groups is None:
            n_groups = len(np.unique(group_ids))
        covered = (self.agg.fn in KERNEL_AGGREGATIONS and self.agg.center and self.adv.method == "grpo"
                   and n_groups < len(group_ids))
        if self.kernel == "auto":
            pays = str(device).split(":")[0] != "cpu" or n_groups >= CPU_MIN_GROUPS
            return covered and pays
        return covered and self.kernel

    def compute(self, rewards: dict[str, np.ndarray], group_ids, valid: np.ndarray | None = None,
                device="cpu") -> AdvantageResult:
        """Advantages of one epoch's gathered rewards; `device`: where the kernel path runs (the
        trainer's device), rewards and results stay numpy arrays on the host."""
        group_ids = np.asarray(group_ids)
        n = len(group_ids)
        rewards = {k: np.asarray(v, dtype=np.float64) for k, v in rewards.items()}
        ok = np.ones(n, dtype=bool) if valid is None else np.asarray(valid, dtype=bool).copy()
        for v in rewards.values():
            ok &= np.isfinite(v)
        adv = np.zeros(n)
        combined = np.full(n, np.nan)
        stats: dict[str, float] = {"masked": float((~ok).sum()), "kernel": 0.0}
        idx = np.flatnonzero(ok)
        if idx.size:
            g = group_ids[idx]
            groups, inverse = np.unique(g, return_inverse=True)
            inverse = inverse.reshape(-1)
            kernel = self.kernel_applies(g, device, len(groups))
            if kernel:
                values, a, info = self._kernel(rewards, idx, inverse, device)
            else:
                values, a, info = self._numpy(rewards, idx, g)
            combined[idx], adv[idx] = values, a
            stats.update(info, kernel=float(kernel))
            group_std, group_stats = self._group_stats(values, groups, inverse)
            stats.update(group_stats)
            self.seen_groups.update(groups.tolist())
        keep = ok.copy()
        if self.adv.drop_zero_std_groups and idx.size:
            keep[idx[group_std[inverse] < ZERO_STD]] = False
        adv[~keep] = 0.0
        stats["dropped"] = float((ok & ~keep).sum())
        stats["adv_abs_mean"] = float(np.abs(adv[keep]).mean()) if keep.any() else 0.0
        stats["trained_prompt_num"] = float(len(self.seen_groups))
        return AdvantageResult(adv, combined, keep, stats)

    def _numpy(self, rewards: dict[str, np.ndarray], idx: np.ndarray, g: np.ndarray):
        """(aggregated rewards, clipped advantages, aggregation statistics) of the samples `idx`."""
        agg = aggregate({k: v[idx] for k, v in rewards.items()}, self.weights, self.agg.fn, g,
                        threshold=self.agg.threshold, global_std=self.adv.global_std,
                        std_floor=self.adv.std_floor, center=self.agg.center, where=self.where)
        # Uncentred (the reference's use of an aggregation function's output as the advantage);
        # its default weighted sum was always normalised, so compat mode normalises it too.
        if agg.is_advantage or (not self.agg.center and self.agg.fn != "weighted_sum"):
            a = agg.values
        else:
            values = group_ranks(agg.values, g) if self.adv.method == "rank_grpo" else agg.values
            if len(np.unique(g)) == len(g):
                # Every group has one sample (k = 1): normalise over the batch instead.
                a = group_normalize(values, np.zeros_like(g), True, self.adv.std_floor)
            else:
                a = group_normalize(values, g, self.adv.global_std, self.adv.std_floor)
        return agg.values, np.clip(a, -self.adv.clip, self.adv.clip), agg.info

    def _kernel(self, rewards: dict[str, np.ndarray], idx: np.ndarray, dense_ids: np.ndarray, device):
        """The same as `_numpy` through kernels.grpo_advantages on `device` (see `kernel_applies`);
        `dense_ids`: each sample's group as 0..G-1 (any id type upstream)."""
        import torch

        import kernels
        from kernels.grpo import LogTameDomainError

        names = list(rewards)
        r = torch.from_numpy(np.stack([rewards[n][idx] for n in names])).to(device)
        dense = torch.from_numpy(dense_ids).to(device)
        tame = self.agg.threshold if self.agg.fn == "log_tame" else None
        try:
            out = kernels.grpo_advantages(r, [self.weights.get(n, 1.0) for n in names], dense, log_tame=tame,
                                          global_std=self.adv.global_std, std_floor=self.adv.std_floor,
                                          clip=self.adv.clip, backend=self.backend)
        except LogTameDomainError as err:  # the numpy path's message, with the reward's name
            raise RewardError(f"log_tame: reward '{names[err.index]}' has values <= -1 (min {err.minimum:.4g}); "
                              "log(1+r) is undefined") from None
        info: dict[str, float] = {}
        if tame is not None:
            cv, tamed = out.cv.cpu().tolist(), out.tamed.cpu().tolist()
            info.update({f"log_tame/h/{n}": cv[i] for i, n in enumerate(names)})
            info.update({f"log_tame/tamed/{n}": float(tamed[i]) for i, n in enumerate(names)})
            info["log_tame/threshold"] = float(out.threshold)
        return out.combined.cpu().numpy(), out.advantages.cpu().numpy(), info

    @staticmethod
    def _group_stats(values: np.ndarray, groups: np.ndarray, inverse: np.ndarray):
        """(std of each group, statistics) of the samples' values; `inverse`: each one's group index."""
        sizes = np.bincount(inverse)
        mean = np.bincount(inverse, values) / sizes
        stds = np.sqrt(np.bincount(inverse, (values - mean[inverse]) ** 2) / sizes)
        return stds, {
            "num_groups": float(len(groups)), "avg_group_size": float(sizes.mean()),
            "avg_group_std": float(stds.mean()), "global_std": float(values.std()),
            "zero_std_ratio": float((stds < ZERO_STD).mean())}

    def state_dict(self) -> dict:
        return {"seen_groups": sorted(self.seen_groups)}

    def load_state_dict(self, state: dict) -> None:
        self.seen_groups = set(state.get("seen_groups", []))
