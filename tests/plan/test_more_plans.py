"""The full-size plans beyond `make test-plan`'s (CI's): `make test-plan-more`, outside CI's time (1-3 min
of CPU apiece, about 10 min on 2 cores). Qwen-Image-Edit and Edit-2509 (two input images) and Qwen-Image's and
Z-Image's and FLUX.2-klein's T2IS recipes from the CLI, SD3.5-M's PickScore and GenEval recipes, the local reward models and CLIP-I at full size,
DiffusionNFT's old policy, a loss from tests/ and the loss comparison (benchmarks/loss_compare.py
--full-scale). Run it for a change to one of these families, a reward model, a loss or paco_ds/gpu_plan/."""
from __future__ import annotations

import pytest

from tests.conftest import REPO, run_cli
from tests.plan.planning import (EDIT_DATA, MULTI_EDIT_DATA, QWEN_IMAGE_TRANSFORMER_PARAMS, T2IS_DATA, GiB, check_editing_plan,
                                 check_t2is_family_cli_plan, plan as _plan, sd3_data)

pytestmark = pytest.mark.plan_more


@pytest.mark.parametrize("recipe,data", [("qwen_edit.yaml", EDIT_DATA),
                                         ("qwen_edit_plus.yaml", MULTI_EDIT_DATA)])  # two input images per edit
def test_qwen_image_edit_fits_on_8_x_80(recipe, data):
    """Qwen-Image-Edit with one input image per edit, and Edit-2509/2511 with two (qwen_edit_plus.yaml, which
    fits without gradient checkpointing: 58.2 GiB in training)."""
    check_editing_plan(recipe, data, QWEN_IMAGE_TRANSFORMER_PARAMS)


def test_qwen_image_t2is_plan_counts_the_transformer_and_fits_on_8_x_80_from_the_cli():
    """Qwen-Image's 60-block MMDiT (Qwen-Image-Edit's transformer config) with Qwen2.5-VL-7B."""
    check_t2is_family_cli_plan("qwen_image", "transformer (base) 20,430,401,088, lora 424,673,280",
                               "text_encoders 8,292,166,656")


def test_z_image_t2is_plan_counts_the_transformer_and_fits_on_8_x_80_from_the_cli():
    """Z-Image-Turbo's single-stream DiT (its published config, diffusers' own class) with Qwen3-4B."""
    check_t2is_family_cli_plan("z_image", "transformer (base) 6,154,908,736, lora 158,760,960",
                               "text_encoders 4,022,468,096")


def test_flux2_klein_t2is_plan_counts_the_transformer_and_fits_on_8_x_80_from_the_cli():
    """FLUX.2-klein-base-9B's transformer (FLUX.2's class, its published config) with Qwen3-8B; FLUX.2-dev's
    plan (make test-plan) covers the family's code path."""
    check_t2is_family_cli_plan("flux2_klein", "transformer (base) 9,078,581,248, lora 142,606,336",
                               "text_encoders 8,190,735,360")


# ------------------------------------------------------------------------------- SD3.5-Medium's recipes
def test_sd3_pickscore_with_gradient_checkpointing_fits_on_8_x_80(tmp_path):
    """SD3.5-Medium with PickScore (Flow-GRPO's recipe) at full size; CI's plan tier keeps its parts' count."""
    data = sd3_data(tmp_path, "tiny_ocr_train.txt")
    plan = _plan("sd3_pickscore.yaml", data + ["model.gradient_checkpointing=true"])
    assert plan.fits, plan.to_json()["verdict"]
    assert plan.image_size == (512, 512) and plan.counts["rollout_batch"] == 9
    assert plan.counts["transformer_calls_per_image"] == 10
    assert plan.params["transformer"] - plan.params["lora"] == 2_243_171_520
    assert plan.params["text_encoders"] == 123_650_304 + 694_659_840 + 4_762_310_656  # CLIP-L, CLIP-G, T5-XXL
    assert plan.params["reward_models"] > 9e8  # PickScore's CLIP-H at full size, on the device
    assert plan.memory["training"]["text encoders"] == 0 < plan.memory["sampling"]["text encoders"]
    assert plan.memory["scoring"]["reward models"] > GiB
    # 10 steps of one batched CFG forward each; training recomputes the checkpointed forward
    assert plan.flops["sampling"] > 10 * plan.flops_detail["transformer_forward"] > 0
    assert plan.flops_detail["train_micro_step"] > 3 * plan.flops_detail["transformer_forward"]


