"""rollout.mode: async launched for real on the tiny recipe: 1 sampler process and 2 ZeRO-3 trainer ranks
(3 processes). With max_staleness 0 it trains what the colocated run trains (the shared run of
tests/grpo/test_train.py, the same metrics epoch for epoch): the `runs` lane's one async launch. The
`async_runs` lane (`make test-async`, outside CI's lanes for their time: 3 launches) holds the rest: with
1 and 2 the samplers run ahead within the bound and the trainers correct; a resume restarts sampling
from the checkpoint's adapter version; a sampler killed mid-epoch stops the run with one line naming it
and leaves nothing running."""
import json
import os
import signal
import subprocess
import time

import psutil
import pytest

from distributed_runs import REPO, SHORT_RUN, cpu_env, launch_cmd, resume_copy, stable, tail

# each test declares its own tier: the k = 0 equality in `runs`, the others in `async_runs`

# the shared run of tests/grpo/test_train.py; the async run takes 2 of its 4 epochs (W&B aside), the judge
# served by the run scoring the sampler's batches as they finish
SHARED = ("train.num_epochs=4", "sample.group_size=4", "test.eval_freq=2", "checkpoint.save_freq=2",
          "checkpoint.keep_last=2", "logging.wandb.mode=offline")
ASYNC = ("rollout.mode=async", "rollout.samplers=1")


def _async_rows(run) -> list[dict]:
    rows = run.ok().epochs()
    assert [r["epoch"] for r in rows] == [0, 1], [r["epoch"] for r in rows]
    return rows


@pytest.mark.runs
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


# short runs: 2 epochs of 2 trained steps on jpeg compressibility alone (no judge)
SHORT = (*SHORT_RUN, *ASYNC, "sample.noise_steps=[0,1]")


@pytest.fixture(scope="module")
def stale2(runs):
    return runs.get("t2is_async_k2", *SHORT, "rollout.max_staleness=2", nproc=3)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A max_staleness 1 run whose sampler is killed (SIGKILL) once epoch 1 is trained, while the sampler
    samples epoch 2 or 3: (its directory, exit status, output, the killed pid, every process it had)."""
    tmp = tmp_path_factory.mktemp("killed")
    run_dir, out = tmp / "run", tmp / "out.txt"
    cmd = launch_cmd("launch/train.py", run_dir, *SHORT, "train.num_epochs=200", "rollout.max_staleness=1", nproc=3)
    with open(out, "w") as log:
        launcher = subprocess.Popen(cmd, cwd=REPO, env=cpu_env(), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # turns a hang into a failure; the event waited for is epoch 2's start
        latest = run_dir / "checkpoints" / "latest"
        while not (latest.is_file() and latest.read_text() >= "epoch_0002"):
            assert launcher.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.5)
        everything = psutil.Process(launcher.pid).children(recursive=True)
        sampler = [p for p in everything if "--local_rank=2" in p.cmdline()]
        assert len(sampler) == 1
        sampler[0].send_signal(signal.SIGKILL)
        code = launcher.wait(timeout=120)  # a run that hung on the dead sampler would time out here
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    return run_dir, code, out.read_text(), sampler[0].pid, everything


@pytest.mark.async_runs
def test_with_max_staleness_2_the_samplers_sample_an_epoch_ahead_and_the_trainers_correct(stale2):
    first, second = _async_rows(stale2)
    assert first["async/staleness_max"] == 0  # epoch 0 is sampled with the initial adapter, before any step
    # epoch 1 is sampled while epoch 0 trains: its first batch with version 0 (two optimizer steps stale), the
    # later ones with the newest version out when each starts
    assert (second["async/version_min"], second["async/staleness_max"]) == (0, 2)
    assert second["async/dropped_stale"] == 0 and 0 < second["async/proximal_forwards"] <= 2 * 8  # 2 steps x 8 samples
    assert 0 < second["async/behaviour_weight_mean"] <= 2.0
    assert second["train/ratio_first"] == 1.0  # pi / pi_prox at the epoch's first step: pi_prox is recomputed exactly
    assert second["train/grad_norm"] > 0 and second["train/loss"] == second["train/loss"]


@pytest.mark.async_runs
def test_with_max_staleness_1_the_samplers_wait_for_the_first_optimizer_step(killed):
    rows = [json.loads(l) for l in (killed[0] / "metrics.jsonl").read_text().splitlines() if l.strip()]
    epochs = [r for r in rows if "time/epoch" in r]
    assert [r["epoch"] for r in epochs[:2]] == [0, 1]
    assert all(r["async/staleness_max"] <= 1 and r["async/dropped_stale"] == 0 for r in epochs)
    # epoch 1 with version 1 once epoch 0's first optimizer step is out (2 if the sampler looked only after the second)
    assert epochs[1]["async/version_min"] >= 1 and epochs[1]["train/grad_norm"] > 0
    assert epochs[1]["train/ratio_first"] == 1.0


@pytest.mark.async_runs
def test_a_resume_samples_from_the_checkpointed_adapter_version(stale2, tmp_path):
    run_dir = tmp_path / "resumed"
    meta = json.loads((stale2.ok().dir / "checkpoints" / "epoch_0001" / "meta.json").read_text())
    assert meta["adapter_version"] == meta["global_step"] == 2
    resumed = resume_copy(stale2.dir, run_dir, "epoch_0001", *SHORT, "rollout.max_staleness=2", nproc=3)
    assert resumed.returncode == 0, tail(resumed)
    assert "resumed from" in resumed.stdout
    assert "1 sampler(s) sample from epoch 1 with adapter version 2" in resumed.stdout
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    epoch1 = [r for r in rows if r.get("epoch") == 1 and "time/epoch" in r]
    assert len(epoch1) == 1 and epoch1[0]["async/version_min"] == 2  # the uninterrupted run sampled it with 0
    assert stable(rows)[0] == stable(stale2.metrics())[0]  # epoch 0 as the run logged it


@pytest.mark.async_runs
def test_killing_the_sampler_mid_epoch_stops_the_run_with_one_line_and_nothing_left(killed):
    _, code, text, pid, everything = killed
    assert code != 0
    named = [l for l in text.splitlines() if f"rollout sampler 0 (rank 2, pid {pid}) ended" in l]
    assert len(named) == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    psutil.wait_procs(everything, timeout=30)
    assert not [p for p in everything if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
