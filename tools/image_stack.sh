#!/usr/bin/env bash
# The GPU image's software on the CPU (docs/gpu-validation.md, "The GPU image's stack, on
# the CPU"): Python 3.12, torch 2.11 and triton 3.6 in a venv without system site packages,
# with the versions of the framework integrations and pytest-xdist that the image lent now
# (nvidia-h200) has. Runs every test, failing on a skip for any reason but a missing CUDA
# device or optional extra (the image has no torchao or bitsandbytes), then the
# validation's CPU dry run as validate.sh runs it there.
#   bash tools/image_stack.sh                     # venv in ${TMPDIR:-/tmp}/tw-image-stack
#   bash tools/image_stack.sh /work/venvs/x       # or where you say (reused if present)
# torch 2.11 from the registry is its CUDA build: about 0.5 GB, and about 3 GB of CUDA
# libraries beside it; it runs without a GPU (torch.cuda.is_available() is False).
# PY312 names the Python 3.12 interpreter (default: python3.12 on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-${TMPDIR:-/tmp}/tw-image-stack}"

[ -x "$venv/bin/python" ] || "${PY312:-python3.12}" -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -qq "torch==2.11.0" "triton==3.6.0" numpy safetensors zstandard isal pytest hypothesis \
    pytest-xdist "transformers==5.17.0" "accelerate==1.15.0" "lightning==2.6.6"
"$py" -m pip install -qq --no-deps --no-build-isolation -e .
"$py" - "$PWD" <<'PY'
import pathlib
import sys

import torch
import triton
import tw_triton

assert sys.version_info[:2] == (3, 12), f"Python {sys.version.split()[0]}, not 3.12"
assert torch.__version__.startswith("2.11."), f"torch {torch.__version__}, not 2.11"
assert triton.__version__ == "3.6.0", f"triton {triton.__version__}, not 3.6.0"
root = pathlib.Path(sys.argv[1]).resolve()
assert root in pathlib.Path(tw_triton.__file__).resolve().parents, f"tw_triton is not from {root}"
print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}")
PY

log="$(mktemp)"
"$py" -m pytest -q -p no:cacheprovider -rs tests | tee "$log"
if grep "^SKIPPED" "$log" | grep -Ev "needs a CUDA device|needs the optional|needs the '[a-z]+' extra|is not installed: pip install 'tw-triton\["; then
    echo "image_stack.sh: the tests above were skipped for another reason than a missing GPU or extra" >&2
    exit 1
fi
rm -f "$log"
PYTHON="$py" OUT="$(mktemp -d)" bash benchmarks/gpu/validate.sh --dry-run
