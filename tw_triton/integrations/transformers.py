"""Hugging Face ``Trainer`` checkpoints as tw_triton files: keyframes, deltas, resume.

Usage::

    trainer = TwTrainer(model=model, args=args, train_dataset=ds)   # Trainer's arguments
    trainer.train(resume_from_checkpoint=True)

``TwTrainer`` is :class:`TwCheckpointMixin` + ``transformers.Trainer`` (put the mixin first
in your own subclass). Contract: model, optimizer, scheduler, scaler and RNG states of step N
go into one file ``output_dir/tw_triton/step-N.tw.safetensors`` written by a
:class:`~tw_triton.Checkpointer`; ``checkpoint-N/`` holds ``trainer_state.json`` and
``tw_checkpoint.json`` (which names the file) and no pickle. ``save_total_limit`` deletes
folders as usual, once what it keeps has landed (with 1, the folder before goes at the next
save); their files go at the next save, except those a kept delta or the next one needs.
DeepSpeed, FSDP and multi-process runs are refused with a
:class:`~tw_triton.errors.TwTritonError`. The why: docs/integrations.md#hugging-face-trainer.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import weakref
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from ..checkpoint_dir import checkpoint_name, parse_checkpoint_name
from ..checkpointer import Checkpointer
from ..deltas import with_references
from ..errors import CheckpointError, TwTritonError
from ..optimizer_classes import check_file
from ..rng import restore_rng_state
from ..rules import check_rules
from . import require
from .hf_pointer import POINTER_NAME, read_pointer, write_pointer

require("transformers", "hf")
require("accelerate", "hf")  # Trainer cannot run without it
from transformers import Trainer, TrainerCallback  # noqa: E402
from transformers.trainer import TRAINER_STATE_NAME  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR  # noqa: E402

logger = logging.getLogger(__name__)

TW_SUBDIR = "tw_triton"
# What a resume refused for another optimizer class (optimizer_classes) tells the user to do.
RESUME_ADVICE = (
    "resume with the optimizer the run was saved with (TrainingArguments.optim), or start a new "
    "run from the weights alone (load_checkpoint_state(folder)['model']), without resume_from_checkpoint"
)


def load_checkpoint_state(
    checkpoint_dir: str | os.PathLike,
    *,
    device: torch.device | str = "cpu",
    into: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load the state a :class:`TwTrainer` checkpoint folder points to.

    ``into``: objects to decode into where they can take it (``{"model": model}``), as
    :meth:`~tw_triton.checkpointer.Checkpointer.load` does.

    Returns:
        ``{"step", "model", "optimizer", "scheduler", ["scaler"], "rng"}`` as saved
        (``optimizer``/``scheduler`` are absent with ``save_only_model``).

    Raises:
        CheckpointError: the folder has no (valid) ``tw_checkpoint.json``, the file it names
            is missing (e.g. deleted by retention), or the file or its keyframe is bad.
    """
    where = os.fspath(checkpoint_dir)
    if not os.path.isdir(where):
        why = "not a directory" if os.path.exists(where) else "no such directory"
        raise CheckpointError(f"{where}: {why}; expected a checkpoint-N folder")
    pointer = read_pointer(where)
    if pointer is None:
        raise CheckpointError(f"{where}: no {POINTER_NAME}; not a TwTrainer checkpoint")
    path, name = pointer["path"], checkpoint_name(pointer["step"])
    if not os.path.isfile(path):
        why = "a directory, not a checkpoint file" if os.path.isdir(path) else "which does not exist"
        raise CheckpointError(f"{where}: {POINTER_NAME} names {path}, {why}")
    if os.path.basename(path) != name:
        raise CheckpointError(f"{where}: {POINTER_NAME} names {path}, expected a file named {name}")
    reader = Checkpointer(os.path.dirname(path), keep_last=None, async_write=False)
    try:
        return reader.load(pointer["step"], device=device, into=into)
    finally:
        reader.close()


