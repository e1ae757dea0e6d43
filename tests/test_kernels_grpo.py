"""The GRPO advantage op (torch version, the CPU path) against the numpy StatTracker."""
import pytest
import torch

import kernels
from kernel_checks import check_advantages
from paco_ds.errors import RewardError


@pytest.mark.parametrize("global_std", [True, False])
@pytest.mark.parametrize("log_tame", [None, "mean", "median", 0.5])
def test_advantages_match_the_stat_tracker(log_tame, global_std):
    check_advantages("torch", log_tame, global_std)


def test_single_sample_and_zero_spread_groups_get_zero():
    rewards = torch.tensor([[1.0, 3.0, 5.0, 5.0, 5.0, 9.0]], dtype=torch.float64)
    out = kernels.grpo_advantages(rewards, [1.0], torch.tensor([7, 7, 9, 9, 9, 4]), global_std=False)
    assert out.advantages.tolist() == pytest.approx([-1, 1, 0, 0, 0, 0], abs=1e-9)


def test_log_tame_rejects_rewards_at_or_below_minus_one():
    rewards = torch.tensor([[0.5, 0.6, 0.5, 0.4], [-1.0, 9.0, 0.0, 30.0]], dtype=torch.float64)
    with pytest.raises(RewardError, match="reward type 1 has values <= -1"):
        kernels.grpo_advantages(rewards, [1.0, 1.0], torch.tensor([0, 0, 1, 1]), log_tame="mean")


def test_unknown_log_tame_threshold():
    with pytest.raises(ValueError, match="log_tame"):
        kernels.grpo_advantages(torch.ones(1, 2), [1.0], torch.zeros(2), log_tame="max")
