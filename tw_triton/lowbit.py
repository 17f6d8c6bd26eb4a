"""Low-bit optimizer states: stored as they are, never quantized again.

Two kinds of state arrive already quantized:

* torchao's low-bit optimizers (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``) keep each
  moment as a *tensor subclass* whose data lives in inner tensors (codes, block scales, a
  code map). :func:`flatten_subclass` splits one into its inner tensors and a JSON node;
  :func:`rebuild_subclass` puts it back together on load. Only the types of
  :data:`KNOWN_SUBCLASSES` are stored: a file records a type by its key in that table, and
  the library imports the class from its own table entry, never from a name the file
  gives. Any other subclass that dispatches on its own (DTensor, other wrappers) is refused
  at save time, naming the path and the type.
* bitsandbytes' 8-bit optimizers are plain tensors (uint8 ``state1``/``state2``, float32
  ``absmax`` and ``qmap``) that their ``state_dict()`` gathers under the key
  :data:`BNB_STATE_KEY`.

Both are stored exact (the entropy stage still applies where it pays), whatever the rules
say: :func:`stored_as_is` is what :func:`tw_triton.rules.select_rule` asks first. Paths of
inner tensors are the subclass's path, then a component ``%`` + the inner name
(``optimizer/state/0/exp_avg/%codes``), which no dict key gives (a ``%`` in a key is
escaped as ``%25``). Why: docs/training-loop.md, "Low-bit optimizers"; the skeleton node:
docs/format.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import CheckpointError, UnsupportedTensorError
from .skeleton import PATH_SEPARATOR, describe_path, short_repr

# The marker of an inner tensor's path component (see module doc).
INNER_MARK = "%"
# The key under which bitsandbytes' Optimizer8bit.state_dict() puts a parameter's states.
BNB_STATE_KEY = "__bnb_optimizer_quant_state__"


@dataclass(frozen=True)
class KnownSubclass:
    """A tensor subclass tw_triton stores: where its class lives, and its inner tensors."""

    module: str
    qualname: str
    inner: tuple[str, ...]
    package: str  # what to install to load it

    @property
    def key(self) -> str:
        """The name a file records: the class's fully qualified name."""
        return f"{self.module}.{self.qualname}"

    def load_class(self, where: str) -> type:
        try:
            module = importlib.import_module(self.module)
        except ImportError as e:
            raise CheckpointError(
                f"{where}: a {self.key} needs the package {self.package!r} to be rebuilt ({e})"
            ) from e
        cls = getattr(module, self.qualname, None)
        if not (
            isinstance(cls, type) and issubclass(cls, torch.Tensor) and hasattr(cls, "__tensor_unflatten__")
        ):
            raise CheckpointError(
                f"{where}: {self.module} has no tensor subclass {self.qualname} (another version of "
                f"{self.package}?)"
            )
        return cls


KNOWN_SUBCLASSES: dict[str, KnownSubclass] = {
    k.key: k
    for k in (
        KnownSubclass("torchao.optim.subclass_8bit", "OptimState8bit", ("codes", "scale", "qmap"), "torchao"),
        KnownSubclass("torchao.optim.subclass_4bit", "OptimState4bit", ("codes", "scale", "qmap"), "torchao"),
        KnownSubclass("torchao.optim.subclass_fp8", "OptimStateFp8", ("codes", "scale"), "torchao"),
    )
}


def installed_classes() -> list[type]:
    """The classes of :data:`KNOWN_SUBCLASSES` whose package is installed (imported here):
    what ``tw convert`` lets ``torch.load(weights_only=True)`` build."""
    out = []
    for spec in KNOWN_SUBCLASSES.values():
        if importlib.util.find_spec(spec.package) is not None:
            try:
                out.append(spec.load_class(spec.key))
            except CheckpointError:
                continue  # another version of the package: its files are refused as before
    return out


def is_wrapper(t: torch.Tensor) -> bool:
    """Whether ``t``'s class dispatches on its own: its data may live elsewhere than its
    storage (a subclass that only adds Python methods, as ``nn.Parameter``, does not)."""
    return type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def inner_path(path: str, name: str) -> str:
    """The path of inner tensor ``name`` of the subclass at ``path``."""
    comp = INNER_MARK + name
    return f"{path}{PATH_SEPARATOR}{comp}" if path else comp


def stored_as_is(path: str) -> bool:
    """Whether the tensor at ``path`` is already quantized by its optimizer: an inner tensor
    of a tensor subclass, or a state under bitsandbytes' :data:`BNB_STATE_KEY`."""
    comps = path.split(PATH_SEPARATOR)
    # An escaped key starts with "%2" or "%0" ("%25", "%2F", "%00"); an inner name with a letter.
    return BNB_STATE_KEY in comps or any(c[:1] == INNER_MARK and c[1:2].isalpha() for c in comps)


def outer_path(path: str) -> str:
    """The path of the tensor an entry belongs to: the subclass's for an inner tensor, else
    ``path`` itself."""
    head, sep, last = path.rpartition(PATH_SEPARATOR)
    return head if last[:1] == INNER_MARK and last[1:2].isalpha() else path


