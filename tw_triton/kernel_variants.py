"""The kernel variants a state's first saves launch, and running them ahead of time.

Triton compiles one binary per specialization of a kernel: its ``constexpr`` arguments
(bits, block, rows, whether a reference is added, whether the tile is masked, a grouped
kernel's table bucket ``LOG_T``; not the largest code ``qmax``, a runtime value or a
column of a grouped kernel's table), its
pointers' dtypes and alignment, and whether integer arguments are 1 or multiples of 16.
On a cold cache each costs about a
second, on the thread that launches. Where a device's launches are grouped
(:mod:`tw_triton.state.grouped`), :func:`precompile_saves` runs the first keyframe's and
first delta's encode (and the closed-loop advance's decode) through that path on small
tensors: the saves' groups, member counts, slots and dtypes, each member with a whole
tile and a tail where its tensor has them; entries encoded alone on tensors that launch as
theirs; the ``max_error`` bits choice's grouped statistics before each. Elsewhere :func:`save_variants` lists the single-tensor variants and
:func:`compile_variant` runs each. :meth:`Checkpointer.prepare
<tw_triton.checkpointer.Checkpointer.prepare>` calls it. Why, and what it leaves out
(``max_error`` tensors split across widths): docs/training-loop.md ("The first save").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import delta_bits, ops
from .codecs import ExactCodec, get_codec
from .codecs.bitmask import sparse_candidate
from .delta_bits import WIDER_BITS
from .rules import keyframe_rules, partner_free, resolve_rules, select_rule
from .state import encode as state_encode
from .state.grouped import DeviceEncode, decode_grouped, group_of
from .state.partners import serves_as_partner
from .tree import Flattened

# Elements per program of the row-tiled kernels (kernels/tiles.py TILE_ELEMENTS).
TILE_ELEMENTS = 4096
# Bytes per program of the grouped copy (kernels/copy_grouped.py COPY_BLOCK, one row).
COPY_TILE_BYTES = 4096
# The device type whose tensors the kernels code.
KERNEL_DEVICE_TYPE = "cuda"
# Rule params that select no kernel variant: ``delta`` only decides whether a reference is
# passed, which ``Variant.has_ref`` records.
NOT_KERNEL_PARAMS = ("delta",)


@dataclass(frozen=True)
class Variant:
    """One codec configuration on one dtype at one size class: encoded (and, with
    ``decode``, decoded) it launches the kernels a save of such a tensor launches."""

    codec: str
    params: tuple[tuple[str, Any], ...]  # resolved codec params, sorted, without NOT_KERNEL_PARAMS
    dtype: torch.dtype
    has_ref: bool
    numel: int  # a small length that specializes like the tensor's (representative_numel)
    decode: bool = False  # also decoded against the reference (a closed-loop advance)


def representative_numel(n: int, block: int) -> int:
    """A length of at most 32 tiles whose launches specialize as ``n``'s: the same whole
    tiles or none, the same tail or none, ``n`` and the tail's first row alike modulo 16
    (and 0 or 1 alike)."""
    rows = max(1, TILE_ELEMENTS // block)
    tile = rows * block
    full, tail = divmod(n, tile)
    if full >= 32:
        full = 16 + full % 16  # full * rows stays the same modulo 16, and above 1
    return full * tile + tail


def save_variants(
    state: Any, rules: Any, *, bits: int, block: int, delta_mode: str, device_type: str | None = None
) -> list[Variant]:
    """The kernel variants the first keyframe and the first delta of ``state`` launch, in
    a stable order (each once).

    Args:
        state: the saved state (nested, or :class:`~tw_triton.tree.Flattened`).
        rules, bits, block: how it is coded (as :func:`~tw_triton.rules.resolve_rules`).
        delta_mode: ``"open"``, ``"closed"`` or ``"none"``.
        device_type: only tensors on devices of this type count (default
            :data:`KERNEL_DEVICE_TYPE`: the kernels are theirs).
    """
    device_type = device_type or KERNEL_DEVICE_TYPE
    flat = Flattened.of(state)
    rule_list = resolve_rules(rules, state, bits=bits, block=block)
    key_rules = keyframe_rules(rule_list)
    seen: dict[Variant, None] = {}
    # Entries coded with a partner decode it first (state/partners.py), in every mode.
    partners = set()
    for path, t in flat.tensors.items():
        for rule in (select_rule(key_rules, path, t), select_rule(rule_list, path, t)):
            codec = get_codec(rule.codec)
            if codec is not None and codec.has_partners:
                if _partner_serves(codec, rule, path, t, flat.tensors, (key_rules, rule_list)):
                    partners.add(codec.partner_path(path, rule.params, flat.tensors))
    for path, t in flat.tensors.items():
        if t.device.type != device_type:
            continue
        later = select_rule(rule_list, path, t)
        later_codec = get_codec(later.codec)
        reconstructed = (
            delta_mode != "none" and later_codec is not None and later_codec.uses_reference(later.params)
        )
        for rule, keyframe in ((select_rule(key_rules, path, t), True), (later, False)):
            codec = get_codec(rule.codec)
            dtype = t.dtype
            if codec is not None and codec.has_partners:
                if _partner_serves(codec, rule, path, t, flat.tensors, (key_rules, rule_list)):
                    # u = m / (sqrt(v_hat) + eps), float32 whatever m's dtype, coded blockwise
                    name, inner = codec.inner_spec(rule.params)  # type: ignore[attr-defined]
                    rule, dtype = type(rule)(rule.pattern, name, inner, rule.min_numel), torch.float32
                else:  # as state.partners.plan_partners: the fallback codes m itself
                    rule = partner_free(rule)
                codec = get_codec(rule.codec)
            if codec is None or not getattr(codec, "has_kernel", False):
                continue
            # A keyframe codes without a reference; "none" codes every save so.
            has_ref = not keyframe and delta_mode != "none" and codec.uses_reference(rule.params)
            n = representative_numel(t.numel(), rule.params["block"])
            # A rule with max_error picks the bits from the values (delta_bits.py): every
            # container may be launched (any qmax is fewer levels in a container, whose
            # kernels take qmax as a value: nothing more to compile).
            bits_options = [rule.params.get("bits")]
            if not keyframe and rule.max_error is not None:
                bits_options += [b for b in WIDER_BITS if b > rule.params["bits"]]
            for b in bits_options:
                chosen = rule.params if b == rule.params.get("bits") else {**rule.params, "bits": b}
                params = tuple(sorted((k, v) for k, v in chosen.items() if k not in NOT_KERNEL_PARAMS))
                # A closed loop decodes its deltas; a keyframe's lossy entries of tensors
                # the deltas are coded against are decoded as their reference.
                decode = has_ref and delta_mode == "closed" or keyframe and reconstructed or path in partners
                variant = Variant(rule.codec, params, dtype, has_ref, n, decode)
                seen.setdefault(variant, None)
    return list(seen)


def _partner_serves(
    codec: Any, rule: Any, path: str, t: torch.Tensor, tensors: dict, rule_sets: tuple
) -> bool:
    """Whether the save codes ``path`` with its partner, as
    :func:`~tw_triton.state.partners.plan_partners` decides: one of ``t``'s shape as
    float32, not itself coded with a partner under either of ``rule_sets``."""
    found = codec.partner_path(path, rule.params, tensors)
    v = tensors.get(found) if found is not None else None
    if v is None or found == path:
        return False
    return all(serves_as_partner(t, v, get_codec(select_rule(rs, found, v).codec)) for rs in rule_sets)


def compile_variant(variant: Variant, device: torch.device) -> None:
    """Launch ``variant``'s kernels on ``device`` once (compiling them, or loading them
    from the disk cache): an encode of a tensor of its length, and its decode if the
    saves decode it."""
    codec = get_codec(variant.codec)
    params = dict(variant.params)
    resolved = codec.resolve_params(params, bits=params["bits"], block=params["block"])
    if variant.has_ref:
        resolved = {**resolved, "delta": True}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(variant.numel, generator=gen).to(variant.dtype).to(device)
    ref = (x * 0.5).contiguous() if variant.has_ref else None
    enc = codec.encode(x, resolved, ref)
    if variant.decode:
        codec.decode(enc.entry, ref, device, f"precompile {variant.codec}")


def precompile(variants: list[Variant], device: torch.device) -> int:
    """Run :func:`compile_variant` of each of ``variants``; returns how many ran."""
    for variant in variants:
        compile_variant(variant, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(variants)


def grouped_numel(n: int, tile: int) -> int:
    """A length whose part in a grouped launch specializes as ``n``'s: a whole tile if ``n``
    has any (the whole-tile launch), and ``n``'s tail (the masked launch). Every other
    specialization of a grouped kernel (the table bucket ``LOG_T``, the count of rows,
    the flag slots) is the group's, not the tensor's."""
    full, tail = divmod(n, tile)
    return min(full, 1) * tile + tail


def _small(x: torch.Tensor, rule: Any, codec: Any, grouped: bool) -> torch.Tensor:
    """A small tensor on ``x``'s device and of its dtype that launches as ``x`` does."""
    n = x.numel()
    if grouped and isinstance(codec, ExactCodec):
        tile = COPY_TILE_BYTES // x.element_size()
        n = grouped_numel(n, tile)
    elif grouped:
        block = rule.params["block"]
        n = grouped_numel(n, max(1, TILE_ELEMENTS // block) * block)
    else:  # the single-tensor kernels tile by block (bitmask: by TILE_ELEMENTS)
        n = representative_numel(n, rule.params.get("block", TILE_ELEMENTS))
    gen = torch.Generator().manual_seed(n)
    if not x.is_floating_point():
        return torch.ones(n, dtype=x.dtype, device=x.device)
    small = (torch.rand(n + 1, generator=gen) + 0.5).to(x.dtype).to(x.device)
    # A sparse candidate that the grouped count cannot read in place (contiguous and
    # 16-byte aligned, kernels/tiles.py) is counted alone: its small tensor is not either.
    if isinstance(codec, ExactCodec) and sparse_candidate(x) and not aligned(x):
        return small[1:]
    return small[:n]


def _with_bits(rule: Any, bits: int) -> Any:
    return type(rule)(rule.pattern, rule.codec, {**rule.params, "bits": bits}, rule.min_numel, rule.max_error)


def _kept(job: tuple, copy: bool) -> bool:
    """Whether the device encode leaves ``job`` out of the groups, as
    :func:`~tw_triton.state.quantize_state_dict` does: a sparse candidate (decided after
    the sync) or, with ``copy`` off, a contiguous exact entry (kept as it is)."""
    x, _, codec, _ = job
    return isinstance(codec, ExactCodec) and (sparse_candidate(x) or (not copy and x.is_contiguous()))


def _encode_as_saved(jobs: list[tuple], small: list[tuple], copy: bool) -> list[Any]:
    """The device encode :func:`~tw_triton.state.quantize_state_dict` runs for ``jobs``
    (the state's), on ``small`` (their small tensors and references, in the same order):
    the same groups, member counts and slots; entries it encodes alone, alone. The sparse
    candidates are coded by the bitmask codec in one grouped encode, as the save codes
    those that pay (half their elements zeroed in place)."""

    def alone(i: int) -> Any:
        x, rule, codec, ref = small[i]
        if _kept(jobs[i], copy):
            return None
        enc = codec.encode(x, rule.params, ref)
        enc.entry.codec = rule.codec
        return enc

    # The small jobs group as the state's (group keys see devices, codecs, params and
    # whether a reference is given): the same groups, member counts and slots; the sparse
    # candidates are counted in one grouped op, as the save counts them.
    counted = [
        i for i, (x, _, codec, _) in enumerate(jobs) if isinstance(codec, ExactCodec) and sparse_candidate(x)
    ]
    encoded = DeviceEncode(small, alone, lambda i: _kept(jobs[i], copy), counted).run()[0]
    if copy:
        _dense_copies([small[i][0] for i in counted])
    if counted:
        # In place: a copy would be aligned where the state's tensor is not.
        xs = [small[i][0] for i in counted]
        for x in xs:
            x[::2] = 0
        encs = get_codec("bitmask").encode_counted_many(xs, [x.numel() - x[::2].numel() for x in xs])
        for i, enc in zip(counted, encs):
            encoded[i] = enc
        _sparse_encodes([x for x in xs if aligned(x)])
    return encoded


def _dense_copies(candidates: list[torch.Tensor]) -> None:
    """The grouped copy a save makes after its host read of the sparse candidates that are
    not sparse (with ``copy``): which those are depends on the values, so one copy for each
    count of them that launches differently (its table's rows being 1 or a multiple of
    16, and the binary search's steps), whole tiles and tails apart."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for x in candidates:
        by_device.setdefault(x.device, []).append(x)
    for device, xs in by_device.items():
        nbytes = [x.numel() * x.element_size() for x in xs]
        whole = sum(n >= COPY_TILE_BYTES for n in nbytes)
        tails = sum(n % COPY_TILE_BYTES != 0 for n in nbytes)
        for count, size in ((whole, COPY_TILE_BYTES), (tails, 16)):
            keys = {(r == 1, r % 16 == 0, (r - 1).bit_length()): r for r in range(1, count + 1)}
            x = torch.zeros(size, dtype=torch.uint8, device=device)
            for r in keys.values():
                ops.copy_many([x] * r)


def _sparse_encodes(candidates: list[torch.Tensor]) -> None:
    """The grouped bitmask encode a save runs after its host read on the sparse candidates
    that pay (those it reads in place): which pay depends on the values, so, per device and
    element width, one encode for each count of them that launches differently (as
    :func:`_dense_copies`), whole tiles and tails apart."""
    groups: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
    for x in candidates:
        groups.setdefault((x.device, x.element_size()), []).append(x)
    for (device, _), xs in groups.items():
        whole = sum(x.numel() >= TILE_ELEMENTS for x in xs)
        tails = sum(x.numel() % TILE_ELEMENTS != 0 for x in xs)
        for count, size in ((whole, TILE_ELEMENTS), (tails, 16)):
            keys = {(r == 1, r % 16 == 0, (r - 1).bit_length()): r for r in range(1, count + 1)}
            x = torch.ones(size, dtype=xs[0].dtype, device=device)
            x[::2] = 0
            for r in keys.values():
                ops.bitmask_encode_many([x] * r, [size // 2] * r)


def aligned(x: torch.Tensor) -> bool:
    """Whether the grouped kernels read ``x`` in place (contiguous, 16-byte aligned)."""
    return x.is_contiguous() and x.data_ptr() % 16 == 0


def precompile_saves(
    state: Any, rules: Any, *, bits: int, block: int, delta_mode: str, device: torch.device, copy: bool
) -> int:
    """Run the device encodes of the first keyframe and delta of ``state`` (and the
    closed-loop advance's decode) on small tensors that launch as the state's do, where
    the launches are grouped (:mod:`tw_triton.state.grouped`); else
    :func:`precompile` of :func:`save_variants`. Returns how many encodes ran.

    Args:
        state, rules, bits, block, delta_mode: as :func:`save_variants`.
        device: the kernels' device (:func:`kernel_device`).
        copy: whether the saves copy exact entries (a device state's are kept as they are).
    """
    if not state_encode.groups_launches(device):
        variants = save_variants(state, rules, bits=bits, block=block, delta_mode=delta_mode)
        return precompile(variants, device)
    flat = Flattened.of(state)
    rule_list = resolve_rules(rules, state, bits=bits, block=block)
    seen: set = set()
    paths = []
    for path, t in flat.tensors.items():  # tied tensors are encoded once, as in a save
        key = state_encode.storage_key(t)
        if key is None or key not in seen:
            seen.add(key)
            paths.append(path)
    # A rule with max_error codes each tensor in one of its candidate containers: one pass
    # of the first delta each, every such tensor in it (docs/training-loop.md; the levels
    # in a container, qmax, are a column of the grouped kernel's table: one group whatever
    # the qmax its tensors take).
    widths = [None] + [b for b in WIDER_BITS if any(r.max_error is not None for r in rule_list)]
    passes = [(keyframe_rules(rule_list), False, None)]
    passes += [(rule_list, delta_mode != "none", b) for b in widths]
    for rule_set, deltas, width in passes:
        jobs, small = [], []
        for path in paths:
            t = flat.tensors[path]
            rule = partner_free(select_rule(rule_set, path, t))  # the same blockwise launches
            if width is not None and rule.max_error is not None and width > rule.params["bits"]:
                rule = _with_bits(rule, width)
            codec = get_codec(rule.codec)
            has_ref = deltas and codec.uses_reference(rule.params)
            jobs.append((t, rule, codec, t if has_ref else None))
            x = _small(t, rule, codec, group_of(jobs[-1]) is not None and not _kept(jobs[-1], copy))
            small.append((x, rule, codec, (x * 0.5).to(x.dtype) if has_ref else None))
        if width is None:  # a rule with max_error: the bits choice's grouped statistics
            delta_bits.adapt(small, grouped=state_encode.groups_launches)
        encoded = _encode_as_saved(jobs, small, copy)
        _partnered_as_saved(paths, [select_rule(rule_set, p, flat.tensors[p]) for p in paths], small, encoded)
        if deltas and delta_mode == "closed":
            _advance_as_saved(small, encoded)
        elif rule_set is not rule_list and delta_mode != "none":
            # The deltas' reference is the keyframe's reconstruction: its lossy entries of
            # delta-coded tensors are decoded, grouped (deltas.keyframe_values).
            _keyframe_values_as_saved(rule_list, flat, paths, small, encoded)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(passes)


def _partnered_as_saved(paths: list[str], rules: list[Any], small: list[tuple], encoded: list[Any]) -> None:
    """Phase two of a device encode (:func:`~tw_triton.state.partners.encode_grouped`) on
    the small tensors: the partners' grouped decode, then one grouped encode with partners
    per codec, params and dtype (against a stand-in ``v_hat`` of each tensor's size)."""
    index = {p: i for i, p in enumerate(paths)}
    pairs = []
    for i, (path, rule) in enumerate(zip(paths, rules)):
        codec = get_codec(rule.codec)
        if not codec.has_partners:
            continue
        j = index.get(codec.partner_path(path, rule.params, index))  # type: ignore[arg-type]
        if j is not None and j != i and encoded[j] is not None and small[j][0].dtype == torch.float32:
            pairs.append((i, j))
    if not pairs:
        return
    items = []
    for _, j in pairs:
        entry, ref = encoded[j].entry, small[j][3]
        uses = get_codec(entry.codec).uses_reference(entry.params)
        items.append((entry, ref if uses else None, small[j][0].device, "precompile"))
    decode_grouped(items, lambda k: get_codec(items[k][0].codec).decode(*items[k]))
    groups: dict[Any, list[int]] = {}
    for i, _ in pairs:
        x, rule = small[i][0], rules[i]
        groups.setdefault((x.device, rule.codec, repr(sorted(rule.params.items())), x.dtype), []).append(i)
    for (device, name, _, _), members in groups.items():
        codec = get_codec(name)
        xs = [small[i][0] for i in members]
        flags = torch.zeros(len(xs), dtype=torch.int64, device=device)
        v_hats = [torch.ones(x.shape, dtype=torch.float32, device=device) for x in xs]
        codec.encode_group_with_partners(xs, rules[members[0]].params, ["partner"] * len(xs), v_hats, flags)


def _keyframe_values_as_saved(
    rule_list: Any, flat: Flattened, paths: list, small: list, encoded: list
) -> None:
    """The decode of a keyframe's lossy entries of delta-coded tensors to the deltas'
    reference (:func:`~tw_triton.deltas.keyframe_values`), on ``small``."""
    items = []
    for path, (x, _, _, _), enc in zip(paths, small, encoded):
        later = select_rule(rule_list, path, flat.tensors[path])
        delta_coded = get_codec(later.codec).uses_reference(later.params)
        if enc is not None and delta_coded and enc.entry.codec != "exact":
            items.append((enc.entry, None, x.device, "precompile"))

    def alone(i: int) -> torch.Tensor:
        entry, _, device, context = items[i]
        return get_codec(entry.codec).decode(entry, None, device, context)  # type: ignore[union-attr]

    decode_grouped(items, alone)


def _advance_as_saved(small: list[tuple], encoded: list[Any]) -> None:
    """The closed-loop advance's decode of the delta-coded entries of ``small``."""
    items, codecs = [], []
    for (x, rule, codec, ref), enc in zip(small, encoded):
        if ref is not None and enc is not None:
            enc.entry.codec = rule.codec
            items.append((enc.entry, ref, x.device, f"precompile {rule.codec}"))
            codecs.append(codec)

    def alone(i: int) -> torch.Tensor:
        entry, ref, device, context = items[i]
        uses = codecs[i].uses_reference(entry.params)
        return codecs[i].decode(entry, ref if uses else None, device, context)

    # Into the references, as the advance decodes (deltas.advance).
    decode_grouped(items, alone, [ref for _, ref, _, _ in items])


def kernel_device(tensors: Any) -> torch.device | None:
    """The first device of ``tensors`` whose type the kernels code, or ``None``."""
    return next((t.device for t in tensors if t.device.type == KERNEL_DEVICE_TYPE), None)


__all__ = [
    "KERNEL_DEVICE_TYPE",
    "Variant",
    "kernel_device",
    "compile_variant",
    "grouped_numel",
    "precompile",
    "precompile_saves",
    "representative_numel",
    "save_variants",
]
