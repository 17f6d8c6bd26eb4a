"""Write the version-1 checkpoint files under tests/data (kept for the record).

These files pin format version 1, so that a later writer cannot silently break reading
the files already on users' disks. They were produced by this script at commit 54fd86b
(the last commit that wrote version 1); running it on a later tree writes the newer
version, so do not rerun it to "refresh" them.

Each checkpoint comes with an ``*_expected.safetensors`` written by stock safetensors
(not by tw_triton), holding what reading it must give back:

* ``v1_format.safetensors``: a hand-built encoded state (blockwise 8/4/2-bit entries, one
  a delta, exact entries of several dtypes, a 0-dim and an empty tensor, an alias).
  Expected: every stored buffer under ``"<entry>:<buffer>"``.
* ``v1_keyframe.safetensors`` + ``v1_delta.safetensors``: a tiny MLP with its AdamW state,
  saved as a keyframe and, a few steps later, as a delta against it (``tw_triton.save``).
  Expected: the decoded flat state of each (``tw_triton.load``), under the flat paths.

Usage: ``PYTHONPATH=. python tests/data/make_v1_files.py``
"""

from __future__ import annotations

import json
import os
import sys

import safetensors.torch
import torch

import tw_triton
from tw_triton import format as fmt
from tw_triton.codecs.blockwise import quantize
from tw_triton.qstate import EncodedEntry, QuantizedState
from tw_triton.tree import flatten

HERE = os.path.dirname(os.path.abspath(__file__))


def _blockwise(x: torch.Tensor, bits: int, block: int, ref: torch.Tensor | None = None) -> EncodedEntry:
    q = quantize(x, bits=bits, block=block, reference=ref)
    return EncodedEntry(
        codec="blockwise",
        params={"bits": bits, "block": block, "packing": "lsb-first", "delta": ref is not None},
        shape=tuple(x.shape),
        dtype=x.dtype,
        buffers={"codes": q.codes, "scales": q.scales},
    )


def _exact(x: torch.Tensor) -> EncodedEntry:
    return EncodedEntry(codec="exact", params={}, shape=tuple(x.shape), dtype=x.dtype, buffers={"data": x})


def format_state() -> QuantizedState:
    g = torch.Generator().manual_seed(12)
    w = torch.randn(16, 24, generator=g)
    return QuantizedState(
        entries={
            "model/w8": _blockwise(w, 8, 64, ref=w + 0.01 * torch.randn(w.shape, generator=g)),
            "model/w4": _blockwise(torch.randn(40, 8, generator=g).to(torch.bfloat16), 4, 32),
            "model/w2": _blockwise(torch.randn(9, 7, generator=g).half(), 2, 32),
            "model/bias": _exact(torch.randn(24, generator=g)),
            "opt/exp_avg": _exact(torch.randn(16, 24, generator=g)),
            "opt/step": _exact(torch.tensor(5.0)),
            "mask": _exact(torch.tensor([True, False, True, True])),
            "positions": _exact(torch.arange(6, dtype=torch.int64)),
            "empty": _exact(torch.empty(0, 3, dtype=torch.bfloat16)),
        },
        skeleton={
            "model": {"__tensor__": "model"},
            "step": 5,
            "betas": {"__tuple__": [0.9, 0.999]},
            "name": "v1-ü",
        },
        checkpoint_id="v1-format-0001",
        reference_id="v1-keyframe-0000",
        aliases={"model/w8_tied": "model/w8"},
        rules=[["model/*", "blockwise", {"bits": 8}], ["*", "exact", {}]],
        metadata={"step": 5, "note": "format version 1"},
    )


def _train_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": int(opt.state_dict()["state"][0]["step"]),
    }


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, g: torch.Generator, n: int) -> None:
    for _ in range(n):
        x = torch.randn(8, 12, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def main() -> None:
    assert fmt.FORMAT_VERSION == 1, "run this at the commit that writes format version 1"
    state = format_state()
    fmt.write_file(state, os.path.join(HERE, "v1_format.safetensors"), fsync=False)
    expected = {
        fmt.tensor_key(p, n): b.contiguous() for p, e in state.entries.items() for n, b in e.buffers.items()
    }
    safetensors.torch.save_file(expected, os.path.join(HERE, "v1_format_expected.safetensors"))

    torch.manual_seed(3)
    g = torch.Generator().manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rules = [("model/*.weight", {"codec": "blockwise", "bits": 8, "block": 32, "min_numel": 0})]
    _steps(model, opt, g, 5)
    key_state = _train_state(model, opt)
    kq = tw_triton.quantize_state_dict(key_state, rules="exact", checkpoint_id="v1-keyframe-0000")
    key_path = os.path.join(HERE, "v1_keyframe.safetensors")
    tw_triton.save(kq, key_path, fsync=False)
    _steps(model, opt, g, 3)
    delta_state = _train_state(model, opt)
    dq = tw_triton.quantize_state_dict(
        delta_state, reference=key_path, rules=rules, checkpoint_id="v1-delta-0001"
    )
    delta_path = os.path.join(HERE, "v1_delta.safetensors")
    tw_triton.save(dq, delta_path, fsync=False)
    for name, path, ref in (("v1_keyframe", key_path, None), ("v1_delta", delta_path, key_path)):
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
                if f.endswith(".safetensors")
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
