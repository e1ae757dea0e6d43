"""The GRPO trainer's longer real runs: the shared tiny run (tests/grpo/test_train.py) resumed exactly from
its own epoch-2 checkpoint (continuing its W&B run), a rank killed mid-run, and finished runs that always exit 0."""
import os
import signal
import subprocess
import time

import psutil
import pytest

from distributed_runs import REPO, cpu_env, launch_cmd, metrics, resume_copy, run_trainer, stable, tail, wandb_env
from wandb_records import exit_code, history, numbers, offline_runs, run_record, split_images, wandb_processes

pytestmark = pytest.mark.runs

FAST = ("train.num_epochs=4", "sample.group_size=4", "test.eval_freq=2", "checkpoint.save_freq=2",
        "checkpoint.keep_last=2", "logging.wandb.mode=offline")
NO_JUDGE = ("reward_servers=null", "rewards.train.terms={jpeg_compressibility: {weight: 1.0}}")


@pytest.fixture(scope="module")
def full_run(runs):
    """The shared run of tests/grpo/test_train.py (the run cache launches it once per session)."""
    return runs.get("t2is_full", *FAST, script="tests/scripts/train_probe.py").ok().dir


def test_exact_resume(full_run, tmp_path):
    """The run resumed from its epoch-2 checkpoint (in a copy of its directory) through
    launch/train.py ends with exactly the run's own metrics.

    W&B (offline): the resume continues the W&B run the checkpoint names, as a second segment of the
    same run id. W&B already holds epochs 2-4 from the first pass (an exact resume repeats them), so
    the segment sends no step below 5: none here. Both segments together are still the run's own
    metrics, the run is finished with exit 0, and no W&B process of the launch outlives it."""
    run_dir = tmp_path / "resumed"
    marked = wandb_env(tmp_path / "wandb_home")
    resumed = resume_copy(full_run, run_dir, "epoch_0002", *FAST, env=marked)
    assert resumed.returncode == 0, tail(resumed)
    assert "resumed from" in resumed.stdout
    assert stable(metrics(run_dir)) == stable(metrics(full_run))
    assert not wandb_processes(("WANDB_CONFIG_DIR", marked["WANDB_CONFIG_DIR"]))
    first, second = offline_runs(run_dir)
    assert run_record(second).run_id == run_record(first).run_id and run_record(second).resume
    assert exit_code(second) == 0 and history(second) == {}
    scalars, _ = split_images({**history(first), **history(second)})
    rows = [numbers(r) for r in metrics(run_dir)]
    assert stable([scalars[r["epoch"]] for r in rows]) == stable(rows) and len(scalars) == len(rows)


def test_killing_one_rank_stops_the_run_and_keeps_the_last_checkpoint(tmp_path):
    run_dir = tmp_path / "killed"
    launcher = subprocess.Popen(launch_cmd("launch/train.py", run_dir, "train.num_epochs=200", "test.eval_freq=0",
                                           "checkpoint.save_freq=1", "logging.num_train_images=0", *NO_JUDGE),
                                cwd=REPO, env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 240  # turns a hang into a failure; the event waited for is the checkpoint
        latest = run_dir / "checkpoints" / "latest"
        while not (latest.is_file() and latest.read_text() >= "epoch_0001"):
            assert launcher.poll() is None and time.monotonic() < deadline, "training did not reach epoch 1"
            time.sleep(0.5)
        ranks = [p for p in psutil.Process(launcher.pid).children(recursive=True)
                 if any(a.startswith("--local_rank=1") for a in p.cmdline())]
        assert len(ranks) == 1
        ranks[0].send_signal(signal.SIGKILL)
        rc = launcher.wait(timeout=60)  # a run that hung on the dead rank would time out here
        assert rc != 0
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    # The last complete checkpoint still loads: export its LoRA (a 2-process run restores it).
    export = run_trainer(run_dir, *NO_JUDGE, extra=("--export-lora", "latest"))
    assert export.returncode == 0, tail(export)
    assert (run_dir / "lora" / "pytorch_lora_weights.safetensors").is_file()


LAYOUTS = REPO / "paco_ds/data/prompts/tiny_t2is_layouts.jsonl"


def test_prompts_of_one_to_nine_panels_train_to_the_end(runs):
    """The tiny recipe (its judge served by the run, on_failure: raise) on one prompt of each layout from
    1x1 to 3x3, every prompt in every epoch: the single panel has no pair for consistency_score, which
    neither scores nor fails it, and the run trains it on the other rewards to its end (exit 0)."""
    run = runs.get("t2is_layouts", f"data.train_file={LAYOUTS}", f"data.test_file={LAYOUTS}", "sample.group_size=2",
                   "sample.prompts_per_epoch=9", "train.optimizer_steps_per_epoch=1", "train.num_epochs=2",
                   "sample.noise_steps=[1]", "test.eval_freq=2", "test.resolution=64", "checkpoint.save_freq=0",
                   "logging.num_train_images=0").ok()
    epochs = run.epochs()
    assert [r["epoch"] for r in epochs] == [0, 1]
    for r in epochs:
        assert r["reward/consistency_score/not_applicable"] == 2.0  # the 1x1 prompt's group of 2
        assert r["reward/masked"] == 0.0 and r["reward/failures"] == 0.0 and r["adv/masked"] == 0.0
        assert 0.0 <= r["reward/consistency_score/mean"] <= 1.0 and r["train/grad_norm"] > 0
    evals = [r for r in run.metrics() if "eval/subfig_clipT/mean" in r]  # the nine layouts evaluated too
    assert evals and all(r["eval/subfig_clipT/mean"] == r["eval/subfig_clipT/mean"] for r in evals)
