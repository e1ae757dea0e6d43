"""`geneval`: a client for a GenEval reward server, in Flow-GRPO's reward-server protocol.

The protocol (yifan123/flow_grpo, flow_grpo/rewards.py geneval_score; the server is
yifan123/reward-server, app_geneval.py and reward_server/gen_eval.py): one HTTP POST to the server's
root per batch, the body a pickled dict {"images": [JPEG bytes], "meta_datas": [GenEval metadata],
"only_strict": bool}; the answer (HTTP 200) a pickled dict of per-image lists "scores", "rewards",
"strict_rewards" and per-tag dicts "group_rewards", "group_strict_rewards"; HTTP 500 carries the
server's traceback as text. The server runs the detector (Mask2Former) and the CLIP colour
classifier and does the object/count/colour/position scoring itself, so the protocol returns scores,
not detections: this client scores nothing of its own.

Each sample's metadata is the GenEval record of its prompt (the prompt file's JSONL line: "tag",
"include" [{"class", "count", "color"?, "position"?}], "exclude"?, "prompt"), sent as is. The reward is
"scores" (GenEval's partial credit per requirement, in [0, 1]; Flow-GRPO's geneval reward); the
parts are "strict" (1 when every requirement holds exactly) and, with `only_strict: false`,
"correct" (GenEval's own at-least criterion, the benchmark's accuracy).

The answer is unpickled by an unpickler that builds only plain data (dict, list, str, numbers and
numpy scalars): a server's answer cannot run code here. Connection errors and HTTP 5xx are retried
with backoff within a time budget (Flow-GRPO retries 500s without end), then the batch is a
RewardError naming the server; a sample whose metadata lacks the GenEval fields is a RewardError
naming it. Nothing becomes a silent 0.
"""
from __future__ import annotations

import io
import math
import pickle
import sys
import time

import httpx
import numpy as np

from paco_ds.errors import ConfigError, RewardError
from paco_ds.rewards.base import Count, JpegQuality, NonNegative, PartialRewardError, Reward, RewardResult, Seconds
from paco_ds.rewards.client import RETRY_STATUS, RetryPolicy, retry_after

TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


