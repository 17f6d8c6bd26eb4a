"""How this rank's DCP chunks become tw_triton entries, and their encoding.

Each chunk is an entry named by its tensor's object path (``model/layer.weight``), so rules
select codecs as they do for ``quantize_state_dict`` on the same nested state; the rule is
matched on the whole tensor, so any number of ranks picks the same codec. Each file's
manifest metadata holds a chunk table (``CHUNK_TABLE_KEY``) mapping entries back to DCP's
fqn and offsets. See docs/distributed.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..codecs import get_codec
from ..errors import CheckpointError
from ..lowbit import is_wrapper
from ..qstate import EncodedEntry, QuantizedState
from ..rules import (
    Rule,
    keyframe_rules,
    partner_free,
    resolve_rules,
    rules_as_specs,
    select_rule,
    warn_if_too_coarse,
)
from ..state import quantize_state_dict
from ..tree import escape_component, flatten
from .keyframe import Keyframe

logger = logging.getLogger(__name__)
FILE_SUFFIX = ".tw.safetensors"
CHUNK_TABLE_KEY = "dcp"


@dataclass
class Chunk:
    """One chunk of a tensor (or one non-tensor item, as bytes) that this rank writes."""

    fqn: str
    obj_path: tuple[Any, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor  # this rank's data: a tensor chunk, or uint8 bytes
    global_shape: tuple[int, ...]


def entry_path(obj_path: tuple[Any, ...]) -> str:
    """The entry name of a chunk: its object path, components escaped and joined by ``/``."""
    return "/".join(escape_component(str(c)) for c in obj_path)


def nest(leaves: dict[tuple[Any, ...], Any]) -> dict[str, Any]:
    """Nested dicts with str keys whose ``tree.flatten`` paths are ``entry_path(obj_path)``."""
    root: dict[str, Any] = {}
    for obj_path, value in leaves.items():
        node = root
        for c in obj_path[:-1]:
            node = node.setdefault(str(c), {})
        node[str(obj_path[-1])] = value
    return root


def encode_chunks(
    chunks: list[Chunk],
    *,
    rules: Any,
    bits: int,
    block: int,
    keyframe: Keyframe | None,
    checkpoint_id: str,
    as_keyframe: bool = False,
) -> QuantizedState:
    """Encode this rank's chunks, each with the rule its *whole* tensor selects.

    Rules are matched on the global tensor (a meta tensor of its full shape), so a size
    floor such as ``min_numel`` gives the same codec on any number of ranks. Chunks are
    then encoded in one ``quantize_state_dict`` call per selected rule, with the
    keyframe's regions as the reference of the delta ones.
    """
    full = {c.obj_path: torch.empty(c.global_shape, dtype=c.tensor.dtype, device="meta") for c in chunks}
    rule_list = resolve_rules(rules, nest(full), bits=bits, block=block)
    # A chunk is coded with the others of its rule alone, so a codec that needs a partner
    # entry (blockwise-update) codes its fallback instead (docs/distributed.md).
    free = [partner_free(r) for r in rule_list]
    if free != rule_list:
        logger.info(
            "checkpoint %s: rules of a codec that needs a partner entry (blockwise-update) "
            "code DCP chunks with its fallback (blockwise) instead",
            checkpoint_id,
        )
        rule_list = free
    if as_keyframe:
        rule_list = keyframe_rules(rule_list)
    elif keyframe is not None:
        # DCP deltas are open loop (against the keyframe directory).
        warn_if_too_coarse(rule_list, "open", f"checkpoint {checkpoint_id}")
    groups: dict[int, tuple[Rule, list[Chunk]]] = {}
    # A low-bit optimizer's state (a tensor subclass) is stored as it is, its inner tensors
    # exact: never a delta from the keyframe.
    as_is = Rule("*", "exact")
    for c in chunks:
        rule = (
            as_is
            if is_wrapper(c.tensor)
            else select_rule(rule_list, entry_path(c.obj_path), full[c.obj_path])
        )
        groups.setdefault(id(rule), (rule, []))[1].append(c)
    entries: dict[str, EncodedEntry] = {}
    aliases: dict[str, str] = {}
    for rule, cs in groups.values():
        codec = get_codec(rule.codec)
        reference = None
        if keyframe is not None and codec is not None and codec.uses_reference(rule.params):
            ref_leaves: dict[tuple[Any, ...], torch.Tensor] = {}
            by_device: dict[torch.device, list[Chunk]] = {}
            for c in cs:
                by_device.setdefault(c.tensor.device, []).append(c)
            for dev, dcs in by_device.items():
                keys = [(c.fqn, c.offsets, tuple(c.tensor.shape)) for c in dcs]
                for c, r in zip(dcs, keyframe.regions(keys, dev)):
                    ref_leaves[c.obj_path] = r
            reference = nest(ref_leaves)
        part = quantize_state_dict(
            nest({c.obj_path: c.tensor for c in cs}),
            reference=reference,
            reference_id=keyframe.checkpoint_id if reference is not None else None,
            rules=rules_as_specs([Rule("*", rule.codec, rule.params, 0)]),
            bits=bits,
            block=block,
            checkpoint_id=checkpoint_id,
        )
        entries.update(part.entries)
        aliases.update(part.aliases)
    return QuantizedState(
        entries=entries,
        skeleton=None,
        checkpoint_id=checkpoint_id,
        aliases=aliases,
        rules=[r.to_json() for r in rule_list],
    )


def is_delta_entry(entry: EncodedEntry) -> bool:
    codec = get_codec(entry.codec)
    return codec is not None and codec.uses_reference(entry.params)


def file_state(
    chunks: list[Chunk], encoded: QuantizedState, *, checkpoint_id: str, reference_id: str | None, rank: int
) -> QuantizedState:
    """The entries of ``chunks`` from ``encoded``, as one file's state (a tensor subclass's
    chunk is the entries of its inner tensors, under one row of the chunk table)."""
    entries: dict[str, EncodedEntry] = {}
    table: dict[str, Any] = {}
    # Only a subclass's metadata is read here: its data are the encoded buffers.
    paths, skeleton = flatten(
        nest({c.obj_path: c.tensor if is_wrapper(c.tensor) else torch.empty(0) for c in chunks})
    )
    for path in paths:
        entry = encoded.entries.get(path)
        if entry is None:
            # Shared storage (tied weights) was encoded once; this file needs its own copy.
            entry = encoded.entries[encoded.aliases[path]]
        entries[path] = entry
    for c in chunks:
        path = entry_path(c.obj_path)
        if path in entries and tuple(entries[path].shape) != tuple(c.tensor.shape):
            raise CheckpointError(
                f"tw_triton DCP: {c.fqn!r} was staged with shape {tuple(entries[path].shape)} but the "
                f"plan writes a chunk of shape {tuple(c.tensor.shape)} (state changed after stage?)"
            )
        table[path] = {"fqn": c.fqn, "obj_path": list(c.obj_path), "offsets": list(c.offsets)}
    has_delta = any(is_delta_entry(e) for e in entries.values())
    return QuantizedState(
        entries=entries,
        skeleton=skeleton,
        checkpoint_id=checkpoint_id,
        reference_id=reference_id if has_delta else None,
        rules=encoded.rules,
        metadata={CHUNK_TABLE_KEY: {"rank": rank, "chunks": table}},
    )


__all__ = [
    "FILE_SUFFIX",
    "CHUNK_TABLE_KEY",
    "Chunk",
    "entry_path",
    "nest",
    "encode_chunks",
    "is_delta_entry",
    "file_state",
]
