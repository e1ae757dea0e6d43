"""The gateway in front of two real hf-engine servers (different weights): routing by model,
merged model list, health, and the errors it answers itself (400, 401, 404, 413, 502, 504)."""
import base64
import io
import os
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from conftest import REPO
from paco_ds.models.tiny.qwen_vl import save_tiny_qwen2_5_vl
from paco_ds.serving import manager
from paco_ds.recipe.servers import ServersConfig

pytestmark = pytest.mark.runs  # real server processes: make test-runs

TOKEN_ENV, TOKEN = "PACO_TEST_GATEWAY_TOKEN", "gw-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _uri(seed):
    im = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (48, 48, 3), dtype=np.uint8))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _body(model, images=2):
    content = [{"type": "image_url", "image_url": {"url": _uri(i)}} for i in range(images)]
    return {"model": model, "messages": [{"role": "user", "content": content + [{"type": "text", "text": "Same?"}]}],
            "max_tokens": 1, "logprobs": True, "top_logprobs": 267}


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    ckpt = save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("judge_b"), seed=1)
    os.environ[TOKEN_ENV] = TOKEN
    state_dir = tmp_path_factory.mktemp("gateway")
    cfg = ServersConfig(engine="hf", models=[{"name": "judge-a", "tiny": True}, {"name": "judge-b", "path": str(ckpt)}],
                        layout="gateway", port=0, backend_base_port=0, max_logprobs=267, max_body_mb=1,
                        api_key_env=TOKEN_ENV, startup_timeout=120)
    try:
        state = manager.start(cfg, state_dir, exit_with_parent=True)
        yield {"gateway": state["endpoints"]["judge-a"],
               **{s["name"]: s["url"] for s in state["servers"] if s["role"] == "engine"}}
    finally:
        manager.stop(state_dir)
        os.environ.pop(TOKEN_ENV, None)


def _completed(backend_url):
    return httpx.get(f"{backend_url}/stats", headers=AUTH).json().get("completed", 0)


def _top(resp):
    return {t["token"]: t["logprob"] for t in resp.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}


def test_routes_each_model_to_its_backend(group):
    gw = group["gateway"]
    assert gw != f"{group['judge-a']}/v1"
    answers = {}
    for model in ("judge-a", "judge-b"):
        before = {m: _completed(group[m]) for m in ("judge-a", "judge-b")}
        r = httpx.post(f"{gw}/chat/completions", json=_body(model), headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        after = {m: _completed(group[m]) for m in ("judge-a", "judge-b")}
        assert {m: after[m] - before[m] for m in after} == {m: int(m == model) for m in after}
        direct = httpx.post(f"{group[model]}/v1/chat/completions", json=_body(model), headers=AUTH, timeout=60)
        assert _top(r) == _top(direct)
        answers[model] = _top(r)
    assert answers["judge-a"] != answers["judge-b"]  # different weights: the routing is visible in the answer


def test_merged_models_and_health(group):
    gw = group["gateway"]
    models = httpx.get(f"{gw}/models", headers=AUTH).json()
    assert sorted(m["id"] for m in models["data"]) == ["judge-a", "judge-b"]
    health = httpx.get(gw.removesuffix("/v1") + "/health")
    assert health.status_code == 200 and set(health.json()["backends"].values()) == {"ok"}


@pytest.mark.parametrize("kind, status, expect", [
    ("unknown", 404, "model 'judge-c' is not served by this gateway; served: judge-a, judge-b"),
    ("missing", 400, "no 'model' field"),
    ("malformed", 400, "malformed JSON"),
    ("images", 400, "request has 3 images; this server accepts at most 2"),
    ("oversized", 413, "exceeds the limit"),
    ("token", 401, "bearer token"),
])
def test_gateway_rejects_bad_requests_itself(group, kind, status, expect):
    gw = group["gateway"]
    before = [_completed(group[m]) for m in ("judge-a", "judge-b")]
    post = lambda **kw: httpx.post(f"{gw}/chat/completions", timeout=30, **kw)
    if kind == "unknown":
        r = post(json=_body("judge-c"), headers=AUTH)
    elif kind == "missing":
        r = post(json={k: v for k, v in _body("judge-a").items() if k != "model"}, headers=AUTH)
    elif kind == "malformed":
        r = post(content=b"{not json", headers=AUTH)
    elif kind == "images":
        r = post(json=_body("judge-a", images=3), headers=AUTH)
    elif kind == "oversized":
        r = post(content=b"x" * (2 << 20), headers=AUTH)
    else:
        r = post(json=_body("judge-a"))
    assert r.status_code == status and expect in r.json()["error"]["message"], r.text
    assert [_completed(group[m]) for m in ("judge-a", "judge-b")] == before  # never reached a backend


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_backend_is_502_and_silent_one_is_504(tmp_path):
    silent = socket.socket()  # accepts connections (kernel backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    dead, port = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "paco_ds.serving.gateway", "--port", str(port), "--timeout", "1",
           "--backend", f"dead=http://127.0.0.1:{dead}", "--backend", f"silent=http://127.0.0.1:{silent.getsockname()[1]}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(TOKEN_ENV, None)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.get(f"{url}/")
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        r = httpx.post(f"{url}/v1/chat/completions", json=_body("dead"), timeout=30)
        assert r.status_code == 502 and f"backend http://127.0.0.1:{dead} for model 'dead' is unreachable" in r.text
        r = httpx.post(f"{url}/v1/chat/completions", json=_body("silent"), timeout=30)
        assert r.status_code == 504 and "timed out" in r.text  # the gateway's 1 s timeout, not the client's 30 s
        assert httpx.get(f"{url}/health", timeout=30).status_code == 503
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        silent.close()
