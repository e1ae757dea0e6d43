"""A stop stops everything; a preemption saves first. Real processes: the deepspeed launcher,
2 ZeRO-3 CPU ranks, and (for the stop) the judge server the run starts.

DeepSpeed's runner forwards signals only for multi-node launches, so a SIGTERM to the `deepspeed`
process alone (what `kill`, a scheduler or a supervisor does) used to leave both ranks and the
judge training on. Each test signals only the named process, never a process group.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from distributed_runs import (REPO, cpu_env, launch_cmd, metrics, run_trainer, stable, tail,
                              wandb_env)
from wandb_records import (exit_code, history, numbers, offline_runs, run_record, wandb_processes,
                           was_marked_preempting)
from paco_ds.runtime.checkpoint import verify

pytestmark = pytest.mark.stop

NO_JUDGE = ("reward_servers=null", "rewards.train.terms={jpeg_compressibility: {weight: 1.0}}")
SHORT = ("sample.group_size=4", "test.eval_freq=0", "logging.num_train_images=0", "checkpoint.keep_last=3")
# The tiny judge's vocabulary bounds the log-probs it can return.
JUDGE = ("reward_servers.max_logprobs=256", "rewards.train.terms.consistency_score.top_logprobs=256")
STOP_BOUND_S = 30  # the promise: every rank and judge gone within 30 s of the stop


def _start(run_dir, *sets):
    return subprocess.Popen(launch_cmd("launch/train.py", run_dir, *sets, cli=True), cwd=REPO, env=cpu_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(cond, launcher, what, timeout=300):
    deadline = time.monotonic() + timeout
    while not cond():
        assert launcher.poll() is None, f"the run ended before {what}: {launcher.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout}s"
        time.sleep(0.3)


def _latest(run_dir):
    p = run_dir / "checkpoints" / "latest"
    return p.read_text().strip() if p.is_file() else ""


def _descendants(pid):
    return [p for p in psutil.Process(pid).children(recursive=True)]


def _judge_pids(run_dir):
    states = list((run_dir / "reward_servers").glob("*/servers.json"))
    return [s["pid"] for f in states for s in json.loads(f.read_text())["servers"]]


def _running(p):
    try:  # an orphan that exited may stay a zombie where nothing reaps it: it runs nothing
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _gone_within(procs, seconds):
    """(all gone?, the ones still running after `seconds`)."""
    deadline = time.monotonic() + seconds
    while (alive := [p for p in procs if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not alive, alive


def _cleanup(launcher, procs):
    for p in procs:
        with_suppress(p.kill)
    if launcher.poll() is None:
        with_suppress(lambda: os.killpg(launcher.pid, signal.SIGKILL))
    launcher.communicate(timeout=30)


def with_suppress(fn):
    try:
        fn()
    except (ProcessLookupError, psutil.Error, PermissionError):
        pass


def test_a_sigterm_to_the_launcher_alone_stops_every_rank_and_judge(tmp_path):
    """SIGTERM to the `deepspeed` pid (the runner has no handler on one node): both ranks, the judge and
    W&B's service are gone within 30 s, the launcher's status is non-zero, and `latest` names a complete
    checkpoint that no later write touched. (The launcher's death by SIGKILL: tests/grpo/test_stop_more.py.)"""
    signal_the_launcher_alone(tmp_path, signal.SIGTERM)


def signal_the_launcher_alone(tmp_path, sig):
    """Start the tiny run with its judge and W&B, send `sig` to the launcher's pid alone once epoch 1 is
    checkpointed, and check that every rank, judge and service is gone within STOP_BOUND_S and the run
    directory's last checkpoint verifies and stays as it was."""
    run_dir = tmp_path / "run"
    launcher = _start(run_dir, "train.num_epochs=200", "checkpoint.save_freq=1", "logging.wandb.mode=offline",
                      *SHORT, *JUDGE)
    procs = []
    try:
        _wait_for(lambda: _latest(run_dir) >= "epoch_0001", launcher, "checkpoint epoch_0001")
        procs = _descendants(launcher.pid) + [psutil.Process(p) for p in _judge_pids(run_dir)]
        ranks = [p for p in procs if any(a.startswith("--local_rank=") for a in p.cmdline())]
        judges = [p for p in procs if "paco_ds.serving.hf_engine" in p.cmdline()]
        assert len(ranks) == 2 and judges, [p.cmdline()[:4] for p in procs]
        assert [p for p in procs if "wandb-core" in p.cmdline()[0]]  # W&B's service must go too
        os.kill(launcher.pid, sig)  # the launcher alone: no process group
        assert launcher.wait(timeout=STOP_BOUND_S) != 0
        gone, alive = _gone_within(procs, STOP_BOUND_S)
        assert gone, f"still running {STOP_BOUND_S}s after the stop: {[p.cmdline()[:4] for p in alive]}"
    finally:
        _cleanup(launcher, procs)
    latest = run_dir / "checkpoints" / _latest(run_dir)
    verify(latest)  # every file as recorded when it was published
    epochs_logged = len(metrics(run_dir))
    time.sleep(2)
    assert len(metrics(run_dir)) == epochs_logged  # nothing writes into the stopped run any more


def test_preemption_saves_and_resumes_to_the_uninterrupted_run(tmp_path):
    """checkpoint.save_on_sigterm: a SIGTERM to every rank (as a scheduler sends it) mid-epoch:
    the ranks finish the micro-step, save together and exit 75; --resume latest then ends with
    the metrics of the run that was never interrupted, every epoch, exactly."""
    sets = ("train.num_epochs=3", "checkpoint.save_freq=2", "checkpoint.save_on_sigterm=true", *SHORT, *NO_JUDGE,
            "logging.wandb.mode=offline")
    reference = run_trainer(tmp_path / "reference", *sets)
    assert reference.returncode == 0, tail(reference)

    run_dir = tmp_path / "preempted"
    launcher = _start(run_dir, *sets)
    procs = []
    try:
        # Mid-epoch 1: epoch 0's metrics are written, epoch 1 has begun training or sampling.
        _wait_for(lambda: (run_dir / "metrics.jsonl").is_file() and len(metrics(run_dir)) >= 1, launcher,
                  "epoch 0's metrics")
        procs = _descendants(launcher.pid)
        ranks = [p for p in procs if any(a.startswith("--local_rank=") for a in p.cmdline())]
        services = [p for p in procs if "wandb-core" in p.cmdline()[0] or "wandb-symon" in p.cmdline()[0]]
        assert len(ranks) == 2 and services
        for r in ranks:
            r.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)
        assert launcher.returncode == 75, err[-3000:]
        assert not [p for p in services if _running(p)]  # rank 0 stopped them before it exited
    finally:
        _cleanup(launcher, procs)
    assert "stop requested: SIGTERM; saving a checkpoint first" in err
    saved = _latest(run_dir)
    assert saved.startswith("epoch_0001"), saved  # this epoch's state, not the one before
    verify(run_dir / "checkpoints" / saved)
    assert len(metrics(run_dir)) == 1  # epoch 1 is not logged: it is finished after the resume
    # what a requeue decides on: the marker names the checkpoint (the launcher's own status may be 143)
    marker = json.loads((run_dir / "PREEMPTED").read_text())
    assert marker["checkpoint"].endswith(saved) and "SIGTERM" in marker["reason"]

    resumed = run_trainer(run_dir, *sets, extra=("--resume", "latest"), env=wandb_env(tmp_path / "wandb_home"))
    assert resumed.returncode == 0, tail(resumed)
    assert f"resumed from {run_dir / 'checkpoints' / saved}" in resumed.stdout
    assert stable(metrics(run_dir)) == stable(metrics(tmp_path / "reference"))
    assert not (run_dir / "PREEMPTED").exists()  # training again cleared it
    # W&B: the preempted run finished as such (75), then continued by the resume (a requeue's
    # `--resume latest`) under the same id; both segments hold the run's metrics once each.
    assert not wandb_processes(("WANDB_CONFIG_DIR", str(tmp_path / "wandb_home" / "config")))
    first, second = offline_runs(run_dir)
    assert run_record(first).run_id == run_record(second).run_id and run_record(second).resume
    assert (exit_code(first), was_marked_preempting(first), exit_code(second)) == (75, True, 0)
    assert sorted(history(first)) == [0] and sorted(history(second)) == [1, 2]
    wandb_rows = {**history(first), **history(second)}
    assert [wandb_rows[r["epoch"]] for r in metrics(run_dir)] == [numbers(r) for r in metrics(run_dir)]


