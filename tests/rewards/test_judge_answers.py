"""A judge's answers are checked for sense (paco_ds/rewards/client.py): a positive logprob, an
answer from another model than asked, or a malformed answer is an invalid answer naming the
endpoint and the field, counted in reward/failures (mask) or stopping the run (raise), never a
score; and a failed batch stops the run at the next rollout batch, not at the end of the epoch.

The judge is a scripted OpenAI server on loopback (http.server), so each answer is exactly the
one under test.
"""
from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from conftest import REPO
from paco_ds.recipe.schema import RewardSet
from paco_ds.errors import RewardError
from paco_ds.rewards.base import PartialRewardError
from paco_ds.rewards.registry import build_reward
from paco_ds.rewards.runner import RewardRunner

pytestmark = pytest.mark.fast

MODEL = "paco-reward-tiny"
ITEM = json.loads((REPO / "paco_ds/data/prompts/tiny_t2is_train.jsonl").read_text().splitlines()[0])


def _answer(top=None, model=MODEL, drop=None):
    top = [{"token": "Yes", "logprob": -0.1}, {"token": "No", "logprob": -2.4}] if top is None else top
    body = {"id": "x", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "Yes"},
                         "logprobs": {"content": [{"token": "Yes", "logprob": -0.1, "top_logprobs": top}]}}]}
    if drop == "logprobs":
        body["choices"][0]["logprobs"] = None
    return body


class Judge:
    """A scripted judge: /v1/models names MODEL, every chat completion gets `self.answer`."""

    def __init__(self):
        judge = self
        self.answer = _answer()
        self.requests = 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, body):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                        "owned_by": "x"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                judge.requests += 1
                self._send(judge.respond(body))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def respond(self, body: dict) -> dict:
        """The completion for a request (`body`, the chat request): `self.answer`."""
        return self.answer

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def judge():
    j = Judge()
    yield j
    j.close()


def _grids(n, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)) for _ in range(n)]


def _terms(judge):
    return {"consistency_score": {"model": MODEL, "base_url": judge.url, "retry_budget": 5.0}}


def test_a_sane_answer_is_a_score(judge):
    r = build_reward("consistency_score", _terms(judge)["consistency_score"])
    try:
        res = r(_grids(1), [ITEM["prompt"]], [ITEM])
        assert res.valid[0] and res.scores[0] == pytest.approx(1 / (1 + math.exp(-2.3)))
        judge.answer = _answer([{"token": "Yes", "logprob": 3e-7}, {"token": "No", "logprob": -30.0}])  # rounding
        res = r(_grids(1, seed=1), [ITEM["prompt"]], [ITEM])
        assert res.valid[0] and res.scores[0] == pytest.approx(1.0)
    finally:
        r.close()


BAD_ANSWERS = {
    "positive_logprob": (_answer([{"token": "Yes", "logprob": 50.0}, {"token": "No", "logprob": -1.0}]),
                         r"invalid answer: field 'choices\[0\].logprobs.content\[0\].top_logprobs\[0\].logprob' is "
                         r"50.0 for token 'Yes'; a log-probability is <= 0"),
    "small_positive_logprob": (_answer([{"token": "No", "logprob": -1.0}, {"token": "Yes", "logprob": 3.0}]),
                               r"field 'choices\[0\].logprobs.content\[0\].top_logprobs\[1\].logprob' is 3.0"),
    "top_logprobs_null": (_answer(top=[]) | {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Y"},
                                                          "finish_reason": "length", "logprobs": {"content": [
                                                              {"token": "Y", "logprob": -0.1, "top_logprobs": None}]}}]},
                          r"malformed answer: field 'choices\[0\].logprobs.content\[0\].top_logprobs' is null"),
    "logprob_not_a_number": (_answer([{"token": "Yes", "logprob": "high"}]),
                             r"field 'choices\[0\].logprobs.content\[0\].top_logprobs\[0\].logprob' is 'high'"),
    "token_null": (_answer([{"token": None, "logprob": -0.5}]),
                   r"field 'choices\[0\].logprobs.content\[0\].top_logprobs\[0\].token' is null"),
    "no_logprobs": (_answer(drop="logprobs"), "the response has no logprobs for the first token"),
    "yes_and_no_both_certain": (_answer([{"token": "Yes", "logprob": 0.0}, {"token": "No", "logprob": 0.0}]),
                                r"invalid answer: the probabilities in field 'choices\[0\].logprobs.content\[0\]"
                                r".top_logprobs' add up to 2, more than 1"),
    "yes_listed_twice": (_answer([{"token": "Yes", "logprob": -0.1}, {"token": "No", "logprob": -3.0},
                                  {"token": "Yes", "logprob": -5.0}]),
                         r"invalid answer: token 'Yes' is listed twice among the first token's top logprobs"),
    "another_model": (_answer(model="gpt-4o-mini"),
                      r"reward server {url}: asked model 'paco-reward-tiny' but the answer is from model "
                      r"'gpt-4o-mini'; refused"),
}


