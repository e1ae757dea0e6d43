"""The stat tracker and every aggregator against hand-computed values."""
import numpy as np
import pytest

from paco_ds.config import AdvantageConfig, AggregationConfig
from paco_ds.errors import ConfigError, RewardError
from paco_ds.grpo.advantages import StatTracker, group_ranks
from paco_ds.rewards.aggregate import aggregate


def tracker(fn="weighted_sum", weights=None, center=True, threshold="mean", **adv):
    return StatTracker(AdvantageConfig(**adv), AggregationConfig(fn=fn, center=center, threshold=threshold),
                       weights or {})


def test_grpo_global_std_by_hand():
    r = {"a": np.array([1.0, 3.0, 2.0, 2.0])}
    g = np.array([0, 0, 1, 1])
    out = tracker().compute(r, g)
    # group means 2, 2; global std of [1,3,2,2] = sqrt(0.5)
    s = np.sqrt(0.5)
    assert out.advantages == pytest.approx([-1 / s, 1 / s, 0, 0])
    assert out.stats["zero_std_ratio"] == 0.5 and out.stats["global_std"] == pytest.approx(s)
    assert out.stats["avg_group_std"] == pytest.approx(0.5) and out.stats["avg_group_size"] == 2


def test_grpo_group_std_and_zero_std_group():
    r = {"a": np.array([1.0, 3.0, 5.0, 5.0, 5.0])}
    g = np.array([7, 7, 9, 9, 9])
    out = tracker(global_std=False).compute(r, g)
    assert out.advantages == pytest.approx([-1, 1, 0, 0, 0])  # group std 1; std 0 floored, numerator 0


def test_std_floor_and_clip():
    r = {"a": np.array([0.0, 1e-9, 0.0, 100.0])}
    g = np.array([0, 0, 1, 1])
    out = tracker(global_std=False, std_floor=1e-6, clip=5.0).compute(r, g)
    # group 0: std 5e-10 floored to 1e-6 -> +-5e-4; group 1: +-1
    assert out.advantages == pytest.approx([-5e-4, 5e-4, -1, 1])
    out = tracker(global_std=False, std_floor=1e-12, clip=3.0).compute(r, g)
    assert out.advantages[:2] == pytest.approx([-1, 1]) and out.advantages[2:] == pytest.approx([-1, 1])
    out = tracker(global_std=True, clip=0.5).compute(r, g)
    assert np.abs(out.advantages).max() == 0.5


def test_single_sample_groups():
    # mixed: a single-sample group gets 0 (its own mean)
    out = tracker().compute({"a": np.array([1.0, 2.0, 3.0])}, np.array([0, 0, 1]))
    assert out.advantages[2] == 0
    # all groups of size 1 (k = 1): global normalisation over the batch
    out = tracker().compute({"a": np.array([1.0, 2.0, 3.0])}, np.array([0, 1, 2]))
    assert out.advantages == pytest.approx(np.array([-1, 0, 1]) / np.std([1, 2, 3]))


def test_weighted_sum_weights():
    r = {"a": np.array([1.0, 0.0]), "b": np.array([0.0, 1.0])}
    out = tracker(weights={"a": 0.2, "b": 1.0}).compute(r, np.array([0, 0]))
    assert out.combined == pytest.approx([0.2, 1.0])
    assert out.advantages == pytest.approx([-1, 1])


def test_rank_grpo():
    assert group_ranks(np.array([3.0, 1.0, 2.0, 5.0, 5.0]), np.array([0, 0, 0, 1, 1])) == pytest.approx(
        [1, 0, 0.5, 0.5, 0.5])  # ties share their average rank
    out = tracker(method="rank_grpo", global_std=False).compute({"a": np.array([10.0, -3.0, 0.5])}, np.array([0, 0, 0]))
    ranks = np.array([1, 0, 0.5])
    assert out.advantages == pytest.approx((ranks - ranks.mean()) / ranks.std())


def test_geometric_and_harmonic_means():
    r = {"a": np.array([1.0, 4.0]), "b": np.array([4.0, 1.0]), "c": np.array([2.0, 2.0])}
    g = np.array([0, 1])
    assert aggregate(r, {}, "geometric_mean", g).values == pytest.approx([2.0, 2.0])
    assert aggregate(r, {}, "harmonic_mean", g).values == pytest.approx([3 / (1 + 0.25 + 0.5)] * 2)
    w = aggregate({"a": np.array([1.0]), "b": np.array([8.0])}, {"a": 2, "b": 1}, "geometric_mean", np.array([0]))
    assert w.values == pytest.approx([8 ** (1 / 3)])
    with pytest.raises(RewardError, match="positive"):
        aggregate({"a": np.array([0.0, 1.0])}, {}, "geometric_mean", g)


