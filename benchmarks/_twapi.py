"""The checkpoint settings the benchmarks compare, and the one place they call tw_triton.

A :class:`Setting` names what is quantized how (model weights, optimizer moments, delta or
not). :func:`save_setting` writes a training state with it through the public state-level
API (``quantize_state_dict`` + ``save``) and :func:`load_setting` reads it back with
``load``, so every size the benchmarks report is the size of a real file on disk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tw_triton

# Tensors smaller than this stay exact, like the library's default rules: their scales
# would cost more than the bits saved.
MIN_QUANT_NUMEL = 4096


@dataclass(frozen=True)
class Setting:
    """How a checkpoint stores a training state ``{"model": ..., "optimizer": ...}``.

    Attributes:
        name: label used in tables and plots.
        bits: code width for the model weights, or ``None`` for exact weights.
        block: elements per scale.
        delta: whether quantized weights are the delta from the reference checkpoint.
        moment_bits: code width for the AdamW moments (``exp_avg``, ``exp_avg_sq``), or
            ``None`` to keep them exact (the library default).
        moment_delta: whether quantized moments are deltas from the reference.
        moments: which optimizer state entries ``moment_bits`` applies to.
        preset: a library preset name (``rules="int8-moments"``) to use instead of the
            rules the other fields describe; those fields must then say what it does.
    """

    name: str
    bits: int | None = 8
    block: int = 128
    delta: bool = True
    moment_bits: int | None = None
    moment_delta: bool = True
    moments: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    preset: str | None = None

    @property
    def uses_reference(self) -> bool:
        """Whether a reference checkpoint is needed to decode."""
        return (self.bits is not None and self.delta) or (
            self.moment_bits is not None and self.moment_delta
        )


def rules_for(setting: Setting) -> list[Any] | str:
    """The ordered ``(glob, codec spec)`` rules that express ``setting`` (see tw_triton.rules).

    The last rule keeps everything else exact, so the library's defaults never add to it.
    A setting that names a preset is passed through as that preset.
    """
    if setting.preset is not None:
        return setting.preset  # type: ignore[return-value]
    rules: list[Any] = []
    if setting.moment_bits is not None:
        spec = {
            "codec": "blockwise",
            "bits": setting.moment_bits,
            "block": setting.block,
            "delta": setting.moment_delta,
            "min_numel": MIN_QUANT_NUMEL,
        }
        for moment in setting.moments:
            rules.append((f"optimizer/state/*/{moment}", spec))
    if setting.bits is not None:
        spec = {
            "codec": "blockwise",
            "bits": setting.bits,
            "block": setting.block,
            "delta": setting.delta,
            "min_numel": MIN_QUANT_NUMEL,
        }
        rules.append(("model/*", spec))
    rules.append(("*", "exact"))
    return rules


def save_setting(
    state: dict[str, Any],
    setting: Setting,
    path: str | os.PathLike[str],
    reference: str | os.PathLike[str] | None = None,
) -> int:
    """Encode ``state`` with ``setting`` and write it to ``path``; return the file's size.

    Args:
        state: nested training state with ``"model"`` (a state dict) and optionally
            ``"optimizer"`` (an optimizer state dict) and plain values.
        setting: what to quantize how.
        path: the checkpoint file to write.
        reference: path of an exact checkpoint of the same structure (the keyframe); needed
            when ``setting.uses_reference``.
    """
    ref = reference if setting.uses_reference else None
    qstate = tw_triton.quantize_state_dict(
        state,
        reference=str(ref) if ref is not None else None,
        rules=rules_for(setting),
        bits=setting.bits or 8,
        block=setting.block,
    )
    tw_triton.save(qstate, path)
    return Path(path).stat().st_size


def load_setting(
    path: str | os.PathLike[str], reference: str | os.PathLike[str] | None = None
) -> Any:
    """Read a checkpoint written by :func:`save_setting` back to CPU tensors."""
    return tw_triton.load(path, device="cpu", reference=str(reference) if reference else None)
