"""A keyframe that finds no pooled memory to copy into (the first save of a process without
``prepare``) is encoded in ``save`` instead of copied: the moments' codes are written, not
a full copy of them. The files and every later save are those of the copy path; the writer
thread then faults in the buffers the next save's copy needs."""

from __future__ import annotations

import pytest
import torch

from tw_triton import Checkpointer
from tw_triton import save_pipeline as pipeline_mod
from tw_triton.format import read_manifest
from tw_triton.snapshot_pool import MIN_POOLED_BYTES


class Tied(torch.nn.Module):
    """Two large layers and a weight shared by two names (as a tied embedding is)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(256, 256)
        self.b = torch.nn.Linear(256, 256)
        self.c = torch.nn.Linear(256, 256)
        self.c.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def _run() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, 0)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, k: int) -> None:
    opt.zero_grad()
    model(torch.full((4, 256), 0.1 * (k + 1))).square().mean().backward()
    opt.step()


def _count_encodes_here(monkeypatch) -> list[bool]:
    """Record, per save, whether it encoded in ``save`` (True) or queued a copy (False)."""
    calls: list[bool] = []
    real_here, real_queue = pipeline_mod.SavePipeline.encode_here, pipeline_mod.SavePipeline.queue_snapshot

    def here(self, job, *args, **kwargs):
        calls[-1] = True
        return real_here(self, job, *args, **kwargs)

    def queue(self, job):
        calls.append(False)
        return real_queue(self, job)

    monkeypatch.setattr(pipeline_mod.SavePipeline, "encode_here", here)
    monkeypatch.setattr(pipeline_mod.SavePipeline, "queue_snapshot", queue)
    return calls


def _same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


@pytest.mark.parametrize("delta_mode", ["open", "closed"])
def test_a_cold_keyframe_and_its_chain_load_as_the_copy_paths(tmp_path, monkeypatch, delta_mode):
    calls = _count_encodes_here(monkeypatch)
    runs = {}
    for name, prepare in (("cold", False), ("prepared", True)):
        model, opt = _run()
        ckpt = Checkpointer(tmp_path / name, fsync=False, keyframe_every=3, keep_last=None, delta=delta_mode)
        if prepare:
            ckpt.prepare(model=model, optimizer=opt)
        for step in range(5):
            ckpt.save(step, model=model, optimizer=opt)
            # Each save written before the next: a keyframe that found the buffers of a
            # save still being written would be cold too (and encoded in save, rightly).
            ckpt.flush()
            _step(model, opt, step + 1)
        ckpt.close()
        runs[name] = [Checkpointer(tmp_path / name).load(s) for s in range(5)]
        # Without prepare only the first keyframe found no memory; the second (step 3)
        # copies into the buffers the writer faulted in. With prepare every save copies.
        assert calls == ([True, False, False, False, False] if not prepare else [False] * 5), name
        calls.clear()
    for step, (cold, prepared) in enumerate(zip(runs["cold"], runs["prepared"])):
        _same(cold["model"], prepared["model"], f"step {step} model")
        _same(cold["optimizer"], prepared["optimizer"], f"step {step} optimizer")
        assert cold["model"]["a.weight"].data_ptr() != 0


def test_the_live_state_may_change_as_soon_as_a_cold_save_returns(tmp_path, monkeypatch):
    calls = _count_encodes_here(monkeypatch)
    model, opt = _run()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {(i, n): t.clone() for i, s in opt.state_dict()["state"].items() for n, t in s.items()}
    with Checkpointer(tmp_path, fsync=False) as ckpt:
        ckpt.save(0, model=model, optimizer=opt)
        assert calls == [True]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
            for s in opt.state.values():
                s["exp_avg"].add_(1.0)
                s["exp_avg_sq"].mul_(4.0)
        ckpt.flush()
        got = ckpt.load(0)
    for k, v in want.items():
        assert torch.equal(got["model"][k], v), k
    plain = Checkpointer(tmp_path / "ref", fsync=False, async_write=False)
    for (i, n), t in moments.items():
        # The moments are lossy-coded: compare with a synchronous save of the same values.
        opt.state[opt.param_groups[0]["params"][i]][n].copy_(t)
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(want[k])
    plain.save(0, model=model, optimizer=opt)
    plain.close()
    _same(got["optimizer"], Checkpointer(tmp_path / "ref").load(0)["optimizer"], "optimizer")


def test_after_a_cold_keyframe_the_writer_faults_in_the_next_copy(tmp_path, monkeypatch):
    calls = _count_encodes_here(monkeypatch)
    model, opt = _run()
    ckpt = Checkpointer(tmp_path, fsync=False)
    tensors = [*model.state_dict().values(), *(t for s in opt.state.values() for t in s.values())]
    sizes = [t.nbytes for t in tensors]
    assert not ckpt._saves.warm_for(sizes)
    ckpt.save(0, model=model, optimizer=opt).result()
    ckpt._writer.flush()  # the buffers are faulted in on the writer thread after the write
    assert ckpt._saves.warm_for(sizes)
    pooled = [n for n in sizes if n >= MIN_POOLED_BYTES]
    assert ckpt._saves.pool.reusable_bytes(sizes) == sum(pooled)
    allocated = ckpt._saves.pool.allocated
    _step(model, opt, 1)
    ckpt.save(1, model=model, optimizer=opt).result()
    # The delta's whole copy came from those buffers: nothing new for the snapshot (the
    # writer's codes of the two weights and of the two second moments, log2-temporal in a
    # delta, may be new).
    assert calls == [True, False]
    assert ckpt._saves.pool.allocated - allocated <= 4
    ckpt.close()


def test_without_a_pool_every_keyframe_is_encoded_in_save_and_deltas_copy(tmp_path, monkeypatch):
    calls = _count_encodes_here(monkeypatch)
    model, opt = _run()
    with Checkpointer(tmp_path, fsync=False, keyframe_every=2, snapshot_pool_bytes=0) as ckpt:
        for step in range(4):
            ckpt.save(step, model=model, optimizer=opt)
            _step(model, opt, step + 1)
    assert calls == [True, False, True, False]
    assert ckpt.pool_bytes == 0
    loaded = Checkpointer(tmp_path).load(3)
    assert loaded["model"]["a.weight"].shape == (256, 256)


def test_a_small_state_copies_even_on_the_first_save(tmp_path, monkeypatch):
    """Nothing large enough to be pooled: the copy comes from the heap, no faults to save."""
    calls = _count_encodes_here(monkeypatch)
    with Checkpointer(tmp_path, fsync=False) as ckpt:
        ckpt.save(0, model={"w": torch.ones(16, 16)})
    assert calls == [False]


@pytest.mark.parametrize("async_write", [True, False])
def test_a_tied_weight_is_delta_coded_after_a_keyframe_encoded_in_save(tmp_path, async_write):
    """A keyframe encoded in ``save`` (cold, or ``async_write=False``) keeps the tied
    weight's alias among the tensors the next deltas are coded against."""
    model, opt = _run()
    with Checkpointer(tmp_path, fsync=False, async_write=async_write) as ckpt:
        ckpt.save(0, model=model, optimizer=opt)
        _step(model, opt, 1)
        ckpt.save(1, model=model, optimizer=opt)
        ckpt.flush()
        got = ckpt.load(1)
        manifest = read_manifest(ckpt.path_for(1))
    assert manifest["reference_id"] is not None  # a delta, not a standalone save
    assert manifest["entries"]["model/a.weight"]["codec"] == "blockwise"
    assert got["model"]["c.weight"].data_ptr() == got["model"]["a.weight"].data_ptr()
    err = (got["model"]["a.weight"] - model.a.weight.detach()).abs().max()
    assert 0 < err < 0.02  # a coarse delta of one AdamW step of 1e-2