# A run that cannot write any more stops with one line naming the path (paco_ds/runtime/storage.py).
VERIFY_LATEST = ("import json, sys; from pathlib import Path; from paco_ds.runtime.checkpoint import verify; "
                 "root = Path(sys.argv[1]) / 'checkpoints'; tag = (root / 'latest').read_text().strip(); "
                 "verify(root / tag); print('VERIFIED', tag)")


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err, err[-4000:]


def _fill_the_disk_after(cmd: list[str], disk: Path, run_dir: Path, checkpoint: str, after: str = "",
                         ) -> tuple[int, str, str]:
    """Run `cmd` with `disk` a 64 MiB tmpfs of its own (a private mount namespace, so the host's
    disk never fills); once `run_dir`'s `latest` reaches `checkpoint`, fill that disk to the last
    byte. `after` runs in the namespace once `cmd` has ended. Returns (status, stdout, stderr)."""
    script = f'mount -t tmpfs -o size=64m tmpfs "$1" || exit 99; shift; "$@"; rc=$?; {after} exit $rc'
    shell = subprocess.Popen(["unshare", "-m", "sh", "-c", script, "sh", str(disk), *cmd], cwd=REPO,
                             env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    view = Path(f"/proc/{shell.pid}/root{run_dir}")  # the run directory as seen inside its namespace
    try:
        _wait_for(lambda: _latest(view) >= checkpoint, shell, f"checkpoint {checkpoint}")
        with open(view.parent / "filler", "wb") as fh:
            try:
                while True:
                    fh.write(b"\0" * (1 << 20))
                    fh.flush()
            except OSError:
                pass
        out, err = shell.communicate(timeout=240)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.communicate(timeout=30)
    return shell.returncode, out, err


def test_a_full_disk_mid_run_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """The run directory on a disk of its own that the test fills once a checkpoint is published:
    the run ends naming the file it could not write, and `latest` still names a checkpoint whose
    every file verifies."""
    disk = tmp_path / "disk"
    disk.mkdir()
    run_dir = disk / "run"
    train = launch_cmd("launch/train.py", run_dir, "train.num_epochs=200", "checkpoint.save_freq=1", *SHORT, *NO_JUDGE,
                       cli=True)
    code, out, err = _fill_the_disk_after(train, disk, run_dir, "epoch_0001",
                                          after=f'{sys.executable} -c "{VERIFY_LATEST}" "{run_dir}";')
    assert code == 74, err[-4000:]
    assert "train: error: " in err and "no space left on device writing " + str(run_dir) in err, err[-4000:]
    _no_traceback(err)
    assert "VERIFIED epoch_" in out, (out[-2000:], err[-2000:])


def test_a_run_directory_deleted_mid_run_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    launcher = _start(run_dir, "train.num_epochs=200", "checkpoint.save_freq=1", *SHORT, *NO_JUDGE)
    try:
        _wait_for(lambda: _latest(run_dir) >= "epoch_0001", launcher, "checkpoint epoch_0001")
        shutil.rmtree(run_dir, ignore_errors=True)
        _, err = launcher.communicate(timeout=240)
    finally:
        _cleanup(launcher, [])
    assert launcher.returncode == 74, err[-4000:]
    assert f"train: error: the run directory {run_dir} was deleted while the run was writing to it" in err, err[-4000:]
    _no_traceback(err)
