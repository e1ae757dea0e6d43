#!/usr/bin/env bash
# Which attention kernel fails: the probe (tests/gpu/flux_lora_probe.py: the reduced full-width FLUX, bf16,
# sample and train at 512 px) with PyTorch's SDPA restricted to one kernel at a time, each in its own process
# with CUDA_LAUNCH_BLOCKING=1. The first H100 lane run hit an illegal memory access after such a backward;
# on an H200 the same step failed in cuDNN's kernel ("mha_graph.execute(...).is_good()"), with and without
# LoRA and with either kernels backend, so the trainer's default SDPA now leaves cuDNN out
# (paco_ds.models.attention.sdpa_without_cudnn). Run on the GPU machine with the lane's deps on PYTHONPATH:
#   PYTHONPATH=/tmp/paco_ds_gpu_site:$PWD bash tests/gpu/diagnose.sh     (log: $OUT or /tmp, diagnose.log)
set -u
cd "$(dirname "$0")/../.."
PY=${GPU_PYTHON:-python3}
LOG=${OUT:-/tmp}/diagnose.log
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore CUDA_LAUNCH_BLOCKING=1
for kernel in cudnn flash efficient default; do
    t0=$(date +%s)
    echo "=== sdpa $kernel" >> "$LOG"
    timeout --kill-after=5 90 "$PY" tests/gpu/flux_lora_probe.py --device cuda --backend torch --sdpa $kernel \
        --sizes 1024x512 >> "$LOG" 2>&1
    echo "=== sdpa $kernel: rc=$? in $(( $(date +%s) - t0 ))s" | tee -a "$LOG"
done
grep -E "^ok |probe|Error" "$LOG" | head -40
