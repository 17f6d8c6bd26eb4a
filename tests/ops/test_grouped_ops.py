"""The grouped ops (many tensors per launch) against the single-tensor torch path.

``quantize_blockwise_many``'s and ``quantize_log2_many``'s kernels walk a table of
tensors; each tensor's buffers must be the bytes the torch path gives it alone, and its
flag raised exactly where one of its blocks cannot be coded. ``fingerprints``' kernel must give the
reference's int64 per tensor. Without a GPU the kernels run under ``TRITON_INTERPRET=1``
on CPU tensors (the Triton backend's functions called directly); with one, compiled.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from _kernel_testing import (
    FLOATS,
    KERNEL_DEVICE,
    assert_same_bits,
    on_kernel_device,
    random_floats,
    require_runnable_kernels,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tw_triton.errors import QuantizationError
from tw_triton.ops.backends.triton import (
    copy_many_cuda,
    dequantize_blockwise_many_cuda,
    fingerprints_cuda,
    quantize_blockwise_many_cuda,
    quantize_log2_many_cuda,
)
from tw_triton.ops.reference import (
    dequantize_blockwise_torch,
    fingerprint_torch,
    quantize_blockwise_torch,
    quantize_log2_torch,
)

require_runnable_kernels()

grouped_module = importlib.import_module("tw_triton.kernels.tiles")


def assert_group_encodes_like_torch(
    xs: list[torch.Tensor],
    refs: list[torch.Tensor] | None,
    bits: int,
    block: int,
    qmax: int | list[int | None] | None = None,
) -> torch.Tensor:
    """Encode ``xs`` as one group on the kernel device and each alone with torch on the CPU
    (``qmax``: one for all, or tensor ``i``'s at ``i``)."""
    flags = torch.zeros(len(xs), dtype=torch.int64, device=KERNEL_DEVICE)
    pairs = quantize_blockwise_many_cuda(
        [on_kernel_device(x) for x in xs],
        None if refs is None else [on_kernel_device(r) for r in refs],
        bits,
        block,
        flags=flags,
        qmax=qmax,
    )
    assert len(pairs) == len(xs)
    for i, (x, (codes, scales)) in enumerate(zip(xs, pairs)):
        ref = None if refs is None else refs[i]
        q = qmax if qmax is None or isinstance(qmax, int) else qmax[i]
        t_codes, t_scales = quantize_blockwise_torch(x, ref, bits, block, qmax=q)
        assert torch.equal(codes.cpu(), t_codes), f"tensor {i}: codes differ"
        assert torch.equal(scales.cpu().view(torch.int32), t_scales.view(torch.int32)), (
            f"tensor {i}: scales differ"
        )
        assert int(flags[i]) == int(torch.isinf(t_scales).any()), f"tensor {i}: flag {int(flags[i])}"
    return flags


# Sizes around the tile (4096 elements) and block boundaries: whole tiles only, a tail
# only, both, one element, none.
SIZES = (4096, 5000, 33, 9000, 4096 * 3 + 7, 1, 0, 128)


@pytest.mark.parametrize("bits,block", [(8, 128), (4, 32), (2, 4096), (4, 1024)])
@pytest.mark.parametrize("with_ref", [False, True])
def test_group_of_mixed_dtypes_and_sizes_gives_each_tensors_own_bytes(bits, block, with_ref) -> None:
    gen = torch.Generator().manual_seed(bits * block)
    dtypes = [FLOATS[i % 3] for i in range(len(SIZES))]
    xs = [random_floats(gen, n, d, -3, 2) for n, d in zip(SIZES, dtypes)]
    refs = None
    if with_ref:
        refs = [(x.double() + 1e-3 * torch.randn(x.shape, generator=gen, dtype=torch.float64)) for x in xs]
        refs = [r.to(FLOATS[(i + 1) % 3]) for i, r in enumerate(refs)]
    assert_group_encodes_like_torch(xs, refs, bits, block)


def test_views_that_are_not_aligned_or_not_contiguous_are_read_in_order() -> None:
    gen = torch.Generator().manual_seed(3)
    base = random_floats(gen, 9001, torch.bfloat16, -2, 2)
    matrix = random_floats(gen, 100 * 90, torch.float32, -2, 2).view(100, 90)
    xs = [base[1:], matrix.t(), base[8:4104]]  # 2 bytes off, transposed, 16 bytes off
    assert not grouped_module.aligned(xs[0]) and not xs[1].is_contiguous() and grouped_module.aligned(xs[2])
    refs = [torch.zeros_like(x) + 0.5 for x in xs]
    assert_group_encodes_like_torch(xs, refs, 4, 128)


def test_flags_are_raised_only_for_tensors_with_a_nonfinite_block_and_never_cleared() -> None:
    gen = torch.Generator().manual_seed(4)
    xs = [random_floats(gen, n, torch.float32, -1, 1) for n in (5000, 4096, 70, 9000)]
    xs[1][4000] = float("inf")  # in a whole tile
    xs[3][8999] = float("nan")  # in the tail tile
    flags = assert_group_encodes_like_torch(xs, None, 8, 128)
    assert flags.tolist() == [0, 1, 0, 1]
    # A reference whose difference overflows flags the tensor too.
    big = torch.full((300,), 3e38)
    flags = assert_group_encodes_like_torch([big], [-big], 8, 32)
    assert flags.tolist() == [1]
    raised = torch.tensor([1, 0], dtype=torch.int64, device=KERNEL_DEVICE)
    quantize_blockwise_many_cuda([on_kernel_device(xs[0])] * 2, None, 8, 128, flags=raised)
    assert raised.tolist() == [1, 0]


def test_narrowed_qmax_is_applied_to_every_tensor() -> None:
    gen = torch.Generator().manual_seed(5)
    xs = [random_floats(gen, n, torch.bfloat16, -1, 1) for n in (4096, 300)]
    assert_group_encodes_like_torch(xs, None, 4, 64, qmax=3)


def ties_at(qmax: int, n: int, block: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` fp32 values whose blocks' absmax is ``qmax * 2**-4``, so that at ``qmax`` the
    scale is ``2**-4`` and every other element ``d / s`` an exact half-integer (a tie); at
    another ``qmax`` the scale and codes differ."""
    k = torch.randint(-qmax, qmax, (n,), generator=gen).double() + 0.5
    k[::block] = qmax
    return (k * 2.0**-4).float()


@pytest.mark.parametrize("bits", [8, 4])
def test_each_tensor_is_coded_with_its_own_qmax(bits) -> None:
    """One group, tensors coded with different numbers of levels in one container (the
    ``max_error`` choice's any ``qmax``): each gets the bytes of its own ``qmax`` alone,
    ties at that ``qmax`` included, in the whole-tile launch and the tail launch."""
    gen = torch.Generator().manual_seed(bits)
    top = (1 << (bits - 1)) - 1
    qmaxes = [top, 1, 2, None, top - 1, 5 if bits == 8 else 3, 3, 1 + top // 2]
    sizes = [4096, 5000, 33, 4096 * 2 + 7, 128, 9000, 4096, 300]
    xs = [ties_at(q or top, n, 64, gen) for q, n in zip(qmaxes, sizes)]
    refs = [torch.zeros(n, dtype=d) for n, d in zip(sizes, FLOATS * 3)]
    assert_group_encodes_like_torch(xs, refs, bits, 64, qmax=qmaxes)
    assert_group_encodes_like_torch([x.bfloat16() for x in xs], None, bits, 64, qmax=qmaxes)


def test_a_qmax_per_tensor_is_checked_per_tensor() -> None:
    xs = [torch.ones(64), torch.ones(64)]
    flags = torch.zeros(2, dtype=torch.int64)
    for bad in ([3], [3, 8], [3, 0], [3, 2.0]):
        with pytest.raises(QuantizationError, match="qmax"):
            quantize_blockwise_many_cuda(xs, None, 4, 32, flags=flags, qmax=bad)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 9000), min_size=1, max_size=5),
    bits=st.sampled_from([8, 4, 2]),
    block=st.sampled_from([32, 128, 512, 4096]),
    dtype=st.sampled_from(FLOATS),
    ref_dtype=st.sampled_from((None, *FLOATS)),
    seed=st.integers(0, 2**31 - 1),
    levels=st.lists(st.integers(0, 127), min_size=5, max_size=5),
)
def test_any_group_matches_the_torch_path(sizes, bits, block, dtype, ref_dtype, seed, levels) -> None:
    """Any tensors, each with any ``qmax`` its container holds (``None``: the full range)."""
    gen = torch.Generator().manual_seed(seed)
    xs = [random_floats(gen, n, dtype, -6, 4, zero_fraction=0.1) for n in sizes]
    refs = None if ref_dtype is None else [random_floats(gen, n, ref_dtype, -6, 4) for n in sizes]
    top = (1 << (bits - 1)) - 1
    qmax = [None if q == 0 else 1 + (q - 1) % top for q in levels[: len(sizes)]]
    assert_group_encodes_like_torch(xs, refs, bits, block, qmax=qmax)


def test_fingerprints_match_the_reference_in_one_call_per_dtype() -> None:
    gen = torch.Generator().manual_seed(6)
    sizes = (0, 1, 2047, 2048, 2049, 4096 * 3 + 1, 100_000)
    ts = [random_floats(gen, n, FLOATS[i % 3], -40, 30, zero_fraction=0.1) for i, n in enumerate(sizes)]
    ts.append(torch.randn(5000, generator=gen, dtype=torch.float64))  # no kernel: the reference
    ts.append(random_floats(gen, 64 * 64, torch.float32, -1, 1).view(64, 64).t())  # not contiguous
    out = torch.full((len(ts),), -1, dtype=torch.int64, device=KERNEL_DEVICE)
    fingerprints_cuda([on_kernel_device(t) for t in ts], out=out)
    want = [int(fingerprint_torch(t)) for t in ts]
    assert out.tolist() == want


def assert_log2_group_encodes_like_torch(xs: list[torch.Tensor], bits: int, block: int) -> torch.Tensor:
    flags = torch.zeros(len(xs), dtype=torch.int64, device=KERNEL_DEVICE)
    triples = quantize_log2_many_cuda([on_kernel_device(x) for x in xs], bits, block, flags=flags)
    for i, (x, got) in enumerate(zip(xs, triples)):
        want = quantize_log2_torch(x, bits, block)
        for name, g, w in zip(("codes", "lo", "hi"), got, want):
            assert torch.equal(g.cpu(), w), f"tensor {i}: {name} differ"
        assert int(flags[i]) == int((want[2] < 0).any()), f"tensor {i}: flag {int(flags[i])}"
    return flags


@pytest.mark.parametrize("bits,block", [(4, 128), (8, 32), (2, 4096)])
def test_log2_group_gives_each_tensors_own_bytes(bits, block) -> None:
    gen = torch.Generator().manual_seed(bits + block)
    xs = [random_floats(gen, n, FLOATS[i % 3], -12, 3, zero_fraction=0.2).abs() for i, n in enumerate(SIZES)]
    xs[2][3] = -1.0  # a negative element: that tensor cannot be coded
    xs[4][-1] = float("nan")  # in the tail tile
    xs.append(xs[0][1:])  # not aligned
    flags = assert_log2_group_encodes_like_torch(xs, bits, block)
    assert flags[2] == 1 and flags[4] == 1 and flags[0] == 0


def test_grouped_copy_gives_each_tensor_its_own_bytes() -> None:
    gen = torch.Generator().manual_seed(7)
    xs = [
        torch.randint(-(2**62), 2**62, (1000,), generator=gen, dtype=torch.int64),
        torch.randn(4096 * 2 + 3, generator=gen).to(torch.bfloat16),
        torch.rand(37, generator=gen) > 0.5,
        torch.randn(4096, generator=gen),
        torch.randn(4097, generator=gen).to(torch.float16)[1:],  # not aligned: cloned alone
        torch.randn(8, 9, generator=gen).t(),  # not contiguous: cloned alone
        torch.empty(0, dtype=torch.int32),
        torch.tensor(3.5, dtype=torch.float64),  # 0-dim
    ]
    copies = copy_many_cuda([on_kernel_device(x) for x in xs])
    for x, c in zip(xs, copies):
        assert c.dtype == x.dtype and c.shape == x.shape and c.is_contiguous()
        assert torch.equal(c.cpu(), x), (x.dtype, x.shape)
    if KERNEL_DEVICE.type == "cpu":  # the copies are new memory, not the inputs
        assert all(c.data_ptr() != x.data_ptr() for x, c in zip(xs, copies) if x.numel())


@pytest.mark.parametrize("bits,block", [(8, 128), (4, 32), (2, 4096)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_grouped_decode_gives_each_tensor_its_own_values(bits, block, dtype) -> None:
    gen = torch.Generator().manual_seed(bits * 7 + block)
    xs = [random_floats(gen, n, dtype, -3, 2) for n in SIZES]
    refs = [
        (x.double() + 1e-2 * torch.randn(x.shape, generator=gen, dtype=torch.float64)).to(dtype) for x in xs
    ]
    refs.append(random_floats(gen, 4096 * 2, dtype, -3, 2)[8:])  # 16 bytes in, or not aligned
    xs.append(refs[-1] * 1.5)
    encoded = [quantize_blockwise_torch(x, r, bits, block) for x, r in zip(xs, refs)]
    for with_ref in (True, False):
        got = dequantize_blockwise_many_cuda(
            [on_kernel_device(c) for c, _ in encoded],
            [on_kernel_device(s) for _, s in encoded],
            [x.numel() for x in xs],
            bits,
            block,
            [on_kernel_device(r) for r in refs] if with_ref else None,
            dtype,
        )
        for i, ((c, s), x, r) in enumerate(zip(encoded, xs, refs)):
            want = dequantize_blockwise_torch(c, s, x.numel(), bits, block, r if with_ref else None, dtype)
            assert_same_bits(got[i], want, f"tensor {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_decode_writes_over_each_reference_in_place(dtype, monkeypatch) -> None:
    """The closed-loop advance's decode: each tensor's output is its reference (``out``),
    written where it is (no second copy), to the values the torch path gives it alone; an
    ``out`` the kernel cannot write where it is (not 16-byte aligned) is filled."""
    gen = torch.Generator().manual_seed(21)
    xs = [random_floats(gen, n, dtype, -3, 2) for n in SIZES]
    refs = [
        (x.double() + 1e-2 * torch.randn(x.shape, generator=gen, dtype=torch.float64)).to(dtype) for x in xs
    ]
    refs.append(random_floats(gen, 4096 + 9, dtype, -3, 2)[1:])  # not 16-byte aligned
    xs.append(refs[-1] * 1.5)
    encoded = [quantize_blockwise_torch(x, r, 4, 128) for x, r in zip(xs, refs)]
    want = [
        dequantize_blockwise_torch(c, s, x.numel(), 4, 128, r, dtype)
        for (c, s), x, r in zip(encoded, xs, refs)
    ]
    dev = [on_kernel_device(r).clone() if r.data_ptr() % 16 == 0 else on_kernel_device(r) for r in refs]
    ptrs = [r.data_ptr() for r in dev]
    kernel_module = importlib.import_module("tw_triton.kernels.dequantize_blockwise_grouped")
    scratch: list = []
    real = kernel_module.group_outputs
    monkeypatch.setattr(kernel_module, "group_outputs", lambda n, *a: scratch.extend(n) or real(n, *a))
    got = dequantize_blockwise_many_cuda(
        [on_kernel_device(c) for c, _ in encoded],
        [on_kernel_device(s) for _, s in encoded],
        [x.numel() for x in xs],
        4,
        128,
        dev,
        dtype,
        out=dev,
    )
    for i, (g, r, w) in enumerate(zip(got, dev, want)):
        assert g is r and g.data_ptr() == ptrs[i], f"tensor {i}: not decoded into its reference"
        assert_same_bits(g, w, f"tensor {i}")
    # Only the reference that is not 16-byte aligned went through a scratch buffer.
    assert scratch == [xs[-1].numel()], scratch
