"""Metrics of the two reward-model benchmarks, as the reference computes them and as they should be.

ConsistencyRank (PaCo-RL/PaCo-Reward/evaluation/Consistency_Rank/eval_vllm.py). Per item the judge
scores each candidate against the reference image; `pred_rank` lists candidate indices best first,
`gt_rank` is the annotated best-first list. The reference applies `scipy.stats.kendalltau` / `spearmanr`
to these two *index-order lists*, which correlates the permutations as sequences (position p holds
candidate c), not the rank each candidate got. Both forms are reported here:

- `kendalltau` / `spearmanr`: the reference's form, on (pred_rank, gt_rank); reproduces its tables.
- `kendalltau_ranks` / `spearmanr_ranks`: the correct form, between the judge's scores and the
  annotated ranks per candidate, with tied scores as ties (tau-b, average ranks). NaN when every
  score ties (the correlation is undefined); such items are left out of that mean and counted.

Ties in the scores are broken deterministically for `pred_rank` (lower candidate index first,
a stable sort) and the number of items with a tie is reported: a tied judge is then neither
rewarded nor penalised by chance from one run to the next. A score of NaN (the judge answered
neither Yes nor No) sorts last.

EditReward-Bench (PaCo-RL/PaCo-Reward/evaluation/Edit-Bench/calculate_statistics.py). Each record
compares two outputs (the human-preferred one first) on one dimension (prompt_following, consistency or
overall); accuracy per (task type, dimension) is strict (s0 > s1) or geq (s0 >= s1); the `average` is
the macro mean over task types; the four group means average task types. A task type without records for
a dimension is NaN and left out of the means (the reference would crash on the missing file).
"""
from __future__ import annotations

import math
import warnings
from typing import Sequence

import numpy as np

TASK_TYPES = ("background_change", "color_alter", "style_change", "subject-add", "subject-remove",
              "subject-replace", "material_alter", "motion_change", "ps_human", "text_change", "tone_transfer",
              "extract", "compose")
GROUPS = {
    "object": ("subject-add", "subject-remove", "subject-replace"),
    "appearance": ("color_alter", "material_alter", "style_change", "tone_transfer"),
    "scene": ("background_change", "extract"),
    "advanced": ("ps_human", "text_change", "motion_change", "compose"),
}
DIMENSIONS = ("prompt_following", "consistency", "overall")
RANK_METRICS = ("accuracy", "kendalltau", "spearmanr", "kendalltau_ranks", "spearmanr_ranks", "top1_accuracy",
                "bottom1_accuracy", "top1_bottom1_accuracy", "footrule_distance")


# ------------------------------------------------------------------------------------ correlations
# scipy.stats, as the reference's own evaluation: tau-b (ties on either side counted) and Spearman's
# rho on average ranks. A constant side makes either undefined: NaN, without scipy's warning (the
# caller counts such items).
def kendall_tau_b(x: Sequence[float], y: Sequence[float]) -> float:
    from scipy import stats

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", stats.ConstantInputWarning)
        return float(stats.kendalltau(x, y, variant="b").statistic)


def spearman_rho(x: Sequence[float], y: Sequence[float]) -> float:
    from scipy import stats

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", stats.ConstantInputWarning)
        return float(stats.spearmanr(x, y).statistic)


# ------------------------------------------------------------------------------------ ConsistencyRank
def predicted_order(scores: Sequence[float]) -> tuple[list[int], bool]:
    """Candidate indices best first (stable: a tie keeps the lower index first; NaN last), and
    whether any two finite scores tie."""
    s = [(-v if math.isfinite(v) else math.inf) for v in scores]
    order = sorted(range(len(s)), key=lambda i: s[i])
    finite = [v for v in scores if math.isfinite(v)]
    return order, len(set(finite)) < len(finite)


def rank_item_metrics(scores: Sequence[float], gt_rank: Sequence[int]) -> dict:
    """Every per-item metric for one ConsistencyRank item: scores per candidate (in the item's
    `comp_images` order), gt_rank = candidate indices best first."""
    pred, tied = predicted_order(scores)
    gt = list(gt_rank)
    n = len(gt)
    if sorted(pred) != sorted(gt):
        raise ValueError(f"gt_rank {gt} is not a permutation of the {len(scores)} candidates")
    pos_pred = {c: p for p, c in enumerate(pred)}
    pos_gt = {c: p for p, c in enumerate(gt)}
    # the correct form: per candidate, higher score should mean better (smaller) annotated position
    cands = list(range(n))
    score_key = [scores[c] if math.isfinite(scores[c]) else -math.inf for c in cands]
    gt_goodness = [-pos_gt[c] for c in cands]
    top1 = float(pred[0] == gt[0])
    bottom1 = float(pred[-1] == gt[-1])
    return {
        "pred_rank": pred, "gt_rank": gt, "tie": tied,
        "accuracy": sum(p == g for p, g in zip(pred, gt)) / n,
        "kendalltau": kendall_tau_b(pred, gt),
        "spearmanr": spearman_rho(pred, gt),
        "kendalltau_ranks": kendall_tau_b(score_key, gt_goodness),
        "spearmanr_ranks": spearman_rho(score_key, gt_goodness),
        "top1_accuracy": top1, "bottom1_accuracy": bottom1, "top1_bottom1_accuracy": (top1 + bottom1) / 2,
        "footrule_distance": float(sum(abs(pos_gt[c] - pos_pred[c]) for c in cands)),
    }


def summarize_rank(items: list[dict]) -> dict:
    """Mean and std over items of each metric (NaNs left out and counted), items with ties."""
    out: dict = {"items": len(items), "items_with_ties": int(sum(it["tie"] for it in items))}
    for m in RANK_METRICS:
        v = np.array([it[m] for it in items], dtype=np.float64)
        ok = v[np.isfinite(v)]
        out[m] = float(ok.mean()) if ok.size else math.nan
        out[f"{m}_std"] = float(ok.std()) if ok.size else math.nan
        if ok.size < v.size:
            out[f"{m}_undefined"] = int(v.size - ok.size)
    return out


# ------------------------------------------------------------------------------------ EditReward-Bench
def overall_score(pf: float, cons: float) -> float:
    return math.sqrt(pf * cons)


def summarize_edit(records: list[dict]) -> dict:
    """records: {task_type, dimension, score: [preferred, other]} -> accuracies.

    Returns {"strict"|"geq": {dimension: {task_type: acc, "average": macro, <group>: mean}}, "counts": ...}."""
    out: dict = {"strict": {}, "geq": {}, "counts": {}}
    types = list(TASK_TYPES) + sorted({r["task_type"] for r in records} - set(TASK_TYPES))
    for dim in DIMENSIONS:
        rows = [r for r in records if r["dimension"] == dim]
        out["counts"][dim] = {t: sum(r["task_type"] == t for r in rows) for t in types}
        for mode in ("strict", "geq"):
            acc = {}
            for t in types:
                rs = [r for r in rows if r["task_type"] == t]
                if not rs:
                    acc[t] = math.nan
                    continue
                hits = [(r["score"][0] > r["score"][1]) if mode == "strict" else (r["score"][0] >= r["score"][1])
                        for r in rs]
                acc[t] = sum(hits) / len(rs)
            acc["average"] = _nanmean([acc[t] for t in types])
            for g, members in GROUPS.items():
                acc[g] = _nanmean([acc[t] for t in members])
            out[mode][dim] = acc
    return out


def _nanmean(values: list[float]) -> float:
    ok = [v for v in values if not math.isnan(v)]
    return sum(ok) / len(ok) if ok else math.nan
