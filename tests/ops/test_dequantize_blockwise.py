"""The Triton decode kernel against the torch path (the spec): bit-identical tensors.

Without a GPU the kernel runs under ``TRITON_INTERPRET=1`` on CPU tensors (conftest.py);
with one it runs compiled on CUDA tensors and is compared with the CPU torch path, with
parameters from the precompiled grid (``ON_GRID``, tests/_kernel_testing.py): there the
output and the reference have the entry's dtype, as in a load.
"""

from __future__ import annotations

import math

import pytest
import torch
from _kernel_testing import (
    BLOCKS,
    FLOATS,
    KERNEL_DEVICE,
    ON_GRID,
    assert_same_bits,
    block_for,
    exponent_range,
    grid_variants,
    max_examples,
    numels,
    on_kernel_device,
    random_floats,
    require_runnable_kernels,
    run_offset_check,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tw_triton
import tw_triton.kernels
from tw_triton import ops
from tw_triton.codecs.blockwise import dequantize_blockwise_torch, quantize_blockwise_torch
from tw_triton.errors import QuantizationError
from tw_triton.kernels import dequantize_blockwise

require_runnable_kernels()


def assert_decodes_like_torch(
    codes: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    bits: int,
    block: int,
    ref: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Decode on the kernel device and with torch on the CPU; the bits must match."""
    out = dequantize_blockwise(
        on_kernel_device(codes),
        on_kernel_device(scales),
        numel,
        bits,
        block,
        on_kernel_device(ref),
        dtype,
    )
    expected = dequantize_blockwise_torch(codes, scales, numel, bits, block, ref, dtype)
    assert out.device.type == KERNEL_DEVICE.type
    assert_same_bits(out, expected, f"decode bits={bits} block={block} -> {dtype}")
    return expected


def random_scales(gen: torch.Generator, count: int, exp_lo: int, special: float) -> torch.Tensor:
    """Positive fp32 scales around ``10**exp_lo``; a ``special`` fraction of them are 0,
    +inf, subnormal or near the fp32 maximum (where ``q * scale`` overflows)."""
    scales = random_floats(gen, count, torch.float64, exp_lo, exp_lo + 3).abs().float()
    pick = torch.rand(count, generator=gen) < special
    menu = torch.tensor([0.0, math.inf, 1e-41, 3e-39, 3.0e38, 2.7e36], dtype=torch.float32)
    choice = torch.randint(0, menu.numel(), (count,), generator=gen)
    return torch.where(pick, menu[choice], scales)


@st.composite
def decode_cases(draw):
    numel = draw(numels())
    if ON_GRID:
        v = draw(st.sampled_from(grid_variants("blockwise")))
        bits, block, out_dtype, ref_dtype = v.bits, v.block, v.dtype, v.ref_dtype
    else:
        bits = draw(st.sampled_from((8, 4, 2)))
        block = draw(st.sampled_from(BLOCKS))
        out_dtype = draw(st.sampled_from(FLOATS))
        ref_dtype = draw(st.sampled_from((None,) + FLOATS))
    exp_lo = draw(st.integers(-38, 35))
    special = draw(st.sampled_from((0.0, 0.1, 0.5)))
    seed = draw(st.integers(0, 2**31 - 1))
    return numel, bits, block, out_dtype, ref_dtype, exp_lo, special, seed


@settings(max_examples=max_examples(250), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decode_cases())
def test_kernel_decode_of_arbitrary_codes_is_bit_identical_to_torch(case) -> None:
    """Any bytes, any scales (0, inf, subnormal, huge), any reference, every output dtype."""
    numel, bits, block, out_dtype, ref_dtype, exp_lo, special, seed = case
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, ((numel * bits + 7) // 8,), generator=gen, dtype=torch.uint8)
    scales = random_scales(gen, -(-numel // block), exp_lo, special)
    ref = None
    if ref_dtype is not None:
        lo, hi = exponent_range(ref_dtype)
        ref_exp = min(max(exp_lo + 1, lo), hi)
        ref = random_floats(gen, numel, ref_dtype, ref_exp - 2, ref_exp + 1, zero_fraction=0.1)
    assert_decodes_like_torch(codes, scales, numel, bits, block, ref, out_dtype)


@settings(max_examples=max_examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    numel=numels(),
    dtype=st.sampled_from(FLOATS),
    bits=st.sampled_from((8, 4, 2)),
    block=st.sampled_from((block_for("blockwise", 128),) if ON_GRID else BLOCKS),
    with_ref=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_decodes_identically_in_every_output_dtype(
    numel: int, dtype: torch.dtype, bits: int, block: int, with_ref: bool, seed: int
) -> None:
    """Codes from a real encode, decoded by kernel and torch, with and without the
    reference, into each of the three output dtypes."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = exponent_range(dtype)
    exp = int(torch.randint(lo, hi + 1, (1,), generator=gen))
    x = random_floats(gen, numel, dtype, exp, exp + 2)
    ref = (x.double() + random_floats(gen, numel, torch.float64, exp - 3, exp - 2)).to(dtype)
    ref = ref if with_ref else None
    codes, scales = quantize_blockwise_torch(x, ref, bits, block)
    for out_dtype in (dtype,) if ON_GRID else FLOATS:
        assert_decodes_like_torch(codes, scales, numel, bits, block, ref, out_dtype)


def test_bf16_and_fp16_output_rounding_ties_and_saturation() -> None:
    """The kernel's own fp32 -> bf16 rounding: exact ties go to even, subnormals survive,
    NaN stays NaN; values past the largest bf16/fp16 (infinities included) saturate to it."""
    block = 32
    one_ulp_bf16 = 2.0**-7  # bf16 spacing at 1.0
    values = torch.tensor(
        [
            1.0 + one_ulp_bf16 / 2,  # tie between 1.0 (even) and 1 + ulp: -> 1.0
            1.0 + 3 * one_ulp_bf16 / 2,  # tie between 1+ulp (odd) and 1+2ulp (even): -> 1+2ulp
            -(1.0 + 3 * one_ulp_bf16 / 2),
            1.0 + one_ulp_bf16 / 2 + 2.0**-20,  # just above the tie: rounds up
            3.3961775e38,  # above the largest bf16 (3.3895e38) by more than half an ulp
            65520.0,  # would round to inf in fp16
            1e-39,  # fp32 subnormal, a bf16 subnormal too
            2.0**-24 * 1.5,  # fp16 subnormal tie
            -0.0,
            math.nan,
            -math.inf,
            3.3895e38,  # just below the largest bf16, past the largest fp16
        ],
        dtype=torch.float32,
    )
    if ON_GRID:
        _output_rounding_on_the_grid(values, one_ulp_bf16)
        return
    numel = values.numel()
    # Encode nothing: code `offset` means q = 0, so the output is the reference itself
    # (0 * scale + ref), saturated and cast by the kernel's rounding.
    codes = torch.full(((numel * 8 + 7) // 8,), 128, dtype=torch.uint8)
    scales = torch.ones(-(-numel // block))
    for out_dtype in (torch.bfloat16, torch.float16):
        expected = assert_decodes_like_torch(codes, scales, numel, 8, block, values, out_dtype)
        # 0 * scale + ref: the add turns -0.0 into +0.0, the rest is ref's own rounding
        # after the clamp to the dtype's range.
        big = torch.finfo(out_dtype).max
        assert_same_bits(expected, (0.0 + values).clamp(-big, big).to(out_dtype), "vs .to()")
        assert bool(torch.isfinite(expected[:9]).all()) and bool(torch.isfinite(expected[10:]).all())
        assert expected[10].item() == -big
    bf = dequantize_blockwise_torch(codes, scales, numel, 8, block, values, torch.bfloat16)
    assert bf[0].item() == 1.0 and bf[1].item() == 1.0 + 2 * one_ulp_bf16
    assert bf[4].item() == torch.finfo(torch.bfloat16).max and bf[6].item() != 0.0
    assert math.isnan(bf[9].item())
    fp16 = dequantize_blockwise_torch(codes, scales, numel, 8, block, values, torch.float16)
    assert fp16[5].item() == 65504.0 and fp16[11].item() == 65504.0


def _output_rounding_on_the_grid(values: torch.Tensor, one_ulp_bf16: float) -> None:
    """The same fp32 values, as products instead of an fp32 reference (the grid decodes
    bf16 and fp16 entries without one): value i is code +-1 times scale |v_i| in the first
    element of block i; NaN is 0 times an infinite scale, -inf is -1 times one (clamped to
    the fp32 maximum, like an infinite reference)."""
    block = block_for("blockwise", 32)
    count = values.numel()
    numel = count * block
    q = torch.zeros(numel, dtype=torch.int64)
    scales = values.abs()
    first = torch.arange(count) * block
    q[first] = torch.where(values < 0, -1, 1)
    zero_q = torch.isnan(values) | (values == 0)
    q[first[zero_q]] = 0
    scales[torch.isnan(values)] = math.inf
    codes = (q + 128).to(torch.uint8)
    for out_dtype in (torch.bfloat16, torch.float16):
        out = assert_decodes_like_torch(codes, scales, numel, 8, block, None, out_dtype)[first]
        big = torch.finfo(out_dtype).max
        assert_same_bits(out, (0.0 + values).clamp(-big, big).to(out_dtype), "vs .to()")
        assert out[10].item() == -big
    bf = dequantize_blockwise_torch(codes, scales, numel, 8, block, None, torch.bfloat16)[first]
    assert bf[0].item() == 1.0 and bf[1].item() == 1.0 + 2 * one_ulp_bf16
    assert bf[4].item() == torch.finfo(torch.bfloat16).max and bf[6].item() != 0.0
    assert math.isnan(bf[9].item())
    fp16 = dequantize_blockwise_torch(codes, scales, numel, 8, block, None, torch.float16)[first]
    assert fp16[5].item() == 65504.0 and fp16[11].item() == 65504.0


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_overflowing_products_and_sums_saturate(bits: int) -> None:
    """q * scale past the fp32 maximum (8 and 4 bits here) is clamped before the reference
    is added, so a reference of the other sign brings it back (no inf + r); the sum is
    clamped to the output dtype's range; NaN (q = 0 times an infinite scale) stays NaN.
    On the GPU grid the reference has the output's dtype (fp16 cannot hold it)."""
    block = block_for("blockwise", 32)
    qmax, offset = (1 << (bits - 1)) - 1, 1 << (bits - 1)
    f32_max = torch.finfo(torch.float32).max
    numel = 3 * block
    u = torch.full((numel,), offset + qmax, dtype=torch.int64)
    u[2 * block :] = offset  # q = 0
    packed = sum(u.view(-1, 8 // bits)[:, j] << (j * bits) for j in range(8 // bits))
    codes = packed.to(torch.uint8)
    # Block 0: qmax * scale overflows fp32; block 1: it does not; block 2: infinite scale.
    scales = torch.tensor([f32_max, f32_max / (2 * qmax), math.inf])
    ref32 = torch.full((numel,), -f32_max / 2)
    for out_dtype in (torch.float32, torch.bfloat16) if ON_GRID else FLOATS:
        ref = ref32.to(out_dtype) if ON_GRID else ref32
        out = assert_decodes_like_torch(codes, scales, numel, bits, block, ref, out_dtype)
        big = torch.finfo(out_dtype).max
        want0 = torch.tensor(f32_max / 2).clamp(-big, big).to(out_dtype)
        assert bool((out[:block] == want0).all()), "product saturated to the fp32 max, plus ref"
        assert bool(torch.isfinite(out[: 2 * block]).all())
        assert bool(torch.isnan(out[2 * block :]).all())
        plain = dequantize_blockwise_torch(codes, scales, numel, bits, block, None, out_dtype)
        assert bool((plain[:block] == big).all()), "no reference: saturated to the dtype max"


def test_infinite_scale_decodes_to_nan_and_zero_scale_to_the_reference() -> None:
    block = block_for("blockwise", 32)
    codes = torch.randint(0, 256, (3 * block,), dtype=torch.uint8)
    codes[:block] = 128  # what the encoder stores in an unquantizable block: q = 0
    scales = torch.tensor([math.inf, 0.0, 0.25])
    ref32 = torch.randn(3 * block)
    for out_dtype in FLOATS:
        ref = ref32.to(out_dtype) if ON_GRID else ref32
        out = assert_decodes_like_torch(codes, scales, 3 * block, 8, block, ref, out_dtype)
        assert torch.isnan(out[:block]).all()
        assert_same_bits(out[block : 2 * block], ref[block : 2 * block].to(out_dtype))


def test_numel_zero_and_one() -> None:
    for dtype in FLOATS:
        out = dequantize_blockwise(
            on_kernel_device(torch.empty(0, dtype=torch.uint8)),
            on_kernel_device(torch.empty(0)),
            0,
            4,
            64,
            None,
            dtype,
        )
        assert out.shape == (0,) and out.dtype == dtype
        assert_decodes_like_torch(
            torch.tensor([0b10], dtype=torch.uint8),
            torch.tensor([0.75]),
            1,
            2,
            block_for("blockwise", 32),
            torch.tensor([1.0]).to(dtype),
            dtype,
        )


def test_int64_offsets_past_2_31_and_2_32_elements() -> None:
    """Shifted pointers under the interpreter (8 windows, to 2**37 elements); real
    allocations on a GPU (7 windows, up to 43 GiB each: see tests/_offsets64.py)."""
    out = run_offset_check("decode")
    if KERNEL_DEVICE.type == "cuda":
        assert "checked 7 windows (real placement)" in out, out
    else:
        assert "checked 8 windows (shifted placement)" in out, out


def test_int64_offset_check_with_real_allocations_runs_on_small_windows() -> None:
    """The GPU variant's code (full-size buffers, NaN-filled around the window) end to
    end through the child's command line, on windows a few tiles from the start."""
    out = run_offset_check("decode", "--placement", "real", "--small")
    assert "checked 8 windows (real placement)" in out, out


def test_launcher_rejects_bad_buffers() -> None:
    codes = on_kernel_device(torch.zeros(64, dtype=torch.uint8))
    scales = on_kernel_device(torch.ones(2))
    with pytest.raises(QuantizationError, match="codes has 64 elements, expected 32"):
        dequantize_blockwise(codes, scales, 64, 4, 32, None, torch.float32)
    with pytest.raises(QuantizationError, match="scales has 2 elements, expected 1"):
        dequantize_blockwise(codes, scales, 64, 8, 64, None, torch.float32)
    with pytest.raises(QuantizationError, match="scales must be torch.float32"):
        dequantize_blockwise(codes, scales.half(), 64, 8, 32, None, torch.float32)
    with pytest.raises(QuantizationError, match="reference must be contiguous"):
        ref = on_kernel_device(torch.randn(8, 8)).t()
        dequantize_blockwise(codes, scales, 64, 8, 32, ref, torch.float32)
    with pytest.raises(QuantizationError, match="output dtype"):
        dequantize_blockwise(codes, scales, 64, 8, 32, None, torch.float64)


def test_tw_triton_dequantize_dispatches_to_the_kernel(monkeypatch) -> None:
    """On CUDA, ``tw_triton.dequantize`` calls this launcher through the "cuda" backend of
    the op; here that backend also serves the CPU, so the same code path runs on the
    interpreter, with a non-contiguous reference."""
    calls = []

    def spy(codes, scales, numel, bits, block, reference, dtype):
        calls.append((codes.is_contiguous(), reference.is_contiguous(), dtype))
        return dequantize_blockwise(codes, scales, numel, bits, block, reference, dtype)

    x = torch.randn(40, 50)
    ref_base = torch.randn(50, 40, dtype=torch.bfloat16)
    q = tw_triton.quantize(x, bits=2, block=block_for("blockwise", 32), reference=ref_base.t())  # CPU
    expected = tw_triton.dequantize(q, reference=ref_base.t(), dtype=torch.bfloat16)

    monkeypatch.setattr(tw_triton.kernels, "dequantize_blockwise", spy)
    with ops.using("dequantize_blockwise", KERNEL_DEVICE.type, ops.lookup("dequantize_blockwise", "cuda")):
        out = tw_triton.dequantize(
            q.to(KERNEL_DEVICE), reference=on_kernel_device(ref_base).t(), dtype=torch.bfloat16
        )
    assert calls == [(True, True, torch.bfloat16)]
    assert out.shape == (40, 50)
    assert_same_bits(out, expected, "tw_triton.dequantize through the kernel")
