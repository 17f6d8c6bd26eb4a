"""HeaderCache: a file's header is parsed once per cache while the file stays the same, and
a changed file is parsed again (a stale header must never be used)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import tw_triton
from tw_triton import Checkpointer
from tw_triton import format as fmt
from tw_triton.errors import CheckpointError


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 128, generator=g), "b": torch.randn(64, generator=g)}}


def test_a_file_is_parsed_once_per_cache(tmp_path, parses):
    path = tmp_path / "a.tw"
    tw_triton.save(tw_triton.quantize_state_dict(_state(), rules="int8-delta"), path)
    cache = fmt.HeaderCache()
    manifest = fmt.read_manifest(path, headers=cache)
    q = fmt.read_file(path, headers=cache)
    fmt.verify_file(path, headers=cache)
    assert parses == ["a.tw"] and len(cache) == 1
    assert q.checkpoint_id == manifest["checkpoint_id"]
    # Without a cache every call parses.
    fmt.read_manifest(path)
    fmt.read_file(path)
    assert parses == ["a.tw"] * 3


def test_a_replaced_file_is_parsed_again(tmp_path, parses):
    path = tmp_path / "a.tw"
    tw_triton.save(tw_triton.quantize_state_dict(_state(0), rules="exact", checkpoint_id="first"), path)
    cache = fmt.HeaderCache()
    assert fmt.read_manifest(path, headers=cache)["checkpoint_id"] == "first"
    tw_triton.save(
        tw_triton.quantize_state_dict(_state(1), rules="exact", checkpoint_id="second"), path
    )  # temp + rename
    assert fmt.read_manifest(path, headers=cache)["checkpoint_id"] == "second"
    got = fmt.read_file(path, headers=cache)
    assert torch.equal(got.entries["model/w"].buffers["data"], _state(1)["model"]["w"])
    assert len(parses) == 2


def test_a_header_corrupted_in_place_is_not_served_from_the_cache(tmp_path):
    path = tmp_path / "a.tw"
    tw_triton.save(tw_triton.quantize_state_dict(_state()), path)
    cache = fmt.HeaderCache()
    fmt.read_manifest(path, headers=cache)
    st = os.stat(path)
    with open(path, "r+b") as f:  # flip a byte of the manifest, in place
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0x01]))
    # Keep the size; let the clock move the modification time on (ns resolution).
    assert os.stat(path).st_size == st.st_size
    if os.stat(path).st_mtime_ns == st.st_mtime_ns:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with pytest.raises(CheckpointError):
        fmt.read_file(path, headers=cache)


def test_retain_forgets_files_no_longer_listed(tmp_path):
    cache = fmt.HeaderCache()
    paths = []
    for i in range(3):
        p = tmp_path / f"{i}.tw"
        tw_triton.save(tw_triton.quantize_state_dict(_state(i)), p)
        fmt.read_manifest(p, headers=cache)
        paths.append(str(p))
    assert len(cache) == 3
    cache.retain(paths[1:])
    assert len(cache) == 2


def test_loaded_params_are_not_the_cached_manifest(tmp_path):
    path = tmp_path / "a.tw"
    tw_triton.save(tw_triton.quantize_state_dict(_state(), rules=[("model/w", "int8")]), path)
    cache = fmt.HeaderCache()
    q = fmt.read_file(path, headers=cache)
    q.entries["model/w"].params["bits"] = 2
    q.metadata["changed"] = True
    manifest = fmt.read_manifest(path, headers=cache)
    assert manifest["entries"]["model/w"]["params"]["bits"] == 8
    assert "changed" not in manifest["metadata"]


def test_checkpointer_load_parses_each_header_once(tmp_path, parses):
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    with Checkpointer(tmp_path, keyframe_every=10, fsync=False) as ckpt:
        for step in range(3):
            ckpt.save(step, model=model, optimizer=opt)
    parses.clear()
    reader = Checkpointer(tmp_path)
    state = reader.load(2)  # a delta: its chain is steps 0, 1, 2
    assert sorted(parses) == sorted(f"step-{s:08d}.tw.safetensors" for s in range(3))
    parses.clear()
    reader.restore(model=torch.nn.Linear(64, 64), optimizer=torch.optim.AdamW(model.parameters()))
    reader.load(0)
    assert parses == []  # nothing changed on disk: every header came from the cache
    assert state["step"] == 2


@pytest.mark.parametrize("async_write", [True, False])
@pytest.mark.parametrize("delta", [True, False])
def test_a_checkpointer_lists_its_own_files_without_parsing_them(tmp_path, parses, async_write, delta):
    """A save lists the directory (retention) on the loop's thread; the files this
    Checkpointer wrote are listed from what it noted when it encoded them, and the listing
    is the one a fresh Checkpointer gets by parsing every header."""
    state = _state()
    with Checkpointer(
        tmp_path, keyframe_every=3, keep_last=2, async_write=async_write, delta=delta, fsync=False
    ) as ckpt:
        for step in range(7):
            state["model"]["w"].add_(0.01)
            ckpt.save(step, **state)
        ckpt.flush()
        assert parses == []
        assert len(ckpt._dir.headers) == 0  # no header held for the saves' sake
        own = ckpt._dir.scan()
    fresh = Checkpointer(tmp_path)._dir.scan()
    assert own == fresh and len(fresh) >= 2
    kinds = {info.kind for info in fresh.values()}
    assert ("delta" in kinds) == delta and ("standalone" in kinds) == (not delta)


def test_a_file_replaced_behind_the_checkpointer_is_parsed_again(tmp_path, parses):
    with Checkpointer(tmp_path, keyframe_every=10, keep_last=None, fsync=False) as ckpt:
        ckpt.save(0, **_state())
        ckpt.save(1, **_state(1))
        ckpt.flush()
        assert parses == []
        # Another writer puts a different checkpoint at step 1's path.
        other = tmp_path / "other"
        with Checkpointer(other, fsync=False) as writer:
            writer.save(1, model={"w": torch.zeros(3)})
        os.replace(other / "step-00000001.tw.safetensors", tmp_path / "step-00000001.tw.safetensors")
        listed = ckpt._dir.scan()
        assert parses == ["step-00000001.tw.safetensors"]
        assert listed[1] == Checkpointer(tmp_path)._dir.scan()[1]


class _HoldAfterRelease:
    """The writer's slot semaphore, holding the writer thread after its first release: the
    file is renamed into place and its slot free, but its Future not yet done."""

    def __init__(self, slots):
        self._slots = slots
        self.released = threading.Event()
        self.gate = threading.Event()

    def acquire(self, *args, **kwargs):
        return self._slots.acquire(*args, **kwargs)

    def release(self):
        self._slots.release()
        if threading.current_thread() is not threading.main_thread() and not self.released.is_set():
            self.released.set()
            assert self.gate.wait(60), "the test never let the writer go on"


def test_a_file_written_but_not_yet_reported_is_not_parsed(tmp_path, parses):
    """The writer frees a save's slot before it resolves the save's Future, so the next
    save() can list the directory while that file is in place but not collected: the listing
    leaves it to be noted, instead of parsing its header on the loop's thread."""
    state = _state()
    with Checkpointer(tmp_path, keyframe_every=10, keep_last=2, delta=False, fsync=False) as ckpt:
        ckpt.prepare(**state)
        hold = _HoldAfterRelease(ckpt._writer._slots)
        ckpt._writer._slots = hold
        try:
            ckpt.save(0, **state)
            assert hold.released.wait(60)
            ckpt.save(1, **state)  # lists the directory while step 0's Future is pending
        finally:
            hold.gate.set()
        ckpt.flush()
        assert parses == []
        assert sorted(ckpt._dir.scan()) == [0, 1]
