"""Tests of the tensor-level API, ``tw_triton.quantize`` / ``dequantize``, on the CPU path.

The bytes are checked against the plain numpy statement of the spec in ``_codec_oracle``;
the exact error bound has its own property tests in ``test_codec_properties.py``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _codec_oracle import spec_codes_to_q, spec_decode_f32, spec_encode, to_f32

import tw_triton
from tw_triton import QuantizationError, QuantizedTensor
from tw_triton.codecs import blockwise as codec
from tw_triton.errors import CheckpointError
from tw_triton.ops.reference import buffers, copy_flat_range

ROOT = Path(__file__).resolve().parents[2]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCKS = tuple(2**k for k in range(5, 13))
F32_MAX = float(np.finfo(np.float32).max)


def _bits_of(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so that equality also covers -0.0 and NaN payloads."""
    return t.view({torch.float32: torch.int32}.get(t.dtype, torch.int16))


def _assert_matches_spec(x, ref, bits, block, q: QuantizedTensor) -> None:
    codes, scales = spec_encode(to_f32(x), to_f32(ref), bits, block)
    assert np.array_equal(q.codes.numpy(), codes)
    assert np.array_equal(q.scales.numpy().view(np.int32), scales.view(np.int32))
    want = spec_decode_f32(codes, scales, x.numel(), bits, block, to_f32(ref))
    got = tw_triton.dequantize(q, reference=ref, dtype=torch.float32).reshape(-1).numpy()
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


def _randn(n: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(dtype)


# ---------------------------------------------------------------------------- dtypes, bits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ref_dtype", (None,) + DTYPES)
@pytest.mark.parametrize("bits", (8, 4, 2))
def test_every_dtype_pair_and_bits(dtype, ref_dtype, bits):
    x = _randn(1000, dtype, seed=1)
    ref = None if ref_dtype is None else (x.float() + _randn(1000, torch.float32, 2, 0.1)).to(ref_dtype)
    q = tw_triton.quantize(x, bits=bits, block=64, reference=ref)
    assert q.dtype == dtype and q.bits == bits and q.block == 64 and q.device == x.device
    _assert_matches_spec(x, ref, bits, 64, q)
    out = tw_triton.dequantize(q, reference=ref)
    assert out.dtype == dtype and out.shape == x.shape
    # Decoding is close to x: within the block's scale (exact bound in the property tests).
    s = q.scales.repeat_interleave(64)[:1000]
    d = x.float() - (0 if ref is None else ref.float())
    err = (out.float() - x.float()).abs()
    assert bool((err <= 0.51 * s + x.float().abs() * 2.0**-7 + 1e-30).all())
    qmax = codec.qmax_for(bits)
    assert bool((d.abs() <= qmax * s * (1 + 2**-20) + 1e-38).all())  # s is absmax / qmax


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("bits", (8, 4, 2))
def test_every_block_size(block, bits):
    n = 3 * block + 5
    x = _randn(n, torch.float32, seed=block)
    q = tw_triton.quantize(x, bits=bits, block=block)
    assert q.scales.numel() == 4 and q.codes.numel() == math.ceil(n * bits / 8)
    _assert_matches_spec(x, None, bits, block, q)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 31, 33, 127, 129, 1000, 4097])
@pytest.mark.parametrize("bits", (8, 4, 2))
def test_any_numel(n, bits):
    x = _randn(n, torch.bfloat16, seed=n)
    ref = _randn(n, torch.float16, seed=n + 1)
    q = tw_triton.quantize(x, bits=bits, block=32, reference=ref)
    assert q.codes.numel() == (n * bits + 7) // 8
    assert q.scales.numel() == (n + 31) // 32
    _assert_matches_spec(x, ref, bits, 32, q)
    out = tw_triton.dequantize(q, reference=ref)
    assert out.shape == (n,) and out.dtype == torch.bfloat16


def test_zero_dim_and_empty_shapes():
    x = torch.tensor(3.5)
    q = tw_triton.quantize(x)
    out = tw_triton.dequantize(q)
    assert out.shape == () and out.item() == 3.5  # a lone element is its own absmax
    e = torch.empty(0, 7, dtype=torch.float16)
    qe = tw_triton.quantize(e, reference=torch.empty(0, 7))
    assert qe.codes.numel() == 0 and qe.scales.numel() == 0 and not bool(qe.nonfinite)
    assert tw_triton.dequantize(qe).shape == (0, 7)


