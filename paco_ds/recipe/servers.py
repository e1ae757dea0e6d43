"""The `reward_servers` section: which judge models to serve, with which engine, where.

One schema serves three users: `launch/serve_reward.py` (a YAML file with a `reward_servers:`
key, or flags; paco_ds/serving/config.py), a training recipe whose run starts and stops its own
servers (paco_ds/recipe/schema.py holds it), and the reference's environment variables
(`config_from_env`). It sits in the recipe, below the servers it describes: an attention
implementation is checked by the caller that loads it (the validation context's
`check_attn_implementation`, which paco_ds/serving/config.py and the GRPO loader give).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from paco_ds.errors import ConfigError

API_KEY_ENV = "PACO_REWARD_API_KEY"
# The judge server's per-request limits (paco_ds/serving/protocol.py reads them): an image's pixels
# and the memory one request's image preparation may take.
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DEFAULT_PREPARE_MEMORY_MB = 1024


class _Section(BaseModel):
    # allow_inf_nan=False: a timeout or size of .inf/.nan is refused at load, naming the key
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ServedModel(_Section):
    """One judge model: the name clients ask for (case-sensitive) and where its weights are."""

    name: str = Field(min_length=1)
    path: str | None = None  # hub id or local checkpoint directory
    tiny: bool = False  # hf engine only: build the tiny offline Qwen2.5-VL instead of loading `path`

    @model_validator(mode="after")
    def _one_source(self) -> "ServedModel":
        if (self.path is None) == (not self.tiny):
            raise ValueError(f"model '{self.name}': give exactly one of 'path' or 'tiny: true'")
        return self


class ServersConfig(_Section):
    engine: Literal["vllm", "hf"] = "vllm"
    models: list[ServedModel] = Field(min_length=1)
    # single: one model on `port`; gateway: backends on loopback behind a gateway on `port`;
    # separate: model i on port + i. auto: single for one model, gateway for several.
    layout: Literal["auto", "single", "gateway", "separate"] = "auto"
    host: str = "127.0.0.1"  # public bind address; 0.0.0.0 exposes the servers to the network
    port: int = Field(8000, ge=0, le=65535)  # 0: pick free ports
    backend_base_port: int = Field(18001, ge=0, le=65535)  # gateway backends, on 127.0.0.1; 0: free ports
    # vLLM
    gpus: list[int] | None = None  # GPUs to split evenly among the models (default: the visible ones)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    max_model_len: int = Field(8192, gt=0)
    enable_prefix_caching: bool = True  # the two panels of a pair share the system prompt and images repeat
    trust_remote_code: bool = True
    extra_args: list[str] = Field(default_factory=list)  # appended to every vLLM command
    # The interpreter that runs `python -m vllm.entrypoints.openai.api_server` (vLLM pins its own
    # torch and transformers, so it often lives in a venv of its own); default: $PACO_VLLM_PYTHON,
    # else this interpreter.
    vllm_python: str | None = None
    cpu_kvcache_gb: int = Field(1, ge=1)  # device: cpu, vLLM's CPU build: VLLM_CPU_KVCACHE_SPACE (GiB)
    # Request limits and logprobs (both engines; the gateway checks images and body size too)
    max_logprobs: int = Field(20, ge=1)
    max_images: int = Field(2, ge=1)
    max_body_mb: float = Field(64, gt=0)
    max_image_pixels: int = Field(DEFAULT_MAX_IMAGE_PIXELS, ge=1)  # per image, from its header (gateway too)
    prepare_memory_mb: float = Field(DEFAULT_PREPARE_MEMORY_MB, gt=0)  # hf engine: images being prepared at once
    # auto: cuda when available, else cpu (hf engine); vLLM: GPUs, unless "cpu" (vLLM's CPU build)
    device: str = "auto"
    # Built-in transformers engine
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    max_batch_size: int = Field(16, ge=1)
    batch_wait_ms: float = Field(5.0, ge=0)
    # transformers' attention implementation (paco_ds/models/attention.py): sdpa (default), eager,
    # flex_attention, flash_attention_2 (the `flash` extra), ...; vLLM picks its own backend.
    attn_implementation: str | None = None
    # Security: the name of an environment variable holding a bearer token. When it is set, the
    # servers and the gateway require it and the clients send it; the token never goes on a command line.
    api_key_env: str = API_KEY_ENV
    startup_timeout: float = Field(600.0, gt=0)

    @field_validator("attn_implementation")
    @classmethod
    def _attention_runs_here(cls, v: str | None, info: ValidationInfo) -> str | None:
        # the name and its package, checked by whoever loads the section (it knows the model code)
        check = (info.context or {}).get("check_attn_implementation")
        return check(v) if check is not None and v is not None else v

    @field_validator("models")
    @classmethod
    def _unique_names(cls, v: list[ServedModel]) -> list[ServedModel]:
        names = [m.name for m in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"served model names must be unique (repeated: {', '.join(dup)})")
        return v

    @model_validator(mode="after")
    def _engine_fits(self) -> "ServersConfig":
        if self.engine == "vllm" and any(m.tiny for m in self.models):
            raise ValueError("'tiny: true' models need engine: hf (vLLM loads checkpoints only)")
        if self.attn_implementation is not None:
            if self.engine == "vllm":
                raise ValueError("attn_implementation is the hf engine's; vLLM picks its attention backend itself "
                                 "(set VLLM_ATTENTION_BACKEND in its environment to choose one)")
        for m in self.models:
            vocab = judge_vocab_size(m)
            if vocab is not None and self.max_logprobs > vocab:
                raise ValueError(logprobs_above_vocab("reward_servers.max_logprobs", self.max_logprobs, m.name, vocab))
        if self.resolved_layout == "single" and len(self.models) > 1:
            raise ValueError(f"layout 'single' serves one model; {len(self.models)} are configured "
                             "(use 'gateway' or 'separate')")
        return self

    @property
    def resolved_layout(self) -> str:
        if self.layout != "auto":
            return self.layout
        return "single" if len(self.models) == 1 else "gateway"


def judge_vocab_size(model: ServedModel) -> int | None:
    """The size of a judge's output vocabulary (the logits a top_logprobs ranks), when it can be
    known before anything loads: the tiny judge's, or `vocab_size` in a local checkpoint's
    config.json. None for a hub id (nothing is downloaded to find out)."""
    if model.tiny:
        from paco_ds.recipe.tiny_judge import TINY_JUDGE_VOCAB_SIZE

        return TINY_JUDGE_VOCAB_SIZE
    config = Path(model.path).expanduser() / "config.json"
    if not config.is_file():
        return None
    import json

    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None  # loading the checkpoint reports it
    size = (data.get("text_config") or {}).get("vocab_size") or data.get("vocab_size")
    return int(size) if isinstance(size, int) else None


def logprobs_above_vocab(key: str, value: int, model: str, vocab: int) -> str:
    """The one-line refusal of a top_logprobs above the judge's vocabulary: vLLM's sampler cannot
    rank more tokens than there are (a request asking for it kills vLLM's engine)."""
    return (f"{key}={value} exceeds the vocabulary of judge '{model}' ({vocab} tokens); "
            f"ask for at most {vocab}")


def check_top_logprobs(terms: Mapping[str, Mapping[str, Any]], servers: "ServersConfig | None") -> None:
    """Each reward term (dotted key -> its keyword arguments) that asks a judge this run serves for
    `top_logprobs` asks for no more than that judge's vocabulary and its server's max_logprobs."""
    if servers is None:
        return
    served = {m.name: m for m in servers.models}
    for key, kwargs in terms.items():
        top, model = kwargs.get("top_logprobs"), served.get(kwargs.get("model"))
        if model is None or not isinstance(top, int):
            continue
        vocab = judge_vocab_size(model)
        if vocab is not None and top > vocab:
            raise ValueError(logprobs_above_vocab(f"{key}.top_logprobs", top, model.name, vocab))
        if top > max(servers.max_logprobs, 20 if servers.engine == "vllm" else 0):
            raise ValueError(f"{key}.top_logprobs={top} exceeds reward_servers.max_logprobs={servers.max_logprobs} "
                             f"(the server refuses such requests)")


class ServersFile(BaseModel):
    """A YAML file holding a `reward_servers:` section: a serving config, or a whole training recipe
    (its other keys are the trainer's business and are ignored here)."""

    model_config = ConfigDict(extra="ignore")
    reward_servers: ServersConfig
    source: str | None = None
