"""Issue 28: the decompression-bomb bound reaches every load of a Checkpointer, a delta's
keyframe and earlier links included, and can be raised for a state that stores a large
constant tensor on purpose; and one verification gives one answer: a file whose stored
bytes changed is refused alike by ``verify_file``, ``read_file``/``load``, ``latest()``
and ``restore()``, even where its zstd frame still decodes to checksum-valid content.
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tw_triton
import tw_triton.state.encode
from tw_triton import Checkpointer
from tw_triton import format as fmt
from tw_triton.checkpoint_dir import checkpoint_name
from tw_triton.errors import CheckpointError
from tw_triton.format import reader

ZEROS = 1 << 20  # elements of the constant tensor: 4 MiB that zstd stores in a few KiB


def _decoded_and_size(path: Path) -> tuple[int, int]:
    """What a file's staged buffers decode to, and its size (what the bound compares)."""
    manifest = fmt.read_manifest(path)
    decoded = sum(
        b["stage"]["raw_nbytes"]
        for e in manifest["entries"].values()
        for b in e["buffers"].values()
        if "stage" in b
    )
    return decoded, path.stat().st_size


def _state(step: int) -> dict[str, torch.Tensor]:
    """A model of the large zero tensor and a weight that drifts a little each step."""
    w = torch.randn(8192, generator=torch.Generator().manual_seed(0))
    drift = torch.randn(8192, generator=torch.Generator().manual_seed(1 + step))
    return {"zeros": torch.zeros(ZEROS), "w": w + 0.01 * step * drift}


@pytest.fixture
def run_with_zeros(tmp_path, monkeypatch) -> Path:
    """A closed-loop run of a keyframe (step 0) and two deltas whose model holds a large
    all-zero tensor, with the bound's slack lowered so that the keyframe, and only it, is
    over the default bound."""
    d = tmp_path / "run"
    # Stored exact, not by the sparse codec: the zstd frame of its zeros is what is large.
    monkeypatch.setattr(tw_triton.state.encode, "sparse_candidate", lambda x: False)
    with Checkpointer(d, keyframe_every=10, keep_last=None, async_write=False, fsync=False) as ck:
        for step in range(3):
            ck.save(step, model=_state(step))
    sizes = {step: _decoded_and_size(d / checkpoint_name(step)) for step in range(3)}
    # The slack that lets each delta through: the bound then holds back the keyframe only.
    slack = max(dec - fmt.MAX_EXPANSION * size for dec, size in (sizes[1], sizes[2]))
    monkeypatch.setattr(reader, "EXPANSION_SLACK_BYTES", max(0, int(slack) + 1))
    dec, size = sizes[0]
    assert dec > fmt.MAX_EXPANSION * size + reader.EXPANSION_SLACK_BYTES, (
        "the keyframe must be over the bound"
    )
    return d


def test_latest_and_restore_refuse_a_chain_over_the_bound_naming_max_expansion(run_with_zeros, caplog):
    ck = Checkpointer(run_with_zeros)
    with caplog.at_level(logging.WARNING):
        assert ck.latest() is None
    # Every step is passed over for its keyframe, each with a warning that names the bound.
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(skipped) == 3 and all("max_expansion" in m for m in skipped)
    assert any(checkpoint_name(2) in m and "its reference" in m and checkpoint_name(0) in m for m in skipped)
    model = {"zeros": torch.ones(ZEROS), "w": torch.zeros(8192)}
    with pytest.raises(CheckpointError, match="max_expansion"):
        ck.restore(model=_Module(model))
    with pytest.raises(CheckpointError, match="max_expansion"):
        ck.load()
    # An explicit step reads the chain with the same bound, verified or not.
    for verify in (True, False):
        with pytest.raises(CheckpointError, match="max_expansion"):
            ck.load(2, verify=verify)
    ck.close()


@pytest.mark.parametrize("bound", [None, 1e6])
def test_a_checkpointer_with_a_larger_bound_restores_the_chain(run_with_zeros, bound):
    with Checkpointer(run_with_zeros, max_expansion=bound) as ck:
        assert ck.max_expansion == bound
        assert ck.latest() == 2
        module = _Module({"zeros": torch.ones(ZEROS), "w": torch.zeros(8192)})
        state = ck.restore(model=module)
        assert state["step"] == 2
        assert torch.equal(module.held["zeros"], torch.zeros(ZEROS))
        assert (module.held["w"] - _state(2)["w"]).abs().max() < 0.1  # 2-bit deltas of a 0.03 drift
        # The keyframe itself, and an explicit step, load too.
        assert torch.equal(ck.load(0)["model"]["zeros"], torch.zeros(ZEROS))
        assert torch.equal(ck.load(1, verify=False)["model"]["w"], ck.load(1)["model"]["w"])


def test_load_of_a_delta_bounds_every_link_of_its_chain(run_with_zeros):
    """A reference file that is itself a delta is decoded against the keyframe found beside
    it: that read takes the caller's bound too, and only it is over the default here."""
    d = run_with_zeros
    delta2, delta1 = d / checkpoint_name(2), d / checkpoint_name(1)
    fmt.verify_file(delta1)  # the link given is within the default bound; its keyframe is not
    with pytest.raises(CheckpointError, match="max_expansion") as info:
        tw_triton.load(delta2, reference=delta1)
    assert checkpoint_name(0) in str(info.value)
    back = tw_triton.load(delta2, reference=delta1, max_expansion=None)
    with Checkpointer(d, max_expansion=None) as ck:
        want = ck.load(2)
    assert torch.equal(back["model"]["w"], want["model"]["w"])
    assert torch.equal(back["model"]["zeros"], torch.zeros(ZEROS))
    # The same bound on the decode of an already read delta against a reference path.
    q = fmt.read_file(delta2)
    with pytest.raises(CheckpointError, match="max_expansion"):
        tw_triton.dequantize_state_dict(q, reference=delta1)
    again = tw_triton.dequantize_state_dict(fmt.read_file(delta2), reference=delta1, max_expansion=None)
    assert torch.equal(again["model"]["w"], want["model"]["w"])


