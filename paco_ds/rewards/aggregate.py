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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from paco_ds.errors import ConfigError, RewardError
from paco_ds.recipe import resolve

BUILTIN = ("weighted_sum", "geometric_mean", "harmonic_mean", "log_tame", "weighted_advantage_sum")


@dataclass
class Aggregated:
    values: torch.Tensor  # one fp64 value per sample
    is_advantage: bool  # True: already centred and scaled (weighted_advantage_sum)
    info: dict


def _stack(rewards: dict, weights: dict[str, float]) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """(names, rewards [K, N] fp64, weights [K] fp64) on the rewards' device."""
    names = list(rewards)
    r = torch.stack([torch.as_tensor(rewards[n], dtype=torch.float64) for n in names])
    w = torch.tensor([weights.get(n, 1.0) for n in names], dtype=torch.float64, device=r.device)
    return names, r, w


def weighted_sum(rewards, weights, group_ids=None) -> torch.Tensor:
    _, r, w = _stack(rewards, weights)
    return (w[:, None] * r).sum(0)


def _require_positive(names, r, fn):
    for i, n in enumerate(names):
        if bool((r[i] <= 0).any()):
            raise RewardError(f"{fn} needs positive rewards, but '{n}' has min {r[i].min().item():.4g}")


def geometric_mean(rewards, weights, group_ids=None, weighted: bool = True) -> torch.Tensor:
    """Weighted geometric mean across reward types; `weighted=False` ignores the weights (the reference)."""
    names, r, w = _stack(rewards, weights)
    _require_positive(names, r, "geometric_mean")
    if not weighted:
        w = torch.ones_like(w)
    return torch.exp((w[:, None] * torch.log(r)).sum(0) / w.sum())


def harmonic_mean(rewards, weights, group_ids=None, weighted: bool = True) -> torch.Tensor:
    """Weighted harmonic mean across reward types; `weighted=False` ignores the weights (the reference)."""
    names, r, w = _stack(rewards, weights)
    _require_positive(names, r, "harmonic_mean")
    if not weighted:
        w = torch.ones_like(w)
    return w.sum() / (w[:, None] / r).sum(0)


def log_tame(rewards, weights, group_ids=None, threshold="mean") -> tuple[torch.Tensor, dict]:
    """Rewards whose coefficient of variation h_k = std(r_k) / (mean(r_k) + 1e-6) over the batch
    exceeds the threshold (the mean or median of the h_k, or a number) are replaced by log(1 + r)."""
    names, r, w = _stack(rewards, weights)
    h = r.std(dim=1, unbiased=False) / (r.mean(dim=1) + 1e-6)
    if threshold == "median":  # the two middle values averaged (numpy's median; torch's takes the lower one)
        s = h.sort().values
        tau = float((s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2)
    else:
        tau = float(h.mean() if threshold == "mean" else threshold)
    tamed = (h > tau).tolist()
    for i, n in enumerate(names):
        if tamed[i] and bool((r[i] <= -1).any()):
            raise RewardError(f"log_tame: reward '{n}' has values <= -1 (min {r[i].min().item():.4g}); "
                              "log(1+r) is undefined")
    r = torch.where(torch.tensor(tamed, device=r.device)[:, None], torch.log1p(r), r)
    info = {f"log_tame/h/{n}": float(h[i]) for i, n in enumerate(names)}
    info.update({f"log_tame/tamed/{n}": float(tamed[i]) for i, n in enumerate(names)}, **{"log_tame/threshold": tau})
    return (w[:, None] * r).sum(0), info


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
    """Normalise each reward per group on its own, then sum the advantages with the weights."""
    names, r, w = _stack(rewards, weights)
    return sum(w[i] * group_normalize(r[i], group_ids, global_std, std_floor, backend=backend)
               for i in range(len(names)))


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
