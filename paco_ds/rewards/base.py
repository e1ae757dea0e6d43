"""The reward interface.

A reward maps (images, prompts, metadata[, reference images]) to one float per sample plus a
validity mask. A reward that cannot score a sample raises (policy `raise`) or marks it invalid
(policy `mask`); it never returns a silent 0. Weights live in the config, not in the reward.

A third state is neither a score nor a failure: a sample the reward does not apply to by
construction (`Reward.applies`: a one-panel image has no pair of panels for a pairwise judge;
`Reward.applies_to`: a video of one frame has no pair of frames). Such a sample is
`applicable=False`: no question is asked, it is not counted as a failure, and the advantage step
trains it on the rewards that do apply (paco_ds/rewards/aggregate.py).

Videos (a video family's samples) reach a reward as one list of PIL frames per sample. A reward says
what it does with them (`Reward.video`): "video", it judges the frames itself (frame_consistency);
"frames", an image reward's per-frame form: each frame is scored as an image with its sample's
prompt, and the video's score is the mean over its frames (a frame that fails fails its video; each
part is averaged the same way); None, it scores images only, and a recipe giving it a video family's
samples is refused before the run starts (paco_ds/grpo/preflight.py).
"""
from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Sequence

import numpy as np
from PIL import Image

from paco_ds.errors import RewardError

# Types of the rewards' recipe arguments, in their constructors' annotations: the registry checks a
# recipe's values against them before anything starts (--dry-run too), one line naming the key.
try:
    from pydantic import Field
except ImportError:  # pragma: no cover - pydantic is a requirement; the annotations stay plain then
    def Field(**_):  # noqa: N802
        return None
Count = Annotated[int, Field(ge=1)]  # batch sizes, concurrency, attempts, tokens, threads, cache entries
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
Seconds = Annotated[float, Field(gt=0.0)]
NonNegative = Annotated[float, Field(ge=0.0)]
JpegQuality = Annotated[int, Field(ge=1, le=100)]
ImageFormat = Literal["png", "jpeg"]


@dataclass
class RewardResult:
    scores: np.ndarray  # float64 [B]; NaN where invalid
    valid: np.ndarray  # bool [B]
    # Named components the score is made of (float64 [B] each, e.g. consistency_for_editing's
    # 'consistency' and 'following'), for logging as reward/<name>/<part>; never used as rewards.
    parts: dict[str, np.ndarray] = field(default_factory=dict)
    # bool [B]: False where the reward does not apply by construction (Reward.applies); such a sample
    # is NaN and not valid, and it is neither a failure nor a score. None: it applies to every sample.
    applicable: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.applicable is None:
            self.applicable = np.ones(len(self.scores), dtype=bool)
        if (self.valid & ~self.applicable).any():
            raise ValueError("a sample the reward does not apply to cannot hold a valid score")

    @classmethod
    def ok(cls, scores: Sequence[float], parts: dict[str, Sequence[float]] | None = None,
           applicable: Sequence[bool] | None = None) -> "RewardResult":
        s = np.asarray(scores, dtype=np.float64)
        applies = np.ones(len(s), dtype=bool) if applicable is None else np.asarray(applicable, dtype=bool)
        s = np.where(applies, s, np.nan)
        return cls(s, np.isfinite(s), {k: np.asarray(v, dtype=np.float64) for k, v in (parts or {}).items()},
                   applies)

    @classmethod
    def failed(cls, n: int, applicable: np.ndarray | None = None) -> "RewardResult":
        return cls(np.full(n, np.nan), np.zeros(n, dtype=bool), applicable=applicable)

    @property
    def unjudged(self) -> np.ndarray:
        """bool [B]: applicable and still without a score (a failed request, an answer that is no score)."""
        return self.applicable & ~self.valid


class PartialRewardError(RewardError):
    """A reward failed on some samples of a batch only. `result` holds the scores of the others;
    under `mask` only the `failed` samples are masked."""

    def __init__(self, message: str, result: RewardResult, failed: np.ndarray):
        super().__init__(message)
        self.result, self.failed = result, failed

    @classmethod
    def check(cls, name: str, result: RewardResult, errors: list) -> RewardResult:
        """`result` if no sample failed (errors[i] is None), else raise naming the first error."""
        failed = np.array([e is not None for e in errors])
        if failed.any():
            first = next(e for e in errors if e is not None)
            raise cls(f"{name}: {int(failed.sum())} of {len(errors)} samples failed: {first}", result, failed)
        return result


def model_dtype(device):
    """The dtype of a local reward model (CLIP-H, PickScore) on `device`: bf16 on a GPU, where fp32
    would keep two 1B-parameter towers at 7.3 GiB per rank (docs/gpu_plan.md); fp32 on a CPU,
    where bf16 matmuls are slow. Similarities are taken in fp32 either way."""
    import torch

    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


