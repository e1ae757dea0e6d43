"""Peak memory and time of the fused linear + first_token_weight loss against the naive path.

    python benchmarks/weighted_ce.py            # 4096 tokens, vocabulary 152,064, hidden 256, fp32 (CPU)

Both variants compute PaCo-Reward's first_token_weight loss (alpha 0.1;
PaCo-RL/PaCo-Reward/LLaMA-Factory/src/llamafactory/train/sft/trainer.py:122-175) and its gradient
with respect to the hidden states (the LM head is frozen in LoRA SFT), forward + backward:
  naive  logits = h W^T materialised [tokens, vocab], then paco_ds.sft.loss.naive_weighted_ce (the
         reference's computation: fp32 cross-entropy, weights, sum / valid tokens), autograd;
  fused  paco_ds.sft.loss.sft_loss through kernels.weighted_linear_ce (chunks of rows; Triton
         rows on CUDA, torch rows on CPU).

Memory, on CPU: torch has no allocator statistics there, so each call is measured as the rise of
the process's resident set: the kernel's high-water mark (VmHWM) is reset through
/proc/self/clear_refs just before the call, and peak = VmHWM after it - VmRSS before it. glibc is
told to mmap every allocation above 64 KiB, so freed tensors leave the resident set at once and
calls do not hide each other.
On CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus what was allocated
before. Time: the median of the rounds; the variants alternate inside each round, so drifts of a
shared machine hit both. The hidden size only scales the two matmuls (memory is dominated by the
tokens x vocabulary logits, independent of it): 256 keeps a naive call under half a minute on 2 cores.

Prints a table and writes benchmarks/results/weighted_ce_<device>.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paco_ds.sft.loss import naive_weighted_ce, sft_loss  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TARGETS = {"memory_ratio_max": 0.25, "time_ratio_max": 1.2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _fixed_mmap_threshold(nbytes: int = 1 << 16) -> bool:
    """Serve every allocation above 64 KiB with its own mmap (glibc), returned to the system on free,
    so the resident set follows the live tensors; otherwise glibc raises its threshold after a free
    and later allocations can reuse heap pages that a measurement would not see."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, nbytes))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def _status_bytes(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


class Meter:
    """Peak memory of one call, in bytes above what was in use just before it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def run(self, fn) -> tuple[float, int]:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            base = _status_bytes("VmRSS")
        t0 = time.perf_counter()
        fn()
        if self.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated() if self.cuda else _status_bytes("VmHWM")) - base
        return seconds, peak


def make_inputs(tokens: int, hidden: int, vocab: int, dtype, device, seed: int = 0):
    """hidden [1, tokens + 1, H], a frozen head [V, H], labels on every position after the first."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(1, tokens + 1, hidden, generator=g).to(device, dtype)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(device, dtype)
    labels = torch.randint(0, vocab, (1, tokens + 1), generator=g).to(device)
    labels[0, 0] = -100
    return h, w, labels


def variants(h, w, labels, alpha: float, chunk_size: int | None):
    out = {}

    def naive():
        x = h.clone().requires_grad_(True)
        loss = naive_weighted_ce(x @ w.t(), labels, alpha)
        loss.backward()
        out["naive"] = (loss.detach(), x.grad)

    def fused():
        x = h.clone().requires_grad_(True)
        loss = sft_loss(x, w, labels, alpha, chunk_size=chunk_size).loss
        loss.backward()
        out["fused"] = (loss.detach(), x.grad)

    return {"naive": naive, "fused": fused}, out


