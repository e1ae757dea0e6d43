"""The remote consistency rewards: a VLM judge's P(Yes) over the OpenAI chat API.

`consistency_score` (T2IS, PaCo-RL/PaCo-GRPO/paco_grpo/rewards/consistency_scorer.py) asks the judge
about every unordered pair of panels of a generated grid (earlier panel first) and averages. The default
prompt (template 1) names only the grid's theme, not a criterion, so a 2x2 image needs its 6 pair
requests once; the reference repeats them for each of about 9.5 criteria (about 57 requests). Template 0
asks per criterion and averages pairs -> criteria -> dimensions as the reference does. Requests are
deduplicated within a call and cached across calls by (panel contents, prompt text, model).

`consistency_for_editing` (PaCo-RL/PaCo-GRPO/paco_grpo/rewards/consistency_for_editing.py) asks two
questions about (reference, edited), the reference (the original the trainer passes as `ref_images`, at
its own size) first, and returns sqrt(P_consistent * P_follows), with both probabilities as the result's
parts. Without reference images it is a RewardError, not a score. A multi-image edit asks the same two
questions about each input image and the edit; its score is the weakest input's (the minimum over
inputs, docs/editing.md says why), `consistency`/`following` are that input's probabilities, and each
input's own score is logged as part `input<i>`.

The score is P(Yes)/(P(Yes)+P(No)) from the first token's top logprobs (exact "Yes"/"No", or
with `canonicalize` every token that strips and lowercases to yes/no). A sample whose requests
failed after the client's retries is invalid and the call raises a PartialRewardError naming the
endpoint, so the run's `on_failure` policy decides (raise, or mask those samples); a judge that
answers neither Yes nor No leaves the sample invalid (NaN). Nothing becomes a silent 0.

An image of one panel has no pair to ask about: `consistency_score` does not apply to it
(`applies`), which is neither a score nor a failure; the reference scores it 0.0
(docs/differences.md).
"""
from __future__ import annotations

import base64
import io
import logging
import math
import threading
from itertools import combinations
from typing import Hashable, Literal

import numpy as np
from PIL import Image

from paco_ds.errors import ConfigError, RewardError
from paco_ds.images import grid_shape, split_panels, split_prompt
from paco_ds.rewards.base import (Count, ImageFormat, JpegQuality, LRUCache, NonNegative, PartialRewardError, Reward,
                                  RewardResult, Seconds, image_digest, per_input_parts, reference_sets,
                                  weakest_input)
from paco_ds.rewards.client import ChatClient, RetryPolicy, open_judge

log = logging.getLogger(__name__)

PAIR_TEMPLATE_V1 = ('Given two subfigures generated based on the theme: "{theme}", do the two images maintain '
                    'consistency in terms of style, logic and identity? Answer "Yes" and "No" first, and then '
                    'provide detailed reasons.')
PAIR_TEMPLATE_V0 = "Do images meet the following criteria? {criterion} Please answer Yes or No first, then provide detailed reasons."
EDIT_CONSISTENCY_TEMPLATE = (
    "Compare the edited image (second) with the original image (first). Instruction: '{prompt}'. Except for the "
    "parts that are intentionally changed according to the instruction, does the edited image remain consistent "
    "with the original in style, logic, and identity? Answer 'Yes' or 'No' first, then provide detailed reasons.")
EDIT_FOLLOWING_TEMPLATE = (
    "Compare the edited image (second) with the original image (first). Instruction: '{prompt}'. Does the edited "
    "image accurately follow this instruction? Answer 'Yes' or 'No' first, then provide detailed reasons.")


