"""The tiny Wan policies against diffusers' own WanPipeline on the same tiny components: Wan2.1 (`wan`),
Wan2.2-A14B's two experts (`wan22`) and Wan2.2-TI2V-5B (`wan22_ti2v`). ODE sampling (with and without
guidance) from the same latents and prompts, and the decoded videos; the published UniPC schedule and
the expert chosen at each step; the exported LoRA loads with the pipeline's load_lora_weights; the
real loading code reads a folder in the checkpoints' layout."""
import numpy as np
import pytest
import torch

from conftest import with_active_lora
from paco_ds.models import POLICIES, policy_class, with_family_defaults
from paco_ds.models.tiny.wan import WAN22_BOUNDARY_RATIO, tiny_wan_pipeline
from paco_ds.recipe.schema import LoraConfig, ModelConfig
from paco_ds.sampling.spec import RolloutBatch, SamplingSpec
from paco_ds.sampling.trajectory import make_generator, sample_trajectories


CPU = torch.device("cpu")
PROMPTS = ["a red fox trots through   fresh snow", "two cats play &amp; jump on a sofa"]  # cleaned as the pipeline cleans
FRAMES, STEPS = 9, 4
# family -> the tiny pipeline's options and a video side
FAMILIES = {"wan": ({}, 32), "wan22": ({"experts": 2}, 32), "wan22_ti2v": ({"ti2v": True}, 64)}


def _cfg(family):
    return with_family_defaults(ModelConfig(family=family, tiny=True, dtype="fp32", lora=LoraConfig(rank=4, alpha=8),
                                            max_sequence_length=32, num_frames=FRAMES))


@pytest.fixture(scope="module")
def base():
    return {f: policy_class(f).load(_cfg(f), CPU) for f in FAMILIES}  # no LoRA: the pipeline's own weights


