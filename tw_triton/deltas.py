"""What a Checkpointer's deltas are coded against, and decoding a chain of them.

``delta="open"``: every delta is coded against the last keyframe's exact values (loading
reads two files). ``delta="closed"``: every delta is coded against the reconstruction of
the save before it (:func:`advance`), so loading delta ``k`` decodes the chain from the
keyframe (:func:`decode_chain`), and a lost link makes the deltas after it unloadable.
Each file records the id of the checkpoint it is a delta of (``reference_id``), so the
chain is found from the files themselves (:func:`chain_of`). Why, and the trade-offs:
docs/training-loop.md ("Keyframes and deltas", "Closed loop").
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from . import format as _format
from .checkpoint_files import checkpoint_name
from .codecs import get_codec
from .errors import CheckpointError, ReferenceMismatchError, checkpoint_label
from .parallel import parallel_map
from .qstate import QuantizedState
from .rules import select_rule
from .snapshot_pool import SnapshotLease
from .state import delta_paths, dequantize_entries, dequantize_state_dict, disjoint_paths
from .state.grouped import decode_grouped, groups_launches
from .tree import Flattened, flatten

DELTA_MODES = ("open", "closed", "none")
_UNESCAPE_RE = re.compile(r"%(25|2F)")


def delta_mode(delta: Any) -> str:
    """The delta mode a ``Checkpointer(delta=...)`` argument names.

    ``True`` is ``"open"`` and ``False`` is ``"none"`` (the values before closed loop
    existed).

    Raises:
        CheckpointError: anything else than a bool or one of :data:`DELTA_MODES`.
    """
    if delta is True:
        return "open"
    if delta is False:
        return "none"
    if isinstance(delta, str) and delta in DELTA_MODES:
        return delta
    raise CheckpointError(
        f"delta must be True, False or one of {', '.join(map(repr, DELTA_MODES))}, got {delta!r}"
    )


def _unescape(component: str) -> str:
    return _UNESCAPE_RE.sub(lambda m: "%" if m.group(1) == "25" else "/", component)


def nest(flat: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Nested dicts whose flattened paths (``tree.flatten``) are exactly ``flat``'s keys.

    List indices become string keys, which flatten to the same path components.
    """
    root: dict[str, Any] = {}
    for path, t in flat.items():
        parts = [_unescape(p) for p in path.split("/")]
        node = root
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = t
    return root


@dataclass
class Reference:
    """What the next delta is encoded against, kept on the tensors' devices.

    ``checkpoint_id`` and ``step`` name the checkpoint the next delta will record as its
    reference (the keyframe; in closed loop, the last delta). They are read and written by
    the thread that calls ``save``. ``tree`` is read and, in closed loop, replaced by the
    thread that encodes (the writer thread for a CPU state with an async writer), always in
    save order.
    """

    checkpoint_id: str
    step: int
    tree: dict[str, Any]  # nested like the saved state, only the delta-coded tensors
    nbytes: int
    future: Future  # the keyframe's write: if it fails, the reference is dropped
    lease: SnapshotLease | None = None  # pooled host buffers under ``tree``, kept with it
    last_use: Future | None = None  # the last save encoded against it on the writer thread
    closed: bool = False
    links: list[Future] = field(default_factory=list)  # closed loop: the writes of its deltas
    # Closed loop: ``tree``'s tensors were decoded by :func:`advance`, so nothing else holds
    # them (the keyframe's are its snapshot buffers, which its write reads until ``future``
    # is done).
    owned: bool = False
    # The events of the keyframe's device-to-host copies (a device state with an async
    # writer): once they have fired, its write reads the host copies, not ``tree``.
    copied: list | None = None

    def lost(self) -> bool:
        """Whether a write this reference depends on failed (the keyframe, or a chain link)."""
        return any(f.done() and f.exception() is not None for f in (self.future, *self.links))


def delta_coded(values: Mapping[str, torch.Tensor], rule_list: Any) -> dict[str, torch.Tensor]:
    """The entries of ``values`` (flat, by path) that ``rule_list`` will code as deltas."""
    flat: dict[str, torch.Tensor] = {}
    for path, data in values.items():
        rule = select_rule(rule_list, path, data)
        codec = get_codec(rule.codec)
        if codec is not None and codec.uses_reference(rule.params):
            flat[path] = data
    return flat


def make_reference(
    checkpoint_id: str,
    flat: Mapping[str, torch.Tensor],
    step: int,
    future: Future,
    *,
    closed: bool,
) -> Reference:
    """Keep the keyframe's values of the tensors that the rules will delta-code.

    ``flat`` is :func:`delta_coded` of the keyframe's snapshot tensors (its exact entries,
    or the private copy the writer thread encodes): the keyframe stores exactly these for
    every delta-coded path (:func:`~tw_triton.rules.keyframe_rules`), so holding them costs
    nothing more than not freeing them.
    """
    nbytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in flat.values()}.values())
    return Reference(checkpoint_id, step, nest(dict(flat)), nbytes, future, closed=closed)


