"""The storage layer's historical module path: :class:`StorageWriter` (:mod:`.writer`),
:class:`StorageReader` (:mod:`.reader`) and the directory checks (:mod:`.directory`).
See docs/distributed.md.
"""

from __future__ import annotations

from .chunks import FILE_SUFFIX
from .directory import complete_record, find_keyframe, is_complete
from .reader import StorageReader
from .writer import StorageWriter

__all__ = ["StorageWriter", "StorageReader", "FILE_SUFFIX", "is_complete", "complete_record", "find_keyframe"]
