"""The tiny Qwen-Image policy (text-to-image) against diffusers' own QwenImagePipeline on the same
tiny components: the prompt embeddings, ODE sampling from the same latents and the decoded images;
the exported LoRA loads into the pipeline; the real loading code reads a folder in Qwen/Qwen-Image's
layout (a tokenizer, no processor)."""
import numpy as np
import pytest
import torch

from conftest import load_exported_lora, save_diffusers_layout, with_active_lora
from paco_ds.recipe.schema import LoraConfig, ModelConfig
from paco_ds.models import POLICIES, policy_class, with_family_defaults
from paco_ds.models.qwen_image import QwenImagePolicy
from paco_ds.models.qwen_image_edit import QwenEditPolicy
from paco_ds.models.tiny.qwen_image import tiny_qwen_image_components, tiny_qwen_image_pipeline
from paco_ds.sampling.spec import RolloutBatch, SamplingSpec
from paco_ds.sampling.trajectory import make_generator, sample_trajectories, transition_log_prob

pytestmark = pytest.mark.fast

CPU = torch.device("cpu")
PROMPTS = ["a red cube on a blue sphere", "four panels of the same cat in different seasons, with snow"]
MAX_SEQ = 56  # 40 and 72 tokens after the prefix: the first is padded, the second cut


def _cfg(max_sequence_length=MAX_SEQ):
    return with_family_defaults(ModelConfig(family="qwen_image", tiny=True, dtype="fp32",
                                            lora=LoraConfig(rank=4, alpha=8), max_sequence_length=max_sequence_length))


@pytest.fixture(scope="module")
def policy():
    """The tiny policy with a LoRA whose B matrices are non-zero (so the adapter matters)."""
    return with_active_lora(QwenImagePolicy.load(_cfg(), CPU), _cfg().lora)


@pytest.fixture(scope="module")
def base():
    return QwenImagePolicy.load(_cfg(), CPU)  # no LoRA: the pipeline's own weights


@pytest.fixture(scope="module")
def pipe(base):
    """diffusers' QwenImagePipeline on the same tiny parts (the same seed builds the same weights).
    It drops 34 template tokens, the count with Qwen's tokenizer; the byte-level tiny tokenizer's
    prefix is longer, and the policy counts it from the tokenizer."""
    pipe = tiny_qwen_image_pipeline(seed=0)
    assert pipe.prompt_template_encode == base.prompt_template
    pipe.prompt_template_encode_start_idx = base.template_drop
    return pipe


def test_registered_with_qwen_images_checkpoint_and_the_edit_models_targets():
    assert POLICIES["qwen_image"] == "paco_ds.models.qwen_image:QwenImagePolicy"
    assert policy_class("qwen_image") is QwenImagePolicy
    assert QwenImagePolicy.default_path == "Qwen/Qwen-Image"
    assert QwenImagePolicy.lora_targets == QwenEditPolicy.lora_targets and QwenImagePolicy.attention_dispatch
    cfg = with_family_defaults(ModelConfig(family="qwen_image"))
    assert cfg.path == "Qwen/Qwen-Image" and cfg.lora.target_modules == list(QwenEditPolicy.lora_targets)
    # the same MMDiT as Qwen-Image-Edit: one full-size transformer description
    assert QwenImagePolicy.full_size.transformer is QwenEditPolicy.full_size.transformer


