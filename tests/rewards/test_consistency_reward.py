"""The remote consistency rewards against a real hf-engine server on loopback: the reference
prompts and scoring, 6 requests per 2x2 image counted at the server (the reference's behaviour
costs pairs x criteria, about 57), the cache, and failures that raise or mask, never score 0."""
import base64
import io
import json
import math
import re
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from conftest import REPO, shared_file
from paco_ds.recipe.schema import RewardSet
from paco_ds.errors import RewardError
from paco_ds.images import split_panels, split_prompt
from paco_ds.models.tiny.qwen_vl import tiny_qwen2_5_vl
from paco_ds.rewards.consistency import (EDIT_CONSISTENCY_TEMPLATE, EDIT_FOLLOWING_TEMPLATE, PAIR_TEMPLATE_V0,
                                         PAIR_TEMPLATE_V1, data_uri, yes_probability)
from paco_ds.rewards.registry import build_reward
from paco_ds.rewards.runner import RewardRunner
from paco_ds.serving import manager
from paco_ds.recipe.servers import ServersConfig

pytestmark = pytest.mark.fast

MODEL = "paco-reward-tiny"
ITEMS = [json.loads(l) for l in (REPO / "paco_ds/data/prompts/tiny_t2is_train.jsonl").read_text().splitlines() if l]


def _start(state_dir):
    cfg = ServersConfig(engine="hf", models=[{"name": MODEL, "tiny": True}], port=0, max_logprobs=267,
                        startup_timeout=120)
    return manager.start(cfg, state_dir, exit_with_parent=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("judge")
    try:
        yield _start(state_dir)["endpoints"][MODEL]
    finally:
        manager.stop(state_dir)


@pytest.fixture(scope="module")
def judge():
    """The same tiny judge in-process: P(Yes) for (images, text)."""
    model, proc = tiny_qwen2_5_vl()
    yes, no = proc.tokenizer.convert_tokens_to_ids("Yes"), proc.tokenizer.convert_tokens_to_ids("No")

    def p_yes(images, text):
        msgs = [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]}]
        prompt = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        with torch.no_grad():
            lp = model(**proc(text=[prompt], images=images, return_tensors="pt")).logits[0, -1].log_softmax(-1)
        return torch.sigmoid(lp[yes] - lp[no]).item()

    return p_yes


def _grids(n, seed=0, size=64):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def _reward(url, name="consistency_score", **kw):
    return build_reward(name, {"model": MODEL, "base_url": url, "top_logprobs": 267, **kw})


def _completed(url):
    return httpx.get(url.removesuffix("/v1") + "/stats").json().get("completed", 0)


def test_six_requests_per_2x2_image_at_the_server_and_a_cache_across_calls(server, judge):
    r = _reward(server)
    images, items = _grids(4), ITEMS[:4]
    before = _completed(server)
    res = r(images, [it["prompt"] for it in items], items)
    assert _completed(server) - before == 6 * len(images) == r.requests
    assert res.valid.all()
    latencies = r.take_latencies()  # one per answered request, for judge/latency_ms_* in metrics
    assert len(latencies) == 6 * len(images) and all(0 < t < 60 for t in latencies) and r.take_latencies() == []
    # The score is the mean over the 6 panel pairs (earlier panel first) of the reference v1 prompt.
    panels = split_panels(images[0], 2, 2)
    text = PAIR_TEMPLATE_V1.format(theme=split_prompt(items[0]["prompt"])[0])
    want = np.mean([judge([panels[i], panels[j]], text) for i in range(4) for j in range(i + 1, 4)])
    assert abs(res.scores[0] - want) < 1e-5
    # The reference would ask the same 6 pairs once per criterion.
    reference = sum(6 * sum(1 for d in it["criteria"].values() for t in d.values() if t.strip()) for it in items)
    assert reference == 3 * 6 * len(items)
    again = r(images, [it["prompt"] for it in items], items)
    assert _completed(server) - before == 6 * len(images)  # all from the cache
    assert r.take_latencies() == []  # no request, no latency
    assert np.array_equal(again.scores, res.scores)
    r.close()


def test_reference_cost_on_the_real_t2is_prompts():
    """pairs x non-empty criteria per 2x2 prompt of the paper's training set: about 57 (vs 6)."""
    rows = [json.loads(l) for l in shared_file("t2is", "half_2by2_small_train", "train_metadata.jsonl").open()]
    per_image = [6 * sum(1 for d in r["criteria"].values() for t in d.values() if isinstance(t, str) and t.strip())
                 for r in rows]
    assert 55 < np.mean(per_image) < 60


