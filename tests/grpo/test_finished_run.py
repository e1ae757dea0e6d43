"""A finished run exits 0 with its LoRA written: a short 2-rank run. `make test-runs-more` (outside CI's
time): every session's launches are checked for SIGABRT at exit (tests/conftest.py), and every run test of
CI's lanes asserts its own exit status."""
import pytest

from distributed_runs import run_trainer, tail
from test_train_runs import NO_JUDGE

pytestmark = pytest.mark.runs_more


def test_a_finished_run_exits_0(tmp_path):
    """A finished run once died at exit now and then ("terminate called without an active exception",
    SIGABRT, 250 from the launcher: a native worker thread destroyed during interpreter teardown). The
    entry points now end without teardown (paco_ds/errors.py run_entry_point): a short 2-rank run exits 0
    with its LoRA written. "Every time" is the session's to hold: tests/conftest.py fails any session in
    which a launch died of SIGABRT, and each lane makes dozens of launches."""
    proc = run_trainer(tmp_path / "run", "train.num_epochs=1", "sample.group_size=2", "sample.noise_steps=[1]",
                       "test.eval_freq=0", "checkpoint.save_freq=0", "logging.num_train_images=0",
                       "logging.tensorboard=false", *NO_JUDGE)
    assert "terminate called" not in proc.stderr, tail(proc)
    assert proc.returncode == 0, tail(proc)
    assert (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").is_file()
