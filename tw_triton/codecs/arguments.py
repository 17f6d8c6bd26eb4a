"""The argument checks of :func:`~tw_triton.codecs.blockwise.quantize` and
:func:`~tw_triton.codecs.blockwise.dequantize`: tensors that hold dense float data, a
reference like the tensor, a device torch knows. Each failure is a
:class:`~tw_triton.errors.QuantizationError`, never an error from deep inside torch."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import QuantizationError, TwTritonError
from ..ops.layout import FLOAT_DTYPES


def check_dense(t: torch.Tensor, what: str) -> None:
    """Refuse a tensor whose data the codec cannot read: a meta tensor (no data), a sparse
    or nested one (not one strided block of values)."""
    if t.device.type == "meta":
        raise QuantizationError(f"{what} is a meta tensor: it holds no data to code")
    if t.layout != torch.strided or t.is_nested:
        kind = "nested" if t.is_nested else f"layout {t.layout}"
        raise QuantizationError(f"{what} has {kind}: only dense (strided) tensors can be coded")


def check_input(x: torch.Tensor, reference: torch.Tensor | None) -> None:
    """The arguments of ``quantize``: a dense float tensor, and a reference of its shape
    and device."""
    if not isinstance(x, torch.Tensor):
        raise QuantizationError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise QuantizationError(f"can only quantize float32, float16 or bfloat16 tensors, got {x.dtype}")
    check_dense(x, "the tensor")
    if reference is None:
        return
    if not isinstance(reference, torch.Tensor):
        raise QuantizationError(f"reference must be a torch.Tensor, got {type(reference).__name__}")
    if reference.dtype not in FLOAT_DTYPES:
        raise QuantizationError(f"reference must be float32, float16 or bfloat16, got {reference.dtype}")
    if tuple(reference.shape) != tuple(x.shape):
        raise QuantizationError(
            f"reference shape {tuple(reference.shape)} does not match tensor shape {tuple(x.shape)}"
        )
    if reference.device != x.device:
        raise QuantizationError(f"reference is on {reference.device} but the tensor is on {x.device}")
    check_dense(reference, "reference")


def parse_device(
    device: Any,
    what: str,
    error: type[TwTritonError],
    *,
    meta: bool = False,
    no_cuda: type[TwTritonError] | None = None,
) -> torch.device:
    """``device`` as a ``torch.device``, or ``error`` naming what is decoded (``what``): not
    a device torch knows, CUDA where none is available (``no_cuda`` if given: a reader
    must not blame the file for it), or (unless ``meta``: a state's decode plans its
    placement there) the meta device, which holds no data."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise error(f"cannot decode {what} to device {device!r}: {e}") from e
    if dev.type == "meta" and not meta:
        raise error(f"cannot decode {what} to device {device!r}: the meta device holds no data")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise (no_cuda or error)(f"cannot decode {what} to device {device!r}: CUDA is not available")
    return dev


def decode_device(device: torch.device | str | None, default: torch.device) -> torch.device:
    """The device ``dequantize`` decodes on (``None``: ``default``, where the codes are).

    Raises:
        QuantizationError: as :func:`parse_device`.
    """
    return default if device is None else parse_device(device, "the tensor", QuantizationError)


__all__ = ["check_dense", "check_input", "decode_device", "parse_device"]