def _euler(policy):
    """The policy and a pipeline stepping the same sigmas with diffusers' Euler scheduler (the
    published UniPC scheduler is a multistep solver, which the SDE rollout does not use)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    shift = policy.scheduler_config["flow_shift"]
    policy.scheduler_config = {"num_train_timesteps": 1000, "shift": shift}
    return FlowMatchEulerDiscreteScheduler(shift=shift)


@pytest.mark.fast
def test_registered_with_the_published_checkpoints_and_wans_targets():
    assert POLICIES["wan"] == "paco_ds.models.wan:WanPolicy"
    assert POLICIES["wan22"] == "paco_ds.models.wan22:Wan22Policy"
    assert POLICIES["wan22_ti2v"] == "paco_ds.models.wan:WanTI2VPolicy"
    paths = {f: with_family_defaults(ModelConfig(family=f)).path for f in FAMILIES}
    assert paths == {"wan": "Wan-AI/Wan2.1-T2V-14B-Diffusers", "wan22": "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
                     "wan22_ti2v": "Wan-AI/Wan2.2-TI2V-5B-Diffusers"}
    cfg = with_family_defaults(ModelConfig(family="wan"))
    assert cfg.lora.target_modules == ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q",
                                       "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2"]
    cls = policy_class("wan")
    assert cls.video and cls.frames(cfg) == 81 and cls.frames(cfg.model_copy(update={"num_frames": 33})) == 33
    assert "4k + 1 frames (e.g. 77 or 81)" in cls.check_num_frames(80)


# The two tests of the three tiny policies (`base`: 18 s to build, 30 s with their calls) are the video
# lane's (make test-video), outside the fast tier's time.
@pytest.mark.video
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_ode_sampling_and_the_decoded_video_are_the_pipelines(base, family, guidance):
    """The same latents and prompts through the policy's ODE rollout and through WanPipeline: the same
    final latents, and the decoded video equals the pipeline's frames (within one uint8 level).
    Guidance 3 runs cond and uncond in two calls, as the pipeline does."""
    options, side = FAMILIES[family]
    policy = base[family]
    saved = policy.scheduler_config
    try:
        scheduler = _euler(policy)
        x0 = policy.initial_latents(2, side, side, [make_generator(3, i) for i in range(2)])
        traj = sample_trajectories(policy, policy.transformer, SamplingSpec(num_steps=STEPS, guidance=guidance,
                                                                             keep_final=True),
                                   RolloutBatch(prompts=PROMPTS, embeds=policy.encode_prompts(PROMPTS), height=side,
                                                width=side, initial_latents=x0))
    finally:
        policy.scheduler_config = saved
    pipe = tiny_wan_pipeline(seed=0, scheduler=scheduler, **options)
    call = dict(height=side, width=side, num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=guidance,
                max_sequence_length=32)
    theirs = pipe(list(PROMPTS), latents=x0.clone(), output_type="latent", **call).frames
    torch.testing.assert_close(traj.x_final, theirs, rtol=0, atol=5e-6)
    video = pipe(list(PROMPTS), latents=x0.clone(), output_type="np", **call).frames  # [B, F, H, W, 3] in [0, 1]
    assert traj.images.shape == (2, FRAMES, 3, side, side) and traj.images.dtype == torch.uint8
    want = np.round(video * 255).astype(np.int16)
    # the decode alone, of the pipeline's own final latents (its de-normalisation and autoencoder), and
    # the rollout's video
    for ours in (policy.decode(theirs, side, side), traj.images):
        assert np.abs(ours.permute(0, 1, 3, 4, 2).numpy().astype(np.int16) - want).max() <= 1


@pytest.mark.video
def test_the_published_unipc_schedule_and_the_expert_of_each_step(base):
    """Wan's checkpoints ship UniPC with flow sigmas (flow_shift 3): the policy's sigmas and the
    transformer's timesteps are the scheduler's (its int64 timesteps); Wan2.2 picks the expert of a
    step from that timestep against boundary_ratio x 1000, as the pipeline does."""
    from diffusers import UniPCMultistepScheduler

    policy = base["wan22"]
    config = {k: v for k, v in policy.scheduler_config.items() if not k.startswith("_")}
    for steps in (4, 10, 40):
        scheduler = UniPCMultistepScheduler(**config)
        scheduler.set_timesteps(steps)
        sigmas = policy.sigmas(steps, 32, 32)
        torch.testing.assert_close(sigmas, scheduler.sigmas, rtol=0, atol=0)
        t = policy.timesteps(sigmas[:-1], steps)
        assert t.tolist() == scheduler.timesteps.float().tolist()
        experts = [policy.expert_of(t[[i]]) for i in range(steps)]
        assert experts == [0 if ts >= WAN22_BOUNDARY_RATIO * 1000 else 1 for ts in scheduler.timesteps.tolist()]
    assert experts[:4] == [0] * 4 and experts[-1] == 1  # 40 steps: the first are the high-noise expert's
    with pytest.raises(ValueError, match="mixes timesteps of both Wan2.2 experts"):
        policy.expert_of(torch.tensor([990.0, 500.0]))


@pytest.mark.fast
def test_lora_export_loads_into_wan_pipeline_and_draws_differently(tmp_path):
    """WanPipeline.load_lora_weights reads the export; for Wan2.2 the low-noise expert's adapter
    (transformer_2/) with load_into_transformer_2=True. The pipeline's video then differs from the
    base pipeline's, and each expert's velocity is the policy's."""
    from paco_ds.models.lora import adapter_config, export_family_lora, lora_state_dict

    for family, (options, side) in FAMILIES.items():
        if family == "wan22_ti2v":
            continue  # WanPolicy's own code: the wan case covers it
        policy = with_active_lora(policy_class(family).load(_cfg(family), CPU), _cfg(family).lora)
        folder = tmp_path / family
        export_family_lora(type(policy), lora_state_dict(policy.transformer), folder, adapter_config(policy.transformer))
        pipe = tiny_wan_pipeline(seed=0, **options)
        plain = pipe(PROMPTS[:1], height=side, width=side, num_frames=5, num_inference_steps=2, output_type="np",
                     max_sequence_length=32, generator=torch.Generator().manual_seed(0)).frames
        pipe.load_lora_weights(folder)
        modules = [pipe.transformer]
        if family == "wan22":
            pipe.load_lora_weights(folder / "transformer_2", load_into_transformer_2=True)
            modules.append(pipe.transformer_2)
        loaded = sum(1 for m in modules for n, _ in m.named_parameters() if "lora_B" in n)
        assert loaded == sum(1 for n, _ in policy.transformer.named_parameters() if "lora_B" in n)
        adapted = pipe(PROMPTS[:1], height=side, width=side, num_frames=5, num_inference_steps=2, output_type="np",
                       max_sequence_length=32, generator=torch.Generator().manual_seed(0)).frames
        assert np.abs(adapted - plain).max() > 1e-3
        emb = policy.encode_prompts(PROMPTS[:1])
        x = policy.initial_latents(1, side, side, [make_generator(13)])
        ours = [policy.transformer.transformer, policy.transformer.transformer_2] if family == "wan22" else \
            [policy.transformer]
        for k, (mine, module) in enumerate(zip(ours, modules)):
            t = torch.tensor([950.0 if k == 0 else 300.0])
            call = dict(hidden_states=x, timestep=t, encoder_hidden_states=policy.text_rows(emb), return_dict=False)
            with torch.no_grad():
                torch.testing.assert_close(mine(**call)[0], module(**call)[0], rtol=0, atol=1e-6)


