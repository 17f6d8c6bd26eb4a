"""Lightning integration: TwCheckpointIO with ModelCheckpoint, ckpt_path resume, exact dicts, refusals."""

from __future__ import annotations

import math
import os
import pathlib
import threading
from collections import Counter, OrderedDict

import numpy as np
import pytest
import torch

pytest.importorskip(
    "lightning", reason="the Lightning extra is not installed: pip install 'tw-triton[lightning]'"
)

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from safetensors import safe_open  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from tw_triton.errors import CheckpointError, QuantizationError  # noqa: E402
from tw_triton.format import read_manifest  # noqa: E402
from tw_triton.integrations.lightning import TwCheckpointIO, TwPrepareFirstSave  # noqa: E402

BATCHES_PER_EPOCH = 2
EPOCHS = 4


class TinyModule(pl.LightningModule):
    """64 -> 128 -> 1 MLP (the 128x64 weight has 8192 elements: the rules code it), no dropout."""

    def __init__(self, hidden: int = 128, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {
            "optimizer": opt,
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9),
        }


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16 * BATCHES_PER_EPOCH, 64, generator=g)
    y = x[:, :1] * 0.5
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)


def make_trainer(root, io, max_epochs=EPOCHS, **ckpt_kw):
    ckpt = ModelCheckpoint(dirpath=str(root), **{"save_top_k": -1, "save_last": True, **ckpt_kw})
    return pl.Trainer(
        max_epochs=max_epochs,
        plugins=[io],
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        default_root_dir=str(root),
    ), ckpt