class _PlainUnpickler(pickle.Unpickler):
    """Plain data only: any global but numpy's scalar reconstruction is refused."""

    ALLOWED = {("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"), ("numpy", "dtype")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to build {module}.{name}")


def loads_plain(data: bytes):
    return _PlainUnpickler(io.BytesIO(data)).load()


def check_metadata(meta) -> str | None:
    """Why a sample's metadata cannot be sent to a GenEval server, or None."""
    if not isinstance(meta, dict):
        return f"metadata is {type(meta).__name__}, not a GenEval record"
    if meta.get("tag") not in TAGS:
        return f"metadata 'tag' is {meta.get('tag')!r} (GenEval's tags: {', '.join(TAGS)})"
    include = meta.get("include")
    if not isinstance(include, list) or not include:
        return "metadata has no 'include' list of required objects"
    for req in include:
        if not isinstance(req, dict) or not isinstance(req.get("class"), str) or not isinstance(req.get("count"), int) \
                or req["count"] < 1:
            return f"metadata 'include' entry {req!r} needs a 'class' and a 'count' >= 1"
    return None


class GenEval(Reward):
    name = "geneval"
    remote = True

    @classmethod
    def check_record(cls, prompt: str, metadata: dict) -> str | None:
        return check_metadata(metadata)

    def __init__(self, base_url: str = "http://127.0.0.1:18085", batch_size: Count = 64, only_strict: bool = True,
                 jpeg_quality: JpegQuality = 75, timeout: Seconds = 120.0, retry_budget: NonNegative = 600.0, backoff: NonNegative = 1.0,
                 max_backoff: NonNegative = 16.0, startup_timeout: NonNegative = 10.0):
        """`base_url`: the server (Flow-GRPO's default port). `only_strict`: skip the server's second,
        non-strict evaluation (Flow-GRPO trains with it on). `jpeg_quality`: PIL's default, 75, as
        Flow-GRPO encodes the images. `startup_timeout`: how long the server may take to answer at
        all before the run starts (0: no check); `retry_budget` is for a server that fails later."""
        if batch_size < 1:
            raise ConfigError(f"geneval.batch_size: {batch_size} (use >= 1)")
        self.url, self.batch_size, self.only_strict = base_url.rstrip("/") + "/", batch_size, only_strict
        self.jpeg_quality, self.timeout = jpeg_quality, timeout
        # the reward clients' one retry rule (paco_ds/rewards/client.py); the budget bounds the attempts
        self.retry = RetryPolicy(max_attempts=sys.maxsize, backoff=backoff, max_backoff=max_backoff,
                                 budget=retry_budget, timeout=timeout)
        self.http = httpx.Client(timeout=timeout)
        self.requests = 0
        self._latencies: list[float] = []
        if startup_timeout:
            self._check_answers(startup_timeout)

    def _check_answers(self, within: float) -> None:
        """Any HTTP answer (GenEval's server takes POSTs only) within `within` seconds, else one line
        saying what to start: a server nobody started would otherwise cost the whole retry budget
        at the first score, after the models have loaded."""
        deadline, last = time.monotonic() + within, ""
        while True:
            try:
                self.http.get(self.url, timeout=min(5.0, max(0.5, deadline - time.monotonic())))
                return
            except httpx.TransportError as err:
                last = type(err).__name__
            if time.monotonic() + 0.5 > deadline:
                raise RewardError(f"geneval: nothing answers at {self.url} ({last} for {within:g}s): start "
                                  "Flow-GRPO's GenEval reward server there (its reward-server/ directory), or set "
                                  "the reward's base_url")
            time.sleep(0.5)

    def _post(self, body: bytes) -> dict:
        start, attempt, last = time.monotonic(), 0, ""
        while True:
            try:
                t0 = time.perf_counter()
                resp = self.http.post(self.url, content=body, headers={"Content-Type": "application/octet-stream"})
                if resp.status_code == 200:
                    self._latencies.append(time.perf_counter() - t0)
                    try:
                        answer = loads_plain(resp.content)
                    except Exception as err:  # noqa: BLE001 - a malformed answer names the server
                        raise RewardError(f"geneval server {self.url}: malformed answer ({type(err).__name__}: "
                                          f"{err})") from None
                    if not isinstance(answer, dict):
                        raise RewardError(f"geneval server {self.url}: malformed answer: a {type(answer).__name__}, "
                                          "not a dict")
                    return answer
                tail = resp.text.strip().splitlines()[-1:] if resp.content else []
                last = f"HTTP {resp.status_code}" + (f": {tail[0][:300]}" if tail else "")
                if resp.status_code not in RETRY_STATUS:
                    raise RewardError(f"geneval server {self.url}: request rejected with {last}")
                asked = retry_after(resp.headers)
            except httpx.TransportError as err:
                last, asked = f"connection failed ({type(err).__name__})", None
            wait = self.retry.delay(attempt, asked)
            attempt += 1
            if time.monotonic() - start + wait > self.retry.budget:
                raise RewardError(f"geneval server {self.url}: failed after {attempt} attempts in "
                                  f"{time.monotonic() - start:.1f}s: {last}")
            time.sleep(wait)

    def score(self, images, prompts, metadata, ref_images=None) -> RewardResult:
        n = len(images)
        scores, strict, correct = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
        errors: list[RewardError | None] = [None] * n
        ok = []
        for i, meta in enumerate(metadata):
            why = check_metadata(meta)
            if why:
                errors[i] = RewardError(f"geneval: sample {i} ({prompts[i][:60]!r}): {why}")
            else:
                ok.append(i)
        for b in range(0, len(ok), self.batch_size):
            idx = ok[b:b + self.batch_size]
            jpegs = []
            for i in idx:
                buf = io.BytesIO()
                images[i].convert("RGB").save(buf, format="JPEG", quality=self.jpeg_quality)
                jpegs.append(buf.getvalue())
            body = pickle.dumps({"images": jpegs, "meta_datas": [dict(metadata[i]) for i in idx],
                                 "only_strict": self.only_strict})
            self.requests += 1
            try:
                answer = self._post(body)
                got = {k: _floats(answer, k, len(idx), self.url) for k in ("scores", "strict_rewards", "rewards")}
            except RewardError as err:
                for i in idx:
                    errors[i] = err
                continue
            scores[idx], strict[idx], correct[idx] = got["scores"], got["strict_rewards"], got["rewards"]
        parts = {"strict": strict} if self.only_strict else {"strict": strict, "correct": correct}
        return PartialRewardError.check(self.name, RewardResult.ok(scores, parts), errors)

    def take_latencies(self) -> list[float]:
        out, self._latencies = self._latencies, []
        return out

    def close(self) -> None:
        self.http.close()


def _floats(answer: dict, key: str, n: int, url: str) -> np.ndarray:
    values = answer.get(key)
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else repr(type(values).__name__)
        raise RewardError(f"geneval server {url}: malformed answer: '{key}' should hold {n} numbers, got {got}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not math.isfinite(float(v)):
            raise RewardError(f"geneval server {url}: malformed answer: '{key}' holds {v!r}, not a finite number")
        if not 0.0 <= float(v) <= 1.0:  # GenEval's partial credit and its rewards are fractions
            raise RewardError(f"geneval server {url}: invalid answer: '{key}' holds {v!r}, outside [0, 1]")
        out.append(float(v))
    return np.asarray(out)