@pytest.mark.fast
@pytest.mark.parametrize("family", ["wan", "wan22"])
def test_real_loading_code_reads_a_diffusers_layout_folder(tmp_path, family):
    """`load` from a local folder in the checkpoints' layout (model_index.json with Wan2.2's
    boundary_ratio, transformer/ and transformer_2/, vae/, text_encoder/, tokenizer/, scheduler/ with
    UniPC's config; written by the tiny pipeline) gives the tiny builder's policy; a folder of the
    other family is refused, naming the family to use."""
    options = FAMILIES[family][0]
    tiny_wan_pipeline(seed=0, **options).save_pretrained(tmp_path)
    cfg = _cfg(family).model_copy(update={"tiny": False, "path": str(tmp_path)})
    real, tiny = policy_class(family).load(cfg, CPU), policy_class(family).load(_cfg(family), CPU)
    assert real.boundary_ratio == tiny.boundary_ratio and real.scheduler_config["flow_shift"] == 3.0
    torch.testing.assert_close(real.sigmas(10, 32, 32), tiny.sigmas(10, 32, 32))
    e = tiny.encode_prompts(PROMPTS)
    torch.testing.assert_close(real.encode_prompts(PROMPTS).prompt_embeds, e.prompt_embeds)
    x = tiny.initial_latents(1, 32, 32, [make_generator(15)])
    with torch.no_grad():
        for sigma in (0.95, 0.4):  # both experts of Wan2.2
            torch.testing.assert_close(real.velocity(real.transformer, x, sigma, e.select([0]), 32, 32, 1.0),
                                       tiny.velocity(tiny.transformer, x, sigma, e.select([0]), 32, 32, 1.0))
    other = "wan22" if family == "wan" else "wan"
    with pytest.raises(ValueError, match=f"model.family {family}'s"):
        policy_class(other).load(cfg.model_copy(update={"family": other}), CPU)


@pytest.mark.fast
def test_frames_and_sizes_are_checked_before_anything_loads(tmp_path):
    from conftest import REPO, dry_run, one_line_error

    recipe = REPO / "configs/tiny/wan_t2v.yaml"
    line = one_line_error(dry_run(recipe, tmp_path, "model.num_frames=6"))
    assert line.startswith("train: error: config key 'model.num_frames': 6 frames: the Wan2.1 autoencoder "
                           "compresses time 4x after the first frame, so a video has 4k + 1 frames (e.g. 5 or 9)"), line
    line = one_line_error(dry_run(recipe, tmp_path, "train.resolution=[48,40]"))
    assert "config key 'train.resolution': 40 is not a multiple of 16, which the 'wan' model needs" in line, line
    line = one_line_error(dry_run(REPO / "configs/tiny/wan22_t2v.yaml", tmp_path,
                                  "sample.sde_window={size: 1, range: [0, 4], per: group}"))
    assert "config key 'sample.sde_window.per': 'group' draws a window per prompt group" in line, line


@pytest.mark.fast
def test_a_wan22_forward_gives_the_idle_experts_adapter_a_zero_gradient_not_none():
    """ZeRO-3 keeps a parameter's gradient partition from the last accumulation window when the
    parameter gets no gradient at a window's first micro-step: a step of one expert gives the other
    expert's adapter an explicit zero gradient (and the high-noise expert's a real one)."""
    from paco_ds.models.lora import add_lora

    cfg = _cfg("wan22")
    policy = policy_class("wan22").load(cfg, CPU)
    add_lora(policy.transformer, cfg.lora)
    emb = policy.encode_prompts(PROMPTS[:1])
    x = policy.initial_latents(1, 32, 32, [make_generator(7)])
    policy.velocity(policy.transformer, x, 0.99, emb, 32, 32, 1.0).square().mean().backward()
    # lora_B: lora_A's gradient passes through B, which starts at zero
    high = [p.grad for n, p in policy.transformer.named_parameters() if "lora_B" in n and n.startswith("transformer.")]
    low = [p.grad for n, p in policy.transformer.named_parameters() if "lora_" in n and n.startswith("transformer_2.")]
    assert low and all(g is not None and not g.any() for g in low)
    assert any(g is not None and g.any() for g in high)
