"""The tiny FLUX.2-dev and FLUX.2 [klein] policies against diffusers' own Flux2Pipeline and
Flux2KleinPipeline on the same tiny components: the prompt embeddings (Mistral3's layers 10/20/30 with
the system message; Qwen3's 9/18/27), the schedule (compute_empirical_mu), ODE sampling from the same
latents (dev's guidance embedding; klein with and without its classifier-free guidance) and the
decoded images (the VAE's batch-norm statistics undone); the training log-prob equals the sampled
one; the exported LoRA loads with the pipelines' load_lora_weights and gives the policy's velocity."""
import numpy as np
import pytest
import torch

from conftest import REPO, assert_loaded_lora_matches, load_exported_lora, with_active_lora
from paco_ds.recipe.schema import LoraConfig, ModelConfig
from paco_ds.models import POLICIES, policy_class, with_family_defaults
from paco_ds.models.flux2 import Flux2Policy
from paco_ds.models.flux2_klein import Flux2KleinPolicy
from paco_ds.models.tiny.flux2 import tiny_flux2_klein_pipeline, tiny_flux2_pipeline
from paco_ds.sampling.spec import RolloutBatch, SamplingSpec
from paco_ds.sampling.trajectory import make_generator, sample_trajectories, transition_log_prob

pytestmark = pytest.mark.fast

CPU = torch.device("cpu")
PROMPTS = ["a red cube on a blue sphere", "four panels of the same cat in different seasons, with snow"]
MAX_SEQ = 224  # with the template: dev's first prompt is padded (200 tokens), its second cut; klein's both padded
FAMILIES = ("flux2", "flux2_klein")
PIPELINES = {"flux2": tiny_flux2_pipeline, "flux2_klein": tiny_flux2_klein_pipeline}


def _cfg(family, max_sequence_length=MAX_SEQ):
    return with_family_defaults(ModelConfig(family=family, tiny=True, dtype="fp32", lora=LoraConfig(rank=4, alpha=8),
                                            max_sequence_length=max_sequence_length))


@pytest.fixture(scope="module")
def base():
    """Each family's tiny policy without a LoRA: the pipeline's own weights."""
    return {f: policy_class(f).load(_cfg(f), CPU) for f in FAMILIES}


@pytest.fixture(scope="module")
def policy():
    """Each family's tiny policy with a LoRA whose B matrices are non-zero (so the adapter matters)."""
    return {f: with_active_lora(policy_class(f).load(_cfg(f), CPU), _cfg(f).lora) for f in FAMILIES}


@pytest.fixture(scope="module")
def pipe():
    return {f: PIPELINES[f](seed=0) for f in FAMILIES}  # the same seed builds the same weights


def test_registered_with_their_checkpoints_and_flux2s_targets():
    assert POLICIES["flux2"] == "paco_ds.models.flux2:Flux2Policy"
    assert POLICIES["flux2_klein"] == "paco_ds.models.flux2_klein:Flux2KleinPolicy"
    assert policy_class("flux2") is Flux2Policy and issubclass(Flux2KleinPolicy, Flux2Policy)
    assert with_family_defaults(ModelConfig(family="flux2")).path == "black-forest-labs/FLUX.2-dev"
    cfg = with_family_defaults(ModelConfig(family="flux2_klein"))
    assert cfg.path == "black-forest-labs/FLUX.2-klein-base-9B"  # the one Flux2KleinPipeline's docstring names
    assert cfg.lora.target_modules == list(Flux2Policy.lora_targets)
    assert Flux2Policy.attention_dispatch and not Flux2Policy.text_attention_mask


