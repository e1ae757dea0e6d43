"""What the GPU lane's stages check on their outputs (tests/gpu/run_lane.sh), as functions a CPU test runs on
a CPU run's outputs too (tests/lanes/test_gpu_lane_cpu.py).

    python tests/gpu/lane_checks.py grpo RUN_DIR                 # the grpo stage's run
    python tests/gpu/lane_checks.py bench JSON [--missed FILE]   # the bench stage's results

Each check raises AssertionError saying what is wrong, and returns one line saying what it saw.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EVAL_LAYOUT = ("eval/height", "eval/width")  # the evaluation's image size: the same whatever the weights


def _rows(run: Path) -> list[dict]:
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def ema_updates_before_evals(cfg: dict, rows: list[dict]) -> list[tuple[int, int, int]]:
    """(epoch, optimizer steps, EMA updates) before each evaluation the run logged: an evaluation at epoch e
    runs before that epoch trains, after the optimizer steps the epochs before it made (their last
    `global_step`). Without an EMA every optimizer step counts as an update of the evaluated weights."""
    ema = cfg["train"].get("ema") or {}
    interval = int(ema.get("update_interval", 1)) if ema.get("enabled", True) else 1
    out = []
    for r in rows:
        if not any(k.startswith("eval/") for k in r):
            continue
        steps = max((int(t["global_step"]) for t in rows if "train/loss" in t and t["epoch"] < r["epoch"]), default=0)
        out.append((r["epoch"], steps, steps // interval))
    return out


def planned_ema_updates(cfg: dict) -> list[tuple[int, int, int]]:
    """The same from the recipe alone (its epochs, optimizer steps per epoch, eval_freq and EMA interval):
    what a run of it will evaluate, for a check of the recipe before any run."""
    train, ema = cfg["train"], cfg["train"].get("ema") or {}
    per_epoch = int(train.get("optimizer_steps_per_epoch", 1)) * int(train.get("num_inner_epochs", 1))
    interval = int(ema.get("update_interval", 1)) if ema.get("enabled", True) else 1
    freq = int(cfg["test"].get("eval_freq") or 0)
    if not freq:
        return []
    return [(e, e * per_epoch, e * per_epoch // interval) for e in range(0, int(train["num_epochs"]) + 1)
            if e % freq == 0]


def check_evaluations(cfg: dict, rows: list[dict], every_eval_after_an_update: bool) -> str:
    """The evaluation changed once the weights it uses (the EMA when enabled) were updated: every evaluation
    after at least one update differs from the first (before any); with `every_eval_after_an_update` each
    evaluation after the first must come after an update (one that cannot change is wasted time)."""
    evals = {r["epoch"]: {k: v for k, v in r.items() if k.startswith("eval/") and k not in EVAL_LAYOUT}
             for r in rows if any(k.startswith("eval/") for k in r)}
    plan = ema_updates_before_evals(cfg, rows)
    assert plan, "no evaluation logged"
    first_epoch, _, first_updates = plan[0]
    assert first_updates == 0, f"the first evaluation (epoch {first_epoch}) came after {first_updates} EMA updates"
    bad = [k for k, v in evals[first_epoch].items() if not _finite(v)]
    assert not bad, f"non-finite evaluation metrics at epoch {first_epoch}: {bad}"
    interval = (cfg["train"].get("ema") or {}).get("update_interval")
    updated = []
    for epoch, steps, updates in plan[1:]:
        if updates == 0:
            assert not every_eval_after_an_update, (
                f"the evaluation at epoch {epoch} came after {steps} optimizer steps and no EMA update "
                f"(train.ema.update_interval {interval}): it can only repeat epoch {first_epoch}'s")
            continue
        same = evals[epoch] == evals[first_epoch]
        assert not same, (f"the evaluation at epoch {epoch} (after {steps} optimizer steps, {updates} EMA updates) "
                          f"is identical to epoch {first_epoch}'s: {evals[epoch]}")
        updated.append(epoch)
    assert updated, (f"no evaluation came after an EMA update (evaluations at epochs {[p[0] for p in plan]}, "
                     f"train.ema.update_interval {interval}): nothing shows the evaluated weights changed")
    key = next((k for k in evals[first_epoch] if k.endswith("/mean")), None)
    seen = ", ".join(f"epoch {e} {evals[e].get(key, float('nan')):.6g}" for e in [first_epoch, *updated])
    return f"evaluations after EMA updates differ from epoch {first_epoch}'s ({key}: {seen})"


def check_adapter_changed(run: Path, cfg: dict) -> str:
    """The adapter (LoRA) weights the optimizer trains changed: the first and the last checkpoint's trained
    tensors (DeepSpeed's own reader, every rank's shards) are finite and differ, and where the adapter
    started from zero B matrices (no model.lora.path), the first checkpoint's are no longer all zero."""
    from paco_ds.grpo.export import trained_state

    ckpts = sorted(p for p in (run / "checkpoints").iterdir() if p.is_dir() and (p / "meta.json").is_file()
                   and not p.name.startswith(".")) if (run / "checkpoints").is_dir() else []
    assert len(ckpts) >= 2, f"{run / 'checkpoints'}: {len(ckpts)} checkpoints, need 2 to compare the adapter"
    first, last = ckpts[0], ckpts[-1]
    a, b = trained_state(first), trained_state(last)
    assert a and list(a) == list(b), f"{first.name} and {last.name} do not hold the same LoRA tensors"
    bad = [k for k, t in {**a, **b}.items() if not bool(t.isfinite().all())]
    assert not bad, f"non-finite LoRA weights: {bad[:3]}"
    diff = {k: float((a[k].detach().float() - b[k].detach().float()).abs().max()) for k in a}
    changed = [k for k, d in diff.items() if d > 0]
    steps = [json.loads((c / "meta.json").read_text()).get("global_step") for c in (first, last)]
    assert changed, (f"the adapter did not change between {first.name} (step {steps[0]}) and {last.name} "
                     f"(step {steps[1]}): {len(a)} LoRA tensors identical")
    if not (cfg["model"].get("lora") or {}).get("path"):
        moved = [k for k, t in a.items() if "lora_B" in k and bool(t.detach().abs().max() > 0)]
        assert moved, f"{first.name}: every lora_B is still zero, as at init: the optimizer never moved the adapter"
    return (f"adapter changed: {len(changed)} of {len(a)} LoRA tensors differ between {first.name} (step {steps[0]}) "
            f"and {last.name} (step {steps[1]}), max |diff| {max(diff.values()):.3g}")


