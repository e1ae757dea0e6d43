"""A rank whose peer failed says so in one line: two ranks under the `deepspeed` launcher, for real (the runs
tier, `make test-runs`)."""
import pytest

from distributed_runs import free_port

pytestmark = pytest.mark.runs


def test_a_rank_whose_peer_failed_says_so_in_one_line_and_the_run_exits_with_the_peers_status():
    """Rank 0 fails with its own line (status 74) while rank 1 waits in a barrier: rank 1 reports
    the lost peer in one line, no traceback, and the launcher's status is rank 0's."""
    import subprocess

    from distributed_runs import REPO, cpu_env, deepspeed_cli

    cmd = [*deepspeed_cli(2, free_port()), str(REPO / "tests/scripts/peer_gone_probe.py")]
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=300)
    err = proc.stderr
    assert proc.returncode == 74, err[-3000:]
    assert "probe: error: rank 0 failed on purpose" in err, err[-3000:]
    lost = [l for l in err.splitlines() if "probe: error: rank 1: another rank of this run ended" in l]
    assert len(lost) == 1 and "gloo: Connection" in lost[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
