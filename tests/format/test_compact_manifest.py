"""Format version 3 stores the manifest zstd-compressed in ``__metadata__``: smaller
headers, the same manifest back, versions stated before anything is decompressed, and
the decompression bounded (tw_triton.format.compact)."""

from __future__ import annotations

import base64
import json
import struct
import zlib
from pathlib import Path

import pytest
import safetensors
import zstandard
from _format_samples import assert_same_state, sample_state

from tw_triton import format as fmt
from tw_triton.errors import CheckpointError


def header_of(path: Path) -> dict:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n])


def rewrite_metadata(path: Path, meta: dict) -> None:
    """``path`` with its ``__metadata__`` replaced by ``meta`` (the data kept)."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    header["__metadata__"] = meta
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n :])


def compact_meta(frame: bytes, version: str = "3") -> dict:
    stored = base64.b64encode(frame).decode()
    return {
        fmt.MANIFEST_VERSION_KEY: version,
        fmt.MANIFEST_ZSTD_KEY: stored,
        fmt.MANIFEST_CRC_KEY: f"{zlib.crc32(stored.encode()):08x}",
    }


@pytest.fixture
def written(tmp_path) -> tuple[Path, dict]:
    path = tmp_path / "ckpt.safetensors"
    state = sample_state(2, scale=4)
    fmt.write_file(state, path, fsync=False)
    return path, fmt.read_manifest(path)


def test_the_manifest_is_stored_compressed_and_reads_back(tmp_path):
    state = sample_state(1, scale=4)
    path = tmp_path / "ckpt.safetensors"
    fmt.write_file(state, path, fsync=False)
    meta = header_of(path)["__metadata__"]
    assert set(meta) == {fmt.MANIFEST_VERSION_KEY, fmt.MANIFEST_ZSTD_KEY, fmt.MANIFEST_CRC_KEY}
    assert meta[fmt.MANIFEST_VERSION_KEY] == str(fmt.FORMAT_VERSION) == "3"
    text, version = fmt.manifest_text(meta, str(path))
    manifest = fmt.read_manifest(path)
    assert version == 3 and json.loads(text) == manifest and manifest["version"] == 3
    # Smaller than the JSON it holds, which version 2 stored as it is.
    assert len(meta[fmt.MANIFEST_ZSTD_KEY]) < len(text) / 2
    assert_same_state(state, fmt.read_file(path))
    fmt.verify_file(path)
    with safetensors.safe_open(str(path), framework="pt") as f:  # stock safetensors opens it
        assert fmt.is_checkpoint_metadata(f.metadata())
        assert len(list(f.keys())) == manifest["stats"]["buffers"]


@pytest.mark.parametrize("version", ["4", "17", "1000000000000"])
def test_a_newer_version_is_refused_naming_it(written, version):
    path, _ = written
    rewrite_metadata(path, compact_meta(b"not even zstd", version))
    with pytest.raises(
        CheckpointError, match=f"unknown format version '{version}'.*reads versions 1, 2, 3.*newer"
    ):
        fmt.read_manifest(path)


@pytest.mark.parametrize("version", ["2", "1", "0", "x", "", " 3", "-3"])
def test_a_version_key_that_is_not_a_compact_version_is_refused(written, version):
    path, _ = written
    rewrite_metadata(path, compact_meta(b"x", version))
    with pytest.raises(CheckpointError, match=f"unknown format version {version!r}"):
        fmt.read_manifest(path)


def test_a_decompression_bomb_is_refused_before_decompressing(written, monkeypatch):
    path, manifest = written
    size = fmt.MANIFEST_SLACK_BYTES + 64 * 1000 + 1
    frame = zstandard.ZstdCompressor(level=19).compress(b" " * size)
    assert len(frame) < 1000
    rewrite_metadata(path, compact_meta(frame))
    decompressed = []
    monkeypatch.setattr(zstandard.ZstdDecompressor, "decompress", lambda *a, **k: decompressed.append(1))
    with pytest.raises(CheckpointError, match="decompression bomb"):
        fmt.read_manifest(path)
    assert not decompressed


def test_the_bound_lets_a_real_manifest_through(written):
    path, manifest = written
    text = json.dumps(manifest) + " " * (fmt.MANIFEST_SLACK_BYTES // 2)  # compresses very well
    frame = zstandard.ZstdCompressor(level=19).compress(text.encode())
    assert len(text) <= fmt.MAX_MANIFEST_EXPANSION * len(frame) + fmt.MANIFEST_SLACK_BYTES
    rewrite_metadata(path, compact_meta(frame))
    assert fmt.read_manifest(path) == manifest


def test_a_frame_without_its_content_size_is_refused(written):
    path, manifest = written
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(json.dumps(manifest).encode())
    rewrite_metadata(path, compact_meta(frame))
    with pytest.raises(CheckpointError, match="does not state its content size"):
        fmt.read_manifest(path)


@pytest.mark.parametrize(
    "mangle, match",
    [
        (lambda f: f + b"\0\0\0", "trailing bytes"),
        (lambda f: f[:-5], "truncated"),
        (lambda f: b"\0" + f[1:], "zstd frame"),
    ],
    ids=["trailing", "truncated", "magic"],
)
def test_a_malformed_frame_is_refused(written, mangle, match):
    path, manifest = written
    frame = zstandard.ZstdCompressor().compress(json.dumps(manifest).encode())
    rewrite_metadata(path, compact_meta(mangle(frame)))
    with pytest.raises(CheckpointError, match=match):
        fmt.read_manifest(path)


def test_bad_base64_and_a_stale_checksum_are_refused(written):
    path, manifest = written
    meta = compact_meta(b"x")
    meta[fmt.MANIFEST_ZSTD_KEY] = "@@@@"
    meta[fmt.MANIFEST_CRC_KEY] = f"{zlib.crc32(b'@@@@'):08x}"
    rewrite_metadata(path, meta)
    with pytest.raises(CheckpointError, match="not base64"):
        fmt.read_manifest(path)
    meta = fmt.manifest_metadata(json.dumps(manifest))
    meta[fmt.MANIFEST_ZSTD_KEY] = meta[fmt.MANIFEST_ZSTD_KEY][:-4] + "AAA="
    rewrite_metadata(path, meta)
    with pytest.raises(CheckpointError, match="manifest checksum mismatch"):
        fmt.read_manifest(path)


def test_the_stated_version_must_be_the_manifests(written):
    path, manifest = written
    rewrite_metadata(path, fmt.manifest_metadata(json.dumps({**manifest, "version": 2})))
    with pytest.raises(CheckpointError, match="says format version 3, the manifest says 2"):
        fmt.read_manifest(path)
    # A version-3 manifest stored as plain JSON was never written.
    rewrite_metadata(path, fmt.manifest_metadata(json.dumps(manifest), 2))
    with pytest.raises(CheckpointError, match="must be stored compressed"):
        fmt.read_manifest(path)
    # A version-2 manifest stored as plain JSON is a version-2 file.
    rewrite_metadata(path, fmt.manifest_metadata(json.dumps({**manifest, "version": 2}), 2))
    assert fmt.read_manifest(path)["version"] == 2


def test_no_manifest_at_all(written):
    path, _ = written
    rewrite_metadata(path, {"format": "pt"})
    with pytest.raises(CheckpointError, match="plain safetensors file"):
        fmt.read_manifest(path)
    assert not fmt.is_checkpoint_metadata({"format": "pt"})
    assert not fmt.is_checkpoint_metadata(None)
