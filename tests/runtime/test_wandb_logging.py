"""Weights & Biases beside metrics.jsonl and TensorBoard, with the real wandb in offline mode (no network):
what MetricsLogger sends, read back from the offline run's own log with wandb's record type; a resume
that continues the same W&B run; the recipe's logging.wandb section at load. The trainer's own use
(a real 2-rank run and its resume) is checked in tests/grpo/test_train.py and test_train_runs.py."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from PIL import Image

from conftest import TINY, one_line_error, run_cli
from distributed_runs import wandb_env
from paco_ds.recipe.schema import WandbConfig
from paco_ds.errors import ConfigError
from paco_ds.runtime.metrics import MetricsLogger, check_wandb
from paco_ds.runtime.stopping import Preempted
from wandb_records import (exit_code, history, numbers, offline_runs, run_record, split_images, wandb_processes,
                           was_marked_preempting)

pytestmark = pytest.mark.fast

OFFLINE = WandbConfig(project="paco_ds_tests", mode="offline")


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, its own folders in tmp_path; after the test no W&B process started from here is
    left (wandb-core and its monitor inherit WANDB_CONFIG_DIR, which marks them)."""
    env = wandb_env(tmp_path / "wandb_home")
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    yield
    left = wandb_processes(("WANDB_CONFIG_DIR", env["WANDB_CONFIG_DIR"]))
    assert not left, f"W&B processes outlived the logger: {[p.cmdline()[:2] for p in left]}"


def _rows(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


def _grid(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (12, 20, 3), dtype=np.uint8))


@pytest.mark.parametrize("ending, status", [(None, 0), (SystemExit(130), 130), (RuntimeError("a bug"), 1)],
                         ids=["finished", "sigint", "error"])
def test_wandb_gets_the_scalars_of_metrics_jsonl_and_the_grids_at_their_steps(tmp_path, offline_wandb, ending, status):
    """Whatever ended the run (a SIGINT is SystemExit(130) in a rank, paco_ds/runtime/stopping.py), the W&B run
    is finished with the process's status and its service stopped (the fixture checks)."""
    run_dir = tmp_path / "run"
    logger = MetricsLogger(run_dir, enabled=True, tensorboard=False)
    logger.open_wandb(OFFLINE, "tiny", {"seed": 1})
    grid = _grid(0)
    for epoch in range(3):
        if epoch == 1:
            logger.save_image("train_samples", grid, epoch)
        logger.log({"epoch": epoch, "train/loss": 1.0 / (epoch + 1), "reward/mean": float("nan") if epoch == 2 else 0.5,
                    "skipped": True, "note": "text"}, step=epoch)
    run_id = logger.wandb_run_id
    logger.close(ending)

    [segment] = offline_runs(run_dir)  # W&B's files in the run directory by default
    assert run_record(segment).run_id == run_id and logger.wandb_run_id is None  # closed
    assert run_record(segment).display_name == "tiny" and run_record(segment).project == "paco_ds_tests"
    scalars, images = split_images(history(segment))
    assert scalars == {row["epoch"]: numbers(row) for row in _rows(run_dir)}
    assert scalars[2]["train/loss"] == pytest.approx(1 / 3) and "reward/mean" not in scalars[2]  # NaN: no point
    assert list(images) == [1] and list(images[1]) == ["images/train_samples"]
    image = images[1]["images/train_samples"]
    assert image["_type"] == "image-file" and (image["width"], image["height"]) == (20, 12)
    sent = Image.open(segment.parent / "files" / image["path"])
    assert np.array_equal(np.asarray(sent.convert("RGB")), np.asarray(grid))
    assert (run_dir / "images" / "train_samples_epoch0001.png").is_file()
    assert exit_code(segment) == status and not was_marked_preempting(segment)


