"""DiffusionNFT, GRPO-Guard and Flow-GRPO-Fast formulas against values worked out by hand."""

import pytest
import torch

from kernels.sde_reference import sde_step
from paco_ds.grpo.losses.base import RolloutNeeds
from paco_ds.grpo.losses.nft import nft_loss, old_policy_decay, optimality_weight
from paco_ds.grpo.losses.ppo import ratio_norm
from paco_ds.grpo.plan import load_config
from paco_ds.sampling.spec import SamplingSpec
from paco_ds.sampling.window import rollout_steps, window_start

pytestmark = pytest.mark.fast

TINY = "configs/tiny/t2is.yaml"


def test_optimality_weight_maps_clipped_advantage_to_zero_one():
    r = optimality_weight(torch.tensor([-7.0, -5.0, -2.5, 0.0, 1.0, 5.0, 9.0]), 5.0)
    assert r.tolist() == pytest.approx([0.0, 0.0, 0.25, 0.5, 0.6, 1.0, 1.0])


def test_old_policy_decay_schedules():
    assert [old_policy_decay(s, 0) for s in (0, 10, 1000)] == [0.0, 0.0, 0.0]
    assert [old_policy_decay(s, 1) for s in (0, 100, 400, 600)] == pytest.approx([0.0, 0.1, 0.4, 0.5])
    assert [old_policy_decay(s, 2) for s in (74, 75, 95, 1000)] == pytest.approx([0.0, 0.0, 0.15, 0.999])


def test_nft_loss_by_hand_one_element():
    # x0 = 1, eps = 3, sigma = 0.5 -> x_t = 2; target v = eps - x0 = 2.
    # v_theta = 2.5, v_old = 1.5, beta = 1: v+ = 2.5, v- = 2*1.5 - 2.5 = 0.5.
    x0, eps, s = torch.tensor([[1.0]]), torch.tensor([[3.0]]), torch.tensor([0.5])
    x_t = (1 - s) * x0 + s * eps
    vt, vo = torch.tensor([[2.5]]), torch.tensor([[1.5]])
    # plain flow-matching form: L+ = (2.5-2)^2 = 0.25, L- = (0.5-2)^2 = 2.25; r = 0.75
    loss, _ = nft_loss(vt, vo, x_t, x0, s, eps, torch.tensor([0.75]), 1.0, adaptive=False)
    assert float(loss) == pytest.approx(0.75 * 0.25 + 0.25 * 2.25)
    # adaptive x0 form: x0+ = 2 - 0.5*2.5 = 0.75 (err -0.25): 0.0625/0.25 = 0.25;
    # x0- = 2 - 0.25 = 1.75 (err 0.75): 0.5625/0.75 = 0.75 -> 0.75*0.25 + 0.25*0.75
    loss, _ = nft_loss(vt, vo, x_t, x0, s, eps, torch.tensor([0.75]), 1.0, adaptive=True)
    assert float(loss) == pytest.approx(0.375)
    # beta = 0.5: v+ = 0.5*1.5 + 0.5*2.5 = 2 (exact: L+ = 0), v- = 1.5*1.5 - 0.5*2.5 = 1 (L- = 1); /beta
    loss, _ = nft_loss(vt, vo, x_t, x0, s, eps, torch.tensor([0.25]), 0.5, adaptive=False)
    assert float(loss) == pytest.approx((0.25 * 0.0 + 0.75 * 1.0) / 0.5)


def test_nft_gradient_pushes_toward_positive_policy_when_r_is_one():
    # r = 1, beta = 1: L = (v_theta - v)^2 -> dL/dv_theta = 2 (2.5 - 2) = 1
    x0, eps, s = torch.tensor([[1.0]]), torch.tensor([[3.0]]), torch.tensor([0.5])
    vt = torch.tensor([[2.5]], requires_grad=True)
    loss, _ = nft_loss(vt, torch.tensor([[1.5]]), (1 - s) * x0 + s * eps, x0, s, eps, torch.tensor([1.0]), 1.0,
                       adaptive=False)
    loss.sum().backward()
    assert float(vt.grad) == pytest.approx(1.0)


