"""Full-size plans of the text-to-video recipes on fake CUDA tensors: 81-frame videos of Wan2.1-T2V-14B
and Wan2.2-T2V-A14B at 480p and 720p, and Wan2.2-TI2V-5B's 121 frames at 704 x 1280, on 8 x 80 GiB
and 8 x 141 GiB (H200), and for Wan2.1 at 720p the sequence-parallel degrees tried without checkpointing.
Each plan builds the checkpoint's real classes on meta from its published config, samples and scores a
video and trains a micro-step on the real code path (2 min of CPU each).
Wan2.1-14B at 480p is CI's plan tier's (`make test-plan`); the others are the `video` lane's
(`make test-video`, outside CI for their time). docs/gpu_plan.md tabulates them."""
from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import REPO

GiB = 2 ** 30
WAN_14B_TRANSFORMER = 14_288_491_584  # WanTransformer3DModel at Wan2.1-T2V-14B's config, without the LoRA
WAN22_TI2V_5B_TRANSFORMER = 4_999_787_712  # TI2V-5B's published config, without the LoRA
UMT5_XXL_ENCODER = 5_680_910_336  # the shared token embedding counted once, as the checkpoint ties it
P720 = ["train.resolution=[720,1280]", "test.resolution=[720,1280]"]


def _plan(recipe: str, overrides: list[str]):
    from paco_ds.gpu_plan.plan import gpu_plan
    from paco_ds.grpo.plan import load_config

    return gpu_plan(load_config(REPO / "configs" / recipe, overrides), 8, 80)


def _verdicts(plan) -> tuple[str, str]:
    from paco_ds.gpu_plan.plan import verdict

    return verdict(plan), verdict(dataclasses.replace(plan, gpu_gib=141))


@pytest.mark.plan  # CI's plan tier holds this one (make test-plan); the others are the video lane's
def test_wan21_14b_at_480p_fits_on_8_x_80_with_checkpointing_and_flash_attention():
    """81 frames at 480 x 832 (32,760 video tokens per sample): the 14B transformer gathered for
    sampling beside UMT5-XXL, and training's activations with checkpointing and the flash kernel."""
    plan = _plan("wan_t2v.yaml", [])
    assert plan.image_size == (480, 832) and plan.gradient_checkpointing
    assert plan.params["transformer"] - plan.params["lora"] == WAN_14B_TRANSFORMER
    assert plan.params["text_encoders"] == UMT5_XXL_ENCODER
    at_80, at_141 = _verdicts(plan)
    assert plan.fits and at_80.startswith("fits on 8 x 80 GiB"), at_80
    assert at_141.startswith("fits on 8 x 141 GiB"), at_141
    assert max(plan.memory["training"], key=plan.memory["training"].get) == "activations"
    assert plan.memory["sampling"]["transformer gathered for sampling"] > 20 * GiB


@pytest.mark.video
def test_wan21_14b_at_720p_fits_with_checkpointing_and_no_sequence_degree_fits_without():
    """81 frames at 720 x 1280 (75,600 tokens): with checkpointing and the flash kernel training fits on
    8 x 80 GiB, its activations the biggest part; as --dry-run --gpu-memory 80 prints it, the plan asks the
    sequence-parallel degrees the world size and heads allow without checkpointing (gpu_plan/sequence.py),
    and none fits: the verdict keeps checkpointing and states what it costs."""
    import re

    from paco_ds.gpu_plan import print_plan
    from paco_ds.grpo.plan import load_config

    printed = []
    plan = print_plan(load_config(REPO / "configs" / "wan_t2v.yaml", P720), 8, 80, log=printed.append)
    assert plan.image_size == (720, 1280) and plan.gradient_checkpointing
    at_80, at_141 = _verdicts(plan)
    assert plan.fits and at_80.startswith("fits on 8 x 80 GiB"), at_80
    assert at_141.startswith("fits on 8 x 141 GiB"), at_141
    assert max(plan.memory["training"], key=plan.memory["training"].get) == "activations"
    assert printed[:3] == [f"(planning parallel.sequence={n} without gradient checkpointing)" for n in (2, 4, 8)]
    advice = re.search(r"no parallel.sequence fits without gradient checkpointing \(2: training ([\d.]+) GiB, "
                       r"4: training ([\d.]+) GiB, 8: training ([\d.]+) GiB\); gradient checkpointing instead", at_80)
    assert advice, at_80
    two, four, eight = map(float, advice.groups())
    assert two > four > eight > 80  # each doubling of N about halves what one rank holds


