"""An independent, slow, numpy statement of the codec and exact-arithmetic helpers.

The torch path in :mod:`tw_triton.codecs.blockwise` is optimized (chunks, in-place passes, a rounding
constant instead of ``round``, packing in float); this module restates the spec of
docs/codecs.md ("Quantize a tensor") as plainly as possible so the tests can compare the two byte for
byte. It also turns fp32 values into exact integers (units of ``2**-EXACT_SHIFT``) so error
bounds can be checked with equality arithmetic instead of a tolerance.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch

# Every fp32 value is a multiple of 2**-149, a product q * scale too, and the bound terms
# scale / 2 and half an ulp are multiples of 2**-150; 2**-175 leaves room to spare.
EXACT_SHIFT = 175


def to_f32(t: torch.Tensor | None) -> np.ndarray | None:
    """The tensor's values as flat float32 numpy (fp16/bf16 upcast exactly)."""
    if t is None:
        return None
    return t.detach().reshape(-1).to(torch.float32).numpy().copy()


def spec_encode(
    x32: np.ndarray, r32: np.ndarray | None, bits: int, block: int, qmax: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Codes (uint8) and scales (float32) of the codec in docs/codecs.md, block by block (``qmax``:
    the largest code magnitude, by default the container's)."""
    qmax = (1 << (bits - 1)) - 1 if qmax is None else qmax
    offset = 1 << (bits - 1)
    k = 8 // bits
    n = x32.size
    with np.errstate(all="ignore"):
        d = x32 if r32 is None else (x32 - r32).astype(np.float32)
        nblocks = -(-n // block)
        padded = np.zeros(nblocks * block, dtype=np.float32)
        padded[:n] = d
        rows = padded.reshape(nblocks, block)
        absmax = np.abs(rows).max(axis=1) if nblocks else np.zeros(0, np.float32)
        absmax = np.where(np.isfinite(absmax), absmax, np.float32(np.inf)).astype(np.float32)
        scales = (absmax / np.float32(qmax)).astype(np.float32)
        usable = (scales > 0) & np.isfinite(scales)
        q = nearest_integer(rows, np.where(usable, scales, 1)[:, None])
        q = np.clip(q, -qmax, qmax)
        q = np.where(usable[:, None], q, 0).astype(np.int64)
    u = (q + offset).reshape(-1)
    nbytes = (n * bits + 7) // 8
    groups = u.reshape(-1, k)
    packed = np.zeros(groups.shape[0], dtype=np.int64)
    for j in range(k):
        packed |= groups[:, j] << (j * bits)
    return packed[:nbytes].astype(np.uint8), scales


def nearest_integer(d32: np.ndarray, s32: np.ndarray) -> np.ndarray:
    """The integer nearest to the exact quotient ``d / s`` of fp32 values, ties to even
    (int64; NaN and infinite ``d`` give 0, ``s`` must be positive and finite).

    The fp64 quotient is within a relative ``2**-53`` of ``d / s``, so rounding it gives
    the right integer unless it lies that close to a half-integer. Quotients within a
    relative ``2**-40`` of one are rounded in exact rational arithmetic instead. (The kernel
    stays in fp32 and settles ties with split products, see
    ``tw_triton.ops.reference.nearest_integer_at_ties``; the torch path rounds an fp64 quotient at 8
    and 4 bits, see ``tw_triton.ops.reference.blockwise_encode``. This check relies on neither.)
    """
    d = np.asarray(d32, dtype=np.float64)
    s = np.broadcast_to(np.asarray(s32, dtype=np.float64), d.shape)
    finite = np.isfinite(d)
    t = np.where(finite, d, 0.0) / s
    # Far beyond any code: the clamp decides, and int64 must not overflow.
    t = np.clip(t, -(2.0**40), 2.0**40)
    q = np.rint(t)
    near_tie = np.abs(np.abs(t - np.floor(t)) - 0.5) < np.abs(t) * 2.0**-40
    for idx in zip(*np.nonzero(near_tie)):
        # Python's round() of a Fraction is exact, ties to even.
        q[idx] = round(Fraction(float(d[idx])) / Fraction(float(s[idx])))
    return q.astype(np.int64)


def spec_codes_to_q(codes: np.ndarray, numel: int, bits: int) -> np.ndarray:
    """Signed integer codes q, one per element, from packed bytes."""
    k = 8 // bits
    mask = (1 << bits) - 1
    u = (codes.astype(np.int64)[:, None] >> (np.arange(k) * bits)) & mask
    return u.reshape(-1)[:numel] - (1 << (bits - 1))


def saturate(a: np.ndarray, limit: float) -> np.ndarray:
    """``a`` clamped to ``[-limit, limit]`` by comparisons, so NaN stays NaN (bits kept)."""
    lim = np.float32(limit)
    return np.where(a > lim, lim, np.where(a < -lim, -lim, a)).astype(np.float32)


def spec_decode_f32(
    codes: np.ndarray,
    scales: np.ndarray,
    numel: int,
    bits: int,
    block: int,
    r32: np.ndarray | None,
    dtype: torch.dtype = torch.float32,
) -> np.ndarray:
    """The decoded fp32 values before the final cast to ``dtype``:
    ``sat_dtype(fl(fl(r) + sat_fp32(fl(q * scale))))``, ``sat_T`` clamping to T's largest
    finite value."""
    q = spec_codes_to_q(codes, numel, bits).astype(np.float32)
    s = np.repeat(scales, block)[:numel]
    with np.errstate(all="ignore"):
        p = saturate((q * s).astype(np.float32), np.finfo(np.float32).max)
        # numpy never fuses the multiply into the add
        xh = p if r32 is None else (r32 + p).astype(np.float32)
    return saturate(xh, torch.finfo(dtype).max)


def exact(a: np.ndarray) -> np.ndarray:
    """Finite float32 (or fp32-representable float64) values as exact Python ints, in
    units of ``2**-EXACT_SHIFT`` (an object array)."""
    a64 = np.asarray(a, dtype=np.float64).reshape(-1)
    assert np.all(np.isfinite(a64)), "exact() takes finite values only"
    m, e = np.frexp(a64)
    mant = (m * 2.0**24).astype(np.int64)  # exact: an fp32 has 24 significant bits
    assert np.all(mant.astype(np.float64) == m * 2.0**24), "value is not an fp32"
    # value = mant * 2**(e - 24); every fp32 is a multiple of 2**-149, so e + 151 >= 2.
    out = np.empty(a64.size, dtype=object)
    for i, (mi, ei) in enumerate(zip(mant.tolist(), e.tolist())):
        out[i] = mi << (ei - 24 + EXACT_SHIFT) if mi else 0
    return out


def half_ulp_exact(a32: np.ndarray) -> np.ndarray:
    """Exact half spacing above |a| for fp32 values: bounds the error of a rounding to a."""
    with np.errstate(over="ignore"):
        gap = np.abs(np.spacing(np.abs(a32.astype(np.float32))))
    # Above the fp32 maximum the next value would be 2**128: the spacing there is 2**104.
    gap = np.where(np.isfinite(gap), gap, np.float32(2.0**104)).astype(np.float32)
    return exact(gap) // 2


def scale_of(absmax32: np.ndarray, bits: int, qmax: int | None = None) -> np.ndarray:
    """The codec's scale ``fl(absmax / qmax)`` in fp32."""
    qmax = (1 << (bits - 1)) - 1 if qmax is None else qmax
    return (np.asarray(absmax32, np.float32) / np.float32(qmax)).astype(np.float32)


def near_tie_blocks(
    rng: np.random.Generator,
    nblocks: int,
    block: int,
    bits: int,
    log2_lo: float,
    log2_hi: float,
    qmax: int | None = None,
) -> np.ndarray:
    """fp32 deltas, ``nblocks * block`` of them, built to sit on or next to half-integer
    multiples of their block's scale: where a once-rounded quotient ``fl(d/s)`` lands on a
    half-integer that ``d/s`` is not on.

    Block ``b`` gets a scale ``s`` of magnitude ``2**e``, ``e`` uniform in
    ``[log2_lo, log2_hi]`` (a power of two for a quarter of the blocks, a random 24-bit
    mantissa otherwise); its first element is an absmax ``a`` with ``fl(a/qmax) = s`` and
    the others are ``fl((n + 1/2) * s)`` moved by ``-2..2`` ulps, ``|n + 1/2| < qmax``.
    """
    qmax = (1 << (bits - 1)) - 1 if qmax is None else qmax
    e = rng.uniform(log2_lo, log2_hi, nblocks)
    mant = np.where(rng.random(nblocks) < 0.25, 1.0, 1.0 + rng.integers(0, 2**23, nblocks) / 2**23)
    s = (mant * np.exp2(np.floor(e))).astype(np.float32)
    s = np.where(s > 0, s, np.float32(2.0**-149)).astype(np.float32)
    a = (np.float64(qmax) * s.astype(np.float64)).astype(np.float32)
    # Nudge a until it maps back to s where it can; otherwise keep the scale it gives.
    for step in (0, 1, -1, 2, -2):
        cand = np.maximum(a.view(np.int32) + np.int32(step), 1).view(np.float32)
        hit = scale_of(cand, bits, qmax) == s
        a = np.where(hit, cand, a).astype(np.float32)
    s = scale_of(a, bits, qmax)
    n = rng.integers(-qmax, qmax, (nblocks, block)) + 0.5  # half-integers in (-qmax, qmax)
    base = (n * s.astype(np.float64)[:, None]).astype(np.float32)  # n*s is exact in fp64
    ulps = rng.integers(-2, 3, (nblocks, block)).astype(np.int32)
    # Moving the bit pattern of |base| by k moves it by k ulps (across binades too).
    mag = np.maximum(np.abs(base).view(np.int32) + ulps, 0).view(np.float32)
    d = np.copysign(mag, base).astype(np.float32)
    d[:, 0] = a
    # |d| <= (qmax - 1/2) * s + 2 ulps < a: the first element stays the absmax.
    return d.reshape(-1)


def with_reference(
    rng: np.random.Generator, d32: np.ndarray, ref_dtype: torch.dtype
) -> tuple[np.ndarray, torch.Tensor]:
    """``(x32, ref)`` with ``fl(x32 - fp32(ref)) == d32`` element for element, so that a
    delta built by :func:`near_tie_blocks` survives being encoded against a reference.

    The reference is ``d`` times a random factor in ``[-4, 4]``, rounded to ``ref_dtype``;
    where ``x = d + ref`` is not exact in fp32 the reference is 0 there instead.
    """
    d = np.asarray(d32, dtype=np.float32)
    r64 = d.astype(np.float64) * rng.uniform(-4, 4, d.shape)
    r32 = torch.from_numpy(r64).to(ref_dtype).to(torch.float32).numpy()
    with np.errstate(all="ignore"):
        x = (d.astype(np.float64) + r32.astype(np.float64)).astype(np.float32)
        ok = np.isfinite(x) & np.isfinite(r32) & ((x - r32).astype(np.float32) == d)
    r32 = np.where(ok, r32, np.float32(0)).astype(np.float32)
    x = np.where(ok, x, d).astype(np.float32)
    return x, torch.from_numpy(r32).to(ref_dtype)


# bits(+inf) and bits(-0.0) as int32 values (the log2 codec's spec).
_F32_INF_BITS = 0x7F800000
_NEG_ZERO_BITS = -(1 << 31)


def spec_encode_log2(x32: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes (uint8), ``lo`` and ``hi`` (int32) of the ``log2`` codec, as its module doc
    states them, block by block in numpy (no chunks, no fast path, no packing tricks)."""
    n_steps = np.float32((1 << bits) - 2)
    n = x32.size
    nblocks = -(-n // block)
    v = np.zeros(nblocks * block, dtype=np.float32)
    v[:n] = x32
    t = v.view(np.int32).astype(np.int64).reshape(nblocks, block)
    pos = (t > 0) & (t < _F32_INF_BITS)
    zero = (t == 0) | (t == _NEG_ZERO_BITS)
    bad = ~(pos | zero).all(axis=1)
    pos &= ~bad[:, None]
    has = pos.any(axis=1)
    lo = np.where(has, np.where(pos, t, 2**40).min(axis=1), 0)
    hi = np.where(has, np.where(pos, t, 0).max(axis=1), 0)
    lo = np.where(bad, -1, lo)
    hi = np.where(bad, -1, hi)
    step = ((hi - lo).astype(np.float32) / n_steps).astype(np.float32)
    with np.errstate(all="ignore"):
        r = ((t - lo[:, None]).astype(np.float32) / np.where(step > 0, step, np.float32(1))[:, None]).astype(
            np.float32
        )
        r = np.where((step > 0)[:, None], np.rint(r), 0)
    u = np.where(pos, 1 + np.minimum(n_steps, np.maximum(r, 0)), 0).astype(np.int64).reshape(-1)
    k = 8 // bits
    packed = np.zeros(u.size // k, dtype=np.int64)
    for j in range(k):
        packed |= u.reshape(-1, k)[:, j] << (j * bits)
    return packed[: (n * bits + 7) // 8].astype(np.uint8), lo.astype(np.int32), hi.astype(np.int32)


def spec_decode_log2(
    codes: np.ndarray, lo: np.ndarray, hi: np.ndarray, numel: int, bits: int, block: int
) -> np.ndarray:
    """The fp32 values the ``log2`` codec decodes to (before the cast to the stored dtype)."""
    n_steps = np.float32((1 << bits) - 2)
    k = 8 // bits
    u = ((codes.astype(np.int64)[:, None] >> (np.arange(k) * bits)) & ((1 << bits) - 1)).reshape(-1)[:numel]
    blk = np.arange(numel) // block
    lo_e, hi_e = lo.astype(np.int64)[blk], hi.astype(np.int64)[blk]
    step = ((hi_e - lo_e).astype(np.float32) / n_steps).astype(np.float32)
    p = ((u - 1).astype(np.float32) * step).astype(np.float32)
    p = (p + np.float32(0.5)).astype(np.float32)
    t_hat = np.minimum(hi_e, lo_e + np.trunc(p).astype(np.int64))
    t_hat = np.where(u == 0, 0, t_hat)
    return t_hat.astype(np.int32).view(np.float32)


def near_half_log2_blocks(rng: np.random.Generator, nblocks: int, block: int, bits: int) -> np.ndarray:
    """fp32 positives, ``nblocks * block`` of them, whose log2 quotients ``fl(t - lo) / step``
    sit on and within a few dozen units of half-integers: where one multiply by the
    reciprocal of the step can land on the wrong side of the half-integer.

    Block ``b`` spans bit patterns ``lo .. lo + D`` (``D`` up to ``2**30``, so the step is
    large and an integer ``t - lo`` can come within an ulp of ``(k + 1/2) * step``); its first
    two elements are its bounds, the others ``lo + round((k + 1/2) * step) + d``,
    ``|d| <= 40``, clipped to the block's span.
    """
    n_steps = (1 << bits) - 2
    lo = rng.integers(0x20000000, 0x30000000, nblocks).astype(np.int64)
    span = rng.integers(1 << 20, 1 << 30, nblocks).astype(np.int64)
    step = (span.astype(np.float32) / np.float32(n_steps)).astype(np.float64)
    k = rng.integers(0, n_steps, (nblocks, block)) + 0.5
    a = np.rint(k * step[:, None]).astype(np.int64) + rng.integers(-40, 41, (nblocks, block))
    t = lo[:, None] + np.clip(a, 0, span[:, None])
    t[:, 0], t[:, 1] = lo, lo + span
    return t.astype(np.int32).view(np.float32).reshape(-1)
