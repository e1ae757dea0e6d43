"""Process-group set-up and the few collectives the trainers use.

Works under the deepspeed launcher, torchrun, or a plain `python` (a world of one). On a machine
without CUDA it applies what was measured on CPU: the CPU accelerator, gloo, and
no JIT-compiled shared-memory comm op (which takes a minute to build on first use).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    # parallel.sequence: N consecutive ranks hold one sample's tokens between them (a sequence group,
    # paco_ds/runtime/sequence.py) and sample, score and train the same samples: to the data they are
    # one data-parallel rank
    sequence: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """This rank's sequence group: the data-parallel rank whose samples it holds a share of."""
        return self.rank // self.sequence

    @property
    def data_world(self) -> int:
        """The number of sequence groups: the data-parallel world size."""
        return self.world_size // self.sequence

    @property
    def scores(self) -> bool:
        """Whether this rank scores and reports its group's samples (the group's first rank: the
        others hold the same images)."""
        return self.rank % self.sequence == 0


def _cpu_only() -> bool:
    return not torch.cuda.is_available()


def setup_distributed() -> DistInfo:
    """Initialise torch.distributed through DeepSpeed (once) and return this process's place."""
    if _cpu_only():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    import deepspeed

    if _cpu_only():
        # The shm comm op is JIT-compiled on first use (about a minute); gloo alone is enough here.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cpu") if _cpu_only() else torch.device("cuda", local_rank)
    if not _cpu_only():
        torch.cuda.set_device(local_rank)
    if not torch.distributed.is_initialized() and not _cpu_only() and int(os.environ["WORLD_SIZE"]) > 1:
        # NCCL bound to this rank's device at init, whatever DeepSpeed's version does: the
        # communicators are created on the right GPU instead of guessed at the first collective.
        # (A world of one is left unbound: a bound group builds every later group by splitting.)
        torch.distributed.init_process_group("nccl", device_id=device)
        deepspeed.init_distributed(dist_backend="nccl")  # DeepSpeed's comm layer over that group
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if _cpu_only() else "nccl")
    return DistInfo(rank=torch.distributed.get_rank(), world_size=torch.distributed.get_world_size(),
                    local_rank=local_rank, device=device)


def shutdown_distributed() -> None:
    """Leave together: a rank that exits while others still talk to it can abort in gloo's threads."""
    if torch.distributed.is_initialized():
        barrier()
        torch.distributed.destroy_process_group()


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def barrier() -> None:
    if world_size() > 1:
        torch.distributed.barrier()


# What gloo and NCCL raise in a rank whose collective lost its other end: a rank that failed
# and exited. That rank printed its own error; this one's is only the consequence.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "remote process exited", "NCCL communicator was aborted")
# The launcher stops every rank once one fails and exits with the first failed rank's status,
# polling once a second (deepspeed.launcher.launch, torchrun): a rank left waiting on a peer
# gives it that long, so the status a user sees is the failed rank's, not this consequence's.
PEER_GONE_WAIT_S = 10.0


def peer_gone(err: BaseException) -> str | None:
    """The backend's words when `err` says another rank of this run is gone, else None."""
    if not isinstance(err, RuntimeError) or world_size() == 1:
        return None
    return next((m for m in PEER_GONE if m in str(err)), None)


def exit_after_peer(prog: str, err: BaseException) -> None:
    """One line instead of a traceback in a rank whose peer failed, then wait for the launcher's
    stop (SIGTERM, paco_ds.runtime.stopping) before exiting on our own with status 1."""
    rank = torch.distributed.get_rank()
    print(f"{prog}: error: rank {rank}: another rank of this run ended while this one waited for it "
          f"({torch.distributed.get_backend()}: {peer_gone(err)}); that rank's error is the cause",
          file=sys.stderr, flush=True)
    from paco_ds.runtime import stopping

    control = stopping.current()
    if control is not None and control.has_launcher:
        time.sleep(PEER_GONE_WAIT_S)
    raise SystemExit(1) from None


def all_gather_object(obj) -> list:
    """Every rank's object, in rank order (pickled; for metadata and small arrays)."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    torch.distributed.all_gather_object(out, obj)
    return out




def collective_device() -> torch.device:
    """The device whose tensors the default process group reduces.

    NCCL reduces only CUDA tensors and gloo only CPU ones: a collective handed a tensor on the other
    device raises at the first multi-GPU epoch. So the device follows the group's backend, never a
    caller's default: CPU when the group has a CPU backend (gloo, or a `cpu:gloo,cuda:nccl` group,
    where small host-side reductions avoid a device sync), else this rank's CUDA device.
    """
    backend = str(torch.distributed.get_backend())
    if backend == "gloo" or "cpu:" in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _reduce(values: list[float], op) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64).to(collective_device())
    torch.distributed.all_reduce(t, op=op)
    return t.cpu().tolist()


def any_true(flag: bool) -> bool:
    """True on every rank if it is true on any rank (ranks must agree before skipping collectives)."""
    if world_size() == 1:
        return bool(flag)
    return _reduce([1.0 if flag else 0.0], torch.distributed.ReduceOp.MAX)[0] > 0


def all_reduce_max(value: float) -> float:
    if world_size() == 1:
        return value
    return _reduce([float(value)], torch.distributed.ReduceOp.MAX)[0]


def all_reduce_mean(values: dict[str, float]) -> dict[str, float]:
    if world_size() == 1 or not values:
        return dict(values)
    keys = sorted(values)
    total = _reduce([float(values[k]) for k in keys], torch.distributed.ReduceOp.SUM)
    return {k: v / world_size() for k, v in zip(keys, total)}
