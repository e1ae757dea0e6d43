"""The trainers' collectives hand each backend tensors on the device it reduces.

NCCL reduces only CUDA tensors: a CPU tensor raises "No backend type associated with device type
cpu" at the first multi-GPU epoch. Without a GPU, the NCCL case is simulated: FakeTensorMode lets
the collectives build CUDA tensors without a device, and a stand-in all_reduce checks the device
like NCCL does. A real 2-process gloo group checks the values.
"""
import os

import pytest
import torch
import torch.multiprocessing as mp
from torch._subclasses.fake_tensor import FakeTensorMode

import paco_ds.runtime.distributed as D
from distributed_runs import free_port

pytestmark = pytest.mark.fast


class _Reduced(Exception):
    """Raised by the stand-in all_reduce once it has checked the tensor (fake tensors hold no data)."""


def _simulate_backend(monkeypatch, backend: str, cuda_index: int = 1) -> list:
    seen = []

    def all_reduce(t, op=None, group=None, async_op=False):
        seen.append(t.device)
        if backend == "nccl" and t.device.type != "cuda":
            raise RuntimeError(f"No backend type associated with device type {t.device.type}")
        raise _Reduced

    monkeypatch.setattr(D, "world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: cuda_index)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    return seen


COLLECTIVES = {"any_true": lambda: D.any_true(True), "all_reduce_max": lambda: D.all_reduce_max(3.0),
               "all_reduce_mean": lambda: D.all_reduce_mean({"loss": 1.0, "kl": 2.0})}


@pytest.mark.parametrize("name", COLLECTIVES)
def test_collectives_give_nccl_cuda_tensors_of_this_rank(monkeypatch, name):
    seen = _simulate_backend(monkeypatch, "nccl", cuda_index=1)
    with FakeTensorMode(), pytest.raises(_Reduced):
        COLLECTIVES[name]()
    assert seen == [torch.device("cuda", 1)]


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo,cuda:nccl"])
def test_collectives_give_cpu_backends_cpu_tensors(monkeypatch, backend):
    seen = _simulate_backend(monkeypatch, backend)
    for call in COLLECTIVES.values():
        with pytest.raises(_Reduced):
            call()
    assert seen == [torch.device("cpu")] * len(COLLECTIVES)


def _worker(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        out.put((rank, D.any_true(rank == 1), D.any_true(False), D.all_reduce_max(float(rank) * 5),
                 D.all_reduce_mean({"a": float(rank), "b": 2.0 * rank + 1})))
    finally:
        torch.distributed.destroy_process_group()


def test_collectives_agree_across_two_gloo_ranks():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for _, anyone, nobody, peak, mean in results:
        assert (anyone, nobody, peak) == (True, False, 5.0)
        assert mean == {"a": 0.5, "b": 2.0}


def test_the_preemption_marker_tells_a_launcher_the_ranks_saved(tmp_path):
    import time

    from paco_ds.runtime.stopping import clear_preempted, mark_preempted, preempted_since

    assert preempted_since(tmp_path, 0.0) is None
    start = time.time()
    mark_preempted(tmp_path, tmp_path / "checkpoints" / "epoch_0001", "SIGTERM")
    record = preempted_since(tmp_path, start)
    assert record["checkpoint"].endswith("epoch_0001") and record["reason"] == "SIGTERM"
    assert preempted_since(tmp_path, time.time() + 60) is None  # a marker older than this launch is not its status
    clear_preempted(tmp_path)
    assert preempted_since(tmp_path, 0.0) is None and not (tmp_path / "PREEMPTED").exists()
