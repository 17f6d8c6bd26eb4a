"""``dequantize_log2_many`` (the log2 decode of many tensors per launch: a keyframe's second
moments, decoded to the reference its deltas are coded against) against the single-tensor
torch path.

Each tensor must decode to the bits the torch path gives it alone, for every output dtype,
whole tiles and tails, into scratch or in place into given outputs. Without a GPU the
kernel runs under ``TRITON_INTERPRET=1`` on CPU tensors (the Triton backend's function
called directly); with one, compiled.
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from _kernel_testing import KERNEL_DEVICE, on_kernel_device, require_runnable_kernels
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tw_triton import ops
from tw_triton.codecs import get_codec
from tw_triton.ops.backends.triton import dequantize_log2_many_cuda
from tw_triton.ops.reference import dequantize_log2_many_torch, dequantize_log2_torch, quantize_log2_torch

require_runnable_kernels()
kernel_module = importlib.import_module("tw_triton.kernels.dequantize_log2_grouped")
# Whole tiles only, a tail only, both, one element, one block.
SIZES = (4096, 5000, 33, 1, 128)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def moments(gen: torch.Generator, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Second-moment-like values: many octaves, some exact zeros."""
    x = torch.randn(n, generator=gen).square() * torch.exp2(
        torch.randint(-30, 0, (n,), generator=gen).float()
    )
    x[torch.rand(n, generator=gen) < 0.1] = 0.0
    return x.to(dtype)


def encoded_group(sizes, bits: int, block: int, dtype: torch.dtype, seed: int):
    """Tensors encoded by the torch path: ``([(codes, lo, hi)], wanted values)``."""
    gen = torch.Generator().manual_seed(seed)
    parts, want = [], []
    for n in sizes:
        codes, lo, hi = quantize_log2_torch(moments(gen, n, dtype), bits, block)
        parts.append((codes, lo, hi))
        want.append(dequantize_log2_torch(codes, lo, hi, n, bits, block, dtype))
    return parts, want


def decode_on_device(parts, sizes, bits, block, dtype, out=None):
    dev = [tuple(on_kernel_device(t) for t in p) for p in parts]
    return dequantize_log2_many_cuda(
        [c for c, _, _ in dev],
        [lo for _, lo, _ in dev],
        [hi for _, _, hi in dev],
        list(sizes),
        bits,
        block,
        dtype,
        out=out,
    )


def assert_same(got, want, dtype) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == dtype and g.numel() == w.numel(), i
        assert torch.equal(g.cpu().reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), (
            f"tensor {i} differs"
        )


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,block", [(4, 128), (8, 32), (2, 4096)])
def test_a_group_decodes_each_tensor_to_the_torch_paths_bits(
    bits, block, dtype, in_place, monkeypatch
) -> None:
    parts, want = encoded_group(SIZES, bits, block, dtype, seed=bits + block)
    scratch: list = []
    real = kernel_module.group_outputs
    monkeypatch.setattr(kernel_module, "group_outputs", lambda n, *a: scratch.extend(n) or real(n, *a))
    out = [torch.full((n,), 7.0, dtype=dtype, device=KERNEL_DEVICE) for n in SIZES] if in_place else None
    got = decode_on_device(parts, SIZES, bits, block, dtype, out)
    assert_same(got, want, dtype)
    # In place: the kernel wrote the given outputs themselves, no scratch buffer.
    assert scratch == ([] if in_place else list(SIZES)), scratch
    if in_place:
        assert all(g is o for g, o in zip(got, out)), "not decoded into the outputs"


def test_outputs_the_kernel_cannot_write_where_they_are_are_copied_into() -> None:
    sizes = (5000, 300)
    parts, want = encoded_group(sizes, 4, 128, torch.float32, seed=9)
    odd = [torch.zeros(n + 1, dtype=torch.float32, device=KERNEL_DEVICE)[1:] for n in sizes]  # 4 bytes off 16
    # Codes 1 byte off 16 (the backend reads a copy) and bounds in views.
    off = [(on_kernel_device(torch.cat([c.new_zeros(1), c]))[1:], lo, hi) for c, lo, hi in parts]
    got = decode_on_device(off, sizes, 4, 128, torch.float32, odd)
    assert all(g is o for g, o in zip(got, odd))
    assert_same(got, want, torch.float32)


def test_the_reference_op_decodes_into_its_outputs() -> None:
    parts, want = encoded_group((700, 5000), 4, 128, torch.bfloat16, seed=5)
    out = [torch.empty(n, dtype=torch.bfloat16) for n in (700, 5000)]
    got = dequantize_log2_many_torch(
        [c for c, _, _ in parts],
        [lo for _, lo, _ in parts],
        [hi for _, _, hi in parts],
        [700, 5000],
        4,
        128,
        torch.bfloat16,
        out=out,
    )
    assert all(g is o for g, o in zip(got, out))
    assert_same(got, want, torch.bfloat16)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 9000), min_size=1, max_size=3),
    bits=st.sampled_from([8, 4, 2]),
    block=st.sampled_from([32, 128, 4096]),
    dtype=st.sampled_from(DTYPES),
    in_place=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_any_group_decodes_like_the_torch_path(sizes, bits, block, dtype, in_place, seed) -> None:
    parts, want = encoded_group(sizes, bits, block, dtype, seed)
    out = [torch.empty(n, dtype=dtype, device=KERNEL_DEVICE) for n in sizes] if in_place else None
    got = decode_on_device(parts, sizes, bits, block, dtype, out)
    assert_same(got, want, dtype)


@pytest.mark.parametrize("kernel", [False, True])
def test_the_codecs_grouped_decode_gives_its_decodes_values_in_place(kernel) -> None:
    """``Log2Codec.decode_group`` (the op through the dispatch: the torch reference, or the
    kernel) gives what ``decode`` gives each entry alone, written into the ``outs`` that
    fit (a tensor of another dtype gets a fresh result)."""
    codec = get_codec("log2")
    params = codec.resolve_params({}, bits=4, block=128)
    gen = torch.Generator().manual_seed(6)
    xs = [moments(gen, 5000, torch.float32).view(50, 100), moments(gen, 33, torch.bfloat16)]
    entries = [codec.encode(x, params, None).entry for x in xs]
    assert codec.decode_group_key(entries[0], None) == (4, 128, torch.float32)
    assert codec.decode_group_key(entries[1], None) == (4, 128, torch.bfloat16)
    assert codec.decode_group_key(entries[0], xs[0]) is None
    want = [codec.decode(e, None, None, "test") for e in entries]
    dev_entries = [
        type(e)(e.codec, e.params, e.shape, e.dtype, {k: on_kernel_device(b) for k, b in e.buffers.items()})
        for e in entries
    ]
    outs = [torch.empty(50, 100, device=KERNEL_DEVICE)]
    backend = ops.using("dequantize_log2_many", KERNEL_DEVICE.type, dequantize_log2_many_cuda)
    with backend if kernel else contextlib.nullcontext():
        got = codec.decode_group(dev_entries[:1], [None], KERNEL_DEVICE, ["a"], outs)
        other = codec.decode_group(dev_entries[1:], [None], KERNEL_DEVICE, ["b"], [torch.empty(33)])
    assert got[0] is outs[0]
    assert got[0].shape == (50, 100) and other[0].shape == (33,)
    for g, w in zip(got + other, want):
        assert g.dtype == w.dtype and torch.equal(g.cpu().view(torch.uint8), w.view(torch.uint8))
