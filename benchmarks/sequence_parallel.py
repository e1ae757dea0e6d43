"""What `parallel.sequence: 2` costs against 1 on CPU ranks over gloo: communication against compute.

Two processes (one core each, gloo). For each model and call, in turns (N=1, N=2, N=1, ...):
- N=1: each rank runs the whole sample on its own (data parallelism: two samples at a time);
- N=2: the two ranks run one sample between them, its tokens split (paco_ds/models/sequence.py:
  diffusers' Ulysses attention), each attention trading heads for sequence with an all-to-all.
Within N=2 the time spent in the all-to-alls (forward and backward) and the output gather is
measured apart from the rest: that is communication plus waiting for the other rank.

Models: the tiny FLUX.1 transformer of the tests (2 heads of 16) at 128 px (64 image and 64 prompt
tokens), and the reduced full-width FLUX (FLUX.1-dev's width, 24 heads of 128, 1 double + 2 single
blocks, paco_ds/models/tiny/flux.py) at 256 px (256 image and 256 prompt tokens), both fp32 with a
LoRA (r8 tiny, r64 reduced). Calls: a sampling forward (no grad) and a training step (forward and
backward), one sample each. Prints a table; writes benchmarks/results/sequence_parallel_cpu.json
(median and spread of the repeats, the command, the machine, the commit). On a GPU, NVLink's
all-to-all against a GPU's compute is another ratio altogether: not measured here.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from _common import REPO, RESULTS, machine, write_report  # also puts the repository on sys.path

MODELS = {
    "tiny FLUX (2 heads x 16)": {"size": 128, "text": 64, "lora": 8},
    "reduced FLUX (24 heads x 128, 1+2 blocks)": {"size": 256, "text": 256, "lora": 64},
}


class Clock:
    """Seconds spent inside the wrapped functions (diffusers' all-to-all and output gather)."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
        return timed


def transformer(name: str):
    from diffusers import FluxTransformer2DModel

    from paco_ds.models.tiny.flux import REDUCED_FLUX_TRANSFORMER, tiny_flux_components
    from paco_ds.recipe.schema import TinyModelConfig

    if name.startswith("tiny"):
        return tiny_flux_components(TinyModelConfig(), seed=0)["transformer"]
    torch.manual_seed(0)
    return FluxTransformer2DModel(**REDUCED_FLUX_TRANSFORMER)


def inputs(model, size: int, text: int) -> dict:
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    tokens = (size // 16) ** 2
    side = size // 16
    ids = torch.zeros(tokens, 3)
    ids[:, 1], ids[:, 2] = torch.arange(tokens) // side, torch.arange(tokens) % side
    return dict(hidden_states=torch.randn(1, tokens, cfg.in_channels, generator=g),
                encoder_hidden_states=torch.randn(1, text, cfg.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=g),
                timestep=torch.full((1,), 0.7), guidance=torch.full((1,), 3.5), img_ids=ids,
                txt_ids=torch.zeros(text, 3), return_dict=False)


def worker(rank: int, port: int, reps: int, names: list[str], out: str) -> None:
    import copy
    import json
    import types

    import diffusers.hooks.context_parallel as cp
    import diffusers.models.attention_dispatch as dispatch

    from paco_ds.models.flux import FluxPolicy
    from paco_ds.models.lora import add_lora
    from paco_ds.models.sequence import shard_sequence
    from paco_ds.recipe.schema import LoraConfig
    from paco_ds.runtime.distributed import DistInfo
    from paco_ds.runtime.sequence import sequence_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    mesh = sequence_mesh(DistInfo(rank, 2, rank, torch.device("cpu"), sequence=2))
    clock = Clock()  # every all-to-all of the Ulysses attention, and the gather of the output tokens
    dispatch._all_to_all_single = clock.wrap(dispatch._all_to_all_single)
    cp.EquipartitionSharder.unshard = classmethod(clock.wrap(cp.EquipartitionSharder.unshard.__func__))

    def max_over_ranks(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t)

    results = {}
    for name in names:
        spec = MODELS[name]
        plain = transformer(name)
        add_lora(plain, LoraConfig(rank=spec["lora"], alpha=2 * spec["lora"], target_modules=list(FluxPolicy.lora_targets)))
        # the same weights (and gradients) in both: only the modules and their hooks are copied, so a
        # rank holds the reduced model once
        shared = {id(t): t for t in (*plain.parameters(), *plain.buffers())}
        sharded = copy.deepcopy(plain, memo=shared)
        shard_sequence(types.SimpleNamespace(transformer=sharded), mesh)
        x = inputs(plain, spec["size"], spec["text"])

        def sample(m):
            m.eval()
            with torch.no_grad():
                m(**x)

        def train(m):
            m.train()
            m.zero_grad(set_to_none=True)
            m(**x)[0].pow(2).mean().backward()

        def timed(call, m) -> tuple[float, float]:
            torch.distributed.barrier()
            clock.seconds = 0.0
            t = time.perf_counter()
            call(m)
            total = time.perf_counter() - t
            return max_over_ranks(total), max_over_ranks(clock.seconds)

        rows = {}
        for kind, call in (("sample", sample), ("train", train)):
            timed(call, plain), timed(call, sharded)  # warm-up: allocations, first-call paths
            one, two, comm = [], [], []
            for _ in range(reps):  # in turns: the machine may be shared
                one.append(timed(call, plain)[0])
                total, exchanged = timed(call, sharded)
                two.append(total)
                comm.append(exchanged)
            t1, t2, c2 = statistics.median(one), statistics.median(two), statistics.median(comm)
            rows[kind] = {"n1_s": one, "n2_s": two, "n2_communication_s": comm, "n1_median_s": t1,
                          "n2_median_s": t2, "n2_communication_median_s": c2, "n2_compute_median_s": t2 - c2,
                          "latency_n2_over_n1": t2 / t1, "throughput_n2_over_n1": t1 / (2 * t2),
                          "communication_share": c2 / t2}
        results[name] = {"image_tokens": (spec["size"] // 16) ** 2, "text_tokens": spec["text"],
                         "heads": plain.config.num_attention_heads, "head_dim": plain.config.attention_head_dim,
                         "lora_rank": spec["lora"], "calls": rows}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main(argv=None) -> dict:
    import json
    import socket
    import subprocess
    import tempfile

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5, help="timed calls per model, kind and N (default 5)")
    p.add_argument("--quick", action="store_true", help="the tiny model only, 2 repeats (the test's run)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    reps = 2 if args.quick else args.reps
    names = list(MODELS)[:1] if args.quick else list(MODELS)
    info = machine()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        found = Path(tmp) / "results.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(port), str(reps), str(found),
                                   *names], env=env) for r in range(2)]
        codes = [proc.wait() for proc in procs]
        if any(codes):
            raise SystemExit(f"a worker failed: exit codes {codes}")
        results = json.loads(found.read_text())
    print(f"{'model':44} {'call':7} {'N=1 s':>8} {'N=2 s':>8} {'of it comm.':>11} {'latency':>8} {'throughput':>10}")
    for name, r in results.items():
        for kind, c in r["calls"].items():
            print(f"{name:44} {kind:7} {c['n1_median_s']:8.3f} {c['n2_median_s']:8.3f} "
                  f"{c['communication_share']:10.0%} {c['latency_n2_over_n1']:7.2f}x {c['throughput_n2_over_n1']:9.2f}x")
    report = {"what": "N=1: each of 2 ranks runs a whole sample; N=2: the 2 ranks run one sample, its tokens split "
                      "(Ulysses all-to-all); communication = time inside the all-to-alls and the output gather, "
                      "waiting for the other rank included. latency = N=2 time / N=1 time for one sample; "
                      "throughput = samples per second of the pair, N=2 over N=1",
              "backend": "gloo", "dtype": "fp32", "reps": reps, "models": results,
              "source": _source(), "load_average_at_end": list(os.getloadavg())}
    print(write_report("sequence_parallel_cpu", report, Path(args.out), info))
    return report


def _source() -> dict:
    from kernels.bench.source import source_state

    return source_state(REPO)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, port, reps, out, *names = sys.argv[2:]
        worker(int(rank), int(port), int(reps), names, out)
    else:
        main()
