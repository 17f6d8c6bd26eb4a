#!/usr/bin/env bash
# The GPU validation in one command (see validate.py): installs what is missing, then runs
# every step and writes benchmarks/results/gpu/<device>/. Non-interactive and idempotent.
#   bash benchmarks/gpu/validate.sh              # on a GPU machine
#   bash benchmarks/gpu/validate.sh --dry-run    # anywhere: the CPU dry run
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python}"

# torch (a CUDA build) must be there already: installing it here would fetch GBs, or a CPU build.
"$PY" -c "import torch" || { echo "validate.sh: torch is not installed" >&2; exit 2; }

# The project and its test extra. Installed only when something is missing, so a rerun
# changes nothing. An install of another checkout is left alone (it may be someone else's):
# this checkout's package then comes first on the path, with a warning.
if ! "$PY" -c "import hypothesis, pytest, safetensors, triton, tw_triton.kernels" 2>/dev/null; then
    echo "validate.sh: installing this checkout with its test extra" >&2
    # Offline first (the build backend already installed), then with build isolation.
    "$PY" -m pip install --quiet --no-build-isolation -e ".[test]" \
        || "$PY" -m pip install --quiet -e ".[test]"
fi
where="$("$PY" -c "import pathlib, tw_triton.kernels as k; print(pathlib.Path(k.__file__).resolve().parent.parent)")"
if [ "$where" != "$(pwd -P)" ]; then
    echo "validate.sh: warning: tw_triton.kernels comes from $where, not this checkout" >&2
    export PYTHONPATH="$(pwd -P)${PYTHONPATH:+:$PYTHONPATH}"
fi

exec "$PY" benchmarks/gpu/validate.py "$@"
