#!/usr/bin/env bash
# tw_triton without triton (macOS, Windows, CPU-only installs): in a fresh venv that has no
# triton, `import tw_triton` works and a CPU save and load round-trip. The venv has no isal
# either (a platform without its wheels): the checksums are zlib's.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(mktemp -d)/venv"
python -m venv "$venv"
"$venv/bin/python" -m pip install -q "torch==2.13.0" numpy safetensors zstandard
"$venv/bin/python" -m pip install -q --no-deps -e .
"$venv/bin/python" - <<'PY'
import importlib.util
import os
import sys
import tempfile

import torch

assert importlib.util.find_spec("triton") is None, "this venv must not have triton"
assert importlib.util.find_spec("isal") is None, "this venv must not have isal"
import tw_triton
from tw_triton.format.checksum import CRC32_LIBRARY

assert CRC32_LIBRARY == "zlib", CRC32_LIBRARY

assert "triton" not in sys.modules, "import tw_triton imported triton"
state = {"w": torch.randn(256, 300), "step": 3}
path = os.path.join(tempfile.mkdtemp(), "ck.tw.safetensors")
tw_triton.save(tw_triton.quantize_state_dict(state), path)
back = tw_triton.load(path)
assert back["step"] == 3 and (back["w"] - state["w"]).abs().max() < 0.1
assert "triton" not in sys.modules
print("without triton: import, CPU save and load OK")
PY
rm -rf "$(dirname "$venv")"
