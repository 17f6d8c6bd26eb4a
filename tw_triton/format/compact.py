"""Where a file's manifest text lives in the safetensors ``__metadata__`` map, both ways.

Versions 1 and 2 store the manifest's JSON text as it is under ``"tw_triton"``; version 3
stores it zstd-compressed and base64-encoded under ``"tw_triton.zstd"``, with its version
under ``"tw_triton.version"`` (read before anything is decompressed, so a file of a newer
version is refused by its version number). ``"tw_triton.crc32"`` is the CRC-32 of the
stored string in both. Decompressing is bounded (:func:`manifest_limit`): a small file
cannot declare a huge manifest. Why: docs/format.md ("Compact manifest").
"""

from __future__ import annotations

import base64
import binascii
import re

import zstandard

from ..codecs.entropy.zstd import check_zstd_frame, decode_error
from ..errors import CheckpointError
from .checksum import crc32
from .spec import (
    COMPACT_VERSION,
    CRC_RE,
    FORMAT_VERSION,
    MANIFEST_CRC_KEY,
    MANIFEST_KEY,
    MANIFEST_VERSION_KEY,
    MANIFEST_ZSTD_KEY,
    MAX_HEADER_BYTES,
    READABLE_VERSIONS,
)

# Level 9: level 19 stores 7-16% less on real manifests but takes 15-50 times as long on
# the writer thread (docs/format.md, "Compact manifest").
MANIFEST_ZSTD_LEVEL = 9
# A compressed manifest may decode to at most this many times its stored size plus the
# slack (and never past MAX_HEADER_BYTES); real manifests compress 5 to 10 times.
MAX_MANIFEST_EXPANSION = 64
MANIFEST_SLACK_BYTES = 1 << 20
_DECIMAL = re.compile(r"[1-9][0-9]{0,30}")


def manifest_metadata(text: str, version: int = FORMAT_VERSION) -> dict[str, str]:
    """The ``__metadata__`` entries that store the manifest ``text`` of format ``version``."""
    if version < COMPACT_VERSION:
        stored = text
        meta = {MANIFEST_KEY: stored}
    else:
        z = zstandard.ZstdCompressor(level=MANIFEST_ZSTD_LEVEL, write_content_size=True, write_checksum=False)
        stored = base64.b64encode(z.compress(text.encode("utf-8"))).decode("ascii")
        meta = {MANIFEST_VERSION_KEY: str(version), MANIFEST_ZSTD_KEY: stored}
    meta[MANIFEST_CRC_KEY] = f"{crc32(stored.encode('utf-8', 'surrogatepass')):08x}"
    return meta


def is_checkpoint_metadata(meta: dict[str, str] | None) -> bool:
    """Whether a safetensors ``__metadata__`` map is that of a tw_triton checkpoint."""
    return bool(meta) and any(k in meta for k in (MANIFEST_KEY, MANIFEST_VERSION_KEY))


def manifest_limit(stored_nbytes: int) -> int:
    """The most bytes a compressed manifest of ``stored_nbytes`` may decode to."""
    return min(MAX_HEADER_BYTES, MAX_MANIFEST_EXPANSION * stored_nbytes + MANIFEST_SLACK_BYTES)


def _versions() -> str:
    return ", ".join(map(str, READABLE_VERSIONS))


def manifest_text(meta: dict[str, str], path: str) -> tuple[str, int | None]:
    """The manifest's JSON text stored in ``meta``, its checksum checked, decompressed
    within :func:`manifest_limit`.

    Returns:
        The text, and the version the metadata states (``None``: versions 1 and 2, whose
        manifest alone states it).

    Raises:
        CheckpointError: no manifest, an unknown version (naming it and the readable ones),
            a checksum mismatch, or a compressed manifest that is malformed or too large.
    """
    version = None
    if MANIFEST_VERSION_KEY in meta:
        raw_version = meta[MANIFEST_VERSION_KEY]
        version = int(raw_version) if _DECIMAL.fullmatch(raw_version) else None
        if version not in READABLE_VERSIONS or version < COMPACT_VERSION:
            newer = version is not None and version > FORMAT_VERSION
            raise CheckpointError(
                f"checkpoint {path}: unknown format version {raw_version!r}, this tw_triton reads "
                f"versions {_versions()}" + (" (written by a newer tw_triton?)" if newer else "")
            )
        key = MANIFEST_ZSTD_KEY
    elif MANIFEST_KEY in meta:
        key = MANIFEST_KEY
    else:
        raise CheckpointError(
            f"checkpoint {path}: no {MANIFEST_KEY!r} manifest in __metadata__ "
            "(a plain safetensors file, not a tw_triton checkpoint)"
        )
    stored = meta.get(key)
    if stored is None:
        raise CheckpointError(f"checkpoint {path}: format version {version} needs __metadata__[{key!r}]")
    stored_crc = meta.get(MANIFEST_CRC_KEY)
    if not isinstance(stored_crc, str) or not CRC_RE.fullmatch(stored_crc):
        raise CheckpointError(
            f"checkpoint {path}: expected __metadata__[{MANIFEST_CRC_KEY!r}] to be 8 hex digits"
        )
    actual_crc = crc32(stored.encode("utf-8", "surrogatepass"))
    if actual_crc != int(stored_crc, 16):
        raise CheckpointError(
            f"checkpoint {path}: manifest checksum mismatch (expected crc32 {stored_crc}, "
            f"computed {actual_crc:08x}): the header is corrupted"
        )
    if version is None:
        return stored, None
    return _decompress(stored, path), version


def _decompress(stored: str, path: str) -> str:
    where = f"checkpoint {path}: compressed manifest"
    try:
        frame = base64.b64decode(stored.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error) as exc:
        raise CheckpointError(f"{where}: not base64: {exc}") from exc
    try:
        size = zstandard.get_frame_parameters(frame).content_size
    except zstandard.ZstdError as exc:
        raise CheckpointError(f"{where}: bad zstd frame header: {exc}") from exc
    limit = manifest_limit(len(frame))
    if size != zstandard.CONTENTSIZE_UNKNOWN and size > limit:
        raise CheckpointError(
            f"{where}: declares {size} bytes, more than {MAX_MANIFEST_EXPANSION} times its "
            f"{len(frame)} stored bytes plus {MANIFEST_SLACK_BYTES} (at most {limit}): refused "
            "before decompressing (a decompression bomb?)"
        )
    # One frame, its content size stated, blocks that can make it: then zstd writes into
    # exactly that many bytes and fails on any other count.
    check_zstd_frame(memoryview(frame), size, where)
    try:
        raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise decode_error(where, exc) from exc
    if len(raw) != size:
        raise CheckpointError(f"{where}: the zstd frame decodes to {len(raw)} bytes, its header says {size}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{where}: not UTF-8: {exc}") from exc
