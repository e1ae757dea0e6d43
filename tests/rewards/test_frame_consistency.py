"""A video reaches a reward as its frames. `frame_consistency` asks PaCo-Reward's question about pairs of
frames and reads the answer as `consistency_score` does; the image rewards' per-frame forms score every
frame and average; a reward without one is refused for a video family before the run starts.

The judge is a scripted OpenAI server on loopback: it answers "consistent" (P(Yes) = sigmoid(2.3))
when the two images of a request are the same and "not consistent" (sigmoid(-1.8)) when they differ,
and counts the requests."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import REPO, dry_run, one_line_error
from paco_ds.errors import RewardError
from paco_ds.images import to_media
from paco_ds.rewards.frame_consistency import frame_pairs, sampled_frames
from paco_ds.rewards.registry import build_reward
from test_judge_answers import Judge  # the scripted judge server, answering here by the request's images

pytestmark = pytest.mark.fast

MODEL = "paco-reward-tiny"
SAME, DIFFERENT = 1 / (1 + math.exp(-2.3)), 1 / (1 + math.exp(1.8))
PROMPT = "A red fox trots through fresh snow in a birch forest at dawn."


def _answer(yes: float, no: float) -> dict:
    top = [{"token": "Yes", "logprob": yes}, {"token": "No", "logprob": no}]
    return {"id": "x", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "Yes"},
                         "logprobs": {"content": [{"token": "Yes", "logprob": yes, "top_logprobs": top}]}}]}


class PairJudge(Judge):
    """Answers by whether the two images of a request are the same; keeps each request's text."""

    def __init__(self):
        self.texts: list[str] = []
        super().__init__()

    def respond(self, body: dict) -> dict:
        content = body["messages"][-1]["content"]
        urls = [c["image_url"]["url"] for c in content if c["type"] == "image_url"]
        self.texts.append(next(c["text"] for c in content if c["type"] == "text"))
        return _answer(-0.1, -2.4) if urls[0] == urls[1] else _answer(-2.0, -0.2)


@pytest.fixture
def judge():
    j = PairJudge()
    yield j
    j.close()


def _frame(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8))


def _reward(judge, **kw):
    return build_reward("frame_consistency", {"model": MODEL, "base_url": judge.url, "retry_budget": 5.0, **kw})


def test_frames_are_sampled_evenly_with_the_first_and_the_last_and_paired_as_asked():
    assert sampled_frames(81, 8) == [0, 11, 23, 34, 46, 57, 69, 80]
    assert sampled_frames(5, 8) == [0, 1, 2, 3, 4] and sampled_frames(9, 3) == [0, 4, 8]
    assert frame_pairs(4, "adjacent") == [(0, 1), (1, 2), (2, 3)]
    assert frame_pairs(4, "first") == [(0, 1), (0, 2), (0, 3)]


def test_identical_frames_and_frames_that_differ(judge):
    """Identical frames: every pair is the same question, asked once, read as 'consistent'. Frames
    that all differ: one request per pair of the sampled frames, read as 'not consistent'. A video
    as the trainer hands it over ([B, F, 3, H, W] uint8) is scored the same as its PIL frames."""
    r = _reward(judge, max_frames=4)
    try:
        still = [_frame(0)] * 9
        res = r([still], [PROMPT], [{}])
        assert res.valid[0] and res.scores[0] == pytest.approx(SAME) and r.requests == 1
        moving = [_frame(i) for i in range(9)]
        res = r([moving], [PROMPT], [{}])
        assert res.valid[0] and res.scores[0] == pytest.approx(DIFFERENT) and r.requests == 1 + 3  # 4 kept, 3 pairs
        tensor = torch.stack([torch.from_numpy(np.array(f)).permute(2, 0, 1) for f in moving])[None]
        assert r(tensor, [PROMPT], [{}]).scores[0] == pytest.approx(DIFFERENT) and r.requests == 4  # cached
    finally:
        r.close()


def test_adjacent_and_first_pairs_read_differently(judge):
    """[a, b, a]: adjacent pairs (a, b), (b, a) both differ; against the first, (a, b) differs and
    (a, a) is the same."""
    a, b = _frame(1), _frame(2)
    adjacent, first = _reward(judge, pairs="adjacent"), _reward(judge, pairs="first")
    try:
        assert adjacent([[a, b, a]], [PROMPT], [{}]).scores[0] == pytest.approx(DIFFERENT)
        assert first([[a, b, a]], [PROMPT], [{}]).scores[0] == pytest.approx((SAME + DIFFERENT) / 2)
    finally:
        adjacent.close(), first.close()


