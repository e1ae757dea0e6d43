"""DiffusionNFT, AWM, Diffusion-DPO, DGPO and a loss from tests/ for real: the
deepspeed launcher, 2 ZeRO-3 CPU processes, and the run resumed from its epoch-1 checkpoint matches the
uninterrupted one."""
import math

import pytest
import yaml

from distributed_runs import REPO, resumes_exactly

pytestmark = pytest.mark.runs_more  # make test-runs-more (not in CI: its time)

AWM = REPO / "configs/tiny/t2is_awm.yaml"


def test_nft_runs_without_sde_log_probs_and_resumes_exactly(tmp_path):
    rows = resumes_exactly(tmp_path, REPO / "configs/tiny/t2is_nft.yaml", "train.timesteps=[1, 4]")
    for r in rows:
        assert r["train/sde_logprob_rows"] == 0  # no SDE log-prob in the rollout nor in training
        assert r["train/forwards_per_step"] == 2.0  # old (no grad) + current (grad); beta = 0: no ref
        assert "train/ratio_first" not in r
    assert rows[1]["train/grad_norm"] > 0  # old != current after the first epoch's step
    assert rows[0]["train/nft_old_decay"] == pytest.approx(0.001)  # 1 optimizer step per epoch


def test_awm_trains_on_two_zero3_ranks_and_resumes_exactly(tmp_path):
    # The recipe with the EMA anchor (its weights live in the checkpoint): 1 optimizer step per epoch.
    rows = resumes_exactly(tmp_path, AWM, "train.awm.ema_beta=1.0")
    for r in rows:
        assert r["train/sde_logprob_rows"] == 0  # ODE rollout, no SDE log-prob in training
        # per rank: 4 samples x 3 levels, each the anchor's forward (no grad) + the current one
        assert r["train/micro_steps"] == 12 and r["train/forwards_per_step"] == 2.0
        assert r["train/ratio_first"] == 1.0 and r["train/kl"] == 0.0
    # linear: min(0.3, 0.001 x optimizer steps), one step per epoch
    assert [r["train/awm_anchor_decay"] for r in rows] == pytest.approx([0.001, 0.002])
    # epoch 0 trains the initial weights, which the anchor holds; epoch 1's differ from the blend
    assert rows[0]["train/ema_kl"] == 0.0 and rows[1]["train/ema_kl"] > 0
    assert rows[1]["train/grad_norm"] > 0


def test_a_loss_that_lives_in_tests_only_trains_from_its_recipe_and_resumes_exactly(tmp_path):
    # tests/grpo/reinforce_loss.py: the loss and its section, one file, no line in paco_ds
    rows = resumes_exactly(tmp_path, REPO / "tests/grpo/reinforce.yaml")
    for r in rows:
        assert r["train/ratio_first"] == 1.0  # an unchanged policy's importance ratio
        assert r["train/forwards_per_step"] == 1.0
    assert rows[1]["train/grad_norm"] > 0
    saved = yaml.safe_load((tmp_path / "full" / "config.yaml").read_text())
    assert saved["train"]["loss"] == "tests.grpo.reinforce_loss:Reinforce"
    assert saved["train"]["reinforce"] == {"scale": 2.0}  # its own key, from the recipe


def test_dpo_pairs_within_micro_batches_on_two_zero3_ranks_and_resumes_exactly(tmp_path):
    # SHORT_RUN's 4 images per prompt: the plan rounds the prompts up to 4 (16 images) so that a rank's 8
    # fill one micro-batch of train.batch_size 8; 8 images of 4 prompts hold 2 of some prompt, so
    # every micro-step has 1 to 4 pairs (best against worst of each prompt present twice or more).
    rows = resumes_exactly(tmp_path, REPO / "configs/tiny/t2is_dpo.yaml")
    for r in rows:
        assert r["train/sde_logprob_rows"] == 0  # ODE rollout, no SDE log-prob in training
        # per rank: 1 micro-batch x 2 trained noise levels, each the reference (no grad) + the policy
        assert r["train/micro_steps"] == 2 and r["train/forwards_per_step"] == 2.0
        assert r["adv/num_groups"] == 4 and r["adv/avg_group_size"] == 4
        assert 1 <= r["train/dpo_pairs"] <= 4 and r["train/dpo_adv_gap"] > 0
        assert r["train/kl"] == 0.0
    # epoch 0 trains the initial adapter (zero): the policy is the reference, the loss log 2, and
    # its gradient already points the winner's error down
    assert rows[0]["train/policy_loss"] == pytest.approx(math.log(2)) and rows[0]["train/dpo_accuracy"] == 0.0
    assert rows[0]["train/grad_norm"] > 0 and rows[1]["train/grad_norm"] > 0
    assert rows[1]["train/policy_loss"] != pytest.approx(math.log(2))


def test_dgpo_sums_each_group_over_both_ranks_and_resumes_exactly(tmp_path):
    # SHORT_RUN's 4 prompts x 4 images, a rank's 8 in one micro-batch: each group's members on both
    # ranks are summed in the same micro-step, so every group's sigmoid weight sees all 4 of them.
    # With the authors' clip_dsm and switch_ema_ref on: the old policy, blended after every optimizer
    # step, is a third forward of each trained step, and from the first optimizer step on the rollouts
    # sample with it (one launch for both: the loss without them is the same code minus that forward).
    rows = resumes_exactly(tmp_path, REPO / "configs/tiny/t2is_dgpo.yaml", "train.dgpo.clip_dsm=true",
                           "train.dgpo.sample_with_old_after=0")
    for r in rows:
        assert r["train/sde_logprob_rows"] == 0  # ODE rollout, no SDE log-prob in training
        # per rank: 1 micro-batch x 2 drawn steps, each the reference and the old policy (no grad) + the policy
        assert r["train/micro_steps"] == 2 and r["train/forwards_per_step"] == 3.0
        assert r["train/dgpo_group_coverage"] == 1.0 and r["train/kl"] == 0.0
        assert 0.0 <= r["train/dgpo_clipfrac"] <= 1.0
    # epoch 0 trains the initial adapter (zero): the policy is the reference, z = 0, every weight 1/2,
    # and the gradient is already the advantage-weighted matching one
    assert rows[0]["train/dgpo_z"] == 0.0 and rows[0]["train/dgpo_weight"] == 0.5
    assert rows[0]["train/grad_norm"] > 0 and rows[1]["train/grad_norm"] > 0
    assert rows[1]["train/dgpo_weight"] != 0.5
