"""Malformed checkpoint files: a corpus of corruptions and a fuzz test.

Every malformed file must raise ``CheckpointError`` (naming the file, and the entry where
there is one), never another exception, a crash, a hang or an allocation larger than the
file. Hand-made corruptions recompute the manifest checksum, so they reach the deeper checks
instead of stopping at the checksum.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import zstandard
from _format_samples import STAGE_EVERYTHING, assert_same_state, blockwise_entry, exact_entry, unstage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tw_triton
from tw_triton import format as fmt
from tw_triton.codecs import entropy
from tw_triton.errors import CheckpointError
from tw_triton.qstate import QuantizedState


def small_state() -> QuantizedState:
    """A few hundred bytes of data: small enough to try every cut point and every byte."""
    g = torch.Generator().manual_seed(0)
    return QuantizedState(
        entries={
            "model/w": blockwise_entry(torch.randn(10, 16, generator=g), bits=4, block=32),
            "model/b": exact_entry(torch.randn(6, generator=g).to(torch.bfloat16)),
            "step": exact_entry(torch.tensor(3, dtype=torch.int64)),
            "mask": exact_entry(torch.tensor([True, False, True])),
            "empty": exact_entry(torch.empty(0)),
        },
        skeleton={"model": {"w": "model/w", "b": "model/b"}, "step": 3, "lr": 0.5},
        checkpoint_id="c1",
        reference_id=None,
        aliases={"model/w_tied": "model/w"},
        rules=[["*", "exact"]],
        metadata={"step": 3},
    )


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[QuantizedState, bytes]:
    state = small_state()
    path = tmp_path_factory.mktemp("good") / "good.safetensors"
    fmt.write_file(state, path, fsync=False)
    return state, path.read_bytes()


def split(blob: bytes) -> tuple[dict, dict, bytes]:
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    manifest = json.loads(fmt.manifest_text(header["__metadata__"], "x")[0])
    return header, manifest, blob[8 + n :]


def assemble(header: dict, manifest: dict | str | None, data: bytes, *, fix_crc: bool = True) -> bytes:
    """Re-encode a header (with a valid manifest checksum unless told not to)."""
    header = json.loads(json.dumps(header))
    if manifest is not None:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        crc = header["__metadata__"][fmt.MANIFEST_CRC_KEY]
        # Stored as its version stores it; a version this reader does not know, as JSON
        # (so that the manifest's own version is what the reader refuses).
        version = manifest.get("version") if isinstance(manifest, dict) else fmt.FORMAT_VERSION
        compact = type(version) is int and version >= fmt.COMPACT_VERSION and version in fmt.READABLE_VERSIONS
        header["__metadata__"] = fmt.manifest_metadata(text, fmt.COMPACT_VERSION if compact else 2)
        if not fix_crc:
            header["__metadata__"][fmt.MANIFEST_CRC_KEY] = crc
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def craft(blob: bytes, edit: Callable[[dict, dict], None], data: bytes | None = None) -> bytes:
    header, manifest, old = split(blob)
    edit(header, manifest)
    return assemble(header, manifest, old if data is None else data)


def put(path: Path, blob: bytes) -> None:
    """Make ``path`` hold ``blob``: rewritten in place, because on ext4 reopening a file
    with O_TRUNC flushes it to disk, which would make the thousands of cases here slow."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, len(blob))
        os.pwrite(fd, blob, 0)
    finally:
        os.close(fd)


def outcome(path: Path, state: QuantizedState) -> str:
    """``"error"`` for a CheckpointError, ``"identical"`` for a read equal to ``state``.

    Anything else (another exception, or a read that differs) fails the test.
    """
    try:
        back = fmt.read_file(path)
    except CheckpointError as e:
        assert str(path) in str(e), f"message does not name the file: {e}"
        return "error"
    assert_same_state(state, back)
    return "identical"


def expect_error(tmp_path: Path, blob: bytes, match: str, name: str = "bad.safetensors") -> CheckpointError:
    path = tmp_path / name
    put(path, blob)
    with pytest.raises(CheckpointError, match=match) as info:
        fmt.read_file(path)
    assert str(path) in str(info.value)
    # The cheap header-only reader sees the same problems (data checksums aside).
    if "checksum mismatch" not in match:
        with pytest.raises(CheckpointError):
            fmt.read_manifest(path)
    return info.value


# --------------------------------------------------------------------------------------
# Truncation and flipped bits
# --------------------------------------------------------------------------------------


def test_every_truncation_raises(tmp_path, good):
    state, blob = good
    path = tmp_path / "cut.safetensors"
    for cut in range(len(blob)):
        put(path, blob[:cut])
        with pytest.raises(CheckpointError) as info:
            fmt.read_file(path)
        assert str(path) in str(info.value), cut


def test_every_header_bit_flip_is_caught(tmp_path, good):
    state, blob = good
    (n,) = struct.unpack("<Q", blob[:8])
    path = tmp_path / "flip.safetensors"
    results = {"error": 0, "identical": 0}
    for pos in range(8 + n):
        for bit in range(8):
            mutated = bytearray(blob)
            mutated[pos] ^= 1 << bit
            put(path, bytes(mutated))
            results[outcome(path, state)] += 1
    # A flip can only leave the content identical if it changes nothing JSON sees; the
    # header is ASCII without escapes or insignificant whitespace but its end padding, so
    # none can.
    assert results["identical"] == 0, results


def test_every_data_byte_flip_is_caught_by_checksums(tmp_path, good):
    state, blob = good
    header, _, data = split(blob)
    start = len(blob) - len(data)
    owner = {}
    for key, info in header.items():
        if key != "__metadata__":
            for i in range(*info["data_offsets"]):
                owner[i] = key.rsplit(":", 1)
    path = tmp_path / "flip.safetensors"
    for i in range(len(data)):
        mutated = bytearray(blob)
        mutated[start + i] ^= 1 << (i % 8)
        put(path, bytes(mutated))
        with pytest.raises(CheckpointError, match="checksum mismatch") as info:
            fmt.read_file(path)
        entry, name = owner[i]
        assert f"entry {entry!r} buffer {name!r}" in str(info.value)
        # read_manifest does not read the data, verify_file does.
        fmt.read_manifest(path)
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            fmt.verify_file(path)


def test_appended_bytes_raise(tmp_path, good):
    expect_error(tmp_path, good[1] + b"\0", "bytes appended")


# --------------------------------------------------------------------------------------
# The length prefix and the JSON
# --------------------------------------------------------------------------------------


