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
    The blockwise absmax integer codec of :mod:`tw_triton.codecs.blockwise` (Triton on CUDA, torch on
    CPU). Buffers ``codes`` (uint8, packed LSB-first) and ``scales`` (float32, one per
    block). Parameters ``bits`` (8, 4, 2), ``block`` (power of two, 32..4096), ``packing``
    (``"lsb-first"``) and ``delta`` (whether the codes are the delta from a reference).
``log2``
    The second-moment codec of :mod:`tw_triton.codecs.log2`, for non-negative tensors such
    as AdamW's ``exp_avg_sq``: codes linear in a piecewise-linear log2 between each block's
    smallest and largest positive value, code 0 reserved for exact zero. Buffers ``codes``
    (uint8), ``lo`` and ``hi`` (int32, one per block). Parameters ``bits``, ``block``,
    ``packing``. Never decodes a value below zero, nor zero where the input was not.
``bitmask``
    The lossless sparse codec of :mod:`tw_triton.codecs.bitmask`: buffers ``mask`` (uint8,
    a bit per element, LSB-first, set where the bit pattern is not zero) and ``values``
    (the non-zero elements in order, in the tensor's dtype). Parameter ``packing``. The
    state API picks it by itself for a float tensor it would store exact when that is
    smaller.
``log2-temporal``
    The temporal codec of :mod:`tw_triton.codecs.log2_temporal` for the same moments between
    keyframes: the change of the fp32 bit pattern against the last reconstruction, one
    signed byte per element, absolute ``log2`` codes for the blocks it cannot code. Buffer
    ``codes`` (uint8: the int32 bounds ``lo`` and ``hi`` of every block, then one code per
    element). Parameters ``bits``, ``block``, ``min_step``, ``delta``.
``blockwise-update``
    Adam's first moment in the update's domain (:mod:`tw_triton.codecs.blockwise_update`):
    ``exp_avg / (sqrt(v_hat) + eps)`` as blockwise codes, ``v_hat`` the decoded entry at
    param ``partner`` of the same file. Buffers as ``blockwise``'s. Parameters ``bits``,
    ``block``, ``packing``, ``qmax`` (optional), ``eps``, ``partner``. Opt-in, in no preset.

The numeric work runs in the ops of :mod:`tw_triton.ops` (dispatched by device). Why each
codec: docs/codecs.md.
"""

from __future__ import annotations

from ..errors import QuantizationError
from .base import Codec, Encoded
from .bitmask import BitmaskCodec
from .blockwise import PACKING, BlockwiseCodec
from .blockwise_update import BlockwiseUpdateCodec
from .exact import EXACT_DTYPES, ExactCodec
from .log2 import Log2Codec
from .log2_temporal import Log2TemporalCodec

# The registry is the one piece of mutable module state: codecs are process-wide plug-ins,
# looked up by the name a file records, so a registry object would have to be global anyway.
_REGISTRY: dict[str, Codec] = {
    c.name: c
    for c in (
        ExactCodec(),
        BlockwiseCodec(),
        Log2Codec(),
        Log2TemporalCodec(),
        BitmaskCodec(),
        BlockwiseUpdateCodec(),
    )
}


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


def unregister_codec(name: str) -> Codec | None:
    """Remove the codec registered as ``name`` (a plug-in's, or a test's); returns it, or
    ``None`` if there was none. Files naming it no longer load."""
    return _REGISTRY.pop(name, None)


def get_codec(name: str) -> Codec | None:
    """The codec registered as ``name``, or ``None``."""
    return _REGISTRY.get(name)


def codec_names() -> list[str]:
    """Names of all registered codecs."""
    return sorted(_REGISTRY)


__all__ = [
    "EXACT_DTYPES",
    "PACKING",
    "BitmaskCodec",
    "BlockwiseCodec",
    "BlockwiseUpdateCodec",
    "Codec",
    "Encoded",
    "ExactCodec",
    "Log2Codec",
    "Log2TemporalCodec",
    "codec_names",
    "get_codec",
    "register_codec",
    "unregister_codec",
]