def test_ratio_norm_by_hand():
    # two elements; s = 0.5; mu - mu_old = (0.1, -0.3): bias = mean(0.01, 0.09)/(2*0.25) = 0.1
    # log pi - log pi_old = -0.04 -> (-0.04 + 0.1) * 0.5 = 0.03
    mean, mean_old = torch.tensor([[0.1, -0.3]]), torch.zeros(1, 2)
    z = ratio_norm(torch.tensor([-1.04]), torch.tensor([-1.0]), mean, mean_old, torch.tensor([0.5]))
    assert z.tolist() == pytest.approx([0.03])


def test_ratio_norm_removes_the_bias_of_the_gaussian_log_ratio():
    # x' = mu_old + s*eps: the normalised log-ratio is exactly mean((mu - mu_old) * eps)
    g = torch.Generator().manual_seed(0)
    mu_old, d, eps = (torch.randn(3, 64, generator=g) for _ in range(3))
    s = torch.tensor([0.3, 0.05, 0.01])
    x = mu_old + s[:, None] * eps
    lp = lambda mu: (-(x - mu) ** 2 / (2 * s[:, None] ** 2) - torch.log(s[:, None])).mean(1)
    raw = lp(mu_old + 0.01 * d) - lp(mu_old)
    assert (raw.mean() < 0) and raw[2].abs() > raw[0].abs()  # below 0, larger at low noise
    z = ratio_norm(lp(mu_old + 0.01 * d), lp(mu_old), mu_old + 0.01 * d, mu_old, s)
    assert torch.allclose(z.double(), (0.01 * d * eps).mean(1).double(), atol=1e-6)


def training_spec(cfg, log_probs=True):
    return SamplingSpec.training(cfg, sde_step, RolloutNeeds(log_probs=log_probs))


def test_sde_window_is_seeded_in_range_and_per_group():
    cfg = load_config(TINY, ["sample.sde_window={size: 2, range: [0, 5]}", "sample.num_steps=6"])
    starts = {window_start(cfg, e) for e in range(50)}
    assert starts <= {0, 1, 2, 3} and len(starts) == 4  # starts in [0, 5 - 2]
    assert window_start(cfg, 7) == window_start(cfg, 7)
    noise, train = rollout_steps(cfg, training_spec(cfg), 7, [0, 1])
    assert noise == train == list(range(window_start(cfg, 7), window_start(cfg, 7) + 2))
    noise, train = rollout_steps(cfg, training_spec(cfg, log_probs=False), 7, [0, 1])
    assert len(noise) == 2 and train == []  # a loss that keeps no log-probs trains no step's transition
    cfg = load_config(TINY, ["sample.sde_window={size: 2, range: [0, 5], per: group}", "sample.num_steps=6"])
    noise, _ = rollout_steps(cfg, training_spec(cfg), 3, [4, 9, 4])
    assert noise[0] == noise[2] and all(len(n) == 2 for n in noise)
    assert noise[1] == list(range(window_start(cfg, 3, 9), window_start(cfg, 3, 9) + 2))


def mixgrpo_start(iteration, tau, stride, first, last, roll_back):
    """MixGRPO's progressive window, moved one iteration at a time as its scheduler moves it: after
    every `tau` iterations the start advances by `stride`; past `last` it stays there (the window
    keeps its size) or, with roll-back, returns to `first`."""
    start = first
    for it in range(1, iteration + 1):
        if it % tau == 0:
            start += stride
            if start > last:
                start = first if roll_back else last
    return start


@pytest.mark.parametrize("tau, stride, roll_back", [(1, 1, False), (3, 2, False), (2, 2, True), (1, 3, True)])
def test_a_sliding_window_follows_mixgrpos_progressive_schedule(tau, stride, roll_back):
    cfg = load_config(TINY, [f"sample.sde_window={{size: 3, range: [1, 10], schedule: sliding, shift_every: {tau}, "
                             f"stride: {stride}, roll_back: {str(roll_back).lower()}}}", "sample.num_steps=10"])
    starts = [window_start(cfg, e) for e in range(40)]
    assert starts == [mixgrpo_start(e, tau, stride, 1, 7, roll_back) for e in range(40)]
    assert starts[0] == 1 and max(starts) <= 7 and len(set(starts)) > 1
    noise, train = rollout_steps(cfg, training_spec(cfg), 5, [0, 1, 2])
    assert noise == train == list(range(starts[5], starts[5] + 3))  # one window for every group


