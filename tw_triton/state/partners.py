"""Entries coded with another entry's decoded tensor (their *partner*): encode and checks.

A codec with partners (:meth:`~tw_triton.codecs.Codec.partner_path`; built in:
``blockwise-update``, Adam's ``exp_avg`` coded with ``exp_avg_sq``) is encoded in a second
phase of :func:`~tw_triton.state.quantize_state_dict`, after every other entry is final
(NaN/Inf entries replaced by exact ones, sparse ones decided): each partner is decoded as a
loader decodes it, and the dependent entry is coded with that. Decoding checks the partners
a file records (:func:`partner_map`) and decodes the dependent entries last
(:mod:`tw_triton.state.decode`). Why: docs/design.md, "Why these choices".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..codecs import Codec, Encoded, get_codec
from ..errors import CheckpointError, QuantizationError
from ..parallel import parallel_map
from ..qstate import EncodedEntry
from ..rules import partner_free
from ..snapshot_pool import Allocator
from . import fingerprints
from .grouped import decode_grouped

logger = logging.getLogger(__name__)

# A device encode decodes the partners of at most this many bytes at once (float32), or
# one partner larger than that: the peak it adds to a save (docs/training-loop.md, "Memory").
DECODED_PARTNER_BYTES = 256 << 20
# (tensor, rule, codec, reference or None), as quantize_state_dict plans an entry.
Job = tuple[torch.Tensor, Any, Codec, "torch.Tensor | None"]


def serves_as_partner(x: torch.Tensor, partner: torch.Tensor, partner_codec: Any) -> bool:
    """Whether ``partner`` (coded by ``partner_codec``) can be ``x``'s partner: float32 of
    its shape, not itself coded with a partner."""
    return why_not_partner(x, partner, partner_codec) is None


def why_not_partner(x: torch.Tensor, partner: torch.Tensor | None, partner_codec: Any) -> str | None:
    """Why ``partner`` cannot be ``x``'s partner (:func:`serves_as_partner`), or None."""
    if partner is None:
        return "no partner entry in the state"
    if partner_codec.has_partners:
        return "its partner is itself coded with a partner"
    if partner.dtype != torch.float32:
        return f"its partner is {str(partner.dtype).removeprefix('torch.')}, not float32"
    if tuple(partner.shape) != tuple(x.shape):
        return f"its partner's shape is {tuple(partner.shape)}, not {tuple(x.shape)}"
    return None


# What plan_partners has warned of in this process: a state saved again and again falls back
# for the same entries at every save, and says so once (later ones at DEBUG).
warned_fallbacks: set[tuple[tuple[str, str], ...]] = set()


def plan_partners(canonical: Sequence[str], jobs: list[Job], aliases: Mapping[str, str]) -> dict[int, int]:
    """The entries coded with a partner, ``{job index: partner's job index}``; a job whose
    partner cannot serve (none, another shape, not float32, itself with a partner) gets
    its codec's fallback rule in ``jobs``, logged with the first one's reason (a warning
    the first time the same entries fall back for the same reasons in this process)."""
    index = {p: i for i, p in enumerate(canonical)}
    present = set(index) | set(aliases)
    out: dict[int, int] = {}
    fell_back: list[tuple[str, str]] = []
    for i, (x, rule, codec, _) in enumerate(jobs):
        if not codec.has_partners:
            continue
        found = codec.partner_path(canonical[i], rule.params, present)
        j = index.get(aliases.get(found, found)) if found is not None else None  # type: ignore[arg-type]
        partner, partner_codec = (jobs[j][0], jobs[j][2]) if j is not None and j != i else (None, None)
        reason = why_not_partner(x, partner, partner_codec)
        if reason is None:
            out[i] = j  # type: ignore[assignment]
            continue
        rule = partner_free(rule)
        jobs[i] = (x, rule, get_codec(rule.codec), None)  # type: ignore[assignment]
        fell_back.append((canonical[i], reason))
    if fell_back:
        key = tuple(fell_back)
        level = logging.DEBUG if key in warned_fallbacks else logging.WARNING
        warned_fallbacks.add(key)
        logger.log(
            level,
            "%d entr%s (%r first: %s) coded without a partner; coded with the fallback codec instead",
            len(fell_back),
            "y" if len(fell_back) == 1 else "ies",
            fell_back[0][0],
            fell_back[0][1],
        )
    return out


def encode_partnered(
    entries: dict[str, EncodedEntry],
    partners: Mapping[int, int],
    jobs: Sequence[Job],
    canonical: Sequence[str],
    exact_entry: Callable[[torch.Tensor], EncodedEntry],
    allocate: Allocator | None,
    grouped: bool = False,
    decoded: dict[str, torch.Tensor] | None = None,
) -> None:
    """Phase two of an encode: each entry of ``partners`` coded with its partner's entry
    decoded as a loader decodes it (a delta against the job's reference), into
    ``entries``; one host read of the NaN/Inf flags, the flagged ones stored exact.
    ``grouped`` (a device state): the partners decoded and the entries encoded in grouped
    ops (:func:`encode_grouped`), a number of launches that does not grow with their count.
    ``decoded``: where a host encode keeps each coded partner's decode, by entry path."""
    pending = encode_pending(entries, partners, jobs, canonical, allocate, grouped, decoded)
    bad = fingerprints.read_device_scalars([enc.unusable for _, enc in pending])
    settle(entries, pending, bad, jobs, canonical, exact_entry)


