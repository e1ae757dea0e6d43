"""Geometric and harmonic aggregation in both modes, against numbers worked out by hand.

`aggregation.center: false` (reference-compatible) must give what the reference's scipy gmean/hmean
across reward types give, which ignore the reward weights; the centred default weights them.
Case: one prompt, two samples, the t2is weights {consistency 0.2, clipT 1, pickscore 1}.
"""
import math

import numpy as np
import pytest

from paco_ds.recipe.schema import AdvantageConfig, AggregationConfig
from paco_ds.errors import ConfigError
from paco_ds.grpo.advantages import StatTracker
from paco_ds.rewards.aggregate import aggregate

pytestmark = pytest.mark.fast

REWARDS = {"consistency_score": np.array([0.9, 0.1]), "subfig_clipT": np.array([0.3, 0.3]),
           "pickscore": np.array([0.85, 0.85])}
WEIGHTS = {"consistency_score": 0.2, "subfig_clipT": 1.0, "pickscore": 1.0}
GROUPS = np.array([0, 0])
SAMPLES = [(0.9, 0.3, 0.85), (0.1, 0.3, 0.85)]  # (consistency, clipT, pickscore) per sample
W = (0.2, 1.0, 1.0)

# The reference (scipy.stats.gmean / hmean over the three rewards of each sample, no weights).
REF_GMEAN = [(c * t * p) ** (1 / 3) for c, t, p in SAMPLES]
REF_HMEAN = [3 / (1 / c + 1 / t + 1 / p) for c, t, p in SAMPLES]
# paco_ds's centred default: the weighted means.
WEIGHTED_GMEAN = [math.exp(sum(w * math.log(x) for w, x in zip(W, s)) / sum(W)) for s in SAMPLES]
WEIGHTED_HMEAN = [sum(W) / sum(w / x for w, x in zip(W, s)) for s in SAMPLES]


def test_hand_computed_reference_values():
    # the reference's advantages for this case, as printed by its compute_advantages
    assert REF_GMEAN == pytest.approx([0.6122, 0.2943], abs=5e-5)
    assert REF_HMEAN == pytest.approx([0.5337, 0.2068], abs=5e-5)
    assert WEIGHTED_GMEAN == pytest.approx([0.5322, 0.4358], abs=5e-5)
    assert WEIGHTED_HMEAN == pytest.approx([0.4649, 0.3380], abs=5e-5)


@pytest.mark.parametrize("fn, ref, weighted", [("geometric_mean", REF_GMEAN, WEIGHTED_GMEAN),
                                               ("harmonic_mean", REF_HMEAN, WEIGHTED_HMEAN)])
def test_uncentred_mode_ignores_weights_centred_mode_applies_them(fn, ref, weighted):
    compat = aggregate(REWARDS, WEIGHTS, fn, GROUPS, center=False)
    assert compat.values == pytest.approx(ref, rel=1e-12) and not compat.is_advantage
    default = aggregate(REWARDS, WEIGHTS, fn, GROUPS)
    assert default.values == pytest.approx(weighted, rel=1e-12)
    assert aggregate(REWARDS, WEIGHTS, fn, GROUPS, center=True).values == pytest.approx(weighted, rel=1e-12)


def test_weights_play_no_part_in_the_compat_means():
    for fn in ("geometric_mean", "harmonic_mean"):
        a = aggregate(REWARDS, WEIGHTS, fn, GROUPS, center=False).values
        b = aggregate(REWARDS, {}, fn, GROUPS, center=False).values
        assert a.tolist() == b.tolist()


@pytest.mark.parametrize("fn, ref, weighted", [("geometric_mean", REF_GMEAN, WEIGHTED_GMEAN),
                                               ("harmonic_mean", REF_HMEAN, WEIGHTED_HMEAN)])
def test_stat_tracker_compat_mode_reproduces_the_reference_advantages(fn, ref, weighted):
    centred = StatTracker(AdvantageConfig(), AggregationConfig(fn=fn), WEIGHTS).compute(REWARDS, GROUPS)
    assert centred.combined == pytest.approx(weighted, rel=1e-12)
    assert centred.advantages == pytest.approx([1.0, -1.0])  # two samples, normalised in their group
    out = StatTracker(AdvantageConfig(), AggregationConfig(fn=fn, center=False), WEIGHTS).compute(REWARDS, GROUPS)
    assert out.advantages == pytest.approx(ref, rel=1e-12)  # used as advantages as they are: uncentred
    assert out.combined == pytest.approx(ref, rel=1e-12)