def test_packing_is_lsb_first():
    # Block of [absmax, then codes] so the scale is 1 and q is the value itself.
    x = torch.zeros(32)
    x[:8] = torch.tensor([7.0, -7.0, 1.0, 2.0, 3.0, -1.0, 0.0, 5.0])
    q = tw_triton.quantize(x, bits=4, block=32)
    assert q.scales[0].item() == 1.0
    u = [v + 8 for v in (7, -7, 1, 2, 3, -1, 0, 5)]
    want = [u[0] | u[1] << 4, u[2] | u[3] << 4, u[4] | u[5] << 4, u[6] | u[7] << 4]
    assert q.codes[:4].tolist() == want
    x2 = torch.zeros(32)
    x2[:4] = torch.tensor([1.0, -1.0, 0.0, 1.0])
    q2 = tw_triton.quantize(x2, bits=2, block=32)
    assert q2.codes[0].item() == 3 | 1 << 2 | 2 << 4 | 3 << 6


# ---------------------------------------------------------------------------- layouts


NON_CONTIGUOUS = {
    "transposed": lambda base: base.t(),
    "sliced": lambda base: base[::3, 5:41],
    "expanded": lambda base: base[7:8, :37].expand(29, 37),
    "permuted": lambda base: base.reshape(8, 8, 48).permute(2, 0, 1),
    "narrowed": lambda base: base.narrow(1, 7, 30),
}


@pytest.mark.parametrize("view", sorted(NON_CONTIGUOUS))
@pytest.mark.parametrize("bits", (8, 4, 2))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_non_contiguous_equals_contiguous_copy(view, bits, dtype):
    make = NON_CONTIGUOUS[view]
    x = make(_randn(64 * 48, dtype, seed=5).reshape(64, 48))
    ref = make(_randn(64 * 48, torch.float16, seed=6).reshape(64, 48))  # strided too
    assert not x.is_contiguous() and not ref.is_contiguous()
    for r in (None, ref):
        q = tw_triton.quantize(x, bits=bits, block=32, reference=r)
        rc = None if r is None else r.contiguous()
        qc = tw_triton.quantize(x.contiguous(), bits=bits, block=32, reference=rc)
        assert torch.equal(q.codes, qc.codes)
        assert torch.equal(_bits_of(q.scales), _bits_of(qc.scales))
        assert q.shape == tuple(x.shape)
        out = tw_triton.dequantize(q, reference=r)
        outc = tw_triton.dequantize(qc, reference=rc)
        assert out.shape == x.shape and torch.equal(_bits_of(out), _bits_of(outc))
        _assert_matches_spec(x, r, bits, 32, q)


@pytest.mark.parametrize("view", sorted(NON_CONTIGUOUS))
@pytest.mark.parametrize("bits", (8, 2))
def test_non_contiguous_across_chunk_boundaries(monkeypatch, view, bits):
    """Tiny chunks: every chunk starts and ends inside rows of the strided input."""
    monkeypatch.setattr(buffers, "CHUNK_ELEMENTS", 32)
    make = NON_CONTIGUOUS[view]
    x = make(_randn(64 * 48, torch.bfloat16, seed=7).reshape(64, 48))
    ref = make(_randn(64 * 48, torch.float32, seed=8).reshape(64, 48))
    for r in (None, ref):
        q = tw_triton.quantize(x, bits=bits, block=32, reference=r)
        _assert_matches_spec(x, r, bits, 32, q)


