"""The gateway in front of vLLM: two models behind one port, `paco-reward-tiny` on the shared vLLM
server and `paco-reward-tiny-hf` on an hf engine with the same weights. Each request reaches the
backend its model names (the gateway's per-model counts), answers as that backend answers
directly, and the two models' rewards through the gateway agree (same weights, two engines)."""
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from conftest import REPO
from paco_ds.rewards.registry import build_reward
from paco_ds.serving import manager

from .conftest import JUDGE, VOCAB, servers_config

pytestmark = pytest.mark.vllm

HF_NAME = "paco-reward-tiny-hf"


@pytest.fixture(scope="module")
def gateway(vllm_server, judge_dir, tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("hf_b")
    cfg = servers_config("hf", judge_dir).model_copy(update={"models": [
        servers_config("hf", judge_dir).models[0].model_copy(update={"name": HF_NAME})]})
    hf = manager.start(cfg, state_dir, exit_with_parent=True)["endpoints"][HF_NAME]
    port = manager.free_port()
    routes = {JUDGE: vllm_server["url"].removesuffix("/v1"), HF_NAME: hf.removesuffix("/v1")}
    argv = [sys.executable, "-m", "paco_ds.serving.gateway", "--port", str(port), "--exit-with-parent",
            *[a for name, url in routes.items() for a in ("--backend", f"{name}={url}")]]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the gateway did not come up"
            time.sleep(0.5)
        yield {"url": url, "routes": routes}
    finally:
        proc.terminate()
        proc.wait(30)
        manager.stop(state_dir)


def _body(model, seed):
    from paco_ds.rewards.consistency import data_uri

    rng = np.random.default_rng(seed)
    ims = [Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)) for _ in range(2)]
    return {"model": model, "max_tokens": 1, "logprobs": True, "top_logprobs": VOCAB, "temperature": 0,
            "messages": [{"role": "user", "content": [
                *[{"type": "image_url", "image_url": {"url": data_uri(im, "png")}} for im in ims],
                {"type": "text", "text": "Same?"}]}]}


def _top(r) -> list[tuple[str, float]]:
    """The first token's top logprobs in rank order (a list: byte tokens that are not whole UTF-8
    characters share one text, '' from vLLM)."""
    assert r.status_code == 200, r.text
    return [(t["token"], t["logprob"]) for t in r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]]


def test_routes_two_models_one_of_them_vllm(gateway):
    gw, routes = gateway["url"], gateway["routes"]
    listed = {m["id"] for m in httpx.get(f"{gw}/v1/models", timeout=30).json()["data"]}
    assert listed == {JUDGE, HF_NAME}
    ranked = {}
    for model in (JUDGE, HF_NAME):
        before = httpx.get(f"{gw}/stats", timeout=30).json()
        routed = httpx.post(f"{gw}/v1/chat/completions", json=_body(model, 1), timeout=300)
        after = httpx.get(f"{gw}/stats", timeout=30).json()
        assert {m: after.get(f"{m}/requests", 0) - before.get(f"{m}/requests", 0) for m in routes} == \
            {m: int(m == model) for m in routes}
        assert routed.json()["model"] == model
        direct = httpx.post(f"{routes[model]}/v1/chat/completions", json=_body(model, 1), timeout=300)
        assert _top(routed) == _top(direct)  # the backend's own answer, untouched
        ranked[model] = _top(routed)
    assert len(ranked[JUDGE]) == len(ranked[HF_NAME]) == VOCAB  # the whole vocabulary, from vLLM too
    answers = {m: dict(r) for m, r in ranked.items()}  # "Yes" and "No" are whole tokens: one entry each
    p = {m: np.exp(answers[m]["Yes"]) / (np.exp(answers[m]["Yes"]) + np.exp(answers[m]["No"])) for m in answers}
    assert p[JUDGE] == pytest.approx(p[HF_NAME], abs=1e-6)
    r = httpx.post(f"{gw}/v1/chat/completions", json=_body("nobody", 1), timeout=30)
    assert r.status_code == 404 and "not served by this gateway" in r.text


def test_rewards_through_the_gateway_agree_across_engines(gateway):
    rng = np.random.default_rng(5)
    images = [Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)) for _ in range(2)]
    prompts = ["A 2x2 grid of a red fox in four seasons."] * 2
    scores = {}
    for model in (JUDGE, HF_NAME):
        r = build_reward("consistency_score", {"model": model, "base_url": f"{gateway['url']}/v1",
                                               "top_logprobs": VOCAB})
        try:
            res = r(images, prompts, [{}, {}])
        finally:
            r.close()
        assert res.valid.all()
        scores[model] = res.scores
    np.testing.assert_allclose(scores[JUDGE], scores[HF_NAME], rtol=0, atol=1e-6)
