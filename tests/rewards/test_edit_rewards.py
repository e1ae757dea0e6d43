"""The editing rewards: edit_score (PaCo-RL's EditScore.py reward, the rubric's image order, unparsable replies
fail rather than score 0) against the tiny judge on loopback and a scripted one, and the local
clip_i (reference vs edit)."""
import base64
import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from paco_ds.recipe.schema import RewardSet
from paco_ds.data import load_prompts, read_reference
from paco_ds.errors import RewardError
from paco_ds.rewards.base import PartialRewardError
from paco_ds.rewards.edit_score import parse_scores, pq_prompt, sc_prompt
from paco_ds.rewards.registry import build_reward
from paco_ds.rewards.runner import RewardRunner, part_scores
from paco_ds.serving import manager
from paco_ds.recipe.servers import ServersConfig
from conftest import REPO

pytestmark = pytest.mark.fast

MODEL = "paco-reward-tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("judge")
    cfg = ServersConfig(engine="hf", models=[{"name": MODEL, "tiny": True}], port=0, max_logprobs=267,
                        startup_timeout=120)
    try:
        yield manager.start(cfg, state_dir, exit_with_parent=True)["endpoints"][MODEL]
    finally:
        manager.stop(state_dir)


def _images(n, seed, size=(48, 40)):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(n)]


