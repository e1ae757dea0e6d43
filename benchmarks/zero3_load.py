"""Peak resident memory per rank of loading FLUX under ZeRO-3: plain load vs partitioned load.

    python benchmarks/zero3_load.py             # reduced full-width FLUX (0.67B), 2 ranks, bf16

The folder is written once with `paco_ds.models.tiny.flux.save_flux_folder` (REDUCED_FLUX_TRANSFORMER:
FLUX.1-dev's width, 1 double + 2 single blocks) under runs/ (git-ignored). Each mode starts 2 fresh
ranks with the deepspeed launcher (CPU, gloo), which do what the trainer does:
  naive        FluxPolicy.load(cfg, device): the whole transformer on every rank, partitioned
               only by deepspeed.initialize;
  partitioned  FluxPolicy.load(cfg, device, ds_config=ZeRO-3): built under zero.Init, weights
               streamed tensor by tensor into the partitions (paco_ds/models/zero_load.py);
then add_lora (the recipe's LoRA, rank 64) and paco_ds.runtime.engine.create_engine (deepspeed.initialize).

Memory per rank, from /proc/self/status: the kernel's high-water mark VmHWM is reset through
/proc/self/clear_refs after the imports, so "peak" is the highest resident set (anonymous memory
plus mapped file pages, such as safetensors read through mmap) during load + engine, and "rise" is
that peak minus the resident set before loading (torch, DeepSpeed, diffusers, transformers
imported). Rises are also given as a fraction of the transformer's bytes in the load dtype, so
"each rank holds about 1/world of it at peak" reads off directly. glibc is told to mmap every
allocation above 64 KiB, so freed tensors leave the resident set at once. ru_maxrss (whole
process, imports included) is recorded too.

Prints a table and writes benchmarks/results/zero3_load_cpu.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_FOLDER = ROOT / "runs" / "bench_cache" / "flux_reduced_bf16"
MODES = ("naive", "partitioned")


def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process in bytes."""
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"^{k}:\s+(\d+) kB", text, re.M).group(1)) * 1024
            for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _fixed_mmap_threshold(nbytes: int = 1 << 16) -> bool:
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, nbytes))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


# ---------------------------------------------------------------------------------------- rank
def worker(args) -> None:
    mmap_fixed = _fixed_mmap_threshold()
    import resource

    import diffusers  # noqa: F401  (imported before the baseline, like everything the load uses)
    import peft  # noqa: F401
    import torch
    import transformers  # noqa: F401

    from paco_ds.recipe.schema import LoraConfig, ModelConfig
    from paco_ds.runtime.distributed import setup_distributed, shutdown_distributed
    from paco_ds.runtime.engine import build_ds_config, create_engine, load_ds_config
    from paco_ds.models.flux import FluxPolicy
    from paco_ds.models.lora import add_lora

    dist = setup_distributed()
    cfg = ModelConfig(path=str(args.folder), dtype=args.dtype)
    ds_config = build_ds_config(load_ds_config(ROOT / "configs" / "deepspeed" / "zero3.json"), micro_batch=1,
                                grad_accum=1, world_size=dist.world_size, grad_clip=1.0, bf16=args.dtype == "bf16")
    torch.distributed.barrier()
    before = _status()
    peak_reset = _reset_peak()
    t0 = time.perf_counter()
    policy = FluxPolicy.load(cfg, dist.device, ds_config=ds_config if args.worker == "partitioned" else None)
    t_load = time.perf_counter() - t0
    after_load = _status()
    transformer = policy.transformer
    numel = sum(int(getattr(p, "ds_numel", p.numel())) for p in transformer.parameters())
    elem = next(transformer.parameters()).element_size()
    largest = max(int(getattr(p, "ds_numel", p.numel())) for p in transformer.parameters()) * elem
    others = sum(q.numel() * q.element_size() for m in (policy.vae, policy.text_encoder, policy.text_encoder_2)
                 for q in m.parameters())
    torch.manual_seed(0)
    add_lora(transformer, LoraConfig(target_modules=list(FluxPolicy.lora_targets)))
    t1 = time.perf_counter()
    engine = create_engine(transformer, [p for p in transformer.parameters() if p.requires_grad], ds_config,
                           lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    t_engine = time.perf_counter() - t1
    after_engine = _status()
    local = sum(int(p.ds_tensor.numel()) for p in transformer.parameters() if hasattr(p, "ds_tensor"))
    out = {"rank": dist.rank, "world_size": dist.world_size, "mode": args.worker, "dtype": args.dtype,
           "transformer_numel": numel, "transformer_bytes": numel * elem,
           "largest_tensor_bytes": largest, "vae_and_text_encoders_bytes": others, "local_numel_after_engine": local,
           "before": before, "after_load": after_load, "after_engine": after_engine,
           "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "peak_reset": peak_reset, "mmap_threshold_fixed": mmap_fixed,
           "load_s": round(t_load, 2), "engine_s": round(t_engine, 2)}
    Path(args.result_dir, f"rank{dist.rank}.json").write_text(json.dumps(out))
    del engine
    shutdown_distributed()


# ---------------------------------------------------------------------------------------- driver
def run_mode(mode: str, folder: Path, dtype: str, nproc: int) -> list[dict]:
    sys.path.insert(0, str(ROOT / "tests"))
    from distributed_runs import DEEPSPEED, cpu_env, free_port

    with tempfile.TemporaryDirectory(prefix=f"zero3_load_{mode}_") as tmp:
        cmd = [str(DEEPSPEED), "--num_gpus", str(nproc), "--master_port", str(free_port()), str(Path(__file__)),
               "--worker", mode, "--folder", str(folder), "--dtype", dtype, "--result-dir", tmp]
        proc = subprocess.run(cmd, cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"{mode} run failed:\n{proc.stdout[-3000:]}\n---\n{proc.stderr[-3000:]}")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(nproc)]


