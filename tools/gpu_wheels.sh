#!/usr/bin/env bash
# Fill the git-ignored wheel folder .whl/ with what the GPU image lacks, for an offline
# install there (benchmarks/gpu/install.sh). Run it HERE, on a machine that reaches the
# package registry, before carrying the checkout (with .whl/) to the GPU machine:
#   bash tools/gpu_wheels.sh            # -> .whl/{zstandard,isal}-*-cp312-*manylinux*x86_64.whl
# The wheels are for the GPU image, not for this machine: CPython 3.12, manylinux x86_64.
set -euo pipefail
cd "$(dirname "$0")/.."

# WHAT THE GPU IMAGE LACKS, the one list to edit. How it was decided: the image (Python
# 3.12, torch 2.11, triton 3.6, no network) already has numpy, safetensors, hypothesis,
# pytest, setuptools, wheel and packaging; of pyproject.toml's [project] dependencies
# (torch, triton, zstandard, isal) and its test extra (pytest, hypothesis) zstandard and
# isal are missing. Each pin is the newest release that pyproject allows and that has
# cp312 manylinux wheels (the one this project is tested with on the CPU); isal has no
# dependencies of its own. Without isal the checksums are zlib's, the same values, slower.
# Everything is pure binary and --no-deps: add a package's own dependencies here too.
PACKAGES=(
    "zstandard==0.25.0"
    "isal==1.9.1"
)

DEST="${WHEEL_DIR:-.whl}"
PY="${PYTHON:-python3}"
mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 \
    -d "$DEST" "${PACKAGES[@]}"
ls -l "$DEST"/*.whl