def yes_probability(top: list[tuple[str, float]], canonicalize: bool = False) -> float:
    """P(Yes)/(P(Yes)+P(No)) from (token, logprob) pairs; NaN when neither answer is among them.
    ValueError when an answer token is listed twice (which entry would be its probability?); other
    strings may repeat: distinct byte-level tokens can decode to the same text ('\ufffd')."""
    read = [t for t, _ in top if (t.strip().lower() if canonicalize else t) in (("yes", "no") if canonicalize
                                                                                 else ("Yes", "No"))]
    twice = sorted({t for t in read if read.count(t) > 1})
    if twice:
        raise ValueError(f"token {twice[0]!r} is listed twice among the first token's top logprobs")
    def logsumexp(values: list[float]) -> float:
        if not values:
            return -math.inf
        m = max(values)
        return m + math.log(sum(math.exp(v - m) for v in values))

    if canonicalize:
        yes = logsumexp([lp for t, lp in top if t.strip().lower() == "yes"])
        no = logsumexp([lp for t, lp in top if t.strip().lower() == "no"])
    else:
        yes = next((lp for t, lp in top if t == "Yes"), -math.inf)
        no = next((lp for t, lp in top if t == "No"), -math.inf)
    if yes == -math.inf and no == -math.inf:
        return math.nan
    d = yes - no  # sigmoid(d), stable for d = +-inf
    return 1.0 / (1.0 + math.exp(-d)) if d >= 0 else math.exp(d) / (1.0 + math.exp(d))


def data_uri(image: Image.Image, fmt: str = "png", quality: int = 75) -> str:
    """PNG is lossless; JPEG at quality 75 reproduces what the reference sends
    (PaCo-RL/PaCo-GRPO/paco_grpo/utils.py, its image encoding). PNG uses
    zlib level 1: about 2.5x faster to encode than the default 6 for 10% more bytes, and encoding
    runs in the trainer process, beside sampling."""
    buf = io.BytesIO()
    if fmt == "png":
        image.convert("RGB").save(buf, format="PNG", compress_level=1)
    else:
        image.convert("RGB").save(buf, format="JPEG", quality=quality)
    return f"data:image/{'png' if fmt == 'png' else 'jpeg'};base64,{base64.b64encode(buf.getvalue()).decode()}"


class RemoteJudge(Reward):
    """Asks a served VLM Yes/No questions about image pairs, with deduplication and a cache."""

    remote = True

    def __init__(self, model: str = "PaCo-Reward-7B", base_url: str | None = None, image_format: ImageFormat = "png",
                 jpeg_quality: JpegQuality = 75, top_logprobs: Count = 20, canonicalize: bool = False,
                 max_concurrency: Count = 64, timeout: Seconds = 60.0, max_attempts: Count = 8,
                 retry_budget: NonNegative = 120.0, backoff: NonNegative = 0.5, api_key_env: str = "PACO_REWARD_API_KEY",
                 cache_size: Count = 65536, reward_endpoints: dict[str, str] | None = None):
        if image_format not in ("png", "jpeg"):
            raise ConfigError(f"{self.name}.image_format: '{image_format}' (use png or jpeg)")
        self.image_format, self.jpeg_quality = image_format, jpeg_quality
        self.top_logprobs, self.canonicalize = top_logprobs, canonicalize
        retry = RetryPolicy(max_attempts=max_attempts, backoff=backoff, budget=retry_budget, timeout=timeout)
        self.client = open_judge(self.name, ChatClient, model, base_url, reward_endpoints, api_key_env, max_concurrency,
                                 retry)
        self.cache = LRUCache(cache_size)
        self.requests = 0  # sent to the server (after deduplication and cache)
        self._count_lock = threading.Lock()  # judge() runs on several of the runner's threads at once

    def judge(self, questions: dict[Hashable, tuple[tuple[Image.Image, ...], str]]) -> dict[Hashable, float | RewardError]:
        """P(Yes) for each question {key: (images, text)}; keys already answered come from the cache.
        A question that failed after the retries maps to its RewardError."""
        out: dict[Hashable, float | RewardError] = {}
        todo = {}
        for key, q in questions.items():
            hit = self.cache.get((self.client.model, key))
            if hit is None:
                todo[key] = q
            else:
                out[key] = hit
        uris: dict[int, str] = {}  # each distinct image object is encoded once per call

        def uri(im: Image.Image) -> str:
            if id(im) not in uris:
                uris[id(im)] = data_uri(im, self.image_format, self.jpeg_quality)
            return uris[id(im)]

        requests = {key: self.client.first_token_logprobs(
            [*({"type": "image_url", "image_url": {"url": uri(im)}} for im in images), {"type": "text", "text": text}],
            self.top_logprobs) for key, (images, text) in todo.items()}
        with self._count_lock:
            self.requests += len(requests)
        for key, value in self.client.answers(requests, lambda res: yes_probability(res, self.canonicalize)).items():
            out[key] = value
            if not isinstance(value, RewardError):
                self.cache.put((self.client.model, key), value)
        return out

    def _finish(self, scores: list[float], errors: list[RewardError | None],
                parts: dict[str, list[float]] | None = None) -> RewardResult:
        result = RewardResult.ok(scores, parts)
        failed = np.array([e is not None for e in errors])
        unanswered = int((~result.valid & ~failed).sum())
        if unanswered:
            log.warning("%s: %d of %d samples invalid (no criteria to ask about, or the judge answered neither "
                        "Yes nor No within its top %d tokens)", self.name, unanswered, len(scores), self.top_logprobs)
        return PartialRewardError.check(self.name, result, errors)

    def close(self) -> None:
        self.client.close()


