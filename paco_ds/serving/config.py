"""Loading the `reward_servers` section (paco_ds/recipe/servers.py) for `launch/serve_reward.py`: a
YAML file with a `reward_servers:` key (with `extends` and `--set`), command-line flags, or the
reference's environment variables (`config_from_env`). The attention implementation it names is
checked here against the model code (paco_ds/models/attention.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from pydantic import ValidationError

from paco_ds.errors import ConfigError
from paco_ds.recipe.loader import load_recipe
from paco_ds.recipe.servers import ServersConfig, ServersFile


def servers_context() -> dict:
    """The validation context that checks a section's `attn_implementation` against transformers."""
    from paco_ds.models.attention import attn_implementation_field

    return {"check_attn_implementation": attn_implementation_field}

def load_servers_config(path: str | Path, overrides: list[str] | None = None) -> ServersConfig:
    """Read the `reward_servers` section of a YAML file (with `extends` and `--set`), reporting
    mistakes as one line naming file:line and key."""
    return load_recipe(path, overrides, ServersFile, context=servers_context()).reward_servers


def config_from_env(environ: Mapping[str, str]) -> dict:
    """The reference launcher's variables (VLLM_MODEL_PATHS, VLLM_MODEL_NAMES, VLLM_PORT,
    GPU_MEMORY_UTILIZATION, MAX_MODEL_LEN) as `reward_servers` values; only those that are set
    appear. CUDA_VISIBLE_DEVICES keeps its meaning: the GPUs split among the models."""
    out: dict = {}
    paths = [p.strip() for p in environ.get("VLLM_MODEL_PATHS", "").split(",") if p.strip()]
    if paths:
        names = [n.strip() for n in environ.get("VLLM_MODEL_NAMES", "").split(",") if n.strip()]
        if not names:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in paths]
        if len(names) != len(paths):
            raise ConfigError(f"VLLM_MODEL_NAMES has {len(names)} names for {len(paths)} VLLM_MODEL_PATHS")
        out["models"] = [{"name": n, "path": p} for n, p in zip(names, paths)]
    for var, key, kind in (("VLLM_PORT", "port", int), ("GPU_MEMORY_UTILIZATION", "gpu_memory_utilization", float),
                           ("MAX_MODEL_LEN", "max_model_len", int)):
        if environ.get(var, "").strip():
            try:
                out[key] = kind(environ[var])
            except ValueError:
                raise ConfigError(f"{var}={environ[var]!r} is not a valid {kind.__name__}") from None
    return out


def build_servers_config(path: str | Path | None, overrides: list[str], flags: dict[str, Any],
                         environ: Mapping[str, str]) -> ServersConfig:
    """The servers to start: a YAML section (with --set overrides) or, without a file, the
    reference's environment variables; command-line flags that were given win over both."""
    if path is not None:
        data = load_servers_config(path, overrides).model_dump()
    elif overrides:
        raise ConfigError("--set needs --config")
    else:
        data = config_from_env(environ)
    data.update({k: v for k, v in flags.items() if v is not None})
    if not data.get("models"):
        raise ConfigError("no models to serve: give --config FILE, --model NAME=PATH, --tiny NAME, "
                          "or VLLM_MODEL_PATHS (and VLLM_MODEL_NAMES)")
    try:
        return ServersConfig.model_validate(data, context=servers_context())
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(x) for x in e["loc"])
        raise ConfigError(f"reward_servers.{where}: {e['msg'].removeprefix('Value error, ')}") from None
