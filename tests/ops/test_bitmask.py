"""The bitmask ops' reference (the spec of the sparse codec's layout): round trips bit for
bit, the mask's layout, chunking and the dispatch through :mod:`tw_triton.ops`."""

from __future__ import annotations

import pytest
import torch
from _kernel_testing import FLOATS, INT_VIEW, bit_patterns, numels, same_bits, shapes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tw_triton import ops
from tw_triton.errors import QuantizationError
from tw_triton.ops.reference import bitmask as spec


def mask_by_loop(x: torch.Tensor) -> list[int]:
    """The mask as the format defines it, one element at a time."""
    flat = x.reshape(-1).view(INT_VIEW[x.dtype]).tolist()
    out = [0] * ((len(flat) + 7) // 8)
    for i, v in enumerate(flat):
        if v != 0:
            out[i // 8] |= 1 << (i % 8)
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    numel=numels(),
    dtype=st.sampled_from(FLOATS),
    zeros=st.sampled_from((0.0, 0.1, 0.5, 0.9, 1.0)),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_round_trip_is_bit_exact(numel, dtype, zeros, seed, data) -> None:
    x = bit_patterns(torch.Generator().manual_seed(seed), numel, dtype, zeros).view(data.draw(shapes(numel)))
    mask, values = ops.bitmask_encode(x)
    flat = x.reshape(-1).view(INT_VIEW[dtype])
    assert mask.tolist() == mask_by_loop(x)
    assert same_bits(values, x.reshape(-1)[flat != 0])
    assert int(spec.nonzero_count(x)) == values.numel()
    back = ops.bitmask_decode(mask, values, numel)
    assert same_bits(back, x.reshape(-1))


@pytest.mark.parametrize("dtype", FLOATS)
def test_edges_empty_all_zero_none_zero_negative_zero_nan(dtype) -> None:
    cases = [
        torch.zeros(0, dtype=dtype),
        torch.zeros(13, dtype=dtype),
        torch.ones(13, dtype=dtype),
        torch.full((9,), -0.0, dtype=dtype),
        torch.tensor([0.0, float("nan"), -0.0, 0.0, float("inf"), float("-inf"), 0.0, 1e-40], dtype=dtype),
    ]
    for x in cases:
        mask, values = ops.bitmask_encode(x)
        assert mask.numel() == (x.numel() + 7) // 8
        assert same_bits(ops.bitmask_decode(mask, values, x.numel()), x)
    assert ops.bitmask_encode(cases[1])[1].numel() == 0
    assert ops.bitmask_encode(cases[3])[1].numel() == 9  # -0.0 is a value, not a zero


def test_chunks_strides_and_given_outputs(monkeypatch) -> None:
    """Several chunks (at a size that is not a multiple of 8), a transposed input and
    outputs given by the caller give the same bytes as one chunk."""
    gen = torch.Generator().manual_seed(3)
    x = bit_patterns(gen, 3 * 1001, torch.float32, 0.5).view(3, 1001)
    whole = ops.bitmask_encode(x)
    monkeypatch.setattr(spec, "CHUNK_ELEMENTS", 100)
    t = x.t().contiguous().t()
    assert not t.is_contiguous()
    for got in (ops.bitmask_encode(x), ops.bitmask_encode(t)):
        assert torch.equal(got[0], whole[0]) and same_bits(got[1], whole[1])
    out = (torch.empty_like(whole[0]), torch.empty_like(whole[1]))
    got = ops.bitmask_encode(x, nnz=whole[1].numel(), out=out)
    assert got[0] is out[0] and torch.equal(out[0], whole[0]) and same_bits(out[1], whole[1])
    back = torch.empty(x.numel(), dtype=x.dtype)
    assert ops.bitmask_decode(whole[0], whole[1], x.numel(), out=back) is back
    assert same_bits(back, x.reshape(-1))


def test_a_wrong_count_is_refused() -> None:
    x = torch.tensor([0.0, 1.0, 2.0, 0.0])
    for nnz in (1, 3):
        with pytest.raises(QuantizationError, match="nnz"):
            ops.bitmask_encode(x, nnz=nnz)


def test_ops_dispatch_to_the_reference_on_the_cpu() -> None:
    assert "bitmask_encode" in ops.OPS and "bitmask_decode" in ops.OPS
    calls = []
    ref = ops.registry.reference("bitmask_encode")

    def traced(*args, **kwargs):
        calls.append(1)
        return ref(*args, **kwargs)

    with ops.using("bitmask_encode", "cpu", traced):
        ops.bitmask_encode(torch.zeros(4))
    assert calls == [1]