def test_a_torch_save_file_is_named_as_one_not_as_a_truncated_checkpoint(tmp_path):
    # A stock Lightning .ckpt given to TwCheckpointIO, or a .pt to tw inspect: the message
    # said "header length 578712552184433488 ... (truncated or not a safetensors file)".
    torch.save({"w": torch.ones(3)}, tmp_path / "zip.pt")
    torch.save({"w": torch.ones(3)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    expect_error(tmp_path, (tmp_path / "zip.pt").read_bytes(), r"a zip archive \(what torch\.save writes\)")
    expect_error(tmp_path, (tmp_path / "legacy.pt").read_bytes(), r"a pickle \(torch\.save's legacy format\)")


@pytest.mark.parametrize("n", [2**64 - 1, 2**63, 2**40, 10**9])
def test_header_length_larger_than_the_file(tmp_path, good, n):
    expect_error(tmp_path, struct.pack("<Q", n) + good[1][8:], "header length")


def test_short_files(tmp_path):
    expect_error(tmp_path, b"", "too short")
    expect_error(tmp_path, b"\x02\0\0\0\0\0\0", "too short")
    expect_error(tmp_path, struct.pack("<Q", 2) + b"{}", "__metadata__")
    expect_error(tmp_path, struct.pack("<Q", 0), "not valid JSON")


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[1, 2]", "JSON object"),
        (b"{" * 100000, "not valid JSON"),
        # Nesting deep enough for a RecursionError in the parser.
        (b'{"__metadata__": ' + b"[" * 100000 + b"]" * 100000 + b"}", "not valid JSON"),
        (b'{"__metadata__": {}, "__metadata__": {}}', "duplicate key"),
        (b'{"__metadata__": {"a": NaN}}', "not valid JSON"),
        (b'{"__metadata__": {"tw_triton": 1}}', "str to str"),
        (b'{"__metadata__": []}', "str to str"),
        (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', "__metadata__"),
    ],
    ids=lambda v: v[:24].decode("latin-1") if isinstance(v, bytes) else None,
)
def test_malformed_json_header(tmp_path, raw, match):
    raw += b" " * (-(8 + len(raw)) % 8)
    expect_error(tmp_path, struct.pack("<Q", len(raw)) + raw, match)


def test_manifest_that_is_not_json(tmp_path, good):
    header, _, data = split(good[1])
    expect_error(tmp_path, assemble(header, "{not json", data), "manifest is not valid JSON")
    expect_error(tmp_path, assemble(header, "[1]", data), "expected a JSON object")


def test_manifest_checksum_is_checked(tmp_path, good):
    header, manifest, data = split(good[1])
    manifest["metadata"]["step"] = 4  # valid JSON, changed content, stale checksum
    expect_error(tmp_path, assemble(header, manifest, data, fix_crc=False), "manifest checksum mismatch")
    header["__metadata__"][fmt.MANIFEST_CRC_KEY] = "xyz"
    expect_error(tmp_path, assemble(header, None, data), "8 hex digits")
    del header["__metadata__"][fmt.MANIFEST_CRC_KEY]
    expect_error(tmp_path, assemble(header, None, data), "8 hex digits")


# --------------------------------------------------------------------------------------
# Offsets, shapes, dtypes, keys (with a valid manifest checksum)
# --------------------------------------------------------------------------------------


def _buf(manifest: dict, entry: str, name: str) -> dict:
    return manifest["entries"][entry]["buffers"][name]


def _set_both(header: dict, manifest: dict, entry: str, name: str, field: str, value) -> None:
    header[f"{entry}:{name}"][field] = value
    _buf(manifest, entry, name)[field] = value


def test_offsets_past_the_end(tmp_path, good):
    def edit(h, m):
        b = _buf(m, "model/w", "codes")
        s, e = b["data_offsets"]
        _set_both(h, m, "model/w", "codes", "data_offsets", [s + 10**6, e + 10**6])

    expect_error(tmp_path, craft(good[1], edit), "model/w")


def test_overlapping_offsets(tmp_path, good):
    def edit(h, m):
        # Two same-size buffers made to start at the same place: an overlap and a gap.
        a = _buf(m, "model/w", "codes")["data_offsets"]
        _set_both(h, m, "step", "data", "data_offsets", [a[0], a[0] + 8])

    err = expect_error(tmp_path, craft(good[1], edit), "overlaps|gap|begin")
    assert "entry " in str(err)


def test_gap_between_buffers(tmp_path, good):
    def edit(h, m):
        for key, info in h.items():
            if key != "__metadata__":
                s, e = info["data_offsets"]
                entry, name = key.rsplit(":", 1)
                _set_both(h, m, entry, name, "data_offsets", [s + 8, e + 8])
        m["stats"]["stored_bytes"] += 8

    expect_error(tmp_path, craft(good[1], edit, data=b"\0" * 8 + split(good[1])[2]), "gap")


def test_span_that_does_not_match_the_shape(tmp_path, good):
    def edit(h, m):
        _set_both(h, m, "model/w", "codes", "shape", [81])

    err = expect_error(tmp_path, craft(good[1], edit), "do not span shape")
    assert "entry 'model/w' buffer 'codes'" in str(err)


@pytest.mark.parametrize("shape", [[2**60], [2**30, 2**30, 2**30], [2**62, 4], [-1], [1.5], ["8"], [True], 8])
def test_absurd_buffer_shapes(tmp_path, good, shape):
    def edit(h, m):
        _set_both(h, m, "model/w", "scales", "shape", shape)

    expect_error(tmp_path, craft(good[1], edit), "model/w")


@pytest.mark.parametrize("shape", [[0, 2**40, 2**40], [0, 2**63], [2**64, 0]])
def test_absurd_empty_buffer_shapes(tmp_path, good, shape):
    """No elements, so the byte span (0) matches, but torch could not even build the strides."""

    def edit(h, m):
        _set_both(h, m, "empty", "data", "shape", shape)

    expect_error(tmp_path, craft(good[1], edit), "entry 'empty' buffer 'data'.*2\\*\\*63")


def test_absurd_entry_shape_is_refused_before_any_allocation(tmp_path, good, monkeypatch):
    def edit(h, m):
        m["entries"]["model/w"]["shape"] = [2**62, 2]

    expect_error(tmp_path, craft(good[1], edit), "2\\*\\*63")

    # 2**60 float32 elements fit in 2**63 bytes, so the format accepts the shape (it knows
    # no codec); decoding must then refuse it by the codec's buffer sizes, not allocate.
    def edit60(h, m):
        m["entries"]["model/w"]["shape"] = [2**60]

    path = tmp_path / "shape60.safetensors"
    put(path, craft(good[1], edit60))
    assert fmt.read_file(path).entries["model/w"].shape == (2**60,)
    real_empty = torch.empty

    def bounded_empty(*size, **kw):
        t = real_empty(*size, **kw)
        assert t.numel() * t.element_size() <= path.stat().st_size * 64, "giant allocation"
        return t

    monkeypatch.setattr(torch, "empty", bounded_empty)
    with pytest.raises(CheckpointError, match="model/w"):
        tw_triton.load(path)


@pytest.mark.parametrize("dtype", ["F128", "f32", "", 3, None, "I4"])
def test_unknown_buffer_dtype(tmp_path, good, dtype):
    def edit(h, m):
        _set_both(h, m, "model/b", "data", "dtype", dtype)

    expect_error(tmp_path, craft(good[1], edit), "unknown dtype")


def test_unknown_entry_dtype(tmp_path, good):
    def edit(h, m):
        m["entries"]["model/b"]["dtype"] = "float128"

    expect_error(tmp_path, craft(good[1], edit), "entry 'model/b': unknown dtype")


def test_tensor_table_and_manifest_must_agree(tmp_path, good):
    cases = {
        "dtype": ("U8", "I8"),  # same size, different meaning
        "shape": ([80], [8, 10]),
    }
    for field, (_, value) in cases.items():

        def edit(h, m, field=field, value=value):
            h["model/w:codes"][field] = value

        expect_error(tmp_path, craft(good[1], edit), f"tensor table says {field}")

    def extra_field(h, m):
        h["model/w:codes"]["extra"] = 1

    expect_error(tmp_path, craft(good[1], extra_field), "unexpected fields")


def test_missing_entries_and_stray_tensors(tmp_path, good):
    def drop_tensor(h, m):
        del h["model/b:data"]

    expect_error(tmp_path, craft(good[1], drop_tensor), "missing from the file")

    def drop_entry(h, m):
        del m["entries"]["model/b"]
        m["stats"]["entries"] -= 1
        m["stats"]["buffers"] -= 1

    expect_error(tmp_path, craft(good[1], drop_entry), "no manifest entry names it")

    def drop_buffer(h, m):
        del m["entries"]["model/w"]["buffers"]["scales"]

    expect_error(tmp_path, craft(good[1], drop_buffer), "'model/w:scales' is in the file")

    def drop_field(h, m):
        del m["entries"]["model/w"]["buffers"]["codes"]["crc32"]

    expect_error(tmp_path, craft(good[1], drop_field), "missing field.*crc32")


def test_wrong_tensor_key(tmp_path, good):
    def edit(h, m):
        h["model/w:codez"] = h.pop("model/w:codes")
        _buf(m, "model/w", "codes")["key"] = "model/w:codez"

    expect_error(tmp_path, craft(good[1], edit), "expected tensor key 'model/w:codes'")


@pytest.mark.parametrize(
    "version, match",
    [
        (4, "unknown format version 4.*reads versions 1, 2, 3.*newer"),
        (2**70, "version 1180591620717411303424.*newer"),
        (0, "unknown format version 0"),
        ("1", "version '1'"),
        (True, "version True"),
        (None, "version None"),
    ],
)
def test_unknown_version(tmp_path, good, version, match):
    def edit(h, m):
        m["version"] = version

    expect_error(tmp_path, craft(good[1], edit), match)


def test_not_our_format(tmp_path, good):
    def edit(h, m):
        m["format"] = "other"

    expect_error(tmp_path, craft(good[1], edit), "expected format 'tw_triton'")


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("checkpoint_id", 5, "checkpoint_id"),
        ("reference_id", [], "reference_id"),
        ("checksum", "md5", "checksum"),
        ("entries", [], "entries must be"),
        ("aliases", {"x": "nope"}, "alias 'x' must name an entry"),
        ("aliases", {"step": "model/w"}, "also an entry"),
        ("rules", {}, "rules"),
        ("metadata", [], "metadata"),
        ("stats", {"raw_bytes": 1}, "missing field"),
    ],
)
def test_manifest_schema(tmp_path, good, field, value, match):
    def edit(h, m):
        m[field] = value

    expect_error(tmp_path, craft(good[1], edit), match)


