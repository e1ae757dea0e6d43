"""The FLUX.1-Kontext editing policy on tiny offline models: condition tokens, target-only outputs,
log-prob recomputation, the schedule, aspect ratio, LoRA export into FluxKontextPipeline, loading."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import with_active_lora
from paco_ds.recipe.schema import LoraConfig, ModelConfig
from paco_ds.models import with_family_defaults
from paco_ds.models.base import Condition
from paco_ds.models.lora import adapter_config, export_lora, lora_state_dict
from paco_ds.sampling.spec import RolloutBatch, SamplingSpec
from paco_ds.sampling.trajectory import make_generator, sample_trajectories, transition_log_prob
from paco_ds.models.schedule import flux_sigmas

pytestmark = pytest.mark.fast

PROMPTS = ["turn the sky red", "add a hat to the cat"]
GUIDANCE = 2.5  # the Kontext recipe's guidance scale


def tiny_cfg(**kw) -> ModelConfig:
    return with_family_defaults(ModelConfig(family="flux_kontext", tiny=True, dtype="fp32",
                                            lora=LoraConfig(rank=8, alpha=16), **kw))


@pytest.fixture(scope="module")
def policy():
    """A tiny Kontext policy with a LoRA whose B matrices are non-zero (so the adapter matters)."""
    from paco_ds.models import build_policy

    p = build_policy(tiny_cfg(), torch.device("cpu"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return with_active_lora(p, tiny_cfg().lora)


def refs(*sizes, seed=0) -> list[torch.Tensor]:
    """Smooth random reference images (uint8 [3, H, W]) of the given (H, W) sizes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for h, w in sizes:
        low = torch.rand(1, 3, 4, 4, generator=g)
        out.append((torch.nn.functional.interpolate(low, size=(h, w), mode="bilinear")[0] * 255).to(torch.uint8))
    return out


def other_latents(cond: Condition, seed: int = 0) -> Condition:
    """The same images with unrelated latents. (The tiny random encoder barely responds to its
    input, so two real images give nearly the same condition tokens; these show the velocity reads them.)"""
    g = torch.Generator().manual_seed(seed)
    return Condition(cond.images, torch.randn(cond.latents.shape, generator=g), cond.size)


SPEC = SamplingSpec(num_steps=4, guidance=GUIDANCE, noise_level=0.9)  # what `rollout` samples with


def rollout(policy, cond, h, w, seeds, steps=4, noise_steps=(1,), train_steps=(1,)):
    prompts = PROMPTS[:len(seeds)]
    spec = SamplingSpec(num_steps=steps, guidance=SPEC.guidance, noise_level=SPEC.noise_level)
    return sample_trajectories(policy, policy.transformer, spec, RolloutBatch(
        prompts=prompts, embeds=policy.encode_prompts(prompts), height=h, width=w, condition=cond,
        generators=[make_generator(0, 0, s) for s in seeds], noise_steps=list(noise_steps),
        train_steps=list(train_steps)))


def test_registered_and_refuses_a_missing_condition(policy):
    from paco_ds.models import policy_class
    from paco_ds.models.flux_kontext import KontextPolicy

    assert policy_class("flux_kontext") is KontextPolicy and isinstance(policy, KontextPolicy)
    x = policy.initial_latents(1, 32, 32, [make_generator(0)])
    with pytest.raises(ValueError, match="needs the Condition"):
        policy.velocity(policy.transformer, x, 0.9, policy.encode_prompts(PROMPTS[:1]), 32, 32, GUIDANCE)


