"""The tiny Z-Image policy against diffusers' own ZImagePipeline on the same tiny components: the
prompt embeddings, ODE sampling (without and with guidance) from the same latents and the decoded
images; the training log-prob equals the sampled one; the exported LoRA loads into the pipeline;
the real loading code reads a folder in Tongyi-MAI/Z-Image-Turbo's layout."""
import numpy as np
import pytest
import torch

from conftest import load_exported_lora, save_diffusers_layout, with_active_lora
from paco_ds.recipe.schema import LoraConfig, ModelConfig
from paco_ds.models import POLICIES, policy_class, with_family_defaults
from paco_ds.models.z_image import ZImagePolicy
from paco_ds.models.tiny.z_image import tiny_z_image_components, tiny_z_image_pipeline
from paco_ds.sampling.spec import RolloutBatch, SamplingSpec
from paco_ds.sampling.trajectory import make_generator, sample_trajectories, transition_log_prob

pytestmark = pytest.mark.fast

CPU = torch.device("cpu")
PROMPTS = ["a red cube on a blue sphere", "four panels of the same cat in different seasons, with snow"]
MAX_SEQ = 64  # the template included: the first prompt is padded, the second cut


def _cfg(max_sequence_length=MAX_SEQ):
    return with_family_defaults(ModelConfig(family="z_image", tiny=True, dtype="fp32",
                                            lora=LoraConfig(rank=4, alpha=8), max_sequence_length=max_sequence_length))


@pytest.fixture(scope="module")
def policy():
    """The tiny policy with a LoRA whose B matrices are non-zero (so the adapter matters)."""
    return with_active_lora(ZImagePolicy.load(_cfg(), CPU), _cfg().lora)


@pytest.fixture(scope="module")
def base():
    return ZImagePolicy.load(_cfg(), CPU)  # no LoRA: the pipeline's own weights


@pytest.fixture(scope="module")
def pipe():
    return tiny_z_image_pipeline(seed=0)  # the same seed builds the same weights


def test_registered_with_z_image_turbos_checkpoint_and_its_own_targets():
    assert POLICIES["z_image"] == "paco_ds.models.z_image:ZImagePolicy"
    assert policy_class("z_image") is ZImagePolicy and ZImagePolicy.attention_dispatch
    cfg = with_family_defaults(ModelConfig(family="z_image"))
    assert cfg.path == "Tongyi-MAI/Z-Image-Turbo"
    assert cfg.lora.target_modules == ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                                       "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]


def test_the_z_image_recipes_resolve_to_z_images_own():
    from conftest import REPO
    from paco_ds.grpo.plan import load_config

    for recipe, steps in (("configs/z_image_t2is.yaml", 8), ("configs/tiny/z_image_t2is.yaml", 6)):
        cfg = load_config(REPO / recipe, ["data.train_file=paco_ds/data/prompts/tiny_t2is_train.jsonl",
                                          "data.test_file=paco_ds/data/prompts/tiny_t2is_test.jsonl"])
        assert (cfg.model.family, cfg.model.path) == ("z_image", "Tongyi-MAI/Z-Image-Turbo")
        assert cfg.model.lora.target_modules == list(ZImagePolicy.lora_targets)
        assert cfg.model.max_sequence_length == 512 and cfg.sample.guidance_scale == 0.0
        assert cfg.sample.num_steps == steps and cfg.data.format == "t2is"
        assert "consistency_score" in cfg.rewards.train.terms


def test_lora_targets_cover_the_refiners_and_the_joint_blocks(policy):
    adapted = {n.rsplit(".lora_", 1)[0] for n, _ in policy.transformer.named_parameters() if ".lora_" in n}
    for part in ("noise_refiner.", "context_refiner.", "layers."):
        for target in ZImagePolicy.lora_targets:
            assert any(a.startswith(part) and a.endswith(target) for a in adapted), (part, target)


