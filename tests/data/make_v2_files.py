"""Write the version-2 checkpoint files under tests/data (kept for the record).

These files pin format version 2 (the manifest as plain JSON, buffers that may carry an
entropy stage), so that a later writer cannot silently break reading the files already on
users' disks. They were produced by this script on the tree of commit d16ae0b (the last
commit that wrote version 2), with ``make_v1_files.py``'s states and an entropy stage on;
running it on a later tree writes the newer version, so do not rerun it to "refresh" them.

Each checkpoint comes with an ``*_expected.safetensors`` written by stock safetensors, as
the version-1 files do (see ``make_v1_files.py``):

* ``v2_format.safetensors``: the hand-built encoded state of version 1, plus a
  compressible buffer, so that some buffers are staged.
* ``v2_keyframe.safetensors`` + ``v2_delta.safetensors``: the tiny MLP of version 1, saved
  as a keyframe and a delta against it.

Usage: ``PYTHONPATH=. python tests/data/make_v2_files.py``
"""

from __future__ import annotations

import json
import os
import sys

import safetensors.torch
import torch

import tw_triton
from tw_triton import format as fmt
from tw_triton.tree import flatten

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from make_v1_files import _exact, _steps, _train_state, format_state  # noqa: E402


def main() -> None:
    assert fmt.FORMAT_VERSION == 2, "run this at the commit that writes format version 2"
    state = format_state()
    state.checkpoint_id, state.reference_id = "v2-format-0001", "v2-keyframe-0000"
    state.entries["opt/counts"] = _exact(torch.arange(4096, dtype=torch.int32) % 7)
    state.metadata = {"step": 5, "note": "format version 2"}
    fmt.write_file(state, os.path.join(HERE, "v2_format.safetensors"), fsync=False)
    expected = {
        fmt.tensor_key(p, n): b.contiguous() for p, e in state.entries.items() for n, b in e.buffers.items()
    }
    safetensors.torch.save_file(expected, os.path.join(HERE, "v2_format_expected.safetensors"))

    torch.manual_seed(3)
    g = torch.Generator().manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rules = [("model/*.weight", {"codec": "blockwise", "bits": 8, "block": 32, "min_numel": 0})]
    _steps(model, opt, g, 5)
    kq = tw_triton.quantize_state_dict(
        _train_state(model, opt), rules="exact", checkpoint_id="v2-keyframe-0000"
    )
    key_path = os.path.join(HERE, "v2_keyframe.safetensors")
    tw_triton.save(kq, key_path, fsync=False)
    _steps(model, opt, g, 3)
    dq = tw_triton.quantize_state_dict(
        _train_state(model, opt), reference=key_path, rules=rules, checkpoint_id="v2-delta-0001"
    )
    delta_path = os.path.join(HERE, "v2_delta.safetensors")
    tw_triton.save(dq, delta_path, fsync=False)
    for name, path, ref in (("v2_keyframe", key_path, None), ("v2_delta", delta_path, key_path)):
        flat, _ = flatten(tw_triton.load(path, reference=ref))
        safetensors.torch.save_file(
            {k: v.contiguous() for k, v in flat.items()},
            os.path.join(HERE, f"{name}_expected.safetensors"),
        )
    print(
        json.dumps(
            {
                f: os.path.getsize(os.path.join(HERE, f))
                for f in sorted(os.listdir(HERE))
                if f.startswith("v2_")
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