def keyframe_values(
    q: QuantizedState, values: dict[str, torch.Tensor], *, in_place: bool
) -> dict[str, torch.Tensor]:
    """Make ``values`` (by path, the tensors the deltas after keyframe ``q`` are coded
    against) the keyframe's *reconstruction*: a path the keyframe stores with a lossy codec
    (``log2-temporal``'s ``keyframe_spec``: the absolute ``log2`` codes) gets its decoded
    entry, written into the tensor already there (``in_place``: the keyframe's snapshot,
    which its write no longer reads) or in its place (a placeholder, say on the meta
    device). Exact entries are left as they are; one the encode decoded already
    (``q.decoded``, then cleared) is taken from there. Returns ``values``.

    Host tensors are decoded one at a time; device ones in grouped decodes
    (:func:`~tw_triton.state.grouped.decode_grouped`: a number of launches that does not
    grow with their count), into the tensors already there where the codec can.
    """
    items, paths, targets = [], [], []
    for path, t in list(values.items()):
        target = q.aliases.get(path, path)
        entry = q.entries[target]
        if entry.codec == "exact":
            continue
        context = f"checkpoint {q.checkpoint_id}: entry {target!r}"
        if get_codec(entry.codec) is None:
            raise CheckpointError(f"{context}: unknown codec {entry.codec!r}")
        device = entry_device(entry, t.device) if t.device.type == "meta" else t.device
        items.append((entry, None, device, context))
        paths.append(path)
        targets.append(target)

    def alone(i: int) -> torch.Tensor:
        entry, _, device, context = items[i]
        taken = q.decoded.get(targets[i])  # decoded by the encode already
        if taken is not None and taken.device == device:
            return taken
        return get_codec(entry.codec).decode(entry, None, device, context)  # type: ignore[union-attr]

    grouped = [i for i, item in enumerate(items) if groups_launches(item[2])]
    decoded = dict.fromkeys(range(len(items)))
    if grouped:
        outs = [values[paths[i]] if in_place else None for i in grouped]
        got = decode_grouped([items[i] for i in grouped], lambda k: alone(grouped[k]), outs)
        decoded.update(zip(grouped, got))
    for i, path in enumerate(paths):
        t = values[path]
        out = alone(i) if decoded[i] is None else decoded[i]
        if not in_place:
            values[path] = out
        elif out is not t:
            t.copy_(out)
    q.decoded.clear()
    return values


def reference_misfit(tree: Any, rule_list: Any, reference: Reference) -> str | None:
    """Why a delta of ``tree`` (nested, or :class:`~tw_triton.tree.Flattened`) cannot be
    coded against ``reference``, or ``None`` when it can: a tensor the rules delta-code
    that has no tensor of its shape in the reference (unless its codec codes it on its
    own then), or a reference tensor the state no longer delta-codes (the model changed
    since the keyframe)."""
    ref_flat, _ = flatten(reference.tree)
    coded = set()
    for entry, x in Flattened.of(tree).tensors.items():
        rule = select_rule(rule_list, entry, x)
        codec = get_codec(rule.codec)
        if codec is None or not codec.uses_reference(rule.params):
            continue
        coded.add(entry)
        r = ref_flat.get(entry)
        if (r is None or tuple(r.shape) != tuple(x.shape)) and not codec.reference_optional:
            found = "no tensor" if r is None else f"shape {tuple(r.shape)}"
            return f"entry {entry!r} has shape {tuple(x.shape)}, the reference {found}"
    gone = sorted(ref_flat.keys() - coded)
    if gone:
        return f"{len(gone)} entries of the reference are not delta-coded in it, e.g. {gone[0]!r}"
    return None


