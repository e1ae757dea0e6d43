"""Typed recipes: the paper's values, extends/--set, derived values, and one-line errors."""
import math

import pytest

from conftest import REPO, TINY, one_line_error as _one_line_error, run_cli
from paco_ds.recipe.schema import Config
from paco_ds.errors import ConfigError
from paco_ds.grpo.plan import derive, load_config

pytestmark = pytest.mark.fast


def test_flux_t2is_recipe_has_the_paper_values():
    c = load_config(REPO / "configs" / "flux_t2is.yaml")
    assert c.model.path == "black-forest-labs/FLUX.1-dev" and not c.model.tiny
    assert (c.model.lora.rank, c.model.lora.alpha) == (64, 128)
    assert (c.train.resolution, c.test.resolution) == (512, 1024)
    assert (c.sample.group_size, c.sample.prompts_per_epoch) == (16, 42)
    assert c.sample.noise_steps == [1] and c.sample.noise_level == 0.7 and c.sample.num_steps == 10
    assert c.train.ppo.clip_range == 1e-4 and c.train.kl_beta == 0 and c.train.learning_rate == 3e-4
    weights = {k: v.weight for k, v in c.rewards.train.terms.items()}
    assert weights == {"consistency_score": 0.2, "subfig_clipT": 1.0, "pickscore": 1.0}
    assert c.train_timesteps == [1]
    assert c.rewards.eval is c.rewards.train  # no test set given: the train rewards


def test_tiny_recipe_extends_the_real_one(tiny_cfg):
    assert tiny_cfg.model.tiny and tiny_cfg.model.path == "black-forest-labs/FLUX.1-dev"  # inherited
    assert tiny_cfg.sample.guidance_scale == 3.5  # inherited
    assert tiny_cfg.sample.noise_steps == list(range(6)) and tiny_cfg.train_timesteps == list(range(6))
    assert tiny_cfg.train.resolution == 64 and tiny_cfg.test.resolution == 128
    # `_replace: true` replaced the set: the real recipe's consistency term (with its base_url) is not merged in
    assert "base_url" not in tiny_cfg.rewards.train.terms["consistency_score"].kwargs
    assert tiny_cfg.rewards.test is not None and set(tiny_cfg.rewards.test.terms) != set(tiny_cfg.rewards.train.terms)
    assert tiny_cfg.rewards.train.terms["subfig_clipT"].kwargs == {"tiny": True}


def test_set_overrides_parse_yaml_values():
    c = load_config(TINY, ["train.learning_rate=2e-5", "sample.noise_steps=[2, 1]", "model.lora.rank=4",
                           "advantage.global_std=false", "rewards.train.aggregation.threshold=0.5"])
    assert c.train.learning_rate == 2e-5 and c.sample.noise_steps == [1, 2]
    assert c.model.lora.rank == 4 and c.advantage.global_std is False
    assert c.rewards.train.aggregation.threshold == 0.5


@pytest.mark.parametrize("world, m, ga", [(1, 42, 336), (2, 42, 168), (3, 42, 112), (7, 42, 48), (8, 42, 42)])
def test_derived_values_match_the_reference_arithmetic(world, m, ga):
    c = load_config(REPO / "configs" / "flux_t2is.yaml")
    plan = derive(c, world)
    assert plan.prompts_per_epoch == m and plan.samples_per_epoch == m * 16
    assert plan.grad_accum_steps == ga and plan.optimizer_steps_per_epoch == 2
    # Two optimizer steps per epoch: GA x 2 micro-steps cover every sample once.
    assert plan.grad_accum_steps * 2 == plan.micro_steps_per_rank == plan.samples_per_rank


def test_prompts_per_epoch_rounds_up_to_fit_the_world_size():
    c = load_config(TINY, ["sample.group_size=3", "sample.prompts_per_epoch=5"])
    for world in (1, 2, 3, 4, 5, 6):
        plan = derive(c, world)
        assert plan.prompts_per_epoch >= 5
        assert plan.samples_per_epoch % (world * 2) == 0  # whole batches and 2 optimizer steps per rank
        # the smallest such m
        assert not any((m * 3) % (world * 2) == 0 for m in range(5, plan.prompts_per_epoch))


def test_derived_values_use_the_world_size_given_not_the_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6")
    monkeypatch.setenv("WORLD_SIZE", "7")
    c = load_config(REPO / "configs" / "flux_t2is.yaml")
    assert derive(c, 8).grad_accum_steps == 42


