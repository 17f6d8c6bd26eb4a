"""The device memory a Checkpointer holds beside the training state, and its bound.

:func:`device_memory_bound` is the documented formula, computed from a state and the
Checkpointer's settings; :func:`held_nbytes` measures tensors (each storage once). The
parts, and why each is there: docs/training-loop.md ("Memory").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import interval_rules
from .codecs import get_codec
from .codecs.bitmask import sparse_candidate
from .codecs.log2_temporal import stored_nbytes as temporal_nbytes
from .delta_bits import WIDER_BITS
from .ops.layout import blockwise_buffers, log2_buffers
from .rules import keyframe_rule, keyframe_rules, resolve_rules, select_rule
from .state.partners import DECODED_PARTNER_BYTES
from .tree import Flattened

# The CUDA caching allocator rounds every allocation up to a multiple of this.
ALLOC_BYTES = 512
# Scalars each coded entry keeps on the device until the save's one host sync: its NaN/Inf
# flag and reference fingerprint, and their int64 copies for the transfer.
SCALAR_BYTES_PER_ENTRY = 4 * ALLOC_BYTES
# Device bytes of each sparse candidate (an exact float tensor of >= 4096 elements) until
# the host sync: its two int64 counts in the save's scalars buffer, and its rows (whole
# tiles, tail) of the grouped count's table.
SCALAR_BYTES_PER_CANDIDATE = 2 * 8 + 2 * 64
# Device bytes of each tensor whose bits a rule's max_error chooses, until the bits choice's
# host read (before the encode): its four int64 statistics (ops.delta_statistics_many) and
# its rows (whole tiles, tail) of the grouped kernel's table.
SCALAR_BYTES_PER_STATISTICS = 4 * 8 + 2 * 64
# The grouped bitmask encode's temporaries, after the host sync, for the candidates that
# pay (one element width at a time): its two tables (whole tiles, tail: two rows of 64
# bytes per candidate each), and per tile of 4096 elements its count, their cumulative sum
# and its exclusive form (int64 each).
SPARSE_TABLE_BYTES_PER_CANDIDATE = 2 * 64
SPARSE_BYTES_PER_TILE = 8
SPARSE_TILE = 4096
# A fingerprint's temporaries (a sample of 2048 elements, widened to int64, its weights,
# their product), one entry at a time.
FINGERPRINT_SCRATCH = 64 << 10

# A grouped log2-temporal encode stores a group's entries in one buffer, each entry's codes
# on 16 bytes (codecs/log2_temporal.py group_stored): at most 15 bytes before each entry.
TEMPORAL_GROUP_PAD = 16

# Buffers of the codecs whose layout is known: (numel, bits, block) -> [(name, elements, dtype)].
_LAYOUTS = {
    "blockwise": blockwise_buffers,
    "blockwise-update": blockwise_buffers,  # the blockwise codes of u
    "log2": log2_buffers,
    "log2-temporal": lambda n, bits, block: [
        ("codes", temporal_nbytes(n, block) + TEMPORAL_GROUP_PAD, torch.uint8)
    ],
}


@dataclass(frozen=True)
class DeviceMemoryBound:
    """The formula's parts, in bytes (docs/training-loop.md, "Memory").

    Attributes:
        reference: held between saves: one copy of the delta-coded tensors (0 with a host
            reference or without deltas).
        keyframe: the device buffers a keyframe encodes (its quantized entries' codes and
            per-block values, and copies of exact tensors that are not contiguous).
        delta: the same for a save between keyframes.
        scalars: the coded entries' flags and fingerprints, and the sparse candidates'
            counts, until the save's host sync; the ``max_error`` tensors' statistics,
            until the bits choice's read.
        scratch: a save's temporaries beside its buffers, one entry at a time: the
            largest delta-coded tensor once for a closed-loop advance (decoded, then copied
            into the reference) and once more for a host reference (its copy on the device
            while it is used); a fingerprint's temporaries; the largest NaN/Inf check; the
            grouped bitmask encode's tables and tile counts (:func:`sparse_scratch`); the
            partners of ``blockwise-update`` entries decoded, a chunk at a time.
        saves_in_flight: saves whose device buffers can exist at once (``max_pending``
            queued, whose copies the writer thread has not waited for yet, plus the one
            being encoded).
    """

    reference: int
    keyframe: int
    delta: int
    scalars: int
    scratch: int
    saves_in_flight: int

    @property
    def peak(self) -> int:
        """The most the Checkpointer holds on the device at any moment of a save."""
        encoded = self.saves_in_flight * max(self.keyframe, self.delta)
        return self.reference + encoded + self.scalars + self.scratch

    def as_dict(self) -> dict[str, int]:
        return {
            "reference": self.reference,
            "keyframe": self.keyframe,
            "delta": self.delta,
            "scalars": self.scalars,
            "scratch": self.scratch,
            "saves_in_flight": self.saves_in_flight,
            "peak": self.peak,
        }


def held_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors`` (tied tensors count once)."""
    seen: dict[tuple[torch.device, int], int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        seen[key] = max(seen.get(key, 0), storage.nbytes())
    return sum(seen.values())


def encoded_nbytes(codec_name: str, params: Mapping[str, Any], x: torch.Tensor) -> int:
    """Bytes of the buffers ``codec_name`` encodes ``x`` into on its device.

    Each buffer counts as the caching allocator rounds it (:data:`ALLOC_BYTES`). A codec
    whose layout is not known here counts the tensor's own bytes (a codec that shrinks
    nothing; every built-in one that is not listed here is exact).
    """
    layout = _LAYOUTS.get(codec_name)
    if layout is None:
        return allocated(x.numel() * x.element_size())
    return sum(
        allocated(n * dtype.itemsize) for _, n, dtype in layout(x.numel(), params["bits"], params["block"])
    )


def allocated(nbytes: int) -> int:
    """``nbytes`` as the caching allocator rounds it."""
    return -(-nbytes // ALLOC_BYTES) * ALLOC_BYTES


def device_memory_bound(
    state: Any,
    rules: Any,
    *,
    bits: int,
    block: int,
    delta_mode: str,
    max_pending: int,
    host_reference: bool,
) -> DeviceMemoryBound:
    """The formula of docs/training-loop.md ("Memory") for saving ``state``.

    Args:
        state: the saved state (nested, or :class:`~tw_triton.tree.Flattened`).
        rules, bits, block: how its tensors are coded (as :func:`~tw_triton.rules.resolve_rules`).
        delta_mode: ``"open"``, ``"closed"`` or ``"none"``.
        max_pending: the writer's ``max_pending`` (0: no async writer).
        host_reference: the reference is kept in host memory (``reference_device="cpu"``).

    Returns:
        The parts of the bound; tensors already on the CPU count as if on a device.
    """
    rule_list = resolve_rules(rules, state, bits=bits, block=block)
    flat = Flattened.of(state)
    distinct: dict[tuple[Any, ...], tuple[str, torch.Tensor]] = {}
    for path, t in flat.tensors.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        distinct.setdefault(key, (path, t))
    key_rules = keyframe_rules(rule_list)
    reference = keyframe = delta = largest = flag = temporal = 0
    coded = {True: 0, False: 0}  # coded entries of a keyframe, of a delta
    partnered: dict[bool, list[int]] = {True: [], False: []}  # their partners decoded (float32)
    candidates = {True: 0, False: 0}  # their sparse candidates (counted on the device)
    chosen = {True: 0, False: 0}  # their tensors whose bits max_error chooses
    tiles = {True: 0, False: 0}  # the candidates' tiles (the grouped bitmask encode's)
    for path, t in distinct.values():
        rule = select_rule(rule_list, path, t)
        codec = get_codec(rule.codec)
        if delta_mode == "none" and codec is not None and codec.reference_optional:
            # No reference: coded as a keyframe codes it (state/encode.py).
            rule = keyframe_rule(rule)
            codec = get_codec(rule.codec)
        uses_ref = codec is not None and codec.uses_reference(rule.params) and delta_mode != "none"
        nbytes = allocated(t.numel() * t.element_size())
        if uses_ref:
            reference += nbytes
            largest = max(largest, nbytes)
        for key, r in ((True, select_rule(key_rules, path, t)), (False, rule)):
            if r.codec != "exact":
                coded[key] += 1
                if get_codec(r.codec).has_partners:  # type: ignore[union-attr]
                    partnered[key].append(allocated(t.numel() * 4))
                chosen[key] += r.max_error is not None and t.numel() > 0
                flag = max(flag, allocated(-(-t.numel() // r.params.get("block", 1))))
            elif sparse_candidate(t):
                candidates[key] += 1
                tiles[key] += -(-t.numel() // SPARSE_TILE)
        delta += _save_nbytes(rule, t)
        if rule.codec == "log2-temporal":
            # An entry encoded alone: the kernel's outputs (codes, lo, hi) before they are
            # copied into the one stored buffer (a grouped encode writes it in place).
            nb = -(-t.numel() // rule.params["block"])
            temporal = max(temporal, allocated(t.numel()) + 2 * allocated(4 * nb))
        keyframe += _save_nbytes(select_rule(key_rules, path, t), t)
    entries = max(coded.values())
    held = max(
        8 * coded[k] + SCALAR_BYTES_PER_CANDIDATE * candidates[k] + SCALAR_BYTES_PER_STATISTICS * chosen[k]
        for k in coded
    )
    scalars = entries * SCALAR_BYTES_PER_ENTRY + allocated(held)
    scratch = largest * ((delta_mode == "closed") + host_reference) + flag + temporal
    # Partners decoded for blockwise-update, a chunk at a time (state/partners.py): at most
    # DECODED_PARTNER_BYTES of raw bytes, or one partner, each allocation rounded up.
    scratch += max(
        min(sum(v), max(max(v, default=0), DECODED_PARTNER_BYTES + ALLOC_BYTES * len(v)))
        for v in partnered.values()
    )
    scratch += max(sparse_scratch(candidates[k], tiles[k]) for k in coded)
    if largest:
        scratch += FINGERPRINT_SCRATCH
    return DeviceMemoryBound(
        reference=0 if host_reference else reference,
        keyframe=keyframe,
        delta=delta,
        scalars=scalars,
        scratch=scratch,
        saves_in_flight=max_pending + 1,
    )


def sparse_scratch(candidates: int, tiles: int) -> int:
    """Device bytes the grouped bitmask encode of ``candidates`` tensors of ``tiles`` tiles
    in all allocates beside its outputs, at most (two tables, three int64 per tile)."""
    if not candidates:
        return 0
    table = allocated(SPARSE_TABLE_BYTES_PER_CANDIDATE * candidates)
    return 2 * table + 3 * allocated(SPARSE_BYTES_PER_TILE * tiles)


def bound_of(
    state: Any, rules: Any, bits: int, block: int, mode: str, max_pending: int, reference_device: str | None
) -> dict[str, int]:
    """:func:`device_memory_bound` with a Checkpointer's settings, as a dict (for ``"auto"``
    rules, the larger of its two presets' bounds, part by part)."""
    bounds = [
        device_memory_bound(
            state,
            r,
            bits=bits,
            block=block,
            delta_mode=mode,
            max_pending=max_pending,
            host_reference=reference_device == "cpu",
        ).as_dict()
        for r in interval_rules.candidates(rules)
    ]
    return {k: max(b[k] for b in bounds) for k in bounds[0]}


def private_copies(
    flat: Flattened,
    coded: Mapping[str, torch.Tensor],
    *,
    host_reference: bool,
    on_device: Callable[[torch.Tensor], bool],
) -> Flattened:
    """A device state's ``flat`` with copies of what the writer would otherwise read after
    ``save`` returns (tied tensors stay tied): its host tensors (step counts, RNG states:
    the writer stages only device buffers), and the keyframe's delta-coded tensors
    (``coded``, by path), which it stores and the deltas after it are coded against: on
    their device, or in host memory with ``host_reference``. Every other tensor is the
    state's own: the writer copies it to the host (docs/training-loop.md, "Memory")."""
    copies: dict[int, torch.Tensor] = {}
    tensors = dict(flat.tensors)
    for path, t in flat.tensors.items():
        if on_device(t) and path not in coded:
            continue
        c = copies.get(id(t))
        if c is None:
            to_host = host_reference or not on_device(t)
            c = t.detach().to("cpu", copy=True) if to_host else t.detach().clone()
            copies[id(t)] = c
        tensors[path] = c
    return Flattened(tensors, flat.skeleton)


def own_copies(
    ref_values: dict[str, torch.Tensor], copies: Flattened, live: Flattened
) -> dict[str, torch.Tensor] | None:
    """``ref_values`` with each placeholder (a meta tensor) replaced by the save's private
    copy of that path in ``copies`` (:func:`private_copies`), or
    ``None`` if one has no such copy: contiguous, of its shape and dtype, and not the live
    tensor itself (``live``: the state as saved)."""
    out = dict(ref_values)
    for path, t in ref_values.items():
        if not t.is_meta:
            continue
        c = copies.tensors.get(path)
        if (
            c is None
            or c.is_meta
            or c is live.tensors.get(path)
            or c.shape != t.shape
            or c.dtype != t.dtype
            or not c.is_contiguous()
        ):
            return None
        out[path] = c
    return out


def _save_nbytes(rule: Any, t: torch.Tensor) -> int:
    """Device bytes a save encodes ``t`` into with ``rule``: an exact entry of a contiguous
    tensor is copied to the host from the tensor itself (nothing on the device). A rule
    with ``max_error`` counts the widest container it may choose (delta_bits.py: a width
    between two containers is fewer levels in the wider, of the wider's bytes)."""
    if rule.codec == "exact":
        return 0 if t.is_contiguous() else allocated(t.numel() * t.element_size())
    params = rule.params
    if rule.max_error is not None:
        params = {**params, "bits": max(WIDER_BITS)}
    return encoded_nbytes(rule.codec, params, t)


__all__ = [
    "DeviceMemoryBound",
    "bound_of",
    "device_memory_bound",
    "encoded_nbytes",
    "held_nbytes",
    "own_copies",
    "private_copies",
    "sparse_scratch",
]
