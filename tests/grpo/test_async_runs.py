"""rollout.mode: async launched for real on the tiny recipe: 1 sampler process and 2 ZeRO-3 trainer ranks
(3 processes). With max_staleness 0 it trains what the colocated run trains (the shared run of
tests/grpo/test_train.py, the same metrics epoch for epoch); with 1 and 2 the samplers run ahead within
the bound and the trainers correct; a resume restarts sampling from the checkpoint's adapter version;
a sampler killed mid-epoch stops the run with one line naming it and leaves nothing running."""
import json
import os
import signal
import subprocess
import time

import psutil
import pytest

from distributed_runs import REPO, SHORT_RUN, cpu_env, launch_cmd, resume_copy, stable, tail

pytestmark = pytest.mark.runs

# the shared run of tests/grpo/test_train.py; the async run takes 2 of its 4 epochs (W&B aside), the judge
# served by the run scoring the sampler's batches as they finish
SHARED = ("train.num_epochs=4", "sample.group_size=4", "test.eval_freq=2", "checkpoint.save_freq=2",
          "checkpoint.keep_last=2", "logging.wandb.mode=offline")
ASYNC = ("rollout.mode=async", "rollout.samplers=1")


def _async_rows(run) -> list[dict]:
    rows = run.ok().epochs()
    assert [r["epoch"] for r in rows] == [0, 1], [r["epoch"] for r in rows]
    return rows


@pytest.fixture(scope="module")
def stale2(runs):
    return runs.get("t2is_async_k2", *SHORT_RUN, *ASYNC, "rollout.max_staleness=2", nproc=3)


def test_with_max_staleness_0_the_async_run_trains_what_the_colocated_run_trains(runs):
    colocated = runs.get("t2is_full", *SHARED, script="tests/scripts/train_probe.py").ok()
    run = runs.get("t2is_async_k0", "train.num_epochs=2", *SHARED[1:5], *ASYNC, "rollout.max_staleness=0", nproc=3)
    rows = _async_rows(run)
    for mine, theirs in zip(stable(rows), stable(colocated.epochs()[:2])):
        assert {k: mine.get(k) for k in theirs} == theirs  # every metric of the colocated epoch, equal
        assert mine["async/staleness_max"] == 0 and mine["async/proximal_forwards"] == 0
        assert mine["async/dropped_stale"] == 0
    assert rows[0]["reward/consistency_score/mean"] == rows[0]["reward/consistency_score/mean"]  # the judge scored
    assert [r["async/version_min"] for r in rows] == [0, 2]  # each epoch sampled with the adapter that trains it


@pytest.mark.parametrize("k", [1, 2])
def test_the_samplers_run_ahead_within_max_staleness_and_the_trainers_correct(runs, stale2, k):
    run = stale2 if k == 2 else runs.get("t2is_async_k1", *SHORT_RUN, *ASYNC, "rollout.max_staleness=1", nproc=3)
    rows = _async_rows(run)
    assert all(r["async/staleness_max"] <= k and r["async/dropped_stale"] == 0 for r in rows)
    first, second = rows
    assert first["async/staleness_max"] == 0  # epoch 0 is sampled with the initial adapter, before any step
    # epoch 1 is sampled while epoch 0 trains: its first batch with version 0 at once (k = 2), or (k = 1) with
    # version 1 once epoch 0's first optimizer step is out (2 if the sampler looked only after the second)
    assert (second["async/version_min"], second["async/staleness_max"]) == (0, 2) if k == 2 else \
        second["async/version_min"] >= 1
    if second["async/staleness_max"] > 0:
        assert second["async/proximal_forwards"] > 0 and 0 < second["async/behaviour_weight_mean"] <= 2.0
    assert second["train/ratio_first"] == 1.0  # pi / pi_prox at the epoch's first step: pi_prox is recomputed exactly
    assert second["train/grad_norm"] > 0 and second["train/loss"] == second["train/loss"]


def test_a_resume_samples_from_the_checkpointed_adapter_version(stale2, tmp_path):
    run_dir = tmp_path / "resumed"
    meta = json.loads((stale2.ok().dir / "checkpoints" / "epoch_0001" / "meta.json").read_text())
    assert meta["adapter_version"] == meta["global_step"] == 2
    resumed = resume_copy(stale2.dir, run_dir, "epoch_0001", *SHORT_RUN, *ASYNC, "rollout.max_staleness=2", nproc=3)
    assert resumed.returncode == 0, tail(resumed)
    assert "resumed from" in resumed.stdout
    assert "1 sampler(s) sample from epoch 1 with adapter version 2" in resumed.stdout
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    epoch1 = [r for r in rows if r.get("epoch") == 1 and "time/epoch" in r]
    assert len(epoch1) == 1 and epoch1[0]["async/version_min"] == 2  # the uninterrupted run sampled it with 0
    assert stable(rows)[0] == stable(stale2.metrics())[0]  # epoch 0 as the run logged it


def test_killing_the_sampler_mid_epoch_stops_the_run_with_one_line_and_nothing_left(tmp_path):
    run_dir, out = tmp_path / "killed", tmp_path / "out.txt"
    cmd = launch_cmd("launch/train.py", run_dir, *SHORT_RUN, *ASYNC, "train.num_epochs=200", "rollout.max_staleness=1",
                     nproc=3)
    with open(out, "w") as log:
        launcher = subprocess.Popen(cmd, cwd=REPO, env=cpu_env(), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    try:
        deadline = time.monotonic() + 300  # turns a hang into a failure; the event waited for is epoch 1's start
        latest = run_dir / "checkpoints" / "latest"
        while not (latest.is_file() and latest.read_text() >= "epoch_0001"):
            assert launcher.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.5)
        everything = psutil.Process(launcher.pid).children(recursive=True)
        sampler = [p for p in everything if "--local_rank=2" in p.cmdline()]
        assert len(sampler) == 1
        sampler[0].send_signal(signal.SIGKILL)
        assert launcher.wait(timeout=120) != 0  # a run that hung on the dead sampler would time out here
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    text = out.read_text()
    named = [l for l in text.splitlines() if f"rollout sampler 0 (rank 2, pid {sampler[0].pid}) ended" in l]
    assert len(named) == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    psutil.wait_procs(everything, timeout=30)
    assert not [p for p in everything if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
