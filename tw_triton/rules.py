"""Which codec stores which tensor: ordered glob rules on flattened paths.

A rule is a glob on the flattened path (see :mod:`tw_triton.tree`: ``model/encoder.0.weight``,
``optimizer/state/3/exp_avg``) and a codec spec. Rules are tried in order and the **first
match wins**. A rule matches a tensor only if its glob matches the path, the tensor has at
least ``min_numel`` elements, and the codec can encode the tensor's dtype (so
``("model/*", "int4")`` does not catch an integer buffer such as ``num_batches_tracked``,
which falls through to the next rule). Globs use :func:`fnmatch.fnmatchcase`; ``*`` also
matches ``/``.

Codec specs:

* ``"exact"``, ``"blockwise"`` or any registered codec name;
* ``"int8"``, ``"int4"``, ``"int2"``: the blockwise codec at 8, 4 or 2 bits; ``"int3"``:
  seven levels (``qmax`` 3) in a 4-bit container, which the entropy stage stores in about
  their entropy;
* a dict ``{"codec": "blockwise", "bits": 4, "block": 64, "delta": False, "min_numel": 0}``;
  a blockwise dict may add ``"max_error": 0.015``: per tensor, the fewest levels (the
  largest code ``qmax``, from its ``bits``' own up to 127) whose error bound relative to
  the tensor stays under it, in the narrowest of the 2-, 4- and 8-bit containers
  (:mod:`tw_triton.delta_bits`; each entry records its ``bits`` and ``qmax``).

Parameters a spec leaves out (``bits``, ``block``) come from the call
(``quantize_state_dict(..., bits=8, block=128)``). ``delta`` defaults to true: quantized
entries are deltas from the reference whenever a reference is given.

The user's rules come first; the defaults follow them, so anything the user's rules do not
match gets the default treatment:

* floating tensors (float32, float16, bfloat16) of at least 4096 elements *under the model*
  are quantized with the call's ``bits`` and ``block``;
* everything else is exact: integer and bool tensors, small tensors (biases, norms), step
  counters, RNG states, and optimizer moments (unless a rule or a preset says otherwise).

States a low-bit optimizer already quantized (torchao's subclasses, bitsandbytes' 8-bit
states: :mod:`tw_triton.lowbit`) are exact whatever the rules say.

"Under the model" means: if the state's top level is a dict with a key ``"model"``,
``"model_state_dict"`` or ``"state_dict"`` holding a dict, the paths under those keys
(``model/*``). Otherwise, if the top level is a flat dict (no value is a dict, list or tuple:
a plain ``nn.Module.state_dict()``), every path. Otherwise nothing is under the model, and
the defaults quantize nothing.

Presets (``rules="int4-delta"``), each followed by the defaults:

``"default"``    the defaults alone (same as ``rules=None``);
``"exact"``      everything exact;
``"int8-delta"`` / ``"int4-delta"``  the model's large float tensors at 8 / 4 bits;
``"int8-exp-avg"``  like ``int8-delta``, and AdamW's first moment ``exp_avg`` (at least
4096 elements) at 8 bits too. The second moment ``exp_avg_sq`` stays exact: it spans the
square of the gradient's range, so linear 8-bit codes round its small values to zero (and a
delta can make them negative), and a resumed AdamW then takes huge or NaN steps.

Presets by intent, for a whole training state (model and optimizer), each followed by the
defaults. Weights are deltas from the keyframe; the optimizer state is coded on its own by its
role (:mod:`tw_triton.roles`, any optimizer of ``torch.optim``): *signed* running averages
(``exp_avg``, ``momentum_buffer``, ...) blockwise without a reference, *non-negative* ones
(``exp_avg_sq``, ``square_avg``, Adagrad's ``sum``, ...) by the ``log2`` codec, which never
decodes a negative value nor a zero where there was none, both from 4096 elements up;
everything else, and any name no optimizer of ``torch.optim`` uses, exact:

``"safe"``      weight deltas int8, signed int8, non-negative log2 8 bits;
``"small"``     weight deltas int8, signed int4, non-negative log2 4 bits (what the
                :class:`~tw_triton.dcp.DistributedCheckpointer`'s ``"auto"`` takes
                below ``LONG_INTERVAL_STEPS``), between
                keyframes the float32 non-negative moments as ``log2-temporal``;
``"smallest"``  weight deltas int2, signed int4 but Adam's ``exp_avg`` as int3 codes of
                the update ``exp_avg / (sqrt(exp_avg_sq) + eps)`` (``blockwise-update``),
                non-negative log2 4 bits, between keyframes
                the float32 non-negative moments as ``log2-temporal`` changes against
                the last reconstruction (others stay log2); a tensor whose
                change 2 bits would code with a relative error above
                :data:`DELTA_MAX_ERROR` gets more levels, up to 8 bits (``max_error``, below). Its 2-bit weight
                deltas need *closed-loop* deltas
                (``Checkpointer(delta="closed")``, the default; see
                :mod:`tw_triton.deltas`): against a keyframe many saves back (open loop)
                four levels are too coarse, and the resumed run drifts;
``"auto"``      the :class:`~tw_triton.checkpointer.Checkpointer` default: ``smallest``
                for saves fewer than ``LONG_INTERVAL_STEPS`` (100) steps apart, ``safe``
                from there (:mod:`tw_triton.interval_rules`; the
                :class:`~tw_triton.dcp.DistributedCheckpointer`'s takes ``small`` and
                ``safe``); without a save interval (:func:`resolve_rules`), ``smallest``.

How each preset resumes against the noise floor: docs/performance.md.

A preset is the whole ``rules`` value; it is not mixed into a list, which keeps the order
of matching obvious.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from . import roles
from .codecs import Codec, codec_names, get_codec
from .errors import QuantizationError
from .interval_rules import AUTO, SHORT_INTERVAL_PRESET
from .lowbit import stored_as_is
from .ops.layout import check_params
from .tree import Flattened

DEFAULT_MIN_NUMEL = 4096
MODEL_KEYS = ("model", "model_state_dict", "state_dict")
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict")
logger = logging.getLogger(__name__)
# Codec names that are the blockwise codec with these params ("int3": seven levels in a
# 4-bit container, which the entropy stage stores in about their entropy).
_BITS_ALIASES: dict[str, dict[str, int]] = {
    "int8": {"bits": 8},
    "int4": {"bits": 4},
    "int3": {"bits": 4, "qmax": 3},
    "int2": {"bits": 2},
}
PRESETS = (
    "auto",
    "default",
    "exact",
    "int8-delta",
    "int4-delta",
    "int8-exp-avg",
    "safe",
    "small",
    "smallest",
)
# The presets by intent: (weight-delta bits, exp_avg spec, exp_avg_sq log2 spec). Globs end
# with the moment's name, so they match whatever name the optimizer was saved under. Fewer
# moment bits do not resume within the noise floor on every run (docs/performance.md): no
# preset uses them.
MOMENT_PRESETS: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {
    "safe": (8, {"codec": "int8"}, {"bits": 8}),
    "small": (8, {"codec": "int4"}, {"bits": 4}),
    "smallest": (2, {"codec": "int4"}, {"bits": 4}),
}
# Presets that code Adam's ``exp_avg`` in the update's domain, ``exp_avg / (sqrt(v_hat) + eps)``
# with its ``exp_avg_sq`` (codec ``blockwise-update``; why: docs/codecs.md); an ``exp_avg``
# without one (Adamax) and DCP's chunks get the preset's ``exp_avg`` bits of before, int4.
UPDATE_DOMAIN: dict[str, dict[str, Any]] = {
    "smallest": {"codec": "blockwise-update", "bits": 3, "fallback_bits": 4}
}
# Presets whose weight deltas take more bits for a tensor whose change the preset's bits would
# code with a larger relative error than this bound (tw_triton.delta_bits; the value: docs/codecs.md).
DELTA_MAX_ERROR = {"smallest": 0.015}
# The presets whose float32 second moments are coded between keyframes by ``log2-temporal``
# against their last reconstruction (the keyframe keeps the log2 codes; docs/codecs.md).
TEMPORAL_PRESETS = frozenset({"small", "smallest"})
# Weight-delta bits that need closed-loop deltas (see "smallest" above).
CLOSED_LOOP_BITS = 2


@dataclass(frozen=True)
class Rule:
    """One resolved rule: glob, registered codec name, full codec params, size floor."""

    pattern: str
    codec: str
    params: dict[str, Any] = field(default_factory=dict)
    min_numel: int = 0
    # Blockwise deltas: more bits per tensor where ``params["bits"]`` would leave a larger
    # relative error than this (tw_triton.delta_bits); ``None``: the rule's bits always.
    max_error: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The rule as recorded in the manifest."""
        out = {
            "pattern": self.pattern,
            "codec": self.codec,
            "params": dict(self.params),
            "min_numel": self.min_numel,
        }
        if self.max_error is not None:
            out["max_error"] = self.max_error
        return out

    def matches(self, path: str, tensor: torch.Tensor, codec: Codec) -> bool:
        """Whether this rule applies to ``tensor`` at ``path``."""
        return (
            tensor.numel() >= self.min_numel
            and fnmatch.fnmatchcase(path, self.pattern)
            and codec.accepts(tensor)
        )


