"""parallel.sequence: 2 for real, on CPU ranks over gloo (paco_ds/models/sequence.py: diffusers'
Ulysses attention; paco_ds/runtime/sequence.py: the groups).

- 4 ranks, two groups of 2: a tiny recipe trains 2 epochs under ZeRO-3, evaluates, and a copy resumed
  from its epoch-1 checkpoint reproduces its metrics; each sample is scored and counted once.
"""
import math

import pytest

from distributed_runs import SHORT_RUN, metrics, resume_copy, stable, tail

pytestmark = pytest.mark.runs

# SHORT_RUN made small for 4 processes on 2 cores: one trained step of two, 32 px images (4 tokens), 16
# prompt tokens, an evaluation at the start and the end
SHARDED = (*SHORT_RUN, "parallel.sequence=2", "sample.num_steps=2", "sample.noise_steps=[0]", "train.resolution=32",
           "model.max_sequence_length=16", "sample.batch_size=2", "train.batch_size=2", "test.eval_freq=2",
           "test.resolution=32", "test.num_steps=2", "logging.tensorboard=false")


def test_two_sequence_groups_train_under_zero3_evaluate_and_resume_exactly(runs, tmp_path):
    run = runs.get("sequence_parallel", *SHARDED, nproc=4).ok()
    rows = run.epochs()
    assert [r["epoch"] for r in rows] == [0, 1]
    for r in rows:
        # 2 prompts x 4 images over the 2 groups: each sample scored and counted once, not once per rank
        assert r["adv/num_groups"] == 2 and r["adv/avg_group_size"] == 4
        assert r["sample/transformer_calls"] == 8 * 2
        assert r["train/ratio_first"] == 1.0 and r["train/forwards_per_step"] == 1.0
        assert r["train/grad_norm"] > 0 and r["train/skipped_optimizer_steps"] == 0
    evals = [r for r in run.metrics() if "eval/jpeg_compressibility/mean" in r]
    assert [r["epoch"] for r in evals] == [0, 2] and all(math.isfinite(r["eval/jpeg_compressibility/mean"])
                                                          for r in evals)
    resumed = resume_copy(run.dir, tmp_path / "resumed", "epoch_0001", *SHARDED, nproc=4)
    assert resumed.returncode == 0, tail(resumed)
    assert "resumed from" in resumed.stdout
    assert stable(metrics(tmp_path / "resumed")) == stable(run.metrics())