@pytest.mark.parametrize("threshold, tamed", [("mean", {"b"}), ("median", {"b"}), (0.05, {"a", "b", "c"}), (0.5, {"b"}), (10.0, set())])
def test_log_tame_thresholds(threshold, tamed):
    a = np.array([1.0, 1.1, 0.9, 1.0])  # cv ~0.07
    b = np.array([0.1, 2.0, 0.5, 3.0])  # cv ~0.86
    c = np.array([5.0, 5.0, 5.5, 4.5])  # cv ~0.07
    r = {"a": a, "b": b, "c": c}
    h = {k: v.std() / (v.mean() + 1e-6) for k, v in r.items()}
    out = aggregate(r, {"a": 1, "b": 2, "c": 1}, "log_tame", np.zeros(4), threshold=threshold)
    want = sum(w * (np.log1p(r[k]) if k in tamed else r[k]) for k, w in {"a": 1, "b": 2, "c": 1}.items())
    assert out.values == pytest.approx(want)
    for k in r:
        assert out.info[f"log_tame/tamed/{k}"] == float(k in tamed)
        assert out.info[f"log_tame/h/{k}"] == pytest.approx(h[k])
    expected_tau = {"mean": np.mean(list(h.values())), "median": np.median(list(h.values()))}.get(threshold, threshold)
    assert out.info["log_tame/threshold"] == pytest.approx(expected_tau)


def test_log_tame_then_normalise_vs_reference_uncentred():
    r = {"a": np.array([1.0, 2.0, 3.0, 4.0]), "b": np.array([0.5, 0.5, 0.6, 0.4])}
    g = np.array([0, 0, 1, 1])
    centred = tracker(fn="log_tame").compute(r, g)
    for x in (0, 1):
        assert centred.advantages[g == x].sum() == pytest.approx(0)
    uncentred = tracker(fn="log_tame", center=False).compute(r, g)
    # the reference's trap: the aggregated reward itself becomes the advantage (all positive)
    assert (uncentred.advantages > 0).all()
    assert uncentred.advantages == pytest.approx(np.clip(uncentred.combined, -5, 5))


def test_weighted_advantage_sum():
    r = {"a": np.array([1.0, 3.0, 0.0, 0.0]), "b": np.array([2.0, 2.0, 0.0, 4.0])}
    g = np.array([0, 0, 1, 1])
    out = tracker(fn="weighted_advantage_sum", weights={"a": 1.0, "b": 0.5}, global_std=False).compute(r, g)
    # a: group0 (-1, 1), group1 (0, 0); b: group0 (0, 0), group1 (-1, 1)
    assert out.advantages == pytest.approx([-1, 1, -0.5, 0.5])


def _user_agg(rewards, weights, group_ids):
    return rewards["a"] * 10


def test_user_function_by_module_path():
    out = tracker(fn=f"{__name__}:_user_agg").compute({"a": np.array([1.0, 2.0])}, np.array([0, 0]))
    assert out.combined == pytest.approx([10, 20]) and out.advantages == pytest.approx([-1, 1])
    with pytest.raises(ConfigError, match="cannot import"):
        tracker(fn="no_such_module:f").compute({"a": np.array([1.0])}, np.array([0]))


def test_unknown_aggregation_name_is_a_config_error():
    with pytest.raises(Exception, match="did you mean 'log_tame'"):
        AggregationConfig(fn="log_tamed")


def test_masked_samples_are_left_out_not_zeroed():
    r = {"a": np.array([1.0, 3.0, np.nan, 100.0]), "b": np.array([0.0, 0.0, 0.0, 0.0])}
    g = np.array([0, 0, 0, 1])
    valid = np.array([True, True, True, False])
    out = tracker(global_std=False).compute(r, g, valid)
    assert out.stats["masked"] == 2 and not out.keep[2] and not out.keep[3]
    assert out.advantages == pytest.approx([-1, 1, 0, 0])  # group 0 normalised over its 2 valid samples
    assert np.isnan(out.combined[2])


def test_drop_zero_std_groups_and_stats():
    r = {"a": np.array([1.0, 1.0, 1.0, 2.0])}
    g = np.array([0, 0, 1, 1])
    t = tracker(drop_zero_std_groups=True)
    out = t.compute(r, g)
    assert out.keep.tolist() == [False, False, True, True] and out.stats["dropped"] == 2
    assert out.stats["zero_std_ratio"] == 0.5
    t.compute(r, np.array([5, 5, 6, 6]))
    assert t.state_dict()["seen_groups"] == [0, 1, 5, 6]
    t2 = tracker()
    t2.load_state_dict(t.state_dict())
    assert t2.compute(r, g).stats["trained_prompt_num"] == 4