def test_the_flux2_recipes_resolve_to_their_own():
    from paco_ds.grpo.plan import load_config

    data = ["data.train_file=paco_ds/data/prompts/tiny_t2is_train.jsonl",
            "data.test_file=paco_ds/data/prompts/tiny_t2is_test.jsonl"]
    for family, recipe, steps in (("flux2", "flux2_t2is", 10), ("flux2_klein", "flux2_klein_t2is", 10),
                                  ("flux2", "tiny/flux2_t2is", 6), ("flux2_klein", "tiny/flux2_klein_t2is", 6)):
        cfg = load_config(REPO / "configs" / f"{recipe}.yaml", data)
        assert (cfg.model.family, cfg.model.path) == (family, policy_class(family).default_path)
        assert cfg.model.lora.target_modules == list(Flux2Policy.lora_targets)
        assert cfg.model.max_sequence_length == 512 and cfg.sample.guidance_scale == 4.0
        assert cfg.sample.num_steps == steps and cfg.data.format == "t2is"
        assert "consistency_score" in cfg.rewards.train.terms


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_targets_cover_both_streams_and_the_single_blocks(policy, family):
    adapted = {n.rsplit(".lora_", 1)[0] for n, _ in policy[family].transformer.named_parameters() if ".lora_" in n}
    for target in Flux2Policy.lora_targets:
        part = "single_transformer_blocks." if target == "attn.to_qkv_mlp_proj" else "transformer_blocks."
        assert any(a.startswith(part) and a.endswith(target) for a in adapted), target


def test_text_only_no_condition(base):
    from paco_ds.models.base import Condition

    cond = Condition(images=[torch.zeros(3, 64, 64, dtype=torch.uint8)])
    for pol in base.values():
        with pytest.raises(ValueError, match="text-to-image only"):
            pol.encode_prompts(PROMPTS[:1], cond)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_embeddings_and_ids_are_the_pipelines(base, pipe, family):
    ours = base[family].encode_prompts(PROMPTS)
    with torch.no_grad():
        theirs, text_ids = pipe[family].encode_prompt(list(PROMPTS), device=CPU, max_sequence_length=MAX_SEQ)
    assert ours.prompt_embeds.shape == theirs.shape == (2, MAX_SEQ, 3 * 32)  # three layers side by side
    torch.testing.assert_close(ours.prompt_embeds, theirs, rtol=0, atol=1e-6)
    assert torch.equal(base[family].text_ids(MAX_SEQ), text_ids[0])
    latents = torch.zeros(1, 16, 4, 6)  # 64 x 96 pixels: 4 x 6 patches
    assert torch.equal(base[family].image_ids(64, 96), pipe[family]._prepare_latent_ids(latents)[0])


