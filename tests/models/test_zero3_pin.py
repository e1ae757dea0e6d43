"""The rollout pin (paco_ds.runtime.engine.gathered_for_phase) against the installed DeepSpeed.

It relies on DeepSpeed's private per-parameter `ds_active_sub_modules`: a parameter listed as in
use by an active module is not released after a forward. These checks fail if an upgrade changes
that: parameters must stay gathered across all forwards of a phase and be released after it, and
GatheredParameters alone must (still) release them after a forward, which is why the pin exists.
Within the phase DeepSpeed's forward hooks are lifted (nothing is left for them to do, and a
compiled block must not trace them) and put back after it.
"""
import pytest

from distributed_runs import rank_probe

pytestmark = pytest.mark.runs_more  # make test-runs-more: outside CI's time


def test_pin_keeps_parameters_gathered_for_the_phase_and_releases_after(tmp_path):
    for r in rank_probe("pin_probe.py", tmp_path, "pin"):
        n = len(r["before"])
        assert all(r["partitioned"]), "every parameter is split over the 2 ranks"
        assert r["before"] == [False] * n, "released before the phase"
        assert r["pinned"] == [[True] * n] * 3, "gathered after every forward of the phase"
        assert r["after"] == [False] * n, "released after the phase"
        assert r["outputs_match"], "the pinned module computes what the engine computes"
        h = r["hooks"]  # ZeRO-3 puts 2 pre- and 2 post-forward hooks on every module, the engine 2 more on the root
        assert h["before"] >= 4 * h["modules"], h
        assert h["in_phase"] == 0, "DeepSpeed's hooks are lifted while the parameters are whole"
        assert h["after"] == h["before"], "and put back after the phase"
        # Without the pin the engine's hooks release parameters after a forward (else no pin is needed).
        assert not all(all(s) for s in r["unpinned"]), "GatheredParameters alone now keeps parameters gathered"
