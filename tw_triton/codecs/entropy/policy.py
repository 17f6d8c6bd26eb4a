"""The entropy policy: which stage a buffer gets when a checkpoint is written, and the
registry of stages a reader looks a recorded name up in.

Buffers under :data:`MIN_STAGE_BYTES` stay raw; 1-byte buffers get ``zstd``, floats the
byte-plane stages; a stage is kept only where it saves at least :data:`MIN_SAVING` of the
bytes. Why these thresholds: docs/performance.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CheckpointError
from .planes import PLANE_MATCH_MIN_BYTES, ByteGroupZstdStage, PlanesZstdStage
from .zstd import DEFAULT_LEVEL, Stage, ZstdSettings, ZstdStage, default_threads

# Wider buffers from this size up get zstd-planes (a frame per plane, near-random planes
# stored raw); smaller ones zstd-bytegroup (one frame: a frame per plane costs ~20 bytes
# of framing each, and a plane of a small buffer takes little time either way).
PLANES_MIN_BYTES = PLANE_MATCH_MIN_BYTES
# Buffers under this many bytes stay raw: the manifest record of a stage costs ~80 bytes
# and a zstd frame ~20, so a small buffer saves little and costs a decoder call.
MIN_STAGE_BYTES = 4096
# A stage is kept only where it saves at least this fraction of the raw bytes. Below it,
# the decode time costs more than reading the few saved bytes from any disk.
MIN_SAVING = 0.03

# The stage registry, like the codec registry: a file names its stage, the reader looks it up.
_STAGES: dict[str, Stage] = {s.name: s for s in (ZstdStage(), ByteGroupZstdStage(), PlanesZstdStage())}


def register_stage(stage: Stage, *, replace: bool = False) -> None:
    """Make ``stage`` available to writing and reading under ``stage.name``.

    Raises:
        CheckpointError: not a :class:`Stage`, an empty name, or a taken name without ``replace``.
    """
    if not isinstance(stage, Stage) or not isinstance(stage.name, str) or not stage.name:
        raise CheckpointError(f"a stage must subclass Stage and have a name, got {stage!r}")
    if stage.name in _STAGES and not replace:
        raise CheckpointError(f"stage {stage.name!r} is already registered (pass replace=True)")
    _STAGES[stage.name] = stage


def get_stage(name: str) -> Stage | None:
    """The stage registered as ``name``, or ``None``."""
    return _STAGES.get(name)


def unregister_stage(name: str) -> Stage | None:
    """Remove the stage registered as ``name`` (a plug-in's, or a test's); returns it, or
    ``None`` if there was none."""
    return _STAGES.pop(name, None)


def stage_names() -> list[str]:
    """Names of all registered stages."""
    return sorted(_STAGES)


@dataclass(frozen=True)
class EntropyPolicy:
    """Which buffers go through which stage when a checkpoint is written.

    Attributes:
        level: zstd level for every stage.
        min_match, hash_log: zstd match-finder settings for every stage (see
            :class:`ZstdSettings`; 0: the level's own); ``None``: each stage's
            :meth:`Stage.match_for` (``zstd-bytegroup``: :data:`PLANE_MATCH` from
            :data:`PLANE_MATCH_MIN_BYTES` up).
        min_bytes: buffers smaller than this stay raw.
        min_saving: a stage is kept only where it saves at least this fraction of the raw
            bytes; ``None`` keeps it whatever it gives (for tests of the format).
        stage: force this stage for every buffer it fits (``None``: by element size, see
            :func:`candidate_stages`).
        threads: zstd compression threads (0: the writer thread alone); ``None`` picks by
            buffer size and core count (:func:`default_threads`).
    """

    level: int = DEFAULT_LEVEL
    min_match: int | None = None
    hash_log: int | None = None
    min_bytes: int = MIN_STAGE_BYTES
    min_saving: float | None = MIN_SAVING
    stage: str | None = None
    threads: int | None = None


AUTO = EntropyPolicy()


def resolve_policy(entropy: Any) -> EntropyPolicy | None:
    """``"auto"`` -> the default policy, ``None``/``"none"`` -> no stage, a policy as is.

    Raises:
        CheckpointError: anything else, or a policy naming an unknown stage.
    """
    if entropy is None or entropy == "none":
        return None
    if isinstance(entropy, str) and entropy == "auto":
        return AUTO
    if isinstance(entropy, EntropyPolicy):
        if entropy.stage is not None and entropy.stage not in _STAGES:
            raise CheckpointError(
                f"entropy policy names unknown stage {entropy.stage!r}; known: {stage_names()}"
            )
        return entropy
    raise CheckpointError(f"entropy must be 'auto', 'none', None or an EntropyPolicy, got {entropy!r}")


def candidate_stages(dtype: torch.dtype, nbytes: int, policy: EntropyPolicy) -> tuple[str, ...]:
    """The stages to try for a buffer (the smallest output wins); ``()`` to store it raw.

    * under ``policy.min_bytes`` (or empty): raw;
    * 1-byte elements (codes, int8, bool): ``zstd`` (grouping one byte changes nothing);
    * floating and complex: byte planes, which put sign and exponent bytes together (they
      beat plain zstd on every float kind of the benchmark): ``zstd-planes`` from
      :data:`PLANES_MIN_BYTES` up, ``zstd-bytegroup`` below;
    * wider integers: the planes stage and ``zstd``. Small counters give zstd long runs of
      equal 8-byte patterns that grouping breaks up, while integers that hold float bits
      (the log2 codec's per-block bounds) group like floats; both kinds occur, and integer
      buffers are few.
    """
    if nbytes < policy.min_bytes or nbytes == 0:
        return ()
    if policy.stage is not None:
        return (policy.stage,)
    if dtype.itemsize == 1:
        return ("zstd",)
    planes = "zstd-planes" if nbytes >= PLANES_MIN_BYTES else "zstd-bytegroup"
    if dtype.is_floating_point or dtype.is_complex:
        return (planes,)
    return (planes, "zstd")


@dataclass(frozen=True)
class StagedBytes:
    """A buffer after its stage: the stored bytes and the manifest record of the stage."""

    data: bytes
    record: dict[str, Any]  # {"name", "params", "raw_nbytes"}


def encode_buffer(tensor: torch.Tensor, data: memoryview, policy: EntropyPolicy) -> StagedBytes | None:
    """Run the policy's stage on one contiguous CPU buffer whose bytes are ``data``.

    Returns ``None`` where the buffer stays raw (too small, or the stage saved too little).
    """
    best: tuple[bytes, str, dict[str, Any]] | None = None
    threads = default_threads(len(data)) if policy.threads is None else policy.threads
    for name in candidate_stages(tensor.dtype, len(data), policy):
        stage = _STAGES[name]
        match = stage.match_for(len(data))
        min_match = match[0] if policy.min_match is None else policy.min_match
        hash_log = match[1] if policy.hash_log is None else policy.hash_log
        zstd = ZstdSettings(policy.level, min_match, hash_log, threads)
        stored, params = stage.encode(data, tensor.element_size(), zstd)
        if best is None or len(stored) < len(best[0]):
            best = (stored, name, params)
    if best is None:
        return None
    stored, name, params = best
    if policy.min_saving is not None and len(stored) > len(data) * (1.0 - policy.min_saving):
        return None
    return StagedBytes(stored, {"name": name, "params": params, "raw_nbytes": len(data)})