def test_text_only_no_condition(policy):
    from paco_ds.models.base import Condition

    cond = Condition(images=[torch.zeros(3, 64, 64, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="text alone"):
        policy.encode_prompts(PROMPTS[:1], cond)
    x = policy.initial_latents(1, 64, 64, [make_generator(0)])
    with pytest.raises(ValueError, match="text alone"):
        policy.velocity(policy.transformer, x, 0.5, policy.encode_prompts(PROMPTS[:1]), 64, 64, 0.0, condition=cond)


def test_prompt_embeddings_are_the_pipelines(base, pipe):
    ours = base.encode_prompts(PROMPTS)
    with torch.no_grad():
        theirs = pipe.encode_prompt(list(PROMPTS), device=CPU, do_classifier_free_guidance=False,
                                    max_sequence_length=MAX_SEQ)[0]  # a list: each prompt's valid tokens
    assert ours.mask.sum(dim=1).tolist() == [t.shape[0] for t in theirs]
    assert theirs[1].shape[0] == MAX_SEQ and theirs[0].shape[0] < MAX_SEQ
    for row, want in zip(ours.prompt_embeds, theirs):
        torch.testing.assert_close(row[:want.shape[0]], want, rtol=0, atol=1e-6)
    # the chat template wraps each prompt: its tokens are the template's and the prompt's
    template = base.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=True)
    assert template == f"<|im_start|>user\n{PROMPTS[0]}<|im_end|>\n<|im_start|>assistant\n"
    assert ours.mask[0].sum() == len(base.tokenizer(template)["input_ids"])


@pytest.mark.parametrize("guidance, size", [(0.0, (64, 64)), (0.0, (48, 96)), (2.0, (64, 64))])
def test_ode_sampling_and_decoding_are_the_pipelines(base, pipe, guidance, size):
    """Z-Image-Turbo's way (guidance 0: one forward per step) and the undistilled model's (guidance >
    0: the empty negative prompt in the same call)."""
    h, w = size
    x0 = base.initial_latents(2, h, w, [make_generator(3, i) for i in range(2)])
    traj = sample_trajectories(base, base.transformer, SamplingSpec(num_steps=4, guidance=guidance, keep_final=True),
                               RolloutBatch(prompts=PROMPTS, embeds=base.encode_prompts(PROMPTS), height=h, width=w,
                                            initial_latents=x0))
    call = dict(height=h, width=w, num_inference_steps=4, guidance_scale=guidance, latents=base.unpack(x0, h, w),
                max_sequence_length=MAX_SEQ)
    # the pipeline writes the chat template into the prompt list it is given: a copy each call
    theirs = pipe(list(PROMPTS), output_type="latent", **call).images
    torch.testing.assert_close(base.unpack(traj.x_final, h, w), theirs, rtol=0, atol=1e-5)
    images = pipe(list(PROMPTS), output_type="np", **call).images
    ours = base.decode(traj.x_final, h, w)
    assert ours.shape == (2, 3, h, w)
    want = np.round(images * 255).astype(np.int16)
    assert np.abs(ours.permute(0, 2, 3, 1).numpy().astype(np.int16) - want).max() <= 1


def test_turbos_schedule_is_the_pipelines(base, pipe):
    """Shift 3 and no resolution shift: the same sigmas at every image size."""
    pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 8, 8).tolist(), mu=0.0)
    for size in ((64, 64), (48, 96)):
        assert torch.allclose(base.sigmas(8, *size), pipe.scheduler.sigmas, rtol=0, atol=1e-6)


@pytest.mark.parametrize("guidance", [0.0, 2.0])
def test_training_log_prob_equals_the_sampled_one(policy, guidance):
    spec = SamplingSpec(num_steps=4, guidance=guidance, noise_level=0.7)
    traj = sample_trajectories(policy, policy.transformer, spec, RolloutBatch(
        prompts=PROMPTS, embeds=policy.encode_prompts(PROMPTS), height=64, width=64,
        generators=[make_generator(1, i) for i in range(2)], noise_steps=[1, 2], train_steps=[1, 2]))
    assert traj.embeds.mask is not None and traj.condition is None
    with torch.no_grad():
        for t in range(2):
            for i in range(2):
                one = transition_log_prob(policy, policy.transformer, traj, t, [i], spec=spec)
                assert torch.allclose(one.log_prob.float(), traj.log_prob[[i], t], rtol=0, atol=1e-5)


def test_lora_export_loads_into_z_image_pipeline(policy, tmp_path):
    """ZImagePipeline has diffusers' LoRA loader (ZImageLoraLoaderMixin): the exported adapter
    gives its transformer the policy's velocities."""
    pipe = load_exported_lora(policy, tiny_z_image_pipeline(seed=0), tmp_path)
    emb = policy.encode_prompts(PROMPTS[:1])
    x = policy.initial_latents(1, 64, 96, [make_generator(13)])
    with torch.no_grad():
        ours = policy.velocity(policy.transformer, x, 0.6, emb, 64, 96, 0.0)
        theirs = policy.velocity(pipe.transformer, x, 0.6, emb, 64, 96, 0.0)
        with policy.adapter_disabled():
            without = policy.velocity(policy.transformer, x, 0.6, emb, 64, 96, 0.0)
    assert torch.allclose(ours, theirs, atol=1e-6) and not torch.allclose(ours, without, atol=1e-4)


def test_real_loading_code_reads_a_diffusers_layout_folder(tmp_path):
    """`load` from a local folder in Tongyi-MAI/Z-Image-Turbo's layout (transformer, vae,
    text_encoder, tokenizer with its chat template, scheduler; here written from the tiny parts)
    gives the tiny builder's policy."""
    save_diffusers_layout(tiny_z_image_components(seed=0), tmp_path, ("transformer", "vae", "text_encoder",
                                                                       "tokenizer"))
    real = ZImagePolicy.load(_cfg().model_copy(update={"tiny": False, "path": str(tmp_path)}), CPU)
    tiny = ZImagePolicy.load(_cfg(), CPU)
    assert real.shift == tiny.shift and not real.shift.use_dynamic_shifting and real.shift.shift == 3.0
    e_real, e_tiny = real.encode_prompts(PROMPTS), tiny.encode_prompts(PROMPTS)
    torch.testing.assert_close(e_real.prompt_embeds, e_tiny.prompt_embeds)
    x = tiny.initial_latents(1, 48, 96, [make_generator(15)])
    with torch.no_grad():
        torch.testing.assert_close(real.velocity(real.transformer, x, 0.5, e_tiny.select([0]), 48, 96, 0.0),
                                   tiny.velocity(tiny.transformer, x, 0.5, e_tiny.select([0]), 48, 96, 0.0))


def test_max_sequence_length_is_bounded_by_the_rope_table():
    with pytest.raises(ValueError, match=r"model.max_sequence_length is at most 1504 for Z-Image"):
        ZImagePolicy.load(_cfg(max_sequence_length=1505), CPU)