def test_stats_must_match_the_file(tmp_path, good):
    def edit(h, m):
        m["stats"]["stored_bytes"] += 1

    expect_error(tmp_path, craft(good[1], edit), "stored_bytes")


def test_unknown_codec_is_the_loaders_error(tmp_path, good):
    """The format stores codecs generically, so a file naming a codec this version does not
    know reads fine (a newer codec never touches the format); decoding it is refused by
    the codec registry in ``tw_triton.load``, with the file and the entry named."""

    def edit(h, m):
        m["entries"]["model/b"]["codec"] = "zstd-from-the-future"

    path = tmp_path / "codec.safetensors"
    put(path, craft(good[1], edit))
    assert fmt.read_file(path).entries["model/b"].codec == "zstd-from-the-future"
    with pytest.raises(CheckpointError, match="zstd-from-the-future") as info:
        tw_triton.load(path)
    assert str(path) in str(info.value) and "model/b" in str(info.value)

    def empty(h, m):
        m["entries"]["model/b"]["codec"] = ""

    expect_error(tmp_path, craft(good[1], empty), "codec must be")


# --------------------------------------------------------------------------------------
# Fuzz
# --------------------------------------------------------------------------------------


def _fuzz_once(tmp_path: Path, state: QuantizedState, blob: bytes, monkeypatch) -> str:
    path = tmp_path / "fuzz.safetensors"
    put(path, blob)
    limit = max(len(blob), 1)
    real_empty = torch.empty

    def bounded_empty(*size, **kw):
        t = real_empty(*size, **kw)
        assert t.numel() * t.element_size() <= limit, "allocation larger than the file"
        return t

    with monkeypatch.context() as m:
        m.setattr(torch, "empty", bounded_empty)
        return outcome(path, state)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_mutations_anywhere(tmp_path, good, monkeypatch, data):
    state, blob = good
    mutated = bytearray(blob)
    for pos, value in data.draw(
        st.lists(st.tuples(st.integers(0, len(blob) - 1), st.integers(0, 255)), min_size=1, max_size=8)
    ):
        mutated[pos] = value
    cut = data.draw(st.none() | st.integers(0, len(blob)))
    if cut is not None:
        mutated = mutated[:cut]
    _fuzz_once(tmp_path, state, bytes(mutated), monkeypatch)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_mutations_in_the_header(tmp_path, good, monkeypatch, data):
    state, blob = good
    (n,) = struct.unpack("<Q", blob[:8])
    mutated = bytearray(blob)
    edits = data.draw(
        st.lists(
            st.tuples(st.integers(0, 8 + n - 1), st.sampled_from(b' {}[]":,0123456789-.eE\\ntfu\x00\xff')),
            min_size=1,
            max_size=4,
        )
    )
    for pos, value in edits:
        mutated[pos] = value
    result = _fuzz_once(tmp_path, state, bytes(mutated), monkeypatch)
    # The only harmless header edits are rewrites of the trailing space padding to other
    # JSON whitespace (or to itself, or edits that restore the original bytes).
    if result == "identical":
        pad_start = 8 + len(blob[8 : 8 + n].rstrip(b" "))
        changed = [p for p in range(8 + n) if mutated[p] != blob[p]]
        assert all(p >= pad_start and mutated[p] in b" \t\n\r" for p in changed)


