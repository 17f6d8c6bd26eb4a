"""The Checkpointer: small checkpoints inside a training loop, retention, crash-safe resume.

Usage::

    ckpt = Checkpointer("runs/ckpt", keyframe_every=10, keep_last=3)
    for step in range(start, steps):
        train_step()
        if step % 100 == 0:
            ckpt.save(step, model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    ckpt.close()

    # after a restart, into fresh objects:
    state = Checkpointer("runs/ckpt").restore(model=model, optimizer=opt, scheduler=sched)
    start = state["step"] + 1

What a save holds
    ``save(step, **state)`` stores ``{"step": step, <your names>: ..., "rng": ...}``:
    every object with a ``state_dict()`` (modules, optimizers, LR schedulers, GradScalers)
    by its state dict, plain values (ints, floats, strings, tensors, nested containers) as
    they are, and the RNG states of torch (CPU, and CUDA once CUDA is initialized), numpy
    and Python's ``random``. ``step`` and ``rng`` are therefore reserved names.

Keyframes and deltas
    Every ``keyframe_every``-th save (and the first save of a process) is a *keyframe*. The
    saves in between are *deltas*: the tensors the rules delta-code (the float tensors of at
    least 4096 elements under the name ``model``, so pass the model as ``model=``, or give
    ``rules``) are stored as the blockwise-quantized difference from a reference. A
    keyframe stores exactly those tensors exact (:func:`~tw_triton.rules.keyframe_rules`)
    and codes everything else by the rules. The default rules are the preset
    ``"smallest"`` (:data:`DEFAULT_RULES`): weight deltas in 2 bits, AdamW's ``exp_avg`` in
    int4 and ``exp_avg_sq`` by the ``log2`` codec in 4 bits, in keyframes and deltas alike;
    counters, small tensors and RNG states stay exact. With ``rules="default"`` the
    optimizer is exact and restoring a keyframe is bit for bit.

    ``delta`` picks the reference (:mod:`tw_triton.deltas`). ``"closed"`` (the default):
    each delta is coded against the reconstruction of the save before it, so its error
    does not grow with the distance from the keyframe; loading delta ``k`` decodes the
    keyframe and the deltas up to ``k`` (each file names the one before it), and a lost
    delta makes the ones after it unloadable until the next keyframe (:meth:`latest` falls
    back). ``"open"`` (or ``True``): every delta is coded against the keyframe; loading reads
    two files and losing a delta loses only that delta, but 2-bit weight deltas are too
    coarse for it (a warning says so): use ``rules="small"`` with open loop.

Device memory of deltas
    To encode deltas, the keyframe's values of the quantized-by-rule tensors stay where the
    tensors live (on the GPU for a GPU run): one extra copy of those tensors, in their own
    dtype (by default: one copy of the model's large weights; nothing for optimizer state).
    The copy is the keyframe snapshot itself, so it costs no extra copy at keyframe time.
    With ``delta=False`` nothing is kept: the saves between keyframes quantize the same
    tensors on their own (absolute values, blockwise), which is larger on disk than a delta
    and less exact, but needs no reference in memory or on disk.

Resuming in an existing directory
    A new ``Checkpointer`` on a directory that already holds checkpoints lists them (for
    ``latest``, ``load``, ``restore`` and retention) but never adopts an old keyframe as
    the reference for its deltas: its first ``save`` writes a new keyframe. Reading the
    old keyframe back to the device would cost as much as writing a new one, and the new
    one cannot belong to a different run that happened to use the same directory.

Host memory of snapshots
    On the CPU a save copies the state before ``save`` returns: a keyframe everything (it
    is stored exact); a delta too, with ``async_write``, and the writer thread then encodes
    the copy (a delta from the reference, which stays untouched until the last save that
    reads it is written), so the loop does not wait for the encode. With
    ``async_write=False`` a delta encodes in ``save`` and copies only what it stores exact.
    Fresh memory for the copy costs page faults on every save, which were most of the pause
    on a small VM, so the Checkpointer keeps the snapshot buffers in a
    :class:`~tw_triton.snapshot_pool.SnapshotPool` and the next save copies into them. A
    save's buffers go back to the pool only when its Future is done (the writer has
    finished with them); a keyframe's buffers that serve as the delta reference stay with
    the reference until the next keyframe (and the last save encoded against it). Cost: between saves the process keeps up to
    ``max_pending + 1`` snapshots' worth of host memory (one with ``async_write=False``)
    plus the pooled part of the reference, that it would otherwise give back to the OS,
    the largest snapshot so far being the measure; ``snapshot_pool_bytes`` sets another cap, ``0``
    turns reuse off. Buffers under 64 KiB and device buffers are not pooled (the heap and
    the CUDA caching allocator recycle those already). On the host the codes and scales
    that the writer thread's codecs produce come from the same save's lease (they go back
    with its snapshot). :attr:`Checkpointer.pool_bytes` reports what the pool holds. The
    first save of a process finds the pool empty; :meth:`Checkpointer.prepare` fills it
    ahead of that save (call it after the optimizer's first step). A keyframe that finds
    less than half of its copy's bytes in free pooled buffers (no ``prepare``, or
    ``snapshot_pool_bytes=0``) is encoded in ``save`` instead of copied: it then writes the
    moments' codes, a fraction of their bytes, into fresh memory instead of a full copy of
    them, which paused the loop less, finished the save sooner and held less memory (the
    README's "CPU speed" section). The writer thread then faults in the buffers the next
    save's copy needs, after that keyframe's write. Deltas always copy.

Crash safety
    Files appear under their final name only when complete (``format.write_file``: temp
    file, fsync, rename, directory fsync). A crash leaves at most temp files
    (``.step-....tmp``), which every listing ignores. A new ``Checkpointer`` removes them
    when it opens the directory, with one logged warning naming how many files and bytes,
    unless another writer (another process, or another open ``Checkpointer``) holds the
    directory: each holds a shared lock on it until :meth:`close`
    (:class:`~tw_triton.checkpoint_dir.DirectoryClaim`). :meth:`latest` verifies each
    candidate (checksums of the file and of its keyframe) and falls back, with a logged
    warning, to the newest checkpoint that verifies.

    A save's Future reports success only when its file and every file it needs (its
    keyframe and, in closed loop, the deltas before it) are written: a delta whose keyframe
    or earlier link failed is not written, its Future fails, and the next save is a new
    keyframe. The failure of the save it needed is raised to the loop once, at the next
    ``save``, ``flush`` or ``close`` (or by the ``save`` that was waiting for it).

Retention
    After each save completes, the ``keep_last`` newest checkpoints are kept, plus every
    keyframe that a kept (or still pending) delta needs, plus the keyframe that the next
    deltas will use; every other checkpoint file is deleted. A needed reference is never
    deleted.

One ``Checkpointer`` writes a directory at a time (several readers are fine).
"""

