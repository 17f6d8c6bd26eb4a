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
from typing import Any, Iterator, Mapping

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


# The non-finite floats a skeleton names as {"float": ...}, as _encode_scalar writes them.
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
# Skeleton paths are built only for a message: a walk passes the parent's path and the key.
_PLAIN_TYPES = (type(None), bool, str, int, float)


def _decode_scalar(node: Any, where: str = "the top level") -> Any:
    """The plain value of a skeleton leaf, checked to be one :func:`_encode_scalar` writes.

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
        f"skeleton at {where}: malformed node {_short(node)}, expected null, a bool, number or string, "
        "or a {'float'}, {'bytes'} or {'npscalar', 'value'} object"
    )


def _decode_bytes(text: Any, where: str) -> bytes:
    try:
        if not isinstance(text, str):
            raise ValueError
        return bytes.fromhex(text)
    except ValueError:
        raise CheckpointError(f"skeleton at {where}: bytes {_short(text)}, expected a string of hex digit pairs") from None


def _decode_npscalar(node: dict[str, Any], where: str) -> np.generic:
    """A numpy scalar leaf: its dtype, and a value that dtype holds as it was written."""
    dtype = _numpy_dtype(node["npscalar"], where)
    value = node["value"]
    if dtype.kind == "b":
        ok = isinstance(value, bool)
        expected = "true or false"
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        ok = isinstance(value, int) and not isinstance(value, bool) and info.min <= value <= info.max
        expected = f"an int from {info.min} to {info.max}"
    else:
        value = _decode_scalar(value, where) if isinstance(value, dict) else value
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and _fits_float(value, dtype)
        expected = f"a number within the range of {dtype.name}"
    if not ok:
        raise CheckpointError(f"skeleton at {where}: numpy {dtype.name} value {_short(value)}, expected {expected}")
    return dtype.type(value)


def _fits_float(value: float, dtype: np.dtype) -> bool:
    """Whether ``value`` is a value of the float ``dtype`` could have written: a finite one
    stays finite (1e20 is no float16, and an int past float64 is no float)."""
    # Python compares an int with a float exactly, without converting it (no overflow).
    if isinstance(value, int):
        return abs(value) <= float(np.finfo(dtype).max)
    return not math.isfinite(value) or abs(value) <= float(np.finfo(dtype).max)


def _short(value: Any) -> str:
    """repr of a value from a file, cut short: a message must not quote a megabyte."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _numpy_dtype(spec: Any, where: str = "the top level") -> np.dtype:
    """A numpy dtype named in a skeleton; only the kinds :func:`flatten` writes."""
    try:
        dtype = np.dtype(spec) if isinstance(spec, str) else None
    except (TypeError, ValueError, SyntaxError):
        dtype = None
    if dtype is None or dtype.kind not in _NDARRAY_KINDS or dtype.fields is not None or dtype.shape:
        raise CheckpointError(
            f"skeleton at {where}: numpy dtype {_short(spec)}, expected a bool, int or float dtype"
        )
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


def unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild the nested state from its skeleton and tensors by path.

    ``ndarray`` leaves come back as numpy arrays of their original dtype (copied to the
    host if their tensor is elsewhere); the same tensor object may appear under several
    paths (tied weights stay tied).

    The skeleton comes from a file, so it is checked as it is read: it must be one that
    :func:`flatten` writes (node shapes, leaf values in range for their numpy dtype, dict
    keys that give distinct path components).

    Raises:
        CheckpointError: the skeleton is malformed or names a path missing from ``tensors``;
            the message names the node's path in the state and what was expected. Nothing
            else escapes (a skeleton that breaks a check in an unforeseen way is reported
            as malformed too).
    """
    try:
        return _unflatten_node(skeleton, tensors, "")
    except CheckpointError:
        raise
    except MemoryError:
        raise
    except Exception as e:
        # A skeleton comes from a file: whatever else is wrong with it is a malformed file.
        raise CheckpointError(f"malformed skeleton: {type(e).__name__}: {e}") from e


def check_skeleton(skeleton: Any, dtypes: Mapping[str, torch.dtype]) -> None:
    """Check that :func:`unflatten` accepts ``skeleton`` given tensors of these dtypes by
    path (a manifest's entries and aliases), without any tensor data: what choosing a
    checkpoint to restore needs to know before it picks a file.

    Raises:
        CheckpointError: as :func:`unflatten`.
    """
    empty = {d: torch.empty(0, dtype=d) for d in set(dtypes.values())}
    placeholders = {p: empty[d] for p, d in dtypes.items()}
    unflatten(skeleton, placeholders)


def _lookup(tensors: Mapping[str, torch.Tensor], node: dict[str, Any], key: str, path: str) -> torch.Tensor:
    name = node[key]
    if not isinstance(name, str) or name not in tensors:
        raise CheckpointError(f"skeleton at {_describe(path)}: names {key} {_short(name)}, which has no entry")
    return tensors[name]


# The keys each container or tensor node has, as flatten writes them.
_NODE_KEYS = {
    "tensor": ({"tensor"},),
    "ndarray": ({"ndarray", "dtype"}, {"ndarray"}),
    "list": ({"list"},),
    "tuple": ({"tuple"},),
    "dict": ({"dict"},),
    "odict": ({"odict"}, {"odict", "meta"}),
}


def _node_kind(node: dict[str, Any], path: str) -> str | None:
    """Which container or tensor node ``node`` is (``None``: a scalar leaf), checked to
    have exactly the keys of its kind."""
    for kind, shapes in _NODE_KEYS.items():
        if kind in node:
            if node.keys() not in shapes:
                raise CheckpointError(
                    f"skeleton at {_describe(path)}: a {kind!r} node with keys {sorted(node)}, expected "
                    + " or ".join(str(sorted(k)) for k in shapes)
                )
            return kind
    return None


def _unflatten_node(node: Any, tensors: Mapping[str, torch.Tensor], path: str) -> Any:
    kind = _node_kind(node, path) if isinstance(node, dict) else None
    if kind is None:
        return _decode_scalar(node, _describe(path))
    if kind == "tensor":
        return _lookup(tensors, node, "tensor", path)
    if kind == "ndarray":
        t = _lookup(tensors, node, "ndarray", path)
        want = _numpy_dtype(node["dtype"], _describe(path)) if "dtype" in node else None
        try:
            arr = t.detach().cpu().numpy()
        except TypeError:
            raise CheckpointError(
                f"skeleton at {_describe(path)}: a numpy array of entry {node['ndarray']!r}, which is "
                f"{t.dtype}: numpy has no such dtype"
            ) from None
        return arr if want is None or arr.dtype == want else arr.astype(want)
    if kind in ("list", "tuple"):
        kids = [_unflatten_node(v, tensors, join_path(path, str(i))) for i, v in enumerate(_as_list(node[kind], path))]
        return kids if kind == "list" else tuple(kids)
    out: dict[Any, Any] = OrderedDict() if kind == "odict" else {}
    seen: set[str] = set()
    for pair in _as_list(node[kind], path):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise CheckpointError(f"skeleton at {_describe(path)}: dict item {_short(pair)}, expected [key, node]")
        key = _decode_key(pair[0], path)
        comp = _key_component(key, path)
        if comp in seen or key in out:
            raise CheckpointError(f"skeleton at {_describe(path)}: key {key!r} appears twice")
        seen.add(comp)
        out[key] = _unflatten_node(pair[1], tensors, join_path(path, comp))
    if "meta" in node:
        out._metadata = _unflatten_node(node["meta"], tensors, join_path(path, "_metadata"))  # type: ignore[attr-defined]
    return out


def _decode_key(node: Any, path: str) -> Any:
    """A dict key of a skeleton: a scalar that flatten accepts as a key."""
    key = _decode_scalar(node, f"{_describe(path)} (a dict key)")
    try:
        _key_component(key, path)
    except QuantizationError as e:
        raise CheckpointError(f"skeleton at {_describe(path)}: {e}") from None
    return key


def _as_list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise CheckpointError(f"skeleton at {_describe(path)}: expected a list, found {type(value).__name__}")
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
