"""Advantage Weighted Matching (`train.loss: awm`): its formulas against values worked out by hand,
the loss's wiring on a stub policy, the recipe's validation, and a real run (2 ZeRO-3 CPU ranks)
that stops after epoch 1 and resumes to match the uninterrupted one."""
import math

import pytest
import torch

from stub_policy import StubBatch, stub_loss
from paco_ds.grpo.losses.awm import (AWM, anchor_decay, continuous_time, matching_log_prob, scaled_advantages,
                              stratum_step)
from paco_ds.grpo.plan import load_config

pytestmark = pytest.mark.fast

RECIPE = "configs/tiny/t2is_awm.yaml"


# ------------------------------------------------------------------------------------ formulas
@pytest.mark.parametrize("weighting, power, expected", [
    # v - target = (2, 2) -> mse 4; t = 0.5
    ("uniform", 0.25, -4.0),                                   # -mse
    ("t", 0.25, -2.0),                                         # -0.5 * 4
    ("t2", 0.25, -1.0),                                        # -0.25 * 4
    ("huber", 0.25, -(2.0 - 1e-5) * 0.5),                      # -(sqrt(4 + 1e-10) - sqrt(1e-10)) * 0.5
    ("ghuber", 0.5, -(2.0 - 1e-5) * 0.5 / 0.5),                # p = 1/2 is huber / p: -1.99999
    ("ghuber", 0.25, -(math.sqrt(2) - 10 ** -2.5) * 0.5 / 0.25),  # 4^(1/4) = 1.41421, 1e-10^(1/4) = 0.00316: -2.82210
])
def test_matching_log_prob_by_hand(weighting, power, expected):
    v = torch.tensor([[3.0, 3.0], [1.0, -2.0]])
    target = torch.tensor([[1.0, 1.0], [1.0, -2.0]])  # second sample exact: mse 0, every weighting gives 0
    lp, mse = matching_log_prob(v, target, torch.tensor([0.5, 0.9]), weighting, power)
    assert mse.tolist() == [4.0, 0.0]
    assert lp.dtype == torch.float32
    assert lp.tolist() == pytest.approx([expected, 0.0], rel=1e-6, abs=1e-9)


def test_scaled_advantages_clip_then_rescale():
    # Z = 5, advantage_max 1: clip to [-5, 5], then / 5
    a = scaled_advantages(torch.tensor([-7.0, -2.5, 0.0, 1.0, 5.0, 9.0]), 5.0, 1.0)
    assert a.tolist() == pytest.approx([-1.0, -0.5, 0.0, 0.2, 1.0, 1.0])
    assert scaled_advantages(torch.tensor([2.0]), 5.0, 5.0).tolist() == [2.0]  # advantage_max = Z: clip only


def test_stratum_steps_by_hand():
    # 10 steps x 0.9 -> end 9. discrete, K = 3: strata [0,3) [3,6) [6,9)
    assert [stratum_step("discrete", s, 3, u, 10, 0.9) for s, u in ((0, 0.5), (1, 0.0), (2, 0.99))] == [1, 3, 8]
    # wo_init: [1, 9) in 3 -> bounds 1, 3.67, 6.33, 9 -> [1,3) [3,6) [6,9)
    assert [stratum_step("discrete_wo_init", s, 3, u, 10, 0.9) for s, u in ((0, 0.5), (1, 0.0), (2, 0.99))] == [2, 3, 8]
    # with_init: slot 0 is step 0; [1, 9) in 2 for the others -> [1,5) [5,9)
    assert [stratum_step("discrete_with_init", s, 3, u, 10, 0.9) for s, u in ((0, 0.7), (1, 0.5), (2, 0.99))] == [0, 3, 8]
    # the tiny recipe: 6 x 0.9 -> end 5, K = 3: strata [0,1) [1,3) [3,5)
    assert {stratum_step("discrete", 1, 3, u / 10, 6, 0.9) for u in range(10)} == {1, 2}


def test_stratum_steps_match_the_authors_linspace_strata():
    # scripts/train_sd3_awm.py: boundaries = linspace(start, end, K + 1).long(); lower + (u (upper - lower)).long()
    for n, frac in ((14, 0.9), (10, 1.0), (6, 0.9)):
        end = int(n * frac)
        for kind, start in (("discrete", 0), ("discrete_wo_init", 1)):
            for k in range(1, end - start + 1):
                b = torch.linspace(start, end, k + 1).long()
                for s in range(k):
                    for u in (0.0, 0.3, 0.999):
                        want = int(b[s] + int(u * float(b[s + 1] - b[s])))
                        assert stratum_step(kind, s, k, u, n, frac) == want, (n, kind, k, s, u)


def test_continuous_times_by_hand():
    # logit-normal: p = (1 + 0) / 2 = 0.5 -> Phi^-1 = 0 -> sigmoid 0.5 -> shift 3: 1.5 / (1 + 2 * 0.5) = 0.75
    assert continuous_time("logit_normal", 1, 2, 0.0, 3.0) == pytest.approx(0.75)
    # p -> 1e-7: sigmoid(-5.2) = 0.0055, unshifted, floored at 0.01
    assert continuous_time("logit_normal", 0, 1, 0.0, 1.0) == 0.01
    # uniform: p = 0.5 / 2 = 0.25 -> 0.2 + 0.8 * 0.25 = 0.4 -> 3 * 0.4 / (1 + 2 * 0.4) = 2/3
    assert continuous_time("uniform", 0, 2, 0.5, 3.0) == pytest.approx(2 / 3)


