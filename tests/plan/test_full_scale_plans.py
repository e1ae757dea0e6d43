"""Full-size plans of the paper recipes on fake CUDA tensors (1-2 min of CPU each): `make test-plan`
(CI runs it). A plan per family CI holds (FLUX.1 from the CLI with rollout.mode: async, Kontext,
Qwen-Image-Edit-2509 with two input images, FLUX.2-dev), SD3.5-M's parts counted, FLUX.1 at 1024 px and its
sequence-parallel advice, and the device-mix check. The other plans (Qwen-Image-Edit, Qwen-Image, Z-Image and
FLUX.2-klein T2IS, SD3.5-M's PickScore and GenEval recipes, the local reward models, CLIP-I, DiffusionNFT's old
policy, a loss from tests/, the loss comparison) are tests/plan/test_more_plans.py's (`make test-plan-more`,
outside CI's time).
"""
from __future__ import annotations


import pytest
import torch

from tests.conftest import REPO, run_cli
from tests.plan.planning import EDIT_DATA, T2IS_DATA, GiB, check_editing_plan
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


def test_kontext_fits_on_8_x_80():
    """FLUX.1-Kontext's edit with its reference (Qwen-Image-Edit's plans are make test-plan-more's)."""
    check_editing_plan("kontext_edit.yaml", EDIT_DATA, None)


def test_flux2_dev_plan_counts_32b_and_24b_fits_on_141_and_names_the_switches_for_80():
    """FLUX.2-dev's transformer (32.2B, diffusers' class on fake tensors from its published config) and
    Mistral-Small-3.1 (24.0B, whole on every rank while sampling, parked for training) on the paper's
    T2IS settings, as --dry-run --gpu-memory 80 prints it (print_plan): they fit on 8 x 141 GiB (the
    same plan's verdict there); on 8 x 80 GiB the gathered transformer beside the text encoder (sampling)
    does not, while training does, and the verdict names the key that fits it there, which the second
    plan sets."""
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
    assert "sampling needs" in text and "fix: deepspeed.rollout_gather: per_step" in text and "training" not in text
    assert planned.total("training") < 80 * GiB
    on_141 = verdict(dataclasses.replace(planned, gpu_gib=141))
    assert on_141.startswith("fits on 8 x 141 GiB"), on_141
    plan = _plan("flux2_t2is.yaml", T2IS_DATA + ["deepspeed.rollout_gather=per_step"])
    assert plan.fits and not plan.gradient_checkpointing, plan.to_json()["verdict"]
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
