"""The consistency rewards scored by vLLM equal the hf engine's on the same requests and the same
weights (the tiny judge, text head size 32): T2IS consistency_score on 2x2 grids at 64 and 256 px,
and editing consistency_for_editing with its two parts. Both engines run float32 on CPU, so the
probabilities agree to float rounding; a difference beyond that means one engine templates,
preprocesses or reads logprobs differently from the other."""
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from conftest import REPO
from paco_ds.rewards.consistency import data_uri
from paco_ds.rewards.registry import build_reward

from .conftest import JUDGE, VOCAB

pytestmark = pytest.mark.vllm

ITEMS = [json.loads(l) for l in (REPO / "paco_ds/data/prompts/tiny_t2is_train.jsonl").read_text().splitlines() if l]
# float32 on both sides: P(Yes) came out bit-identical here; 1e-6 leaves room for the summation
# order of other attention kernels, while a different template, image preprocessing or logprob
# reading moves a random judge's P(Yes) by far more (1e-3 and up).
TOL = 1e-6


def _images(n, seed, size):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def _score(url, name, images, prompts, metadata, **kw):
    r = build_reward(name, {"model": JUDGE, "base_url": url, "top_logprobs": VOCAB})
    try:
        return r(images, prompts, metadata, **kw), r.requests
    finally:
        r.close()


@pytest.mark.parametrize("size", [64, 256])
def test_t2is_consistency_score_equals_the_hf_engines(vllm_server, hf_server, size):
    images, items = _images(3, seed=size, size=size), ITEMS[:3]
    args = (images, [it["prompt"] for it in items], items)
    ours, n_v = _score(vllm_server["url"], "consistency_score", *args)
    want, n_h = _score(hf_server, "consistency_score", *args)
    assert n_v == n_h == 6 * len(images)  # the same requests: 6 panel pairs per 2x2 grid
    assert ours.valid.all() and want.valid.all()
    assert np.all((ours.scores > 0) & (ours.scores < 1))
    assert len(set(np.round(want.scores, 9))) == len(images)  # the images score differently: a real comparison
    np.testing.assert_allclose(ours.scores, want.scores, rtol=0, atol=TOL)


def test_editing_consistency_equals_the_hf_engines(vllm_server, hf_server):
    refs, edited = _images(2, seed=7, size=64), _images(2, seed=8, size=64)
    prompts = ["make the sky red", "add a hat"]
    ours, _ = _score(vllm_server["url"], "consistency_for_editing", edited, prompts, [{}, {}], ref_images=refs)
    want, _ = _score(hf_server, "consistency_for_editing", edited, prompts, [{}, {}], ref_images=refs)
    assert ours.valid.all() and sorted(ours.parts) == ["consistency", "following"]
    for part in ("consistency", "following"):
        np.testing.assert_allclose(ours.parts[part], want.parts[part], rtol=0, atol=TOL)
    np.testing.assert_allclose(ours.scores, want.scores, rtol=0, atol=TOL)


def test_first_token_logprobs_match_token_for_token(vllm_server, hf_server):
    """One 2-image request, top 20: the same tokens in the same order with the same logprobs."""
    a, b = _images(2, seed=3, size=64)
    body = {"model": JUDGE, "max_tokens": 1, "logprobs": True, "top_logprobs": 20, "temperature": 0,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_uri(a, "png")}},
                {"type": "image_url", "image_url": {"url": data_uri(b, "png")}},
                {"type": "text", "text": "Are these two images consistent? Answer Yes or No."}]}]}
    tops = []
    for url in (vllm_server["url"], hf_server):
        r = httpx.post(f"{url}/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        tops.append(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"])
    ours, want = tops
    assert len(ours) == len(want) == 20
    np.testing.assert_allclose([t["logprob"] for t in ours], [t["logprob"] for t in want], rtol=0, atol=1e-5)
    # A byte token that is not a whole UTF-8 character reads '' from vLLM and U+FFFD from the hf
    # engine; every other token is the same text at the same rank.
    partial = ("", "\ufffd")
    same = [(a["token"], b["token"]) for a, b in zip(ours, want) if a["token"] not in partial or b["token"] not in partial]
    assert len(same) >= 5 and all(a == b for a, b in same), same
