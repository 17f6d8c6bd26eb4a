"""Property tests of the codec's CPU path (hypothesis).

For random shapes, dtypes, bits, blocks, magnitudes from 1e-30 to 1e30, with and without a
reference of any float dtype:

* the optimized torch path gives the bytes of the plain numpy statement of the spec
  (``_codec_oracle``), scales bit for bit, and decodes to the same bits;
* shapes, dtypes and buffer sizes are what the API promises;
* the error bound holds element-wise, checked in exact integer arithmetic.

The bound (``d`` the fp32 delta, ``s`` its block's scale, ``q`` its code, ``a`` the block's
absmax, ``qmax = 2**(bits-1) - 1``)::

    |d - q*s| <= s/2                      when s is a normal fp32,
    |d - q*s| <= max(s/2, a - qmax*s)     always (s subnormal or 0).

Why: ``q`` is the integer nearest to the exact quotient ``d/s`` (ties to even), clamped to
``+-qmax``: ``rne(fl(d/s))`` everywhere except where ``fl(d/s)`` is a half-integer, which is
resolved exactly (``tw_triton.codecs.blockwise.nearest_integer_at_ties``). A normal ``s`` is within a
factor ``1 + 2**-24`` of ``a/qmax``, so ``|d/s|`` rounds to at most ``qmax`` and the clamp
never binds; a subnormal ``s`` can be up to ``2**-150`` short of ``a/qmax``, then the clamp
binds and the error is ``|d| - qmax*s <= a - qmax*s < qmax * 2**-150``. A block whose
``a/qmax`` underflows to ``s = 0`` decodes to 0: error ``|d| <= a``.

Decoded fp32 value before the final cast (``x32 = fp32(x)``, ``r32 = fp32(ref)``,
``p = sat(fl(q*s))``, ``xh = sat(fl(r32 + p))``, ``sat`` clamping to the fp32 range)::

    |x32 - xh| <= E + ulp(p)/2 + [ulp(d)/2 + ulp(xh)/2 with a reference]

with ``E`` the bound above and ``ulp(y)`` the spacing of fp32 above ``|y|``: the delta, the
product and the add are each rounded to nearest once, and a saturation only moves a value
towards ``x32``, which lies inside the range. So a quantizable block never decodes to inf.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from _codec_oracle import (
    EXACT_SHIFT,
    exact,
    half_ulp_exact,
    near_tie_blocks,
    saturate,
    spec_codes_to_q,
    spec_decode_f32,
    spec_encode,
    to_f32,
    with_reference,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tw_triton
from tw_triton.codecs import blockwise as codec
from tw_triton.ops.reference import buffers

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_NUMEL = 3000
SMALLEST_NORMAL = 2.0**-126
F32_MAX = float(np.finfo(np.float32).max)

PROPERTY_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@st.composite
def shapes(draw: st.DrawFn) -> tuple[int, ...]:
    """Shapes of 0 to 3 dims with at most MAX_NUMEL elements; now and then an empty one."""
    ndim = draw(st.integers(0, 3))
    shape: list[int] = []
    budget = MAX_NUMEL
    for _ in range(ndim):
        dim = draw(st.integers(1, min(budget, 700)))
        shape.append(dim)
        budget = max(1, budget // dim)
    if ndim and draw(st.integers(0, 15)) == 0:
        shape[draw(st.integers(0, ndim - 1))] = 0
    return tuple(shape)


def _values(mode: str, rng: np.random.Generator, n: int, log_mag: float, bits: int, block: int) -> np.ndarray:
    """n float64 values (exact in fp32 where it matters) of one of the test distributions."""
    qmax = codec.qmax_for(bits)
    if mode == "wide":  # magnitudes spread over 4 decades inside each block
        return rng.standard_normal(n) * 10.0 ** (log_mag + rng.uniform(-2, 2, n))
    if mode == "narrow":
        return rng.standard_normal(n) * 10.0**log_mag
    if mode == "ties":  # exact half-integer multiples of a power-of-two scale
        unit = 2.0 ** math.floor(log_mag * math.log2(10))
        vals = rng.integers(-2 * qmax, 2 * qmax + 1, n) * (unit / 2)
        if n:
            vals[0] = qmax * unit  # pins the absmax, so the scale is exactly `unit`
        return vals
    if mode == "near_ties":  # on and next to half-integer multiples of the block's scale
        blocks = -(-n // block)
        lo = log_mag * math.log2(10)
        return near_tie_blocks(rng, blocks, block, bits, lo - 3, lo + 3)[:n].astype(np.float64)
    if mode == "sparse":  # mostly zeros: whole blocks of absmax 0
        return rng.standard_normal(n) * 10.0**log_mag * (rng.random(n) < 0.02)
    # subnormal scales (and subnormal x), magnitudes next to the fp32 maximum, or both
    # Scales are subnormal below qmax * 2**-126 = 2**(bits - 127) or so.
    tiny = rng.uniform(-1, 1, n) * 2.0 ** rng.uniform(-148, -118) * (rng.random(n) < 0.7)
    huge = rng.uniform(-1, 1, n) * float(np.finfo(np.float32).max)
    pick_tiny = rng.random(n) < {"tiny": 1.0, "huge": 0.0, "both": 0.5}[mode]
    return np.where(pick_tiny, tiny, huge)


@st.composite
def codec_cases(draw: st.DrawFn) -> dict:
    """One encode problem: x, an optional reference, bits and block."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(shapes())
    bits = draw(st.sampled_from(codec.SUPPORTED_BITS))
    block = 2 ** draw(st.integers(5, 12))
    seed = draw(st.integers(0, 2**32 - 1))
    # fp16 holds about 6e-8..6.5e4; bf16 and fp32 hold 1e-30..1e30 comfortably.
    lo, hi = (-7.0, 4.0) if dtype == torch.float16 else (-30.0, 30.0)
    log_mag = draw(st.floats(lo, hi))
    mode = draw(st.sampled_from(("wide", "narrow", "ties", "near_ties", "sparse", "tiny", "huge", "both")))
    ref_kind = draw(st.sampled_from((None, "near", "far")))
    ref_dtype = draw(st.sampled_from(DTYPES))

    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    vals = _values(mode, rng, n, log_mag, bits, block)
    x = torch.from_numpy(vals).to(torch.float32).to(dtype).reshape(shape)
    ref = None
    if mode == "near_ties" and ref_kind is not None:
        # Keep the near-tie deltas: x = d + ref exactly (fp32 x; d in fp32 needs it).
        x32, ref = with_reference(rng, vals.astype(np.float32), ref_dtype)
        x = torch.from_numpy(x32).reshape(shape)
        ref = ref.reshape(shape)
    elif ref_kind == "near":
        noise = rng.standard_normal(n) * np.abs(vals) * 10.0 ** rng.uniform(-4, 0.5)
        ref = torch.from_numpy(vals + noise).to(torch.float32).to(ref_dtype).reshape(shape)
    elif ref_kind == "far":
        ref_vals = _values(mode, rng, n, log_mag, bits, block)
        ref = torch.from_numpy(ref_vals).to(torch.float32).to(ref_dtype).reshape(shape)
    return dict(x=x, ref=ref, bits=bits, block=block)


