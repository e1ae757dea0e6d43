#!/usr/bin/env bash
# The GPU lane (`make test-gpu`): everything the project checks on one CUDA GPU, in one command, on a
# bare machine with no network. Stages, each with its log in tests/gpu/results/<stage>.log:
#   deps       install the wheels of .whl/ that the interpreter lacks (tests/gpu/bundle.py), into an
#              overlay folder put on PYTHONPATH; torch, triton and transformers are never touched
#   pytest     pytest tests/gpu: the Triton kernels against float64 references, fwd+bwd, fp32/bf16
#   bench      python -m kernels.bench: kernels/bench/results/<gpu>.json with the triton columns
#   grpo       a tiny GRPO run under the DeepSpeed launcher on 1 GPU (NCCL, bf16, Triton kernels,
#              the judge on the hf engine on the GPU): configs/tiny/t2is_gpu.yaml
#   compile    benchmarks/compile_blocks.py --device cuda: model.compile's regional compile of the
#              reduced full-width FLUX at 512 px, bf16, eager vs compiled
#   reference  benchmarks/grpo_vs_reference.py --device cuda
# A failing stage does not stop the others; the summary (results/summary.json) says which passed,
# and the exit status is non-zero if any failed. Without a CUDA GPU it runs nothing and exits 2.
#
# Environment: GPU_PYTHON (default python3: the interpreter that holds torch), LANE_STAGES (default
# all, in the order above; each stage runs alone too, e.g. LANE_STAGES=grpo), LANE_BUDGET_S (seconds
# for the whole lane, default 540: one 10-minute device call with room to copy results back; 0 = no
# limit; each stage gets at most what is left), LANE_BENCH_ARGS (default --no-compile; "" for the torch.compile column too),
# LANE_SITE (overlay folder, default /tmp/paco_ds_gpu_site), LANE_PORT (default 29531).
# When OUT is set (the workplace's device runner), the summary, junit xml, bench json, metrics and a
# tarball of the logs are copied there after every stage.
set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
PY=${GPU_PYTHON:-python3}
RES=$REPO/tests/gpu/results
SITE=${LANE_SITE:-/tmp/paco_ds_gpu_site}
STAGES=${LANE_STAGES:-deps pytest bench grpo compile reference}
BUDGET=${LANE_BUDGET_S:-540}
BENCH_ARGS=${LANE_BENCH_ARGS---no-compile}
START=$(date +%s)

# DeepSpeed on the GPU (the Makefile exports DS_ACCELERATOR=cpu for the CPU lanes), compiled Triton.
export DS_ACCELERATOR=cuda HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONWARNINGS=ignore::FutureWarning
unset TRITON_INTERPRET
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"

# Earlier stages' results stay (a stage run alone must not erase the others'): only the logs of the
# stages run now are started afresh.
mkdir -p "$RES"
for s in $STAGES; do rm -f "$RES/$s.log"; done
declare -A STATUS SECONDS_TAKEN NOTE

summary() {  # results/summary.json, and the files that come back through $OUT
    {
        printf '{\n "stages": {'
        local sep=""
        for s in $STAGES; do
            printf '%s\n  "%s": {"status": "%s", "seconds": %s, "log": "tests/gpu/results/%s.log", "note": "%s"}' \
                "$sep" "$s" "${STATUS[$s]:-not run}" "${SECONDS_TAKEN[$s]:-0}" "$s" "${NOTE[$s]:-}"
            sep=","
        done
        printf '\n },\n "machine": %s,\n "seconds": %s\n}\n' "$(cat "$RES/machine.json" 2>/dev/null || echo null)" \
            "$(( $(date +%s) - START ))"
    } > "$RES/summary.json"
    if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
        cp "$RES/summary.json" "$OUT/" 2>/dev/null
        for f in "$RES/pytest_gpu.xml" "$RES"/bench_*.json "$RES/metrics.jsonl" "$RES"/grpo_vs_reference_*.json \
                 "$RES"/compile_blocks_*.json; do
            [ -f "$f" ] && cp "$f" "$OUT/"
        done
        tar -czf "$OUT/logs.tar.gz" -C "$RES" $(cd "$RES" && ls *.log *.png machine.json 2>/dev/null) 2>/dev/null
    fi
}

left() {  # seconds a stage may take: what the budget leaves (at least 30), else 3600
    if [ "$BUDGET" -gt 0 ]; then
        local l=$(( BUDGET - ($(date +%s) - START) ))
        echo $(( l > 30 ? l : 30 ))
    else
        echo 3600
    fi
}

