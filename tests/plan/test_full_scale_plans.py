"""Full-size plans of the paper recipes on fake CUDA tensors (1-3 min of CPU each): `make test-plan`
(CI runs it). The plans whose code path one of these already takes (Qwen-Image-Edit beside its 2509
sibling, Qwen-Image's T2IS recipe, the loss comparison's four) are tests/plan/test_more_plans.py's
(`make test-plan-more`, outside CI's time)."""
from __future__ import annotations


import pytest
import torch

from tests.conftest import REPO, run_cli
from tests.plan.planning import (EDIT_DATA, MULTI_EDIT_DATA, QWEN_IMAGE_TRANSFORMER_PARAMS, T2IS_DATA, GiB,
                                 check_editing_plan, check_t2is_family_cli_plan)
from tests.plan.planning import plan as _plan

pytestmark = pytest.mark.plan  # minutes each: make test-plan


def test_flux_t2is_fits_on_8_x_80_from_the_cli():
    """The plan from the CLI, with rollout.mode: async (one pass serves both): the per-rank plan, then how
    many of the 8 GPUs sample (paco_ds/gpu_plan/async_split.py) from the same counted FLOPs."""
    args = [a for o in (*T2IS_DATA, "rollout.mode=async", "rollout.samplers=4") for a in ("--set", o)]
    proc = run_cli("launch/train.py", "--config", "configs/flux_t2is.yaml", "--dry-run", "--world-size", "8",
                   "--gpu-memory", "80", *args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "verdict: fits on 8 x 80 GiB" in proc.stdout
    assert "transformer gathered for sampling" in proc.stdout and "model FLOPs per image" in proc.stdout
    # sampling 225.8 + scoring 1.9 TFLOPs per image against training 45.6 + one proximal forward 21.9
    assert "samplers 6: 227.8 TFLOPs per image" in proc.stdout and "trainers 2: 67.4 TFLOPs" in proc.stdout
    assert "the recipe's rollout.samplers: 4:" in proc.stdout and "set rollout.samplers: 6" in proc.stdout
    assert "0.36 GB per adapter push" in proc.stdout
    # the verdict names the largest rollout batch that fits (the recipe samples one image per call)
    import re

    largest = int(re.search(r"rollouts: sample.batch_size: (\d+) is the largest that fits", proc.stdout).group(1))
    assert largest > 1


@pytest.mark.parametrize("recipe,data,transformer", [
    ("kontext_edit.yaml", EDIT_DATA, None),
    ("qwen_edit_plus.yaml", MULTI_EDIT_DATA, QWEN_IMAGE_TRANSFORMER_PARAMS),  # two input images per edit
])
def test_editing_recipes_fit_on_8_x_80(recipe, data, transformer):
    check_editing_plan(recipe, data, transformer)


@pytest.mark.parametrize("family, transformer, text_encoders", [
    # Z-Image-Turbo's single-stream DiT (its published config, diffusers' own class) with Qwen3-4B
    ("z_image", "transformer (base) 6,154,908,736, lora 158,760,960", "text_encoders 4,022,468,096"),
    # FLUX.2-klein-base-9B's transformer (FLUX.2's class, its published config) with Qwen3-8B
    ("flux2_klein", "transformer (base) 9,078,581,248, lora 142,606,336", "text_encoders 8,190,735,360"),
])
def test_a_t2is_family_plan_counts_the_transformer_and_fits_on_8_x_80_from_the_cli(family, transformer, text_encoders):
    """A family's recipe on the paper's T2IS settings, planned on fake tensors from the CLI: the plan
    states the transformer's parameters (its base, and its LoRA beside it), the text encoder's, and its verdict."""
    check_t2is_family_cli_plan(family, transformer, text_encoders)


def test_flux2_dev_plan_counts_32b_and_24b_fits_on_141_and_names_the_switches_for_80():
    """FLUX.2-dev's transformer (32.2B, diffusers' class on fake tensors from its published config) and
    Mistral-Small-3.1 (24.0B, whole on every rank while sampling, parked for training) on the paper's
    T2IS settings, as --dry-run --gpu-memory 80 prints it (print_plan): they fit on 8 x 141 GiB (the
    same plan's verdict there); on 8 x 80 GiB the gathered transformer beside the text encoder (sampling)
    and the activations (training) do not, and the verdict names the two keys that fit it there, which
    the second plan sets."""
    import dataclasses

    from paco_ds.gpu_plan import print_plan
    from paco_ds.gpu_plan.plan import verdict
    from paco_ds.grpo.plan import load_config

    printed = []
    planned = print_plan(load_config(REPO / "configs" / "flux2_t2is.yaml", T2IS_DATA), 8, 80, log=printed.append)
    out = "\n".join(printed)
    assert "GPU plan per rank (flux2, 512x512, bfloat16, gradient checkpointing off" in out
    params = next(line for line in out.splitlines() if line.startswith("parameters:"))
    assert "transformer (base) 32,223,281,152, lora 308,281,344" in params  # 32,531,562,496 with the LoRA
    assert "text_encoders 24,011,361,280" in params  # Mistral-Small-3.1, its vision tower included
    assert "note: text encoders (24,011,361,280 parameters, 44.7 GiB): whole on every rank" in out
    text = next(line for line in out.splitlines() if line.startswith("verdict:"))
    assert text.startswith("verdict: does not fit on 8 x 80 GiB"), text
    assert "deepspeed.rollout_gather: per_step" in text and "model.gradient_checkpointing: true" in text
    on_141 = verdict(dataclasses.replace(planned, gpu_gib=141))
    assert on_141.startswith("fits on 8 x 141 GiB"), on_141
    plan = _plan("flux2_t2is.yaml", T2IS_DATA + ["deepspeed.rollout_gather=per_step", "model.gradient_checkpointing=true"])
    assert plan.fits, plan.to_json()["verdict"]
    assert plan.memory["sampling"]["text encoders"] > 40 * GiB and plan.memory["training"]["text encoders"] == 0


def test_flux_at_1024_without_gradient_checkpointing_does_not_fit_and_names_the_sequence_parallel_degree_that_does():
    """The plan as --dry-run --gpu-memory prints it (print_plan): FLUX.1 at 1024 px does not fit on 8 x 80 GiB
    for its training activations; the verdict names checkpointing and, planned again as one rank of a
    sequence group (gpu_plan/sequence.py), the smallest parallel.sequence that fits without it."""
    import re

    from paco_ds.gpu_plan import print_plan
    from paco_ds.gpu_plan.plan import verdict
    from paco_ds.grpo.plan import load_config

    printed = []
    cfg = load_config(REPO / "configs" / "flux_t2is.yaml", T2IS_DATA + ["train.resolution=1024", "sample.ode_steps=3"])
    plan = print_plan(cfg, 8, 80, log=printed.append)
    assert plan.image_size == (1024, 1024)
    assert not plan.fits
    # the ODE tail after the SDE step at 1, [2, 10), in 3 steps: 5 transformer calls per image, not 10
    assert plan.counts["transformer_calls_per_image"] == 5
    assert plan.flops["sampling"] < 6 * plan.flops_detail["transformer_forward"]
    text = verdict(plan)
    assert "training" in text and "model.gradient_checkpointing: true" in text
    assert max(plan.memory["training"], key=plan.memory["training"].get) == "activations"
    # 24 heads, 4096 image and 512 prompt tokens: 2 is the first degree tried, and its plan fits
    assert printed[0] == "(planning parallel.sequence=2 without gradient checkpointing)"
    sharded = re.search(r"parallel.sequence: 2 fits without gradient checkpointing \(training ([\d.]+) GiB per rank, "
                        r"activations ([\d.]+); each rank's all-to-alls and gathers ([\d.]+) GiB per trained micro-step\); "
                        r"gradient checkpointing instead recomputes about one transformer forward per trained step "
                        r"\(\+([\d.]+) TFLOPs per image in training", text)
    assert sharded, text
    training, activations, exchanged, recompute = map(float, sharded.groups())
    assert training <= 80 and activations < plan.memory["training"]["activations"] / 2 ** 30 / 2
    assert exchanged > 1 and recompute == round(plan.flops_detail["transformer_forward"] / 1e12, 1)
    assert f"verdict: {text}" in printed[-1]


def test_a_host_tensor_in_the_sde_steps_inputs_is_caught_on_the_real_path(monkeypatch):
    import kernels
    from paco_ds.gpu_plan.plan import DevicePathError

    sde = kernels.sde_step

    def step(x, v, *args, **kwargs):
        return sde(x.cpu(), v, *args, **kwargs)  # what a stray .cpu() in the rollout would do

    monkeypatch.setattr(kernels, "sde_step", step)  # the SDE step every loss builds its own from
    with pytest.raises(DevicePathError, match="device mix"):
        _plan("flux_t2is.yaml", T2IS_DATA)


# ------------------------------------------------------------------------------- SD3.5-Medium
def _sd3_data(tmp_path, name: str) -> list[str]:
    """A shipped tiny prompt file repeated to 48 prompts: one epoch of Flow-GRPO's SD3 recipes at 8 ranks."""
    src = REPO / "paco_ds" / "data" / "prompts" / name
    lines = src.read_text().strip().splitlines()
    many = tmp_path / f"train{src.suffix}"
    many.write_text("\n".join(lines * -(-48 // len(lines))) + "\n")
    return [f"data.train_file={many}", f"data.test_file={src}"]


def test_sd3_geneval_without_gradient_checkpointing_does_not_fit_and_says_why(tmp_path):
    """GenEval scores on its own server: no local reward model. At Flow-GRPO's 9 images per micro-step
    (18 with the batched CFG), the training activations are what does not fit."""
    args = [a for o in _sd3_data(tmp_path, "tiny_geneval_train.jsonl") for a in ("--set", o)]
    proc = run_cli("launch/train.py", "--config", "configs/sd3_geneval.yaml", "--dry-run", "--world-size", "8",
                   "--gpu-memory", "80", *args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "GPU plan per rank (sd3, 512x512, bfloat16, gradient checkpointing off" in proc.stdout
    verdict = next(line for line in proc.stdout.splitlines() if line.startswith("verdict:"))
    assert "does not fit on 8 x 80 GiB: training" in verdict and "biggest: activations" in verdict
    assert "fix: model.gradient_checkpointing: true" in verdict
    assert "reward_models" not in next(line for line in proc.stdout.splitlines() if line.startswith("parameters:"))


def test_sd3_pickscore_with_gradient_checkpointing_fits_on_8_x_80(tmp_path):
    data = _sd3_data(tmp_path, "tiny_ocr_train.txt")
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


def test_sd35_medium_parts_count_their_parameters():
    """SD3.5-Medium's transformer (MMDiT-X: 24 joint blocks, the first 13 with a second image
    attention) and its three text encoders, built on meta from the repo's configs."""
    from paco_ds.gpu_plan.fake import FakeCuda, to_fake_cuda
    from paco_ds.grpo.plan import load_config
    from paco_ds.models.full_size import count
    from paco_ds.models.sd3 import SD3Policy

    t = SD3Policy.full_size.transformer()
    assert count(t) == 2_243_171_520
    assert sum(1 for b in t.transformer_blocks if b.attn2 is not None) == 13
    parts = SD3Policy.full_size.components(load_config(REPO / "configs" / "sd3_pickscore.yaml", []).model)
    assert count(parts["text_encoder"]) == 123_650_304 and count(parts["text_encoder_2"]) == 694_659_840
    t5 = parts["text_encoder_3"]
    assert count(t5) == 4_762_310_656  # the embedding once, as the checkpoint has it
    to_fake_cuda(FakeCuda(), t5, torch.bfloat16)
    assert t5.encoder.embed_tokens.weight is t5.shared.weight and count(t5) == 4_762_310_656


# ------------------------------------------------------------------------------- local reward models
def test_each_local_reward_counts_its_own_models(tmp_path):
    """The plan asks each reward for its full-size models (`Reward.full_size`) and scores the batch
    through its own `score`: PickScore's CLIP-H (bf16 on a GPU), the aesthetic predictor's CLIP
    ViT-L/14 and head, ImageReward's BLIP ViT-L/16, text encoder and head (fp32, their default)."""
    clip_h, clip_l14, head, blip_vit, blip_text = 986_109_441, 427_616_513, 927_969, 303_301_632, 141_977_088
    plan = _plan("sd3_pickscore.yaml", _sd3_data(tmp_path, "tiny_ocr_train.txt") + [
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