def _per_element(values: np.ndarray, block: int, n: int) -> np.ndarray:
    return np.repeat(values, block)[:n]


def _check_encode_bound(d32: np.ndarray, q: np.ndarray, scales: np.ndarray, bits: int, block: int):
    """Exact check of |d - q*s| against the bound in the module docstring; returns the
    per-element bound (exact ints) for the decode check."""
    n = d32.size
    qmax = codec.qmax_for(bits)
    rows = np.zeros(scales.size * block, dtype=np.float32)
    rows[:n] = d32
    absmax = np.abs(rows.reshape(-1, block)).max(axis=1)
    s = _per_element(scales, block, n)
    a = _per_element(absmax, block, n)
    S, D, A = exact(s), exact(d32), exact(a)
    Q = q.astype(object)
    err = np.abs(D - Q * S)
    half = S // 2  # S is a multiple of 2**26 units: exact
    clamp = A - qmax * S
    normal = s >= SMALLEST_NORMAL
    assert np.all(err[normal] <= half[normal]), "strict bound s/2 for normal scales violated"
    bound = np.maximum(half, clamp)
    assert np.all(err <= bound), "bound for subnormal/zero scales violated"
    # The clamp term is at most qmax * 2**-150 where it is not dominated.
    tiny = clamp > half
    assert np.all(clamp[tiny] <= qmax * 2 ** (EXACT_SHIFT - 150))
    return bound