def model_patterns(state: Any) -> list[str]:
    """Globs of the paths that are "under the model" for this state (see module doc); the
    state nested, or :class:`~tw_triton.tree.Flattened`."""
    if isinstance(state, Flattened):
        top = state.top_level()
        if top is None:
            return []
        keys = [k for k in MODEL_KEYS if top.get(k) == "dict"]
        if keys:
            return [f"{k}/*" for k in keys]
        return ["*"] if all(kind == "leaf" for kind in top.values()) else []
    if not isinstance(state, dict):
        return []
    keys = [k for k in MODEL_KEYS if isinstance(state.get(k), dict)]
    if keys:
        return [f"{k}/*" for k in keys]
    if all(not isinstance(v, (dict, list, tuple)) for v in state.values()):
        return ["*"]
    return []


def _parse_spec(spec: Any, where: str) -> tuple[str, dict[str, Any], int, float | None]:
    if isinstance(spec, str):
        if spec in _BITS_ALIASES:
            return "blockwise", dict(_BITS_ALIASES[spec]), 0, None
        return spec, {}, 0, None
    if isinstance(spec, Mapping):
        params = dict(spec)
        name = params.pop("codec", None)
        if not isinstance(name, str):
            raise QuantizationError(f"{where}: a dict codec spec needs a 'codec' name, got {spec!r}")
        if name in _BITS_ALIASES:
            for key, value in _BITS_ALIASES[name].items():
                params.setdefault(key, value)
            name = "blockwise"
        min_numel = params.pop("min_numel", 0)
        if not isinstance(min_numel, int) or isinstance(min_numel, bool) or min_numel < 0:
            raise QuantizationError(f"{where}: min_numel must be a non-negative int, got {min_numel!r}")
        max_error = params.pop("max_error", None)
        if max_error is not None:
            if (
                isinstance(max_error, bool)
                or not isinstance(max_error, (int, float))
                or not 0 < max_error < 1
            ):
                raise QuantizationError(f"{where}: max_error must be a number in (0, 1), got {max_error!r}")
            if name != "blockwise" or "qmax" in params:
                raise QuantizationError(
                    f"{where}: max_error applies to the blockwise codec's full-range bits only"
                )
            max_error = float(max_error)
        return name, params, min_numel, max_error
    raise QuantizationError(f"{where}: a codec spec is a name or a dict, got {spec!r}")