def test_template_v0_asks_per_criterion_and_averages_pairs_criteria_dimensions(server, judge):
    r = _reward(server, prompt_template_version=0)
    meta = {"criteria": {"Identity": {"a": "Same face.", "b": "Same clothes."}, "Style": {"c": "Same palette.", "d": ""}}}
    (image,) = _grids(1, seed=5)
    res = r([image], ["A 2x2 grid of a fox."], [meta])
    assert r.requests == 6 * 3  # pairs x non-empty criteria
    panels = split_panels(image, 2, 2)
    crit = {t: np.mean([judge([panels[i], panels[j]], PAIR_TEMPLATE_V0.format(criterion=t))
                        for i in range(4) for j in range(i + 1, 4)]) for t in ("Same face.", "Same clothes.", "Same palette.")}
    want = np.mean([np.mean([crit["Same face."], crit["Same clothes."]]), crit["Same palette."]])
    assert abs(res.scores[0] - want) < 1e-5
    r.close()


def test_editing_reward_is_the_geometric_mean_of_two_questions(server, judge):
    r = _reward(server, name="consistency_for_editing")
    refs, edited = _grids(2, seed=7, size=48), _grids(2, seed=8, size=48)
    prompts = ["make the sky red", "add a hat"]
    before = _completed(server)
    res = r(edited, prompts, [{}, {}], ref_images=refs)
    assert _completed(server) - before == 4
    for i in range(2):
        pc = judge([refs[i], edited[i]], EDIT_CONSISTENCY_TEMPLATE.format(prompt=prompts[i]))
        pf = judge([refs[i], edited[i]], EDIT_FOLLOWING_TEMPLATE.format(prompt=prompts[i]))
        assert abs(res.scores[i] - math.sqrt(pc * pf)) < 1e-5
        assert abs(res.parts["consistency"][i] - pc) < 1e-5 and abs(res.parts["following"][i] - pf) < 1e-5
    with pytest.raises(RewardError, match=r"consistency_for_editing compares each edit with its reference image, "
                                          r"and none was passed \(ref_images is None\)"):
        r(edited, prompts, [{}, {}])
    with pytest.raises(RewardError, match="needs one reference image per sample"):
        r(edited, prompts, [{}, {}], ref_images=refs[:1])
    r.close()


def test_editing_reward_takes_original_references_of_other_sizes_cached_by_content(server, judge):
    """What the trainer passes: the originals (PIL, or read_reference's uint8 [3, H, W]), whose
    size differs from the edit's; a group's k samples share one reference."""
    r = _reward(server, name="consistency_for_editing")
    (ref,) = _grids(1, seed=21, size=40)
    ref = ref.resize((56, 40))
    edited = _grids(3, seed=22, size=48)
    as_tensor = torch.from_numpy(np.asarray(ref).copy()).permute(2, 0, 1)
    before = _completed(server)
    res = r(edited, ["make it red"] * 3, [{}] * 3, ref_images=[ref, ref, as_tensor])
    assert _completed(server) - before == 2 * 3 and res.valid.all()
    pc = judge([ref, edited[2]], EDIT_CONSISTENCY_TEMPLATE.format(prompt="make it red"))
    assert abs(res.parts["consistency"][2] - pc) < 1e-5
    again = r(edited[:1], ["make it red"], [{}], ref_images=[ref])  # from the cache
    assert _completed(server) - before == 6 and again.scores[0] == res.scores[0]
    # The runner carries the parts across batches; part_scores flattens them for logging.
    from paco_ds.rewards.runner import part_scores

    runner = RewardRunner(RewardSet(terms={"consistency_for_editing": {"model": MODEL, "base_url": server,
                                                                       "top_logprobs": 267}}))
    runner.submit(edited[:2], ["make it red"] * 2, [{}] * 2, [ref, ref])
    runner.submit(edited[2:], ["make it red"], [{}], [as_tensor])
    out = runner.collect()["consistency_for_editing"]
    assert np.allclose(out.scores, res.scores) and np.allclose(out.parts["following"], res.parts["following"])
    flat = part_scores({"consistency_for_editing": out})
    assert sorted(flat) == ["consistency_for_editing/consistency", "consistency_for_editing/following"]
    runner.close()
    r.close()


