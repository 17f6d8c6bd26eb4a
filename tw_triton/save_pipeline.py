"""The save pipeline of a Checkpointer: snapshot, encode, queue.

:meth:`SavePipeline.save` turns one ``save`` call into a queued write. On the CPU with an
async writer it copies the state into pooled host buffers (the only part that blocks the
loop) and queues the encode and the write on the writer thread; otherwise (a device
state, ``async_write=False``, or a keyframe with no pooled memory to copy into) it encodes
here and hands the encoded state to the writer. A keyframe stores the delta-coded tensors
exact and starts the :class:`~tw_triton.reference_chain.ReferenceChain`; a delta's write
depends on its keyframe and links. Why: docs/training-loop.md ("Memory", "The first save").
"""

from __future__ import annotations

import functools
import gc
import logging
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import torch

from . import format as _format
from . import interval_rules, kernel_variants
from .deltas import Reference, delta_coded, keyframe_values, reference_misfit
from .device_memory import own_copies, private_copies
from .optimizer_classes import METADATA_KEY
from .qstate import QuantizedState
from .reference_chain import ReferenceChain, depends_on, ref_at
from .retention import InFlight, NotedFile, SaveInFlight
from .rules import keyframe_rules, resolve_rules, rules_as_specs, warn_if_too_coarse
from .save_encode import encode_delta, encode_keyframe, keyframe_values_then
from .snapshot_pool import MIN_POOLED_BYTES, SavePool, SnapshotLease
from .state import quantize_state_dict
from .tree import Flattened, flatten, leaf_tensors
from .writer import AsyncWriter

logger = logging.getLogger(__name__)


@dataclass
class SaveJob:
    """What one ``save`` call decided, for the branch that encodes it."""

    path: str
    tree: dict[str, Any]
    rule_list: Any
    keyframe: bool
    reference: Reference | None
    meta: dict[str, Any]
    lease: SnapshotLease | None
    noted: NotedFile
    rules: Any = None  # the rules value rule_list resolves (a delta's encode resolves it again)
    flat: Flattened | None = None  # the tree flattened once: the check, the copy and the encode


@dataclass
class Queued:
    """A save handed to the writer: its future, ids, and (a keyframe) the tensors the next
    deltas are coded against."""

    future: Future
    checkpoint_id: str
    reference_id: str | None
    ref_values: dict[str, torch.Tensor]
    warm_up: list[int] | None = None  # sizes to fault in for the next save (see warm_up)


