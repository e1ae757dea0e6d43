"""`model.compile` on the reduced-depth, full-width FLUX transformer (1 double + 2 single blocks at
FLUX.1-dev's width, paco_ds/models/tiny/flux.py), LoRA r64 on PaCo-RL's targets.

Times one sampling call (no grad, a batch of 4) and one training step (batch 1, forward and
backward) eager and compiled, interleaved (A, B, A, B: the machine may be shared), after a warm-up
that holds the compile time. Prints a table, writes JSON.
- `--device cpu` (default): fp32 at 128 px (64 image + 64 text tokens), 3 repeats;
  benchmarks/results/compile_blocks_cpu.json.
- `--device cuda`: bf16 at the paper's 512 px with FLUX's 512 T5 tokens (1024 image + 512 text
  tokens), synchronised before and after each call, 10 repeats; benchmarks/results/compile_blocks_<gpu>.json.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

import torch
from _common import RESULTS, device_slug, machine, write_report  # also puts the repository on sys.path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--reps", type=int, help="timed calls per kind and model (default 3 on CPU, 10 on cuda)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    reps = args.reps or (10 if cuda else 3)
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    img, txt = (1024, 512) if cuda else (64, 64)  # (512 px / 16)^2 image tokens; T5 tokens
    info = machine()
    from diffusers import FluxTransformer2DModel

    from paco_ds.recipe.schema import LoraConfig
    from paco_ds.models.attention import set_attention_backend
    from paco_ds.models.compile import compile_blocks
    from paco_ds.models.flux import FluxPolicy
    from paco_ds.models.lora import add_lora
    from paco_ds.models.tiny.flux import REDUCED_FLUX_TRANSFORMER

    torch.manual_seed(0)
    eager = FluxTransformer2DModel(**REDUCED_FLUX_TRANSFORMER).to(device, dtype)
    add_lora(eager, LoraConfig(rank=64, alpha=128, target_modules=list(FluxPolicy.lora_targets)))
    eager.to(device, dtype)  # the LoRA layers too
    set_attention_backend(eager, None)  # as the trainer: PyTorch's SDPA without cuDNN's kernel
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled)

    def inputs(batch, seed):
        g = torch.Generator().manual_seed(seed)
        on = dict(device=device, dtype=dtype)
        return dict(hidden_states=torch.randn(batch, img, 64, generator=g).to(**on),
                    encoder_hidden_states=torch.randn(batch, txt, 4096, generator=g).to(**on),
                    pooled_projections=torch.randn(batch, 768, generator=g).to(**on),
                    timestep=torch.full((batch,), 0.7, **on), guidance=torch.full((batch,), 3.5, **on),
                    img_ids=torch.zeros(img, 3, **on), txt_ids=torch.zeros(txt, 3, **on), return_dict=False)

    def sample(m, x):
        m.eval()
        with torch.no_grad():
            m(**x)

    def train(m, x):
        m.train()
        m.zero_grad(set_to_none=True)
        m(**x)[0].float().pow(2).mean().backward()

    batch = {sample: 4, train: 1}

    def timed(fn, m, seed):
        x = inputs(batch[fn], seed)  # made before the clock starts
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn(m, x)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    compile_s = {"sample": timed(sample, compiled, 0), "train": timed(train, compiled, 0)}
    first_eager = {"sample": timed(sample, eager, 0), "train": timed(train, eager, 0)}
    times = {k: {"eager": [], "compiled": []} for k in ("sample", "train")}
    for r in range(reps):  # interleaved: eager, compiled, eager, compiled
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
    report = {"model": f"reduced FLUX (1 double + 2 single blocks, width 3072), {str(dtype)[6:]}, LoRA r64",
              "device": str(device), "gpu": torch.cuda.get_device_name(0) if cuda else None,
              "shapes": {"sample_batch": 4, "train_batch": 1, "image_tokens": img, "text_tokens": txt},
              "reps": reps, "times_s": times, "results": rows,
              "load_average_at_end": list(os.getloadavg())}
    print(write_report(f"compile_blocks_{device_slug(device)}", report, Path(args.out), info))
    return report


if __name__ == "__main__":
    main()
