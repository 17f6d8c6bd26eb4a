"""The on-disk format: one checkpoint is one safetensors file with a JSON manifest.

:func:`write_file` writes a :class:`~tw_triton.qstate.QuantizedState` atomically;
:func:`read_file`, :func:`read_manifest` and :func:`verify_file` validate the whole header
before they allocate anything, check every buffer's CRC-32, and raise
:class:`~tw_triton.errors.CheckpointError` (a malformed file) or
:class:`~tw_triton.errors.CheckpointIOError` (the operating system failed). No pickle: a
file holds JSON and raw little-endian bytes only.

Modules: ``spec`` (constants, dtypes, key syntax, the layout and manifest schema),
``header`` (parse and validate), ``manifest`` (write and check the manifest), ``plan`` and
``writer`` (write a file; ``writeback``, the early-writeback hint), ``buffer_io`` and
``reader`` (read and verify; the decompression-bomb bound), ``files`` (temporary names,
OS errors). The guarantees and the why: docs/format.md.
"""

from .files import IO_CHUNK_BYTES, is_temp_file, remove_quietly, temp_path_for
from .header import HeaderCache
from .reader import EXPANSION_SLACK_BYTES, MAX_EXPANSION, read_file, read_manifest, verify_file
from .spec import (
    BUFFER_DTYPES,
    BUFFER_NAME_RE,
    CHECKSUM_NAME,
    ENTRY_DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_CRC_KEY,
    MANIFEST_KEY,
    MAX_HEADER_BYTES,
    READABLE_VERSIONS,
    tensor_key,
)
from .writer import write_file

__all__ = [
    "BUFFER_DTYPES",
    "BUFFER_NAME_RE",
    "CHECKSUM_NAME",
    "ENTRY_DTYPES",
    "EXPANSION_SLACK_BYTES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HeaderCache",
    "IO_CHUNK_BYTES",
    "MANIFEST_CRC_KEY",
    "MANIFEST_KEY",
    "MAX_EXPANSION",
    "MAX_HEADER_BYTES",
    "READABLE_VERSIONS",
    "is_temp_file",
    "read_file",
    "read_manifest",
    "remove_quietly",
    "temp_path_for",
    "tensor_key",
    "verify_file",
    "write_file",
]

# alias for other areas until the merge: benchmarks/ reach these internals of the old
# tw_triton/format.py (header_writeback.py, profile_save_load.py, checksum_cost.py).
import zlib  # noqa: E402,F401
from ..codecs.entropy import encode_buffer  # noqa: E402,F401
from .buffer_io import read_exact_into as _read_exact_into  # noqa: E402,F401
from .header import read_layout as _read_layout  # noqa: E402,F401
from .manifest import quote as _quote, to_json as _json  # noqa: E402,F401
from .plan import plan_file as _plan  # noqa: E402,F401
from .writeback import can_start_writeback  # noqa: E402,F401
from .writer import encode_header as _encode_header, write_buffers as _write_buffers  # noqa: E402,F401
