"""Sample encoded states for the file-format tests, built from real codec outputs.

The tests of ``tw_triton.format`` build ``QuantizedState`` objects directly (the state
API is not needed to test the file), so they share these builders and the comparison.
"""

from __future__ import annotations

import torch

from tw_triton.codecs.blockwise import quantize
from tw_triton.codecs.entropy import EntropyPolicy, get_stage
from tw_triton.qstate import EncodedEntry, QuantizedState

# Every non-empty buffer through its stage, kept whatever it saves (even when the stored
# bytes are larger): small files in which every buffer is staged, for the format tests.
STAGE_EVERYTHING = EntropyPolicy(min_bytes=1, min_saving=None)


def unstage(buffer_record: dict, stored: bytes) -> bytes:
    """The raw bytes of a buffer from its stored bytes, by the stage its manifest record
    names (the stored bytes themselves when it has none)."""
    rec = buffer_record.get("stage")
    if rec is None:
        return stored
    stage = get_stage(rec["name"])
    out = bytearray(rec["raw_nbytes"])
    where = buffer_record["key"]
    stage.check(memoryview(stored), rec["params"], rec["raw_nbytes"], where)
    stage.decode(memoryview(stored), rec["params"], memoryview(out), where)
    return bytes(out)


def blockwise_entry(
    x: torch.Tensor, *, bits: int, block: int, reference: torch.Tensor | None = None
) -> EncodedEntry:
    """Encode ``x`` with the real codec, as the state API records a blockwise entry."""
    q = quantize(x, bits=bits, block=block, reference=reference)
    return EncodedEntry(
        codec="blockwise",
        params={"bits": bits, "block": block, "packing": "lsb-first", "delta": reference is not None},
        shape=tuple(x.shape),
        dtype=x.dtype,
        buffers={"codes": q.codes, "scales": q.scales},
    )


def exact_entry(x: torch.Tensor) -> EncodedEntry:
    """An entry stored exactly, as one ``data`` buffer."""
    return EncodedEntry(codec="exact", params={}, shape=tuple(x.shape), dtype=x.dtype, buffers={"data": x})


def sample_state(seed: int = 0, *, scale: int = 1) -> QuantizedState:
    """A small training-like state: blockwise weights (8/4/2 bits, with and without a
    reference), exact optimizer moments, integer and bool tensors, an RNG state, a 0-dim
    step, a zero-element tensor, an alias, and a skeleton with typed leaves."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64 * scale, 48, generator=g)
    ref = w + 0.01 * torch.randn(w.shape, generator=g)
    emb = torch.randn(100 * scale, 16, generator=g).to(torch.bfloat16)
    entries = {
        "model/encoder.0.weight": blockwise_entry(w, bits=8, block=128, reference=ref),
        "model/embed.weight": blockwise_entry(emb, bits=4, block=64),
        "model/head.weight": blockwise_entry(torch.randn(33, 7, generator=g).half(), bits=2, block=32),
        "model/encoder.0.bias": exact_entry(torch.randn(48, generator=g)),
        "optimizer/state/0/exp_avg": exact_entry(torch.randn(64 * scale, 48, generator=g)),
        "optimizer/state/0/step": exact_entry(torch.tensor(7.0)),
        "model/mask": exact_entry(torch.rand(5, 3, generator=g) > 0.5),
        "model/positions": exact_entry(torch.arange(11, dtype=torch.int64)),
        "rng/torch": exact_entry(torch.get_rng_state()),
        "model/empty": exact_entry(torch.empty(0, 4, dtype=torch.bfloat16)),
    }
    return QuantizedState(
        entries=entries,
        skeleton={
            "model": {"__tensor__": "model"},
            "step": 7,
            "lr": 0.001,
            "betas": {"__tuple__": [0.9, 0.999]},
            "name": "run-ü",
        },
        checkpoint_id=f"ckpt-{seed:04d}",
        reference_id="keyframe-0000",
        aliases={"model/lm_head.weight": "model/embed.weight"},
        rules=[["model/**.weight", "blockwise", {"bits": 8}], ["*", "exact", {}]],
        metadata={"step": 7, "wall_time": 12.5},
    )


def assert_same_state(a: QuantizedState, b: QuantizedState) -> None:
    """Every field equal; every buffer the same dtype, shape and bytes."""
    assert list(a.entries) == list(b.entries)
    for path, ea in a.entries.items():
        eb = b.entries[path]
        assert (ea.codec, ea.params, tuple(ea.shape), ea.dtype) == (
            eb.codec,
            eb.params,
            tuple(eb.shape),
            eb.dtype,
        ), path
        assert list(ea.buffers) == list(eb.buffers), path
        for name, ta in ea.buffers.items():
            tb = eb.buffers[name]
            assert ta.dtype == tb.dtype and ta.shape == tb.shape, (path, name)
            assert tb.device.type == "cpu"
            # Compare bytes, so that NaN payloads and -0.0 count too.
            ua = ta.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            ub = tb.contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(ua, ub), (path, name)
    assert a.skeleton == b.skeleton
    assert a.checkpoint_id == b.checkpoint_id
    assert a.reference_id == b.reference_id
    assert a.aliases == b.aliases
    assert a.rules == b.rules
    assert a.metadata == b.metadata
