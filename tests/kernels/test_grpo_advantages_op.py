"""The GRPO advantage op (torch version, the CPU path) against the numpy StatTracker."""
import pytest
import torch

import kernels
from kernel_checks import check_advantages, check_ppo
from kernels.grpo import LogTameDomainError

pytestmark = pytest.mark.fast


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
    with pytest.raises(LogTameDomainError, match="reward type 1 has values <= -1") as err:
        kernels.grpo_advantages(rewards, [1.0, 1.0], torch.tensor([0, 0, 1, 1]), log_tame="mean")
    assert isinstance(err.value, ValueError) and err.value.index == 1 and err.value.minimum == -1


def test_unknown_log_tame_threshold():
    with pytest.raises(ValueError, match="log_tame"):
        kernels.grpo_advantages(torch.ones(1, 2), [1.0], torch.zeros(2), log_tame="max")


def test_the_torch_ppo_clip_loss_matches_float64():
    check_ppo("torch")


def test_no_cpp_kernel_for_the_vector_ops_and_asking_for_one_says_so():
    """"cpp" has no kernel for [B] and [K, N] vectors: the torch reference runs them, and a run that
    names "cpp" is told so once per op instead of being counted as a C++ run."""
    for op in ("ppo_clip_loss", "grpo_advantages", "weighted_linear_ce"):
        assert kernels.active_backend(op, "cpu", "cpp") == "torch"
        assert kernels.active_backend(op, "cpu", "auto") == "torch"
    lp, old, adv = torch.zeros(4), torch.zeros(4), torch.ones(4)
    kernels._warned.discard(("ppo_clip_loss", "cpp", "cpu"))
    with pytest.warns(RuntimeWarning, match="ppo_clip_loss runs the torch reference: 'cpp' has no kernel for it"):
        loss, _ = kernels.ppo_clip_loss(lp, old, adv, 1e-4, 5.0, backend="cpp")
    assert torch.equal(loss, kernels.grpo.ppo_clip_loss_torch(lp, old, adv, 1e-4, 5.0)[0])
