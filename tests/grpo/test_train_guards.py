"""Single-process runs of the trainer: non-finite losses and rewards (a LoRA target that matches nothing:
tests/grpo/test_launch_refusals.py, `make test-runs-more`).
The switches that must not change what trains (the KL path, the kernel backends, gradient checkpointing)
are tests/grpo/test_train_switches.py's (`make test-runs-more`)."""
import math
import subprocess
import sys

import pytest


from distributed_runs import REPO, TINY, cpu_env, free_port, metrics, tail

pytestmark = pytest.mark.runs

# One process, one epoch of 2 prompts x 4 images trained on one noised step, no judge server.
ONE_EPOCH = ("train.num_epochs=1", "test.eval_freq=0", "checkpoint.save_freq=0", "logging.num_train_images=0",
             "logging.tensorboard=false", "sample.group_size=4", "sample.noise_steps=[1]", "reward_servers=null",
             "rewards.train.terms={jpeg_compressibility: {weight: 1.0}, subfig_clipT: {weight: 1.0, tiny: true}}")


def _env(run_dir):
    return cpu_env(OMP_NUM_THREADS="2", MASTER_PORT=str(free_port()))


def _fault(mode, run_dir, *sets):
    args = [sys.executable, str(REPO / "tests/scripts/fault_probe.py"), mode, str(TINY),
            f"output_dir={run_dir.parent}", f"run_name={run_dir.name}", *sets]
    return subprocess.run(args, cwd=REPO, env=_env(run_dir), capture_output=True, text=True, timeout=300)


def _train(run_dir, *sets):
    args = [sys.executable, str(REPO / "launch/train.py"), "--config", str(TINY)]
    for s in (f"output_dir={run_dir.parent}", f"run_name={run_dir.name}", *sets):
        args += ["--set", s]
    return subprocess.run(args, cwd=REPO, env=_env(run_dir), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def faults_run(tmp_path_factory):
    """Two epochs with every fault training survives (tests/scripts/fault_probe.py 'faults'): NaN rewards
    for the first batch scored (masked: on_failure mask; with raise a batch with no valid score stops the
    run), a NaN gradient at the first micro-step, NaN losses at the 2nd and 3rd."""
    run_dir = tmp_path_factory.mktemp("faults") / "faults"
    proc = _fault("faults", run_dir, *ONE_EPOCH, "train.num_epochs=2", "rewards.train.on_failure=mask")
    assert proc.returncode == 0, tail(proc)
    return run_dir, proc, [r for r in metrics(run_dir) if "time/epoch" in r]


def test_nonfinite_losses_are_skipped_counted_and_training_goes_on(faults_run):
    _, _, rows = faults_run
    assert [r["train/nonfinite_steps"] for r in rows] == [2.0, 0.0]
    assert all(math.isfinite(r["train/grad_norm"]) for r in rows)  # NaN never reached the weights
    assert rows[1]["global_step"] == 4


def test_a_skipped_optimizer_step_is_counted_and_training_goes_on(faults_run):
    # a finite loss whose gradient is NaN: ZeRO-3 skips that optimizer step (seen on a GPU, where every
    # step of a bf16 run was skipped while the metrics looked like training)
    _, proc, rows = faults_run
    assert [r["train/skipped_optimizer_steps"] for r in rows] == [1.0, 0.0]
    assert "optimizer step was skipped" in proc.stderr


def test_nonfinite_rewards_are_masked_not_zeroed(faults_run):
    _, _, rows = faults_run
    assert rows[0]["reward/masked"] == rows[0]["adv/masked"] > 0 and rows[1]["reward/masked"] == 0
    assert math.isfinite(rows[0]["reward/jpeg_compressibility/mean"])  # computed over the valid samples only


def test_several_nonfinite_losses_in_a_row_stop_the_run(tmp_path):
    proc = _fault("diverge", tmp_path / "div", *ONE_EPOCH, "train.max_consecutive_nonfinite=3")
    assert proc.returncode == 3, tail(proc)
    lines = [l for l in proc.stderr.splitlines() if l.startswith("train: error:")]
    assert len(lines) == 1 and "3 non-finite" in lines[0] and "train.max_consecutive_nonfinite=3" in lines[0]
    assert "Traceback" not in proc.stderr


def test_optimizer_steps_skipped_in_a_row_stop_the_run(tmp_path):
    proc = _fault("nan_grad", tmp_path / "g", *ONE_EPOCH, "train.num_epochs=3", "train.max_consecutive_nonfinite=3")
    assert proc.returncode == 3, tail(proc)
    lines = [l for l in proc.stderr.splitlines() if l.startswith("train: error:")]
    assert len(lines) == 1 and "3 optimizer steps in a row" in lines[0], lines
    assert "Traceback" not in proc.stderr
