"""Full-size plans of the paper recipes on fake CUDA tensors (1-3 min of CPU each): `make test-plan`
(CI runs it). The recipes' prompt files are not in the repository: the shipped tiny data stands in
(the plan's shapes come from the recipe's resolution and the models, not from the prompts)."""
from __future__ import annotations

import os

import pytest

from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.skipif(os.environ.get("PACO_TEST_PLAN") != "1",
                                reason="full-size plans take minutes: make test-plan")

T2IS_DATA = ["data.train_file=paco_ds/data/prompts/tiny_t2is_train.jsonl",
             "data.test_file=paco_ds/data/prompts/tiny_t2is_test.jsonl", "sample.prompts_per_epoch=8"]
EDIT_DATA = ["data.train_file=paco_ds/data/prompts/tiny_edit/train_metadata.jsonl",
             "data.test_file=paco_ds/data/prompts/tiny_edit/test_metadata.jsonl", "sample.prompts_per_epoch=7"]
GiB = 2 ** 30


def _plan(recipe: str, overrides: list[str], **kw):
    from paco_ds.gpu_plan.plan import gpu_plan
    from paco_ds.grpo.plan import load_config

    return gpu_plan(load_config(REPO / "configs" / recipe, overrides), 8, 80, **kw)


def test_flux_t2is_fits_on_8_x_80_from_the_cli():
    args = [a for o in T2IS_DATA for a in ("--set", o)]
    proc = run_cli("launch/train.py", "--config", "configs/flux_t2is.yaml", "--dry-run", "--world-size", "8",
                   "--gpu-memory", "80", *args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "verdict: fits on 8 x 80 GiB" in proc.stdout
    assert "transformer gathered for sampling" in proc.stdout and "model FLOPs per image" in proc.stdout


@pytest.mark.parametrize("recipe", ["kontext_edit.yaml", "qwen_edit.yaml"])
def test_editing_recipes_fit_on_8_x_80(recipe):
    plan = _plan(recipe, EDIT_DATA)
    assert plan.fits, plan.to_json()["verdict"]
    # the text encoders are parked for training; the gathered transformer is in sampling only
    assert plan.memory["training"]["text encoders"] == 0 < plan.memory["sampling"]["text encoders"]
    assert plan.memory["sampling"]["transformer gathered for sampling"] > 15 * GiB
    assert plan.flops["training"] > 0 and plan.flops["sampling"] > plan.flops["training"] / 4


def test_flux_at_1024_without_gradient_checkpointing_does_not_fit_and_says_why():
    from paco_ds.gpu_plan.plan import verdict

    plan = _plan("flux_t2is.yaml", T2IS_DATA + ["train.resolution=1024"])
    assert plan.image_size == (1024, 1024)
    assert not plan.fits
    text = verdict(plan)
    assert "training" in text and "model.gradient_checkpointing: true" in text
    assert max(plan.memory["training"], key=plan.memory["training"].get) == "activations"


def test_a_host_tensor_in_the_sde_steps_inputs_is_caught_on_the_real_path():
    from paco_ds.gpu_plan.plan import DevicePathError

    def inject(name, sde):
        def step(x, v, *args, **kwargs):
            return sde(x.cpu(), v, *args, **kwargs)  # what a stray .cpu() in the rollout would do
        return step

    with pytest.raises(DevicePathError, match="device mix"):
        _plan("flux_t2is.yaml", T2IS_DATA, inject=inject)
