"""serve_reward.py start|status|stop and the manager: state in servers.json, readiness failures
reported with the server's log tail, no leaked or wrongly killed processes."""
import json
import socket
import subprocess

import httpx
import pytest

from conftest import one_line_error as _one_line_error, run_cli
from paco_ds.runtime import processes
from paco_ds.serving import manager
from paco_ds.recipe.servers import ServersConfig

pytestmark = pytest.mark.runs  # real server processes: make test-runs


def _cli(*args, timeout=180):
    return run_cli("launch/serve_reward.py", *args, timeout=timeout)


def test_cli_start_status_stop(tmp_path):
    run_dir = str(tmp_path / "servers")
    out = _cli("start", "--engine", "hf", "--tiny", "judge", "--port", "0", "--run-dir", run_dir)
    try:
        assert out.returncode == 0, out.stderr
        state = json.loads((tmp_path / "servers" / "servers.json").read_text())
        (server,) = state["servers"]
        assert server["name"] == "judge" and server["port"] > 0 and processes.alive(server["pid"])
        url = state["endpoints"]["judge"]
        assert f"model 'judge': base_url {url}" in out.stdout
        assert [m["id"] for m in httpx.get(f"{url}/models").json()["data"]] == ["judge"]
        status = _cli("status", "--run-dir", run_dir)
        assert status.returncode == 0 and "alive  health 200" in status.stdout, status.stdout
        again = _one_line_error(_cli("start", "--engine", "hf", "--tiny", "judge", "--port", "0", "--run-dir", run_dir))
        assert "still running" in again and str(server["pid"]) in again
    finally:
        stopped = _cli("stop", "--run-dir", run_dir)
    assert stopped.returncode == 0 and "stopped: judge" in stopped.stdout
    assert not processes.alive(server["pid"])
    assert "no reward servers recorded" in _one_line_error(_cli("status", "--run-dir", run_dir))


def test_a_server_that_dies_is_reported_with_its_log_tail(tmp_path):
    line = _one_line_error(_cli("start", "--engine", "hf", "--model", f"broken={tmp_path}/no_such_checkpoint",
                                "--port", "0", "--run-dir", str(tmp_path / "s")))
    assert "reward server 'broken' exited with code" in line and "broken.log" in line
    assert "no_such_checkpoint" in line  # the tail of the server's own log says what went wrong
    assert not (tmp_path / "s" / "servers.json").exists()


def test_readiness_timeout_stops_the_server(tmp_path):
    cfg = ServersConfig(engine="hf", models=[{"name": "slow", "tiny": True}], port=0, startup_timeout=0.5)
    with pytest.raises(manager.ServerError, match=r"'slow' was not ready on http://127.0.0.1:\d+ after 0.5s"):
        manager.start(cfg, tmp_path)
    assert not (tmp_path / "servers.json").exists()
    assert "--served-model-name slow" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_port_in_use_is_refused(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        line = _one_line_error(_cli("start", "--engine", "hf", "--tiny", "j", "--port", str(port),
                                    "--run-dir", str(tmp_path)))
    assert f"port {port} on 127.0.0.1 is already in use" in line


def test_stop_never_signals_a_recycled_pid(tmp_path):
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / "servers.json").write_text(json.dumps({"servers": [
            {"name": "old", "role": "engine", "url": "http://127.0.0.1:1", "pid": bystander.pid, "start_time": "1"}]}))
        assert manager.stop(tmp_path) == []
        assert bystander.poll() is None  # same pid, another process: left alone
    finally:
        bystander.kill()
        bystander.wait()


def test_servers_owned_by_a_run_start_and_stop_with_it(tmp_path):
    cfg = ServersConfig(engine="hf", models=[{"name": "judge", "tiny": True}], port=0)
    with manager.started_for_run(cfg, tmp_path, local_rank=0):
        url = manager.endpoints_for_run(cfg, tmp_path)["judge"]
        (server,) = manager.read_state(manager.run_state_dir(tmp_path))["servers"]
        assert "--exit-with-parent" in server["argv"]
        assert httpx.get(f"{url}/models").status_code == 200
    assert not processes.alive(server["pid"])
    assert manager.endpoints_for_run(None, tmp_path) == {}
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/models")


@pytest.mark.parametrize("text, says", [
    ('{"servers": [{"name": "judge", "role": "engine", "url": "http://127.0.0.1:1", "pi', "servers.json:1: not a reward-server state file"),
    ('[1, 2]', "expected a JSON object"),
    ('{"servers": [{"name": "judge", "role": "engine", "url": "u", "pid": "12"}]}', "servers[0].pid missing or not an integer"),
    ('{"servers": [{"name": "judge", "role": "engine", "url": "u", "pid": 1}]}', "servers[0].pid 1 is not a server's pid"),
])
def test_a_damaged_state_file_is_one_line_for_status_and_stop(tmp_path, text, says):
    (tmp_path / "servers.json").write_text(text)
    for command in ("status", "stop"):
        out = _cli(command, "--run-dir", str(tmp_path), timeout=60)
        assert out.returncode == 2, (command, out.stderr)
        line = _one_line_error(out)
        assert says in line and str(tmp_path / "servers.json") in line, line
    assert (tmp_path / "servers.json").read_text() == text  # kept for the user to look at
