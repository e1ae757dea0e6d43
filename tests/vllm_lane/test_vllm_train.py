"""Tiny GRPO runs (2 ZeRO-3 processes on CPU) scored by the lane's one vLLM server (started through the
manager with the vLLM engine, as a recipe's `reward_servers.engine: vllm` starts it; one start-up of
minutes instead of two). The first run ends with exit 0 and logs the consistency reward; in the
second, the server is killed after the first epoch: the run stops, naming the endpoint, as it does
with the hf engine. That kill ends the shared server, so this file runs last."""
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO
from distributed_runs import finish, metrics, rank_launcher

from paco_ds.runtime import processes
from paco_ds.serving.manager import free_port

from .conftest import JUDGE, VLLM_PYTHON, VOCAB

pytestmark = pytest.mark.vllm

RECIPE = REPO / "configs" / "tiny" / "t2is_vllm.yaml"
BUDGET = 3.0  # seconds of retries per request (a loaded 2-core machine can take a second to answer)


def _launch(tmp_path, *sets, recipe=RECIPE):
    args = [*rank_launcher(2, free_port()), str(REPO / "launch/train.py"),
            "--config", str(recipe), "--set", f"output_dir={tmp_path}", "--set", "test.eval_freq=0",
            "--set", "checkpoint.save_freq=0", "--set", "logging.num_train_images=0",
            "--set", "sample.group_size=4", "--set", "sample.noise_steps=[1]"]  # 8 samples, 1 trained step
    for s in sets:
        args += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PACO_VLLM_PYTHON": VLLM_PYTHON}
    log = (tmp_path / "run.log").open("w")
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def test_a_run_scored_by_vllm_trains_and_logs_the_consistency_reward(tmp_path, vllm_server):
    url = vllm_server["url"]
    terms = (f"{{consistency_score: {{weight: 1.0, model: {JUDGE}, base_url: '{url}', top_logprobs: {VOCAB}}}, "
             "jpeg_compressibility: {weight: 1.0}}")
    proc = _launch(tmp_path, "train.num_epochs=2", f"rewards.train.terms={terms}", "reward_servers=null")
    code = finish(proc, timeout=900)
    out = (tmp_path / "run.log").read_text()
    assert code == 0, out[-4000:]
    assert "vllm" in Path(vllm_server["log"]).read_text().lower()  # the judge was vLLM's server
    rows = metrics(tmp_path / "tiny_t2is_vllm")
    assert [r["epoch"] for r in rows] == [0, 1]
    for r in rows:
        mean = r["reward/consistency_score/mean"]
        assert math.isfinite(mean) and 0 < mean < 1, r
        assert r["reward/failures"] == 0 and r["reward/masked"] == 0


def test_vllm_judge_killed_mid_run_stops_the_run_naming_the_endpoint(tmp_path, vllm_server):
    """The recipe scores against the lane's vLLM server (a judge the run did not start); SIGKILL it
    after the first epoch's metrics. Runs last: the shared server is gone afterwards."""
    url = vllm_server["url"]
    terms = (f"{{consistency_score: {{weight: 1.0, model: {JUDGE}, base_url: '{url}', top_logprobs: {VOCAB}, "
             f"retry_budget: {BUDGET}, backoff: 0.1}}}}")
    proc = _launch(tmp_path, "train.num_epochs=6", "rewards.train.on_failure=raise", f"rewards.train.terms={terms}",
                   "reward_servers=null")
    run_dir, deadline = tmp_path / "tiny_t2is_vllm", time.monotonic() + 600
    metrics_file = run_dir / "metrics.jsonl"
    while not (metrics_file.is_file() and metrics_file.read_text().strip()):
        assert proc.poll() is None, (tmp_path / "run.log").read_text()[-4000:]
        assert time.monotonic() < deadline, "no epoch within the time limit"
        time.sleep(0.2)
    # the API server and its engine process (its group), while the pid is still that server's
    assert processes.signal_group_if_same(vllm_server["pid"], vllm_server["start_time"], signal.SIGKILL)
    code = finish(proc, timeout=180)
    out = (tmp_path / "run.log").read_text()
    assert code != 0
    assert f"reward server {url} (model '{JUDGE}')" in out and "connection failed" in out, out[-4000:]
    assert "Traceback" not in out  # a reward server failure is a user-facing one-liner
    assert len(metrics(run_dir)) <= 2  # stopped in the epoch after the kill