def machine(device: torch.device) -> dict:
    info = {"cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform()}
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = re.search(r"model name\s*:\s*(.+)", cpuinfo)
    info["cpu"] = cpu.group(1).strip() if cpu else platform.processor()
    info["ram_gib"] = round(int(re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text()).group(1))
                            / 2**20, 1)
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=152064)  # Qwen2.5-VL
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--chunk-size", type=int, default=0, help="rows per chunk of the fused op (0: its auto size)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a smoke run: 1024 tokens, vocabulary 16384, hidden 64")
    p.add_argument("--out", type=Path, default=None, help="directory for the JSON (default benchmarks/results)")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.vocab, args.hidden, args.rounds = 1024, 16384, 64, 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fixed_mmap = device.type == "cpu" and _fixed_mmap_threshold()
    dtype = DTYPES[args.dtype]
    h, w, labels = make_inputs(args.tokens, args.hidden, args.vocab, dtype, device)
    fns, out = variants(h, w, labels, args.alpha, args.chunk_size or None)
    meter = Meter(device)
    for fn in fns.values():  # warm-up: libraries, kernels, page tables
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    peaks: dict[str, list[int]] = {k: [] for k in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            seconds, peak = meter.run(fn)
            times[name].append(seconds)
            peaks[name].append(peak)
    (loss_n, grad_n), (loss_f, grad_f) = out["naive"], out["fused"]
    from kernels.weighted_ce import auto_chunk_size

    chunk = args.chunk_size or auto_chunk_size(args.vocab)
    itemsize = torch.finfo(dtype).bits // 8
    results = [{"variant": k, "median_s": statistics.median(times[k]), "times_s": times[k],
                "peak_bytes": max(peaks[k]), "peaks_bytes": peaks[k]} for k in fns]
    by = {r["variant"]: r for r in results}
    ratios = {"memory": by["fused"]["peak_bytes"] / by["naive"]["peak_bytes"],
              "time": by["fused"]["median_s"] / by["naive"]["median_s"],
              "time_by_round": [f / n for f, n in zip(times["fused"], times["naive"])]}
    cmd = "python benchmarks/weighted_ce.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    report = {
        "command": cmd.strip(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": str(device), "machine": machine(device),
        "config": {"tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "dtype": args.dtype,
                   "alpha": args.alpha, "chunk_rows": chunk, "rounds": args.rounds, "backward": "hidden states"},
        "method": ("forward + backward per call; peak = rise of resident memory during the call (VmHWM reset via "
                   "/proc/self/clear_refs, minus VmRSS before; glibc mmap threshold fixed at 64 KiB: "
                   f"{fixed_mmap}) on CPU, torch.cuda.max_memory_allocated on CUDA; "
                   "time = median over rounds, variants alternating within a round"),
        "analytic_bytes": {"naive_logits": args.tokens * args.vocab * itemsize,
                           "naive_logits_fp32": args.tokens * args.vocab * 4,
                           "fused_chunk_fp32": min(chunk, args.tokens) * args.vocab * 4},
        "results": results, "ratios": ratios,
        "agreement": {"loss_abs_diff": abs(loss_f.item() - loss_n.item()),
                      "grad_rel_diff": ((grad_f.double() - grad_n.double()).norm() / grad_n.double().norm()).item()},
        "targets": {**TARGETS, "memory_met": ratios["memory"] <= TARGETS["memory_ratio_max"],
                    "time_met": ratios["time"] <= TARGETS["time_ratio_max"]},
    }
    gib = 2**30
    print(f"{'variant':<8} {'median s':>10} {'peak GiB':>10}")
    for r in results:
        print(f"{r['variant']:<8} {r['median_s']:>10.3f} {r['peak_bytes'] / gib:>10.3f}")
    met = report["targets"]
    print(f"fused / naive: memory {ratios['memory']:.3f} (target <= {TARGETS['memory_ratio_max']}: "
          f"{_verdict(met['memory_met'])}), time {ratios['time']:.3f} (target <= {TARGETS['time_ratio_max']}: "
          f"{_verdict(met['time_met'])}); "
          f"tokens {args.tokens}, vocab {args.vocab}, hidden {args.hidden}, {args.dtype}, chunk {chunk} rows, {device}")
    out_dir = args.out or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"weighted_ce_{device.type}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    missed = [k for k in ("memory", "time") if not met[f"{k}_met"]]
    if missed:  # a benchmark that misses its own target says so, last, where it is read
        print(f"TARGET MISSED: {' and '.join(missed)} (see the targets above)")
    return report


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


if __name__ == "__main__":
    main()
