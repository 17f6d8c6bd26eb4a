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

from ..codecs import Codec, get_codec
from ..errors import CheckpointError
from ..parallel import parallel_map
from ..qstate import EncodedEntry
from ..rules import partner_free
from ..snapshot_pool import Allocator
from . import fingerprints

logger = logging.getLogger(__name__)

# (tensor, rule, codec, reference or None), as quantize_state_dict plans an entry.
Job = tuple[torch.Tensor, Any, Codec, "torch.Tensor | None"]


def plan_partners(canonical: Sequence[str], jobs: list[Job], aliases: Mapping[str, str]) -> dict[int, int]:
    """The entries coded with a partner, ``{job index: partner's job index}``; a job whose
    partner cannot serve (none, another shape, not float32, itself with a partner) gets
    its codec's fallback rule in ``jobs``, logged once for the call."""
    index = {p: i for i, p in enumerate(canonical)}
    present = set(index) | set(aliases)
    out: dict[int, int] = {}
    fell_back: list[str] = []
    for i, (x, rule, codec, _) in enumerate(jobs):
        if not codec.has_partners:
            continue
        found = codec.partner_path(canonical[i], rule.params, present)
        j = index.get(aliases.get(found, found)) if found is not None else None  # type: ignore[arg-type]
        if (
            j is not None
            and j != i
            and not jobs[j][2].has_partners
            and jobs[j][0].dtype == torch.float32
            and tuple(jobs[j][0].shape) == tuple(x.shape)
        ):
            out[i] = j
            continue
        rule = partner_free(rule)
        jobs[i] = (x, rule, get_codec(rule.codec), None)  # type: ignore[assignment]
        fell_back.append(canonical[i])
    if fell_back:
        logger.warning(
            "%d entr%s (%r first) coded without a partner: none in the state of their shape as "
            "float32 that is not itself coded with a partner; coded with the fallback codec instead",
            len(fell_back),
            "y" if len(fell_back) == 1 else "ies",
            fell_back[0],
        )
    return out


def encode_partnered(
    entries: dict[str, EncodedEntry],
    partners: Mapping[int, int],
    jobs: Sequence[Job],
    canonical: Sequence[str],
    exact_entry: Callable[[torch.Tensor], EncodedEntry],
    allocate: Allocator | None,
) -> None:
    """Phase two of an encode: each entry of ``partners`` coded with its partner's entry
    decoded as a loader decodes it (a delta against the job's reference), into
    ``entries``; one host read of the NaN/Inf flags, the flagged ones stored exact."""
    on_host = all(jobs[i][0].device.type == "cpu" for i in partners)

    def encode(i: int) -> Any:
        x, rule, codec, _ = jobs[i]
        j = partners[i]
        entry, ref = entries[canonical[j]], jobs[j][3]
        partner_codec = get_codec(entry.codec)
        context = f"entry {canonical[j]!r} (partner of {canonical[i]!r})"
        uses = partner_codec.uses_reference(entry.params)  # type: ignore[union-attr]
        ref = ref.to(x.device) if uses and ref is not None else None
        v_hat = partner_codec.decode(entry, ref, x.device, context)  # type: ignore[union-attr]
        enc = codec.encode_with_partner(x, rule.params, canonical[j], v_hat, allocate)
        enc.entry.codec = rule.codec
        return enc

    order = list(partners)
    encs = parallel_map(
        encode, order, sizes=[jobs[i][0].numel() * 4 for i in order], threads=None if on_host else 1
    )
    bad = fingerprints.read_device_scalars([enc.unusable for enc in encs])
    for i, enc, flagged in zip(order, encs, bad):
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
