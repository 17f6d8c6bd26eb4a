"""``ops.delta_statistics_many``: the grouped statistics kernel against the spec (the torch
``delta_statistics`` of each tensor).

Without a GPU the kernel runs under ``TRITON_INTERPRET=1`` on CPU tensors (the Triton
backend's function called directly); with one, compiled. Each tensor's four integers must
be the spec's: the maxima's bits always (a non-finite maximum: non-finite alike, NaN or
infinite as the spec's), the two sums wherever the spec's are defined (a maximum whose
level factor is finite; elsewhere the spec casts a NaN to an integer, and
``delta_bits.error_bound`` reads neither). The bits chosen from them are the spec's on
every input.
"""

from __future__ import annotations

import importlib
import math
import struct

import pytest
import torch
from _kernel_testing import (
    BLOCKS,
    FLOATS,
    KERNEL_DEVICE,
    max_examples,
    on_kernel_device,
    random_floats,
    require_runnable_kernels,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tw_triton import delta_bits, ops
from tw_triton.ops.backends.cpu import delta_statistics_many_cpu
from tw_triton.ops.backends.triton import delta_statistics_many_cuda
from tw_triton.ops.reference import delta_statistics_many_torch, delta_statistics_torch

require_runnable_kernels()

kernel_module = importlib.import_module("tw_triton.kernels.delta_statistics_grouped")
TILE = 4096
SPECIALS = [0.0, -0.0, 1e-45, 1e-39, 1e-36, 7e-31, 3.4e38, -3.4e38, float("nan"), float("inf"), -float("inf")]


def as_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def spec(xs: list[torch.Tensor], refs: list[torch.Tensor | None], block: int) -> list[int]:
    out = []
    for x, r in zip(xs, refs):
        out += [int(v) for v in delta_statistics_torch(x, r, block)] if x.numel() else [0, 0, 0, 0]
    return out


def grouped(xs: list[torch.Tensor], refs: list[torch.Tensor | None] | None, block: int) -> list[int]:
    out = torch.zeros(4 * len(xs), dtype=torch.int64, device=KERNEL_DEVICE)
    got = delta_statistics_many_cuda(
        [on_kernel_device(x) for x in xs],
        None if refs is None else [on_kernel_device(r) for r in refs],
        block,
        out=out,
    )
    assert got is out
    return out.tolist()


def sums_defined(top_bits: int, scale: float) -> bool:
    """Whether the spec's levels against a maximum are numbers: the maximum finite and its
    level factor ``scale / max(top, FLT_MIN)`` finite in fp32."""
    top = torch.tensor(as_float(top_bits), dtype=torch.float32)
    factor = scale / top.clamp_min(torch.finfo(torch.float32).tiny)
    return bool(torch.isfinite(top) and torch.isfinite(factor))


def assert_statistics_match(got: list[int], want: list[int], block: int) -> None:
    """Per tensor: the maxima's bits (NaN as NaN), the sums where the spec defines them,
    and the bits every candidate ``max_error`` chooses."""
    for k in range(0, len(want), 4):
        g, w = got[k : k + 4], want[k : k + 4]
        for j in (0, 1):
            if math.isnan(as_float(w[j])):
                assert math.isnan(as_float(g[j])), (k // 4, j, g, w)
            else:
                assert g[j] == w[j], (k // 4, j, g, w)
        if sums_defined(w[0], 4096.0):
            assert g[2] == w[2], (k // 4, g, w)
        if sums_defined(w[1], 256.0):
            assert g[3] == w[3], (k // 4, g, w)
        for bits in (2, 4, 8):
            assert delta_bits.error_bound(g, block, bits) == delta_bits.error_bound(w, block, bits), (
                k // 4,
                g,
                w,
            )
            for limit in (0.003, 0.015, 0.1):
                assert delta_bits.choose(g, block, bits, limit) == delta_bits.choose(w, block, bits, limit)


def check(xs: list[torch.Tensor], refs: list[torch.Tensor | None], block: int) -> list[int]:
    got = grouped(xs, refs, block)
    want = spec(xs, refs, block)
    assert_statistics_match(got, want, block)
    return got


def weights(
    gen: torch.Generator, n: int, dtype: torch.dtype, change: float
) -> tuple[torch.Tensor, torch.Tensor]:
    ref = torch.randn(n, generator=gen)
    x = ref + change * torch.randn(n, generator=gen) ** 3
    return x.to(dtype), ref.to(dtype)


@pytest.mark.parametrize("block", [32, 128, 4096])
def test_a_group_of_weights_gives_the_specs_integers(block) -> None:
    """Mixed sizes (whole tiles, tails, sizes not a multiple of the block), dtypes and
    changes, with and without references: every integer is the spec's, exactly."""
    gen = torch.Generator().manual_seed(block)
    xs, refs = [], []
    for i, n in enumerate([TILE, 2 * TILE + 100, 5000, 17, 3 * block + 1, 1, TILE - 1]):
        x, r = weights(gen, n, FLOATS[i % 3], (1e-4, 0.05, 2.0)[i % 3])
        xs.append(x)
        refs.append(r if i % 4 != 3 else None)
    got = check(xs, refs, block)
    assert got == spec(xs, refs, block)


def test_adversarial_values() -> None:
    """NaN and Inf in a tensor, in a reference, and in a difference only (two finite
    values whose difference overflows); zero tensors and zero changes; values below
    ``2**-100`` (the level factor overflows); ``-0.0``; a one-element tensor."""
    n = TILE + 37
    base = torch.randn(n, generator=torch.Generator().manual_seed(5))
    nan, inf = base.clone(), base.clone()
    nan[100], inf[TILE + 3] = float("nan"), float("inf")
    huge = torch.full((n,), 3.4e38)
    tiny = torch.full((n,), 1e-39)
    # Maxima above 2**126, whose reciprocals are subnormal: the factor is torch's rounded
    # reciprocal times the scale, not the quotient.
    large = base.clamp(-2, 2) * 1e38
    xs = [
        nan,
        base,
        inf,
        huge,
        torch.zeros(n),
        base,
        tiny,
        base * 1e-36,
        torch.full((n,), -0.0),
        base[:1],
        large,
    ]
    refs = [
        base,
        nan,
        None,
        -huge,
        None,
        base.clone(),
        torch.zeros(n),
        None,
        torch.zeros(n),
        None,
        -0.5 * large,
    ]
    got = check(xs, refs, 128)
    assert math.isnan(as_float(got[0])) and math.isnan(as_float(got[4]))  # NaN in x or ref
    assert as_float(got[8]) == math.inf and as_float(got[12]) == math.inf  # Inf; an overflowed difference
    assert got[16:20] == [0, 0, 0, 0]  # a zero tensor
    assert got[20] == 0 and got[23] > 0  # no change: A = 0, the tensor's own sum
    for k in (0, 1, 2, 3, 6, 7):  # the widest code wherever the statistics say nothing
        assert delta_bits.choose(got[4 * k : 4 * k + 4], 128, 2, 0.015) == (8, 127), k


def test_an_empty_tensor_keeps_zeros_and_other_dtypes_get_the_spec() -> None:
    """An empty tensor launches nothing; a float64 tensor, which the kernel does not read,
    gets the spec alone in the same call; views that are not 16-byte aligned or not
    contiguous are copied first."""
    gen = torch.Generator().manual_seed(2)
    x, r = weights(gen, 3 * TILE + 9, torch.float32, 0.01)
    matrix = torch.randn(96, 80, generator=gen)
    xs = [torch.zeros(0), x.double(), x[1:], matrix.t(), x]
    refs = [None, r.double(), r[1:], (matrix + 0.01).t(), r]
    got = check(xs, refs, 128)
    assert got[:4] == [0, 0, 0, 0]


@pytest.mark.parametrize("block", [32, 4096])
def test_every_backend_and_the_dispatch_give_the_spec(block) -> None:
    gen = torch.Generator().manual_seed(9)
    pairs = [weights(gen, n, dtype, 0.02) for n, dtype in [(5000, torch.float32), (333, torch.bfloat16)]]
    xs, refs = [p[0] for p in pairs], [p[1] for p in pairs]
    refs[1] = None
    want = spec(xs, refs, block)
    for fn in (delta_statistics_many_torch, delta_statistics_many_cpu, ops.delta_statistics_many):
        out = torch.zeros(8, dtype=torch.int64)
        assert fn(xs, refs, block, out=out) is out and out.tolist() == want, fn
    out = torch.zeros(0, dtype=torch.int64)
    assert ops.delta_statistics_many([], None, block, out=out) is out


def test_launches_per_dtype_pair_do_not_grow_with_the_tensors(monkeypatch) -> None:
    """Per pair of (tensor, reference) dtypes: the maxima and the sums, each in a launch of
    whole tiles and one of tails: four launches, whatever the number of tensors."""
    launches = []
    real = kernel_module.delta_statistics_grouped_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                launches.append((meta["SUMS"], meta["MASKED"]))
                return real[grid](*args, **meta)

            return launch

    monkeypatch.setattr(kernel_module, "delta_statistics_grouped_kernel", Spy())
    gen = torch.Generator().manual_seed(3)
    pairs = [weights(gen, n, torch.bfloat16, 0.01) for n in [TILE, 2 * TILE + 5, 17] * 5]
    check([p[0] for p in pairs], [p[1] for p in pairs], 128)
    assert sorted(launches) == [(False, False), (False, True), (True, False), (True, True)]


@settings(max_examples=max_examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tensors=st.lists(
        st.tuples(
            st.sampled_from([1, 15, 31, 128, 4095, 4096, 4097, 8192 + 33]),
            st.sampled_from(
                [
                    (torch.float32, torch.float32),
                    (torch.bfloat16, torch.bfloat16),
                    (torch.float16, torch.float32),
                    (torch.bfloat16, None),
                    (torch.float32, None),
                ]
            ),
            st.floats(-40.0, 30.0),
            st.sampled_from([0.0, 0.0, 0.01, 0.2]),
        ),
        min_size=1,
        max_size=5,
    ),
    block=st.sampled_from(BLOCKS),
    seed=st.integers(0, 2**31 - 1),
)
def test_any_group_gives_the_specs_integers(tensors, block, seed) -> None:
    """Any sizes, dtype pairs, scales from ``1e-40`` to ``1e30`` (fp16 overflows to Inf and
    underflows to subnormals there) and a share of special values."""
    gen = torch.Generator().manual_seed(seed)
    xs, refs = [], []
    for n, (dtype, ref_dtype), exp, specials in tensors:
        x = random_floats(gen, n, torch.float32, exp, exp + 1)
        pick = torch.rand(n, generator=gen) < specials
        x[pick] = torch.tensor(SPECIALS)[torch.randint(0, len(SPECIALS), (int(pick.sum()),), generator=gen)]
        change = random_floats(gen, n, torch.float32, exp - 3, exp - 1)
        xs.append(x.to(dtype))
        refs.append(None if ref_dtype is None else (x + change).to(ref_dtype))
    check(xs, refs, block)


def test_the_gpu_precompile_runs_the_kernel_for_every_blockwise_entry(monkeypatch) -> None:
    """benchmarks/gpu/_precompile.py: each blockwise grid entry also computes its tensor's
    statistics, so both passes' one-tensor launches (whole tiles, tail) of every dtype,
    with and without a reference, are compiled."""
    from _kernel_testing import GPU_BENCH_DIR

    monkeypatch.syspath_prepend(str(GPU_BENCH_DIR))
    import _precompile

    seen = set()
    real = kernel_module.delta_statistics_grouped_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(table, out, x_carrier, ref_carrier, *args, **meta):
                seen.add((x_carrier.dtype, meta["HAS_REF"], meta["SUMS"], meta["MASKED"]))
                return real[grid](table, out, x_carrier, ref_carrier, *args, **meta)

            return launch

    monkeypatch.setattr(kernel_module, "delta_statistics_grouped_kernel", Spy())
    firsts = {}
    for entry in _precompile.default_grid():
        if entry.codec == "blockwise":
            firsts.setdefault((entry.dtype, entry.has_ref), entry)
    with ops.using("delta_statistics_many", KERNEL_DEVICE.type, delta_statistics_many_cuda):
        for entry in firsts.values():
            _precompile.run_entry(entry, KERNEL_DEVICE)
    assert seen == {
        (dtype, has_ref, sums, masked)
        for dtype in FLOATS
        for has_ref in (False, True)
        for sums in (False, True)
        for masked in (False, True)
    }
