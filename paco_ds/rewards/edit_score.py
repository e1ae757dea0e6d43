"""EditScore (PaCo-RL/PaCo-GRPO/paco_grpo/rewards/EditScore.py): a served VLM rates an edit on two
rubrics and writes JSON.

  * SC (semantic consistency): the original and the edited image, with the instruction; scores
    [editing success, degree of over-editing].
  * PQ (perceptual quality): the edited image alone; scores [naturalness, artifacts].
Both rubrics use a 0..score_range scale (25, as EditScore-7B was trained; the rubric text says
so). Each part is mean(scores) / score_range, and the reward is sqrt(SC * PQ); the result carries
SC and PQ as parts 'sc' and 'pq'. Two requests per sample, sent concurrently.

Differences from the reference, on purpose:
  * The SC images are sent in the order the rubric describes, the original first (the reference
    sends [edited, original]). The content is [rubric text, images...], as there.
  * A reply that does not parse (no JSON object with a `score` list of two numbers within the
    scale, nor the `||V^=^V||`-delimited form, nor a bare `[a, b]`) fails that sample: the call
    raises a PartialRewardError, so `on_failure` raises or masks it. The reference scores it 0.
  * Decoding follows EditScore (temperature 0.7, top_p 0.9, 512 tokens); answers are cached by
    content only when `temperature` is 0, since sampled answers differ from call to call. The hf
    engine decodes greedily only: a tiny-judge recipe sets `temperature: 0`.
"""
from __future__ import annotations

import json
import logging
import math
import re
import threading

import numpy as np

from paco_ds.errors import ConfigError, RewardError
from paco_ds.rewards.base import (Count, Fraction, ImageFormat, JpegQuality, LRUCache, NonNegative,
                                  PartialRewardError, Reward, RewardResult, Seconds, image_digest, reference_images)
from paco_ds.rewards.client import ChatClient, RetryPolicy, open_judge
from paco_ds.rewards.consistency import data_uri

log = logging.getLogger(__name__)

CONTEXT = """You are a professional digital artist. You will have to evaluate the effectiveness of the AI-generated image(s) based on given rules.
All the input images are AI-generated. All human in the images are AI-generated too. so you need not worry about the privacy confidentials.

IMPORTANT: You will have to give your output in this way (Keep your reasoning concise and short.):
{
"reasoning" : "...",
"score" : [...]
}
"""

TWO_IMAGE_EDIT_RULE = """RULES:

Two images will be provided: The first being the original AI-generated image and the second being an edited version of the first.
The objective is to evaluate how successfully the editing instruction has been executed in the second image.

Note that sometimes the two images might look identical due to the failure of image edit.
"""

SC_RULE = """
From scale 0 to 10: 
A score from 0 to 10 will be given based on the success of the editing. (0 indicates that the scene in the edited image does not follow the editing instruction at all. 10 indicates that the scene in the edited image follow the editing instruction text perfectly.)
A second score from 0 to 10 will rate the degree of overediting in the second image. (0 indicates that the scene in the edited image is completely different from the original. 10 indicates that the edited image can be recognized as a minimal edited yet effective version of original.)
Put the score in a list such that output score = [score1, score2], where 'score1' evaluates the editing success and 'score2' evaluates the degree of overediting.

Editing instruction: <instruction>
"""

PQ_RULE = """RULES:

The image is an AI-generated image.
The objective is to evaluate how successfully the image has been generated.

From scale 0 to 10: 
A score from 0 to 10 will be given based on image naturalness. 
(
    0 indicates that the scene in the image does not look natural at all or give a unnatural feeling such as wrong sense of distance, or wrong shadow, or wrong lighting. 
    10 indicates that the image looks natural.
)
A second score from 0 to 10 will rate the image artifacts. 
(
    0 indicates that the image contains a large portion of distortion, or watermark, or scratches, or blurred faces, or unusual body parts, or subjects not harmonized. 
    10 indicates the image has no artifacts.
)
Put the score in a list such that output score = [naturalness, artifacts]
"""

DELIMITER = "||V^=^V||"
_QUOTES = str.maketrans({"\u201c": '"', "\u201d": '"', "\u2018": "'", "\u2019": "'"})


def sc_prompt(instruction: str, score_range: int = 25) -> str:
    return "\n".join([CONTEXT, TWO_IMAGE_EDIT_RULE, SC_RULE.replace("10", str(score_range))]).replace(
        "<instruction>", instruction)


def pq_prompt(score_range: int = 25) -> str:
    return "\n".join([CONTEXT, PQ_RULE.replace("10", str(score_range))])


def parse_scores(text: str, score_range: int = 25) -> tuple[float, float]:
    """The two scores of a judge reply; ValueError (with the reason) when there are not exactly
    two numbers within [0, score_range] in one of the forms the module docstring lists."""
    s = (text or "").translate(_QUOTES).strip()
    if s.count(DELIMITER) == 2:
        body = s[s.find(DELIMITER) + len(DELIMITER):s.rfind(DELIMITER)].strip()
    elif "{" in s and "}" in s[s.find("{"):]:
        body = s[s.find("{"):s.rfind("}") + 1]
    elif re.fullmatch(r"\[\s*-?\d+(\.\d+)?\s*,\s*-?\d+(\.\d+)?\s*\]", s):
        body = json.dumps({"score": json.loads(s)})
    else:
        raise ValueError("no JSON object in the reply")
    try:
        obj = json.loads(body.replace("\n", " "))
    except json.JSONDecodeError as err:
        raise ValueError(f"malformed JSON ({err.msg})") from None
    score = obj.get("score") if isinstance(obj, dict) else None
    if not isinstance(score, list) or len(score) != 2:
        raise ValueError(f"'score' must be a list of two numbers (got {score!r})")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= score_range for v in score):
        raise ValueError(f"'score' {score!r} is not two numbers within [0, {score_range}]")
    return float(score[0]), float(score[1])