def test_anchor_decay_schedules():
    assert [anchor_decay(s, 0.3, "linear") for s in (0, 100, 300, 1000)] == pytest.approx([0.0, 0.1, 0.3, 0.3])
    assert anchor_decay(5, 0.3, "constant") == 0.3


# ------------------------------------------------------------------------------------ the loss on a stub policy
def _batch(adv):
    n = len(adv)
    return StubBatch(x_final=torch.arange(n * 8, dtype=torch.float32).reshape(n, 4, 2) / 10, positions=list(range(n)),
                  height=64, width=64, embeds=torch.zeros(n, 1), condition=None, advantages=torch.tensor(adv),
                  keep=torch.ones(n, dtype=torch.bool))


def _loss(*sets):
    return stub_loss(AWM, RECIPE, 0.3, None, *sets)[:3]


def _grad(loss, module, batch, t):
    module.w.grad = None
    value, stats = loss(module, batch, t)
    value.backward()
    return float(module.w.grad), stats


def test_noise_levels_are_the_schedules_sigmas_of_each_stratum():
    loss, policy, module = _loss()
    batch = _batch([1.0] * 4)
    sig = torch.linspace(1.0, 0.0, 7).tolist()
    for t in range(3):
        loss(module, batch, t)
    # K = 3 of 6 steps x 0.9: strata [0,1) [1,3) [3,5)
    assert all(s == sig[0] for s in policy.seen[0][1].tolist())
    assert set(policy.seen[1][1].tolist()) <= {sig[1], sig[2]} and set(policy.seen[2][1].tolist()) <= {sig[3], sig[4]}


def test_clipped_ratio_starts_at_one_with_the_plain_weighted_matching_gradient():
    batch = _batch([5.0, -2.5])
    clipped, _, m1 = _loss()
    plain, _, m2 = _loss("train.awm.clip_range=null")
    g1, stats = _grad(clipped, m1, batch, 1)
    g2, _ = _grad(plain, m2, batch, 1)
    assert stats["ratio"] == 1.0 and m1.forwards == 1  # log p_old is the current value: no second forward
    assert g1 == pytest.approx(g2, rel=1e-6) and g1 != 0


def test_positive_advantage_pulls_the_velocity_to_the_target_negative_pushes_away():
    for adv, sign in ((5.0, -1), (-5.0, 1)):
        loss, policy, module = _loss("train.awm.clip_range=null", "train.awm.weighting=uniform")
        batch = _batch([adv])
        _, before = _grad(loss, module, batch, 2)
        with torch.no_grad():
            module.w -= 0.01 * module.w.grad
        loss.begin_epoch(0)  # the same draw again
        _, after = _grad(loss, module, batch, 2)
        assert sign * (after["awm_mse"] - before["awm_mse"]) > 0


def test_after_an_optimizer_step_log_p_old_comes_from_the_sampling_weights():
    loss, policy, module = _loss("train.optimizer_steps_per_epoch=2")
    batch = _batch([1.0, -1.0])
    _, first = _grad(loss, module, batch, 0)
    assert first["ratio"] == 1.0 and module.forwards == 2  # old (the same weights yet) + current
    with torch.no_grad():
        module.w += 0.05  # an optimizer step
    module.forwards = 0
    _, second = _grad(loss, module, batch, 1)
    assert module.forwards == 2 and second["ratio"] != 1.0  # old (sampling weights swapped in) + current
    assert float(module.w.detach()) == pytest.approx(0.35)  # the current weights are back after the swap


# ------------------------------------------------------------------------------------ config
def test_recipe_validates_and_plans_k_levels_per_sample():
    cfg = load_config(RECIPE)
    assert cfg.train.loss == "awm" and cfg.train_timesteps == [0, 1, 2]
    assert cfg.sample.noise_level == 0 and cfg.train.optimizer_steps_per_epoch == 1
    fixed = load_config(RECIPE, ["train.awm.timestep_sampling=fixed", "train.timesteps=[1, 4]"])
    assert fixed.train_timesteps == [1, 4]


@pytest.mark.parametrize("sets, key", [
    (["train.awm.num_timesteps=6"], "train.awm.num_timesteps"),  # 5 strata below 6 x 0.9
    (["train.timesteps=[1]"], "train.timesteps"),  # only with fixed
    (["train.awm.timestep_sampling=fixed", "train.timesteps=[6]"], "train.timesteps"),
    (["train.ppo.ratio_norm=true"], "train.ppo.ratio_norm"),
    (["train.awm.weighting=cubic"], "train.awm.weighting"),
    (["train.awm.clip_range=0"], "train.awm.clip_range"),
])
def test_bad_awm_config_names_the_key(sets, key):
    from paco_ds.errors import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(RECIPE, sets)


def test_bad_awm_config_is_one_line_exit_2_in_dry_run():
    from conftest import one_line_error, run_cli

    line = one_line_error(run_cli("launch/train.py", "--config", RECIPE, "--dry-run", "--set",
                                  "train.awm.num_timesteps=6"))
    assert "train.awm.num_timesteps" in line and "at most 5" in line


# ------------------------------------------------------------------------------------ a real run


