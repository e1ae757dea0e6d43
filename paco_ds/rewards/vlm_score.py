"""`vlm_score`: a served VLM judge rates each image with one of Flow-GRPO's judge prompts.

One reward, named prompt templates (`template:`), each with how its answer becomes a score in [0, 1]:

- `qwenvl` (yifan123/flow_grpo, flow_grpo/qwenvl.py): Qwen2.5-VL-7B-Instruct rates aesthetic quality
  1-5 after a <Thought> analysis, inside <Score>X</Score>; score X / 5. Image only.
- `unifiedreward` (flow_grpo/rewards.py, unifiedreward_score_sglang): UnifiedReward-7b-v1.5 rates
  caption alignment and quality 1-5 after 'Final Score:'; score X / 5. Image and prompt. Flow-GRPO
  resizes the image to 512x512 first; `resize` does the same (the template's default).
- `deqa` (yifan123/reward-server, reward_server/deqa.py; the DeQA-Score model's own `score`): the
  quality question "How would you rate the quality of this image?" answered with one of five levels
  (excellent, good, fair, poor, bad = 5..1); the score is the expected level under the first
  token's probabilities over the five words, / 5, as DeQA-Score's scorer does it from its logits.
  Image only. This is the logprob template: the judge server must return top logprobs.

The judges are the same OpenAI-compatible servers as PaCo-Reward's (paco_ds/rewards/client.py: retries,
served-model check, an endpoint of the run's own `reward_servers` when no base_url is given).
`mode: text` parses the answer, `mode: logprobs` reads the first token's top logprobs; a template
names its default. An answer with no score in it, or with no level word among the top logprobs, is
an invalid sample (NaN, logged), and a request that failed after the retries is a PartialRewardError
naming the endpoint: Flow-GRPO's 0 for an unparsed answer is never given.
"""
from __future__ import annotations

import logging
import math
import re
import threading
from dataclasses import dataclass
from typing import Literal


from paco_ds.errors import ConfigError, RewardError
from paco_ds.rewards.base import (Count, ImageFormat, JpegQuality, LRUCache, NonNegative, PartialRewardError, Reward,
                                  RewardResult, Seconds, image_digest)
from paco_ds.rewards.client import ChatClient, RetryPolicy, open_judge
from paco_ds.rewards.consistency import data_uri

log = logging.getLogger(__name__)

QWENVL_TASK = '''
Your role is to evaluate the aesthetic quality score of given images.
1. Bad: Extremely blurry, underexposed with significant noise, indiscernible
subjects, and chaotic composition.
2. Poor: Noticeable blur, poor lighting, washed-out colors, and awkward
composition with cut-off subjects.
3. Fair: In focus with adequate lighting, dull colors, decent composition but
lacks creativity.
4. Good: Sharp, good exposure, vibrant colors, thoughtful composition with
a clear focal point.
5. Excellent: Exceptional clarity, perfect exposure, rich colors, masterful
composition with emotional impact.

Please first provide a detailed analysis of the evaluation process, including the criteria for judging aesthetic quality, within the <Thought> tag. Then, give a final score from 1 to 5 within the <Score> tag.
<Thought>
[Analyze the evaluation process in detail here]
</Thought>
<Score>X</Score>
'''

UNIFIEDREWARD_TASK = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to evaluate "
    "this image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with "
    "the provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as "
    "described in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including "
    "clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, "
    "assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]")

# DeQA-Score asks "How would you rate the quality of this image?" and reads the next word after
# "The quality of the image is"; over a chat API the judge is told to answer with that word.
DEQA_TASK = ("How would you rate the quality of this image? Answer with one word: excellent, good, fair, poor "
             "or bad.")
DEQA_LEVELS = {"excellent": 5.0, "good": 4.0, "fair": 3.0, "poor": 2.0, "bad": 1.0}


@dataclass(frozen=True)
class Template:
    text: str  # may name {prompt}
    mode: str  # default: "text" (parse the answer) or "logprobs" (first-token levels)
    pattern: str | None  # text mode: a regex whose group 1 is the score
    scale: float  # the parsed score or expected level is divided by this
    levels: dict[str, float] | None = None  # logprobs mode: word -> level
    max_tokens: int = 2048  # text mode: the answer's length limit (qwenvl.py generates up to 2048)
    resize: int | None = None  # the image is resized to resize x resize before it is sent
    valid: tuple[float, float] | None = None  # text mode: the scores the question allows (1-5); others are invalid


