#!/usr/bin/env bash
# The GPU lane (`make test-gpu`): everything the project checks on one CUDA GPU, in one command, on a
# bare machine with no network. Stages, each with its log in tests/gpu/results/<stage>.log:
#   deps       install the wheels of .whl/ that the interpreter lacks (tests/gpu/bundle.py), into an
#              overlay folder put on PYTHONPATH; torch, triton and transformers are never touched
#   pytest     pytest tests/gpu: the Triton kernels against float64 references, fwd+bwd, fp32/bf16; the
#              skip policy of every lane (tests/conftest.py): no skip except an optional package's
#   bench      python -m kernels.bench: kernels/bench/results/<gpu>.json with the triton columns; each op's
#              target (kernels/bench/__init__.py OP_TARGETS) met or missed: "targets missed" when one is
#   grpo       a tiny GRPO run under the DeepSpeed launcher on 1 GPU (NCCL, bf16, Triton kernels,
#              the judge on the hf engine on the GPU): configs/tiny/t2is_gpu.yaml; tests/gpu/lane_checks.py
#              checks that it trained, that the adapter changed and that the evaluation changed with the EMA
#   compile    benchmarks/compile_blocks.py --device cuda: model.compile's regional compile of the
#              reduced full-width FLUX at 512 px, bf16, eager vs compiled
#   reference  benchmarks/grpo_vs_reference.py --device cuda
# A failing stage does not stop the others; the summary (results/summary.json) says which passed,
# and the exit status is non-zero if any failed. A stage that passed its checks but missed a performance
# target reads "targets missed" (with a note naming them), which does not fail the lane. Without a CUDA GPU
# it runs nothing and exits 2.
# Every results file records the source it came from (kernels/bench/source.py: the commit and whether the
# tree was clean, from git, or in a copy without .git from .whl/source.json, which `make gpu-wheels`
# writes): results/source.json, machine.json and summary.json, the bench JSON, the junit xml, the
# metrics copy (its first line) and the compile and reference JSONs.
#
# Environment: GPU_PYTHON (default python3: the interpreter that holds torch), LANE_STAGES (default
# all, in the order above; each stage runs alone too, e.g. LANE_STAGES=grpo), LANE_BUDGET_S (seconds
# for the whole lane, default 540: one 10-minute device call with room to copy results back; 0 = no
# limit; each stage gets at most what is left), LANE_BENCH_ARGS (default --no-compile; "" for the torch.compile column too),
# LANE_SITE (overlay folder, default /tmp/paco_ds_gpu_site), LANE_PORT (default 29531), LANE_RESULTS (the
# results folder, default tests/gpu/results).
# When OUT is set (the workplace's device runner), the summary, junit xml, bench json, metrics and a
# tarball of the logs are copied there after every stage.
set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
PY=${GPU_PYTHON:-python3}
RES=${LANE_RESULTS:-$REPO/tests/gpu/results}
RES_SHOWN=${RES#"$REPO"/}  # as the summary names it: relative to the repository when inside it
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
for s in $STAGES; do rm -f "$RES/$s.log" "$RES/$s.note" "$RES/$s.missed"; done
declare -A STATUS SECONDS_TAKEN NOTE

summary() {  # results/summary.json, and the files that come back through $OUT
    {
        printf '{\n "stages": {'
        local sep=""
        for s in $STAGES; do
            printf '%s\n  "%s": {"status": "%s", "seconds": %s, "log": "%s/%s.log", "note": "%s"}' \
                "$sep" "$s" "${STATUS[$s]:-not run}" "${SECONDS_TAKEN[$s]:-0}" "$RES_SHOWN" "$s" "${NOTE[$s]:-}"
            sep=","
        done
        printf '\n },\n "source": %s,\n "machine": %s,\n "seconds": %s\n}\n' \
            "$(cat "$RES/source.json" 2>/dev/null || echo null)" "$(cat "$RES/machine.json" 2>/dev/null || echo null)" \
            "$(( $(date +%s) - START ))"
    } > "$RES/summary.json"
    if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
        cp "$RES/summary.json" "$OUT/" 2>/dev/null
        for f in "$RES/pytest_gpu.xml" "$RES"/bench_*.json "$RES/metrics.jsonl" "$RES"/grpo_vs_reference_*.json \
                 "$RES"/compile_blocks_*.json; do
            [ -f "$f" ] && cp "$f" "$OUT/"
        done
        tar -czf "$OUT/logs.tar.gz" -C "$RES" $(cd "$RES" && ls *.log *.png machine.json source.json 2>/dev/null) 2>/dev/null
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
    if [ $rc -eq 0 ] && [ -f "$RES/$name.missed" ]; then STATUS[$name]="targets missed"; NOTE[$name]=$(cat "$RES/$name.missed")
    elif [ $rc -eq 0 ]; then STATUS[$name]=passed
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then STATUS[$name]=failed; NOTE[$name]="timed out after ${limit}s"
    else STATUS[$name]=failed; NOTE[$name]=${NOTE[$name]:-"exit status $rc"}; fi
    echo "   $name: ${STATUS[$name]} in ${SECONDS_TAKEN[$name]}s ${NOTE[$name]:-}"
    tail -n 5 "$RES/$name.log" | sed 's/^/   | /'
    summary
    return $rc
}

# ---------------------------------------------------------------------------------------- the GPU
"$PY" - "$RES/source.json" > "$RES/machine.json" 2> "$RES/gpu.log" <<'EOF'
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
try:  # the commit and whether the tree was clean, before any stage writes into it
    from kernels.bench.source import source_state
    source = source_state()
except Exception as err:  # noqa: BLE001 - the lane runs on; the record says why it does not know
    source = {"commit": "unknown", "clean": None, "from": f"kernels.bench.source failed: {err}", "changes": []}
with open(sys.argv[1], "w") as f:
    json.dump(source, f)
print(json.dumps({"gpu": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "capability": f"{p.major}.{p.minor}",
                  "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
                  "python": sys.version.split()[0], "executable": sys.executable,
                  "cudnn": torch.backends.cudnn.version(), "source": source}))
EOF
rc=$?
if [ $rc -ne 0 ]; then
    rm -f "$RES/machine.json" "$RES/source.json"
    echo "test-gpu: no CUDA GPU for the lane: $(tail -n 1 "$RES/gpu.log")."
    [ $rc -eq 4 ] && echo "test-gpu: GPU_PYTHON names the interpreter that holds torch (make test-gpu GPU_PYTHON=...)."
    echo "test-gpu: the lane needs a CUDA GPU, so nothing was run (the CPU tests are 'make test')."
    exit 2
fi
echo "GPU: $(cat "$RES/machine.json")"
echo "source: $(cat "$RES/source.json")"
SLUG=$("$PY" -c "import re, torch; print(re.sub(r'[^a-z0-9]+', '-', torch.cuda.get_device_name(0).lower()).strip('-'))")

# ---------------------------------------------------------------------------------------- stages
stage_deps() {
    if "$PY" -c "import deepspeed, diffusers, open_clip, openai, fastapi, uvicorn, pydantic" 2>/dev/null; then
        echo "every import of the project is there; nothing to install"
        return 0
    fi
    "$PY" tests/gpu/bundle.py install --dir .whl --target "$SITE" || return 1
    "$PY" -c "import deepspeed, diffusers, open_clip, openai, fastapi, uvicorn, pydantic, kernels, paco_ds.recipe.schema; \
print('imports ok: deepspeed', deepspeed.__version__, 'from', deepspeed.__file__)"
}

stamp() {  # stamp FILE...: record the lane's source state in results files (kernels/bench/source.py)
    "$PY" -m kernels.bench.source stamp --state "$RES/source.json" "$@"
}

stage_pytest() {
    # on a GPU, a skipped GPU test fails the lane (the skip policy of every lane, tests/conftest.py), except
    # one whose optional package (flash-attn, the `flash` extra) is not installed: its check says so in one
    # line, and -rs lists it
    "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu --junitxml="$RES/pytest_gpu.xml" \
        --allowed-skips=0 --allow-skip="optional package not installed here"
    local rc=$?
    stamp "$RES/pytest_gpu.xml"
    return $rc
}

stage_bench() {
    # shellcheck disable=SC2086
    "$PY" -m kernels.bench --device cuda $BENCH_ARGS || return 1
    cp "kernels/bench/results/$SLUG.json" "$RES/bench_$SLUG.json" && cp "kernels/bench/results/$SLUG.png" "$RES/" 2>/dev/null
    # a triton column for every op, or the stage fails; an op that missed its target: "targets missed"
    "$PY" tests/gpu/lane_checks.py bench "kernels/bench/results/$SLUG.json" --missed "$RES/bench.missed"
}

stage_grpo() {
    local run="$RES/runs/tiny_t2is_gpu"
    # NCCL_DEBUG=INFO: NCCL announces itself when the first collective builds its communicator
    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT "$PY" -m deepspeed.launcher.runner --num_gpus 1 --master_port "${LANE_PORT:-29531}" launch/train.py \
        --config configs/tiny/t2is_gpu.yaml --set "output_dir=$RES/runs" || return 1
    cp "$run/metrics.jsonl" "$RES/metrics.jsonl" 2>/dev/null && stamp "$RES/metrics.jsonl"
    # trained (finite losses and gradient norms, no skipped step), the adapter changed, the evaluation
    # changed once the EMA updated (tests/gpu/lane_checks.py check_grpo_run)
    "$PY" tests/gpu/lane_checks.py grpo "$run" || return 1
    if grep -q "NCCL INFO" "$RES/grpo.log"; then echo "NCCL: $(grep -m1 -o 'NCCL version [^ ]*' "$RES/grpo.log")"
    else echo "no 'NCCL INFO' line in the log: the run did not use NCCL" | tee "$RES/grpo.note"; return 1; fi
}

stage_compile() {
    "$PY" benchmarks/compile_blocks.py --device cuda || return 1
    stamp "benchmarks/results/compile_blocks_$SLUG.json"
    cp "benchmarks/results/compile_blocks_$SLUG.json" "$RES/"
}

stage_reference() {
    if [ ! -f benchmarks/grpo_vs_reference.py ]; then
        echo "benchmarks/grpo_vs_reference.py is missing" | tee "$RES/reference.note"
        return 1
    fi
    "$PY" benchmarks/grpo_vs_reference.py --device cuda --out "benchmarks/results/grpo_vs_reference_$SLUG.json" \
        || return 1
    stamp "benchmarks/results/grpo_vs_reference_$SLUG.json"
    cp "benchmarks/results/grpo_vs_reference_$SLUG.json" "$RES/"
}

export PY RES SITE SLUG BENCH_ARGS
export -f stamp stage_deps stage_pytest stage_bench stage_grpo stage_compile stage_reference
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
for s in $STAGES; do printf '  %-10s %-14s %5ss  %s\n' "$s" "${STATUS[$s]:-not run}" "${SECONDS_TAKEN[$s]:-0}" "${NOTE[$s]:-}"; done
echo "results: $RES_SHOWN/ (summary.json, <stage>.log)"
exit $FAILED
