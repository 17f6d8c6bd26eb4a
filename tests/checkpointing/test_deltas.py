"""Closed-loop deltas (``Checkpointer(delta="closed")``): chains of deltas, each coded against
the reconstruction of the save before it (tw_triton.deltas)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from _read_spy import spy_on_reads

import tw_triton
import tw_triton.format as fmt
from tw_triton.checkpointer import Checkpointer
from tw_triton.deltas import delta_mode
from tw_triton.errors import CheckpointError
from tw_triton.format import read_manifest
from tw_triton.state import dequantize_entries

BITS, BLOCK = 2, 64


def _drift(steps: int, seed: int = 0, shape: tuple[int, int] = (96, 64)) -> list[dict[str, torch.Tensor]]:
    """Weights that move steadily (a random walk plus a trend), as training moves them."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=gen)
    trend = torch.randn(*shape, generator=gen) * 1e-3
    out = []
    for _ in range(steps):
        w = w + trend + torch.randn(*shape, generator=gen) * 2e-4
        out.append({"w": w.clone(), "b": torch.randn(8, generator=gen)})
    return out


def _save_all(directory, states, *, delta, async_write, keyframe_every=100, keep_last=None):
    with Checkpointer(
        directory,
        keyframe_every=keyframe_every,
        keep_last=keep_last,
        rules="default",
        bits=BITS,
        block=BLOCK,
        delta=delta,
        async_write=async_write,
        fsync=False,
    ) as ck:
        for step, s in enumerate(states):
            ck.save(step, model=s)
    return Checkpointer(directory, keep_last=None)


def _expected_closed(states):
    """The reconstructions a closed-loop chain must give, computed with the tensor API."""
    ref = states[0]["w"].clone()
    out = [ref]
    for s in states[1:]:
        q = tw_triton.quantize(s["w"], bits=BITS, block=BLOCK, reference=ref)
        ref = tw_triton.dequantize(q, reference=ref)
        out.append(ref)
    return out


@pytest.mark.parametrize("async_write", [True, False])
def test_closed_loop_chain_decodes_to_the_encoders_reconstruction(tmp_path, async_write):
    states = _drift(7)
    ck = _save_all(tmp_path, states, delta="closed", async_write=async_write)
    infos = ck.infos()
    assert [i.kind for i in infos] == ["keyframe"] + ["delta"] * 6
    for prev, info in zip(infos, infos[1:]):
        assert info.reference_id == prev.checkpoint_id  # each link names the one before it
        assert read_manifest(info.path)["metadata"]["delta_mode"] == "closed"
    want = _expected_closed(states)
    for step in range(7):
        got = ck.load(step)["model"]
        assert torch.equal(got["w"], want[step]), step
        assert torch.equal(got["b"], states[step]["b"])  # small tensors stay exact
    assert ck.latest() == 6
    assert torch.equal(ck.load()["model"]["w"], want[6])


def test_closed_loop_error_stays_bounded_where_open_loop_grows(tmp_path):
    states = _drift(12)
    closed = _save_all(tmp_path / "closed", states, delta="closed", async_write=True)
    opened = _save_all(tmp_path / "open", states, delta="open", async_write=True)
    err_closed = [(closed.load(s)["model"]["w"] - states[s]["w"]).abs().max().item() for s in range(1, 12)]
    err_open = [(opened.load(s)["model"]["w"] - states[s]["w"]).abs().max().item() for s in range(1, 12)]
    # Open loop: the codes span the whole drift since the keyframe, so the error grows.
    assert err_open[-1] > 3 * err_open[0]
    # Closed loop: bounded by one step's change (plus the carried error), whatever the distance.
    assert max(err_closed) < 0.5 * err_open[-1]
    assert err_closed[-1] < 2 * err_closed[0]


def test_async_and_sync_closed_loop_write_the_same_values(tmp_path):
    states = _drift(5, seed=3)
    a = _save_all(tmp_path / "a", states, delta="closed", async_write=True)
    b = _save_all(tmp_path / "b", states, delta="closed", async_write=False)
    for step in range(5):
        assert torch.equal(a.load(step)["model"]["w"], b.load(step)["model"]["w"])


