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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tw_triton
from _format_samples import assert_same_state, blockwise_entry, exact_entry
from tw_triton import format as fmt
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
    manifest = json.loads(header["__metadata__"][fmt.MANIFEST_KEY])
    return header, manifest, blob[8 + n :]


def assemble(header: dict, manifest: dict | str | None, data: bytes, *, fix_crc: bool = True) -> bytes:
    """Re-encode a header (with a valid manifest checksum unless told not to)."""
    header = json.loads(json.dumps(header))
    if manifest is not None:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        header["__metadata__"][fmt.MANIFEST_KEY] = text
        if fix_crc:
            header["__metadata__"][fmt.MANIFEST_CRC_KEY] = f"{zlib.crc32(text.encode()):08x}"
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
    [(3, "unknown format version 3.*reads versions 1, 2.*newer"), (2**70, "version 1180591620717411303424.*newer"), (0, "unknown format version 0"), ("1", "version '1'"), (True, "version True"), (None, "version None")],
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
    | st.sampled_from(["", "F32", "U8", "BOOL", "float32", "exact", "blockwise", "model/w", "model/w:codes"])
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
    state, blob = good
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
            assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == payload[begin:end]