run_stage() {  # run_stage NAME FUNCTION: run it with a time limit, log to results/NAME.log
    local name=$1; shift
    local t0=$(date +%s) limit
    limit=$(left)
    echo "== $name (limit ${limit}s): $*"
    # timeout signals the stage's whole process group (launcher, ranks, judge server) when time is up
    timeout --kill-after=15 "$limit" bash -c "$*" > "$RES/$name.log" 2>&1
    local rc=$?
    [ -f "$RES/$name.note" ] && NOTE[$name]=$(cat "$RES/$name.note")
    SECONDS_TAKEN[$name]=$(( $(date +%s) - t0 ))
    if [ $rc -eq 0 ]; then STATUS[$name]=passed
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then STATUS[$name]=failed; NOTE[$name]="timed out after ${limit}s"
    else STATUS[$name]=failed; NOTE[$name]=${NOTE[$name]:-"exit status $rc"}; fi
    echo "   $name: ${STATUS[$name]} in ${SECONDS_TAKEN[$name]}s ${NOTE[$name]:-}"
    tail -n 5 "$RES/$name.log" | sed 's/^/   | /'
    summary
    return $rc
}

# ---------------------------------------------------------------------------------------- the GPU
"$PY" - > "$RES/machine.json" 2> "$RES/gpu.log" <<'EOF'
import json, sys
try:
    import torch
except ImportError as err:
    print(f"{sys.executable} cannot import torch ({err})", file=sys.stderr)
    sys.exit(4)
if not torch.cuda.is_available():
    print(f"{sys.executable} has torch {torch.__version__}, and torch.cuda.is_available() is False", file=sys.stderr)
    sys.exit(3)
import triton
p = torch.cuda.get_device_properties(0)
print(json.dumps({"gpu": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "capability": f"{p.major}.{p.minor}",
                  "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
                  "python": sys.version.split()[0], "executable": sys.executable,
                  "cudnn": torch.backends.cudnn.version()}))
EOF
rc=$?
if [ $rc -ne 0 ]; then
    rm -f "$RES/machine.json"
    echo "test-gpu: no CUDA GPU for the lane: $(tail -n 1 "$RES/gpu.log")."
    [ $rc -eq 4 ] && echo "test-gpu: GPU_PYTHON names the interpreter that holds torch (make test-gpu GPU_PYTHON=...)."
    echo "test-gpu: the lane needs a CUDA GPU, so nothing was run (the CPU tests are 'make test')."
    exit 2
fi
echo "GPU: $(cat "$RES/machine.json")"
SLUG=$("$PY" -c "import re, torch; print(re.sub(r'[^a-z0-9]+', '-', torch.cuda.get_device_name(0).lower()).strip('-'))")

# ---------------------------------------------------------------------------------------- stages
stage_deps() {
    if "$PY" -c "import deepspeed, diffusers, open_clip, openai, fastapi, uvicorn, pydantic" 2>/dev/null; then
        echo "every import of the project is there; nothing to install"
        return 0
    fi
    "$PY" tests/gpu/bundle.py install --dir .whl --target "$SITE" || return 1
    "$PY" -c "import deepspeed, diffusers, open_clip, openai, fastapi, uvicorn, pydantic, kernels, paco_ds.config; \
print('imports ok: deepspeed', deepspeed.__version__, 'from', deepspeed.__file__)"
}

stage_pytest() {
    "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu --junitxml="$RES/pytest_gpu.xml" || return 1
    # on a GPU, a skipped GPU test is a failure of the lane, except one whose optional package (flash-attn,
    # the `flash` extra) is not installed: its check says so in one line, and the lane lists it
    "$PY" - "$RES/pytest_gpu.xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
skips = [(c.get("name"), s.get("message", "")) for c in suite.iter("testcase") for s in c.findall("skipped")]
optional = [(name, m) for name, m in skips if "optional package not installed here" in m]
print("junit:", n)
for name, m in optional:
    print(f"skipped, optional package absent: {name}: {m}")
sys.exit(0 if n["tests"] > 0 and len(skips) == len(optional) and n["failures"] == n["errors"] == 0 else 1)
EOF
}

stage_bench() {
    # shellcheck disable=SC2086
    "$PY" -m kernels.bench --device cuda $BENCH_ARGS || return 1
    cp "kernels/bench/results/$SLUG.json" "$RES/bench_$SLUG.json" && cp "kernels/bench/results/$SLUG.png" "$RES/" 2>/dev/null
    "$PY" - "kernels/bench/results/$SLUG.json" <<'EOF'
import json, sys
from kernels.bench.__main__ import OPS
rep = json.load(open(sys.argv[1]))
rows = [r for r in rep["results"] if r["backend"] == "triton"]
missing = sorted(set(OPS) - {r["op"] for r in rows})
print(f"{sys.argv[1]}: {len(rows)} triton rows; target: {rep.get('targets')}")
if missing:
    sys.exit(f"no triton column for {missing}")
EOF
}

