#!/usr/bin/env bash
# The offline install step of the GPU validation (validate.sh runs it; usable alone):
#   bash benchmarks/gpu/install.sh [--wheels DIR] [--target DIR] [--in-place] [--fallback DIR] [--no-project]
# 1. every wheel in DIR (default .whl/, filled by tools/gpu_wheels.sh where the registry is
#    reachable) with pip --no-index --no-deps: nothing is fetched, nothing else is touched;
# 2. this checkout, editable, with --no-index --no-deps --no-build-isolation, built against
#    the torch, triton and setuptools already there (skipped when it already imports from
#    here, or with --no-project).
# Then it checks that every requirement imports, and names exactly what is missing. With
# --target the wheels go to DIR (pip --target) and it checks imports with DIR on the path.
# With --in-place the checkout is not installed: its optional C library is built beside its
# sources and the checkout is put on the path. --fallback DIR is --target DIR --in-place
# where the environment's site-packages takes no install (a read-only image, another
# user's environment; TW_GPU_READONLY_SITE=1 says so without probing), else nothing.
# Stdout: one line, the folders to put first on PYTHONPATH (empty when none are needed).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
WHEELS=".whl"
TARGET=""
IN_PLACE=0
FALLBACK=""
PROJECT=1
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS="$2"; shift 2 ;;
        --target) TARGET="$2"; shift 2 ;;
        --in-place) IN_PLACE=1; shift ;;
        --fallback) FALLBACK="$2"; shift 2 ;;
        --no-project) PROJECT=0; shift ;;
        *) echo "install.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
if [ -n "$FALLBACK" ] && [ -z "$TARGET" ]; then
    if [ "${TW_GPU_READONLY_SITE:-0}" = 1 ] || ! "$PY" -c \
        "import sysconfig, tempfile; tempfile.TemporaryFile(dir=sysconfig.get_paths()['purelib']).close()" 2>/dev/null; then
        echo "install.sh: this environment's site-packages takes no install: wheels to $FALLBACK," \
            "this checkout used in place" >&2
        TARGET="$FALLBACK"
        IN_PLACE=1
    fi
fi
PATHS=()  # what the caller must put first on PYTHONPATH
# Modules to check after the install (the import names of what tw_triton and its tests need).
REQUIRED="${INSTALL_CHECK:-torch triton zstandard numpy safetensors pytest hypothesis}"

# Stdout is the caller's (the path line at the end): pip's goes to stderr.
pip_offline() { "$PY" -m pip install --quiet --no-index --no-deps --disable-pip-version-check "$@" >&2; }

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
    echo "install.sh: installing ${#wheels[@]} wheel(s) from $WHEELS offline" >&2
    if [ -n "$TARGET" ]; then
        pip_offline --target "$TARGET" "${wheels[@]}"
    else
        pip_offline "${wheels[@]}"
    fi
else
    echo "install.sh: no wheels in $WHEELS (run tools/gpu_wheels.sh where the registry is reachable)" >&2
fi
if [ -n "$TARGET" ]; then
    mkdir -p "$TARGET"
    PATHS+=("$(cd "$TARGET" && pwd -P)")
fi

if [ "$PROJECT" = 1 ] && [ "$IN_PLACE" = 1 ]; then
    # Optional extensions: a failed compile leaves the CPU path on the torch spec (same bytes).
    echo "install.sh: building this checkout's C library in place" >&2
    "$PY" setup.py -q build_ext --inplace >&2 ||
        echo "install.sh: the in-place build failed: the CPU path runs the torch spec (same bytes, slower)" >&2
    PATHS+=("$(pwd -P)")
elif [ "$PROJECT" = 1 ]; then
    here="$("$PY" -c "import pathlib, tw_triton.kernels as k; print(pathlib.Path(k.__file__).resolve().parent.parent)" 2>/dev/null || true)"
    if [ "$here" != "$(pwd -P)" ]; then
        echo "install.sh: installing this checkout (editable, offline, no build isolation)" >&2
        if ! pip_offline --no-build-isolation -e .; then
            echo "install.sh: the offline install of this checkout failed; it needs setuptools>=64 and" \
                "wheel importable here (build backend, no isolation): $("$PY" -c 'import setuptools, wheel' 2>&1 | tail -1)" >&2
            exit 3
        fi
    fi
fi

if [ ${#PATHS[@]} -gt 0 ]; then
    prefix="$(IFS=:; echo "${PATHS[*]}")"
    export PYTHONPATH="$prefix${PYTHONPATH:+:$PYTHONPATH}"
fi
missing=()
for mod in $REQUIRED; do
    "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "install.sh: MISSING after the offline install: ${missing[*]}" >&2
    echo "install.sh: torch and triton must be preinstalled; add anything else to PACKAGES in" \
        "tools/gpu_wheels.sh, run it where the registry is reachable, and carry .whl/" >&2
    exit 4
fi
echo "install.sh: ok ($REQUIRED import)" >&2
# isal only makes the checksums faster (zlib gives the same values): say so, do not stop.
"$PY" -c "import isal" 2>/dev/null ||
    echo "install.sh: isal is missing: checksums run on zlib, slower (loads time slower)" >&2
echo "${prefix:-}"
