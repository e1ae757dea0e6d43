"""Cheaper rollouts that train the same thing: ODE-only stretches walked in fewer steps
(sample.ode_steps / sample.ode_solver) and a group's shared prefix under sample.same_latent
(sample.share_prefix), against the plain sampler on the tiny FLUX policy."""
import pytest
import torch
from conftest import REPO, TINY, run_cli

from paco_ds.data import PromptItem
from paco_ds.grpo.losses.base import RolloutNeeds
from paco_ds.grpo.plan import load_config
from paco_ds.sampling.rollouts import Pick, Rollouts
from paco_ds.sampling.trajectory import transition_log_prob
from paco_ds.sampling.solver import Step, multistep_velocity, ode_stretches, step_plan

pytestmark = pytest.mark.fast

SIZE = 64


def cfg_with(*overrides):
    return load_config(TINY, ["sample.num_steps=8", "sample.noise_level=0.7", *overrides])


# ------------------------------------------------------------------------------------ the plan
def test_stretches_come_from_the_recipe():
    assert ode_stretches(cfg_with("sample.noise_steps=[1]")) == [(0, 1), (2, 8)]
    assert ode_stretches(cfg_with("sample.noise_steps=[2, 3]")) == [(0, 2), (4, 8)]
    # an SDE window may lie anywhere in its range: only the steps outside the range are ODE-only
    assert ode_stretches(cfg_with("sample.sde_window={size: 2, range: [1, 5]}")) == [(0, 1), (5, 8)]
    assert ode_stretches(cfg_with("sample.noise_level=0")) == [(0, 8)]  # an ODE rollout (nft, awm)


def test_plan_walks_only_the_ode_stretches_in_fewer_steps():
    assert step_plan(8, [(0, 1), (2, 8)]) == [Step(i, i + 1) for i in range(8)]
    plan = step_plan(8, [(0, 1), (2, 8)], "ab2", ode_steps=3)
    assert [(st.i, st.k) for st in plan] == [(0, 1), (1, 2), (2, 4), (4, 6), (6, 8)]
    assert [st.multistep for st in plan] == [False, False, False, True, True]  # each stretch starts with Euler
    plan = step_plan(10, [(0, 3), (5, 10)], "euler", ode_steps=2)
    assert [(st.i, st.k) for st in plan] == [(0, 1), (1, 3), (3, 4), (4, 5), (5, 7), (7, 10)]
    assert not any(st.multistep for st in plan)
    assert step_plan(8, [(0, 8)], ode_steps=1) == [Step(0, 8)]


def test_ab2_is_exact_where_euler_is_not():
    """For a velocity linear in sigma, two-step Adams-Bashforth integrates exactly (second order)."""
    a, b = torch.tensor([0.3, -1.0]), torch.tensor([2.0, 0.5])
    sig = [1.0, 0.7, 0.45, 0.2, 0.0]
    x_ab2 = x_euler = torch.zeros(2)
    prev = None
    for s, s_next in zip(sig, sig[1:]):
        v, h = a + b * s, s_next - s
        x_ab2 = x_ab2 + h * (multistep_velocity(v, *prev, h) if prev else v)
        x_euler = x_euler + h * v
        prev = (v, h)
    exact = a * (0 - 1) + b * (0 - 1) / 2  # integral of a + b s from 1 to 0
    # The first step is Euler (no history), whose error AB2 carries; the rest add none.
    first_err = (a + b * 1.0) * (0.7 - 1.0) - (a * (0.7 - 1.0) + b * (0.49 - 1.0) / 2)
    torch.testing.assert_close(x_ab2 - exact, first_err, rtol=0, atol=1e-6)
    assert (x_euler - exact).abs().max() > 2 * first_err.abs().max()


# ------------------------------------------------------------------------------------ rollouts
def picks_of(groups: list[int], k: int):
    items = [PromptItem(prompt) for prompt in ("a red fox in snow", "two cups of tea", "a lighthouse at dusk")]
    return [Pick(items[g], g, g * k + j) for g in groups for j in range(k)]


def rollouts(policy, cfg, **kwargs):
    return Rollouts(cfg, policy, needs=RolloutNeeds(log_probs=True), **kwargs)


