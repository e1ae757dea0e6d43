"""Multi-node runs from a DeepSpeed hostfile: place the judges, start them over ssh, run the
trainers with `deepspeed --hostfile --include`, and stop everything on every host however it ends.

The recipe's `cluster:` section says where the judges go:

    cluster:
      judges: [{host: node-0, gpus: [0]}]   # one judge per entry, on those GPUs of that host
      # every_node: {gpus: [0]}              # or: one judge on those GPUs of every host
      # colocate: true                       # or: one judge per host on the trainers' GPUs

The judges serve the recipe's `reward_servers` model (the first one) with its engine; a judge's
GPUs are taken out of its host's trainer slots unless `colocate` is set. Every rank receives the
judges' URLs in PACO_REWARD_ENDPOINTS (through DeepSpeed's environment file) and uses the judge on
its own host first, then the first other one that answers (paco_ds/serving/routing.py).

Judges run in the foreground of their ssh session (`exec` keeps the pid and the start time the
shell printed), with `--exit-with-parent`: if the launcher dies without cleaning up, the ssh session
closes and the judge follows. The launcher also stops each one explicitly, by pid over ssh, once the
pid's start time shows it is still that judge (paco_ds/runtime/processes.py checks every signal the same way).

A SIGTERM or SIGUSR1 to the launcher (a scheduler's stop, or its warning before a time limit) asks
every rank on every host to stop through a file in the shared run directory (PACO_STOP_FILE,
paco_ds/runtime/stopping.py): with `checkpoint.save_on_sigterm` they save together and exit 75. The launcher
waits for them (within sigterm_grace_s) and then stops the judges. Ctrl-C stops everything at once.
The hosts come from a DeepSpeed hostfile (`main`) or a Slurm allocation (paco_ds/launchers/slurm.py); both go
through `run` below.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from paco_ds.runtime import processes
from paco_ds.recipe.schema import ClusterConfig, JudgePlacement
from paco_ds.errors import ConfigError, UserError
from paco_ds.serving.manager import log_tail
from paco_ds.runtime.stopping import HARD_STOP_S, PREEMPTED_EXIT, STOP_FILE_ENV, preempted_since

REPO_ROOT = Path(__file__).resolve().parents[2]
ENDPOINTS_ENV = "PACO_REWARD_ENDPOINTS"
# What every rank needs, wherever it runs; DeepSpeed forwards PYTHON*/NCCL*/... by itself.
FORWARDED = ("DS_ACCELERATOR", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "GLOO_SOCKET_IFNAME",
             "NCCL_SOCKET_IFNAME", "TORCH_EXTENSIONS_DIR", "CUDA_HOME")
FORWARDED_PREFIXES = ("HF_", "TRANSFORMERS_")
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9_./:@%+,=-]*$")  # DeepSpeed's pdsh runner pastes values unquoted


class ClusterError(UserError):
    """A host, a judge or a rank failed; the message names the host and what failed."""


# ------------------------------------------------------------------------------------------------
# The recipe's `cluster:` section
# ------------------------------------------------------------------------------------------------
# The schema (ClusterConfig, JudgePlacement, EveryNode) lives with the recipe's in paco_ds/recipe/schema.py.


# ------------------------------------------------------------------------------------------------
# Hostfile
# ------------------------------------------------------------------------------------------------
_HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")


def parse_hostfile(path: str | Path) -> dict[str, int]:
    """host -> slots, in file order. `#` starts a comment; a duplicate host or a malformed line is
    a ConfigError naming file:line (DeepSpeed's own parser rejects the same files)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"hostfile {path}: cannot read it ({err.strerror})") from None
    hosts: dict[str, int] = {}
    first: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _HOST_LINE.match(line)
        if not m:
            raise ConfigError(f"{path}:{n}: expected 'HOST slots=N', got {raw.strip()!r}")
        host, slots = m.group(1), int(m.group(2))
        if host in hosts:
            raise ConfigError(f"{path}:{n}: host '{host}' is listed twice (first at line {first[host]})")
        if slots < 1:
            raise ConfigError(f"{path}:{n}: host '{host}' has slots={slots}; it needs at least 1")
        hosts[host], first[host] = slots, n
    if not hosts:
        raise ConfigError(f"{path}: no hosts (lines 'HOST slots=N')")
    return hosts


# ------------------------------------------------------------------------------------------------
# Placement
# ------------------------------------------------------------------------------------------------
@dataclass
class Judge:
    host: str
    gpus: list[int]
    port: int

    @property
    def name(self) -> str:
        return f"judge@{self.host}:{self.port}"


@dataclass
class Placement:
    hosts: dict[str, int]
    judges: list[Judge]
    trainer_slots: dict[str, list[int]]  # host -> local slots the trainers use
    colocate: bool

    @property
    def world_size(self) -> int:
        return sum(len(s) for s in self.trainer_slots.values())

    @property
    def include(self) -> str:
        """DeepSpeed's `--include`: host:slot,slot joined with @."""
        return "@".join(f"{h}:{','.join(map(str, s))}" for h, s in self.trainer_slots.items() if s)

    @property
    def master_host(self) -> str:
        return next(h for h, s in self.trainer_slots.items() if s)

    def last_ranks(self, n: int) -> str:
        """The slots of the launch's last `n` ranks (rollout.mode: async's samplers), as host:slot,slot
        joined with @: DeepSpeed numbers the ranks host after host in the hostfile's order."""
        ranks = [(h, slot) for h, slots in self.trainer_slots.items() for slot in slots][-n:]
        hosts = dict.fromkeys(h for h, _ in ranks)
        return "@".join(f"{h}:{','.join(str(slot) for hh, slot in ranks if hh == h)}" for h in hosts)


def place(hosts: dict[str, int], cluster: ClusterConfig, hostfile: str = "hostfile") -> Placement:
    """Judges and trainer slots for a hostfile; a judge on an unknown host, on a GPU its host does
    not have or shares with another judge, or no slot left for a trainer is a ConfigError."""
    judges: list[Judge] = []
    per_host: dict[str, int] = {}

    def add(host: str, gpus: list[int], key: str) -> None:
        if host not in hosts:
            raise ConfigError(f"{key}.host: '{host}' is not in {hostfile} (hosts: {', '.join(hosts)})")
        bad = [g for g in gpus if not 0 <= g < hosts[host]]
        if bad:
            raise ConfigError(f"{key}.gpus: {bad} not on '{host}', which has slots=0..{hosts[host] - 1} in {hostfile}")
        taken = {g for j in judges if j.host == host for g in j.gpus}
        if taken & set(gpus) and not cluster.colocate:
            raise ConfigError(f"{key}.gpus: {sorted(taken & set(gpus))} of '{host}' already serve another judge")
        i = per_host.get(host, 0)
        per_host[host] = i + 1
        judges.append(Judge(host, list(gpus), cluster.judge_port + i))

    if cluster.judges:
        for i, j in enumerate(cluster.judges):
            add(j.host, j.gpus, f"cluster.judges[{i}]")
    elif cluster.every_node is not None:
        for h in hosts:
            add(h, cluster.every_node.gpus, "cluster.every_node")
    elif cluster.colocate:
        for h in hosts:
            add(h, [], "cluster.colocate")  # a colocated judge sees all its host's GPUs
    slots = {}
    for h, n in hosts.items():
        used = set() if cluster.colocate else {g for j in judges if j.host == h for g in j.gpus}
        slots[h] = [s for s in range(n) if s not in used]
    placement = Placement(dict(hosts), judges, slots, cluster.colocate)
    if placement.world_size == 0:
        raise ConfigError(f"cluster: the judges take every slot of {hostfile}; no trainer rank is left")
    return placement


# ------------------------------------------------------------------------------------------------
# Commands
# ------------------------------------------------------------------------------------------------
def resolve(host: str, strict: bool = True) -> str:
    """The address judges bind and ranks dial (a name can map to 127.0.1.1 on its own host)."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        if not strict:  # --dry-run on a machine outside the cluster
            return host
        raise ClusterError(f"host '{host}': its name does not resolve here") from None


def remote_argv(host: str, command: str, ssh_port: int | None = None, use_pdsh: bool | None = None) -> list[str]:
    """Run `command` on `host` with the transport DeepSpeed's launcher uses (pdsh over ssh where
    installed, else ssh); key-only, no prompt."""
    use_pdsh = shutil.which("pdsh") is not None if use_pdsh is None else use_pdsh
    if use_pdsh:
        return ["pdsh", "-S", "-R", "ssh", "-w", host, command]
    port = ["-p", str(ssh_port)] if ssh_port else []
    return ["ssh", "-o", "BatchMode=yes", *port, host, command]


def judge_command(judge: Judge, servers, bind: str, python: str = sys.executable, colocate: bool = False) -> str:
    """The shell line that runs one judge in the foreground of its ssh session. A colocated vLLM
    judge runs on GPU 0 of its host (beside local rank 0) in sleep mode; size its
    reward_servers.gpu_memory_utilization to what the trainer leaves."""
    model = servers.models[0]
    if servers.engine == "vllm" and (judge.gpus or colocate):
        from paco_ds.serving.vllm import vllm_command

        argv, env = vllm_command(model, servers, bind, judge.port, judge.gpus or [0], {}, sleep_mode=colocate)
    else:
        from paco_ds.serving.manager import hf_engine_command

        argv = [*hf_engine_command(model, servers, bind, judge.port, python), "--exit-with-parent"]
        env = {}
    if judge.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, judge.gpus))
    env.update({k: os.environ[k] for k in (*FORWARDED, servers.api_key_env) if k in os.environ})
    env["PYTHONPATH"] = str(REPO_ROOT)
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    # `exec` keeps the pid and the start time the shell printed. The token reaches the judge in its
    # environment, not its argv; like DeepSpeed's own pdsh launch of the ranks, the ssh command line on
    # this host carries it.
    return (f"cd {shlex.quote(str(REPO_ROOT))} && echo PACO_JUDGE_PID $$ {_shell_start_ticks('$$')} && "
            f"exec env {exports} {shlex.join(argv)}")


def _shell_start_ticks(pid: str) -> str:
    """A POSIX shell word printing the start of process `pid` in ticks since boot (field 22 of
    /proc/<pid>/stat, counted after the command name, which may hold spaces): its identity there."""
    return f'$(s=$(cat /proc/{pid}/stat 2>/dev/null); s=${{s##*") "}}; set -- $s; echo "${{20}}")'


def endpoints_value(model: str, judges: list[Judge], bind: dict[str, str]) -> str:
    """PACO_REWARD_ENDPOINTS: `model=url+url` (shell-safe: DeepSpeed pastes it unquoted)."""
    return f"{model}=" + "+".join(f"http://{bind[j.host]}:{j.port}/v1" for j in judges)


def rank_environment(servers, judges: list[Judge], bind: dict[str, str], environ=os.environ,
                     stop_file: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in environ.items() if k in FORWARDED or k.startswith(FORWARDED_PREFIXES)}
    if stop_file is not None:
        env[STOP_FILE_ENV] = str(stop_file)
    if servers is not None and judges:
        env[ENDPOINTS_ENV] = endpoints_value(servers.models[0].name, judges, bind)
        if servers.api_key_env in environ:
            env[servers.api_key_env] = environ[servers.api_key_env]
    for k, v in env.items():
        if not _SAFE_VALUE.match(v):
            raise ConfigError(f"environment variable {k}={v!r} cannot travel to the ranks: DeepSpeed's pdsh "
                              "launcher pastes values unquoted (use letters, digits and _./:@%+,=-)")
    return env


def deepspeed_argv(p: Placement, hostfile: Path, train_args: list[str], master_port: int,
                   ssh_port: int | None = None, bind: dict[str, str] | None = None) -> list[str]:
    argv = [str(Path(sys.executable).parent / "deepspeed"), "--hostfile", str(hostfile), "--include", p.include,
            "--master_addr", (bind or {}).get(p.master_host, p.master_host), "--master_port", str(master_port), "--no_ssh_check"]
    if ssh_port:
        argv += ["--ssh_port", str(ssh_port)]
    return argv + [str(REPO_ROOT / "launch" / "train.py"), *train_args]


# ------------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------------
@dataclass
class RunningJudge:
    judge: Judge
    url: str
    log: Path
    proc: subprocess.Popen | None = None  # its transport (pdsh or ssh), which leads a process group
    group: processes.Group | None = None  # that group, known by its leader's pid and start time
    pid: tuple[int, str | None] | None = None  # on its host: pid and start ticks
    restarts: int = 0
    history: list[str] = field(default_factory=list)


def _remote_pid(log: Path) -> tuple[int, str | None] | None:
    """The judge's pid on its host and its start ticks there (None in a log of an earlier version,
    which printed none: such a pid cannot be checked and is never signalled)."""
    with contextlib.suppress(OSError):
        found = re.findall(r"PACO_JUDGE_PID (\d+)(?:[ \t]+(\d+))?", log.read_text(errors="replace"))
        if found:  # the log gathers a judge's restarts and resumed runs: the latest start is last
            pid, ticks = found[-1]
            return int(pid), ticks or None
    return None


def _port_taken(url: str) -> bool:
    """Whether something already accepts connections at a judge's address."""
    u = httpx.URL(url)
    with contextlib.suppress(OSError), socket.create_connection((u.host, u.port), timeout=2.0):
        return True
    return False


