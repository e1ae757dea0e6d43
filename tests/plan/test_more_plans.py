"""Full-size plans whose code path a plan of `make test-plan` (CI) already takes, each still its own
recipe and its own numbers: `make test-plan-more`, outside CI's time (2-6 min of CPU apiece). Run it for
a change to a Qwen-Image family or to the loss comparison (benchmarks/loss_compare.py --full-scale)."""
from __future__ import annotations

import pytest

from tests.conftest import REPO
from tests.plan.planning import EDIT_DATA, QWEN_IMAGE_TRANSFORMER_PARAMS, check_editing_plan, check_t2is_family_cli_plan

pytestmark = pytest.mark.plan_more


def test_qwen_image_edit_fits_on_8_x_80():
    """Qwen-Image-Edit, one input image per edit (its 2509 sibling with two is test-plan's)."""
    check_editing_plan("qwen_edit.yaml", EDIT_DATA, QWEN_IMAGE_TRANSFORMER_PARAMS)


def test_qwen_image_t2is_plan_counts_the_transformer_and_fits_on_8_x_80_from_the_cli():
    """Qwen-Image's 60-block MMDiT (Qwen-Image-Edit's transformer config) with Qwen2.5-VL-7B."""
    check_t2is_family_cli_plan("qwen_image", "transformer (base) 20,430,401,088, lora 424,673,280",
                               "text_encoders 8,292,166,656")


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
