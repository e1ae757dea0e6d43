"""The SD3.5 policy on its tiny offline parts: the schedule, prompt encoding and sampling against
diffusers' StableDiffusion3Pipeline, the SDE step against a transcription of Flow-GRPO's
flow_grpo/diffusers_patch/sd3_sde_with_logprob.py, classifier-free guidance in one batched forward
(and its stop-gradient on the unconditional branch), LoRA export, and the real loading path."""
import math

import pytest
import torch

from kernels.sde_reference import sde_step
from conftest import with_active_lora
from paco_ds.recipe.schema import LoraConfig, ModelConfig
from paco_ds.models import POLICIES, policy_class, with_family_defaults
from paco_ds.models.lora import adapter_config, export_lora, lora_state_dict
from paco_ds.models.sd3 import SD3Policy, sd3_sigmas
from paco_ds.models.tiny.sd3 import SD3_SCHEDULER_CONFIG, save_sd3_folder, tiny_sd3_components
from paco_ds.sampling.spec import RolloutBatch, SamplingSpec
from paco_ds.sampling.trajectory import make_generator, sample_trajectories, transition_log_prob

pytestmark = pytest.mark.fast

CPU = torch.device("cpu")
PROMPTS = ['a sign that says "open"', "a red cube on a blue sphere", "two dogs"]
G = 4.5  # Flow-GRPO's guidance scale for SD3.5


def _cfg(**kw) -> ModelConfig:
    return with_family_defaults(ModelConfig(family="sd3", tiny=True, dtype="fp32", lora=LoraConfig(rank=4, alpha=8),
                                            max_sequence_length=32, **kw))


@pytest.fixture(scope="module")
def policy():
    """A tiny SD3 policy whose LoRA B matrices are non-zero (so the adapter matters)."""
    torch.manual_seed(0)
    return with_active_lora(SD3Policy.load(_cfg(), CPU), _cfg().lora)