def test_copy_flat_range_reads_any_strided_range():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 7, 5, 4, generator=g)
    views = [
        base.permute(3, 1, 0, 2),
        base[:, ::2, 1:4, :].transpose(0, 3),
        base[2:3].expand(3, 7, 5, 4),
        base.transpose(1, 2),
        base[..., 1],
    ]
    for v in views:
        flat = v.reshape(-1)
        n = flat.numel()
        for start in sorted({0, 1, 3, 19, 20, 21, n // 2, n - 5, n - 1}):
            for m in sorted({1, 2, 17, 20, n - start}):
                if start + m > n or m <= 0:
                    continue
                dst = torch.empty(m, dtype=torch.float64)
                copy_flat_range(v, start, dst)
                assert torch.equal(dst, flat[start : start + m].double())


# ---------------------------------------------------------------------------- special values


def test_blocks_of_absmax_zero():
    x = torch.zeros(300)
    x[200:210] = 1.5  # block 6 (of 32) is nonzero, the rest are all zero
    ref = torch.full((300,), 0.25, dtype=torch.bfloat16)
    for r in (None, ref):
        xr = x if r is None else x + r.float()
        q = tw_triton.quantize(xr, bits=4, block=32, reference=r)
        scales = q.scales.tolist()
        assert scales[6] == pytest.approx(1.5 / 7) and scales[:6] == [0.0] * 6
        assert scales[7:] == [0.0] * 3
        codes = q.codes.tolist()
        assert codes[:96] == [0x88] * 96  # q = 0 -> u = 8 in both nibbles
        out = tw_triton.dequantize(q, reference=r)
        assert torch.equal(out[:192], xr[:192]) and torch.equal(out[224:], xr[224:])
        assert not bool(q.nonfinite)


@pytest.mark.parametrize("bits", (8, 4, 2))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_subnormal_magnitudes(bits, dtype):
    # Subnormal x, subnormal scales (where the clamp binds), and scales that underflow to 0.
    g = torch.Generator().manual_seed(bits)
    n = 32 * 40
    mag = 2.0 ** torch.linspace(-149, -110, 40).repeat_interleave(32)
    x = ((torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1) * mag).float().to(dtype)
    q = tw_triton.quantize(x, bits=bits, block=32)
    s = q.scales
    assert bool(((s > 0) & (s < 2.0**-126)).any()), "no subnormal scale was exercised"
    assert not bool(q.nonfinite)
    _assert_matches_spec(x, None, bits, 32, q)
    out = tw_triton.dequantize(q, dtype=torch.float32)
    # |x - x_hat| <= max(s/2, absmax - qmax*s) + ulp(q*s)/2, where absmax - qmax*s is below
    # qmax * 2**-150 and the product's half ulp at most |q*s| * 2**-24 (fp64 is exact here).
    qmax = codec.qmax_for(bits)
    err = (out.double() - x.double()).abs()
    s_el = s.double().repeat_interleave(32)
    rounding = out.double().abs() * 2.0**-24
    assert bool((err <= s_el / 2 + qmax * 2.0**-150 + rounding).all())
    normal = s_el >= 2.0**-126
    assert bool((err[normal] <= s_el[normal] / 2 + rounding[normal]).all())


@pytest.mark.parametrize("bits", (8, 4, 2))
def test_huge_magnitudes(bits):
    x = _randn(4096, torch.float32, seed=3, scale=1e38 / 4).clamp(-3e38, 3e38)
    x[0] = 3e38
    q = tw_triton.quantize(x, bits=bits, block=128)
    assert not bool(q.nonfinite)
    _assert_matches_spec(x, None, bits, 128, q)
    out = tw_triton.dequantize(q)
    assert bool(torch.isfinite(out).all())
    # s/2, plus half an ulp of the rounded product (at most |q*s| * 2**-24).
    s = q.scales.double().repeat_interleave(128)
    err = (out.double() - x.double()).abs()
    assert bool((err <= s / 2 + out.double().abs() * 2.0**-24).all())


@pytest.mark.parametrize("bits", (8, 4, 2))
def test_absmax_at_the_fp32_maximum_is_quantized(bits):
    """For 8 bits qmax * scale overflows fp32 here: the decode saturates the product instead
    of producing inf, so such a block is quantizable (not flagged) and decodes within the
    bound, with a reference too (x = M/2 from ref = -M/2 has delta M)."""
    x = torch.zeros(128)
    x[0], x[1] = F32_MAX, -1.0
    ref_x = torch.zeros(128)
    ref_x[0], ref_x[1] = F32_MAX / 2, 1.0
    ref = torch.zeros(128)
    ref[0], ref[1] = -F32_MAX / 2, -2.0  # the delta is again [F32_MAX, -1, 0, ...]
    for xi, r in ((x, None), (ref_x, ref)):
        q = tw_triton.quantize(xi, bits=bits, block=128, reference=r)
        if bits == 8:
            with np.errstate(over="ignore"):
                assert np.isinf(np.float32(127) * q.scales.numpy()[0])
        assert not bool(q.nonfinite)
        _assert_matches_spec(xi, r, bits, 128, q)
        out = tw_triton.dequantize(q, reference=r)
        assert bool(torch.isfinite(out).all())
        s = q.scales[0].item()
        assert abs(out[0].item() - xi[0].item()) <= s / 2 + s * 2.0**-16


def _finite_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ref_dtype", DTYPES)
@pytest.mark.parametrize("bits", (8, 4, 2))
def test_values_at_the_dtype_maximum_never_decode_to_inf(dtype, ref_dtype, bits):
    """x at +-max of its dtype, references on both sides of it: the decode saturates to
    the dtype's range, so it is finite, equals x where the exact r + q*s lies beyond x, and
    keeps the error bound.

    (Before saturation this decoded to inf, e.g. fp16 x = 65504 with q = 1 rounded up by
    0.4*s, and nothing flagged it.)"""
    big = _finite_max(dtype)
    ref_big = min(big, _finite_max(ref_dtype))
    n = 128
    x = torch.zeros(n, dtype=torch.float64)
    ref = torch.zeros(n, dtype=torch.float64)
    # A scale-setting element: d = +-0.4 * min(max) after rounding.
    x[1], ref[1] = 0.25 * ref_big, -0.15 * ref_big
    offsets = [0.0, 1e-3, 0.45, 0.5, 0.6, 0.99, 1.3, 2.7, 3.3, 3.7, 4.6, 5.5, 6.4, 9.7, 12.5, 17.3]
    for j, off in enumerate(offsets):
        for sign in (1.0, -1.0):
            i = 2 + 2 * j + (sign < 0)
            s_est = 0.4 * ref_big / codec.qmax_for(bits)
            x[i] = sign * big
            # A reference just inside x, on its side (the delta stays below ref_big) ...
            ref[i] = sign * (big - min(off * s_est, 0.5 * ref_big))
    for i in range(2 + 2 * len(offsets), 2 + 4 * len(offsets)):
        x[i] = x[i - 2 * len(offsets)]
        ref[i] = x[i] - (ref[i - 2 * len(offsets)] - x[i])  # ... and just outside x
    x = x.to(dtype)
    ref = ref.clamp(-ref_big, ref_big).to(ref_dtype)
    assert bool(torch.isfinite(x).all()) and bool(torch.isfinite(ref).all())
    q = tw_triton.quantize(x, bits=bits, reference=ref)
    assert not bool(q.nonfinite)
    _assert_matches_spec(x, ref, bits, 128, q)
    out = tw_triton.dequantize(q, reference=ref)
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    # Where the exact r + q*s lies beyond the range on x's side, x is +-max itself and the
    # saturated decode gives exactly x. The test is pointless unless that happens.
    raw = _unsaturated(q, ref)
    x64, out64 = x.double().numpy(), out.double().numpy()
    beyond = np.abs(raw) > big
    if _finite_max(ref_dtype) >= big:  # the reference can come as close to x as it likes
        assert beyond.any(), "no decode would have left the range: the test is moot"
    assert np.array_equal(out64[beyond], x64[beyond])
    # Everywhere: the error bound s/2, plus the roundings of the delta, the product, the
    # sum (fp32) and the final cast.
    s = np.repeat(q.scales.numpy().astype(np.float64), 128)
    slack = np.abs(x64) * (torch.finfo(dtype).eps + 2.0**-21)
    assert np.all(np.abs(out64 - x64) <= s / 2 + slack)


def _unsaturated(q: QuantizedTensor, ref: torch.Tensor) -> np.ndarray:
    """fp64 value of fp32(ref) + q*s, exactly (neither rounded nor saturated)."""
    qi = spec_codes_to_q(q.codes.numpy(), q.numel, q.bits)
    s = np.repeat(q.scales.numpy().astype(np.float64), q.block)[: q.numel]
    return to_f32(ref).astype(np.float64) + qi * s


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["x", "ref"])
def test_nonfinite_sets_the_flag_and_only_then(bad, where):
    x = _randn(1000, torch.bfloat16, seed=9)
    ref = _randn(1000, torch.float32, seed=10)
    q_ok = tw_triton.quantize(x, reference=ref)
    assert isinstance(q_ok.nonfinite, torch.Tensor)
    assert q_ok.nonfinite.shape == () and q_ok.nonfinite.dtype == torch.bool
    assert q_ok.nonfinite.device == x.device
    assert not bool(q_ok.nonfinite)
    (x if where == "x" else ref)[517] = bad
    q = tw_triton.quantize(x, reference=ref)
    assert bool(q.nonfinite)
    # Only the block that held it is unquantizable (scale inf); the others are intact.
    assert q.scales[517 // 128].item() == math.inf
    assert bool(torch.isfinite(torch.cat([q.scales[:4], q.scales[5:]])).all())
    _assert_matches_spec(x, ref, 8, 128, q)


def test_overflowing_delta_of_finite_inputs_sets_the_flag():
    x = torch.full((64,), 3e38)
    ref = torch.full((64,), -3e38)
    q = tw_triton.quantize(x, reference=ref, block=32)
    assert bool(q.nonfinite)


# ---------------------------------------------------------------------------- errors


def test_reference_of_another_shape_names_both_shapes():
    x = torch.zeros(4, 6)
    with pytest.raises(QuantizationError, match=re.escape("(6, 4)") + ".*" + re.escape("(4, 6)")):
        tw_triton.quantize(x, reference=torch.zeros(6, 4))
    q = tw_triton.quantize(x)
    with pytest.raises(QuantizationError, match=re.escape("(24,)") + ".*" + re.escape("(4, 6)")):
        tw_triton.dequantize(q, reference=torch.zeros(24))


def test_dequantize_needs_the_reference_exactly_when_quantize_had_one():
    """Without the check a delta decoded without its reference came back as the delta, and
    a plain encoding decoded with one came back shifted by it: silently wrong values."""
    x, ref = _randn(300, torch.float32, seed=1), _randn(300, torch.float32, seed=2)
    delta, plain = tw_triton.quantize(x, reference=ref), tw_triton.quantize(x)
    assert delta.delta and not plain.delta and delta.to("cpu").delta
    with pytest.raises(QuantizationError, match="encoded as a delta.*pass reference="):
        tw_triton.dequantize(delta)
    with pytest.raises(QuantizationError, match="encoded without a reference"):
        tw_triton.dequantize(plain, reference=ref)
    assert (tw_triton.dequantize(delta, reference=ref) - x).abs().max() < 0.05
    # An encoding built by hand (delta not recorded) decodes as asked, as before.
    by_hand = dataclasses.replace(delta, delta=None)
    assert torch.equal(
        tw_triton.dequantize(by_hand, reference=ref), tw_triton.dequantize(delta, reference=ref)
    )


@pytest.mark.parametrize("bits", [0, 1, 3, 16, 8.0, True, "8", None])
def test_bad_bits(bits):
    with pytest.raises(QuantizationError, match="bits must be one of"):
        tw_triton.quantize(torch.zeros(64), bits=bits)


@pytest.mark.parametrize("block", [0, 16, 31, 100, 8192, 128.0, True, "128", None])
def test_bad_block(block):
    with pytest.raises(QuantizationError, match="block must be a power of two from 32 to 4096"):
        tw_triton.quantize(torch.zeros(64), block=block)


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]
)
def test_bad_dtype(dtype):
    with pytest.raises(QuantizationError, match=re.escape(str(dtype))):
        tw_triton.quantize(torch.zeros(64, dtype=dtype))
    with pytest.raises(QuantizationError, match="reference must be"):
        tw_triton.quantize(torch.zeros(64), reference=torch.zeros(64, dtype=dtype))
    q = tw_triton.quantize(torch.zeros(64))
    with pytest.raises(QuantizationError, match=re.escape(str(dtype))):
        tw_triton.dequantize(q, dtype=dtype)


