"""The built-in reward engine: a Qwen2.5-VL (any transformers image-text-to-text checkpoint with a
chat template) behind the OpenAI chat API, on CPU or GPU.

vLLM needs a GPU and `transformers serve` ignores `logprobs`, so this engine implements what the
consistency rewards use: `GET /v1/models`, `GET /health`, and `POST /v1/chat/completions` with
text and data-URI images, greedy decoding, `max_tokens`, and `logprobs`/`top_logprobs` of the
generated tokens in OpenAI's response schema. `GET /stats` counts requests and batches, the wall
seconds in `generate` (the model, one batch at a time) and the CPU seconds of the requests' `prepare`. Sleep mode as
vLLM's (`POST /sleep?level=1`, `POST /wake_up`, `GET /is_sleeping`) for a judge colocated with training.

Dynamic batching: each request is templated and preprocessed on its own (so a bad request fails
alone, with a 400), then queued; a single worker takes what arrives within `batch_wait_ms` (up to
`max_batch_size`), left-pads it into one batch and runs `generate` once. Batched and unbatched
results agree to float rounding (tests/serving/test_hf_engine.py).

    python -m paco_ds.serving.hf_engine --model /path/to/ckpt --served-model-name PaCo-Reward-7B --port 8000
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import logging
import os
import tempfile
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from paco_ds.runtime.dtypes import DTYPES, resolve_dtype
from paco_ds.errors import ConfigError
from paco_ds.recipe.servers import API_KEY_ENV
from paco_ds.serving.protocol import (DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_PREPARE_MEMORY_MB, PREPARE_BYTES_PER_PIXEL,
                                     ApiError, ChatCompletionRequest, MemoryBudget, Message, check_image_count,
                                     check_image_pixels, decode_data_uri,
                                      guard_admin_paths, install_common, parse_chat_request, read_json,
                                      serve)

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16  # when a request names no max_tokens (the rewards always ask for 1)


@dataclass
class Prepared:
    """One request after templating and preprocessing: model inputs with a batch dimension of 1."""

    inputs: dict[str, torch.Tensor]
    max_tokens: int
    top_logprobs: int  # 0: none
    logprobs: bool


@dataclass
class Generation:
    token_ids: list[int]  # generated tokens, including a final end-of-sequence token
    logprobs: list[float]  # of each generated token
    top: list[list[tuple[int, float]]]  # top-k (id, logprob) per generated token; [] when not asked
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int


class Engine:
    """A model and its processor; turns prepared requests into greedy generations with logprobs."""

    def __init__(self, model, processor, max_model_len: int):
        self.model, self.processor = model.eval(), processor
        self.tokenizer = processor.tokenizer
        self.max_model_len = max_model_len
        self.device = next(model.parameters()).device
        if processor.chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("the checkpoint has no chat template")
        eos = model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos = set(eos) | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos)
        self._texts: dict[int, str] = {}
        # The number of logits a top_logprobs ranks (the output embedding's rows), read now: a
        # sleeping engine's weights are empty.
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        # The most bytes one token can stand for: a text longer than max_model_len of these cannot
        # fit, and is refused before the tokenizer spends seconds on it.
        self.max_token_bytes = max((len(t.encode("utf-8")) for t in self.tokenizer.get_vocab()), default=1) or 1

    def check_text_size(self, messages: list[Message]) -> None:
        """Cheap bounds on a request's text before it is templated and tokenised, so no request holds
        a worker for more than about a second: its UTF-8 size against max_model_len x the longest
        token, then the token count of a bounded prefix."""
        texts = [m.content if isinstance(m.content, str) else
                 "".join(p.text or "" for p in m.content if p.type != "image_url") for m in messages]
        size = sum(len(t.encode("utf-8")) for t in texts)
        limit = self.max_model_len * self.max_token_bytes
        if size > limit:
            raise ApiError(400, f"request text of {size} bytes cannot fit max_model_len {self.max_model_len} tokens "
                                f"(at most {limit} bytes); refused before tokenising")
        probe = 16 * self.max_model_len  # characters: a fraction of a second to tokenise
        joined = "\n".join(texts)
        if len(joined) > probe:
            n = len(self.tokenizer(joined[:probe], add_special_tokens=False)["input_ids"])
            if n > self.max_model_len + 1:  # +1: the cut may split one token
                raise ApiError(400, f"request text exceeds max_model_len {self.max_model_len}: its first {probe} "
                                    f"characters are already {n} tokens")

    @classmethod
    def load(cls, path: str | None, tiny: bool = False, device: str = "auto", dtype: str = "auto",
             max_model_len: int = 8192, attn_implementation: str | None = None) -> "Engine":
        dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                           ("cpu" if device == "auto" else device))
        torch_dtype = resolve_dtype(dtype, dev)
        from paco_ds.models.attention import check_attn_implementation

        check_attn_implementation(attn_implementation, "reward_servers.attn_implementation", dev)
        if tiny:
            from paco_ds.models.tiny.qwen_vl import tiny_qwen2_5_vl

            model, processor = tiny_qwen2_5_vl()
            if attn_implementation:
                model.set_attn_implementation(attn_implementation)
        else:
            if path.startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(path)):
                raise FileNotFoundError(f"checkpoint directory {path} does not exist")
            from transformers import AutoModelForImageTextToText, AutoProcessor

            path = os.path.expanduser(path)
            processor = AutoProcessor.from_pretrained(path)
            model = AutoModelForImageTextToText.from_pretrained(
                path, dtype=torch_dtype, **({"attn_implementation": attn_implementation} if attn_implementation else {}))
        return cls(model.to(device=dev, dtype=torch_dtype), processor, max_model_len)

    # -------------------------------------------------------------------------------- requests
    def prepare(self, req: ChatCompletionRequest, max_logprobs: int) -> Prepared:
        """Template, decode images and preprocess one request; every problem is a 400 for it alone."""
        if req.stream:
            raise ApiError(400, "stream=true is not supported by the hf engine")
        if req.n != 1:
            raise ApiError(400, f"n={req.n}: the hf engine returns one choice per request")
        if req.temperature not in (None, 0, 0.0):
            raise ApiError(400, f"temperature={req.temperature}: the hf engine decodes greedily (temperature 0)")
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true")
        if top > max_logprobs:
            raise ApiError(400, f"top_logprobs={top} exceeds this server's max_logprobs={max_logprobs}")
        if top > self.vocab_size:
            raise ApiError(400, f"top_logprobs={top} exceeds the vocabulary of this judge ({self.vocab_size} tokens)")
        max_tokens = req.max_completion_tokens or req.max_tokens or DEFAULT_MAX_TOKENS
        self.check_text_size(req.messages)
        messages, images = self._messages(req.messages)
        try:
            text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            inputs = self.processor(text=[text], images=images or None, return_tensors="pt")
        except Exception as err:  # noqa: BLE001 - what the template or the processor refuses is the request's fault
            raise ApiError(400, f"cannot process the request: {type(err).__name__}: {err}") from None
        n = int(inputs["input_ids"].shape[1])
        if n + max_tokens > self.max_model_len:
            raise ApiError(400, f"prompt of {n} tokens + max_tokens {max_tokens} exceeds max_model_len "
                                f"{self.max_model_len}")
        return Prepared(dict(inputs), max_tokens, top, req.logprobs)

    @staticmethod
    def _messages(messages: list[Message]) -> tuple[list[dict], list]:
        """OpenAI messages -> the processor's chat-template form, plus the images in order."""
        out, images = [], []
        for m in messages:
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": [{"type": "text", "text": m.content}]})
                continue
            parts = []
            for p in m.content:
                if p.type == "image_url":
                    if p.image_url is None:
                        raise ApiError(400, "an image_url part has no 'image_url' object")
                    images.append(decode_data_uri(p.image_url.url))
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": p.text or ""})
            out.append({"role": m.role, "content": parts})
        return out, images

    # -------------------------------------------------------------------------------- batches
    def collate(self, items: list[Prepared]) -> dict[str, torch.Tensor]:
        """Left-pad the per-token tensors to one length; concatenate the per-image ones."""
        length = max(int(p.inputs["input_ids"].shape[1]) for p in items)
        out = {}
        for key, first in items[0].inputs.items():
            if first.dim() == 2 and first.shape[0] == 1 and first.shape[1] == items[0].inputs["input_ids"].shape[1]:
                pad = self.pad_id if key == "input_ids" else 0
                out[key] = torch.cat([torch.nn.functional.pad(p.inputs[key], (length - p.inputs[key].shape[1], 0),
                                                              value=pad) for p in items])
            else:
                out[key] = torch.cat([p.inputs[key] for p in items])
        return out

    @torch.no_grad()
    def generate(self, items: list[Prepared]) -> list[Generation]:
        from transformers import GenerationConfig

        batch = self.collate(items)
        batch = {k: v.to(self.device, dtype=self.model.dtype if v.is_floating_point() else None)
                 for k, v in batch.items()}
        n_new = max(p.max_tokens for p in items)
        config = GenerationConfig(max_new_tokens=n_new, do_sample=False, repetition_penalty=1.0,
                                  eos_token_id=sorted(self.eos), pad_token_id=self.pad_id, output_logits=True,
                                  return_dict_in_generate=True)
        out = self.model.generate(**batch, generation_config=config)
        start = batch["input_ids"].shape[1]
        steps = [s.float().log_softmax(-1) for s in out.logits]  # raw logits: no processor has touched them
        results = []
        for b, p in enumerate(items):
            ids, lps, tops, reason = [], [], [], "length"
            for s in range(min(p.max_tokens, len(steps))):
                tid = int(out.sequences[b, start + s])
                ids.append(tid)
                lps.append(float(steps[s][b, tid]))
                if p.top_logprobs:
                    v, i = steps[s][b].topk(min(p.top_logprobs, steps[s].shape[-1]))
                    tops.append(list(zip(i.tolist(), v.tolist())))
                if tid in self.eos:
                    reason = "stop"
                    break
            results.append(Generation(ids, lps, tops, reason, int(p.inputs["attention_mask"].sum())))
        return results

    def token_text(self, tid: int) -> str:
        if tid not in self._texts:
            self._texts[tid] = self.tokenizer.convert_tokens_to_string([self.tokenizer.convert_ids_to_tokens(tid)])
        return self._texts[tid]

    def completion_text(self, gen: Generation) -> str:
        ids = [t for t in gen.token_ids if t not in self.eos]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -------------------------------------------------------------------------------- sleep mode
    def sleep(self, offload_dir: str | None = None) -> int:
        """Sleep level 1: the weights leave the device and the caches are freed; returns the bytes
        freed. On a GPU the weights go to pinned host RAM (vLLM's level 1). On a CPU host RAM is the
        device, so they go to a file in `offload_dir` (the temp dir by default: it must be a disk,
        not a tmpfs, or nothing is freed) and their memory is given back to the system. The
        Parameter objects stay (tied weights stay tied); only their data is swapped out."""
        if getattr(self, "_offloaded", None) is not None:
            return 0
        params = list(self.model.parameters())  # deduplicated: a tied weight appears once
        nbytes = sum(p.numel() * p.element_size() for p in params)
        if self.device.type == "cpu":
            fd, path = tempfile.mkstemp(prefix="paco_judge_weights_", suffix=".pt", dir=offload_dir)
            os.close(fd)
            torch.save([p.data for p in params], path)
            self._offloaded = path
        else:
            self._offloaded = [torch.empty_like(p.data, device="cpu", pin_memory=True).copy_(p.data) for p in params]
        for p in params:
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self._sleeping_params = params
        _free_caches()
        return nbytes

    def wake_up(self) -> None:
        """The weights back on the device, exactly as they were (scores after a wake are identical)."""
        saved = getattr(self, "_offloaded", None)
        if saved is None:
            return
        if isinstance(saved, str):
            data = torch.load(saved, weights_only=True)
            os.unlink(saved)
        else:
            data = [t.to(self.device, non_blocking=True) for t in saved]
            torch.cuda.synchronize(self.device)
        for p, d in zip(self._sleeping_params, data):
            p.data = d
        self._offloaded = self._sleeping_params = None
        _free_caches()


