"""Inputs that used to pass `--dry-run` and stop a run later with a traceback, or that make no
sense: each is one line naming the key or file:line, exit 2, at load (docs/inputs.md).

In-process checks of the loaders, plus a few `launch/train.py --dry-run` runs (plain python,
world size 1) for the one-line exit 2.
"""
from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
from PIL import Image
from pydantic import BaseModel

from conftest import REPO, TINY, one_line_error, run_cli
from paco_ds.data import load_prompts
from paco_ds.errors import ConfigError, DataError
from paco_ds.grpo.plan import check_recipe, grpo_schema, load_config
from paco_ds.sft.config import SFTConfig, load_sft_config

pytestmark = pytest.mark.fast

SFT_TINY = REPO / "configs" / "tiny" / "reward_sft.yaml"


def _dry_run(*sets: str, config: Path = TINY):
    args = ["launch/train.py", "--config", str(config), "--dry-run"]
    for s in sets:
        args += ["--set", s]
    return run_cli(*args, timeout=120)


def _jsonl(tmp_path: Path, *records: str, name: str = "p.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(records) + "\n", encoding="utf-8")
    return path


GOOD = '{"prompt": "a 2x2 grid of a cat", "layout": "2x2"}'


# ------------------------------------------------------------------------------------ prompts
@pytest.mark.parametrize("bad, what", [
    ('{"prompt": "a cat \\ud83d in a hat"}', r"'prompt' contains a lone surrogate \\ud83d at character 6"),
    ('{"prompt": "a cat\\u0000 in a hat"}', "'prompt' contains NUL at character 5"),
    ('{"prompt": "a cat", "criteria": {"style": ["x\\udc00"]}}', r"'criteria.style\[0\]' contains a lone surrogate"),
])
def test_a_prompt_with_nul_or_a_lone_surrogate_is_refused_naming_file_line(tmp_path, bad, what):
    path = _jsonl(tmp_path, GOOD, bad)
    with pytest.raises(DataError, match=f"p.jsonl:2: {what}"):
        load_prompts(path, "t2is")


def test_nul_in_a_text_prompt_file_is_refused_naming_the_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("a cat\n\na dog\x00 outside\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"p.txt:3: 'prompt' contains NUL at character 5"):
        load_prompts(path, "text")


def test_emoji_right_to_left_and_long_prompts_load_unchanged(tmp_path):
    prompts = ["a 2x2 grid of cats \U0001F408\u200d\u2b1b and \U0001F600", "\u05d7\u05ea\u05d5\u05dc \u0642\u0637\u0629 "
               "in a 1x2 grid", "a 2x2 grid: " + "a very detailed scene " * 2000]
    # JSON's escaped surrogate *pair* is one character once parsed: not a lone surrogate
    path = _jsonl(tmp_path, *(json.dumps({"prompt": p}) for p in prompts), '{"prompt": "pair \\ud83d\\ude00 2x2"}')
    items = load_prompts(path, "t2is")
    assert [it.prompt for it in items] == prompts + ["pair \U0001F600 2x2"]


def test_the_dry_run_refuses_a_lone_surrogate_in_one_line(tmp_path):
    path = _jsonl(tmp_path, GOOD, GOOD.replace("cat", "cat \\ud83d"))
    line = one_line_error(_dry_run(f"data.train_file={path}"))
    assert f"{path}:2: 'prompt' contains a lone surrogate" in line


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN", "1e400"])
def test_a_non_finite_height_is_one_line_naming_file_line(tmp_path, value):
    path = _jsonl(tmp_path, GOOD, f'{{"prompt": "a cat", "height": {value}}}')
    with pytest.raises(DataError, match=r"p.jsonl:2: 'height' must be a positive integer"):
        load_prompts(path, "t2is")


def test_a_non_finite_width_of_an_edit_record_is_refused(tmp_path):
    Image.new("RGB", (32, 32), "red").save(tmp_path / "a.png")
    path = _jsonl(tmp_path, '{"prompt": "make it blue", "image": "a.png", "width": NaN}', name="edit.jsonl")
    with pytest.raises(DataError, match=r"edit.jsonl:1: 'width' must be a positive integer \(got nan\)"):
        load_prompts(path, "edit")


def test_an_edit_instruction_with_a_lone_surrogate_is_refused(tmp_path):
    Image.new("RGB", (32, 32), "red").save(tmp_path / "a.png")
    path = _jsonl(tmp_path, '{"prompt": "make it \\udfff blue", "image": "a.png"}', name="edit.jsonl")
    with pytest.raises(DataError, match=r"edit.jsonl:1: 'prompt' contains a lone surrogate \\udfff"):
        load_prompts(path, "edit")


# ------------------------------------------------------------------------------------ YAML
def _recipe(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("extends, shown", [("5", "5"), (f"[{TINY}, 7]", "7"), ("{a: 1}", "{'a': 1}"), ("''", "''")])
def test_extends_must_name_files(tmp_path, extends, shown):
    path = _recipe(tmp_path, f"run_name: x\nextends: {extends}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "r.yaml:2: config key 'extends' must be a file name or a list of file names" in msg and shown in msg


def test_a_key_repeated_in_one_mapping_names_file_and_line(tmp_path):
    path = _recipe(tmp_path, f"extends: {TINY}\ntrain:\n  learning_rate: 1.0e-3\n  num_epochs: 2\n"
                             "  learning_rate: 1.0e-2\n")
    with pytest.raises(ConfigError, match=r"r.yaml:5: key 'learning_rate' is repeated in this mapping "
                                          r"\(first at line 3\)"):
        load_config(path)


def test_the_same_key_in_two_mappings_and_in_a_base_is_fine(tmp_path):
    path = _recipe(tmp_path, f"extends: {TINY}\ntrain: {{num_epochs: 2}}\ntest: {{num_steps: 2}}\n")
    cfg = load_config(path)
    assert cfg.train.num_epochs == 2 and cfg.test.num_steps == 2


@pytest.mark.timeout(120)  # expanded, the document would never finish loading: a hang is the failure
def test_an_alias_bomb_is_refused_before_it_expands(tmp_path):
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 10):  # 10^10 values once expanded
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    path = _recipe(tmp_path, "\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"r.yaml:\d+: the document expands past 100,000 values through its "
                                          r"aliases"):
        load_config(path)
    # the same through --set
    with pytest.raises(ConfigError, match="expands past"):
        load_config(TINY, ["train.timesteps=" + "{" + ", ".join(lines) + "}"])


def test_aliases_within_bounds_still_work(tmp_path):
    path = _recipe(tmp_path, f"extends: {TINY}\nsample: {{noise_steps: &s [0, 1]}}\ntrain: {{timesteps: *s}}\n")
    assert load_config(path).train.timesteps == [0, 1]


# ------------------------------------------------------------------------------------ run_name
@pytest.mark.parametrize("name", ["../elsewhere", "a/b", "", "..", ".", "/abs", "  "])
def test_a_run_name_is_one_path_component(name):
    with pytest.raises(ConfigError, match=r"config key 'run_name': a run name is one non-empty path component"):
        load_config(TINY, [f"run_name={name}"])
    with pytest.raises(ConfigError, match=r"config key 'run_name': a run name is one non-empty path component"):
        load_sft_config(SFT_TINY, [f"run_name={name}"])


def test_a_run_name_outside_output_dir_is_refused_by_the_dry_run():
    line = one_line_error(_dry_run("run_name=../../escaped"))
    assert "config key 'run_name'" in line and "'../../escaped'" in line


# ------------------------------------------------------------------------------------ finite floats
def _float_keys(model: type[BaseModel], prefix: tuple = ()) -> list[str]:
    """Every float field of a schema (nested sections included), as dotted keys."""
    out = []
    for name, field in model.model_fields.items():
        if name == "source":
            continue
        args = typing.get_args(field.annotation) or (field.annotation,)
        subs = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if subs:
            out += _float_keys(subs[0], prefix + (name,))
        elif float in args:
            out.append(".".join(prefix + (name,)))
    return out


GRPO_FLOATS = _float_keys(grpo_schema({}))  # with the built-in losses' sections
SFT_FLOATS = _float_keys(SFTConfig)


def test_the_schemas_have_the_floats_named_in_the_docs():
    for key in ("train.learning_rate", "train.weight_decay", "sample.guidance_scale", "train.adam_beta1",
                "advantage.clip", "train.awm.time_shift"):
        assert key in GRPO_FLOATS
    assert "train.learning_rate" in SFT_FLOATS and "train.adam_epsilon" in SFT_FLOATS


@pytest.mark.parametrize("key", GRPO_FLOATS)
@pytest.mark.parametrize("value", [".inf", ".nan", "-.inf"])
def test_every_float_of_the_grpo_recipe_is_finite(key, value):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        load_config(TINY, [f"{key}={value}"])


@pytest.mark.parametrize("key", SFT_FLOATS)
def test_every_float_of_the_sft_recipe_is_finite(key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        load_sft_config(SFT_TINY, [f"{key}=.nan"])


def test_a_non_finite_learning_rate_is_one_line_in_the_dry_run():
    line = one_line_error(_dry_run("train.learning_rate=.inf"))
    assert "config key 'train.learning_rate'" in line and "finite" in line


# ------------------------------------------------------------------------------------ the KL weight's key
def test_the_kl_weight_is_train_kl_beta_and_a_bare_beta_is_unknown():
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.beta'"):
        load_config(TINY, ["train.beta=0.04"])
    assert load_config(TINY, ["train.kl_beta=0.04"]).train.kl_beta == 0.04
    assert load_config(TINY, ["train.nft.beta=2"]).train.nft.beta == 2  # NFT's own beta is not the KL weight
    with pytest.raises(ConfigError, match=r"config key 'train.kl_beta'"):
        load_config(TINY, ["train.kl_beta=-1"])


# ------------------------------------------------------------------------------------ advantages that are all 0
def test_all_reward_weights_zero_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"config keys 'rewards.train.terms' \(--set rewards.train.terms=.*\): .*every reward "
                                          r"weight is 0, so every advantage would be 0"):
        load_config(TINY, ["rewards.train.terms={jpeg_compressibility: {weight: 0}, pickscore: {weight: 0.0, "
                           "tiny: true}}"])
    # one non-zero weight is enough; the unweighted reference means ignore the weights
    load_config(TINY, ["rewards.train.terms={jpeg_compressibility: {weight: 0}, pickscore: {weight: 1, tiny: true}}"])
    load_config(TINY, ["rewards.train.terms={jpeg_compressibility: {weight: 0}}",
                       "rewards.train.aggregation={fn: geometric_mean, center: false}"])


def test_a_group_of_one_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"config key 'sample.group_size': Input should be greater than or "
                                          r"equal to 2 \(got 1\)"):
        load_config(TINY, ["sample.group_size=1"])


def test_a_noise_step_past_the_last_step_is_refused():
    with pytest.raises(ConfigError, match=r"'sample.noise_steps' .*: sample.noise_steps \[99\] must be < "
                                          r"sample.num_steps=6"):
        load_config(TINY, ["sample.noise_steps=[0, 99]", "train.timesteps=[0]"])
    line = one_line_error(_dry_run("sample.noise_steps=[0, 99]", "train.timesteps=[0]"))
    assert "sample.noise_steps [99] must be < sample.num_steps=6" in line


def test_the_tiny_recipes_still_load_and_plan():
    planned = []
    for path in sorted((REPO / "configs" / "tiny").glob("*.yaml")):
        if path.name == "reward_sft.yaml":
            assert load_sft_config(path).run_name
        else:
            plan, n_train, *_ = check_recipe(load_config(path), 2)
            assert n_train > 0 and plan.samples_per_epoch > 0, path.name
            planned.append(path.name)
    assert len(planned) >= 10 and "t2is.yaml" in planned


# ------------------------------------------------------------------------------------ reward-model SFT
@pytest.fixture(scope="module")
def processor():
    from paco_ds.models.tiny.qwen_vl import tiny_qwen2_5_vl

    return tiny_qwen2_5_vl()[1]


def _sft_records(tmp_path: Path):
    from paco_ds.sft.data import load_records

    Image.new("RGB", (40, 30), "red").save(tmp_path / "a.png")
    Image.new("RGB", (64, 64), "blue").save(tmp_path / "b.png")
    data = (tmp_path / "b.png").read_bytes()
    (tmp_path / "b.png").write_bytes(data[:len(data) // 2])  # the header is intact, the pixels are cut
    rec = {"messages": [{"role": "user", "content": "<image><image>Same?"}, {"role": "assistant", "content": "Yes."}]}
    (tmp_path / "d.json").write_text(json.dumps([{**rec, "images": ["a.png", "a.png"]},
                                                 {**rec, "images": ["a.png", "b.png"]}]))
    return load_records([tmp_path / "d.json"], "data.train_files")


def test_a_truncated_image_is_found_at_start_up_naming_file_and_record(tmp_path, processor):
    from paco_ds.sft.data import Encoder, SFTDataset

    records = _sft_records(tmp_path)
    with Image.open(tmp_path / "b.png") as im:
        assert im.size == (64, 64)  # what the old header-only check saw
    ds = SFTDataset(records, Encoder(processor, 1024, 28 * 28, 56 * 56))
    index, msg = ds.first_error(range(len(records)))
    assert index == 1 and "d.json: record 1: cannot read image" in msg and "b.png" in msg
    with pytest.raises(DataError, match=r"d.json: record 1: cannot read image .*b.png \(image file is truncated\)"):
        ds[1]  # and at first use, had the file been cut after the start-up check


def test_an_sft_record_with_a_lone_surrogate_is_refused(tmp_path):
    from paco_ds.sft.data import load_records

    Image.new("RGB", (40, 30), "red").save(tmp_path / "a.png")
    (tmp_path / "d.jsonl").write_text('{"messages": [{"role": "user", "content": "<image>Same \\ud800?"}, '
                                      '{"role": "assistant", "content": "Yes"}], "images": ["a.png"]}\n')
    with pytest.raises(DataError, match=r"d.jsonl: record 0: 'messages\[0\].content' contains a lone surrogate"):
        load_records([tmp_path / "d.jsonl"], "data.train_files")


def _checkpoint_with(tmp_path: Path, cfg: SFTConfig, meta_extra: dict | None = None) -> Path:
    from paco_ds.sft.trainer import resume_settings

    ckpt = tmp_path / "step_0000004"
    ckpt.mkdir()
    meta = {"epoch": 1, "global_step": 4, "recipe": resume_settings(cfg)} if meta_extra is None else meta_extra
    (ckpt / "meta.json").write_text(json.dumps(meta))
    return ckpt


def test_resuming_with_another_lora_rank_is_one_line_naming_the_key(tmp_path):
    from paco_ds.sft.trainer import check_resume_settings

    ckpt = _checkpoint_with(tmp_path, load_sft_config(SFT_TINY))
    with pytest.raises(ConfigError, match=r"config key 'lora.rank': --resume .*step_0000004 was trained with 8, "
                                          r"this recipe gives 16"):
        check_resume_settings(load_sft_config(SFT_TINY, ["lora.rank=16"]), ckpt)


def test_resuming_a_checkpoint_without_a_recorded_recipe_reads_the_adapters_rank(tmp_path):
    from paco_ds.sft.trainer import check_resume_settings

    ckpt = _checkpoint_with(tmp_path, load_sft_config(SFT_TINY), meta_extra={"epoch": 1})
    (ckpt / "adapter").mkdir()
    (ckpt / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    assert check_resume_settings(load_sft_config(SFT_TINY), ckpt) == ""
    with pytest.raises(ConfigError, match="config key 'lora.rank'"):
        check_resume_settings(load_sft_config(SFT_TINY, ["lora.rank=4"]), ckpt)


def test_resuming_with_another_learning_rate_or_epoch_count_says_what_changed(tmp_path):
    from paco_ds.sft.trainer import check_resume_settings

    cfg = load_sft_config(SFT_TINY)
    ckpt = _checkpoint_with(tmp_path, cfg)
    assert check_resume_settings(cfg, ckpt) == ""
    changed = check_resume_settings(load_sft_config(SFT_TINY, ["train.learning_rate=1e-5",
                                                               f"train.num_epochs={cfg.train.num_epochs + 3}"]), ckpt)
    assert changed == (f"train.learning_rate {cfg.train.learning_rate!r} -> 1e-05, "
                       f"train.num_epochs {cfg.train.num_epochs} -> {cfg.train.num_epochs + 3}")


# ------------------------------------------------------------------------------------ reward arguments
# Each reward's arguments are typed and ranged in its constructor's annotations (paco_ds/rewards/base.py's
# Count, Fraction, ...): a value of the wrong type or out of range is one line in --dry-run, before any
# model or judge starts, where it used to fail at the first score or hang while the rewards were built.
REWARD_ARGS = [
    ("ocr", "{min_confidence: high}", "ocr.min_confidence': input should be a valid number"),
    ("imagereward", "{batch_size: 0, tiny: true}", "imagereward.batch_size': input should be greater than or equal to 1"),
    ("geneval", "{base_url: [1, 2]}", "geneval.base_url': input should be a valid string"),
    ("vlm_score", "{template: nosuch}", "vlm_score.template': input should be 'qwenvl', 'unifiedreward' or 'deqa'"),
    ("vlm_score", "{max_concurrency: 0}", "vlm_score.max_concurrency': input should be greater than or equal to 1"),
    ("consistency_score", "{top_logprobs: 0}", "consistency_score.top_logprobs': input should be greater than or equal"),
    ("jpeg_compressibility", "{quality: 101}", "jpeg_compressibility.quality': input should be less than or equal to 100"),
]


@pytest.mark.parametrize("name, args, words", REWARD_ARGS, ids=[f"{n}-{a}" for n, a, _ in REWARD_ARGS])
def test_a_reward_argument_of_the_wrong_type_or_range_is_one_line_in_the_dry_run(name, args, words):
    line = one_line_error(_dry_run(f"rewards.train.terms={{{name}: {args}}}", "reward_servers=null"))
    assert f"config key 'rewards.train.terms.{words}" in line, line


def test_vlm_scores_template_choices_are_its_templates():
    import typing

    from paco_ds.rewards.vlm_score import TEMPLATES, VlmScore

    hint = typing.get_type_hints(VlmScore.__init__)["template"]
    assert set(typing.get_args(hint)) == set(TEMPLATES)


# ------------------------------------------------------------------------------------ values that used to crash later
@pytest.mark.parametrize("sets, words", [
    (["sample.noise_steps=[]"], "sample.noise_steps is empty and train.timesteps unset: no step would be trained"),
    (["seed=-1"], "config key 'seed': input should be greater than or equal to 0"),
    (["train.adam_beta1=1.5"], "config key 'train.adam_beta1': input should be less than 1"),
    (["deepspeed.overrides={zero_optimization: {stage: 7}}"], "zero_optimization.stage must be 0, 1, 2 or 3"),
    (["deepspeed.overrides={train_batch_size: 64}"], "'train_batch_size' is what paco_ds sets from the recipe"),
    (["run_name=" + "r" * 300], "config key 'run_name': a run name is at most 200 bytes (got 300)"),
], ids=["no-noise-steps", "negative-seed", "beta1", "zero-stage-7", "ds-batch-size", "long-run-name"])
def test_a_value_that_used_to_fail_after_start_up_is_one_line_in_the_dry_run(sets, words):
    line = one_line_error(_dry_run(*sets))
    assert words in line.lower() if words[0].islower() else words in line, line


def test_a_record_of_an_enormous_image_is_one_line_naming_file_and_line(tmp_path):
    path = _jsonl(tmp_path, GOOD, '{"prompt": "a 2x2 grid of a cat", "height": 1048576, "width": 1048576}')
    with pytest.raises(DataError, match=r"p.jsonl:2: 'height' is 1048576, more than 16384 px"):
        load_prompts(path, "t2is")


@pytest.mark.parametrize("reward, record, words", [
    ("geneval", '{"prompt": "a photo of a cat"}', "reward 'geneval' cannot score this record: metadata 'tag' is None"),
    ("geneval", '{"prompt": "a photo of a cat", "tag": "single_object"}',
     "reward 'geneval' cannot score this record: metadata has no 'include' list"),
    ("ocr", '{"prompt": "a shop sign in the rain"}', "reward 'ocr' cannot score this record: the prompt has no "
                                                     "double-quoted text"),
])
def test_a_record_the_reward_cannot_score_is_one_line_at_load(tmp_path, reward, record, words):
    path = _jsonl(tmp_path, record, name="train.jsonl")
    line = one_line_error(_dry_run(f"data.train_file={path}", f"data.test_file={path}", "sample.prompts_per_epoch=1",
                                   "reward_servers=null", f"rewards.train.terms={{{reward}: {{weight: 1.0}}}}",
                                   "rewards.test=null"))
    assert f"{path}:1: {words}" in line, line


@pytest.mark.parametrize("text, words", [
    ("a: &x\n  b: *x\n", ":1: an alias (*anchor) refers to a mapping or list that contains it"),
    ("? [train, seed]\n: 3\n", ":1: a key must be a name, not a list"),
])
def test_yaml_that_cannot_be_a_recipe_is_one_line(tmp_path, text, words):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    line = one_line_error(_dry_run(config=recipe))
    assert f"{recipe}{words}" in line, line


# ------------------------------------------------------------------------------------ what --dry-run catches and says
LAYOUTS = REPO / "paco_ds/data/prompts/tiny_t2is_layouts.jsonl"


def test_the_dry_run_counts_the_prompts_a_reward_does_not_apply_to():
    """One prompt of each layout from 1x1 to 3x3: the single panel is counted for consistency_score, with
    what its samples train on; the test set's rewards hold no pairwise judge, so nothing is counted there."""
    proc = _dry_run(f"data.train_file={LAYOUTS}", f"data.test_file={LAYOUTS}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("not judged")]
    assert len(lines) == 1, proc.stdout
    assert ("consistency_score: 1 of 9 prompts in data.train_file (a single panel (layout 1x1) has no pair of panels "
            "to compare); their samples train on jpeg_compressibility, subfig_clipT, pickscore without it") in lines[0]


def test_a_record_no_reward_applies_to_is_refused_naming_file_line(tmp_path):
    path = _jsonl(tmp_path, GOOD, '{"prompt": "a 1x1 grid of a cat", "layout": "1x1"}')
    line = one_line_error(_dry_run(f"data.train_file={path}", "rewards.train.terms={_replace: true, "
                                   "consistency_score: {weight: 1.0, model: paco-reward-tiny, top_logprobs: 267}}"))
    assert line.startswith(f"train: error: {path}:2: no reward of rewards.train.terms applies to this record "
                           "(consistency_score: a single panel (layout 1x1) has no pair of panels to compare)"), line


def test_an_unwritable_wandb_dir_is_one_line_at_the_dry_run():
    line = one_line_error(_dry_run("logging.wandb.mode=offline", "logging.wandb.dir=/proc/paco_ds_wandb"))
    assert "config key 'logging.wandb.dir': /proc/paco_ds_wandb is not writable" in line


def test_a_prompt_length_past_the_tiny_text_encoder_is_one_line_at_the_dry_run():
    line = one_line_error(_dry_run("model.max_sequence_length=100000", config=REPO / "configs/tiny/flux2_t2is.yaml"))
    assert ("config key 'model.max_sequence_length': at most 4096 for the tiny twin of model.family 'flux2', "
            "got 100000") in line


def test_cps_noise_past_one_is_one_line_naming_both_keys():
    line = one_line_error(_dry_run("sample.noise_level=5", config=REPO / "configs/tiny/t2is_cps.yaml"))
    assert "'sample.noise_level' (--set sample.noise_level=5), 'sample.sde_type' (" in line
    assert "noise_level must be within [0, 1]" in line


def test_a_batch_size_that_rounds_past_the_data_names_the_batch_size():
    line = one_line_error(_dry_run("sample.batch_size=1000"))
    assert line.startswith("train: error: config key 'sample.batch_size': sample.batch_size=1000 with "
                           "sample.group_size=8"), line
    assert "rounded up from 2 to 125" in line and "lower sample.batch_size" in line
    line = one_line_error(_dry_run("sample.prompts_per_epoch=1000"))  # the key the user set, when it was that
    assert "sample.prompts_per_epoch=1000" in line and "batch_size" not in line


def test_the_dry_run_says_which_loss_trains_and_its_settings():
    proc = _dry_run(config=REPO / "configs/tiny/t2is_dpo.yaml")
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("loss"))
    assert "dpo (train.dpo.beta=" in line and "train.dpo.timestep_sampling=" in line and "train.kl_beta=" in line