def advance(reference: Reference, q: QuantizedState) -> None:
    """Closed loop: make ``reference`` the reconstruction of ``q``, the delta just encoded.

    Every tensor of the reference becomes what a loader decodes from ``q`` at its path
    (the delta decoded against the old reference; an entry stored exact because it held
    NaN/Inf decodes to its own values), on the reference tensor's device and in its
    dtype. Each one is decoded over the old tensor (host tensors one at a time, in place
    where the codec can, :meth:`~tw_triton.codecs.Codec.decode_over`, else decoded and
    copied in; device tensors in grouped decodes that write each into its old tensor,
    :meth:`~tw_triton.codecs.Codec.decode_group`; tied tensors excepted; one the encode
    decoded already, ``q.decoded``, copied in, and that cleared), so the reference
    is never held twice, once nothing else can
    read the old tensors: after the first advance only this reference holds them, and
    before it they are the keyframe's snapshot, which its write reads until
    ``reference.future`` is done, or, for a device state, until its device-to-host copies
    are (``reference.copied``: the device waits for their events before it decodes). A
    keyframe still read otherwise leaves its tensors alone, and the advance decodes into
    fresh ones. A reference held on the host for a device state (``reference_device``) is
    decoded on the delta's device and copied back. The caller keeps the keyframe's pooled
    buffers with the reference for as long as it lives (``reference.lease``).
    """
    old, _ = flatten(reference.tree)
    first: dict[str, torch.Tensor] = {}  # entry path -> a reference tensor decoded to it
    for path, r in old.items():
        target = q.aliases.get(path, path)
        if target not in q.entries:
            raise CheckpointError(
                f"checkpoint {q.checkpoint_id}: has no entry {path!r} to advance the closed-loop reference"
            )
        first.setdefault(target, r)
    refs = {t: old[t] if t in old else r for t, r in first.items()}
    owned = reference.owned or reference.future.done() or after_copies(reference)
    over = disjoint_paths(refs, refs) if owned else set()

    def decode(target: str) -> torch.Tensor:
        entry, r = q.entries[target], first[target]
        codec = get_codec(entry.codec)
        context = f"checkpoint {q.checkpoint_id}: entry {target!r}"
        if codec is None:
            raise CheckpointError(f"{context}: unknown codec {entry.codec!r}")
        where = entry_device(entry, r.device)
        ref = refs[target]
        taken = q.decoded.get(target)
        if taken is not None and target in over and taken.device == ref.device and _fits(ref, taken):
            return ref.copy_(taken.view(ref.shape))  # decoded by the encode already
        if not codec.uses_reference(entry.params):
            out = codec.decode(entry, None, where, context)  # the entry's own buffer
        elif where != r.device:
            # A host reference of a device delta: decoded where the codes are.
            out = codec.decode(entry, ref.to(where), where, context)
        elif target in over:
            out = codec.decode_over(entry, ref, r.device, context)
            if out.data_ptr() == ref.data_ptr():
                return out
        else:
            return codec.decode(entry, ref, r.device, context)
        if target in over and _fits(ref, out):
            # Into the old tensor, before the next one is decoded: one tensor of scratch.
            return ref.copy_(out.reshape(ref.shape))
        return out.to(r.device, copy=True)

    # Host tensors decode on the worker threads, as a load does; device ones here, the
    # deltas in grouped launches (tw_triton.state.grouped).
    targets = list(first)
    on_host = all(not groups_launches(r.device) for r in first.values()) and all(
        not groups_launches(b.device) for t in targets for b in q.entries[t].buffers.values()
    )
    if on_host:
        results = parallel_map(decode, targets, sizes=[q.entries[t].raw_nbytes for t in targets])
    else:
        items = [
            (q.entries[t], refs[t], first[t].device, f"checkpoint {q.checkpoint_id}: entry {t!r}")
            for t in targets
        ]
        # Each delta decoded over its old tensor where nothing else reads it: in place,
        # so the grouped decode holds no second copy of the reference.
        outs = [refs[t] if t in over and refs[t].device == first[t].device else None for t in targets]
        results = decode_grouped(items, lambda i: decode(targets[i]), outs)
    decoded = dict(zip(targets, results))
    q.decoded.clear()
    # By entry path, so tied tensors stay tied.
    reference.tree = nest({path: decoded[q.aliases.get(path, path)] for path in old})
    reference.owned = True


def after_copies(reference: Reference) -> bool:
    """Whether the keyframe under ``reference`` is read only through host copies made on the
    device: then the device's current stream waits for those copies (their events), and
    the reference may be decoded over. ``False`` where none were recorded."""
    if not reference.copied:
        return False
    for event in reference.copied:
        # The current stream of the event's device waits (the host does not): the advance's
        # kernels run there, on the reference's device. ``wait()`` alone would make the
        # current device's stream wait, another device's when the state is not on it.
        device = getattr(event, "device", None)
        event.wait(None if device is None else torch.cuda.current_stream(device))
    return True


def entry_device(entry: Any, default: torch.device) -> torch.device:
    """The device of an encoded entry's buffers (``default`` when it has none)."""
    for buf in entry.buffers.values():
        return buf.device
    return default


def _fits(dest: torch.Tensor, src: torch.Tensor) -> bool:
    return dest.dtype == src.dtype and dest.numel() == src.numel() and dest.is_contiguous()


