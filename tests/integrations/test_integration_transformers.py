"""Hugging Face Trainer integration: tw_triton checkpoints, retention, resume vs an uninterrupted run.

A tiny BertForSequenceClassification built from a BertConfig (no downloads) trains 8 steps
on random token ids, saving every 2 steps.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

_HF_MISSING = "the Hugging Face extra is not installed: pip install 'tw-triton[hf]'"
transformers = pytest.importorskip("transformers", reason=_HF_MISSING)
pytest.importorskip("accelerate", reason=_HF_MISSING)  # Trainer needs it

from safetensors import safe_open  # noqa: E402

from tw_triton.checkpointer import parse_checkpoint_name  # noqa: E402
from tw_triton.errors import CheckpointError, QuantizationError, TwTritonError  # noqa: E402
from tw_triton.format import read_manifest  # noqa: E402
from tw_triton.integrations.transformers import (  # noqa: E402
    POINTER_NAME,
    TW_SUBDIR,
    TwTrainer,
    load_checkpoint_state,
)

STEPS = 8
SAVE_EVERY = 2
VOCAB = 128
SEQ = 16


def tiny_bert(seed: int = 0) -> torch.nn.Module:
    # hidden 64 / intermediate 128 / vocab 128: the attention, FFN and embedding matrices
    # have >= 4096 elements, so the default rules delta-code them.
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=SEQ,
        num_labels=2,
    )
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(config)


def dataset(n: int = 64) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    labels = (ids[:, 0] % 2).long()  # learnable: the label is a function of the first token
    return [
        {"input_ids": ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": labels[i]}
        for i in range(n)
    ]


def make_trainer(out, *, tw_options=None, cls=TwTrainer, max_steps=STEPS, model=None, **args):
    targs = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        save_steps=SAVE_EVERY,
        save_strategy="steps",
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **args,
    )
    kw = {} if cls is transformers.Trainer else {"tw_options": tw_options}
    return cls(model=tiny_bert() if model is None else model, args=targs, train_dataset=dataset(), **kw)


class StopAt(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def params(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """8 steps, a checkpoint every 2; keyframes at steps 2 and 6, deltas at 4 and 8.

    rules="default": the optimizer is exact and keyframes are exact, so resuming from a
    keyframe must give the same run bit for bit.
    """
    out = tmp_path_factory.mktemp("hf-full")
    trainer = make_trainer(out, tw_options={"keyframe_every": 2, "rules": "default", "fsync": False})
    trainer.train()
    return out, losses(trainer), params(trainer)


def test_checkpoint_folders_hold_tw_files_and_no_pickles(uninterrupted):
    out, _, _ = uninterrupted
    folders = sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))
    assert folders == [f"checkpoint-{s}" for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)]
    for d in folders:
        names = set(os.listdir(out / d))
        assert names == {POINTER_NAME, "trainer_state.json"}, names
    tw = out / TW_SUBDIR
    kinds = {}
    for name in os.listdir(tw):
        step = parse_checkpoint_name(name)
        assert step is not None, name
        manifest = read_manifest(tw / name)
        kinds[step] = manifest["metadata"]["kind"]
        with safe_open(str(tw / name), "pt") as f:  # stock safetensors opens every file
            assert len(list(f.keys())) > 0
    assert kinds == {2: "keyframe", 4: "delta", 6: "keyframe", 8: "delta"}
    state = load_checkpoint_state(out / "checkpoint-4")
    assert set(state) >= {"step", "model", "optimizer", "scheduler", "rng"}
    assert state["step"] == 4
    assert state["scheduler"]["last_epoch"] == 4


def test_resume_from_keyframe_is_bit_identical(uninterrupted, tmp_path):
    src, full_losses, full_params = uninterrupted
    trainer = make_trainer(tmp_path, tw_options={"keyframe_every": 2, "rules": "default", "fsync": False})
    trainer.train(resume_from_checkpoint=str(src / "checkpoint-6"))
    assert trainer.state.global_step == STEPS
    got = params(trainer)
    for k, v in full_params.items():
        assert torch.equal(got[k], v), k
    assert {s: v for s, v in losses(trainer).items() if s > 6} == {
        s: v for s, v in full_losses.items() if s > 6
    }


def test_resume_decodes_the_weights_into_the_models_own_memory(uninterrupted, tmp_path, monkeypatch):
    import tw_triton.integrations.transformers as hf

    src, _, full_params = uninterrupted
    seen = []
    real = hf.load_checkpoint_state

    def spy(checkpoint_dir, **kwargs):
        state = real(checkpoint_dir, **kwargs)
        live = kwargs["into"]["model"].state_dict()
        seen.append({k: (state["model"][k].data_ptr(), live[k].data_ptr()) for k in state["model"]})
        return state

    monkeypatch.setattr(hf, "load_checkpoint_state", spy)
    trainer = make_trainer(tmp_path, tw_options={"keyframe_every": 2, "rules": "default", "fsync": False})
    trainer.train(resume_from_checkpoint=str(src / "checkpoint-4"))  # a delta: decoded over its keyframe
    assert len(seen) == 1
    shared = [k for k, (loaded, live) in seen[0].items() if loaded == live]
    # Every tensor of the model was read, or decoded over its keyframe, in place.
    assert sorted(shared) == sorted(full_params)


def test_resume_from_delta_is_close(uninterrupted, tmp_path):
    src, full_losses, full_params = uninterrupted
    trainer = make_trainer(tmp_path, tw_options={"keyframe_every": 2, "rules": "default", "fsync": False})
    trainer.train(resume_from_checkpoint=str(src / "checkpoint-4"))
    got = params(trainer)
    # int8 blockwise delta of the weights at step 4, then 4 more AdamW steps (lr 1e-3).
    worst = max((got[k] - v).abs().max().item() for k, v in full_params.items())
    assert worst < 1e-3, worst
    resumed = losses(trainer)
    for s in range(5, STEPS + 1):
        assert resumed[s] == pytest.approx(full_losses[s], rel=1e-3, abs=1e-4), s


def test_resume_true_with_library_default_rules(tmp_path):
    # An interrupted run: the same schedule (max_steps 8), stopped after step 4.
    first = make_trainer(tmp_path, tw_options={"fsync": False})
    first.add_callback(StopAt(4))
    first.train()
    assert first.state.global_step == 4
    second = make_trainer(tmp_path, tw_options={"fsync": False})
    second.train(resume_from_checkpoint=True)  # finds checkpoint-4 in output_dir
    assert second.state.global_step == STEPS
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("checkpoint-")) == [
        f"checkpoint-{s}" for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)
    ]
    ref = make_trainer(tmp_path / "ref", tw_options={"fsync": False})
    ref.train()
    a, b = losses(second), losses(ref)
    for s in range(5, STEPS + 1):
        # Library default rules code the optimizer moments: close, not bit for bit.
        assert a[s] == pytest.approx(b[s], rel=2e-2), s


def test_resume_true_skips_a_newest_folder_whose_file_was_never_written(uninterrupted, tmp_path, caplog):
    # A run killed while step 8's file was still being written (async): checkpoint-8 has its
    # pointer and trainer_state.json, the file is not there.
    src, full_losses, full_params = uninterrupted
    run = tmp_path / "run"
    shutil.copytree(src, run)
    (run / TW_SUBDIR / "step-00000008.tw.safetensors").unlink()
    trainer = make_trainer(run, tw_options={"keyframe_every": 2, "rules": "default", "fsync": False})
    with caplog.at_level(logging.WARNING, logger="tw_triton.integrations.transformers"):
        trainer.train(resume_from_checkpoint=True)  # checkpoint-6, a keyframe
    assert "checkpoint-8" in caplog.text and "does not exist" in caplog.text
    assert trainer.state.global_step == STEPS
    got = params(trainer)
    for k, v in full_params.items():
        assert torch.equal(got[k], v), k
    assert losses(trainer)[STEPS] == full_losses[STEPS]


def test_with_save_total_limit_1_a_failed_save_does_not_cost_the_checkpoint_before_it(tmp_path, monkeypatch):
    # Trainer deletes the older checkpoint-N folders as soon as _save_checkpoint returns.
    # With one kept, the folder before went while the new file was still being written, so
    # a save that never landed (a full disk here; a kill while writing alike) left nothing
    # to resume from.
    from tw_triton import format as fmt

    real = fmt.write_file

    def full_disk_at_step_4(qstate, path, **kw):
        if os.path.basename(path).startswith("step-00000004"):
            raise OSError(28, "No space left on device")
        return real(qstate, path, **kw)

    monkeypatch.setattr(fmt, "write_file", full_disk_at_step_4)
    trainer = make_trainer(tmp_path, save_total_limit=1, tw_options={"fsync": False, "rules": "default"})
    with pytest.raises(CheckpointError, match="step-00000004"):
        trainer.train()
    monkeypatch.undo()
    assert load_checkpoint_state(tmp_path / "checkpoint-2")["step"] == 2
    resumed = make_trainer(tmp_path, save_total_limit=1, tw_options={"fsync": False, "rules": "default"})
    resumed.train(resume_from_checkpoint=True)  # passes over checkpoint-4, whose file is not there
    assert resumed.state.global_step == STEPS


def test_with_save_total_limit_1_a_save_does_not_wait_and_the_folder_before_stays_until_its_file_lands(
    tmp_path, monkeypatch
):
    # save_total_limit=1 used to make each save wait for its own file (a flush), since
    # Trainer deletes the folder before right after _save_checkpoint. Now the save returns
    # while its file is written and that folder goes once the file is on disk.
    import threading

    from tw_triton import format as fmt

    real_write, real_rmtree = fmt.write_file, shutil.rmtree
    step_4_returned = threading.Event()
    tw_dir = tmp_path / TW_SUBDIR
    removed = []  # (folder removed, the files on disk at that moment)
    seen = {}  # step -> (checkpoint folders, whether its file is on disk) after its save returned

    def write(qstate, path, **kw):
        if os.path.basename(path).startswith("step-00000004"):
            assert step_4_returned.wait(timeout=20)  # a safety net: on_save(4) sets it
        return real_write(qstate, path, **kw)

    def rmtree(path, *args, **kw):
        removed.append((os.path.basename(path), sorted(os.listdir(tw_dir))))
        return real_rmtree(path, *args, **kw)

    class Watch(transformers.TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            step = state.global_step
            folders = sorted(d for d in os.listdir(tmp_path) if d.startswith("checkpoint-"))
            seen[step] = (folders, os.path.exists(tw_dir / f"step-{step:08d}.tw.safetensors"))
            if step == 4:
                step_4_returned.set()

    monkeypatch.setattr(fmt, "write_file", write)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    trainer = make_trainer(tmp_path, save_total_limit=1, tw_options={"fsync": False, "rules": "default"})
    trainer.add_callback(Watch())
    trainer.train()
    # Step 4's save returned before its file was written, checkpoint-2 still there.
    assert seen[4] == (["checkpoint-2", "checkpoint-4"], False)
    assert seen[6][0] == ["checkpoint-4", "checkpoint-6"]
    # Each folder went only once the file of a newer one was on disk.
    assert [name for name, _ in removed] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    for name, files in removed:
        step = int(name.split("-")[1])
        assert f"step-{step + SAVE_EVERY:08d}.tw.safetensors" in files, (name, files)
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("checkpoint-")) == ["checkpoint-8"]
    assert load_checkpoint_state(tmp_path / "checkpoint-8")["step"] == STEPS


def test_with_saves_in_flight_rotation_waits_for_all_but_the_newest(tmp_path, monkeypatch):
    # max_pending=2 lets step 6's save start while step 4's file is still being written;
    # Trainer then deletes checkpoint-2 (save_total_limit=2 keeps 4 and 6), and a step-4
    # write that never landed left two folders without files and nothing to resume from.
    import threading

    from tw_triton import format as fmt
    from tw_triton.checkpointer import Checkpointer

    real_write, real_save = fmt.write_file, Checkpointer.save
    step_6_submitted = threading.Event()

    def write(qstate, path, **kw):
        if os.path.basename(path).startswith("step-00000004"):
            step_6_submitted.wait(timeout=20)  # a safety net: the test sets it
            raise OSError(28, "No space left on device")
        return real_write(qstate, path, **kw)

    def save(self, step, **state):
        future = real_save(self, step, **state)
        if step == 6:
            step_6_submitted.set()
        return future

    monkeypatch.setattr(fmt, "write_file", write)
    monkeypatch.setattr(Checkpointer, "save", save)
    options = {"fsync": False, "rules": "default", "max_pending": 2, "keyframe_every": 10}
    trainer = make_trainer(tmp_path, save_total_limit=2, tw_options=options)
    with pytest.raises(CheckpointError, match="step-00000004"):
        trainer.train()
    monkeypatch.undo()
    assert load_checkpoint_state(tmp_path / "checkpoint-2")["step"] == 2


@pytest.mark.parametrize(
    "delta,kept",
    [
        ("open", [2, 6, 8]),  # 4 is gone; 2 stays because 6 is a delta from it
        ("closed", [2, 4, 6, 8]),  # 6 is a delta from 4, which is one from 2: the chain stays
    ],
)
def test_retention_keeps_the_keyframes_kept_deltas_need(tmp_path, delta, kept):
    # keyframe_every=3: saves at 2 (keyframe), 4, 6 (deltas), 8 (keyframe).
    trainer = make_trainer(
        tmp_path,
        save_total_limit=2,
        tw_options={"keyframe_every": 3, "fsync": False, "delta": delta, "rules": "small"},
    )
    trainer.train()
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("checkpoint-")) == [
        "checkpoint-6",
        "checkpoint-8",
    ]
    steps = sorted(parse_checkpoint_name(n) for n in os.listdir(tmp_path / TW_SUBDIR))
    assert steps == kept
    assert load_checkpoint_state(tmp_path / "checkpoint-6")["step"] == 6


def test_missing_file_is_a_clear_error(uninterrupted, tmp_path):
    src, _, _ = uninterrupted
    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    pointer = json.loads((src / "checkpoint-4" / POINTER_NAME).read_text())
    pointer["file"] = "../nowhere/step-00000004.tw.safetensors"
    (folder / POINTER_NAME).write_text(json.dumps(pointer))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint_state(folder)
    (folder / POINTER_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match=POINTER_NAME):
        load_checkpoint_state(folder)
    # A pointer to a directory, a folder that is not there or is a file: each said as it is.
    pointer["file"] = os.path.relpath(src / TW_SUBDIR, folder)
    (folder / POINTER_NAME).write_text(json.dumps(pointer))
    with pytest.raises(CheckpointError, match="a directory, not a checkpoint file"):
        load_checkpoint_state(folder)
    with pytest.raises(CheckpointError, match="no such directory"):
        load_checkpoint_state(tmp_path / "checkpoint-99")
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint_state(folder / POINTER_NAME)


def test_reserved_options_are_refused(tmp_path):
    with pytest.raises(Exception, match="save_total_limit"):
        make_trainer(tmp_path, tw_options={"keep_last": 2})


@pytest.mark.parametrize(
    "options,error,match",
    [
        ({"keyframe_evry": 2}, TwTritonError, "'keyframe_evry'.*keyframe_every"),
        ({"rules": "nonsense"}, QuantizationError, "nonsense"),
        ({"rules": [("*", "no-such-codec")]}, QuantizationError, "no-such-codec"),
        ({"bits": 3}, QuantizationError, "bits must be one of"),
    ],
)
def test_bad_options_are_refused_when_the_trainer_is_made(tmp_path, options, error, match):
    # They were found at the first optimizer step or save, a typo as a raw TypeError.
    with pytest.raises(error, match=match):
        make_trainer(tmp_path, tw_options=options)


def test_corrupted_file_fails_the_resume_naming_it(uninterrupted, tmp_path):
    import shutil

    src, _, _ = uninterrupted
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    path = copy / TW_SUBDIR / "step-00000006.tw.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # a byte of tensor data: the checksum catches it
    path.write_bytes(bytes(data))
    trainer = make_trainer(tmp_path / "out", tw_options={"fsync": False})
    with pytest.raises(CheckpointError, match="step-00000006"):
        trainer.train(resume_from_checkpoint=str(copy / "checkpoint-6"))


def test_resuming_with_another_optimizer_is_refused_naming_both(uninterrupted, tmp_path):
    src, _, _ = uninterrupted
    metadata = read_manifest(src / TW_SUBDIR / "step-00000006.tw.safetensors")["metadata"]
    assert metadata["optimizers"] == {"optimizer": "torch.optim.AdamW"}  # not accelerate's wrapper
    trainer = make_trainer(tmp_path, tw_options={"fsync": False}, optim="sgd")
    with pytest.raises(
        CheckpointError,
        match=r"(?s)step-00000006.*'optimizer'.*'torch.optim.AdamW'.*'torch.optim.SGD'.*TrainingArguments.optim",
    ):
        trainer.train(resume_from_checkpoint=str(src / "checkpoint-6"))


def test_sharded_runs_are_refused(tmp_path):
    trainer = make_trainer(tmp_path, tw_options={"fsync": False})
    trainer.is_fsdp_enabled = True  # what Trainer sets for an FSDP run
    with pytest.raises(TwTritonError, match="FSDP"):
        trainer._save_checkpoint(trainer.model, trial=None)
    assert not (tmp_path / TW_SUBDIR).exists()


from _readme import readme_example  # noqa: E402


def test_readme_example_runs_and_its_listing_is_what_it_writes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "readme"}
    exec(compile(readme_example("Hugging Face `Trainer`"), "README.md", "exec"), scope)
    listed = set()
    for line in readme_example("Hugging Face `Trainer`", "text").splitlines():
        path = line.split("}")[0] + "}" if "{" in line else line.split()[0]
        if "{" in path:
            head, names = path.split("{")
            listed |= {head + n.strip() for n in names.rstrip("}").split(",")}
        elif path:
            listed.add(path)
    written = {str(p.relative_to(tmp_path)) for p in (tmp_path / "hf-run").rglob("*") if p.is_file()}
    assert written == listed
    exec(compile(readme_example("Hugging Face `Trainer`", index=1), "README.md", "exec"), scope)
    assert scope["trainer"].state.global_step == 30
    assert sorted(d for d in os.listdir(tmp_path / "hf-run") if d.startswith("checkpoint-")) == [
        "checkpoint-25",
        "checkpoint-30",
    ]


def test_the_first_save_copies_into_memory_prepared_after_the_first_step(tmp_path, monkeypatch):
    from tw_triton.checkpointer import Checkpointer

    calls, first_save = [], {}
    real_prepare, real_save = Checkpointer.prepare, Checkpointer.save

    def prepare(self, **state):
        n = real_prepare(self, **state)
        # AdamW's moments exist by now: the optimizer's state is part of the reservation.
        calls.append((n, bool(state["optimizer"].state)))
        return n

    def save(self, step, **state):
        fut = real_save(self, step, **state)
        first_save.setdefault("reused", self._saves.pool.reused)
        return fut

    monkeypatch.setattr(Checkpointer, "prepare", prepare)
    monkeypatch.setattr(Checkpointer, "save", save)
    # FFN matrices of 128 x 256 fp32 (128 KiB): large enough for the snapshot pool.
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=SEQ,
        num_labels=2,
    )
    model = transformers.BertForSequenceClassification(config)
    trainer = make_trainer(tmp_path, max_steps=4, tw_options={"fsync": False}, model=model)
    trainer.train()
    assert len(calls) == 1 and calls[0][0] > 0 and calls[0][1], calls
    # The model's large matrices and both AdamW moments of each took a reserved buffer.
    pooled = [p for p in trainer.model.parameters() if p.nbytes >= 1 << 16]
    assert first_save["reused"] >= 3 * len(pooled) > 0
    state = load_checkpoint_state(tmp_path / "checkpoint-2")
    assert state["step"] == 2


def test_a_pointer_the_disk_cannot_take_is_a_checkpoint_io_error_naming_it(tmp_path, monkeypatch):
    # A full disk while TwTrainer wrote checkpoint-N/tw_checkpoint.json raised json's bare
    # OSError (no file named, outside tw_triton's errors) and left the temp file behind.
    import errno

    from tw_triton.errors import CheckpointIOError
    from tw_triton.integrations import hf_pointer

    folder = tmp_path / "checkpoint-4"
    hf_pointer.write_pointer(str(folder), str(tmp_path / TW_SUBDIR), 4)
    real_dump = hf_pointer.json.dump

    def full_disk(data, f, **kw):
        f.write("{")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf_pointer.json, "dump", full_disk)
    with pytest.raises(CheckpointIOError, match=POINTER_NAME) as err:
        hf_pointer.write_pointer(str(folder), str(tmp_path / TW_SUBDIR), 6)
    assert err.value.errno == errno.ENOSPC
    monkeypatch.setattr(hf_pointer.json, "dump", real_dump)
    assert os.listdir(folder) == [POINTER_NAME]  # no temp file left; the pointer before intact
    assert hf_pointer.read_pointer(folder)["step"] == 4