def test_fewer_ode_steps_keep_every_sde_step_and_its_log_prob(tiny_policy):
    base = cfg_with("sample.noise_steps=[1]", "sample.share_prefix=false")
    fast = cfg_with("sample.noise_steps=[1]", "sample.share_prefix=false", "sample.ode_solver=ab2", "sample.ode_steps=2")
    picks = picks_of([0, 1], 1)
    plain, cheap = rollouts(tiny_policy, base), rollouts(tiny_policy, fast)
    a = plain.sample(tiny_policy.transformer, picks, SIZE, SIZE, epoch=0)
    b = cheap.sample(tiny_policy.transformer, picks, SIZE, SIZE, epoch=0)
    assert (plain.transformer_calls, cheap.transformer_calls) == (2 * 8, 2 * (1 + 1 + 2))
    # the SDE step j=1 follows the one-step head stretch, an Euler step either way: the same x_j
    assert torch.equal(a.x_t, b.x_t) and torch.equal(a.x_next, b.x_next) and torch.equal(a.log_prob, b.log_prob)
    assert not torch.equal(a.images, b.images)  # the tail [2, 8) took 2 steps instead of 6
    # the final latents stay close to the full-step sampler's (a coarse walk of the same ODE)
    err = (a.images.float() - b.images.float()).abs().mean() / 255
    assert err < 0.05, err
    # training recomputes log pi_old from the stored transition exactly, as with the plain sampler
    with torch.no_grad():
        step = transition_log_prob(tiny_policy, tiny_policy.transformer, b, 0, slice(None), spec=cheap.spec(0))
    assert torch.equal(step.log_prob.float(), b.log_prob[:, 0])


def test_a_trained_step_inside_a_shortened_stretch_is_refused(tiny_policy):
    from paco_ds.sampling.spec import RolloutBatch, SamplingSpec
    from paco_ds.sampling.trajectory import sample_trajectories

    cfg = cfg_with("sample.noise_steps=[1]")
    prompts = ["a red fox in snow"]
    spec = SamplingSpec(num_steps=8, guidance=3.5, noise_level=0.7, plan=step_plan(8, [(2, 8)], ode_steps=2))
    batch = RolloutBatch(prompts=prompts, embeds=tiny_policy.encode_prompts(prompts), height=SIZE, width=SIZE,
                         generators=[torch.Generator().manual_seed(0)], noise_steps=[4], train_steps=[4])
    with pytest.raises(ValueError, match="inside an ODE stretch walked in fewer steps"):
        sample_trajectories(tiny_policy, tiny_policy.transformer, spec, batch)
    assert cfg.sample.ode_steps is None  # the recipe's plan never does this: its stretches hold no SDE step


@pytest.mark.parametrize("window", [None, "{size: 2, range: [2, 6], per: group}"])
def test_a_shared_group_prefix_gives_the_same_images_bitwise(tiny_policy, window):
    """One rollout batch per sample (sample.batch_size 1): each sample's prefix is a batch of one
    either way, so sharing it is exact to the bit, with per-group SDE windows too."""
    extra = ["sample.noise_steps=[3]"] if window is None else [f"sample.sde_window={window}"]
    shared_cfg = cfg_with("sample.same_latent=true", *extra)
    plain_cfg = cfg_with("sample.same_latent=true", "sample.share_prefix=false", *extra)
    plain, shared = rollouts(tiny_policy, plain_cfg), rollouts(tiny_policy, shared_cfg, share_prefix=True)
    picks = picks_of([0, 1], 3)
    for epoch in (0, 1):  # the prefixes of one epoch are not those of the next
        for p in picks:
            a = plain.sample(tiny_policy.transformer, [p], SIZE, SIZE, epoch)
            b = shared.sample(tiny_policy.transformer, [p], SIZE, SIZE, epoch)
            assert torch.equal(a.images, b.images) and torch.equal(a.x_t, b.x_t)
            assert torch.equal(a.log_prob, b.log_prob)
    assert shared.transformer_calls < plain.transformer_calls
    if window is None:  # 3 prefix steps once per group (2 groups) instead of once per sample (6), per epoch
        assert plain.transformer_calls - shared.transformer_calls == 2 * 3 * (6 - 2)


