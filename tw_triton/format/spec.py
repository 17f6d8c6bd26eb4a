"""The file format's constants: names, versions, dtypes and the tensor-key syntax.

Layout (the safetensors layout, so stock ``safetensors`` opens every file written here)::

    [8 bytes: N, unsigned little-endian]
    [N bytes: JSON header, padded with spaces so that 8 + N is a multiple of 8]
    [data: every buffer's bytes, back to back, no gaps]

The header maps each tensor key to ``{"dtype", "shape", "data_offsets"}`` (offsets relative
to the start of the data) and holds ``__metadata__`` (str -> str) with, from version 3:

* ``"tw_triton.version"``: the format version (decimal), read before anything else;
* ``"tw_triton.zstd"``: the manifest, a JSON document (schema below), as one zstd frame
  stating its content size, base64-encoded;
* ``"tw_triton.crc32"``: CRC-32 of the stored manifest string, 8 lowercase hex digits, so a
  flipped bit anywhere in the manifest is caught even where the JSON stays valid.

Versions 1 and 2 store the manifest's JSON text as it is under ``"tw_triton"`` (and its CRC
under ``"tw_triton.crc32"``): :mod:`tw_triton.format.compact` reads both.

Tensor keys are ``"<entry path>:<buffer name>"``. Buffer names match ``[A-Za-z0-9_.-]+``
(no colon), so the last colon splits a key unambiguously whatever the entry path holds.

Buffers are laid out by decreasing element size (stable in entry order; a staged buffer
counts as bytes), so with the data section starting 8-byte aligned every buffer starts
aligned to its element size, as safetensors' own writer does.

Manifest, versions 2 and 3::

    {"format": "tw_triton", "version": 3,
     "checkpoint_id": str, "reference_id": str | null, "checksum": "crc32",
     "entries": {path: {"codec": str, "params": {...}, "dtype": "bfloat16", "shape": [..],
                        "buffers": {name: {"key": str, "dtype": "U8", "shape": [..],
                                           "data_offsets": [begin, end], "crc32": "89abcdef",
                                           "stage": {"name": "zstd", "params": {"level": 3},
                                                     "raw_nbytes": int}}}}},
     "aliases": {path: path}, "skeleton": any JSON, "rules": [...], "metadata": {...},
     "stats": {"raw_bytes": int, "stored_bytes": int, "entries": int, "buffers": int}}

A buffer record's ``dtype`` and ``shape`` are those of the buffer as the codec made it (what
a read returns); ``data_offsets`` and ``crc32`` are those of the bytes stored in the file.
``"stage"`` is optional (version 2 on): the buffer went through the lossless entropy stage
``name`` of :mod:`tw_triton.codecs.entropy` with ``params``, and ``raw_nbytes`` (shape x
dtype size) is its size before the stage. A staged buffer is, in the safetensors tensor
table, a 1-D ``U8`` tensor of its stored bytes. ``stats.stored_bytes`` is the data section,
``raw_bytes`` the original tensors. Version 1 is version 2 without stage records; version 3
is version 2 with the manifest compressed. All three are read, any other version is refused
(naming it).

The format knows no codec: it stores an entry's codec name, params and buffers as they are.
The why of these choices: docs/format.md and docs/design.md.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from ..errors import CheckpointError

FORMAT_NAME = "tw_triton"
FORMAT_VERSION = 3
# Versions this reader reads: 1 (no entropy stage), 2 (buffers may carry a stage) and 3
# (version 2 with the manifest compressed).
READABLE_VERSIONS = (1, 2, 3)
# The first version whose manifest is stored compressed (format.compact).
COMPACT_VERSION = 3

# Keys of the safetensors ``__metadata__`` map.
MANIFEST_KEY = "tw_triton"
MANIFEST_CRC_KEY = "tw_triton.crc32"
# Version 3 on: the format version, and the manifest zstd-compressed and base64-encoded.
MANIFEST_VERSION_KEY = "tw_triton.version"
MANIFEST_ZSTD_KEY = "tw_triton.zstd"
CHECKSUM_NAME = "crc32"

# safetensors refuses headers above this size; staying under it keeps files readable there.
MAX_HEADER_BYTES = 100_000_000

BUFFER_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+")
CRC_RE = re.compile(r"[0-9a-f]{8}")

# safetensors dtype names and the torch dtypes they hold (only those this torch has).
_SAFETENSORS_DTYPE_NAMES = (
    ("F64", "float64"),
    ("F32", "float32"),
    ("F16", "float16"),
    ("BF16", "bfloat16"),
    ("I64", "int64"),
    ("I32", "int32"),
    ("I16", "int16"),
    ("I8", "int8"),
    ("U64", "uint64"),
    ("U32", "uint32"),
    ("U16", "uint16"),
    ("U8", "uint8"),
    ("BOOL", "bool"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("C64", "complex64"),
)
# A buffer's dtype: safetensors name -> torch dtype, and back.
BUFFER_DTYPES: dict[str, torch.dtype] = {
    st: getattr(torch, name) for st, name in _SAFETENSORS_DTYPE_NAMES if hasattr(torch, name)
}
BUFFER_DTYPE_NAMES: dict[torch.dtype, str] = {dt: st for st, dt in BUFFER_DTYPES.items()}
# An entry's original dtype is only recorded (the codec decodes to it), so it may be any
# dtype a buffer may be, plus complex128 (an exact codec can store it as a float64 view).
ENTRY_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in [n for _, n in _SAFETENSORS_DTYPE_NAMES] + ["complex128"]
    if hasattr(torch, name)
}
ENTRY_DTYPE_NAMES: dict[torch.dtype, str] = {dt: n for n, dt in ENTRY_DTYPES.items()}

# The safetensors dtype of a staged buffer's stored bytes.
STAGED_DTYPE = "U8"

# The fields of each record, as the writer writes them and the reader requires them.
MANIFEST_FIELDS = (
    "format",
    "version",
    "checkpoint_id",
    "reference_id",
    "checksum",
    "entries",
    "aliases",
    "skeleton",
    "rules",
    "metadata",
    "stats",
)
ENTRY_FIELDS = ("codec", "params", "dtype", "shape", "buffers")
BUFFER_FIELDS = ("key", "dtype", "shape", "data_offsets", "crc32")
STAGE_FIELDS = ("name", "params", "raw_nbytes")
TENSOR_INFO_FIELDS = ("dtype", "shape", "data_offsets")
STATS_FIELDS = ("raw_bytes", "stored_bytes", "entries", "buffers")

# Any tensor torch can hold has fewer bytes than this.
_MAX_TENSOR_BYTES = 1 << 63
# Dimensions below this take check_shape's fast path (two of them multiply to under 2**62).
_SMALL_DIM = 1 << 31


def tensor_key(entry_path: str, buffer_name: str) -> str:
    """The safetensors key of one buffer: ``"<entry path>:<buffer name>"``."""
    return f"{entry_path}:{buffer_name}"


def is_int(v: Any) -> bool:
    """Whether ``v`` is an int of JSON (``True`` is not)."""
    return isinstance(v, int) and not isinstance(v, bool)


def check_shape(shape: Any, itemsize: int, where: Any) -> int:
    """Validate a shape of elements of ``itemsize`` bytes.

    The bound is on the product of the dimensions counting zeros as ones: torch computes
    strides from it, so ``[0, 2**40, 2**40]`` (no elements) would still overflow them.

    Args:
        shape: the shape to check (a list from JSON, or a tuple).
        itemsize: bytes per element.
        where: what the message names (anything whose ``str`` does; made only on failure).

    Returns:
        The number of elements.

    Raises:
        CheckpointError: not a list of non-negative ints, or 2**63 bytes or more.
    """
    if type(shape) is list and len(shape) <= 2:
        # Most buffers and entries: a vector or a matrix of ints read from JSON. With both
        # dimensions under 2**31 the bound below is the same test on the product itself (a
        # zero dimension leaves the other, far under it).
        if all(type(s) is int and 0 <= s < _SMALL_DIM for s in shape):
            n = 1
            for s in shape:
                n *= s
            if n * itemsize < _MAX_TENSOR_BYTES:
                return n
    if not isinstance(shape, (list, tuple)) or not all(is_int(s) and s >= 0 for s in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative ints, found {shape!r}")
    extent = 1
    for s in shape:
        extent *= max(s, 1)
        # Stop multiplying early, so an absurd shape costs no time.
        if extent * itemsize >= _MAX_TENSOR_BYTES:
            raise CheckpointError(
                f"{where}: shape {list(shape)} spans 2**63 bytes or more of {itemsize}-byte elements"
            )
    return math.prod(shape)
