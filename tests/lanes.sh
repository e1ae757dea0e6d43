#!/usr/bin/env bash
# Every lane of the project's tests, in CI's order, each timed, with a table at the end:
# `make test-all` runs it and so does CI (.ci/run). LANES="test test-runs" runs a subset.
# The side venvs (vLLM's CPU build, Triton 3.6.0) install in the background once the fast tier is done,
# while the multi-process lanes run (downloads and unpacking, which overlap well with their CPU work
# on 2 cores): `make test` keeps both cores, so its time is the fast tier's own; the lanes that need
# the venvs wait for them. A failed lane does not stop the others; the exit status is 1 if any
# failed. The table also goes to build/lanes.json.
# A lane that needs root (test-cluster, test-slurm: network namespaces, sshd, Slurm's daemons) is skipped
# without it, and in CI (CI=true) fails instead: CI must run every lane. Each lane's pytest declares the
# skips it allows (the Makefile's SKIP_POLICY; tests/conftest.py), so a lane whose tests all skipped fails.
# Environment: LANES (the lanes, in order), MAKE (the make to run them with, default make), LANES_OUT (the
# folder for lanes.json and side-venvs.log, default build), PACO_LANES_UID (the user id to judge root
# by, default `id -u`: tests/lanes/test_lanes.py plays a user without root with it).
set -u
cd "$(dirname "$0")/.."
LANES=${LANES:-test test-runs test-vllm test-stop test-plan test-triton36 test-cluster test-slurm}
MAKE=${MAKE:-make}
OUTDIR=${LANES_OUT:-build}
USER_ID=${PACO_LANES_UID:-$(id -u)}
mkdir -p "$OUTDIR"
START=$(date +%s)
side_pid=""
side_wanted=""
[[ " $LANES " == *" test-vllm "* || " $LANES " == *" test-triton36 "* ]] && side_wanted=1
start_side_venvs() {  # once
    [[ -n $side_wanted ]] || return 0
    side_wanted=""
    ("$MAKE" vllm-setup triton36-setup > "$OUTDIR/side-venvs.log" 2>&1) &
    side_pid=$!
}
declare -A STATUS SECS FREE
FAILED=0
free_gib() { df -P -k . | awk 'NR==2 {printf "%.1f", $4 / 1048576}'; }
echo "lanes: $(free_gib) GiB free on this disk at the start"
for lane in $LANES; do
    [[ $lane == test ]] || start_side_venvs
    t0=$(date +%s)
    if [[ ( $lane == test-vllm || $lane == test-triton36 ) && -n $side_pid ]]; then
        if ! wait "$side_pid"; then
            tail -n 40 "$OUTDIR/side-venvs.log"
            echo "lanes: the side venvs (make vllm-setup triton36-setup) failed; log: $OUTDIR/side-venvs.log"
            STATUS[side-venvs]=failed; FAILED=1
        fi
        side_pid=""
    fi
    if [[ ( $lane == test-cluster || $lane == test-slurm ) && $USER_ID != 0 ]]; then
        if [[ ${CI:-} == true ]]; then
            echo "lanes: make $lane FAILED: the two-node tests need root (network namespaces, sshd, Slurm's daemons), and CI runs every lane"
            STATUS[$lane]=failed; FAILED=1
        else
            echo "lanes: skipping make $lane: the two-node tests need root (network namespaces, sshd, Slurm's daemons)"
            STATUS[$lane]=skipped
        fi
        SECS[$lane]=0
        continue
    fi
    echo "==== make $lane"
    if "$MAKE" "$lane"; then STATUS[$lane]=passed; else STATUS[$lane]=failed; FAILED=1; fi
    [[ $lane == test-cluster ]] && bash tests/cluster/netns.sh down
    [[ $lane == test-slurm ]] && bash tests/slurm/slurm.sh down
    SECS[$lane]=$(( $(date +%s) - t0 ))
    FREE[$lane]=$(free_gib)
done
TOTAL=$(( $(date +%s) - START ))
echo
printf '%-16s %-8s %8s %12s\n' lane status seconds "GiB free"
json="{"
for lane in $LANES; do
    printf '%-16s %-8s %8s %12s\n' "$lane" "${STATUS[$lane]:-not run}" "${SECS[$lane]:-0}" "${FREE[$lane]:--}"
    json+="\"$lane\": {\"status\": \"${STATUS[$lane]:-not run}\", \"seconds\": ${SECS[$lane]:-0}, \"free_gib\": ${FREE[$lane]:-null}}, "
done
printf '%-16s %-8s %8s\n' total "" "$TOTAL"
echo "${json}\"total_seconds\": $TOTAL, \"load_average\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}" > "$OUTDIR/lanes.json"
exit $FAILED
