"""The `tw` command tells the truth (issue 28): names from crafted files print escaped, a
checkpoint that cannot be loaded is not reported verified, `tw verify` is the library's
verification, `tw ls` shows every file, references are found and named, and `tw convert`
says when it is lossy."""

from __future__ import annotations

import io
import json
import os
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import tw_triton
from tw_triton import format as fmt
from tw_triton.checkpoint_dir import CheckpointDirectory, checkpoint_name
from tw_triton.cli import EXIT_CHECKPOINT, EXIT_OK, EXIT_USAGE, main
from tw_triton.errors import CheckpointError, ReferenceMismatchError
from tw_triton.format import read_manifest, verify_file


def run(argv, stdout=None):
    out = stdout if stdout is not None else io.StringIO()
    code = main([str(a) for a in argv], stdout=out)
    if isinstance(out, io.TextIOWrapper):
        out.flush()
        return code, out.buffer.getvalue().decode(out.encoding)
    return code, out.getvalue()


def strict_stream(encoding):
    """A stdout like a pipe's or a terminal's whose encoding is ``encoding``, strict."""
    return io.TextIOWrapper(io.BytesIO(), encoding=encoding, errors="strict")


def state(seed=0):
    torch.manual_seed(seed)
    return {"model": {"w": torch.randn(256, 64), "b": torch.randn(64)}, "step": seed}


@pytest.fixture()
def pair(tmp_path):
    """A keyframe and a delta from it, side by side."""
    tw_triton.save(tw_triton.quantize_state_dict(state(0)), tmp_path / "key.tw")
    changed = state(0)
    changed["model"]["w"] = changed["model"]["w"] + 1e-3
    tw_triton.save(
        tw_triton.quantize_state_dict(changed, reference=tmp_path / "key.tw"), tmp_path / "delta.tw"
    )
    return tmp_path