def test_a_shared_prefix_in_a_batch_moves_a_sample_no_more_than_its_batch_does(tiny_policy):
    """With several samples per rollout batch, the prefix runs in a smaller batch than the
    sample's own; matrix products on fewer rows may round differently, by no more than moving the
    sample into another batch already does."""
    extra = ("sample.same_latent=true", "sample.noise_steps=[3]")
    plain, shared = rollouts(tiny_policy, cfg_with(*extra, "sample.share_prefix=false")), \
        rollouts(tiny_policy, cfg_with(*extra), share_prefix=True)
    picks = picks_of([0, 1], 2)
    a = plain.sample(tiny_policy.transformer, picks, SIZE, SIZE, 0)
    b = shared.sample(tiny_policy.transformer, picks, SIZE, SIZE, 0)
    alone = torch.cat([plain.sample(tiny_policy.transformer, [p], SIZE, SIZE, 0).x_t for p in picks])
    batch_effect = (a.x_t - alone).abs().max()
    assert (a.x_t - b.x_t).abs().max() <= max(4 * batch_effect, 1e-6)
    assert torch.equal(b.x_t[0], b.x_t[1])  # the group's two samples start their SDE step from one latent
    assert (a.images.float() - b.images.float()).abs().max() <= 1  # uint8 images: at most a rounding flip


