"""Flatten a nested training state to ``{path: tensor}`` plus a JSON skeleton, and back.

A training state is any nesting of ``dict`` (including ``OrderedDict``), ``list`` and
``tuple`` whose leaves are tensors, numpy arrays and plain values. :func:`flatten` splits it
into the tensors (which the codecs encode) and a *skeleton*: a JSON-serializable tree that
records every container's type, every dict key's type, and every plain leaf, with each tensor
replaced by its path. :func:`unflatten` rebuilds the same structure with the same types.

Paths
    Path components are joined with ``/``: ``model/encoder.0.weight``,
    ``optimizer/state/0/exp_avg``, ``rng/numpy/1``. A dict key becomes ``str(key)`` and a
    list or tuple index its decimal position. A ``/`` or ``%`` inside a key is escaped as
    ``%2F`` / ``%25`` so that paths stay unique; two keys of one dict that give the same
    component (``0`` and ``"0"``) are rejected.

Skeleton nodes (JSON)
    ``null``, ``true``/``false``, JSON integers, finite floats (JSON numbers with a
    fraction or exponent, so ``1.0`` stays a float) and strings stand for themselves.
    Everything else is a one-key object naming its type::

        {"tensor": path}                        a torch.Tensor leaf
        {"ndarray": path, "dtype": "<u4"}       a numpy array (stored as a tensor)
        {"float": "nan" | "inf" | "-inf"}       a non-finite Python float
        {"npscalar": "<f8", "value": ...}       a numpy scalar (np.float64, np.int64, ...)
        {"bytes": "hex..."}                      a bytes object
        {"list": [node, ...]}                   a list
        {"tuple": [node, ...]}                  a tuple (stays a tuple)
        {"dict": [[key, node], ...]}            a dict; keys are scalar nodes, order kept
                                                (in memory each pair is a tuple)
        {"odict": [[key, node], ...], "meta": ...}
                                                an OrderedDict, with the ``_metadata``
                                                attribute ``nn.Module.state_dict()`` attaches

Anything else (namedtuples, sets, arbitrary objects, complex numbers, ...) is rejected with a
:class:`~tw_triton.errors.QuantizationError` naming its path: there is no pickle fallback.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from .errors import CheckpointError, QuantizationError

PATH_SEPARATOR = "/"

# numpy dtype kinds that map onto a torch dtype safetensors can store: bool, signed and
# unsigned ints, floats.
_NDARRAY_KINDS = ("b", "i", "u", "f")


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


def _describe(path: str) -> str:
    return repr(path) if path else "the top level"


def _encode_scalar(value: Any, path: str) -> Any:
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
    if isinstance(value, np.generic) and value.dtype.kind in _NDARRAY_KINDS:
        item = value.item()
        return {"npscalar": value.dtype.str, "value": _encode_scalar(item, path)}
    raise QuantizationError(
        f"unsupported value of type {type(value).__module__}.{type(value).__qualname__} at "
        f"{_describe(path)}: a state may hold tensors, numpy arrays, dict/list/tuple, "
        "None, bool, int, float, str and bytes (no pickle fallback)"
    )


def _decode_scalar(node: Any) -> Any:
    if node is None or isinstance(node, (bool, str, int, float)):
        return node
    if isinstance(node, dict) and len(node) == 1 and "float" in node:
        return float(node["float"])
    if isinstance(node, dict) and "bytes" in node:
        return bytes.fromhex(node["bytes"])
    if isinstance(node, dict) and "npscalar" in node:
        return _numpy_dtype(node["npscalar"]).type(_decode_scalar(node["value"]))
    raise CheckpointError(f"malformed skeleton node {node!r}")


def _numpy_dtype(spec: Any) -> np.dtype:
    """A numpy dtype named in a skeleton; only the kinds :func:`flatten` writes."""
    dtype = np.dtype(spec) if isinstance(spec, str) else None
    if dtype is None or dtype.kind not in _NDARRAY_KINDS:
        raise CheckpointError(f"skeleton names numpy dtype {spec!r}, expected a bool, int or float dtype")
    return dtype


def _key_component(key: Any, path: str) -> str:
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, (bool, int)):
        return str(key)
    if isinstance(key, float) and math.isfinite(key):
        return repr(key)
    raise QuantizationError(
        f"unsupported dict key {key!r} of type {type(key).__name__} at {_describe(path)}: "
        "keys may be str, int, bool, None or finite float"
    )


@dataclass(frozen=True)
class Flattened:
    """A state already split by :func:`flatten`, which
    :func:`~tw_triton.state.quantize_state_dict` takes in place of the nested state (it is
    not flattened again: a save that has flattened its state once passes it on)."""

    tensors: dict[str, torch.Tensor]
    skeleton: Any

    @classmethod
    def of(cls, state: Any) -> "Flattened":
        """``flatten(state)`` as a :class:`Flattened` (one that is already, as it is)."""
        return state if isinstance(state, Flattened) else cls(*flatten(state))

    def top_level(self) -> dict[Any, str] | None:
        """The top-level keys of the state and the kind of each value (``"dict"`` for a dict
        or OrderedDict, ``"container"`` for a list or tuple, ``"leaf"`` otherwise); ``None``
        when the state is not a dict. What the default rules look at."""
        node = self.skeleton
        if not isinstance(node, dict) or not ({"dict", "odict"} & node.keys()):
            return None
        out = {}
        for key, value in node.get("dict", node.get("odict")):
            kind = "leaf"
            if isinstance(value, dict) and ("dict" in value or "odict" in value):
                kind = "dict"
            elif isinstance(value, dict) and ("list" in value or "tuple" in value):
                kind = "container"
            out[_decode_scalar(key)] = kind
        return out


def flatten(state: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Split a nested state into its tensors and a JSON skeleton.

    Args:
        state: nested dict / OrderedDict / list / tuple of tensors, numpy arrays and plain
            values (None, bool, int, float, str, bytes, numpy scalars).

    Returns:
        ``(tensors, skeleton)``: the tensors by path in traversal order (numpy arrays are
        returned as CPU tensors sharing their memory), and the skeleton (see module doc).

    Raises:
        QuantizationError: an unsupported leaf or key type, a sparse or otherwise
            non-strided tensor, or two keys that map to the same path; the message names
            the path.
    """
    tensors: dict[str, torch.Tensor] = {}
    try:
        skeleton = _flatten_node(state, "", tensors)
    except RecursionError as e:
        raise QuantizationError("the state is nested too deeply (or contains itself)") from e
    return tensors, skeleton


