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

# This checkout installed (tw_triton.kernels is mapped from kernels/ by the install), plus
# the test extra; skipped when all of it is importable from here already.
if ! "$PY" - <<'PY' 2>/dev/null
import pathlib, sys
import hypothesis, pytest, safetensors, triton  # noqa: F401
import tw_triton, tw_triton.kernels
here = pathlib.Path.cwd().resolve()
ok = pathlib.Path(tw_triton.__file__).resolve().is_relative_to(here) and \
     pathlib.Path(tw_triton.kernels.__file__).resolve().is_relative_to(here)
sys.exit(0 if ok else 1)
PY
then
    echo "validate.sh: installing this checkout with its test extra" >&2
    # Offline first (the build backend already installed), then with build isolation.
    "$PY" -m pip install --quiet --no-build-isolation -e ".[test]" \
        || "$PY" -m pip install --quiet -e ".[test]"
fi

exec "$PY" benchmarks/gpu/validate.py "$@"
