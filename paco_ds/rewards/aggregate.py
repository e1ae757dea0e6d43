"""Multi-reward aggregation: several per-sample rewards -> one value per sample.

Built-ins (PaCo-RL/PaCo-GRPO/config/grpo.py's aggregate functions): weighted_sum (default),
geometric_mean, harmonic_mean, log_tame(threshold), weighted_advantage_sum(global_std); or any
"module:function" with the signature fn(rewards: dict[str, ndarray], weights: dict[str, float],
group_ids: ndarray) -> ndarray.

All but weighted_advantage_sum return an aggregated *reward* that the GRPO step then normalises
per prompt group; the reference used those outputs directly as advantages (uncentred, often all
positive). `aggregation.center: false` reproduces that behaviour on purpose, and with it the
reference's unweighted means: its geometric and harmonic means (scipy's gmean/hmean across the
reward types) ignore the reward weights. The default (centred) mode weights them:
exp(sum w_k log r_k / sum w_k) and sum w_k / sum (w_k / r_k).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from paco_ds.errors import ConfigError, RewardError

BUILTIN = ("weighted_sum", "geometric_mean", "harmonic_mean", "log_tame", "weighted_advantage_sum")


@dataclass
class Aggregated:
    values: np.ndarray  # one value per sample
    is_advantage: bool  # True: already centred and scaled (weighted_advantage_sum)
    info: dict


def _stack(rewards: dict[str, np.ndarray], weights: dict[str, float]) -> tuple[list[str], np.ndarray, np.ndarray]:
    names = list(rewards)
    r = np.stack([np.asarray(rewards[n], dtype=np.float64) for n in names])  # [K, N]
    w = np.array([weights.get(n, 1.0) for n in names], dtype=np.float64)
    return names, r, w


def weighted_sum(rewards, weights, group_ids=None) -> np.ndarray:
    _, r, w = _stack(rewards, weights)
    return (w[:, None] * r).sum(0)


def _require_positive(names, r, fn):
    bad = [(n, r[i].min()) for i, n in enumerate(names) if (r[i] <= 0).any()]
    if bad:
        n, lo = bad[0]
        raise RewardError(f"{fn} needs positive rewards, but '{n}' has min {lo:.4g}")


def geometric_mean(rewards, weights, group_ids=None, weighted: bool = True) -> np.ndarray:
    """Weighted geometric mean across reward types; `weighted=False` ignores the weights (the reference)."""
    names, r, w = _stack(rewards, weights)
    _require_positive(names, r, "geometric_mean")
    if not weighted:
        w = np.ones_like(w)
    return np.exp((w[:, None] * np.log(r)).sum(0) / w.sum())


def harmonic_mean(rewards, weights, group_ids=None, weighted: bool = True) -> np.ndarray:
    """Weighted harmonic mean across reward types; `weighted=False` ignores the weights (the reference)."""
    names, r, w = _stack(rewards, weights)
    _require_positive(names, r, "harmonic_mean")
    if not weighted:
        w = np.ones_like(w)
    return w.sum() / (w[:, None] / r).sum(0)


def coefficients_of_variation(r: np.ndarray) -> np.ndarray:
    """h_k = std(r_k) / (mean(r_k) + 1e-6) over the batch, one per reward type."""
    return r.std(axis=1) / (r.mean(axis=1) + 1e-6)


def log_tame(rewards, weights, group_ids=None, threshold="mean") -> tuple[np.ndarray, dict]:
    """Rewards whose coefficient of variation exceeds the threshold are replaced by log(1 + r)."""
    names, r, w = _stack(rewards, weights)
    h = coefficients_of_variation(r)
    tau = float(np.mean(h) if threshold == "mean" else np.median(h) if threshold == "median" else threshold)
    tamed = h > tau
    for i in np.flatnonzero(tamed):
        if (r[i] <= -1).any():
            raise RewardError(f"log_tame: reward '{names[i]}' has values <= -1 (min {r[i].min():.4g}); log(1+r) is undefined")
        r[i] = np.log1p(r[i])
    info = {f"log_tame/h/{n}": float(h[i]) for i, n in enumerate(names)}
    info.update({f"log_tame/tamed/{n}": float(tamed[i]) for i, n in enumerate(names)}, **{"log_tame/threshold": tau})
    return (w[:, None] * r).sum(0), info


def group_normalize(values: np.ndarray, group_ids: np.ndarray, global_std: bool, std_floor: float) -> np.ndarray:
    """(v - mean of the sample's group) / std, std global or per group, floored (ddof 0)."""
    values = np.asarray(values, dtype=np.float64)
    adv = np.zeros_like(values)
    gstd = max(values.std(), std_floor) if values.size else std_floor
    for g in np.unique(group_ids):
        sel = group_ids == g
        v = values[sel]
        std = gstd if global_std else max(v.std(), std_floor)
        adv[sel] = (v - v.mean()) / std
    return adv


def weighted_advantage_sum(rewards, weights, group_ids, global_std=True, std_floor=1e-6) -> np.ndarray:
    """Normalise each reward per group on its own, then sum the advantages with the weights."""
    names, r, w = _stack(rewards, weights)
    return sum(w[i] * group_normalize(r[i], group_ids, global_std, std_floor) for i in range(len(names)))


def load_user_fn(spec: str, where: str) -> Callable:
    module, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"config key '{where}': cannot import aggregation function '{spec}' ({err})") from None
    if not callable(fn):
        raise ConfigError(f"config key '{where}': '{spec}' is not callable")
    return fn


def aggregate(rewards: dict[str, np.ndarray], weights: dict[str, float], fn: str, group_ids: np.ndarray, *,
              threshold="mean", global_std: bool = True, std_floor: float = 1e-6, center: bool = True,
              where: str = "rewards.train.aggregation.fn") -> Aggregated:
    """`center`: the value of `aggregation.center`; False selects the reference's unweighted
    geometric and harmonic means (the other aggregations are the same in both modes)."""
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
        return Aggregated(weighted_advantage_sum(rewards, weights, group_ids, global_std, std_floor), True, {})
    if ":" not in fn:
        import difflib

        close = difflib.get_close_matches(fn, BUILTIN, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"config key '{where}': unknown aggregation '{fn}'{hint}; built-ins: {', '.join(BUILTIN)} "
                          "or 'module:function'")
    values = np.asarray(load_user_fn(fn, where)(rewards, weights, group_ids), dtype=np.float64)
    if values.shape != (len(group_ids),):
        raise RewardError(f"aggregation '{fn}' returned shape {values.shape}, expected ({len(group_ids)},)")
    return Aggregated(values, False, {})
