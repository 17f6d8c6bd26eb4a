"""Write the Checkpointer files under tests/data/v3_checkpointer (kept for the record).

They pin what a Checkpointer wrote before files recorded the class of each optimizer
(format version 3, no ``"optimizers"`` in the manifest metadata), so that a later reader
cannot start refusing the files already on users' disks. They were produced by this script
on the tree of commit ddebd7f (the last commit that did not write the record); running it
on a later tree writes the record, so do not rerun it to "refresh" them.

* ``v3_checkpointer/step-00000005.tw.safetensors``: a keyframe of a tiny MLP and its
  AdamW state (``keyframe_every=2``, the weights blockwise 8-bit, the rest exact);
* ``v3_checkpointer/step-00000008.tw.safetensors``: a delta against it, three steps later;
* ``v3_checkpointer_expected.safetensors`` (stock safetensors): the decoded flat state of
  the delta (``Checkpointer.load``), under the flat paths.

Usage: ``PYTHONPATH=. python tests/data/make_v3_checkpointer_files.py``
"""

from __future__ import annotations

import json
import os

import safetensors.torch
import torch

from tw_triton import format as fmt
from tw_triton.checkpointer import Checkpointer
from tw_triton.tree import flatten

HERE = os.path.dirname(os.path.abspath(__file__))
DIRECTORY = os.path.join(HERE, "v3_checkpointer")


def main() -> None:
    assert fmt.FORMAT_VERSION == 3, "run this at a commit that writes format version 3"
    torch.manual_seed(3)
    g = torch.Generator().manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rules = [("model/*.weight", {"codec": "blockwise", "bits": 8, "block": 32, "min_numel": 0})]
    options = {"keep_last": None, "async_write": False, "fsync": False}
    with Checkpointer(DIRECTORY, keyframe_every=2, rules=rules, **options) as ckpt:
        for step in range(9):
            opt.zero_grad()
            model(torch.randn(8, 12, generator=g)).square().mean().backward()
            opt.step()
            if step in (5, 8):
                ckpt.save(step, model=model, optimizer=opt)
        flat, _ = flatten(ckpt.load(8))
        assert [i.kind for i in ckpt.infos()] == ["keyframe", "delta"]
    for name in os.listdir(DIRECTORY):
        meta = fmt.read_manifest(os.path.join(DIRECTORY, name))["metadata"]
        assert "optimizers" not in meta, "this tree records optimizer classes already"
    expected = {k: v.contiguous() for k, v in flat.items() if not k.startswith("rng/")}
    safetensors.torch.save_file(expected, os.path.join(HERE, "v3_checkpointer_expected.safetensors"))
    sizes = {f: os.path.getsize(os.path.join(DIRECTORY, f)) for f in sorted(os.listdir(DIRECTORY))}
    print(json.dumps(sizes, indent=1))


if __name__ == "__main__":
    main()