def test_mixgrpo_flash_walks_the_ode_stretches_around_this_epochs_window():
    from paco_ds.sampling.solver import Step, plan_for

    cfg = load_config("configs/tiny/t2is_mixgrpo_flash.yaml")  # window 2, stride 2 per epoch, 1 AB2 step
    plans = {e: plan_for(cfg, window_start(cfg, e)) for e in range(4)}
    assert plans[0] == [Step(0, 1), Step(1, 2), Step(2, 6)]
    assert plans[1] == [Step(0, 2), Step(2, 3), Step(3, 4), Step(4, 6)]
    assert plans[2] == plans[3] == [Step(0, 4), Step(4, 5), Step(5, 6)]  # at the end it stays
    assert plan_for(cfg) == [Step(i, i + 1) for i in range(6)]  # not knowing the epoch: the whole range
    from paco_ds.grpo.plan import rollout_line

    assert rollout_line(cfg).startswith("3-4 transformer calls per image of 6 steps (by where the sliding window is)")


@pytest.mark.parametrize("sets, msg", [
    (["sample.sde_window={size: 4, range: [0, 3]}"], "must fit"),
    (["sample.sde_window={size: 2, range: [0, 5], schedule: sliding, per: group}", "sample.num_steps=6"],
     "sliding window moves with the epoch"),
    (["train.loss=nft", "train.ppo.ratio_norm=true"], "nft"),
    (["train.ppo.ratio_norm=true", "sample.sde_type=cps"], "flow_grpo"),
])
def test_invalid_combinations_are_config_errors(sets, msg):
    from paco_ds.errors import ConfigError
    with pytest.raises((ConfigError, ValueError), match=msg):
        load_config(TINY, sets)


@pytest.mark.parametrize("recipe", ["configs/flux_t2is_nft.yaml", "configs/flux_t2is_guard.yaml",
                                    "configs/flux_t2is_fast.yaml", "configs/tiny/t2is_nft.yaml",
                                    "configs/tiny/t2is_guard.yaml", "configs/tiny/t2is_fast.yaml",
                                    "configs/flux_t2is_mixgrpo.yaml", "configs/flux_t2is_mixgrpo_flash.yaml",
                                    "configs/tiny/t2is_mixgrpo_flash.yaml"])
def test_recipes_validate(recipe):
    cfg = load_config(recipe)
    assert cfg.train.loss in ("ppo", "nft")
    assert cfg.train.ppo.ratio_norm or cfg.train.loss == "nft" or cfg.sample.sde_window is not None


def test_the_epoch_line_prints_what_the_loss_reports():
    from paco_ds.grpo.epoch import epoch_line
    from paco_ds.grpo.losses.base import Loss
    from paco_ds.grpo.losses.nft import NFT
    from paco_ds.grpo.losses.ppo import PPOClip

    class OwnStat(Loss):  # a loss outside paco_ds reports its own statistic
        headline = {"margin": ".2f"}

    m = {"epoch": 3, "reward/x/mean": 0.5, "train/loss": 0.25, "train/ratio": 1.0, "train/clipfrac": 0.125,
         "train/margin": 0.5, "time/epoch": 2.0}
    lines = {loss: epoch_line(m, loss.headline) for loss in (PPOClip, NFT, OwnStat)}
    assert "loss=0.25 ratio=1.000000 clipfrac=0.125 |" in lines[PPOClip]
    assert "loss=0.25 |" in lines[NFT] and "ratio" not in lines[NFT]  # NFT has no likelihood ratio
    assert "loss=0.25 margin=0.50 |" in lines[OwnStat] and "ratio" not in lines[OwnStat]