def test_dev_prompts_carry_the_pipelines_system_message(base):
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    tok = base["flux2"].tokenizer
    ids = base["flux2"]._prompt_inputs(PROMPTS[:1])["input_ids"][0]
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith(f"<s>[SYSTEM_PROMPT]{SYSTEM_MESSAGE}[/SYSTEM_PROMPT][INST]{PROMPTS[0]}[/INST]")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_schedule_is_the_pipelines_empirical_mu(base, pipe, family):
    """linspace(1, 1/N, N) shifted by compute_empirical_mu(tokens, N): it moves with the image size
    and the number of steps."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    second = []
    for n, (h, w) in ((4, (64, 64)), (10, (48, 96)), (20, (512, 512))):
        seq = (h // 16) * (w // 16)
        pipe[family].scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=compute_empirical_mu(seq, n))
        got = base[family].sigmas(n, h, w)
        torch.testing.assert_close(got, pipe[family].scheduler.sigmas, rtol=0, atol=1e-6)
        second.append(round(float(got[1]), 6))
    assert len(set(second)) == 3, second  # the shift moves with the size and the steps


@pytest.mark.parametrize("family, guidance, size", [
    ("flux2", 4.0, (64, 64)), ("flux2", 1.5, (48, 96)),  # the guidance embedding at two scales
    ("flux2_klein", 4.0, (64, 64)), ("flux2_klein", 1.0, (48, 96)),  # CFG (one batched forward), and none
])
def test_ode_sampling_and_decoding_are_the_pipelines(base, pipe, family, guidance, size):
    h, w = size
    pol = base[family]
    gens = [make_generator(3, i) for i in range(2)]
    x0 = pol.initial_latents(2, h, w, gens)
    traj = sample_trajectories(pol, pol.transformer, SamplingSpec(num_steps=4, guidance=guidance, keep_final=True),
                               RolloutBatch(prompts=PROMPTS, embeds=pol.encode_prompts(PROMPTS), height=h, width=w,
                                            initial_latents=x0))
    b, length, c = x0.shape  # the pipeline's latents: the patchified [B, 4C, h/2, w/2] our tokens pack
    call = dict(prompt=list(PROMPTS), height=h, width=w, num_inference_steps=4, guidance_scale=guidance,
                latents=x0.permute(0, 2, 1).reshape(b, c, h // 16, w // 16), max_sequence_length=MAX_SEQ)
    theirs = pipe[family](output_type="latent", **call).images
    if family == "flux2":  # Flux2Pipeline returns the packed, normalised tokens
        torch.testing.assert_close(traj.x_final, theirs, rtol=0, atol=1e-5)
    else:  # Flux2KleinPipeline the unpatchified latents, the normalisation undone
        bn, eps = pol.vae.bn, pol.vae.config.batch_norm_eps
        ours = pol.unpack(traj.x_final * torch.sqrt(bn.running_var + eps) + bn.running_mean, h, w)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    images = pipe[family](output_type="np", **call).images
    ours = pol.decode(traj.x_final, h, w)
    assert ours.shape == (2, 3, h, w)
    want = np.round(images * 255).astype(np.int16)
    assert np.abs(ours.permute(0, 2, 3, 1).numpy().astype(np.int16) - want).max() <= 1


def test_dev_reads_the_guidance_embedding_and_klein_guides_by_cfg(base):
    """dev: the scale changes the one forward's output; klein base: 1 is the conditional velocity
    alone, 4 extrapolates from the empty prompt's; a distilled klein ignores the scale."""
    emb = {f: base[f].encode_prompts(PROMPTS[:1]) for f in FAMILIES}
    x = base["flux2"].initial_latents(1, 64, 64, [make_generator(5)])
    with torch.no_grad():
        v = {(f, g): base[f].velocity(base[f].transformer, x, 0.7, emb[f], 64, 64, g) for f in FAMILIES for g in (1.0, 4.0)}
        klein = base["flux2_klein"]
        neg = klein.velocity(klein.transformer, x, 0.7, klein.negative, 64, 64, 1.0)
    assert not torch.allclose(v["flux2", 1.0], v["flux2", 4.0], atol=1e-4)
    torch.testing.assert_close(v["flux2_klein", 4.0], neg + 4.0 * (v["flux2_klein", 1.0] - neg), rtol=0, atol=1e-5)
    klein.is_distilled = True
    try:
        with torch.no_grad():
            torch.testing.assert_close(klein.velocity(klein.transformer, x, 0.7, emb["flux2_klein"], 64, 64, 4.0),
                                       v["flux2_klein", 1.0])
    finally:
        klein.is_distilled = False


