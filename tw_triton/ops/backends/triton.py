"""The Triton kernels as the "cuda" backend of the codec ops.

Importing this module imports neither triton nor the kernels: :func:`kernels` does, on the
first CUDA tensor coded, so that ``import tw_triton`` and every CPU path work where triton
is not installed. The kernels take contiguous tensors and allocate their outputs; they give
the reference's bytes and values (docs/codecs.md, "Bit-exact across devices").
"""

from __future__ import annotations

import re
import types

import torch

from ...errors import CheckpointError
from ..layout import check_qmax

DEVICE_TYPE = "cuda"

# The oldest triton whose kernels are proven bit-exact with the CPU path: before 3.6,
# ``tl.div_rn`` lowered to a flush-to-zero division (``div.rn.ftz.f32``), so a block with
# subnormal values would encode differently from the CPU (tests/ops/test_ptx.py checks the
# installed triton's PTX for ``.ftz``).
MIN_TRITON = (3, 6)


def check_triton_version(version: str) -> None:
    """Raise :class:`CheckpointError` unless ``version`` (``triton.__version__``) is at
    least :data:`MIN_TRITON`.

    Raises:
        CheckpointError: an older or unparseable version; the message names both.
    """
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None or (int(m.group(1)), int(m.group(2))) < MIN_TRITON:
        need = ".".join(map(str, MIN_TRITON))
        raise CheckpointError(
            f"coding a CUDA tensor needs triton>={need} (older versions flush subnormals to "
            f"zero in the kernels' division, so the bytes would differ from the CPU path); "
            f"triton {version} is installed: pip install 'triton>={need}'"
        )


_version_checked: list[bool] = []  # non-empty once the installed triton passed


def kernels() -> types.ModuleType:
    """The module :mod:`tw_triton.kernels`, imported on first use.

    Raises:
        CheckpointError: triton is not installed (a CUDA tensor cannot be coded without it),
            or is older than :data:`MIN_TRITON`.
    """
    try:
        from ... import kernels as module
    except ImportError as exc:
        if exc.name is None or not (exc.name == "triton" or exc.name.startswith("triton.")):
            raise
        raise CheckpointError(
            "coding a CUDA tensor needs triton, which is not installed here "
            "(pip install 'triton>=3.6'; CPU tensors need no triton)"
        ) from exc
    if not _version_checked:
        import triton  # imported by the kernels already

        check_triton_version(triton.__version__)
        _version_checked.append(True)
    return module


def _out(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    # The kernels allocate; a caller's buffer receives a copy (no caller passes one today).
    if out is None:
        return result
    out.view(-1).copy_(result)
    return out


def quantize_blockwise_cuda(
    x: torch.Tensor,
    reference: torch.Tensor | None,
    bits: int,
    block: int,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    qmax: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused encode kernel (delta, absmax, rounding and packing in one pass) on
    contiguous copies of the inputs. ``out`` is ignored: the kernel allocates."""
    rc = reference.contiguous() if reference is not None else None
    return kernels().quantize_blockwise(x.contiguous(), rc, bits, block, check_qmax(bits, qmax))


def dequantize_blockwise_cuda(
    codes: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    bits: int,
    block: int,
    reference: torch.Tensor | None,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused decode kernel (unpack, scale, add the reference, cast)."""
    rc = reference.contiguous() if reference is not None else None
    return _out(kernels().dequantize_blockwise(codes, scales, numel, bits, block, rc, dtype), out)


def quantize_log2_cuda(
    x: torch.Tensor, bits: int, block: int, *, out: tuple[torch.Tensor, ...] | None = None
) -> tuple[torch.Tensor, ...]:
    """The fused log2 encode kernel on a contiguous copy. ``out`` is ignored."""
    return kernels().quantize_log2(x.contiguous(), bits, block)


def dequantize_log2_cuda(
    codes: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    numel: int,
    bits: int,
    block: int,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused log2 decode kernel."""
    return _out(kernels().dequantize_log2(codes, lo, hi, numel, bits, block, dtype), out)


def quantize_log2_temporal_cuda(
    x: torch.Tensor,
    reference: torch.Tensor,
    bits: int,
    block: int,
    min_step: int,
    *,
    out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """The fused temporal encode kernel on contiguous copies. ``out`` is ignored."""
    return kernels().quantize_log2_temporal(x.contiguous(), reference.contiguous(), bits, block, min_step)


def dequantize_log2_temporal_cuda(
    codes: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    reference: torch.Tensor,
    numel: int,
    bits: int,
    block: int,
    min_step: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused temporal decode kernel (``out`` may be ``reference``: the kernel writes a
    fresh tensor, copied in afterwards)."""
    return _out(
        kernels().dequantize_log2_temporal(codes, lo, hi, reference, numel, bits, block, min_step), out
    )


# The ops this backend serves on DEVICE_TYPE (registered by tw_triton.ops).
BACKEND = {
    "quantize_blockwise": quantize_blockwise_cuda,
    "dequantize_blockwise": dequantize_blockwise_cuda,
    "quantize_log2": quantize_log2_cuda,
    "dequantize_log2": dequantize_log2_cuda,
    "quantize_log2_temporal": quantize_log2_temporal_cuda,
    "dequantize_log2_temporal": dequantize_log2_temporal_cuda,
}
