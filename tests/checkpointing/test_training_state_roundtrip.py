"""Acceptance: a real training state (tiny transformer, AdamW, LinearLR, GradScaler, step,
torch/numpy/python RNG) saved and loaded, and a resumed run that takes the same next step."""

from __future__ import annotations

import io
import os
import random
import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _states import assert_same

import tw_triton
from tw_triton.tree import flatten

VOCAB, DIM = 128, 64


class TinyLM(torch.nn.Module):
    """Embedding, one transformer encoder layer (with dropout), tied output head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.enc = torch.nn.TransformerEncoderLayer(DIM, 4, 128, dropout=0.1, batch_first=True)
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.enc(self.emb(tokens))))


def build(seed: int):
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=10)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    return model, opt, sched, scaler


def train_step(model, opt, sched, scaler) -> float:
    # All three RNGs drive the step: python picks the batch size, numpy the tokens, torch
    # the dropout masks, so a resumed run matches only if all three were restored.
    batch = random.randint(2, 4)
    tokens = torch.from_numpy(np.random.randint(0, VOCAB, size=(batch, 12)))
    logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    return loss.item()


def training_state(model, opt, sched, scaler, step):
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "scaler": scaler.state_dict(),
        "step": step,
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
    }


def restore(state, model, opt, sched, scaler) -> None:
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])


def header_bytes(path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def deep_copy(state):
    tensors, skeleton = flatten(state)
    return tw_triton.tree.unflatten(skeleton, {k: v.clone() for k, v in tensors.items()})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Train a few steps, checkpoint with two settings, then take one more step."""
    random.seed(1)
    np.random.seed(2)
    model, opt, sched, scaler = build(seed=3)
    for _ in range(4):
        train_step(model, opt, sched, scaler)
    state = training_state(model, opt, sched, scaler, step=4)
    snapshot = deep_copy(state)  # what the checkpoint must reproduce

    d = tmp_path_factory.mktemp("ckpt")
    files = {}
    for name, rules in (("exact", "exact"), ("default", None)):
        q = tw_triton.quantize_state_dict(state, rules=rules)
        files[name] = (d / f"{name}.tw", tw_triton.save(q, d / f"{name}.tw"), q)
    buf = io.BytesIO()
    torch.save(state, buf)
    torch_bytes = buf.getbuffer().nbytes

    # The original run goes on (this mutates `state`'s tensors in place).
    next_loss = train_step(model, opt, sched, scaler)
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "snapshot": snapshot,
        "files": files,
        "torch_bytes": torch_bytes,
        "next_loss": next_loss,
        "after": after,
        "after_opt": deep_copy(opt.state_dict()),
        "after_lr": sched.get_last_lr(),
    }


def test_exact_setting_is_bit_exact_everywhere(trained):
    path, _, _ = trained["files"]["exact"]
    out = tw_triton.load(path)
    # Same structure, same types (tuples, int keys, floats, ndarray), same bits.
    assert_same(trained["snapshot"], out)
    assert out["model"]["head.weight"] is out["model"]["emb.weight"]
    assert isinstance(out["optimizer"]["param_groups"][0]["betas"], tuple)
    assert isinstance(out["rng"]["numpy"][1], np.ndarray) and out["rng"]["numpy"][1].dtype == np.uint32


def test_resumed_run_takes_the_same_next_step(trained):
    path, _, _ = trained["files"]["exact"]
    model, opt, sched, scaler = build(seed=99)  # different init: everything must come from the file
    restore(tw_triton.load(path), model, opt, sched, scaler)
    loss = train_step(model, opt, sched, scaler)
    assert loss == trained["next_loss"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, trained["after"][k]), k
    assert_same(trained["after_opt"], opt.state_dict())
    assert sched.get_last_lr() == trained["after_lr"]


def test_default_rules_exact_where_the_codec_is_exact(trained):
    path, _, q = trained["files"]["default"]
    out = tw_triton.load(path)
    snap_tensors, snap_skel = flatten(trained["snapshot"])
    out_tensors, out_skel = flatten(out)
    assert out_skel == snap_skel  # every plain value and container type identical
    quantized = {p for p, e in q.entries.items() if e.codec != "exact"}
    assert quantized and all(p.startswith("model/") for p in quantized)
    assert {p for p in out_tensors if p.startswith(("optimizer/", "rng/"))}.isdisjoint(quantized)
    for p, x in snap_tensors.items():
        y = out_tensors[p]
        assert y.dtype == x.dtype and y.shape == x.shape, p
        target = q.aliases.get(p, p)
        if target in quantized:
            assert (y - x).abs().max() <= x.abs().max() / 127, p
        else:
            assert torch.equal(y, x), p
    # A resumed run is close to the original (the benchmarks measure how close).
    model, opt, sched, scaler = build(seed=99)
    restore(out, model, opt, sched, scaler)
    loss = train_step(model, opt, sched, scaler)
    assert abs(loss - trained["next_loss"]) < 1e-2 * abs(trained["next_loss"])


def test_file_size_is_entries_plus_header_and_beats_torch_save(trained, capsys):
    torch_bytes = trained["torch_bytes"]
    ratios = {}
    for name, (path, size, q) in trained["files"].items():
        # The data section is the buffers after the entropy stage, never more than the buffers.
        stored = tw_triton.format.read_manifest(path)["stats"]["stored_bytes"]
        assert size == os.path.getsize(path) == stored + header_bytes(path)
        assert stored <= q.nbytes
        ratios[name] = size / torch_bytes
    with capsys.disabled():
        print(
            f"\n[size] torch.save {torch_bytes} B; tw exact {ratios['exact']:.3f}x, "
            f"tw default (int8 model) {ratios['default']:.3f}x of torch.save"
        )
    assert ratios["default"] < 1
    # No quantization: the same tensor bytes as torch.save, less what the entropy stage
    # saves, plus a header (compressed since format version 3), give or take.
    assert 0.8 < ratios["exact"] < 1.25
