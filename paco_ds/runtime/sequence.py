"""Sequence groups (`parallel.sequence: N`): the ranks of a run in groups of N consecutive ranks.

The ranks of a group hold one sample's tokens between them (paco_ds/models/sequence.py shards the
transformer's sequence over them) and do everything else together: they draw the same samples
from the same noise, score them once (the group's first rank), and train on the same samples, so
to the data, the rewards and the advantages a group is one data-parallel rank (`DistInfo.data_rank`,
`DistInfo.data_world`). ZeRO-3 partitions the weights over all ranks, as without groups.

Consecutive ranks, so that on GPUs a group sits on one node, where the attention's all-to-all runs
over NVLink. The groups are the "ulysses" dimension of a device mesh ("data", "ring", "ulysses") of
shape (world / N, 1, N): the layout diffusers' context parallelism reads ("ring" unused).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Iterator

import torch

from paco_ds.errors import ConfigError
from paco_ds.runtime.distributed import DistInfo

KEY = "parallel.sequence"
MESH_DIMS = ("data", "ring", "ulysses")


def data_world(world_size: int, n: int) -> int:
    """The data-parallel world size of `world_size` ranks in sequence groups of n."""
    if n < 1 or world_size % n:
        raise ConfigError(f"config key '{KEY}': {n} does not divide the world size {world_size} (every sequence group "
                          f"holds {n} ranks)")
    return world_size // n


def grouped(dist: DistInfo, n: int) -> DistInfo:
    """`dist` with its ranks in sequence groups of n."""
    data_world(dist.world_size, n)
    return replace(dist, sequence=n)


def group_loss(loss: torch.Tensor, dist: DistInfo) -> torch.Tensor:
    """The loss a rank backpropagates: under parallel.sequence its gradient is its token shard's part
    of the sample's gradient (paco_ds/models/sequence.py), and DeepSpeed averages the gradients over
    all ranks; times N, that average is the one over sequence groups, the data-parallel ranks."""
    return loss * dist.sequence


def sequence_mesh(dist: DistInfo):
    """The run's device mesh of sequence groups (collective: every rank calls it), None without groups."""
    if dist.sequence == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(dist.device.type, (dist.data_world, 1, dist.sequence), mesh_dim_names=MESH_DIMS)


@contextlib.contextmanager
def emulated_group(n: int) -> Iterator:
    """One rank of a sequence group of n in this process alone (the GPU plan: one process counts one
    rank): a process group of torch's "fake" backend, whose collectives do nothing, and on fake
    tensors diffusers' all-to-alls and gathers give their real shapes. Yields the mesh; the group is
    destroyed after. A process that already has a process group cannot hold a second default one."""
    if torch.distributed.is_initialized():
        raise RuntimeError("a sequence group is emulated in a process without a process group")
    from torch.distributed.device_mesh import init_device_mesh

    torch.distributed.init_process_group("fake", rank=0, world_size=n)
    try:
        yield init_device_mesh("cpu", (1, 1, n), mesh_dim_names=MESH_DIMS)
    finally:
        torch.distributed.destroy_process_group()