def summarise(rank: dict) -> dict:
    gib = 1 << 30
    tb = rank["transformer_bytes"]
    rise = rank["after_engine"]["VmHWM"] - rank["before"]["VmRSS"]
    return {"rank": rank["rank"], "baseline_rss_gib": round(rank["before"]["VmRSS"] / gib, 3),
            "peak_rss_gib": round(rank["after_engine"]["VmHWM"] / gib, 3),
            "peak_rise_gib": round(rise / gib, 3), "peak_rise_x_transformer": round(rise / tb, 3),
            "rise_after_load_x_transformer": round((rank["after_load"]["VmRSS"] - rank["before"]["VmRSS"]) / tb, 3),
            "rise_after_engine_x_transformer": round((rank["after_engine"]["VmRSS"] - rank["before"]["VmRSS"]) / tb, 3),
            "ru_maxrss_gib": round(rank["ru_maxrss_bytes"] / gib, 3),
            "vae_and_text_encoders_x_transformer": round(rank["vae_and_text_encoders_bytes"] / tb, 3),
            "largest_tensor_x_transformer": round(rank["largest_tensor_bytes"] / tb, 3),
            "local_share_after_engine": round(rank["local_numel_after_engine"] / rank["transformer_numel"], 4),
            "load_s": rank["load_s"], "engine_s": rank["engine_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--folder", type=Path, default=DEFAULT_FOLDER, help="FLUX folder (written once if absent)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from _common import machine, write_report
    from paco_ds.models.tiny.flux import REDUCED_FLUX_TRANSFORMER, save_flux_folder

    machine_info = machine()
    t0 = time.perf_counter()
    save_flux_folder(args.folder)
    print(f"FLUX folder {args.folder} ready in {time.perf_counter() - t0:.1f}s")
    ranks = {mode: run_mode(mode, args.folder, args.dtype, args.nproc) for mode in MODES}
    rows = {mode: [summarise(r) for r in rs] for mode, rs in ranks.items()}
    tb = ranks["naive"][0]["transformer_bytes"]
    print(f"\ntransformer: {ranks['naive'][0]['transformer_numel'] / 1e9:.3f}B params, {tb / (1 << 30):.3f} GiB in "
          f"{args.dtype}; {args.nproc} ranks; 1/world = {1 / args.nproc:.2f}")
    r0 = rows["naive"][0]
    print(f"T = transformer bytes; the rises include the VAE and text encoders "
          f"({r0['vae_and_text_encoders_x_transformer']} T, loaded whole in both modes); "
          f"largest transformer tensor {r0['largest_tensor_x_transformer']} T")
    head = ("mode", "rank", "base GiB", "peak GiB", "rise GiB", "rise/T", "after load/T", "after engine/T",
            "load s", "engine s")
    print(" | ".join(f"{h:>14}" for h in head))
    for mode, rs in rows.items():
        for r in rs:
            vals = (mode, r["rank"], r["baseline_rss_gib"], r["peak_rss_gib"], r["peak_rise_gib"],
                    r["peak_rise_x_transformer"], r["rise_after_load_x_transformer"],
                    r["rise_after_engine_x_transformer"], r["load_s"], r["engine_s"])
            print(" | ".join(f"{v:>14}" for v in vals))
    report = {
        "config": {"folder": str(args.folder.relative_to(ROOT) if args.folder.is_relative_to(ROOT) else args.folder),
                   "transformer_config": REDUCED_FLUX_TRANSFORMER, "dtype": args.dtype, "nproc": args.nproc,
                   "ds_config": "configs/deepspeed/zero3.json", "lora": "LoraConfig() defaults (rank 64), FLUX's own targets"},
        "transformer": {"numel": ranks["naive"][0]["transformer_numel"], "bytes": tb},
        "method": ("per rank: peak = VmHWM (reset via /proc/self/clear_refs after imports) over load + add_lora + "
                   "deepspeed.initialize; rise = peak - VmRSS before loading; x_transformer = rise / transformer "
                   "bytes in the load dtype; RSS includes mapped safetensors pages"),
        "results": rows, "raw": ranks,
        "reading": ("rise/T is the per-rank peak over the imports as a fraction of the transformer; the partitioned "
                    "load's is 1/world plus the VAE and text encoders plus about two copies of the largest tensor "
                    "(the gathered parameter and its all-gather buffer), the naive load's is the whole transformer "
                    "plus what deepspeed.initialize allocates while partitioning it"),
    }
    path = write_report(f"zero3_load_{'cpu' if machine_info['gpu'] is None else 'gpu'}", report, args.out,
                        machine_info)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