class _Module:
    """The least a restore target needs: a state dict of plain tensors, and a load that
    keeps what it was given."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.held: dict[str, torch.Tensor] = {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.held = dict(state)


# --------------------------------------------------------------------------------------
# One verification, one answer (issue 28 item 7)
# --------------------------------------------------------------------------------------

WEIGHTS = 1 << 16  # large enough that a delta's 2-bit codes get a zstd frame


def _drifting(step: int) -> dict[str, torch.Tensor]:
    w = torch.randn(WEIGHTS, generator=torch.Generator().manual_seed(0))
    drift = torch.randn(WEIGHTS, generator=torch.Generator().manual_seed(1 + step))
    return {"w": w + 0.01 * step * drift}


def _frame_start(path: Path, entry: str, buffer: str) -> int:
    """Where the zstd frame of a staged buffer starts in the file."""
    spec = fmt.read_manifest(path)["entries"][entry]["buffers"][buffer]
    assert spec["stage"]["name"] in ("zstd", "zstd-bytegroup"), spec["stage"]
    blob = path.read_bytes()
    start = 8 + struct.unpack("<Q", blob[:8])[0] + spec["data_offsets"][0]
    assert blob[start : start + 4] == b"\x28\xb5\x2f\xfd"  # a zstd frame's magic number
    return start


def _flip_unused_bit(path: Path, entry: str, buffer: str) -> None:
    """Set the frame header's "unused" bit of a buffer's zstd frame: zstd ignores it, so
    the frame decodes to the same content and passes zstd's own content checksum, but the
    stored bytes are no longer those written (their CRC-32 differs)."""
    raw = bytearray(path.read_bytes())
    raw[_frame_start(path, entry, buffer) + 4] ^= 0x10
    path.write_bytes(bytes(raw))


@pytest.fixture
def two_cycles(tmp_path) -> Path:
    """Keyframes at steps 0 and 2, closed-loop deltas at 1 and 3."""
    d = tmp_path / "run"
    with Checkpointer(d, keyframe_every=2, keep_last=None, async_write=False, fsync=False) as ck:
        for step in range(4):
            ck.save(step, model=_drifting(step))
    return d


@pytest.mark.parametrize(
    "step, entry, buffer, good",
    [(3, "model/w", "codes", 2), (2, "model/w", "data", 1)],
    ids=["delta-codes", "keyframe-weights"],
)
def test_a_changed_frame_gets_one_answer_from_verify_read_load_latest_and_restore(
    two_cycles, step, entry, buffer, good
):
    bad = two_cycles / checkpoint_name(step)
    _flip_unused_bit(bad, entry, buffer)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        fmt.verify_file(bad)
    with pytest.raises(CheckpointError, match="checksum mismatch") as info:
        fmt.read_file(bad)
    assert str(bad) in str(info.value) and repr(entry) in str(info.value) and repr(buffer) in str(info.value)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        tw_triton.load(bad, reference=two_cycles / checkpoint_name(step - 1) if step % 2 else None)
    # Reading only the entry whose frame changed, as a chain link is read, refuses it too.
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        fmt.read_file(bad, entries=[entry])
    # Without verification the data is not checked, by either path.
    fmt.read_file(bad, verify=False)
    with Checkpointer(two_cycles) as ck:
        assert ck.latest() == good
        module = _Module({"w": torch.zeros(WEIGHTS)})
        assert ck.restore(model=module)["step"] == good
        assert ck.load()["step"] == good
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            ck.load(step)
        assert ck._dir.problems()[step] is not None


def test_every_bit_of_a_frame_header_gets_the_same_answer_from_verify_and_read(two_cycles):
    """Whatever bit of a zstd frame's first bytes changes (magic number, frame header,
    content size, the bits zstd ignores), verify_file and read_file agree, and neither
    takes the file."""
    src = two_cycles / checkpoint_name(3)
    start = _frame_start(src, "model/w", "codes")
    blob = src.read_bytes()
    bad = two_cycles.parent / "bad.tw"
    for offset in range(start, start + 10):
        for bit in range(8):
            raw = bytearray(blob)
            raw[offset] ^= 1 << bit
            bad.write_bytes(bytes(raw))
            assert _answer(fmt.verify_file, bad) == _answer(fmt.read_file, bad) == "refused", (
                offset - start,
                bit,
            )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0, 1, exclude_max=True), byte=st.integers(1, 255))
def test_property_any_changed_data_byte_gets_one_answer(two_cycles, where, byte):
    """Any byte of the data section XORed with anything: verify_file, read_file and load
    say the same, and it is a CheckpointError (nothing else escapes)."""
    src = two_cycles / checkpoint_name(2)
    blob = bytearray(src.read_bytes())
    data_start = 8 + struct.unpack("<Q", blob[:8])[0]
    offset = data_start + int(where * (len(blob) - data_start))
    blob[offset] ^= byte
    bad = two_cycles.parent / "bad.tw"
    bad.write_bytes(bytes(blob))
    answers = {_answer(fmt.verify_file, bad), _answer(fmt.read_file, bad), _answer(tw_triton.load, bad)}
    assert answers == {"refused"}


def _answer(read, path: Path) -> str:
    """``"refused"`` if ``read(path)`` raises a CheckpointError, ``"taken"`` if it returns."""
    try:
        read(path)
    except CheckpointError:
        return "refused"
    return "taken"
