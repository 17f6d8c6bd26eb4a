"""The dispatch table of the codec operations: one implementation per (op, device type).

Every op declared in :mod:`tw_triton.ops` has a reference implementation in plain torch
(:mod:`tw_triton.ops.reference`), which runs on any device and is the spec. A backend
registers a faster implementation of the same contract for one device type
(:func:`register`); :func:`lookup` returns it, or the reference where none is registered.
Backends must give the same bytes and the same decoded values as the reference: see
docs/codecs.md ("Bit-exact across devices").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from ..errors import QuantizationError

# The op names of tw_triton.ops: a backend registering anything else is a typo.
OPS = (
    "quantize_blockwise",
    "dequantize_blockwise",
    "quantize_log2",
    "dequantize_log2",
    "quantize_blockwise_many",
    "quantize_log2_many",
    "fingerprints",
    "copy_many",
    "dequantize_blockwise_many",
    "bitmask_encode",
    "bitmask_decode",
    "mask_popcount",
    "quantize_log2_temporal",
    "quantize_log2_temporal_many",
    "dequantize_log2_temporal",
    "log2_temporal_code_errors",
    "log2_temporal_code_flags_many",
    "sparsity_counts",
    "delta_statistics",
    "sparsity_counts_many",
    "dequantize_log2_temporal_many",
    "quantize_blockwise_update_many",
    "dequantize_log2_many",
    "dequantize_blockwise_update_many",
    "delta_statistics_many",
    "update_root",
    "update_divide",
    "update_multiply",
    "bitmask_encode_many",
)

_REFERENCE: dict[str, Callable] = {}
_BACKENDS: dict[tuple[str, str], Callable] = {}


def _check_op(op: str) -> None:
    if op not in OPS:
        raise QuantizationError(f"unknown codec op {op!r}; the ops are {list(OPS)}")


def register_reference(op: str, fn: Callable) -> None:
    """Make ``fn`` the reference (plain-torch, any-device) implementation of ``op``."""
    _check_op(op)
    _REFERENCE[op] = fn


def register(op: str, device_type: str, fn: Callable | None) -> Callable | None:
    """Make ``fn`` serve ``op`` for tensors on ``device_type`` (``"cpu"``, ``"cuda"``, ...);
    ``None`` removes the backend, so the reference serves that device again.

    Returns:
        The implementation registered before, or ``None``.
    """
    _check_op(op)
    before = _BACKENDS.pop((op, device_type), None)
    if fn is not None:
        _BACKENDS[(op, device_type)] = fn
    return before


@contextlib.contextmanager
def using(op: str, device_type: str, fn: Callable | None) -> Iterator[None]:
    """:func:`register` ``fn`` for the duration of a ``with`` block (tests, benchmarks)."""
    before = register(op, device_type, fn)
    try:
        yield
    finally:
        register(op, device_type, before)


def lookup(op: str, device_type: str) -> Callable:
    """The implementation of ``op`` for a tensor on ``device_type``: the registered
    backend, else the reference."""
    fn = _BACKENDS.get((op, device_type))
    if fn is not None:
        return fn
    _check_op(op)
    return _REFERENCE[op]


def reference(op: str) -> Callable:
    """The reference implementation of ``op`` (the spec every backend is held to)."""
    _check_op(op)
    return _REFERENCE[op]


def backends() -> dict[tuple[str, str], str]:
    """``{(op, device_type): implementation name}`` of every registered backend."""
    return {k: f"{fn.__module__}.{fn.__qualname__}" for k, fn in sorted(_BACKENDS.items())}
