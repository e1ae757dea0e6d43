"""Reward SFT under ZeRO-2 (the recipes' default is ZeRO-3, which tests/sft/test_sft_train.py trains):
one epoch on 2 ranks lowers the evaluation loss and exports the adapter. `make test-runs-more` (outside
CI's time); run it for a change to SFT's engine or checkpointing."""
import pytest

from test_sft_train import deepspeed_sft, metrics

pytestmark = pytest.mark.runs_more


def test_zero2_runs_too(tmp_path):
    deepspeed_sft(tmp_path, "deepspeed.zero_stage=2", "train.num_epochs=1", "eval.at_start=true",
                  "checkpoint.every_epochs=0")
    rows = metrics(tmp_path / "tiny_reward_sft")
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0]
    assert not (tmp_path / "tiny_reward_sft" / "checkpoints").exists()
    assert (tmp_path / "tiny_reward_sft" / "adapter" / "adapter_model.safetensors").is_file()