def test_bad_types_and_devices():
    with pytest.raises(QuantizationError, match="expected a torch.Tensor, got ndarray"):
        tw_triton.quantize(np.zeros(64, dtype=np.float32))
    with pytest.raises(QuantizationError, match="reference must be a torch.Tensor, got list"):
        tw_triton.quantize(torch.zeros(3), reference=[0.0, 0.0, 0.0])
    with pytest.raises(QuantizationError, match="reference is on meta but the tensor is on cpu"):
        tw_triton.quantize(torch.zeros(3), reference=torch.zeros(3, device="meta"))
    with pytest.raises(QuantizationError, match="expected a QuantizedTensor, got Tensor"):
        tw_triton.dequantize(torch.zeros(3))
    # Errors are of the library's family and still ValueErrors.
    assert issubclass(QuantizationError, tw_triton.TwTritonError)
    assert issubclass(QuantizationError, ValueError)


def test_tensors_without_dense_data_and_bad_devices_are_quantization_errors():
    """Each was a raw RuntimeError, NotImplementedError or AssertionError from torch."""
    x = torch.randn(64, 64)
    with pytest.raises(QuantizationError, match="meta tensor"):
        tw_triton.quantize(torch.empty(64, device="meta"))
    with pytest.raises(QuantizationError, match="layout torch.sparse_coo"):
        tw_triton.quantize(x.to_sparse())
    with pytest.raises(QuantizationError, match="reference has layout torch.sparse_coo"):
        tw_triton.quantize(x, reference=x.to_sparse())
    q = tw_triton.quantize(x, reference=x)
    with pytest.raises(QuantizationError, match="reference is a meta tensor"):
        tw_triton.dequantize(q, reference=torch.empty(64, 64, device="meta"))
    with pytest.raises(QuantizationError, match="reference has layout torch.sparse_coo"):
        tw_triton.dequantize(q, reference=x.to_sparse())
    for device in ("nope", "meta"):
        with pytest.raises(QuantizationError, match=f"device {device!r}"):
            tw_triton.dequantize(tw_triton.quantize(x), device=device)
    if not torch.cuda.is_available():
        with pytest.raises(QuantizationError, match="CUDA is not available"):
            tw_triton.dequantize(tw_triton.quantize(x), device="cuda")


