"""consistency_score against a served judge killed mid-run: with on_failure: mask only the samples it did not
answer are masked (a cached answer survives), with raise the batch fails naming the endpoint. A real judge
process (the runs tier, `make test-runs`); the scoring itself is tests/rewards/test_consistency_reward.py's."""
import signal

import pytest

from paco_ds.errors import RewardError
from paco_ds.recipe.schema import RewardSet
from paco_ds.rewards.base import PartialRewardError
from paco_ds.rewards.runner import RewardRunner
from paco_ds.runtime import processes
from paco_ds.serving import manager
from test_consistency_reward import ITEMS, MODEL, _grids, _start

pytestmark = pytest.mark.runs


def test_server_killed_mid_run_raises_or_masks_only_the_affected_samples(tmp_path):
    state = _start(tmp_path)
    url = state["endpoints"][MODEL]
    kw = {"model": MODEL, "base_url": url, "top_logprobs": 267, "retry_budget": 4.0, "backoff": 0.1}
    try:
        runners = {policy: RewardRunner(RewardSet(terms={"consistency_score": kw}, on_failure=policy))
                   for policy in ("mask", "raise")}
        old, new = _grids(2, seed=11)
        prompt, meta = ITEMS[0]["prompt"], ITEMS[0]
        for runner in runners.values():
            assert runner.score([old], [prompt], [meta])["consistency_score"].valid.all()
        judge = state["servers"][0]
        assert processes.signal_if_same(judge["pid"], judge["start_time"], signal.SIGKILL)

        res = runners["mask"].score([old, new], [prompt] * 2, [meta] * 2)["consistency_score"]
        assert res.valid.tolist() == [True, False] and runners["mask"].failures == 1  # the cached one survives
        with pytest.raises(RewardError, match=f"reward server {url} \\(model '{MODEL}'\\)") as err:
            runners["raise"].score([old, new], [prompt] * 2, [meta] * 2)
        assert isinstance(err.value, PartialRewardError) and err.value.failed.tolist() == [False, True]
        for runner in runners.values():
            runner.close()
    finally:
        manager.stop(tmp_path)
