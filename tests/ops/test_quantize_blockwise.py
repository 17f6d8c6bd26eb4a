"""The Triton encode kernel against the torch path (the spec): byte-identical codes and scales.

Without a GPU the kernel runs under ``TRITON_INTERPRET=1`` on CPU tensors (conftest.py);
with one it runs compiled on CUDA tensors and is compared with the CPU torch path, with
parameters from the precompiled grid (``ON_GRID``, tests/_kernel_testing.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _codec_oracle import near_tie_blocks, spec_encode, with_reference
from _kernel_testing import (
    BLOCKS,
    FLOATS,
    KERNEL_DEVICE,
    ON_GRID,
    block_for,
    exponent_range,
    grid_bits,
    grid_variants,
    max_examples,
    numels,
    on_kernel_device,
    random_floats,
    require_runnable_kernels,
    run_offset_check,
    shapes,
    unpack_codes,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tw_triton
import tw_triton.kernels
from tw_triton import ops
from tw_triton.codecs.blockwise import quantize_blockwise_torch
from tw_triton.errors import QuantizationError
from tw_triton.kernels import quantize_blockwise

require_runnable_kernels()


def assert_encodes_like_torch(
    x: torch.Tensor, ref: torch.Tensor | None, bits: int, block: int, qmax: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode on the kernel device and with torch on the CPU; codes and scales must match."""
    codes, scales = quantize_blockwise(on_kernel_device(x), on_kernel_device(ref), bits, block, qmax)
    t_codes, t_scales = quantize_blockwise_torch(x, ref, bits, block, qmax=qmax)
    assert codes.device.type == KERNEL_DEVICE.type
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float32
    assert codes.shape == t_codes.shape == ((x.numel() * bits + 7) // 8,)
    assert scales.shape == t_scales.shape == (-(-x.numel() // block),)
    assert torch.equal(codes.cpu(), t_codes), (
        f"codes differ at bytes {(codes.cpu() != t_codes).nonzero()[:8].flatten().tolist()}"
    )
    # Scales are never NaN (a NaN block gets +inf), so integer equality is bit equality.
    assert torch.equal(scales.cpu().view(torch.int32), t_scales.view(torch.int32)), (
        f"scales differ at blocks {(scales.cpu() != t_scales).nonzero()[:8].flatten().tolist()}"
    )
    return t_codes, t_scales


@st.composite
def encode_cases(draw):
    numel = draw(numels())
    shape = draw(shapes(numel))
    if ON_GRID:
        v = draw(st.sampled_from(grid_variants("blockwise")))
        dtype, ref_dtype, bits, qmax, block = v.dtype, v.ref_dtype, v.bits, None, v.block
    else:
        dtype = draw(st.sampled_from(FLOATS))
        ref_dtype = draw(st.sampled_from((None,) + FLOATS))
        bits = draw(st.sampled_from((8, 4, 2)))
        # Fewer levels than the container (int3 = 4 bits, qmax 3) in a quarter of the cases.
        qmax = draw(st.sampled_from((None, None, None, draw(st.integers(1, (1 << (bits - 1)) - 1)))))
        block = draw(st.sampled_from(BLOCKS))
    lo, hi = exponent_range(dtype)
    exp_lo = draw(st.integers(lo, hi))
    exp_span = draw(st.integers(0, 6))
    zero_fraction = draw(st.sampled_from((0.0, 0.0, 0.3, 0.97)))
    ref_mode = draw(st.sampled_from(("near", "independent")))
    seed = draw(st.integers(0, 2**31 - 1))
    return shape, dtype, ref_dtype, bits, qmax, block, exp_lo, exp_span, zero_fraction, ref_mode, seed


@settings(max_examples=max_examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(encode_cases())
def test_kernel_encode_is_byte_identical_to_torch(case) -> None:
    shape, dtype, ref_dtype, bits, qmax, block, exp_lo, exp_span, zero_fraction, ref_mode, seed = case
    gen = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    x = random_floats(gen, numel, dtype, exp_lo, exp_lo + exp_span, zero_fraction).view(shape)
    ref = None
    if ref_dtype is not None:
        if ref_mode == "near":
            # A training-like reference: x plus a small drift, so deltas are small.
            drift = random_floats(gen, numel, torch.float64, exp_lo - 3, exp_lo - 1)
            ref = (x.double().flatten() + drift).to(ref_dtype).view(shape)
        else:
            lo, hi = exponent_range(ref_dtype)
            ref_exp = exp_lo if lo <= exp_lo <= hi else lo
            ref = random_floats(gen, numel, ref_dtype, ref_exp, ref_exp + 2).view(shape)
    assert_encodes_like_torch(x, ref, bits, block, qmax)


@settings(max_examples=max_examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    # The ties are fp32 values: on the GPU grid, an fp32 tensor and reference.
    bits=st.sampled_from(grid_bits("blockwise") if ON_GRID else (8, 4, 2, "int3")),
    block=st.sampled_from((block_for("blockwise", 128),) if ON_GRID else BLOCKS),
    nblocks=st.integers(1, 3),
    tail=st.integers(0, 31),
    log2_scale=st.integers(-149, 120),
    ref_dtype=st.sampled_from((None, torch.float32) if ON_GRID else (None,) + FLOATS),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_encode_of_near_ties_is_byte_identical_to_torch(
    bits: int, block: int, nblocks: int, tail: int, log2_scale: int, ref_dtype, seed: int
) -> None:
    """Deltas on and within 2 ulps of half-integer multiples of the block scale (power-of-two
    and random 24-bit scales, subnormal to huge): where fl(d/s) is a half-integer, both
    paths must settle the side of the exact quotient the same way."""
    qmax = None
    if bits == "int3":
        bits, qmax = 4, 3
    rng = np.random.default_rng(seed)
    d = near_tie_blocks(rng, nblocks, block, bits, log2_scale, log2_scale + 1, qmax)
    d = d[: max(1, d.size - tail)]
    if ref_dtype is None:
        x, ref = torch.from_numpy(d), None
    else:
        x32, ref = with_reference(rng, d, ref_dtype)
        x = torch.from_numpy(x32)
    codes, _ = assert_encodes_like_torch(x, ref, bits, block, qmax)
    if ref_dtype is None:
        # And both are the exact-arithmetic oracle's codes.
        want, _ = spec_encode(d, None, bits, block, qmax)
        assert np.array_equal(codes.numpy(), want)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", FLOATS)
def test_edge_blocks(bits: int, dtype: torch.dtype) -> None:
    """Zero, subnormal, huge, NaN and Inf blocks side by side in one tensor."""
    block = block_for("blockwise", 32)
    big = 1e38 if dtype != torch.float16 else 6.0e4
    tiny = 1e-40 if dtype != torch.float16 else 1e-7  # subnormal in each dtype
    parts = [
        torch.zeros(block),
        torch.linspace(-tiny, tiny, block),
        torch.linspace(-big, big, block),
        torch.full((block,), -big),
        torch.cat([torch.randn(block - 1), torch.tensor([math.nan])]),
        torch.cat([torch.tensor([math.inf]), torch.randn(block - 1)]),
        torch.cat([torch.tensor([-math.inf]), torch.zeros(block - 1)]),
        torch.randn(block) * 1e-3,
        torch.randn(block // 2),  # a partial last block
    ]
    x = torch.cat(parts).to(dtype)
    codes, scales = assert_encodes_like_torch(x, None, bits, block)
    qmax, offset = (1 << (bits - 1)) - 1, 1 << (bits - 1)
    assert scales[0] == 0.0, "an all-zero block has scale 0"
    assert torch.isinf(scales[4:7]).all() and (scales[4:7] > 0).all(), "NaN/Inf blocks get +inf"
    assert torch.isfinite(scales[[0, 1, 2, 3, 7, 8]]).all()
    # Unusable blocks (scale 0 or inf) store q = 0 everywhere, i.e. the code `offset`.
    u = unpack_codes(codes, bits)[: x.numel()]
    for b in (0, 4, 5, 6):
        assert (u[b * block : (b + 1) * block] == offset).all()
    # A constant block of -big maps every element to -qmax exactly.
    assert (u[3 * block : 4 * block] == offset - qmax).all()


@pytest.mark.parametrize(("bits", "qmax", "top"), [(8, None, 190), (4, None, 10), (4, 3, 4)])
def test_a_subnormal_scale_rounded_down_clamps_its_codes(bits: int, qmax: int | None, top: int) -> None:
    """A block whose absmax is ``top`` units of 2**-149: its scale ``top / qmax`` units rounds
    down to one unit (fp32's subnormal spacing), so quotients reach ``top`` and the codes
    clamp at ``qmax``; only such a tile needs the clamp (the kernel skips it elsewhere)."""
    unit = 2.0**-149
    q = qmax or (1 << (bits - 1)) - 1
    block = block_for("blockwise", 32)
    ramp = torch.linspace(-top, top, block, dtype=torch.float64).round()
    x = torch.cat([ramp * unit, torch.randn(block, dtype=torch.float64)]).float()
    codes, scales = assert_encodes_like_torch(x, None, bits, block, qmax)
    assert scales[0].item() == unit
    u = unpack_codes(codes, bits)[:block].to(torch.int64) - (1 << (bits - 1))
    assert u.min().item() == -q and u.max().item() == q and (u.abs() == q).sum() > 2


@pytest.mark.parametrize("ref_dtype", [torch.float32, torch.bfloat16])
def test_delta_overflowing_to_inf_marks_the_block(ref_dtype: torch.dtype) -> None:
    """Finite x and finite ref whose fp32 difference overflows: that block is unusable.

    (An fp16 reference cannot do this: |ref| <= 65504 is far below half an ulp of the fp32
    maximum, so only references in fp32 and bf16 are tried; on the GPU grid, a tensor of
    the reference's dtype.)
    """
    block = block_for("blockwise", 32)
    x = torch.randn(3 * block)
    ref = torch.randn(3 * block)
    x[block + 3], ref[block + 3] = 3.0e38, -3.0e38
    ref = ref.to(ref_dtype)
    x = x.to(ref_dtype) if ON_GRID else x
    assert torch.isfinite(ref).all()
    _, scales = assert_encodes_like_torch(x, ref, 8, block)
    assert torch.isinf(scales[1]) and torch.isfinite(scales[[0, 2]]).all()


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_ties_round_half_to_even(bits: int) -> None:
    """Values exactly halfway between codes: the kernel's magic-constant rounding is RNE."""
    qmax = (1 << (bits - 1)) - 1
    block = block_for("blockwise", 32)
    # Scale 1 per block (absmax = qmax); the other entries are exact halves.
    halves = torch.tensor([0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 3.5, -3.5, 4.5, 6.5, -6.5])
    halves = halves[halves.abs() < qmax]
    row = torch.cat([torch.tensor([float(qmax)]), halves, torch.zeros(block - 1 - halves.numel())])
    codes, scales = assert_encodes_like_torch(row, None, bits, block)
    assert scales[0] == 1.0
    q = unpack_codes(codes, bits)[1 : 1 + halves.numel()].int() - (1 << (bits - 1))
    assert torch.equal(q, torch.round(halves).int())  # torch.round is half-to-even


def test_numel_zero_and_one() -> None:
    for dtype in FLOATS:
        empty = on_kernel_device(torch.empty(0, dtype=dtype))
        codes, scales = quantize_blockwise(empty, None, 4, 64)  # no launch
        assert codes.numel() == 0 and scales.numel() == 0
        assert_encodes_like_torch(torch.tensor([-2.75]).to(dtype), None, 2, block_for("blockwise", 32))
        x = torch.tensor([1e-30]).to(dtype) if ON_GRID else torch.tensor([1e-30])
        assert_encodes_like_torch(x, torch.tensor([0.5]).to(dtype), 8, block_for("blockwise", 4096))


def test_int64_offsets_past_2_31_and_2_32_elements() -> None:
    """Shifted pointers under the interpreter (8 windows, to 2**37 elements); real
    allocations on a GPU (7 windows, up to 43 GiB each: see tests/_offsets64.py)."""
    out = run_offset_check("encode")
    if KERNEL_DEVICE.type == "cuda":
        assert "checked 7 windows (real placement)" in out, out
    else:
        assert "checked 8 windows (shifted placement)" in out, out


def test_int64_offset_check_with_real_allocations_runs_on_small_windows() -> None:
    """The GPU variant's code (full-size buffers, NaN-filled around the window) end to
    end through the child's command line, on windows a few tiles from the start."""
    out = run_offset_check("encode", "--placement", "real", "--small")
    assert "checked 8 windows (real placement)" in out, out


def test_launcher_rejects_bad_input() -> None:
    x = on_kernel_device(torch.randn(4, 64))
    with pytest.raises(QuantizationError, match="x must be contiguous"):
        quantize_blockwise(x.t(), None, 8, 32)
    with pytest.raises(QuantizationError, match="reference has 255 elements, expected 256"):
        quantize_blockwise(x, on_kernel_device(torch.randn(255)), 8, 32)
    with pytest.raises(QuantizationError, match="got torch.int32"):
        quantize_blockwise(on_kernel_device(torch.zeros(64, dtype=torch.int32)), None, 8, 32)
    with pytest.raises(QuantizationError, match="block=48"):
        quantize_blockwise(x, None, 8, 48)
    with pytest.raises(QuantizationError, match="bits=3"):
        quantize_blockwise(x, None, 3, 32)


def test_tw_triton_quantize_dispatches_contiguous_tensors_to_the_kernel(monkeypatch) -> None:
    """On CUDA, ``tw_triton.quantize`` calls this launcher through the "cuda" backend of
    the op; here that backend also serves the CPU, so the same code path runs on the
    interpreter, with a non-contiguous input."""
    calls = []

    def spy(x, reference, bits, block, qmax=None):
        calls.append((x.is_contiguous(), None if reference is None else reference.is_contiguous(), qmax))
        return quantize_blockwise(x, reference, bits, block, qmax)

    monkeypatch.setattr(tw_triton.kernels, "quantize_blockwise", spy)
    base = torch.randn(96, 70, dtype=torch.bfloat16)
    x = on_kernel_device(base.t())  # non-contiguous
    ref = on_kernel_device(torch.randn(70, 96, dtype=torch.bfloat16 if ON_GRID else torch.float32))
    block = block_for("blockwise", 64)
    with ops.using("quantize_blockwise", x.device.type, ops.lookup("quantize_blockwise", "cuda")):
        q = tw_triton.quantize(x, bits=4, block=block, reference=ref)
    assert calls == [(True, True, 7)]
    t_codes, t_scales = quantize_blockwise_torch(base.t().contiguous(), ref.cpu(), 4, block)
    assert torch.equal(q.codes.cpu(), t_codes) and torch.equal(q.scales.cpu(), t_scales)
    assert q.shape == (70, 96) and q.dtype == torch.bfloat16