def test_text_only_no_condition(policy):
    from paco_ds.models.base import Condition

    cond = Condition(images=[torch.zeros(3, 64, 64, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="text alone"):
        policy.encode_prompts(PROMPTS[:1], cond)
    with pytest.raises(NotImplementedError, match="text alone"):
        policy.encode_condition(cond.images, 64, 64)
    x = policy.initial_latents(1, 64, 64, [make_generator(0)])
    with pytest.raises(ValueError, match="text alone"):
        policy.velocity(policy.transformer, x, 0.5, policy.encode_prompts(PROMPTS[:1]), 64, 64, 1.0, condition=cond)


def test_prompt_embeddings_are_the_pipelines(base, pipe):
    ours = base.encode_prompts(PROMPTS)
    theirs, mask = pipe.encode_prompt(PROMPTS, device=CPU, max_sequence_length=MAX_SEQ)
    assert ours.prompt_embeds.shape == theirs.shape and ours.prompt_embeds.shape[1] == MAX_SEQ
    torch.testing.assert_close(ours.prompt_embeds, theirs, rtol=0, atol=1e-6)
    assert torch.equal(ours.mask, mask)
    tail = base.tokenizer(PROMPTS[0] + "<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    assert ours.mask.sum(dim=1).tolist() == [len(tail), MAX_SEQ]  # the system prefix dropped; the second cut


@pytest.mark.parametrize("size", [(64, 64), (48, 96)])
def test_ode_sampling_and_decoding_are_the_pipelines(base, pipe, size):
    h, w = size
    x0 = base.initial_latents(2, h, w, [make_generator(3, i) for i in range(2)])
    traj = sample_trajectories(base, base.transformer, SamplingSpec(num_steps=4, guidance=1.0, keep_final=True),
                               RolloutBatch(prompts=PROMPTS, embeds=base.encode_prompts(PROMPTS), height=h, width=w,
                                            initial_latents=x0))
    theirs = pipe(PROMPTS, height=h, width=w, num_inference_steps=4, true_cfg_scale=1.0, latents=x0,
                  max_sequence_length=MAX_SEQ, output_type="latent").images
    torch.testing.assert_close(traj.x_final, theirs, rtol=0, atol=1e-5)
    images = pipe(PROMPTS, height=h, width=w, num_inference_steps=4, true_cfg_scale=1.0, latents=x0,
                  max_sequence_length=MAX_SEQ, output_type="np").images
    ours = base.decode(traj.x_final, h, w)
    assert ours.shape == (2, 3, h, w)
    want = np.round(images * 255).astype(np.int16)
    assert np.abs(ours.permute(0, 2, 3, 1).numpy().astype(np.int16) - want).max() <= 1


def test_training_log_prob_equals_the_sampled_one(policy):
    prompts = PROMPTS
    spec = SamplingSpec(num_steps=4, guidance=1.0, noise_level=0.7)
    traj = sample_trajectories(policy, policy.transformer, spec, RolloutBatch(
        prompts=prompts, embeds=policy.encode_prompts(prompts), height=64, width=64,
        generators=[make_generator(1, i) for i in range(2)], noise_steps=[1, 2], train_steps=[1, 2]))
    assert traj.embeds.mask is not None and traj.condition is None
    with torch.no_grad():
        for t in range(2):
            for i in range(2):
                one = transition_log_prob(policy, policy.transformer, traj, t, [i], spec=spec)
                assert torch.allclose(one.log_prob.float(), traj.log_prob[[i], t], rtol=0, atol=1e-5)


def test_lora_export_loads_into_qwen_image_pipeline(policy, tmp_path):
    pipe = load_exported_lora(policy, tiny_qwen_image_pipeline(seed=0), tmp_path)
    emb = policy.encode_prompts(PROMPTS[:1])
    x = policy.initial_latents(1, 64, 96, [make_generator(13)])
    with torch.no_grad():
        ours = policy.velocity(policy.transformer, x, 0.6, emb, 64, 96, 1.0)
        theirs = policy.velocity(pipe.transformer, x, 0.6, emb, 64, 96, 1.0)
        with policy.adapter_disabled():
            without = policy.velocity(policy.transformer, x, 0.6, emb, 64, 96, 1.0)
    assert torch.allclose(ours, theirs, atol=1e-6) and not torch.allclose(ours, without, atol=1e-4)
    images = pipe(PROMPTS[:1], height=64, width=64, num_inference_steps=2, output_type="np").images
    assert images.shape == (1, 64, 64, 3)


def test_real_loading_code_reads_a_diffusers_layout_folder(tmp_path):
    """`load` from a local folder in Qwen/Qwen-Image's layout (transformer, vae, text_encoder,
    tokenizer, scheduler; here written from the tiny parts) gives the tiny builder's policy."""
    save_diffusers_layout(tiny_qwen_image_components(seed=0), tmp_path, ("transformer", "vae", "text_encoder",
                                                                         "tokenizer"))
    real = QwenImagePolicy.load(_cfg().model_copy(update={"tiny": False, "path": str(tmp_path)}), CPU)
    tiny = QwenImagePolicy.load(_cfg(), CPU)
    assert real.shift == tiny.shift and real.shift_terminal == 0.02 and real.template_drop == tiny.template_drop
    e_real, e_tiny = real.encode_prompts(PROMPTS), tiny.encode_prompts(PROMPTS)
    torch.testing.assert_close(e_real.prompt_embeds, e_tiny.prompt_embeds)
    x = tiny.initial_latents(1, 48, 96, [make_generator(15)])
    with torch.no_grad():
        torch.testing.assert_close(real.velocity(real.transformer, x, 0.5, e_tiny.select([0]), 48, 96, 1.0),
                                   tiny.velocity(tiny.transformer, x, 0.5, e_tiny.select([0]), 48, 96, 1.0))


def test_max_sequence_length_is_capped_as_the_pipelines():
    with pytest.raises(ValueError, match="at most 1024"):
        QwenImagePolicy.load(_cfg(max_sequence_length=2048), CPU)
    # and a recipe asking for more is one line naming the key before anything loads (--dry-run, preflight)
    from conftest import one_line_error, run_cli

    line = one_line_error(run_cli("launch/train.py", "--config", "configs/tiny/qwen_image_t2is.yaml", "--dry-run",
                                  "--set", "model.max_sequence_length=2048"))
    assert "config key 'model.max_sequence_length': at most 1024 for model.family 'qwen_image', got 2048" in line
