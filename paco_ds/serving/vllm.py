"""`vllm serve` command lines for the judge models.

vLLM runs only on GPU machines with vLLM installed; here we only build its argv and environment
(`paco_ds.serving.manager` starts it). Compared with the reference launcher
(PaCo-RL/PaCo-GRPO/vllm_server/launch.sh) the command always names what the consistency rewards rely on:
`--max-logprobs` >= 20 (top-20 first-token logprobs), `--limit-mm-per-prompt` for two images, prefix
caching, and it binds 127.0.0.1 unless told otherwise. A bearer token goes through `VLLM_API_KEY`, not
the command line.
"""
from __future__ import annotations

import json
import os
from typing import Mapping

from paco_ds.errors import ConfigError
from paco_ds.serving.config import ServedModel, ServersConfig

MIN_LOGPROBS = 20  # the rewards ask for the top 20 first-token logprobs


def split_gpus(gpus: list[int], n: int) -> list[list[int]]:
    """Contiguous, equal blocks of GPUs, one per model (the reference's split)."""
    if n < 1 or len(gpus) < n:
        raise ConfigError(f"reward_servers: {n} models need at least {n} GPUs, {len(gpus)} visible ({gpus}); "
                          "set reward_servers.gpus or CUDA_VISIBLE_DEVICES")
    per = len(gpus) // n
    return [gpus[i * per:(i + 1) * per] for i in range(n)]


def vllm_command(model: ServedModel, cfg: ServersConfig, host: str, port: int, gpus: list[int],
                 environ: Mapping[str, str] | None = None, sleep_mode: bool = False) -> tuple[list[str], dict[str, str]]:
    """argv and the environment additions for one `vllm serve` process. `sleep_mode` (a judge
    colocated with training): `--enable-sleep-mode`, and VLLM_SERVER_DEV_MODE=1, without which vLLM
    does not expose /sleep, /wake_up and /is_sleeping."""
    environ = os.environ if environ is None else environ
    argv = [
        "vllm", "serve", str(model.path),
        "--served-model-name", model.name,
        "--host", host, "--port", str(port),
        "--tensor-parallel-size", str(len(gpus)),
        "--gpu-memory-utilization", f"{cfg.gpu_memory_utilization:g}",
        "--max-model-len", str(cfg.max_model_len),
        "--max-logprobs", str(max(MIN_LOGPROBS, cfg.max_logprobs)),
        "--limit-mm-per-prompt", json.dumps({"image": cfg.max_images}),
        "--enable-prefix-caching" if cfg.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    if cfg.trust_remote_code:
        argv.append("--trust-remote-code")
    if sleep_mode:
        argv.append("--enable-sleep-mode")
    argv += list(cfg.extra_args)
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
    if sleep_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    token = environ.get(cfg.api_key_env)
    if token:
        env["VLLM_API_KEY"] = token
    return argv, env
