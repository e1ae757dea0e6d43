"""The benchmark itself, imported by __main__.py once the command line is parsed (it imports torch)."""
from __future__ import annotations

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

import kernels
from kernels.bench import OP_TARGETS, SDE_OPS, op_targets, target_met, targets_line
from kernels.bench.source import source_state
from kernels.grpo import ppo_clip_loss_torch as ppo_ref
from kernels.sde_reference import kl_to_reference as kl_ref, sde_step as sde_ref, sde_step_kl as sde_kl_ref

C = 64  # FLUX packed latent channels
NOISE_LEVEL, SIGMA, SIGMA_NEXT = 0.7, 0.9441, 0.8825  # step 1 of FLUX's 512 px, 10-step schedule
KERNEL_OP = {"sde_fwd": "sde_step", "sde_fwd_bwd": "sde_step", "sde_sample": "sde_step",  # bench op -> kernels op
             "kl_fwd_bwd": "kl_to_reference", "sde_kl_fwd_bwd": "sde_step_kl", "grpo_advantages": "grpo_advantages",
             "ppo_fwd_bwd": "ppo_clip_loss"}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ------------------------------------------------------------------------------------------ timing
def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache (sysfs), to size the buffer that flushes it between timed calls."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        m = re.fullmatch(r"(\d+)([KMG]?)", f.read_text().strip())
        if m:
            sizes.append(int(m[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[m[2]])
    return max(sizes, default=default)


class Timer:
    """Median wall time of fn, each call starting with cold caches, as a training step finds them
    (the previous step streamed gigabytes through): on CUDA Triton's `do_bench` (CUDA events, L2
    cleared before each call); on CPU a buffer of twice the last-level cache is written before each
    call. Warm-up calls (compiles, caches) are not timed."""

    def __init__(self, device: torch.device, min_time: float, min_reps: int, max_reps: int):
        self.cuda = device.type == "cuda"
        self.min_time, self.min_reps, self.max_reps = min_time, min_reps, max_reps
        self.cache_bytes = 0 if self.cuda else last_level_cache_bytes()
        self._flush = None if self.cuda else torch.empty(2 * self.cache_bytes // 4, dtype=torch.float32)

    def samples(self, fn) -> list[float]:
        if self.cuda:
            from triton.testing import do_bench

            ms = do_bench(fn, warmup=0, rep=max(1, int(self.min_time * 1e3)), return_mode="all")
            return [t / 1e3 for t in ms[:self.max_reps]]
        out: list[float] = []
        start = time.perf_counter()
        while len(out) < self.max_reps and (len(out) < self.min_reps or time.perf_counter() - start < self.min_time):
            self._flush.zero_()  # evict fn's inputs: the call reads them from memory
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    def warm(self, fn, calls: int = 2) -> None:
        for _ in range(calls):
            fn()
        if self.cuda:
            torch.cuda.synchronize()


def side_by_side(timer: Timer, fns: dict, rounds: int) -> dict[str, float]:
    """Median seconds per backend; the backends alternate within each round."""
    for fn in fns.values():
        timer.warm(fn)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name] += timer.samples(fn)
    return {name: statistics.median(s) for name, s in samples.items()}


def copy_bandwidth(timer: Timer, device: torch.device, nbytes: int) -> float:
    """GB/s of dst.copy_(src) on one buffer of nbytes (it reads and writes nbytes each)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = side_by_side(timer, {"copy": lambda: dst.copy_(src)}, rounds=3)["copy"]
    return 2 * nbytes / t / 1e9


# ------------------------------------------------------------------------------------------ cases
def sde_case(op: str, b: int, px: int, dtype, device, fused: list[str], compiled: dict | None):
    """(bytes moved at least, {backend: fn}) for one SDE/KL op at batch b and resolution px."""
    n = b * (px // 16) ** 2 * C
    e = torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator().manual_seed(0)
    shape = (b, (px // 16) ** 2, C)
    x, v, noise = (torch.randn(shape, generator=g).to(device, dtype) for _ in range(3))
    sig = torch.full((b,), SIGMA, device=device)
    sig_next = torch.full((b,), SIGMA_NEXT, device=device)
    prev = sde_ref(x, v, sig, sig_next, NOISE_LEVEL, sig, noise=noise).prev_sample
    vg = v.clone().requires_grad_(True)

    def score(backend):
        if backend == "torch":
            return lambda: sde_ref(x, v, sig, sig_next, NOISE_LEVEL, sig, prev_sample=prev).log_prob
        if backend == "torch.compile":
            return lambda: compiled["score"](x, v, sig, sig_next, prev)
        return lambda: kernels.sde_step(x, v, sig, sig_next, NOISE_LEVEL, sig, prev_sample=prev, backend=backend,
                                        return_mean=False).log_prob

    def fwd_bwd(backend):
        if backend == "torch":
            lp = lambda: sde_ref(x, vg, sig, sig_next, NOISE_LEVEL, sig, prev_sample=prev).log_prob  # noqa: E731
        elif backend == "torch.compile":
            lp = lambda: compiled["score"](x, vg, sig, sig_next, prev)  # noqa: E731
        else:
            lp = lambda: kernels.sde_step(x, vg, sig, sig_next, NOISE_LEVEL, sig, prev_sample=prev,  # noqa: E731
                                          backend=backend, return_mean=False).log_prob

        def run():
            vg.grad = None
            lp().sum().backward()
        return run

    def sample(backend):
        if backend == "torch":
            return lambda: sde_ref(x, v, sig, sig_next, NOISE_LEVEL, sig, noise=noise).prev_sample
        if backend == "torch.compile":
            return lambda: compiled["sample"](x, v, sig, sig_next, noise)
        return lambda: kernels.sde_step(x, v, sig, sig_next, NOISE_LEVEL, sig, noise=noise, backend=backend,
                                        return_mean=False).prev_sample

    def kl(backend):
        m = torch.randn(shape, generator=g).to(device).requires_grad_(True)
        mr = torch.randn(shape, generator=g).to(device)
        std = torch.full((b,), 2.9, device=device)
        call = {"torch": lambda: kl_ref(m, mr, std),
                "torch.compile": lambda: compiled["kl"](m, mr, std)}.get(
            backend, lambda: kernels.kl_to_reference(m, mr, std, backend=backend))

        def run():
            m.grad = None
            call().sum().backward()
        return run

    vr = (v.float() + 0.05 * torch.randn(shape, generator=g).to(device)).to(dtype)

    def score_kl(backend):
        # the training step with train.kl_beta > 0: log-prob and KL to the reference velocity, backward to v
        if backend.endswith(" unfused"):  # the same backend's kernels as the loss ran them before the fused op
            return score_kl_unfused(backend.split()[0])
        call = {"torch": lambda: _lp_plus_kl(sde_kl_ref(x, vg, vr, sig, sig_next, NOISE_LEVEL, sig, prev_sample=prev)),
                "torch.compile": lambda: compiled["score_kl"](x, vg, vr, sig, sig_next, prev)}.get(
            backend, lambda: _lp_plus_kl(kernels.sde_step_kl(x, vg, vr, sig, sig_next, NOISE_LEVEL, sig,
                                                             prev_sample=prev, backend=backend)))

        def run():
            vg.grad = None
            call().sum().backward()
        return run

    def score_kl_unfused(backend):
        def run():
            vg.grad = None
            step = kernels.sde_step(x, vg, sig, sig_next, NOISE_LEVEL, sig, prev_sample=prev, backend=backend)
            with torch.no_grad():
                ref = kernels.sde_step(x, vr, sig, sig_next, NOISE_LEVEL, sig, prev_sample=prev, backend=backend)
            kl = kernels.kl_to_reference(step.mean, ref.mean, step.std, backend=backend)
            (step.log_prob + kl).sum().backward()
        return run

    backends = ["torch"] + (["torch.compile"] if compiled else []) + fused
    if op == "sde_kl_fwd_bwd":
        backends += [f"{b} unfused" for b in fused]
    make, nbytes = {"sde_fwd": (score, 3 * n * e), "sde_fwd_bwd": (fwd_bwd, 7 * n * e),
                    "sde_sample": (sample, 4 * n * e), "kl_fwd_bwd": (kl, 5 * n * 4),
                    "sde_kl_fwd_bwd": (score_kl, 9 * n * e)}[op]
    with torch.set_grad_enabled(op.endswith("bwd")):
        return nbytes, {name: _no_grad_unless(op, make(name)) for name in backends}


def _lp_plus_kl(out):
    step, kl = out
    return step.log_prob + kl


def _no_grad_unless(op: str, fn):
    if op.endswith("bwd"):
        return fn

    def run():
        with torch.no_grad():
            return fn()
    return run


def advantage_case(k: int, m: int, log_tame, global_std: bool, device, triton: bool):
    """`kernels.grpo_advantages` of an epoch of m prompts x k images with 3 rewards (fp64 on the
    device): the torch reference, and Triton on CUDA. The trainer's whole advantage step around it
    (aggregation, masking, group statistics) is benchmarks/advantage_step.py."""
    g = torch.Generator().manual_seed(0)
    n = k * m
    rewards = torch.rand(3, n, generator=g, dtype=torch.float64).to(device)
    ids = torch.arange(m).repeat_interleave(k)[torch.randperm(n, generator=g)].to(device)
    weights = torch.tensor([0.2, 1.0, 1.0], dtype=torch.float64)
    backends = ["torch"] + (["triton"] if triton else [])
    fns = {b: (lambda b=b: kernels.grpo_advantages(rewards, weights, ids, log_tame=log_tame, global_std=global_std,
                                                   backend=b)) for b in backends}
    return 3 * n * 8 + n * 8 + 2 * n * 8, fns


def ppo_case(b: int, device, triton: bool, compiled: dict | None):
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(b, generator=g) * 1e-4).to(device).requires_grad_(True)
    old, adv = (torch.randn(b, generator=g) * 1e-4).to(device), torch.randn(b, generator=g).to(device)

    def wrap(call):
        def run():
            lp.grad = None
            call()[0].backward()
        return run

    fns = {"torch": wrap(lambda: ppo_ref(lp, old, adv, 1e-4, 5.0))}
    if compiled:
        fns["torch.compile"] = wrap(lambda: compiled["ppo"](lp, old, adv))
    if triton:
        fns["triton"] = wrap(lambda: kernels.ppo_clip_loss(lp, old, adv, 1e-4, 5.0, backend="triton"))
    return 4 * b * 4, fns


def compiled_refs() -> dict:
    dyn = dict(dynamic=True)
    return {
        "score": torch.compile(lambda x, v, s, sn, prev: sde_ref(x, v, s, sn, NOISE_LEVEL, s,
                                                                  prev_sample=prev).log_prob, **dyn),
        "sample": torch.compile(lambda x, v, s, sn, noise: sde_ref(x, v, s, sn, NOISE_LEVEL, s,
                                                                   noise=noise).prev_sample, **dyn),
        "kl": torch.compile(kl_ref, **dyn),
        "score_kl": torch.compile(lambda x, v, vr, s, sn, prev: _lp_plus_kl(sde_kl_ref(x, v, vr, s, sn, NOISE_LEVEL, s,
                                                                                   prev_sample=prev)), **dyn),
        "ppo": torch.compile(lambda lp, old, adv: ppo_ref(lp, old, adv, 1e-4, 5.0), **dyn),
    }


# ------------------------------------------------------------------------------------------ report
def machine(device: torch.device) -> dict:
    info = {"device": device.type, "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "cpu_model": _cpu_model(),
            "load_average_at_start": os.getloadavg()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                    compute_capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda)
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def device_slug(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def print_table(rows: list[dict]) -> None:
    head = (f"{'op':<14} {'shape':<30} {'backend':<14} {'median ms':>10} {'GB/s':>8} {'% copy':>7} {'vs eager':>9} "
            f"{'target':>7}")
    print(head)
    print("-" * len(head))
    last = None
    for r in rows:
        key = (r["op"], r["shape"])
        if last is not None and key[0] != last[0]:
            print()
        speed = f"{r['speedup_vs_eager']:.2f}x" if r["speedup_vs_eager"] is not None else "-"
        label = r["backend"] if r["runs"] == r["backend"] else f"{r['backend']}->{r['runs']}"
        met = {True: "met", False: "MISSED", None: ""}[target_met(r)]
        print(f"{r['op'] if key != last else '':<14} {r['shape'] if key != last else '':<30} {label:<14} "
              f"{r['median_ms']:>10.4f} {r['gbs']:>8.1f} {r['pct_copy']:>6.0f}%{'*' if 'note' in r else ' '}{speed:>8} "
              f"{met:>7}")
        last = key
    notes = list(dict.fromkeys(r["note"] for r in rows if "note" in r))
    if notes:
        print("\n* " + "\n* ".join(notes))
    if any(r["op"] == "grpo_advantages" for r in rows):
        print("\n(grpo_advantages: k x m samples and 3 rewards; the trainer's whole advantage step is "
              "benchmarks/advantage_step.py)")


def print_op_targets(targets: dict[str, dict]) -> None:
    """Each op's target (kernels/bench/__init__.py OP_TARGETS) and whether its fused kernel met it."""
    print("\nop targets (the fused kernel against eager torch, at every shape timed; kernels.bench.OP_TARGETS):")
    for op, t in targets.items():
        if t["status"] == "no fused kernel here":
            print(f"  {op:<16} {t['target']:<36} -       no fused kernel here")
            continue
        verdict = "MISSED" if t["status"] == "missed" else "met"
        print(f"  {op:<16} {t['target']:<36} {t['backend']:<7} {verdict:<7}"
              f"{t['rows_met']}/{t['rows']} shapes, worst {t['worst_speedup_vs_eager']:.3g}x")
    print(f"targets: {targets_line(targets)}")


def plot(path: Path, rows: list[dict], curve: list[dict], copy_gbs: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in SDE_OPS if any(r["op"] == op for r in rows)] or ["copy"]  # at least the copy curve
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 3.8), squeeze=False)
    for ax, op in zip(axes[0], ops):
        ax.plot([c["bytes"] for c in curve], [c["gbs"] for c in curve], color="0.6", marker=".", label="copy")
        ax.axhline(copy_gbs, color="0.6", linestyle="--", linewidth=0.8)
        for backend in dict.fromkeys(r["backend"] for r in rows if r["op"] == op):
            pts = sorted((r["bytes"], r["gbs"]) for r in rows if r["op"] == op and r["backend"] == backend)
            ax.plot(*zip(*pts), marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes moved per call")
        ax.set_title(op)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("achieved GB/s")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def targets(rows: list[dict], device: torch.device) -> dict:
    """The acceptance targets of the fused log-prob (fwd+bwd at 512 px latents)."""
    fused = "triton" if device.type == "cuda" else "cpp"
    sel = [r for r in rows if r["op"] == "sde_fwd_bwd" and r["px"] == 512 and r["backend"] == r["runs"] == fused]
    if not sel:
        return {}
    out = {"backend": fused, "speedup_vs_eager_by_batch": {r["batch"]: round(r["speedup_vs_eager"], 2) for r in sel},
           "pct_copy_by_batch": {r["batch"]: round(r["pct_copy"], 1) for r in sel}}
    if device.type == "cuda":
        out["target"] = "triton fwd+bwd >= 80% of copy bandwidth and >= 3x eager torch"
        out["met"] = all(r["pct_copy"] >= 80 and r["speedup_vs_eager"] >= 3 for r in sel)
    else:
        out["target"] = "cpp fwd+bwd >= 3x eager torch"
        out["met"] = all(r["speedup_vs_eager"] >= 3 for r in sel)
    return out


# ------------------------------------------------------------------------------------------ main
def print_aot_table() -> None:
    """The compiled kernels' resources per GPU arch, as committed (see kernels/aot.py)."""
    from kernels import aot

    text = aot.read_tables()
    print("\nTriton kernels compiled ahead of time (worst configuration per kernel; `python -m kernels.aot`):\n"
          + (text or "no kernels/bench/results/aot_sm*.json: run `python -m kernels.aot`"))


def run(args, argv=None) -> int:
    """The benchmark of parsed arguments `args` (see __main__.py); `argv`: the command line, recorded."""
    ops = [o for o in args.ops.split(",") if o]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype]
    pxs, batches = ((512,), (1, 4)) if args.quick else ((256, 512, 1024), (1, 4, 16))
    groups = ((16, 42),) if args.quick else ((8, 8), (16, 42), (24, 48), (16, 512))
    ppo_batches = (16,) if args.quick else (16, 672)
    use_compile = not (args.quick or args.no_compile)
    rounds = 2 if args.quick else 3
    timer = Timer(device, min_time=0.05, min_reps=3, max_reps=200)
    t_start = time.perf_counter()

    fused = [b for b in kernels.available_backends(device) if b != "torch" and (b != "triton" or device.type == "cuda")]
    triton = "triton" in fused
    compiled = compiled_refs() if use_compile else None

    large = (1 << 30) if device.type == "cuda" else (1 << 28)
    copy_gbs = copy_bandwidth(timer, device, large)
    curve = [{"bytes": 2 * s, "gbs": copy_bandwidth(timer, device, s)} for s in (1 << k for k in range(16, 29, 2))]
    print(f"device: {device_slug(device)}  ({_cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads)")
    print(f"copy bandwidth: {copy_gbs:.1f} GB/s (dst.copy_(src) of {large >> 20} MiB); fused backends: "
          f"{', '.join(fused) or 'none'}; torch.compile: {'yes' if compiled else 'no'}\n")

    rows = []

    def record(op, shape, extra, nbytes, times, baseline="torch"):
        base = times.get(baseline)
        for backend, t in times.items():
            gbs = nbytes / t / 1e9
            runs = kernels.active_backend(KERNEL_OP[op], device, backend) if backend in ("cpp", "triton") else backend
            row = {"op": op, "shape": shape, **extra, "backend": backend, "runs": runs, "median_ms": t * 1e3,
                   "bytes": nbytes, "gbs": gbs, "pct_copy": 100 * gbs / copy_gbs,
                   "speedup_vs_eager": base / t if base else None, "baseline": baseline}
            met = target_met(row)
            if met is not None:
                row |= {"target_speedup_vs_eager": OP_TARGETS[op], "target_met": met}
            if row["pct_copy"] > 100:  # the caches were flushed before the call: say what explains it
                row["note"] = (f"above the copy bandwidth: the backward re-reads the forward's inputs, counted twice "
                               f"in the bytes model, and part of them is still in the {timer.cache_bytes >> 20} MiB "
                               "cache" if "bwd" in op else
                               "above the copy bandwidth: the bytes model counts more than the call moves")
            rows.append(row)

    for op in [o for o in ops if o in SDE_OPS]:
        for px in pxs:
            for b in batches:
                nbytes, fns = sde_case(op, b, px, dtype, device, fused, compiled)
                dt = args.dtype if op != "kl_fwd_bwd" else "fp32"
                record(op, f"B={b} L={(px // 16) ** 2} C={C} {dt}", {"px": px, "batch": b, "dtype": dt}, nbytes,
                       side_by_side(timer, fns, rounds))
    if "grpo_advantages" in ops:
        for k, m in groups:
            for log_tame, global_std in (("mean", True), (None, False))[:1 if args.quick else 2]:
                nbytes, fns = advantage_case(k, m, log_tame, global_std, device, triton)
                tame = f"log-tame {log_tame}" if log_tame else "no tame"
                std = "global" if global_std else "group"
                record("grpo_advantages", f"{k}x{m} {tame} {std}-std",
                       {"group_size": k, "groups": m, "log_tame": log_tame, "global_std": global_std}, nbytes,
                       side_by_side(timer, fns, rounds))
    if "ppo_fwd_bwd" in ops:
        for b in ppo_batches:
            nbytes, fns = ppo_case(b, device, triton, compiled)
            record("ppo_fwd_bwd", f"B={b}", {"batch": b}, nbytes, side_by_side(timer, fns, rounds))

    print_table(rows)
    targets_by_op = op_targets(rows)
    print_op_targets(targets_by_op)
    print_aot_table()
    slug = device_slug(device)
    env = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    command = " ".join([f"{env}python -m kernels.bench", *(sys.argv[1:] if argv is None else argv)])
    report = {"command": command,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(device),
              "copy_bandwidth_gbs": copy_gbs, "copy_bytes": 2 * large, "copy_curve": curve,
              "timing": {"method": "triton.testing.do_bench (L2 cleared per call)" if device.type == "cuda" else
                         "perf_counter, caches flushed before each call", "cache_flush_bytes": 2 * timer.cache_bytes},
              "bytes_model": {"sde_fwd": "read x, v, x'", "sde_fwd_bwd": "fwd reads x, v, x'; bwd reads them again "
                              "and writes dv", "sde_sample": "read x, v, noise; write x'",
                              "kl_fwd_bwd": "fp32 means: fwd reads 2, bwd reads 2 and writes 1",
                              "sde_kl_fwd_bwd": "fwd reads x, v, v_ref, x'; bwd reads them again and writes dv",
                              "grpo_advantages": "read rewards [3, N] fp64 and ids, write 2 x [N] fp64",
                              "ppo_fwd_bwd": "read 3 x [B], write [B] grad"},
              "targets": targets(rows, device), "op_targets": targets_by_op,
              "op_targets_missed": [op for op, t in targets_by_op.items() if t["status"] == "missed"],
              "source": source_state(), "seconds": round(time.perf_counter() - t_start, 1), "results": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{slug}.json").write_text(json.dumps(report, indent=1))
    title = (f"{slug}: {report['machine']['cpu_model'] if device.type == 'cpu' else report['machine'].get('gpu')}, "
             f"copy {copy_gbs:.1f} GB/s, {args.dtype} latents")
    plot(args.out / f"{slug}.png", rows, curve, copy_gbs, title)
    if report["targets"]:
        tg = report["targets"]
        print(f"\ntarget ({tg['target']}): {'met' if tg['met'] else 'NOT met'}; speed-up by batch "
              f"{tg['speedup_vs_eager_by_batch']}, % copy {tg['pct_copy_by_batch']}")
    print(f"wrote {args.out / (slug + '.json')} and .png in {report['seconds']:.0f} s")
    return 0

