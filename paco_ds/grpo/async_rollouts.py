"""Rollouts that do not wait for training (`rollout.mode: async`, docs/async.md).

Placement. The launch's last `rollout.samplers` ranks (M) sample and score; the others (T) train.
The trainers form a torch.distributed world of their own (WORLD_SIZE=T) on which ZeRO-3 runs as
in a colocated run; the samplers join no process group: each holds the whole frozen model and
the adapter (paco_ds/grpo/sampler.py). DeepSpeed 0.19.8's ZeRO-3 cannot run on a sub-group of a
larger world: it calls `dist.barrier()` on the default group while it builds its fp32 partitions
(stage3.py `_setup_for_real_optimizer`) and in every `save_checkpoint`, which ranks outside the
engine would have to join at the same moments. A world of the trainers alone needs nothing of
DeepSpeed's group plumbing.

Communication: files in the run directory (`<run>/async/`), written whole and published by a
rename (`Exchange`). They need no transport the two sides share, so a dead sampler leaves no
trainer blocked in a collective (the launcher stops the run, as when any rank dies); they work
across nodes through the shared run directory multi-node runs already need (docs/cluster.md); and
a rollout in flight is a file one can look at. What travels:
- `adapter/v<version>.pt`: the trainable (LoRA) weights, by trainer rank 0 at the start and after
  every optimizer step; `version` is the trainers' optimizer step count (global_step), so a
  checkpoint's adapter version is its global_step;
- `trainers.json`: the epoch the trainers train next and the version they start it from;
- `rollouts/e<epoch>_r<rank>_b<batch>.pt`: one rank batch of the colocated epoch plan for trainer
  rank r (KRepeatSampler over the T trainers: the same positions, seeds and batches a colocated run
  of T ranks samples), sampled with one adapter version and scored: its trajectories, each
  reward's results, the judge's latencies, the version, the sampler's times;
- `hello/sampler_<j>.json` and `start.json`: the handshake of one launch (a sampler's nonce,
  echoed by the trainers), so that no process reads another launch's files;
- `ended.json`: how the trainers ended; `stop.json`: a sampler asked to stop.

Staleness. A sample's staleness is the version its epoch's training starts from minus the version
it was sampled with (0 in a colocated run: an epoch samples with the weights that then train it;
the optimizer steps within an epoch are PPO's own, corrected by its ratio). A sampler samples
epoch e only with a version >= start(e) - max_staleness, waiting for the trainers otherwise, and
always with the newest version it has (picked up between rank batches). start(e) is the version
the trainers announced for the epoch they train next plus S (optimizer steps per epoch) for each
epoch after it: an upper bound (an epoch with no kept sample takes no step), so a sample is never
staler than its bound; the trainers check it again and drop (and count) a batch past it.

Correction: decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization",
arXiv 2110.00641; AReaL's asynchronous RL, arXiv 2505.24298): the clipped ratio is
pi_theta / pi_prox, where pi_prox is the adapter the epoch's training starts from, and each
sample's term is weighted by pi_prox / pi_behaviour, whose denominator is the sampler's stored
log-probs, truncated at `rollout.behaviour_weight_cap` as verl's rollout correction truncates its
importance weights (verl's "Rollout Correction" documentation, `rollout_is_threshold`). log pi_prox
costs one forward without grad per trained step of a stale sample, before the epoch's first
optimizer step; a sample sampled with pi_prox itself needs none (its weight is 1). With
max_staleness 0 no sample is stale: the epoch trains exactly what a colocated run of T ranks trains.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from paco_ds.errors import ConfigError, UserError

ASYNC_DIR = "async"
POLL_S = 0.05


class RolloutPeerLost(UserError):
    """A sampler or the trainers of an async run ended while the other side waited for them; that
    process's own output says why. One line, exit 1."""

    exit_code = 1


# ------------------------------------------------------------------------------------ placement
@dataclass(frozen=True)
class Role:
    """This process's place in a launch: a trainer (sampler None) or sampler `sampler` of `samplers`."""

    rank: int  # in the launch (RANK)
    launch_world: int  # processes the launcher started (WORLD_SIZE)
    trainers: int
    samplers: int
    sampler: int | None = None

    @property
    def is_sampler(self) -> bool:
        return self.sampler is not None


def trainer_world(cfg, launch_world: int) -> int:
    """The ranks that train among `launch_world` processes: all of them unless rollout.mode is async."""
    return launch_world - cfg.rollout.samplers if cfg.rollout.mode == "async" else launch_world