class _TextClient(ChatClient):
    async def reply(self, content: list[dict], max_tokens: int, temperature: float, top_p: float | None) -> str:
        async def call(timeout: float):
            extra = {} if top_p is None else {"top_p": top_p}
            return await self._client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
                temperature=temperature, timeout=timeout, **extra)

        resp = await self._with_retries("chat completion", call)
        self.check_answer_model(resp)
        try:
            return resp.choices[0].message.content or ""
        except (AttributeError, IndexError, TypeError):
            raise RewardError(f"{self.where}: the response has no message") from None


class EditScore(Reward):
    name = "edit_score"
    remote = True

    def __init__(self, model: str = "EditScore-7B", base_url: str | None = None, score_range: Count = 25,
                 temperature: NonNegative = 0.7, top_p: Fraction | None = 0.9, max_tokens: Count = 512,
                 image_format: ImageFormat = "png", jpeg_quality: JpegQuality = 75, max_concurrency: Count = 64, timeout: Seconds = 60.0,
                 max_attempts: Count = 8, retry_budget: NonNegative = 120.0, backoff: NonNegative = 0.5,
                 api_key_env: str = "PACO_REWARD_API_KEY", cache_size: Count = 65536,
                 reward_endpoints: dict[str, str] | None = None):
        if image_format not in ("png", "jpeg"):
            raise ConfigError(f"{self.name}.image_format: '{image_format}' (use png or jpeg)")
        if score_range <= 0:
            raise ConfigError(f"{self.name}.score_range: must be positive (got {score_range})")
        self.score_range, self.temperature, self.top_p, self.max_tokens = score_range, temperature, top_p, max_tokens
        self.image_format, self.jpeg_quality = image_format, jpeg_quality
        retry = RetryPolicy(max_attempts=max_attempts, backoff=backoff, budget=retry_budget, timeout=timeout)
        self.client = open_judge(self.name, _TextClient, model, base_url, reward_endpoints, api_key_env, max_concurrency,
                                 retry)
        self.cache = LRUCache(cache_size) if temperature == 0 else None
        self.requests = 0  # sent to the server
        self._count_lock = threading.Lock()  # score() runs on several of the runner's threads at once
        self.unparsed = 0  # replies that did not parse

    def _ask(self, questions: dict) -> dict:
        """{key: (images, text)} -> {key: (s1, s2) | RewardError}."""
        out, todo = {}, {}
        for key, q in questions.items():
            hit = self.cache.get((self.client.model, key)) if self.cache is not None else None
            if hit is None:
                todo[key] = q
            else:
                out[key] = hit
        uris: dict[int, str] = {}

        def uri(im):
            if id(im) not in uris:
                uris[id(im)] = data_uri(im, self.image_format, self.jpeg_quality)
            return uris[id(im)]

        requests = {key: self.client.reply([{"type": "text", "text": text},
                                            *({"type": "image_url", "image_url": {"url": uri(im)}} for im in images)],
                                           self.max_tokens, self.temperature, self.top_p)
                    for key, (images, text) in todo.items()}
        with self._count_lock:
            self.requests += len(requests)
        for key, value in self.client.answers(requests, self._parse).items():
            out[key] = value
            if self.cache is not None and not isinstance(value, RewardError):
                self.cache.put((self.client.model, key), value)
        return out

    def _parse(self, reply: str):
        try:
            return parse_scores(reply, self.score_range)
        except ValueError as err:
            with self._count_lock:
                self.unparsed += 1
            raise ValueError(f"the judge's reply does not parse ({err}): {' '.join(reply.split())[:120]!r}") from None

    def score(self, images, prompts, metadata, ref_images=None) -> RewardResult:
        refs = reference_images(ref_images, len(images), self.name)
        pq_text = pq_prompt(self.score_range)
        questions, per_sample, digests = {}, [], {}
        for ref, edited, prompt in zip(refs, images, prompts):
            if id(ref) not in digests:
                digests[id(ref)] = image_digest(ref)
            d_edit = image_digest(edited)
            sc_key = ("SC", digests[id(ref)], d_edit, prompt)
            pq_key = ("PQ", d_edit)
            questions.setdefault(sc_key, ((ref, edited), sc_prompt(prompt, self.score_range)))  # original first
            questions.setdefault(pq_key, ((edited,), pq_text))
            per_sample.append((sc_key, pq_key))
        answers = self._ask(questions)
        scores, sc, pq, errors = [], [], [], []
        for keys in per_sample:
            err = next((answers[k] for k in keys if isinstance(answers[k], RewardError)), None)
            errors.append(err)
            if err is not None:
                scores.append(math.nan)
                sc.append(math.nan)
                pq.append(math.nan)
                continue
            s, q = (float(np.mean(answers[k])) / self.score_range for k in keys)
            sc.append(s)
            pq.append(q)
            scores.append(math.sqrt(s * q))
        return PartialRewardError.check(self.name, RewardResult.ok(scores, {"sc": sc, "pq": pq}), errors)

    def close(self) -> None:
        self.client.close()
