"""The tiny Qwen-Image-Edit-2509/2511 policy: several input images per edit, each read by the VL
encoder in the pipeline's numbered prompt and concatenated as VAE tokens after the target's, every
input mattering, exact log-prob recomputation, and the exported LoRA loading into diffusers'
QwenImageEditPlusPipeline."""
import pytest
import torch

from conftest import assert_loaded_lora_matches, load_exported_lora, save_diffusers_layout, with_active_lora
from paco_ds.recipe.schema import LoraConfig, ModelConfig
from paco_ds.models.qwen_image_edit_plus import HUB_IDS, QwenEditPlusPolicy
from paco_ds.sampling.spec import RolloutBatch, SamplingSpec
from paco_ds.sampling.trajectory import gather_samples, make_generator, sample_trajectories, transition_log_prob

pytestmark = pytest.mark.fast

CPU = torch.device("cpu")


def _cfg(**kw):
    return ModelConfig(family="qwen_image_edit_plus", tiny=True, dtype="fp32",
                       lora=LoraConfig(rank=4, alpha=8, target_modules=list(QwenEditPlusPolicy.lora_targets)), **kw)


@pytest.fixture(scope="module")
def policy():
    cfg = _cfg()
    return with_active_lora(QwenEditPlusPolicy.load(cfg, CPU), cfg.lora)


def _ref(h, w, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8)


def _pil(t):
    from PIL import Image

    return Image.fromarray(t.permute(1, 2, 0).numpy())


def test_family_defaults_name_both_checkpoints_and_the_tiny_model_is_2511():
    from paco_ds.models import policy_class

    assert policy_class("qwen_image_edit_plus") is QwenEditPlusPolicy
    assert QwenEditPlusPolicy.default_path == HUB_IDS["2509"] == "Qwen/Qwen-Image-Edit-2509"
    assert HUB_IDS["2511"] == "Qwen/Qwen-Image-Edit-2511" and QwenEditPlusPolicy.max_input_images == 3
    tiny = QwenEditPlusPolicy.tiny_parts(_cfg().tiny_spec)["transformer"]
    assert tiny.config.zero_cond_t  # 2511's conditioning path runs in the CPU tests


def test_vl_prompt_and_image_grid_are_the_pipelines(policy, monkeypatch):
    """The VL encoder gets the text QwenImageEditPlusPipeline builds ("Picture 1: ...Picture 2: ..."
    then the instruction) and each input at the pipeline's final processor size (same grid)."""
    from paco_ds.models.tiny.qwen_image import tiny_qwen_edit_plus_pipeline

    pipe = tiny_qwen_edit_plus_pipeline(seed=0)
    refs = [_ref(64, 96, 1), _ref(90, 60, 2)]
    seen = []
    real = type(pipe.processor).__call__

    def record(self, *args, **kw):
        out = real(self, *args, **kw)
        seen.append((kw["text"], out["image_grid_thw"].tolist(), out["input_ids"].tolist()))
        return out

    monkeypatch.setattr(type(pipe.processor), "__call__", record)
    # the pipeline resizes each input to about 384x384 (calculate_dimensions), then its processor snaps it
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions

    cond_images = []
    for r in refs:
        w, h = calculate_dimensions(CONDITION_IMAGE_SIZE, r.shape[2] / r.shape[1])
        cond_images.append(pipe.image_processor.resize(_pil(r), h, w))
    pipe.encode_prompt(prompt=["swap them"], image=cond_images, device=CPU)
    cond = policy.encode_condition([tuple(refs)], 64, 64)
    policy.encode_prompts(["swap them"], cond)
    assert len(seen) == 2
    (theirs_text, theirs_grid, theirs_ids), (ours_text, ours_grid, ours_ids) = seen
    assert ours_text == theirs_text == [policy.vl_text("swap them", 2)]
    assert "Picture 1: <|vision_start|>" in ours_text[0] and "Picture 2: <|vision_start|>" in ours_text[0]
    assert ours_grid == theirs_grid and ours_ids == theirs_ids  # the same image tokens, in the same places


def test_condition_latents_are_each_inputs_vae_tokens_in_order(policy):
    """[input 1 tokens | input 2 tokens] at their own aspect ratios, as the pipeline's prepare_latents
    concatenates them (here compared with its _encode_vae_image + _pack_latents at the same sizes)."""
    from paco_ds.models.tiny.qwen_image import tiny_qwen_edit_plus_pipeline

    a, b = _ref(48, 80, 3), _ref(64, 64, 4)  # already at their condition sizes: no resampling on either side
    h, w = 64, 64
    cond = policy.encode_condition([(a, b)], h, w)
    assert cond.size == ((48, 80), (64, 64)) and cond.images[0][0] is a  # the originals, kept for the rewards
    assert cond.latents.shape == (1, 3 * 5 + 4 * 4, 16)
    pipe = tiny_qwen_edit_plus_pipeline(seed=0)
    images = [(t.float()[None] / 127.5 - 1).unsqueeze(2) for t in (a, b)]
    _, image_latents = pipe.prepare_latents(images, 1, 4, h, w, torch.float32, CPU, None)
    torch.testing.assert_close(cond.latents, image_latents)


