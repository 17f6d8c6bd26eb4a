"""Lightning checkpoints as tw_triton files: the :class:`TwCheckpointIO` plugin.

Usage::

    trainer = L.Trainer(plugins=[TwCheckpointIO()],
                        callbacks=[ModelCheckpoint(...), TwPrepareFirstSave()])

Contract: each checkpoint is one standalone tw_triton file (no deltas) at the path Lightning
gives, holding Lightning's whole checkpoint dict; tensors the rules would delta-code are
stored exact (:func:`~tw_triton.rules.keyframe_rules`). Values that are not plain data
(tensors, numpy, containers, scalars, str, bytes) are refused with a ``QuantizationError``
before anything is written; no pickle is written or read. Writes run on a background
thread into a snapshot pool; ``load_checkpoint``, ``remove_checkpoint`` and ``teardown``
wait for them, and a failed write is raised at the next call. Local paths only.
The why, and the loading rules: docs/integrations.md#lightning.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from ..checkpointer import DEFAULT_RULES, collect_setup_garbage
from ..directory_claim import DirectoryClaim, write_temp_files
from ..errors import CheckpointError, QuantizationError
from ..format import write_file
from ..format.files import io_error
from ..rules import check_rules, keyframe_rules, resolve_rules, rules_as_specs
from ..snapshot_pool import SavePool, SnapshotLease
from ..state import dequantize_state_dict, load, quantize_state_dict
from ..tree import flatten
from ..writer import AsyncWriter
from . import require

require("lightning", "lightning")
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

WRITER = "tw_triton.integrations.lightning"
logger = logging.getLogger(__name__)


def _local_path(path: Any) -> str:
    text = os.fspath(path)
    if "://" in text:
        raise CheckpointError(f"{text}: TwCheckpointIO writes local files only, not URLs")
    return text


def _encode(
    tree: Any,
    rules: Any,
    bits: int,
    block: int,
    meta: dict[str, Any],
    copy: bool,
    allocate: SnapshotLease | None = None,
) -> Any:
    q = quantize_state_dict(
        tree, rules=rules, bits=bits, block=block, metadata=meta, copy=copy, allocate=allocate
    )
    q.metadata["kind"] = "keyframe"
    return q


class TwCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that writes each checkpoint as one tw_triton file.

    Args:
        rules: which tensors are coded how, as for :class:`~tw_triton.Checkpointer` (default:
            the library's default preset); tensors the rules delta-code are stored exact.
        bits, block: parameters of quantizing rules that do not set them.
        async_write: write on a background thread (see the module doc).
        max_pending: saves in flight before ``save_checkpoint`` waits.
        fsync: fsync files and their directory (leave on outside of tests).
        verify: check checksums when loading.
        snapshot_pool_bytes: cap on the host memory kept between saves for their CPU
            copies (async only); ``None``: ``max_pending + 1`` times the largest save so
            far; ``0``: every copy in fresh memory.

    Raises:
        QuantizationError: ``rules``, ``bits`` or ``block`` no save could use (an unknown
            preset or codec, a malformed rule, bits or block outside the codec's).
    """

    def __init__(
        self,
        *,
        rules: Any = DEFAULT_RULES,
        bits: int = 8,
        block: int = 128,
        async_write: bool = True,
        max_pending: int = 1,
        fsync: bool = True,
        verify: bool = True,
        snapshot_pool_bytes: int | None = None,
    ) -> None:
        super().__init__()
        check_rules(rules, bits=bits, block=block)  # refused now, not at the first save
        self.rules = rules
        self.bits = bits
        self.block = block
        self.async_write = async_write
        self.max_pending = max_pending
        self.fsync = fsync
        self.verify = verify
        self._writer: AsyncWriter | None = None
        self._pending: dict[str, Future] = {}
        # The module the next load may decode into (see load_into), held weakly.
        self._load_into: weakref.ref | None = None
        # Each save's pooled buffers, until its write is done (the writer reads them).
        self._saves = SavePool(snapshot_pool_bytes, max_pending + 1)
        # The directories written to, held (and swept once) as a Checkpointer holds its own.
        self._claims: dict[str, DirectoryClaim] = {}

    @property
    def save_pool(self) -> SavePool:
        """The snapshot memory of the background saves (its ``pool`` is ``None`` with
        ``snapshot_pool_bytes=0``)."""
        return self._saves

    @property
    def load_target(self) -> Any | None:
        """The module the next load decodes into (see :meth:`load_into`), or ``None``."""
        return self._load_into() if self._load_into is not None else None

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Encode ``checkpoint`` and write it to ``path`` (see the module doc).

        Raises:
            TypeError: ``storage_options`` were given (as Lightning's own local plugin does).
            QuantizationError: an entry the format cannot hold; names the file and the entry.
            CheckpointError: an earlier background write failed.
        """
        if storage_options is not None:
            raise TypeError(f"TwCheckpointIO does not take storage_options; got {storage_options!r}")
        path = _local_path(path)
        self._saves.release_written()
        lease = None
        try:
            rule_list = resolve_rules(self.rules, checkpoint, bits=self.bits, block=self.block)
            specs = rules_as_specs(keyframe_rules(rule_list))
            meta = {"writer": WRITER, "saved_at": time.time()}
            tensors, _ = flatten(checkpoint)
            on_cpu = all(t.device.type == "cpu" for t in tensors.values())
            if self.async_write and on_cpu:
                # Only this copy holds up training; the writer thread encodes the copy, its
                # codes going into the same lease.
                lease = self._saves.lease()
                snapshot = dequantize_state_dict(
                    quantize_state_dict(checkpoint, rules="exact", allocate=lease, sparse=False)
                )
                job: Any = functools.partial(
                    _encode, snapshot, specs, self.bits, self.block, meta, False, allocate=lease
                )
            else:
                job = _encode(checkpoint, specs, self.bits, self.block, meta, True)
        except BaseException as e:
            if lease is not None:
                lease.release()  # nothing was queued: no one reads these buffers
            if not isinstance(e, QuantizationError):
                raise
            raise QuantizationError(
                f"{path}: cannot store this Lightning checkpoint: {e}. Turn such values into "
                "plain ones in on_save_checkpoint (and back in on_load_checkpoint), or leave "
                "them out of save_hyperparameters(ignore=[...])"
            ) from e
        if not self.async_write:
            self._claim(path)
            write_file(job, path, fsync=self.fsync)
            return
        try:
            self._claim(path)
            self._wait_for(path)  # two saves to one path (last.ckpt) land in order anyway
            self._pending = {p: f for p, f in self._pending.items() if not f.done()}
            if self._writer is None:
                self._writer = AsyncWriter(max_pending=self.max_pending, fsync=self.fsync)
            future = self._writer.submit(job, path)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        self._pending[path] = future
        if lease is not None:
            self._saves.track(future, lease)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint dict written by :meth:`save_checkpoint`.

        Args:
            path: the checkpoint file (local).
            map_location: ``None`` loads to the CPU; a device or device string loads there
                (CUDA decodes on the GPU); a function or dict (``torch.load`` storage maps)
                loads to the CPU, where Lightning moves the state anyway.
            weights_only: accepted and has nothing to restrict: loading never runs code.

        Raises:
            FileNotFoundError: no file at ``path``.
            CheckpointError: the file is not a valid tw_triton checkpoint (names the entry).
        """
        path = _local_path(path)
        self.flush()
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        device: Any = "cpu"
        if isinstance(map_location, (str, torch.device)):
            device = map_location
        module = self._load_into() if self._load_into is not None else None
        self._load_into = None  # for this load only
        into = {"state_dict": module} if module is not None else None
        state = load(path, device=device, verify=self.verify, into=into)
        if not isinstance(state, dict):
            raise CheckpointError(f"{path}: not a Lightning checkpoint (expected a dict at the top)")
        return state

    def writing(self, path: Any) -> bool:
        """Whether a save to ``path`` is still being written in the background: the file
        is not there yet, but the name is taken (:class:`TwPrepareFirstSave` tells
        ``ModelCheckpoint`` so)."""
        text = os.fspath(path)
        if "://" in text:
            return False  # never written by this plugin
        target = os.path.abspath(text)
        return any(not f.done() and os.path.abspath(p) == target for p, f in list(self._pending.items()))

    def load_into(self, module: Any | None) -> None:
        """Let the next :meth:`load_checkpoint` decode the checkpoint's ``state_dict`` into
        ``module``'s own CPU tensors where they fit (as
        :meth:`~tw_triton.checkpointer.Checkpointer.restore` does), for that one load;
        ``None`` cancels. :class:`TwPrepareFirstSave` calls it in ``setup``, just before
        Lightning restores a checkpoint into the module, which then copies nothing."""
        self._load_into = weakref.ref(module) if module is not None else None

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (after its pending write, if any).

        While a later checkpoint is still being written, ``path`` goes on the writer thread
        once it has landed, and stays (logged) if that write fails: ``ModelCheckpoint``
        removes the older file right after saving the newer one, and a kill or a failure
        meanwhile must not leave no checkpoint at all.
        """
        path = _local_path(path)
        self._wait_for(path)
        # Every later save still listed, landed or not: one that already failed keeps it too.
        later = list(self._pending.values())
        if self._writer is None or not later:
            _remove(path)
        elif all(f.done() for f in later):
            _remove_after(path, later)
        else:
            self._writer.call(functools.partial(_remove_after, path, later))

    def flush(self) -> None:
        """Wait for every pending write; raise a failed one's error."""
        try:
            if self._writer is not None:
                self._writer.flush()
        finally:
            self._pending.clear()
            self._saves.release_written()

    def teardown(self) -> None:
        """Flush, stop the writer thread (a later save starts a new one), give the
        snapshot memory back and let go of the directories written to."""
        writer, self._writer = self._writer, None
        self._pending.clear()
        try:
            if writer is not None:
                writer.close()
        finally:
            self._saves.close()
            claims, self._claims = self._claims, {}
            for claim in claims.values():
                claim.close()

    def prepare(self, checkpoint: dict[str, Any]) -> int:
        """Fault in the host memory the next save will copy ``checkpoint``'s tensors into.

        Any nested dict whose tensors have the sizes of the checkpoint's will do: the
        module's state dict and the optimizers' states are all but a few bytes of it
        (:class:`TwPrepareFirstSave` passes those). Reserving again adds only what is missing.

        Like :meth:`tw_triton.Checkpointer.prepare` it also runs Python's full garbage
        collection, unless the collector is off.

        Returns:
            Bytes reserved: 0 without a pool, with ``async_write=False`` or for tensors off
            the CPU (whose saves copy nothing into the pool).
        """
        collect_setup_garbage()  # as Checkpointer.prepare: setup's full collection, now
        tensors = flatten(checkpoint)[0].values()
        if not self.async_write or any(t.device.type != "cpu" for t in tensors):
            return 0
        return self._saves.reserve([t.numel() * t.element_size() for t in tensors])

    def _claim(self, path: str) -> None:
        """Make ``path``'s directory; the first time, remove the temp files that killed
        writes left there unless another writer holds it, and hold it until teardown."""
        directory = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:  # a file of that name, or in its parents; no permission
            raise io_error(exc, f"{directory}: cannot be made or used as a checkpoint directory") from exc
        if directory not in self._claims:
            claim = self._claims[directory] = DirectoryClaim(directory)
            claim.sweep(lambda: write_temp_files(directory))

    def _wait_for(self, path: str) -> None:
        future = self._pending.pop(path, None)
        if future is not None:
            wait_futures([future])
            if self._writer is not None:
                self._writer.check()


def _remove(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _remove_after(path: str, saves: list[Future]) -> None:
    """Once ``saves`` are done (on the writer thread, or here when they already are):
    delete ``path`` unless one of them failed."""
    failed = [f for f in saves if f.exception() is not None]
    if failed:
        logger.warning("kept %s: a checkpoint written after it failed (%s)", path, failed[0].exception())
        return
    _remove(path)


class _TakenNames:
    """``ModelCheckpoint.file_exists`` that also counts a name whose write is in flight,
    so that the checkpoint after it gets ``-v1`` instead of overwriting it."""

    def __init__(self, exists: Any, io: TwCheckpointIO) -> None:
        self._exists = exists
        self._io = weakref.ref(io)

    def __call__(self, filepath: Any, trainer: Any) -> bool:
        io = self._io()
        return self._exists(filepath, trainer) or (io is not None and io.writing(filepath))


class TwPrepareFirstSave(Callback):
    """Fills a :class:`TwCheckpointIO`'s snapshot pool after the first training batch of a
    fit (the optimizer creates its state in that batch's step), so the first checkpoint
    pauses training no longer than the later ones. Does nothing with another plugin.

    It also shows ``ModelCheckpoint`` the names whose writes are still in flight as taken
    (from ``setup`` to ``teardown``): its version counter looks for existing files, and
    without that a second checkpoint under the same name (``filename="{epoch}"`` saved
    every few steps) would overwrite the first before it landed.

    It also lets a resume decode into the module: in ``setup``, which Lightning runs just
    before it restores ``ckpt_path``, it hands the module to
    :meth:`TwCheckpointIO.load_into`; the hand-over ends with that load, or at the stage's
    start if there was none (strategies that restore after their setup, such as FSDP, then
    load as before)."""

    def __init__(self) -> None:
        self._pending = True

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(io, TwCheckpointIO):
            io.load_into(pl_module)
            for cb in trainer.checkpoint_callbacks:
                if isinstance(cb, ModelCheckpoint) and "file_exists" not in vars(cb):
                    cb.file_exists = _TakenNames(cb.file_exists, io)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        for cb in trainer.checkpoint_callbacks:
            if isinstance(vars(cb).get("file_exists"), _TakenNames):
                del cb.file_exists

    def _end_hand_over(self, trainer: Any) -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(io, TwCheckpointIO):
            io.load_into(None)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._end_hand_over(trainer)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._end_hand_over(trainer)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._end_hand_over(trainer)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._end_hand_over(trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._pending = True

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._pending:
            return
        self._pending = False
        io = trainer.strategy.checkpoint_io
        if isinstance(io, TwCheckpointIO):
            io.prepare(
                {
                    "state_dict": pl_module.state_dict(),
                    "optimizer_states": [opt.state_dict() for opt in trainer.optimizers],
                }
            )


__all__ = ["TwCheckpointIO", "TwPrepareFirstSave"]
