"""The in-memory form of an encoded training state, shared by the state API, the file
format and the writer.

A :class:`QuantizedState` is what ``quantize_state_dict`` returns and what ``save`` and
the async writer put on disk: a flat mapping of tensor paths to encoded entries, plus a
JSON skeleton of everything that is not a tensor. Its buffers may live on the GPU until the
writer copies them to the host. Its form on disk: docs/format.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class EncodedEntry:
    """One tensor of the state, as a codec encoded it.

    Attributes:
        codec: registry name of the codec, e.g. ``"exact"`` or ``"blockwise"``.
        params: JSON-serializable codec parameters recorded in the manifest, e.g.
            ``{"bits": 8, "block": 128, "packing": "lsb-first", "delta": true}``.
        shape: the original tensor's shape.
        dtype: the original tensor's dtype.
        buffers: named tensors to store, e.g. ``{"codes": uint8, "scales": float32}`` for
            the blockwise codec or ``{"data": tensor}`` for the exact codec. They may live
            on any device; the writer moves them to the host.
    """

    codec: str
    params: dict[str, Any]
    shape: tuple[int, ...]
    dtype: torch.dtype
    buffers: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        """Bytes this entry stores (sum of its buffers)."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the original tensor."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class QuantizedState:
    """An encoded training state: a consistent snapshot, safe to write while training goes on.

    Attributes:
        entries: flattened tensor path (``"model/encoder.0.weight"``) to its encoding.
        aliases: path to the path whose entry it shares storage with (tied weights are
            stored once and restored under every key).
        skeleton: JSON-serializable tree of the original nested structure, with tensors
            replaced by references to their paths and the non-tensor leaves kept as typed
            JSON values (tuples stay tuples, ints stay ints).
        checkpoint_id: unique id of this checkpoint (stored in the file).
        reference_id: id of the reference checkpoint the deltas are against, or ``None``.
        rules: the rules in force, as JSON-serializable data (recorded in the manifest).
        metadata: small JSON-serializable user metadata (step, wall time, ...).
        decoded: host tensors by entry path that the encode decoded as a loader would (the
            partners of ``blockwise-update`` entries), kept when ``quantize_state_dict`` is
            asked to (``keep_decoded``) so that a closed loop's reference takes them instead
            of decoding those entries again; never written. Whoever takes them clears it.
    """

    entries: dict[str, EncodedEntry]
    skeleton: Any
    checkpoint_id: str
    reference_id: str | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    rules: list[Any] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    decoded: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """Bytes of all stored buffers (the file adds only its header)."""
        return sum(e.nbytes for e in self.entries.values())