TEMPLATES: dict[str, Template] = {
    "qwenvl": Template(QWENVL_TASK, "text", r"<Score>\s*(\d+(?:\.\d+)?)\s*</Score>", 5.0, valid=(1.0, 5.0)),
    "unifiedreward": Template(UNIFIEDREWARD_TASK, "text", r"Final Score:\s*(\d+(?:\.\d+)?)", 5.0, resize=512,
                              valid=(1.0, 5.0)),
    "deqa": Template(DEQA_TASK, "logprobs", None, 5.0, DEQA_LEVELS),
}


def parse_score(answer: str, pattern: str, scale: float, valid: tuple[float, float] | None = None) -> float:
    """The first match of `pattern` in the answer, read as the number it is, / scale; NaN (an invalid
    answer) when there is none or the number is outside what the question allows (`valid`: a 1-5
    template's 99 or 0 is not a score to clamp, and 'Final Score: 10' is ten, not one)."""
    match = re.search(pattern, answer or "")
    if not match:
        return math.nan
    try:
        value = float(match.group(1))
    except ValueError:
        return math.nan
    if valid is not None and not valid[0] <= value <= valid[1]:
        return math.nan
    return value / scale


def expected_level(top: list[tuple[str, float]], levels: dict[str, float], scale: float) -> float:
    """sum_w p(w) * level(w) / sum_w p(w) over the level words among the first token's top logprobs
    (tokens compared stripped and lower-cased; several spellings of one word add up), / scale;
    NaN when no level word is among them."""
    mass = {w: 0.0 for w in levels}
    tokens = [t for t, _ in top if t.strip().lower() in mass]
    twice = sorted({t for t in tokens if tokens.count(t) > 1})
    if twice:  # one spelling listed twice: which entry is its probability? (other strings may repeat)
        raise ValueError(f"token {twice[0]!r} is listed twice among the first token's top logprobs")
    for token, lp in top:
        word = token.strip().lower()
        if word in mass:
            mass[word] += math.exp(lp)
    total = sum(mass.values())
    if total <= 0.0:
        return math.nan
    return sum(mass[w] * levels[w] for w in levels) / total / scale


class AnsweringClient(ChatClient):
    """The judge client, plus a whole (greedy) answer for the text templates."""

    async def answer(self, content: list[dict], max_tokens: int) -> str:
        async def call(timeout: float):
            return await self._client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": content}], temperature=0.0,
                max_completion_tokens=max_tokens, timeout=timeout)

        resp = await self._with_retries("chat completion", call)
        self.check_answer_model(resp)
        try:
            text = resp.choices[0].message.content
        except (AttributeError, IndexError, TypeError):
            raise RewardError(f"{self.where}: malformed answer: no choices[0].message.content") from None
        if text is not None and not isinstance(text, str):
            raise RewardError(f"{self.where}: malformed answer: choices[0].message.content is "
                              f"{type(text).__name__}, not a string")
        return text or ""