def params(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same(a, b, where="checkpoint"):
    """Deep equality with types: containers, keys and order, leaf types and values, tensors bit for bit."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pl-full")
    trainer, _ = make_trainer(root, TwCheckpointIO(rules="default", fsync=False))
    module = TinyModule()
    trainer.fit(module, loader())
    return root, params(module)


def test_each_checkpoint_is_one_tw_file_at_lightnings_path(full_run):
    root, _ = full_run
    names = sorted(os.listdir(root))
    steps = [BATCHES_PER_EPOCH * (e + 1) for e in range(EPOCHS)]
    assert names == sorted([f"epoch={e}-step={s}.ckpt" for e, s in enumerate(steps)] + ["last.ckpt"])
    for name in names:
        manifest = read_manifest(root / name)
        assert manifest["metadata"]["writer"] == "tw_triton.integrations.lightning"
        assert manifest.get("reference_id") is None  # every file stands alone
        with safe_open(str(root / name), "pt") as f:
            assert any(k.startswith("state_dict/") for k in f.keys())


def test_ckpt_path_resume_matches_the_uninterrupted_run(full_run, tmp_path):
    src, want = full_run
    trainer, _ = make_trainer(tmp_path, TwCheckpointIO(rules="default", fsync=False))
    module = TinyModule(hidden=128, lr=1e-2)
    torch.manual_seed(123)
    for p in module.parameters():  # a fresh init that the checkpoint must overwrite
        p.data.normal_()
    trainer.fit(module, loader(), ckpt_path=str(src / "epoch=1-step=4.ckpt"))
    assert trainer.global_step == BATCHES_PER_EPOCH * EPOCHS
    got = params(module)
    for k, v in want.items():
        assert torch.equal(got[k], v), k  # exact rules: bit for bit


def test_a_resume_with_the_callback_decodes_into_the_module(full_run, tmp_path, monkeypatch):
    import tw_triton.integrations.lightning as plmod

    src, want = full_run
    seen = []
    real = plmod.load

    def spy(path, **kwargs):
        state = real(path, **kwargs)
        live = kwargs["into"]["state_dict"].state_dict() if kwargs.get("into") else {}
        seen.append(
            {k: live[k].data_ptr() == t.data_ptr() for k, t in state["state_dict"].items() if k in live}
        )
        return state

    monkeypatch.setattr(plmod, "load", spy)
    io = TwCheckpointIO(rules="default", fsync=False)
    trainer, _ = make_trainer(tmp_path, io)
    trainer.callbacks.append(TwPrepareFirstSave())
    module = TinyModule()
    for p in module.parameters():
        p.data.normal_()
    trainer.fit(module, loader(), ckpt_path=str(src / "epoch=1-step=4.ckpt"))
    assert len(seen) == 1 and seen[0] and all(seen[0].values()), seen  # every tensor in place
    got = params(module)
    for k, v in want.items():
        assert torch.equal(got[k], v), k  # and the run still ends bit for bit
    # The hand-over was for that load only: a later load touches no module.
    assert io.load_target is None
    other = io.load_checkpoint(str(src / "last.ckpt"))
    assert all(other["state_dict"][k].data_ptr() != t.data_ptr() for k, t in module.state_dict().items())


def test_checkpoint_dict_comes_back_exactly(tmp_path):
    trainer, _ = make_trainer(tmp_path / "run", TwCheckpointIO(rules="default", fsync=False), max_epochs=1)
    module = TinyModule()
    trainer.fit(module, loader())
    ckpt = trainer._checkpoint_connector.dump_checkpoint()
    ckpt["extra"] = {
        "tuple": (1, 2.5, None),
        "inf": float("inf"),
        "nan": float("nan"),
        "bytes": b"\x00\xff",
        "np": np.arange(3, dtype=np.int16),
        "npf": np.float32(0.5),
        "od": OrderedDict(b=1, a=2),
        "milestones": Counter({30: 1, 80: 1}),  # a MultiStepLR's, in lr_schedulers
    }
    for async_write in (True, False):
        io = TwCheckpointIO(rules="default", fsync=False, async_write=async_write)
        path = tmp_path / f"x-{async_write}.ckpt"
        io.save_checkpoint(ckpt, path)
        assert_same(io.load_checkpoint(path), ckpt)
        io.teardown()


def test_default_rules_are_smaller_and_resume(full_run, tmp_path):
    src, _ = full_run
    trainer, _ = make_trainer(tmp_path, TwCheckpointIO(fsync=False), max_epochs=1)
    module = TinyModule()
    trainer.fit(module, loader())
    ckpt = trainer._checkpoint_connector.dump_checkpoint()
    tw_path, pt_path = tmp_path / "tw.ckpt", tmp_path / "pt.ckpt"
    TwCheckpointIO(fsync=False, async_write=False).save_checkpoint(ckpt, tw_path)
    torch.save(ckpt, pt_path)
    assert os.path.getsize(tw_path) < os.path.getsize(pt_path)
    loaded = TwCheckpointIO().load_checkpoint(tw_path)
    assert_same(loaded["state_dict"], ckpt["state_dict"])  # the model is exact in every file
    m0, m1 = ckpt["optimizer_states"][0]["state"], loaded["optimizer_states"][0]["state"]
    big = [i for i, s in m0.items() if s["exp_avg"].numel() >= 4096]
    assert big and not all(torch.equal(m0[i]["exp_avg"], m1[i]["exp_avg"]) for i in big)  # coded
    # Resuming from a default-rules file runs to the end.
    trainer2, _ = make_trainer(tmp_path / "r", TwCheckpointIO(fsync=False), max_epochs=2)
    trainer2.fit(TinyModule(), loader(), ckpt_path=str(tw_path))
    assert trainer2.global_step == 2 * BATCHES_PER_EPOCH


def test_model_checkpoint_top_k_removes_through_the_plugin(tmp_path):
    trainer, cb = make_trainer(tmp_path, TwCheckpointIO(fsync=False), save_top_k=2, monitor="train_loss")
    trainer.fit(TinyModule(), loader())
    kept = sorted(n for n in os.listdir(tmp_path) if n != "last.ckpt")
    assert len(kept) == 2
    assert {os.path.basename(p) for p in cb.best_k_models} == set(kept)
    best = TwCheckpointIO().load_checkpoint(cb.best_model_path)
    assert best["global_step"] > 0


def test_unsupported_entry_is_refused_naming_it(tmp_path):
    ckpt = {
        "state_dict": OrderedDict(w=torch.ones(3)),
        "hyper_parameters": {"data_dir": pathlib.Path("/data")},
    }
    io = TwCheckpointIO(fsync=False)
    path = tmp_path / "bad.ckpt"
    with pytest.raises(QuantizationError, match=r"bad\.ckpt.*'hyper_parameters/data_dir'"):
        io.save_checkpoint(ckpt, path)
    io.teardown()
    assert not path.exists()


@pytest.mark.parametrize("rules", ["nonsense", [("*", "no-such-codec")]])
def test_rules_that_do_not_resolve_are_refused_when_the_plugin_is_made(rules):
    # They were refused at the first save, after an epoch, with a hint about plain values.
    with pytest.raises(QuantizationError, match="nonsense|no-such-codec") as info:
        TwCheckpointIO(rules=rules)
    assert "on_save_checkpoint" not in str(info.value)


def test_bits_or_block_no_save_could_use_are_refused_when_the_plugin_is_made():
    with pytest.raises(QuantizationError, match="bits must be one of"):
        TwCheckpointIO(bits=3)


def test_temp_files_of_killed_writes_go_unless_another_writer_holds_the_directory(tmp_path):
    # What a write killed mid-way leaves beside the checkpoint (format.write_file's temp).
    leftover = tmp_path / ".last.ckpt.0123456789abcdef.tmp"
    other = tmp_path / "notes.tmp"
    leftover.write_bytes(b"x")
    other.write_bytes(b"x")
    holder = TwCheckpointIO(fsync=False)
    holder.save_checkpoint({"a": torch.ones(2)}, tmp_path / "a.ckpt")
    assert not leftover.exists() and other.exists()
    leftover.write_bytes(b"x")  # as if the holder's write were in flight
    second = TwCheckpointIO(fsync=False)
    second.save_checkpoint({"b": torch.ones(2)}, tmp_path / "b.ckpt")
    assert leftover.exists()  # the holder may still be writing it
    second.teardown()
    holder.teardown()


def test_load_errors_and_remote_paths(tmp_path):
    io = TwCheckpointIO()
    with pytest.raises(FileNotFoundError, match="not found"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    with pytest.raises(Exception, match="local files only"):
        io.save_checkpoint({"a": 1}, "s3://bucket/x.ckpt")
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"a": 1}, tmp_path / "x.ckpt", storage_options={"x": 1})


def test_a_directory_that_cannot_be_made_is_a_checkpoint_io_error_naming_it(tmp_path):
    # A dirpath under a file raised the bare FileExistsError of os.makedirs, not a
    # tw_triton error naming the directory as a failed write is.
    import errno

    from tw_triton.errors import CheckpointIOError

    (tmp_path / "file").write_bytes(b"")
    io = TwCheckpointIO(fsync=False)
    with pytest.raises(CheckpointIOError, match="cannot be made or used as a checkpoint directory") as err:
        io.save_checkpoint({"a": 1}, tmp_path / "file" / "runs" / "last.ckpt")
    assert err.value.errno == errno.ENOTDIR and str(tmp_path / "file" / "runs") in str(err.value)
    io.teardown()


def test_a_failed_background_write_is_raised_naming_the_file(tmp_path):
    io = TwCheckpointIO(fsync=False)
    target = tmp_path / "taken.ckpt"
    target.mkdir()  # the final rename onto a directory fails on the writer thread
    io.save_checkpoint({"state_dict": OrderedDict(w=torch.ones(4))}, target)
    with pytest.raises(CheckpointError, match="taken.ckpt"):
        io.flush()
    io.teardown()
    io.save_checkpoint({"a": 1}, tmp_path / "ok.ckpt")  # the plugin is usable again
    io.teardown()
    assert io.load_checkpoint(tmp_path / "ok.ckpt") == {"a": 1}


def test_a_checkpoint_is_kept_when_the_write_after_it_already_failed(tmp_path):
    # The order the fit above leaves to chance: the later write has failed (and landed as
    # a failure) before ModelCheckpoint removes the older file.
    from concurrent.futures import wait

    io = TwCheckpointIO(fsync=False)
    io.save_checkpoint({"state_dict": OrderedDict(w=torch.ones(4))}, tmp_path / "old.ckpt")
    io.flush()
    (tmp_path / "new.ckpt").mkdir()  # the final rename onto a directory fails
    io.save_checkpoint({"state_dict": OrderedDict(w=torch.zeros(4))}, tmp_path / "new.ckpt")
    wait(list(io._pending.values()))
    io.remove_checkpoint(tmp_path / "old.ckpt")
    assert (tmp_path / "old.ckpt").is_file()
    with pytest.raises(CheckpointError, match="new.ckpt"):
        io.flush()
    io.teardown()


def test_the_checkpoint_before_goes_only_once_the_next_one_is_on_disk(tmp_path, monkeypatch, caplog):
    # save_top_k=1 removes the older file right after the newer one's save_checkpoint
    # returned, while it was still being written: a write that never landed (a full disk
    # here; a kill while writing alike) left no checkpoint at all.
    from tw_triton import format as fmt

    real = fmt.write_file
    real_remove = TwCheckpointIO.remove_checkpoint
    removal_asked = threading.Event()

    def remove_checkpoint(self, path):
        real_remove(self, path)
        removal_asked.set()

    def full_disk_at_step_4(qstate, path, **kw):
        if "step=4" in os.path.basename(path):
            # The order under test: the older file's removal is asked for while this write
            # is still going (the other order is the test above).
            removal_asked.wait(30)
            raise OSError(28, "No space left on device")
        return real(qstate, path, **kw)

    monkeypatch.setattr(fmt, "write_file", full_disk_at_step_4)
    monkeypatch.setattr(TwCheckpointIO, "remove_checkpoint", remove_checkpoint)
    trainer, _ = make_trainer(
        tmp_path, TwCheckpointIO(fsync=False), max_epochs=2, save_top_k=1, save_last=False
    )
    with pytest.raises(CheckpointError, match=r"step=4\.ckpt"):
        trainer.fit(TinyModule(), loader())
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["epoch=0-step=2.ckpt"]
    assert TwCheckpointIO().load_checkpoint(tmp_path / "epoch=0-step=2.ckpt")["global_step"] == 2
    assert "kept" in caplog.text and "epoch=0-step=2.ckpt" in caplog.text
    # Without a failure the older one goes, after the newer one landed.
    trainer, cb = make_trainer(
        tmp_path / "ok", TwCheckpointIO(fsync=False), max_epochs=2, save_top_k=1, save_last=False
    )
    trainer.fit(TinyModule(), loader())
    assert os.listdir(tmp_path / "ok") == ["epoch=1-step=4.ckpt"]


def test_copies_reuse_pooled_buffers_only_after_their_write(tmp_path, monkeypatch):
    """Every save's copy goes into the pool; a buffer comes back only once its write is
    done, so files written late still hold their own values."""
    import threading

    from tw_triton import format as fmt

    real = fmt.write_file
    permits = threading.Semaphore(0)

    def held_write(qstate, path, **kw):
        assert permits.acquire(timeout=20), "the test never let a write go"
        return real(qstate, path, **kw)

    monkeypatch.setattr(fmt, "write_file", held_write)
    io = TwCheckpointIO(fsync=False, rules="default", max_pending=2)
    big = 1 << 15  # fp32 elements: 128 KiB tensors, pooled
    for k in range(6):
        io.save_checkpoint(
            {"state_dict": OrderedDict(w=torch.full((big,), float(k)), v=torch.arange(big) + k)},
            tmp_path / f"{k}.ckpt",
        )
        if k:
            permits.release()  # the previous save may be written now; this one waits
    permits.release()
    io.flush()
    pool = io.save_pool.pool
    assert pool.reused > 0, "nothing was reused: the test could not see an early release"
    assert pool.held_bytes <= 3 * io.save_pool.largest
    for k in range(6):
        got = io.load_checkpoint(tmp_path / f"{k}.ckpt")["state_dict"]
        assert torch.equal(got["w"], torch.full((big,), float(k))) and torch.equal(
            got["v"], torch.arange(big) + k
        )
    io.teardown()
    assert pool.held_bytes == 0
    monkeypatch.undo()
    off = TwCheckpointIO(fsync=False, snapshot_pool_bytes=0)
    off.save_checkpoint({"w": torch.ones(big)}, tmp_path / "off.ckpt")
    off.teardown()
    assert off.save_pool.pool is None and torch.equal(
        off.load_checkpoint(tmp_path / "off.ckpt")["w"], torch.ones(big)
    )
    with pytest.raises(CheckpointError, match="snapshot_pool_bytes"):
        TwCheckpointIO(snapshot_pool_bytes=-1)


def test_the_callback_prepares_the_first_save_after_the_first_batch(tmp_path, monkeypatch):
    calls, first = [], {}
    real_prepare, real_save = TwCheckpointIO.prepare, TwCheckpointIO.save_checkpoint

    def prepare(self, checkpoint):
        n = real_prepare(self, checkpoint)
        calls.append((n, bool(checkpoint["optimizer_states"][0]["state"])))  # AdamW's moments exist
        return n

    def save(self, checkpoint, path, storage_options=None):
        real_save(self, checkpoint, path, storage_options)
        first.setdefault("reused", self.save_pool.pool.reused)

    monkeypatch.setattr(TwCheckpointIO, "prepare", prepare)
    monkeypatch.setattr(TwCheckpointIO, "save_checkpoint", save)
    io = TwCheckpointIO(fsync=False)
    trainer, _ = make_trainer(tmp_path, io, max_epochs=2)
    trainer.callbacks.append(TwPrepareFirstSave())
    module = TinyModule(hidden=512)  # 512 x 64 fp32: 128 KiB, pooled
    trainer.fit(module, loader())
    assert len(calls) == 1 and calls[0][0] > 0 and calls[0][1], calls
    # The big weight and its two moments took reserved buffers in the first save.
    assert first["reused"] >= 3
    monkeypatch.undo()
    assert io.prepare({"w": torch.ones(4)}) == 0  # too small to pool: nothing to reserve
    off = TwCheckpointIO(snapshot_pool_bytes=0)
    assert off.prepare({"w": torch.ones(1 << 16)}) == 0


class _StepLoss(TinyModule):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("step_loss", loss, on_step=True, on_epoch=False)
        return loss


def test_a_name_whose_write_is_in_flight_counts_as_taken(tmp_path, monkeypatch):
    """ModelCheckpoint adds -v1, -v2 to a name that exists; a name whose background write
    has not landed yet exists too, or the next checkpoint overwrites it (one file for three
    checkpoints). The writes are held until training ends, so each name is chosen while
    the one before is still in flight."""
    import threading

    from tw_triton import format as fmt

    real, landed = fmt.write_file, threading.Event()

    def held_write(qstate, path, **kw):
        landed.wait(timeout=20)  # a safety net only: the test releases them at train end
        return real(qstate, path, **kw)

    class Release(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            landed.set()

    monkeypatch.setattr(fmt, "write_file", held_write)
    io = TwCheckpointIO(fsync=False, max_pending=8)
    trainer, cb = make_trainer(
        tmp_path,
        io,
        max_epochs=1,
        save_last=False,
        monitor="step_loss",
        filename="{epoch}",
        every_n_train_steps=1,
    )
    trainer.callbacks.extend([TwPrepareFirstSave(), Release()])
    trainer.fit(_StepLoss(), loader())
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-v1.ckpt", "epoch=0.ckpt"]
    assert {os.path.basename(p) for p in cb.best_k_models} == {"epoch=0-v1.ckpt", "epoch=0.ckpt"}
    steps = {name: io.load_checkpoint(tmp_path / name)["global_step"] for name in os.listdir(tmp_path)}
    assert steps == {"epoch=0.ckpt": 1, "epoch=0-v1.ckpt": 2}
    assert "file_exists" not in vars(cb)  # given back at teardown


def test_prepare_runs_the_full_collection_that_setup_brings_close(gc_generations):
    TwCheckpointIO(fsync=False).prepare({"w": torch.ones(1 << 16)})
    assert 2 in gc_generations


from _readme import readme_example  # noqa: E402


def test_readme_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "readme"}
    exec(compile(readme_example("Lightning"), "README.md", "exec"), scope)
    assert scope["state"]["global_step"] == 20  # 5 epochs of 4 batches: resumed after 3
    assert sorted(os.listdir(tmp_path / "pl-run")) == ["epoch=4-step=20.ckpt", "last.ckpt"]