@pytest.mark.parametrize("family, guidance", [("flux2", 4.0), ("flux2_klein", 4.0)])
def test_training_log_prob_equals_the_sampled_one(policy, family, guidance):
    pol = policy[family]
    spec = SamplingSpec(num_steps=4, guidance=guidance, noise_level=0.7)
    traj = sample_trajectories(pol, pol.transformer, spec, RolloutBatch(
        prompts=PROMPTS, embeds=pol.encode_prompts(PROMPTS), height=64, width=64,
        generators=[make_generator(1, i) for i in range(2)], noise_steps=[1, 2], train_steps=[1, 2]))
    with torch.no_grad():
        for t in range(2):
            for i in range(2):
                one = transition_log_prob(pol, pol.transformer, traj, t, [i], spec=spec)
                assert torch.allclose(one.log_prob.float(), traj.log_prob[[i], t], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_export_loads_into_the_pipeline(policy, family, tmp_path):
    """Flux2Pipeline and Flux2KleinPipeline have diffusers' LoRA loader (Flux2LoraLoaderMixin): the
    exported adapter gives their transformer the policy's velocity."""
    pol = policy[family]
    pipe = load_exported_lora(pol, PIPELINES[family](seed=0), tmp_path)
    x = pol.initial_latents(1, 64, 96, [make_generator(13)])
    assert_loaded_lora_matches(pol, pipe, x, 0.6, pol.encode_prompts(PROMPTS[:1]), 64, 96, 4.0)


def test_a_prompt_length_past_the_text_encoder_is_one_line_before_anything_loads():
    from conftest import one_line_error, run_cli

    args = ("launch/train.py", "--config", "configs/tiny/flux2_klein_t2is.yaml", "--dry-run",
            "--set", "model.max_sequence_length=50000")
    line = one_line_error(run_cli(*args, "--set", "model.tiny=false"))  # Qwen3-8B's position table
    assert "config key 'model.max_sequence_length': at most 40960 for model.family 'flux2_klein', got 50000" in line
    line = one_line_error(run_cli(*args))  # the tiny twin's Qwen3 holds 4096 positions
    assert "at most 4096 for the tiny twin of model.family 'flux2_klein'" in line


@pytest.mark.parametrize("family", FAMILIES)
def test_the_gpu_lanes_round_trip_passes_on_the_cpu_in_fp32(family):
    """tests/gpu/family_checks.py (the GPU lane runs it on CUDA in bf16 for every registered family)."""
    from gpu.family_checks import family_round_trip

    out = family_round_trip(family, CPU, "fp32", guidance=4.0)
    ratio = torch.exp(out["recomputed"] - out["sampled"])
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-4), ratio
    grads = [g for g in out["lora_grads"] if g is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("family, distilled", [("flux2", None), ("flux2_klein", True)])
def test_real_loading_code_reads_a_diffusers_layout_folder(tmp_path, family, distilled):
    """`load` from a local folder in the checkpoints' layout (transformer, vae, text_encoder,
    tokenizer with its chat template, scheduler, model_index.json; here written from the tiny parts)
    gives the tiny builder's policy; klein reads `is_distilled` from model_index.json."""
    import json

    from conftest import save_diffusers_layout
    from paco_ds.models.tiny.flux2 import tiny_flux2_components, tiny_flux2_klein_components

    build = tiny_flux2_components if family == "flux2" else tiny_flux2_klein_components
    save_diffusers_layout(build(seed=0), tmp_path, ("transformer", "vae", "text_encoder", "tokenizer"))
    (tmp_path / "model_index.json").write_text(json.dumps({"is_distilled": True}))
    real = policy_class(family).load(_cfg(family).model_copy(update={"tiny": False, "path": str(tmp_path)}), CPU)
    tiny = policy_class(family).load(_cfg(family), CPU)
    assert real.shift == tiny.shift and real.shift.use_dynamic_shifting
    assert getattr(real, "is_distilled", None) is distilled
    e_real, e_tiny = real.encode_prompts(PROMPTS), tiny.encode_prompts(PROMPTS)
    torch.testing.assert_close(e_real.prompt_embeds, e_tiny.prompt_embeds)
    x = tiny.initial_latents(1, 48, 96, [make_generator(15)])
    with torch.no_grad():  # (a distilled klein ignores the scale: the tiny base at 1 is the same forward)
        torch.testing.assert_close(real.velocity(real.transformer, x, 0.5, e_tiny.select([0]), 48, 96, 4.0),
                                   tiny.velocity(tiny.transformer, x, 0.5, e_tiny.select([0]), 48, 96,
                                                 1.0 if distilled else 4.0))
