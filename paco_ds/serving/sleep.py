"""Sleep and wake the judges of a run whose judges share the trainers' devices (`cluster.colocate`).

The protocol, per epoch (paco_ds/grpo/trainer.py):
  wake   before evaluation/sampling: every rank first frees what training left behind (its
         activations and gradients are gone; `torch.cuda.empty_cache()` returns the allocator's
         cache), a barrier, then the owners wake their judges, a barrier. During sampling the
         judge is awake next to the sampler (rewards overlap sampling); under ZeRO-3 the gathered
         transformer copy lives only for the sampling phase and is released when it ends.
  sleep  after scoring: every rank has collected its rewards (score_epoch's all-gather), so no
         request is in flight; the owners put their judges to sleep (level 1: weights off the
         device, caches freed; a judge still drains what it holds before it sleeps), a barrier,
         then training allocates.
Who owns a judge: local rank 0 of each node, for the judges on its own host (the ones whose
memory it competes with): the servers its run started, or under launch/cluster.py the judges of
PACO_REWARD_ENDPOINTS whose address is this host's.

Same endpoints on vLLM (`--enable-sleep-mode`, VLLM_SERVER_DEV_MODE=1) and on the hf engine:
`POST /sleep?level=1&mode=wait`, `POST /wake_up`, `GET /is_sleeping`. vLLM's /sleep aborts the
requests in flight unless asked otherwise (its `mode` defaults to "abort"); `mode=wait` lets them
finish first, which is what the hf engine always does. The trainer, besides, sleeps its judges only
when none of its own reward requests is in flight (`sleep(in_flight=...)`). vLLM's sleep mode runs on
GPUs only (its CPU build refuses --enable-sleep-mode): on CPU the hf engine is the one that sleeps.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import httpx

from paco_ds.errors import UserError


class JudgeSleepError(UserError):
    """A judge refused to sleep or wake, or did not answer."""


# vLLM's PauseMode (vllm/v1/engine/__init__.py): "abort" (its default) drops the requests in flight,
# "wait" lets them complete before the engine sleeps, "keep" freezes them until it wakes.
SLEEP_MODE = "wait"


def sleep_path(level: int = 1) -> str:
    """The sleep request: the level, and in-flight requests finish first."""
    return f"/sleep?level={level}&mode={SLEEP_MODE}"


def base_url(url: str) -> str:
    """A judge's server root from its OpenAI base URL (`http://h:p/v1` -> `http://h:p`)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class JudgeSleep:
    """Sleeps and wakes a list of judges together (in parallel), and counts what it did. The
    judges start awake."""

    def __init__(self, urls: list[str], token: str | None = None, timeout: float = 900.0):
        self.urls = [base_url(u) for u in urls]
        self.headers = {"authorization": f"Bearer {token}"} if token else {}
        self.timeout = timeout
        self.awake = True
        self.counts = {"sleeps": 0, "wakes": 0}
        self.seconds = {"sleep_s": 0.0, "wake_s": 0.0}

    def _post(self, path: str) -> list[dict]:
        def one(url: str) -> dict:
            try:
                r = httpx.post(f"{url}{path}", headers=self.headers, timeout=self.timeout)
            except httpx.HTTPError as err:
                raise JudgeSleepError(f"judge {url}: POST {path} failed: {type(err).__name__}: {err}") from None
            if r.status_code != 200:
                raise JudgeSleepError(f"judge {url}: POST {path} answered {r.status_code}: {r.text[:300]}")
            try:
                return r.json() if r.content else {}
            except ValueError:
                return {}  # vLLM answers an empty 200

        if not self.urls:
            return []
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            return list(pool.map(one, self.urls))

    def sleep(self, level: int = 1, in_flight: int = 0) -> float:
        """Every judge asleep (each lets its in-flight requests finish first); returns the seconds.
        `in_flight`: reward batches the caller still has at the judges; a sleep then would stall
        them (or, asked of vLLM without mode=wait, abort them), so it is refused."""
        if not self.awake:
            return 0.0
        if in_flight:
            raise JudgeSleepError(f"{in_flight} reward batches are still in flight at the judges "
                                  f"({', '.join(self.urls)}); collect them before the judges sleep")
        t0 = time.perf_counter()
        self._post(sleep_path(level))
        self.awake = False
        dt = time.perf_counter() - t0
        if self.urls:
            self.counts["sleeps"] += 1
            self.seconds["sleep_s"] += dt
        return dt

    def wake(self) -> float:
        if self.awake:
            return 0.0
        t0 = time.perf_counter()
        self._post("/wake_up")
        self.awake = True
        dt = time.perf_counter() - t0
        if self.urls:
            self.counts["wakes"] += 1
            self.seconds["wake_s"] += dt
        return dt

    def is_sleeping(self) -> dict[str, bool]:
        out = {}
        for url in self.urls:
            r = httpx.get(f"{url}/is_sleeping", headers=self.headers, timeout=30.0)
            r.raise_for_status()
            out[url] = bool(r.json()["is_sleeping"])
        return out

    def take_metrics(self) -> dict[str, float]:
        """`judge/sleeps`, `judge/wakes`, `judge/sleep_s`, `judge/wake_s` since the last call."""
        out = {f"judge/{k}": float(v) for k, v in {**self.counts, **self.seconds}.items()}
        self.counts = dict.fromkeys(self.counts, 0)
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        return out