def test_every_input_and_its_order_reach_the_velocity(policy):
    a, b, c = _ref(64, 64, 5), _ref(64, 64, 6), _ref(64, 64, 7)
    h, w = 64, 64
    x = policy.initial_latents(1, h, w, [make_generator(8)])

    def v(inputs):
        cond = policy.encode_condition([inputs], h, w)
        emb = policy.encode_prompts(["put picture 1 into picture 2"], cond)
        with torch.no_grad():
            return policy.velocity(policy.transformer, x, 0.7, emb, h, w, 1.0, condition=cond)

    ab = v((a, b))
    assert ab.shape == x.shape == (1, policy.latent_seq_len(h, w), 16)
    assert not torch.allclose(ab, v((a, c)), atol=1e-5)  # the second input matters
    assert not torch.allclose(ab, v((c, b)), atol=1e-5)  # the first too
    assert not torch.allclose(ab, v((b, a)), atol=1e-5)  # and their order
    one = v(a)  # a single input (a tensor, not a tuple) is a one-image edit
    assert one.shape == x.shape and not torch.allclose(one, ab, atol=1e-5)


def test_training_log_prob_equals_the_sampled_one(policy):
    """Ratio exactly 1 with two inputs per sample, alone or gathered with another rollout's samples."""
    h, w = policy.target_size(80, 80, 64)
    inputs = [(_ref(64, 96, 9), _ref(80, 80, 10)), (_ref(64, 96, 11), _ref(80, 80, 12))]
    prompts = ["put the circle of picture 1 into picture 2", "paint picture 2 like picture 1"]
    cond = policy.encode_condition(inputs, h, w)
    spec = SamplingSpec(num_steps=4, guidance=1.0, noise_level=0.7)
    traj = sample_trajectories(policy, policy.transformer, spec, RolloutBatch(
        prompts=prompts, embeds=policy.encode_prompts(prompts, cond), height=h, width=w, condition=cond,
        generators=[make_generator(2, i) for i in range(2)], noise_steps=[1], train_steps=[1]))
    with torch.no_grad():
        both = transition_log_prob(policy, policy.transformer, traj, 0, slice(None), spec=spec)
        assert torch.equal(both.log_prob.float(), traj.log_prob[:, 0])
        batch = gather_samples([(traj, 1), (traj, 0)])
        again = transition_log_prob(policy, policy.transformer, batch, 0, slice(None), spec=spec)
    assert torch.allclose(again.log_prob.float(), traj.log_prob[[1, 0], 0], rtol=0, atol=1e-5)
    assert batch.condition.images[0] is inputs[1]  # each sample keeps its own inputs


def test_a_batch_mixing_input_sizes_or_too_many_inputs_is_refused(policy):
    with pytest.raises(ValueError, match="sample.batch_size 1"):
        policy.encode_condition([(_ref(64, 64, 0), _ref(40, 80, 1)), (_ref(64, 64, 0), _ref(80, 40, 1))], 64, 64)
    with pytest.raises(ValueError, match="at most 3 input images"):
        policy.encode_condition([tuple(_ref(64, 64, i) for i in range(4))], 64, 64)


def test_lora_export_loads_into_qwen_image_edit_plus_pipeline(policy, tmp_path):
    from paco_ds.models.tiny.qwen_image import tiny_qwen_edit_plus_pipeline

    pipe = load_exported_lora(policy, tiny_qwen_edit_plus_pipeline(seed=0), tmp_path)
    h, w = 64, 96
    cond = policy.encode_condition([(_ref(64, 96, 13), _ref(80, 80, 14))], h, w)
    emb = policy.encode_prompts(["make it red"], cond)
    x = policy.initial_latents(1, h, w, [make_generator(15)])
    assert_loaded_lora_matches(policy, pipe, x, 0.6, emb, h, w, 1.0, condition=cond)


def test_real_loading_code_reads_a_diffusers_layout_folder(tmp_path):
    """`load` from a local folder in Qwen/Qwen-Image-Edit-2511's layout (written from the tiny parts)
    gives the same policy as the tiny builder, zero_cond_t read from the transformer's config."""
    from paco_ds.models.tiny.qwen_image import tiny_qwen_edit_components

    save_diffusers_layout(tiny_qwen_edit_components(seed=0, zero_cond_t=True), tmp_path,
                          ("transformer", "vae", "text_encoder", "processor"))
    real = QwenEditPlusPolicy.load(_cfg().model_copy(update={"tiny": False, "path": str(tmp_path)}), CPU)
    tiny = QwenEditPlusPolicy.load(_cfg(), CPU)
    assert real.transformer.config.zero_cond_t and real.template_drop == tiny.template_drop
    cond = tiny.encode_condition([(_ref(48, 96, 16), _ref(64, 64, 17))], 48, 96)
    e_real, e_tiny = real.encode_prompts(["x"], cond), tiny.encode_prompts(["x"], cond)
    torch.testing.assert_close(e_real.prompt_embeds, e_tiny.prompt_embeds)
    x = tiny.initial_latents(1, 48, 96, [make_generator(18)])
    with torch.no_grad():
        torch.testing.assert_close(real.velocity(real.transformer, x, 0.5, e_tiny, 48, 96, 1.0, condition=cond),
                                   tiny.velocity(tiny.transformer, x, 0.5, e_tiny, 48, 96, 1.0, condition=cond))
