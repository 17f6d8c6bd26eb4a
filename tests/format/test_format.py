"""The checkpoint file: round trips, safetensors compatibility, layout, atomic writes."""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import struct

import pytest
import safetensors
import safetensors.torch
import torch
from _format_samples import (
    STAGE_EVERYTHING,
    assert_same_state,
    blockwise_entry,
    exact_entry,
    sample_state,
    unstage,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tw_triton
from tw_triton import format as fmt
from tw_triton.codecs import entropy
from tw_triton.codecs.blockwise import QuantizedTensor, dequantize
from tw_triton.errors import CheckpointError, CheckpointIOError
from tw_triton.format import writer
from tw_triton.format.plan import plan_file
from tw_triton.format.reader import MappedCheckpoint
from tw_triton.format.spec import ENTRY_DTYPE_NAMES
from tw_triton.qstate import EncodedEntry, QuantizedState


def header_of(path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


# --------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------


def test_round_trip_is_exact(tmp_path):
    state = sample_state(1)
    path = tmp_path / "ckpt.safetensors"
    written = fmt.write_file(state, path)
    assert written == path.stat().st_size
    back = fmt.read_file(path)
    assert_same_state(state, back)
    assert back.nbytes == state.nbytes


def test_round_trip_decodes_like_the_original(tmp_path):
    x = torch.randn(300, 70)
    ref = x + 0.05 * torch.randn_like(x)
    entry = blockwise_entry(x, bits=4, block=64, reference=ref)
    state = QuantizedState(entries={"w": entry}, skeleton=None, checkpoint_id="c")
    fmt.write_file(state, tmp_path / "a")
    got = fmt.read_file(tmp_path / "a").entries["w"]

    def decode(e: EncodedEntry) -> torch.Tensor:
        q = QuantizedTensor(
            codes=e.buffers["codes"],
            scales=e.buffers["scales"],
            shape=e.shape,
            dtype=e.dtype,
            bits=e.params["bits"],
            block=e.params["block"],
            nonfinite=torch.tensor(False),
        )
        return dequantize(q, reference=ref)

    assert torch.equal(decode(got), decode(entry))
    assert (decode(got) - x).abs().max() < 0.05


def test_buffers_are_independent_writable_cpu_tensors(tmp_path):
    fmt.write_file(sample_state(2), tmp_path / "a")
    back = fmt.read_file(tmp_path / "a")
    w = back.entries["optimizer/state/0/exp_avg"].buffers["data"]
    b = back.entries["model/encoder.0.bias"].buffers["data"]
    before = b.clone()
    w.add_(1.0)
    assert torch.equal(b, before)
    assert w.is_contiguous() and w.device.type == "cpu"


def test_noncontiguous_and_grad_buffers_are_written_in_logical_order(tmp_path):
    base = torch.randn(6, 5, requires_grad=True)
    state = QuantizedState(
        entries={
            "t": exact_entry(base.t()),
            "s": exact_entry(torch.arange(20.0)[::3]),
            "g": exact_entry(base),
        },
        skeleton=None,
        checkpoint_id="c",
    )
    fmt.write_file(state, tmp_path / "a")
    back = fmt.read_file(tmp_path / "a")
    assert torch.equal(back.entries["t"].buffers["data"], base.detach().t())
    assert torch.equal(back.entries["s"].buffers["data"], torch.arange(20.0)[::3])
    assert torch.equal(back.entries["g"].buffers["data"], base.detach())


_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
]


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    # Random bytes reinterpreted: every bit pattern (NaNs, -0.0, subnormals) must survive.
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw > 127).view(shape)
    return raw.view(dtype).view(shape)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    specs=st.lists(
        st.tuples(
            st.text(min_size=0, max_size=12),  # entry path: any text, colons and unicode included
            st.sampled_from(_DTYPES),
            st.lists(st.integers(0, 5), min_size=0, max_size=3),
            st.integers(0, 2**31),
        ),
        max_size=6,
        unique_by=lambda s: s[0],
    ),
    checkpoint_id=st.text(max_size=20),
    reference_id=st.none() | st.text(max_size=20),
    skeleton=st.recursive(
        st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=5),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
        max_leaves=10,
    ),
)
def test_round_trip_property(tmp_path, specs, checkpoint_id, reference_id, skeleton):
    entries = {
        path: EncodedEntry(
            codec="exact",
            params={"i": i},
            shape=tuple(shape),
            dtype=dtype,
            buffers={"data": _random_tensor(dtype, tuple(shape), seed), "x.y-z_0": torch.tensor([i])},
        )
        for i, (path, dtype, shape, seed) in enumerate(specs)
    }
    state = QuantizedState(
        entries=entries,
        skeleton=skeleton,
        checkpoint_id=checkpoint_id,
        reference_id=reference_id,
        metadata={"n": len(entries)},
    )
    path = tmp_path / "p.safetensors"
    size = fmt.write_file(state, path, fsync=False)
    back = fmt.read_file(path)
    assert_same_state(state, back)
    n, _ = header_of(path)
    assert size == 8 + n + state.nbytes
    # Stock safetensors reads every file too, whatever the dtypes, shapes and key text.
    theirs = safetensors.torch.load_file(str(path))
    ours = {fmt.tensor_key(p, name): t for p, e in back.entries.items() for name, t in e.buffers.items()}
    assert theirs.keys() == ours.keys()
    for key, t in ours.items():
        assert theirs[key].dtype == t.dtype and theirs[key].shape == t.shape
        assert torch.equal(theirs[key].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


# --------------------------------------------------------------------------------------
# Stock safetensors reads what we write
# --------------------------------------------------------------------------------------


def _unstage(manifest: dict, key: str, stored: torch.Tensor) -> torch.Tensor:
    """What a stock reader sees under ``key``, decoded by the stage the manifest names
    (the tensor as it is for a raw buffer)."""
    entry, name = key.rsplit(":", 1)
    buf = manifest["entries"][entry]["buffers"][name]
    if "stage" not in buf:
        return stored
    assert stored.dtype == torch.uint8 and stored.dim() == 1
    raw = unstage(buf, stored.numpy().tobytes())
    return torch.frombuffer(bytearray(raw), dtype=fmt.BUFFER_DTYPES[buf["dtype"]]).reshape(buf["shape"])


@pytest.mark.parametrize("entropy", ["auto", None])
def test_safe_open_lists_every_buffer_and_reads_the_same_bytes(tmp_path, entropy):
    state = sample_state(3, scale=8)
    path = tmp_path / "ckpt.safetensors"
    fmt.write_file(state, path, entropy=entropy)
    expected = {fmt.tensor_key(p, name): t for p, e in state.entries.items() for name, t in e.buffers.items()}
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(expected)
        manifest = json.loads(fmt.manifest_text(f.metadata(), str(path))[0])
        for key, t in expected.items():
            got = _unstage(manifest, key, f.get_tensor(key))
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    assert manifest == fmt.read_manifest(path)
    assert manifest["format"] == fmt.FORMAT_NAME and manifest["version"] == fmt.FORMAT_VERSION
    staged = [b for e in manifest["entries"].values() for b in e["buffers"].values() if "stage" in b]
    assert bool(staged) == (entropy == "auto")


@pytest.mark.parametrize("entropy", ["auto", None])
def test_safetensors_load_file_matches_read_file(tmp_path, entropy):
    path = tmp_path / "ckpt.safetensors"
    fmt.write_file(sample_state(4, scale=8), path, entropy=entropy)
    loaded = safetensors.torch.load_file(str(path))
    manifest = fmt.read_manifest(path)
    back = fmt.read_file(path)
    ours = {fmt.tensor_key(p, n): t for p, e in back.entries.items() for n, t in e.buffers.items()}
    assert loaded.keys() == ours.keys()
    for key, t in ours.items():
        got = _unstage(manifest, key, loaded[key])
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def _mapped_rss_kib(path) -> int:
    """Resident KiB of this process's mappings of ``path`` (from /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = len(fields) >= 6 and fields[-1] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps")
def test_read_file_lets_go_of_a_buffers_pages_once_decoded(tmp_path):
    """A staged buffer is decoded from the memory map; its pages then leave the process,
    so a load does not hold the file resident next to the state."""
    path = tmp_path / "big.tw"
    t = torch.randn(4 << 20, generator=torch.Generator().manual_seed(0))  # 16 MiB; the stage saves ~1/8
    state = QuantizedState(entries={"x": exact_entry(t)}, skeleton={"x": "x"}, checkpoint_id="c")
    fmt.write_file(state, path)
    assert "stage" in fmt.read_manifest(path)["entries"]["x"]["buffers"]["data"]
    assert path.stat().st_size > 8 << 20
    with MappedCheckpoint(str(path), verify=True, pin=False, entries=None) as ck:
        (spec,) = ck.layout.buffers
        got = ck.read_buffer(spec)
        assert _mapped_rss_kib(path) < 256  # of a 14 MiB map: a page or two at the ends
        mapped = ck.file_map
    assert torch.equal(got, t)
    got.add_(1)  # a tensor of its own, writable: not the read-only map
    assert mapped.closed and ck.file.closed


def test_read_file_reads_staged_buffers_where_files_cannot_be_mapped(tmp_path, monkeypatch):
    """A file system without mmap: the staged buffers are read instead, to the same bytes,
    and a corrupted one is still caught, naming its entry."""
    path = tmp_path / "ckpt.tw"
    fmt.write_file(sample_state(6, scale=8), path, entropy=STAGE_EVERYTHING)
    mapped = fmt.read_file(path)

    def no_mmap(*args, **kwargs):
        raise OSError(19, "No such device")

    monkeypatch.setattr(mmap, "mmap", no_mmap)
    assert_same_state(fmt.read_file(path), mapped)
    manifest = fmt.read_manifest(path)
    entry, name, buf = next(
        (p, k, b) for p, e in manifest["entries"].items() for k, b in e["buffers"].items() if "stage" in b
    )
    blob = bytearray(path.read_bytes())
    n = struct.unpack("<Q", blob[:8])[0]
    blob[8 + n + buf["data_offsets"][1] - 7] ^= 0x40  # in the last block, or the content checksum
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=f"entry '{entry}' buffer '{name}'"):
        fmt.read_file(path)


def test_a_plain_safetensors_file_is_rejected_by_name(tmp_path):
    path = tmp_path / "plain.safetensors"
    safetensors.torch.save_file({"w": torch.ones(3)}, str(path))
    with pytest.raises(CheckpointError, match="not a tw_triton checkpoint") as info:
        fmt.read_file(path)
    assert str(path) in str(info.value)


# --------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------


def test_file_size_is_buffers_plus_header(tmp_path):
    state = sample_state(5, scale=4)
    path = tmp_path / "ckpt.safetensors"
    size = fmt.write_file(state, path, entropy=None)
    n, header = header_of(path)
    buffer_bytes = sum(
        t.numel() * t.element_size() for e in state.entries.values() for t in e.buffers.values()
    )
    assert size == path.stat().st_size == buffer_bytes + 8 + n
    assert (8 + n) % 8 == 0
    manifest = json.loads(fmt.manifest_text(header["__metadata__"], "x")[0])
    assert manifest["stats"]["stored_bytes"] == buffer_bytes
    assert manifest["stats"]["raw_bytes"] == sum(e.raw_nbytes for e in state.entries.values())


def test_staged_file_size_is_stored_bytes_plus_header(tmp_path):
    state = sample_state(5, scale=16)
    path = tmp_path / "ckpt.safetensors"
    size = fmt.write_file(state, path)
    n, header = header_of(path)
    manifest = json.loads(fmt.manifest_text(header.pop("__metadata__"), "x")[0])
    stored = sum(info["data_offsets"][1] - info["data_offsets"][0] for info in header.values())
    raw = sum(t.numel() * t.element_size() for e in state.entries.values() for t in e.buffers.values())
    assert size == path.stat().st_size == stored + 8 + n
    assert manifest["stats"]["stored_bytes"] == stored < raw
    for entry in manifest["entries"].values():
        for buf in entry["buffers"].values():
            if "stage" in buf:
                span = buf["data_offsets"][1] - buf["data_offsets"][0]
                assert header[buf["key"]] == {
                    "dtype": "U8",
                    "shape": [span],
                    "data_offsets": buf["data_offsets"],
                }
                assert buf["stage"]["raw_nbytes"] * (1 - entropy.MIN_SAVING) >= span


def test_every_buffer_is_aligned_to_its_element_size(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    fmt.write_file(sample_state(6), path)
    n, header = header_of(path)
    header.pop("__metadata__")
    itemsize = {name: dt.itemsize for name, dt in fmt.BUFFER_DTYPES.items()}
    for key, info in header.items():
        assert (8 + n + info["data_offsets"][0]) % itemsize[info["dtype"]] == 0, key


def test_manifest_records_codec_params_and_sizes(tmp_path):
    state = sample_state(7)
    path = tmp_path / "ckpt.safetensors"
    fmt.write_file(state, path)
    m = fmt.read_manifest(path)
    assert m["checkpoint_id"] == "ckpt-0007" and m["reference_id"] == "keyframe-0000"
    e = m["entries"]["model/embed.weight"]
    assert e["codec"] == "blockwise"
    assert e["params"] == {"bits": 4, "block": 64, "packing": "lsb-first", "delta": False}
    assert e["dtype"] == "bfloat16" and e["shape"] == [100, 16]
    assert e["buffers"]["codes"]["key"] == "model/embed.weight:codes"
    assert e["buffers"]["codes"]["dtype"] == "U8" and e["buffers"]["scales"]["dtype"] == "F32"
    assert m["aliases"] == {"model/lm_head.weight": "model/embed.weight"}
    assert m["rules"] == state.rules and m["metadata"] == state.metadata
    assert m["stats"]["entries"] == len(state.entries)


def test_read_manifest_does_not_read_the_data(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    fmt.write_file(sample_state(8), path)
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF  # data corruption: only a data read can see it
    path.write_bytes(bytes(blob))
    assert fmt.read_manifest(path)["checkpoint_id"] == "ckpt-0008"
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        fmt.read_file(path)


def test_verify_false_skips_only_the_data_checksums(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    state = sample_state(9)
    fmt.write_file(state, path)
    n, header = header_of(path)
    info = header["model/encoder.0.bias:data"]
    pos = 8 + n + info["data_offsets"][0]
    blob = bytearray(path.read_bytes())
    blob[pos] ^= 0x01
    path.write_bytes(bytes(blob))
    back = fmt.read_file(path, verify=False)
    assert not torch.equal(
        back.entries["model/encoder.0.bias"].buffers["data"],
        state.entries["model/encoder.0.bias"].buffers["data"],
    )
    for reader in (fmt.read_file, fmt.verify_file):
        with pytest.raises(CheckpointError) as err:
            reader(path)
        msg = str(err.value)
        assert str(path) in msg and "'model/encoder.0.bias'" in msg and "'data'" in msg


@pytest.mark.parametrize("policy", [None, STAGE_EVERYTHING], ids=["raw", "staged"])
def test_check_others_checks_the_buffers_of_entries_not_read(tmp_path, policy):
    path = tmp_path / "ckpt.safetensors"
    state = sample_state(9)
    fmt.write_file(state, path, entropy=policy)
    n, header = header_of(path)
    other = "model/encoder.0.bias"
    wanted = [p for p in state.entries if p != other][:1]
    blob = bytearray(path.read_bytes())
    blob[8 + n + header[f"{other}:data"]["data_offsets"][0]] ^= 0x01
    path.write_bytes(bytes(blob))
    # Without check_others, a corrupt entry that is not read goes unnoticed.
    back = fmt.read_file(path, entries=wanted)
    assert list(back.entries) == wanted
    with pytest.raises(CheckpointError, match=rf"{other}.*checksum mismatch"):
        fmt.read_file(path, entries=wanted, check_others=True)
    # check_others goes with verify: a read that checks no checksum checks none of them.
    assert list(fmt.read_file(path, entries=wanted, verify=False, check_others=True).entries) == wanted


@pytest.mark.parametrize("policy", [None, STAGE_EVERYTHING], ids=["raw", "staged"])
def test_read_into_given_tensors_where_they_fit(tmp_path, policy):
    path = tmp_path / "ckpt.safetensors"
    state = sample_state(11)
    fmt.write_file(state, path, entropy=policy)
    quantized = next(p for p, e in state.entries.items() if e.codec != "exact")
    fits, two_d, wrong_dtype, strided = (
        "rng/torch",
        "optimizer/state/0/exp_avg",
        "model/positions",
        "model/encoder.0.bias",
    )
    assert state.entries[two_d].codec == "exact" and len(state.entries[two_d].shape) == 2
    dest = {
        fits: torch.empty(tuple(state.entries[fits].shape), dtype=state.entries[fits].dtype),
        # The same size in another shape: a model changed since the save is not overwritten.
        two_d: torch.full(
            (state.entries[two_d].buffers["data"].numel(),), 7.0, dtype=state.entries[two_d].dtype
        ),
        wrong_dtype: torch.full(
            (state.entries[wrong_dtype].buffers["data"].numel(),), 7.0, dtype=torch.float64
        ),
        strided: torch.full((state.entries[strided].buffers["data"].numel() * 2,), 7.0)[::2],
        quantized: torch.full((64,), 7.0),
    }
    before = {p: t.clone() for p, t in dest.items()}
    back = fmt.read_file(path, into=dest)
    assert_same_state(back, state)
    got = back.entries[fits].buffers["data"]
    assert got.data_ptr() == dest[fits].data_ptr() and got.shape == state.entries[fits].buffers["data"].shape
    for p in (two_d, wrong_dtype, strided, quantized):  # left alone; the entry got its own memory
        assert torch.equal(dest[p], before[p])
        assert all(b.data_ptr() != dest[p].data_ptr() for b in back.entries[p].buffers.values())


def _reference_header(plan) -> bytes:
    """The header as json.dumps of nested dicts writes it: the spec of writer.encode_header,
    which writes the same JSON text piece by piece."""
    q = plan.qstate
    dumps = lambda v: json.dumps(v, separators=(",", ":"), ensure_ascii=True)  # noqa: E731
    entries = {}
    for entry_path, entry in q.entries.items():
        bufs = {}
        for name, b in plan.by_entry[entry_path].items():
            bufs[name] = {
                "key": b.key,
                "dtype": b.st_dtype,
                "shape": list(b.tensor.shape),
                "data_offsets": [b.begin, b.end],
                "crc32": f"{b.crc32:08x}",
            }
            if b.stage is not None:
                bufs[name]["stage"] = b.stage
        entries[entry_path] = {
            "codec": entry.codec,
            "params": entry.params,
            "dtype": ENTRY_DTYPE_NAMES[entry.dtype],
            "shape": list(entry.shape),
            "buffers": bufs,
        }
    manifest = dumps(
        {
            "format": fmt.FORMAT_NAME,
            "version": fmt.FORMAT_VERSION,
            "checkpoint_id": q.checkpoint_id,
            "reference_id": q.reference_id,
            "checksum": fmt.CHECKSUM_NAME,
            "entries": entries,
            "aliases": dict(q.aliases),
            "skeleton": q.skeleton,
            "rules": q.rules,
            "metadata": q.metadata,
            "stats": {
                "raw_bytes": sum(e.raw_nbytes for e in q.entries.values()),
                "stored_bytes": plan.data_size,
                "entries": len(q.entries),
                "buffers": len(plan.buffers),
            },
        }
    )
    header = {"__metadata__": fmt.manifest_metadata(manifest)}
    for b in plan.buffers:
        header[b.key] = {"dtype": b.table_dtype, "shape": b.table_shape, "data_offsets": [b.begin, b.end]}
    raw = dumps(header).encode("ascii")
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", [None, "auto", STAGE_EVERYTHING], ids=["raw", "auto", "staged"])
def test_header_text_is_json_dumps_of_the_header(seed, policy):
    state = sample_state(seed)
    # Keys and values that JSON must escape, an alias, metadata of every JSON kind.
    state.entries['mödel/w\u2603 "q"'] = exact_entry(torch.arange(6.0).reshape(2, 3))
    state.entries['mödel/w\u2603 "q"'].params = {"note": "é\n", "n": [1, 2.5, None, True]}
    state.aliases = {"alias/é": 'mödel/w\u2603 "q"'}
    state.metadata = {"k": [1.5, None, False, {"x": "ü"}]}
    plan = plan_file(state, "x", entropy.resolve_policy(policy))
    assert writer.encode_header(plan, "x") == _reference_header(plan)


def test_header_writes_params_that_compare_equal_as_they_are():
    """The header writes each distinct params dict once (manifest.params_json): params that are
    equal in Python but not in JSON must each keep their own text."""
    state = sample_state(0)
    variants = [
        {"b": 1},
        {"b": True},
        {"b": 1.0},
        {"b": -0.0},
        {"b": 0.0},
        {"b": 0},
        {"b": (1,)},
        {"b": (True,)},
        {"b": [1]},
        {"b": None},
        {"b": "1"},
        {},
        {"a": 1, "b": 2},
        {"b": 2, "a": 1},  # equal dicts, keys in another order
    ]
    for i, params in enumerate(variants):
        state.entries[f"p{i}"] = exact_entry(torch.arange(3.0))
        state.entries[f"p{i}"].params = params
    plan = plan_file(state, "x", None)
    header = writer.encode_header(plan, "x")
    assert header == _reference_header(plan)
    manifest = json.loads(fmt.manifest_text(json.loads(header[8:])["__metadata__"], "x")[0])
    written = [json.dumps(manifest["entries"][f"p{i}"]["params"]) for i in range(len(variants))]
    assert written == [json.dumps(p) for p in variants]


def test_verify_file_passes_on_a_good_file(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    fmt.write_file(sample_state(10), path)
    assert fmt.verify_file(path) is None


def test_empty_state(tmp_path):
    state = QuantizedState(entries={}, skeleton={}, checkpoint_id="empty")
    path = tmp_path / "e"
    size = fmt.write_file(state, path)
    n, _ = header_of(path)
    assert size == 8 + n
    assert_same_state(state, fmt.read_file(path))
    fmt.verify_file(path)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert list(f.keys()) == []


def test_pin_memory(tmp_path, caplog):
    path = tmp_path / "ckpt.safetensors"
    state = sample_state(11)
    fmt.write_file(state, path)
    with caplog.at_level(logging.WARNING, logger="tw_triton.format"):
        back = fmt.read_file(path, pin_memory=True)
    assert_same_state(state, back)
    pinned = [t.is_pinned() for e in back.entries.values() for t in e.buffers.values() if t.numel()]
    if torch.cuda.is_available():
        assert all(pinned)
    else:
        assert not any(pinned)
        assert "not pinned" in caplog.text


@pytest.mark.cuda
def test_cuda_buffers_are_written(tmp_path):
    state = sample_state(12)
    on_gpu = QuantizedState(
        entries={
            p: EncodedEntry(e.codec, e.params, e.shape, e.dtype, {n: t.cuda() for n, t in e.buffers.items()})
            for p, e in state.entries.items()
        },
        skeleton=state.skeleton,
        checkpoint_id=state.checkpoint_id,
        reference_id=state.reference_id,
        aliases=state.aliases,
        rules=state.rules,
        metadata=state.metadata,
    )
    fmt.write_file(on_gpu, tmp_path / "g")
    assert_same_state(state, fmt.read_file(tmp_path / "g"))


# --------------------------------------------------------------------------------------
# What cannot be written
# --------------------------------------------------------------------------------------


def _cyclic() -> dict:
    d: dict = {"a": 1}
    d["self"] = [d]
    return d


def _one(entry: EncodedEntry, **kw) -> QuantizedState:
    return QuantizedState(entries={"e": entry}, skeleton=None, checkpoint_id="c", **kw)


@pytest.mark.parametrize(
    "state, match",
    [
        (_one(EncodedEntry("exact", {}, (2,), torch.float32, {"a:b": torch.ones(2)})), "buffer names"),
        (_one(EncodedEntry("exact", {}, (2,), torch.float32, {"": torch.ones(2)})), "buffer names"),
        (
            _one(
                EncodedEntry(
                    "exact", {}, (2,), torch.complex128, {"data": torch.ones(2, dtype=torch.complex128)}
                )
            ),
            "no safetensors name",
        ),
        (_one(EncodedEntry("exact", {}, (2,), torch.float32, {"data": [1.0, 2.0]})), "expected a tensor"),
        (_one(EncodedEntry("", {}, (2,), torch.float32, {"data": torch.ones(2)})), "codec"),
        (
            _one(EncodedEntry("exact", {"f": object()}, (2,), torch.float32, {"data": torch.ones(2)})),
            "entry 'e' params is not JSON",
        ),
        (
            _one(
                EncodedEntry("exact", {}, (2,), torch.float32, {"data": torch.ones(2)}),
                metadata={"x": {1, 2}},
            ),
            "metadata is not JSON",
        ),
        (
            _one(
                EncodedEntry("exact", {}, (2,), torch.float32, {"data": torch.ones(2)}),
                aliases={"x": "missing"},
            ),
            "not an entry",
        ),
        (
            _one(EncodedEntry("exact", {}, (2,), torch.float32, {"data": torch.ones(2)}), aliases={"e": "e"}),
            "also an entry",
        ),
        (_one(EncodedEntry("exact", {}, (-1,), torch.float32, {"data": torch.ones(2)})), "non-negative"),
        (_one(EncodedEntry("exact", {}, (2**62, 2), torch.float32, {"data": torch.ones(2)})), "2\\*\\*63"),
        (
            _one(
                EncodedEntry("exact", {}, (2,), torch.float32, {"data": torch.ones(2)}),
                metadata={"a": [{1: "x", "1": "y"}]},
            ),
            "metadata: dict key 1 is a int",
        ),
        (
            _one(EncodedEntry("exact", {3: 1}, (2,), torch.float32, {"data": torch.ones(2)})),
            "entry 'e' params: dict key 3",
        ),
        (
            _one(EncodedEntry("exact", {}, (2,), torch.float32, {"data": torch.ones(2)}), metadata=_cyclic()),
            "metadata is not JSON",
        ),
        (
            QuantizedState(
                entries={"bad\udc80": exact_entry(torch.ones(1))}, skeleton=None, checkpoint_id="c"
            ),
            "not valid UTF-8",
        ),
        ("not a state", "expected a QuantizedState"),
        # What dequantize_state_dict(release_buffers=True) leaves: was written, then unloadable.
        (_one(EncodedEntry("exact", {}, (2,), torch.float32, {})), "entry 'e': holds no buffers"),
    ],
)
def test_unwritable_states_raise_before_touching_the_disk(tmp_path, state, match):
    path = tmp_path / "x.safetensors"
    with pytest.raises(CheckpointError, match=match) as info:
        fmt.write_file(state, path)
    assert str(path) in str(info.value)
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------------------
# Atomic write
# --------------------------------------------------------------------------------------


def test_temp_file_convention(tmp_path):
    final = tmp_path / "step_100.safetensors"
    tmp = fmt.temp_path_for(final)
    assert os.path.dirname(tmp) == str(tmp_path)
    assert os.path.basename(tmp).startswith(".step_100.safetensors.") and tmp.endswith(".tmp")
    assert fmt.is_temp_file(tmp) and fmt.is_temp_file(os.path.basename(tmp))
    assert tmp != fmt.temp_path_for(final)
    for name in (
        "step_100.safetensors",
        ".hidden",
        ".x.tmp",
        ".x.abc.tmp",
        "x.0123456789abcdef.tmp",
        ".x.0123456789ABCDEF.tmp",
    ):
        assert not fmt.is_temp_file(name), name


def test_write_uses_temp_fsync_replace_then_directory_fsync(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(
            ("fsync", os.path.isdir(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else None)
        )
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.basename(src), os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "ckpt.safetensors"
    fmt.write_file(sample_state(13), path)
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"]
    assert fmt.is_temp_file(events[1][1]) and events[1][2] == "ckpt.safetensors"
    if events[0][1] is not None:
        assert events[0][1] is False and events[2][1] is True  # the file, then the directory
    events.clear()
    fmt.write_file(sample_state(13), tmp_path / "nosync", fsync=False)
    assert [e[0] for e in events] == ["replace"]


def _assert_only(tmp_path, names):
    assert sorted(os.listdir(tmp_path)) == sorted(names)


@pytest.mark.parametrize("where", ["data", "fsync", "replace"])
def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch, where):
    path = tmp_path / "ckpt.safetensors"
    fmt.write_file(sample_state(14), path)
    old = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "data":

        def partial(f, plan, *args, **kwargs):
            f.write(b"\0" * 100)  # something reached the temp file before the failure
            fail()

        monkeypatch.setattr(writer, "write_buffers", partial)
    elif where == "fsync":
        monkeypatch.setattr(os, "fsync", fail)
    else:
        monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(CheckpointIOError) as info:
        fmt.write_file(sample_state(15), path)
    err = info.value
    assert isinstance(err, OSError) and isinstance(err, CheckpointError)
    assert err.errno == errno.ENOSPC and isinstance(err.__cause__, OSError)
    assert str(path) in str(err)
    assert path.read_bytes() == old
    _assert_only(tmp_path, ["ckpt.safetensors"])


def test_interrupted_write_removes_the_temp_and_propagates(tmp_path, monkeypatch):
    def interrupt(f, plan, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "write_buffers", interrupt)
    with pytest.raises(KeyboardInterrupt):
        fmt.write_file(sample_state(16), tmp_path / "ckpt")
    _assert_only(tmp_path, [])


def test_write_to_a_missing_directory_is_an_io_error(tmp_path):
    with pytest.raises(CheckpointIOError) as info:
        fmt.write_file(sample_state(17), tmp_path / "nope" / "ckpt")
    assert info.value.errno == errno.ENOENT


def test_overwrite_replaces_the_file(tmp_path):
    path = tmp_path / "ckpt"
    fmt.write_file(sample_state(18), path)
    fmt.write_file(sample_state(19), path)
    assert fmt.read_manifest(path)["checkpoint_id"] == "ckpt-0019"
    _assert_only(tmp_path, ["ckpt"])


def test_reading_a_missing_file_is_an_io_error(tmp_path):
    with pytest.raises(CheckpointIOError) as info:
        fmt.read_file(tmp_path / "missing")
    assert info.value.errno == errno.ENOENT and str(tmp_path / "missing") in str(info.value)
    with pytest.raises(CheckpointIOError):
        fmt.read_manifest(tmp_path / "missing")


def test_read_file_of_some_entries_reads_just_those(tmp_path):
    w = torch.randn(64, 64)
    state = {"model": {"a": w, "tied": w, "b": torch.randn(300)}, "extra": torch.arange(10)}
    tw_triton.save(tw_triton.quantize_state_dict(state, rules=[("model/a", "int4")]), tmp_path / "s.tw")
    full = fmt.read_file(tmp_path / "s.tw")
    part = fmt.read_file(tmp_path / "s.tw", entries=["model/tied", "extra"])  # an alias of model/a
    assert sorted(part.entries) == ["extra", "model/a"]
    assert part.aliases == {"model/tied": "model/a"}
    for path, entry in part.entries.items():
        for name, buf in entry.buffers.items():
            assert torch.equal(buf, full.entries[path].buffers[name]), (path, name)
    with pytest.raises(CheckpointError, match=r"s\.tw: has no entry 'model/zz'"):
        fmt.read_file(tmp_path / "s.tw", entries=["model/zz"])
