"""Where `tw export` and `tw convert` write: never over their own inputs, and a target that
cannot be written is a one-line error, not a traceback; a path of the wrong kind is named so."""

from __future__ import annotations

import io

import torch
from safetensors.torch import save_file

import tw_triton
from tw_triton.cli import EXIT_CHECKPOINT, EXIT_OK, EXIT_USAGE, main


def run(argv):
    out = io.StringIO()
    code = main([str(a) for a in argv], stdout=out)
    return code, out.getvalue()


def keyframe_and_delta(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    key, delta = tmp_path / "key.tw", tmp_path / "delta.tw"
    tw_triton.save(tw_triton.quantize_state_dict({"model": {"w": w}}), key)
    tw_triton.save(tw_triton.quantize_state_dict({"model": {"w": w + 0.01}}, reference=key), delta)
    return key, delta


def test_export_over_its_own_input_or_reference_is_refused(tmp_path, capsys):
    key, delta = keyframe_and_delta(tmp_path)
    before = {p: p.read_bytes() for p in (key, delta)}
    for argv in (
        ["export", delta, delta],
        ["export", delta, key],
        ["export", delta, tmp_path / "." / "key.tw", "--reference", key],
    ):
        code, _ = run(argv)
        err = capsys.readouterr().err
        assert code == EXIT_USAGE, argv
        assert "would overwrite" in err and "Traceback" not in err, err
    assert {p: p.read_bytes() for p in (key, delta)} == before
    tw_triton.load(delta, reference=key)


def test_convert_over_its_own_input_or_reference_is_refused(tmp_path, capsys):
    key, _ = keyframe_and_delta(tmp_path)
    src = tmp_path / "in.safetensors"
    save_file({"w": torch.randn(64, 128)}, str(src))
    before = src.read_bytes(), key.read_bytes()
    for argv in (["convert", src, src], ["convert", src, key, "--lossy", "--reference", key]):
        code, _ = run(argv)
        err = capsys.readouterr().err
        assert code == EXIT_USAGE and "would overwrite" in err, (argv, err)
    assert (src.read_bytes(), key.read_bytes()) == before


def test_export_to_a_missing_directory_or_a_directory_is_a_one_line_error(tmp_path, capsys):
    key, _ = keyframe_and_delta(tmp_path)
    (tmp_path / "adir").mkdir()
    for out in (tmp_path / "nodir" / "o.safetensors", tmp_path / "adir"):
        code, _ = run(["export", key, out])
        err = capsys.readouterr().err
        assert code == EXIT_CHECKPOINT, err
        assert err.startswith("tw export: error: ") and err.count("\n") == 1 and str(out) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "delta.tw", "key.tw"]
    assert list((tmp_path / "adir").iterdir()) == []
    code, _ = run(["export", key, tmp_path / "ok.safetensors"])
    assert code == EXIT_OK


def test_a_directory_given_for_a_file_and_a_file_for_a_directory_are_named_as_such(tmp_path, capsys):
    key, _ = keyframe_and_delta(tmp_path)
    for argv in (
        ["inspect", tmp_path],
        ["verify", tmp_path],
        ["export", tmp_path, tmp_path / "o.safetensors"],
    ):
        code, _ = run(argv)
        err = capsys.readouterr().err
        assert code == EXIT_USAGE and f"{tmp_path}: is a directory, not a checkpoint file" in err, err
    code, _ = run(["ls", key])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and f"{key}: not a directory" in err, err
    code, _ = run(["inspect", tmp_path / "missing.tw"])
    assert code == EXIT_USAGE and "missing.tw: no such file" in capsys.readouterr().err