def test_a_delta_right_after_the_keyframe_waits_for_the_warm_up_not_for_fresh_memory(tmp_path, monkeypatch):
    """The first delta saved as soon as its cold keyframe is written finds the writer still
    faulting in its buffers: it waits for them rather than copying into fresh memory."""
    import threading

    from tw_triton.snapshot_pool import SavePool

    started, waited, release = threading.Event(), threading.Event(), threading.Event()
    real_reserve, real_wait = SavePool.reserve_beside, pipeline_mod.wait_futures
    ckpt: Checkpointer | None = None

    def held(self, sizes):
        # The warm-up is held until the delta's save() waits for it (or gives up on it): a
        # sleep here would leave it to the machine's speed whether it still runs by then.
        started.set()
        assert release.wait(120), "the warm-up was never released"
        return real_reserve(self, sizes)

    def wait(fs, *args, **kwargs):
        warming = ckpt._pipeline.warming if ckpt is not None else None
        if warming is not None and warming[1] in fs:
            waited.set()
            release.set()
        return real_wait(fs, *args, **kwargs)

    monkeypatch.setattr(SavePool, "reserve_beside", held)
    monkeypatch.setattr(pipeline_mod, "wait_futures", wait)
    model, opt = _run()
    ckpt = Checkpointer(tmp_path, fsync=False)
    ckpt.save(0, model=model, optimizer=opt).result()
    assert started.wait(10)
    allocated = ckpt._saves.pool.allocated  # the warm-up's buffers are not counted yet
    _step(model, opt, 1)
    try:
        delta = ckpt.save(1, model=model, optimizer=opt)
    finally:
        release.set()  # never leave the writer thread held
    assert waited.is_set(), "the delta's save() copied without waiting for the warm-up"
    delta.result()
    tensors = [*model.state_dict().values(), *(t for s in opt.state.values() for t in s.values())]
    pooled = sum(1 for t in {id(t): t for t in tensors}.values() if t.nbytes >= MIN_POOLED_BYTES)
    # The warm-up's buffers (the tied weight is one tensor, counted once by the copy but
    # twice by the sizes) and the writer's codes of the two weights, no copy into fresh ones.
    assert ckpt._saves.pool.allocated - allocated <= (pooled + 1) + 2
    # Every tensor the delta copies lands in a warmed buffer (``pooled`` counts the tied
    # weight twice: state_dict() gives each name its own tensor object).
    assert ckpt._saves.pool.reused >= pooled - 1
    ckpt.close()