def test_the_benchmark_counts_each_switchs_calls(tmp_path):
    """benchmarks/rollout_speedups.py on the tiny model: each variant's transformer calls per image
    and its images (the shared prefix changes none)."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    from rollout_speedups import main

    rows = main(["--quick", "--repeats", "1", "--images", "4", "--group-size", "2", "--size", "32",
                 "--out", str(tmp_path)])["sampling"]["rows"]
    # 10 steps, SDE at 1: the prefix (step 0) once per group of 2; the tail [2, 10) in 3 steps
    assert {k: r["transformer_calls_per_image"] for k, r in rows.items()} == \
        {"plain": 10, "share_prefix": 9.5, "ode_steps=3 ab2": 5, "both": 4.5}
    assert rows["share_prefix"]["image_diff_max"] == 0
    assert (tmp_path / "rollout_speedups_cpu.json").is_file()


def test_the_benchmark_times_rollout_batch_sizes_side_by_side(tmp_path):
    import json
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    from rollout_speedups import main

    rows = main(["--quick", "--repeats", "2", "--images", "4", "--size", "32", "--batches", "1", "2",
                 "--out", str(tmp_path)])["rollout_batches"]["rows"]
    assert set(rows) == {"1", "2"} and rows["1"]["speed_vs_first"] == 1
    assert all(len(r["seconds"]) == 2 for r in rows.values())  # each size timed once per repeat
    report = json.loads((tmp_path / "rollout_batches_cpu.json").read_text())
    assert report["rollout_batches"]["images"] == 4 and report["machine"]["cores"]


def test_the_dry_run_says_how_a_rollout_walks_its_steps():
    from paco_ds.grpo.plan import rollout_line

    assert rollout_line(cfg_with("sample.noise_steps=[0, 1]")) == "8 transformer calls per image of 8 steps"
    line = rollout_line(cfg_with("sample.noise_steps=[1]", "sample.same_latent=true", "sample.ode_solver=ab2",
                                 "sample.ode_steps=2"))
    assert line.startswith("4 transformer calls per image of 8 steps (ODE-only stretches in <= 2 ab2 steps); ")
    assert "sample.share_prefix" in line


@pytest.mark.parametrize("guidance, calls", [(4.0, 8), (1.0, 4)])
def test_the_dry_run_counts_wans_unconditional_call_under_guidance(guidance, calls):
    """Wan makes classifier-free guidance's unconditional velocity a transformer call of its own (as
    WanPipeline does): two calls per step above guidance 1, one at 1."""
    from paco_ds.grpo.plan import rollout_line

    cfg = load_config(REPO / "configs/tiny/wan22_t2v.yaml", ["sample.num_steps=4", f"sample.guidance_scale={guidance}"])
    line = rollout_line(cfg)
    assert line.startswith(f"{calls} transformer calls per image of 4 steps"), line
    assert ("2 per step: classifier-free guidance's unconditional velocity" in line) == (guidance > 1)


@pytest.mark.parametrize("key, value, says", [("sample.ode_steps", "0", "greater than or equal to 1"),
                                              ("sample.ode_solver", "heun", "'euler' or 'ab2'")])
def test_a_bad_switch_is_one_line_naming_the_key(key, value, says):
    from conftest import one_line_error

    line = one_line_error(run_cli("launch/train.py", "--config", str(TINY), "--dry-run", "--set", f"{key}={value}"))
    assert key in line and says in line


def test_the_dry_run_says_share_prefix_is_off_where_the_trainer_turns_it_off():
    args = ["launch/train.py", "--config", str(TINY), "--dry-run", "--set", "sample.share_prefix=true",
            "--set", "sample.noise_steps=[2]"]
    shared = run_cli(*args)
    per_step = run_cli(*args, "--set", "deepspeed.rollout_gather=per_step")
    assert shared.returncode == per_step.returncode == 0, shared.stderr + per_step.stderr
    assert "before its first SDE step once per rank (sample.share_prefix)" in shared.stdout
    assert "sample.share_prefix is off under deepspeed.rollout_gather: per_step (ZeRO-3)" in per_step.stdout
    assert "once per rank" not in per_step.stdout


@pytest.mark.parametrize("batch", [2, 4])
def test_batched_rollouts_agree_with_one_sample_at_a_time(tiny_policy, batch):
    """sample.batch_size only changes how many rows a transformer call holds: each sample's noise is
    its own (seeded by its position), so a batch of `batch` gives every sample the latents and
    log-probs it gets alone, to float rounding (matrix products over more rows may round differently)."""
    cfg = cfg_with("sample.noise_steps=[1, 3]", "sample.share_prefix=false")
    r = rollouts(tiny_policy, cfg)
    picks = picks_of([0, 1], 2)[:batch]
    together = r.sample(tiny_policy.transformer, picks, SIZE, SIZE, epoch=0)
    alone = [r.sample(tiny_policy.transformer, [p], SIZE, SIZE, epoch=0) for p in picks]
    for name in ("x_t", "x_next", "log_prob"):
        torch.testing.assert_close(getattr(together, name), torch.cat([getattr(a, name) for a in alone]),
                                   rtol=1e-4, atol=1e-4, msg=name)
    assert (together.images.float() - torch.cat([a.images for a in alone]).float()).abs().max() <= 1


# ------------------------------------------------------------------------------------ the prompt cache
def test_a_prompt_that_comes_back_is_not_encoded_again_and_samples_the_same(tiny_policy, monkeypatch):
    """Across epochs a prompt's embeddings come from the cache (the text encoders do not run), and the
    epoch samples what it samples with fresh embeddings; with the cache off every batch encodes."""
    cfg = cfg_with("sample.noise_steps=[1]")
    calls = []
    encode = tiny_policy.encode_prompts
    monkeypatch.setattr(tiny_policy, "encode_prompts", lambda prompts, condition=None: (
        calls.append(len(prompts)), encode(prompts, condition))[1])
    cached, fresh = rollouts(tiny_policy, cfg), rollouts(tiny_policy, cfg_with("sample.noise_steps=[1]",
                                                                               "sample.prompt_cache_gib=0"))
    picks = picks_of([0, 1], 2)
    cached.sample(tiny_policy.transformer, picks, SIZE, SIZE, epoch=0)
    assert calls == [1, 1] and len(cached.prompts) == 2  # each prompt once, alone
    again = cached.sample(tiny_policy.transformer, picks, SIZE, SIZE, epoch=1)
    assert calls == [1, 1] and cached.prompts.hits == 2 + 4  # its own group mates, then the whole batch
    calls.clear()
    plain = fresh.sample(tiny_policy.transformer, picks, SIZE, SIZE, epoch=1)
    assert calls == [4]
    assert torch.equal(again.embeds.prompt_embeds, plain.embeds.prompt_embeds)
    assert torch.equal(again.log_prob, plain.log_prob) and torch.equal(again.images, plain.images)


def test_the_prompt_cache_keeps_the_most_recent_prompts_within_its_budget():
    from paco_ds.models.base import TextEmbeds
    from paco_ds.sampling.prompt_cache import PromptCache

    row = lambda r: (TextEmbeds(torch.full((1, 4, 8), float(r))), None)  # noqa: E731 - 128 bytes
    cache = PromptCache(budget_bytes=300)
    for key in "abc":
        cache.encoded([key], lambda rows, k=key: row(ord(k)))
    assert len(cache) == 2 and cache.bytes == 256  # "a", the least recently used, went first
    embeds, _ = cache.encoded(["c", "b"], lambda rows: pytest.fail("both are cached"))
    assert embeds.prompt_embeds[:, 0, 0].tolist() == [ord("c"), ord("b")]