def _slots(node, out: list) -> list:
    """Every (container, key) under ``node``: the places a structured edit can hit."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        out.append((node, k))
        _slots(v, out)
    return out


_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.sampled_from([0, 1, -1, 7, 2**31, 2**62, 2**63, 2**64, 10**30, -(2**63)])
    | st.integers()
    | st.floats(allow_nan=False)
    | st.sampled_from(
        [
            "",
            "F32",
            "U8",
            "BOOL",
            "float32",
            "exact",
            "blockwise",
            "model/w",
            "model/w:codes",
            "zstd",
            "zstd-bytegroup",
        ]
    )
    | st.text(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=6,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_structured_edits_with_a_valid_manifest_checksum(tmp_path, good, monkeypatch, data):
    """Byte flips mostly stop at the manifest checksum; these edits replace one JSON value
    anywhere in the tensor table or the manifest and fix the checksum, so they reach every
    schema, offset and shape check behind it."""
    _structured_edits(tmp_path, good[1], monkeypatch, data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_staged_fuzz_structured_edits_with_a_valid_manifest_checksum(tmp_path, staged, monkeypatch, data):
    """The same on a file whose buffers are staged: stage records, raw sizes, U8 tables."""
    _structured_edits(tmp_path, staged[1], monkeypatch, data)


def _structured_edits(tmp_path: Path, blob: bytes, monkeypatch, data) -> None:
    header, manifest, payload = split(blob)
    tables = [{k: v for k, v in header.items() if k != "__metadata__"}, manifest]
    for _ in range(data.draw(st.integers(1, 3))):
        slots = _slots(tables, [])
        container, key = slots[data.draw(st.integers(0, len(slots) - 1))]
        container[key] = data.draw(_JSON_VALUES)
    table, edited = tables
    if not isinstance(table, dict) or not isinstance(edited, dict):
        return  # a whole table replaced: covered by the JSON tests above
    new_header = {"__metadata__": header["__metadata__"], **table}
    path = tmp_path / "structured.safetensors"
    put(path, assemble(new_header, edited, payload))
    real_empty = torch.empty

    def bounded_empty(*size, **kw):
        t = real_empty(*size, **kw)
        assert t.numel() * t.element_size() <= len(payload), "allocation larger than the data"
        return t

    with monkeypatch.context() as m:
        m.setattr(torch, "empty", bounded_empty)
        try:
            back = fmt.read_file(path)
        except CheckpointError as e:
            assert str(path) in str(e)
            return
    # The edit made another valid file (the manifest is authoritative and its checksum was
    # fixed): what was read must be exactly what the edited manifest describes.
    assert back.checkpoint_id == edited["checkpoint_id"] and back.reference_id == edited["reference_id"]
    assert back.skeleton == edited["skeleton"] and back.rules == edited["rules"]
    assert back.metadata == edited["metadata"] and back.aliases == edited["aliases"]
    assert list(back.entries) == list(edited["entries"])
    for entry_path, entry in edited["entries"].items():
        got = back.entries[entry_path]
        assert (got.codec, got.params, list(got.shape)) == (entry["codec"], entry["params"], entry["shape"])
        assert got.dtype == fmt.ENTRY_DTYPES[entry["dtype"]]
        for name, buf in entry["buffers"].items():
            t = got.buffers[name]
            assert t.dtype == fmt.BUFFER_DTYPES[buf["dtype"]] and list(t.shape) == buf["shape"]
            begin, end = buf["data_offsets"]
            assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == unstage(buf, payload[begin:end])


# --------------------------------------------------------------------------------------
# Staged (compressed) buffers
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> tuple[QuantizedState, bytes]:
    """small_state with every non-empty buffer through its entropy stage."""
    state = small_state()
    path = tmp_path_factory.mktemp("staged") / "staged.safetensors"
    fmt.write_file(state, path, fsync=False, entropy=STAGE_EVERYTHING)
    manifest = fmt.read_manifest(path)
    stages = {
        b["stage"]["name"]
        for e in manifest["entries"].values()
        for b in e["buffers"].values()
        if "stage" in b
    }
    assert stages == {"zstd", "zstd-bytegroup"}
    return state, path.read_bytes()


def _staged_keys(blob: bytes) -> list[tuple[str, str]]:
    _, manifest, _ = split(blob)
    return [(p, n) for p, e in manifest["entries"].items() for n, b in e["buffers"].items() if "stage" in b]


def relayout(
    blob: bytes, entry: str, name: str, stored: bytes, edit: Callable[[dict, dict], None] | None = None
) -> bytes:
    """Replace one buffer's stored bytes (offsets, sizes and its CRC made consistent), so
    that crafted stored bytes reach the stage's checks."""
    header, manifest, data = split(blob)
    keys = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    target = fmt.tensor_key(entry, name)
    out, pos = b"", 0
    for key in keys:
        b, e = header[key]["data_offsets"]
        chunk = stored if key == target else data[b:e]
        e_path, b_name = key.rsplit(":", 1)
        _set_both(header, manifest, e_path, b_name, "data_offsets", [pos, pos + len(chunk)])
        if key == target:
            header[key]["shape"] = [len(chunk)]
            _buf(manifest, entry, name)["crc32"] = f"{zlib.crc32(chunk):08x}"
        out += chunk
        pos += len(chunk)
    manifest["stats"]["stored_bytes"] = pos
    if edit is not None:
        edit(header, manifest)
    return assemble(header, manifest, out)


def test_staged_every_truncation_raises(tmp_path, staged):
    _, blob = staged
    path = tmp_path / "cut.safetensors"
    for cut in range(len(blob)):
        put(path, blob[:cut])
        with pytest.raises(CheckpointError) as info:
            fmt.read_file(path)
        assert str(path) in str(info.value), cut


