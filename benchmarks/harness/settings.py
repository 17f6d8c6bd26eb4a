"""The checkpoint settings the benchmarks compare, and the one place they call tw_triton.

A :class:`Setting` names what is quantized how (model weights, optimizer moments, delta or
not). :func:`save_setting` writes a training state with it through the public state-level
API (``quantize_state_dict`` + ``save``) and :func:`load_setting` reads it back with
``load``, so every size the benchmarks report is the size of a real file on disk.

A :class:`ResumeSetting` is what the restart benchmarks run through a
:class:`tw_triton.Checkpointer`: a rule set (a preset name from ``tw_triton.rules.PRESETS``
or an explicit rule list), ``bits``, ``block``, ``keyframe_every`` and the delta mode.
:func:`parse_settings` turns ``--settings small,int4-delta,w8-m4:k=4`` into settings (any
preset the library knows runs with no change here), and :func:`stored_split` reads how many
bytes a written file spends on weights, ``exp_avg``, ``exp_avg_sq`` and the rest from its
manifest.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import tw_triton
from harness import update_domain
from tw_triton.checkpointer import DEFAULT_DELTA
from tw_triton.rules import PRESETS, resolve_rules, rules_as_specs

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
        return (self.bits is not None and self.delta) or (self.moment_bits is not None and self.moment_delta)


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


def load_setting(path: str | os.PathLike[str], reference: str | os.PathLike[str] | None = None) -> Any:
    """Read a checkpoint written by :func:`save_setting` back to CPU tensors."""
    return tw_triton.load(path, device="cpu", reference=str(reference) if reference else None)


# --------------------------------------------------------------------------- restarts

# How a Checkpointer codes the saves between keyframes: "open" = deltas from the last
# keyframe; "closed" = each delta from the reconstruction of the save before it;
# "none" = quantized on their own (see tw_triton.deltas).
DELTA_MODES = {"open": "open", "closed": "closed", "none": "none"}
# The Checkpointer's own default, against which the cycle average is also reported.
DEFAULT_KEYFRAME_EVERY = 10
# The parts of a checkpoint whose bytes the restart benchmarks report apart.
PARTS = ("weights", "exp_avg", "exp_avg_sq", "rest")


def _moment(name: str, spec: Any) -> tuple[str, Any]:
    return (f"optimizer/state/*/{name}", spec)


# Explicit rule lists, for what no preset expresses. Weight rules come from the defaults
# (the call's ``bits``), so a list only names the optimizer moments it codes.
EXPLICIT_RULES: dict[str, list[Any]] = {
    # exp_avg int4 on its own, exp_avg_sq exact: the first-moment lever alone.
    "w8-m4": [_moment("exp_avg", {"codec": "int4", "delta": False, "min_numel": 4096})],
    # exp_avg int4, exp_avg_sq log2 at 4 bits, weight deltas at int4 (bits=4 below).
    "w4-m4-v4": [
        _moment("exp_avg_sq", {"codec": "log2", "bits": 4, "min_numel": 4096}),
        _moment("exp_avg", {"codec": "int4", "delta": False, "min_numel": 4096}),
    ],
    # A negative control: exp_avg_sq linear int8 (known to break AdamW on resume).
    "w8-m8-v8linear": [
        _moment("exp_avg_sq", {"codec": "int8", "delta": False, "min_numel": 4096}),
        _moment("exp_avg", {"codec": "int8", "delta": False, "min_numel": 4096}),
    ],
    # The moment presets' shapes at other weight bits (weights from bits= below).
    "w2-m4-v2": [
        _moment("exp_avg_sq", {"codec": "log2", "bits": 2, "min_numel": 4096}),
        _moment("exp_avg", {"codec": "int4", "delta": False, "min_numel": 4096}),
    ],
    "w2-m2-v2": [
        _moment("exp_avg_sq", {"codec": "log2", "bits": 2, "min_numel": 4096}),
        _moment("exp_avg", {"codec": "int2", "delta": False, "min_numel": 4096}),
    ],
    # Wider blocks for the moments: fewer scales and bounds per element.
    "w2-m4-v2-wide": [
        _moment("exp_avg_sq", {"codec": "log2", "bits": 2, "block": 512, "min_numel": 4096}),
        _moment("exp_avg", {"codec": "int4", "block": 256, "delta": False, "min_numel": 4096}),
    ],
    # exp_avg in seven levels (int3: 4-bit container, stored near its entropy by zstd).
    "w2-m3-v2-wide": [
        _moment("exp_avg_sq", {"codec": "log2", "bits": 2, "block": 512, "min_numel": 4096}),
        _moment("exp_avg", {"codec": "int3", "block": 256, "delta": False, "min_numel": 4096}),
    ],
    "w2-m3-v2-wider": [
        _moment("exp_avg_sq", {"codec": "log2", "bits": 2, "block": 1024, "min_numel": 4096}),
        _moment("exp_avg", {"codec": "int3", "block": 512, "delta": False, "min_numel": 4096}),
    ],
    # Ablations of "smallest": its moments with int8 weight deltas, its weights with the
    # moments of "small".
    "w8-m3-v2-wide": [
        _moment("exp_avg_sq", {"codec": "log2", "bits": 2, "block": 512, "min_numel": 4096}),
        _moment("exp_avg", {"codec": "int3", "block": 256, "delta": False, "min_numel": 4096}),
    ],
    "w2-m4-v4": [
        _moment("exp_avg_sq", {"codec": "log2", "bits": 4, "min_numel": 4096}),
        _moment("exp_avg", {"codec": "int4", "delta": False, "min_numel": 4096}),
    ],
    # "smallest" with a coarser temporal step for exp_avg_sq: at least one octave (2**23
    # bit-pattern units), about the absolute 4-bit codes' largest step on the tiny GPT.
    "w2-m4-v4t23": [
        _moment("exp_avg_sq", {"codec": "log2-temporal", "bits": 4, "min_step": 1 << 23, "min_numel": 4096}),
        _moment("exp_avg_sq", {"codec": "log2", "bits": 4, "min_numel": 4096}),
        _moment("exp_avg", {"codec": "int4", "delta": False, "min_numel": 4096}),
    ],
    "w2-m3-v4": [
        _moment("exp_avg_sq", {"codec": "log2", "bits": 4, "min_numel": 4096}),
        _moment("exp_avg", {"codec": "int3", "block": 256, "delta": False, "min_numel": 4096}),
    ],
}


def _smallest_with(*overrides: tuple[str, Any]) -> list[Any]:
    """``smallest``'s rules with ``overrides`` matched first (the first matching rule wins)."""
    z = torch.zeros(64, 64)
    template = {"model": {"w": z}, "optimizer": {"state": {0: {"exp_avg": z, "exp_avg_sq": z}}}}
    return [*overrides, *rules_as_specs(resolve_rules("smallest", template, bits=8, block=128))]


