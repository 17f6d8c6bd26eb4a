"""The compiled CPU codec of ``log2-temporal`` (``tw_triton/csrc/log2_temporal.c``), called
through ctypes as :mod:`tw_triton.ops.backends.native` calls the others: the twin of
:func:`~tw_triton.ops.reference.quantize_log2_temporal_torch` and its decode, the same
bytes and the same decoded bits, split over threads in ranges of whole blocks.
"""

from __future__ import annotations

import torch

from ...errors import TwTritonError
from .native import block_ranges, decode_ranges, enabled, library, run_ranges, sized

# The largest step floor the C code takes (the codec's is 2**29): the step then stays at
# most 2**31, which its integer and double arithmetic is exact for (log2_temporal.c).
MAX_MIN_STEP = 1 << 31


def _takes(
    reference: torch.Tensor,
    codes: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    numel: int,
    block: int,
    min_step: int,
) -> bool:
    """Contiguous CPU buffers of the sizes the C code reads and writes, a step floor it
    takes, and the library on."""
    nblocks = -(-numel // block)
    return (
        sized(reference, torch.float32, numel)
        and sized(codes, torch.uint8, numel)
        and sized(lo, torch.int32, nblocks)
        and sized(hi, torch.int32, nblocks)
        and isinstance(min_step, int)
        and 1 <= min_step <= MAX_MIN_STEP
        and numel > 0
        and enabled()
    )


def encode_log2_temporal(
    x: torch.Tensor,
    reference: torch.Tensor,
    bits: int,
    block: int,
    min_step: int,
    codes: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
) -> bool:
    """Encode float32 ``x`` against ``reference`` into ``codes``, ``lo`` and ``hi`` as
    :func:`~tw_triton.ops.reference.quantize_log2_temporal_torch` does, if the C codec
    takes these tensors; ``False`` (nothing written) if not."""
    n = x.numel()
    if not (sized(x, torch.float32, n) and _takes(reference, codes, lo, hi, n, block, min_step)):
        return False
    lib = library()
    x_ptr, ref_ptr, codes_ptr, lo_ptr, hi_ptr = (t.data_ptr() for t in (x, reference, codes, lo, hi))

    def one(r: tuple[int, int]) -> int:
        s, b = r[0], 4 * (r[0] // block)
        return lib.tw_log2_temporal_encode(
            x_ptr + 4 * s,
            ref_ptr + 4 * s,
            r[1] - s,
            block,
            bits,
            min_step,
            codes_ptr + s,
            lo_ptr + b,
            hi_ptr + b,
        )

    if min(run_ranges(one, block_ranges(n, block))) < 0:
        raise TwTritonError(f"the compiled log2-temporal encode refused bits={bits}, block={block}")
    return True


def check_log2_temporal(
    codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, reference: torch.Tensor, bits: int, block: int
) -> bool:
    """``True`` when the C check takes these tensors and finds only what an encoder writes
    (:func:`~tw_triton.ops.reference.log2_temporal_code_errors_torch`); ``False`` when it
    finds something else or does not take them (the torch check then says what)."""
    numel = codes.numel()
    if not _takes(reference, codes, lo, hi, numel, block, 1):
        return False
    lib = library()
    codes_ptr, lo_ptr, hi_ptr, ref_ptr = (t.data_ptr() for t in (codes, lo, hi, reference))

    def one(r: tuple[int, int]) -> int:
        s, b = r[0], 4 * (r[0] // block)
        nb = -(-(r[1] - s) // block)
        done = lib.tw_log2_temporal_check(
            codes_ptr + s, lo_ptr + b, hi_ptr + b, ref_ptr + 4 * s, r[1] - s, bits, block
        )
        return int(done == nb)

    return min(run_ranges(one, block_ranges(numel, block))) == 1


def decode_log2_temporal(
    codes: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    reference: torch.Tensor,
    numel: int,
    bits: int,
    block: int,
    min_step: int,
    out: torch.Tensor,
) -> list[tuple[int, int]] | None:
    """Decode as :func:`~tw_triton.ops.reference.dequantize_log2_temporal_torch` does, into
    float32 ``out`` (which may be ``reference`` itself), if the C codec takes these tensors.

    Returns:
        ``None`` when it does not (nothing written); else the element ranges it left for
        the torch path: from a block that is neither temporal (bounds ``0, 0``) nor absolute
        with bounds ``0 <= lo <= hi < bits(+inf)`` and codes up to ``2**bits - 1`` (of what
        an encoder writes, only an uncodable block's ``-1, -1``) to the end of that
        thread's range.
    """
    if not (sized(out, torch.float32, numel) and _takes(reference, codes, lo, hi, numel, block, min_step)):
        return None
    lib = library()
    codes_ptr, lo_ptr, hi_ptr, ref_ptr, out_ptr = (t.data_ptr() for t in (codes, lo, hi, reference, out))

    def one(r: tuple[int, int]) -> int:
        s, b = r[0], 4 * (r[0] // block)
        return lib.tw_log2_temporal_decode(
            codes_ptr + s,
            lo_ptr + b,
            hi_ptr + b,
            ref_ptr + 4 * s,
            r[1] - s,
            bits,
            block,
            min_step,
            out_ptr + 4 * s,
        )

    return decode_ranges(one, numel, bits, block, "log2-temporal")


__all__ = ["MAX_MIN_STEP", "check_log2_temporal", "decode_log2_temporal", "encode_log2_temporal"]