# ---------------------------------------------------------------------------- API details


def test_dequantize_dtype_and_device_arguments():
    x = _randn(500, torch.float32, seed=11)
    ref = _randn(500, torch.bfloat16, seed=12)
    q = tw_triton.quantize(x, bits=4, block=32, reference=ref)
    f32 = tw_triton.dequantize(q, reference=ref)
    for dtype in (torch.float16, torch.bfloat16):
        out = tw_triton.dequantize(q, reference=ref, dtype=dtype, device="cpu")
        # The cast of the same fp32 values: one rounding, from the decoded fp32.
        assert torch.equal(_bits_of(out), _bits_of(f32.to(dtype)))
    moved = q.to("cpu")
    assert torch.equal(moved.codes, q.codes) and moved.shape == q.shape


def test_quantize_does_not_modify_its_inputs():
    x = _randn(1000, torch.float32, seed=13)
    ref = _randn(1000, torch.float32, seed=14)
    x0, r0 = x.clone(), ref.clone()
    for bits in (8, 4, 2):
        tw_triton.quantize(x, bits=bits, reference=ref)
        tw_triton.quantize(x, bits=bits)
    assert torch.equal(x, x0) and torch.equal(ref, r0)


def test_ties_round_to_even():
    # Scale 1 (absmax 127); half-integers go to the even neighbour.
    x = torch.zeros(128)
    x[0] = 127.0
    x[1:9] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5])
    q = tw_triton.quantize(x, bits=8, block=128)
    assert q.scales[0].item() == 1.0
    got = (q.codes[1:9].to(torch.int32) - 128).tolist()
    assert got == [0, 2, 2, 0, -2, -2, 126, -126]


