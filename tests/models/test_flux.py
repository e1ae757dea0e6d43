"""The tiny FLUX policy: rollout, log-prob recomputation, LoRA export, and a T2IS batch end to end."""
import numpy as np
import pytest
import torch

from paco_ds.data import load_t2is_jsonl
from paco_ds.images import grid_shape, split_panels, to_pil
from paco_ds.models.lora import adapter_config, export_lora, lora_state_dict
from paco_ds.sampling.spec import RolloutBatch, SamplingSpec
from paco_ds.sampling.trajectory import make_generator, sample_trajectories, transition_log_prob
from conftest import REPO

pytestmark = pytest.mark.fast

PROMPTS = REPO / "paco_ds" / "data" / "prompts" / "tiny_t2is_train.jsonl"


SPEC = SamplingSpec(num_steps=6, guidance=3.5, noise_level=0.7)


def _rollout(policy, prompts, seeds, noise_steps=(1,), train_steps=(1,), size=64, steps=6):
    batch = RolloutBatch(prompts=prompts, embeds=policy.encode_prompts(prompts), height=size, width=size,
                         generators=[make_generator(0, 0, s) for s in seeds], noise_steps=list(noise_steps),
                         train_steps=list(train_steps))
    spec = SamplingSpec(num_steps=steps, guidance=SPEC.guidance, noise_level=SPEC.noise_level)
    return sample_trajectories(policy, policy.transformer, spec, batch)


def test_rollout_keeps_only_what_training_needs(tiny_policy):
    prompts = [it.prompt for it in load_t2is_jsonl(PROMPTS)[:2]]
    traj = _rollout(tiny_policy, prompts, [0, 1], noise_steps=[1, 2], train_steps=[1, 2])
    L = tiny_policy.latent_seq_len(64, 64)
    assert traj.images.shape == (2, 3, 64, 64) and traj.images.dtype == torch.uint8
    assert traj.x_t.shape == traj.x_next.shape == (2, 2, L, 16)
    assert traj.log_prob.shape == (2, 2) and torch.isfinite(traj.log_prob).all()
    assert torch.equal(traj.x_next[:, 0], traj.x_t[:, 1])  # step 1's output is step 2's input
    sig = tiny_policy.sigmas(6, 64, 64)
    assert torch.equal(traj.sigma[0], sig[[1, 2]]) and torch.equal(traj.sigma_next[0], sig[[2, 3]])
    assert traj.embeds.prompt_embeds.shape[0] == 2


def test_recomputed_log_prob_equals_the_sampled_one(tiny_policy):
    prompts = [it.prompt for it in load_t2is_jsonl(PROMPTS)[:3]]
    traj = _rollout(tiny_policy, prompts, [3, 4, 5])
    for i in range(3):  # one sample at a time, as training does with batch size 1
        step = transition_log_prob(tiny_policy, tiny_policy.transformer, traj, 0, [i], spec=SPEC)
        assert torch.allclose(step.log_prob, traj.log_prob[[i], 0], rtol=0, atol=1e-5)
        assert torch.exp(step.log_prob - traj.log_prob[[i], 0]).item() == pytest.approx(1.0, abs=1e-5)


def test_rollout_is_deterministic_per_sample_seed(tiny_policy):
    p = [load_t2is_jsonl(PROMPTS)[0].prompt] * 2
    a = _rollout(tiny_policy, p, [10, 11])
    b = _rollout(tiny_policy, p[:1], [11])  # same seed, different batch: the same sample
    assert torch.allclose(a.x_next[1], b.x_next[0], atol=1e-5)
    assert not torch.allclose(a.x_next[0], a.x_next[1])


def test_ode_rollout_at_eval_resolution(tiny_policy):
    p = [load_t2is_jsonl(PROMPTS)[0].prompt]
    traj = _rollout(tiny_policy, p, [0], noise_steps=[], train_steps=[], size=128, steps=3)
    assert traj.images.shape == (1, 3, 128, 128) and traj.x_t is None and traj.log_prob is None


def test_adapter_disabled_is_the_base_model(tiny_policy):
    p = tiny_policy
    emb = p.encode_prompts(["a fox"])
    x = p.initial_latents(1, 64, 64, [make_generator(1)])
    with torch.no_grad():
        with_lora = p.velocity(p.transformer, x, 0.9, emb, 64, 64, 3.5)
        with p.adapter_disabled():
            base = p.velocity(p.transformer, x, 0.9, emb, 64, 64, 3.5)
        again = p.velocity(p.transformer, x, 0.9, emb, 64, 64, 3.5)
    assert not torch.allclose(with_lora, base) and torch.equal(with_lora, again)


