"""A Checkpointer's chain of deltas across a restart: after ``restore``, the next save is a
delta against the restored state where that gives the same bytes as a run that never
stopped, instead of a keyframe.

:func:`seed_chain` runs after a restore: the decoded state is, bit for bit, what the
chain's reference was when that checkpoint was saved (a keyframe's delta-coded tensors are
stored exact; in closed loop each delta's reconstruction is what the next one is coded
against, and the loader decodes the same). It keeps a copy of every entry the chain keeps
as reference (:func:`~tw_triton.deltas.delta_coded`), with the restored file as reference
and the links since its keyframe counted, so ``keyframe_every`` counts across restarts.
Where that would not give the same bytes it logs why, and the next save is a keyframe.
:func:`check_seeded` runs at the first save after: a state that no longer fits the
restored reference starts a keyframe (logged) instead of failing. Why:
docs/training-loop.md ("Restarts").
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

import torch

from . import format as _format
from . import interval_rules
from .checkpoint_dir import CheckpointDirectory, CheckpointInfo
from .deltas import Reference, chain_of, delta_coded, nest
from .errors import CheckpointError
from .reference_chain import ReferenceChain
from .rules import keyframe_rules, resolve_rules, rules_as_specs
from .tree import Flattened, flatten

logger = logging.getLogger(__name__)


def seed_chain(
    chain: ReferenceChain,
    directory: CheckpointDirectory,
    info: CheckpointInfo,
    state: dict[str, Any],
    *,
    rules: Any,
    bits: int,
    block: int,
    host_reference: bool = False,
) -> bool:
    """After restoring ``info`` (decoded as ``state``), continue ``chain`` from it; with
    ``host_reference`` (``reference_device="cpu"``) the kept copy is in host memory.

    The chain's current reference is dropped either way. Not continued, with the reason
    logged: delta mode ``"none"``; a newer checkpoint in the directory (the saves after it
    would replace files of another history); a file that is not a keyframe or a delta; an
    open-loop delta (its reference is its keyframe, not what was restored); a file whose
    rules are not those this Checkpointer codes with; or a chain with no delta left before
    the next keyframe.

    Returns:
        Whether the next save is a delta against the restored state.
    """
    chain.restart()
    try:
        found = directory.scan()
    except (CheckpointError, OSError) as exc:  # the restore itself succeeded: not its failure
        logger.info(
            "restored %s: the next save is a keyframe: the directory cannot be read again: %s", info.path, exc
        )
        return False
    newer = sorted(s for s in found if s > info.step and found[s].by_checkpointer)
    if newer:
        # INFO: a restore to evaluate or inspect an older step is fine; a save before the
        # newer steps is what mixes two runs, and that save warns (retention.abandon).
        logger.info(
            "restored step %d of %s, but step %d is newer: until a save passes step %d, restore() "
            "without a step picks the newer checkpoints again; remove them to abandon that run",
            info.step,
            directory.path,
            newer[-1],
            newer[-1],
        )
    if not chain.delta:
        return False
    try:
        why, since, rules = _why_not(
            chain, directory, found, info, state, rules=rules, bits=bits, block=block
        )
    except (CheckpointError, OSError) as exc:  # the restore itself succeeded: not its failure
        why, since = f"its chain cannot be read again: {exc}", 0
    if why is None and since + 1 >= chain.keyframe_every:
        return False  # the next save is the keyframe it would be anyway
    if why is not None:
        logger.info("restored %s: the next save is a keyframe, not a delta against it: %s", info.path, why)
        return False
    flat, _ = flatten(state)
    kept = delta_coded(flat, resolve_rules(rules, state, bits=bits, block=block))
    copies: dict[int, torch.Tensor] = {}  # tied tensors stay tied
    values = {
        p: copies.setdefault(id(t), t.detach().to("cpu", copy=True) if host_reference else t.detach().clone())
        for p, t in kept.items()
    }
    nbytes = sum(t.numel() * t.element_size() for t in copies.values())
    written: Future = Future()
    written.set_result(info.nbytes)
    chain.reference = Reference(
        info.checkpoint_id,
        info.step,
        nest(values),
        nbytes,
        written,
        closed=chain.mode == "closed",
        owned=True,
    )
    chain.since_keyframe, chain.rules = since, rules
    return True


def _why_not(
    chain: ReferenceChain,
    directory: CheckpointDirectory,
    found: dict[int, CheckpointInfo],
    info: CheckpointInfo,
    state: dict[str, Any],
    *,
    rules: Any,
    bits: int,
    block: int,
) -> tuple[str | None, int, Any]:
    """Why the chain cannot continue from ``info`` (``None``: it can), the deltas since its
    keyframe, and the rules it was coded with (for ``"auto"``, one of its presets)."""
    newest = max((s for s in found if found[s].by_checkpointer), default=info.step)
    if newest > info.step:
        return f"it is not the newest checkpoint here (step {newest} is)", 0, rules
    manifest = _format.read_manifest(info.path, headers=directory.headers)
    meta = manifest.get("metadata") or {}
    kind = meta.get("kind")
    # "auto" codes a save with one of two presets (tw_triton.interval_rules): either fits.
    options = interval_rules.candidates(rules)
    rule_lists = [resolve_rules(r, state, bits=bits, block=block) for r in options]
    if kind == "keyframe":
        expected = [
            resolve_rules(rules_as_specs(keyframe_rules(rule_list)), state, bits=bits, block=block)
            for rule_list in rule_lists
        ]
        since = 0
    elif kind == "delta":
        if chain.mode != "closed" or meta.get("delta_mode") != "closed":
            return "it is an open-loop delta: the next delta is coded against its keyframe", 0, rules
        expected = rule_lists
        try:
            since = len(chain_of(info, {i.checkpoint_id: i for i in found.values()}, directory.path)) - 1
        except CheckpointError as exc:
            return f"its chain is not all here ({exc})", 0, rules
    else:
        return f"it is a {kind or 'file of unknown kind'}, not a keyframe or a delta", 0, rules
    for option, rule_list in zip(options, expected):
        if [r.to_json() for r in rule_list] == manifest.get("rules"):
            return None, since, option
    return "it was coded with other rules than this Checkpointer's (rules, bits or block)", 0, rules


def check_seeded(chain: ReferenceChain, tree: dict[str, Any], *, rules: Any, bits: int, block: int) -> None:
    """Before the first save after :func:`seed_chain`: if the entries of ``tree`` that the
    chain keeps as reference are not those restored (paths, shapes, dtypes, devices), log
    why and make that save a keyframe."""
    ref = chain.reference
    if ref is None:
        return
    flat = Flattened.of(tree).tensors
    wanted = delta_coded(flat, resolve_rules(rules, tree, bits=bits, block=block))
    held, _ = flatten(ref.tree)
    why = None
    if wanted.keys() != held.keys():
        diff = sorted(wanted.keys() ^ held.keys())
        why = f"{len(diff)} entries differ, e.g. {diff[0]!r}"
    else:
        for path, x in wanted.items():
            r = held[path]
            # A reference in host memory (reference_device="cpu") serves a device state.
            elsewhere = r.device != x.device and r.device.type != "cpu"
            if (x.shape, x.dtype) != (r.shape, r.dtype) or elsewhere:
                why = (
                    f"entry {path!r} is {tuple(x.shape)} {x.dtype} on {x.device}, the restored one "
                    f"{tuple(r.shape)} {r.dtype} on {r.device}"
                )
                break
    if why is not None:
        logger.info(
            "the state saved after the restore of step %d does not fit it (%s): this save is a keyframe",
            ref.step,
            why,
        )
        chain.restart()


__all__ = ["check_seeded", "seed_chain"]