# ---------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("bits", (8, 4, 2))
@pytest.mark.parametrize("block", BLOCKS)
def test_stored_bytes_per_element_are_exactly_predicted(bits, block):
    n = block * 6
    q = tw_triton.quantize(_randn(n, torch.bfloat16, seed=1), bits=bits, block=block)
    assert q.nbytes == q.codes.numel() * q.codes.element_size() + q.scales.numel() * 4
    # A multiple of the block: exactly bits/8 + 4/block bytes per element.
    assert q.nbytes == n * bits // 8 + 4 * (n // block)
    assert q.nbytes / n == codec.stored_bytes_per_element(bits, block) == bits / 8 + 4 / block
    # Any numel: ceil(n * bits / 8) + 4 * ceil(n / block).
    for m in (1, block - 1, block + 1, 5 * block + 3):
        qm = tw_triton.quantize(_randn(m, torch.float32, seed=m), bits=bits, block=block)
        assert qm.nbytes == math.ceil(m * bits / 8) + 4 * math.ceil(m / block)
        assert qm.nbytes == codec.packed_nbytes(m, bits) + 4 * codec.num_blocks(m, block)


# ---------------------------------------------------------------------------- docs, bench


def _readme_codec_section() -> str:
    text = (ROOT / "docs" / "codecs.md").read_text()  # moved there from the README
    start = text.index("## Quantize a tensor")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_readme_example_runs():
    section = _readme_codec_section()
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "the codec section of docs/codecs.md has no python example"
    for code in blocks:
        exec(compile(code, "docs/codecs.md", "exec"), {"__name__": "readme_example"})