def test_staged_every_data_bit_flip_is_caught_naming_the_entry(tmp_path, staged):
    """Every frame written here carries zstd's content checksum, which a load checks as it
    decodes (no CRC pass): a flip raises a CheckpointError naming the file and the entry,
    or, where no decoder sees it, the content is intact. ``verify_file`` checks the CRC
    as well: it reports every flip."""
    state, blob = staged
    header, _, data = split(blob)
    start = len(blob) - len(data)
    owner = {}
    for key, info in header.items():
        if key != "__metadata__":
            for i in range(*info["data_offsets"]):
                owner[i] = key.rsplit(":", 1)
    path = tmp_path / "flip.safetensors"
    results = {"error": 0, "identical": 0}
    for i in range(len(data)):
        mutated = bytearray(blob)
        mutated[start + i] ^= 1 << (i % 8)
        put(path, bytes(mutated))
        entry, name = owner[i]
        try:
            back = fmt.read_file(path)
        except CheckpointError as exc:
            assert f"entry {entry!r} buffer {name!r}" in str(exc) and str(path) in str(exc)
            results["error"] += 1
        else:
            assert_same_state(state, back)
            results["identical"] += 1
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            fmt.verify_file(path)
    assert results["error"] > 0.9 * sum(results.values()), results


def test_a_frame_without_content_checksum_is_crc_checked_before_the_decoder(tmp_path, staged, monkeypatch):
    """A zstd frame written without its content checksum (not by this library, but valid)
    gets the CRC pass: a flip stops there, and the stage never runs."""
    import zstandard

    state, blob = staged
    _, manifest, data = split(blob)
    entry, name = next(
        (e, n) for e, n in _staged_keys(blob) if _buf(manifest, e, n)["stage"]["name"] == "zstd"
    )
    b, e = _buf(manifest, entry, name)["data_offsets"]
    raw = zstandard.ZstdDecompressor().decompress(data[b:e])
    bare = zstandard.ZstdCompressor(level=1, write_checksum=False, write_content_size=True).compress(raw)
    assert not zstandard.get_frame_parameters(bare).has_checksum
    good = relayout(blob, entry, name, bare)
    path = tmp_path / "bare.safetensors"
    put(path, good)
    assert_same_state(state, fmt.read_file(path))
    header, manifest, data = split(good)
    start = len(good) - len(data)
    b, e = _buf(manifest, entry, name)["data_offsets"]
    calls = []
    monkeypatch.setattr(entropy.ZstdStage, "decode", lambda *a, **k: calls.append(a[-1]))
    where = f"entry {entry!r} buffer {name!r}"
    for i in range(b, e):
        mutated = bytearray(good)
        mutated[start + i] ^= 1 << (i % 8)
        put(path, bytes(mutated))
        calls.clear()
        with pytest.raises(CheckpointError, match="checksum mismatch") as info:
            fmt.read_file(path)
        assert where in str(info.value)
        assert not any(where in call for call in calls)


def test_staged_bit_flips_without_verify_never_escape_as_another_error(tmp_path, staged):
    """With verify=False the CRC is skipped: the frame checks and zstd's own content
    checksum must still turn every flip in compressed data into a CheckpointError that
    names the entry (or, for a flip no decoder sees, the identical content)."""
    state, blob = staged
    header, manifest, data = split(blob)
    start = len(blob) - len(data)
    path = tmp_path / "flip.safetensors"
    results = {"error": 0, "identical": 0}
    for entry, name in _staged_keys(blob):
        b, e = _buf(manifest, entry, name)["data_offsets"]
        for i in range(b, e):
            for bit in (0, 3, 7):
                mutated = bytearray(blob)
                mutated[start + i] ^= 1 << bit
                put(path, bytes(mutated))
                try:
                    back = fmt.read_file(path, verify=False)
                except CheckpointError as exc:
                    assert f"entry {entry!r} buffer {name!r}" in str(exc) and str(path) in str(exc)
                    results["error"] += 1
                    continue
                assert_same_state(state, back)
                results["identical"] += 1
    assert results["error"] > 0.9 * sum(results.values()), results


@pytest.mark.parametrize("raw_nbytes", [0, 1, 2**40, -1, "64", None, 1.5])
def test_staged_lying_raw_size(tmp_path, staged, raw_nbytes):
    def edit(h, m):
        _buf(m, "model/w", "codes")["stage"]["raw_nbytes"] = raw_nbytes

    err = expect_error(tmp_path, craft(staged[1], edit), "raw_nbytes")
    assert "entry 'model/w' buffer 'codes'" in str(err)


def test_staged_lying_shape_and_raw_size_together(tmp_path, staged, monkeypatch):
    """Shape and raw_nbytes agree with each other but not with the stored frame: refused by
    the frame check before the destination is allocated."""
    for numel in (81, 79, 2**40):

        def edit(h, m, numel=numel):
            _buf(m, "model/w", "codes")["shape"] = [numel]
            _buf(m, "model/w", "codes")["stage"]["raw_nbytes"] = numel

        path = tmp_path / "lie.safetensors"
        put(path, craft(staged[1], edit))
        fmt.read_manifest(path)  # the header alone is consistent
        # Without the bound on the whole file's expansion (which refuses 2**40 first), the
        # frame check still holds.
        with _bounded_allocations(monkeypatch, len(staged[1])):
            with pytest.raises(
                CheckpointError, match="zstd frame holds 80 bytes, the manifest says raw_nbytes"
            ) as info:
                fmt.read_file(path, max_expansion=None)
        assert "entry 'model/w' buffer 'codes'" in str(info.value) and str(path) in str(info.value)
        with pytest.raises(CheckpointError, match="zstd frame holds 80"):
            fmt.verify_file(path, max_expansion=None)


class _bounded_allocations:
    """torch.empty may not allocate more than ``limit`` bytes inside the block."""

    def __init__(self, monkeypatch, limit: int) -> None:
        self.monkeypatch, self.limit = monkeypatch, limit

    def __enter__(self) -> None:
        real_empty = torch.empty
        limit = self.limit

        def bounded_empty(*size, **kw):
            t = real_empty(*size, **kw)
            assert t.numel() * t.element_size() <= limit, "allocation larger than the bound"
            return t

        self.ctx = self.monkeypatch.context()
        self.ctx.__enter__().setattr(torch, "empty", bounded_empty)

    def __exit__(self, *exc) -> None:
        self.ctx.__exit__(*exc)


