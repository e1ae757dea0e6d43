"""Stops beyond `make test-stop`'s (CI's): the launcher killed by SIGKILL, reward SFT on a full disk, a
preemption while an epoch trains (DiffusionNFT's inner epochs) and one during evaluation, each resumed.
`make test-stop-more`, outside CI's time (7 launches, about 5 min of 2 cores); run it for a change to paco_ds/runtime/stopping.py,
preemption.py, storage.py or the trainer's and SFT's save paths. Real processes, as tests/grpo/test_stop.py."""
import re
import signal
import threading

import pytest

from distributed_runs import REPO, deepspeed_cli, metrics, run_trainer, stable, tail
from paco_ds.runtime.checkpoint import verify
from test_stop import (NO_JUDGE, SHORT, _cleanup, _descendants, _fill_the_disk_after, _latest, _no_traceback, _start,
                       signal_the_launcher_alone)

pytestmark = pytest.mark.stop_more


def test_a_sigkill_of_the_launcher_stops_every_rank_and_judge(tmp_path):
    """The launcher's death by SIGKILL (no handler runs): its guard stops both ranks, the judge and W&B's
    service within 30 s, and the last checkpoint verifies (tests/grpo/test_stop.py's SIGTERM case)."""
    signal_the_launcher_alone(tmp_path, signal.SIGKILL)


def test_reward_sft_on_a_full_disk_names_a_file_of_its_run(tmp_path):
    """The same for reward SFT: DeepSpeed copies its zero_to_fp32.py into each checkpoint, and a
    copy that fails names its source (inside DeepSpeed's package) first; the line names the file
    in the run directory."""
    disk = tmp_path / "disk"
    disk.mkdir()
    run_dir = disk / "tiny_reward_sft"
    sft = [*deepspeed_cli(2), str(REPO / "launch/sft.py"),
           "--config", str(REPO / "configs/tiny/reward_sft.yaml"), "--set", f"output_dir={disk}",
           "--set", "train.num_epochs=200", "--set", "eval.at_start=false"]
    code, _, err = _fill_the_disk_after(sft, disk, run_dir, "step_")
    assert code == 74, err[-4000:]
    assert "sft: error: " in err and "no space left on device writing " + str(run_dir) in err, err[-4000:]
    assert "site-packages" not in err.split("sft: error: ", 1)[1].splitlines()[0]
    _no_traceback(err)


def _preempt_on_progress(launcher, bar: str, past: float) -> tuple[str, list[tuple[int, int]]]:
    """Run `launcher` to its end; SIGTERM every rank once the progress bar `bar` shows more than
    `past` of its total. (its stderr, every (n, total) the bar showed)."""
    progress = re.compile(re.escape(bar) + r":\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)")
    err_text, seen, signalled = [], [], threading.Event()

    def watch():  # tqdm redraws its line after \r: read characters, match the line being drawn
        line = ""
        while ch := launcher.stderr.read(1):
            err_text.append(ch)
            line = "" if ch in "\r\n" else line + ch
            if ch == " " and (m := progress.search(line)):  # a space follows the n/total it drew
                seen.append((int(m.group(1)), int(m.group(2))))
                if not signalled.is_set() and seen[-1][0] > past * seen[-1][1]:
                    for r in _descendants(launcher.pid):
                        if any(a.startswith("--local_rank=") for a in r.cmdline()):
                            r.send_signal(signal.SIGTERM)
                    signalled.set()

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    try:
        launcher.wait(timeout=600)
        reader.join(10)
    finally:
        _cleanup(launcher, [])
    err = "".join(err_text)
    assert signalled.is_set(), f"the '{bar}' bar never passed {past:.0%}: {err[-3000:]}"
    return err, seen


def test_preemption_mid_training_resumes_to_the_uninterrupted_run(tmp_path):
    """A SIGTERM while epoch 0 trains, in its second inner epoch (DiffusionNFT, whose noise
    depends on how often each sample and step was visited this epoch): the checkpoint keeps the
    epoch's rollouts, the micro-steps done, the gradients accumulated and the loss's own state;
    --resume latest ends with the uninterrupted run's metrics exactly."""
    sets = ("train.num_epochs=1", "checkpoint.save_freq=1", "checkpoint.save_on_sigterm=true", "train.loss=nft",
            "train.num_inner_epochs=2", *SHORT, *NO_JUDGE)
    reference = run_trainer(tmp_path / "reference", *sets)
    assert reference.returncode == 0, tail(reference)

    run_dir = tmp_path / "preempted"
    launcher = _start(run_dir, *sets)
    err, _ = _preempt_on_progress(launcher, "epoch 0 train", 0.6)
    assert launcher.returncode == 75, err[-3000:]
    saved = _latest(run_dir)
    assert saved.startswith("epoch_0000_step_"), saved  # mid-epoch: the rollouts and the steps done are kept
    verify(run_dir / "checkpoints" / saved)

    resumed = run_trainer(run_dir, *sets, extra=("--resume", "latest"))
    assert resumed.returncode == 0, tail(resumed)
    assert stable(metrics(run_dir)) == stable(metrics(tmp_path / "reference"))


def test_preemption_during_evaluation_ends_it_and_saves(tmp_path):
    """Evaluation can take minutes on a real test set, longer than a scheduler's grace: a SIGTERM
    ends it at the next batch, and the ranks save the epoch's start together (exit 75)."""
    prompts = (REPO / "paco_ds" / "data" / "prompts" / "tiny_t2is_train.jsonl").read_text().splitlines()
    test_file = tmp_path / "test.jsonl"
    test_file.write_text("\n".join(prompts * 2) + "\n")  # 16 prompts: 8 per rank, one per batch
    sets = ("train.num_epochs=1", "checkpoint.save_freq=1", "checkpoint.save_on_sigterm=true", "test.eval_freq=1",
            "test.batch_size=1", f"data.test_file={test_file}", "sample.group_size=4", "logging.num_train_images=0",
            *NO_JUDGE)
    run_dir = tmp_path / "run"
    launcher = _start(run_dir, *sets)
    err, seen = _preempt_on_progress(launcher, "eval", 0.1)
    assert launcher.returncode == 75, err[-3000:]
    assert seen[-1][0] < seen[-1][1], seen  # it ended early: not every prompt was evaluated
    assert _latest(run_dir) == "epoch_0000"
    verify(run_dir / "checkpoints" / "epoch_0000")
    resumed = run_trainer(run_dir, *sets, extra=("--resume", "latest"))
    assert resumed.returncode == 0, tail(resumed)
    rows = metrics(run_dir)
    assert [r["epoch"] for r in rows] == [0, 1] and "eval/jpeg_compressibility/mean" in rows[0]
