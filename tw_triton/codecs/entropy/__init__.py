"""The lossless entropy stage: a buffer's bytes become fewer stored bytes, and back.

A stage sits after the codecs: it sees one stored buffer (packed codes, per-block scales,
an exact tensor) as bytes and returns other bytes plus JSON parameters that the manifest
records next to the buffer (``tw_triton.format``, version 2). It never changes a value:
decoding gives back the very same bytes. Built in: ``zstd`` (:mod:`.zstd`),
``zstd-bytegroup`` and ``zstd-planes`` (byte planes, :mod:`.planes`); which buffer gets
which is the policy (:mod:`.policy`). Reading is bounded: a frame is checked against the
raw size the manifest records before the destination is allocated, and every failure is a
:class:`~tw_triton.errors.CheckpointError` naming the file, the entry and the buffer.
Stage records: docs/format.md; measurements: docs/performance.md.
"""

from __future__ import annotations

from .planes import (
    PLANE_MATCH,
    PLANE_MATCH_MIN_BYTES,
    PLANE_MIN_SAVING,
    PLANE_SAMPLE,
    ByteGroupZstdStage,
    PlanesZstdStage,
)
from .policy import (
    AUTO,
    MIN_SAVING,
    MIN_STAGE_BYTES,
    PLANES_MIN_BYTES,
    EntropyPolicy,
    StagedBytes,
    candidate_stages,
    encode_buffer,
    get_stage,
    register_stage,
    resolve_policy,
    stage_names,
    unregister_stage,
)
from .zstd import (
    CHUNK_BYTES,
    DEFAULT_LEVEL,
    MAX_THREADS,
    MIN_LEVEL,
    MT_MIN_BYTES,
    ONE_SHOT_MAX_BYTES,
    DecodeStream,
    Stage,
    ZstdSettings,
    ZstdStage,
    check_zstd_frame,
    default_threads,
)

__all__ = [
    "AUTO",
    "CHUNK_BYTES",
    "DEFAULT_LEVEL",
    "MAX_THREADS",
    "MIN_LEVEL",
    "MIN_SAVING",
    "MIN_STAGE_BYTES",
    "MT_MIN_BYTES",
    "ONE_SHOT_MAX_BYTES",
    "DecodeStream",
    "PLANES_MIN_BYTES",
    "PLANE_MATCH",
    "PLANE_MATCH_MIN_BYTES",
    "PLANE_MIN_SAVING",
    "PLANE_SAMPLE",
    "ByteGroupZstdStage",
    "EntropyPolicy",
    "PlanesZstdStage",
    "Stage",
    "StagedBytes",
    "ZstdSettings",
    "ZstdStage",
    "candidate_stages",
    "check_zstd_frame",
    "default_threads",
    "encode_buffer",
    "get_stage",
    "register_stage",
    "resolve_policy",
    "stage_names",
    "unregister_stage",
]