def _flatten_node(node: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, torch.Tensor):
        if node.layout != torch.strided or node.is_quantized or node.device.type == "meta":
            raise QuantizationError(
                f"tensor at {_describe(path)} has layout {node.layout} on {node.device}: "
                "only dense tensors with data can be checkpointed"
            )
        tensors[path] = node.detach()
        return {"tensor": path}
    if isinstance(node, np.ndarray):
        if node.dtype.kind not in _NDARRAY_KINDS:
            raise QuantizationError(
                f"numpy array at {_describe(path)} has dtype {node.dtype}: only bool, int, "
                "uint and float arrays can be checkpointed"
            )
        native = node.astype(node.dtype.newbyteorder("="), copy=False)
        if not (native.flags.c_contiguous and native.flags.writeable):
            # torch.from_numpy warns on read-only arrays (the codec copies it anyway);
            # np.ascontiguousarray would turn a 0-d array into a 1-d one.
            native = native.copy(order="C")
        tensors[path] = torch.from_numpy(native)
        return {"ndarray": path, "dtype": node.dtype.str}
    if isinstance(node, dict):
        if type(node) not in (dict, OrderedDict):
            raise QuantizationError(
                f"unsupported mapping type {type(node).__qualname__} at {_describe(path)}: "
                "use dict or OrderedDict"
            )
        items = []
        seen: dict[str, Any] = {}
        for key, value in node.items():
            comp = _key_component(key, path)
            if comp in seen:
                raise QuantizationError(
                    f"keys {seen[comp]!r} and {key!r} at {_describe(path)} give the same path "
                    f"component {comp!r}"
                )
            seen[comp] = key
            # A tuple, written as a JSON array like a list: the collector stops tracking a pair
            # of a key and a leaf node, so a state's hundreds of pairs are not promoted
            # towards a full collection while a save that holds them runs.
            items.append((_encode_scalar(key, path), _flatten_node(value, join_path(path, comp), tensors)))
        if type(node) is OrderedDict:
            meta = getattr(node, "_metadata", None)
            out: dict[str, Any] = {"odict": items}
            if meta is not None:
                out["meta"] = _flatten_plain(meta, join_path(path, "_metadata"))
            return out
        return {"dict": items}
    if isinstance(node, (list, tuple)):
        if type(node) not in (list, tuple):
            raise QuantizationError(
                f"unsupported sequence type {type(node).__qualname__} at {_describe(path)} "
                "(namedtuples and list subclasses would not come back as themselves)"
            )
        kids = [_flatten_node(v, join_path(path, str(i)), tensors) for i, v in enumerate(node)]
        return {"tuple" if type(node) is tuple else "list": kids}
    return _encode_scalar(node, path)


