"""The GRPO trainer for real: the deepspeed launcher, 2 processes, ZeRO-3 over gloo, tiny models.

One 4-epoch run of the tiny recipe as shipped (all three PaCo rewards, the consistency judge on an
hf-engine server the run starts and stops; through tests/scripts/train_probe.py, which also
records the partitioning and the gathered LoRA of each rank) serves several checks; the resume,
kill and learning tests run their own.
"""
import json
import math
import os
import statistics
import signal
import subprocess
import time

import psutil
import pytest
from PIL import Image

from distributed_runs import REPO, cpu_env, launch_cmd, metrics, resume_copy, run_trainer, stable, tail

# Short runs: 4 epochs of 2 prompts x 4 images, eval and checkpoints every 2.
FAST = ("train.num_epochs=4", "sample.group_size=4", "test.eval_freq=2", "checkpoint.save_freq=2",
        "checkpoint.keep_last=2")

# Without the judge server (faster) where a test is not about rewards.
NO_JUDGE = ("reward_servers=null", "rewards.train.terms={jpeg_compressibility: {weight: 1.0}}")

EPOCH_FIELDS = [
    "reward/jpeg_compressibility/mean", "reward/jpeg_compressibility/std", "reward/subfig_clipT/mean",
    "reward/pickscore/mean", "reward/consistency_score/mean", "reward/combined/mean", "adv/adv_abs_mean", "adv/zero_std_ratio", "adv/global_std",
    "train/loss", "train/policy_loss", "train/kl", "train/ratio", "train/ratio_first", "train/clipfrac",
    "train/grad_norm", "train/nonfinite_steps", "time/sample", "time/reward_wait", "time/train", "time/epoch",
    "images_per_sec", "global_step",
]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("grpo") / "full"
    proc = run_trainer(run_dir, *FAST, script="tests/scripts/train_probe.py")
    assert proc.returncode == 0, tail(proc)
    return run_dir


def _probes(run_dir):
    return [json.loads((run_dir / f"probe_rank{r}.json").read_text()) for r in (0, 1)]


def test_zero3_partitions_every_transformer_parameter(full_run):
    for probe in _probes(full_run):
        assert probe["world_size"] == 2
        rows = probe["partition"]
        assert len(rows) > 50
        bad = [r["name"] for r in rows if not r["local"] < r["full"]]
        assert not bad, f"not partitioned: {bad[:5]}"


def test_both_ranks_hold_identical_lora_after_gather(full_run):
    a, b = _probes(full_run)
    assert a["lora_numel"] == b["lora_numel"] > 0
    assert a["lora_digest"] == b["lora_digest"]


def test_metrics_have_every_field_for_every_epoch(full_run):
    rows = [r for r in metrics(full_run) if "time/epoch" in r]
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        missing = [k for k in EPOCH_FIELDS if k not in r]
        assert not missing, (r["epoch"], missing)
        assert all(isinstance(r[k], (int, float)) and math.isfinite(r[k]) for k in EPOCH_FIELDS)
        assert r["global_step"] == 2 * (r["epoch"] + 1)  # two optimizer steps per epoch
    evals = [r for r in metrics(full_run) if "eval/jpeg_compressibility/mean" in r]
    assert [r["epoch"] for r in evals] == [0, 2, 4]


def test_ratio_is_exactly_one_on_the_first_micro_step_and_one_forward_per_step(full_run):
    for r in (r for r in metrics(full_run) if "time/epoch" in r):
        assert r["train/ratio_first"] == 1.0
        assert r["train/forwards_per_step"] == 1.0  # beta = 0: no reference forward
        # noise at every step (sample.noise_steps 0..5): nothing is shared or walked in fewer steps
        assert r["sample/transformer_calls"] == 2 * 4 * 6  # 2 prompts x 4 images x 6 steps
        assert r["train/ratio"] != 1.0  # the second optimizer step sees the updated policy


def test_train_and_eval_images_have_their_own_resolutions(full_run):
    rows = metrics(full_run)
    assert {r["train/height"] for r in rows if "train/height" in r} == {64.0}
    assert {(r["eval/height"], r["eval/width"]) for r in rows if "eval/height" in r} == {(128.0, 128.0)}
    grid = Image.open(full_run / "images" / "eval_epoch0004.png")
    assert grid.size[0] >= 2 * 128  # a grid of 128 px eval images


