"""Flatten a nested training state to ``{path: tensor}`` plus a JSON skeleton, and back.

A training state is any nesting of ``dict`` (including ``OrderedDict`` and ``Counter``), ``list`` and
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
        {"counter": [[key, node], ...]}         a collections.Counter (``MultiStepLR``'s
                                                milestones)
        {"subclass": name, "inner": [[name, node], ...], "meta": ..., "size": [...],
         "stride": [...]}                       a known tensor subclass (torchao's low-bit
                                                optimizer states), see :mod:`tw_triton.lowbit`

Anything else (namedtuples, sets, arbitrary objects, complex numbers, ...) is rejected with a
:class:`~tw_triton.errors.QuantizationError` naming its path: there is no pickle fallback.
Plain leaves, dict keys and paths are written and checked by :mod:`tw_triton.skeleton`;
why: docs/format.md.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import CheckpointError, QuantizationError
from .lowbit import flatten_subclass, is_wrapper, rebuild_subclass

# The path helpers are part of this module's API too (tw_triton.dcp uses escape_component).
from .skeleton import (  # noqa: F401
    EMPTY_TOP_LEVEL_KEY,
    NDARRAY_KINDS,
    PATH_SEPARATOR,
    decode_key,
    decode_scalar,
    describe_path,
    encode_scalar,
    escape_component,
    join_path,
    key_component,
    numpy_dtype,
    short_repr,
)


@dataclass(frozen=True)
class Flattened:
    """A state already split by :func:`flatten`, which
    :func:`~tw_triton.state.quantize_state_dict` takes in place of the nested state (it is
    not flattened again: a save that has flattened its state once passes it on)."""

    tensors: dict[str, torch.Tensor]
    skeleton: Any

    @classmethod
    def of(cls, state: Any) -> Flattened:
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
            out[decode_scalar(key)] = kind
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
            the path (a tensor subclass tw_triton does not know:
            :class:`~tw_triton.errors.UnsupportedTensorError`, also a CheckpointError).
    """
    tensors: dict[str, torch.Tensor] = {}
    try:
        skeleton = _flatten_node(state, "", tensors)
    except RecursionError as e:
        raise QuantizationError("the state is nested too deeply (or contains itself)") from e
    return tensors, skeleton


def _flatten_node(node: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, torch.Tensor):
        if is_wrapper(node):
            return flatten_subclass(node, path, lambda t, p: _flatten_node(t, p, tensors))
        if node.is_nested:  # strided layout, but no one shape: fails deep in the codec
            raise QuantizationError(
                f"tensor at {describe_path(path)} is a nested tensor: only dense tensors with data "
                "can be checkpointed"
            )
        if node.layout != torch.strided or node.is_quantized or node.device.type == "meta":
            raise QuantizationError(
                f"tensor at {describe_path(path)} has layout {node.layout} on {node.device}: "
                "only dense tensors with data can be checkpointed"
            )
        tensors[path] = node.detach()
        return {"tensor": path}
    if isinstance(node, np.ndarray):
        if node.dtype.kind not in NDARRAY_KINDS:
            raise QuantizationError(
                f"numpy array at {describe_path(path)} has dtype {node.dtype}: only bool, int, "
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
        if type(node) not in (dict, OrderedDict, Counter):
            raise QuantizationError(
                f"unsupported mapping type {type(node).__qualname__} at {describe_path(path)}: "
                "use dict, OrderedDict or Counter"
            )
        items = []
        seen: dict[str, Any] = {}
        for key, value in node.items():
            comp = key_component(key, path)
            if comp in seen:
                raise QuantizationError(
                    f"keys {seen[comp]!r} and {key!r} at {describe_path(path)} give the same path "
                    f"component {comp!r}"
                )
            seen[comp] = key
            # A tuple, written as a JSON array like a list: the collector stops tracking a pair
            # of a key and a leaf node, so a state's hundreds of pairs are not promoted
            # towards a full collection while a save that holds them runs.
            items.append((encode_scalar(key, path), _flatten_node(value, join_path(path, comp), tensors)))
        if type(node) is OrderedDict:
            meta = getattr(node, "_metadata", None)
            out: dict[str, Any] = {"odict": items}
            if meta is not None:
                out["meta"] = _flatten_plain(meta, join_path(path, "_metadata"))
            return out
        return {"counter" if type(node) is Counter else "dict": items}
    if isinstance(node, (list, tuple)):
        if type(node) not in (list, tuple):
            raise QuantizationError(
                f"unsupported sequence type {type(node).__qualname__} at {describe_path(path)} "
                "(namedtuples and list subclasses would not come back as themselves)"
            )
        kids = [_flatten_node(v, join_path(path, str(i)), tensors) for i, v in enumerate(node)]
        return {"tuple" if type(node) is tuple else "list": kids}
    return encode_scalar(node, path)


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
        raise QuantizationError(f"tensors inside {describe_path(path)} are not supported")
    return out


def unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor], *, build: bool = True) -> Any:
    """Rebuild the nested state from its skeleton and tensors by path.

    ``ndarray`` leaves come back as numpy arrays of their original dtype (copied to the
    host if their tensor is elsewhere); the same tensor object may appear under several
    paths (tied weights stay tied).

    The skeleton comes from a file, so it is checked as it is read: it must be one that
    :func:`flatten` writes (node shapes, leaf values in range for their numpy dtype, dict
    keys that give distinct path components, tensor subclasses of the allowlist only).
    ``build=False`` checks the skeleton without rebuilding tensor subclasses.

    Raises:
        CheckpointError: the skeleton is malformed or names a path missing from ``tensors``;
            the message names the node's path in the state and what was expected. Nothing
            else escapes (a skeleton that breaks a check in an unforeseen way is reported
            as malformed too).
    """
    try:
        return _unflatten_node(skeleton, tensors, "", build)
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
    unflatten(skeleton, placeholders, build=False)


