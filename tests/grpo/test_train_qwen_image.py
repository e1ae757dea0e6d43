"""Qwen-Image text-to-image-set GRPO for real: the tiny recipe as shipped (PaCo-GRPO's 2x2 sets, the
consistency judge served by the run) on 2 ZeRO-3 CPU processes under the deepspeed launcher, two
epochs, then resumed from its epoch-1 checkpoint (in a copy of its directory): it must reproduce its
own metrics exactly."""
import math

import pytest

from distributed_runs import REPO, metrics, resume_copy, run_trainer, stable, tail

pytestmark = pytest.mark.runs

RECIPE = REPO / "configs/tiny/qwen_image_t2is.yaml"
SHORT = ("train.num_epochs=2", "sample.group_size=4", "test.eval_freq=0", "checkpoint.save_freq=1",
         "checkpoint.keep_last=2", "logging.num_train_images=0", "logging.tensorboard=false")
FIELDS = ["reward/consistency_score/mean", "reward/subfig_clipT/mean", "reward/pickscore/mean", "train/loss",
          "train/grad_norm"]


def test_tiny_qwen_image_t2is_trains_on_two_zero3_ranks_and_resumes_exactly(tmp_path):
    full = tmp_path / "full"
    proc = run_trainer(full, *SHORT, config=RECIPE)
    assert proc.returncode == 0, tail(proc)
    rows = [r for r in metrics(full) if "time/epoch" in r]
    assert [r["epoch"] for r in rows] == [0, 1]
    for r in rows:
        assert all(k in r and math.isfinite(r[k]) for k in FIELDS), [k for k in FIELDS if k not in r]
        assert r["train/ratio_first"] == 1.0  # log-probs at training equal those at sampling
        assert r["train/forwards_per_step"] == 1.0  # no guidance, beta = 0: one forward per trained step
    assert rows[1]["train/grad_norm"] > 0
    assert (full / "lora" / "pytorch_lora_weights.safetensors").is_file()

    resumed = resume_copy(full, tmp_path / "resumed", "epoch_0001", *SHORT, config=RECIPE)
    assert resumed.returncode == 0, tail(resumed)
    assert "resumed from" in resumed.stdout
    assert stable(metrics(tmp_path / "resumed")) == stable(metrics(full))
