"""Each rollout and model switch in one table and one JSON: exact or not, its measured CPU ratio, its
counted full-scale effect, and what the paper's recipe should set on GPUs.

Nothing is measured here: the ratios are read from the benchmarks' own results (rerun those to
refresh them, then this), so the table cannot drift from the JSON it cites:

  grpo_vs_reference_cpu.json   whole epochs of the rollout switches (benchmarks/grpo_vs_reference.py)
  grpo_full_scale.json         the T2IS epoch on 8 x H100 from counted FLOPs (benchmarks/grpo_full_scale.py)
  compile_blocks_cpu.json      model.compile, one call (benchmarks/compile_blocks.py)
  zero3_compile_cpu.json       ZeRO-3's gathered phase, compiled, and engine.compile() (benchmarks/zero3_compile.py)
  rollout_batches_cpu.json     sample.batch_size (benchmarks/rollout_speedups.py --batches)

docs/benchmarks.md's switch table is `--markdown`'s output (tests/test_switch_table.py holds them equal).

    python benchmarks/switches.py [--markdown]      # writes benchmarks/results/switches.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS  # noqa: E402

OWN_GPU, COLOCATED = "paco_ds (judge on its own GPU)", "paco_ds (judges colocated)"


def _load(results: Path, name: str) -> dict:
    return json.loads((results / name).read_text())


def switches(results: Path = RESULTS) -> list[dict]:
    """The rows, each with its numbers and the JSON they come from."""
    ref = _load(results, "grpo_vs_reference_cpu.json")
    full = _load(results, "grpo_full_scale.json")
    blocks = _load(results, "compile_blocks_cpu.json")["results"]
    h200 = _load(results, "compile_blocks_nvidia-h200.json")["results"]  # the GPU lane's compile stage
    zero3 = _load(results, "zero3_compile_cpu.json")
    batches = _load(results, "rollout_batches_cpu.json")["rollout_batches"]["rows"]
    gain = full["switches"]["gain_over_plain_paco_ds"]["40%"]  # the same at 30 and 50 % MFU
    fwd = full["switches"]["sampling_forwards_per_image"]

    def per_cpu_s(a: str, b: str) -> float:
        return ref[a]["images_per_cpu_sec"] / ref[b]["images_per_cpu_sec"]

    def wall(a: str, b: str) -> float:
        return ref[a]["images_per_sec"] / ref[b]["images_per_sec"]

    def counted(suffix: str) -> dict:
        return {"own_gpu": gain[f"{OWN_GPU} + {suffix}"], "colocated": gain[f"{COLOCATED} + {suffix}"],
                "sampling_forwards_per_image": [fwd[""], fwd[f" + {suffix}"]]}

    ode, prefix, both = counted("ode_steps 3"), counted("share_prefix"), counted("both")
    once = zero3["sampling_median_s"]
    return [
        {"switch": "`sample.ode_steps: 2` (CPU; 3 at full scale), `ode_solver: ab2`",
         "exact": "every trained step exact; the final image (and its reward) is the ab2 solver's",
         "cpu": {"epoch_wall": wall("paco_ds+ode", "paco_ds"), "per_cpu_second": per_cpu_s("paco_ds+ode", "paco_ds"),
                 "sampling_forwards_per_image": [ref["paco_ds"]["sample_forwards_per_image"],
                                                 ref["paco_ds+ode"]["sample_forwards_per_image"]]},
         "full_scale": ode,
         "gpu": "on, `ode_steps: 3`, when the reward may score the ab2 solver's image (the paper's numbers are "
                "with the plain sampler)",
         "sources": ["grpo_vs_reference_cpu.json", "grpo_full_scale.json"]},
        {"switch": "`sample.share_prefix` with `same_latent`",
         "exact": "yes: the same images as `same_latent` without sharing",
         "cpu": {"epoch_wall": wall("paco_ds+prefix", "paco_ds+same_latent"),
                 "per_cpu_second": per_cpu_s("paco_ds+prefix", "paco_ds+same_latent"), "against": "same_latent alone",
                 "sampling_forwards_per_image": [ref["paco_ds+same_latent"]["sample_forwards_per_image"],
                                                 ref["paco_ds+prefix"]["sample_forwards_per_image"]]},
         "full_scale": prefix,
         "gpu": "off: the paper draws one latent per image; `same_latent` changes what a group explores",
         "sources": ["grpo_vs_reference_cpu.json", "grpo_full_scale.json"]},
        {"switch": "both", "exact": "as above", "cpu": None, "full_scale": both, "gpu": "as the two rows above",
         "sources": ["grpo_full_scale.json"]},
        {"switch": "`model.compile`",
         "exact": "to float tolerance (velocities rtol 1e-4), not bitwise",
         "cpu": {"sampling_call": blocks["sample"]["speedup"], "training_step": blocks["train"]["speedup"],
                 "compile_minutes": [blocks["sample"]["compile_s"] / 60, blocks["train"]["compile_s"] / 60],
                 "zero3_sampling_phase": once["once"] / once["once_compiled"]},
         "full_scale": None,
         "gpu": f"on: {h200['sample']['speedup']:.2f}x sampling call, {h200['train']['speedup']:.2f}x training step "
                f"on an H200 (bf16, 512 px, {h200['sample']['compile_s']:.0f}-{h200['train']['compile_s']:.0f} s "
                "compile); under ZeRO-3 (`rollout_gather: once`) the blocks run compiled in sampling, the training "
                "steps eager",
         "gpu_measured": {"sampling_call": h200["sample"]["speedup"], "training_step": h200["train"]["speedup"],
                          "compile_s": [h200["sample"]["compile_s"], h200["train"]["compile_s"]]},
         "sources": ["compile_blocks_cpu.json", "zero3_compile_cpu.json", "compile_blocks_nvidia-h200.json"]},
        {"switch": "`deepspeed.engine_compile` (ZeRO-3 training steps)",
         "exact": "to float tolerance, not bitwise",
         "cpu": {"training_step": zero3["engine_compile_speedup"],
                 "graph_breaks_first_step": zero3["dynamo_engine_compile_first_step"]["graph_breaks"]},
         "full_scale": None,
         "gpu": "try it: a graph break at every module's ZeRO-3 hooks, so the gain on GPUs is unmeasured "
                "(DeepCompile, DeepSpeed's unbroken route, builds only with CUDA)",
         "sources": ["zero3_compile_cpu.json"]},
        {"switch": "`sample.batch_size` (rollout batch)",
         "exact": "yes (`tests/grpo/test_rollout_speedups.py`: batched and one at a time agree)",
         "cpu": {"images_per_s_vs_batch_1": {b: r["speed_vs_first"] for b, r in batches.items()}},
         "full_scale": None,
         "gpu": "the largest that fits, which `--dry-run --gpu-memory 80` names in its verdict",
         "sources": ["rollout_batches_cpu.json"]},
        {"switch": "`model.attention_backend`",
         "exact": "to bf16 rounding (2e-2 of the output's scale) against `native`: `tests/gpu/test_attention_gpu.py`, "
                  "passed for `_native_flash` on an H200; flash-attn's `flash` not run (not installed there)",
         "cpu": None, "full_scale": None,
         "gpu": "`flash` (or `_flash_3` on Hopper) where flash-attn is installed (`pip install .[flash]`); FLUX "
                "masks no prompt token, so a mask-free kernel is allowed. The default, `native`, is PyTorch's SDPA "
                "without cuDNN's kernel, whose backward fails on Hopper with torch 2.11",
         "sources": []},
    ]


def _cpu_cell(row: dict) -> str:
    c, name = row["cpu"], row["switch"]
    if name == "`model.attention_backend`":
        return "not measurable: the flash kernels need a GPU"
    if c is None:
        return "not measured together"
    if "epoch_wall" in c:
        f = c["sampling_forwards_per_image"]
        against = f", against {c['against']}" if "against" in c else ""
        return (f"{c['epoch_wall']:.2f}x epoch wall, {c['per_cpu_second']:.2f}x per CPU second{against} "
                f"({f[0]:g} -> {f[1]:g} sampling forwards / image; noisy under load)")
    if "sampling_call" in c:
        lo, hi = sorted(c["compile_minutes"])
        return (f"{c['sampling_call']:.2f}x sampling call, {c['training_step']:.2f}x training step "
                f"({lo:.1f}-{hi:.1f} min compile); {c['zero3_sampling_phase']:.2f}x a ZeRO-3 sampling phase")
    if "images_per_s_vs_batch_1" in c:
        s = c["images_per_s_vs_batch_1"]
        return f"{s['4']:.2f}x images/s at 4, {s['8']:.2f}x at 8 (one thread: compute-bound at any batch)"
    return f"{c['training_step']:.2f}x training step ({c['graph_breaks_first_step']} graph breaks)"


def _full_cell(row: dict) -> str:
    f, name = row["full_scale"], row["switch"]
    if f is not None:
        a, b = f["sampling_forwards_per_image"]
        return f"{f['own_gpu']:.2f}x / {f['colocated']:.2f}x ({a:.3g} -> {b:.3g})"
    if name == "`sample.batch_size` (rollout batch)":
        return "the same FLOPs; a batch buys GPU utilisation, which only a GPU measures"
    return "none counted: the same FLOPs, run faster" if "compile" in name else "the same FLOPs; faster attention kernels"


def markdown(rows: list[dict]) -> str:
    head = ("| switch | exact? | CPU measured ratio | full-scale counted ratio (judge on its own GPU / colocated; "
            "sampling forwards per image) | on the paper's recipe on GPUs | source JSON |\n|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['switch']} | {r['exact']} | {_cpu_cell(r)} | {_full_cell(r)} | {r['gpu']} | "
        f"{', '.join(f'`{s}`' for s in r['sources']) or 'none yet'} |\n" for r in rows)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=RESULTS, help="where the benchmarks' JSON files are")
    p.add_argument("--out", type=Path, default=RESULTS / "switches.json")
    p.add_argument("--markdown", action="store_true", help="print the table as docs/benchmarks.md has it")
    args = p.parse_args(argv)
    rows = switches(args.results)
    print(markdown(rows), end="")
    if not args.markdown:
        args.out.write_text(json.dumps({"benchmark": "switches", "command": "python benchmarks/switches.py",
                                        "note": "read from the listed JSON files; nothing measured here",
                                        "switches": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