class ConsistencyScore(RemoteJudge):
    name = "consistency_score"

    # The arguments are spelled out (not **kwargs) so that a misspelled recipe key is an error.
    def __init__(self, model: str = "PaCo-Reward-7B", base_url: str | None = None,
                 prompt_template_version: Literal[0, 1] = 1,
                 image_format: ImageFormat = "png", jpeg_quality: JpegQuality = 75, top_logprobs: Count = 20, canonicalize: bool = False,
                 max_concurrency: Count = 64, timeout: Seconds = 60.0, max_attempts: Count = 8, retry_budget: NonNegative = 120.0,
                 backoff: NonNegative = 0.5, api_key_env: str = "PACO_REWARD_API_KEY", cache_size: Count = 65536,
                 reward_endpoints: dict[str, str] | None = None):
        if prompt_template_version not in (0, 1):
            raise ConfigError(f"consistency_score.prompt_template_version: {prompt_template_version} is not "
                              "supported (0: per criterion, 1: the theme prompt)")
        self.version = prompt_template_version
        super().__init__(model, base_url, image_format, jpeg_quality, top_logprobs, canonicalize, max_concurrency,
                         timeout, max_attempts, retry_budget, backoff, api_key_env, cache_size, reward_endpoints)

    def _structure(self, panels_d: list[str], prompt: str, meta: dict,
                   pairs: list[tuple[int, int]] | None = None) -> list[list[list[tuple]]]:
        """Question keys of one image: dimensions -> criteria -> panel pairs (earlier panel first;
        `pairs`: which, default every unordered pair)."""
        pairs = list(combinations(range(len(panels_d)), 2)) if pairs is None else pairs
        if self.version == 1:
            text = PAIR_TEMPLATE_V1.format(theme=split_prompt(prompt)[0])
            return [[[(panels_d[i], panels_d[j], text) for i, j in pairs]]]
        dims = []
        for crits in (meta.get("criteria") or {}).values():
            texts = [t for t in (crits or {}).values() if isinstance(t, str) and t.strip()]
            if texts:
                dims.append([[(panels_d[i], panels_d[j], PAIR_TEMPLATE_V0.format(criterion=t)) for i, j in pairs]
                             for t in texts])
        return dims

    @classmethod
    def applies(cls, prompt: str, metadata: dict) -> str | None:
        rows, cols = grid_shape(prompt, metadata)
        if rows * cols < 2:
            return f"a single panel (layout {rows}x{cols}) has no pair of panels to compare"
        return None

    def score(self, images, prompts, metadata, ref_images=None) -> RewardResult:
        # each image's panels (two or more: see applies()), every unordered pair of them
        return self.score_pairs([(split_panels(im, *grid_shape(prompt, meta)), None)
                                 for im, prompt, meta in zip(images, prompts, metadata)], prompts, metadata)

    def score_pairs(self, sets: list[tuple[list[Image.Image], list[tuple[int, int]] | None]], prompts: list[str],
                    metadata: list[dict]) -> RewardResult:
        """Each sample's images and the pairs of them to ask about (None: every unordered pair): the
        judge's P(Yes) per question, averaged over pairs, then criteria, then dimensions."""
        questions, structures = {}, []
        for (panels, pairs), prompt, meta in zip(sets, prompts, metadata):
            digests = [image_digest(p) for p in panels]
            by_digest = dict(zip(digests, panels))
            structure = self._structure(digests, prompt, meta, pairs)
            for dim in structure:
                for crit in dim:
                    for key in crit:
                        questions.setdefault(key, ((by_digest[key[0]], by_digest[key[1]]), key[2]))
            structures.append(structure)
        answers = self.judge(questions)
        scores, errors = [], []
        for structure in structures:
            keys = [k for dim in structure for crit in dim for k in crit]
            err = next((answers[k] for k in keys if isinstance(answers[k], RewardError)), None)
            errors.append(err)
            if err is not None or not structure:
                scores.append(math.nan)
                continue
            scores.append(float(np.mean([np.mean([np.mean([answers[k] for k in crit]) for crit in dim])
                                         for dim in structure])))
        return self._finish(scores, errors)