def _stop_group(group: processes.Group, timeout: float = 10.0, proc: subprocess.Popen | None = None) -> None:
    """SIGTERM the process group a local helper leads (pdsh exits before its ssh child may), then
    SIGKILL what is left after `timeout`. Its direct children are signalled too, in case pdsh gave
    its ssh a group of its own. `proc`: the helper, when this process started it (to reap it).
    Every signal checks its target's identity first (paco_ds/runtime/processes.py): a helper whose pid now
    belongs to another process is gone, and nothing of that newcomer's is signalled."""
    for pid, started in processes.children_of(group.leader, group.started).items():
        processes.signal_if_same(pid, started, signal.SIGTERM)

    def running(g: processes.Group) -> bool:
        if proc is not None:
            proc.poll()
        return g.alive()

    processes.stop_groups([group], signal.SIGTERM, timeout, running=running)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


def _stop_trainers(group: processes.Group, proc: subprocess.Popen | None = None) -> None:
    """SIGINT to the deepspeed launcher's group (it forwards it and kills pdsh), SIGKILL after 20 s."""
    def running(g: processes.Group) -> bool:
        return (proc is None or proc.poll() is None) and g.alive()

    if processes.stop_groups([group], signal.SIGINT, 20.0, running=running) and proc is not None:
        proc.wait()


