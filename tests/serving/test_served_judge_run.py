"""The tiny T2IS recipe with the consistency judge served by the run itself (2 ZeRO-3 processes on
CPU): the judge server is killed after the first epoch. With on_failure: raise the run stops
within the retry budget naming the endpoint; with mask it finishes and counts what it masked. And a run
colocated with its judge sleeps it for training and wakes it for scoring."""
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import REPO, TINY
from distributed_runs import finish, rank_launcher

from paco_ds.runtime import processes
from paco_ds.serving import manager
from paco_ds.serving.manager import free_port

pytestmark = pytest.mark.runs

BUDGET = 3.0  # seconds of retries per request (a loaded 2-core machine can take a second to answer)


def _launch(tmp_path, *sets):
    consistency = ("{consistency_score: {weight: 1.0, model: paco-reward-tiny, top_logprobs: 267, "
                   f"retry_budget: {BUDGET}, backoff: 0.1}}}}")
    args = [*rank_launcher(2, free_port()), str(REPO / "launch/train.py"), "--config", str(TINY),
            "--set", f"output_dir={tmp_path}",
            "--set", f"rewards.train.terms={consistency}", "--set", "test.eval_freq=0",
            "--set", "checkpoint.save_freq=0", "--set", "logging.num_train_images=0",
            "--set", "sample.group_size=4", "--set", "sample.noise_steps=[1]"]  # 8 samples, 1 trained step
    for s in sets:
        args += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    log = (tmp_path / "run.log").open("w")
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _kill_judge_after_first_epoch(proc, run_dir, timeout=240):
    """Wait for epoch 0's metrics, then SIGKILL the judge server; returns its base URL."""
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert proc.poll() is None, "the run ended before its first epoch"
        assert time.monotonic() < deadline, "no epoch within the time limit"
        time.sleep(0.2)
    (state_file,) = (run_dir / "reward_servers").glob("*/servers.json")
    state = json.loads(state_file.read_text())
    judge = state["servers"][0]
    assert processes.signal_if_same(judge["pid"], judge["start_time"], signal.SIGKILL)  # the judge, not a newcomer
    return state["endpoints"]["paco-reward-tiny"]


def test_judge_killed_with_mask_trains_on_and_counts_the_masked_samples(tmp_path):
    proc = _launch(tmp_path, "train.num_epochs=3", "rewards.train.on_failure=mask",
                   "train.max_consecutive_nonfinite=10")
    _kill_judge_after_first_epoch(proc, tmp_path / "tiny_t2is")
    code = finish(proc, timeout=120)
    out = (tmp_path / "run.log").read_text()
    assert code == 0, out[-3000:]
    rows = [json.loads(l) for l in (tmp_path / "tiny_t2is" / "metrics.jsonl").read_text().splitlines() if l.strip()]
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    assert rows[0]["reward/masked"] == 0 and rows[0]["reward/failures"] == 0
    samples = 2 * 4  # prompts per epoch x group size
    assert rows[-1]["reward/masked"] == samples  # the last epoch had no judge at all
    assert rows[-1]["reward/failures"] >= samples  # cumulative over ranks and epochs
    assert "reward 'consistency_score' failed on" in out and "(masked)" in out


def test_tiny_run_colocated_sleeps_the_judge_for_training(tmp_path):
    """2 ZeRO-3 ranks on CPU, 2 epochs, evaluation after the last: epoch 0 sleeps the judge (it starts
    awake), epoch 1 wakes and sleeps it, the final evaluation wakes it."""
    args = [*rank_launcher(2, manager.free_port()), str(REPO / "launch/train.py"), "--config", str(TINY)]
    for s in (f"output_dir={tmp_path}", "train.num_epochs=2", "test.eval_freq=2", "checkpoint.save_freq=0",
              "logging.num_train_images=0", "sample.group_size=4", "sample.noise_steps=[1]",
              "cluster.colocate=true"):
        args += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    r = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rows = [json.loads(l) for l in (tmp_path / "tiny_t2is" / "metrics.jsonl").read_text().splitlines() if l.strip()]
    by_epoch = {}
    for row in rows:
        by_epoch.setdefault(row["epoch"], {}).update(row)
    assert [by_epoch[e]["judge/sleeps"] for e in (0, 1)] == [1.0, 1.0]
    assert [by_epoch[e]["judge/wakes"] for e in (0, 1, 2)] == [0.0, 1.0, 1.0]
    assert by_epoch[1]["judge/wake_s"] > 0 and by_epoch[0]["judge/sleep_s"] > 0
    assert all(by_epoch[e]["reward/consistency_score/mean"] == by_epoch[e]["reward/consistency_score/mean"]
               for e in (0, 1))  # scored (not NaN) every epoch: the judge was awake when it mattered
    print({e: {k: v for k, v in m.items() if k.startswith("judge/")} for e, m in by_epoch.items()})