class VlmScore(Reward):
    name = "vlm_score"
    remote = True

    def __init__(self, template: Literal["qwenvl", "unifiedreward", "deqa"] = "qwenvl", model: str = "Qwen2.5-VL-7B-Instruct", base_url: str | None = None,
                 mode: Literal["text", "logprobs"] | None = None, max_tokens: Count | None = None, resize: int | None = None,
                 image_format: ImageFormat = "png", jpeg_quality: JpegQuality = 75, top_logprobs: Count = 20,
                 max_concurrency: Count = 64, timeout: Seconds = 120.0, max_attempts: Count = 8, retry_budget: NonNegative = 300.0,
                 backoff: NonNegative = 0.5, api_key_env: str = "PACO_REWARD_API_KEY", cache_size: Count = 65536,
                 reward_endpoints: dict[str, str] | None = None):
        """`template`: qwenvl, unifiedreward or deqa. `mode`, `max_tokens` and `resize` override the
        template's own (`resize: 0` sends the image at its size)."""
        if template not in TEMPLATES:
            raise ConfigError(f"vlm_score.template: '{template}' is not a known template "
                              f"(known: {', '.join(TEMPLATES)})")
        t = TEMPLATES[template]
        self.template, self.t = template, t
        self.mode = mode or t.mode
        if self.mode not in ("text", "logprobs"):
            raise ConfigError(f"vlm_score.mode: '{self.mode}' (use text or logprobs)")
        if self.mode == "text" and t.pattern is None:
            raise ConfigError(f"vlm_score.mode: template '{template}' has no answer pattern; it is read from "
                              "logprobs (mode: logprobs)")
        if self.mode == "logprobs" and t.levels is None:
            raise ConfigError(f"vlm_score.mode: template '{template}' asks for a written score; it is read from "
                              "the answer (mode: text)")
        if image_format not in ("png", "jpeg"):
            raise ConfigError(f"vlm_score.image_format: '{image_format}' (use png or jpeg)")
        self.max_tokens = max_tokens or t.max_tokens
        self.resize = t.resize if resize is None else (resize or None)
        self.image_format, self.jpeg_quality, self.top_logprobs = image_format, jpeg_quality, top_logprobs
        retry = RetryPolicy(max_attempts=max_attempts, backoff=backoff, budget=retry_budget, timeout=timeout)
        self.client = open_judge(f"vlm_score ({template})", AnsweringClient, model, base_url, reward_endpoints,
                                 api_key_env, max_concurrency, retry)
        self.cache = LRUCache(cache_size)
        self.requests = 0
        self._count_lock = threading.Lock()

    def question(self, prompt: str) -> str:
        return self.t.text.format(prompt=prompt) if "{prompt}" in self.t.text else self.t.text

    def score(self, images, prompts, metadata, ref_images=None) -> RewardResult:
        keys, todo = [], {}
        for im, prompt in zip(images, prompts):
            text = self.question(prompt)
            key = (self.client.model, self.template, self.mode, image_digest(im), text)
            keys.append(key)
            if key not in todo and self.cache.get(key) is None:
                todo[key] = (im, text)

        def content(im, text):
            if self.resize:
                im = im.resize((self.resize, self.resize))
            return [{"type": "image_url", "image_url": {"url": data_uri(im, self.image_format, self.jpeg_quality)}},
                    {"type": "text", "text": text}]

        if self.mode == "text":
            requests = {key: self.client.answer(content(im, text), self.max_tokens) for key, (im, text) in todo.items()}
            parse = lambda res: parse_score(res, self.t.pattern, self.t.scale, self.t.valid)  # noqa: E731
        else:
            requests = {key: self.client.first_token_logprobs(content(im, text), self.top_logprobs)
                        for key, (im, text) in todo.items()}
            parse = lambda res: expected_level(res, self.t.levels, self.t.scale)  # noqa: E731
        with self._count_lock:
            self.requests += len(requests)
        answers = self.client.answers(requests, parse)
        for key, value in answers.items():
            if not isinstance(value, RewardError) and math.isfinite(value):
                self.cache.put(key, value)  # an unparsed answer is asked again next time
        scores, errors = [], []
        for key in keys:
            value = answers[key] if key in answers else self.cache.get(key)
            if isinstance(value, RewardError):
                scores.append(math.nan)
                errors.append(value)
            else:
                scores.append(value)
                errors.append(None)
        result = RewardResult.ok(scores)
        unparsed = int(sum(1 for s, e in zip(scores, errors) if e is None and not math.isfinite(s)))
        if unparsed:
            what = ("had no score matching " + repr(self.t.pattern)
                    + (f" within {self.t.valid[0]:g}-{self.t.valid[1]:g}" if self.t.valid else "") if self.mode == "text"
                    else f"had none of {', '.join(self.t.levels)} among the top {self.top_logprobs} first tokens")
            log.warning("vlm_score (%s): %d of %d answers %s (invalid samples)", self.template, unparsed,
                        len(scores), what)
        return PartialRewardError.check(self.name, result, errors)

    def close(self) -> None:
        self.client.close()
