#!/usr/bin/env bash
# The GPU check (docs/engines.md "Checking on a GPU"): what the CPU tests cannot check, on a lent
# GPU machine with no network, in a few minutes.
#
#   bash scripts/gpu_check.sh [--dry-run] [--wheels DIR] [--out DIR] [--parts LIST] [--budget S] [--keep-work]
#
# 1. installs the carried wheels (--wheels, default .whl/ when it exists: hydra-core, omegaconf,
#    antlr4-python3-runtime, which the lent machines' image lacks) into a scratch site directory,
#    with no network; sdp itself runs from this checkout (PYTHONPATH, no pip install);
# 2. checks that `python -m sdp_cli` and Hydra import;
# 3. runs bench/gpu.py: the model, `sdp train`, the CUDA tests, the engine's tokens/s and a
#    torchrun FSDP run, each with a time limit. --dry-run does all of it on the CPU at a tiny shape.
#
# Writes gpu_check.json, gpu_check.md, gpu_check.log, gpu_tests.xml and train_metrics.jsonl into
# --out (default: $OUT when set, else ./gpu_check_out). PYTHON picks the interpreter (python3).
# Exit status: 0 when every part that ran passed, 1 otherwise, 2 for bad arguments.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
python=${PYTHON:-python3}
out=${OUT:-./gpu_check_out}
wheels=""
keep_work=0
forward=()
usage() { sed -n '4,5p' "$0" | sed 's/^# *//'; }
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) forward+=(--dry-run); shift ;;
        --wheels) wheels=${2:?--wheels needs a directory}; shift 2 ;;
        --out) out=${2:?--out needs a directory}; shift 2 ;;
        --parts|--budget) forward+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
        --keep-work) keep_work=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
done
if [ -z "$wheels" ] && [ -d .whl ]; then wheels=.whl; fi

mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/sdp_gpu_check.XXXXXX") || exit 2
if [ "$keep_work" = 1 ]; then
    echo "gpu_check: scratch directory $work is kept"
else
    trap 'rm -rf "$work"' EXIT
fi

fail() {  # a failure before bench/gpu.py can run: one line, and a report that says so
    echo "gpu_check: $1" >&2
    "$python" -c 'import json, sys; json.dump({"check": "sdp gpu check", "parts": {"install": {"status": "failed", "reason": sys.argv[1]}}}, open(sys.argv[2], "w"), indent=2)' \
        "$1" "$out/gpu_check.json"
    exit 1
}

check() {
    local site=$work/site pythonpath=$repo
    if [ -n "$wheels" ]; then
        shopt -s nullglob
        local files=("$wheels"/*.whl)
        shopt -u nullglob
        [ ${#files[@]} -gt 0 ] || fail "no *.whl in $wheels; download them first (docs/engines.md \"Checking on a GPU\")"
        echo "gpu_check: installing ${#files[@]} wheel(s) from $wheels into $site"
        timeout 300 "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "${files[@]}" || fail "pip could not install the wheels in $wheels"
        pythonpath=$repo:$site
    else
        echo "gpu_check: no wheels carried; using the installed packages"
    fi
    export PYTHONPATH=$pythonpath${PYTHONPATH:+:$PYTHONPATH}
    timeout 300 "$python" -m sdp_cli --version || fail "python -m sdp_cli does not run from $repo"
    timeout 300 "$python" -c 'import hydra, omegaconf; import sdp_cli.config.compose' \
        || fail "hydra-core or omegaconf does not import; carry their wheels (--wheels)"
    "$python" bench/gpu.py --out "$out" --work "$work" ${wheels:+--wheels "$wheels" --site "$site"} "${forward[@]}"
}

# everything printed also goes to the log that comes back
check 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