def leaf_tensors(state: Any) -> Iterator[torch.Tensor]:
    """The tensor leaves of a nested state, in :func:`flatten`'s order, without building
    paths or a skeleton and without checking the rest (a few times cheaper: for a question
    about the tensors alone, such as which device they are on)."""
    stack = [state]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            yield node
        elif isinstance(node, dict):
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, (list, tuple)):
            stack.extend(reversed(node))


def _flatten_plain(node: Any, path: str) -> Any:
    """Skeleton of a tensor-free structure (``OrderedDict._metadata``)."""
    sink: dict[str, torch.Tensor] = {}
    out = _flatten_node(node, path, sink)
    if sink:
        raise QuantizationError(f"tensors inside {_describe(path)} are not supported")
    return out


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Rebuild the nested state from its skeleton and tensors by path.

    ``ndarray`` leaves come back as numpy arrays of their original dtype (copied to the
    host if their tensor is elsewhere); the same tensor object may appear under several
    paths (tied weights stay tied).

    Raises:
        CheckpointError: the skeleton is malformed or names a path missing from ``tensors``.
    """
    try:
        return _unflatten_node(skeleton, tensors)
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as e:
        # A skeleton comes from a file: whatever is wrong with it is a malformed checkpoint.
        raise CheckpointError(f"malformed skeleton: {type(e).__name__}: {e}") from e


def _lookup(tensors: dict[str, torch.Tensor], path: Any) -> torch.Tensor:
    if not isinstance(path, str) or path not in tensors:
        raise CheckpointError(f"skeleton names tensor {path!r}, which has no entry")
    return tensors[path]


def _unflatten_node(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if not isinstance(node, dict):
        if isinstance(node, list):
            raise CheckpointError(f"malformed skeleton node {node!r}")
        return _decode_scalar(node)
    if "tensor" in node:
        return _lookup(tensors, node["tensor"])
    if "ndarray" in node:
        t = _lookup(tensors, node["ndarray"])
        arr = t.detach().cpu().numpy()
        want = _numpy_dtype(node.get("dtype", arr.dtype.str))
        return arr if arr.dtype == want else arr.astype(want)
    if "list" in node:
        return [_unflatten_node(v, tensors) for v in _as_list(node["list"])]
    if "tuple" in node:
        return tuple(_unflatten_node(v, tensors) for v in _as_list(node["tuple"]))
    if "dict" in node or "odict" in node:
        ordered = "odict" in node
        pairs = _as_list(node["odict" if ordered else "dict"])
        out: dict[Any, Any] = OrderedDict() if ordered else {}
        for pair in pairs:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise CheckpointError(f"malformed skeleton dict item {pair!r}")
            out[_decode_scalar(pair[0])] = _unflatten_node(pair[1], tensors)
        if ordered and "meta" in node:
            out._metadata = _unflatten_node(node["meta"], tensors)  # type: ignore[attr-defined]
        return out
    return _decode_scalar(node)


def _as_list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise CheckpointError(f"malformed skeleton: expected a list, got {type(value).__name__}")
    return value


def skeleton_tensor_paths(skeleton: Any) -> list[str]:
    """Paths of all tensor and ndarray leaves named by a skeleton, in traversal order."""
    out: list[str] = []
    _collect_paths(skeleton, out, ("tensor", "ndarray"))
    return out


def skeleton_ndarray_paths(skeleton: Any) -> list[str]:
    """Paths of the numpy-array leaves named by a skeleton (they are decoded on the host)."""
    out: list[str] = []
    _collect_paths(skeleton, out, ("ndarray",))
    return out


def _collect_paths(node: Any, out: list[str], kinds: tuple[str, ...]) -> None:
    # Lenient on malformed nodes: unflatten() reports those with a proper error.
    if not isinstance(node, dict):
        return
    for key in ("tensor", "ndarray"):
        if key in node:
            if key in kinds and isinstance(node[key], str):
                out.append(node[key])
            return
    for key in ("list", "tuple"):
        if isinstance(node.get(key), list):
            for v in node[key]:
                _collect_paths(v, out, kinds)
            return
    for key in ("dict", "odict"):
        if isinstance(node.get(key), list):
            for pair in node[key]:
                if isinstance(pair, (list, tuple)) and len(pair) == 2:
                    _collect_paths(pair[1], out, kinds)
            return
