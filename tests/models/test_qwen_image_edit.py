"""The tiny Qwen-Image-Edit policy: the reference is encoded once per sample (VL prompt encoder and
VAE) and reused by every training forward, its aspect ratio is kept, the schedule is Qwen's, and
the exported LoRA loads into diffusers' QwenImageEditPipeline."""
import numpy as np
import pytest
import torch

from conftest import assert_loaded_lora_matches, load_exported_lora, save_diffusers_layout, with_active_lora
from paco_ds.recipe.schema import LoraConfig, ModelConfig
from paco_ds.models.qwen_image_edit import QwenEditPolicy
from paco_ds.sampling.spec import RolloutBatch, SamplingSpec
from paco_ds.sampling.trajectory import gather_samples, make_generator, sample_trajectories, transition_log_prob

pytestmark = pytest.mark.fast

# The recipe's targets: attention and MLP of both streams, in Qwen-Image's names.
QWEN_LORA_TARGETS = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                     "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2",
                     "txt_mlp.net.0.proj", "txt_mlp.net.2"]
CPU = torch.device("cpu")


def _cfg(**kw):
    return ModelConfig(family="qwen_image_edit", tiny=True, dtype="fp32",
                       lora=LoraConfig(rank=4, alpha=8, target_modules=QWEN_LORA_TARGETS), **kw)


@pytest.fixture(scope="module")
def policy():
    """The tiny policy with a LoRA whose B matrices are non-zero (so the adapter matters)."""
    cfg = _cfg()
    return with_active_lora(QwenEditPolicy.load(cfg, CPU), cfg.lora)


def _ref(h, w, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8)


class _Counter:
    """Counts forward calls (and rows) of a module through a hook."""

    def __init__(self, module):
        self.calls, self.rows = 0, 0
        self.handle = module.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        x = args[0] if args else next(iter(kwargs.values()))
        self.calls += 1
        self.rows += x.shape[0]

    def close(self):
        self.handle.remove()