# "smallest" with one moment at 8 bits: which of its 4-bit moments moves a long fine-tune
# saved every 200 steps (docs/performance.md, "Save intervals").
EXPLICIT_RULES["smallest-v8"] = _smallest_with(
    _moment("exp_avg_sq", {"codec": "log2-temporal", "bits": 8, "min_numel": 4096}),
    _moment("exp_avg_sq", {"codec": "log2", "bits": 8, "min_numel": 4096}),
)
EXPLICIT_RULES["smallest-m8"] = _smallest_with(
    _moment("exp_avg", {"codec": "blockwise-update", "bits": 8, "fallback_bits": 8, "min_numel": 4096}),
)
EXPLICIT_RULES["smallest-m8v8"] = [*EXPLICIT_RULES["smallest-m8"][:1], *EXPLICIT_RULES["smallest-v8"]]
EXPLICIT_BITS = {
    "smallest-m8v8": 2,
    "smallest-v8": 2,
    "smallest-m8": 2,
    "w4-m4-v4": 4,
    "w2-m4-v2": 2,
    "w2-m2-v2": 2,
    "w2-m4-v2-wide": 2,
    "w2-m3-v2-wide": 2,
    "w2-m3-v2-wider": 2,
    "w8-m3-v2-wide": 8,
    "w2-m4-v4": 2,
    "w2-m4-v4t23": 2,
    "w2-m3-v4": 2,
}


@dataclass(frozen=True)
class ResumeSetting:
    """One way to checkpoint a run: what a :class:`tw_triton.Checkpointer` is built with.

    Attributes:
        label: name in tables (the ``--settings`` token that made it).
        rules: a preset name or a list of ``(glob, codec spec)`` pairs.
        bits, block: the Checkpointer's defaults for quantizing rules.
        keyframe_every: one save in this many is a keyframe.
        delta: delta mode, a key of :data:`DELTA_MODES`.
        exp_avg_domain: a setting of :mod:`harness.update_domain` (``exp_avg`` in the
            update's domain, simulated), or ``None``.
    """

    label: str
    rules: Any
    bits: int = 8
    block: int = 128
    keyframe_every: int = DEFAULT_KEYFRAME_EVERY
    delta: str = DEFAULT_DELTA
    # A key of harness.update_domain.SETTINGS: exp_avg as that simulation codes it.
    exp_avg_domain: str | None = None

    def checkpointer(self, directory: str | os.PathLike[str]) -> tw_triton.Checkpointer:
        """A Checkpointer on ``directory`` with this setting, as a (re)started process makes it.

        Synchronous and without fsync: the benchmark measures what the files hold, not how
        fast they are written, and every save must be on disk when ``save`` returns.
        """
        return tw_triton.Checkpointer(
            directory,
            keyframe_every=self.keyframe_every,
            keep_last=2,
            rules=self.rules,
            bits=self.bits,
            block=self.block,
            delta=DELTA_MODES[self.delta],
            async_write=False,
            fsync=False,
        )

    def to_json(self) -> dict[str, Any]:
        """The setting as plain JSON values (rule lists as lists)."""
        d = dataclasses.asdict(self)
        if not isinstance(self.rules, str):
            d["rules"] = [[g, spec] for g, spec in self.rules]
        return d