def flatten_subclass(t: torch.Tensor, path: str, flatten_inner: Callable[[torch.Tensor, str], Any]) -> Any:
    """The skeleton node of an allowlisted subclass at ``path``; its inner tensors go
    through ``flatten_inner(tensor, inner_path)``.

    Raises:
        UnsupportedTensorError: a type not in :data:`KNOWN_SUBCLASSES`, or one whose inner
            tensors or metadata are not what its table entry says; naming the path and type.
    """
    name = f"{type(t).__module__}.{type(t).__qualname__}"
    spec = KNOWN_SUBCLASSES.get(name)
    if spec is None:
        raise UnsupportedTensorError(
            f"tensor at {describe_path(path)} is a {name}, a tensor subclass tw_triton cannot store "
            f"(it stores plain tensors and {', '.join(sorted(KNOWN_SUBCLASSES))}); save a plain "
            "tensor there instead (a DTensor: use tw_triton.dcp)"
        )
    names, meta = t.__tensor_flatten__()
    if tuple(names) != spec.inner:
        raise UnsupportedTensorError(
            f"tensor at {describe_path(path)}: {name} flattens to inner tensors {list(names)}, "
            f"expected {list(spec.inner)} (a {spec.package} version tw_triton does not know)"
        )
    for n in names:
        if not isinstance(getattr(t, n), torch.Tensor) or is_wrapper(getattr(t, n)):
            raise UnsupportedTensorError(
                f"tensor at {describe_path(path)}: inner {n!r} of its {name} is a "
                f"{type(getattr(t, n)).__name__}, expected a plain tensor"
            )
    return {
        "subclass": spec.key,
        "inner": [[n, flatten_inner(getattr(t, n), inner_path(path, n))] for n in names],
        "meta": encode_meta(meta, path),
        "size": list(t.shape),
        "stride": list(t.stride()),
    }


def rebuild_subclass(
    node: Mapping[str, Any], inner: dict[str, torch.Tensor], path: str, *, build: bool = True
) -> torch.Tensor | None:
    """The tensor a :func:`flatten_subclass` node stands for, given its inner tensors by
    name; with ``build=False`` only the node is checked (nothing is imported).

    Raises:
        CheckpointError: a type not in :data:`KNOWN_SUBCLASSES`, inner names or metadata
            that are not its own, its package missing, or a constructor that fails.
    """
    where = f"skeleton at {describe_path(path)}"
    key = node["subclass"]
    spec = KNOWN_SUBCLASSES.get(key) if isinstance(key, str) else None
    if spec is None:
        raise CheckpointError(
            f"{where}: tensor subclass {short_repr(key)} is not one tw_triton rebuilds "
            f"(known: {', '.join(sorted(KNOWN_SUBCLASSES))})"
        )
    if tuple(inner) != spec.inner:
        raise CheckpointError(f"{where}: {key} with inner tensors {list(inner)}, expected {list(spec.inner)}")
    meta = decode_meta(node["meta"], where)
    size, stride = (_int_list(node[k], where, k) for k in ("size", "stride"))
    if len(size) != len(stride):
        raise CheckpointError(f"{where}: size {size} and stride {stride} differ in length")
    if not build:
        return None
    cls = spec.load_class(where)
    try:
        out = cls.__tensor_unflatten__(dict(inner), meta, torch.Size(size), tuple(stride))
    except Exception as e:
        raise CheckpointError(f"{where}: rebuilding {key} failed: {type(e).__name__}: {e}") from e
    if type(out) is not cls or list(out.shape) != size:
        raise CheckpointError(
            f"{where}: rebuilding {key} gave {type(out).__name__} of shape {list(out.shape)}"
        )
    return out


def encode_meta(value: Any, path: str) -> Any:
    """JSON of a subclass's ``__tensor_flatten__`` metadata: plain values, lists, tuples,
    ``torch.dtype`` and ``torch.Size``; anything else is refused."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)):
        return value
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Size):
        return {"size": [int(n) for n in value]}
    if type(value) in (list, tuple):
        return {type(value).__name__: [encode_meta(v, path) for v in value]}
    raise UnsupportedTensorError(
        f"tensor at {describe_path(path)}: its subclass metadata holds {short_repr(value)} of type "
        f"{type(value).__name__}, which a file cannot record"
    )


_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def decode_meta(node: Any, where: str) -> Any:
    """The metadata :func:`encode_meta` wrote, checked node by node."""
    if (
        node is None
        or isinstance(node, (bool, str, int))
        or (isinstance(node, float) and math.isfinite(node))
    ):
        return node
    if isinstance(node, dict) and len(node) == 1:
        ((kind, value),) = node.items()
        if kind in ("list", "tuple") and isinstance(value, list):
            kids = [decode_meta(v, where) for v in value]
            return kids if kind == "list" else tuple(kids)
        if kind == "dtype" and isinstance(value, str) and value in _DTYPES:
            return _DTYPES[value]
        if kind == "size":
            return torch.Size(_int_list(value, where, "size"))
    raise CheckpointError(f"{where}: subclass metadata {short_repr(node)} is not one tw_triton writes")


def _int_list(value: Any, where: str, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(n) is int and n >= 0 for n in value):
        raise CheckpointError(f"{where}: {what} {short_repr(value)}, expected a list of non-negative ints")
    return value