def run_dir(directory, saves=3, keyframe_every=3):
    """A Checkpointer directory: a keyframe at step 0, deltas after it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 128)
    with tw_triton.Checkpointer(directory, keyframe_every=keyframe_every, keep_last=None, fsync=False) as ck:
        for step in range(saves):
            with torch.no_grad():
                model.weight.add_(0.01)
            ck.save(step, model=model)
    return directory


def rewrite_header(src, dst, edit):
    """Copy the checkpoint ``src`` to ``dst`` with ``edit(header_text) -> header_text``
    applied to its JSON header; the manifest's checksum is recomputed, so the file is
    well-formed (what a crafted file looks like)."""
    raw = open(src, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    # The edit sees the manifest as JSON text inside the header (where version 2 kept it).
    header = json.loads(raw[8 : 8 + n].decode("utf-8"))
    header["__metadata__"] = {"manifest": fmt.manifest_text(header["__metadata__"], str(src))[0]}
    header = json.loads(edit(json.dumps(header)))
    header["__metadata__"] = fmt.manifest_metadata(header["__metadata__"]["manifest"])
    text = json.dumps(header).encode("utf-8")
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def crafted_name_file(tmp_path, name_json):
    """A checkpoint whose entry ``model/b`` is renamed to ``name_json`` (a JSON string
    body, escapes allowed) in the manifest and the tensor table alike."""
    src = tmp_path / "plain.tw"
    tw_triton.save(tw_triton.quantize_state_dict(state(0)), src)

    def edit(text):
        # The manifest is a JSON string inside the header: its quotes are escaped there.
        return text.replace('\\"model/b', '\\"' + name_json.replace("\\", "\\\\")).replace(
            '"model/b:data"', '"' + name_json + ':data"'
        )

    rewrite_header(src, tmp_path / "crafted.tw", edit)
    return tmp_path / "crafted.tw"


# ---- item 4: names print escaped, whatever the stream's encoding ----------------------------


@pytest.mark.parametrize("encoding", ["utf-8", "ascii"])
def test_inspect_and_verify_print_a_lone_surrogate_escaped(tmp_path, encoding):
    path = crafted_name_file(tmp_path, "model/\\udc80\\u001b[31m")
    assert "model/\udc80\x1b[31m" in read_manifest(path)["entries"]  # the crafted name loads
    code, text = run(["inspect", path], strict_stream(encoding))
    assert code == EXIT_OK
    row = next(line for line in text.splitlines() if line.startswith("model/\\udc80"))
    assert row.startswith("model/\\udc80\\x1b[31m ")  # escaped: no surrogate, no terminal escape
    code, text = run(["verify", path], strict_stream(encoding))
    assert code == EXIT_OK and "checksums OK" in text


def test_a_name_the_stream_cannot_encode_is_escaped_not_fatal(tmp_path):
    path = crafted_name_file(tmp_path, "model/caf\\u00e9")
    code, text = run(["inspect", path], strict_stream("ascii"))
    assert code == EXIT_OK and "model/caf\\xe9" in text
    code, text = run(["inspect", path], strict_stream("utf-8"))
    assert code == EXIT_OK and "model/café" in text  # printable and encodable: as it is


@pytest.mark.parametrize("encoding", ["utf-8", "ascii"])
def test_every_command_prints_a_non_utf8_path_escaped(tmp_path, encoding):
    # A directory name of non-UTF-8 bytes reaches Python as lone surrogates.
    d = tmp_path / "run-\udcff"
    run_dir(d, saves=2)
    (d / ".step-00000009.tw.safetensors.0123456789abcdef.tmp").write_bytes(b"partial")
    code, text = run(["ls", d, "--verify"], strict_stream(encoding))
    assert code == EXIT_OK and "run-\\udcff" in text
    first = d / checkpoint_name(1)
    assert run(["inspect", first], strict_stream(encoding))[0] == EXIT_OK
    for argv in (["verify", first], ["export", first, d / "out.safetensors"]):
        code, text = run(argv, strict_stream(encoding))
        assert code == EXIT_OK and "run-\\udcff" in text
    torch.save({"w": torch.ones(2)}, d / "in.pt")
    code, text = run(["convert", d / "in.pt", d / "o.tw"], strict_stream(encoding))
    assert code == EXIT_OK and "run-\\udcff" in text


def test_errors_on_stderr_print_escaped(tmp_path, capsys):
    missing = tmp_path / "nope-\udcff.tw"
    assert run(["verify", missing])[0] == EXIT_USAGE
    assert "nope-\\udcff.tw: no such file" in capsys.readouterr().err


@settings(max_examples=300, deadline=None)
@given(st.text(), st.sampled_from([None, "utf-8", "ascii", "latin-1"]))
def test_printable_always_encodes_and_keeps_what_is_printable(text, encoding):
    from tw_triton.cli import printable

    shown = printable(text, encoding)
    shown.encode(encoding or "utf-8")  # strict: never raises
    assert shown.isprintable()
    encodable = all(c.encode(encoding or "utf-8", "ignore") for c in text if not ("\ud800" <= c <= "\udfff"))
    if text.isprintable() and encodable:
        assert shown == text


# ---- item 6: a delta whose reference is absent is not verified ----------------------------------


def test_verify_of_a_delta_without_its_reference_exits_1_and_says_why(pair, capsys):
    os.remove(pair / "key.tw")
    code, text = run(["verify", pair / "delta.tw"])
    assert code == EXIT_CHECKPOINT and "OK" not in text
    err = capsys.readouterr().err
    assert "delta.tw" in err and "--reference" in err and "--checksums-only" in err
    # Checksums alone, when asked for, and the output says that is all it checked.
    code, text = run(["verify", pair / "delta.tw", "--checksums-only"])
    assert code == EXIT_OK
    assert "checksums OK" in text and "--checksums-only" in text and "reference was not checked" in text


def test_verify_help_states_checksums_only(capsys):
    assert main(["verify", "--help"]) == EXIT_OK
    text = capsys.readouterr().out
    assert "--checksums-only" in text and "exits 1" in text


# ---- item 7: tw verify is the library's verification ---------------------------------------------


def test_verify_agrees_with_verify_file_on_a_zstd_frame_whose_bytes_changed(tmp_path):
    path = tmp_path / "key.tw"
    tw_triton.save(tw_triton.quantize_state_dict(state(0)), path)
    manifest = read_manifest(path)
    codes = manifest["entries"]["model/w"]["buffers"]["codes"]
    assert codes["stage"]["name"] == "zstd"
    raw = bytearray(path.read_bytes())
    frame = 8 + struct.unpack("<Q", raw[:8])[0] + codes["data_offsets"][0]
    assert raw[frame : frame + 4] == b"\x28\xb5\x2f\xfd"  # a zstd frame's magic number
    # The frame header's "unused" bit: decoders ignore it, so the frame decodes to the same
    # content and passes zstd's content checksum, but the stored bytes are not those written.
    raw[frame + 4] ^= 0x10
    bad = tmp_path / "bad.tw"
    bad.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        verify_file(bad)
    code, text = run(["verify", bad])
    assert code == EXIT_CHECKPOINT and "OK" not in text
    code, _ = run(["verify", bad, "--checksums-only"])
    assert code == EXIT_CHECKPOINT
    # And `tw ls --verify` gives the same answer for the same bytes.
    run_dir(tmp_path / "run", saves=1)
    os.replace(bad, tmp_path / "run" / checkpoint_name(0))
    assert run(["ls", tmp_path / "run", "--verify"])[0] == EXIT_CHECKPOINT


# ---- item 12: tw ls shows every checkpoint file ---------------------------------------------------


def truncate(path, nbytes):
    data = path.read_bytes()
    path.write_bytes(data[:-nbytes])


def test_ls_shows_a_truncated_newest_checkpoint_and_exits_1(tmp_path):
    d = run_dir(tmp_path / "run", saves=3)
    truncate(d / checkpoint_name(2), 100)
    code, text = run(["ls", d, "--verify"])
    assert code == EXIT_CHECKPOINT
    rows = {line.split()[0]: line for line in text.splitlines()[1:4]}
    assert set(rows) == {"0", "1", "2"}
    assert "cannot load" in rows["2"] and "truncated" in rows["2"] and checkpoint_name(2) in rows["2"]
    assert rows["0"].endswith("ok") and rows["1"].endswith("ok")
    assert "3 checkpoints" in text and "latest loadable: step 1" in text
    # Without --verify the file is listed too, and why it cannot be read is said.
    code, text = run(["ls", d])
    assert code == EXIT_OK and "unreadable" in text and "step 2: its header cannot be read" in text
    # ... and the newest checkpoint it names is one whose header reads, not step 2.
    assert "newest: step 1 (not verified" in text


def test_ls_names_a_truncated_keyframe_as_truncated_not_missing(tmp_path):
    d = run_dir(tmp_path / "run", saves=3)
    key = d / checkpoint_name(0)
    truncate(key, 100)
    code, text = run(["ls", d, "--verify"])
    assert code == EXIT_CHECKPOINT
    rows = {line.split()[0]: line for line in text.splitlines()[1:4]}
    assert set(rows) == {"0", "1", "2"}
    assert "truncated" in rows["0"]
    assert "step 0 (unreadable)" in rows["1"]
    assert "which is not in" not in rows["1"]
    assert (
        "step 0" in rows["1"]
        and str(key) in rows["1"]
        and "cannot be read" in rows["1"]
        and "truncated" in rows["1"]
    )
    assert "latest loadable: none" in text


# ---- item 13: references named by step and file, found beside, --reference named --------------


def test_reference_errors_name_the_step_and_the_file(tmp_path):
    d = run_dir(tmp_path / "run", saves=2)
    key = d / checkpoint_name(0)
    os.remove(key)
    problems = CheckpointDirectory(d).problems(verify=True)
    assert "step 0" in problems[1] and str(key) in problems[1]
    with pytest.raises(ReferenceMismatchError, match=r"step 0"):
        tw_triton.load(d / checkpoint_name(1))


def test_verify_and_export_find_the_reference_beside_the_delta(pair):
    code, text = run(["verify", pair / "delta.tw"])
    assert code == EXIT_OK and "reference OK" in text and "key.tw" in text
    code, _ = run(["export", pair / "delta.tw", pair / "out.safetensors"])
    assert code == EXIT_OK
    expected = tw_triton.load(pair / "delta.tw", reference=pair / "key.tw")
    assert torch.equal(load_file(str(pair / "out.safetensors"))["model/w"], expected["model"]["w"])


def test_a_file_beside_whose_id_differs_is_never_used(pair, capsys):
    # Another checkpoint takes the keyframe's place: same tensors, another id.
    os.remove(pair / "key.tw")
    tw_triton.save(tw_triton.quantize_state_dict(state(0)), pair / "key.tw")
    for argv in (["verify", pair / "delta.tw"], ["export", pair / "delta.tw", pair / "o.safetensors"]):
        assert run(argv)[0] == EXIT_CHECKPOINT
        err = capsys.readouterr().err
        assert "which is not in" in err and "--reference" in err
    assert not (pair / "o.safetensors").exists()


def test_verify_in_a_checkpointer_directory_follows_a_closed_loop_chain(tmp_path, capsys):
    d = tmp_path / "run"
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 128)
    with tw_triton.Checkpointer(d, keyframe_every=10, keep_last=None, fsync=False, delta="closed") as ck:
        for step in range(3):
            with torch.no_grad():
                model.weight.add_(0.01)
            ck.save(step, model=model)
    code, text = run(["verify", d / checkpoint_name(2)])
    assert code == EXIT_OK
    assert text.count("reference OK") == 2 and "step 1" in text and "step 0" in text
    # A keyframe replaced by another run's file of the same step: named, and refused.
    other = run_dir(tmp_path / "other", saves=1)
    os.replace(other / checkpoint_name(0), d / checkpoint_name(0))
    assert run(["verify", d / checkpoint_name(2)])[0] == EXIT_CHECKPOINT
    err = capsys.readouterr().err
    assert "step 0" in err and checkpoint_name(0) in err


# ---- item 14: tw convert is lossless unless asked, and says which ----------------------------


def test_convert_is_lossless_by_default_and_says_so(tmp_path):
    sd = {k: v.clone() for k, v in torch.nn.Linear(256, 256).state_dict().items()}
    save_file(sd, str(tmp_path / "model.safetensors"))
    code, text = run(["convert", tmp_path / "model.safetensors", tmp_path / "out.tw"])
    assert code == EXIT_OK and "lossless" in text and "lossy" not in text
    out = tw_triton.load(tmp_path / "out.tw")
    assert all(torch.equal(out[k], v) for k, v in sd.items())
    code, text = run(["convert", tmp_path / "model.safetensors", tmp_path / "q.tw", "--lossy"])
    assert code == EXIT_OK and "lossy: 1 of 2 entries quantized (int8/128" in text
    assert read_manifest(tmp_path / "q.tw")["entries"]["weight"]["codec"] == "blockwise"
    # Options that only quantizing uses ask for it explicitly.
    assert run(["convert", tmp_path / "model.safetensors", tmp_path / "r.tw", "--bits", "4"])[0] == EXIT_USAGE
    assert not (tmp_path / "r.tw").exists()
    code, text = run(["convert", tmp_path / "model.safetensors", tmp_path / "s.tw", "--rules", "default"])
    assert code == EXIT_OK and "lossy:" in text


def test_convert_help_states_the_default_is_lossless(capsys):
    assert main(["convert", "--help"]) == EXIT_OK
    text = " ".join(capsys.readouterr().out.split())
    assert "Lossless by default" in text and "--lossy" in text


def test_only_codecs_that_give_back_every_bit_count_as_lossless():
    """What `tw convert` reports as lossless: the exact and bitmask codecs, no other."""
    from tw_triton.codecs import codec_names, get_codec

    assert {n for n in codec_names() if get_codec(n).lossless} == {"exact", "bitmask"}
    x = torch.randn(5000)
    x[::3] = 0.0
    for name in ("exact", "bitmask"):
        codec = get_codec(name)
        enc = codec.encode(x, codec.resolve_params({}, bits=8, block=128), None)
        assert torch.equal(codec.decode(enc.entry, None, None, "t").view(torch.int32), x.view(torch.int32))