def test_lora_targets_exist_in_the_qwen_transformer(policy):
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in policy.transformer.named_parameters() if ".lora_A" in n}
    for t in QWEN_LORA_TARGETS:
        assert any(n.endswith(t) for n in wrapped), t
    trainable = [n for n, p in policy.transformer.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_vl_encoder_runs_once_per_sample_at_rollout_and_never_in_training(policy):
    refs = [_ref(40, 80, 0), _ref(50, 100, 1), _ref(40, 80, 0)]
    prompts = ["make the circle blue", "turn it upside down", "make the circle blue"]
    h, w = policy.target_size(40, 80, 64)
    vl, tr, vae = _Counter(policy.text_encoder), _Counter(policy.transformer), _Counter(policy.vae.encoder)
    try:
        cond = policy.encode_condition(refs, h, w)
        embeds = policy.encode_prompts(prompts, cond)
        spec = SamplingSpec(num_steps=4, guidance=4.0, noise_level=1.0)
        traj = sample_trajectories(policy, policy.transformer, spec, RolloutBatch(
            prompts=prompts, embeds=embeds, height=h, width=w, condition=cond,
            generators=[make_generator(0, i) for i in range(3)], noise_steps=[1, 2], train_steps=[1, 2]))
        assert (vl.calls, vl.rows) == (1, 3)  # one batched forward: each sample encoded once
        assert vae.rows == 3 and tr.calls == 4
        vl_before, vae_before, tr_before = vl.rows, vae.rows, tr.calls
        with torch.no_grad():
            for t in range(2):
                for i in range(3):
                    transition_log_prob(policy, policy.transformer, traj, t, [i], spec=spec)
        assert vl.rows == vl_before and vae.rows == vae_before  # training re-encodes nothing
        assert tr.calls - tr_before == 6  # one transformer forward per trained step and sample
    finally:
        for c in (vl, tr, vae):
            c.close()
    assert traj.embeds.mask is not None and traj.condition.latents.shape[0] == 3


def test_prompt_embeds_drop_the_template_prefix_and_read_the_image(policy):
    h, w = 48, 96
    a = policy.encode_condition([_ref(48, 96, 3)], h, w)
    b = policy.encode_condition([_ref(48, 96, 4)], h, w)
    ea, eb = policy.encode_prompts(["x"], a), policy.encode_prompts(["x"], b)
    vh, vw = policy.vl_size(h, w)
    assert (vh % 28, vw % 28) == (0, 0) and (vh, vw) == (56, 84)
    image_tokens = (vh // 28) * (vw // 28)
    tok = policy.processor.tokenizer
    tail = tok("x<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    # <|vision_start|>, the image tokens, <|vision_end|>, then the instruction and the assistant turn
    assert ea.prompt_embeds.shape[1] == 1 + image_tokens + 1 + len(tail) and bool(ea.mask.all())
    assert not torch.allclose(ea.prompt_embeds, eb.prompt_embeds)  # the image reaches the embeddings


def test_velocity_returns_target_tokens_and_depends_on_the_condition(policy):
    h, w = 64, 64
    refs = [_ref(64, 64, 5), _ref(64, 64, 6)]
    c1, c2 = policy.encode_condition(refs[:1], h, w), policy.encode_condition(refs[1:], h, w)
    emb = policy.encode_prompts(["make it red"], c1)
    x = policy.initial_latents(1, h, w, [make_generator(7)])
    with torch.no_grad():
        v1 = policy.velocity(policy.transformer, x, 0.8, emb, h, w, 1.0, condition=c1)
        v2 = policy.velocity(policy.transformer, x, 0.8, emb, h, w, 1.0, condition=c2)
    assert v1.shape == x.shape == (1, policy.latent_seq_len(h, w), 16)
    assert not torch.allclose(v1, v2, atol=1e-4)
    with pytest.raises(ValueError, match="Condition"):
        policy.velocity(policy.transformer, x, 0.8, emb, h, w, 1.0)


def test_training_log_prob_equals_the_sampled_one(policy):
    """Ratio exactly 1: the recomputation sees the rollout's own embeddings and condition latents,
    alone or gathered with samples of another rollout batch (other prompt lengths: padded)."""
    h, w = policy.target_size(60, 90, 64)
    prompts = ["make the circle blue", "add a hat"]
    cond = policy.encode_condition([_ref(60, 90, 8), _ref(60, 90, 9)], h, w)
    spec = SamplingSpec(num_steps=4, guidance=1.0, noise_level=0.7)
    traj = sample_trajectories(policy, policy.transformer, spec, RolloutBatch(
        prompts=prompts, embeds=policy.encode_prompts(prompts, cond), height=h, width=w, condition=cond,
        generators=[make_generator(1, i) for i in range(2)], noise_steps=[1], train_steps=[1]))
    with torch.no_grad():
        both = transition_log_prob(policy, policy.transformer, traj, 0, slice(None), spec=spec)
        assert torch.equal(both.log_prob.float(), traj.log_prob[:, 0])
        assert torch.equal(torch.exp(both.log_prob.float() - traj.log_prob[:, 0]), torch.ones(2))
        for i in range(2):  # batch size 1, as training runs by default
            one = transition_log_prob(policy, policy.transformer, traj, 0, [i], spec=spec)
            assert torch.allclose(one.log_prob.float(), traj.log_prob[[i], 0], rtol=0, atol=1e-5)
        batch = gather_samples([(traj, 1), (traj, 0)])
        again = transition_log_prob(policy, policy.transformer, batch, 0, slice(None), spec=spec)
    assert torch.allclose(again.log_prob.float(), traj.log_prob[[1, 0], 0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("target", ["derived", "square"])
def test_a_non_square_reference_keeps_its_aspect_ratio(policy, target):
    ref = _ref(40, 80, 10)
    h, w = policy.target_size(40, 80, 64) if target == "derived" else (64, 64)
    cond = policy.encode_condition([ref], h, w)
    ch, cw = cond.size
    assert (ch, cw) == ((48, 96) if target == "derived" else policy.target_size(40, 80, 64))
    assert cw / ch == pytest.approx(2.0)  # not squashed to the (square) target
    assert cond.latents.shape == (1, (ch // 16) * (cw // 16), 16)
    assert cond.images[0] is ref  # the original is kept for the rewards
    assert policy.vl_size(ch, cw) == (56, 84)
    # A square target with the non-square condition: img_shapes list both, the output is the target's.
    emb = policy.encode_prompts(["make it wide"], cond)
    x = policy.initial_latents(1, h, w, [make_generator(11)])
    with torch.no_grad():
        v = policy.velocity(policy.transformer, x, 0.5, emb, h, w, 1.0, condition=cond)
    assert v.shape == x.shape
    assert policy.decode(x, h, w).shape == (1, 3, h, w)


def test_batch_mixing_condition_sizes_is_refused(policy):
    with pytest.raises(ValueError, match="sample.batch_size 1"):
        policy.encode_condition([_ref(40, 80, 0), _ref(80, 40, 1)], 64, 64)


def test_sigmas_are_qwen_schedulers(policy):
    """The same sigmas as FlowMatchEulerDiscreteScheduler.set_timesteps with Qwen's config (dynamic
    exponential shift, stretched to a last sigma of 0.02), mu from the target's tokens."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from paco_ds.models.tiny.qwen_image import QWEN_IMAGE_SCHEDULER_CONFIG
    from paco_ds.models.schedule import calculate_mu

    sched = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG)
    for steps, (h, w) in [(10, (384, 384)), (8, (512, 768)), (20, (64, 96))]:
        mu = calculate_mu(policy.latent_seq_len(h, w), policy.shift)
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        ours = policy.sigmas(steps, h, w)
        assert ours.dtype == torch.float32 and ours.shape == (steps + 1,)
        torch.testing.assert_close(ours, sched.sigmas.float(), rtol=0, atol=1e-6)
        assert ours[-2].item() == pytest.approx(0.02) and ours[0].item() == 1.0
    # at 384^2 (576 tokens) with 10 steps, the reference's editing setting
    assert policy.sigmas(10, 384, 384)[1].item() == pytest.approx(0.9277, abs=1e-4)


def test_lora_export_loads_into_qwen_image_edit_pipeline(policy, tmp_path):
    from paco_ds.models.tiny.qwen_image import tiny_qwen_edit_pipeline

    pipe = load_exported_lora(policy, tiny_qwen_edit_pipeline(seed=0), tmp_path)
    h, w = 64, 96
    cond = policy.encode_condition([_ref(64, 96, 12)], h, w)
    emb = policy.encode_prompts(["make it red"], cond)
    x = policy.initial_latents(1, h, w, [make_generator(13)])
    assert_loaded_lora_matches(policy, pipe, x, 0.6, emb, h, w, 1.0, condition=cond)


def test_real_loading_code_reads_a_diffusers_layout_folder(tmp_path):
    """`load` from a local folder in Qwen/Qwen-Image-Edit's layout (here written from the tiny parts)
    gives the same policy as the tiny builder."""
    from paco_ds.models.tiny.qwen_image import tiny_qwen_edit_components

    save_diffusers_layout(tiny_qwen_edit_components(seed=0), tmp_path, ("transformer", "vae", "text_encoder",
                                                                        "processor"))
    real = QwenEditPolicy.load(_cfg().model_copy(update={"tiny": False, "path": str(tmp_path)}), CPU)
    tiny = QwenEditPolicy.load(_cfg(), CPU)
    assert real.shift == tiny.shift and real.shift_terminal == 0.02 and real.template_drop == tiny.template_drop
    cond = tiny.encode_condition([_ref(48, 96, 14)], 48, 96)
    e_real, e_tiny = real.encode_prompts(["x"], cond), tiny.encode_prompts(["x"], cond)
    torch.testing.assert_close(e_real.prompt_embeds, e_tiny.prompt_embeds)
    torch.testing.assert_close(real.encode_condition([_ref(48, 96, 14)], 48, 96).latents, cond.latents)
    x = tiny.initial_latents(1, 48, 96, [make_generator(15)])
    with torch.no_grad():
        torch.testing.assert_close(real.velocity(real.transformer, x, 0.5, e_tiny, 48, 96, 1.0, condition=cond),
                                   tiny.velocity(tiny.transformer, x, 0.5, e_tiny, 48, 96, 1.0, condition=cond))