def test_compat_mode_still_normalises_the_weighted_sum():
    # The reference skips normalisation only for an aggregation function; its default weighted sum
    # is always normalised per prompt: R = 0.2 c + t + p = [1.33, 1.17], mean 1.25, std 0.08.
    out = StatTracker(AdvantageConfig(), AggregationConfig(fn="weighted_sum", center=False),
                      WEIGHTS).compute(REWARDS, GROUPS)
    assert out.combined == pytest.approx([1.33, 1.17], rel=1e-12)
    assert out.advantages == pytest.approx([(1.33 - 1.25) / 0.08, (1.17 - 1.25) / 0.08], rel=1e-9)


def test_unknown_aggregation_name_raises_with_a_hint():
    with pytest.raises(ConfigError, match=r"config key 'x.fn': unknown aggregation 'geometric_means' "
                                          r"\(did you mean 'geometric_mean'\?\)"):
        aggregate(REWARDS, WEIGHTS, "geometric_means", GROUPS, where="x.fn")


# Not applicable: a one-panel prompt's group (ids 1) has no consistency term; the 2x2 group (ids 0) has.
NA_REWARDS = {"consistency_score": np.array([0.9, 0.1, np.nan, np.nan]), "subfig_clipT": np.array([0.3, 0.5, 0.2, 0.6]),
              "pickscore": np.array([0.85, 0.8, 0.7, 0.9])}
NA_GROUPS = np.array([0, 0, 1, 1])


def test_a_reward_that_does_not_apply_is_left_out_of_each_aggregate():
    """Worked by hand: the sum adds the terms that apply with their weights (as the reference's 0.0 would
    for a weighted sum), the means renormalise the weights over the terms that apply, and
    weighted_advantage_sum normalises consistency over the samples it applies to only."""
    s = aggregate(NA_REWARDS, WEIGHTS, "weighted_sum", NA_GROUPS).values
    assert s.tolist() == pytest.approx([0.2 * 0.9 + 0.3 + 0.85, 0.2 * 0.1 + 0.5 + 0.8, 0.2 + 0.7, 0.6 + 0.9])
    g = aggregate(NA_REWARDS, WEIGHTS, "geometric_mean", NA_GROUPS).values
    assert g[2] == pytest.approx(math.sqrt(0.2 * 0.7)) and g[3] == pytest.approx(math.sqrt(0.6 * 0.9))
    assert g[0] == pytest.approx(math.exp((0.2 * math.log(0.9) + math.log(0.3) + math.log(0.85)) / 2.2))
    h = aggregate(NA_REWARDS, WEIGHTS, "harmonic_mean", NA_GROUPS).values
    assert h[2] == pytest.approx(2 / (1 / 0.2 + 1 / 0.7))
    a = aggregate(NA_REWARDS, WEIGHTS, "weighted_advantage_sum", NA_GROUPS, global_std=False).values
    # per group, std per group: each reward gives +-1 in a two-sample group of distinct values
    assert a.tolist() == pytest.approx([0.2 + (-1) + 1, -0.2 + 1 - 1, -1 - 1, 1 + 1])
    for fn in ("weighted_sum", "geometric_mean", "harmonic_mean", "log_tame", "weighted_advantage_sum"):
        assert np.isfinite(aggregate(NA_REWARDS, WEIGHTS, fn, NA_GROUPS).values.numpy()).all(), fn


def test_the_tracker_trains_a_sample_on_the_rewards_that_apply_and_never_one_no_reward_applies_to():
    tracker = StatTracker(AdvantageConfig(), AggregationConfig(), WEIGHTS)
    rewards = {k: np.append(v, np.nan) for k, v in NA_REWARDS.items()}
    applies = {k: np.isfinite(v) for k, v in rewards.items()}
    res = tracker.compute(rewards, np.append(NA_GROUPS, 2), np.ones(5, bool), applicable=applies)
    assert res.keep.tolist() == [True, True, True, True, False]  # the last: no reward applies
    assert res.combined[:4] == pytest.approx(aggregate(NA_REWARDS, WEIGHTS, "weighted_sum", NA_GROUPS).values.numpy())
    assert res.stats["masked"] == 1.0
    # the same NaN where the reward applies is a failure: that sample is masked, not trained
    failed = tracker.compute(rewards, np.append(NA_GROUPS, 2), np.ones(5, bool),
                             applicable={k: np.ones(5, bool) for k in rewards})
    assert failed.keep.tolist() == [True, True, False, False, False]
