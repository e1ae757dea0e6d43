"""A checkpoint written by an earlier layout of the package (tests/grpo/fixtures/pre_layout_run: the tiny
recipe's first epoch, saved by the code before the package root was sorted into rooms) resumes with
today's code and continues to the metrics that run logged for its second epoch. The checkpoint's files
are DeepSpeed's and torch's (their pickles name no paco_ds class), so a move of paco_ds's modules must
leave them readable."""
import json
import math
import shutil

import pytest

from distributed_runs import REPO, metrics, run_trainer, stable, tail

pytestmark = pytest.mark.runs_more  # make test-runs-more: outside CI's time

FIXTURE = REPO / "tests" / "grpo" / "fixtures" / "pre_layout_run"
# what the fixture's run was launched with (its config.yaml holds the whole recipe)
SETS = ("train.num_epochs=2", "sample.group_size=2", "test.eval_freq=0", "checkpoint.save_freq=1",
        "checkpoint.keep_last=2", "logging.num_train_images=0", "reward_servers=null",
        "rewards.train.terms={jpeg_compressibility: {weight: 1.0}}", "rewards.test=null")


def _close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7) or (math.isnan(a) and math.isnan(b))
    return a == b


def test_a_checkpoint_of_the_earlier_layout_resumes_to_its_own_run(tmp_path):
    run_dir = tmp_path / "resumed"
    shutil.copytree(FIXTURE, run_dir)
    saved = [json.loads(l) for l in (FIXTURE / "metrics.jsonl").read_text().splitlines() if l.strip()]
    proc = run_trainer(run_dir, *SETS, extra=("--resume", "latest"))
    assert proc.returncode == 0, tail(proc)
    assert "resumed from" in proc.stdout and "at epoch 1" in proc.stdout
    resumed, expected = stable(metrics(run_dir)), stable(saved)
    assert [r["epoch"] for r in resumed] == [r["epoch"] for r in expected] == [0, 1]
    second = next(r for r in resumed if r["epoch"] == 1)
    want = next(r for r in expected if r["epoch"] == 1)
    assert second.keys() == want.keys()
    differ = {k: (second[k], want[k]) for k in want if not _close(second[k], want[k])}
    assert not differ, differ
    assert (run_dir / "lora" / "pytorch_lora_weights.safetensors").is_file()