def _decode(uri: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB"))


# ------------------------------------------------------------------------------ edit_score: parsing
@pytest.mark.parametrize("reply,want", [
    ('{"reasoning": "fine", "score": [20, 15]}', (20.0, 15.0)),
    ('Sure.\n{\n"reasoning" : "the sky is red",\n"score" : [25, 0]\n}\nDone.', (25.0, 0.0)),
    ('||V^=^V||{"score": [3, 4.5], "reasoning": "x"}||V^=^V||', (3.0, 4.5)),
    ("[7, 9]", (7.0, 9.0)),
    ("{\u201creasoning\u201d: \u201cok\u201d, \u201cscore\u201d: [1, 2]}", (1.0, 2.0)),
])
def test_parse_scores(reply, want):
    assert parse_scores(reply) == want


@pytest.mark.parametrize("reply,why", [
    ("", "no JSON object"), ("The edit looks good, 9/10.", "no JSON object"),
    ('{"score": [20, 15]', "no JSON object"), ('{"score": [20 15]}', "malformed JSON"),
    ('{"score": [30, 1]}', "within \\[0, 25\\]"), ('{"score": [1, 2, 3]}', "list of two numbers"),
    ('{"score": 12}', "list of two numbers"), ('{"reasoning": "no score"}', "list of two numbers"),
    ('{"score": [true, 2]}', "within"), ("[7]", "no JSON object"),
])
def test_unparsable_replies_are_errors_not_zero(reply, why):
    with pytest.raises(ValueError, match=why):
        parse_scores(reply)


def test_rubric_text_and_scale():
    sc = sc_prompt("make the circle blue")
    assert "The first being the original AI-generated image and the second being an edited version" in sc
    assert "From scale 0 to 25" in sc and "25 indicates" in sc and " 10 " not in sc
    assert sc.rstrip().endswith("Editing instruction: make the circle blue")
    pq = pq_prompt()
    assert "naturalness" in pq and "artifacts" in pq and "From scale 0 to 25" in pq and "10" not in pq
    assert "From scale 0 to 10" in sc_prompt("x", score_range=10)


# ------------------------------------------------------------------------------ edit_score: a scripted judge
def test_score_is_sqrt_of_sc_times_pq_with_the_original_first(server, monkeypatch):
    r = build_reward("edit_score", {"model": MODEL, "base_url": server, "temperature": 0.0})
    sent = []

    async def reply(content, max_tokens, temperature, top_p):
        sent.append(content)
        text = content[0]["text"]
        if "Editing instruction" in text:
            return '{"reasoning": "ok", "score": [20, 10]}' if "blue" in text else "I cannot tell."
        return '{"reasoning": "clean", "score": [25, 15]}'

    monkeypatch.setattr(r.client, "reply", reply)
    refs = _images(1, seed=1, size=(56, 40)) * 2  # one original, two samples of its group
    edits = _images(2, seed=2)
    res = r(edits[:1], ["make the circle blue"], [{}], ref_images=refs[:1])
    assert res.scores[0] == pytest.approx(math.sqrt((15 / 25) * (20 / 25)))
    assert res.parts["sc"][0] == pytest.approx(15 / 25) and res.parts["pq"][0] == pytest.approx(20 / 25)
    sc_msg = next(c for c in sent if "Editing instruction" in c[0]["text"])
    pq_msg = next(c for c in sent if "Editing instruction" not in c[0]["text"])
    assert [p["type"] for p in sc_msg] == ["text", "image_url", "image_url"]  # the rubric, then the images
    assert np.array_equal(_decode(sc_msg[1]["image_url"]["url"]), np.asarray(refs[0]))  # the original first
    assert np.array_equal(_decode(sc_msg[2]["image_url"]["url"]), np.asarray(edits[0]))
    assert len(pq_msg) == 2 and np.array_equal(_decode(pq_msg[1]["image_url"]["url"]), np.asarray(edits[0]))
    assert r.requests == 2
    # A reply that does not parse fails its sample (raise), or masks only it (mask): never a 0.
    with pytest.raises(PartialRewardError, match="does not parse .*I cannot tell") as err:
        r(edits, ["make the circle blue", "make it red"], [{}, {}], ref_images=refs)
    assert err.value.failed.tolist() == [False, True] and r.requests == 2 + 2  # temperature 0: cached
    assert math.isnan(err.value.result.scores[1]) and err.value.result.scores[0] == res.scores[0]
    with pytest.raises(RewardError, match="compares each edit with its reference image"):
        r(edits, ["a", "b"], [{}, {}])
    r.close()


def test_unparsable_tiny_judge_replies_raise_or_mask_in_the_runner(server):
    kw = {"model": MODEL, "base_url": server, "temperature": 0.0, "max_tokens": 12}
    refs, edits = _images(2, seed=3), _images(2, seed=4)
    runners = {p: RewardRunner(RewardSet(terms={"edit_score": kw}, on_failure=p)) for p in ("mask", "raise")}
    try:
        res = runners["mask"].score(edits, ["add a hat", "remove the tree"], [{}, {}], refs)["edit_score"]
        reward = runners["mask"].rewards["edit_score"]
        assert reward.requests == 4 and reward.unparsed == 4  # 2 per sample; random weights write no JSON
        assert not res.valid.any() and np.isnan(res.scores).all() and runners["mask"].failures == 2
        assert np.isnan(part_scores({"edit_score": res})["edit_score/sc"]).all()
        with pytest.raises(RewardError, match="edit_score: 2 of 2 samples failed: reward server .*: invalid answer: the judge's reply does not parse"):
            runners["raise"].score(edits, ["add a hat", "remove the tree"], [{}, {}], refs)
    finally:
        for runner in runners.values():
            runner.close()


def test_sampling_temperature_needs_a_sampling_server(server):
    """EditScore decodes at temperature 0.7; the hf engine only decodes greedily and says so."""
    r = build_reward("edit_score", {"model": MODEL, "base_url": server, "max_tokens": 4})
    assert r.cache is None
    with pytest.raises(PartialRewardError, match="temperature=0.7: the hf engine decodes greedily"):
        r(_images(1, seed=5), ["x"], [{}], ref_images=_images(1, seed=6))
    r.close()


# ------------------------------------------------------------------------------ clip_i
def test_clip_i_cosine_of_reference_and_edit_with_a_cache():
    r = build_reward("clip_i", {"tiny": True})
    items = load_prompts(REPO / "paco_ds/data/prompts/tiny_edit/train_metadata.jsonl", "edit")
    refs = [read_reference(it) for it in items[:2]]
    ref_pil = [Image.fromarray(t.permute(1, 2, 0).numpy()) for t in refs]
    edits = [ref_pil[0].copy(), _images(1, seed=7, size=(96, 64))[0], ref_pil[1].resize((64, 64))]
    calls = []
    embed = r._embed
    r._embed = lambda ims: calls.append(len(ims)) or embed(ims)
    res = r(edits, [items[0].prompt, items[0].prompt, items[1].prompt], [{}] * 3,
            ref_images=[refs[0], refs[0], refs[1]])  # read_reference's tensors, as the trainer has them
    assert res.valid.all() and res.scores[0] == pytest.approx(1.0, abs=1e-5)
    assert res.scores[1] < res.scores[0] and -1 <= res.scores.min() and res.scores.max() <= 1 + 1e-6
    want = torch.nn.functional.cosine_similarity(*[torch.nn.functional.normalize(
        r.model.encode_image(r.preprocess(im)[None]).float(), dim=-1) for im in (ref_pil[1], edits[2])]).item()
    assert res.scores[2] == pytest.approx(want, abs=1e-5)
    assert calls == [4]  # 2 references + 2 distinct edits (edit 0 is reference 0)
    again = r(edits[:2], ["p", "p"], [{}, {}], ref_images=ref_pil[:1] * 2)
    assert calls == [4] and np.allclose(again.scores, res.scores[:2])  # all from the cache
    with pytest.raises(RewardError, match="clip_i compares each edit with its reference image"):
        r(edits, ["p"] * 3, [{}] * 3)
    with pytest.raises(RewardError, match="clip_i needs one reference image per sample"):
        r(edits, ["p"] * 3, [{}] * 3, ref_images=ref_pil)


def test_clip_i_multi_image_edit_keeps_the_weakest_input_and_edit_score_refuses_it(server):
    r = build_reward("clip_i", {"tiny": True})
    a, b, c = _images(3, seed=11, size=(64, 48))
    res = r([a, c], ["put picture 1 into picture 2"] * 2, [{}] * 2, ref_images=[(a, b), (b,)])
    single = r([a, c], ["p"] * 2, [{}] * 2, ref_images=[a, b])
    against_b = r([a], ["p"], [{}], ref_images=[b]).scores[0]
    assert single.scores[0] == pytest.approx(1.0, abs=1e-5) and against_b < 1 - 1e-3
    assert res.scores[0] == pytest.approx(against_b, abs=1e-6)  # the weakest input, not the mean
    assert res.parts["input1"][0] == pytest.approx(1.0, abs=1e-5) and res.parts["input2"][0] == pytest.approx(against_b)
    assert res.scores[1] == pytest.approx(single.scores[1]) and math.isnan(res.parts["input2"][1])
    assert "input1" not in single.parts
    e = build_reward("edit_score", {"model": MODEL, "base_url": server, "temperature": 0.0})
    with pytest.raises(RewardError, match="edit_score rates an edit against one original image, and a sample has 2"):
        e([a], ["p"], [{}], ref_images=[(a, b)])
    e.close()


def test_editing_rewards_are_registered():
    from paco_ds.rewards.registry import REWARDS, reward_class

    assert reward_class("edit_score").remote and not reward_class("clip_i").remote
    assert {"edit_score", "clip_i", "consistency_for_editing"} <= set(REWARDS)
