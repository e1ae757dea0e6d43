"""An OpenAI-API client for reward servers: async inside, blocking outside.

Rewards are called from a worker thread of the RewardRunner, so the client owns an event loop
on its own thread and callers block on `run()`; many requests are then in flight at once
(bounded by `max_concurrency`) without `asyncio.run` per call. Each request retries transient
failures (connection errors, timeouts, 408, 409, 429 and 5xx) with exponential backoff and jitter,
waiting at least what the server's `Retry-After` asks, within a total time budget (`RetryPolicy`,
which the GenEval client shares), then raises a RewardError naming the endpoint and the model. A request the
server rejects (400, 401, 404) is not retried. `check_model()` asks the server which names it
serves, so a misspelled model is an error at start-up, not minutes of retries scoring 0.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import difflib
import email.utils
import logging
import math
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Hashable, Sequence

import openai

from paco_ds.errors import ConfigError, RewardError

log = logging.getLogger(__name__)

RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 8
    backoff: float = 0.5  # seconds before the second attempt; doubles each time
    max_backoff: float = 8.0
    budget: float = 120.0  # total seconds for one request, all attempts and waits included
    timeout: float = 60.0  # seconds for one attempt

    def delay(self, attempt: int, asked: float | None = None) -> float:
        """Exponential backoff with jitter: a uniform draw in [d/2, d] so that clients that failed
        together do not retry together; at least what the server asked for (`Retry-After`), which
        paco_ds's own judge sends while it sleeps beside training."""
        d = min(self.max_backoff, self.backoff * 2 ** attempt)
        return max(random.uniform(d / 2, d), asked or 0.0)


