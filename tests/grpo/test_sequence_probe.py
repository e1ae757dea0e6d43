"""parallel.sequence: 2 for real on 2 CPU ranks over gloo, one group (paco_ds/models/sequence.py:
diffusers' Ulysses attention): for FLUX.1, Qwen-Image, FLUX.2 dev, Wan2.1, Wan2.2-A14B (both experts
sharded) and Wan2.2-TI2V-5B (its per-token timesteps split with the video; tiny twins, 5-frame videos),
the velocity, the sampled latents and log-probs and the LoRA gradients of one trained micro-step (ZeRO-3 engine,
backpropagated as the trainer does) equal those of the unsharded transformer on one rank
(tests/scripts/sequence_probe.py). And the runs tier's two sequence groups of 4 ranks
(tests/grpo/test_sequence_parallel.py), resumed from their epoch-1 checkpoint under ZeRO-3, reproduce
their metrics. Its own tier, `make test-sequence`, outside CI's lanes: minutes of launches on 2 cores."""
import pytest

from distributed_runs import SEQUENCE_GROUPS_RUN, metrics, rank_probe, resume_copy, stable, tail

pytestmark = pytest.mark.sequence


def test_the_sharded_velocity_log_prob_and_lora_gradients_equal_the_unsharded_ones(tmp_path):
    results = rank_probe("sequence_probe.py", tmp_path, "sequence", timeout=600)
    for r in results:
        assert set(r["families"]) == {"flux", "qwen_image", "flux2", "wan", "wan22", "wan22_ti2v"}
        for family, d in r["families"].items():
            tokens = d["tokens"]  # the first attention saw this rank's half; preflight counts the same tokens
            assert 2 * tokens["sharded"] == tokens["full"] == tokens["preflight"], (family, tokens)
            assert d["velocity"] <= 1e-5 * d["velocity_scale"], (family, d)
            assert d["latents"] <= 1e-5 and d["log_prob"] <= 1e-5 * d["log_prob_scale"], (family, d)
            assert d["loss"] <= 1e-6, (family, d)
            # the group's gradient shares, averaged by DeepSpeed over the ranks, are the sample's gradient
            assert d["grad_scale"] > 0 and d["grad"] <= 1e-4 * d["grad_scale"], (family, d)
    assert results[0]["families"] == results[1]["families"]  # both ranks of the group hold the same


def test_two_sequence_groups_resume_exactly(runs, tmp_path):
    run = runs.get("sequence_parallel", *SEQUENCE_GROUPS_RUN, nproc=4).ok()  # the runs tier's run, cached
    resumed = resume_copy(run.dir, tmp_path / "resumed", "epoch_0001", *SEQUENCE_GROUPS_RUN, nproc=4)
    assert resumed.returncode == 0, tail(resumed)
    assert "resumed from" in resumed.stdout
    assert stable(metrics(tmp_path / "resumed")) == stable(run.metrics())