def _hand_frame(content_size: int, blocks: list[tuple[int, int, bytes]]) -> bytes:
    """A single-segment zstd frame with an 8-byte content size and the given blocks."""
    out = b"\x28\xb5\x2f\xfd" + bytes([(3 << 6) | (1 << 5)]) + struct.pack("<Q", content_size)
    for i, (kind, size, body) in enumerate(blocks):
        out += (int(i == len(blocks) - 1) | (kind << 1) | (size << 3)).to_bytes(3, "little") + body
    return out


def test_staged_decompression_bomb_is_refused_before_allocating(tmp_path, staged, monkeypatch):
    """A few stored bytes whose frame and manifest both claim 2**40 bytes: the frame's
    blocks cannot make that many, so nothing is allocated."""
    huge = 2**40

    def edit(h, m):
        _buf(m, "model/b", "data")["shape"] = [huge // 2]
        _buf(m, "model/b", "data")["stage"]["raw_nbytes"] = huge
        m["entries"]["model/b"]["shape"] = [huge // 2]

    bomb = _hand_frame(huge, [(1, 128 << 10, b"\0")] * 4)
    path = tmp_path / "bomb.safetensors"
    put(path, relayout(staged[1], "model/b", "data", bomb, edit))
    fmt.read_manifest(path)
    with _bounded_allocations(monkeypatch, len(staged[1])):
        with pytest.raises(CheckpointError, match="decode to 1099511627\\d+ bytes, more than 32 times"):
            fmt.read_file(path)
        # Beneath the bound on the whole file, the frame's own blocks refuse it too.
        with pytest.raises(
            CheckpointError, match="hold at most 524288 bytes, fewer than the 1099511627776"
        ) as info:
            fmt.read_file(path, max_expansion=None)
        with pytest.raises(CheckpointError, match="hold at most 524288"):
            fmt.verify_file(path, max_expansion=None)
    assert "entry 'model/b' buffer 'data'" in str(info.value)


@pytest.mark.parametrize(
    "stored, match",
    [
        (b"", "magic"),
        (b"not a zstd frame at all", "magic"),
        (zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 12), "content size"),
        (zstandard.ZstdCompressor().compress(b"\0" * 12) + b"\0", "trailing bytes"),
        (zstandard.ZstdCompressor().compress(b"\0" * 11), "holds 11 bytes"),
        # Frame, shape and raw size all say 12 bytes; the blocks make 2 (an RLE block of 2).
        (_hand_frame(12, [(1, 2, b"\0")]), "hold at most 2 bytes"),
    ],
)
def test_staged_crafted_stored_bytes(tmp_path, staged, monkeypatch, stored, match):
    """model/b is 6 bf16 values (12 bytes); crafted stored bytes with a valid CRC."""
    path = tmp_path / "crafted.safetensors"
    put(path, relayout(staged[1], "model/b", "data", stored))
    with _bounded_allocations(monkeypatch, len(staged[1])):
        with pytest.raises(CheckpointError, match=match) as info:
            fmt.read_file(path)
    assert "entry 'model/b' buffer 'data'" in str(info.value) and str(path) in str(info.value)
    with pytest.raises(CheckpointError, match=match):
        fmt.verify_file(path)


def test_staged_frame_that_is_a_valid_frame_of_other_bytes_is_caught_by_zstd_checksum(tmp_path, staged):
    """Without the CRC (verify=False), a well-formed frame of 12 wrong bytes with a wrong
    content checksum is still refused."""
    good = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(b"\1" * 12))
    good[-1] ^= 1
    path = tmp_path / "x.safetensors"
    put(path, relayout(staged[1], "model/b", "data", bytes(good)))
    with pytest.raises(CheckpointError, match="entry 'model/b' buffer 'data': checksum mismatch"):
        fmt.read_file(path, verify=False)


@pytest.mark.parametrize(
    "stage, match",
    [
        ({"name": "lz4", "params": {}, "raw_nbytes": 80}, "unknown entropy stage 'lz4'"),
        ({"name": "", "params": {}, "raw_nbytes": 80}, "unknown entropy stage ''"),
        ({"name": 7, "params": {}, "raw_nbytes": 80}, "unknown entropy stage 7"),
        ({"name": "zstd", "params": {}, "raw_nbytes": 80}, "stage params"),
        (
            {"name": "zstd-bytegroup", "params": {"level": 3, "width": 2}, "raw_nbytes": 80},
            "'width' must be the element size 1",
        ),
        ({"name": "zstd", "params": {"level": 3}, "raw_nbytes": 80, "x": 1}, "unexpected fields"),
        ({"name": "zstd", "params": {"level": 3}}, "missing field.*raw_nbytes"),
        ("zstd", "expected a JSON object"),
        (None, "expected a JSON object"),
    ],
)
def test_staged_bogus_stage_records(tmp_path, staged, stage, match):
    def edit(h, m):
        _buf(m, "model/w", "codes")["stage"] = stage

    err = expect_error(tmp_path, craft(staged[1], edit), match)
    assert "entry 'model/w' buffer 'codes'" in str(err)


def test_staged_tensor_table_must_say_u8_bytes(tmp_path, staged):
    for field, value in (("dtype", "F32"), ("shape", [80])):

        def edit(h, m, field=field, value=value):
            h["model/w:codes"][field] = value

        expect_error(tmp_path, craft(staged[1], edit), f"tensor table says {field}")


def test_a_stage_record_in_a_version_1_manifest_is_refused(tmp_path, staged):
    def edit(h, m):
        m["version"] = 1

    expect_error(tmp_path, craft(staged[1], edit), "needs format version 2, the file says 1")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_staged_fuzz_mutations_anywhere(tmp_path, staged, monkeypatch, data):
    state, blob = staged
    mutated = bytearray(blob)
    for pos, value in data.draw(
        st.lists(st.tuples(st.integers(0, len(blob) - 1), st.integers(0, 255)), min_size=1, max_size=8)
    ):
        mutated[pos] = value
    cut = data.draw(st.none() | st.integers(0, len(blob)))
    if cut is not None:
        mutated = mutated[:cut]
    _fuzz_once(tmp_path, state, bytes(mutated), monkeypatch)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_staged_fuzz_mutations_of_compressed_data_without_verify(tmp_path, staged, monkeypatch, data):
    """Byte edits inside staged buffers only, CRC skipped: the stage's checks must hold."""
    state, blob = staged
    header, manifest, payload = split(blob)
    start = len(blob) - len(payload)
    entry, name = data.draw(st.sampled_from(_staged_keys(blob)))
    b, e = _buf(manifest, entry, name)["data_offsets"]
    mutated = bytearray(blob)
    for pos, value in data.draw(
        st.lists(st.tuples(st.integers(b, e - 1), st.integers(0, 255)), min_size=1, max_size=4)
    ):
        mutated[start + pos] = value
    path = tmp_path / "fuzz.safetensors"
    put(path, bytes(mutated))
    with _bounded_allocations(monkeypatch, len(blob)):
        try:
            back = fmt.read_file(path, verify=False)
        except CheckpointError as exc:
            assert f"entry {entry!r} buffer {name!r}" in str(exc) and str(path) in str(exc)
            return
    assert_same_state(state, back)


