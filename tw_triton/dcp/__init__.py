"""tw_triton for ``torch.distributed.checkpoint`` (DCP): sharded, async, reshardable saves.

DCP plans, deduplicates, reshards and runs the async machinery; tw_triton encodes each
chunk with its codecs and writes tw_triton files::

    import torch.distributed.checkpoint as dcp
    from tw_triton.dcp import StorageWriter, StorageReader

    dcp.save(state, storage_writer=StorageWriter("ckpt/step_100", rules="small"))
    dcp.load(state, storage_reader=StorageReader("ckpt/step_100"))

``tw_triton.dcp.save`` / ``load`` do the same and re-raise tw_triton's errors out of DCP's
``CheckpointException``. Private and experimental DCP points are wrapped in :mod:`tw_triton.dcp._compat`.
"""

from .api import load, save
from .checkpointer import DistributedCheckpointer
from .keyframe import Keyframe
from .storage import StorageReader, StorageWriter, is_complete

__all__ = ["StorageWriter", "StorageReader", "Keyframe", "save", "load", "DistributedCheckpointer", "is_complete"]