def test_velocity_returns_target_tokens_and_depends_on_the_condition(policy):
    h, w = 32, 48
    a, b = refs((32, 48), (32, 48), seed=3)
    cond = policy.encode_condition([a, b], h, w)
    L = policy.latent_seq_len(h, w)
    assert cond.latents.shape == (2, L, 16) and cond.size == (h, w)
    assert not torch.equal(cond.latents[0], cond.latents[1])
    cond = other_latents(cond)
    emb = policy.encode_prompts(PROMPTS)
    x = policy.initial_latents(2, h, w, [make_generator(1), make_generator(2)])
    with torch.no_grad():
        v = policy.velocity(policy.transformer, x, 0.8, emb, h, w, GUIDANCE, condition=cond)
        swapped = policy.velocity(policy.transformer, x, 0.8, emb, h, w, GUIDANCE, condition=cond.select([1, 0]))
        one = policy.velocity(policy.transformer, x[:1], 0.8, emb.select([0]), h, w, GUIDANCE,
                              condition=cond.select([0]))
    assert v.shape == x.shape  # the condition tokens are cut off
    assert (v - swapped).abs().max() > 5e-3  # each sample reads its own condition
    assert torch.allclose(v[:1], one, atol=1e-5)


def test_condition_ids_and_latents_are_the_kontext_pipelines(policy):
    """Same latents and ids as diffusers' FluxKontextPipeline.prepare_latents for the same image."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline
    from PIL import Image

    from paco_ds.models.flux_kontext import resize_to
    from paco_ds.models.tiny.flux import tiny_flux_components

    parts = tiny_flux_components(tiny_cfg().tiny_spec, seed=0)
    pipe = FluxKontextPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**parts.pop("scheduler_config")), **parts)
    ref = refs((40, 72), seed=5)[0]
    h, w = 32, 64
    pil = pipe.image_processor.resize(Image.fromarray(ref.permute(1, 2, 0).numpy()), h, w)
    pixels = pipe.image_processor.preprocess(pil, h, w)
    assert torch.allclose(resize_to(ref, h, w), pixels, atol=1e-6)  # the same Lanczos resize
    _, image_latents, latent_ids, image_ids = pipe.prepare_latents(
        pixels, 1, 4, h, w, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
    fresh = type(policy).load(tiny_cfg(), torch.device("cpu"))  # the pipeline's weights (no LoRA)
    cond = fresh.encode_condition([ref], h, w)
    assert torch.allclose(cond.latents, image_latents, atol=1e-5)
    assert torch.equal(fresh.condition_ids(h, w), image_ids) and torch.equal(fresh.image_ids(h, w), latent_ids)
    assert (image_ids[:, 0] == 1).all() and (latent_ids[:, 0] == 0).all()


def test_recomputed_log_prob_equals_the_sampled_one(policy):
    h, w = 32, 32
    cond = policy.encode_condition(refs((48, 48), (24, 40), seed=7), h, w)
    traj = rollout(policy, cond, h, w, seeds=[0, 1])
    assert traj.condition is not None and traj.condition.latents.shape[0] == 2
    whole = transition_log_prob(policy, policy.transformer, traj, 0, [0, 1], spec=SPEC)
    assert torch.equal(whole.log_prob.float(), traj.log_prob[:, 0])  # the rollout's own batch: ratio exactly 1
    for i in range(2):  # one sample at a time, as training does with batch size 1
        step = transition_log_prob(policy, policy.transformer, traj, 0, [i], spec=SPEC)
        assert torch.exp(step.log_prob.float() - traj.log_prob[[i], 0]).item() == pytest.approx(1.0, abs=1e-5)
    # Other condition latents give another mean and log-prob: training reads the condition too.
    traj = dataclasses.replace(traj, condition=other_latents(traj.condition))  # a Trajectory is frozen
    other = transition_log_prob(policy, policy.transformer, traj, 0, [0, 1], spec=SPEC)
    assert (other.mean - whole.mean).abs().max() > 1e-3
    assert not torch.equal(other.log_prob, whole.log_prob)


def test_one_transformer_forward_per_trained_step_and_no_encode(policy):
    h, w = 32, 32
    cond = policy.encode_condition(refs((32, 32), seed=2) * 2, h, w)
    traj = rollout(policy, cond, h, w, seeds=[4, 5], steps=4, noise_steps=[1, 2], train_steps=[1, 2])
    calls = {"transformer": 0, "vae": 0}

    def counter(key):
        def hook(*_):
            calls[key] += 1
        return hook

    handles = [policy.transformer.register_forward_hook(counter("transformer")),
               policy.vae.encoder.register_forward_hook(counter("vae"))]
    try:
        for t in range(2):
            for i in range(2):
                transition_log_prob(policy, policy.transformer, traj, t, [i], spec=SPEC)
    finally:
        for hd in handles:
            hd.remove()
    assert calls == {"transformer": 4, "vae": 0}  # condition latents travel with the trajectory


def test_group_copies_of_a_reference_are_encoded_once(policy):
    calls = []
    handle = policy.vae.encoder.register_forward_hook(lambda *_: calls.append(1))
    try:
        a, b = refs((32, 32), (32, 32), seed=9)
        cond = policy.encode_condition([a, a.clone(), b, a], 32, 32)
    finally:
        handle.remove()
    assert len(calls) == 2 and cond.latents.shape[0] == 4
    assert torch.equal(cond.latents[0], cond.latents[1]) and torch.equal(cond.latents[0], cond.latents[3])


@pytest.mark.parametrize("ref_hw", [(60, 120), (150, 50)])
def test_non_square_reference_keeps_its_aspect_ratio(policy, ref_hw):
    ref = refs(ref_hw, seed=11)[0]
    h, w = policy.target_size(*ref_hw, resolution=64)
    assert h != w and abs((w / h) / (ref_hw[1] / ref_hw[0]) - 1) < 0.2  # rounded to multiples of 16
    cond = policy.encode_condition([ref], h, w)
    assert cond.size == (h, w) and cond.latents.shape[1] == policy.latent_seq_len(h, w)
    assert cond.images[0] is ref  # the rewards get the original
    traj = rollout(policy, cond, h, w, seeds=[0], steps=2)
    assert traj.images.shape == (1, 3, h, w) and traj.x_t.shape[2] == policy.latent_seq_len(h, w)
    assert traj.condition.images[0].shape == (3, *ref_hw)


def test_schedule_uses_the_target_length(policy):
    h, w = 32, 64
    L = policy.latent_seq_len(h, w)
    assert L == (h // 16) * (w // 16)  # target tokens only, not target + condition
    assert torch.equal(policy.sigmas(8, h, w), flux_sigmas(8, L, policy.shift))
    assert not torch.equal(policy.sigmas(8, h, w), flux_sigmas(8, 2 * L, policy.shift))
    cond = policy.encode_condition(refs((32, 64), seed=1), h, w)
    traj = rollout(policy, cond, h, w, seeds=[0], steps=8)
    sig = flux_sigmas(8, L, policy.shift)
    assert torch.equal(traj.sigma[0], sig[[1]]) and torch.equal(traj.sigma_max[0], sig[1])
    # The shifted schedule worked out for Kontext's recipe size: 384x384 (L = 576), 8 steps: sigma_1
    # .9241, sigma_2 .8393.
    s = policy.sigmas(8, 384, 384)
    assert s[1].item() == pytest.approx(0.9241, abs=1e-4) and s[2].item() == pytest.approx(0.8393, abs=1e-4)


def test_lora_export_loads_into_flux_kontext_pipeline(policy, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline
    from PIL import Image

    from paco_ds.models.tiny.flux import tiny_flux_components

    state = lora_state_dict(policy.transformer)
    path = export_lora(state, tmp_path, adapter_config(policy.transformer))
    parts = tiny_flux_components(tiny_cfg().tiny_spec, seed=0)
    pipe = FluxKontextPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**parts.pop("scheduler_config")), **parts)
    pipe.load_lora_weights(path.parent)
    from peft import get_peft_model_state_dict

    (name,) = pipe.get_list_adapters()["transformer"]
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=name)
    assert sorted(loaded) == sorted(state) and all(torch.equal(loaded[k], state[k]) for k in state)
    h, w = 32, 48
    cond = policy.encode_condition(refs((40, 60), seed=4), h, w)
    emb = policy.encode_prompts(PROMPTS[:1])
    x = policy.initial_latents(1, h, w, [make_generator(2)])
    with torch.no_grad():
        ours = policy.velocity(policy.transformer, x, 0.8, emb, h, w, GUIDANCE, condition=cond)
        theirs = policy.velocity(pipe.transformer, x, 0.8, emb, h, w, GUIDANCE, condition=cond)
    assert torch.allclose(ours, theirs, atol=1e-6)  # alpha/r scale restored from the metadata
    image = Image.fromarray(cond.images[0].permute(1, 2, 0).numpy())
    out = pipe(image=image, prompt=PROMPTS[0], height=h, width=w, num_inference_steps=2, guidance_scale=GUIDANCE,
               max_area=h * w, _auto_resize=False, output_type="np").images
    assert out.shape == (1, h, w, 3)


def test_load_refuses_checkpoints_that_are_not_kontext(tmp_path):
    from paco_ds.models.flux_kontext import KONTEXT_PATH, kontext_path

    assert kontext_path(ModelConfig(family="flux_kontext")) == KONTEXT_PATH  # model.path unset
    assert kontext_path(ModelConfig(family="flux_kontext", path=KONTEXT_PATH)) == KONTEXT_PATH
    with pytest.raises(ValueError, match="FLUX.1-Kontext weights"):  # the reference's recipe bug
        kontext_path(ModelConfig(family="flux_kontext", path="black-forest-labs/FLUX.1-dev"))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(ValueError, match="FluxPipeline checkpoint"):
        kontext_path(ModelConfig(family="flux_kontext", path=str(tmp_path)))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxKontextPipeline"}))
    assert kontext_path(ModelConfig(family="flux_kontext", path=str(tmp_path))) == str(tmp_path)


def test_zero3_load_goes_through_the_partitioned_builder(tmp_path, monkeypatch):
    """Under ZeRO-3 the Kontext transformer is built by zero_load.build_partitioned from the
    folder's transformer/ (the 2-rank load itself is tests/models/test_zero3_load.py's, shared code)."""
    from diffusers import FluxTransformer2DModel

    import paco_ds.models.zero_load as zero_load
    from paco_ds.models.flux_kontext import KontextPolicy
    from paco_ds.models.tiny.flux import save_flux_folder

    small = {"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
             "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
             "guidance_embeds": True, "axes_dims_rope": [4, 6, 6]}
    folder = save_flux_folder(tmp_path / "kontext", small, dtype=torch.float32)
    seen = {}

    def fake_build(cls, folder_, ds_config, dtype):
        seen.update(cls=cls, folder=folder_, ds_config=ds_config, dtype=dtype)
        return cls.from_pretrained(folder_, torch_dtype=dtype)

    monkeypatch.setattr(zero_load, "build_partitioned", fake_build)
    ds = {"zero_optimization": {"stage": 3}}
    p = KontextPolicy.load(ModelConfig(family="flux_kontext", path=str(folder), dtype="fp32"), torch.device("cpu"),
                           ds_config=ds)
    assert seen["cls"] is FluxTransformer2DModel and seen["ds_config"] is ds and seen["dtype"] == torch.float32
    assert str(seen["folder"]).endswith("transformer") and p.transformer.config.guidance_embeds
    h = w = 32
    cond = p.encode_condition(refs((32, 32)), h, w)  # AutoencoderKL: the mode of the latent distribution
    x = p.initial_latents(1, h, w, [make_generator(0)])
    with torch.no_grad():
        v = p.velocity(p.transformer, x, 0.5, p.encode_prompts(PROMPTS[:1]), h, w, GUIDANCE, condition=cond)
    assert v.shape == x.shape and torch.isfinite(v).all()