def _unquantizable_blocks(scales: np.ndarray) -> np.ndarray:
    """Blocks with an infinite scale: NaN/Inf in x, in the reference or in their delta."""
    return np.isinf(scales)


@PROPERTY_SETTINGS
@given(case=codec_cases())
def test_torch_path_matches_the_spec_byte_for_byte(case):
    x, ref, bits, block = case["x"], case["ref"], case["bits"], case["block"]
    q = tw_triton.quantize(x, bits=bits, block=block, reference=ref)
    codes, scales = spec_encode(to_f32(x), to_f32(ref), bits, block)
    assert np.array_equal(q.codes.numpy(), codes)
    assert np.array_equal(q.scales.numpy().view(np.int32), scales.view(np.int32))
    want_f32 = spec_decode_f32(codes, scales, x.numel(), bits, block, to_f32(ref))
    got_f32 = tw_triton.dequantize(q, reference=ref, dtype=torch.float32)
    assert np.array_equal(got_f32.reshape(-1).numpy().view(np.int32), want_f32.view(np.int32))
    for dtype in DTYPES:
        got = tw_triton.dequantize(q, reference=ref, dtype=dtype)
        # The final cast is torch's round-to-nearest-even of the fp32 value saturated to
        # the dtype's range.
        want_sat = spec_decode_f32(codes, scales, x.numel(), bits, block, to_f32(ref), dtype)
        want = torch.from_numpy(want_sat).to(dtype).reshape(x.shape)
        assert torch.equal(
            got.view(torch.int16 if dtype != torch.float32 else torch.int32),
            want.view(torch.int16 if dtype != torch.float32 else torch.int32),
        )


@PROPERTY_SETTINGS
@given(case=codec_cases())
def test_round_trip_shapes_sizes_and_flag(case):
    x, ref, bits, block = case["x"], case["ref"], case["bits"], case["block"]
    q = tw_triton.quantize(x, bits=bits, block=block, reference=ref)
    n = x.numel()
    assert q.shape == tuple(x.shape) and q.dtype == x.dtype and q.numel == n
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (math.ceil(n * bits / 8),)
    assert q.scales.dtype == torch.float32 and q.scales.shape == (math.ceil(n / block),)
    assert q.nbytes == math.ceil(n * bits / 8) + 4 * math.ceil(n / block)
    out = tw_triton.dequantize(q, reference=ref)
    assert out.shape == x.shape and out.dtype == x.dtype
    # The flag: a 0-dim bool tensor, true exactly when some block cannot be quantized.
    assert q.nonfinite.shape == () and q.nonfinite.dtype == torch.bool
    d32 = to_f32(x) if ref is None else (to_f32(x) - to_f32(ref))
    scales = q.scales.numpy()
    assert bool(q.nonfinite) == bool(_unquantizable_blocks(scales).any())
    if not np.all(np.isfinite(d32)):
        assert bool(q.nonfinite)
    else:
        assert not bool(q.nonfinite)  # finite deltas: every block is quantizable
    if not bool(q.nonfinite):
        assert np.all(np.isfinite(to_f32(x)))
        # The decode saturates: a quantizable tensor never decodes to inf, in any dtype.
        assert bool(torch.isfinite(out).all())
        for dtype in DTYPES:
            assert bool(torch.isfinite(tw_triton.dequantize(q, reference=ref, dtype=dtype)).all())


