"""GRPO-Guard with Flow-GRPO-Fast windows, CPS sampling and MixGRPO-Flash for real: the deepspeed
launcher, 2 ZeRO-3 CPU processes, and the run resumed from its epoch-1 checkpoint matches the
uninterrupted one."""
import pytest

from distributed_runs import REPO, resumes_exactly

pytestmark = pytest.mark.runs_more  # make test-runs-more (not in CI: its time)


def test_guard_with_per_group_fast_window_and_cheaper_rollouts_resumes_exactly(tmp_path):
    # The rollout switches ride along: the ODE tail after the window's range, [3, 6), in 2 AB2 steps,
    # and each group's steps before its window (sample.same_latent) walked once per rank.
    rows = resumes_exactly(tmp_path, REPO / "configs/tiny/t2is_guard.yaml",
                            "sample.sde_window={size: 2, range: [0, 3], per: group}",
                            "sample.ode_solver=ab2", "sample.ode_steps=2")
    for r in rows:
        assert r["train/ratio_first"] == 1.0  # the normalised ratio of an unchanged policy
        assert r["sample/transformer_calls"] <= 8 * 5  # 8 samples x 5 steps (6 without the switches)
        # per rank: 4 samples x 2 window steps in the rollout + 4 x 2 recomputed in training
        assert r["train/sde_logprob_rows"] == 16
        assert r["train/micro_steps"] == 8
        for t in (0, 1):
            for k in ("raw_mean", "raw_std", "norm_mean", "norm_std"):
                assert f"train/guard/window{t}/logratio_{k}" in r


def test_cps_sampling_trains_on_two_zero3_ranks_and_resumes_exactly(tmp_path):
    rows = resumes_exactly(tmp_path, REPO / "configs/tiny/t2is_cps.yaml")
    for r in rows:
        assert r["train/ratio_first"] == 1.0  # CPS's stored log-prob, recomputed in training: ratio 1
        # per rank: 4 samples x 6 noisy steps in the rollout + the same 24 recomputed in training
        assert r["train/sde_logprob_rows"] == 48 and r["train/micro_steps"] == 24
    assert rows[1]["train/grad_norm"] > 0


def test_mixgrpo_flash_slides_its_window_and_resumes_exactly(tmp_path):
    rows = resumes_exactly(tmp_path, REPO / "configs/tiny/t2is_mixgrpo_flash.yaml")
    assert [r["sample/sde_window_start"] for r in rows] == [0.0, 2.0]  # 2 steps further each epoch
    for r in rows:
        assert r["train/ratio_first"] == 1.0
        assert r["train/micro_steps"] == 8  # per rank: 4 samples x the window's 2 steps
    # per sample: epoch 0 walks steps 0, 1 and one AB2 step over 2-6 (3 calls); epoch 1 one step over
    # 0-2, then 2, 3, and one over 4-6 (4 calls, the first shared by a group's same-latent samples)
    assert rows[0]["sample/transformer_calls"] < rows[1]["sample/transformer_calls"] <= 8 * 4


def test_tree_rollouts_train_with_per_step_advantages_and_resume_exactly(tmp_path):
    # the short run's groups of 4: a tree splitting in 2 at steps 0 and 3
    rows = resumes_exactly(tmp_path, REPO / "configs/tiny/t2is_tree.yaml", "sample.noise_steps=[0, 3]")
    for r in rows:
        assert r["train/ratio_first"] == 1.0  # each leaf's stored split log-probs, recomputed in training
        assert r["train/micro_steps"] == 8  # per rank: 4 leaves x the tree's 2 splits
        # each rank computes the nodes its leaves need, shared where two of its leaves share them (two
        # groups over 4 leaves per rank: some always do), so the 8 leaves cost fewer than 8 x 6 calls
        assert r["sample/transformer_calls"] < 8 * 6
        assert r["adv/tree_depth1_abs_mean"] > 0 and r["adv/tree_depth2_abs_mean"] > 0
    assert rows[1]["train/grad_norm"] > 0
