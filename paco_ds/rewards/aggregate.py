"""Multi-reward aggregation: several per-sample rewards -> one value per sample, in torch (fp64).

Built-ins (PaCo-RL/PaCo-GRPO/config/grpo.py's aggregate functions): weighted_sum (default),
geometric_mean, harmonic_mean, log_tame(threshold), weighted_advantage_sum(global_std); or any
"module:function" with the signature fn(rewards: dict[str, ndarray], weights: dict[str, float],
group_ids: ndarray) -> ndarray (numpy arrays: a user's function is the one place numpy remains).

All but weighted_advantage_sum return an aggregated *reward* that the GRPO step then normalises
per prompt group; the reference used those outputs directly as advantages (uncentred, often all
positive). `aggregation.center: false` reproduces that behaviour on purpose, and with it the
reference's unweighted means: its geometric and harmonic means (scipy's gmean/hmean across the
reward types) ignore the reward weights. The default (centred) mode weights them:
exp(sum w_k log r_k / sum w_k) and sum w_k / sum (w_k / r_k).

A reward that does not apply to a sample by construction (a pairwise judge and a one-panel image,
paco_ds/rewards/base.py) is NaN there and is left out of that sample's aggregate: a sum adds the
terms that apply with their own weights (what the reference's 0.0 for such a sample gives a
weighted sum), the means take the weighted mean over the terms that apply (their weights
renormalised to those terms), log_tame measures each reward's spread over the samples it applies
to, and weighted_advantage_sum normalises each reward over those samples (its term is 0
elsewhere). A user's function receives the NaNs as they are. A sample no reward applies to never
reaches aggregation (paco_ds/grpo/advantages.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from paco_ds.errors import ConfigError, RewardError
from paco_ds.recipe.loader import resolve

BUILTIN = ("weighted_sum", "geometric_mean", "harmonic_mean", "log_tame", "weighted_advantage_sum")


@dataclass
class Aggregated:
    values: torch.Tensor  # one fp64 value per sample
    is_advantage: bool  # True: already centred and scaled (weighted_advantage_sum)
    info: dict


def _stack(rewards: dict, weights: dict[str, float]) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """(names, rewards [K, N] fp64, weights [K] fp64) on the rewards' device; NaN where a reward
    does not apply to a sample."""
    names = list(rewards)
    r = torch.stack([torch.as_tensor(rewards[n], dtype=torch.float64) for n in names])
    w = torch.tensor([weights.get(n, 1.0) for n in names], dtype=torch.float64, device=r.device)
    return names, r, w


def _applied_weights(r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[K, N]: each reward's weight where it applies to the sample, 0 where it does not (NaN)."""
    return torch.where(torch.isfinite(r), w[:, None], torch.zeros((), dtype=r.dtype, device=r.device))


def weighted_sum(rewards, weights, group_ids=None) -> torch.Tensor:
    _, r, w = _stack(rewards, weights)
    return (_applied_weights(r, w) * r.nan_to_num(0.0)).sum(0)


def _require_positive(names, r, fn):
    for i, n in enumerate(names):
        if bool((r[i] <= 0).any()):  # NaN (not applicable) compares False
            raise RewardError(f"{fn} needs positive rewards, but '{n}' has min {r[i].nanquantile(0).item():.4g}")


def geometric_mean(rewards, weights, group_ids=None, weighted: bool = True) -> torch.Tensor:
    """Weighted geometric mean across reward types; `weighted=False` ignores the weights (the reference)."""
    names, r, w = _stack(rewards, weights)
    _require_positive(names, r, "geometric_mean")
    wa = _applied_weights(r, w if weighted else torch.ones_like(w))
    return torch.exp((wa * torch.log(r).nan_to_num(0.0)).sum(0) / wa.sum(0))


def harmonic_mean(rewards, weights, group_ids=None, weighted: bool = True) -> torch.Tensor:
    """Weighted harmonic mean across reward types; `weighted=False` ignores the weights (the reference)."""
    names, r, w = _stack(rewards, weights)
    _require_positive(names, r, "harmonic_mean")
    wa = _applied_weights(r, w if weighted else torch.ones_like(w))
    return wa.sum(0) / (wa / r.nan_to_num(1.0)).sum(0)


