"""``dequantize_log2_temporal_many`` (the temporal decode of many tensors per launch, the
closed-loop advance of a save's second moments) against the single-tensor torch path.

Each tensor must decode to the bits the torch path gives it alone, absolute and temporal
blocks, whole tiles and tails, and, written over its own reference (``out``), still from the
reference's values before the write. Without a GPU the kernel runs under
``TRITON_INTERPRET=1`` on CPU tensors (the Triton backend's function called directly); with
one, compiled.
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from _kernel_testing import KERNEL_DEVICE, on_kernel_device, require_runnable_kernels
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_quantize_log2_temporal_many import moments

from tw_triton import ops
from tw_triton.codecs import get_codec
from tw_triton.codecs.log2_temporal import group_stored, split_stored
from tw_triton.ops.backends.triton import dequantize_log2_temporal_many_cuda
from tw_triton.ops.reference import (
    dequantize_log2_temporal_many_torch,
    dequantize_log2_temporal_torch,
    quantize_log2_temporal_torch,
)

require_runnable_kernels()
kernel_module = importlib.import_module("tw_triton.kernels.dequantize_log2_temporal_grouped")
MIN_STEP = 1 << 19
# Whole tiles only, a tail only, both, one element, one block.
SIZES = (4096, 5000, 33, 1, 128)


def encoded_group(sizes, bits: int, block: int, min_step: int, seed: int, drift: float = 0.05):
    """Moments and their references, encoded (torch) into one group's stored buffers, as
    the grouped encode stores them: ``(refs, stored, [(codes, lo, hi)], wanted values)``."""
    gen = torch.Generator().manual_seed(seed)
    pairs = [moments(gen, n, drift=drift) for n in sizes]
    stored = group_stored(list(sizes), block, torch.device("cpu"))
    parts, want = [], []
    for (x, r), s in zip(pairs, stored):
        codes, lo, hi = quantize_log2_temporal_torch(x, r, bits, block, min_step)
        views = split_stored(s, x.numel(), block)
        for v, t in zip(views, (codes, lo, hi)):
            v.copy_(t)
        parts.append(views)
        want.append(dequantize_log2_temporal_torch(codes, lo, hi, r, x.numel(), bits, block, min_step))
    return [r for _, r in pairs], stored, parts, want


def decode_on_device(refs, stored, parts, bits, block, min_step, in_place: bool):
    """The group decoded by the kernel on the kernel device (into copies of the references
    when ``in_place``); returns the results and the outputs handed over."""
    dev_stored = [on_kernel_device(s) for s in stored]
    dev_parts = [split_stored(s, c.numel(), block) for s, (c, _, _) in zip(dev_stored, parts)]
    dev_refs = [on_kernel_device(r).clone() for r in refs]
    out = dev_refs if in_place else None
    got = dequantize_log2_temporal_many_cuda(
        [c for c, _, _ in dev_parts],
        [lo for _, lo, _ in dev_parts],
        [hi for _, _, hi in dev_parts],
        dev_refs,
        bits,
        block,
        min_step,
        out=out,
    )
    return got, out


def assert_same(got, want) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == torch.float32 and g.numel() == w.numel(), i
        assert torch.equal(g.cpu().reshape(-1).view(torch.int32), w.reshape(-1).view(torch.int32)), (
            f"tensor {i} differs"
        )


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("bits,block", [(4, 128), (8, 32), (2, 4096)])
def test_a_group_decodes_each_tensor_to_the_torch_paths_bits(bits, block, in_place, monkeypatch) -> None:
    refs, stored, parts, want = encoded_group(SIZES, bits, block, MIN_STEP, seed=bits + block)
    scratch: list = []
    real = kernel_module.group_outputs
    monkeypatch.setattr(kernel_module, "group_outputs", lambda n, *a: scratch.extend(n) or real(n, *a))
    # Both kinds of block are there: temporal (bounds 0, 0) and absolute (the jumps).
    lo = torch.cat([p[1] for p in parts])
    assert bool((lo == 0).any()) and bool((lo > 0).any())
    got, out = decode_on_device(refs, stored, parts, bits, block, MIN_STEP, in_place)
    assert_same(got, want)
    # In place: the kernel wrote the references themselves, no scratch buffer.
    assert scratch == ([] if in_place else list(SIZES)), scratch
    if in_place:
        assert all(g is o for g, o in zip(got, out)), "not decoded into the references"


def test_outputs_and_references_the_kernel_cannot_use_where_they_are_are_copied() -> None:
    refs, stored, parts, want = encoded_group((5000, 300), 4, 128, MIN_STEP, seed=9)
    odd = [torch.empty(r.numel() + 1, dtype=torch.float32, device=KERNEL_DEVICE)[1:] for r in refs]
    for o, r in zip(odd, refs):
        o.copy_(on_kernel_device(r))  # the references, 4 bytes off 16: decoded over
    dev = [split_stored(on_kernel_device(s), r.numel(), 128) for s, r in zip(stored, refs)]
    lo_alone = [lo.clone() for _, lo, _ in dev]  # bounds in separate tensors
    got = dequantize_log2_temporal_many_cuda(
        [c for c, _, _ in dev], lo_alone, [hi.clone() for _, _, hi in dev], odd, 4, 128, MIN_STEP, out=odd
    )
    assert all(g is o for g, o in zip(got, odd))
    assert_same(got, want)


def test_the_reference_op_decodes_over_its_references() -> None:
    refs, _, parts, want = encoded_group((700, 5000), 4, 128, MIN_STEP, seed=5)
    out = [r.clone() for r in refs]
    got = dequantize_log2_temporal_many_torch(
        [c for c, _, _ in parts],
        [lo for _, lo, _ in parts],
        [hi for _, _, hi in parts],
        out,
        4,
        128,
        MIN_STEP,
        out=out,
    )
    assert all(g is o for g, o in zip(got, out))
    assert_same(got, want)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 9000), min_size=1, max_size=3),
    bits=st.sampled_from([8, 4, 2]),
    block=st.sampled_from([32, 128, 4096]),
    drift=st.sampled_from([0.0, 0.05, 2.0]),
    min_step=st.sampled_from([1, MIN_STEP, 1 << 29]),
    in_place=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_any_group_decodes_like_the_torch_path(sizes, bits, block, drift, min_step, in_place, seed) -> None:
    refs, stored, parts, want = encoded_group(sizes, bits, block, min_step, seed, drift=drift)
    got, _ = decode_on_device(refs, stored, parts, bits, block, min_step, in_place)
    assert_same(got, want)


@pytest.mark.parametrize("kernel", [False, True])
def test_the_codecs_grouped_decode_gives_its_decodes_values_in_place(kernel) -> None:
    """``Log2TemporalCodec.decode_group`` (the op through the dispatch: the torch reference,
    or the kernel) gives what ``decode`` gives each entry alone, written over the
    references handed over as ``outs``."""
    codec = get_codec("log2-temporal")
    params = codec.resolve_params({}, bits=4, block=128)
    gen = torch.Generator().manual_seed(6)
    pairs = [moments(gen, n) for n in (5000, 33)]
    xs, refs = [x.view(-1, 1) for x, _ in pairs], [r.view(-1, 1) for _, r in pairs]
    flags = torch.zeros(2, dtype=torch.int64)
    entries = [e.entry for e in codec.encode_group(xs, params, refs, flags)]
    assert codec.decode_group_key(entries[0], refs[0]) == (4, 128, params["min_step"])
    assert codec.decode_group_key(entries[0], None) is None
    assert codec.decode_group_key(entries[0], refs[1]) is None  # another shape: alone
    want = [codec.decode(e, r, None, "test") for e, r in zip(entries, refs)]
    dev_entries = [
        type(e)(e.codec, e.params, e.shape, e.dtype, {"codes": on_kernel_device(e.buffers["codes"])})
        for e in entries
    ]
    outs = [on_kernel_device(r).clone() for r in refs]
    backend = ops.using(
        "dequantize_log2_temporal_many", KERNEL_DEVICE.type, dequantize_log2_temporal_many_cuda
    )
    with backend if kernel else contextlib.nullcontext():
        got = codec.decode_group(dev_entries, outs, KERNEL_DEVICE, ["a", "b"], outs)
    assert all(g is o for g, o in zip(got, outs))
    assert_same(got, want)