def retry_after(headers) -> float | None:
    """The seconds a `Retry-After` header asks for (delta-seconds or an HTTP date), None without one."""
    value = headers.get("retry-after") if headers is not None else None
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class ChatClient:
    """One served model at one base URL."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, max_concurrency: int = 64,
                 retry: RetryPolicy = RetryPolicy()):
        self.base_url, self.model, self.retry = base_url.rstrip("/"), model, retry
        self.where = f"reward server {self.base_url} (model '{model}')"
        self._closing = False  # set by close(): callers of run() stop waiting on the loop
        self._latencies: list[float] = []  # seconds per answered request, until take_latencies()
        self._latency_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"reward-client:{model}", daemon=True)
        self._thread.start()

        async def setup():
            self._sem = asyncio.Semaphore(max_concurrency)
            # The openai client's own retries are off: ours have a total budget and jitter.
            return openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key or "none", max_retries=0,
                                      timeout=retry.timeout)

        self._client = self.run([setup()])[0]

    # ---------------------------------------------------------------------------------- running
    def run(self, coros: Sequence[Awaitable], return_exceptions: bool = False) -> list:
        """Run coroutines concurrently on the client's loop and wait for all of them.

        A caller that arrives while or after the client closes gets CancelledError: its coroutine
        would be queued on a loop that no longer runs, and waiting on it would block forever, and
        with it the interpreter's exit (it joins the reward threads): a run that had printed its
        error would then never end."""
        async def gather():
            return await asyncio.gather(*coros, return_exceptions=return_exceptions)

        if self._closing or self._loop.is_closed():
            for c in coros:
                getattr(c, "close", lambda: None)()  # never awaited: no "coroutine was never awaited" warning
            raise concurrent.futures.CancelledError(f"{self.where}: the client is closed")
        fut = asyncio.run_coroutine_threadsafe(gather(), self._loop)
        while True:
            try:
                return fut.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                if self._closing and not self._loop.is_running():
                    fut.cancel()
                    raise concurrent.futures.CancelledError(f"{self.where}: the client is closed") from None

    def answers(self, requests: dict[Hashable, Awaitable], parse: Callable[[Any], Any]) -> dict[Hashable, Any]:
        """Each request's answer through `parse`, the requests run concurrently; a request that failed
        after its retries, or whose answer `parse` refuses (ValueError: an answer that makes no
        sense), maps to a RewardError naming this server. It is a failure, never a score."""
        out: dict[Hashable, Any] = {}
        for key, res in zip(requests, self.run(list(requests.values()), return_exceptions=True) if requests else []):
            if isinstance(res, RewardError):
                out[key] = res
            elif isinstance(res, BaseException):
                raise res
            else:
                try:
                    out[key] = parse(res)
                except ValueError as err:
                    out[key] = RewardError(f"{self.where}: invalid answer: {err}")
        return out

    async def _with_retries(self, what: str, call: Callable[[float], Awaitable[Any]], timed: bool = True) -> Any:
        """`timed`: the answered attempt's latency goes to take_latencies() (scoring requests)."""
        start = time.monotonic()
        deadline = start + self.retry.budget
        last: Exception | None = None
        for attempt in range(self.retry.max_attempts):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                async with self._sem:
                    t0 = time.perf_counter()
                    result = await call(min(self.retry.timeout, left))
                if timed:
                    with self._latency_lock:
                        self._latencies.append(time.perf_counter() - t0)
                return result
            except openai.APIStatusError as err:
                if err.status_code not in RETRY_STATUS:
                    raise RewardError(f"{self.where}: {what} rejected with HTTP {err.status_code}: "
                                      f"{_message(err)}") from None
                last = err
            except openai.APIConnectionError as err:  # includes timeouts
                last = err
            wait = self.retry.delay(attempt, retry_after(getattr(getattr(last, "response", None), "headers", None)))
            if time.monotonic() + wait >= deadline or attempt + 1 == self.retry.max_attempts:
                break
            log.debug("%s: %s failed (%s), retrying in %.2fs", self.where, what, _message(last), wait)
            await asyncio.sleep(wait)
        raise RewardError(f"{self.where}: {what} failed after {attempt + 1} attempts in "
                          f"{time.monotonic() - start:.1f}s: {_message(last)}")

    def take_latencies(self) -> list[float]:
        """Seconds from send to answer of each scoring request answered since the last call (the
        answering attempt; retries and the wait for a concurrency slot not included)."""
        with self._latency_lock:
            out, self._latencies = self._latencies, []
        return out

    # ---------------------------------------------------------------------------------- API
    async def served_models(self) -> list[str]:
        page = await self._with_retries("listing models", lambda t: self._client.models.list(timeout=t), timed=False)
        return [m.id for m in page.data]

    def check_model(self) -> None:
        """Fail now, listing the served names, when the server does not serve our model."""
        names = self.run([self.served_models()])[0]
        if self.model in names:
            return
        close = difflib.get_close_matches(self.model, names, n=1, cutoff=0.6)
        same_case = [n for n in names if n.lower() == self.model.lower()]
        hint = (f" (names are case-sensitive: did you mean '{same_case[0]}'?)" if same_case else
                f" (did you mean '{close[0]}'?)" if close else "")
        raise RewardError(f"model '{self.model}' is not served at {self.base_url}; served: "
                          f"{', '.join(names) or 'none'}{hint}")

    async def first_token_logprobs(self, content: list[dict], top_logprobs: int) -> list[tuple[str, float]]:
        """The top logprobs of the first generated token for one user turn: [(token, logprob)]."""
        async def call(timeout: float):
            return await self._client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": content}], temperature=0.0,
                max_completion_tokens=1, logprobs=True, top_logprobs=top_logprobs, timeout=timeout)

        resp = await self._with_retries("chat completion", call)
        self.check_answer_model(resp)
        try:
            first = resp.choices[0].logprobs.content[0]
        except (AttributeError, IndexError, TypeError):
            raise RewardError(f"{self.where}: the response has no logprobs for the first token (does the server "
                              f"return logprobs, with max_logprobs >= {top_logprobs}?)") from None
        return checked_logprobs(getattr(first, "top_logprobs", None), self.where)

    def check_answer_model(self, resp) -> None:
        """An answer must come from the model asked: a server (or a proxy in front of several) that
        answers with another model would score with the wrong judge. A dated snapshot of the name
        asked ('gpt-4o' answered by 'gpt-4o-2024-08-06', as OpenAI names them) is the same model."""
        got = getattr(resp, "model", None)
        if got is None:
            return  # the field is optional in practice (some servers omit it); nothing to compare
        if not isinstance(got, str):
            raise RewardError(f"{self.where}: malformed answer: field 'model' is {type(got).__name__}, not a string")
        if got != self.model and not got.startswith(self.model + "-"):
            raise RewardError(f"reward server {self.base_url}: asked model '{self.model}' but the answer is from "
                              f"model '{got}'; refused (is another model served at this address?)")

    def close(self) -> None:
        """Cancel what is in flight (a caller blocked in `run()` gets CancelledError instead of
        waiting forever on a stopped loop), close the connections, stop the loop thread."""
        if self._loop.is_closed():
            return
        self._closing = True

        async def shutdown():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._client.close()

        fut = asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
        try:
            fut.result(timeout=5)
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()


