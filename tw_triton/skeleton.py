"""The skeleton's vocabulary: paths, plain leaves and dict keys, both ways.

:func:`tw_triton.tree.flatten` names every tensor by a path (components joined with ``/``,
``/`` and ``%`` escaped) and writes every plain value as a JSON node
(:func:`encode_scalar`); reading a skeleton back from a file checks each leaf and key
strictly (:func:`decode_scalar`, :func:`decode_key`) and raises
:class:`~tw_triton.errors.CheckpointError` naming the node's path. The node syntax is in
:mod:`tw_triton.tree`; why: docs/format.md.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .errors import CheckpointError, QuantizationError

PATH_SEPARATOR = "/"

# numpy dtype kinds that map onto a torch dtype safetensors can store: bool, signed and
# unsigned ints, floats.
NDARRAY_KINDS = ("b", "i", "u", "f")


def escape_component(key: str) -> str:
    """Escape ``%`` and ``/`` in one path component so that joined paths stay unique."""
    return key.replace("%", "%25").replace(PATH_SEPARATOR, "%2F")


# The path of an empty key at the top level: '' is the root's own path, whose children's
# paths have no prefix, so {"": [x]} would give x the path "0" of the key 0. An escaped key
# never holds "%00" ("%" itself is escaped).
EMPTY_TOP_LEVEL_KEY = "%00"


def join_path(prefix: str, key: str) -> str:
    """Join an already-escaped prefix and an unescaped key into a path."""
    comp = escape_component(key)
    if not prefix:
        return comp or EMPTY_TOP_LEVEL_KEY
    return f"{prefix}{PATH_SEPARATOR}{comp}"


def describe_path(path: str) -> str:
    """How a message names a path (the root has none)."""
    return repr(path) if path else "the top level"


def encode_scalar(value: Any, path: str) -> Any:
    """Skeleton node of a plain (non-container, non-tensor) value."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, np.generic) and value.dtype.kind in NDARRAY_KINDS:
        item = value.item()
        return {"npscalar": value.dtype.str, "value": encode_scalar(item, path)}
    raise QuantizationError(
        f"unsupported value of type {type(value).__module__}.{type(value).__qualname__} at "
        f"{describe_path(path)}: a state may hold tensors, numpy arrays, dict/list/tuple, "
        "None, bool, int, float, str and bytes (no pickle fallback)"
    )


# The non-finite floats a skeleton names as {"float": ...}, as _encode_scalar writes them.
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
# Skeleton paths are built only for a message: a walk passes the parent's path and the key.
_PLAIN_TYPES = (type(None), bool, str, int, float)


def decode_scalar(node: Any, where: str = "the top level") -> Any:
    """The plain value of a skeleton leaf, checked to be one :func:`encode_scalar` writes.

    Raises:
        CheckpointError: anything else, naming ``where`` and what was expected.
    """
    if isinstance(node, _PLAIN_TYPES):
        return node
    if isinstance(node, dict):
        if node.keys() == {"float"}:
            value = _NONFINITE.get(node["float"]) if isinstance(node["float"], str) else None
            if value is None:
                raise CheckpointError(
                    f"skeleton at {where}: float {node['float']!r}, expected 'nan', 'inf' or '-inf'"
                )
            return value
        if node.keys() == {"bytes"}:
            return _decode_bytes(node["bytes"], where)
        if node.keys() == {"npscalar", "value"}:
            return _decode_npscalar(node, where)
    raise CheckpointError(
        f"skeleton at {where}: malformed node {short_repr(node)}, expected null, a bool, number or string, "
        "or a {'float'}, {'bytes'} or {'npscalar', 'value'} object"
    )


def _decode_bytes(text: Any, where: str) -> bytes:
    try:
        if not isinstance(text, str):
            raise ValueError
        return bytes.fromhex(text)
    except ValueError:
        raise CheckpointError(
            f"skeleton at {where}: bytes {short_repr(text)}, expected a string of hex digit pairs"
        ) from None


def _decode_npscalar(node: dict[str, Any], where: str) -> np.generic:
    """A numpy scalar leaf: its dtype, and a value that dtype holds as it was written."""
    dtype = numpy_dtype(node["npscalar"], where)
    value = node["value"]
    if dtype.kind == "b":
        ok = isinstance(value, bool)
        expected = "true or false"
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        ok = isinstance(value, int) and not isinstance(value, bool) and info.min <= value <= info.max
        expected = f"an int from {info.min} to {info.max}"
    else:
        value = decode_scalar(value, where) if isinstance(value, dict) else value
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and _fits_float(value, dtype)
        expected = f"a number within the range of {dtype.name}"
    if not ok:
        raise CheckpointError(
            f"skeleton at {where}: numpy {dtype.name} value {short_repr(value)}, expected {expected}"
        )
    return dtype.type(value)


def _fits_float(value: float, dtype: np.dtype) -> bool:
    """Whether ``value`` is a value of the float ``dtype`` could have written: a finite one
    stays finite (1e20 is no float16, and an int past float64 is no float)."""
    # Python compares an int with a float exactly, without converting it (no overflow).
    if isinstance(value, int):
        return abs(value) <= float(np.finfo(dtype).max)
    return not math.isfinite(value) or abs(value) <= float(np.finfo(dtype).max)


def short_repr(value: Any) -> str:
    """repr of a value from a file, cut short: a message must not quote a megabyte."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def numpy_dtype(spec: Any, where: str = "the top level") -> np.dtype:
    """A numpy dtype named in a skeleton; only the kinds :func:`~tw_triton.tree.flatten` writes."""
    try:
        dtype = np.dtype(spec) if isinstance(spec, str) else None
    except (TypeError, ValueError, SyntaxError):
        dtype = None
    if dtype is None or dtype.kind not in NDARRAY_KINDS or dtype.fields is not None or dtype.shape:
        raise CheckpointError(
            f"skeleton at {where}: numpy dtype {short_repr(spec)}, expected a bool, int or float dtype"
        )
    return dtype


def key_component(key: Any, path: str) -> str:
    """The path component of a dict key (``str(key)``; ``repr`` of a float).

    Raises:
        QuantizationError: a key type a skeleton cannot hold, naming ``path``.
    """
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, (bool, int)):
        return str(key)
    if isinstance(key, float) and math.isfinite(key):
        return repr(key)
    raise QuantizationError(
        f"unsupported dict key {key!r} of type {type(key).__name__} at {describe_path(path)}: "
        "keys may be str, int, bool, None or finite float"
    )


def decode_key(node: Any, path: str) -> Any:
    """A dict key of a skeleton: a scalar that flatten accepts as a key."""
    key = decode_scalar(node, f"{describe_path(path)} (a dict key)")
    try:
        key_component(key, path)
    except QuantizationError as e:
        raise CheckpointError(f"skeleton at {describe_path(path)}: {e}") from None
    return key