class SavePipeline:
    """Snapshots, encodes and queues the saves of one Checkpointer.

    Args:
        writer: the async writer, or ``None`` to write before ``save`` returns.
        saves: the pooled host buffers of the saves' snapshots.
        chain: the delta reference and when the next keyframe is due.
        inflight: where each queued save is tracked until it is done.
        rules, bits, block: how tensors are coded (:func:`~tw_triton.rules.resolve_rules`).
        fsync: fsync what is written without a writer.
        directory: the directory, for the warning about too coarse rules.
        host_reference: keep the delta reference of a device state in host memory.
    """

    def __init__(
        self,
        writer: AsyncWriter | None,
        saves: SavePool,
        chain: ReferenceChain,
        inflight: InFlight,
        *,
        rules: Any,
        bits: int,
        block: int,
        fsync: bool,
        directory: str,
        host_reference: bool = False,
    ) -> None:
        self.writer, self.saves, self.chain, self.inflight = writer, saves, chain, inflight
        self.host_reference = host_reference
        self.rules, self.bits, self.block, self.fsync = rules, bits, block, fsync
        self.directory = directory
        # Whether the pool got (or is getting) room for the first delta's copy of what the
        # reference holds: once per Checkpointer, by prepare() or after the first keyframe.
        self.ref_share_reserved = False
        # (the keyframe's Future, the Future of the writer's warm-up after it): see warm_up
        self.warming: tuple[Future, Future] | None = None
        self.warned_coarse = False
        # The step of the last save made or restored ("auto" rules: the interval since it).
        self.last_step: int | None = None
        # The reference (weakly: a dropped reference's tensors must go) and the tensor layout
        # (path: shape, dtype) of the last save: a save of the same layout against the same
        # reference fits it, unchecked (the check selects a rule per entry).
        self.fitted: tuple[weakref.ref[Reference] | None, Any] = (None, None)

    def count_first_interval(self, step: int, written_steps: Callable[[], list[int]]) -> None:
        """Before a save of ``step``: for ``"auto"`` rules with no save made or restored yet,
        count its interval from the newest checkpoint before it in the directory
        (``written_steps()``), else step 0 (:func:`~tw_triton.interval_rules.counted_from`)."""
        if self.last_step is None and interval_rules.is_auto(self.rules):
            self.last_step = interval_rules.counted_from(step, written_steps())

    def rules_for(self, step: int) -> Any:
        """The rules a save of ``step`` codes with: for ``"auto"``, the preset of its interval
        since the last save made or restored (the first: since step 0)."""
        return interval_rules.rules_after(self.rules, step, self.last_step)

    def save(
        self, step: int, tree: dict[str, Any], path: str, record: dict[str, Any] | None = None
    ) -> Future:
        """Snapshot and encode ``tree`` (the whole saved state) for ``path``; return its Future.
        ``record``: more for the file's metadata (:mod:`~tw_triton.optimizer_classes`)."""
        chain = self.chain
        rules = self.rules_for(step)
        if chain.reference is not None and chain.rules != rules:
            # Another preset may delta-code other entries: a new chain.
            logger.info(
                "step %d is coded with rules %r, not %r: it starts a keyframe", step, rules, chain.rules
            )
            chain.restart()
        elif chain.reference is not None and step <= chain.reference.step:
            # Its file replaces the reference's (the same step) or a rewound run's saves go on
            # to replace the chain's files: a delta would name a file that changes under it.
            logger.info(
                "step %d is not after step %d, the reference of the next delta: it starts a keyframe",
                step,
                chain.reference.step,
            )
            chain.restart()
        # What the writer thread could fail on is checked here, so it reaches the loop now.
        flat = Flattened.of(tree)
        rule_list = resolve_rules(rules, tree, bits=self.bits, block=self.block)
        tensors = flat.tensors.values()  # few objects: the layout is built at every save
        layout = (list(flat.tensors), [t.shape for t in tensors], [t.dtype for t in tensors])
        misfit = None
        fitted_ref = self.fitted[0]() if self.fitted[0] is not None else None
        if chain.reference is not None and (fitted_ref is not chain.reference or self.fitted[1] != layout):
            misfit = reference_misfit(flat, rule_list, chain.reference)
        # Not held past here: a keyframe below retires the reference, whose tensors must be
        # free before the new keyframe copies its own.
        del fitted_ref
        if misfit is not None:
            # The model changed since the keyframe (grown, resized, a part removed).
            logger.info(
                "the state saved at step %d does not fit the reference of step %d (%s): it starts a keyframe",
                step,
                chain.reference.step,
                misfit,
            )
            chain.restart()
        keyframe = chain.keyframe_due()
        if keyframe and chain.reference is not None:
            # A keyframe needs no reference, and the old one's buffers can hold the new one.
            chain.retire()
            self.saves.release_written()
        meta: dict[str, Any] = {"step": step, "saved_at": time.time()}
        if record:
            meta[METADATA_KEY] = record
        lease = self.saves.lease(chain.kept_bytes())
        reference = chain.reference if chain.delta else None
        if not self.warned_coarse:
            self.warned_coarse = warn_if_too_coarse(rule_list, chain.mode, self.directory)
        job = SaveJob(path, tree, rule_list, keyframe, reference, meta, lease, NotedFile(path), rules, flat)
        ref_tree = reference.tree if reference is not None else None
        try:
            if self.writer is not None and all_on_cpu(tree):
                queued = self.queue_snapshot(job)
            else:
                queued = self.encode_here(job, flat)
        except BaseException:
            if lease is not None:
                lease.release()  # nothing was queued: no one reads these buffers
            if reference is not None and reference.tree is not ref_tree:
                chain.drop_advanced(step)
            raise
        future = queued.future
        if lease is not None:
            # Back to the pool only once the writer is done with them.
            self.saves.track(future, lease)
        self.inflight.add(step, SaveInFlight(future, queued.checkpoint_id, queued.reference_id, job.noted))
        self.last_step, chain.rules = step, rules
        if keyframe:
            chain.start(queued.checkpoint_id, queued.ref_values, step, future, lease)
            ref = chain.reference
            if ref is not None and self.writer is not None and not all_on_cpu(ref.tree):
                # Its write reads the host copies once these fire: advance need not wait for it.
                ref.copied = self.writer.copy_events(future)
            if queued.warm_up is not None:
                self.warm_up(queued.warm_up, lease, future)
        else:
            chain.add_delta(reference, queued.checkpoint_id, queued.reference_id, step, future)
        self.fitted = (weakref.ref(chain.reference) if chain.reference is not None else None, layout)
        return future

    def queue_snapshot(self, job: SaveJob) -> Queued:
        """CPU with an async writer: copy the state into the save's lease here (the only
        part that blocks the loop) and queue its encode and write on the writer thread."""
        reference = job.reference  # None for a keyframe: save() retired it
        q_id = uuid.uuid4().hex
        flat = job.flat if job.flat is not None else Flattened.of(job.tree)
        sizes = nbytes_each(flat.tensors.values())
        self.wait_for_warm_up()
        if job.keyframe and not self.saves.warm_for(sizes):
            # No faulted-in memory to copy into (the first save of a process, no prepare):
            # encoding now writes the moments' codes, a fraction of their bytes, instead of
            # faulting in a copy of them, and so pauses less. Deltas always copy: in closed
            # loop each one's encode advances the reference on the writer thread, in order.
            return self.encode_here(job, flat, warm_up=sizes)
        snap_q = quantize_state_dict(
            flat, rules="exact", checkpoint_id=q_id, allocate=job.lease, sparse=False
        )
        # The copy's tensors by path, in the state's order (tied ones shared): the exact
        # entries' buffers, allocated in the tensors' shapes.
        copies = snap_q.entries
        snapshot = Flattened(
            {p: copies[snap_q.aliases.get(p, p)].buffers["data"] for p in flat.tensors}, flat.skeleton
        )
        del snap_q, copies
        ref_values: dict[str, torch.Tensor] = {}
        # The writer thread's codecs write their codes and scales into this save's lease as
        # well: pooled, they do not page-fault fresh memory every save.
        if job.keyframe:
            # Chosen before the writer thread starts: rule matching is Python, and once that
            # thread runs it would wait on the GIL.
            if self.chain.delta:
                ref_values = delta_coded(snapshot.tensors, job.rule_list)
            encode = functools.partial(
                encode_keyframe,
                snapshot,
                rules_as_specs(keyframe_rules(job.rule_list)),
                self.bits,
                self.block,
                job.meta,
                q_id,
                allocate=job.lease,
                reconstruct=ref_values,
            )
        else:
            encode = functools.partial(
                encode_delta,
                snapshot,
                reference,
                job.rules,
                self.bits,
                self.block,
                job.meta,
                q_id,
                allocate=job.lease,
                ref_at=ref_at(reference),
            )
        future = self.write(job.noted.noting(encode), job.path, reference)
        if reference is not None:
            reference.last_use = future
        if ref_values and not self.ref_share_reserved:
            # The first delta copies the state while this keyframe's copies of what it is
            # coded against stay held as the reference: fault that much memory in on the
            # writer thread once the keyframe is written, not in that delta's save().
            self.ref_share_reserved = True
            assert self.writer is not None
            self.writer.call(functools.partial(self.saves.reserve_beside, nbytes_each(ref_values.values())))
        return Queued(future, q_id, reference.checkpoint_id if reference is not None else None, ref_values)

    def encode_here(
        self, job: SaveJob, flat: Flattened | None = None, warm_up: list[int] | None = None
    ) -> Queued:
        """Encode the live state on this thread (a device state, ``async_write=False``, or a
        keyframe with no pooled memory to copy into) and hand the encoded state to the
        writer (or write it now). ``flat``: the state already flattened; ``warm_up``: the
        sizes of the snapshot that found no pooled memory (see :meth:`warm_up`)."""
        ref_values: dict[str, torch.Tensor] = {}
        lossy: dict[str, torch.Tensor] = {}  # decoded on the writer thread
        state: Any = job.tree if flat is None else flat
        # A device state's exact entries are copied to the host from the tensors themselves
        # (docs/training-loop.md, "Memory"); a keyframe's delta-coded ones are copied first,
        # on the device (or to the host) as the reference.
        live = not all_on_cpu(job.tree)
        if live:
            flat = Flattened.of(state)
            coded = delta_coded(flat.tensors, job.rule_list) if job.keyframe and self.chain.delta else {}
            state = private_copies(flat, coded, host_reference=self.host_reference, on_device=on_device)
        if job.keyframe:
            q = encode_keyframe(
                state,
                rules_as_specs(keyframe_rules(job.rule_list)),
                self.bits,
                self.block,
                job.meta,
                None,
                allocate=job.lease,
                live=live,
            )
            # The tensors deltas are coded against are exact entries of the keyframe, under
            # every path that names them: a tied weight's alias is coded against it too.
            # A lossy one (log2-temporal's log2 keyframe codes) by its reconstruction.
            if self.chain.delta:
                # Placeholders for the others: keyframe_values decodes them (a bitmask entry
                # to its exact values, log2 codes to their reconstruction).
                kept = {
                    p: e.buffers["data"]
                    if e.codec == "exact"
                    else torch.empty(e.shape, dtype=e.dtype, device="meta")
                    for p, e in q.entries.items()
                }
                kept.update({alias: kept[target] for alias, target in q.aliases.items() if target in kept})
                ref_values = delta_coded(kept, job.rule_list)
                if self.writer is not None and not live:
                    # The reconstruction is decoded on the writer thread, before the write
                    # and so before any delta that reads it: host tensors to decode into.
                    fresh = {
                        id(t): torch.empty(t.shape, dtype=t.dtype) for t in ref_values.values() if t.is_meta
                    }
                    lossy = {p: fresh[id(t)] for p, t in ref_values.items() if id(t) in fresh}
                    ref_values.update(lossy)
                elif live and not self.host_reference and (into := own_copies(ref_values, state, flat)):
                    # A device keyframe's lossy entries are decoded into the save's own copies
                    # of those tensors (encoded already, on this stream; the writer reads only
                    # their codes), not beside them: no second copy of them on the device.
                    ref_values = keyframe_values(q, into, in_place=True)
                else:
                    ref_values = keyframe_values(q, ref_values, in_place=False)
        else:
            q = encode_delta(
                state,
                job.reference,
                job.rules,
                self.bits,
                self.block,
                job.meta,
                None,
                allocate=job.lease,
                ref_at=ref_at(job.reference),
                live=live,
            )
        job.noted.note(q)
        reference = job.reference if q.reference_id is not None else None
        if not lossy:
            q.decoded.clear()  # (what no keyframe_values took)
        to_write = functools.partial(keyframe_values_then, q, lossy) if lossy else q
        return Queued(
            self.write(to_write, job.path, reference, live=live),
            q.checkpoint_id,
            q.reference_id,
            ref_values,
            warm_up,
        )

    def write(
        self,
        q: QuantizedState | Callable[[], QuantizedState],
        path: str,
        reference: Reference | None,
        *,
        live: bool = False,
    ) -> Future:
        """Write (or queue) ``q``; a delta's write waits for the saves it is coded against
        and fails if one of them did (:meth:`AsyncWriter.submit`), so that no Future
        reports success for a file that could never load. ``live``: exact entries hold the
        state's own tensors (copied to the host before the loop's next work)."""
        if self.writer is not None:
            return self.writer.submit(q, path, after=depends_on(reference), live=live)
        assert not callable(q), "only the async writer encodes on its thread"
        f: Future = Future()
        f.set_result(_format.write_file(q, path, fsync=self.fsync))
        return f

    def warm_up(self, sizes: list[int], lease: SnapshotLease | None, written: Future) -> None:
        """After a keyframe encoded in ``save`` for want of pooled memory: fault in buffers
        for the next save's copy of buffers of ``sizes`` on the writer thread, after that
        keyframe's write (``written``, its Future), as ``prepare`` would have (the next
        save is a delta, which copies). The buffers ``lease`` keeps after the reference
        split off its own come back to the pool with the write (the copies of what the
        keyframe stores exact, its codes): only the sizes they do not cover are added."""
        if self.writer is None or lease is None:
            return
        # The reference holds the keyframe's own buffers, so this covers the whole copy:
        # the first delta needs no share reserved for it.
        self.ref_share_reserved = True
        missing = Counter(n for n in sizes if n >= MIN_POOLED_BYTES) - Counter(lease.buffer_sizes())
        if missing:
            self.saves.make_room(sizes, self.chain.kept_bytes())
            warmed = self.writer.call(functools.partial(self.saves.reserve_beside, list(missing.elements())))
            self.warming = (written, warmed)

    def wait_for_warm_up(self) -> None:
        """Before a copy: if the writer thread is faulting in its buffers (:meth:`warm_up`)
        because the keyframe before it is written, wait for the rest. Copying into fresh
        memory instead would cost the loop the same page faults and hold a second copy. A
        keyframe still being written is not waited for: that is what ``max_pending`` is."""
        if self.warming is None:
            return
        written, warmed = self.warming
        if written.done() or warmed.done():
            wait_futures([warmed])
            self.warming = None

    def copies(self, tree: dict[str, Any]) -> bool:
        """Whether a save of ``tree`` copies it into pooled host memory (else: nothing to
        reserve for it)."""
        return self.writer is not None and all_on_cpu(tree)

    def precompile(self, tree: dict[str, Any]) -> int:
        """Compile the kernels the first keyframe and delta of ``tree`` (the named state)
        launch, now (docs/training-loop.md, "The first save"); returns how many variants or
        encodes ran (0: no tensor the kernels code)."""
        device = kernel_variants.kernel_device(leaf_tensors(tree))
        if device is None:
            return 0
        state, mode, copy = {"step": 0, **tree}, self.chain.mode, all_on_cpu(tree)
        return sum(  # "auto": the presets of either interval
            kernel_variants.precompile_saves(
                state, rules, bits=self.bits, block=self.block, delta_mode=mode, device=device, copy=copy
            )
            for rules in interval_rules.candidates(self.rules)
        )

    def reserve(self, tree: dict[str, Any]) -> int:
        """Reserve pooled host memory for the first save's copy of ``tree`` (see
        :meth:`Checkpointer.prepare <tw_triton.checkpointer.Checkpointer.prepare>`).

        Returns:
            Bytes reserved now.
        """
        flat = flatten(tree)[0]
        sizes = nbytes_each(flat.values())
        # The first delta copies the state while the keyframe's copies of what it is coded
        # against stay held as the reference: room for those too, until a reference holds
        # its own.
        extra: list[int] = []
        if self.chain.delta and self.chain.reference is None and not self.ref_share_reserved:
            rule_list = resolve_rules(self.rules, tree, bits=self.bits, block=self.block)
            extra = nbytes_each(delta_coded(flat, rule_list).values())
            self.ref_share_reserved = bool(extra)
        return self.saves.reserve(sizes, self.chain.kept_bytes(), extra)


def collect_setup_garbage() -> None:
    """One full garbage collection, unless the caller turned the collector off.

    Setup makes many long-lived objects, and Python runs a full collection once enough of
    them have piled up, at a moment set by allocation counts: otherwise often inside an
    early save. Run here, it resets that count (docs/training-loop.md, "Python's garbage
    collector").
    """
    if gc.isenabled():
        gc.collect()


def nbytes_each(tensors: Iterable[torch.Tensor]) -> list[int]:
    """The size in bytes of each tensor."""
    return [t.numel() * t.element_size() for t in tensors]


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` is device memory, whose buffers the writer stages (not the CPU's)."""
    return t.device.type != "cpu"


def all_on_cpu(tree: Any) -> bool:
    """Whether every tensor of ``tree`` is on the CPU (the branch that copies and queues)."""
    return not any(on_device(t) for t in leaf_tensors(tree))


__all__ = ["SavePipeline", "collect_setup_garbage"]