def check_grpo_run(run: Path, gpu: bool = True, every_eval_after_an_update: bool = True) -> str:
    """The grpo stage's run trained the policy: every epoch logged a finite loss and gradient norm with no
    skipped optimizer step (on the GPU: Triton kernels, bf16), the adapter changed, and the evaluation
    changed once the EMA updated."""
    import yaml

    run = Path(run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    rows = _rows(run)
    train = [r for r in rows if "train/loss" in r]
    epochs = cfg["train"]["num_epochs"]
    if gpu:
        assert cfg["kernels"]["backend"] == "triton" and cfg["model"]["dtype"] == "bf16", (
            f"the GPU stage runs the Triton kernels in bf16: kernels.backend {cfg['kernels']['backend']}, "
            f"model.dtype {cfg['model']['dtype']}")
    assert len(train) == epochs, f"{len(train)} epochs logged a loss, want {epochs}"
    bad = [r["epoch"] for r in train if not isinstance(r["train/loss"], float) or not math.isfinite(r["train/loss"])]
    assert not bad, f"non-finite loss at epochs {bad}"
    assert all(r.get("train/nonfinite_steps", 0) == 0 for r in train), "non-finite micro-steps"
    # A step whose gradient norm is not finite is skipped by ZeRO-3, and a run whose every step was skipped
    # still logs finite losses (seen on an H100: grad_norm null throughout).
    skipped = [r["epoch"] for r in train if r.get("train/skipped_optimizer_steps", 0) > 0
               or not isinstance(r.get("train/grad_norm"), float) or not math.isfinite(r["train/grad_norm"])]
    assert not skipped, f"optimizer steps skipped (non-finite gradient norm) at epochs {skipped}"
    adapter = check_adapter_changed(run, cfg)
    evals = check_evaluations(cfg, rows, every_eval_after_an_update)
    losses = [round(r["train/loss"], 6) for r in train]
    return f"{len(train)} epochs, losses {losses}; {adapter}; {evals}"


def check_bench(path: Path, ops=None) -> tuple[str, list[str]]:
    """The bench stage's JSON has a Triton column for every op (of `ops`, default all); returns its targets
    line (each op's target: kernels/bench/__init__.py OP_TARGETS) and the ops that missed theirs."""
    sys.path.insert(0, str(REPO))
    from kernels.bench import OPS, op_targets, targets_line

    rep = json.loads(Path(path).read_text())
    rows = [r for r in rep["results"] if r["backend"] == "triton"]
    missing = sorted(set(OPS if ops is None else ops) - {r["op"] for r in rows})
    assert not missing, f"no triton column for {missing}"
    targets = rep.get("op_targets") or op_targets(rep["results"])
    missed = [op for op, t in targets.items() if t["status"] == "missed"]
    return f"{len(rows)} triton rows; {targets_line(targets)}", missed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tests/gpu/lane_checks.py")
    sub = ap.add_subparsers(dest="stage", required=True)
    g = sub.add_parser("grpo")
    g.add_argument("run", type=Path)
    b = sub.add_parser("bench")
    b.add_argument("json", type=Path)
    b.add_argument("--missed", type=Path, help="write the targets line here when an op missed its target")
    args = ap.parse_args(argv)
    try:
        if args.stage == "grpo":
            print(check_grpo_run(args.run))
        else:
            line, missed = check_bench(args.json)
            print(line)
            if missed and args.missed:
                args.missed.write_text(line.split("; ", 1)[1] + "\n")
    except AssertionError as err:
        print(f"{args.stage} check failed: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
