"""The built-in transformers engine, served for real on loopback from a tiny Qwen2.5-VL checkpoint
saved to a temp dir: OpenAI-schema logprobs equal to the in-process model's, dynamic batching
that does not change results, and the limits (image count, body size, bearer token)."""
import base64
import io
import math
import os
import threading

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from paco_ds.models.tiny.qwen_vl import save_tiny_qwen2_5_vl, tiny_qwen2_5_vl
from paco_ds.serving import manager
from paco_ds.recipe.servers import ServersConfig
from paco_ds.serving.hf_engine import Engine
from paco_ds.serving.protocol import ChatCompletionRequest

pytestmark = pytest.mark.fast

TOKEN_ENV, TOKEN = "PACO_TEST_ENGINE_TOKEN", "test-token-123"
MODEL = "paco-tiny"
QUESTION = "Do the two images show the same subject? Answer Yes or No."


def _image(seed, size=64):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def _uri(im):
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _content(images, text=QUESTION):
    return [*({"type": "image_url", "image_url": {"url": _uri(im)}} for im in images), {"type": "text", "text": text}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny_qwen"))


STARTED: dict = {}  # the module's server state (its pid), for tests that watch the process


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    os.environ[TOKEN_ENV] = TOKEN
    state_dir = tmp_path_factory.mktemp("engine")
    cfg = ServersConfig(engine="hf", models=[{"name": MODEL, "path": str(ckpt)}], port=0, max_logprobs=267,
                        max_body_mb=1, api_key_env=TOKEN_ENV, startup_timeout=120)
    try:
        state = manager.start(cfg, state_dir, exit_with_parent=True)
        STARTED.update(state)
        yield state["endpoints"][MODEL]
    finally:
        manager.stop(state_dir)
        os.environ.pop(TOKEN_ENV, None)


@pytest.fixture(scope="module")
def local(ckpt):
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt).eval(), AutoProcessor.from_pretrained(ckpt)


def _client(url):
    return openai.OpenAI(base_url=url, api_key=TOKEN, max_retries=0)


def _local_inputs(local, images, text=QUESTION):
    model, proc = local
    msgs = [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]}]
    prompt = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return proc(text=[prompt], images=images, return_tensors="pt")


def test_two_images_logprobs_match_the_in_process_model(server, local):
    images = [_image(1), _image(2, size=96)]
    resp = _client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": _content(images)}], temperature=0.0,
        max_completion_tokens=1, logprobs=True, top_logprobs=267)
    assert resp.object == "chat.completion" and resp.model == MODEL
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and len(choice.logprobs.content) == 1
    first = choice.logprobs.content[0]
    top = {t.token: t.logprob for t in first.top_logprobs}
    lps = [t.logprob for t in first.top_logprobs]
    assert lps == sorted(lps, reverse=True) and first.logprob == pytest.approx(lps[0])  # greedy
    assert first.token == first.top_logprobs[0].token and bytes(first.bytes) == first.token.encode()

    model, proc = local
    inputs = _local_inputs(local, images)
    with torch.no_grad():
        want = model(**inputs).logits[0, -1].float().log_softmax(-1)
    yes, no = proc.tokenizer.convert_tokens_to_ids("Yes"), proc.tokenizer.convert_tokens_to_ids("No")
    p_server = 1 / (1 + math.exp(top["No"] - top["Yes"]))
    p_local = torch.sigmoid(want[yes] - want[no]).item()
    assert abs(p_server - p_local) < 1e-5
    assert abs(top["Yes"] - want[yes].item()) < 1e-5 and abs(top["No"] - want[no].item()) < 1e-5
    assert resp.usage.prompt_tokens == inputs["input_ids"].shape[1] and resp.usage.completion_tokens == 1


def test_greedy_tokens_up_to_max_tokens(server, local):
    images = [_image(3), _image(4)]
    resp = _client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": _content(images)}], temperature=0, max_tokens=4,
        logprobs=True, top_logprobs=2)
    model, proc = local
    with torch.no_grad():
        inputs = _local_inputs(local, images)
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    tokens = [c.token for c in resp.choices[0].logprobs.content]
    want = [proc.tokenizer.convert_tokens_to_string([proc.tokenizer.convert_ids_to_tokens(int(t))]) for t in out]
    assert tokens == want[:len(tokens)] and len(tokens) >= 1
    assert all(len(c.top_logprobs) == 2 for c in resp.choices[0].logprobs.content)
    assert resp.choices[0].finish_reason == ("length" if len(tokens) == 4 else "stop")


def _first_logprobs(url, images, text):
    r = httpx.post(f"{url}/chat/completions", headers={"authorization": f"Bearer {TOKEN}"}, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": _content(images, text)}], "temperature": 0,
        "max_tokens": 1, "logprobs": True, "top_logprobs": 267})
    assert r.status_code == 200, r.text
    return {t["token"]: t["logprob"] for t in r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}


