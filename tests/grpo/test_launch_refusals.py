"""Launches refused with exit code 2 before they train, beyond CI's lanes (`make test-runs-more`): a PPO
checkpoint resumed under DiffusionNFT (its old policy is missing), and a real launch whose LoRA target
matches nothing (the fast tier's dry runs check every family's targets through the same check)."""
import pytest

from conftest import one_line_error, run_cli
from distributed_runs import TINY, metrics, resume_copy, tail
from test_train_runs import FAST, full_run  # noqa: F401 (the shared run, as tests/grpo/test_train_runs.py asks for it)

pytestmark = pytest.mark.runs_more


def test_a_ppo_checkpoint_resumed_under_nft_is_refused_naming_the_missing_state(full_run, tmp_path):
    """--allow-changed lets the loss change past the recipe check; the checkpoint still has no NFT
    old policy, so the resume stops before step 1 instead of starting NFT from a wrong reference."""
    run_dir = tmp_path / "nft"
    resumed = resume_copy(full_run, run_dir, "epoch_0002", *FAST, "train.loss=nft",
                          extra=("--allow-changed", "train.loss"))
    assert resumed.returncode == 2, tail(resumed)
    assert "the checkpoint lacks the nft loss's 'old' state, which this run needs" in resumed.stderr, tail(resumed)
    assert "Traceback" not in resumed.stderr
    assert metrics(run_dir) == metrics(full_run)  # the copy's log untouched: nothing was trained or dropped


def test_a_run_with_a_target_that_matches_nothing_exits_2_naming_the_key(tmp_path):
    out = run_cli("launch/train.py", "--config", str(TINY), "--set", "model.lora.target_modules=[attn.to_q, ff.net.9]",
                  "--set", f"output_dir={tmp_path}", timeout=300)
    line = one_line_error(out)
    assert "config key 'model.lora.target_modules'" in line and "'ff.net.9'" in line
    assert not list(tmp_path.rglob("checkpoints"))  # it stopped before training