def _check_options(options: dict[str, Any]) -> None:
    """Refuse ``tw_options`` the Checkpointer would refuse, now rather than at the first
    optimizer step or save: unknown names, and rules, bits or block no save could use."""
    params = inspect.signature(Checkpointer.__init__).parameters
    accepted = set(params) - {"self", "directory", "keep_last"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise TwTritonError(
            f"tw_options: unknown option(s) {unknown}; the Checkpointer takes {sorted(accepted)}"
        )
    rules, bits, block = (options.get(n, params[n].default) for n in ("rules", "bits", "block"))
    check_rules(rules, bits=bits, block=block)


class TwCheckpointMixin:
    """Makes a ``transformers.Trainer`` (sub)class write and resume tw_triton checkpoints.

    Args:
        tw_options: keyword arguments for the :class:`~tw_triton.Checkpointer` that writes
            ``output_dir/tw_triton`` (``keyframe_every``, ``rules``, ``bits``, ``block``,
            ``async_write``, ...); what is not given keeps the Checkpointer's default.
            ``keep_last`` is not accepted: ``save_total_limit`` decides retention.
        *args, **kwargs: passed to the ``Trainer``.

    Raises:
        TwTritonError: ``tw_options`` names ``directory``, ``keep_last`` or an option the
            Checkpointer does not take.
        QuantizationError: ``tw_options``' ``rules``, ``bits`` or ``block`` no save could
            use (an unknown preset or codec, a malformed rule, bits or block outside the
            codec's).
    """

    def __init__(self, *args: Any, tw_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        options = dict(tw_options or {})
        for reserved in ("directory", "keep_last"):
            if reserved in options:
                raise TwTritonError(
                    f"tw_options[{reserved!r}] is set by the Trainer (output_dir, save_total_limit)"
                )
        _check_options(options)
        self._tw_options = options
        self._tw_ckpt: Checkpointer | None = None
        self._tw_saved_steps: set[int] = set()
        self._tw_last_save: Future | None = None
        # save_total_limit=1: the run dir, step and Future of the save whose rotation waits.
        self._tw_rotation_due: tuple[str, int, Future] | None = None
        self._tw_in_save = False
        self._tw_resume: tuple[str, dict[str, Any]] | None = None
        super().__init__(*args, **kwargs)
        self.add_callback(_PrepareFirstSave(self))

    # ------------------------------------------------------------------ saving

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self._tw_check_supported()
        run_dir = self._get_output_dir(trial=trial)
        step = self.state.global_step
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if self.args.should_save:
            ckpt = self._tw_checkpointer(run_dir)
            # Files of folders Trainer deleted at the last save go now: every earlier save
            # is complete by here (a listing waits), so each file's keyframe is known.
            self._tw_prune(run_dir, keep_reference=True)
            future = ckpt.save(step, **self._tw_objects())
            self._tw_saved_steps.add(step)
            write_pointer(folder, ckpt.directory, step)
            self._tw_before_rotation(ckpt, future)
        # Trainer writes trainer_state.json, keeps the callbacks' states and rotates the
        # folders; its model/optimizer/scheduler/scaler/RNG writers are no-ops meanwhile.
        # With one folder kept, its rotation would delete the folder before while this
        # save's file is still being written: that one goes once it has landed instead
        # (_tw_rotate_behind), and Trainer is shown no limit for this call.
        limit = self.args.save_total_limit
        self._tw_in_save = True
        try:
            if limit == 1:
                self.args.save_total_limit = None
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
            self._tw_in_save = False
        if limit == 1 and self.args.should_save:
            self._tw_rotation_due = (run_dir, step, future)

    def _tw_before_rotation(self, ckpt: Checkpointer, future: Future) -> None:
        """What Trainer keeps when it deletes folders must hold a file on disk (see docs)."""
        earlier, self._tw_last_save = self._tw_last_save, future
        if (self.args.save_total_limit or 0) >= 1 and earlier is not None:
            wait_futures([earlier])  # done already unless max_pending > 1
            if earlier.exception() is not None:
                ckpt.flush()  # raises it as the Checkpointer does (once, as a CheckpointError)
        if self.args.save_total_limit == 1:
            self._tw_rotate_behind()  # the save before has landed: the folders before it go

    def _tw_rotate_behind(self) -> None:
        """``save_total_limit=1``: delete the ``checkpoint-N`` folders older than the last
        save whose rotation was put off (its file is on disk by now), but the best one, as
        Trainer's rotation would have right after that save."""
        due, self._tw_rotation_due = self._tw_rotation_due, None
        if due is None or not due[2].done() or due[2].exception() is not None:
            return  # a save that failed deletes nothing (its error was raised)
        run_dir, landed, _ = due
        best = self.state.best_model_checkpoint
        prefix = f"{PREFIX_CHECKPOINT_DIR}-"
        for name in os.listdir(run_dir):
            number = name[len(prefix) :]
            folder = os.path.join(run_dir, name)
            if not name.startswith(prefix) or not number.isdigit() or int(number) >= landed:
                continue
            if best is not None and os.path.abspath(best) == os.path.abspath(folder):
                continue
            if os.path.isdir(folder):
                logger.info("deleting older checkpoint [%s] due to args.save_total_limit", folder)
                shutil.rmtree(folder, ignore_errors=True)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self._tw_in_save:
            return
        super().save_model(output_dir, _internal_call=_internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._tw_in_save:
            super()._save_optimizer_and_scheduler(output_dir)

    def _save_scaler(self, output_dir: str) -> None:
        if not self._tw_in_save:
            super()._save_scaler(output_dir)

    def _save_rng_state(self, output_dir: str) -> None:
        if not self._tw_in_save:
            super()._save_rng_state(output_dir)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; on return every checkpoint it saved is on disk and pruned.

        ``resume_from_checkpoint=True`` takes the newest ``checkpoint-N`` folder a resume can
        read (:meth:`_tw_last_checkpoint`), not merely the newest one.
        """
        if resume_from_checkpoint is True:
            # None: no folder at all, which Trainer reports in its own words.
            resume_from_checkpoint = self._tw_last_checkpoint() or True
        try:
            result = super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException:
            try:
                self._tw_finish()
            except TwTritonError as err:  # do not hide the training loop's own exception
                logger.error("while finishing tw_triton checkpoints: %s", err)
            raise
        self._tw_finish()
        return result

    # ----------------------------------------------------------------- loading

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        target = self.model if model is None else model
        # The model's own CPU tensors take what the file stores exact (no second copy).
        state = self._tw_state(resume_from_checkpoint, into={"model": target})
        if state is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        target.load_state_dict(state["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        state = self._tw_state(checkpoint) if checkpoint is not None else None
        if state is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        if "optimizer" in state and "scheduler" in state:
            check_file(read_pointer(checkpoint)["path"], {"optimizer": self.optimizer}, RESUME_ADVICE)
            self.optimizer.load_state_dict(state["optimizer"])
            self.lr_scheduler.load_state_dict(state["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        state = self._tw_state(checkpoint) if checkpoint is not None else None
        if state is None:
            super()._load_scaler(checkpoint)
            return
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and "scaler" in state:
            scaler.load_state_dict(state["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        state = self._tw_state(checkpoint) if checkpoint is not None else None
        if state is None:
            super()._load_rng_state(checkpoint)
            return
        if "rng" in state:
            restore_rng_state(state["rng"], source=os.path.join(checkpoint, POINTER_NAME))
        self._tw_resume = None  # the last piece Trainer restores: free the loaded state

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if self._tw_ckpt is not None:
            self._tw_ckpt.flush()  # the best checkpoint may still be being written
        if best is None or read_pointer(best) is None:
            super()._load_best_model()
            return
        logger.info("loading best model from %s (score: %s)", best, self.state.best_metric)
        state = load_checkpoint_state(best)
        self.model.load_state_dict(state["model"])

    # --------------------------------------------------------------- internals

    def _tw_objects(self) -> dict[str, Any]:
        """What a save stores, by name: the model, and unless ``save_only_model`` the
        optimizer, the LR scheduler and the grad scaler."""
        objects: dict[str, Any] = {"model": self.model}
        if not self.args.save_only_model:
            objects["optimizer"] = self.optimizer
            objects["scheduler"] = self.lr_scheduler
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                objects["scaler"] = scaler
        return objects

    def _tw_prepare(self) -> None:
        """Fault in the first save's snapshot memory, after the first optimizer step (AdamW
        has its moments then), so the first save pauses training no longer than the later
        ones (docs/integrations.md)."""
        if self._tw_unsupported() is not None or not self.args.should_save or self.args.save_strategy == "no":
            return  # an unsupported run is refused at its first save, as before
        run_dir = self._get_output_dir(trial=getattr(self, "_trial", None))
        reserved = self._tw_checkpointer(run_dir).prepare(**self._tw_objects())
        logger.debug("tw_triton: %d bytes of snapshot memory reserved before the first save", reserved)

    def _tw_unsupported(self) -> str | None:
        """What in this run a single-process checkpoint cannot hold, or ``None``."""
        if getattr(self, "is_deepspeed_enabled", False):
            return "DeepSpeed"
        if getattr(self, "is_fsdp_enabled", False):
            return "FSDP"
        if self.args.world_size > 1:
            return f"{self.args.world_size} processes"
        return None

    def _tw_check_supported(self) -> None:
        what = self._tw_unsupported()
        if what is not None:
            raise TwTritonError(
                f"TwTrainer writes single-process checkpoints; this run uses {what}, whose "
                "state is sharded or per rank (use the stock Trainer checkpoints there)"
            )

    def _tw_checkpointer(self, run_dir: str) -> Checkpointer:
        tw_dir = os.path.join(run_dir, TW_SUBDIR)
        if self._tw_ckpt is not None and self._tw_ckpt.directory != tw_dir:
            self._tw_finish()  # a hyperparameter-search trial moved to another run dir
        if self._tw_ckpt is None:
            # Retention is ours (folder by folder, see the module doc), not keep_last's.
            self._tw_ckpt = Checkpointer(tw_dir, keep_last=None, **self._tw_options)
            self._tw_saved_steps = set()
        return self._tw_ckpt

    def _tw_prune(self, run_dir: str, *, keep_reference: bool) -> None:
        """Delete the tw_triton files of ``run_dir`` that no checkpoint folder needs.

        Kept: the file of every ``checkpoint-N`` folder that has a pointer, the files each
        of those needs (its keyframe; in closed loop, every delta back to it), and with
        ``keep_reference`` the reference of the next delta and what it needs.
        """
        ckpt = self._tw_ckpt
        if ckpt is None or not self._tw_orphans(run_dir):
            return
        infos = ckpt.infos()  # waits for this trainer's pending saves
        by_step = {i.step: i for i in infos}
        by_id = {i.checkpoint_id: i for i in infos}
        keep: set[int] = set()
        tw_dir = os.path.abspath(ckpt.directory)
        prefix = f"{PREFIX_CHECKPOINT_DIR}-"
        for name in os.listdir(run_dir):
            folder = os.path.join(run_dir, name)
            if not name.startswith(prefix) or not os.path.isdir(folder):
                continue
            try:
                pointer = read_pointer(folder)
            except CheckpointError as e:
                logger.warning("ignoring %s: %s", folder, e)
                continue
            if pointer is None or os.path.dirname(os.path.abspath(pointer["path"])) != tw_dir:
                continue
            keep.add(pointer["step"])
        if keep_reference and ckpt.reference_id in by_id:
            keep.add(by_id[ckpt.reference_id].step)
        # A delta needs its reference, and in closed loop that one needs its own: the chain.
        ids = with_references({by_step[s].checkpoint_id for s in keep if s in by_step}, by_id)
        keep |= {by_id[i].step for i in ids if i in by_id}
        for info in infos:
            if info.step not in keep:
                try:
                    os.unlink(info.path)
                except FileNotFoundError:
                    pass
                self._tw_saved_steps.discard(info.step)
                logger.info("removed %s: its checkpoint folder was deleted", info.path)

    def _tw_orphans(self, run_dir: str) -> bool:
        """Whether some file in ``tw_triton/`` has no ``checkpoint-N`` folder (cheap: names only).

        Only such files can go, so the common case skips reading every header (and waiting
        for the write in flight).
        """
        prefix = f"{PREFIX_CHECKPOINT_DIR}-"
        folders = {
            int(name[len(prefix) :])
            for name in os.listdir(run_dir)
            if name.startswith(prefix) and name[len(prefix) :].isdigit()
        }
        steps = {parse_checkpoint_name(name) for name in os.listdir(self._tw_ckpt.directory)}
        steps.discard(None)
        return bool(steps - folders)

    def _tw_last_checkpoint(self) -> str | None:
        """The newest ``checkpoint-N`` folder of ``output_dir`` that a resume can read, or
        ``None`` if there is no folder.

        A tw_triton folder whose file or ``trainer_state.json`` is not there (a run killed
        while its file was still being written in the background) is passed over with a
        warning; a folder without a pointer is a stock one, read by Trainer's own code.
        """
        run_dir = self.args.output_dir
        prefix = f"{PREFIX_CHECKPOINT_DIR}-"
        names = os.listdir(run_dir) if os.path.isdir(run_dir) else []
        steps = sorted(
            (int(name[len(prefix) :]), name)
            for name in names
            if name.startswith(prefix) and name[len(prefix) :].isdigit()
        )
        folders = [os.path.join(run_dir, name) for _, name in reversed(steps)]
        for folder in folders:
            if not os.path.isdir(folder):
                continue
            pointer = read_pointer(folder)  # a malformed one is raised, not passed over
            if pointer is None:
                return folder
            missing = [
                p
                for p in (pointer["path"], os.path.join(folder, TRAINER_STATE_NAME))
                if not os.path.isfile(p)
            ]
            if not missing:
                return folder
            logger.warning(
                "not resuming from %s: %s does not exist (a save that did not finish); trying the one before",
                folder,
                " and ".join(missing),
            )
        return folders[0] if folders else None

    def _tw_finish(self) -> None:
        """Wait for pending saves, prune, stop the writer; drop the cached resume state."""
        self._tw_resume = None
        ckpt = self._tw_ckpt
        if ckpt is None:
            return
        try:
            ckpt.flush()
            self._tw_rotate_behind()
            self._tw_prune(os.path.dirname(ckpt.directory), keep_reference=False)
        finally:
            self._tw_ckpt = None
            ckpt.close()

    def _tw_state(self, checkpoint_dir: str, into: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The state a tw checkpoint folder points to (read once per resume, into the objects
        of ``into`` where they can take it), or ``None``."""
        if read_pointer(checkpoint_dir) is None:
            return None
        key = os.path.abspath(checkpoint_dir)
        if self._tw_resume is None or self._tw_resume[0] != key:
            self._tw_check_supported()
            self._tw_resume = (key, load_checkpoint_state(checkpoint_dir, into=into))
        return self._tw_resume[1]


class _PrepareFirstSave(TrainerCallback):
    """Calls the trainer's ``_tw_prepare`` at the end of the first optimizer step of each
    ``train`` (AdamW creates its moments in that step)."""

    def __init__(self, trainer: TwCheckpointMixin) -> None:
        self._trainer = weakref.ref(trainer)  # the trainer holds its callbacks: no cycle
        self._pending = True

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._pending = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if self._pending and trainer is not None:
            self._pending = False
            trainer._tw_prepare()


class TwTrainer(TwCheckpointMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints are tw_triton files (see the module doc).

    Takes ``Trainer``'s arguments plus ``tw_options`` (:class:`TwCheckpointMixin`).
    """


__all__ = ["TwTrainer", "TwCheckpointMixin", "load_checkpoint_state", "read_pointer"]
