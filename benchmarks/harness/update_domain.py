"""``exp_avg`` coded in the update's domain, simulated in the restart experiment.

Adam's step is ``m / (sqrt(v) + eps)``. A decoder that reconstructs ``v`` first could code
``u = m / (sqrt(v_hat) + eps)`` instead of ``m`` and decode ``m_hat = u_hat * (sqrt(v_hat) +
eps)``: blockwise scales then follow the step, not the raw moment. The ``-u`` settings
simulate this (they predate the codec ``blockwise-update``, which does it), against today's
blockwise codes of ``m`` at the same bits.

How the simulation stays faithful: the setting's Checkpointer stores ``exp_avg`` exact and
everything else as ``smallest`` does. After every save the harness loads the file back
(``v_hat``: what a loader reconstructs, the exact value the encoder would divide by), codes
``u`` with the same blockwise codec and entropy stage through a real file, and counts those
bytes instead of the exact ``exp_avg``'s. After every restore it replaces each restored
(exact) ``exp_avg`` by ``u_hat * (sqrt(v_hat) + eps)``, the values such a decoder returns.
Tensors under the rules' ``min_numel`` stay exact, as in ``smallest``.

``smallest-U4`` and ``smallest-U3`` are the same through the real codec ``blockwise-update``
(the files hold the codes of ``u``; nothing is simulated): with the optimizer's default
``eps`` they write the simulation's codes and restore its values.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

import tw_triton
from tw_triton.codecs.blockwise_update import denominator
from tw_triton.rules import resolve_rules, rules_as_specs

MIN_NUMEL = 4096
# setting name -> (domain, codec spec for exp_avg or for u)
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    # exp_avg blockwise at int4 without a reference: ``smallest`` before it took the update's domain.
    "smallest-m4": ("moment", {"codec": "int4", "block": 128, "delta": False, "min_numel": MIN_NUMEL}),
    "smallest-m3": ("moment", {"codec": "int3", "block": 128, "delta": False, "min_numel": MIN_NUMEL}),
    "smallest-u4": ("update", {"codec": "int4", "block": 128, "delta": False, "min_numel": MIN_NUMEL}),
    "smallest-u3": ("update", {"codec": "int3", "block": 128, "delta": False, "min_numel": MIN_NUMEL}),
    # The real codec (tw_triton.codecs.blockwise_update): the files hold the codes of u.
    "smallest-U4": ("codec", {"codec": "blockwise-update", "bits": 4, "block": 128, "min_numel": MIN_NUMEL}),
    "smallest-U3": ("codec", {"codec": "blockwise-update", "bits": 3, "block": 128, "min_numel": MIN_NUMEL}),
}


def _template() -> dict[str, Any]:
    z = torch.zeros(64, 64)
    return {"model": {"w": z}, "optimizer": {"state": {0: {"exp_avg": z, "exp_avg_sq": z}}}}


def rules(name: str) -> list[Any]:
    """``smallest``'s rules with ``exp_avg`` coded as ``name`` says (exact for the simulated
    update domain)."""
    domain, spec = SETTINGS[name]
    first = {"codec": "exact"} if domain == "update" else spec
    return [("*exp_avg", first), *rules_as_specs(resolve_rules("smallest", _template(), bits=8, block=128))]


def _moments(optimizer_state: dict[Any, Any], eps: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{key: (m, sqrt(v) + eps)}`` of the entries large enough to be coded."""
    out = {}
    for key, st in optimizer_state.items():
        m, v = st.get("exp_avg"), st.get("exp_avg_sq")
        if isinstance(m, torch.Tensor) and isinstance(v, torch.Tensor) and m.numel() >= MIN_NUMEL:
            out[str(key)] = (m.float(), denominator(v, eps))  # the codec's: a correctly rounded sqrt
    return out


def _entry_bytes(manifest: dict[str, Any], paths: set[str] | None = None) -> int:
    """Stored bytes of a file's entries (those in ``paths``, or all)."""
    return sum(
        b["data_offsets"][1] - b["data_offsets"][0]
        for p, e in manifest["entries"].items()
        if paths is None or p in paths
        for b in e["buffers"].values()
    )


def _code(
    u: dict[str, torch.Tensor], spec: dict[str, Any], workdir: Path
) -> tuple[dict[str, torch.Tensor], int]:
    """Code ``u`` through a real file with ``spec``; its decoded values and coded bytes."""
    if not u:
        return {}, 0
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        path = Path(tmp) / "u.tw"
        tw_triton.save(tw_triton.quantize_state_dict(u, rules=[("*", spec)]), path, fsync=False)
        return tw_triton.load(path), _entry_bytes(tw_triton.format.read_manifest(path))


def _eps(optimizer: Any) -> float:
    eps = {g.get("eps", 1e-8) for g in optimizer["param_groups"]}
    if len(eps) != 1:
        raise ValueError(f"the update-domain simulation needs one eps for all groups, got {sorted(eps)}")
    return float(eps.pop())


def file_split(
    split: dict[str, Any], path: Path, loaded: dict[str, Any], name: str, workdir: Path
) -> dict[str, Any]:
    """A file's byte split with its exact ``exp_avg`` replaced by the coded ``u``'s bytes.

    Args:
        split: the file's :func:`harness.settings.stored_split`.
        path: the file.
        loaded: the file loaded back (``Checkpointer.load``).
        name: the setting (a key of :data:`SETTINGS`; only the update domain changes it).
        workdir: where temporary files go.
    """
    if SETTINGS[name][0] != "update":
        return split
    opt = loaded["optimizer"]
    moments = _moments(opt["state"], _eps(opt))
    _, coded = _code({k: m / d for k, (m, d) in moments.items()}, SETTINGS[name][1], workdir)
    manifest = tw_triton.format.read_manifest(path)
    exact = _entry_bytes(manifest, {f"optimizer/state/{k}/exp_avg" for k in moments})
    if len(moments) and not exact:
        raise AssertionError(f"{path}: no exact exp_avg entries found for {sorted(moments)[:3]}...")
    out = dict(split)
    out["exp_avg"] = split["exp_avg"] - exact + coded
    out["total"] = split["total"] - exact + coded
    return out


def apply_on_restore(optimizer: torch.optim.Optimizer, name: str, workdir: Path) -> None:
    """Replace a just-restored optimizer's exact ``exp_avg`` by the update-domain decode."""
    if SETTINGS[name][0] != "update":
        return
    sd = optimizer.state_dict()
    moments = _moments(sd["state"], _eps(sd))
    decoded, _ = _code({k: m / d for k, (m, d) in moments.items()}, SETTINGS[name][1], workdir)
    state_by_key = {str(k): st for k, st in sd["state"].items()}
    with torch.no_grad():
        for key, (_, d) in moments.items():
            m = state_by_key[key]["exp_avg"]
            m.copy_((decoded[key].float() * d).to(m.dtype))