def role_of(cfg, rank: int, launch_world: int) -> Role:
    trainers = trainer_world(cfg, launch_world)
    samplers = launch_world - trainers
    return Role(rank, launch_world, trainers, samplers, rank - trainers if rank >= trainers else None)


def check_placement(cfg, launch_world: int) -> None:
    """rollout.mode: async needs a sampler and a trainer among the launch's processes."""
    if cfg.rollout.mode != "async":
        return
    if trainer_world(cfg, launch_world) < 1:
        raise ConfigError(f"config key 'rollout.samplers': {cfg.rollout.samplers} sampler(s) leave no trainer among "
                          f"the {launch_world} process(es) of the launch: start at least {cfg.rollout.samplers + 1} "
                          f"(deepspeed --num_gpus {cfg.rollout.samplers + 1}), or lower rollout.samplers")


def check_recipe(cfg) -> None:
    """What rollout.mode: async trains with (preflight): PPO-clip's log-prob ratio, which the off-policy
    correction reweights; no tree rollouts (their advantages are per node); no judges on the trainers' GPUs."""
    if cfg.rollout.mode != "async":
        return
    from paco_ds.runtime.engine import gathers_per_step

    loss = cfg.train.loss
    for key, bad, why in (
            ("train.loss", loss != "ppo", f"the off-policy correction is decoupled PPO's, on PPO-clip's log-prob ratio "
                                          f"(train.loss: ppo), not {loss}'s"),
            ("train.ppo.ratio_norm", loss == "ppo" and cfg.train.ppo.ratio_norm,
             "GRPO-Guard's normalised ratio has no behaviour weight"),
            ("sample.tree", cfg.sample.tree is not None, "a tree's advantages are per node, shared across samplers"),
            ("deepspeed.rollout_gather", gathers_per_step(cfg), "the trainers' proximal forwards differ in number "
             "between ranks, and a per-step gather is a collective in each (use once)"),
            ("cluster.colocate", cfg.cluster is not None and cfg.cluster.colocate,
             "a sleeping judge on the trainers' GPUs waits for a sampling phase the trainers no longer have")):
        if bad:
            raise ConfigError(f"config key '{key}' with rollout.mode async: {why}")