def _validate(setting: ResumeSetting) -> None:
    """Resolve the setting's rules against a small AdamW-shaped state; raise if they do not.

    An unknown codec or bad parameters raise ``QuantizationError`` here, before any training.
    """
    z = torch.zeros(64, 64)
    state = {"model": {"w": z}, "optimizer": {"state": {0: {"exp_avg": z, "exp_avg_sq": z}}}}
    resolve_rules(setting.rules, state, bits=setting.bits, block=setting.block)


def parse_setting(token: str, *, keyframe_every: int = DEFAULT_KEYFRAME_EVERY) -> ResumeSetting:
    """One ``--settings`` token: ``NAME[:k=INT][:bits=INT][:block=INT][:delta=open|none]``.

    ``NAME`` is a preset of ``tw_triton.rules.PRESETS`` (run as ``rules=NAME``) or a key of
    :data:`EXPLICIT_RULES`. ``keyframe_every`` applies unless the token sets ``k``.

    Raises:
        ValueError: an unknown name or modifier (lists what is known);
        tw_triton.errors.QuantizationError: rules that name an unknown codec or bad params.
    """
    name, *mods = token.split(":")
    if name in PRESETS:
        setting = ResumeSetting(token, name, keyframe_every=keyframe_every)
    elif name in update_domain.SETTINGS:
        setting = ResumeSetting(
            token,
            update_domain.rules(name),
            bits=2,
            keyframe_every=keyframe_every,
            # Only the update's domain needs the harness (the others are plain rule lists).
            exp_avg_domain=name if update_domain.SETTINGS[name][0] == "update" else None,
        )
    elif name in EXPLICIT_RULES:
        setting = ResumeSetting(
            token, EXPLICIT_RULES[name], bits=EXPLICIT_BITS.get(name, 8), keyframe_every=keyframe_every
        )
    else:
        raise ValueError(
            f"unknown setting {name!r}: presets {', '.join(PRESETS)}; rule lists "
            f"{', '.join([*EXPLICIT_RULES, *update_domain.SETTINGS])}"
        )
    fields = {"k": "keyframe_every", "bits": "bits", "block": "block", "delta": "delta"}
    for mod in mods:
        key, sep, value = mod.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"setting {token!r}: bad modifier {mod!r}; use k=, bits=, block=, delta=")
        if key == "delta":
            if value not in DELTA_MODES:
                raise ValueError(
                    f"setting {token!r}: delta mode {value!r} is not one of {', '.join(DELTA_MODES)}"
                )
            setting = dataclasses.replace(setting, delta=value)
        else:
            setting = dataclasses.replace(setting, **{fields[key]: int(value)})
    if setting.keyframe_every < 1:
        raise ValueError(f"setting {token!r}: keyframe_every must be at least 1")
    _validate(setting)
    return setting


def parse_settings(spec: str, *, keyframe_every: int = DEFAULT_KEYFRAME_EVERY) -> tuple[ResumeSetting, ...]:
    """A comma-separated ``--settings`` value (see :func:`parse_setting`)."""
    tokens = [t.strip() for t in spec.split(",") if t.strip()]
    if not tokens:
        raise ValueError("no settings given")
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"a setting is named twice in {spec!r}")
    return tuple(parse_setting(t, keyframe_every=keyframe_every) for t in tokens)


def part_of(path: str) -> str:
    """Which of :data:`PARTS` a flattened checkpoint path belongs to."""
    if path.startswith("model/"):
        return "weights"
    leaf = path.rsplit("/", 1)[-1]
    return leaf if leaf in ("exp_avg", "exp_avg_sq") else "rest"


def stored_split(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Bytes a checkpoint file spends per part, from its manifest (the file's own counts).

    Returns ``{"kind": ..., "step": ..., "total": file size, "weights": ..., "exp_avg": ...,
    "exp_avg_sq": ..., "rest": ...}``; ``rest`` is everything else in the file (header,
    small and exact entries), so the parts add up to the file size.
    """
    manifest = tw_triton.format.read_manifest(path)
    total = Path(path).stat().st_size
    parts = dict.fromkeys(PARTS, 0)
    for entry_path, entry in manifest["entries"].items():
        nbytes = sum(b["data_offsets"][1] - b["data_offsets"][0] for b in entry["buffers"].values())
        parts[part_of(entry_path)] += nbytes
    parts["rest"] = total - parts["weights"] - parts["exp_avg"] - parts["exp_avg_sq"]
    meta = manifest.get("metadata") or {}
    return {"kind": meta.get("kind", "unknown"), "step": meta.get("step"), "total": total, **parts}