def log_tame(rewards, weights, group_ids=None, threshold="mean") -> tuple[torch.Tensor, dict]:
    """Rewards whose coefficient of variation h_k = std(r_k) / (mean(r_k) + 1e-6) over the batch
    exceeds the threshold (the mean or median of the h_k, or a number) are replaced by log(1 + r)."""
    names, r, w = _stack(rewards, weights)
    mean = r.nanmean(dim=1)  # over the samples each reward applies to
    h = ((r - mean[:, None]) ** 2).nanmean(dim=1).sqrt() / (mean + 1e-6)
    measured = h[torch.isfinite(h)]  # a reward that applies to no sample of the batch has no spread
    if threshold == "median":  # the two middle values averaged (numpy's median; torch's takes the lower one)
        s = measured.sort().values
        tau = float((s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2)
    else:
        tau = float(measured.mean() if threshold == "mean" else threshold)
    tamed = (h > tau).tolist()
    for i, n in enumerate(names):
        if tamed[i] and bool((r[i] <= -1).any()):
            raise RewardError(f"log_tame: reward '{n}' has values <= -1 (min {r[i].min().item():.4g}); "
                              "log(1+r) is undefined")
    r = torch.where(torch.tensor(tamed, device=r.device)[:, None], torch.log1p(r), r)
    info = {f"log_tame/h/{n}": float(h[i]) for i, n in enumerate(names)}
    info.update({f"log_tame/tamed/{n}": float(tamed[i]) for i, n in enumerate(names)}, **{"log_tame/threshold": tau})
    return (_applied_weights(r, w) * r.nan_to_num(0.0)).sum(0), info


def group_normalize(values: torch.Tensor, group_ids, global_std: bool, std_floor: float,
                    clip: float = float("inf"), backend: str = "auto") -> torch.Tensor:
    """(v - mean of the sample's group) / std, std global or per group, floored (ddof 0), clipped to
    +-clip: kernels.grpo_advantages of one reward type (Triton on CUDA tensors, torch elsewhere)."""
    import kernels

    values = torch.as_tensor(values, dtype=torch.float64)
    ids = torch.as_tensor(group_ids, device=values.device)
    return kernels.grpo_advantages(values[None], [1.0], ids, global_std=global_std, std_floor=std_floor,
                                   clip=clip, backend=backend).advantages


def weighted_advantage_sum(rewards, weights, group_ids, global_std=True, std_floor=1e-6,
                           backend="auto") -> torch.Tensor:
    """Normalise each reward per group on its own (over the samples it applies to), then sum the
    advantages with the weights."""
    names, r, w = _stack(rewards, weights)
    ids = torch.as_tensor(group_ids, device=r.device)
    out = torch.zeros(r.shape[1], dtype=torch.float64, device=r.device)
    for i in range(len(names)):
        has = torch.isfinite(r[i])
        if bool(has.all()):
            out = out + w[i] * group_normalize(r[i], ids, global_std, std_floor, backend=backend)
        elif bool(has.any()):
            out[has] += w[i] * group_normalize(r[i][has], ids[has], global_std, std_floor, backend=backend)
    return out


def load_user_fn(spec: str, where: str) -> Callable:
    fn = resolve(spec, {}, where, "aggregation function")
    if not callable(fn):
        raise ConfigError(f"config key '{where}': '{spec}' is not callable")
    return fn


def aggregate(rewards: dict, weights: dict[str, float], fn: str, group_ids, *,
              threshold="mean", global_std: bool = True, std_floor: float = 1e-6, center: bool = True,
              where: str = "rewards.train.aggregation.fn", backend: str = "auto") -> Aggregated:
    """`rewards`: name -> [N] tensor (or array); `center`: the value of `aggregation.center`; False
    selects the reference's unweighted geometric and harmonic means (the other aggregations are the
    same in both modes); `backend`: the kernels backend of weighted_advantage_sum's normalisation."""
    if fn == "weighted_sum":
        return Aggregated(weighted_sum(rewards, weights), False, {})
    if fn == "geometric_mean":
        return Aggregated(geometric_mean(rewards, weights, weighted=center), False, {})
    if fn == "harmonic_mean":
        return Aggregated(harmonic_mean(rewards, weights, weighted=center), False, {})
    if fn == "log_tame":
        values, info = log_tame(rewards, weights, threshold=threshold)
        return Aggregated(values, False, info)
    if fn == "weighted_advantage_sum":
        return Aggregated(weighted_advantage_sum(rewards, weights, group_ids, global_std, std_floor, backend),
                          True, {})
    if ":" not in fn:
        import difflib

        close = difflib.get_close_matches(fn, BUILTIN, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"config key '{where}': unknown aggregation '{fn}'{hint}; built-ins: {', '.join(BUILTIN)} "
                          "or 'module:function'")
    host = {k: torch.as_tensor(v).cpu().numpy() for k, v in rewards.items()}
    ids = torch.as_tensor(group_ids).cpu().numpy()
    values = np.asarray(load_user_fn(fn, where)(host, weights, ids), dtype=np.float64)
    if values.shape != (len(ids),):
        raise RewardError(f"aggregation '{fn}' returned shape {values.shape}, expected ({len(ids)},)")
    device = torch.as_tensor(next(iter(rewards.values()))).device
    return Aggregated(torch.from_numpy(values).to(device), False, {})
