"""tw_triton for ``torch.distributed.checkpoint`` (DCP): sharded, async, reshardable saves.

DCP plans, deduplicates, reshards and runs the async machinery; tw_triton encodes each
chunk with its codecs and writes tw_triton files::

    import torch.distributed.checkpoint as dcp
    from tw_triton.dcp import StorageWriter, StorageReader

    dcp.save(state, storage_writer=StorageWriter("ckpt/step_100", rules="small"))
    dcp.load(state, storage_reader=StorageReader("ckpt/step_100"))

``tw_triton.dcp.save`` / ``load`` do the same and re-raise tw_triton's errors out of DCP's
``CheckpointException``. Modules: :mod:`.writer`, :mod:`.reader`, :mod:`.chunks` (chunk to
entry), :mod:`.staging` (pinned copies to the host), :mod:`.meta` (``tw_dcp.json``), :mod:`.directory` (completeness, keyframe lookup),
:mod:`.keyframe`, :mod:`.checkpointer`, :mod:`.api`; DCP's private and experimental points
only in :mod:`.compat`. The why: docs/distributed.md.
"""

from . import compat
from .api import load, save
from .checkpointer import DistributedCheckpointer
from .directory import is_complete
from .keyframe import Keyframe
from .reader import StorageReader
from .writer import StorageWriter

__all__ = [
    "compat",
    "StorageWriter",
    "StorageReader",
    "Keyframe",
    "save",
    "load",
    "DistributedCheckpointer",
    "is_complete",
]
