"""Small tensors of one kind, coded in one call on the CPU.

A model has many small tensors, and the torch path spends a fixed cost of Python and
dispatch per call on each, holding the GIL for much of it, so worker threads do not help
with them. Tensors that a codec can code as one concatenation
(:meth:`~tw_triton.codecs.Codec.batch_key`) are grouped here into work items of up to
:data:`BATCH_ELEMENTS`, so that the fixed cost is paid once per item. The bytes do not
change: each codec's :meth:`~tw_triton.codecs.Codec.encode_many` gives every tensor what
it gives it alone. Why: docs/design.md.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

# Elements of one work item: one chunk of the torch path (blockwise.CHUNK_ELEMENTS), so a
# batch runs the chunk loop once; larger items are slower (the concatenation leaves the cache).
BATCH_ELEMENTS = 1 << 19


def group_batches(
    keys: Sequence[Hashable | None], numels: Sequence[int], cap: int = BATCH_ELEMENTS
) -> list[list[int]]:
    """Indices of items grouped into work items.

    An item with key ``None`` or at least ``cap`` elements is a work item alone. The
    others are grouped by key, in index order, each group closed before it would pass
    ``cap`` elements. Work items come in the order of their first index.
    """
    work: list[list[int]] = []
    open_groups: dict[Hashable, tuple[list[int], int]] = {}
    for i, (key, n) in enumerate(zip(keys, numels)):
        if key is None or n >= cap:
            work.append([i])
            continue
        group = open_groups.get(key)
        if group is not None and group[1] + n <= cap:
            group[0].append(i)
            open_groups[key] = (group[0], group[1] + n)
            continue
        members = [i]
        work.append(members)
        open_groups[key] = (members, n)
    return work


__all__ = ["BATCH_ELEMENTS", "group_batches"]