@pytest.mark.parametrize("case", list(BAD_ANSWERS))
def test_a_senseless_answer_is_invalid_counted_and_names_the_endpoint(judge, case):
    answer, message = BAD_ANSWERS[case]
    message = message.format(url=judge.url)
    judge.answer = _answer()
    runners = {p: RewardRunner(RewardSet(terms=_terms(judge), on_failure=p)) for p in ("mask", "raise")}
    try:
        good = runners["mask"].score(_grids(1), [ITEM["prompt"]], [ITEM])["consistency_score"]
        assert good.valid.all()
        judge.answer = answer
        res = runners["mask"].score(_grids(1, seed=5), [ITEM["prompt"]], [ITEM])["consistency_score"]
        assert not res.valid.any() and np.isnan(res.scores).all()  # never a score
        assert runners["mask"].failures == 1
        with pytest.raises(PartialRewardError, match=message) as err:
            runners["raise"].score(_grids(1, seed=6), [ITEM["prompt"]], [ITEM])
        assert judge.url in str(err.value)
    finally:
        for r in runners.values():
            r.close()


def test_a_dated_snapshot_of_the_model_asked_is_the_same_model(judge):
    judge.answer = _answer(model=MODEL + "-2024-08-06")
    r = build_reward("consistency_score", _terms(judge)["consistency_score"])
    try:
        assert r(_grids(1), [ITEM["prompt"]], [ITEM]).valid.all()
    finally:
        r.close()


def test_a_failed_batch_stops_the_next_submit_not_the_end_of_the_epoch(judge):
    """With on_failure: raise the error surfaces at the next rollout batch: the run ends within
    seconds of a malformed answer instead of sampling the rest of the epoch first."""
    runner = RewardRunner(RewardSet(terms=_terms(judge), on_failure="raise"))
    try:
        judge.answer = _answer(top=[{"token": "Yes", "logprob": 7.0}])
        runner.submit(_grids(1), [ITEM["prompt"]], [ITEM])
        deadline = time.monotonic() + 20
        with pytest.raises(RewardError, match=f"{judge.url}.*top_logprobs\\[0\\].logprob' is 7.0"):
            while time.monotonic() < deadline:
                runner.submit(_grids(1, seed=int(time.monotonic() * 1000) % 1000), [ITEM["prompt"]], [ITEM])
                time.sleep(0.05)
        assert runner.pending == []
    finally:
        runner.close()


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")  # the stopped loop's queue
def test_a_reward_thread_never_waits_forever_on_a_closed_client(judge):
    """A reward thread that hands work to the client while the run closes it (the error path of a
    run) must return, or the interpreter's exit, which joins the reward threads, never ends."""
    import asyncio
    import concurrent.futures

    from paco_ds.rewards.client import ChatClient

    client = ChatClient(judge.url, MODEL)
    # the interleaving of a close: the loop has stopped, close() has not finished
    client._loop.call_soon_threadsafe(client._loop.stop)
    client._thread.join(timeout=5)
    outcome = {}

    def caller():
        try:
            client.run([asyncio.sleep(0)])
        except BaseException as err:  # noqa: BLE001 - what it ends with is the point
            outcome["error"] = type(err).__name__

    thread = threading.Thread(target=caller)
    thread.start()
    time.sleep(0.3)
    client._closing = True  # what close() sets first
    thread.join(timeout=5)
    assert not thread.is_alive() and outcome == {"error": "CancelledError"}
    client._loop.close()
    with pytest.raises(concurrent.futures.CancelledError, match=f"reward server {judge.url}.*the client is closed"):
        client.run([asyncio.sleep(0)])  # after close: at once