def test_readme_ratio_table_is_the_generated_one():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "codec.py"), "--ratios"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    table = proc.stdout.strip()
    assert len(table.splitlines()) == 2 + 3 * 6  # header, rule, bits x blocks
    assert table in _readme_codec_section()


def test_benchmark_quick_smoke(tmp_path):
    out = tmp_path / "codec_cpu.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "codec.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "clone" in proc.stdout and "encode" in proc.stdout
    text = out.read_text()
    assert "GB/s" in text and "chunk" in text


# ------------------------------------------------------------------ fewer levels (int3)


@pytest.mark.parametrize("bits,qmax", [(4, 3), (4, 1), (8, 15), (8, 127)])
def test_fewer_levels_in_the_same_container_match_the_oracle(bits, qmax):
    gen = torch.Generator().manual_seed(qmax)
    x = torch.randn(4 * 128 + 17, generator=gen)
    q = codec.quantize(x, bits=bits, block=128, qmax=qmax)
    want_codes, want_scales = spec_encode(x.numpy(), None, bits, 128, qmax)
    assert np.array_equal(q.codes.numpy(), want_codes)
    assert np.array_equal(q.scales.numpy(), want_scales)
    offset = 1 << (bits - 1)
    u = q.codes.numpy().astype(np.int64)
    fields = [(u >> (j * bits)) & ((1 << bits) - 1) for j in range(8 // bits)]
    used = np.stack(fields, axis=1).reshape(-1)[: x.numel()]
    assert used.min() >= offset - qmax and used.max() <= offset + qmax
    # The usual bound, with the narrower scale: |x - x_hat| <= s / 2.
    err = (codec.dequantize(q) - x).abs().view(-1)
    s = torch.repeat_interleave(q.scales, 128)[: x.numel()]
    assert bool((err <= s / 2).all())


def test_int3_rule_records_qmax_and_round_trips_through_a_file(tmp_path):
    x = torch.randn(64, 96)
    q = tw_triton.quantize_state_dict({"m": x}, rules=[("m", {"codec": "int3", "block": 64})])
    entry = q.entries["m"]
    assert entry.params["bits"] == 4 and entry.params["qmax"] == 3
    tw_triton.save(q, tmp_path / "a.tw")
    back = tw_triton.load(tmp_path / "a.tw")["m"]
    assert torch.equal(back, codec.dequantize(codec.quantize(x, bits=4, block=64, qmax=3)))
    # A full-range qmax is the default and is not recorded.
    q4 = tw_triton.quantize_state_dict({"m": x}, rules=[("m", {"codec": "int4", "qmax": 7})])
    assert "qmax" not in q4.entries["m"].params


@pytest.mark.parametrize("bad", [0, 8, -1, 2.0, True, "3"])
def test_bad_qmax_is_refused_naming_it(bad):
    with pytest.raises(QuantizationError, match="qmax"):
        codec.quantize(torch.randn(256), bits=4, qmax=bad)
    with pytest.raises(QuantizationError, match="qmax"):
        tw_triton.quantize_state_dict({"m": torch.randn(256)}, rules=[("m", {"codec": "int4", "qmax": bad})])


def test_a_manifest_with_an_impossible_qmax_fails_to_load(tmp_path):
    q = tw_triton.quantize_state_dict({"m": torch.randn(256)}, rules=[("m", "int3")])
    q.entries["m"].params["qmax"] = 9  # more levels than 4 bits hold
    tw_triton.save(q, tmp_path / "bad.tw")
    with pytest.raises(CheckpointError, match=r"bad\.tw.*'m'.*qmax"):
        tw_triton.load(tmp_path / "bad.tw")