def make_rule(pattern: str, spec: Any, *, bits: int, block: int, where: str = "rule") -> Rule:
    """Resolve one ``(glob, codec spec)`` pair against the registry and the call's defaults.

    Raises:
        QuantizationError: a bad glob or spec, an unknown codec, or invalid params.
    """
    if not isinstance(pattern, str) or not pattern:
        raise QuantizationError(f"{where}: the glob must be a non-empty string, got {pattern!r}")
    name, params, min_numel, max_error = _parse_spec(spec, where)
    codec = get_codec(name)
    if codec is None:
        raise QuantizationError(
            f"{where}: unknown codec {name!r}; registered: {', '.join(codec_names())} "
            f"(aliases: {', '.join(_BITS_ALIASES)})"
        )
    try:
        resolved = codec.resolve_params(params, bits=bits, block=block)
    except QuantizationError as e:
        raise QuantizationError(f"{where} ({pattern!r}): {e}") from e
    return Rule(pattern, name, resolved, min_numel, max_error)


def default_rules(state: Any, *, bits: int, block: int) -> list[Rule]:
    """The default rules for ``state``: large float tensors under the model quantized."""
    rules = [
        make_rule(p, "blockwise", bits=bits, block=block, where="default rule") for p in model_patterns(state)
    ]
    rules = [replace(r, min_numel=DEFAULT_MIN_NUMEL) for r in rules]
    rules.append(Rule("*", "exact"))
    return rules


