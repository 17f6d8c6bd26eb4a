#!/usr/bin/env bash
# The GPU validation (see validate.py and docs/gpu-validation.md): installs offline what is
# missing, then runs every step in one command of about 7 minutes, or one phase of three.
#   bash benchmarks/gpu/validate.sh                      # all, one budget of 360 s, for a 15-minute lease
#   bash benchmarks/gpu/validate.sh --phase smoke        # 1: <= 3 min, the essentials
#   bash benchmarks/gpu/validate.sh --phase kernels      # 2: identity sweep, pytest -m cuda, throughput
#   bash benchmarks/gpu/validate.sh --phase end-to-end   # 3: concurrency, the 2.2 GB state
#   bash benchmarks/gpu/validate.sh --dry-run            # anywhere: the CPU dry run, every phase
# Results go to $OUT when it is set, else benchmarks/results/gpu/<device>/. Never reaches
# the network: wheels come from .whl/ (tools/gpu_wheels.sh), see install.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHON="${PYTHON:-python3}"

# torch (a CUDA build) must be there already: installing it here would fetch GBs, or a CPU build.
"$PYTHON" -c "import torch" || { echo "validate.sh: torch is not installed" >&2; exit 2; }

# Triton builds its CUDA launcher (a Python extension) with a C compiler at the first launch:
# without one, or without Python's headers, every kernel fails; say so before spending minutes.
if [ "${1:-}" != "--dry-run" ]; then
    cc="${CC:-$(command -v gcc || command -v clang || command -v cc || true)}"
    [ -n "$cc" ] || { echo "validate.sh: no C compiler (gcc, clang, cc or \$CC): Triton cannot build its launcher" >&2; exit 2; }
    # Triton takes $CC, else gcc, else clang, never cc: a plain cc is handed to it as $CC.
    if [ -z "${CC:-}" ] && ! command -v gcc >/dev/null && ! command -v clang >/dev/null; then
        export CC="$cc"
    fi
    # Where Triton's build looks (triton/runtime/build.py): the default scheme's include
    # folder, Debian's posix_local read as posix_prefix.
    "$PYTHON" -c "import os, sysconfig as c; s = c.get_default_scheme(); s = 'posix_prefix' if s == 'posix_local' else s; assert os.path.exists(os.path.join(c.get_paths(scheme=s)['include'], 'Python.h'))" \
        || { echo "validate.sh: Python.h not found: Triton cannot build its launcher" >&2; exit 2; }
fi

# The offline install. Where the environment takes one (the H100 image), the wheels and an
# editable install of this checkout go there, and a rerun finds everything and installs
# nothing. Where it takes none, install.sh puts the wheels in $site, uses this checkout in
# place and prints both for PYTHONPATH; a rerun (the tree is sent again, maybe changed)
# does that again.
site="${TW_GPU_SITE:-${TMPDIR:-/tmp}/tw-gpu-site}"
kernels_home() {
    "$PYTHON" -c "import pathlib, tw_triton.kernels as k; print(pathlib.Path(k.__file__).resolve().parent.parent)" 2>/dev/null || true
}
if [ -d "$site" ] || [ "$(kernels_home)" != "$(pwd -P)" ] ||
    ! "$PYTHON" -c "import hypothesis, pytest, safetensors, triton, zstandard" 2>/dev/null; then
    paths="$(bash benchmarks/gpu/install.sh --fallback "$site")"
    if [ -n "$paths" ]; then
        export PYTHONPATH="$paths${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
where="$(kernels_home)"
if [ -z "$where" ] || { [ "$where" != "$(pwd -P)" ] && [ "$where" != "$(cd "$site" 2>/dev/null && pwd -P)" ]; }; then
    echo "validate.sh: tw_triton.kernels comes from '${where}', neither this checkout nor $site" >&2
    exit 3
fi

exec "$PYTHON" benchmarks/gpu/validate.py "$@"