# ------------------------------------------------------------------------------------ the files
def _write_atomic(path: Path, write) -> None:
    """`write(tmp)` then publish `tmp` as `path` by a rename: a reader sees the whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def _write_json(path: Path, value) -> None:
    _write_atomic(path, lambda tmp: tmp.write_text(json.dumps(value)))


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):  # not there yet (a rename publishes it whole)
        return None


class Exchange:
    """The files of one async run (`<run>/async/`); see the module's docstring."""

    def __init__(self, run_dir: Path):
        self.root = Path(run_dir) / ASYNC_DIR

    # ---------------------------------------------------------------- a launch
    def reset(self) -> None:
        """Trainer rank 0, before anything is published: what an earlier launch left is dropped
        (its rollouts in flight, its adapters, its handshake)."""
        import shutil

        if self.root.exists():
            shutil.rmtree(self.root)
        for sub in ("adapter", "rollouts", "hello"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def hello(self, sampler: int, record: dict) -> None:
        """A sampler says it is there (again at every poll: trainer rank 0 may have just reset the folder)."""
        try:
            _write_json(self.root / "hello" / f"sampler_{sampler}.json", record)
        except FileNotFoundError:  # the folder was being reset under the write
            pass

    def hellos(self) -> dict[int, dict]:
        out = {}
        for p in (self.root / "hello").glob("sampler_*.json"):
            rec = _read_json(p)
            if rec is not None:
                out[int(p.stem.split("_")[1])] = rec
        return out

    def write_start(self, record: dict) -> None:
        _write_json(self.root / "start.json", record)

    def start(self) -> dict | None:
        return _read_json(self.root / "start.json")

    # ---------------------------------------------------------------- adapters
    def publish_adapter(self, version: int, state: dict[str, torch.Tensor], keep: int = 2) -> None:
        _write_atomic(self.root / "adapter" / f"v{version:08d}.pt", lambda tmp: torch.save(state, tmp))
        for old in self.adapter_versions()[:-keep]:  # a sampler needs the newest only
            (self.root / "adapter" / f"v{old:08d}.pt").unlink(missing_ok=True)

    def adapter_versions(self) -> list[int]:
        return sorted(int(p.stem[1:]) for p in (self.root / "adapter").glob("v*.pt"))

    def load_adapter(self, version: int) -> dict[str, torch.Tensor] | None:
        try:
            return torch.load(self.root / "adapter" / f"v{version:08d}.pt", map_location="cpu", weights_only=True)
        except FileNotFoundError:  # a newer one replaced it meanwhile
            return None

    def write_trainers(self, epoch: int, epoch_start_version: int | None) -> None:
        """The epoch the trainers train next and the version they start it from (None: not known yet)."""
        _write_json(self.root / "trainers.json", {"epoch": epoch, "epoch_start_version": epoch_start_version})

    def trainers(self) -> dict | None:
        return _read_json(self.root / "trainers.json")

    # ---------------------------------------------------------------- rollouts
    def batch_path(self, epoch: int, rank: int, batch: int) -> Path:
        return self.root / "rollouts" / f"e{epoch:05d}_r{rank:03d}_b{batch:05d}.pt"

    def put_batch(self, epoch: int, rank: int, batch: int, payload: dict) -> None:
        _write_atomic(self.batch_path(epoch, rank, batch), lambda tmp: torch.save(payload, tmp))

    def take_batch(self, epoch: int, rank: int, batch: int) -> dict:
        path = self.batch_path(epoch, rank, batch)
        payload = torch.load(path, map_location="cpu", weights_only=False)  # written by this run's samplers
        path.unlink()
        return payload

    # ---------------------------------------------------------------- ends
    def end(self, status: str) -> None:
        _write_json(self.root / "ended.json", {"status": status})

    def ended(self) -> str | None:
        rec = _read_json(self.root / "ended.json")
        return rec["status"] if rec else None

    def ask_stop(self, reason: str) -> None:
        _write_json(self.root / "stop.json", {"reason": reason})

    def stop_asked(self) -> str | None:
        rec = _read_json(self.root / "stop.json")
        return rec["reason"] if rec else None


def allowed_version(trainers: dict | None, versions: list[int], epoch: int, steps_per_epoch: int,
                    max_staleness: int) -> int | None:
    """The newest published adapter version (`versions`, sorted) if `epoch` may be sampled with it, else
    None: at least start(epoch) - max_staleness, where start(epoch) is the version the trainers announced
    (`trainers`: the epoch they train next and the version they start it from) plus `steps_per_epoch`
    for each epoch after that one; unknown (None) while the trainers have not announced a version."""
    if trainers is None or not versions or trainers["epoch_start_version"] is None:
        return None
    start = trainers["epoch_start_version"] + max(epoch - trainers["epoch"], 0) * steps_per_epoch
    return versions[-1] if versions[-1] >= start - max_staleness else None


def process_record() -> dict:
    """Who a process is, so that another can tell whether it still runs (pid and start time on a host)."""
    from paco_ds.runtime import processes

    pid = os.getpid()
    return {"pid": pid, "started": processes.start_time(pid), "host": socket.gethostname()}


def gone(record: dict) -> bool:
    """Whether the process of `record` (process_record) has ended; unknown (False) on another host."""
    from paco_ds.runtime import processes

    return record.get("host") == socket.gethostname() and not processes.alive(record["pid"], record["started"])


# ------------------------------------------------------------------------------------ the trainers' side
@dataclass
class Taken:
    """An epoch's rank batches as the trainers received them, before the correction."""

    trajectories: list
    results: list[dict]  # per trajectory: reward name -> RewardResult
    versions: list[int]  # per trajectory: the adapter version it was sampled with
    latencies: list[float]
    failures: int
    transformer_calls: int
    sde_logprob_rows: int  # the samplers' SDE transitions given a log-prob, which a colocated loss counts too
    sampler_wait_s: float
    first_sampled: float  # when the epoch's first batch started sampling, and its last one ended (time.time)
    last_sampled: float


class AsyncRollouts:
    """The trainers' side: publish the adapter, receive an epoch's scored rollouts, drop what is past
    rollout.max_staleness, apply the decoupled-PPO correction. Collective where it says so: every
    trainer rank calls it at the same points."""

    def __init__(self, cfg, dist, plan, policy, rollouts, loss, zero3: bool):
        self.cfg, self.dist, self.policy, self.rollouts, self.loss, self.zero3 = cfg, dist, policy, rollouts, loss, zero3
        self.exchange = Exchange(cfg.run_dir)
        self.k, self.cap = cfg.rollout.max_staleness, cfg.rollout.behaviour_weight_cap
        self.batches = plan.sample_batches_per_rank
        self.named = [(n, p) for n, p in policy.transformer.named_parameters() if p.requires_grad]
        self.failures = 0  # reward failures the samplers counted on this rank's batches, as RewardRunner.failures
        self.samplers: dict[int, dict] = {}  # sampler index -> its process record (from its hello)
        self._ended = threading.Event()  # the trainers' fit is over: a sampler that ends now is no fault
        if dist.is_main:
            self.exchange.reset()

    # ---------------------------------------------------------------- start, publish, end
    def start(self, epoch: int, version: int, within_epoch: bool) -> None:
        """The run's adapter (collective) and the epoch sampling starts at: this epoch, or with a
        mid-epoch checkpoint's rollouts in hand the next one, whose start version is not known until
        this one is trained. Then rank 0 waits for every sampler's hello and answers it."""
        self.publish(version)
        if not self.dist.is_main:
            return
        first = epoch + 1 if within_epoch else epoch
        self.exchange.write_trainers(first, None if within_epoch else version)
        want = self.cfg.rollout.samplers
        while len(hellos := self.exchange.hellos()) < want:
            time.sleep(POLL_S)
        self.samplers = hellos
        self.exchange.write_start({"samplers": {str(j): h["nonce"] for j, h in hellos.items()}, "first_epoch": first,
                                   "version": version, "trainer0": process_record()})
        print(f"[async] {want} sampler(s) sample from epoch {first} with adapter version {version}; at most "
              f"{self.k} version(s) stale", flush=True)
        self._watch_for_stop()

    def publish(self, version: int) -> None:
        """The adapter after `version` optimizer steps, gathered (ZeRO-3; collective) and written by rank 0."""
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters([p for _, p in self.named], enabled=self.zero3):
            state = {n: p.detach().cpu().clone() for n, p in self.named} if self.dist.is_main else None
        if state is not None:
            self.exchange.publish_adapter(version, state)

    def epoch_done(self, next_epoch: int, version: int) -> None:
        if self.dist.is_main:
            self.exchange.write_trainers(next_epoch, version)

    def end(self, error: BaseException | None) -> None:
        """How the trainers ended, for the samplers (rank 0): they stop with the run."""
        import sys

        from paco_ds.runtime import stopping
        from paco_ds.runtime.stopping import Preempted

        self._ended.set()
        if self.dist.is_main:
            status = "finished" if error is None else "preempted" if isinstance(error, Preempted) else "stopped"
            self.exchange.end(status)
            control = stopping.current()
            dead = self._dead_sampler() if error is not None else None
            if dead is not None and (control is None or dead not in (control.reason or "")):
                # the launcher stopped the trainers first (it saw the sampler end): the cause, in one line
                print(f"train: error: {dead}; the run stopped", file=sys.stderr, flush=True)

    def _watch_for_stop(self) -> None:
        """Rank 0, in a thread: a sampler asked to save and stop (checkpoint.save_on_sigterm) has nothing
        to save, so it asks the trainers, whose stop handling then saves as on their own SIGTERM; a sampler
        of this host that ended stops the trainers the same way, its end named as the reason."""
        from paco_ds.runtime import stopping

        control = stopping.current()
        if control is None:
            return

        def watch() -> None:
            while not control.requested and not self._ended.wait(0.25):
                reason = self.exchange.stop_asked() or self._dead_sampler()
                if reason is not None and not self._ended.is_set():
                    control.request_stop(reason)
                    return

        threading.Thread(target=watch, name="paco-async-stop", daemon=True).start()

    # ---------------------------------------------------------------- an epoch
    def take_epoch(self, epoch: int, version: int, stop_asked) -> tuple[Taken | None, dict]:
        """This rank's rank batches of `epoch` once every trainer rank has all of its own (collective:
        the ranks poll in step), or None when a stop was asked meanwhile (`stop_asked()`: this rank's
        own request, answered by the caller's preemption check). Its metrics: the wait, staleness,
        drops, behaviour weights."""
        from paco_ds.runtime.distributed import all_reduce_max

        t0 = time.perf_counter()
        while True:
            mine = all(self.exchange.batch_path(epoch, self.dist.rank, b).is_file() for b in range(self.batches))
            state = all_reduce_max(2.0 if stop_asked() else 0.0 if mine else 1.0)
            if state != 1.0:
                break
            time.sleep(POLL_S)
        waited = time.perf_counter() - t0
        if state == 2.0:
            return None, {}
        payloads = [self.exchange.take_batch(epoch, self.dist.rank, b) for b in range(self.batches)]
        taken = Taken([t for p in payloads for t in p["trajectories"]], [r for p in payloads for r in p["results"]],
                      [p["version"] for p in payloads for _ in p["trajectories"]],
                      [x for p in payloads for x in p["latencies"]], 0, sum(p["transformer_calls"] for p in payloads),
                      sum(p["sde_logprob_rows"] for p in payloads), sum(p["waited_s"] for p in payloads), min(p["t_start"] for p in payloads),
                      max(p["t_end"] for p in payloads))
        self.failures += sum(p["failures"] for p in payloads)
        taken.failures = self.failures
        return taken, {"async/trainer_wait_s": waited}

    def _dead_sampler(self) -> str | None:
        """Rank 0: a sampler of this host that has ended, named (its own output says why it ended)."""
        dead = [(j, rec) for j, rec in sorted(self.samplers.items()) if gone(rec)]
        if not dead:
            return None
        j, rec = dead[0]
        return f"rollout sampler {j} (rank {rec.get('rank')}, pid {rec['pid']}) ended"

    def correct(self, taken: Taken, version: int) -> tuple[list, list[dict], dict]:
        """The epoch's trajectories ready to train from `version`, their reward results (a batch past
        max_staleness keeps its place with no valid reward: not trained, not in the group statistics)
        and the epoch's async/ metrics. A stale batch's log-probs become log pi_prox, recomputed with the
        current adapter (gathered once under ZeRO-3: collective whenever any rank has a stale batch),
        with its behaviour weights; a fresh batch keeps its own log-probs, with weight 1 where another
        batch of the rank is stale."""
        from paco_ds.runtime.distributed import all_gather_object, any_true

        stale = [version - v for v in taken.versions]
        dropped = [s > self.k for s in stale]
        results = [_without_rewards(r) if d else r for r, d in zip(taken.results, dropped)]
        correct = [s > 0 and not d for s, d in zip(stale, dropped)]
        trajs, weights, forwards = list(taken.trajectories), [], 0
        if any_true(any(correct)):
            with torch.no_grad(), self.rollouts.module() as module:
                for i, traj in enumerate(trajs):
                    if correct[i]:
                        prox = torch.stack([self.loss.log_prob(module, traj, t, slice(None)).log_prob.float().cpu()
                                            for t in range(traj.log_prob.shape[1])], dim=1)
                        forwards += traj.log_prob.shape[1]
                        w = torch.exp(prox - traj.log_prob.float()).clamp(max=self.cap)
                        weights.append(w)
                        trajs[i] = replace(traj, log_prob=prox, behaviour_weight=w)
            if any(correct):
                trajs = [t if t.behaviour_weight is not None else replace(t, behaviour_weight=torch.ones_like(t.log_prob))
                         for t in trajs]
        sizes = [len(t) for t in trajs]
        per_sample = lambda values: [v for v, n in zip(values, sizes) for _ in range(n)]  # noqa: E731
        gathered = all_gather_object((per_sample(stale), per_sample(taken.versions), per_sample(dropped),
                                      torch.cat(weights).flatten().tolist() if weights else [], forwards,
                                      taken.sampler_wait_s, taken.first_sampled, taken.last_sampled))
        st = np.array([s for g in gathered for s in g[0]])
        vs = np.array([v for g in gathered for v in g[1]])
        w = np.array([x for g in gathered for x in g[3]])
        metrics = {"async/staleness_mean": float(st.mean()), "async/staleness_max": float(st.max()),
                   "async/version_min": float(vs.min()), "async/version_max": float(vs.max()),
                   "async/dropped_stale": float(sum(d for g in gathered for d in g[2])),
                   "async/proximal_forwards": float(sum(g[4] for g in gathered)),
                   "async/sampler_wait_s": float(sum(g[5] for g in gathered)),
                   "async/sampling_span_s": float(max(g[7] for g in gathered) - min(g[6] for g in gathered)),
                   "async/behaviour_weight_mean": float(w.mean()) if w.size else 1.0,
                   "async/behaviour_weight_truncated": float((w >= self.cap).mean()) if w.size else 0.0}
        return trajs, results, metrics


def _without_rewards(results: dict) -> dict:
    """A dropped batch's reward results: no sample valid (it is neither trained nor counted in its groups)."""
    from paco_ds.rewards.base import RewardResult

    return {name: RewardResult(np.full(len(r.scores), np.nan), np.zeros(len(r.scores), dtype=bool),
                               {k: np.full(len(v), np.nan) for k, v in r.parts.items()}, r.applicable)
            for name, r in results.items()}


def new_nonce() -> str:
    return uuid.uuid4().hex