def test_more_trained_steps_raise_accumulation():
    c = load_config(TINY, ["sample.noise_steps=[1,2]", "train.timesteps=[1,2]"])
    plan = derive(c, 2)
    assert plan.micro_steps_per_rank == 2 * plan.samples_per_rank
    assert plan.grad_accum_steps == plan.micro_steps_per_rank // 2


def test_trained_steps_must_be_noised():
    with pytest.raises(ConfigError, match="not in sample.noise_steps"):
        load_config(TINY, ["sample.noise_steps=[1]", "train.timesteps=[2]"])


def _dry_run(*sets, world=2):
    args = ["launch/train.py", "--config", str(TINY), "--dry-run", "--world-size", str(world)]
    for s in sets:
        args += ["--set", s]
    return run_cli(*args)


def test_cli_dry_run_prints_the_plan():
    out = _dry_run()
    assert out.returncode == 0, out.stderr
    # 2 prompts x 8 images over 2 ranks = 8 samples x 6 trained steps = 48 micro-steps, 2 optimizer steps
    assert "gradient accumulation      24" in out.stdout and "group size k               8" in out.stdout


def test_error_unknown_key_names_the_closest_valid_key():
    line = _one_line_error(_dry_run("train.learnig_rate=1e-3"))
    assert "train.learnig_rate" in line and "did you mean 'train.learning_rate'" in line


def test_error_unknown_key_in_a_file_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"extends: {TINY}\nsample:\n  group_sise: 4\n")
    line = _one_line_error(run_cli("launch/train.py", "--config", str(bad), "--dry-run"))
    assert "bad.yaml:3" in line and "did you mean 'sample.group_size'" in line


def test_error_wrong_type_names_the_path():
    line = _one_line_error(_dry_run("sample.num_steps=ten"))
    assert "'sample.num_steps'" in line and "integer" in line


def test_error_missing_dataset_file():
    line = _one_line_error(_dry_run("data.train_file=no/such/prompts.jsonl"))
    assert "data.train_file" in line and "no/such/prompts.jsonl" in line


def test_error_malformed_jsonl_line_names_file_and_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": "also ok"}\n{"prompt": broken\n')
    line = _one_line_error(_dry_run(f"data.train_file={f}"))
    assert f"{f}:3" in line and "malformed JSON" in line


def test_error_unknown_reward_name():
    line = _one_line_error(_dry_run("rewards.train.terms.clip_score.weight=1"))
    assert "unknown reward 'clip_score'" in line


@pytest.mark.parametrize("key, value, what", [("model.family", "flux_kontxt", "model family"),
                                               ("train.loss", "grpo_guard", "loss")])
def test_error_a_name_without_an_implementation_at_load_and_dry_run(key, value, what):
    line = _one_line_error(_dry_run(f"{key}={value}"))
    assert f"config key '{key}': unknown {what} '{value}'" in line
    with pytest.raises(ConfigError, match=f"unknown {what} '{value}'"):
        load_config(TINY, [f"{key}={value}"])


def test_registered_names_load():
    c = load_config(TINY, ["model.family=flux", "train.loss=ppo"])
    assert (c.model.family, c.train.loss) == ("flux", "ppo")


def test_error_group_size_incompatible_with_world_size():
    line = _one_line_error(_dry_run("sample.group_size=3", "sample.round_prompts_per_epoch=false", world=2))
    assert "sample.group_size=3" in line and "world size 2" in line


def test_error_more_prompts_per_epoch_than_the_dataset_has():
    line = _one_line_error(_dry_run("sample.prompts_per_epoch=9"))
    assert "exceeds the 8 prompts" in line


def test_error_bad_yaml_names_the_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_name: x\nsample: [1, 2\n")
    line = _one_line_error(run_cli("launch/train.py", "--config", str(bad), "--dry-run"))
    assert "bad.yaml" in line and "invalid YAML" in line


def test_schema_has_every_reference_field_group():
    # The reference's config groups (PaCo-RL/PaCo-GRPO/config/base.py): model, data, sample, train,
    # test, rewards (train/test, weights, kwargs, aggregation), deepspeed, logging, checkpoint,
    # kernels.backend.
    fields = set(Config.model_fields)
    assert {"model", "data", "sample", "train", "test", "rewards", "advantage", "deepspeed", "logging",
            "checkpoint", "kernels", "seed", "run_name"} <= fields
    c = load_config(TINY, ["kernels.backend=cpp"])
    assert c.kernels.backend == "cpp"
    assert math.isclose(c.train.adam_beta2, 0.999) and c.train.ema.update_interval == 8