def test_multi_image_edit_is_scored_against_each_input_and_keeps_the_weakest(server, judge):
    """Two questions per input image; the score is the lowest input's sqrt(P_consistent * P_follows),
    consistency/following are that input's, and each input's score is a part (NaN where a sample of
    the batch has fewer inputs). A single-input sample scores as before."""
    r = _reward(server, name="consistency_for_editing")
    inputs, edited = _grids(3, seed=31, size=40), _grids(2, seed=32, size=48)
    prompts = ["put picture 1 into picture 2", "make it red"]
    as_tensor = torch.from_numpy(np.asarray(inputs[1]).copy()).permute(2, 0, 1)
    before = _completed(server)
    res = r(edited, prompts, [{}, {}], ref_images=[(inputs[0], as_tensor), inputs[2]])
    assert _completed(server) - before == 2 * 2 + 2 and res.valid.all()
    terms = []
    for ref in inputs[:2]:
        pc = judge([ref, edited[0]], EDIT_CONSISTENCY_TEMPLATE.format(prompt=prompts[0]))
        pf = judge([ref, edited[0]], EDIT_FOLLOWING_TEMPLATE.format(prompt=prompts[0]))
        terms.append((math.sqrt(pc * pf), pc, pf))
    weakest = min(terms)
    assert abs(res.scores[0] - weakest[0]) < 1e-5
    assert abs(res.parts["consistency"][0] - weakest[1]) < 1e-5 and abs(res.parts["following"][0] - weakest[2]) < 1e-5
    assert abs(res.parts["input1"][0] - terms[0][0]) < 1e-5 and abs(res.parts["input2"][0] - terms[1][0]) < 1e-5
    single = math.sqrt(judge([inputs[2], edited[1]], EDIT_CONSISTENCY_TEMPLATE.format(prompt=prompts[1]))
                       * judge([inputs[2], edited[1]], EDIT_FOLLOWING_TEMPLATE.format(prompt=prompts[1])))
    assert abs(res.scores[1] - single) < 1e-5 and abs(res.parts["input1"][1] - single) < 1e-5
    assert math.isnan(res.parts["input2"][1])
    assert "input1" not in r(edited[1:], prompts[1:], [{}], ref_images=[inputs[2]]).parts  # one input: as before
    r.close()


def test_jpeg_mode_sends_what_the_reference_sends(server):
    (image,) = _grids(1, seed=3)
    buf = io.BytesIO()
    image.save(buf, format="JPEG")  # PIL's default quality, 75: the reference's encoding
    assert data_uri(image, "jpeg") == "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    png = data_uri(image, "png")
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(base64.b64decode(png.split(",", 1)[1])))), np.asarray(image))
    r = _reward(server, image_format="jpeg")
    assert r([image], [ITEMS[0]["prompt"]], [ITEMS[0]]).valid.all()
    r.close()


def test_yes_probability():
    top = [("Yes", math.log(0.3)), ("No", math.log(0.1)), (" yes", math.log(0.2)), ("NO", math.log(0.1))]
    assert yes_probability(top) == pytest.approx(0.75)
    assert yes_probability(top, canonicalize=True) == pytest.approx(0.5 / 0.7)
    assert yes_probability([("Yes", -1.0)]) == 1.0 and yes_probability([("No", -1.0)]) == 0.0
    assert math.isnan(yes_probability([("Maybe", -0.1)]))  # neither answer: invalid, not 0


def test_no_panels_to_compare_is_invalid_not_zero(server):
    r = _reward(server)
    res = r(_grids(1), ["a single picture of a fox"], [{}])
    assert not res.valid[0] and math.isnan(res.scores[0]) and r.requests == 0
    r.close()


def test_misspelled_model_is_an_immediate_error_listing_served_names(server):
    with pytest.raises(RewardError) as err:  # from the model list: no request is sent, nothing retried
        build_reward("consistency_score", {"model": "Paco-Reward-Tiny", "base_url": server, "retry_budget": 3600})
    msg = str(err.value)
    assert f"model 'Paco-Reward-Tiny' is not served at {server}; served: {MODEL}" in msg
    assert f"did you mean '{MODEL}'" in msg and "attempts" not in msg


def test_unreachable_endpoint_fails_within_the_retry_budget():
    url = f"http://127.0.0.1:{manager.free_port()}/v1"
    with pytest.raises(RewardError, match=f"reward server {url} \\(model '{MODEL}'\\).*connection failed") as err:
        build_reward("consistency_score", {"model": MODEL, "base_url": url, "retry_budget": 1.5, "backoff": 0.1})
    # retried, and stopped by the budget, not by the attempt limit (8)
    attempts = int(re.search(r"failed after (\d+) attempts", str(err.value)).group(1))
    assert 1 < attempts < 8, str(err.value)


def test_closing_the_client_releases_a_caller_waiting_on_a_silent_server():
    """A run that stops while a reward thread waits on the server must not hang at exit."""
    import socket
    import threading

    from paco_ds.rewards.client import ChatClient, RetryPolicy

    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        client = ChatClient(f"http://127.0.0.1:{silent.getsockname()[1]}/v1", MODEL,
                            retry=RetryPolicy(budget=60, timeout=60))
        outcome = {}

        def caller():
            try:
                client.run([client.first_token_logprobs([{"type": "text", "text": "Yes?"}], 1)])
            except BaseException as err:  # noqa: BLE001 - what it ends with is the point
                outcome["error"] = type(err).__name__

        thread = threading.Thread(target=caller)
        thread.start()
        time.sleep(0.5)
        client.close()
        thread.join(timeout=5)
    assert not thread.is_alive() and outcome == {"error": "CancelledError"}