def _lookup(tensors: Mapping[str, torch.Tensor], node: dict[str, Any], key: str, path: str) -> torch.Tensor:
    name = node[key]
    if not isinstance(name, str) or name not in tensors:
        raise CheckpointError(
            f"skeleton at {describe_path(path)}: names {key} {short_repr(name)}, which has no entry"
        )
    return tensors[name]


# The keys each container or tensor node has, as flatten writes them.
_NODE_KEYS = {
    "tensor": ({"tensor"},),
    "ndarray": ({"ndarray", "dtype"}, {"ndarray"}),
    "list": ({"list"},),
    "tuple": ({"tuple"},),
    "dict": ({"dict"},),
    "odict": ({"odict"}, {"odict", "meta"}),
    "counter": ({"counter"},),
    "subclass": ({"subclass", "inner", "meta", "size", "stride"},),
}


def _node_kind(node: dict[str, Any], path: str) -> str | None:
    """Which container or tensor node ``node`` is (``None``: a scalar leaf), checked to
    have exactly the keys of its kind."""
    for kind, shapes in _NODE_KEYS.items():
        if kind in node:
            if node.keys() not in shapes:
                raise CheckpointError(
                    f"skeleton at {describe_path(path)}: a {kind!r} node with keys {sorted(node)}, expected "
                    + " or ".join(str(sorted(k)) for k in shapes)
                )
            return kind
    return None


def _unflatten_node(node: Any, tensors: Mapping[str, torch.Tensor], path: str, build: bool = True) -> Any:
    kind = _node_kind(node, path) if isinstance(node, dict) else None
    if kind is None:
        return decode_scalar(node, describe_path(path))
    if kind == "tensor":
        return _lookup(tensors, node, "tensor", path)
    if kind == "ndarray":
        t = _lookup(tensors, node, "ndarray", path)
        want = numpy_dtype(node["dtype"], describe_path(path)) if "dtype" in node else None
        try:
            arr = t.detach().cpu().numpy()
        except TypeError:
            raise CheckpointError(
                f"skeleton at {describe_path(path)}: a numpy array of entry {node['ndarray']!r}, which is "
                f"{t.dtype}: numpy has no such dtype"
            ) from None
        return arr if want is None or arr.dtype == want else arr.astype(want)
    if kind == "subclass":
        inner = {}
        for pair in _as_list(node["inner"], path):
            if (
                not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str))
                or pair[0] in inner
            ):
                raise CheckpointError(
                    f"skeleton at {describe_path(path)}: inner tensor {short_repr(pair)}, expected [name, node]"
                )
            if not isinstance(pair[1], dict) or _node_kind(pair[1], path) != "tensor":
                raise CheckpointError(
                    f"skeleton at {describe_path(path)}: inner {pair[0]!r} is not a tensor node"
                )
            inner[pair[0]] = _lookup(tensors, pair[1], "tensor", path)
        return rebuild_subclass(node, inner, path, build=build)
    if kind in ("list", "tuple"):
        kids = [
            _unflatten_node(v, tensors, join_path(path, str(i)), build)
            for i, v in enumerate(_as_list(node[kind], path))
        ]
        return kids if kind == "list" else tuple(kids)
    out: dict[Any, Any] = OrderedDict() if kind == "odict" else Counter() if kind == "counter" else {}
    seen: set[str] = set()
    for pair in _as_list(node[kind], path):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise CheckpointError(
                f"skeleton at {describe_path(path)}: dict item {short_repr(pair)}, expected [key, node]"
            )
        key = decode_key(pair[0], path)
        comp = key_component(key, path)
        if comp in seen or key in out:
            raise CheckpointError(f"skeleton at {describe_path(path)}: key {key!r} appears twice")
        seen.add(comp)
        out[key] = _unflatten_node(pair[1], tensors, join_path(path, comp), build)
    if "meta" in node:
        out._metadata = _unflatten_node(node["meta"], tensors, join_path(path, "_metadata"))  # type: ignore[attr-defined]
    return out


def _as_list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise CheckpointError(
            f"skeleton at {describe_path(path)}: expected a list, found {type(value).__name__}"
        )
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
    for key in ("dict", "odict", "counter", "inner"):
        if isinstance(node.get(key), list):
            for pair in node[key]:
                if isinstance(pair, (list, tuple)) and len(pair) == 2:
                    _collect_paths(pair[1], out, kinds)
            return
