#!/usr/bin/env bash
# Every lane of the project's tests, in CI's order, each timed, with a table at the end:
# `make test-all` runs it and so does CI (.ci/run). LANES="test test-runs" runs a subset.
# The side venvs (vLLM's CPU build, Triton 3.6.0) install in the background while the first lanes
# run (downloads and unpacking, which overlap well with the suite's CPU work on 2 cores); the lanes
# that need them wait for them. A failed lane does not stop the others; the exit status is 1 if any
# failed. The table also goes to build/lanes.json.
set -u
cd "$(dirname "$0")/.."
LANES=${LANES:-test test-runs test-vllm test-stop test-plan test-triton36 test-cluster test-slurm}
mkdir -p build
START=$(date +%s)
side_pid=""
if [[ " $LANES " == *" test-vllm "* || " $LANES " == *" test-triton36 "* ]]; then
    (make vllm-setup triton36-setup > build/side-venvs.log 2>&1) &
    side_pid=$!
fi
declare -A STATUS SECS FREE
FAILED=0
free_gib() { df -P -k . | awk 'NR==2 {printf "%.1f", $4 / 1048576}'; }
echo "lanes: $(free_gib) GiB free on this disk at the start"
for lane in $LANES; do
    t0=$(date +%s)
    if [[ ( $lane == test-vllm || $lane == test-triton36 ) && -n $side_pid ]]; then
        if ! wait "$side_pid"; then
            tail -n 40 build/side-venvs.log
            echo "lanes: the side venvs (make vllm-setup triton36-setup) failed; log: build/side-venvs.log"
            STATUS[side-venvs]=failed; FAILED=1
        fi
        side_pid=""
    fi
    if [[ ( $lane == test-cluster || $lane == test-slurm ) && $(id -u) != 0 ]]; then
        echo "lanes: skipping make $lane: the two-node tests need root (network namespaces, sshd, Slurm's daemons)"
        STATUS[$lane]=skipped; SECS[$lane]=0
        continue
    fi
    echo "==== make $lane"
    if make "$lane"; then STATUS[$lane]=passed; else STATUS[$lane]=failed; FAILED=1; fi
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
echo "${json}\"total_seconds\": $TOTAL, \"load_average\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}" > build/lanes.json
exit $FAILED
