"""OCR: does the image show the text the prompt puts in double quotes?

Flow-GRPO's definition (yifan123/flow_grpo, flow_grpo/ocr.py): the target is the first quoted span
of the prompt (`prompt.split('"')[1]`), the recognised text is every recognised line joined; both
lose their spaces and are lower-cased; the distance is 0 when the target occurs in the recognised
text, else the Levenshtein distance, capped at the target's length (many unrelated characters cost
no more than reading nothing); the score is 1 - distance / len(target), in [0, 1].

Flow-GRPO recognises with PaddleOCR (English). Here the recogniser is RapidOCR
(`rapidocr_onnxruntime`): PaddleOCR's PP-OCRv4 detection and recognition networks exported to ONNX
and shipped inside the wheel, so the real recogniser runs offline on a CPU with no download; the
tiny form is the same recogniser. Differences from Flow-GRPO: a prompt with no quoted text, or an
image the recogniser fails on, is an invalid sample (a RewardError naming it), not a crash or a
maximal penalty: a score is never a silent 0. An image in which nothing is recognised scores 0,
as it should.
"""
from __future__ import annotations

import math
import threading

import numpy as np

from paco_ds.errors import ConfigError, RewardError
from paco_ds.rewards.base import Count, Fraction, PartialRewardError, Reward, RewardResult


def quoted_text(prompt: str) -> str | None:
    """The first double-quoted span of a prompt, as Flow-GRPO takes it; None without one."""
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else None


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions of one character each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def ocr_score(target: str, recognised: str) -> float:
    """Flow-GRPO's OCR reward of one image (see the module docstring)."""
    target = target.replace(" ", "").lower()
    recognised = recognised.replace(" ", "").lower()
    if not target:
        raise ValueError("the quoted text is empty")
    dist = 0 if target in recognised else min(edit_distance(recognised, target), len(target))
    return 1.0 - dist / len(target)


class OcrReward(Reward):
    name = "ocr"

    @classmethod
    def check_record(cls, prompt: str, metadata: dict) -> str | None:
        target = quoted_text(prompt)
        if target is None:
            return "the prompt has no double-quoted text for the OCR reward to read"
        return None if target.strip() else "the prompt's quoted text is empty"

    def __init__(self, min_confidence: Fraction = 0.0, tiny: bool = False, device: str = "cpu", threads: Count = 1):
        """`min_confidence`: recognised lines at or below this confidence are dropped (Flow-GRPO keeps
        every line with confidence > 0). `threads`: onnxruntime's intra-op threads (the recogniser runs
        on the CPU beside the trainer). `tiny` changes nothing: the real recogniser ships in its wheel."""
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as err:
            raise ConfigError("reward 'ocr' needs the OCR recogniser: pip install rapidocr_onnxruntime "
                              f"({type(err).__name__}: {err})") from None
        if not 0.0 <= min_confidence < 1.0:
            raise ConfigError(f"ocr.min_confidence: {min_confidence} (use a value in [0, 1))")
        self.min_confidence = min_confidence
        # As Flow-GRPO configures PaddleOCR: no text-angle classifier (use_angle_cls=False), every line
        # above the confidence floor kept, and PaddleOCR's detector size (longest side at most 960;
        # RapidOCR's own default scales the shortest side up to 736, 2-3x the work on 512px images).
        self.engine = RapidOCR(intra_op_num_threads=threads, inter_op_num_threads=1, use_cls=False,
                               text_score=min_confidence, det_limit_type="max", det_limit_side_len=960)
        self._lock = threading.Lock()  # one onnxruntime session pair: one image at a time

    def recognise(self, image) -> str:
        """Every recognised line (top to bottom, left to right, as the recogniser orders its boxes) joined."""
        with self._lock:
            result, _ = self.engine(np.asarray(image.convert("RGB")))
        return "".join(text for _, text, conf in (result or []) if float(conf) > self.min_confidence)

    def score(self, images, prompts, metadata, ref_images=None) -> RewardResult:
        scores, errors, recognised_len = [], [], []
        for i, (im, prompt) in enumerate(zip(images, prompts)):
            target = quoted_text(prompt)
            if target is None or not target.replace(" ", ""):
                scores.append(math.nan)
                recognised_len.append(math.nan)
                errors.append(RewardError(f"ocr: prompt {i} has no text in double quotes to read: {prompt[:80]!r}"))
                continue
            try:
                text = self.recognise(im)
            except Exception as err:  # noqa: BLE001 - the sample is invalid, and the error says why
                scores.append(math.nan)
                recognised_len.append(math.nan)
                errors.append(RewardError(f"ocr: the recogniser failed on image {i}: {type(err).__name__}: {err}"))
                continue
            scores.append(ocr_score(target, text))
            recognised_len.append(len(text))
            errors.append(None)
        return PartialRewardError.check(self.name, RewardResult.ok(scores, {"recognised_chars": recognised_len}),
                                        errors)