def encode_pending(
    entries: Mapping[str, EncodedEntry],
    partners: Mapping[int, int],
    jobs: Sequence[Job],
    canonical: Sequence[str],
    allocate: Allocator | None,
    grouped: bool = False,
    decoded: dict[str, torch.Tensor] | None = None,
) -> list[tuple[int, Encoded]]:
    """The encodes of :func:`encode_partnered` before their flags are read: ``(job index,
    encoded)`` in ``partners``' order, each ``unusable`` flag a device scalar (a slice of
    one buffer per device where ``grouped``). ``decoded`` (not ``grouped``): where each
    partner's decode is kept, by entry path, unless its entry is exact (whose decode may
    be the entry's own buffer)."""
    on_host = all(jobs[i][0].device.type == "cpu" for i in partners)

    def decode_item(i: int) -> tuple[EncodedEntry, torch.Tensor | None, torch.device, str]:
        x, j = jobs[i][0], partners[i]
        entry, ref = entries[canonical[j]], jobs[j][3]
        uses = get_codec(entry.codec).uses_reference(entry.params)  # type: ignore[union-attr]
        ref = ref.to(x.device) if uses and ref is not None else None
        return entry, ref, x.device, f"entry {canonical[j]!r} (partner of {canonical[i]!r})"

    def decode_alone(item: tuple[EncodedEntry, torch.Tensor | None, torch.device, str]) -> torch.Tensor:
        return get_codec(item[0].codec).decode(*item)  # type: ignore[union-attr]

    def encode(i: int, v_hat: torch.Tensor | None = None) -> Any:
        x, rule, codec, _ = jobs[i]
        if v_hat is None:
            item = decode_item(i)
            v_hat = decode_alone(item)
            if decoded is not None and item[0].codec != "exact":
                decoded[canonical[partners[i]]] = v_hat
        enc = codec.encode_with_partner(x, rule.params, canonical[partners[i]], v_hat, allocate)
        enc.entry.codec = rule.codec
        return enc

    order = list(partners)
    if grouped:
        encs = encode_grouped(
            order, jobs, [canonical[partners[i]] for i in order], decode_item, decode_alone, encode
        )
    else:
        encs = parallel_map(
            encode, order, sizes=[jobs[i][0].numel() * 4 for i in order], threads=None if on_host else 1
        )
    return list(zip(order, encs))


def settle(
    entries: dict[str, EncodedEntry],
    pending: Sequence[tuple[int, Encoded]],
    bad: Sequence[int],
    jobs: Sequence[Job],
    canonical: Sequence[str],
    exact_entry: Callable[[torch.Tensor], EncodedEntry],
) -> None:
    """Put the entries of :func:`encode_pending` into ``entries``, given their flags as
    read (``bad``): a flagged one is stored exact, logged."""
    for (i, enc), flagged in zip(pending, bad):
        path = canonical[i]
        entries[path] = enc.entry
        if flagged:
            logger.warning(
                "entry %r divided by its partner's sqrt holds NaN or Inf (in the tensor or its "
                "partner); stored exact instead of with codec %r",
                path,
                enc.entry.codec,
            )
            entries[path] = exact_entry(jobs[i][0])


def chunks(sizes: Sequence[int], limit: int = DECODED_PARTNER_BYTES) -> list[range]:
    """Consecutive index ranges of ``sizes`` whose sums stay within ``limit``, or are one
    item larger than it."""
    out, start, total = [], 0, 0
    for k, n in enumerate(sizes):
        if k > start and total + n > limit:
            out.append(range(start, k))
            start, total = k, 0
        total += n
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def encode_grouped(
    order: Sequence[int],
    jobs: Sequence[Job],
    partner_paths: Sequence[str],
    decode_item: Callable[[int], tuple],
    decode_alone: Callable[[tuple], torch.Tensor],
    encode_alone: Callable[[int, torch.Tensor], Encoded],
) -> list[Encoded]:
    """The entries ``order`` encoded on their devices, in chunks whose decoded partners
    take at most :data:`DECODED_PARTNER_BYTES` (or one partner) of device memory at once:
    per chunk, the partners decoded with :func:`~tw_triton.state.grouped.decode_grouped`,
    then one :meth:`~tw_triton.codecs.Codec.encode_group_with_partners` per device, codec,
    params and dtype (flags: one zero-filled buffer per device); ``encode_alone(k, v_hat)``
    where a codec has none or rejects the group. Results in ``order``'s order."""
    out: list[Encoded] = []
    for part in chunks([jobs[i][0].numel() * 4 for i in order]):
        out += _encode_chunk(
            [order[k] for k in part],
            jobs,
            [partner_paths[k] for k in part],
            decode_item,
            decode_alone,
            encode_alone,
        )
    return out


