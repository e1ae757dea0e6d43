"""parallel.sequence: 2 for real, on CPU ranks over gloo (paco_ds/models/sequence.py: diffusers'
Ulysses attention; paco_ds/runtime/sequence.py: the groups).

- 2 ranks, one group: for FLUX.1, Qwen-Image and FLUX.2 dev (tiny twins), the velocity, the sampled
  latents and log-probs and the LoRA gradients of one trained micro-step (ZeRO-3 engine, backpropagated
  as the trainer does) equal those of the unsharded transformer on one rank (tests/scripts/sequence_probe.py).
- 4 ranks, two groups of 2: a tiny recipe trains 2 epochs under ZeRO-3, evaluates, and a copy resumed
  from its epoch-1 checkpoint reproduces its metrics; each sample is scored and counted once.
"""
import math

import pytest

from distributed_runs import SHORT_RUN, metrics, rank_probe, resume_copy, stable, tail

pytestmark = pytest.mark.runs

# SHORT_RUN made small for 4 processes on 2 cores: one trained step of two, 32 px images (4 tokens), 16
# prompt tokens, an evaluation at the start and the end
SHARDED = (*SHORT_RUN, "parallel.sequence=2", "sample.num_steps=2", "sample.noise_steps=[0]", "train.resolution=32",
           "model.max_sequence_length=16", "sample.batch_size=2", "train.batch_size=2", "test.eval_freq=2",
           "test.resolution=32", "test.num_steps=2", "logging.tensorboard=false")


def test_the_sharded_velocity_log_prob_and_lora_gradients_equal_the_unsharded_ones(tmp_path):
    results = rank_probe("sequence_probe.py", tmp_path, "sequence", timeout=600)
    for r in results:
        assert set(r["families"]) == {"flux", "qwen_image", "flux2"}
        for family, d in r["families"].items():
            tokens = d["tokens"]  # the first attention saw this rank's half; preflight counts the same tokens
            assert 2 * tokens["sharded"] == tokens["full"] == tokens["preflight"], (family, tokens)
            assert d["velocity"] <= 1e-5 * d["velocity_scale"], (family, d)
            assert d["latents"] <= 1e-5 and d["log_prob"] <= 1e-5 * d["log_prob_scale"], (family, d)
            assert d["loss"] <= 1e-6, (family, d)
            # the group's gradient shares, averaged by DeepSpeed over the ranks, are the sample's gradient
            assert d["grad_scale"] > 0 and d["grad"] <= 1e-4 * d["grad_scale"], (family, d)
    assert results[0]["families"] == results[1]["families"]  # both ranks of the group hold the same


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