@PROPERTY_SETTINGS
@given(case=codec_cases())
def test_error_bound_is_exact(case):
    x, ref, bits, block = case["x"], case["ref"], case["bits"], case["block"]
    q = tw_triton.quantize(x, bits=bits, block=block, reference=ref)
    n = x.numel()
    x32, r32 = to_f32(x), to_f32(ref)
    with np.errstate(over="ignore", invalid="ignore"):
        d32 = x32 if r32 is None else (x32 - r32).astype(np.float32)
    scales = q.scales.numpy()
    # Only blocks the codec can quantize carry a bound; the others are stored exact.
    ok = ~_per_element(_unquantizable_blocks(scales), block, n)
    if not ok.any():
        return
    codes = q.codes.numpy()
    qi = spec_codes_to_q(codes, n, bits)
    bound = _check_encode_bound(
        np.where(ok, d32, 0).astype(np.float32),
        np.where(ok, qi, 0),
        np.where(_unquantizable_blocks(scales), 0, scales).astype(np.float32),
        bits,
        block,
    )
    # Decoded fp32 value before the final cast: finite wherever the block is quantizable.
    xh = tw_triton.dequantize(q, reference=ref, dtype=torch.float32).reshape(-1).numpy()
    assert np.all(np.isfinite(xh[ok]))
    s = _per_element(scales, block, n)
    with np.errstate(all="ignore"):
        p = saturate((qi.astype(np.float32) * s).astype(np.float32), F32_MAX)
    X, XH = exact(x32[ok]), exact(xh[ok])
    allowed = bound[ok] + half_ulp_exact(p[ok])
    if r32 is not None:
        allowed = allowed + half_ulp_exact(d32[ok]) + half_ulp_exact(xh[ok])
    assert np.all(np.abs(X - XH) <= allowed)


@pytest.mark.parametrize("bits", codec.SUPPORTED_BITS)
def test_many_chunks_match_the_spec(monkeypatch, bits):
    """Chunk boundaries: with tiny chunks a tensor spans many of them plus a partial one."""
    monkeypatch.setattr(buffers, "CHUNK_ELEMENTS", 64)
    rng = np.random.default_rng(bits)
    n = 64 * 37 + 29
    x = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(torch.bfloat16)
    ref = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    for block in (32, 64, 128):
        q = tw_triton.quantize(x, bits=bits, block=block, reference=ref)
        codes, scales = spec_encode(to_f32(x), to_f32(ref), bits, block)
        assert np.array_equal(q.codes.numpy(), codes)
        assert np.array_equal(q.scales.numpy(), scales)
        want = spec_decode_f32(codes, scales, n, bits, block, to_f32(ref))
        got = tw_triton.dequantize(q, reference=ref, dtype=torch.float32).numpy()
        assert np.array_equal(got.view(np.int32), want.view(np.int32))


def _find_strict_bound_violation() -> tuple[np.float32, np.float32, int]:
    """Search (deterministically) for d, s with fl(d/s) exactly k + 1/2 while d/s is not,
    such that the old rule q = rne(fl(d/s)) breaks the strict bound; returns d, s, q_old."""
    rng = np.random.default_rng(0)
    for _ in range(200_000):
        s = np.float32(rng.uniform(1.0, 2.0))
        k = int(rng.integers(64, 127))
        base = np.float32((k + 0.5) * float(s))
        for d in (np.nextafter(base, np.float32(0)), base, np.nextafter(base, np.float32(1e9))):
            v = np.float32(d / s)
            if v != np.float32(k + 0.5):
                continue
            q = int(np.rint(v))
            if abs(exact(np.array([d]))[0] - q * exact(np.array([s]))[0]) > exact(np.array([s]))[0] // 2:
                return d, s, q
    raise AssertionError("no example found")