def test_concurrent_requests_are_batched_without_changing_results(server):
    jobs = [([_image(10 + i, size=48 + 16 * (i % 3)), _image(20 + i)], "Same? " * (1 + i % 4)) for i in range(8)]
    sequential = [_first_logprobs(server, ims, text) for ims, text in jobs]
    stats = lambda: httpx.get(server.removesuffix("/v1") + "/stats", headers={"authorization": f"Bearer {TOKEN}"}).json()
    before = stats()
    concurrent = [None] * len(jobs)
    barrier = threading.Barrier(len(jobs))

    def worker(i):
        barrier.wait()
        concurrent[i] = _first_logprobs(server, *jobs[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = stats()
    assert after["completed"] - before["completed"] == len(jobs)
    assert after["batches"] - before["batches"] < len(jobs) and after["max_batch"] > 1  # really batched
    # the server's own time on them: the model's wall seconds, and the CPU seconds preparing the requests
    assert after["generate_s"] > before.get("generate_s", 0) and after["prepare_cpu_s"] > before.get("prepare_cpu_s", 0)
    for s, c in zip(sequential, concurrent):
        assert s.keys() == c.keys()
        assert max(abs(s[k] - c[k]) for k in s) < 1e-5


def test_engine_batch_equals_single_requests():
    model, proc = tiny_qwen2_5_vl()
    engine = Engine(model, proc, max_model_len=4096)
    reqs = [ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": _content(ims, text)}],
                                  max_tokens=3, logprobs=True, top_logprobs=5)
            for ims, text in [([_image(1, 32), _image(2, 80)], "a"), ([_image(3)], "a longer question " * 5),
                              ([_image(4, 56), _image(5, 56)], "Same?")]]
    prepared = [engine.prepare(r, max_logprobs=20) for r in reqs]
    batched = engine.generate(prepared)
    for p, b in zip(prepared, batched):
        (single,) = engine.generate([p])
        assert single.token_ids == b.token_ids and single.finish_reason == b.finish_reason
        assert np.allclose(single.logprobs, b.logprobs, atol=1e-5)
        assert [i for i, _ in single.top[0]] == [i for i, _ in b.top[0]]
        assert np.allclose([v for _, v in single.top[0]], [v for _, v in b.top[0]], atol=1e-5)


def _post(url, body=None, raw=None, token=TOKEN):
    headers = {"authorization": f"Bearer {token}"} if token else {}
    if raw is not None:
        return httpx.post(f"{url}/chat/completions", content=raw, headers=headers, timeout=30)
    return httpx.post(f"{url}/chat/completions", json=body, headers=headers, timeout=30)


def _body(images=2, **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": _content([_image(i) for i in range(images)])}],
            "max_tokens": 1, **kw}


@pytest.mark.parametrize("kind, status, expect", [
    ("three_images", 400, "request has 3 images; this server accepts at most 2"),
    ("oversized", 413, "exceeds the limit of 1048576 bytes"),
    ("malformed", 400, "malformed JSON"),
    ("remote_url", 400, "must be a base64 data URI"),
    ("too_many_logprobs", 400, "exceeds this server's max_logprobs=267"),
    ("sampling", 400, "decodes greedily"),
    ("unknown_model", 404, "model 'PaCo-Tiny' is not served here; served: paco-tiny"),
    ("no_token", 401, "bearer token"),
    ("wrong_token", 401, "bearer token"),
])
def test_bad_requests_get_clear_errors(server, kind, status, expect):
    if kind == "three_images":
        r = _post(server, _body(images=3))
    elif kind == "oversized":
        r = _post(server, raw=b'{"model": "' + b"x" * (1 << 20) + b'"}')
    elif kind == "malformed":
        r = _post(server, raw=b'{"model": "paco-tiny", "messages": [')
    elif kind == "remote_url":
        body = _body(images=0)
        body["messages"][0]["content"].insert(0, {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}})
        r = _post(server, body)
    elif kind == "too_many_logprobs":
        r = _post(server, _body(logprobs=True, top_logprobs=600))
    elif kind == "sampling":
        r = _post(server, _body(temperature=0.7))
    elif kind == "unknown_model":
        r = _post(server, {**_body(), "model": "PaCo-Tiny"})
    else:
        r = _post(server, _body(), token=None if kind == "no_token" else "wrong")
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert expect in err["message"] and err["code"] == status


def test_health_is_open_and_models_need_the_token(server):
    root = server.removesuffix("/v1")
    assert httpx.get(f"{root}/health").status_code == 200
    assert httpx.get(f"{server}/models").status_code == 401
    models = _client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]


def _peak_rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):  # the process's resident-memory high-water mark
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_an_8000x8000_png_is_refused_without_a_memory_spike(server):
    """An 8000x8000 PNG is a few KiB on the wire and about 0.8 GiB once decoded and prepared:
    the judge refuses it from its header, and its peak memory does not move."""
    (pid,) = [s["pid"] for s in STARTED["servers"]]
    im = Image.new("1", (8000, 8000))  # 8 MB here, 192 MB decoded to RGB in the judge
    body = _body(images=0)
    body["messages"][0]["content"].insert(0, {"type": "image_url", "image_url": {"url": _uri(im)}})
    peak = _peak_rss_mib(pid)
    r = _post(server, body)
    assert r.status_code == 400, r.text
    assert "image of 8000x8000 = 64000000 pixels exceeds this server's limit" in r.json()["error"]["message"]
    assert _peak_rss_mib(pid) - peak < 64  # decoding it would add at least 192 MiB
    stats = httpx.get(f"{server.removesuffix('/v1')}/stats", headers={"authorization": f"Bearer {TOKEN}"}).json()
    assert stats["prepare_bytes_held"] == 0
