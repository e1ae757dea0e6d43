"""Runs a configured set of rewards in the background, so scoring overlaps sampling.

`submit()` hands a finished rollout batch to each reward's worker threads and returns at once;
`collect()` waits for all submitted batches and returns one result per reward in submission
order (with its named parts, if any: `part_scores` flattens them for logging). A remote judge
scores up to `batches_in_flight` batches at once: its time is the server's latency, not this
host's work, so batch b+1's requests must not queue behind batch b's answers (a judge slower per
batch than the sampler would otherwise set the epoch's pace). A local reward (CLIP on the
trainer's device) scores one batch at a time: more would only contend for the same device.
With `on_failure: mask` a reward that raises marks its samples invalid (counted; only the failed
ones when it raises a PartialRewardError), with `raise` the error stops the run, and so does a
batch of which no sample the reward applies to could be scored. A batch whose samples the reward
does not apply to at all (one-panel images for a pairwise judge) is no failure.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from paco_ds.recipe.schema import RewardSet
from paco_ds.errors import RewardError
from paco_ds.images import is_video, to_media
from paco_ds.rewards.base import PartialRewardError, Reward, RewardResult
from paco_ds.rewards.registry import build_reward

log = logging.getLogger(__name__)


def concat_results(rs: list[RewardResult]) -> RewardResult:
    """Batches in order; a part missing from a batch (e.g. a failed one) is NaN there."""
    if not rs:
        return RewardResult(np.zeros(0), np.zeros(0, bool))
    names = dict.fromkeys(p for r in rs for p in r.parts)
    parts = {p: np.concatenate([r.parts.get(p, np.full(len(r.scores), np.nan)) for r in rs]) for p in names}
    return RewardResult(np.concatenate([r.scores for r in rs]), np.concatenate([r.valid for r in rs]), parts,
                        np.concatenate([r.applicable for r in rs]))


def _applies(reward: Reward, prompts: list[str], metadata: list[dict], images: list) -> np.ndarray:
    """Which samples `reward` applies to (a failed batch's samples it does not apply to stay so)."""
    frames = [len(im) for im in images] if is_video(images) else [1] * len(prompts)
    return np.array([reward.applies_to(p, m, f) is None for p, m, f in zip(prompts, metadata, frames)], dtype=bool)


def part_scores(results: dict[str, RewardResult]) -> dict[str, np.ndarray]:
    """The named parts of each reward as {'<reward>/<part>': scores}, NaN where the reward is
    invalid: what a trainer logs as reward/<reward>/<part>/mean next to the rewards themselves."""
    return {f"{name}/{part}": np.where(r.valid, values, np.nan)
            for name, r in results.items() for part, values in r.parts.items()}


class RewardRunner:
    def __init__(self, spec: RewardSet, where: str = "rewards.train.terms", shared: dict[str, Reward] | None = None,
                 overlap: bool = True, batches_in_flight: int = 8, **context):
        """`shared`: already-built rewards to reuse when the name and arguments are the same.
        `overlap=False` scores each batch inside `submit` (the synchronous baseline).
        `batches_in_flight`: batches a remote reward scores at once (local rewards: 1)."""
        if batches_in_flight < 1:
            raise ValueError(f"batches_in_flight must be >= 1 (got {batches_in_flight})")
        self.spec, self.overlap = spec, overlap
        self.weights = {name: term.weight for name, term in spec.terms.items()}
        self.rewards: dict[str, Reward] = {}
        for name, term in spec.terms.items():
            key = (name, tuple(sorted(term.kwargs.items())))
            if shared is not None and key in shared:
                self.rewards[name] = shared[key]
            else:
                self.rewards[name] = build_reward(name, term.kwargs, where=where, **context)
                if shared is not None:
                    shared[key] = self.rewards[name]
        self.pools = {name: ThreadPoolExecutor(max_workers=batches_in_flight if r.remote else 1,
                                               thread_name_prefix=f"reward:{name}")
                      for name, r in self.rewards.items()}
        self.pending: list[tuple[int, dict[str, Future]]] = []
        self.busy_seconds = 0.0  # summed time the reward functions ran
        self.failures = 0
        self._lock = threading.Lock()

    def _run(self, name: str, reward: Reward, images, prompts, metadata, ref_images) -> RewardResult:
        t0 = time.perf_counter()
        try:
            res = reward(images, prompts, metadata, ref_images)
            judged = int(res.applicable.sum())  # samples the reward does not apply to are not failures
            if self.spec.on_failure == "raise" and judged and not res.valid.any():
                # every answer invalid (a judge that never answers with a score): training on nothing
                # would look like training; with `raise` that stops the run, as a failed request does
                raise RewardError(f"reward '{name}': none of the {judged} samples of a batch it applies to could be "
                                  "scored (every answer was invalid; on_failure: raise)")
        except Exception as err:  # noqa: BLE001 - the policy decides, and the error is reported either way
            if self.spec.on_failure == "raise":
                if isinstance(err, RewardError):
                    raise
                raise RewardError(f"reward '{name}' failed: {type(err).__name__}: {err}") from err
            partial = isinstance(err, PartialRewardError)
            res = err.result if partial else RewardResult.failed(len(prompts), _applies(reward, prompts, metadata, images))
            n_failed = int(err.failed.sum()) if partial else int(res.applicable.sum())
            log.warning("reward '%s' failed on %d of %d samples (masked): %s", name, n_failed, len(prompts), err)
            with self._lock:
                self.failures += n_failed
        finally:
            with self._lock:
                self.busy_seconds += time.perf_counter() - t0
        return res

    def raise_if_failed(self) -> None:
        """With `on_failure: raise`, the error of a batch already scored, at once: a judge that
        answers nonsense stops the run at the next rollout batch, not after the epoch's sampling
        (minutes later) when collect() would have found it."""
        if self.spec.on_failure != "raise":
            return
        with self._lock:  # a consumer of collect_oldest may be taking the oldest meanwhile
            pending = list(self.pending)
        for _, futures in pending:
            for fut in futures.values():
                if fut.done() and not fut.cancelled() and fut.exception() is not None:
                    for _, others in pending:
                        for other in others.values():
                            other.cancel()
                    with self._lock:
                        self.pending = []
                    raise fut.exception()

    def submit(self, images, prompts: list[str], metadata: list[dict], ref_images=None) -> None:
        self.raise_if_failed()
        pil = to_media(images)  # PIL images, or each video's PIL frames
        futures = {name: self.pools[name].submit(self._run, name, r, pil, list(prompts), list(metadata), ref_images)
                   for name, r in self.rewards.items()}
        with self._lock:
            self.pending.append((len(pil), futures))
        if not self.overlap:
            for fut in futures.values():
                fut.exception()  # wait here; errors surface in collect()

    def in_flight(self) -> int:
        """Submitted batches some reward is still scoring (colocated judges must not sleep then)."""
        return sum(any(not f.done() for f in futures.values()) for _, futures in self.pending)

    def collect(self) -> dict[str, RewardResult]:
        """Wait for everything submitted; concatenate per reward in submission order."""
        pending, self.pending = self.pending, []
        out: dict[str, list[RewardResult]] = {name: [] for name in self.rewards}
        try:
            for _, futures in pending:
                for name, fut in futures.items():
                    out[name].append(fut.result())
        except BaseException:
            for _, futures in pending:
                for fut in futures.values():
                    fut.cancel()
            raise
        return {name: concat_results(rs) for name, rs in out.items()}

    def collect_oldest(self) -> dict[str, RewardResult]:
        """The results of the oldest batch not collected yet, once every reward has scored it: a consumer
        thread takes the batches one at a time, in submission order, while `submit` goes on (the samplers
        of rollout.mode: async hand each scored batch to the trainers as soon as it is scored)."""
        with self._lock:
            _, futures = self.pending.pop(0)
        try:
            return {name: fut.result() for name, fut in futures.items()}
        except BaseException:
            for fut in futures.values():
                fut.cancel()
            raise

    def score(self, images, prompts, metadata, ref_images=None) -> dict[str, RewardResult]:
        """Synchronous convenience: submit one batch and collect it."""
        self.submit(images, prompts, metadata, ref_images)
        return self.collect()

    def take_latencies(self) -> list[float]:
        """Request latencies (seconds) of the remote rewards since the last call; a reward shared
        with another runner (train and test) reports its requests once, to whichever asks first."""
        return [t for r in {id(r): r for r in self.rewards.values()}.values() for t in r.take_latencies()]

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        for r in set(self.rewards.values()):
            r.close()