stage_grpo() {
    local run="$RES/runs/tiny_t2is_gpu"
    # NCCL_DEBUG=INFO: NCCL announces itself when the first collective builds its communicator
    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT "$PY" -m deepspeed.launcher.runner --num_gpus 1 --master_port "${LANE_PORT:-29531}" launch/train.py \
        --config configs/tiny/t2is_gpu.yaml --set "output_dir=$RES/runs" || return 1
    cp "$run/metrics.jsonl" "$RES/metrics.jsonl" 2>/dev/null
    "$PY" - "$run" <<'EOF'
import json, math, sys
from pathlib import Path
import yaml
run = Path(sys.argv[1])
cfg = yaml.safe_load((run / "config.yaml").read_text())
rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
train = [r for r in rows if "train/loss" in r]
epochs = cfg["train"]["num_epochs"]
assert cfg["kernels"]["backend"] == "triton" and cfg["model"]["dtype"] == "bf16", (cfg["kernels"], cfg["model"]["dtype"])
assert len(train) == epochs, f"{len(train)} epochs logged a loss, want {epochs}"
bad = [r["epoch"] for r in train if not isinstance(r["train/loss"], float) or not math.isfinite(r["train/loss"])]
assert not bad, f"non-finite loss at epochs {bad}"
assert all(r.get("train/nonfinite_steps", 0) == 0 for r in train), "non-finite micro-steps"
# The policy must have been trained: a step whose gradient norm is not finite is skipped by ZeRO-3, and
# a run whose every step was skipped still logs finite losses (seen on an H100: grad_norm null throughout).
skipped = [r["epoch"] for r in train if r.get("train/skipped_optimizer_steps", 0) > 0
           or not isinstance(r.get("train/grad_norm"), float) or not math.isfinite(r["train/grad_norm"])]
assert not skipped, f"optimizer steps skipped (non-finite gradient norm) at epochs {skipped}"
assert any(k.startswith("eval/") for r in rows for k in r), "no evaluation logged"
print(f"{len(train)} epochs, losses {[round(r['train/loss'], 6) for r in train]}, "
      f"reward/combined/mean {[round(r.get('reward/combined/mean', float('nan')), 4) for r in train]}")
EOF
    [ $? -eq 0 ] || return 1
    if grep -q "NCCL INFO" "$RES/grpo.log"; then echo "NCCL: $(grep -m1 -o 'NCCL version [^ ]*' "$RES/grpo.log")"
    else echo "no 'NCCL INFO' line in the log: the run did not use NCCL" | tee "$RES/grpo.note"; return 1; fi
}

stage_compile() {
    "$PY" benchmarks/compile_blocks.py --device cuda || return 1
    cp "benchmarks/results/compile_blocks_$SLUG.json" "$RES/"
}

stage_reference() {
    if [ ! -f benchmarks/grpo_vs_reference.py ]; then
        echo "benchmarks/grpo_vs_reference.py is missing" | tee "$RES/reference.note"
        return 1
    fi
    "$PY" benchmarks/grpo_vs_reference.py --device cuda --out "benchmarks/results/grpo_vs_reference_$SLUG.json" \
        || return 1
    cp "benchmarks/results/grpo_vs_reference_$SLUG.json" "$RES/"
}

export PY RES SITE SLUG BENCH_ARGS
export -f stage_deps stage_pytest stage_bench stage_grpo stage_compile stage_reference
FAILED=0
for s in $STAGES; do
    case $s in
        deps|pytest|bench|grpo|compile|reference) run_stage "$s" "stage_$s" || FAILED=1 ;;
        *) echo "unknown stage '$s' (deps pytest bench grpo compile reference)"; STATUS[$s]=failed; FAILED=1 ;;
    esac
done
summary
echo
echo "GPU lane on $SLUG, $(( $(date +%s) - START ))s:"
for s in $STAGES; do printf '  %-10s %-8s %5ss  %s\n' "$s" "${STATUS[$s]:-not run}" "${SECONDS_TAKEN[$s]:-0}" "${NOTE[$s]:-}"; done
echo "results: tests/gpu/results/ (summary.json, <stage>.log)"
exit $FAILED