@pytest.fixture(scope="module")
def pipe():
    """diffusers' own pipeline on the same tiny parts (the same seed builds the same weights)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    parts = tiny_sd3_components(seed=0)
    for m in parts.values():  # built in training mode: T5's dropout would be on
        if isinstance(m, torch.nn.Module):
            m.eval()
    sched = FlowMatchEulerDiscreteScheduler(**parts.pop("scheduler_config"))
    return StableDiffusion3Pipeline(scheduler=sched, **parts)


# ---------------------------------------------------------------------------------------------- family
def test_registered_with_its_own_checkpoint_and_flow_grpo_targets():
    assert POLICIES["sd3"] == "paco_ds.models.sd3:SD3Policy" and policy_class("sd3") is SD3Policy
    assert SD3Policy.default_path == "stabilityai/stable-diffusion-3.5-medium"
    # scripts/train_sd3.py's target_modules in Flow-GRPO
    assert sorted(SD3Policy.lora_targets) == sorted([
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"])
    assert SD3Policy.size_multiple == 16


def test_lora_targets_the_joint_attention_and_not_the_second_image_attention(policy):
    adapted = {n.split(".lora_")[0] for n, _ in policy.transformer.named_parameters() if "lora_A" in n}
    assert any(".attn.add_q_proj" in n for n in adapted) and any(".attn.to_out.0" in n for n in adapted)
    assert not any(".attn2." in n for n in adapted)
    assert any(".attn2." in n for n, _ in policy.transformer.named_modules())  # SD3.5-M's dual attention exists


# ---------------------------------------------------------------------------------------------- schedule
@pytest.mark.parametrize("steps", [1, 10, 40])
def test_sigmas_are_the_sd3_schedulers(steps):
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER_CONFIG)
    sched.set_timesteps(steps)
    ours = sd3_sigmas(steps, 3.0)
    assert torch.equal(ours, sched.sigmas.float())
    assert torch.equal(ours[:-1] * 1000, sched.timesteps)  # the transformer's timesteps
    assert ours[0].item() == 1.0  # step 0 hits the sigma == 1 guard of the SDE


# ---------------------------------------------------------------------------------------------- SDE
def flow_grpo_sde(sigmas, step_index, model_output, sample, noise_level, prev_sample=None, variance_noise=None,
                  sde_type="sde"):
    """sde_step_with_logprob of Flow-GRPO's flow_grpo/diffusers_patch/sd3_sde_with_logprob.py, written
    out step by step (the scheduler reduced to its sigma table; noise passed in instead of drawn), with
    both of its branches: sde_type "sde" (Flow-GRPO's SDE, paco_ds's "flow_grpo") and "cps"
    (coefficients-preserving sampling, arXiv 2509.05952: a DDIM-like step whose noise keeps the
    coefficients of x0 and x1 those of the next sigma; its log-prob drops every constant)."""
    model_output, sample = model_output.float(), sample.float()
    sigma = sigmas[step_index].view(-1, *([1] * (sample.ndim - 1)))
    sigma_prev = sigmas[[i + 1 for i in step_index]].view(-1, *([1] * (sample.ndim - 1)))
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    if sde_type == "cps":
        std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
        x0_estimate = sample - sigma * model_output
        x1_estimate = sample + (1 - sigma) * model_output
        mean = x0_estimate * (1 - sigma_prev) + x1_estimate * torch.sqrt(sigma_prev ** 2 - std_dev_t ** 2)
        if prev_sample is None:
            prev_sample = mean + std_dev_t * variance_noise
        log_prob = -((prev_sample.detach() - mean) ** 2)
        return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim))), mean, std_dev_t
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    mean = sample * (1 + std_dev_t ** 2 / (2 * sigma) * dt) + model_output * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt
    if prev_sample is None:
        prev_sample = mean + std_dev_t * torch.sqrt(-1 * dt) * variance_noise
    log_prob = (-((prev_sample.detach() - mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                - torch.log(std_dev_t * torch.sqrt(-1 * dt)) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim))), mean, std_dev_t


@pytest.mark.parametrize("ours_type, theirs_type", [("flow_grpo", "sde"), ("cps", "cps")])
@pytest.mark.parametrize("step", [0, 4, 9])  # sigma == 1 (guarded), the middle, the last (to sigma 0)
def test_each_sde_type_is_flow_grpos_sd3_step(step, ours_type, theirs_type):
    sigmas = sd3_sigmas(10, 3.0)
    g = torch.Generator().manual_seed(step)
    x, v, noise = (torch.randn(3, 16, 8, 8, generator=g) for _ in range(3))
    ref_next, ref_lp, ref_mean, ref_std = flow_grpo_sde(sigmas, [step] * 3, v, x, 0.7, variance_noise=noise,
                                                       sde_type=theirs_type)
    ours = sde_step(x, v, sigmas[step].item(), sigmas[step + 1].item(), 0.7, sigmas[1].item(), noise=noise,
                    sde_type=ours_type)
    assert torch.allclose(ours.prev_sample, ref_next, rtol=0, atol=1e-6)
    assert torch.allclose(ours.log_prob, ref_lp, rtol=1e-6, atol=1e-6)
    assert torch.allclose(ours.mean, ref_mean, rtol=0, atol=1e-6)
    assert torch.allclose(ours.std, ref_std.reshape(-1), rtol=1e-6)
    scored = sde_step(x, v, sigmas[step].item(), sigmas[step + 1].item(), 0.7, sigmas[1].item(),
                      prev_sample=ref_next, sde_type=ours_type)  # training: the stored sample scored
    _, ref_scored, _, _ = flow_grpo_sde(sigmas, [step] * 3, v, x, 0.7, prev_sample=ref_next, sde_type=theirs_type)
    assert torch.allclose(scored.log_prob, ref_scored, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(ref_lp).all()
    # a policy's step (another velocity) scores the same stored sample alike: what the ratio reads
    v2 = v + 0.05 * torch.randn(v.shape, generator=g)
    moved = sde_step(x, v2, sigmas[step].item(), sigmas[step + 1].item(), 0.7, sigmas[1].item(),
                     prev_sample=ref_next, sde_type=ours_type)
    _, ref_moved, _, _ = flow_grpo_sde(sigmas, [step] * 3, v2, x, 0.7, prev_sample=ref_next, sde_type=theirs_type)
    assert torch.allclose(moved.log_prob, ref_moved, rtol=1e-5, atol=1e-6) and not torch.equal(moved.log_prob, scored.log_prob)


def test_rollout_log_probs_are_flow_grpos_and_recompute_exactly(policy):
    n = 4
    spec = SamplingSpec(num_steps=n, guidance=G, noise_level=0.7)
    traj = sample_trajectories(policy, policy.transformer, spec, RolloutBatch(
        prompts=PROMPTS[:2], embeds=policy.encode_prompts(PROMPTS[:2]), height=64, width=64,
        generators=[make_generator(0, i) for i in range(2)], noise_steps=list(range(n)), train_steps=list(range(n))))
    sigmas = policy.sigmas(n, 64, 64)
    for t in range(n):
        with torch.no_grad():
            v = policy.velocity(policy.transformer, traj.x_t[:, t], traj.sigma[:, t], traj.embeds, 64, 64, G)
        _, ref, _, _ = flow_grpo_sde(sigmas, [t, t], v, traj.x_t[:, t], 0.7, prev_sample=traj.x_next[:, t])
        assert torch.allclose(traj.log_prob[:, t], ref, rtol=0, atol=1e-5)
        for i in range(2):  # training recomputes it one sample at a time: ratio 1
            step = transition_log_prob(policy, policy.transformer, traj, t, [i], spec=spec)
            assert torch.allclose(step.log_prob, traj.log_prob[[i], t], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------- guidance
def _single(policy, x, sigma, text, pooled):
    return policy.transformer(hidden_states=policy.unpack(x, 64, 64), timestep=torch.full((x.shape[0],), sigma * 1000),
                              encoder_hidden_states=text, pooled_projections=pooled, return_dict=False)[0]


def test_guidance_is_one_batched_forward_of_uncond_and_cond(policy):
    emb = policy.encode_prompts(PROMPTS[:2])
    x = policy.initial_latents(2, 64, 64, [make_generator(1, i) for i in range(2)])
    calls = []
    hook = policy.transformer.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["hidden_states"].shape[0]),
                                                        with_kwargs=True)
    try:
        with torch.no_grad():
            v = policy.velocity(policy.transformer, x, 0.7, emb, 64, 64, G)
    finally:
        hook.remove()
    assert calls == [4]  # one call, the batch doubled
    neg = policy.negative
    with torch.no_grad():
        cond = _single(policy, x, 0.7, emb.prompt_embeds, emb.pooled)
        uncond = _single(policy, x, 0.7, neg.prompt_embeds.expand(2, -1, -1), neg.pooled.expand(2, -1))
    assert torch.allclose(policy.unpack(v, 64, 64), uncond + G * (cond - uncond), atol=1e-5)
    with torch.no_grad():  # guidance 1: the conditional velocity alone, one forward of the batch
        assert torch.allclose(policy.unpack(policy.velocity(policy.transformer, x, 0.7, emb, 64, 64, 1.0), 64, 64),
                              cond, atol=1e-6)


def test_gradient_flows_through_the_conditional_branch_only(policy):
    emb = policy.encode_prompts(PROMPTS[:1])
    x = policy.initial_latents(1, 64, 64, [make_generator(2)])
    params = [p for n, p in policy.transformer.named_parameters() if p.requires_grad]

    def grads(fn):
        policy.transformer.zero_grad(set_to_none=True)
        fn().pow(2).mean().backward()
        return [p.grad.clone() for p in params]

    guided = grads(lambda: policy.velocity(policy.transformer, x, 0.6, emb, 64, 64, G))
    with torch.no_grad():
        neg = policy.negative
        u = _single(policy, x, 0.6, neg.prompt_embeds, neg.pooled)
    by_hand = grads(lambda: policy.pack(u + G * (_single(policy, x, 0.6, emb.prompt_embeds, emb.pooled) - u)))
    policy.transformer.zero_grad(set_to_none=True)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(guided, by_hand))
    assert any(a.abs().sum() > 0 for a in guided)


# ---------------------------------------------------------------------------------------------- diffusers
def test_prompt_embeddings_are_the_pipelines(policy, pipe):
    pe, ne, pp, npool = pipe.encode_prompt(PROMPTS, PROMPTS, PROMPTS, device=CPU, do_classifier_free_guidance=True,
                                           negative_prompt="", max_sequence_length=policy.max_sequence_length)
    ours = policy.encode_prompts(PROMPTS)
    assert ours.prompt_embeds.shape == (3, 77 + policy.max_sequence_length, 64) and ours.pooled.shape == (3, 48)
    assert torch.allclose(ours.prompt_embeds, pe, atol=1e-6) and torch.allclose(ours.pooled, pp, atol=1e-6)
    assert torch.allclose(policy.negative.prompt_embeds, ne[:1], atol=1e-6)
    assert torch.allclose(policy.negative.pooled, npool[:1], atol=1e-6)


def test_ode_sampling_with_guidance_is_the_pipelines(pipe):
    policy = SD3Policy.load(_cfg(), CPU)  # no LoRA: the pipeline's own weights
    x0 = policy.initial_latents(2, 64, 64, [make_generator(3, i) for i in range(2)])
    traj = sample_trajectories(policy, policy.transformer, SamplingSpec(num_steps=3, guidance=G, keep_final=True),
                               RolloutBatch(prompts=PROMPTS[:2], embeds=policy.encode_prompts(PROMPTS[:2]), height=64,
                                            width=64, initial_latents=x0))
    theirs = pipe(PROMPTS[:2], height=64, width=64, num_inference_steps=3, guidance_scale=G, output_type="latent",
                  latents=policy.unpack(x0, 64, 64), max_sequence_length=policy.max_sequence_length).images
    assert torch.allclose(policy.unpack(traj.x_final, 64, 64), theirs, atol=1e-5)


def test_lora_exports_in_the_format_sd3_pipeline_loads(policy, pipe, tmp_path):
    export_lora(lora_state_dict(policy.transformer), tmp_path, adapter_config(policy.transformer))
    pipe.load_lora_weights(tmp_path)
    emb = policy.encode_prompts(["a fox"])
    x = policy.initial_latents(1, 64, 64, [make_generator(4)])
    with torch.no_grad():
        ours = policy.velocity(policy.transformer, x, 0.8, emb, 64, 64, G)
        theirs = policy.velocity(pipe.transformer, x, 0.8, emb, 64, 64, G)
    assert torch.allclose(ours, theirs, atol=1e-6)  # alpha/r restored from the metadata
    images = pipe(["a fox"], height=64, width=64, num_inference_steps=2, output_type="np").images
    assert images.shape == (1, 64, 64, 3)
    pipe.unload_lora_weights()


def test_real_loading_path_reads_a_diffusers_folder(tmp_path):
    folder = save_sd3_folder(tmp_path / "sd3")
    tiny = SD3Policy.load(_cfg(), CPU)
    real = SD3Policy.load(ModelConfig(family="sd3", path=str(folder), dtype="fp32", max_sequence_length=32), CPU)
    emb = real.encode_prompts(PROMPTS[:1])
    assert torch.equal(emb.prompt_embeds, tiny.encode_prompts(PROMPTS[:1]).prompt_embeds)
    x = real.initial_latents(1, 64, 64, [make_generator(5)])
    with torch.no_grad():
        assert torch.equal(real.velocity(real.transformer, x, 0.5, emb, 64, 64, G),
                           tiny.velocity(tiny.transformer, x, 0.5, emb, 64, 64, G))
    img = real.decode(x, 64, 64)
    assert img.shape == (1, 3, 64, 64) and img.dtype == torch.uint8


def test_tiny_tokenizers_are_the_policys_own(policy):
    """A reward scored in another thread (the tiny PickScore) calls the cached CLIP tokenizer with its
    own padding; sharing it, a prompt could come back padded to another length mid-rollout."""
    from paco_ds.models.tiny import clip_tokenizer, t5_tokenizer

    toks = [policy.tokenizer, policy.tokenizer_2, policy.tokenizer_3]
    assert len({id(t) for t in toks}) == 3 and not {id(clip_tokenizer()), id(t5_tokenizer())} & {id(t) for t in toks}
    clip_tokenizer()(["x"], padding="longest")  # another caller's settings do not reach the policy's
    assert policy.encode_prompts(["a b"]).prompt_embeds.shape[1] == 77 + policy.max_sequence_length