# --------------------------------------------------------------------------------------
# Codec params (issue 28, item 5): every recorded param checked for its type and range on
# load, by the codec, naming the file, the entry, the param and what was expected
# --------------------------------------------------------------------------------------

_PARAM_RULES = [
    ("w", {"codec": "blockwise", "bits": 4, "block": 64, "min_numel": 0}),
    ("v", {"codec": "log2", "bits": 4, "block": 64, "min_numel": 0}),
    ("t", {"codec": "log2-temporal", "bits": 4, "block": 64, "min_numel": 0}),
    ("s", "bitmask"),
    ("u", {"codec": "blockwise-update", "bits": 3, "block": 64, "partner_key": "uv", "min_numel": 0}),
    ("uv", {"codec": "log2", "bits": 4, "block": 64, "min_numel": 0}),
    ("*", "exact"),
]


@pytest.fixture(scope="module")
def coded(tmp_path_factory) -> tuple[Path, Path, bytes]:
    """A delta file of the state API with a blockwise delta (with its reference
    fingerprint), a log2 entry, a bitmask entry and an exact one, its reference file, and its
    bytes."""
    g = torch.Generator().manual_seed(5)
    ref = {
        "w": torch.randn(64, 64, generator=g),
        "v": torch.rand(64, 64, generator=g),
        "t": torch.rand(32, 64, generator=g),
        "e": torch.arange(5),
    }
    state = {
        "w": ref["w"] + 0.01,
        "v": torch.rand(64, 64, generator=g),
        "t": ref["t"] * 1.01,
        "e": torch.arange(5),
    }
    state["s"] = torch.randn(63, 61, generator=g) * (torch.rand(63, 61, generator=g) < 0.3)
    state["u"], state["uv"] = torch.randn(32, 64, generator=g), torch.rand(32, 64, generator=g)
    d = tmp_path_factory.mktemp("coded")
    tw_triton.save(tw_triton.quantize_state_dict(ref, rules="exact"), d / "ref.safetensors", fsync=False)
    delta = d / "delta.safetensors"
    q = tw_triton.quantize_state_dict(state, rules=_PARAM_RULES, reference=str(d / "ref.safetensors"))
    tw_triton.save(q, delta, fsync=False)
    return delta, d / "ref.safetensors", delta.read_bytes()


PACKING_NAME = "lsb-first"
_BAD_PARAMS = [
    # entry, param, value (None: remove it), expected text in the message
    ("w", "delta", 1, "param 'delta' is 1, expected true or false"),
    ("w", "delta", "yes", "param 'delta' is 'yes', expected true or false"),
    ("w", "delta", None, "params lack \\['delta'\\]"),
    ("w", "bits", 3, "param 'bits' is 3, expected one of \\[8, 4, 2\\]"),
    ("w", "bits", 4.0, "param 'bits' is 4.0"),
    ("w", "bits", True, "param 'bits' is True"),
    ("w", "bits", "4", "param 'bits' is '4'"),
    ("w", "block", 48, "param 'block' is 48, expected a power of two from 32 to 4096"),
    ("w", "block", 8192, "param 'block' is 8192"),
    ("w", "block", 64.0, "param 'block' is 64.0"),
    ("w", "packing", "msb-first", "param 'packing' is 'msb-first', expected 'lsb-first'"),
    ("w", "packing", None, "params lack \\['packing'\\]"),
    ("w", "qmax", 8, "param 'qmax' is 8, expected an int from 1 to 7"),
    ("w", "qmax", 0, "param 'qmax' is 0"),
    ("w", "qmax", 3.0, "param 'qmax' is 3.0"),
    ("w", "ref_fp", 12, "param 'ref_fp' is 12, expected 16 lowercase hex digits"),
    ("w", "ref_fp", "XYZ", "param 'ref_fp' is 'XYZ'"),
    ("w", "scale", 2, "has no param\\(s\\) \\['scale'\\]"),
    ("v", "bits", 16, "param 'bits' is 16"),
    ("v", "block", 0, "param 'block' is 0"),
    ("v", "packing", 7, "param 'packing' is 7"),
    ("v", "delta", True, "codec 'log2' has no param\\(s\\) \\['delta'\\]"),
    ("t", "min_step", 0, "param 'min_step' is 0, expected an int from 1 to 536870912"),
    ("t", "min_step", 2**30, "param 'min_step' is 1073741824"),
    ("t", "min_step", 1.5, "param 'min_step' is 1.5"),
    ("t", "min_step", None, "params lack \\['min_step'\\]"),
    ("t", "bits", 3, "param 'bits' is 3, expected one of \\[8, 4, 2\\]"),
    ("t", "block", 48, "param 'block' is 48"),
    ("t", "delta", "yes", "param 'delta' is 'yes', expected true or false"),
    ("t", "packing", PACKING_NAME, "codec 'log2-temporal' has no param\\(s\\) \\['packing'\\]"),
    ("e", "delta", True, "codec 'exact' has no param\\(s\\) \\['delta'\\]"),
    ("s", "packing", "msb-first", "param 'packing' is 'msb-first', expected 'lsb-first'"),
    ("s", "packing", None, "codec 'bitmask' params lack \\['packing'\\]"),
    ("s", "delta", True, "codec 'bitmask' has no param\\(s\\) \\['delta'\\]"),
    ("e", "bits", 8, "codec 'exact' has no param\\(s\\) \\['bits'\\]"),
    ("u", "eps", 0.0, "param 'eps' is 0.0, expected a positive finite number"),
    ("u", "eps", "1e-8", "param 'eps' is '1e-8'"),
    ("u", "eps", None, "params lack \\['eps'\\]"),
    ("u", "partner", 5, "param 'partner' is 5, expected the path of an entry of the file"),
    ("u", "partner", "", "param 'partner' is ''"),
    ("u", "partner", None, "params lack \\['partner'\\]"),
    ("u", "partner", "nope", "coded with partner 'nope', expected a float32 entry of shape \\(32, 64\\)"),
    ("u", "partner", "w", "found torch.float32 of shape \\(64, 64\\)"),
    ("u", "partner", "e", "found torch.int64"),
    ("u", "partner", "u", "found an entry coded with a partner itself"),
    ("u", "bits", 3, "param 'bits' is 3, expected one of \\[8, 4, 2\\]"),
    ("u", "qmax", 9, "param 'qmax' is 9"),
    ("u", "delta", False, "codec 'blockwise-update' has no param\\(s\\) \\['delta'\\]"),
]