# A log-probability is <= 0. Servers round (a certain token may come back as 1e-7), so a positive
# value up to this much is read as 0; anything larger is not a probability and not a score.
LOGPROB_ROUNDING = 1e-4
# Probabilities of the top tokens may add up to a little over 1 from the server's rounding of each
# logprob (float32); more than this is not a distribution.
MASS_ROUNDING = 1e-3


def checked_logprobs(top, where: str) -> list[tuple[str, float]]:
    """[(token, logprob)] of a first token's top_logprobs, every entry checked; a malformed answer
    is a RewardError naming the endpoint and the field (an invalid answer, never a score)."""
    field = "choices[0].logprobs.content[0].top_logprobs"
    if not isinstance(top, (list, tuple)):
        got = "null" if top is None else type(top).__name__
        raise RewardError(f"{where}: malformed answer: field '{field}' is {got}, not a list")
    out = []
    for i, entry in enumerate(top):
        token, lp = getattr(entry, "token", None), getattr(entry, "logprob", None)
        if isinstance(entry, dict):
            token, lp = entry.get("token"), entry.get("logprob")
        if not isinstance(token, str):
            raise RewardError(f"{where}: malformed answer: field '{field}[{i}].token' is "
                              f"{'null' if token is None else type(token).__name__}, not a string")
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or math.isnan(lp):
            raise RewardError(f"{where}: malformed answer: field '{field}[{i}].logprob' is {lp!r}, not a number")
        if lp > LOGPROB_ROUNDING:
            raise RewardError(f"{where}: invalid answer: field '{field}[{i}].logprob' is {lp!r} for token "
                              f"{token!r}; a log-probability is <= 0")
        out.append((token, min(float(lp), 0.0)))
    mass = sum(math.exp(lp) for _, lp in out)
    if mass > 1.0 + MASS_ROUNDING:
        raise RewardError(f"{where}: invalid answer: the probabilities in field '{field}' add up to {mass:.4g}, "
                          "more than 1")
    return out


def _message(err: Exception | None) -> str:
    if isinstance(err, openai.APIStatusError):
        body = err.body if isinstance(err.body, dict) else {}
        msg = body.get("message") or (body.get("error") or {}).get("message") if body else None
        return f"HTTP {err.status_code}: {msg or err.message}"
    if isinstance(err, openai.APITimeoutError):
        return "timed out"
    if isinstance(err, openai.APIConnectionError):
        cause = err.__cause__
        return f"connection failed ({type(cause).__name__ if cause else 'no answer'})"
    return str(err)


def open_judge(reward: str, client_cls: type[ChatClient], model: str, base_url: str | None,
               reward_endpoints: dict[str, str] | None, api_key_env: str, max_concurrency: int,
               retry: RetryPolicy) -> ChatClient:
    """A checked client for a reward's judge: `base_url`, else the URL of the run's own server for
    `model`; the served model list must name `model` (else the client is closed and it raises)."""
    if base_url is None:
        served = reward_endpoints or {}
        if model not in served:
            raise ConfigError(f"{reward}: no base_url given and this run serves no model '{model}' "
                              f"(its reward_servers serve: {', '.join(served) or 'nothing'})")
        base_url = served[model]
    client = client_cls(base_url, model, os.environ.get(api_key_env), max_concurrency, retry)
    try:
        client.check_model()
    except RewardError:
        client.close()
        raise
    return client