from __future__ import annotations

import functools
import gc
import logging
import operator
import os
import time
import uuid
from collections import Counter
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from . import format as _format
from .checkpoint_dir import (
    CheckpointDirectory,
    CheckpointInfo,
    DirectoryClaim,
    checkpoint_name,
    parse_checkpoint_name,
    wants_pinned,
)
from .errors import CheckpointError, TwTritonError
from .qstate import QuantizedState
from .deltas import (
    Reference,
    advance,
    check_reference,
    delta_mode,
    delta_coded,
    make_reference,
    with_references,
)
from .rng import capture_rng_state, restore_rng_state
from .rules import keyframe_rules, resolve_rules, rules_as_specs, warn_if_too_coarse
from .snapshot_pool import MIN_POOLED_BYTES, SavePool, SnapshotLease
from .state import decode_targets, quantize_state_dict, state_of
from .tree import Flattened, flatten, leaf_tensors
from .writer import AsyncWriter

logger = logging.getLogger(__name__)

RESERVED_NAMES = ("step", "rng")

# The smallest preset the resume benchmarks measured within the noise floor (README).
DEFAULT_RULES = "smallest"
DEFAULT_DELTA = "closed"

KIND_KEYFRAME = "keyframe"  # everything exact, no reference
KIND_DELTA = "delta"  # quantized entries are deltas from a keyframe
KIND_STANDALONE = "standalone"  # quantized without a reference (delta=False mode)


def _named_state(state: dict[str, Any]) -> dict[str, Any]:
    """What ``save(**state)`` stores under each name, after checking the reserved names."""
    for name in RESERVED_NAMES:
        if name in state:
            raise CheckpointError(
                f"'{name}' is a reserved name in a checkpoint (it holds the "
                f"{'step number' if name == 'step' else 'RNG states'}); use another name"
            )
    return {name: state_of(value) for name, value in state.items()}


def _done_future(result: Any = None) -> Future:
    f: Future = Future()
    f.set_result(result)
    return f


