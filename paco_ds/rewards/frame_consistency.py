"""`frame_consistency`: PaCo-Reward's pairwise question asked across a video's frames.

The judge, the request, the templates and the reading are `consistency_score`'s
(paco_ds/rewards/consistency.py): two images and the same question (template 1: "do the two images
maintain consistency in terms of style, logic and identity?" with the prompt's description as the
theme; template 0: one question per consistency criterion of the record), the score P(Yes) / (P(Yes)
+ P(No)) from the first token's top log-probabilities, averaged over pairs, then criteria, then
dimensions. What differs is which images are paired:

- the video's frames are first sampled down to at most `max_frames`, evenly spaced with the first
  and the last kept, so the requests per video are bounded whatever the frame count (81 frames, 8
  kept: 7 pairs x the criteria); `--dry-run` prints the count;
- `pairs: adjacent` asks about each sampled frame and the next (the video changes smoothly from
  frame to frame), `pairs: first` about each sampled frame and the first (it stays the video of its
  first frame: identity and style do not drift).

A video of one frame has no pair to ask about: the reward does not apply to it (`applies_to`), which
is neither a score nor a failure: its samples train on the recipe's other rewards. Identical frames
give one question (requests are deduplicated by content), and the cache across calls is
consistency_score's.
"""
from __future__ import annotations

from typing import Literal

import numpy as np

from paco_ds.errors import ConfigError
from paco_ds.rewards.base import Count, ImageFormat, JpegQuality, NonNegative, RewardResult, Seconds
from paco_ds.rewards.consistency import ConsistencyScore

MAX_FRAMES = 8


def sampled_frames(n: int, max_frames: int) -> list[int]:
    """Indices of at most `max_frames` of `n` frames, evenly spaced, the first and the last included."""
    return sorted({int(round(i)) for i in np.linspace(0, n - 1, min(n, max_frames))})


def frame_pairs(k: int, pairs: str) -> list[tuple[int, int]]:
    """The pairs of `k` sampled frames to ask about, the earlier frame first."""
    if pairs == "adjacent":
        return [(i, i + 1) for i in range(k - 1)]
    return [(0, j) for j in range(1, k)]


class FrameConsistency(ConsistencyScore):
    name = "frame_consistency"
    video = "video"  # it judges the frames of a video itself

    def __init__(self, model: str = "PaCo-Reward-7B", base_url: str | None = None,
                 pairs: Literal["adjacent", "first"] = "adjacent", max_frames: Count = MAX_FRAMES,
                 prompt_template_version: Literal[0, 1] = 1,
                 image_format: ImageFormat = "png", jpeg_quality: JpegQuality = 75, top_logprobs: Count = 20,
                 canonicalize: bool = False, max_concurrency: Count = 64, timeout: Seconds = 60.0,
                 max_attempts: Count = 8, retry_budget: NonNegative = 120.0, backoff: NonNegative = 0.5,
                 api_key_env: str = "PACO_REWARD_API_KEY", cache_size: Count = 65536,
                 reward_endpoints: dict[str, str] | None = None):
        if pairs not in ("adjacent", "first"):
            raise ConfigError(f"frame_consistency.pairs: '{pairs}' (adjacent: each frame and the next; first: each "
                              "frame and the first)")
        if max_frames < 2:
            raise ConfigError(f"frame_consistency.max_frames: {max_frames}; a pair needs at least 2 frames")
        self.pairs, self.max_frames = pairs, max_frames
        super().__init__(model, base_url, prompt_template_version, image_format, jpeg_quality, top_logprobs,
                         canonicalize, max_concurrency, timeout, max_attempts, retry_budget, backoff, api_key_env,
                         cache_size, reward_endpoints)

    @classmethod
    def applies(cls, prompt: str, metadata: dict) -> str | None:
        return None  # a video's frames, not a grid's panels: the layout does not matter

    @classmethod
    def applies_to(cls, prompt: str, metadata: dict, frames: int = 1) -> str | None:
        if frames < 2:
            return f"a video of {frames} frame has no pair of frames to compare"
        return None

    @classmethod
    def requests_per_video(cls, frames: int, metadata: dict, max_frames: int = MAX_FRAMES,
                           prompt_template_version: int = 1, **_) -> int:
        """The judge requests a video of `frames` frames of this record costs at most (fewer where
        frames are identical or already answered): its frame pairs x the questions per pair."""
        pairs = max(min(frames, max_frames) - 1, 0)
        if prompt_template_version == 1:
            return pairs
        texts = [t for crits in (metadata.get("criteria") or {}).values() for t in (crits or {}).values()
                 if isinstance(t, str) and t.strip()]
        return pairs * len(texts)

    def score(self, images, prompts, metadata, ref_images=None) -> RewardResult:
        """`images`: each sample's frames (a list of PIL images; two or more: see applies_to)."""
        sets = []
        for frames in images:
            kept = [frames[i] for i in sampled_frames(len(frames), self.max_frames)]
            sets.append((kept, frame_pairs(len(kept), self.pairs)))
        return self.score_pairs(sets, prompts, metadata)
