"""Loading a checkpoint never unpickles: an untrusted file cannot run code.

Two independent traps: every pickle entry point (and ``torch.load``) is replaced by a
function that fails the test, and a ``sys.audit`` hook records the ``pickle.find_class``
event that CPython raises whenever an unpickler resolves a global (the step that turns a
pickle into code execution), whichever module reached the unpickler.
"""

from __future__ import annotations

import _pickle
import contextlib
import io
import pickle
import sys

import pytest
import torch
from _format_samples import assert_same_state, sample_state

import tw_triton
from tw_triton import format as fmt

# The audit hook cannot be removed once added, so it is added once and only records while
# a test has switched it on.
_AUDIT = {"on": False, "events": []}


def _audit_hook(event: str, args: tuple) -> None:
    if _AUDIT["on"] and event.startswith("pickle."):
        _AUDIT["events"].append((event, args))


sys.addaudithook(_audit_hook)


class Unpickled(AssertionError):
    pass


@contextlib.contextmanager
def pickle_forbidden():
    """Inside: every way to unpickle fails, and unpickling audit events are recorded."""

    def trap(*args, **kwargs):
        raise Unpickled("something tried to unpickle while loading a checkpoint")

    with pytest.MonkeyPatch.context() as mp:
        for module in (pickle, _pickle):
            for name in ("loads", "load", "Unpickler"):
                mp.setattr(module, name, trap)
        mp.setattr(torch, "load", trap)
        mp.setattr(torch.serialization, "load", trap)
        _AUDIT["events"].clear()
        _AUDIT["on"] = True
        try:
            yield _AUDIT["events"]
        finally:
            _AUDIT["on"] = False


def test_the_traps_work():
    """Without this, a passing test below could mean the traps never fire."""
    blob = io.BytesIO()
    torch.save({"w": torch.ones(2)}, blob)
    data = pickle.dumps(1)
    with pickle_forbidden():
        with pytest.raises(Unpickled):
            torch.load(io.BytesIO(blob.getvalue()), weights_only=False)
        with pytest.raises(Unpickled):
            pickle.loads(data)


def test_audit_hook_sees_unpickling():
    # The real C unpickler (not trapped here) resolving a global raises the audit event.
    _AUDIT["events"].clear()
    _AUDIT["on"] = True
    try:
        pickle.loads(pickle.dumps(io.BytesIO))
    finally:
        _AUDIT["on"] = False
    assert any(e == "pickle.find_class" for e, _ in _AUDIT["events"])


def _write(tmp_path):
    state = sample_state(21)
    path = tmp_path / "ckpt.safetensors"
    fmt.write_file(state, path)
    return state, path


def test_read_file_never_unpickles(tmp_path):
    state, path = _write(tmp_path)
    with pickle_forbidden() as events:
        back = fmt.read_file(path)
        fmt.read_file(path, verify=False)
        manifest = fmt.read_manifest(path)
        fmt.verify_file(path)
    assert events == []
    assert_same_state(state, back)
    assert manifest["checkpoint_id"] == state.checkpoint_id


def test_write_file_never_pickles(tmp_path, monkeypatch):
    def trap(*args, **kwargs):
        raise Unpickled("something tried to pickle while writing a checkpoint")

    for module in (pickle, _pickle):
        for name in ("dumps", "dump", "Pickler"):
            monkeypatch.setattr(module, name, trap)
    monkeypatch.setattr(torch, "save", trap)
    _write(tmp_path)


def test_load_never_unpickles(tmp_path):
    """The public loader (state API) on a full training state, to CPU."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 1,
        "betas": (0.9, 0.999),
        "rng": torch.get_rng_state(),
    }
    path = tmp_path / "train.safetensors"
    tw_triton.save(tw_triton.quantize_state_dict(state), path)
    with pickle_forbidden() as events:
        back = tw_triton.load(path)
    assert events == []
    assert back["step"] == 1 and back["betas"] == (0.9, 0.999)
    assert torch.equal(back["rng"], state["rng"])
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])


def test_tw_inspect_verify_and_export_never_unpickle(tmp_path):
    """The ``tw`` command reads files a user may have downloaded: same guarantee."""
    from tw_triton.cli import main

    state = {"w": torch.randn(64, 96), "step": 3}
    path = tmp_path / "c.safetensors"
    tw_triton.save(tw_triton.quantize_state_dict(state), path)
    out = io.StringIO()
    with pickle_forbidden() as events:
        codes = [
            main(["inspect", str(path)], stdout=out),
            main(["verify", str(path)], stdout=out),
            main(["export", str(path), str(tmp_path / "plain.safetensors")], stdout=out),
        ]
    assert events == []
    assert codes == [0, 0, 0], out.getvalue()
