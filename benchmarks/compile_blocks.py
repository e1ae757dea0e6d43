"""`model.compile` on the reduced-depth, full-width FLUX transformer (1 double + 2 single blocks at
FLUX.1-dev's width, paco_ds/models/tiny/flux.py), CPU, fp32, LoRA r64 on PaCo-RL's targets.

Times one sampling call (no grad, a batch of 4 at 128 px: 64 image + 64 text tokens) and one
training step (batch 1, forward and backward) eager and compiled, interleaved (A, B, A, B: the
machine is shared), after a warm-up that holds the compile time. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

import torch
from _common import RESULTS, machine, write_report  # also puts the repository on sys.path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    info = machine()
    from diffusers import FluxTransformer2DModel

    from paco_ds.config import LoraConfig
    from paco_ds.models.compile import compile_blocks
    from paco_ds.models.flux import FluxPolicy
    from paco_ds.models.lora import add_lora
    from paco_ds.models.tiny.flux import REDUCED_FLUX_TRANSFORMER

    torch.manual_seed(0)
    eager = FluxTransformer2DModel(**REDUCED_FLUX_TRANSFORMER)
    add_lora(eager, LoraConfig(rank=64, alpha=128, target_modules=list(FluxPolicy.lora_targets)))
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled)

    def inputs(batch, seed):
        g = torch.Generator().manual_seed(seed)
        txt, img = 64, 64
        return dict(hidden_states=torch.randn(batch, img, 64, generator=g),
                    encoder_hidden_states=torch.randn(batch, txt, 4096, generator=g),
                    pooled_projections=torch.randn(batch, 768, generator=g),
                    timestep=torch.full((batch,), 0.7), guidance=torch.full((batch,), 3.5),
                    img_ids=torch.zeros(img, 3), txt_ids=torch.zeros(txt, 3), return_dict=False)

    def sample(m, seed):
        m.eval()
        with torch.no_grad():
            m(**inputs(4, seed))

    def train(m, seed):
        m.train()
        m.zero_grad(set_to_none=True)
        m(**inputs(1, seed))[0].pow(2).mean().backward()

    def timed(fn, m, seed):
        t = time.perf_counter()
        fn(m, seed)
        return time.perf_counter() - t

    compile_s = {"sample": timed(sample, compiled, 0), "train": timed(train, compiled, 0)}
    first_eager = {"sample": timed(sample, eager, 0), "train": timed(train, eager, 0)}
    times = {k: {"eager": [], "compiled": []} for k in ("sample", "train")}
    for r in range(args.reps):  # interleaved: eager, compiled, eager, compiled
        for kind, fn in (("sample", sample), ("train", train)):
            for name, m in (("eager", eager), ("compiled", compiled)):
                times[kind][name].append(timed(fn, m, r + 1))
    rows = {}
    for kind in times:
        e, c = statistics.median(times[kind]["eager"]), statistics.median(times[kind]["compiled"])
        rows[kind] = {"eager_s": e, "compiled_s": c, "speedup": e / c,
                      "first_call_compiled_s": compile_s[kind], "first_call_eager_s": first_eager[kind],
                      "compile_s": compile_s[kind] - first_eager[kind]}
    print(f"{'call':8} {'eager s':>9} {'compiled s':>11} {'speedup':>8} {'compile s':>10}")
    for kind, r in rows.items():
        print(f"{kind:8} {r['eager_s']:9.2f} {r['compiled_s']:11.2f} {r['speedup']:8.2f}x {r['compile_s']:10.1f}")
    report = {"model": "reduced FLUX (1 double + 2 single blocks, width 3072), fp32, LoRA r64",
              "shapes": {"sample_batch": 4, "train_batch": 1, "image_tokens": 64, "text_tokens": 64},
              "reps": args.reps, "times_s": times, "results": rows,
              "load_average_at_end": list(os.getloadavg())}
    print(write_report("compile_blocks_cpu", report, Path(args.out), info))
    return report


if __name__ == "__main__":
    main()