def test_a_corrupt_link_makes_latest_fall_back_before_it(tmp_path, caplog):
    states = _drift(6)
    ck = _save_all(tmp_path, states, delta="closed", async_write=False)
    path = ck.path_for(3)
    data = bytearray(open(path, "rb").read())
    # A byte of the weight codes, which the next links are decoded through: its CRC fails.
    begin = read_manifest(path)["entries"]["model/w"]["buffers"]["codes"]["data_offsets"][0]
    data[8 + int.from_bytes(data[:8], "little") + begin] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert ck.latest() == 2  # 5 and 4 need 3; 3 fails
    assert any("fails verification" in r.message for r in caplog.records)
    want = _expected_closed(states)
    assert torch.equal(ck.load()["model"]["w"], want[2])
    with pytest.raises(CheckpointError, match="step-00000003.*'model/w'"):
        ck.load(5)


def test_retention_keeps_the_whole_chain_a_kept_delta_needs(tmp_path):
    states = _drift(9)
    ck = _save_all(tmp_path, states, delta="closed", async_write=True, keyframe_every=4, keep_last=1)
    # Keyframes at 0, 4, 8: the newest (8) needs nothing; 4..7 are gone once 8 is kept.
    assert ck.steps() == [8]
    ck2 = _save_all(
        tmp_path / "b", states[:7], delta="closed", async_write=True, keyframe_every=4, keep_last=1
    )
    # 6 needs 5 needs 4 (a keyframe): the chain stays, 0..3 go.
    assert ck2.steps() == [4, 5, 6]
    assert torch.equal(ck2.load()["model"]["w"], _expected_closed(states[4:7])[-1])


def test_a_failed_link_write_starts_a_new_keyframe(tmp_path, monkeypatch):
    states = _drift(6)
    real = fmt.write_file
    calls = []

    def failing(q, path, *args, **kwargs):
        calls.append(path)
        if os.path.basename(path).startswith("step-00000002"):
            raise OSError(28, "No space left on device")
        return real(q, path, *args, **kwargs)

    monkeypatch.setattr(fmt, "write_file", failing)
    ck = Checkpointer(
        tmp_path,
        keyframe_every=100,
        keep_last=None,
        rules="default",
        bits=BITS,
        block=BLOCK,
        delta="closed",
        async_write=True,
        fsync=False,
    )
    for step in range(3):
        ck.save(step, model=states[step])
    with pytest.raises(CheckpointError):
        ck.flush()
    ck.save(3, model=states[3])  # must not be a delta of the lost step 2
    ck.close()
    infos = {i.step: i for i in Checkpointer(tmp_path).infos()}
    assert sorted(infos) == [0, 1, 3]
    assert infos[3].kind == "keyframe"
    assert torch.equal(Checkpointer(tmp_path).load(3)["model"]["w"], states[3]["w"])


def test_delta_argument_is_checked(tmp_path):
    assert delta_mode(True) == "open" and delta_mode(False) == "none" and delta_mode("closed") == "closed"
    with pytest.raises(CheckpointError, match="closed"):
        Checkpointer(tmp_path / "never-made", delta="loop")
    assert not (tmp_path / "never-made").exists()


def test_dequantize_entries_decodes_a_subset_and_names_a_missing_path():
    w = torch.randn(64, 64)
    state = {"model": {"a": w, "b": torch.randn(64, 64)}, "step": 3}
    q = tw_triton.quantize_state_dict(state, rules=[("model/*", {"codec": "int8", "min_numel": 0})])
    got = dequantize_entries(q, ["model/a"])
    assert list(got) == ["model/a"]
    assert torch.equal(got["model/a"], tw_triton.dequantize_state_dict(q)["model"]["a"])
    with pytest.raises(CheckpointError, match="model/zz"):
        dequantize_entries(q, ["model/zz"])


@pytest.mark.parametrize(
    "delta,rules,warns",
    [
        ("closed", "smallest", False),
        ("open", "smallest", True),  # 2-bit deltas against the keyframe
        ("open", "small", False),
        ("none", "smallest", True),  # 2-bit weights on their own
        ("none", "small", False),
    ],
)
def test_too_coarse_settings_are_named_in_a_warning(tmp_path, caplog, delta, rules, warns):
    with caplog.at_level(logging.WARNING, logger="tw_triton.rules"):
        with Checkpointer(tmp_path, delta=delta, rules=rules, fsync=False, async_write=False) as ck:
            for step in range(3):
                ck.save(step, model=_drift(1, seed=step)[0])
    said = [r.message for r in caplog.records if "too coarse" in r.message]
    assert len(said) == (1 if warns else 0), said  # once per Checkpointer, not per save
    if warns:
        assert "model/*" in said[0] and str(tmp_path) in said[0]


