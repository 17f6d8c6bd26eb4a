"""The `tw` command, and the state-API example of docs/format.md and its `tw inspect` output."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import tw_triton
from tw_triton.cli import EXIT_CHECKPOINT, EXIT_OK, EXIT_USAGE, ProgressBar, main
from tw_triton.format import read_manifest

README = Path(__file__).resolve().parents[2] / "README.md"


def run(argv):
    out = io.StringIO()
    code = main([str(a) for a in argv], stdout=out)
    return code, out.getvalue()


def model_sd(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 256))
    m[2].weight = m[0].weight
    return m.state_dict()


@pytest.fixture()
def ckpts(tmp_path):
    sd = model_sd()
    key = tw_triton.quantize_state_dict({"model": sd, "step": 1})
    tw_triton.save(key, tmp_path / "key.tw")
    sd2 = {k: v + 1e-3 for k, v in sd.items()}
    sd2["2.weight"] = sd2["0.weight"]  # still tied
    delta = tw_triton.quantize_state_dict({"model": sd2, "step": 2}, reference=tmp_path / "key.tw", bits=4)
    tw_triton.save(delta, tmp_path / "delta.tw")
    return tmp_path, key, delta, sd, sd2


def test_inspect_table_and_totals(ckpts):
    d, key, delta, _, _ = ckpts
    code, text = run(["inspect", d / "delta.tw"])
    assert code == EXIT_OK
    assert f"reference   {key.checkpoint_id}" in text
    assert f"checkpoint  {delta.checkpoint_id}" in text
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("entry"))
    assert header.split() == [
        "entry",
        "shape",
        "dtype",
        "codec",
        "stage",
        "coded",
        "stored",
        "ratio",
        "bits/el",
    ]
    row = next(line for line in lines if line.startswith("model/0.weight"))
    # The codes (8 KiB) go through the entropy stage, the scales (512 B) stay raw.
    assert row.split()[:6] == ["model/0.weight", "256x64", "float32", "int4/128", "delta", "codes:zstd"]
    buffers = read_manifest(d / "delta.tw")["entries"]["model/0.weight"]["buffers"]
    stored = sum(b["data_offsets"][1] - b["data_offsets"][0] for b in buffers.values())
    assert stored < 256 * 64 // 2 + 4 * 128
    assert row.split()[-2] == f"{256 * 64 * 4 / stored:.2f}x"
    assert row.split()[-1] == f"{8 * stored / (256 * 64):.3g}"  # stored bits per element
    assert row.split()[-6:-4] == ["8.5", "KiB"]  # coded: codes + scales before the stage
    assert any(line.startswith("model/2.weight") and "alias of model/0.weight" in line for line in lines)
    size = os.path.getsize(d / "delta.tw")
    with open(d / "delta.tw", "rb") as f:
        hdr = 8 + int.from_bytes(f.read(8), "little")
    assert f"file        {size} bytes = {hdr} header + {size - hdr} data" in text
    # 0.weight, 1.weight, 1.bias, 2.bias; 2.weight is tied to 0.weight.
    assert "total       4 entries + 1 alias:" in text


def test_inspect_shows_a_temporal_moment_with_its_stage_and_bits_per_element(tmp_path):
    g = torch.Generator().manual_seed(0)
    v = torch.rand(256, 64, generator=g) + 0.1
    state = {"optimizer": {"state": {0: {"exp_avg_sq": v}}}}
    rules = [("*exp_avg_sq", {"codec": "log2-temporal", "bits": 4, "block": 128})]
    later = {"optimizer": {"state": {0: {"exp_avg_sq": v * 1.001}}}}
    tw_triton.save(tw_triton.quantize_state_dict(later, rules=rules, reference=state), tmp_path / "t.tw")
    code, text = run(["inspect", tmp_path / "t.tw"])
    assert code == EXIT_OK
    row = next(line for line in text.splitlines() if line.startswith("optimizer/state/0/exp_avg_sq"))
    cols = row.split()
    assert cols[3:7] == ["log2-temporal", "4/128", "delta", "codes:zstd"]
    entry = read_manifest(tmp_path / "t.tw")["entries"]["optimizer/state/0/exp_avg_sq"]
    stored = entry["buffers"]["codes"]["data_offsets"][1] - entry["buffers"]["codes"]["data_offsets"][0]
    assert cols[-1] == f"{8 * stored / v.numel():.3g}" and float(cols[-1]) < 0.5


def test_inspect_and_verify_show_an_update_domain_moment_and_its_partner(tmp_path):
    g = torch.Generator().manual_seed(0)
    m, v = torch.randn(256, 64, generator=g), torch.rand(256, 64, generator=g)
    state = {"optimizer": {"state": {0: {"exp_avg": m, "exp_avg_sq": v}}}}
    rules = [("*exp_avg", {"codec": "blockwise-update", "bits": 3, "block": 128}), ("*exp_avg_sq", "log2")]
    tw_triton.save(tw_triton.quantize_state_dict(state, rules=rules), tmp_path / "u.tw")
    code, text = run(["inspect", tmp_path / "u.tw"])
    assert code == EXIT_OK
    row = next(line for line in text.splitlines() if line.startswith("optimizer/state/0/exp_avg "))
    assert row.split()[3:7] == ["update", "int3/128", "by", "exp_avg_sq"]
    code, text = run(["verify", tmp_path / "u.tw"])
    assert code == EXIT_OK


def test_verify_ok_corrupt_and_reference(ckpts):
    d, *_ = ckpts
    assert run(["verify", d / "key.tw"])[0] == EXIT_OK
    # The reference is found beside the delta, by its checkpoint id.
    code, text = run(["verify", d / "delta.tw"])
    assert code == EXIT_OK and "reference OK" in text and "key.tw" in text
    code, text = run(["verify", d / "delta.tw", "--reference", d / "key.tw"])
    assert code == EXIT_OK and "reference OK" in text
    # The wrong reference: exit 1.
    assert run(["verify", d / "delta.tw", "--reference", d / "delta.tw"])[0] == EXIT_CHECKPOINT
    # A flipped bit in the data: exit 1, and the error names the file.
    raw = bytearray((d / "key.tw").read_bytes())
    raw[-10] ^= 0x40
    (d / "bad.tw").write_bytes(bytes(raw))
    assert run(["verify", d / "bad.tw"])[0] == EXIT_CHECKPOINT
    # Not a checkpoint at all, and a missing file.
    (d / "junk.tw").write_bytes(b"hello world, not safetensors")
    assert run(["inspect", d / "junk.tw"])[0] == EXIT_CHECKPOINT
    assert run(["verify", d / "nope.tw"])[0] == EXIT_USAGE


def test_errors_go_to_stderr_with_the_file_name(ckpts, capsys):
    d, *_ = ckpts
    (d / "alone").mkdir()
    os.replace(d / "delta.tw", d / "alone" / "delta.tw")  # its reference is not beside it
    assert run(["export", d / "alone" / "delta.tw", d / "x.safetensors"])[0] == EXIT_CHECKPOINT
    err = capsys.readouterr().err
    assert "delta.tw" in err and "reference" in err and "--reference" in err
    assert not (d / "x.safetensors").exists()


def test_export_writes_plain_safetensors(ckpts):
    d, _, _, _, sd2 = ckpts
    code, _ = run(["export", d / "delta.tw", d / "out.safetensors", "--reference", d / "key.tw"])
    assert code == EXIT_OK
    loaded = tw_triton.load(d / "delta.tw", reference=d / "key.tw")
    with safe_open(str(d / "out.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
    assert keys == {"model/0.weight", "model/1.weight", "model/1.bias", "model/2.weight", "model/2.bias"}
    assert meta["tw_triton.source_checkpoint"] and "skeleton" in " ".join(meta)
    plain = load_file(str(d / "out.safetensors"))
    for k, v in loaded["model"].items():
        assert torch.equal(plain[f"model/{k}"], v)
    assert torch.equal(plain["model/2.weight"], plain["model/0.weight"])


def test_convert_from_safetensors_and_torch_files(tmp_path):
    sd = {k: v.clone() for k, v in model_sd().items()}
    save_file(sd, str(tmp_path / "in.safetensors"))
    torch.save(sd, tmp_path / "in.pt")
    for src in ("in.safetensors", "in.pt"):
        code, text = run(
            ["convert", tmp_path / src, tmp_path / f"{src}.tw", "--lossy", "--bits", "4", "--block", "64"]
        )
        assert code == EXIT_OK and "wrote" in text
        m = tw_triton.format.read_manifest(tmp_path / f"{src}.tw")
        assert m["entries"]["0.weight"]["codec"] == "blockwise"
        assert m["entries"]["0.weight"]["params"]["bits"] == 4
        assert m["entries"]["0.weight"]["params"]["block"] == 64
        out = tw_triton.load(tmp_path / f"{src}.tw")
        assert torch.equal(out["1.bias"], sd["1.bias"])
        assert (out["0.weight"] - sd["0.weight"]).abs().max() < sd["0.weight"].abs().max() / 7
    # With a reference: a delta recording its id; with a preset.
    code, _ = run(
        ["convert", tmp_path / "in.pt", tmp_path / "d.tw", "--lossy", "--reference", tmp_path / "in.pt.tw"]
    )
    assert code == EXIT_OK
    ref_id = tw_triton.format.read_manifest(tmp_path / "in.pt.tw")["checkpoint_id"]
    assert tw_triton.format.read_manifest(tmp_path / "d.tw")["reference_id"] == ref_id
    assert run(["convert", tmp_path / "in.pt", tmp_path / "e.tw", "--rules", "exact"])[0] == EXIT_OK
    assert all(
        e["codec"] == "exact" for e in tw_triton.format.read_manifest(tmp_path / "e.tw")["entries"].values()
    )
    # A tw_triton file is not converted as if its buffers were weights; junk is refused.
    os.replace(tmp_path / "e.tw", tmp_path / "e.safetensors")
    assert run(["convert", tmp_path / "e.safetensors", tmp_path / "f.tw"])[0] == EXIT_CHECKPOINT
    (tmp_path / "junk.safetensors").write_bytes(b"\x10" * 40)
    assert run(["convert", tmp_path / "junk.safetensors", tmp_path / "f.tw"])[0] == EXIT_CHECKPOINT
    assert not (tmp_path / "f.tw").exists()


def test_convert_reads_what_a_file_is_not_what_it_is_named(tmp_path, capsys):
    # A safetensors file under another name (a Lightning TwCheckpointIO checkpoint is a
    # tw_triton file named last.ckpt) was read as a torch pickle, and the refusal said that
    # torch.load(weights_only=False) "will likely succeed".
    save_file({"w": torch.arange(4.0)}, str(tmp_path / "weights.bin"))
    assert run(["convert", tmp_path / "weights.bin", tmp_path / "a.tw"])[0] == EXIT_OK
    assert torch.equal(tw_triton.load(tmp_path / "a.tw")["w"], torch.arange(4.0))
    os.replace(tmp_path / "a.tw", tmp_path / "last.ckpt")
    capsys.readouterr()
    assert run(["convert", tmp_path / "last.ckpt", tmp_path / "b.tw"])[0] == EXIT_CHECKPOINT
    err = capsys.readouterr().err
    assert "last.ckpt is already a tw_triton checkpoint" in err and "weights_only" not in err
    # An empty file, and a state whose keys the format cannot hold: the file is named, and why.
    (tmp_path / "empty.pt").write_bytes(b"")
    assert run(["convert", tmp_path / "empty.pt", tmp_path / "c.tw"])[0] == EXIT_CHECKPOINT
    assert re.search(r"empty\.pt: .*the file is empty", capsys.readouterr().err)
    torch.save({(1, 2): torch.ones(2)}, tmp_path / "tuple.pt")
    assert run(["convert", tmp_path / "tuple.pt", tmp_path / "d.tw"])[0] == EXIT_CHECKPOINT
    assert re.search(r"tuple\.pt: .*unsupported dict key \(1, 2\)", capsys.readouterr().err)
    assert not any((tmp_path / n).exists() for n in ("b.tw", "c.tw", "d.tw"))


class Payload:
    """A class a full pickle would instantiate; weights_only refuses it."""

    built = False

    def __setstate__(self, state):
        Payload.built = True


def test_convert_refuses_non_weights_only_pickles(tmp_path, capsys):
    torch.save({"w": torch.ones(2), "obj": Payload()}, tmp_path / "evil.pt")
    Payload.built = False
    code, _ = run(["convert", tmp_path / "evil.pt", tmp_path / "o.tw"])
    assert code == EXIT_CHECKPOINT
    assert not Payload.built
    assert "weights-only" in capsys.readouterr().err
    assert not (tmp_path / "o.tw").exists()


def test_usage_errors_exit_2(tmp_path):
    assert run([])[0] == EXIT_USAGE
    assert run(["frobnicate"])[0] == EXIT_USAGE
    assert run(["convert", tmp_path / "missing.pt", tmp_path / "o.tw"])[0] == EXIT_USAGE
    torch.save({"w": torch.ones(2)}, tmp_path / "in.pt")
    assert run(["convert", tmp_path / "in.pt", tmp_path / "o.tw", "--block", "100"])[0] == EXIT_USAGE
    assert run(["convert", tmp_path / "in.pt", tmp_path / "o.tw", "--bits", "3"])[0] == EXIT_USAGE
    assert run(["convert", tmp_path / "in.pt", tmp_path / "o.tw", "--rules", "nope"])[0] == EXIT_USAGE


def _run_dir(directory, saves: int = 5):
    """A Checkpointer directory: keyframes at steps 0 and 3, deltas between."""
    from tw_triton import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Linear(96, 96)
    opt = torch.optim.AdamW(model.parameters())
    with Checkpointer(directory, keyframe_every=3, keep_last=None, fsync=False) as ck:
        for step in range(saves):
            model(torch.randn(4, 96)).sum().backward()
            opt.step()
            ck.save(step, model=model, optimizer=opt)
    return directory


def test_ls_lists_a_checkpointer_directory_and_its_chains(tmp_path):
    from tw_triton.checkpointer import checkpoint_name

    d = _run_dir(tmp_path / "run")
    code, text = run(["ls", d])
    assert code == EXIT_OK
    lines = text.splitlines()
    assert lines[0].split() == ["step", "kind", "size", "reference"]
    rows = [line.split() for line in lines[1:6]]
    assert [r[0] for r in rows] == ["0", "1", "2", "3", "4"]
    assert [r[1] for r in rows] == ["keyframe", "delta", "delta", "keyframe", "delta"]
    # closed loop: each delta names the save before it; a keyframe names none
    assert [" ".join(r[4:]) for r in rows] == ["-", "step 0", "step 1", "-", "step 3"]
    assert "5 checkpoints" in text and "newest: step 4 (not verified" in text

    # A corrupted delta: it and the delta after it (its chain) cannot be loaded.
    path = d / checkpoint_name(1)
    data = bytearray(path.read_bytes())
    data[-64] ^= 0xFF
    path.write_bytes(bytes(data))
    (d / ".step-00000005.tw.safetensors.0123456789abcdef.tmp").write_bytes(b"partial")
    code, text = run(["ls", d, "--verify"])
    assert code == EXIT_CHECKPOINT
    status = {line.split()[0]: line for line in text.splitlines()[1:6]}
    assert status["0"].endswith("ok") and status["3"].endswith("ok") and status["4"].endswith("ok")
    assert "it fails verification" in status["1"] and "checksum mismatch" in status["1"]
    assert f"its reference {path} fails verification" in status["2"]
    assert "latest loadable: step 4" in text
    assert "1 temp file of interrupted saves" in text and ".step-00000005" in text


def test_ls_of_an_empty_or_missing_directory(tmp_path):
    code, text = run(["ls", tmp_path, "--verify"])
    assert code == EXIT_OK and "0 checkpoints" in text and "latest loadable: none" in text
    assert run(["ls", tmp_path / "missing"])[0] == EXIT_USAGE
    assert not (tmp_path / "missing").exists()  # listing never creates the directory
    # A DistributedCheckpointer's directory is not a Checkpointer's: say so.
    (tmp_path / "step_00000003").mkdir()
    (tmp_path / "step_00000003" / "tw_dcp.json").write_text("{}")
    code, text = run(["ls", tmp_path])
    assert code == EXIT_OK and "DistributedCheckpointer directory" in text


def test_ls_of_another_writers_directory_says_where_its_checkpoints_are(tmp_path):
    # A TwTrainer output_dir and a Lightning checkpoint directory hold tw_triton files that
    # tw ls did not list: it said "0 checkpoints" and nothing else.
    runs = _run_dir(tmp_path / "hf-run" / "tw_triton", saves=1)
    code, text = run(["ls", tmp_path / "hf-run"])
    assert code == EXIT_OK and "0 checkpoints" in text
    assert f"TwTrainer output_dir: its checkpoints are in {runs}" in text
    (tmp_path / "pl-run").mkdir()
    shutil.copy(runs / "step-00000000.tw.safetensors", tmp_path / "pl-run" / "last.ckpt")
    (tmp_path / "pl-run" / "notes.ckpt").write_bytes(b"not a checkpoint")
    code, text = run(["ls", tmp_path / "pl-run", "--verify"])
    assert code == EXIT_OK and "1 tw_triton file not named as a Checkpointer names them: last.ckpt" in text


def test_a_twtrainer_checkpoint_folder_names_its_file(tmp_path, capsys):
    # hf-run/checkpoint-N is what a TwTrainer user has in hand; tw ls said "0 checkpoints"
    # and nothing else, and tw inspect / tw verify only "is a directory".
    from tw_triton.integrations.hf_pointer import write_pointer

    runs = _run_dir(tmp_path / "hf-run" / "tw_triton", saves=1)
    folder = tmp_path / "hf-run" / "checkpoint-0"
    write_pointer(str(folder), str(runs), 0)
    file = runs / "step-00000000.tw.safetensors"
    code, text = run(["ls", folder])
    assert code == EXIT_OK and "0 checkpoints" in text
    assert f"a TwTrainer checkpoint folder: its file is {file}" in text and f"tw ls {runs}" in text
    for command in ("inspect", "verify"):
        assert run([command, folder])[0] == EXIT_USAGE
        err = capsys.readouterr().err
        assert "is a directory, not a checkpoint file" in err
        assert f"a TwTrainer checkpoint folder: its file is {file}" in err


def test_help_documents_exit_codes_and_pickle_policy(capsys):
    assert main(["--help"]) == EXIT_OK
    text = capsys.readouterr().out
    for word in ("inspect", "verify", "export", "convert", "exit codes", "0 ", "1 ", "2 "):
        assert word in text
    assert main(["convert", "--help"]) == EXIT_OK
    assert "weights_only=True" in capsys.readouterr().out


def test_progress_bar_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        bar = ProgressBar("convert", stream)
        for i in range(1, 5):
            bar(i, 4)
        bar.close()
    assert pipe.getvalue() == ""
    assert "\rconvert [" in tty.getvalue() and "4/4" in tty.getvalue() and tty.getvalue().endswith("\n")
    assert "#" * ProgressBar.WIDTH in tty.getvalue()


def test_runs_as_a_module_and_as_the_installed_script(ckpts):
    d, *_ = ckpts
    proc = subprocess.run(
        [sys.executable, "-m", "tw_triton.cli", "inspect", str(d / "key.tw")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "model/0.weight" in proc.stdout
    # The script `pip install -e .` put beside this interpreter: a `tw` found elsewhere on
    # PATH may belong to another environment.
    exe = shutil.which("tw", path=str(Path(sys.executable).parent))
    if exe is not None:
        proc = subprocess.run(
            [exe, "verify", str(d / "nope.tw")], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == EXIT_USAGE and "no such file" in proc.stderr


def _pyproject_version() -> str:
    import tomllib

    with open(README.parent / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


def test_version_flag_prints_the_package_version(capsys):
    assert tw_triton.__version__ == _pyproject_version()
    assert main(["--version"]) == EXIT_OK
    assert capsys.readouterr().out.strip() == f"tw {tw_triton.__version__}"


def test_python_dash_m_tw_triton_is_the_tw_command(ckpts):
    d, *_ = ckpts
    base = [sys.executable, "-m", "tw_triton"]
    proc = subprocess.run(base + ["inspect", str(d / "key.tw")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_OK, proc.stderr
    assert "model/0.weight" in proc.stdout
    proc = subprocess.run(base + ["--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_OK and "inspect" in proc.stdout and "--version" in proc.stdout
    proc = subprocess.run(base + ["--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_OK and proc.stdout.strip() == f"tw {tw_triton.__version__}"
    # Exit codes are the command's: a missing input is a usage error.
    proc = subprocess.run(base + ["verify", str(d / "nope.tw")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_USAGE and "no such file" in proc.stderr


# ---- README: the state-API example runs, and its `tw inspect` output is current --------------


def readme_section(title: str) -> str:
    text = (README.parent / "docs" / "format.md").read_text()  # moved there from the README
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


_ID = re.compile(r"\b[0-9a-f]{32}\b")


def test_readme_state_example_runs_and_inspect_output_matches(tmp_path, monkeypatch):
    section = readme_section("Training-state checkpoints")
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    shown = re.search(r"\$ tw inspect step200\.tw\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/format.md", "exec"), {"__name__": "readme_example"})
    rc, actual = run(["inspect", "step200.tw"])
    assert rc == EXIT_OK
    # Checkpoint ids are random; everything else (sizes, ratios) is reproducible, but for
    # the file's sizes, within a few bytes: the ids are in the header's compressed manifest,
    # and the data by a few bytes between machines (3 bytes fewer on an AVX-512 Xeon than on
    # the AMD EPYC whose output the docs show).
    sizes = [_FILE_LINE.search(text) for text in (actual, shown)]
    assert all(sizes), actual
    assert abs(int(sizes[0]["data"]) - int(sizes[1]["data"])) <= 64, actual
    assert abs(int(sizes[0]["header"]) - int(sizes[1]["header"])) <= 64, actual
    assert _normalized(actual) == _normalized(shown), (
        "docs/format.md's `tw inspect` output is stale; paste the current output:\n" + actual
    )


_FILE_LINE = re.compile(r"file +(?P<total>\d+) bytes = (?P<header>\d+) header \+ (?P<data>\d+) data")


def _normalized(text: str) -> str:
    return _FILE_LINE.sub("file <size>", _ID.sub("<id>", text.strip()))


def test_codec_labels_are_short_for_every_codec_with_bits():
    from tw_triton.cli.output import codec_label

    assert (
        codec_label("blockwise", {"bits": 4, "block": 128, "delta": True, "ref_fp": "f"}) == "int4/128 delta"
    )
    assert codec_label("blockwise", {"bits": 4, "block": 128, "qmax": 3}) == "int3/128"
    assert codec_label("blockwise", {"bits": 8, "block": 64, "qmax": 127}) == "int8/64"
    assert codec_label("log2", {"bits": 4, "block": 128, "packing": "lsb-first"}) == "log2 4/128"
    assert (
        codec_label("log2-temporal", {"bits": 4, "block": 128, "delta": True}) == "log2-temporal 4/128 delta"
    )
    update = {"bits": 4, "block": 128, "qmax": 3, "partner": "optimizer/state/0/exp_avg_sq"}
    assert codec_label("blockwise-update", update) == "update int3/128 by exp_avg_sq"
    assert codec_label("exact", {}) == "exact"