@dataclass
class FullSizeReward:
    """A reward as a run builds it, its local models at full size on the meta device (the real
    classes from the published configs; no weights, nothing downloaded): what the GPU plan
    (paco_ds/gpu_plan/rewards.py) puts on its fake device and scores one rollout batch with."""

    reward: "Reward"
    models: list[tuple[Any, Any]]  # (module, dtype): what the reward keeps on its device, in that dtype


class Reward:
    """Subclasses implement `score`; `remote` rewards talk to a reward server."""

    name: str = "reward"
    remote: bool = False
    # What the reward does with a video (module docstring): "video", "frames" (the mean of its frames'
    # scores) or None (images only).
    video: Literal["video", "frames"] | None = None

    @classmethod
    def full_size(cls, device, **kwargs) -> FullSizeReward | None:
        """This reward with its recipe arguments `kwargs` at full size for the GPU plan, on `device`;
        None where it keeps no model on the device (a remote judge, a reward without a model). A
        reward with a local model describes it here, beside its constructor."""
        return None

    @classmethod
    def applies(cls, prompt: str, metadata: dict) -> str | None:
        """Why this reward has nothing to judge in a sample of this record by construction (a single
        panel for a pairwise judge), or None when it applies. Such samples are neither scored nor
        failed: --dry-run counts them, and the run trains them on the rewards that do apply."""
        return None

    @classmethod
    def applies_to(cls, prompt: str, metadata: dict, frames: int = 1) -> str | None:
        """`applies` for a sample of `frames` frames (1: an image); a reward judging videos adds its
        own rule (frame_consistency: a pair of frames to compare)."""
        return cls.applies(prompt, metadata)

    @classmethod
    def check_record(cls, prompt: str, metadata: dict) -> str | None:
        """Why this reward could never score a record of the data (checked for every record when the
        run starts, and by --dry-run), or None: a data file the reward cannot read is one line at
        load, not every sample masked (or a stopped run) at the first score."""
        return None

    def score(self, images: list[Image.Image], prompts: list[str], metadata: list[dict],
              ref_images: list[Image.Image] | None = None) -> RewardResult:
        raise NotImplementedError

    def __call__(self, images, prompts, metadata=None, ref_images=None) -> RewardResult:
        from paco_ds.images import is_video, to_media

        images = to_media(images)  # PIL images, or a list of PIL frames per sample (videos)
        metadata = list(metadata) if metadata is not None else [{} for _ in images]
        if not (len(images) == len(prompts) == len(metadata)):
            raise ValueError(f"{self.name}: {len(images)} images, {len(prompts)} prompts, {len(metadata)} metadata")
        prompts = list(prompts)
        video = is_video(images)
        if video and self.video is None:
            raise RewardError(f"{self.name} scores images and has no per-frame form: it cannot score videos")
        score = self.score_frames if video and self.video == "frames" else self.score
        frames = [len(im) if video else 1 for im in images]
        applies = np.array([self.applies_to(p, m, f) is None for p, m, f in zip(prompts, metadata, frames)], dtype=bool)
        if applies.all():
            return score(images, prompts, metadata, ref_images)
        # Only the samples the reward applies to are scored (no request is sent for the others).
        idx = np.flatnonzero(applies)
        n = len(images)
        if not idx.size:
            return RewardResult.failed(n, applicable=applies)
        refs = None if ref_images is None else (
            [ref_images[i] for i in idx] if isinstance(ref_images, (list, tuple)) else ref_images[idx])
        try:
            part = score([images[i] for i in idx], [prompts[i] for i in idx], [metadata[i] for i in idx], refs)
        except PartialRewardError as err:
            failed = np.zeros(n, dtype=bool)
            failed[idx] = err.failed
            raise PartialRewardError(str(err), _scatter(err.result, idx, applies), failed) from err
        return _scatter(part, idx, applies)

    def score_frames(self, videos: list[list[Image.Image]], prompts: list[str], metadata: list[dict],
                     ref_images=None) -> RewardResult:
        """The per-frame form: every frame scored as an image with its video's prompt and metadata (one
        `score` call for the batch's frames), each video's score and parts the mean over its frames; a
        video with a frame that failed or was not scored is invalid (NaN)."""
        owner = np.repeat(np.arange(len(videos)), [len(v) for v in videos])
        frames = [f for v in videos for f in v]
        try:
            res, failed = self.score(frames, [prompts[o] for o in owner], [metadata[o] for o in owner]), None
        except PartialRewardError as err:
            res, failed = err.result, err.failed

        def mean(values: np.ndarray) -> np.ndarray:  # per video; NaN propagates: a bad frame spoils its video
            return np.array([values[owner == i].mean() for i in range(len(videos))], dtype=np.float64)

        out = RewardResult.ok(mean(np.where(res.valid, res.scores, np.nan)),
                              {k: mean(v) for k, v in res.parts.items()})
        if failed is not None and failed.any():
            bad = np.array([failed[owner == i].any() for i in range(len(videos))])
            raise PartialRewardError(f"{self.name}: frames of {int(bad.sum())} of {len(videos)} videos failed",
                                     RewardResult(np.where(bad, np.nan, out.scores), out.valid & ~bad, out.parts), bad)
        return out

    def take_latencies(self) -> list[float]:
        """A remote reward's request latencies (seconds) since the last call; [] for local ones."""
        client = getattr(self, "client", None)
        return client.take_latencies() if client is not None else []

    def close(self) -> None:
        pass


