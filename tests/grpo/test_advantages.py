"""The stat tracker and every aggregator against hand-computed values, and its one torch path
(aggregation, then kernels.grpo_advantages) against a straightforward numpy reference."""
import numpy as np
import pytest

from paco_ds.recipe.schema import AdvantageConfig, AggregationConfig
from paco_ds.errors import ConfigError, RewardError
from paco_ds.grpo.advantages import StatTracker, group_ranks
from paco_ds.rewards.aggregate import aggregate

pytestmark = pytest.mark.fast


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
    from conftest import TINY
    from paco_ds.grpo.plan import load_config

    with pytest.raises(ConfigError, match="did you mean 'log_tame'"):
        load_config(TINY, ["rewards.train.aggregation.fn=log_tamed"])


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


# ----------------------------------------------------------------------------- against a numpy reference
def epoch(seed=0, k=16, m=42, zero_spread=3):
    """One epoch of m prompts x k images (672 by default) and 3 reward types of different scales and
    spreads (coefficients of variation about 0.7, 0.2, 1.4), with scattered, shuffled group ids.
    `zero_spread` groups have one reward per type for all their samples, each a multiple of 1/8, and
    the weights are multiples of 1/4: their weighted sum, and so a group mean, is exact in any
    summation order (see the test of zero-spread groups off that grid)."""
    rng = np.random.default_rng(seed)
    ids = np.repeat(rng.choice(100_000, m, replace=False), k)
    r = rng.gamma(np.array([2.0, 20.0, 0.5])[:, None], 1.0, size=(3, m * k)) * np.array([1.0, 0.05, 3.0])[:, None]
    for gid in ids[::k][:zero_spread]:
        r[:, ids == gid] = rng.integers(1, 40, size=(3, 1)) / 8
    order = rng.permutation(ids.size)
    return {name: r[i, order] for i, name in enumerate("abc")}, ids[order], {"a": 0.25, "b": 1.0, "c": 1.5}


def reference(rewards, ids, weights, valid=None, fn="weighted_sum", threshold="mean", global_std=True,
              std_floor=1e-6, clip=5.0, drop_zero_std_groups=False):
    """The reference's stat tracker written out in numpy (PaCo-RL/PaCo-GRPO/paco_grpo/stat_tracking.py):
    (advantages, combined, keep)."""
    names = list(rewards)
    r = np.stack([rewards[n] for n in names])
    ok = np.isfinite(r).all(0) & (np.ones(ids.size, bool) if valid is None else valid)
    r, g = r[:, ok], ids[ok]
    if fn == "log_tame":
        h = r.std(1) / (r.mean(1) + 1e-6)
        tau = {"mean": np.mean, "median": np.median}[threshold](h) if isinstance(threshold, str) else threshold
        r = np.where((h > tau)[:, None], np.log1p(r), r)
    values = (np.array([weights[n] for n in names])[:, None] * r).sum(0)
    adv, keep = np.zeros(ids.size), ok.copy()
    a = np.zeros(values.size)
    for x in np.unique(g):
        v = values[g == x]
        a[g == x] = (v - v.mean()) / max(values.std() if global_std else v.std(), std_floor)
        if drop_zero_std_groups and v.std() < 1e-5:
            keep[np.flatnonzero(ok)[g == x]] = False
    adv[ok] = np.clip(a, -clip, clip)
    adv[~keep] = 0
    combined = np.full(ids.size, np.nan)
    combined[ok] = values
    return adv, combined, keep


def assert_reference(out, want):
    adv, combined, keep = want
    np.testing.assert_allclose(out.advantages, adv, rtol=0, atol=1e-12)
    np.testing.assert_allclose(out.combined, combined, rtol=1e-12, atol=0)  # NaN where masked, in both
    assert out.keep.tolist() == keep.tolist()


CONFIGS = [
    dict(),
    dict(global_std=False),
    dict(fn="log_tame"),
    dict(fn="log_tame", threshold="median", global_std=False),
    dict(fn="log_tame", threshold=1.0, clip=0.8),
    dict(global_std=False, std_floor=0.05, clip=1.2, drop_zero_std_groups=True),
    dict(fn="log_tame", drop_zero_std_groups=True),
]


def run(rewards, ids, weights, valid=None, fn="weighted_sum", threshold="mean", **adv):
    return tracker(fn=fn, threshold=threshold, weights=weights, **adv).compute(rewards, ids, valid)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_the_advantages_equal_the_numpy_reference(config):
    # log(1 + r) leaves the binary grid: zero-spread groups under a per-group std are the next test's case
    rewards, ids, weights = epoch(zero_spread=0 if config.get("fn") and "global_std" in config else 3)
    out = run(rewards, ids, weights, **config)
    want = reference(rewards, ids, weights, **config)
    assert_reference(out, want)
    assert (np.abs(want[0]) == want[0].max()).sum() > 1 or "clip" not in config  # the clip bites
    if config.get("fn") == "log_tame":
        assert 0 < sum(out.stats[f"log_tame/tamed/{n}"] for n in "abc") < 3  # the case exercises the choice


@pytest.mark.parametrize("k, m", [(2, 3), (5, 8), (24, 48)])
def test_the_advantages_equal_the_numpy_reference_at_other_sizes(k, m):
    rewards, ids, weights = epoch(seed=k, k=k, m=m, zero_spread=1)
    for config in CONFIGS[:3]:
        assert_reference(run(rewards, ids, weights, **config), reference(rewards, ids, weights, **config))


