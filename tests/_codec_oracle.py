"""An independent, slow, numpy statement of the codec and exact-arithmetic helpers.

The torch path in :mod:`tw_triton.codec` is optimized (chunks, in-place passes, a rounding
constant instead of ``round``, packing in float); this module restates the spec of
DESIGN.md ("The codec") as plainly as possible so the tests can compare the two byte for
byte. It also turns fp32 values into exact integers (units of ``2**-EXACT_SHIFT``) so error
bounds can be checked with equality arithmetic instead of a tolerance.
"""

from __future__ import annotations

import numpy as np
import torch

# Every fp32 value is a multiple of 2**-149, a product q * scale too, and the bound terms
# scale * 2**(bits - 26) and half an ulp are multiples of 2**-175 at the finest.
EXACT_SHIFT = 175


def to_f32(t: torch.Tensor | None) -> np.ndarray | None:
    """The tensor's values as flat float32 numpy (fp16/bf16 upcast exactly)."""
    if t is None:
        return None
    return t.detach().reshape(-1).to(torch.float32).numpy().copy()


def spec_encode(
    x32: np.ndarray, r32: np.ndarray | None, bits: int, block: int
) -> tuple[np.ndarray, np.ndarray]:
    """Codes (uint8) and scales (float32) of DESIGN.md's codec, block by block."""
    qmax = (1 << (bits - 1)) - 1
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
        q = np.rint(rows / scales[:, None]).astype(np.float32)  # rint: ties to even
        q = np.clip(q, -qmax, qmax)
        q = np.where(usable[:, None], q, 0).astype(np.int64)
    u = (q + offset).reshape(-1)
    nbytes = (n * bits + 7) // 8
    groups = u.reshape(-1, k)
    packed = np.zeros(groups.shape[0], dtype=np.int64)
    for j in range(k):
        packed |= groups[:, j] << (j * bits)
    return packed[:nbytes].astype(np.uint8), scales


def spec_codes_to_q(codes: np.ndarray, numel: int, bits: int) -> np.ndarray:
    """Signed integer codes q, one per element, from packed bytes."""
    k = 8 // bits
    mask = (1 << bits) - 1
    u = (codes.astype(np.int64)[:, None] >> (np.arange(k) * bits)) & mask
    return u.reshape(-1)[:numel] - (1 << (bits - 1))


def spec_decode_f32(
    codes: np.ndarray, scales: np.ndarray, numel: int, bits: int, block: int, r32: np.ndarray | None
) -> np.ndarray:
    """The decoded fp32 values before the final cast: fl(fl(r) + fl(q * scale))."""
    q = spec_codes_to_q(codes, numel, bits).astype(np.float32)
    s = np.repeat(scales, block)[:numel]
    with np.errstate(all="ignore"):
        p = (q * s).astype(np.float32)  # numpy never fuses this into the add
        return p if r32 is None else (r32 + p).astype(np.float32)


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
    return exact(np.abs(np.spacing(np.abs(a32.astype(np.float32))))) // 2
