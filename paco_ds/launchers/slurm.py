"""Multi-node runs inside a Slurm allocation (`launch/slurm.py`, run by an sbatch script; a template
in configs/slurm/): the hosts and their slots come from Slurm's environment, and the run goes
through the same placement and launcher as a hostfile's (paco_ds/launchers/cluster.py).

- Hosts: SLURM_JOB_NODELIST expanded by `scontrol show hostnames` (Slurm's own parser).
- Slots per host (the allocation is taken as homogeneous, as `--nodes N --gpus-per-node G` gives):
  `--slots-per-node` when given, else the GPUs Slurm gave this node (SLURM_GPUS_ON_NODE, else the
  count of SLURM_JOB_GPUS), else SLURM_NTASKS_PER_NODE (CPU nodes: `--ntasks-per-node=N` asks for N
  trainer slots per node). None of them is one error line, exit 2.
- Resume: when the run directory has a `latest` checkpoint (a requeued job, SLURM_RESTART_COUNT > 0,
  or a job submitted again under the same name), the run continues from it by itself.
- Requeue: Slurm's warning before the time limit (`--signal=B:USR1@SECONDS`) makes every rank save
  and exit 75; when the run directory's preemption marker says they did, the launcher requeues the
  job (`scontrol requeue`). A SIGTERM (scancel, `scontrol requeue`, preemption) also makes the ranks
  save with checkpoint.save_on_sigterm, but then Slurm decides what follows: a cancelled job stays
  cancelled, a requeued or preempted one comes back by itself.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from paco_ds.errors import ConfigError, UserError
from paco_ds.runtime.stopping import PREEMPTED_EXIT


def _scontrol(*args: str) -> str:
    try:
        r = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise UserError("`scontrol` is not on the PATH; run this inside a Slurm allocation") from None
    if r.returncode != 0:
        raise UserError(f"`scontrol {' '.join(args)}` failed: {(r.stderr or r.stdout).strip()[-300:]}")
    return r.stdout


def expand_nodelist(nodelist: str) -> list[str]:
    """`pc-node[0-1]` -> ['pc-node0', 'pc-node1'], by Slurm's own `scontrol show hostnames`."""
    hosts = _scontrol("show", "hostnames", nodelist).split()
    if not hosts:
        raise UserError(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
    return hosts


def slots_per_node(environ=os.environ, given: int | None = None) -> tuple[int, str]:
    """Trainer slots (GPUs, or ranks on CPU nodes) per host, and where the number came from."""
    if given is not None:
        if given < 1:
            raise ConfigError(f"--slots-per-node: {given}; it needs at least 1")
        return given, "--slots-per-node"
    if environ.get("SLURM_GPUS_ON_NODE", "").isdigit() and int(environ["SLURM_GPUS_ON_NODE"]) > 0:
        return int(environ["SLURM_GPUS_ON_NODE"]), "SLURM_GPUS_ON_NODE"
    if gpus := [g for g in environ.get("SLURM_JOB_GPUS", "").split(",") if g.strip()]:
        return len(gpus), "SLURM_JOB_GPUS"
    tasks = environ.get("SLURM_NTASKS_PER_NODE", "")
    if tasks.isdigit() and int(tasks) > 0:
        return int(tasks), "SLURM_NTASKS_PER_NODE"
    raise ConfigError("no trainer slots in this allocation: ask for GPUs (--gpus-per-node) or, on CPU "
                      "nodes, --ntasks-per-node=N, or pass --slots-per-node N")


def allocation(environ=os.environ, given_slots: int | None = None) -> tuple[dict[str, int], str]:
    """host -> slots for this job's nodes, and a line that says where they came from."""
    job = environ.get("SLURM_JOB_ID")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not job or not nodelist:
        missing = "SLURM_JOB_ID" if not job else "SLURM_JOB_NODELIST"
        raise UserError(f"{missing} is not set: run launch/slurm.py inside an allocation "
                        "(an sbatch script, see configs/slurm/)")
    slots, source = slots_per_node(environ, given_slots)
    hosts = {h: slots for h in expand_nodelist(nodelist)}
    return hosts, f"SLURM_JOB_NODELIST={nodelist}, {slots} slot(s) per node from {source}"


def write_hostfile(hosts: dict[str, int], path: Path) -> Path:
    """What DeepSpeed's runner reads: the allocation as a hostfile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# this Slurm job's nodes (written by launch/slurm.py)\n"
                    + "".join(f"{h} slots={n}\n" for h, n in hosts.items()))
    return path


def has_latest_checkpoint(run_dir: Path) -> bool:
    return (Path(run_dir) / "checkpoints" / "latest").is_file()


def requeue(job_id: str, log=print) -> None:
    log(f"[slurm] the ranks saved before the time limit: requeueing job {job_id} (scontrol requeue)")
    _scontrol("requeue", job_id)


def main(config: str, overrides: list[str], slots: int | None = None, dry_run: bool = False,
         master_port: int = 29500, log=print, environ=os.environ) -> int:
    from paco_ds.launchers import cluster
    from paco_ds.grpo.plan import load_config

    hosts, where = allocation(environ, slots)  # before the recipe: outside an allocation, one line
    cfg = load_config(config, overrides)
    restarts = int(environ.get("SLURM_RESTART_COUNT", "0") or 0)
    resume = "latest" if has_latest_checkpoint(cfg.run_dir) else None
    log(f"[slurm] job {environ['SLURM_JOB_ID']} ({environ.get('SLURM_JOB_NAME', '?')}), restart {restarts}: "
        f"{where}: {', '.join(f'{h} slots={n}' for h, n in hosts.items())}; run directory {cfg.run_dir}; "
        + ("resuming from its latest checkpoint" if resume else "starting"
           + (" (no checkpoint yet)" if restarts else "")))
    with tempfile.TemporaryDirectory() as scratch:
        hostfile = write_hostfile(hosts, (Path(scratch) if dry_run else cfg.run_dir / "cluster") / "hostfile")
        outcome = cluster.run(cfg, hosts, hostfile, config, overrides, dry_run, resume, master_port, log)
    # Slurm's warning ahead of the time limit (SIGUSR1) ended the run after the ranks saved (the run
    # directory's marker, not the DeepSpeed launcher's status, says so): come back as this same job.
    # After a SIGTERM Slurm itself decides: scancel cancels, `scontrol requeue` and preemption requeue.
    if outcome.code == PREEMPTED_EXIT and outcome.stop_signal == "SIGUSR1":
        requeue(environ["SLURM_JOB_ID"], log)
    return outcome.code