class Checkpointer:
    """Saves training state into a directory of small checkpoints, and restores it.

    Args:
        directory: where the checkpoints go (created if missing).
        keyframe_every: one save in this many is a keyframe (1: no deltas).
        keep_last: how many of the newest checkpoints retention keeps (plus the keyframes
            they need); ``None`` keeps everything.
        rules: which tensors are coded how, as in :func:`tw_triton.quantize_state_dict`
            (a preset name, default ``"small"``; ``None``: the library defaults, optimizer
            exact; ``[(glob, codec spec), ...]``). Paths start with the names given to
            :meth:`save` (``model/...``, ``optimizer/...``).
        bits, block: parameters of the quantizing rules.
        async_write: write on a background thread (``save`` returns a pending Future);
            ``False`` writes before ``save`` returns.
        delta: how the saves between keyframes are coded (:mod:`tw_triton.deltas`):
            ``"closed"`` (default) as deltas from the previous save's reconstruction,
            ``"open"`` (or ``True``) as deltas from the last keyframe; both keep one copy
            of the delta-coded tensors on their device. ``"none"`` (or ``False``) keeps
            nothing and quantizes those saves on their own.
        max_pending: saves in flight before ``save`` blocks (async only).
        pinned_bytes: cap on the writer's pinned host memory (async only; see
            :class:`~tw_triton.writer.AsyncWriter`).
        fsync: fsync files and the directory (leave on outside of tests).
        snapshot_pool_bytes: cap on the host memory kept to reuse for CPU snapshots
            (see "Host memory of snapshots" in the module docs); ``None``: ``max_pending
            + 1`` times the largest snapshot so far (1 time with ``async_write=False``),
            plus the reference;
            ``0``: no reuse, every snapshot in fresh memory.
        max_expansion: the directory's bound on what a checkpoint file's compressed
            buffers may decode to (``max_expansion`` times the file's size plus
            :data:`~tw_triton.format.EXPANSION_SLACK_BYTES`, checked from the header before
            anything is decoded: see :func:`~tw_triton.format.read_file`). It holds for
            every file :meth:`latest`, :meth:`load` and :meth:`restore` read, a delta's
            keyframe and earlier links included, so that the checkpoint ``latest()``
            picks is the one ``restore()`` loads. A state that holds a large constant
            tensor on purpose (a zero-initialised buffer) compresses far beyond the
            default: restore it with a larger value, or ``None`` for no bound.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keyframe_every: int = 10,
        keep_last: int | None = 3,
        rules: Any = DEFAULT_RULES,
        bits: int = 8,
        block: int = 128,
        async_write: bool = True,
        delta: bool | str = DEFAULT_DELTA,
        max_pending: int = 1,
        pinned_bytes: int | None = None,
        fsync: bool = True,
        snapshot_pool_bytes: int | None = None,
        max_expansion: float | None = _format.MAX_EXPANSION,
    ) -> None:
        self.delta_mode = delta_mode(delta)
        if keyframe_every < 1:
            raise CheckpointError(f"keyframe_every must be at least 1, got {keyframe_every}")
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last must be at least 1 or None, got {keep_last}")
        self._dir = CheckpointDirectory(directory, max_expansion=max_expansion)
        self.directory = self._dir.path
        self.max_expansion = max_expansion
        self._claim = DirectoryClaim(self.directory)
        self._claim.sweep(self._dir.temp_files)
        self.keyframe_every = keyframe_every
        self.keep_last = keep_last
        self.rules = rules
        self.bits = bits
        self.block = block
        self.delta = self.delta_mode != "none"
        self.fsync = fsync
        self._writer = (
            AsyncWriter(max_pending=max_pending, pinned_bytes=pinned_bytes, fsync=fsync)
            if async_write else None
        )
        self._reference: Reference | None = None
        self._since_keyframe: int | None = None  # None: the next save is a keyframe
        # Whether the pool got (or is getting) room for the first delta's copy of what the
        # reference holds: once per Checkpointer, by prepare() or after the first keyframe.
        self._ref_share_reserved = False
        # (the keyframe's Future, the Future of the writer's warm-up after it): see _warm_up
        self._warming: tuple[Future, Future] | None = None
        # step -> (future, id, ref id, what its file says of itself once encoded)
        self._inflight: dict[int, tuple[Future, str, str | None, _Noted]] = {}
        # Each save's pooled buffers, until its write is done (then back to the pool).
        self._saves = SavePool(snapshot_pool_bytes, (max_pending + 1) if async_write else 1)
        self._closed = False
        self._warned_coarse = False

    # ------------------------------------------------------------------- saving

    def save(self, step: int, **state: Any) -> Future:
        """Snapshot and encode ``state`` now; write it (in the background if async).

        The loop pauses for the snapshot and the encode (on CUDA: the kernel launches and
        one sync; on the CPU with ``async_write``: a copy, whose encode runs on the writer
        thread, or for a keyframe with no pooled memory to copy into, the encode itself),
        and for backpressure when ``max_pending`` saves are still being written.

        Args:
            step: the training step; names the file (a step saved again is replaced).
            **state: objects with ``state_dict()`` and plain values, by name.

        Returns:
            A Future that resolves to the bytes written (already resolved when
            ``async_write=False``).

        Raises:
            CheckpointError: an earlier async save failed (raised once, chained from the
                original; an ``OSError`` arrives as ``CheckpointIOError`` with its errno),
                a reserved name was used, or the Checkpointer is closed.
            QuantizationError: a value the format cannot store (names its path).
        """
        if self._closed:
            raise CheckpointError(f"cannot save step {step}: the Checkpointer of {self.directory!r} is closed")
        step = operator.index(step)
        if step < 0:
            raise CheckpointError(f"step must be non-negative, got {step}")
        named = _named_state(state)
        self._collect_finished()
        if self._writer is not None:
            try:
                self._writer.check()
            except TwTritonError:
                self._drop_reference_if_lost()
                raise
        self._retain()

        tree: dict[str, Any] = {"step": step, **named, "rng": capture_rng_state()}

        keyframe = self._since_keyframe is None or self._since_keyframe + 1 >= self.keyframe_every
        if keyframe and self._reference is not None:
            # A keyframe needs no reference, and the old one's buffers can hold the new one.
            self._retire_reference()
            self._saves.release_written()
        path = self._dir.path_for(step)
        meta: dict[str, Any] = {"step": step, "saved_at": time.time()}
        lease = self._saves.lease(self._kept_bytes())
        reference = self._reference if self.delta else None
        # What the writer thread could fail on is checked here, so it reaches the loop now.
        rule_list = resolve_rules(self.rules, tree, bits=self.bits, block=self.block)
        if not self._warned_coarse:
            self._warned_coarse = warn_if_too_coarse(rule_list, self.delta_mode, self.directory)
        job = _SaveJob(path, tree, rule_list, keyframe, reference, meta, lease, _Noted(path))
        ref_tree = reference.tree if reference is not None else None
        try:
            if self._writer is not None and _all_on_cpu(tree):
                queued = self._queue_snapshot(job)
            else:
                queued = self._encode_here(job)
        except BaseException:
            if lease is not None:
                lease.release()  # nothing was queued: no one reads these buffers
            if reference is not None and reference.tree is not ref_tree:
                self._drop_advanced_reference(step)
            raise
        future = queued.future
        if lease is not None:
            # Back to the pool only once the writer is done with them.
            self._saves.track(future, lease)

        self._inflight[step] = (future, queued.checkpoint_id, queued.reference_id, job.noted)
        if keyframe:
            self._since_keyframe = 0
            self._reference = (
                make_reference(queued.checkpoint_id, queued.ref_values, step, future,
                               closed=self.delta_mode == "closed")
                if self.delta else None
            )
            if self._reference is not None and lease is not None:
                # The reference outlives this save's write: its buffers leave the lease.
                self._reference.lease = lease.split(list(_leaves(self._reference.tree)))
            if queued.warm_up is not None:
                self._warm_up(queued.warm_up, lease, future)
        else:
            self._since_keyframe = (self._since_keyframe or 0) + 1
            if reference is not None and reference.closed and queued.reference_id is not None:
                self._link(reference, queued.checkpoint_id, step, future)
        if self._writer is None:
            self._collect_finished()
            self._retain()
        return future

    def _queue_snapshot(self, job: _SaveJob) -> _Queued:
        """CPU with an async writer: copy the state into the save's lease here (the only
        part that blocks the loop) and queue its encode and write on the writer thread."""
        reference = job.reference  # None for a keyframe: save() retired it
        q_id = uuid.uuid4().hex
        # Flattened once: the check, the copy and the writer's encode all take it.
        flat = Flattened.of(job.tree)
        if reference is not None:
            check_reference(flat, job.rule_list, reference, job.path)
        sizes = _nbytes_each(flat.tensors.values())
        self._wait_for_warm_up()
        if job.keyframe and not self._saves.warm_for(sizes):
            # No faulted-in memory to copy into (the first save of a process, no prepare):
            # encoding now writes the moments' codes, a fraction of their bytes, instead of
            # faulting in a copy of them, and so pauses less (see "Host memory of
            # snapshots"). Deltas always copy: in closed loop each one's encode advances
            # the reference on the writer thread, in order.
            return self._encode_here(job, flat, warm_up=sizes)
        snap_q = quantize_state_dict(flat, rules="exact", checkpoint_id=q_id, allocate=job.lease)
        # The copy's tensors by path, in the state's order (tied ones shared): the exact
        # entries' buffers, allocated in the tensors' shapes.
        copies = snap_q.entries
        snapshot = Flattened({p: copies[snap_q.aliases.get(p, p)].buffers["data"] for p in flat.tensors},
                             flat.skeleton)
        del snap_q, copies
        ref_values: dict[str, torch.Tensor] = {}
        # The writer thread's codecs write their codes and scales into this save's lease as
        # well: pooled, they do not page-fault fresh memory every save.
        if job.keyframe:
            encode = functools.partial(
                _encode_keyframe, snapshot, rules_as_specs(keyframe_rules(job.rule_list)), self.bits,
                self.block, job.meta, q_id, allocate=job.lease,
            )
            # Chosen before the writer thread starts: rule matching is Python, and once that
            # thread runs it would wait on the GIL (seen as 30% of the pause).
            if self.delta:
                ref_values = delta_coded(snapshot.tensors, job.rule_list)
        else:
            encode = functools.partial(
                _encode_snapshot, snapshot, reference, self.rules, self.bits, self.block,
                job.meta, q_id, allocate=job.lease, ref_at=_ref_at(reference),
            )
        future = self._write(job.noted.noting(encode), job.path, reference)
        if reference is not None:
            reference.last_use = future
        if ref_values and not self._ref_share_reserved:
            # The first delta copies the state while this keyframe's copies of what it is
            # coded against stay held as the reference: fault that much memory in on the
            # writer thread once the keyframe is written, not in that delta's save() (see
            # prepare()).
            self._ref_share_reserved = True
            self._writer.call(functools.partial(self._saves.reserve_beside, _nbytes_each(ref_values.values())))
        return _Queued(future, q_id, reference.checkpoint_id if reference is not None else None, ref_values)

    def _encode_here(self, job: _SaveJob, flat: Flattened | None = None,
                     warm_up: list[int] | None = None) -> _Queued:
        """Encode the live state on this thread (a device state, ``async_write=False``, or a
        keyframe with no pooled memory to copy into) and hand the encoded state to the
        writer (or write it now). ``flat``: the state already flattened; ``warm_up``: the
        sizes of the snapshot that found no pooled memory (see :meth:`_warm_up`)."""
        ref_values: dict[str, torch.Tensor] = {}
        if job.keyframe:
            q = _encode_keyframe(job.tree if flat is None else flat, rules_as_specs(keyframe_rules(job.rule_list)),
                                 self.bits, self.block, job.meta, None, allocate=job.lease)
            # The tensors deltas are coded against are exact entries of the keyframe, under
            # every path that names them: a tied weight's alias is coded against it too.
            if self.delta:
                exact = {p: e.buffers["data"] for p, e in q.entries.items() if e.codec == "exact"}
                exact.update({alias: exact[target] for alias, target in q.aliases.items() if target in exact})
                ref_values = delta_coded(exact, job.rule_list)
        else:
            q = _encode_snapshot(job.tree, job.reference, self.rules, self.bits, self.block, job.meta, None,
                                 allocate=job.lease, ref_at=_ref_at(job.reference))
        job.noted.note(q)
        reference = job.reference if q.reference_id is not None else None
        return _Queued(self._write(q, job.path, reference), q.checkpoint_id, q.reference_id, ref_values, warm_up)

    def _warm_up(self, sizes: list[int], lease: SnapshotLease | None, written: Future) -> None:
        """After a keyframe encoded in ``save`` for want of pooled memory: fault in buffers
        for the next save's copy of buffers of ``sizes`` on the writer thread, after that
        keyframe's write (``written``, its Future), as :meth:`prepare` would have (the next
        save is a delta, which copies). The buffers ``lease`` keeps after the reference
        split off its own come back to the pool with the write (the copies of what the
        keyframe stores exact, its codes): only the sizes they do not cover are added."""
        if self._writer is None or lease is None:
            return
        # The reference holds the keyframe's own buffers, so this covers the whole copy:
        # the first delta needs no share reserved for it.
        self._ref_share_reserved = True
        missing = Counter(n for n in sizes if n >= MIN_POOLED_BYTES) - Counter(lease.buffer_sizes())
        if missing:
            self._saves.make_room(sizes, self._kept_bytes())
            warmed = self._writer.call(functools.partial(self._saves.reserve_beside, list(missing.elements())))
            self._warming = (written, warmed)

    def _wait_for_warm_up(self) -> None:
        """Before a copy: if the writer thread is faulting in its buffers (:meth:`_warm_up`)
        because the keyframe before it is written, wait for the rest. Copying into fresh
        memory instead would cost the loop the same page faults and hold a second copy
        (seen in ``speed_compare.py``, whose first delta follows its keyframe at once). A
        keyframe still being written is not waited for: that is what ``max_pending`` is."""
        if self._warming is None:
            return
        written, warmed = self._warming
        if written.done() or warmed.done():
            wait_futures([warmed])
            self._warming = None

    def prepare(self, **state: Any) -> int:
        """Fault in the host memory the first save will copy ``state`` into, now.

        On the CPU with ``async_write`` a save copies the state into pooled buffers before
        it returns (see "Host memory of snapshots"). The first save of a process finds the
        pool empty: it encodes the keyframe in ``save`` instead, whose codes need less fresh
        memory than a copy, but its page faults are still most of its pause. ``prepare``
        allocates the copy's buffers and touches their pages here instead, outside the
        loop's saves, and the first save then copies as the later ones do.

        Call it with the same objects as :meth:`save`, once they have their final shapes:
        AdamW creates its moments at the optimizer's first step, so a ``prepare`` before
        that step reserves the model's share only. The memory is the pool's from then on
        (the first save would take it anyway); ``snapshot_pool_bytes`` caps it too.
        Reserving again adds only what is missing. Before the first keyframe it also
        reserves a second copy of the tensors the rules delta-code: the first delta copies
        the state while the keyframe's copies of those stay held as its reference. The codes
        and scales that the writer thread makes are not reserved: they do not pause the loop.

        It also runs Python's full garbage collection now (unless the garbage collector is
        disabled): the objects that setup made (imports, model, optimizer) bring the next
        full collection close, and it stops every thread for as long as the process has
        objects to scan (0.16-0.17 s in a MiniLM training process), inside whichever save
        comes next otherwise. See the README's section on the garbage collector.

        Returns:
            Bytes reserved now: 0 when there is nothing to reserve (``snapshot_pool_bytes=0``,
            ``async_write=False``, which copies only what it stores exact, or a state with
            tensors off the CPU, whose snapshot the device allocators serve).

        Raises:
            CheckpointError: a reserved name, or the Checkpointer is closed.
            QuantizationError: a value the format cannot store (names its path).
        """
        if self._closed:
            raise CheckpointError(f"cannot prepare: the Checkpointer of {self.directory!r} is closed")
        tree = _named_state(state)
        collect_setup_garbage()
        if self._writer is None or not _all_on_cpu(tree):
            return 0
        self._collect_finished()  # written saves' buffers are free again: count them
        flat = flatten(tree)[0]
        sizes = _nbytes_each(flat.values())
        # The first delta copies the state while the keyframe's copies of what it is coded
        # against stay held as the reference: room for those too, until a reference holds
        # its own. Without it that delta paused 0.21x torch.save instead of ~0.16x (default
        # rules), 0.33x with "int8-exp-avg", whose reference also holds exp_avg.
        extra: list[int] = []
        if self.delta and self._reference is None and not self._ref_share_reserved:
            rule_list = resolve_rules(self.rules, tree, bits=self.bits, block=self.block)
            extra = _nbytes_each(delta_coded(flat, rule_list).values())
            self._ref_share_reserved = bool(extra)
        return self._saves.reserve(sizes, self._kept_bytes(), extra)

    def flush(self) -> None:
        """Wait for every pending save, apply retention, and raise a failed save's error.

        When it returns, the files retention dropped are deleted, not only out of the listing.
        """
        if self._writer is not None:
            try:
                self._writer.flush()
            finally:
                self._collect_finished()
                self._drop_reference_if_lost()
        self._retain()
        if self._writer is not None:
            self._writer.flush()  # the deletions that retention just queued

    def close(self) -> None:
        """Flush, stop the writer thread, and drop the reference. Closing twice is harmless."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._retire_reference()
            try:
                if self._writer is not None:
                    self._writer.close()
            finally:
                self._saves.close()
                self._claim.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except TwTritonError as err:  # do not hide the loop's own exception
            logger.error("while handling %s: %s", exc_type.__name__, err)

    @property
    def reference_nbytes(self) -> int:
        """Bytes the current keyframe reference holds on its devices (0 without one)."""
        return self._reference.nbytes if self._reference is not None else 0

    @property
    def reference_id(self) -> str | None:
        """Id of the checkpoint the next delta will be coded against (``None``: the next
        save is a keyframe). In closed loop, the last delta; else the last keyframe."""
        return self._reference.checkpoint_id if self._reference is not None else None

    @property
    def pool_bytes(self) -> int:
        """Host bytes the snapshot pool holds now: in saves not yet written, in the
        reference, and free for the next save (0 with ``snapshot_pool_bytes=0``)."""
        return self._saves.held_bytes

    # ------------------------------------------------------------------ listing

    def steps(self) -> list[int]:
        """Steps of the complete checkpoint files in the directory, oldest first.

        Temp files are not listed; files are not verified (see :meth:`latest`). Waits for
        this Checkpointer's pending saves first (without raising their errors).
        """
        self._wait_inflight()
        return sorted(self._dir.scan())

    def infos(self) -> list[CheckpointInfo]:
        """:class:`CheckpointInfo` of every complete checkpoint file, oldest first."""
        self._wait_inflight()
        found = self._dir.scan()
        return [found[s] for s in sorted(found)]

    def latest(self, *, verify: bool = True) -> int | None:
        """The newest step whose checkpoint (and the keyframe it needs) is good, or ``None``.

        With ``verify`` every candidate file is read and its checksums checked; a file that
        fails (corrupted, or over the Checkpointer's ``max_expansion``), or a delta whose
        keyframe is missing or fails, is skipped with a logged warning, and the next older
        one is tried. Waits for pending saves first.
        """
        self._wait_inflight()
        return self._dir.latest(verify=verify)

    def path_for(self, step: int) -> str:
        """Path of the checkpoint file of ``step`` (whether or not it exists)."""
        return self._dir.path_for(step)

    def remove_temp_files(self) -> list[str]:
        """Delete the temp files that interrupted writes left here; return their paths.

        Retention renames a checkpoint it drops to such a name before the writer thread
        unlinks it, so a crash in between leaves one too.

        A new Checkpointer does this when it opens the directory, if no other writer holds
        it. This method does not look: call it only when nothing else is writing here.
        """
        return self._dir.remove_temp_files()

    # ------------------------------------------------------------------ loading

    def load(
        self, step: int | None = None, *, device: torch.device | str = "cpu", verify: bool = True,
        into: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint (default: :meth:`latest`) as the nested state that was saved.

        Args:
            step: which checkpoint; ``None`` for the latest good one.
            device: where the tensors are loaded.
            verify: check the checksums (and, for the latest, skip checkpoints that fail).
            into: objects by the names used in ``save`` (``{"model": model}``), to decode
                into on the CPU: a tensor of an object's ``state_dict()`` that is
                contiguous, of the stored dtype and shape, sharing no memory with another
                one, and stored exact (or decoded over such a one) is filled in place, and
                the returned state holds it (see :meth:`restore`, which does this for the
                objects it restores). ``load_state_dict`` is not called. If the load fails
                part way, they may hold part of what was read.

        Returns:
            ``{"step": int, <names given to save>: their state dicts or values,
            "rng": {...}}``, tensors on ``device``.

        Raises:
            CheckpointError: no good checkpoint (the message says why the newest was
                passed over), no checkpoint for ``step``, or a bad file (naming the file
                and the entry), a file over the Checkpointer's ``max_expansion`` included.
            ReferenceMismatchError: the keyframe a delta needs is missing or different.
        """
        targets = decode_targets(into) if into and torch.device(device).type == "cpu" else None
        return self._load(step, device=device, verify=verify, into=targets)[0]

    def _load(
        self, step: int | None, *, device: torch.device | str, verify: bool,
        into: dict[str, torch.Tensor] | None = None,
    ) -> tuple[dict[str, Any], CheckpointInfo]:
        """:meth:`load`, and the info of the file it loaded.

        For the latest checkpoint with ``verify``, the files are read once: the reads that
        verified them (checksums checked as they come in) are the ones decoded. ``into``:
        tensors to read exact entries into, by path (see :meth:`restore`).
        """
        dev = torch.device(device)
        self._wait_inflight()
        if step is None and verify:
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise TwTritonError(f"cannot load from {self.directory!r} to {dev}: CUDA is not available")
            found, info, reads = self._dir.latest_read(pin=wants_pinned(dev), into=into)
        else:
            found, info = self._dir.find(step, verify=verify)
            reads = {}
        state = self._dir.decode(info, found, reads, dev, verify=verify, into=into)
        if not isinstance(state, dict) or "step" not in state:
            raise CheckpointError(
                f"{info.path}: not a Checkpointer checkpoint (expected a dict with 'step' at the top)"
            )
        return state, info

    def restore(
        self,
        step: int | None = None,
        *,
        device: torch.device | str | None = None,
        rng: bool = True,
        **objects: Any,
    ) -> dict[str, Any]:
        """Load a checkpoint (default: :meth:`latest`) back into live objects.

        ``ckpt.restore(model=model, optimizer=opt, scheduler=sched, scaler=scaler)`` calls
        each object's ``load_state_dict`` with the state saved under the same name, and
        (with ``rng``) puts back the RNG states, so that the run continues as the saved one
        would have: bit for bit from a keyframe, within quantization error from a delta.

        On the CPU, tensors are decoded into the objects' own where they can be: each
        tensor of an object's ``state_dict()`` that is contiguous, shares no memory with
        another one, and is stored exact in the checkpoint (a keyframe's weights, which a
        delta is then decoded over) is read straight into, so the model is not held
        twice and ``load_state_dict`` has nothing left to copy. The returned state then
        shares those tensors. If restoring fails, the objects may hold part of what was
        read: restore again, or rebuild them.

        Args:
            step: which checkpoint; ``None`` for the latest good one.
            device: where the tensors are loaded before ``load_state_dict``; default: the
                device of the first parameter of the object named ``model`` (or of any
                module given), else the CPU.
            rng: restore the RNG states too.
            **objects: objects with ``load_state_dict``, by the names used in ``save``.

        Returns:
            The loaded state (as :meth:`load`), e.g. ``state["step"]`` and plain values.

        Raises:
            CheckpointError: a name that the checkpoint lacks, an object without
                ``load_state_dict``, or anything :meth:`load` raises.
        """
        for name, obj in objects.items():
            if not callable(getattr(obj, "load_state_dict", None)):
                raise CheckpointError(
                    f"cannot restore {name!r}: {type(obj).__name__} has no load_state_dict(); "
                    f"plain values are in the dict restore() returns"
                )
        if device is None:
            device = _default_device(objects)
        into = decode_targets(objects) if torch.device(device).type == "cpu" else None
        state, info = self._load(step, device=device, verify=True, into=into)
        for name, obj in objects.items():
            if name not in state:
                saved = sorted(k for k in state if k not in RESERVED_NAMES)
                raise CheckpointError(f"{info.path}: holds no state named {name!r}; it holds {saved}")
            obj.load_state_dict(state[name])
        if rng:
            if "rng" not in state:
                raise CheckpointError(f"{info.path}: holds no RNG states")
            restore_rng_state(state["rng"], source=info.path)
        return state

    # ---------------------------------------------------------------- internals

    def _write(self, q: QuantizedState | Callable[[], QuantizedState], path: str,
               reference: Reference | None) -> Future:
        """Write (or queue) ``q``; a delta's write waits for the saves it is coded against
        and fails if one of them did (:meth:`AsyncWriter.submit`), so that no Future
        reports success for a file that could never load."""
        if self._writer is not None:
            return self._writer.submit(q, path, after=_depends_on(reference))
        assert not callable(q), "only the async writer encodes on its thread"
        return _done_future(_format.write_file(q, path, fsync=self.fsync))

    def _drop_advanced_reference(self, step: int) -> None:
        """Closed loop: the save of ``step`` advanced the reference to its reconstruction
        and then was not written. The next delta would name the link before it while being
        coded against it, and load wrong: start a new keyframe instead."""
        logger.warning(
            "the save of step %d failed after the closed-loop reference moved on to it; "
            "the next save will be a new keyframe", step,
        )
        self._retire_reference()
        self._since_keyframe = None

    def _drop_reference_if_lost(self) -> None:
        """A keyframe whose write failed cannot serve as a reference: start a new one."""
        ref = self._reference
        if ref is not None and ref.lost():
            logger.warning(
                "a save that the next delta would build on (step %d or its keyframe) was not "
                "written; the next save will be a new keyframe", ref.step
            )
            self._retire_reference()
            self._since_keyframe = None

    def _link(self, reference: Reference, checkpoint_id: str, step: int, future: Future) -> None:
        """Closed loop: the delta just saved is what the next delta is coded against.

        Its encode (now, or on the writer thread before the next save's) advances the
        reference's tensors, decoding over the keyframe's pooled buffers once the
        keyframe is written (:func:`~tw_triton.deltas.advance`): those stay with the
        reference (``reference.lease``) until it is retired, as in open loop. Handing them
        back after the first delta made that delta's advance decode into fresh memory:
        the model's weights' size of page faults on every cycle.
        """
        reference.checkpoint_id, reference.step = checkpoint_id, step
        reference.links.append(future)

    def _kept_bytes(self) -> int:
        """Pooled bytes the reference keeps beyond the saves' own (a delta copies the whole
        state while the reference is held)."""
        ref = self._reference
        return ref.lease.nbytes if ref is not None and ref.lease is not None else 0

    def _retire_reference(self) -> None:
        """Drop the reference; its buffers go back to the pool once its keyframe is written."""
        ref, self._reference = self._reference, None
        if ref is not None and ref.lease is not None:
            # The writer runs saves in order: when the last one that reads the reference is
            # done, so are the keyframe and every other one.
            self._saves.track(ref.last_use or ref.future, ref.lease, own=False)

    def _collect_finished(self) -> None:
        for step, (future, _, _, noted) in list(self._inflight.items()):
            if future.done():
                del self._inflight[step]
                self._note_written(step, future, noted)
        self._drop_reference_if_lost()
        self._saves.release_written()

    def _note_written(self, step: int, future: Future, noted: _Noted) -> None:
        """List a file this Checkpointer has just written without parsing its header
        (:meth:`CheckpointDirectory.note`): retention lists the directory on every save."""
        if noted.info is None or future.cancelled() or future.exception() is not None:
            return
        self._dir.note(step, noted.path, future.result(), noted.info)

    def _wait_inflight(self) -> None:
        wait_futures([f for f, _, _, _ in self._inflight.values()])
        self._collect_finished()

    def _retain(self) -> None:
        """Delete checkpoints that are neither among the newest nor needed by a kept one."""
        if self.keep_last is None:
            return
        found = self._dir.scan()
        complete = [s for s in sorted(found, reverse=True) if s not in self._inflight]
        keep = set(complete[: self.keep_last]) | set(self._inflight)
        needed = {ref for _, _, ref, _ in self._inflight.values() if ref is not None}
        if self._reference is not None:
            needed.add(self._reference.checkpoint_id)
        needed |= {found[s].reference_id for s in keep if s in found and found[s].reference_id}
        needed = with_references(needed, {info.checkpoint_id: info for info in found.values()})
        for step, info in found.items():
            if step in keep or info.checkpoint_id in needed:
                continue
            # Renamed out of the listing here (a metadata update), unlinked on the writer
            # thread: the unlink of a large file is slow (see AsyncWriter.discard). A crash
            # in between leaves a temp file that remove_temp_files() deletes.
            doomed = self._dir.discard(info)
            if doomed is None:
                continue
            if self._writer is not None:
                self._writer.discard(doomed)
            else:
                _format.remove_quietly(doomed)
            logger.debug("retention removed %s", info.path)


def collect_setup_garbage() -> None:
    """One full garbage collection, unless the caller turned the collector off.

    Setup makes many long-lived objects, and Python runs a full collection once enough of
    them have piled up, at a moment set by allocation counts: in ``benchmarks/loop_pauses.py``
    it ran inside the second save of every run without ``prepare`` (0.17-0.18 s), and
    inside none with it. Run here, it resets that count.
    """
    if gc.isenabled():
        gc.collect()


def _nbytes_each(tensors: Iterable[torch.Tensor]) -> list[int]:
    return [t.numel() * t.element_size() for t in tensors]


def _all_on_cpu(tree: Any) -> bool:
    return all(t.device.type == "cpu" for t in leaf_tensors(tree))


def _depends_on(reference: Reference | None) -> list[Future]:
    """The writes a delta coded against ``reference`` needs on disk: its keyframe and, in
    closed loop, every link since."""
    return [] if reference is None else [reference.future, *reference.links]


def _ref_at(reference: Reference | None) -> tuple[str, int] | None:
    """The id and step of the checkpoint a delta saved now is coded against."""
    return None if reference is None else (reference.checkpoint_id, reference.step)


@dataclass
class _SaveJob:
    """What one ``save`` call decided, for the branch that encodes it."""

    path: str
    tree: dict[str, Any]
    rule_list: Any
    keyframe: bool
    reference: Reference | None
    meta: dict[str, Any]
    lease: SnapshotLease | None
    noted: _Noted


@dataclass
class _Queued:
    """A save handed to the writer: its future, ids, and (a keyframe) the tensors the next
    deltas are coded against."""

    future: Future
    checkpoint_id: str
    reference_id: str | None
    ref_values: dict[str, torch.Tensor]
    warm_up: list[int] | None = None  # sizes to fault in for the next save (see _warm_up)


class _Noted:
    """What a save's file says of itself (id, reference id, kind), noted when its encode
    ran, for :meth:`Checkpointer._note_written`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.info: tuple[str, str | None, str] | None = None

    def note(self, q: QuantizedState) -> None:
        """Note the fields of ``q``, the state the file is written from."""
        self.info = (q.checkpoint_id, q.reference_id, (q.metadata or {}).get("kind", "unknown"))

    def noting(self, encode: Callable[[], QuantizedState]) -> Callable[[], QuantizedState]:
        """``encode``, noting the fields of the state it returns."""

        def encode_and_note() -> QuantizedState:
            q = encode()
            self.note(q)
            return q

        return encode_and_note


def _encode_snapshot(
    snapshot: Any,
    reference: Reference | None,
    rules: Any,
    bits: int,
    block: int,
    meta: dict[str, Any],
    checkpoint_id: str | None,
    *,
    allocate: SnapshotLease | None = None,
    ref_at: tuple[str, int] | None = None,
) -> QuantizedState:
    """Encode a save between keyframes: a delta from ``reference``, or on its own without.

    With ``checkpoint_id`` it runs on the writer thread over ``snapshot``, a private copy of
    the state (exact entries then hold the copy's tensors, no second copy); without, it
    runs in ``save`` over the live state (copies into ``allocate``). ``ref_at`` is the id
    and step of the reference as they were at ``save`` (in closed loop the main thread
    moves them on before the writer thread gets here). A closed-loop reference is advanced
    to this delta's reconstruction before returning.
    """
    deferred = checkpoint_id is not None
    if reference is not None:
        ref_id, ref_step = ref_at if ref_at is not None else (reference.checkpoint_id, reference.step)
        q = quantize_state_dict(
            snapshot, reference=reference.tree, reference_id=ref_id, rules=rules,
            bits=bits, block=block, metadata=meta, checkpoint_id=checkpoint_id, allocate=allocate,
            copy=not deferred,
        )
        q.metadata["kind"] = KIND_DELTA if q.reference_id is not None else KIND_STANDALONE
        if q.reference_id is not None:
            q.metadata["reference_step"] = ref_step
            if reference.closed:
                q.metadata["delta_mode"] = "closed"
                advance(reference, q)
    else:
        q = quantize_state_dict(snapshot, rules=rules, bits=bits, block=block, metadata=meta,
                                checkpoint_id=checkpoint_id, allocate=allocate, copy=not deferred)
        q.metadata["kind"] = KIND_STANDALONE
    return q


def _encode_keyframe(
    snapshot: Any,
    rules: Any,
    bits: int,
    block: int,
    meta: dict[str, Any],
    checkpoint_id: str | None,
    *,
    allocate: SnapshotLease | None = None,
) -> QuantizedState:
    """Encode a keyframe with ``rules`` (the keyframe rules: delta-coded tensors exact).

    With ``checkpoint_id`` it runs on the writer thread over ``snapshot``, a private copy
    (exact entries hold its tensors); without, in ``save`` over the live state.
    """
    deferred = checkpoint_id is not None
    q = quantize_state_dict(snapshot, rules=rules, bits=bits, block=block, metadata=meta,
                            checkpoint_id=checkpoint_id, allocate=allocate, copy=not deferred)
    q.metadata["kind"] = KIND_KEYFRAME
    return q


def _leaves(tree: Any):
    """The tensors of a tree of nested dicts (a reference tree)."""
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    elif isinstance(tree, torch.Tensor):
        yield tree


def _default_device(objects: dict[str, Any]) -> torch.device:
    candidates = [objects["model"]] if "model" in objects else []
    candidates += [o for o in objects.values() if isinstance(o, torch.nn.Module)]
    for obj in candidates:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                return p.device
    return torch.device("cpu")


__all__ = [
    "Checkpointer",
    "CheckpointInfo",
    "checkpoint_name",
    "parse_checkpoint_name",
    "capture_rng_state",
    "restore_rng_state",
]