def test_the_same_question_and_reading_as_consistency_score(judge):
    """Two frames as a video, and the same two as the panels of a 1x2 grid for consistency_score: the
    same request text, the same P(Yes) reading; with template 0 one question per criterion."""
    a, b = _frame(3), _frame(4)
    grid = Image.new("RGB", (64, 32))
    grid.paste(a, (0, 0))
    grid.paste(b, (32, 0))
    frames = _reward(judge)
    panels = build_reward("consistency_score", {"model": MODEL, "base_url": judge.url, "retry_budget": 5.0})
    try:
        video_score = frames([[a, b]], [PROMPT], [{}]).scores[0]
        grid_score = panels([grid], [PROMPT], [{"layout": "1x2"}]).scores[0]
        assert video_score == grid_score == pytest.approx(DIFFERENT)
        assert judge.texts[0] == judge.texts[1] and PROMPT in judge.texts[0]
        criteria = {"criteria": {"Identity": {"Subject": "The fox stays the same fox."},
                                 "Style": {"Rendering": "One style.", "Light": "One light."}}}
        per_criterion = _reward(judge, prompt_template_version=0)
        try:
            assert per_criterion([[a, b, a]], [PROMPT], [criteria]).valid[0]
            assert per_criterion.requests == 2 * 3  # 2 pairs x 3 criteria
            assert type(per_criterion).requests_per_video(3, criteria, prompt_template_version=0) == 6
        finally:
            per_criterion.close()
    finally:
        frames.close(), panels.close()


def test_a_one_frame_video_is_not_judged_and_not_a_failure(judge):
    from paco_ds.recipe.schema import RewardSet
    from paco_ds.rewards.runner import RewardRunner

    runner = RewardRunner(RewardSet(terms={"frame_consistency": {"weight": 1.0, "model": MODEL,
                                                                  "base_url": judge.url}}))
    try:
        res = runner.score([[_frame(5)], [_frame(6), _frame(7)]], [PROMPT] * 2, [{}, {}])["frame_consistency"]
        assert res.applicable.tolist() == [False, True] and res.valid.tolist() == [False, True]
        assert runner.failures == 0 and runner.rewards["frame_consistency"].requests == 1
    finally:
        runner.close()


def test_per_frame_forms_average_their_frames_and_an_image_reward_refuses_a_video(judge):
    jpeg = build_reward("jpeg_compressibility", {})
    frames = [_frame(i) for i in range(3)]
    per_frame = jpeg(frames, [PROMPT] * 3, [{}] * 3).scores
    assert jpeg([frames], [PROMPT], [{}]).scores[0] == pytest.approx(per_frame.mean())
    assert to_media(torch.zeros(2, 3, 3, 8, 8, dtype=torch.uint8))[1][2].size == (8, 8)
    panels = build_reward("consistency_score", {"model": MODEL, "base_url": judge.url})
    try:
        with pytest.raises(RewardError, match="consistency_score scores images and has no per-frame form: it cannot "
                                              "score videos"):
            panels([frames], [PROMPT], [{"layout": "1x2"}])
        assert not judge.texts  # refused before any request
    finally:
        panels.close()


def test_dry_run_refuses_an_image_reward_for_videos_and_prints_the_requests_per_video(tmp_path):
    recipe = REPO / "configs/tiny/wan_t2v.yaml"
    line = one_line_error(dry_run(recipe, tmp_path, "rewards.train.terms.ocr={weight: 1.0}"))
    assert line.startswith("train: error: config key 'rewards.train.terms.ocr': 'ocr' scores images and has no "
                           "per-frame form, and model.family 'wan' draws videos (per-frame forms: "), line
    line = one_line_error(dry_run(REPO / "configs/tiny/t2is.yaml", tmp_path,
                                  "rewards.train.terms.frame_consistency={weight: 1.0}"))
    assert "'frame_consistency' judges the frames of a video, and model.family 'flux' draws images" in line, line
    out = dry_run(recipe, tmp_path, "model.num_frames=81", "rewards.train.terms.frame_consistency.max_frames=8")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "frame_consistency: at most 7 judge requests per video (81 frames sampled down to 8, adjacent pairs)" \
        in out.stdout
    one = dry_run(recipe, tmp_path, "model.num_frames=1")
    assert one.returncode == 0, one.stderr[-2000:]
    assert "frame_consistency: 4 of 4 prompts in data.train_file (a video of 1 frame has no pair of frames to " \
           "compare)" in one.stdout
