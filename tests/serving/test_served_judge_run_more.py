"""A served hf judge killed under a run with on_failure: raise: the run stops naming the endpoint, in one
line. `make test-runs-more` (outside CI's time); CI holds the same stop against a killed vLLM judge
(tests/vllm_lane/test_vllm_train.py) and the masked case here (tests/serving/test_served_judge_run.py)."""
import pytest

from distributed_runs import finish
from test_served_judge_run import _kill_judge_after_first_epoch, _launch

pytestmark = pytest.mark.runs_more


def test_judge_killed_with_raise_stops_the_run_naming_the_endpoint(tmp_path):
    proc = _launch(tmp_path, "train.num_epochs=6", "rewards.train.on_failure=raise")
    url = _kill_judge_after_first_epoch(proc, tmp_path / "tiny_t2is")
    code = finish(proc, timeout=60)
    out = (tmp_path / "run.log").read_text()
    assert code != 0
    assert f"reward server {url} (model 'paco-reward-tiny')" in out and "connection failed" in out
    assert "Traceback" not in out  # a reward server failure is a user-facing one-liner
    # Stopped in the first epoch after the kill: one retry budget plus process teardown.
    lines = (tmp_path / "tiny_t2is" / "metrics.jsonl").read_text().strip().splitlines()
    assert len(lines) <= 2, lines
