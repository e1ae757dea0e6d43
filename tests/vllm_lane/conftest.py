"""The vLLM lane (make test-vllm): vLLM's CPU build in its own venv serves the tiny judge, the same
weights the hf engine serves, and the tests compare the two. PACO_VLLM_PYTHON names the venv's
interpreter; without it (plain `make test`) every test here is skipped with the reason.

One vLLM server is shared by the whole lane (its start-up takes minutes on 2 cores); the test that
kills it mid-run comes last (test_vllm_train.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
VLLM_PYTHON = os.environ.get("PACO_VLLM_PYTHON", "").strip()
JUDGE = "paco-reward-tiny"
VOCAB = 267  # the tiny judge's whole vocabulary: the random judge rarely ranks Yes/No in its top 20
# vLLM's multi-modal processor cache answered 500s ("cache drift") to repeated images on CPU; the
# rewards repeat images (each panel is in 3 pairs), so the lane's servers run without it.
VLLM_EXTRA = ["--mm-processor-cache-gb", "0"]
STARTUP_S = 900.0  # 2.5-3 min on an idle 2-core machine; several times that when it is busy


def vllm_available() -> str | None:
    """Why the lane cannot run here, or None."""
    if not VLLM_PYTHON:
        return "the vLLM lane needs vLLM's CPU build: run `make test-vllm` (PACO_VLLM_PYTHON is not set)"
    if not os.access(VLLM_PYTHON, os.X_OK):
        return f"PACO_VLLM_PYTHON={VLLM_PYTHON} is not an executable interpreter (make vllm-setup)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = vllm_available()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


def servers_config(engine: str, judge_dir: Path, **kw):
    from paco_ds.recipe.servers import ServersConfig

    if engine == "vllm":
        kw = {"device": "cpu", "vllm_python": VLLM_PYTHON, "max_model_len": 2048,
              "extra_args": list(VLLM_EXTRA), **kw}
    else:
        kw = {"device": "cpu", "dtype": "fp32", **kw}
    return ServersConfig(engine=engine, models=[{"name": JUDGE, "path": str(judge_dir)}], port=0,
                         max_logprobs=VOCAB, startup_timeout=STARTUP_S, **kw)


@pytest.fixture(scope="session")
def judge_dir(tmp_path_factory) -> Path:
    """The tiny judge as a checkpoint folder: both engines load these weights."""
    from paco_ds.models.tiny.qwen_vl import save_tiny_qwen2_5_vl

    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny_judge"))


@pytest.fixture(scope="session")
def vllm_server(judge_dir, tmp_path_factory):
    """{"url": OpenAI base URL, "state_dir": ..., "pid": ..., "start_time": ...} of the shared vLLM server."""
    from paco_ds.serving import manager

    state_dir = tmp_path_factory.mktemp("vllm_judge")
    try:
        state = manager.start(servers_config("vllm", judge_dir), state_dir)
        yield {"url": state["endpoints"][JUDGE], "state_dir": state_dir, "pid": state["servers"][0]["pid"],
               "start_time": state["servers"][0]["start_time"], "log": state["servers"][0]["log"]}
    finally:
        manager.stop(state_dir)


@pytest.fixture(scope="session")
def hf_server(judge_dir, tmp_path_factory):
    from paco_ds.serving import manager

    state_dir = tmp_path_factory.mktemp("hf_judge")
    try:
        yield manager.start(servers_config("hf", judge_dir), state_dir, exit_with_parent=True)["endpoints"][JUDGE]
    finally:
        manager.stop(state_dir)
