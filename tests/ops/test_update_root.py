"""The op ``update_root`` (the ``blockwise-update`` codec's ``sqrt(v) + eps``): the compiled
CPU code (``tw_triton/csrc/update_root.c``, each build) against the torch spec, bit for bit,
on zeros, ``-0``, subnormals, the largest values, Inf, NaN and negatives, any ``eps``; and
the op taking the C path when the library is built, the spec when it is off."""

from __future__ import annotations

import pytest
import torch
from _native_builds import build_id, native_builds, use_build
from hypothesis import given, settings
from hypothesis import strategies as st

from tw_triton import ops
from tw_triton.ops.backends import native, native_update
from tw_triton.ops.reference import update_root_torch

F32_MAX = torch.finfo(torch.float32).max
SPECIALS = [0.0, -0.0, 1e-45, 1e-40, 1.1754944e-38, 1.0, 2.0, 3e38, F32_MAX, float("inf")]
BAD = [float("nan"), -1.0, -1e-45, -float("inf")]


@pytest.fixture(params=native_builds() or [None], ids=build_id)
def lib(request, monkeypatch):
    """Each build in turn (an AVX2 machine would otherwise only run the AVX2 one)."""
    return use_build(request.param, monkeypatch, native_update)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN for NaN (a NaN's sign and payload differ between torch's own scalar
    and vector paths, so the spec fixes none; the codec stores such an entry exact)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(
        a[~nan].view(torch.int32), b[~nan].view(torch.int32)
    )


def _values(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mags = torch.rand(n, generator=g) * torch.exp2(torch.randint(-149, 128, (n,), generator=g).float())
    return torch.cat([mags, torch.tensor(SPECIALS + BAD)])


@pytest.mark.parametrize("eps", [1e-8, 1e-6, 0.0, 1e-45, 3e38])
def test_the_compiled_root_is_the_specs_bit_for_bit(lib, eps) -> None:
    v = _values(0, 200_000)
    assert _same(native_update.update_root_native(v, eps), update_root_torch(v, eps))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=0, max_size=300),
    st.floats(min_value=0.0, max_value=0.0010000000474974513, width=32),
)
def test_the_op_is_the_spec_on_any_values(values, eps) -> None:
    v = torch.tensor(values, dtype=torch.float32)
    assert _same(ops.update_root(v, eps), update_root_torch(v, eps))


def test_the_op_takes_the_c_path_when_built_and_the_spec_when_off(monkeypatch) -> None:
    v = _values(1, 5000)
    calls = []
    real = native_update.update_root_native
    monkeypatch.setattr(native_update, "update_root_native", lambda *a: calls.append(1) or real(*a))
    got = ops.update_root(v, 1e-8)
    assert _same(got, update_root_torch(v, 1e-8)) and calls
    monkeypatch.setenv(native.ENV_NATIVE, "0")
    assert native_update.update_root_native(v, 1e-8) is None  # off: the spec serves the op
    assert _same(ops.update_root(v, 1e-8), update_root_torch(v, 1e-8))
    # A view or another dtype is not taken by the C code: the spec serves it.
    assert native_update.update_root_native(v[::2], 1e-8) is None
    assert native_update.update_root_native(v.double(), 1e-8) is None


@pytest.mark.parametrize("eps", [1e-8, 0.0, 3e38])
def test_the_compiled_update_and_moment_are_the_specs(lib, eps) -> None:
    from tw_triton.ops.reference import update_divide_torch, update_multiply_torch

    x, v = _values(2, 100_000), _values(3, 100_000).abs()
    assert _same(native_update.update_divide_native(x, v, eps), update_divide_torch(x, v, eps))
    for big in (F32_MAX, 65504.0):
        u = x.clone()
        assert native_update.update_multiply_native(u, v, eps, big)
        assert _same(u, update_multiply_torch(x.clone(), v, eps, big))
    assert native_update.update_divide_native(x[::2], v[::2], eps) is None
    assert not native_update.update_multiply_native(x.double(), v.double(), eps, F32_MAX)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(width=32), st.floats(width=32)), min_size=0, max_size=200),
    st.floats(min_value=0.0, max_value=0.0010000000474974513, width=32),
)
def test_the_update_ops_are_the_specs_on_any_values(pairs, eps) -> None:
    from tw_triton.ops.reference import update_divide_torch, update_multiply_torch

    x = torch.tensor([a for a, _ in pairs], dtype=torch.float32)
    v = torch.tensor([b for _, b in pairs], dtype=torch.float32)
    assert _same(ops.update_divide(x, v, eps), update_divide_torch(x, v, eps))
    assert _same(
        ops.update_multiply(x.clone(), v, eps, F32_MAX), update_multiply_torch(x.clone(), v, eps, F32_MAX)
    )