def _encode_chunk(
    order: Sequence[int],
    jobs: Sequence[Job],
    partner_paths: Sequence[str],
    decode_item: Callable[[int], tuple],
    decode_alone: Callable[[tuple], torch.Tensor],
    encode_alone: Callable[[int, torch.Tensor], Encoded],
) -> list[Encoded]:
    items = [decode_item(i) for i in order]
    v_hats = decode_grouped(items, lambda k: decode_alone(items[k]))
    groups: dict[Any, list[int]] = {}
    for k, i in enumerate(order):
        x, rule, _, _ = jobs[i]
        try:
            frozen = tuple(sorted(rule.params.items()))
            hash(frozen)
        except TypeError:  # params holding lists or dicts
            frozen = ("alone", k)
        groups.setdefault((x.device, rule.codec, frozen, x.dtype), []).append(k)
    sizes: dict[torch.device, int] = {}
    for (device, *_), members in groups.items():
        sizes[device] = sizes.get(device, 0) + len(members)
    buffers = {d: torch.zeros(n, dtype=torch.int64, device=d) for d, n in sizes.items()}
    used = dict.fromkeys(buffers, 0)
    out: list[Encoded] = [None] * len(order)  # type: ignore[list-item]
    for (device, name, _, _), members in groups.items():
        first = used[device]
        used[device] += len(members)
        flags = buffers[device][first : first + len(members)]
        codec = get_codec(name)
        xs = [jobs[order[k]][0] for k in members]
        try:
            encs = codec.encode_group_with_partners(  # type: ignore[union-attr]
                xs,
                jobs[order[members[0]]][1].params,
                [partner_paths[k] for k in members],
                [v_hats[k] for k in members],
                flags,
            )
            for enc in encs:
                enc.entry.codec = name
        except (NotImplementedError, QuantizationError):
            # One at a time, so that an error names the entry it is about.
            encs = [encode_alone(order[k], v_hats[k]) for k in members]
        for k, enc in zip(members, encs):
            out[k] = enc
    return out


def decode_grouped_with_partners(
    items: Sequence[tuple[EncodedEntry, torch.Tensor, torch.device, str]],
    decode_alone: Callable[[int], torch.Tensor],
) -> list[torch.Tensor]:
    """Decode ``(entry, its partner's decoded tensor, device, context)`` items on devices:
    those whose codec has a grouped decode with partners
    (:meth:`~tw_triton.codecs.Codec.decode_group_with_partners`) in one grouped op per
    codec, key and device, the others with ``decode_alone(i)``. Results in the items'
    order. The entries may be read from a file: the grouped decodes check them as
    :meth:`~tw_triton.codecs.Codec.decode_with_partner` does."""
    groups: dict[Any, list[int]] = {}
    out: list[torch.Tensor] = [None] * len(items)  # type: ignore[list-item]
    for i, (entry, _, device, _) in enumerate(items):
        codec = get_codec(entry.codec)
        key = None if codec is None else codec.partner_group_key(entry)
        if key is None:
            out[i] = decode_alone(i)
        else:
            groups.setdefault((entry.codec, key, device), []).append(i)
    for (name, _, device), members in groups.items():
        codec = get_codec(name)
        try:
            decoded = codec.decode_group_with_partners(  # type: ignore[union-attr]
                [items[i][0] for i in members],
                [items[i][1] for i in members],
                device,
                [items[i][3] for i in members],
            )
        except (NotImplementedError, QuantizationError):
            # One at a time, so that an error names the entry it is about.
            decoded = [decode_alone(i) for i in members]
        for i, t in zip(members, decoded):
            out[i] = t
    return out


def partner_map(
    entries: Mapping[str, tuple[str, Any, torch.dtype, tuple[int, ...]]], source: str
) -> dict[str, str]:
    """``{entry: its partner}`` of a file's entries, given as ``{path: (codec, params,
    dtype, shape)}`` with checked params.

    Raises:
        CheckpointError: a recorded partner that is no entry of the file, not float32, of
            another shape, or itself coded with a partner (naming ``source`` and the entry).
    """
    out: dict[str, str] = {}
    for path, (name, params, _, shape) in entries.items():
        codec = get_codec(name)
        partner = codec.partner_of(params) if codec is not None else None
        if partner is None:
            continue
        found = entries.get(partner)
        problem = None
        if found is None:
            problem = "no entry there"
        elif found[2] != torch.float32 or tuple(found[3]) != tuple(shape):
            problem = f"{found[2]} of shape {tuple(found[3])}"
        else:
            other = get_codec(found[0])
            if other is not None and other.partner_of(found[1]) is not None:
                problem = "an entry coded with a partner itself"
        if problem is not None:
            raise CheckpointError(
                f"{source}: entry {path!r} (codec {name!r}) is coded with partner {partner!r}, "
                f"expected a float32 entry of shape {tuple(shape)} not coded with a partner, found {problem}"
            )
        out[path] = partner
    return out