def _stop_remote_judge(host: str, pid: int, started: str | None, ssh_port: int | None) -> str | None:
    """SIGTERM a judge by pid over ssh, SIGKILL after 10 s, each only while that pid is still the
    process that started at `started` (its start ticks there); what went wrong, or None. Without a
    start time the pid cannot be checked: nothing is sent (the judge follows its ssh session)."""
    if started is None or not started.isdigit():
        return None
    ours = (f'ours() {{ s=$(cat /proc/{pid}/stat 2>/dev/null) || return 1; s=${{s##*") "}}; set -- $s; '
            f'[ "$1" != Z ] && [ "${{20}}" = {started} ]; }}')
    cmd = (f"{ours}; ours && kill -TERM {pid} 2>/dev/null; for i in $(seq 50); do ours || exit 0; "
           f"sleep 0.2; done; ours && kill -KILL {pid} 2>/dev/null; exit 0")
    r = subprocess.run(remote_argv(host, cmd, ssh_port), capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        return f"host '{host}': could not stop judge pid {pid}: {(r.stderr or r.stdout).strip()[-200:]}"
    return None


class Cluster:
    """The processes of one multi-node run; `close()` stops all of them, on every host."""

    def __init__(self, placement: Placement, servers, cluster: ClusterConfig, run_dir: Path, log=print):
        self.p, self.servers, self.cfg, self.log = placement, servers, cluster, log
        self.dir = run_dir / "cluster"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bind = {h: resolve(h) for h in placement.hosts}
        self.judges = [RunningJudge(j, f"http://{self.bind[j.host]}:{j.port}", self.dir / f"{j.host}-{j.port}.log")
                       for j in placement.judges]
        self.trainer: subprocess.Popen | None = None
        self.trainer_group: processes.Group | None = None  # the deepspeed runner's process group
        self.trainer_failure: str | None = None
        self.token = os.environ.get(servers.api_key_env) if servers is not None else None
        self.run_dir = run_dir
        self.stop_file = stop_file_of(run_dir)
        self.stop_file.unlink(missing_ok=True)  # a request of an earlier launch is not this one's
        self.stop_reason: str | None = None
        self.stop_deadline: float | None = None

    # judges ------------------------------------------------------------------------------------
    def _spawn(self, rj: RunningJudge) -> None:
        cmd = judge_command(rj.judge, self.servers, self.bind[rj.judge.host], colocate=self.p.colocate)
        with rj.log.open("a") as fh:
            rj.proc = subprocess.Popen(remote_argv(rj.judge.host, cmd, self.cfg.ssh_port), stdout=fh,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        if rj.group is not None:  # the transport of an earlier start, which has ended
            rj.group.close()
        rj.group = processes.Group(rj.proc.pid, processes.start_time(rj.proc.pid))
        rj.pid = None
        self.record()

    def _headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"} if self.token else {}

    def _ready(self, rj: RunningJudge) -> bool:
        try:
            r = httpx.get(f"{rj.url}/v1/models", headers=self._headers(), timeout=2.0)
            return r.status_code == 200 and self.servers.models[0].name in {m.get("id") for m in r.json()["data"]}
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    def _wait(self, group: list[RunningJudge]) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout
        pending = list(group)
        while pending:
            for rj in list(pending):
                rj.pid = rj.pid or _remote_pid(rj.log)
                if rj.proc.poll() is not None:
                    raise ClusterError(f"host '{rj.judge.host}': judge on port {rj.judge.port} exited with code "
                                       f"{rj.proc.returncode} while starting (log {rj.log}): {log_tail(rj.log, 6)}")
                if self._ready(rj):
                    pending.remove(rj)
            if pending and time.monotonic() > deadline:
                rj = pending[0]
                raise ClusterError(f"host '{rj.judge.host}': judge not ready on {rj.url} after "
                                   f"{self.cfg.startup_timeout:g}s (cluster.startup_timeout; log {rj.log}): "
                                   f"{log_tail(rj.log, 6)}")
            time.sleep(0.3)

    def start_judges(self) -> None:
        for rj in self.judges:
            if self._ready(rj) or _port_taken(rj.url):
                raise ClusterError(f"host '{rj.judge.host}': port {rj.judge.port} is already in use ({rj.url}); "
                                   "stop what listens there or set cluster.judge_port")
            self.log(f"[cluster] starting {rj.judge.name} (gpus {rj.judge.gpus or '-'})")
            self._spawn(rj)
        t0 = time.monotonic()
        self._wait(self.judges)
        if self.judges:
            self.log(f"[cluster] {len(self.judges)} judge(s) ready in {time.monotonic() - t0:.1f}s")

    def check_judges(self) -> None:
        """A judge whose ssh session ended is started again (up to cluster.restarts times), unless the
        run is stopping (a scheduler's SIGTERM reaches the judges' ssh sessions too)."""
        if self.stop_reason is not None:
            return
        for rj in self.judges:
            if rj.proc is not None and rj.proc.poll() is not None:
                code = rj.proc.returncode
                if rj.restarts >= self.cfg.restarts:
                    raise ClusterError(f"host '{rj.judge.host}': judge on port {rj.judge.port} died (code {code}) "
                                       f"after {rj.restarts} restart(s) (log {rj.log}): {log_tail(rj.log, 6)}")
                rj.restarts += 1
                t0 = time.monotonic()
                self.log(f"[cluster] host '{rj.judge.host}': judge on port {rj.judge.port} died (code {code}); "
                         f"restarting ({rj.restarts}/{self.cfg.restarts})")
                self._spawn(rj)
                self._wait([rj])
                rj.history.append(f"restarted in {time.monotonic() - t0:.1f}s")
                self.log(f"[cluster] host '{rj.judge.host}': judge back in {time.monotonic() - t0:.1f}s")

    # trainers ----------------------------------------------------------------------------------
    def request_stop(self, reason: str, within: float) -> None:
        """Ask every rank on every host to stop (to save first, with checkpoint.save_on_sigterm):
        the file their stop control watches. `run_trainers` waits `within` seconds for them."""
        if self.stop_reason is not None:
            return
        self.stop_reason, self.stop_within, self.stop_deadline = reason, within, time.monotonic() + within
        tmp = self.stop_file.with_suffix(".tmp")
        tmp.write_text(reason + "\n")
        os.replace(tmp, self.stop_file)
        self.log(f"[cluster] {reason}: asked every rank to stop; waiting up to {within:g}s for them")

    def _stop_overdue(self) -> None:
        if self.stop_deadline is not None and time.monotonic() > self.stop_deadline:
            raise ClusterError(f"the trainers did not stop within {self.stop_within:g}s of the request "
                               f"({self.stop_reason}); stopping them")

    def _wait_ranks_released(self, poll: float) -> None:
        """After a stop request the DeepSpeed runner may end before the ranks (a SIGTERM to it stops
        its pdsh sessions): wait until rank 0 lets go of the run directory, after its save."""
        from paco_ds.runtime.runlock import in_use

        while in_use(self.run_dir):
            self._stop_overdue()
            time.sleep(poll)

    def run_trainers(self, argv: list[str], env: dict[str, str], poll: float = 0.5, grace: float = 15.0) -> int:
        """Run the deepspeed launcher; its output goes to ours and to cluster/trainers.log. When one
        host's ranks fail (pdsh reports its ssh exit code), the others get `grace` seconds to
        notice before the launcher stops the job."""
        import threading

        env_file = self.dir / "deepspeed_env"
        env_file.touch(mode=0o600)  # it may carry the judges' token
        env_file.write_text("".join(f"{k}={v}\n" for k, v in sorted(env.items())))
        launch_env = {**os.environ, **env, "DS_ENV_FILE": str(env_file), "PDSH_RCMD_TYPE": "ssh"}
        self.log(f"[cluster] {shlex.join(argv)}")
        self.trainer = subprocess.Popen(argv, env=launch_env, start_new_session=True, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, bufsize=1)
        self.trainer_group = processes.Group(self.trainer.pid, processes.start_time(self.trainer.pid))
        self.record()
        failed: list[tuple[str, int, float]] = []

        def pump() -> None:
            with (self.dir / "trainers.log").open("a") as fh:
                for line in self.trainer.stdout:
                    sys.stdout.write(line)
                    fh.write(line)
                    m = _PDSH_EXIT.search(line)
                    if m and int(m.group(2)) != 0:
                        failed.append((m.group(1), int(m.group(2)), time.monotonic()))
            sys.stdout.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        while not processes.exited(self.trainer.pid):
            self.check_judges()
            self._stop_overdue()
            if failed and time.monotonic() - failed[0][2] > grace and self.stop_reason is None:
                host, code, _ = failed[0]
                raise ClusterError(f"host '{host}': trainer rank(s) exited with code {code}; the other hosts "
                                   f"did not stop within {grace:g}s, stopping them")
            time.sleep(poll)
        # Ended but not yet reaped, it still holds its pid: what is left of its group is its own
        self.trainer_group.record_members()
        self.trainer.poll()
        if self.stop_reason is not None:
            self.log(f"[cluster] the trainers' launcher ended (code {self.trainer.returncode}); waiting for "
                     "rank 0 to let go of the run directory")
            self._wait_ranks_released(poll)
        reader.join(5)
        if failed:
            self.trainer_failure = f"host '{failed[0][0]}': trainer rank(s) exited with code {failed[0][1]}"
        return self.trainer.returncode

    # cleanup -----------------------------------------------------------------------------------
    def close(self) -> list[str]:
        """Stop the trainers (the deepspeed launcher kills its pdsh sessions) and every judge, by
        pid over ssh, then their ssh sessions. Returns what could not be confirmed stopped."""
        problems = []
        if self.trainer is not None and self.trainer.poll() is None:
            _stop_trainers(self.trainer_group, self.trainer)
        stats = {}
        for rj in self.judges:  # what each judge served, for the record (cluster/judges.json)
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = httpx.get(f"{rj.url}/stats", headers=self._headers(), timeout=2.0)
                served = r.json() if r.status_code == 200 else {"error": f"/stats answered {r.status_code}: {r.text[:200]}"}
                stats[rj.judge.name] = {**served, "restarts": rj.restarts, "history": rj.history}
        if stats:
            import json

            (self.dir / "judges.json").write_text(json.dumps(stats, indent=2))
        for rj in self.judges:
            rj.pid = rj.pid or _remote_pid(rj.log)
            if rj.pid is not None and (problem := _stop_remote_judge(rj.judge.host, *rj.pid, self.cfg.ssh_port)):
                problems.append(problem)
            if rj.group is not None:  # its transport (pdsh and its ssh child share a process group)
                _stop_group(rj.group, proc=rj.proc)
                rj.group.close()
        if self.trainer_group is not None:
            _stop_group(self.trainer_group, proc=self.trainer)
            self.trainer_group.close()
        self.processes_file.unlink(missing_ok=True)  # all stopped: the guard has nothing left to do
        self.stop_file.unlink(missing_ok=True)
        return problems

    # a guard for the launcher's own death -------------------------------------------------------
    @property
    def processes_file(self) -> Path:
        return self.dir / "processes.json"

    def record(self) -> None:
        """What `close()` would stop, for the guard (`reap`): written whenever it changes."""
        import json

        trainers = self.trainer_group
        state = {"ssh_port": self.cfg.ssh_port, "trainers": trainers.leader if trainers else None,
                 "trainers_started": trainers.started if trainers else None,
                 "judges": [{"host": rj.judge.host, "log": str(rj.log), "transport": rj.group.leader,
                             "transport_started": rj.group.started}
                            for rj in self.judges if rj.group is not None]}
        tmp = self.processes_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.processes_file)

    def start_guard(self) -> subprocess.Popen:
        """A child that outlives this launcher only to stop what it started: SIGKILL (or an OOM
        kill) gives the launcher no chance to clean up, and the judges, the deepspeed runner and
        their ssh sessions run in sessions of their own. It exits once `close()` is done."""
        self.record()
        return subprocess.Popen([sys.executable, "-m", "paco_ds.launchers.cluster", "--reap", str(self.processes_file),
                                 str(os.getpid())], cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                                start_new_session=True)  # a SIGKILL to the launcher's group spares it


def _recorded_groups(state: dict) -> list[tuple[int, object]]:
    """(leader, start time) of each process group a processes file records."""
    out = [(state["trainers"], state.get("trainers_started"))] if state.get("trainers") else []
    return out + [(j["transport"], j.get("transport_started")) for j in state.get("judges", [])]


def reap(processes_file: Path, launcher: int, poll: float = 0.5) -> int:
    """The guard's loop: while the launcher lives (it is our parent) and has not cleaned up, wait;
    if it dies first, stop the trainers, then each judge by pid over ssh, then their transports.
    Each is known by pid and start time; a pid whose process has changed since, or one recorded
    without a start time (a file of an earlier version), is not signalled."""
    import json

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a signal to the launcher's group is the
        signal.signal(sig, signal.SIG_IGN)                      # launcher's to handle; we follow its death
    held: dict[tuple, processes.Group] = {}  # each recorded group, its leader's pidfd held from the start

    def group(leader: int, started) -> processes.Group:
        key = (leader, started)
        if key not in held:
            held[key] = processes.Group(leader, started)
        return held[key]

    def read() -> dict | None:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(processes_file.read_text())
        return None

    while os.getppid() == launcher and processes_file.exists():
        if (state := read()) is not None:  # so a leader that ends before the launcher stays known
            for leader, started in _recorded_groups(state):
                group(leader, started)
        time.sleep(poll)
    if not processes_file.exists() or (state := read()) is None:
        return 0
    print(f"[cluster] launcher (pid {launcher}) died without cleaning up: stopping everything it started",
          file=sys.stderr, flush=True)
    trainers = group(state["trainers"], state.get("trainers_started")) if state["trainers"] else None
    if trainers is not None:
        _stop_trainers(trainers)
    for j in state["judges"]:
        if (judge := _remote_pid(Path(j["log"]))) is not None and (problem := _stop_remote_judge(j["host"], *judge, state["ssh_port"])):
            print(f"[cluster] cleanup: {problem}", file=sys.stderr, flush=True)
        _stop_group(group(j["transport"], j.get("transport_started")))
    if trainers is not None:
        _stop_group(trainers)
    for g in held.values():
        g.close()
    processes_file.unlink(missing_ok=True)
    return 0


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------
_PDSH_EXIT = re.compile(r"pdsh@\S+: (\S+): ssh exited with exit code (\d+)")


def default_cluster(cfg, hosts: dict[str, int]) -> ClusterConfig:
    """Without a `cluster:` section: one judge on the first host (GPU 0 for vLLM, none for hf)."""
    first = next(iter(hosts))
    gpus = [0] if cfg.reward_servers is not None and cfg.reward_servers.engine == "vllm" else []
    return ClusterConfig(judges=[JudgePlacement(host=first, gpus=gpus)] if cfg.reward_servers is not None else [])


def train_arguments(config: str, overrides: list[str], resume: str | None) -> list[str]:
    args = ["--config", str(Path(config).resolve())]
    for o in overrides:
        args += ["--set", o]
    return args + (["--resume", resume] if resume else [])


def describe_plan(p: Placement, hostfile: Path, servers, cluster: ClusterConfig, argv: list[str],
                  env: dict[str, str], bind: dict[str, str], samplers: int = 0) -> str:
    lines = [f"hostfile      {hostfile}: " + ", ".join(f"{h} slots={n}" for h, n in p.hosts.items()),
             f"trainers      world size {p.world_size}: --include {p.include}"
             + ("  (colocated with the judges)" if p.colocate else "")]
    if samplers:  # rollout.mode: async (docs/async.md)
        lines.append(f"samplers      the last {samplers} rank(s), on {p.last_ranks(samplers)}; the other "
                     f"{p.world_size - samplers} train")
    for j in p.judges:
        lines.append(f"judge         {j.host}: gpus {','.join(map(str, j.gpus)) or '-'} -> "
                     f"http://{bind[j.host]}:{j.port}/v1 ({servers.engine})")
    lines.append("")
    for j in p.judges:
        lines.append(f"[{j.host}] " + shlex.join(remote_argv(j.host, judge_command(j, servers, bind[j.host], colocate=p.colocate),
                                                               cluster.ssh_port)))
    lines.append("[launcher] DS_ENV_FILE=<run_dir>/cluster/deepspeed_env: "
                 + (" ".join(f"{k}={v}" for k, v in sorted(env.items())) or "(empty)"))
    lines.append(f"[launcher] {shlex.join(argv)}")
    lines += [f"[{h}] (by deepspeed over pdsh) rank(s) on slots {','.join(map(str, s))}"
              for h, s in p.trainer_slots.items() if s]
    text = "\n".join(lines)
    token = os.environ.get(servers.api_key_env) if servers is not None else None
    return text.replace(token, "<token>") if token else text  # a plan is printed and pasted; a token is not


def ensure_token(api_key_env: str, environ=os.environ) -> None:
    """Judges listen on the hosts' own addresses, where a server without a token refuses /sleep,
    /wake_up and LoRA swaps from anyone but loopback: with no token given, the run makes its own,
    which reaches the judges and the ranks in their environment."""
    if not environ.get(api_key_env):
        import secrets

        environ[api_key_env] = secrets.token_urlsafe(24)


def stop_file_of(run_dir: Path) -> Path:
    return Path(run_dir) / "cluster" / "STOP"


@dataclass
class Outcome:
    code: int  # 0, PREEMPTED_EXIT (the ranks saved after a stop request) or 1
    stop_signal: str | None = None  # the signal that asked the run to stop ("SIGUSR1", "SIGTERM"), if one did


def main(hostfile: str, config: str, overrides: list[str], dry_run: bool = False, resume: str | None = None,
         master_port: int = 29500, log=print, gpu_memory: float | None = None) -> int:
    """`launch/cluster.py`: the hosts of a DeepSpeed hostfile."""
    from paco_ds.grpo.plan import load_config

    cfg = load_config(config, overrides)
    hosts = parse_hostfile(hostfile)
    return run(cfg, hosts, Path(hostfile), config, overrides, dry_run, resume, master_port, log, gpu_memory).code


def run(cfg, hosts: dict[str, int], hostfile: Path, config: str, overrides: list[str], dry_run: bool = False,
        resume: str | None = None, master_port: int = 29500, log=print, gpu_memory: float | None = None) -> Outcome:
    """One multi-node run on `hosts` (host -> slots; `hostfile` lists them for DeepSpeed): place the
    judges and the trainers, start them, wait, stop everything on every host."""
    from paco_ds.grpo.plan import check_recipe, describe

    cluster = cfg.cluster or default_cluster(cfg, hosts)
    if cluster.judges or cluster.every_node or cluster.colocate:
        if cfg.reward_servers is None:
            raise ConfigError("cluster: judges are placed but the recipe has no reward_servers section to serve")
    p = place(hosts, cluster, str(hostfile))
    from paco_ds.grpo.async_rollouts import check_placement, trainer_world

    check_placement(cfg, p.world_size)  # rollout.mode: async: the last rollout.samplers ranks sample
    samplers = p.world_size - trainer_world(cfg, p.world_size)
    plan = check_recipe(cfg, p.world_size - samplers)  # m rounded for the trainers; errors name the keys
    bind = {h: resolve(h, strict=not dry_run) for h in hosts}
    if p.judges and not dry_run:
        ensure_token(cfg.reward_servers.api_key_env)
    env = rank_environment(cfg.reward_servers, p.judges, bind, stop_file=stop_file_of(cfg.run_dir))
    argv = deepspeed_argv(p, Path(hostfile).resolve(), train_arguments(config, overrides, resume), master_port,
                          cluster.ssh_port, bind)
    if dry_run:
        log(describe_plan(p, Path(hostfile), cfg.reward_servers, cluster, argv, env, bind, samplers))
        log("")
        log(describe(cfg, *plan))
        if gpu_memory is not None:  # per trainer rank, with the judges placed as this run places them
            from paco_ds.gpu_plan import print_plan

            print_plan(cfg.model_copy(update={"cluster": cluster}), p.world_size, gpu_memory, log)
        return Outcome(0)
    c = Cluster(p, cfg.reward_servers, cluster, cfg.run_dir, log)
    # A stop request (a scheduler's SIGTERM, or its SIGUSR1 ahead of a time limit) reaches every rank
    # through the stop file; the ranks' own grace, and the launcher's few seconds after it, bound the wait.
    within = (cfg.checkpoint.sigterm_grace_s if cfg.checkpoint.save_on_sigterm else HARD_STOP_S) + 10.0
    stop_signal: list[str] = []

    def on_stop(signum, frame) -> None:
        name = signal.Signals(signum).name
        if c.trainer is None:  # nothing trains yet: nothing to save
            raise KeyboardInterrupt
        stop_signal.append(name)
        c.request_stop(f"{name} to the launcher", within)

    previous = {sig: signal.signal(sig, on_stop) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    failure: str | None = None
    t0 = time.monotonic()
    guard = c.start_guard()
    started = time.time()
    preempted = None
    try:
        c.start_judges()
        code = c.run_trainers(argv, env)
        # The ranks saved after a stop: 75, whatever status the DeepSpeed launcher passed on (143 after SIGTERM)
        preempted = preempted_since(cfg.run_dir, started)
        if code != 0 and preempted is None:
            failure = (f"stopped on request ({c.stop_reason}) without a preemption checkpoint" if c.stop_reason
                       else c.trainer_failure or f"the trainers exited with code {code}")
    except KeyboardInterrupt:
        failure = "interrupted (Ctrl-C or SIGTERM)"
    except ClusterError as err:
        failure = str(err)
    finally:
        for sig in (signal.SIGTERM, signal.SIGUSR1):  # a second request while cleaning up: the same clean-up
            signal.signal(sig, signal.SIG_IGN)
        problems = c.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        with contextlib.suppress(subprocess.TimeoutExpired):
            guard.wait(10)  # it sees close() done and exits
    for pr in problems:
        log(f"[cluster] cleanup: {pr}")
    stopped_by = stop_signal[0] if stop_signal else None
    if preempted is not None and failure is None:
        log(f"[cluster] preempted ({preempted.get('reason')}) after saving {preempted.get('checkpoint')}; "
            f"stopped everything on {', '.join(hosts)}; continue with --resume latest")
        return Outcome(PREEMPTED_EXIT, stopped_by)
    if failure:
        log(f"[cluster] failed after {time.monotonic() - t0:.1f}s: {failure}; stopped everything on "
            f"{', '.join(hosts)}")
        return Outcome(1, stopped_by)
    log(f"[cluster] done in {time.monotonic() - t0:.1f}s; stopped everything on {', '.join(hosts)}")
    return Outcome(0 if not problems else 1, stopped_by)


if __name__ == "__main__":  # the guard: python -m paco_ds.launchers.cluster --reap PROCESSES_FILE LAUNCHER_PID
    if len(sys.argv) != 4 or sys.argv[1] != "--reap":
        raise SystemExit("usage: python -m paco_ds.launchers.cluster --reap PROCESSES_FILE LAUNCHER_PID (launch/cluster.py runs it)")
    raise SystemExit(reap(Path(sys.argv[2]), int(sys.argv[3])))
