"""Every private or experimental point of ``torch.distributed.checkpoint`` tw_triton uses.

Written against torch 2.13. A torch upgrade that moves one of these touches this file only.
Public DCP names (``FileSystemWriter``, ``FileSystemReader``, ``Metadata``, the planner
types) are imported where they are used. See docs/distributed.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def flatten_state_dict(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple]]:
    """DCP's own flattening: ``(fqn -> leaf, fqn -> object path)``.

    PRIVATE in 2.13 (``torch.distributed.checkpoint._nested_dict``). The stager must name
    tensors exactly as ``DefaultSavePlanner`` will, so it calls the same function.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as _flatten

    return _flatten(state_dict)


def local_chunk(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The data this rank holds for ``t`` and its offset in the global tensor.

    ``DTensor.__create_chunk_list__`` is the (undocumented) hook DCP's planner itself uses
    to place a DTensor's local shard; a plain tensor is one chunk at offset zero.
    """
    if isinstance(t, DTensor):
        chunks = t.__create_chunk_list__()
        if len(chunks) != 1:
            raise NotImplementedError(f"a DTensor with {len(chunks)} local chunks per rank is not supported")
        return t.to_local(), tuple(int(o) for o in chunks[0].offsets)
    return t, (0,) * t.dim()


def zstd_extensions() -> list[Any] | None:
    """DCP's zstd stream transform for ``FileSystemWriter(_extensions=...)``, or ``None``.

    EXPERIMENTAL in 2.13 (``torch.distributed.checkpoint._extension.ZStandard``); used by
    the benchmark only.
    """
    try:
        from torch.distributed.checkpoint._extension import ZStandard
    except ImportError:
        return None
    return [ZStandard()] if ZStandard.is_available() else None


__all__ = ["flatten_state_dict", "local_chunk", "zstd_extensions", "rank_errors"]


def rank_errors(exc: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside DCP's ``CheckpointException``, lowest rank first.

    ``CheckpointException.failures`` is public, but the ``(exception, traceback)`` pairs it
    holds are DCP's internal ``WRAPPED_EXCEPTION`` type.
    """
    failures = getattr(exc, "failures", None) or {}
    out = []
    for rank in sorted(failures):
        pair = failures[rank]
        out.append(pair[0] if isinstance(pair, tuple) else pair)
    return out
