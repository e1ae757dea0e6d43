"""tests/lanes.sh (`make test-all`, CI's run) and the skip policy of every lane: a lane whose tests all
skipped fails, a lane that needs root fails in CI without it, and every make target that runs pytest
declares the skips it allows (tests/conftest.py, "the skip policy")."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, skip_policy_verdict

pytestmark = pytest.mark.fast

LANES_SH = REPO / "tests" / "lanes.sh"
PYTEST_LANES = ("test", "test-runs", "test-runs-more", "test-stop", "test-stop-more", "test-plan", "test-plan-more", "test-video", "test-sequence", "test-vllm",
                "test-cluster", "test-cluster-more", "test-slurm", "test-slurm-more")
SET_UPS = ("setup", "vllm-setup", "triton36-setup", "cluster-test-setup", "slurm-test-setup")


def _fake_make(tmp_path: Path, body: str) -> Path:
    make = tmp_path / "make"
    make.write_text("#!/usr/bin/env bash\n" + body)
    make.chmod(0o755)
    return make


def _lanes(tmp_path: Path, env: dict) -> tuple[subprocess.CompletedProcess, dict]:
    base = {k: v for k, v in os.environ.items() if k not in ("CI", "PACO_LANES_UID", "PACO_VLLM_PYTHON", "MAKE",
                                                             "MAKEFLAGS", "MFLAGS", "PYTEST_ADDOPTS")}
    proc = subprocess.run(["bash", str(LANES_SH)], env={**base, "LANES_OUT": str(tmp_path / "out"), **env},
                          capture_output=True, text=True, timeout=600)
    table = json.loads((tmp_path / "out" / "lanes.json").read_text())
    return proc, table


def test_a_lane_whose_tests_all_skip_fails_and_so_does_the_run(tmp_path):
    """The real test-vllm recipe of the Makefile (its skip allowance included), without vLLM's venv: every
    test of tests/vllm_lane skips saying why, so pytest fails the lane and lanes.sh exits 1."""
    set_ups = " ".join(f"-o {t}" for t in SET_UPS)
    make = _fake_make(tmp_path, f'exec make {set_ups} VLLM_PY=/nonexistent/python "$@"\n')
    proc, table = _lanes(tmp_path, {"LANES": "test-vllm", "MAKE": str(make), "PYTEST_ADDOPTS": "tests/vllm_lane"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert " -m pytest -q -m vllm --allowed-skips=0" in out, out[-3000:]  # the Makefile's own recipe ran
    assert "skipped" in out and "skip policy: " in out, out[-3000:]
    assert table["test-vllm"]["status"] == "failed"


def test_the_side_venvs_install_after_the_fast_tier_and_before_the_lanes_that_need_them(tmp_path):
    """`make test` has both cores to itself; the side venvs (one make, in the background) start once
    it is done, and test-vllm and test-triton36 wait for them."""
    calls = tmp_path / "calls"
    make = _fake_make(tmp_path, f'echo "start $*" >> {calls}; [[ $1 == vllm-setup ]] && sleep 1; echo "end $*" >> {calls}\n')
    proc, table = _lanes(tmp_path, {"LANES": "test test-runs test-vllm test-triton36", "MAKE": str(make)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    order = calls.read_text().splitlines()
    assert order.index("end test") < order.index("start vllm-setup triton36-setup")  # beside test-runs, not test
    assert order.index("end vllm-setup triton36-setup") < order.index("start test-vllm")
    assert order.count("start vllm-setup triton36-setup") == 1
    assert all(table[lane]["status"] == "passed" for lane in ("test", "test-runs", "test-vllm", "test-triton36"))


@pytest.mark.parametrize("ci", [True, False])
def test_a_lane_that_needs_root_fails_in_ci_without_it(tmp_path, ci):
    calls = tmp_path / "calls"
    make = _fake_make(tmp_path, f'echo "$@" >> {calls}\n')
    env = {"LANES": "test-cluster test-slurm", "MAKE": str(make), "PACO_LANES_UID": "1000"}
    proc, table = _lanes(tmp_path, {**env, "CI": "true"} if ci else env)
    out = proc.stdout + proc.stderr
    assert not calls.exists()  # neither lane ran
    if ci:
        assert proc.returncode == 1, out
        assert [table[lane]["status"] for lane in ("test-cluster", "test-slurm")] == ["failed", "failed"]
        assert "make test-cluster FAILED: the two-node tests need root" in out and "CI runs every lane" in out
    else:  # on a machine of one's own, without root, they are skipped and say why
        assert proc.returncode == 0, out
        assert [table[lane]["status"] for lane in ("test-cluster", "test-slurm")] == ["skipped", "skipped"]
        assert "skipping make test-slurm: the two-node tests need root" in out


def test_every_pytest_lane_of_the_makefile_declares_its_skips():
    set_ups = [a for t in SET_UPS for a in ("-o", t)]
    for lane in PYTEST_LANES:
        for ci in ("true", ""):
            recipe = subprocess.run(["make", "-n", *set_ups, lane, f"CI={ci}"], cwd=REPO, capture_output=True,
                                    text=True, timeout=60, env={k: v for k, v in os.environ.items()
                                                                if k not in ("MAKEFLAGS", "MFLAGS")})
            assert recipe.returncode == 0, recipe.stderr
            line = next(l for l in recipe.stdout.splitlines() if " -m pytest " in l)
            assert re.search(r" --allowed-skips=\d+", line), (lane, line)
            if lane == "test" and ci:  # CI runs as root: the full-disk checks must mount their tmpfs there
                assert "tmpfs" not in line, line


@pytest.mark.parametrize("passed, skips, allowed, reasons, verdict", [
    (3, [], 0, [], None),
    (3, [("t::a", "the data file x not present")], 0, ["not present"], None),
    (3, [("t::a", "needs a GPU")], 1, [], None),
    (3, [("t::a", "needs a GPU"), ("t::b", "needs a GPU")], 1, [],
     "skip policy: 2 tests skipped for a reason this lane does not allow (at most 1); first: t::a: needs a GPU"),
    (0, [("t::a", "x")], 5, [], "skip policy: no test passed (1 skipped): a lane that tested nothing fails"),
    (0, [], 0, [], "skip policy: no test passed (0 skipped): a lane that tested nothing fails"),
])
def test_skip_policy_verdict(passed, skips, allowed, reasons, verdict):
    assert skip_policy_verdict(passed, skips, allowed, reasons) == verdict


def test_pytest_without_a_policy_is_unchanged():
    """The policy is on only where a lane asks for it (the lane above fails the same selection): a file run
    by hand whose tests all skip still exits 0."""
    env = {k: v for k, v in os.environ.items() if k not in ("PACO_VLLM_PYTHON", "PYTEST_ADDOPTS")}
    plain = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "vllm",
                            "tests/vllm_lane"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0 and "skip policy" not in plain.stdout, plain.stdout[-2000:]
    assert re.search(r"\d+ skipped", plain.stdout), plain.stdout[-2000:]
