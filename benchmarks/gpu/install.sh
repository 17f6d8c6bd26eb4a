#!/usr/bin/env bash
# The offline install step of the GPU validation (validate.sh runs it; usable alone):
#   bash benchmarks/gpu/install.sh [--wheels DIR] [--target DIR] [--fallback DIR] [--no-project]
# 1. every wheel in DIR (default .whl/, filled by tools/gpu_wheels.sh where the registry is
#    reachable) with pip --no-index --no-deps: nothing is fetched, nothing else is touched;
# 2. this checkout, editable, with --no-index --no-deps --no-build-isolation, built against
#    the torch, triton and setuptools already there (skipped when it already imports from
#    here, or with --no-project).
# Then it checks that every requirement imports, and names exactly what is missing.
# --target DIR: the wheels go to DIR instead (pip --target --upgrade: a second run replaces
# what the first put there), and this checkout is used where it is, not installed: its C
# library is built beside its sources, and tw_triton/kernels is made a link to kernels/
# (what the install's package-dir mapping does). The checkout must be the one imported:
# `python -m pytest` and `python -c` from its root put it first on the path anyway.
# --fallback DIR is --target DIR where the environment's site-packages takes no install (a
# read-only image, another user's environment; TW_GPU_READONLY_SITE=1 says so without
# probing), or where DIR exists already (an earlier run fell back); else nothing.
# Stdout: one line, the folders to put first on PYTHONPATH (empty when none are needed).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
WHEELS=".whl"
TARGET=""
FALLBACK=""
PROJECT=1
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS="$2"; shift 2 ;;
        --target) TARGET="$2"; shift 2 ;;
        --fallback) FALLBACK="$2"; shift 2 ;;
        --no-project) PROJECT=0; shift ;;
        *) echo "install.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
if [ -n "$FALLBACK" ] && [ -z "$TARGET" ]; then
    if [ -d "$FALLBACK" ]; then
        echo "install.sh: $FALLBACK holds an earlier run's install: replacing it" >&2
        TARGET="$FALLBACK"
    elif [ "${TW_GPU_READONLY_SITE:-0}" = 1 ] || ! "$PY" -c \
        "import sysconfig, tempfile; tempfile.TemporaryFile(dir=sysconfig.get_paths()['purelib']).close()" 2>/dev/null; then
        echo "install.sh: this environment's site-packages takes no install: wheels to $FALLBACK," \
            "this checkout used in place" >&2
        TARGET="$FALLBACK"
    fi
fi
# Modules to check after the install (the import names of what tw_triton and its tests need).
REQUIRED="${INSTALL_CHECK:-torch triton zstandard numpy safetensors pytest hypothesis}"

# Stdout is the caller's (the path line at the end): pip's goes to stderr.
pip_offline() { "$PY" -m pip install --quiet --no-index --no-deps --disable-pip-version-check "$@" >&2; }
into=()
if [ -n "$TARGET" ]; then
    mkdir -p "$TARGET"
    TARGET="$(cd "$TARGET" && pwd -P)"
    into=(--target "$TARGET" --upgrade)
fi

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
    echo "install.sh: installing ${#wheels[@]} wheel(s) from $WHEELS offline" >&2
    pip_offline "${into[@]}" "${wheels[@]}"
else
    echo "install.sh: no wheels in $WHEELS (run tools/gpu_wheels.sh where the registry is reachable)" >&2
fi

PATHS=()  # what the caller puts first on PYTHONPATH
if [ -n "$TARGET" ]; then
    PATHS+=("$TARGET")
fi
if [ "$PROJECT" = 1 ] && [ -n "$TARGET" ]; then
    echo "install.sh: using this checkout in place (C library built beside its sources)" >&2
    [ -e tw_triton/kernels ] || ln -s ../kernels tw_triton/kernels
    # Optional extensions: a failed compile leaves the CPU path on the torch spec (same bytes).
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

prefix="$(IFS=:; echo "${PATHS[*]}")"
if [ -n "$prefix" ]; then
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
echo "$prefix"