def chain_of(info: Any, by_id: Mapping[str, Any], directory: str) -> list[Any]:
    """``info`` and the checkpoints it needs, oldest (the keyframe) first.

    ``info`` and the values of ``by_id`` have ``checkpoint_id``, ``reference_id`` and
    ``path`` (:class:`~tw_triton.checkpointer.CheckpointInfo`).

    Raises:
        ReferenceMismatchError: a reference that is not in ``by_id``, or a cycle.
    """
    chain = [info]
    seen = {info.checkpoint_id}
    while chain[-1].reference_id is not None:
        ref = by_id.get(chain[-1].reference_id)
        if ref is None:
            raise missing_reference(chain[-1].path, chain[-1].reference_id, directory)
        if ref.checkpoint_id in seen:
            raise ReferenceMismatchError(f"{info.path}: its references form a cycle at {ref.path}")
        seen.add(ref.checkpoint_id)
        chain.append(ref)
    chain.reverse()
    return chain


def missing_reference(path: str, reference_id: str | None, directory: str) -> ReferenceMismatchError:
    """The error for the delta ``path`` whose reference is not among the readable checkpoints
    of ``directory``: it names the reference's step and file (the delta's metadata records
    the step), and, when that file is there, why it is not the reference (say, truncated).

    Only the error path reads headers again; a listing's scan already dropped the file.
    """

    try:
        step = (_format.read_manifest(path).get("metadata") or {}).get("reference_step")
    except (CheckpointError, OSError):
        step = None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return ReferenceMismatchError(
            f"{path}: is a delta from reference {checkpoint_label(reference_id)}, which is not in {directory!r}"
        )
    expected = os.path.join(directory, checkpoint_name(step))
    why = f"which is not in {directory!r}"
    if os.path.exists(expected):
        try:
            found = _format.read_manifest(expected)["checkpoint_id"]
            why = f"but that file is checkpoint {found!r}" if found != reference_id else why
        except (CheckpointError, OSError) as e:
            why = f"whose file is there but cannot be read: {e}"
    return ReferenceMismatchError(
        f"{path}: is a delta from reference {checkpoint_label(reference_id, step, expected)}, {why}"
    )


def with_references(ids: Iterable[str], by_id: Mapping[str, Any]) -> set[str]:
    """``ids`` and every checkpoint id they need, transitively (a closed-loop chain back to
    its keyframe). Ids not in ``by_id`` are kept but not followed."""
    needed = set(ids)
    frontier = list(needed)
    while frontier:
        info = by_id.get(frontier.pop())
        ref = info.reference_id if info is not None else None
        if ref is not None and ref not in needed:
            needed.add(ref)
            frontier.append(ref)
    return needed


def decode_chain(
    chain: list[Any],
    read: Callable[[Any, list[str] | None], QuantizedState],
    device: torch.device,
) -> Any:
    """Decode the last checkpoint of ``chain`` (from :func:`chain_of`) on ``device``.

    ``read(info, entries)`` returns the checkpoint's :class:`QuantizedState`, with only
    ``entries`` (``None``: all). The last link is read whole; each link before it only at
    the paths the next link is a delta of (so a keyframe's optimizer state is never read to
    load a delta), newest first, each checked to be the checkpoint its successor names.
    Then the links are decoded oldest first, each against the one before and into its
    memory where the codec can (the decoded links are this function's own).

    Raises:
        ReferenceMismatchError: a file that is not the checkpoint the next link needs.
        CheckpointError: anything reading or decoding raises, naming the file and the entry.
    """
    qs: list[QuantizedState | None] = [None] * len(chain)
    qs[-1] = read(chain[-1], None)
    needs: list[list[str]] = [[] for _ in chain]
    for k in range(len(chain) - 2, -1, -1):
        nxt = qs[k + 1]
        assert nxt is not None
        needs[k] = delta_paths(nxt, chain[k + 1].path)
        q = read(chain[k], needs[k])
        if q.checkpoint_id != nxt.reference_id:
            raise ReferenceMismatchError(
                f"{chain[k + 1].path}: is a delta from reference checkpoint {nxt.reference_id!r}, but "
                f"reference file {chain[k].path!r} is checkpoint {q.checkpoint_id!r}"
            )
        qs[k] = q
    reference: Any = None
    for k, info in enumerate(chain[:-1]):
        q = qs[k]
        assert q is not None
        flat = dequantize_entries(
            q,
            needs[k],
            reference=reference,
            device=device,
            source=info.path,
            reuse_reference=True,
            release_buffers=True,
        )
        reference = nest(flat)
        qs[k] = None  # a link's buffers are not needed any more
    return dequantize_state_dict(
        qs[-1],
        reference=reference,
        device=device,
        source=chain[-1].path,
        reuse_reference=True,
        release_buffers=True,
    )


__all__ = [
    "DELTA_MODES",
    "Reference",
    "advance",
    "chain_of",
    "reference_misfit",
    "decode_chain",
    "delta_mode",
    "delta_coded",
    "keyframe_values",
    "make_reference",
    "nest",
    "with_references",
]