def judges_for_run(servers, run_dir: str | Path, local_rank: int, environ=os.environ) -> list[str]:
    """The base URLs of the judges this process puts to sleep and wakes: none but on local rank 0;
    there, the judges on this host (launch/cluster.py's) or the engines this node's run started."""
    if servers is None or local_rank != 0:
        return []
    from paco_ds.serving.routing import ENDPOINTS_ENV, is_local, parse

    value = environ.get(ENDPOINTS_ENV, "").strip()
    if value:
        urls = [u for us in parse(value).values() for u in us]
        return list(dict.fromkeys(base_url(u) for u in urls if is_local(u)))
    from paco_ds.serving.manager import read_state, run_state_dir

    return [s["url"] for s in read_state(run_state_dir(run_dir))["servers"] if s["role"] == "engine"]


class ColocatedJudges:
    """cluster.colocate: the judges share the trainers' devices, awake for evaluation, sampling and
    scoring, asleep for training. `in_flight()` counts the reward requests still at the judges."""

    def __init__(self, judges: JudgeSleep, in_flight: Callable[[], int]):
        self.judges, self.in_flight = judges, in_flight

    @classmethod
    def for_run(cls, cfg, run_dir: Path, local_rank: int, in_flight: Callable[[], int]) -> "ColocatedJudges | None":
        """None unless the recipe colocates its judges (cluster.colocate with reward_servers)."""
        if cfg.cluster is None or not cfg.cluster.colocate or cfg.reward_servers is None:
            return None
        urls = judges_for_run(cfg.reward_servers, run_dir, local_rank)
        return cls(JudgeSleep(urls, os.environ.get(cfg.reward_servers.api_key_env)), in_flight)

    def switch(self, wake: bool) -> dict[str, float]:
        """Wake the judges before evaluation and sampling (after freeing the device cache training
        left), put them to sleep before training (every rank has collected its rewards, so nothing
        is in flight). Collective: every rank calls it at the same points, and a judge that fails
        on one rank raises on all."""
        import gc

        import torch

        from paco_ds.runtime.distributed import any_true, barrier

        key = "wake" if wake else "sleep"
        out = {f"judge/{key}s": 0.0, f"judge/{key}_s": 0.0}
        if self.judges.awake == wake:
            return out
        t0 = time.perf_counter()
        if wake:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        barrier()
        error = None
        try:
            if wake:
                self.judges.wake()
            else:  # refused while a reward batch is still at the judges (it would stall, or be aborted)
                self.judges.sleep(in_flight=self.in_flight())
        except Exception as err:  # noqa: BLE001 - raised below on every rank together
            error = err
        if any_true(error is not None):
            raise error if error is not None else JudgeSleepError(f"a judge on another node failed to {key}")
        return {f"judge/{key}s": 1.0, f"judge/{key}_s": time.perf_counter() - t0}