def _preset_rules(name: str, state: Any, *, bits: int, block: int) -> list[Rule]:
    if name == AUTO:  # without a save interval: the short one's (tw_triton.interval_rules)
        name = SHORT_INTERVAL_PRESET
    if name == "default":
        return default_rules(state, bits=bits, block=block)
    if name == "exact":
        return [Rule("*", "exact")]
    if name in ("int8-delta", "int4-delta"):
        return default_rules(state, bits=8 if name == "int8-delta" else 4, block=block)
    if name == "int8-exp-avg":
        moments = [
            make_rule(
                f"{k}/state/*/exp_avg",
                {"codec": "int8", "min_numel": DEFAULT_MIN_NUMEL},
                bits=bits,
                block=block,
                where="preset int8-exp-avg",
            )
            for k in OPTIMIZER_KEYS
        ]
        return moments + default_rules(state, bits=8, block=block)
    if name in MOMENT_PRESETS:
        w_bits, m_spec, v_spec = MOMENT_PRESETS[name]
        where = f"preset {name}"
        roles.log_unknown(state, OPTIMIZER_KEYS)
        by_role = {
            roles.NON_NEGATIVE: {"codec": "log2", **v_spec, "min_numel": DEFAULT_MIN_NUMEL},
            roles.SIGNED: {**m_spec, "delta": False, "min_numel": DEFAULT_MIN_NUMEL},
        }
        # The legacy globs first, in their old order (AdamW's files record the same rules).
        globs = [(g, r) for r in by_role for g in roles.LEGACY_GLOBS[r]]
        globs += [(g, r) for r in by_role for g in roles.role_globs(r) if g not in roles.LEGACY_GLOBS[r]]
        specs = {g: by_role[r] for g, r in globs}
        if name in UPDATE_DOMAIN:
            for g in roles.LEGACY_GLOBS[roles.SIGNED]:
                specs[g] = {**UPDATE_DOMAIN[name], "min_numel": DEFAULT_MIN_NUMEL}
        moments = [make_rule(g, specs[g], bits=bits, block=block, where=where) for g, _ in globs]
        if name in TEMPORAL_PRESETS:
            # Between keyframes: the change against the last reconstruction (float32; other
            # dtypes fall through to log2; a keyframe codes log2, Codec.keyframe_spec).
            temporal = {"codec": "log2-temporal", **v_spec, "min_numel": DEFAULT_MIN_NUMEL}
            nonneg = [g for g, r in globs if r == roles.NON_NEGATIVE]
            moments = [make_rule(g, temporal, bits=bits, block=block, where=where) for g in nonneg] + moments
        weights = default_rules(state, bits=w_bits, block=block)
        if name in DELTA_MAX_ERROR:
            weights = [
                replace(r, max_error=DELTA_MAX_ERROR[name]) if r.codec == "blockwise" else r for r in weights
            ]
        return moments + weights
    raise QuantizationError(f"unknown rules preset {name!r}; presets: {', '.join(PRESETS)}")


def warn_if_too_coarse(rules: Sequence[Rule], mode: str, where: str) -> bool:
    """Log a warning if ``rules`` code weight deltas too coarsely for delta mode ``mode``;
    return whether it did.

    ``"open"``: deltas at :data:`CLOSED_LOOP_BITS` against the keyframe, whose error grows
    with the distance from it. ``"none"``: the tensors the rules delta-code are quantized
    on their own, and below 8 bits that loses a trained model. Closed loop needs no warning.
    """
    deltas = [r for r in rules if r.codec == "blockwise" and r.params.get("delta", True)]
    if mode == "open":
        coarse = [r.pattern for r in deltas if r.params.get("bits") <= CLOSED_LOOP_BITS]
        why = f"at {CLOSED_LOOP_BITS} bits against the keyframe (open loop)"
    elif mode == "none":
        coarse = [r.pattern for r in deltas if r.params.get("bits") < 8]
        why = "below 8 bits on their own (no delta)"
    else:
        return False
    if coarse:
        logger.warning(
            "%s: rules code %s %s; that measured too coarse for a resumed run "
            "(benchmarks/resume_fidelity.py). Use closed-loop deltas (delta='closed') or rules='small'",
            where,
            ", ".join(coarse),
            why,
        )
    return bool(coarse)