def test_masked_samples_and_groups_left_with_one_sample():
    rewards, ids, weights = epoch(seed=3, k=4, m=10)
    rewards["b"][[0, 5, 9]] = np.nan
    valid = np.ones(ids.size, dtype=bool)
    valid[ids == ids[1]] = False
    alone, *others = np.flatnonzero(ids == ids[2])
    valid[others] = False  # one sample of this group is left
    rewards["a"][alone] = 1.0
    out = run(rewards, ids, weights, valid, fn="log_tame", global_std=False)
    assert_reference(out, reference(rewards, ids, weights, valid, fn="log_tame", global_std=False))
    assert out.stats["masked"] > 3 and out.keep[alone] and out.advantages[alone] == 0


def test_zero_spread_groups_off_the_binary_grid_give_rounding_noise_only():
    """A group whose samples share one reward that 1/8 does not divide: its mean rounds, so x - mean
    is a rounding residue of either sign, and under a per-group std it is divided by std_floor. The
    advantages of those samples are then noise of about eps * |x| / std_floor (the same on every
    call), the others are exact, and drop_zero_std_groups leaves the group out of training."""
    rewards, ids, weights = epoch(seed=4, zero_spread=0)
    zero = ids == ids[0]
    for v in rewards.values():
        v[zero] = 0.3
    out = run(rewards, ids, weights, global_std=False)
    want = reference(rewards, ids, weights, global_std=False)
    bound = 8 * np.finfo(float).eps * np.abs(want[1]).max() / 1e-6
    assert np.abs(out.advantages[zero]).max() <= bound
    np.testing.assert_allclose(out.advantages[~zero], want[0][~zero], rtol=0, atol=1e-12)
    assert np.array_equal(run(rewards, ids, weights, global_std=False).advantages, out.advantages)
    dropped = run(rewards, ids, weights, global_std=False, drop_zero_std_groups=True)
    assert not dropped.keep[zero].any() and (dropped.advantages[zero] == 0).all()


def test_log_tame_domain_error_names_the_reward():
    r = {"a": np.array([0.5, 0.6, 0.5, 0.4]), "b": np.array([-1.0, 9.0, 0.0, 30.0])}
    with pytest.raises(RewardError, match=r"^log_tame: reward 'b' has values <= -1 \(min -1\); log\(1\+r\)"):
        tracker(fn="log_tame").compute(r, np.array([0, 0, 1, 1]))


def test_the_advantages_run_on_the_device_and_backend_they_are_given():
    rewards, ids, weights = epoch(seed=6, k=4, m=5)
    t = StatTracker(AdvantageConfig(), AggregationConfig(), weights, backend="torch")
    assert_reference(t.compute(rewards, ids, device="cpu"), reference(rewards, ids, weights))
    with pytest.raises(ValueError, match="'cpp' runs on CPU tensors, these are on meta"):
        StatTracker(AdvantageConfig(), AggregationConfig(), weights, backend="cpp").compute(rewards, ids,
                                                                                        device="meta")


def test_epoch_rewards_are_in_epoch_order_and_each_rank_gets_its_own_back():
    """One process (the gather is the identity): samples drawn out of order come back sorted by
    their epoch position, and `split` hands each rollout batch its own values, in its own order."""
    import torch

    from paco_ds.grpo.advantages import EpochRewards

    positions = np.array([5, 1, 3, 0])  # two rollout batches: [5, 1] and [3, 0]
    r = EpochRewards.gather(positions, groups=np.array([2, 0, 1, 0]), valid=np.array([True, True, False, True]),
                            scores={"a": np.array([0.5, 0.1, 0.3, 0.0])}, parts={}, latency_s=[0.2])
    assert r.groups.tolist() == [0, 0, 1, 2] and r.valid.tolist() == [True, True, False, True]
    assert r.scores["a"].tolist() == [0.0, 0.1, 0.3, 0.5] and r.latency_s == [[0.2]]
    assert r.mine.tolist() == [3, 1, 2, 0]
    per_sample = np.array([10.0, 11.0, 13.0, 15.0])  # indexed by epoch order
    first, second = r.split(per_sample, [2, 2], torch.float32)
    assert first.tolist() == [15.0, 11.0] and second.tolist() == [13.0, 10.0]


def test_epoch_reward_parts_one_rank_lacks_are_nan_there(monkeypatch):
    """Two ranks whose samples have different parts (a multi-image edit's `input2` only where that
    rank drew one): the gathered part spans the epoch, NaN for the other rank's samples."""
    from paco_ds.runtime import distributed
    from paco_ds.grpo.advantages import EpochRewards

    other = {"positions": np.array([1]), "groups": np.array([0]), "valid": np.array([True]),
             "scores": {"a": np.array([0.4])}, "parts": {"a/input1": np.array([0.4])}, "latency_s": [],
             "applicable": {"a": np.array([True])}, "scored": True}
    monkeypatch.setattr(distributed, "all_gather_object", lambda mine: [mine, other])
    r = EpochRewards.gather(np.array([0]), groups=np.array([0]), valid=np.array([True]),
                            scores={"a": np.array([0.2])}, parts={"a/input1": np.array([0.2]),
                                                                  "a/input2": np.array([0.3])}, latency_s=[])
    assert r.parts["a/input1"].tolist() == [0.2, 0.4]
    assert r.parts["a/input2"][0] == 0.3 and np.isnan(r.parts["a/input2"][1])
    assert r.metrics(type("Adv", (), {"stats": {}, "combined": np.array([0.0, 0.0])})())["reward/a/input2/mean"] == 0.3