def test_state_load_follows_a_closed_loop_chain_by_file(tmp_path):
    states = _drift(4)
    ck = _save_all(tmp_path, states, delta="closed", async_write=False)
    want = _expected_closed(states)
    # tw_triton.load with the previous file as the reference: the chain behind it is found
    # by checkpoint id among the files beside it.
    got = tw_triton.load(ck.path_for(3), reference=ck.path_for(2))["model"]["w"]
    assert torch.equal(got, want[3])
    os.unlink(ck.path_for(1))  # a link of the chain is gone
    with pytest.raises(tw_triton.ReferenceMismatchError, match="no checkpoint file"):
        tw_triton.load(ck.path_for(3), reference=ck.path_for(2))


def test_cli_verify_checks_a_closed_loop_delta_against_the_file_before_it(tmp_path):
    import subprocess
    import sys

    ck = _save_all(tmp_path, _drift(3), delta="closed", async_write=False)
    run = subprocess.run(
        [sys.executable, "-m", "tw_triton", "verify", ck.path_for(2), "--reference", ck.path_for(1)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "reference OK" in run.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "tw_triton", "verify", ck.path_for(2), "--reference", ck.path_for(0)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and "step-00000000" in bad.stderr


def test_loading_a_delta_reads_only_what_the_chain_needs_from_earlier_links(tmp_path, monkeypatch):
    states = _drift(3)
    for s in states:
        s["big_exact"] = torch.randn(64, 64)  # not delta-coded (not under model/): never read back
    with Checkpointer(tmp_path, keep_last=None, rules="default", bits=BITS, block=BLOCK, fsync=False) as ck:
        for step, s in enumerate(states):
            ck.save(step, model={"w": s["w"]}, extra=s["big_exact"])
    real = fmt.read_file
    asked = spy_on_reads(monkeypatch)
    got = Checkpointer(tmp_path).load(2)
    assert torch.equal(got["model"]["w"], _expected_closed(states)[2])
    assert torch.equal(got["extra"], states[2]["big_exact"])
    by_file = dict(asked)
    assert by_file["step-00000002.tw.safetensors"] is None  # the one loaded: whole
    assert by_file["step-00000001.tw.safetensors"] == ["model/w"]
    assert by_file["step-00000000.tw.safetensors"] == ["model/w"]
    with pytest.raises(CheckpointError, match="no entry 'model/nope'"):
        real(Checkpointer(tmp_path).path_for(0), entries=["model/nope"])


# ----------------------------------------------------------------------- decoding in place


def _delta_state(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ref = {
        "model": {"w": torch.randn(96, 64, generator=gen).to(dtype), "v": torch.randn(4096, generator=gen)}
    }
    new = {
        "model": {
            k: (t.float() + 1e-3 * torch.randn(t.shape, generator=gen)).to(t.dtype)
            for k, t in ref["model"].items()
        }
    }
    return ref, new


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reuse_reference_decodes_into_the_reference_with_the_same_values(dtype):
    ref, new = _delta_state(dtype)
    q = tw_triton.quantize_state_dict(new, reference=ref, bits=4, block=64)
    want = tw_triton.dequantize_state_dict(q, reference=ref)
    kept = {k: t.clone() for k, t in ref["model"].items()}
    # Default: the caller's reference is left alone.
    assert all(torch.equal(ref["model"][k], kept[k]) for k in kept)
    got = tw_triton.dequantize_state_dict(q, reference=ref, reuse_reference=True)
    for k in kept:
        assert torch.equal(got["model"][k], want["model"][k])
        # Decoded over the reference's own memory: no second buffer.
        assert got["model"][k].data_ptr() == ref["model"][k].data_ptr()


def test_reuse_reference_leaves_tied_reference_tensors_to_fresh_memory():
    gen = torch.Generator().manual_seed(1)
    shared = torch.randn(64, 64, generator=gen)
    ref = {"model": {"a": shared, "b": shared}}  # tied in the reference
    new = {"model": {"a": shared + 1e-3, "b": shared - 1e-3}}  # two entries in the delta
    q = tw_triton.quantize_state_dict(new, reference=ref, bits=8, block=64)
    assert not q.aliases
    want = tw_triton.dequantize_state_dict(q, reference={"model": {"a": shared.clone(), "b": shared.clone()}})
    got = tw_triton.dequantize_state_dict(q, reference=ref, reuse_reference=True)
    # Writing a's result over the shared tensor would have changed what b decodes against.
    assert torch.equal(got["model"]["a"], want["model"]["a"])
    assert torch.equal(got["model"]["b"], want["model"]["b"])


def test_load_decodes_a_delta_over_the_reference_read_from_its_file(tmp_path):
    ref, new = _delta_state()
    tw_triton.save(tw_triton.quantize_state_dict(ref, rules="exact"), tmp_path / "k.tw")
    q = tw_triton.quantize_state_dict(new, reference=tmp_path / "k.tw", bits=4, block=64)
    tw_triton.save(q, tmp_path / "d.tw")
    got = tw_triton.load(tmp_path / "d.tw", reference=tmp_path / "k.tw")
    want = tw_triton.dequantize_state_dict(q, reference=ref)
    for k in ref["model"]:
        assert torch.equal(got["model"][k], want["model"][k])


def test_a_chain_decodes_each_link_into_the_memory_of_the_one_before(tmp_path, monkeypatch):
    states = _drift(5)
    ck = _save_all(tmp_path, states, delta="closed", async_write=False)
    from tw_triton.codecs.blockwise import BlockwiseCodec

    calls = []
    real = BlockwiseCodec.decode_over

    def spy(self, entry, reference, device, context):
        out = real(self, entry, reference, device, context)
        calls.append(out.data_ptr() == reference.data_ptr())
        return out

    monkeypatch.setattr(BlockwiseCodec, "decode_over", spy)
    got = ck.load(4)["model"]["w"]
    assert torch.equal(got, _expected_closed(states)[4])
    assert calls == [True] * 4  # links 1..4, each over its predecessor's "w"


@pytest.mark.parametrize("async_write", [True, False])
def test_closed_loop_reference_advances_in_place_after_the_keyframe(tmp_path, async_write):
    states = _drift(6)
    want = _expected_closed(states)
    seen = []
    with Checkpointer(
        tmp_path,
        keyframe_every=100,
        keep_last=None,
        rules="default",
        bits=BITS,
        block=BLOCK,
        delta="closed",
        async_write=async_write,
        fsync=False,
    ) as ck:
        for step, s in enumerate(states):
            ck.save(step, model=s).result()
            w = ck._chain.reference.tree["model"]["w"]
            seen.append(w.data_ptr())
            # The reference is the reconstruction a loader decodes, save after save.
            assert torch.equal(w, want[step])
    # Each save waited for its write, so the keyframe's snapshot buffer was free to be
    # decoded over by the first advance, and every later one decodes over its own
    # previous tensor: one buffer for the whole cycle.
    assert seen == [seen[0]] * len(states)
    got = Checkpointer(tmp_path, keep_last=None).load(5)["model"]["w"]
    assert torch.equal(got, want[5])


@pytest.mark.parametrize("async_write", [True, False])
def test_a_pooled_closed_loop_reference_is_never_lent_to_a_snapshot(tmp_path, async_write):
    """The keyframe's pooled buffers become the reference's own (the first advance decodes
    over them): a later save's snapshot must never be copied into them."""
    states = _drift(7, shape=(256, 128))  # 128 KiB: pooled
    want = _expected_closed(states)
    with Checkpointer(
        tmp_path,
        keyframe_every=100,
        keep_last=None,
        rules="default",
        bits=BITS,
        block=BLOCK,
        delta="closed",
        async_write=async_write,
        fsync=False,
    ) as ck:
        for step, s in enumerate(states):
            ck.save(step, model=s)
            if step % 2:  # half the saves queue behind the next one
                ck.flush()
                assert torch.equal(ck._chain.reference.tree["model"]["w"], want[step])
        ck.flush()
        assert ck._chain.reference.lease is not None  # still the reference's, not the pool's
    assert torch.equal(Checkpointer(tmp_path).load(6)["model"]["w"], want[6])


def test_the_first_advance_leaves_a_keyframe_that_is_still_being_written_alone():
    from concurrent.futures import Future

    from tw_triton.deltas import advance, make_reference

    states = _drift(2)
    keyframe_w = states[0]["w"].clone()
    for done in (False, True):
        pending: Future = Future()
        if done:
            pending.set_result(0)
        ref = make_reference("k", {"model/w": keyframe_w}, 0, pending, closed=True)
        q = tw_triton.quantize_state_dict(
            {"model": {"w": states[1]["w"]}},
            reference=ref.tree,
            reference_id="k",
            rules="default",
            bits=BITS,
            block=BLOCK,
        )
        before = keyframe_w.clone()
        advance(ref, q)
        w = ref.tree["model"]["w"]
        assert torch.equal(w, _expected_closed(states)[1])
        # Decoded over the keyframe's tensor only once its write is done.
        assert (w.data_ptr() == keyframe_w.data_ptr()) == done
        if not done:
            assert torch.equal(keyframe_w, before)
        keyframe_w = before