def _free_caches() -> None:
    """Freed tensors back to the system: the allocator's cache on GPUs, glibc's heap on CPU."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@dataclass
class SleepState:
    """The engine's sleep mode, as vLLM's: while asleep (from the moment a sleep is asked) chat
    requests get 503; a sleep waits for the requests already in flight to finish (drain)."""

    asleep: bool = False
    inflight: int = 0
    drain_timeout: float = 600.0
    offload_dir: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    idle: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Batcher:
    """Collects concurrent requests into batches for one worker thread (the model runs one batch at a time)."""

    engine: Engine
    max_batch_size: int
    wait_s: float
    stats: Counter = field(default_factory=Counter)

    def __post_init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def submit(self, item: Prepared) -> Generation:
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((item, fut))
        return await fut

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = loop.time() + self.wait_s
            while len(batch) < self.max_batch_size:
                if not self.queue.empty():
                    batch.append(self.queue.get_nowait())
                    continue
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), left))
                except asyncio.TimeoutError:
                    break
            live = [(item, fut) for item, fut in batch if not fut.done()]  # a client may have gone away
            if not live:
                continue
            # Requests asking for the same number of tokens share a generate call.
            by_len: dict[int, list] = {}
            for item, fut in live:
                by_len.setdefault(item.max_tokens, []).append((item, fut))
            for group in by_len.values():
                self.stats["batches"] += 1
                self.stats["batched_requests"] += len(group)
                self.stats["max_batch"] = max(self.stats["max_batch"], len(group))
                t0 = time.perf_counter()
                try:
                    gens = await loop.run_in_executor(self.pool, self.engine.generate, [i for i, _ in group])
                except Exception as err:  # noqa: BLE001 - reported to every waiting client as a 500
                    log.exception("generation failed for a batch of %d", len(group))
                    for _, fut in group:
                        if not fut.done():
                            fut.set_exception(err)
                    continue
                finally:  # the model's busy time: one worker runs one batch at a time, so these add up to wall time
                    self.stats["generate_s"] += time.perf_counter() - t0
                for (_, fut), gen in zip(group, gens):
                    if not fut.done():
                        fut.set_result(gen)


def create_app(engine: Engine, served_name: str, *, max_batch_size: int = 16, batch_wait_ms: float = 5.0,
               max_logprobs: int = 20, max_images: int = 2, max_body_mb: float = 64,
               max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, prepare_memory_mb: float = DEFAULT_PREPARE_MEMORY_MB,
               api_key_env: str | None = API_KEY_ENV, offload_dir: str | None = None):
    max_body = int(max_body_mb * 2 ** 20)
    budget = MemoryBudget(int(prepare_memory_mb * 2 ** 20))
    created = int(time.time())
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        batcher = Batcher(engine, max_batch_size, batch_wait_ms / 1000.0)
        task = asyncio.create_task(batcher.run())
        state["batcher"] = batcher
        try:
            yield
        finally:
            task.cancel()
            batcher.pool.shutdown(wait=False, cancel_futures=True)
            if isinstance(getattr(engine, "_offloaded", None), str):  # stopped asleep: its weights file goes too
                with contextlib.suppress(OSError):
                    os.unlink(engine._offloaded)

    app = FastAPI(title="paco_ds hf engine", lifespan=lifespan)
    install_common(app, api_key_env)
    guard_admin_paths(app, api_key_env, ("/sleep", "/wake_up"))  # a sleeping judge stops every run's scoring
    stats: Counter = Counter()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": served_name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model", "created": created,
                                            "owned_by": "paco_ds"}]}

    @app.get("/stats")
    async def get_stats():
        return {**stats, **state["batcher"].stats, "prepare_bytes_held": budget.used, "prepare_waits": budget.waits}

    # Sleep mode (vLLM's endpoints, level 1): colocated with training, the judge gives its memory back.
    sleep = SleepState(offload_dir=offload_dir)

    @app.middleware("http")
    async def _sleep_gate(request: Request, call_next):
        if request.url.path != "/v1/chat/completions":
            return await call_next(request)
        if sleep.asleep:
            stats["errors_503"] += 1
            return JSONResponse(ApiError(503, "the judge is asleep (colocated with training); POST /wake_up "
                                              "first").body(), status_code=503, headers={"Retry-After": "1"})
        sleep.inflight += 1
        try:
            return await call_next(request)
        finally:
            sleep.inflight -= 1
            if sleep.inflight == 0:
                sleep.idle.set()

    @app.post("/sleep")
    async def sleep_endpoint(level: int = 1, mode: str = "wait"):
        if level != 1:
            raise ApiError(400, f"sleep level {level}: the hf engine implements level 1 (weights off the device)")
        if mode != "wait":  # vLLM's modes: abort, wait, keep; this engine always lets requests finish
            raise ApiError(400, f"sleep mode '{mode}': the hf engine implements 'wait' (requests in flight finish)")
        async with sleep.lock:
            if sleep.asleep:
                return {"is_sleeping": True, "freed_bytes": 0, "drain_s": 0.0, "sleep_s": 0.0}
            sleep.asleep = True  # from here new requests get 503; those in flight finish
            t0 = time.perf_counter()
            try:
                while sleep.inflight:
                    sleep.idle.clear()
                    await asyncio.wait_for(sleep.idle.wait(), max(0.0, sleep.drain_timeout - (time.perf_counter() - t0)))
            except asyncio.TimeoutError:
                sleep.asleep = False
                raise ApiError(409, f"{sleep.inflight} requests still in flight after {sleep.drain_timeout:g}s; "
                                    "not sleeping") from None
            t1 = time.perf_counter()
            freed = await asyncio.get_running_loop().run_in_executor(state["batcher"].pool, engine.sleep,
                                                                     sleep.offload_dir)
            stats["sleeps"] += 1
            return {"is_sleeping": True, "freed_bytes": freed, "drain_s": t1 - t0, "sleep_s": time.perf_counter() - t1}

    @app.post("/wake_up")
    async def wake_endpoint(tags: str | None = None):  # vLLM's tags (weights, kv_cache): here all at once
        async with sleep.lock:
            if not sleep.asleep:
                return {"is_sleeping": False, "wake_s": 0.0}
            t0 = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(state["batcher"].pool, engine.wake_up)
            sleep.asleep = False
            stats["wakes"] += 1
            return {"is_sleeping": False, "wake_s": time.perf_counter() - t0}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": sleep.asleep}

    def prepare(req: ChatCompletionRequest) -> Prepared:
        # CPU seconds of this thread (not wall: requests prepare in many threads at once and would
        # count each other's time): decoding the images, the chat template, the processor
        t0 = time.thread_time()
        try:
            return engine.prepare(req, max_logprobs)
        finally:
            stats["prepare_cpu_s"] += time.thread_time() - t0

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        stats["requests"] += 1
        try:
            body = await read_json(request, max_body)
            check_image_count(body, max_images)
            pixels = check_image_pixels(body, max_image_pixels)
            req = parse_chat_request(body)
            if req.model != served_name:
                raise ApiError(404, f"model '{req.model}' is not served here; served: {served_name}")
            async with budget.hold(pixels * PREPARE_BYTES_PER_PIXEL):
                prepared = await run_in_threadpool(prepare, req)
            gen = await state["batcher"].submit(prepared)
        except ApiError as err:
            stats[f"errors_{err.status}"] += 1
            raise
        except Exception as err:  # noqa: BLE001 - a model failure is the server's fault: 500 with its reason
            stats["errors_500"] += 1
            raise ApiError(500, f"generation failed: {type(err).__name__}: {err}") from err
        stats["completed"] += 1
        return JSONResponse(_response(engine, served_name, prepared, gen))

    return app


def _response(engine: Engine, served_name: str, p: Prepared, gen: Generation) -> dict:
    logprobs = None
    if p.logprobs:
        content = []
        for s, (tid, lp) in enumerate(zip(gen.token_ids, gen.logprobs)):
            text = engine.token_text(tid)
            top = [{"token": engine.token_text(i), "logprob": v, "bytes": list(engine.token_text(i).encode())}
                   for i, v in (gen.top[s] if gen.top else [])]
            content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": top})
        logprobs = {"content": content}
    n_out = len(gen.token_ids)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": served_name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": engine.completion_text(gen)},
                     "logprobs": logprobs, "finish_reason": gen.finish_reason}],
        "usage": {"prompt_tokens": gen.prompt_tokens, "completion_tokens": n_out,
                  "total_tokens": gen.prompt_tokens + n_out},
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Serve a Qwen2.5-VL judge over the OpenAI chat API (transformers).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory or hub id")
    src.add_argument("--tiny", action="store_true", help="the tiny offline Qwen2.5-VL (tests and CPU demos)")
    p.add_argument("--served-model-name", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--attn-implementation", default=None,
                   help="transformers' attention implementation (sdpa, eager, flash_attention_2, ...)")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--batch-wait-ms", type=float, default=5.0)
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--max-images", type=int, default=2)
    p.add_argument("--max-body-mb", type=float, default=64)
    p.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                   help="largest image (width x height) a request may hold; read from its header")
    p.add_argument("--prepare-memory-mb", type=float, default=DEFAULT_PREPARE_MEMORY_MB,
                   help="memory the images of requests being prepared may take at once")
    p.add_argument("--api-key-env", default=API_KEY_ENV, help="environment variable holding the bearer token")
    p.add_argument("--exit-with-parent", action="store_true", help="stop when the starting process dies")
    p.add_argument("--offload-dir", default=None, help="where a sleeping CPU engine writes its weights (a disk; "
                                                       "default: the temp dir)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = Engine.load(args.model, args.tiny, args.device, args.dtype, args.max_model_len,
                             args.attn_implementation)
    except ConfigError as err:  # e.g. a flash implementation on a CPU device
        log.error("%s", err)
        raise SystemExit(2) from None
    except (OSError, ValueError) as err:  # the manager shows this line as the reason the server died
        log.error("cannot load model %s: %s", args.model, err)
        raise SystemExit(2) from None
    if args.max_logprobs > engine.vocab_size:  # refused as vLLM's config check refuses it, before serving
        from paco_ds.recipe.servers import logprobs_above_vocab

        log.error("%s", logprobs_above_vocab("--max-logprobs", args.max_logprobs, args.served_model_name,
                                             engine.vocab_size))
        raise SystemExit(2)
    app = create_app(engine, args.served_model_name, max_batch_size=args.max_batch_size,
                     batch_wait_ms=args.batch_wait_ms, max_logprobs=args.max_logprobs, max_images=args.max_images,
                     max_body_mb=args.max_body_mb, max_image_pixels=args.max_image_pixels,
                     prepare_memory_mb=args.prepare_memory_mb, api_key_env=args.api_key_env,
                     offload_dir=args.offload_dir)
    log.info("serving '%s' (%s) on http://%s:%d/v1 [%s, %s]", args.served_model_name,
             "tiny" if args.tiny else args.model, args.host, args.port, engine.device, engine.model.dtype)
    serve(app, args.host, args.port, exit_with_parent=args.exit_with_parent)


if __name__ == "__main__":
    main()
