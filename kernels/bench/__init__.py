"""Microbenchmarks of the fused ops: `python -m kernels.bench [--quick]` (see __main__.py; the
benchmark itself is run.py).

Results of the runs committed with the project are in kernels/bench/results/<device>.json and .png.
"""
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SDE_OPS = ("sde_fwd", "sde_fwd_bwd", "sde_sample", "kl_fwd_bwd", "sde_kl_fwd_bwd")
OPS = SDE_OPS + ("grpo_advantages", "ppo_fwd_bwd")

# Each op's target, in one place: its fused kernel (Triton on CUDA, C++ on CPU) takes at most the time of
# eager torch, i.e. a speed-up over eager torch of at least this figure, at every shape the benchmark
# times. A kernel that misses it costs more there than the torch code it replaces.
OP_TARGETS = {op: 1.0 for op in OPS}
FUSED = ("triton", "cpp")


def target_met(row: dict) -> bool | None:
    """Whether a result row meets its op's target: None for a row that is not a fused kernel (torch,
    torch.compile, or a fused backend that fell back to torch) and for an op without a target."""
    if row["backend"] not in FUSED or row.get("runs", row["backend"]) != row["backend"] or row["op"] not in OP_TARGETS:
        return None
    return row["speedup_vs_eager"] is not None and row["speedup_vs_eager"] >= OP_TARGETS[row["op"]]


def op_targets(rows: list[dict]) -> dict[str, dict]:
    """Per op: its target, how many of its fused rows meet it, the worst speed-up, and "met", "missed" or
    "no fused kernel here" (an op whose every shape meets the target is met)."""
    out = {}
    for op in dict.fromkeys(r["op"] for r in rows if r["op"] in OP_TARGETS):  # (an op of an older benchmark: none)
        fused = [r for r in rows if r["op"] == op and target_met(r) is not None]
        entry = {"target": f">= {OP_TARGETS[op]:.1f}x eager torch at every shape",
                 "min_speedup_vs_eager": OP_TARGETS[op], "backend": None, "rows": len(fused),
                 "rows_met": sum(bool(target_met(r)) for r in fused), "worst_speedup_vs_eager": None,
                 "status": "no fused kernel here"}
        if fused:
            entry["backend"] = "/".join(dict.fromkeys(r["backend"] for r in fused))
            entry["worst_speedup_vs_eager"] = round(min(r["speedup_vs_eager"] or 0.0 for r in fused), 3)
            entry["status"] = "met" if entry["rows_met"] == len(fused) else "missed"
        out[op] = entry
    return out


def targets_line(targets: dict[str, dict]) -> str:
    """One line: how many ops with a fused kernel here met their target, naming those that missed."""
    judged = {op: t for op, t in targets.items() if t["status"] != "no fused kernel here"}
    missed = [op for op, t in judged.items() if t["status"] == "missed"]
    if not missed:
        return f"all {len(judged)} op targets met"
    return f"{len(missed)} of {len(judged)} op targets missed ({', '.join(missed)})"