@pytest.mark.parametrize(
    "entry, param, value, match", _BAD_PARAMS, ids=[f"{e}-{p}-{v!r}" for e, p, v, _ in _BAD_PARAMS]
)
def test_codec_params_are_checked_on_load(tmp_path, coded, entry, param, value, match):
    delta, ref, blob = coded

    def edit(h, m):
        params = m["entries"][entry]["params"]
        if value is None:
            del params[param]
        else:
            params[param] = value

    path = tmp_path / "params.safetensors"
    put(path, craft(blob, edit))
    with pytest.raises(CheckpointError, match=match) as info:
        tw_triton.load(path, reference=str(ref))
    assert str(path) in str(info.value) and f"entry {entry!r}" in str(info.value)
    # What choosing a checkpoint checks (the header alone) refuses it the same way.
    with pytest.raises(CheckpointError, match=match):
        tw_triton.state.check_manifest(fmt.read_manifest(path), str(path))


def test_a_delta_flag_edited_to_false_is_caught_by_the_reference_checks(tmp_path, coded):
    """``"delta": false`` is a valid value; a delta decoded without its reference would be
    garbage, but its fingerprint says it is a delta: refused, naming the param."""
    delta, ref, blob = coded

    def edit(h, m):
        m["entries"]["w"]["params"]["delta"] = False

    path = tmp_path / "nodelta.safetensors"
    put(path, craft(blob, edit))
    with pytest.raises(
        CheckpointError, match="param 'ref_fp'.*expected none on an entry that is not a delta"
    ):
        tw_triton.load(path, reference=str(ref))
    assert tw_triton.load(delta, reference=str(ref))["w"].shape == (64, 64)


def _mask_edited(blob: bytes, change) -> bytes:
    """``blob`` with the bitmask entry's mask bytes changed by ``change`` (its CRC fixed)."""
    header, manifest, data = split(blob)
    b, e = header[fmt.tensor_key("s", "mask")]["data_offsets"]
    mask = bytearray(data[b:e])
    change(mask)
    return relayout(blob, "s", "mask", bytes(mask))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda m: m.__setitem__(0, m[0] ^ 0xFF), "mask has \\d+ set bits, expected \\d+"),
        (lambda m: m.__setitem__(len(m) - 1, m[-1] | 0x80), "padding bits set"),
    ],
    ids=["popcount", "padding"],
)
def test_a_bitmask_whose_mask_does_not_fit_its_values(tmp_path, coded, change, match):
    """A mask with more or fewer set bits than stored values (or a set padding bit), its
    checksum made right: refused before decoding, naming the file and the entry."""
    delta, ref, blob = coded
    assert fmt.read_manifest(delta)["entries"]["s"]["codec"] == "bitmask"
    path = tmp_path / "mask.safetensors"
    put(path, _mask_edited(blob, change))
    with pytest.raises(CheckpointError, match=match) as info:
        tw_triton.load(path, reference=str(ref))
    assert str(path) in str(info.value) and "entry 's'" in str(info.value)
    assert tw_triton.load(delta, reference=str(ref))["s"].shape == (63, 61)


_BAD_TEMPORAL = [
    # buffer, byte offset, new bytes, expected text: stored data that no encoder writes,
    # with a valid CRC, so the codec's own checks must refuse it
    # (t is 2048 elements in 32 blocks: lo at bytes 0-127, hi at 128-255, then the codes)
    ("lo", 0, struct.pack("<i", 7), "block 0 has bounds lo=7, hi=0"),
    ("hi", 128 + 4, struct.pack("<i", -1), "block 1 has bounds lo=0, hi=-1"),
    ("lo", 8, struct.pack("<i", 0x7F800000), "block 2 has bounds"),
    ("codes", 256, bytes([0x80]), None),  # the zero code over a positive value: valid, loads
]


@pytest.mark.parametrize("buffer, offset, raw, match", _BAD_TEMPORAL)
def test_corrupt_temporal_codes_raise_checkpoint_error(tmp_path, coded, buffer, offset, raw, match):
    delta, ref, blob = coded
    header, manifest, data = split(blob)
    buf = _buf(manifest, "t", "codes")
    assert "stage" not in buf  # small enough to be stored raw
    b, _ = buf["data_offsets"]
    data = data[: b + offset] + raw + data[b + offset + len(raw) :]
    e = buf["data_offsets"][1]
    buf["crc32"] = f"{zlib.crc32(data[b:e]):08x}"
    path = tmp_path / "temporal.safetensors"
    put(path, assemble(header, manifest, data))
    if match is None:
        assert float(tw_triton.load(path, reference=str(ref))["t"][0, 0]) == 0.0
        return
    with pytest.raises(CheckpointError, match=f"corrupt log2-temporal codes: {match}") as info:
        tw_triton.load(path, reference=str(ref))
    assert str(path) in str(info.value) and "entry 't'" in str(info.value)


@pytest.mark.parametrize("level", [23, -(2**17) - 1, 3.0, "3", None])
def test_stage_level_is_checked_for_zstd_range(tmp_path, staged, level):
    def edit(h, m):
        _buf(m, "model/w", "codes")["stage"]["params"]["level"] = level

    expect_error(tmp_path, craft(staged[1], edit), "stage param 'level' must be an int from -131072 to 22")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_codec_params_raise_only_checkpoint_error(tmp_path, coded, data):
    """Any JSON in place of any param (or as the whole params) of any entry: a load
    returns or raises CheckpointError, never another exception."""
    delta, ref, blob = coded
    entry = data.draw(st.sampled_from(["w", "v", "t", "e", "s", "u", "uv"]))
    key = data.draw(
        st.sampled_from(
            [None, "bits", "block", "packing", "delta", "qmax", "ref_fp", "min_step", "eps", "partner", "x"]
        )
    )
    value = data.draw(_JSON_VALUES)

    def edit(h, m):
        if key is None:
            m["entries"][entry]["params"] = value
        else:
            m["entries"][entry]["params"][key] = value

    path = tmp_path / "fuzzparams.safetensors"
    put(path, craft(blob, edit))
    try:
        tw_triton.load(path, reference=str(ref))
    except CheckpointError as e:
        assert str(path) in str(e)