def test_old_rounding_rule_fails_the_strict_bound_where_the_codec_meets_it():
    """rne(fl(d/s)) can cross a tie that d/s is not on; the codec's rule does not."""
    d, s, q_old = _find_strict_bound_violation()
    # Build a block whose scale is exactly s: its absmax is fl(127 * s) if that maps back.
    a = np.float32(np.float32(127) * s)
    if np.float32(a / np.float32(127)) != s:
        a = np.nextafter(a, np.float32(1e9))
    assert np.float32(a / np.float32(127)) == s
    x = torch.zeros(128)
    x[0], x[1] = float(a), float(d)
    q = tw_triton.quantize(x, bits=8, block=128)
    assert q.scales[0].item() == float(s)
    q_new = int(spec_codes_to_q(q.codes.numpy(), 128, 8)[1])
    D, S = exact(np.array([d]))[0], exact(np.array([s]))[0]
    assert abs(D - q_old * S) > S // 2  # the old rule fails the strict bound here ...
    assert abs(D - q_new * S) <= S // 2  # ... the codec meets it,
    assert abs(q_new - q_old) == 1
    # ... because it rounds the exact quotient (Fraction: exact, ties to even).
    assert q_new == round(Fraction(float(d)) / Fraction(float(s)))


def _strict_bound_violations(d32: np.ndarray, q: np.ndarray, scales: np.ndarray, block: int) -> int:
    """How many elements have |d - q*s| > s/2, counted in exact arithmetic."""
    s = _per_element(scales, block, d32.size)
    err = np.abs(exact(d32) - q.astype(object) * exact(s))
    return int(np.count_nonzero(err > exact(s) // 2))


@pytest.mark.parametrize("bits", codec.SUPPORTED_BITS)
def test_strict_bound_on_adversarial_near_ties(bits):
    """Deltas d = fl((n + 1/2) * s) moved by up to 2 ulps, scales from 1e-30 to 1e30 and in
    the lowest normal binade [2**-126, 2**-125) (where v * s_lo would not be exact): the
    strict bound |d - q*s| <= s/2 holds for every element, without and with a reference,
    and the codes are the exact-arithmetic oracle's. The old rule rne(fl(d/s)) fails on this
    input at 8 and 4 bits (at 2 bits, qmax = 1 and s = absmax exactly: fl(d/s) cannot land
    on 1/2 unless d/s is 1/2)."""
    block = 128
    rng = np.random.default_rng(100 + bits)
    d = np.concatenate(
        [
            near_tie_blocks(rng, 480, block, bits, -100.0, 100.0),
            near_tie_blocks(rng, 160, block, bits, -126.0, -125.0),
        ]
    )
    x32, ref = with_reference(rng, d, torch.bfloat16)
    assert np.count_nonzero(ref.float().numpy()) > d.size // 2
    for x, r in ((torch.from_numpy(d), None), (torch.from_numpy(x32), ref)):
        q = tw_triton.quantize(x, bits=bits, block=block, reference=r)
        scales = q.scales.numpy()
        assert np.all(scales >= SMALLEST_NORMAL) and not bool(q.nonfinite)
        qi = spec_codes_to_q(q.codes.numpy(), d.size, bits)
        assert _strict_bound_violations(d, qi, scales, block) == 0
        codes, want_scales = spec_encode(to_f32(x), to_f32(r), bits, block)
        assert np.array_equal(q.codes.numpy(), codes)
        assert np.array_equal(scales.view(np.int32), want_scales.view(np.int32))
    # The input is adversarial: the once-rounded quotient crosses ties on it.
    s = _per_element(scales, block, d.size)
    q_old = np.rint((d / s).astype(np.float32)).astype(np.int64)
    old_violations = _strict_bound_violations(d, q_old, scales, block)
    if bits == 2:
        assert old_violations == 0
    else:
        assert old_violations > d.size // 100