def test_lora_exports_in_the_format_flux_pipeline_loads(tiny_policy, tiny_cfg, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    from paco_ds.models.tiny.flux import tiny_flux_components

    path = export_lora(lora_state_dict(tiny_policy.transformer), tmp_path, adapter_config(tiny_policy.transformer))
    assert path.name == "pytorch_lora_weights.safetensors"
    parts = tiny_flux_components(tiny_cfg.model.tiny_spec, seed=0)
    sched = FlowMatchEulerDiscreteScheduler(**parts.pop("scheduler_config"))
    pipe = FluxPipeline(scheduler=sched, **parts)
    pipe.load_lora_weights(tmp_path)
    emb = tiny_policy.encode_prompts(["a fox"])
    x = tiny_policy.initial_latents(1, 64, 64, [make_generator(2)])
    with torch.no_grad():
        ours = tiny_policy.velocity(tiny_policy.transformer, x, 0.8, emb, 64, 64, 3.5)
        theirs = tiny_policy.velocity(pipe.transformer, x, 0.8, emb, 64, 64, 3.5)
    assert torch.allclose(ours, theirs, atol=1e-6)  # alpha/r scale restored from the metadata
    images = pipe(["a fox"], height=64, width=64, num_inference_steps=2, output_type="np").images
    assert images.shape == (1, 64, 64, 3)


def test_tiny_t2is_batch_gives_images_panels_rewards_and_advantages(tiny_policy, tiny_cfg, tmp_path):
    from paco_ds.grpo.advantages import StatTracker
    from paco_ds.rewards.registry import build_reward
    from paco_ds.serving.manager import endpoints_for_run, started_for_run

    items = load_t2is_jsonl(PROMPTS)[:2]
    k = 3
    prompts = [it.prompt for it in items for _ in range(k)]
    groups = np.repeat([0, 1], k)
    traj = _rollout(tiny_policy, prompts, range(len(prompts)))
    images = to_pil(traj.images)
    rows, cols = grid_shape(prompts[0], items[0].metadata)
    assert [p.size for p in split_panels(images[0], rows, cols)] == [(32, 32)] * 4
    rewards = {}
    with started_for_run(tiny_cfg.reward_servers, tmp_path, local_rank=0):  # the recipe's consistency judge
        endpoints = endpoints_for_run(tiny_cfg.reward_servers, tmp_path)
        for name, term in tiny_cfg.rewards.train.terms.items():
            reward = build_reward(name, term.kwargs, device="cpu", reward_endpoints=endpoints)
            res = reward(images, prompts, [it.metadata for it in items for _ in range(k)])
            reward.close()
            assert res.valid.all() and np.isfinite(res.scores).all()
            rewards[name] = res.scores
    weights = {n: t.weight for n, t in tiny_cfg.rewards.train.terms.items()}
    out = StatTracker(tiny_cfg.advantage, tiny_cfg.rewards.train.aggregation, weights).compute(rewards, groups)
    assert out.advantages.shape == (6,) and out.keep.all()
    for g in (0, 1):  # centred within each group
        assert abs(out.advantages[groups == g].sum()) < 1e-9
    assert np.abs(out.advantages).max() > 0


def test_lora_path_starts_training_from_an_exported_adapter(tiny_policy, tiny_cfg, tmp_path):
    from paco_ds.models.flux import FluxPolicy
    from paco_ds.models.lora import add_lora

    export_lora(lora_state_dict(tiny_policy.transformer), tmp_path, adapter_config(tiny_policy.transformer))
    fresh = FluxPolicy.load(tiny_cfg.model, torch.device("cpu"))
    add_lora(fresh.transformer, tiny_cfg.model.lora.model_copy(update={"path": str(tmp_path)}))
    trainable = [n for n, p in fresh.transformer.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    emb = tiny_policy.encode_prompts(["a fox"])
    x = tiny_policy.initial_latents(1, 64, 64, [make_generator(3)])
    with torch.no_grad():
        want = tiny_policy.velocity(tiny_policy.transformer, x, 0.7, emb, 64, 64, 3.5)
        got = fresh.velocity(fresh.transformer, x, 0.7, emb, 64, 64, 3.5)
    assert torch.allclose(got, want, atol=1e-6)