class ConsistencyForEditing(RemoteJudge):
    """sqrt(P_consistent * P_follows) for each (reference, edited) pair: two questions per sample
    and input image (the input first), asked once per distinct (input, edit, instruction) and cached
    by content. The result carries both probabilities as parts 'consistency' and 'following' (of
    the weakest input, whose score is the sample's), and for multi-image edits each input's score
    as 'input1', 'input2', ..."""

    name = "consistency_for_editing"

    def score(self, images, prompts, metadata, ref_images=None) -> RewardResult:
        ref_sets = reference_sets(ref_images, len(images), self.name)
        questions, per_sample, digests = {}, [], {}
        for refs, edited, prompt in zip(ref_sets, images, prompts):
            d_edit = image_digest(edited)
            per_input = []
            for ref in refs:
                if id(ref) not in digests:  # a group's k samples usually share their references
                    digests[id(ref)] = image_digest(ref)
                keys = []
                for template in (EDIT_CONSISTENCY_TEMPLATE, EDIT_FOLLOWING_TEMPLATE):
                    key = (digests[id(ref)], d_edit, template.format(prompt=prompt))
                    questions.setdefault(key, ((ref, edited), key[2]))
                    keys.append(key)
                per_input.append(keys)
            per_sample.append(per_input)
        answers = self.judge(questions)
        scores, errors, cons, follow, terms = [], [], [], [], []
        for per_input in per_sample:
            keys = [k for pair in per_input for k in pair]
            err = next((answers[k] for k in keys if isinstance(answers[k], RewardError)), None)
            errors.append(err)
            pairs = [(math.nan, math.nan) if err is not None else (answers[c], answers[f]) for c, f in per_input]
            s = [math.sqrt(pc * pf) for pc, pf in pairs]  # NaN when either is (failed, or neither Yes nor No)
            weakest = weakest_input(s)
            cons.append(pairs[weakest][0])
            follow.append(pairs[weakest][1])
            scores.append(s[weakest])
            terms.append(s)
        return self._finish(scores, errors, {"consistency": cons, "following": follow, **per_input_parts(terms)})