def test_with_raise_a_batch_that_nothing_could_score_stops_the_run(judge):
    """A judge that never answers Yes or No (every sample invalid): with `mask` the samples are masked and
    counted as invalid; with the default `raise` the run stops instead of training on nothing."""
    judge.answer = _answer([{"token": "Maybe", "logprob": -0.1}, {"token": "Perhaps", "logprob": -2.5}])
    runners = {p: RewardRunner(RewardSet(terms=_terms(judge), on_failure=p)) for p in ("mask", "raise")}
    try:
        res = runners["mask"].score(_grids(2), [ITEM["prompt"]] * 2, [ITEM] * 2)["consistency_score"]
        assert not res.valid.any() and runners["mask"].failures == 0  # invalid answers, not failed requests
        with pytest.raises(RewardError, match=r"reward 'consistency_score': none of the 2 samples of a batch it "
                                              r"applies to could be scored \(every answer was invalid; on_failure: "
                                              r"raise\)"):
            runners["raise"].score(_grids(2, seed=3), [ITEM["prompt"]] * 2, [ITEM] * 2)
    finally:
        for r in runners.values():
            r.close()


SINGLE = {**ITEM, "layout": "1x1", "prompt": "ONE-PANEL Image with a 1x1 grid layout showing a red kite on a beach."}


def test_a_single_panel_is_not_judged_and_is_no_failure(judge):
    """One panel has no pair to compare: the pairwise judge does not apply (no request is sent), which
    under `raise` stops nothing, even for a batch of single panels only; in a mixed batch the others
    are scored as usual."""
    runner = RewardRunner(RewardSet(terms=_terms(judge), on_failure="raise"))
    try:
        res = runner.score(_grids(2), [SINGLE["prompt"]] * 2, [SINGLE] * 2)["consistency_score"]
        assert judge.requests == 0 and runner.failures == 0
        assert not res.applicable.any() and not res.valid.any() and np.isnan(res.scores).all()
        res = runner.score(_grids(2, seed=1), [SINGLE["prompt"], ITEM["prompt"]], [SINGLE, ITEM])["consistency_score"]
        assert res.applicable.tolist() == [False, True] and res.valid.tolist() == [False, True]
        assert judge.requests == 6  # the 2x2 grid's six pairs, the single panel none
        assert res.unjudged.tolist() == [False, False]
    finally:
        runner.close()


def test_nonsense_answers_still_stop_a_run_beside_single_panels(judge):
    """on_failure still governs a judge that answers nonsense: a batch whose grids it applies to were all
    answered with neither Yes nor No stops the run, whatever single panels the batch also holds."""
    judge.answer = _answer([{"token": "Maybe", "logprob": -0.1}])
    runner = RewardRunner(RewardSet(terms=_terms(judge), on_failure="raise"))
    try:
        with pytest.raises(RewardError, match="none of the 1 samples of a batch it applies to could be scored"):
            runner.score(_grids(2), [SINGLE["prompt"], ITEM["prompt"]], [SINGLE, ITEM])
    finally:
        runner.close()