def keyframe_rules(rules: Sequence[Rule]) -> list[Rule]:
    """``rules`` with every rule that codes a delta made exact: what a keyframe stores.

    A keyframe is the reference of the deltas after it, so the tensors they delta-code are
    stored exact; tensors coded on their own (optimizer moments under a moment preset) keep
    their codec, so a keyframe is smaller than an exact one and a delta decodes against
    exact values.
    """
    return [keyframe_rule(rule) for rule in rules]


def keyframe_rule(rule: Rule) -> Rule:
    """``rule`` as a keyframe (or a save with no reference) codes what it matches: a rule
    that codes a delta becomes exact, or what its codec names (log2-temporal: the absolute
    log2 codes); any other rule is returned as it is."""
    codec = get_codec(rule.codec)
    if codec is None or not codec.uses_reference(rule.params):
        return rule
    name, params = codec.keyframe_spec(rule.params)
    return Rule(rule.pattern, name, dict(params), rule.min_numel)


def partner_free(rule: Rule) -> Rule:
    """``rule``, or for a codec whose entries need a partner entry (``blockwise-update``)
    the rule of its fallback codec (the blockwise codes of the same bits and block): what
    a tensor without a usable partner is coded with, and what DCP chunks are."""
    codec = get_codec(rule.codec)
    if codec is None or not codec.has_partners:
        return rule
    name, params = codec.fallback_spec(rule.params)
    return Rule(rule.pattern, name, dict(params), rule.min_numel)


def rules_as_specs(rules: Sequence[Rule]) -> list[tuple[str, dict[str, Any]]]:
    """Resolved rules as ``(glob, spec)`` pairs that :func:`resolve_rules` takes back."""
    out = []
    for r in rules:
        spec = {"codec": r.codec, **r.params, "min_numel": r.min_numel}
        if r.max_error is not None:
            spec["max_error"] = r.max_error
        out.append((r.pattern, spec))
    return out


def check_rules(rules: Any, *, bits: int, block: int) -> None:
    """Refuse up front what no save could resolve: ``bits`` or ``block`` outside the codec's,
    an unknown preset, a malformed rule or an unknown codec (see :func:`resolve_rules`).

    Raises:
        QuantizationError: naming what is wrong.
    """
    check_params(bits, block)
    resolve_rules(rules, {}, bits=bits, block=block)


def resolve_rules(rules: Any, state: Any, *, bits: int, block: int) -> list[Rule]:
    """The ordered rules in force for ``state``.

    Args:
        rules: ``None`` (the defaults), a preset name, or a sequence of ``(glob, spec)``
            pairs, which are followed by the defaults.
        state: the nested state (to decide what is "under the model").
        bits, block: the call's defaults for quantizing codecs.

    Raises:
        QuantizationError: a malformed rule, unknown codec or preset, or invalid params.
    """
    if rules is None:
        return default_rules(state, bits=bits, block=block)
    if isinstance(rules, str):
        return _preset_rules(rules, state, bits=bits, block=block)
    if not isinstance(rules, Sequence):
        raise QuantizationError(
            f"rules must be None, a preset name or a list of (glob, codec) pairs, got {type(rules).__name__}"
        )
    out = []
    for i, item in enumerate(rules):
        where = f"rule {i}"
        if isinstance(item, str) or not isinstance(item, Sequence) or len(item) != 2:
            raise QuantizationError(f"{where}: expected a (glob, codec spec) pair, got {item!r}")
        out.append(make_rule(item[0], item[1], bits=bits, block=block, where=where))
    return out + default_rules(state, bits=bits, block=block)


def select_rule(rules: Sequence[Rule], path: str, tensor: torch.Tensor) -> Rule:
    """The first rule that matches ``tensor`` at ``path``; exact if none does, and exact
    whatever the rules for a state its optimizer already quantized
    (:func:`tw_triton.lowbit.stored_as_is`)."""
    if stored_as_is(path):
        return Rule("*", "exact")
    for rule in rules:
        codec = get_codec(rule.codec)
        if codec is not None and rule.matches(path, tensor, codec):
            return rule
    return Rule("*", "exact")
