"""The blockwise codec's grouped encode and decode (the bodies of its
:meth:`~tw_triton.codecs.Codec.encode_group` and :meth:`~tw_triton.codecs.Codec.decode_group`).

A save of a device state encodes its blockwise entries in groups
(:mod:`tw_triton.state.grouped`), and a closed-loop save decodes its deltas in groups to
advance the reference (:func:`tw_triton.deltas.advance`): each group is one grouped op, a
fixed number of kernel launches whatever the number of tensors, with each tensor's bytes
and values what the codec gives it alone. Why: docs/design.md ("Launches and syncs per save").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import ops
from ..errors import QuantizationError
from ..ops.layout import check_params, check_qmax
from ..qstate import EncodedEntry
from .arguments import check_input
from .base import Encoded, move_to

if TYPE_CHECKING:
    from .blockwise import BlockwiseCodec


def encode_blockwise_group(
    codec: BlockwiseCodec,
    xs: Sequence[torch.Tensor],
    params: Mapping[str, Any],
    references: Sequence[torch.Tensor] | None,
    flags: torch.Tensor,
    each: Sequence[Mapping[str, Any]] | None = None,
) -> list[Encoded]:
    """:meth:`BlockwiseCodec.encode` of each of ``xs`` (``references`` at the same
    positions, or ``None``), with one grouped op; tensor ``i``'s flag is ``flags[i]``.
    ``each``: tensor ``i``'s params at ``i``, where their ``qmax`` differ (the rest as
    ``params``); default ``params`` for all."""
    refs: Sequence[torch.Tensor | None] = [None] * len(xs) if references is None else references
    for x, r in zip(xs, refs):
        check_input(x, r)
    bits, block = params["bits"], params["block"]
    check_params(bits, block)
    per_tensor = [params] * len(xs) if each is None else list(each)
    if any(p["bits"] != bits or p["block"] != block for p in per_tensor):
        raise QuantizationError("a grouped blockwise encode takes one bits and block for all its tensors")
    pairs = ops.quantize_blockwise_many(
        list(xs),
        None if references is None else list(references),
        bits,
        block,
        flags=flags,
        qmax=[check_qmax(bits, p.get("qmax")) for p in per_tensor],
    )
    return [
        Encoded(codec.entry_of(x, p, r is not None, codes, scales), unusable=flags[i])
        for i, (x, r, p, (codes, scales)) in enumerate(zip(xs, refs, per_tensor, pairs))
    ]


def decode_blockwise_group(
    codec: BlockwiseCodec,
    entries: Sequence[EncodedEntry],
    references: Sequence[torch.Tensor | None],
    device: torch.device,
    contexts: Sequence[str],
    outs: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """:meth:`BlockwiseCodec.decode` of entries of one bits, block and dtype, all deltas
    against their references or all absolute, on ``device``, with one grouped op; into
    ``outs[i]`` where it is a contiguous tensor of the entry's dtype and size on ``device``
    (the reference itself: no second copy of it)."""
    stored = [codec.stored_parts(e, c) for e, c in zip(entries, contexts)]
    delta = codec.uses_reference(entries[0].params)
    numels = [math.prod(e.shape) for e in entries]
    given = [None] * len(entries) if outs is None else list(outs)
    into = [
        o.view(-1) if o is not None and fits(o, entries[0].dtype, n, device) else None
        for o, n in zip(given, numels)
    ]
    flat = ops.dequantize_blockwise_many(
        [move_to(codes.reshape(-1), device) for _, _, codes, _ in stored],
        [move_to(scales.reshape(-1), device) for _, _, _, scales in stored],
        numels,
        stored[0][0],
        stored[0][1],
        [move_to(r, device).reshape(-1) for r in references] if delta else None,  # type: ignore[arg-type]
        entries[0].dtype,
        out=into,
    )
    return [shaped(t, e.shape, o, i) for t, e, o, i in zip(flat, entries, given, into)]


def shaped(
    flat: torch.Tensor, shape: Sequence[int], given: torch.Tensor | None, into: torch.Tensor | None
) -> torch.Tensor:
    """A grouped decode's result of ``shape``: the caller's tensor ``given`` itself where
    the op wrote into it (``into``, its flat view), else the op's flat tensor reshaped."""
    if into is not None and tuple(given.shape) == tuple(shape):  # type: ignore[union-attr]
        return given  # type: ignore[return-value]
    return flat.view(tuple(shape))


def fits(out: torch.Tensor, dtype: torch.dtype, numel: int, device: torch.device) -> bool:
    """Whether a grouped decode may write ``numel`` elements of ``dtype`` into ``out`` (a
    tensor the caller hands over, say its reference) on ``device``."""
    return out.dtype == dtype and out.numel() == numel and out.is_contiguous() and out.device == device


__all__ = ["decode_blockwise_group", "encode_blockwise_group", "fits", "shaped"]
