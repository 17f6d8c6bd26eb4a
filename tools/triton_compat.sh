#!/usr/bin/env bash
# The kernel tests under another triton release, on the CPU (docs/gpu-validation.md,
# "Triton 3.6, the GPU image's version"): builds a venv without system site packages that
# has the given triton, installs this checkout into it (editable, --no-deps), checks that
# tw_triton and tw_triton.kernels come from this checkout, then runs the kernel tests:
# interpreter byte identity and the sm_80/sm_90 ahead-of-time PTX checks (tests/ops, where
# nothing may be skipped), the launchers through triton's JIT (tests/ops/test_jit_launch.py
# is part of tests/ops) and the kernel tests of the save path and DCP.
#   bash tools/triton_compat.sh 3.6.0                 # venv in ${TMPDIR:-/tmp}/tw-triton-3.6.0
#   bash tools/triton_compat.sh 3.6.0 /work/venvs/x   # or where you say (reused if present)
# TORCH (default torch==2.13.0, the CPU build on this machine's disk: any other spec may pull
# gigabytes of CUDA wheels) is the torch to install beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: bash tools/triton_compat.sh TRITON_VERSION [VENV_DIR]}"
venv="${2:-${TMPDIR:-/tmp}/tw-triton-$version}"
torch_spec="${TORCH:-torch==2.13.0}"

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -qq "$torch_spec" "triton==$version" numpy safetensors zstandard isal pytest hypothesis
"$py" -m pip install -qq --no-deps -e .
"$py" - "$version" "$PWD" <<'PY'
import pathlib
import sys

import triton
import tw_triton
import tw_triton.kernels as k

version, root = sys.argv[1], pathlib.Path(sys.argv[2]).resolve()
assert triton.__version__ == version, f"triton {triton.__version__} is installed, not {version}"
for module in (tw_triton, k):
    where = pathlib.Path(module.__file__).resolve()
    assert root in where.parents, f"{module.__name__} comes from {where}, not {root}"
print(f"triton {triton.__version__}, tw_triton and its kernels from {root}")
PY

log="$(mktemp)"
"$py" -m pytest -q -p no:cacheprovider -rs tests/ops | tee "$log"
if grep -Eq "[0-9]+ skipped" "$log"; then
    echo "triton_compat.sh: tests/ops skipped tests under triton $version (see above)" >&2
    exit 1
fi
rm -f "$log"
"$py" -m pytest -q -p no:cacheprovider -rs tests/checkpointing -k "grouped or launches or first_save or kernel"
"$py" -m pytest -q -p no:cacheprovider -rs tests/dcp -k device
