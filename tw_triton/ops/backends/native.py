"""The compiled CPU codec, C called through ctypes.

The plain-torch ops of :mod:`tw_triton.ops.reference` are the spec; the C functions in
``tw_triton/csrc`` do the same arithmetic one block at a time in buffers that stay in the
L1 cache, and give the same bytes and the same decoded values, so which one ran never
shows in a file. :mod:`tw_triton.ops.backends.cpu` runs it where it takes the tensors
and the reference otherwise.

A tensor of at least :data:`SPLIT_MIN_ELEMENTS` is split into ranges of whole blocks that
run on ``torch.get_num_threads()`` threads (ctypes lets go of the GIL during each call).
The library also merges the byte planes of the entropy stage (:func:`merge_planes`, for
:mod:`tw_triton.codecs.entropy`); the ``log2-temporal`` wrappers, built on the range
helpers here, are in :mod:`tw_triton.ops.backends.native_temporal`. Why a C twin:
docs/performance.md.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ...errors import TwTritonError
from ...parallel import parallel_map

logger = logging.getLogger(__name__)

ENV_NATIVE = "TW_TRITON_NATIVE"
# Below this many elements a tensor is not split between threads: a hand-over costs tens
# of microseconds, about what the C code spends on 2**20 elements.
SPLIT_MIN_ELEMENTS = 1 << 20
# The dtype codes of tw_triton/csrc/native.h.
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
_SIGNATURES = {
    # x, x_dtype, ref, ref_dtype, n, block, bits, qmax, codes, scales
    "tw_blockwise_encode": [_P, _I32, _P, _I32, _I64, _I32, _I32, _I32, _P, _P],
    # codes, scales, n, bits, block, ref, ref_dtype, out, out_dtype
    "tw_blockwise_decode": [_P, _P, _I64, _I32, _I32, _P, _I32, _P, _I32],
    # x, x_dtype, n, block, bits, codes, lo, hi
    "tw_log2_encode": [_P, _I32, _I64, _I32, _I32, _P, _P, _P],
    # codes, lo, hi, n, bits, block, out, out_dtype
    "tw_log2_decode": [_P, _P, _P, _I64, _I32, _I32, _P, _I32],
    # x, ref, n, block, bits, min_step, codes, lo, hi
    "tw_log2_temporal_encode": [_P, _P, _I64, _I32, _I32, _I64, _P, _P, _P],
    # codes, lo, hi, ref, n, bits, block, min_step, out
    "tw_log2_temporal_decode": [_P, _P, _P, _P, _I64, _I32, _I32, _I64, _P],
    # codes, lo, hi, ref, n, bits, block
    "tw_log2_temporal_check": [_P, _P, _P, _P, _I64, _I32, _I32],
    # x, x_dtype, ref, ref_dtype, n, block, s (per block), out (4)
    "tw_delta_statistics": [_P, _I32, _P, _I32, _I64, _I32, _P, _P],
    # x, n, itemsize, prev_zero, nnz, runs
    "tw_sparsity_counts": [_P, _I64, _I32, _I32, _P, _P],
    # planes (width pointers), width, count, out
    "tw_planes_merge": [_P, _I32, _I64, _P],
    # v, n, eps, d
    "tw_update_root": [_P, _I64, ctypes.c_float, _P],
    # x, v, n, eps, u
    "tw_update_divide": [_P, _P, _I64, ctypes.c_float, _P],
    # u, v, n, eps, big
    "tw_update_multiply": [_P, _P, _I64, ctypes.c_float, ctypes.c_float],
}


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled library (its AVX2 build on a CPU that has AVX2), or ``None`` when it
    was not built (logged once)."""
    try:
        from ... import _native  # type: ignore[attr-defined]
    except ImportError:
        logger.info(
            "tw_triton's compiled CPU codec is not built (no C compiler at install time?): "
            "the CPU path runs the plain-torch codec, which writes the same bytes, slower"
        )
        return None
    lib = load(_native.__file__)
    if lib.tw_cpu_has_avx2():
        try:
            from ... import _native_avx2  # type: ignore[attr-defined]
        except ImportError:
            pass  # the baseline build runs: the same results
        else:
            lib = load(_native_avx2.__file__)
    return lib


def load(path: str) -> ctypes.CDLL:
    """One build of the library (``tw_triton._native`` or ``_native_avx2``), its functions
    typed. The tests load each build that exists, to hold both to the spec."""
    lib = ctypes.CDLL(path)
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = _I64
    return lib