@pytest.mark.parametrize("rewind", [False, True], ids=["keep", "rewind"])
def test_a_resume_continues_the_same_wandb_run(tmp_path, offline_wandb, rewind):
    """A first pass logs epochs 0-3 and is preempted (exit 75); the run resumes from its epoch-2
    checkpoint and runs epochs 2-4 again, as an exact resume does. The resumed segment is the same W&B
    run. Kept (the default): W&B's epochs 2-3 are the first pass's and the segment starts at 4, so no
    step goes below one W&B holds. Rewound: the segment restarts W&B's history at 2 (resume_from)."""
    run_dir = tmp_path / "run"
    section = WandbConfig(project="paco_ds_tests", mode="offline", rewind=rewind)
    first = MetricsLogger(run_dir, enabled=True, tensorboard=False)
    first.open_wandb(section, "tiny", {})
    run_id = first.wandb_run_id
    for epoch in range(4):
        first.log({"epoch": epoch, "train/loss": float(epoch)}, step=epoch)
    first.close(Preempted("preempted at epoch 3"))

    resumed = MetricsLogger(run_dir, enabled=True, tensorboard=False)
    resumed.truncate_after(2)
    resumed.open_wandb(section, "tiny", {}, run_id=run_id, resume_at=2)
    assert resumed.wandb_run_id == run_id
    for epoch in (2, 3, 4):
        resumed.log({"epoch": epoch, "train/loss": float(epoch)}, step=epoch)
    resumed.close()

    before, after = offline_runs(run_dir)
    assert run_record(before).run_id == run_record(after).run_id == run_id
    assert exit_code(before) == 75 and was_marked_preempting(before)
    assert exit_code(after) == 0 and not was_marked_preempting(after)
    if rewind:
        point = run_record(after).branch_point
        assert (point.run, point.metric, point.value) == (run_id, "_step", 1)
        assert sorted(history(after)) == [2, 3, 4]
        merged = {**{s: r for s, r in history(before).items() if s < 2}, **history(after)}
    else:
        assert run_record(after).resume
        assert sorted(history(after)) == [4]
        merged = {**history(before), **history(after)}
    assert merged == {row["epoch"]: numbers(row) for row in _rows(run_dir)}


def test_online_without_a_login_is_one_line_naming_the_section(tmp_path, offline_wandb, monkeypatch):
    """mode: online, and no API key anywhere (env, netrc, W&B's settings): W&B refuses before any
    network, and the run stops with its message on one line (exit 2 through the entry point)."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    logger = MetricsLogger(tmp_path / "run", enabled=True, tensorboard=False)
    with pytest.raises(ConfigError, match=r"^config key 'logging.wandb': W&B could not start the run \(No API key "
                                          r"configured\. Use `wandb login` to log in\.\)$"):
        logger.open_wandb(WandbConfig(mode="online"), "tiny", {})
    assert logger.wandb is None
    logger.close()


def test_the_recipe_section_and_its_old_boolean_form():
    from paco_ds.grpo.plan import load_config
    from paco_ds.sft.config import SFTConfig

    on = load_config(TINY, ["logging.wandb=true"]).logging.wandb
    assert (on.project, on.mode, on.dir, on.name) == ("paco_ds", None, None, None)
    assert load_config(TINY, ["logging.wandb=false"]).logging.wandb is None
    assert load_config(TINY, []).logging.wandb is None
    section = load_config(TINY, ["logging.wandb.mode=offline", "logging.wandb.entity=lab"]).logging.wandb
    assert (section.mode, section.entity, section.project) == ("offline", "lab", "paco_ds")
    assert SFTConfig.model_fields["logging"].default_factory().wandb is None
    with pytest.raises(ConfigError, match=r"'logging.project' is 'logging.wandb.project' now"):
        load_config(TINY, ["logging.project=x"])


@pytest.mark.parametrize("sets, missing, message", [
    (["logging.wandb.mode=bogus"], False,
     "config key 'logging.wandb.mode': Input should be 'online', 'offline' or 'disabled' (got 'bogus')"),
    (["logging.wandb.mode=offline"], True,
     "config key 'logging.wandb': the wandb package is not installed (pip install wandb), or set "
     "logging.wandb.mode=disabled"),
], ids=["bad-mode", "not-installed"])
def test_a_bad_wandb_section_is_one_line_and_exit_2_before_the_run(monkeypatch, sets, missing, message):
    if missing:
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    args = ["launch/train.py", "--config", str(TINY), "--dry-run"]
    for s in sets:
        args += ["--set", s]
    assert one_line_error(run_cli(*args)).endswith(message)
    if missing:  # disabled needs no package
        check_wandb(WandbConfig(mode="disabled"))