def test_sd3_geneval_without_gradient_checkpointing_does_not_fit_and_says_why(tmp_path):
    """GenEval scores on its own server: no local reward model. At Flow-GRPO's 9 images per micro-step
    (18 with the batched CFG), the training activations are what does not fit."""
    args = [a for o in sd3_data(tmp_path, "tiny_geneval_train.jsonl") for a in ("--set", o)]
    proc = run_cli("launch/train.py", "--config", "configs/sd3_geneval.yaml", "--dry-run", "--world-size", "8",
                   "--gpu-memory", "80", *args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "GPU plan per rank (sd3, 512x512, bfloat16, gradient checkpointing off" in proc.stdout
    verdict = next(line for line in proc.stdout.splitlines() if line.startswith("verdict:"))
    assert "does not fit on 8 x 80 GiB: training" in verdict and "biggest: activations" in verdict
    assert "fix: model.gradient_checkpointing: true" in verdict
    assert "reward_models" not in next(line for line in proc.stdout.splitlines() if line.startswith("parameters:"))


# ------------------------------------------------------------------------------- local reward models
def test_each_local_reward_counts_its_own_models(tmp_path):
    """The plan asks each reward for its full-size models (`Reward.full_size`) and scores the batch
    through its own `score`: PickScore's CLIP-H (bf16 on a GPU), the aesthetic predictor's CLIP
    ViT-L/14 and head, ImageReward's BLIP ViT-L/16, text encoder and head (fp32, their default)."""
    clip_h, clip_l14, head, blip_vit, blip_text = 986_109_441, 427_616_513, 927_969, 303_301_632, 141_977_088
    plan = _plan("sd3_pickscore.yaml", sd3_data(tmp_path, "tiny_ocr_train.txt") + [
        "model.gradient_checkpointing=true", "rewards.train.terms.aesthetic={weight: 1.0}",
        "rewards.train.terms.imagereward={weight: 1.0}"])
    assert plan.params["reward_models"] == clip_h + clip_l14 + head + blip_vit + blip_text + head
    weights = clip_h * 2 + (clip_l14 + blip_vit + blip_text + 2 * head) * 4
    assert weights <= plan.memory["training"]["reward models"] < weights + 16 * 2 ** 20  # + their buffers
    assert plan.flops_detail["reward_models"] > 0.35e12  # more than PickScore's alone


def test_clip_i_scores_the_edits_against_their_references():
    plan = _plan("kontext_edit.yaml", EDIT_DATA + ["rewards.train.terms.clip_i={weight: 1.0}"])
    assert plan.params["reward_models"] == 986_109_441  # open_clip ViT-H-14; the judge runs elsewhere
    assert plan.flops["scoring"] > 0


def test_the_nft_recipe_is_planned_with_its_old_policy():
    # DiffusionNFT keeps an old adapter (loss.setup, as the trainer calls it) that its rollout and
    # training swap in: the plan sets it up too, and the recipe fits.
    plan = _plan("flux_t2is_nft.yaml", T2IS_DATA)
    assert plan.fits, plan.to_json()["verdict"]
    assert plan.flops["training"] > 0


def test_a_loss_and_its_switch_from_tests_are_counted_with_no_change_to_the_plan():
    """The plan builds the trainer's own loss object: a loss defined in tests/ (tests/plan/extra_forwards_loss.py)
    whose switch adds no-grad transformer forwards to each micro-step costs exactly those forwards more
    in the plan's training FLOPs, and nothing in paco_ds/gpu_plan/ names it."""
    loss = ["train.loss=tests.plan.extra_forwards_loss:ExtraForwards"]
    plain = _plan("kontext_edit.yaml", EDIT_DATA + loss)
    extra = _plan("kontext_edit.yaml", EDIT_DATA + loss + ["train.extra_forwards.forwards=2"])
    forward = plain.flops_detail["transformer_forward"]
    trained = plain.counts["trained_steps_per_sample"]
    added = extra.flops_detail["train_micro_step"] - plain.flops_detail["train_micro_step"]
    assert added == pytest.approx(2 * forward, rel=0.02)
    assert extra.flops["training"] - plain.flops["training"] == pytest.approx(2 * forward * trained, rel=0.02)
    assert plain.flops["sampling"] == extra.flops["sampling"]  # the switch acts in training only
    assert not [p for p in (REPO / "paco_ds" / "gpu_plan").rglob("*.py") if "extra_forwards" in p.read_text()]


def test_the_loss_comparison_counts_dpo_dgpo_mixgrpo_flash_and_tree_rollouts_at_full_size(tmp_path):
    # benchmarks/loss_compare.py --full-scale: each method's full-size recipe planned. DGPO trains
    # every sample at each drawn step (the reference's forward and the policy's); DPO only the pair
    # of each group of k, so its training FLOPs per image are 2/k of the plan's per-row count.
    import json
    import sys

    from paco_ds.grpo.plan import load_config
    from paco_ds.sampling.solver import plan_for

    sys.path.insert(0, str(REPO / "benchmarks"))
    import loss_compare

    loss_compare.full_scale(["dgpo", "dpo", "mixgrpo_flash", "tree"], tmp_path, {})
    rows = {r["method"]: r for r in json.loads((tmp_path / "loss_compare_full_scale.json").read_text())["methods"]}
    # MixGRPO-Flash's rollout plan moves with its window: the calls are the mean over its places
    cfg = load_config(REPO / "configs/flux_t2is_mixgrpo_flash.yaml", list(loss_compare.PLAN_DATA))
    win = cfg.sample.sde_window
    calls = [len(plan_for(cfg, at)) for at in range(win.range[0], win.range[1] - win.size + 1)]
    assert rows["mixgrpo_flash"]["transformer_calls_per_image"] == pytest.approx(sum(calls) / len(calls))
    assert rows["mixgrpo_flash"]["transformer_calls_per_image"] < 10
    # a tree of 16 leaves splitting in 2 at steps 0, 2, 3 and 5 of 10: 89 calls for the group's 16 images,
    # and each image trains its 4 splits
    tree = rows["tree"]
    assert tree["transformer_calls_per_image"] == pytest.approx(89 / 16) and tree["trained_steps_per_sample"] == 4
    assert tree["fits_8x80"]
    assert tree["tflops_per_image"]["sampling"] < 6 * tree["transformer_forward_tflops"]
    dgpo, dpo = rows["dgpo"], rows["dpo"]
    assert dgpo["fits_8x80"] and dpo["fits_8x80"]
    assert dgpo["transformer_calls_per_image"] == dpo["transformer_calls_per_image"] == 10  # an ODE rollout
    assert dgpo["trained_steps_per_sample"] == 4 and dpo["trained_steps_per_sample"] == 2
    # per trained step and sample the two losses run the same forwards (reference + policy)
    per_step = dgpo["tflops_per_image"]["training"] / 4
    assert dpo["tflops_per_image"]["training"] == pytest.approx(per_step * 2 * 2 / 16, rel=1e-6)
    assert per_step > 2.5 * dgpo["transformer_forward_tflops"]  # a forward without grad, one with, a backward
