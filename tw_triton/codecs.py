"""The codec registry: how one tensor of a state is encoded into named buffers and back.

A codec turns a tensor (and, for delta codecs, the reference tensor at the same path) into an
:class:`~tw_triton.qstate.EncodedEntry` — a codec name, JSON parameters and named buffers —
and decodes such an entry back. The file format stores entries generically, so registering
a new codec (a sparse bitmask codec, an entropy stage) needs no change to ``format.py``::

    from tw_triton.codecs import Codec, register_codec

    class MyCodec(Codec):
        ...

    register_codec("my-codec", MyCodec())

Built in:

``exact``
    Stores the tensor as it is, in its own dtype (any dtype safetensors stores). Buffer
    ``data``. No parameters.
``blockwise``
    The blockwise absmax integer codec of :mod:`tw_triton.codec` (Triton on CUDA, torch on
    CPU). Buffers ``codes`` (uint8, packed LSB-first) and ``scales`` (float32, one per
    block). Parameters ``bits`` (8, 4, 2), ``block`` (power of two, 32..4096), ``packing``
    (``"lsb-first"``) and ``delta`` (whether the codes are the delta from a reference).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .codec import (
    FLOAT_DTYPES,
    QuantizedTensor,
    check_params,
    dequantize,
    num_blocks,
    packed_nbytes,
    quantize,
)
from .errors import CheckpointError, QuantizationError
from .qstate import EncodedEntry
from .snapshot_pool import Allocator

PACKING = "lsb-first"

# Dtypes the exact codec stores: those safetensors has a name for.
EXACT_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)


@dataclass
class Encoded:
    """What :meth:`Codec.encode` returns.

    Attributes:
        entry: the encoded tensor.
        unusable: ``None``, or a 0-dim bool tensor on the tensor's device that is true when
            this encoding cannot represent the tensor (a NaN/Inf block) and the tensor must
            be stored exact instead. It is a device flag so that the state API can read all
            of them with one host sync.
    """

    entry: EncodedEntry
    unusable: torch.Tensor | None = None


class Codec(ABC):
    """One way to store a tensor. Subclasses set :attr:`name` and implement the methods."""

    name: str = ""

    @abstractmethod
    def resolve_params(self, params: Mapping[str, Any], *, bits: int, block: int) -> dict[str, Any]:
        """Validate rule parameters and fill defaults (``bits``/``block`` of the call).

        Raises:
            QuantizationError: unknown or invalid parameters.
        """

    @abstractmethod
    def accepts(self, tensor: torch.Tensor) -> bool:
        """Whether this codec can encode ``tensor`` (dtype, size). Rules skip it otherwise."""

    def uses_reference(self, params: Mapping[str, Any]) -> bool:
        """Whether an entry with these (resolved or stored) params is a delta."""
        return bool(params.get("delta", False))

    @abstractmethod
    def encode(
        self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None
    ) -> Encoded:
        """Encode ``x`` on its own device. The buffers must not alias ``x`` (a snapshot).

        ``reference`` is given only when :meth:`uses_reference` is true and a reference
        state was passed; the stored params must say whether it was used.
        """

    def encode_with(
        self,
        x: torch.Tensor,
        params: Mapping[str, Any],
        reference: torch.Tensor | None,
        allocate: Allocator,
    ) -> Encoded:
        """:meth:`encode`, writing the output buffers into memory from ``allocate``.

        ``allocate(shape, dtype, device)`` returns an uninitialized contiguous tensor
        (recycled host memory from a :class:`~tw_triton.snapshot_pool.SnapshotPool`).
        The result must be the same as :meth:`encode`'s. The default ignores
        ``allocate``: a codec that cannot write into given buffers still works.
        """
        return self.encode(x, params, reference)

    @abstractmethod
    def decode(
        self,
        entry: EncodedEntry,
        reference: torch.Tensor | None,
        device: torch.device | None,
        context: str,
    ) -> torch.Tensor:
        """Decode ``entry`` on ``device`` (``None``: where its buffers are).

        ``context`` names the file and entry for error messages.

        Raises:
            CheckpointError: the entry's params or buffers are not what this codec writes.
        """


def _move(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    if device is None or t.device == device:
        return t
    # From pinned host memory this copy is asynchronous; decode kernels queue behind it.
    return t.to(device, non_blocking=t.is_pinned())


def _buffer(entry: EncodedEntry, name: str, context: str) -> torch.Tensor:
    buf = entry.buffers.get(name)
    if not isinstance(buf, torch.Tensor):
        raise CheckpointError(
            f"{context}: codec {entry.codec!r} expects a buffer {name!r}, found "
            f"{sorted(entry.buffers)}"
        )
    return buf


class ExactCodec(Codec):
    """Stores the tensor unchanged (a contiguous clone)."""

    name = "exact"

    def resolve_params(self, params: Mapping[str, Any], *, bits: int, block: int) -> dict[str, Any]:
        if params:
            raise QuantizationError(f"codec 'exact' takes no parameters, got {dict(params)}")
        return {}

    def accepts(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype in EXACT_DTYPES

    def encode(
        self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None
    ) -> Encoded:
        self._check_dtype(x)
        data = x.detach().clone(memory_format=torch.contiguous_format)
        return self._entry(x, data)

    def encode_with(
        self,
        x: torch.Tensor,
        params: Mapping[str, Any],
        reference: torch.Tensor | None,
        allocate: Allocator,
    ) -> Encoded:
        self._check_dtype(x)
        data = allocate(tuple(x.shape), x.dtype, x.device)
        data.copy_(x.detach())
        return self._entry(x, data)

    def wrap(self, x: torch.Tensor) -> Encoded:
        """The entry of a contiguous ``x`` that holds ``x`` itself, not a copy.

        Only for a tensor that is already a private snapshot (nothing changes it until the
        entry is written): :meth:`encode` must copy, this does not.
        """
        self._check_dtype(x)
        if not x.is_contiguous():
            raise QuantizationError("only a contiguous tensor can be stored without a copy")
        return self._entry(x, x.detach())

    def _check_dtype(self, x: torch.Tensor) -> None:
        if x.dtype not in EXACT_DTYPES:
            raise QuantizationError(
                f"dtype {x.dtype} cannot be stored: the format holds "
                f"{', '.join(str(d).removeprefix('torch.') for d in EXACT_DTYPES)}"
            )

    def _entry(self, x: torch.Tensor, data: torch.Tensor) -> Encoded:
        entry = EncodedEntry(
            codec=self.name, params={}, shape=tuple(x.shape), dtype=x.dtype, buffers={"data": data}
        )
        return Encoded(entry)

    def decode(
        self,
        entry: EncodedEntry,
        reference: torch.Tensor | None,
        device: torch.device | None,
        context: str,
    ) -> torch.Tensor:
        data = _buffer(entry, "data", context)
        shape = tuple(entry.shape)
        if data.dtype != entry.dtype or data.numel() != math.prod(shape):
            raise CheckpointError(
                f"{context}: exact buffer is {data.dtype} with {data.numel()} elements, "
                f"expected {entry.dtype} with shape {shape}"
            )
        # No copy on the host: the buffer read from the file is the tensor.
        return _move(data.reshape(shape), device)


class BlockwiseCodec(Codec):
    """Blockwise absmax integer codec (delta from a reference when one is given)."""

    name = "blockwise"
    _KEYS = frozenset({"bits", "block", "packing", "delta"})

    def resolve_params(self, params: Mapping[str, Any], *, bits: int, block: int) -> dict[str, Any]:
        unknown = set(params) - self._KEYS
        if unknown:
            raise QuantizationError(
                f"codec 'blockwise' has no parameter(s) {sorted(unknown)}; it takes "
                f"{sorted(self._KEYS)}"
            )
        out = {
            "bits": params.get("bits", bits),
            "block": params.get("block", block),
            "packing": params.get("packing", PACKING),
            "delta": params.get("delta", True),
        }
        check_params(out["bits"], out["block"])
        if out["packing"] != PACKING:
            raise QuantizationError(f"codec 'blockwise' packs {PACKING!r} only, got {out['packing']!r}")
        if not isinstance(out["delta"], bool):
            raise QuantizationError(f"'delta' must be true or false, got {out['delta']!r}")
        return out

    def accepts(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype in FLOAT_DTYPES and tensor.numel() > 0

    def encode(
        self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None
    ) -> Encoded:
        q = quantize(x, bits=params["bits"], block=params["block"], reference=reference)
        stored = {
            "bits": q.bits,
            "block": q.block,
            "packing": PACKING,
            "delta": reference is not None,
        }
        entry = EncodedEntry(
            codec=self.name,
            params=stored,
            shape=q.shape,
            dtype=q.dtype,
            buffers={"codes": q.codes, "scales": q.scales},
        )
        return Encoded(entry, unusable=q.nonfinite)

    def decode(
        self,
        entry: EncodedEntry,
        reference: torch.Tensor | None,
        device: torch.device | None,
        context: str,
    ) -> torch.Tensor:
        params = entry.params
        bits, block = params.get("bits"), params.get("block")
        try:
            check_params(bits, block)  # type: ignore[arg-type]
        except QuantizationError as e:
            raise CheckpointError(f"{context}: {e}") from e
        if params.get("packing") != PACKING:
            raise CheckpointError(
                f"{context}: packing {params.get('packing')!r} is not supported, expected {PACKING!r}"
            )
        if entry.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{context}: blockwise entry has dtype {entry.dtype}, expected one of "
                "float32, float16, bfloat16"
            )
        shape = tuple(entry.shape)
        numel = math.prod(shape)
        codes = _buffer(entry, "codes", context)
        scales = _buffer(entry, "scales", context)
        want_codes, want_scales = packed_nbytes(numel, bits), num_blocks(numel, block)
        if codes.dtype != torch.uint8 or codes.numel() != want_codes:
            raise CheckpointError(
                f"{context}: codes are {codes.dtype} x {codes.numel()}, expected uint8 x "
                f"{want_codes} for shape {shape} at {bits} bits"
            )
        if scales.dtype != torch.float32 or scales.numel() != want_scales:
            raise CheckpointError(
                f"{context}: scales are {scales.dtype} x {scales.numel()}, expected float32 x "
                f"{want_scales} for shape {shape} and block {block}"
            )
        if self.uses_reference(params) and reference is None:
            raise CheckpointError(f"{context}: delta entry decoded without its reference tensor")
        dev = codes.device if device is None else device
        q = QuantizedTensor(
            codes=_move(codes.reshape(-1), dev),
            scales=_move(scales.reshape(-1), dev),
            shape=shape,
            dtype=entry.dtype,
            bits=bits,  # type: ignore[arg-type]
            block=block,  # type: ignore[arg-type]
            nonfinite=torch.zeros((), dtype=torch.bool, device=dev),
        )
        ref = _move(reference, dev) if reference is not None else None
        return dequantize(q, reference=ref if self.uses_reference(params) else None)


# The registry is the one piece of mutable module state: codecs are process-wide plug-ins,
# looked up by the name a file records, so a registry object would have to be global anyway.
_REGISTRY: dict[str, Codec] = {c.name: c for c in (ExactCodec(), BlockwiseCodec())}


def register_codec(name: str, codec: Codec, *, replace: bool = False) -> None:
    """Make ``codec`` available to rules and to loading under ``name``.

    Entries it encodes are recorded under ``name`` in the manifest, and a file naming
    ``name`` is decoded by it.

    Raises:
        QuantizationError: ``codec`` is not a :class:`Codec`, the name is empty, or it is
            taken and ``replace`` is false.
    """
    if not isinstance(codec, Codec):
        raise QuantizationError(f"a codec must subclass tw_triton.codecs.Codec, got {type(codec).__name__}")
    if not isinstance(name, str) or not name:
        raise QuantizationError(f"a codec needs a non-empty string name, got {name!r}")
    if name in _REGISTRY and not replace:
        raise QuantizationError(f"codec {name!r} is already registered (pass replace=True)")
    _REGISTRY[name] = codec


def get_codec(name: str) -> Codec | None:
    """The codec registered as ``name``, or ``None``."""
    return _REGISTRY.get(name)


def codec_names() -> list[str]:
    """Names of all registered codecs."""
    return sorted(_REGISTRY)
