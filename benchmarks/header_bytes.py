"""Where a checkpoint file's header bytes go: the safetensors tensor table and the manifest.

Saves a keyframe and a delta (a ``Checkpointer`` with its defaults, synchronous) of two
states after two AdamW steps on random gradients: the tiny GPT of the restart experiment
(0.47 M parameters, ``harness/tiny_gpt.py``) and a BERT of MiniLM-L6-H384's shape (22.7 M
parameters, random weights, built from its config: nothing is downloaded; needs
``transformers``). Prints, for each file, the header (length prefix included), the part of
it that stores the manifest, and the file's size.

Run: ``python benchmarks/header_bytes.py`` (a few seconds). Prints a table.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import torch
from harness.tiny_gpt import Config, TinyGPT

import tw_triton


def header_bytes(path: str) -> tuple[int, int]:
    """The header's bytes (length prefix included) and those of its ``__metadata__`` values."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n))["__metadata__"]
    return 8 + n, sum(len(v) for v in meta.values())


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()


def measure(name: str, model: torch.nn.Module) -> list[str]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt)
    _step(model, opt)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        with tw_triton.Checkpointer(tmp, async_write=False, fsync=False, keep_last=None) as ck:
            ck.save(0, model=model, optimizer=opt)
            _step(model, opt)
            ck.save(1, model=model, optimizer=opt)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        for step, kind in ((0, "keyframe"), (1, "delta")):
            path = ck.path_for(step)
            header, manifest = header_bytes(path)
            size = Path(path).stat().st_size
            rows.append(f"| {name} ({params:.2f} M) | {kind} | {header} | {manifest} | {size} |")
    return rows


def main() -> None:
    torch.manual_seed(0)
    rows = measure("tiny GPT", TinyGPT(Config()))
    try:
        from transformers import BertConfig, BertModel
    except ImportError:
        print("transformers is not installed: the MiniLM-sized state is left out")
    else:
        torch.manual_seed(0)
        config = BertConfig(
            hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536
        )
        rows += measure("MiniLM-L6-H384-sized BERT", BertModel(config))
    print(f"format version {tw_triton.format.FORMAT_VERSION}")
    print("| state | file | header bytes | manifest bytes | file bytes |\n|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
