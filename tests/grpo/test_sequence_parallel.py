"""parallel.sequence: 2 for real, on CPU ranks over gloo (paco_ds/models/sequence.py: diffusers'
Ulysses attention; paco_ds/runtime/sequence.py: the groups): 4 ranks, two groups of 2, train a tiny
recipe 2 epochs under ZeRO-3 and evaluate; each sample is scored and counted once. The same run
resumed from its epoch-1 checkpoint is in tests/grpo/test_sequence_probe.py (the sequence tier: one
4-process launch here is what the runs tier's time holds).
"""
import math

import pytest

from distributed_runs import SEQUENCE_GROUPS_RUN

pytestmark = pytest.mark.sequence


def test_two_sequence_groups_train_under_zero3_and_evaluate(runs):
    run = runs.get("sequence_parallel", *SEQUENCE_GROUPS_RUN, nproc=4).ok()
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