@pytest.mark.video
def test_wan22_a14b_partitions_both_experts_and_fits_on_8_x_80():
    """Two 14B experts of Wan2.1-14B's config, both partitioned, gathered per step for the rollout
    (the recipe's rollout_gather: per_step): the recipe fits on 8 x 80 GiB, its trained step (one
    expert's) holding the activations of Wan2.1-14B's at the same shapes."""
    plan = _plan("wan22_t2v.yaml", [])
    assert plan.params["transformer"] - plan.params["lora"] == 2 * WAN_14B_TRANSFORMER
    assert plan.params["text_encoders"] == UMT5_XXL_ENCODER
    assert plan.memory["sampling"].get("transformer gathered for sampling", 0) == 0  # per step, not whole
    assert plan.total("sampling") < 80 * GiB
    at_80, at_141 = _verdicts(plan)
    assert plan.fits and at_80.startswith("fits on 8 x 80 GiB"), at_80
    assert at_141.startswith("fits on 8 x 141 GiB"), at_141
    assert plan.memory["training"]["activations"] < 30 * GiB  # Wan2.1-14B's 480p step: 23.7 GiB


@pytest.mark.video
def test_wan22_a14b_at_720p_samples_within_80_gib_and_fits_on_80_with_checkpointing():
    """Both experts at 81 x 720 x 1280: sampling gathers one expert's layers per forward (rollout_gather:
    per_step) and stays within 80 GiB, and a trained step, which runs one expert, holds Wan2.1-14B's
    activations at the same shapes: the recipe fits on 8 x 80 GiB with checkpointing."""
    plan = _plan("wan22_t2v.yaml", P720)
    assert plan.image_size == (720, 1280)
    assert plan.params["transformer"] - plan.params["lora"] == 2 * WAN_14B_TRANSFORMER
    assert plan.total("sampling") < 80 * GiB and plan.total("scoring") < 80 * GiB
    at_80, at_141 = _verdicts(plan)
    assert plan.fits and at_80.startswith("fits on 8 x 80 GiB"), at_80
    assert at_141.startswith("fits on 8 x 141 GiB"), at_141
    assert plan.memory["training"]["activations"] < 60 * GiB  # one expert's step, as Wan2.1's (54.6 GiB)


@pytest.mark.video
def test_wan22_ti2v_5b_fits_on_8_x_80_with_its_own_autoencoder():
    """TI2V-5B's dense transformer (its config: 30 layers, 24 heads) with UMT5-XXL and Wan2.2's
    48-channel autoencoder (16x in space, fp32), 121 frames at 704 x 1280: it fits on 8 x 80 GiB,
    sampling and scoring the largest phases."""
    plan = _plan("wan22_ti2v.yaml", [])
    assert plan.image_size == (704, 1280)
    assert plan.params["transformer"] - plan.params["lora"] == WAN22_TI2V_5B_TRANSFORMER
    assert plan.params["text_encoders"] == UMT5_XXL_ENCODER
    assert plan.params["vae"] > 5 * 126_892_531  # Wan2.2's autoencoder, several times Wan2.1's
    at_80, at_141 = _verdicts(plan)
    assert plan.fits and at_80.startswith("fits on 8 x 80 GiB"), at_80
    assert at_141.startswith("fits on 8 x 141 GiB"), at_141
    assert plan.total("training") < plan.total("sampling")