def test_run_leaves_checkpoints_lora_and_report(full_run):
    ckpts = sorted(p.name for p in (full_run / "checkpoints").iterdir() if p.is_dir())
    assert ckpts == ["epoch_0002", "epoch_0004"]  # keep_last=2 removed epoch_0000
    assert (full_run / "checkpoints" / "latest").read_text() == "epoch_0004"
    assert (full_run / "lora" / "pytorch_lora_weights.safetensors").is_file()
    page = (full_run / "report.html").read_text()
    assert page.count("data:image/png;base64,") >= 3 and "Train rewards" in page


def test_exact_resume(full_run, tmp_path):
    """The run resumed from its epoch-2 checkpoint (in a copy of its directory) through
    launch/train.py ends with exactly the run's own metrics."""
    run_dir = tmp_path / "resumed"
    resumed = resume_copy(full_run, run_dir, "epoch_0002", *FAST)
    assert resumed.returncode == 0, tail(resumed)
    assert "resumed from" in resumed.stdout
    assert stable(metrics(run_dir)) == stable(metrics(full_run))


def test_killing_one_rank_stops_the_run_and_keeps_the_last_checkpoint(tmp_path):
    run_dir = tmp_path / "killed"
    launcher = subprocess.Popen(launch_cmd("launch/train.py", run_dir, "train.num_epochs=200", "test.eval_freq=0",
                                           "checkpoint.save_freq=1", "logging.num_train_images=0", *NO_JUDGE),
                                cwd=REPO, env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        deadline = time.time() + 240
        latest = run_dir / "checkpoints" / "latest"
        while not (latest.is_file() and latest.read_text() >= "epoch_0002"):
            assert launcher.poll() is None and time.time() < deadline, "training did not reach epoch 2"
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


def test_jpeg_compressibility_is_learned(tmp_path):
    """GRPO on the jpeg_compressibility reward alone raises it within 16 epochs.

    The run draws the same 2 prompts every epoch (a 2-prompt file), so epoch means compare like
    with like. Statistic: the mean reward of the last 5 epochs minus that of the first 5 must exceed
    3 standard errors of that difference (from the spread of the epoch means within each window),
    and 0.05 bits per pixel. Measured here: +0.19 at 6.9 standard errors.
    """
    prompts = tmp_path / "two_prompts.jsonl"
    lines = (REPO / "paco_ds/data/prompts/tiny_t2is_train.jsonl").read_text().splitlines()
    prompts.write_text("\n".join(lines[:2]) + "\n")
    run_dir = tmp_path / "learn"
    proc = run_trainer(run_dir, f"data.train_file={prompts}", "train.num_epochs=16", "test.eval_freq=0",
                       "checkpoint.save_freq=0", "logging.num_train_images=0", "reward_servers=null",
                       "rewards.train={terms: {jpeg_compressibility: {weight: 1.0}}}")
    assert proc.returncode == 0, tail(proc)
    r = [row["reward/jpeg_compressibility/mean"] for row in metrics(run_dir) if "time/epoch" in row]
    first, last = r[:5], r[-5:]
    margin = statistics.mean(last) - statistics.mean(first)
    stderr = math.sqrt(statistics.variance(first) / 5 + statistics.variance(last) / 5)
    assert margin > max(3 * stderr, 0.05), (r, margin, stderr)


def test_export_lora_from_one_process_matches_the_runs_own_export(full_run, tmp_path):
    """--export-lora reads the ZeRO checkpoint files: plain python (world size 1; the run had 2),
    no judge started, and the adapter (EMA, as the run exports it) is the run's own, bit for bit."""
    import shutil
    import sys

    import torch
    from safetensors.torch import load_file

    from distributed_runs import TINY

    run = tmp_path / full_run.name
    shutil.copytree(full_run / "checkpoints", run / "checkpoints", symlinks=True)
    proc = subprocess.run([sys.executable, "launch/train.py", "--config", str(TINY), "--set", f"output_dir={tmp_path}",
                           "--set", f"run_name={run.name}", "--export-lora", "latest"], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, tail(proc)
    assert "from epoch_0004" in proc.stdout and "written by 2 ranks, EMA" in proc.stdout
    assert not (run / "reward_servers").exists()
    ours = load_file(run / "lora" / "pytorch_lora_weights.safetensors")
    theirs = load_file(full_run / "lora" / "pytorch_lora_weights.safetensors")
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert any(float(v.abs().max()) > 0 for k, v in ours.items() if "lora_B" in k)  # trained, not the init
