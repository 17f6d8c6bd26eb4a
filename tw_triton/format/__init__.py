"""The on-disk format: one checkpoint is one safetensors file with a JSON manifest.

:func:`write_file` writes a :class:`~tw_triton.qstate.QuantizedState` atomically;
:func:`read_file`, :func:`read_manifest` and :func:`verify_file` validate the whole header
before they allocate anything, check every buffer's CRC-32, and raise
:class:`~tw_triton.errors.CheckpointError` (a malformed file) or
:class:`~tw_triton.errors.CheckpointIOError` (the operating system failed). No pickle: a
file holds JSON and raw little-endian bytes only.

Modules: ``spec`` (constants, dtypes, key syntax, the layout and manifest schema),
``header`` (parse and validate), ``compact`` (where the manifest text is stored: compressed
from version 3), ``manifest`` (write and check the manifest), ``plan`` and
``writer`` (write a file; ``writeback``, the early-writeback hint), ``buffer_io`` and
``reader`` (read and verify; the decompression-bomb bound), ``files`` (temporary names,
OS errors). The guarantees and the why: docs/format.md.
"""

from .compact import (
    MANIFEST_SLACK_BYTES,
    MAX_MANIFEST_EXPANSION,
    is_checkpoint_metadata,
    manifest_metadata,
    manifest_text,
)
from .files import IO_CHUNK_BYTES, is_temp_file, remove_quietly, temp_path_for
from .header import HeaderCache
from .reader import (
    EXPANSION_SLACK_BYTES,
    MAX_EXPANSION,
    check_max_expansion,
    read_file,
    read_manifest,
    verify_file,
)
from .spec import (
    BUFFER_DTYPES,
    BUFFER_NAME_RE,
    CHECKSUM_NAME,
    COMPACT_VERSION,
    ENTRY_DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_CRC_KEY,
    MANIFEST_KEY,
    MANIFEST_VERSION_KEY,
    MANIFEST_ZSTD_KEY,
    MAX_HEADER_BYTES,
    READABLE_VERSIONS,
    tensor_key,
)
from .upload_ring import one_ring
from .writer import write_file

__all__ = [
    "BUFFER_DTYPES",
    "BUFFER_NAME_RE",
    "CHECKSUM_NAME",
    "COMPACT_VERSION",
    "ENTRY_DTYPES",
    "EXPANSION_SLACK_BYTES",
    "check_max_expansion",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HeaderCache",
    "IO_CHUNK_BYTES",
    "MANIFEST_CRC_KEY",
    "MANIFEST_KEY",
    "MANIFEST_SLACK_BYTES",
    "MANIFEST_VERSION_KEY",
    "MANIFEST_ZSTD_KEY",
    "MAX_EXPANSION",
    "MAX_HEADER_BYTES",
    "MAX_MANIFEST_EXPANSION",
    "READABLE_VERSIONS",
    "is_checkpoint_metadata",
    "is_temp_file",
    "manifest_metadata",
    "manifest_text",
    "one_ring",
    "read_file",
    "read_manifest",
    "remove_quietly",
    "temp_path_for",
    "tensor_key",
    "verify_file",
    "write_file",
]