def _scatter(result: RewardResult, idx: np.ndarray, applies: np.ndarray) -> RewardResult:
    """The result of the samples at `idx` placed among all samples; NaN and not valid elsewhere."""
    def spread(values: np.ndarray, fill) -> np.ndarray:
        out = np.full(len(applies), fill, dtype=values.dtype)
        out[idx] = values
        return out

    return RewardResult(spread(result.scores, np.nan), spread(result.valid, False),
                        {k: spread(v, np.nan) for k, v in result.parts.items()}, applies & spread(result.applicable, False))


def reference_sets(ref_images, n: int, name: str) -> list[tuple[Image.Image, ...]]:
    """The editing rewards' input images as RGB PIL images, a tuple per sample: its one reference,
    or a multi-image edit's inputs in order. Each sample's entry is a PIL image or a uint8
    [3, H, W] tensor/array (as paco_ds.data.edit.read_references returns; sizes may differ), or a
    tuple/list of them; or the whole is one [B, 3, H, W] batch. None, or a count that does not
    match, is a RewardError."""
    if ref_images is None:
        raise RewardError(f"{name} compares each edit with its reference image, and none was passed "
                          "(ref_images is None): it needs editing data (data.format: edit) and an editing policy")
    if not isinstance(ref_images, (list, tuple)):
        from paco_ds.images import to_pil

        ref_images = to_pil(ref_images)

    def rgb(im) -> Image.Image:
        if not isinstance(im, Image.Image):
            arr = im.detach().cpu().numpy() if hasattr(im, "detach") else np.asarray(im)
            if arr.ndim != 3 or arr.shape[0] != 3 or arr.dtype != np.uint8:
                raise RewardError(f"{name}: a reference image must be a PIL image or uint8 [3, H, W] "
                                  f"(got {arr.dtype} {list(arr.shape)})")
            im = Image.fromarray(arr.transpose(1, 2, 0))
        return im if im.mode == "RGB" else im.convert("RGB")

    out = [tuple(rgb(im) for im in entry) if isinstance(entry, (list, tuple)) else (rgb(entry),)
           for entry in ref_images]
    if len(out) != n:
        raise RewardError(f"{name} needs one reference image per sample (got {len(out)} for {n})")
    if any(not entry for entry in out):
        raise RewardError(f"{name}: a sample has an empty list of reference images")
    return out


def reference_images(ref_images, n: int, name: str) -> list[Image.Image]:
    """One reference image per sample (reference_sets' input); a multi-image edit is a RewardError
    for a reward that rates an edit against one original."""
    sets = reference_sets(ref_images, n, name)
    several = next((len(s) for s in sets if len(s) > 1), None)
    if several:
        raise RewardError(f"{name} rates an edit against one original image, and a sample has {several} input "
                          "images (multi-image editing: score it with consistency_for_editing or clip_i)")
    return [s[0] for s in sets]


def weakest_input(terms: Sequence[float]) -> int:
    """Which input image a multi-image edit's per-input scores combine to: the lowest (NaN if any
    is NaN: a term that failed or went unanswered is not skipped). The score of an edit of several
    images is its weakest consistency (docs/editing.md says why the minimum, not the mean)."""
    values = np.asarray(terms, dtype=np.float64)
    return int(np.argmax(np.isnan(values))) if np.isnan(values).any() else int(np.argmin(values))


def per_input_parts(terms: list[Sequence[float]]) -> dict[str, list[float]]:
    """Parts 'input1', 'input2', ...: each sample's per-input scores (NaN where a sample has fewer
    inputs), logged as reward/<name>/input<i>/mean; none when every sample has one input."""
    most = max((len(t) for t in terms), default=0)
    if most < 2:
        return {}
    return {f"input{i + 1}": [float(t[i]) if i < len(t) else math.nan for t in terms] for i in range(most)}


def image_digest(image: Image.Image) -> str:
    """Content hash of an image (size, mode and pixels): a cache key that survives re-encoding."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.size}{image.mode}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


class LRUCache:
    """A small bounded cache (used for per-panel scores that repeat across epochs and prompts).
    Thread-safe: a remote judge scores several batches at once from the RewardRunner's threads."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._data: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key):
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                self.hits += 1
                return self._data[key]
            self.misses += 1
            return None

    def put(self, key, value) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)