def enabled() -> bool:
    """Whether the compiled codec will run: built, and not turned off by ``TW_TRITON_NATIVE=0``.

    Raises:
        TwTritonError: ``TW_TRITON_NATIVE`` is set to something other than ``0`` or ``1``.
    """
    raw = os.environ.get(ENV_NATIVE, "").strip()
    if raw not in ("", "0", "1"):
        raise TwTritonError(f"{ENV_NATIVE} must be 0 or 1, found {raw!r}")
    return raw != "0" and library() is not None


def _takes(t: torch.Tensor | None) -> bool:
    """A tensor the C code reads or writes: contiguous, on the CPU, fp32 or bf16."""
    return t is None or (t.device.type == "cpu" and t.dtype in _DTYPE_CODES and t.is_contiguous())


def sized(t: torch.Tensor, dtype: torch.dtype, numel: int) -> bool:
    """A contiguous CPU buffer of ``numel`` elements of ``dtype``: the C code reads and
    writes exactly that much, so nothing else may reach it."""
    return t.device.type == "cpu" and t.dtype == dtype and t.numel() == numel and t.is_contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def block_ranges(numel: int, block: int) -> list[tuple[int, int]]:
    """Element ranges ``[start, stop)`` of whole blocks, one per thread of this caller."""
    threads = torch.get_num_threads() if numel >= SPLIT_MIN_ELEMENTS else 1
    nblocks = -(-numel // block)
    per = -(-nblocks // max(1, threads)) * block
    return [(s, min(s + per, numel)) for s in range(0, numel, per)]


def run_ranges(fn: Callable[[tuple[int, int]], int], ranges: list[tuple[int, int]]) -> list[int]:
    if len(ranges) == 1:
        return [fn(ranges[0])]
    return parallel_map(fn, ranges, threads=len(ranges))


def decode_ranges(
    one: Callable[[tuple[int, int]], int], numel: int, bits: int, block: int, codec: str
) -> list[tuple[int, int]]:
    """Run a decode over this caller's thread ranges; the ranges it left for the torch path
    (each thread's C call returns how many whole blocks it decoded)."""
    ranges = block_ranges(numel, block)
    done = run_ranges(one, ranges)
    if min(done) < 0:
        raise TwTritonError(f"the compiled {codec} decode refused bits={bits}, block={block}")
    return [(start + d * block, stop) for (start, stop), d in zip(ranges, done) if start + d * block < stop]


def range_slices(start: int, stop: int, bits: int, block: int) -> tuple[slice, slice]:
    """The packed-code bytes and the per-block entries of elements ``[start, stop)``
    (``start`` a whole number of blocks): how a caller hands a range the C code left to
    the torch path."""
    b0 = start // block
    byte0 = start * bits // 8
    return slice(byte0, byte0 + -(-(stop - start) * bits // 8)), slice(b0, b0 + -(-(stop - start) // block))


def encode_blockwise(
    x: torch.Tensor,
    reference: torch.Tensor | None,
    bits: int,
    block: int,
    qmax: int,
    codes: torch.Tensor,
    scales: torch.Tensor,
) -> bool:
    """Encode ``x`` (minus ``reference``) into ``codes`` and ``scales`` as
    :func:`~tw_triton.ops.reference.quantize_blockwise_torch` does, if the C codec takes
    these tensors; ``False`` (nothing written) if not. The outputs are contiguous and of
    the right sizes (the caller checks them)."""
    n = x.numel()
    if not (
        _takes(x)
        and _takes(reference)
        and (reference is None or reference.numel() == n)
        and sized(codes, torch.uint8, -(-n * bits // 8))
        and sized(scales, torch.float32, -(-n // block))
        and n > 0
        and enabled()
    ):
        return False
    lib = library()
    x_code = _DTYPE_CODES[x.dtype]
    ref_code = _DTYPE_CODES[reference.dtype] if reference is not None else 0
    x_ptr, ref_ptr, codes_ptr, scales_ptr = x.data_ptr(), _ptr(reference), codes.data_ptr(), scales.data_ptr()
    x_size = x.element_size()
    ref_size = reference.element_size() if reference is not None else 0

    def one(r: tuple[int, int]) -> int:
        start, stop = r
        return lib.tw_blockwise_encode(
            x_ptr + start * x_size,
            x_code,
            None if ref_ptr is None else ref_ptr + start * ref_size,
            ref_code,
            stop - start,
            block,
            bits,
            qmax,
            codes_ptr + start * bits // 8,
            scales_ptr + start // block * 4,
        )

    done = run_ranges(one, block_ranges(n, block))
    if min(done) < 0:
        raise TwTritonError(f"the compiled blockwise encode refused bits={bits}, block={block}, qmax={qmax}")
    return True


def decode_blockwise(
    codes: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    bits: int,
    block: int,
    reference: torch.Tensor | None,
    out: torch.Tensor,
) -> list[tuple[int, int]] | None:
    """Decode as :func:`~tw_triton.ops.reference.dequantize_blockwise_torch` does, into
    ``out`` (which may be ``reference`` itself), if the C codec takes these tensors.

    Returns:
        ``None`` when it does not (nothing written); else the element ranges it left for
        the torch path: from a block whose result holds a NaN (whose payload torch's own
        conversions do not agree on) to the end of that thread's range. Usually none.
    """
    if not (
        _takes(reference)
        and _takes(out)
        and (reference is None or reference.numel() == numel)
        and out.numel() == numel
        and sized(codes, torch.uint8, -(-numel * bits // 8))
        and sized(scales, torch.float32, -(-numel // block))
        and numel > 0
        and enabled()
    ):
        return None
    lib = library()
    ref_code = _DTYPE_CODES[reference.dtype] if reference is not None else 0
    out_code = _DTYPE_CODES[out.dtype]
    codes_ptr, scales_ptr, ref_ptr, out_ptr = (
        codes.data_ptr(),
        scales.data_ptr(),
        _ptr(reference),
        out.data_ptr(),
    )
    ref_size = reference.element_size() if reference is not None else 0
    out_size = out.element_size()

    def one(r: tuple[int, int]) -> int:
        start, stop = r
        return lib.tw_blockwise_decode(
            codes_ptr + start * bits // 8,
            scales_ptr + start // block * 4,
            stop - start,
            bits,
            block,
            None if ref_ptr is None else ref_ptr + start * ref_size,
            ref_code,
            out_ptr + start * out_size,
            out_code,
        )

    return decode_ranges(one, numel, bits, block, "blockwise")


def encode_log2(
    x: torch.Tensor, bits: int, block: int, codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> bool:
    """Encode ``x`` into ``codes``, ``lo`` and ``hi`` as
    :func:`~tw_triton.ops.reference.quantize_log2_torch` does, if the C codec takes these
    tensors; ``False`` (nothing written) if not."""
    n = x.numel()
    nblocks = -(-n // block)
    if not (
        _takes(x)
        and sized(codes, torch.uint8, -(-n * bits // 8))
        and sized(lo, torch.int32, nblocks)
        and sized(hi, torch.int32, nblocks)
        and n > 0
        and enabled()
    ):
        return False
    lib = library()
    x_code, x_ptr, x_size = _DTYPE_CODES[x.dtype], x.data_ptr(), x.element_size()
    codes_ptr, lo_ptr, hi_ptr = codes.data_ptr(), lo.data_ptr(), hi.data_ptr()

    def one(r: tuple[int, int]) -> int:
        start, stop = r
        b0 = start // block
        return lib.tw_log2_encode(
            x_ptr + start * x_size,
            x_code,
            stop - start,
            block,
            bits,
            codes_ptr + start * bits // 8,
            lo_ptr + 4 * b0,
            hi_ptr + 4 * b0,
        )

    if min(run_ranges(one, block_ranges(n, block))) < 0:
        raise TwTritonError(f"the compiled log2 encode refused bits={bits}, block={block}")
    return True


def decode_log2(
    codes: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    numel: int,
    bits: int,
    block: int,
    out: torch.Tensor,
) -> list[tuple[int, int]] | None:
    """Decode as :func:`~tw_triton.ops.reference.dequantize_log2_torch` does, into ``out``, if
    the C codec takes these tensors.

    Returns:
        ``None`` when it does not (nothing written); else the element ranges it left for
        the torch path: from a block whose bounds the encoder cannot have written (not
        ``0 <= lo <= hi < bits(+inf)``) to the end of that thread's range. Usually none.
    """
    nblocks = -(-numel // block)
    if not (
        _takes(out)
        and out.numel() == numel
        and sized(codes, torch.uint8, -(-numel * bits // 8))
        and sized(lo, torch.int32, nblocks)
        and sized(hi, torch.int32, nblocks)
        and numel > 0
        and enabled()
    ):
        return None
    lib = library()
    out_code, out_ptr, out_size = _DTYPE_CODES[out.dtype], out.data_ptr(), out.element_size()
    codes_ptr, lo_ptr, hi_ptr = codes.data_ptr(), lo.data_ptr(), hi.data_ptr()

    def one(r: tuple[int, int]) -> int:
        start, stop = r
        b0 = start // block
        return lib.tw_log2_decode(
            codes_ptr + start * bits // 8,
            lo_ptr + 4 * b0,
            hi_ptr + 4 * b0,
            stop - start,
            bits,
            block,
            out_ptr + start * out_size,
            out_code,
        )

    return decode_ranges(one, numel, bits, block, "log2")


def delta_statistics_native(x: torch.Tensor, reference: torch.Tensor | None, block: int) -> list[int] | None:
    """The four statistics of :func:`~tw_triton.ops.reference.delta_statistics_torch` as
    ints, computed in C; ``None`` where it does not take the tensors or leaves them to the
    spec (a value or difference that is not finite)."""
    n = x.numel()
    if not (
        _takes(x)
        and _takes(reference)
        and (reference is None or reference.numel() == n)
        and n > 0
        and 1 <= block <= 4096
        and enabled()
    ):
        return None
    per_block = torch.empty(-(-n // block), dtype=torch.float32)
    out = torch.zeros(4, dtype=torch.int64)
    got = library().tw_delta_statistics(
        x.data_ptr(),
        _DTYPE_CODES[x.dtype],
        _ptr(reference),
        _DTYPE_CODES[reference.dtype] if reference is not None else 0,
        n,
        block,
        per_block.data_ptr(),
        out.data_ptr(),
    )
    if got < 0:
        raise TwTritonError(f"the compiled delta statistics refused block={block}")
    return None if got else out.tolist()


def count_sparsity(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(nnz, runs)`` of a contiguous CPU tensor as
    :func:`~tw_triton.ops.reference.sparsity_counts_torch` gives them, split over threads
    for a large one; ``None`` if the C code does not take ``x``."""
    n, size = x.numel(), x.element_size()
    if not (x.device.type == "cpu" and x.is_contiguous() and size in (2, 4, 8) and n > 0 and enabled()):
        return None
    lib, base = library(), x.data_ptr()
    bits = x.view(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[size])

    def one(r: tuple[int, int]) -> tuple[int, int]:
        nnz, runs = ctypes.c_int64(), ctypes.c_int64()
        prev_zero = r[0] > 0 and int(bits[r[0] - 1]) == 0
        got = lib.tw_sparsity_counts(
            base + r[0] * size, r[1] - r[0], size, int(prev_zero), ctypes.byref(nnz), ctypes.byref(runs)
        )
        if got < 0:
            raise TwTritonError(f"the compiled sparsity count refused {n} elements of {size} bytes")
        return nnz.value, runs.value

    ranges = block_ranges(n, 1)
    counts = [one(ranges[0])] if len(ranges) == 1 else parallel_map(one, ranges, threads=len(ranges))
    return tuple(torch.tensor(sum(c[k] for c in counts), dtype=torch.int64) for k in (0, 1))  # type: ignore[return-value]


def _byte_array(a: np.ndarray, count: int, writable: bool) -> bool:
    """A contiguous 1-D ``uint8`` array of ``count`` bytes (writable if asked): the C code
    reads or writes exactly that much."""
    return (
        a.dtype == np.uint8
        and a.ndim == 1
        and a.size == count
        and a.flags.c_contiguous
        and (a.flags.writeable or not writable)
    )


def merge_planes(planes: Sequence[np.ndarray], out: np.ndarray) -> bool:
    """Fill ``out`` (the bytes of ``count`` elements of ``len(planes)`` bytes each) from its
    byte planes: byte ``k`` of element ``i`` is ``planes[k][i]``, as the entropy stage's
    planes are laid out. ``False`` (nothing written) where the compiled library does not
    run or the arrays are not contiguous ``uint8`` of those sizes."""
    width = len(planes)
    count = out.size // width if width else 0
    if not (
        width > 0
        and count > 0
        and out.size == count * width
        and _byte_array(out, out.size, True)
        and all(_byte_array(p, count, False) for p in planes)
        and enabled()
    ):
        return False
    pointers = (ctypes.c_void_p * width)(*(p.ctypes.data for p in planes))
    if library().tw_planes_merge(pointers, width, count, out.ctypes.data) < 0:
        raise TwTritonError(f"the compiled plane merge refused width={width}")
    return True


__all__ = [
    "ENV_NATIVE",
    "count_sparsity",
    "delta_statistics_native",
    "SPLIT_MIN_ELEMENTS",
    "enabled",
    "encode_blockwise",
    "decode_blockwise",
    "encode_log2",
    "decode_log2",
    "range_slices",
    "merge_planes",
    "library",
    "load",
    "block_ranges",
    "decode_ranges",
    "run_ranges",
    "sized",
]
