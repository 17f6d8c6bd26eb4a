"""What each optimizer state tensor *is*, by its name: the role the moment presets code by.

An optimizer's per-parameter state (``optimizer/state/<param>/<name>`` in a flattened
training state) holds tensors of three kinds, whatever the optimizer calls them:

``"signed"``
    signed running averages, first-moment-like (``exp_avg``, ``momentum_buffer``,
    RMSprop's centered ``grad_avg``): blockwise codes without a reference, as ``exp_avg``.
``"non-negative"``
    non-negative running averages, second-moment-like (``exp_avg_sq``, ``square_avg``,
    Adagrad's ``sum``, Adafactor's ``row_var``/``col_var``, ...): the ``log2`` codec, which
    never decodes a value negative, nor zero where it was not. A tensor of this role that
    holds a negative value cannot be coded so and is stored exact, logged (the codec's own
    check, at save time).
``"exact"``
    everything else: step counters, products and learning rates (``step``, ``mu_product``,
    ``eta``), state where a coding error changes the trajectory outright (Rprop's ``prev``,
    whose sign picks the step, and ``step_size``, the step itself; ASGD's averaged weights
    ``ax``), and L-BFGS's history.

:data:`OPTIMIZER_STATES` lists the state of every optimizer of ``torch.optim``; a name not in
it is stored exact, and a moment preset logs it once per name (per process), so that a new
optimizer's state is never coded by a guess.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .tree import Flattened

SIGNED = "signed"
NON_NEGATIVE = "non-negative"
EXACT = "exact"
logger = logging.getLogger(__name__)

_LBFGS = (
    "func_evals",
    "n_iter",
    "d",
    "t",
    "old_dirs",
    "old_stps",
    "ro",
    "H_diag",
    "prev_flat_grad",
    "prev_loss",
    "al",
)
# The per-parameter state of every optimizer in torch.optim (torch 2.13), by role.
OPTIMIZER_STATES: dict[str, dict[str, str]] = {
    "Adam": {"step": EXACT, "exp_avg": SIGNED, "exp_avg_sq": NON_NEGATIVE, "max_exp_avg_sq": NON_NEGATIVE},
    "AdamW": {"step": EXACT, "exp_avg": SIGNED, "exp_avg_sq": NON_NEGATIVE, "max_exp_avg_sq": NON_NEGATIVE},
    "SparseAdam": {"step": EXACT, "exp_avg": SIGNED, "exp_avg_sq": NON_NEGATIVE},
    "NAdam": {"step": EXACT, "mu_product": EXACT, "exp_avg": SIGNED, "exp_avg_sq": NON_NEGATIVE},
    "RAdam": {"step": EXACT, "exp_avg": SIGNED, "exp_avg_sq": NON_NEGATIVE},
    "Adamax": {"step": EXACT, "exp_avg": SIGNED, "exp_inf": NON_NEGATIVE},
    "SGD": {"momentum_buffer": SIGNED},
    "Muon": {"momentum_buffer": SIGNED},
    "RMSprop": {"step": EXACT, "square_avg": NON_NEGATIVE, "momentum_buffer": SIGNED, "grad_avg": SIGNED},
    "Adagrad": {"step": EXACT, "sum": NON_NEGATIVE},
    "Adadelta": {"step": EXACT, "square_avg": NON_NEGATIVE, "acc_delta": NON_NEGATIVE},
    "Adafactor": {"step": EXACT, "row_var": NON_NEGATIVE, "col_var": NON_NEGATIVE, "variance": NON_NEGATIVE},
    "ASGD": {"step": EXACT, "eta": EXACT, "mu": EXACT, "ax": EXACT},
    "Rprop": {"step": EXACT, "prev": EXACT, "step_size": EXACT},
    "LBFGS": dict.fromkeys(_LBFGS, EXACT),
}
# One role per name: no two optimizers above disagree on a name.
STATE_ROLES: dict[str, str] = {
    name: role for table in OPTIMIZER_STATES.values() for name, role in table.items()
}
# Names whose preset globs predate the roles (``*exp_avg``, ``*exp_avg_sq``, which also covers
# ``max_exp_avg_sq``): kept as they were, so that AdamW's files record the same rules.
LEGACY_GLOBS = {SIGNED: ["*exp_avg"], NON_NEGATIVE: ["*exp_avg_sq"]}
_LEGACY_NAMES = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
_logged_unknown: set[str] = set()


def role_of(name: str) -> str | None:
    """The role of optimizer state ``name`` (:data:`SIGNED`, :data:`NON_NEGATIVE`,
    :data:`EXACT`), or ``None`` for a name of no optimizer in :data:`OPTIMIZER_STATES`."""
    return STATE_ROLES.get(name)


def role_globs(role: str) -> list[str]:
    """Globs of the flattened paths of the optimizer state of ``role``: the legacy globs,
    then ``*/state/*/<name>`` for each other name: per-parameter state as ``torch.optim``,
    DCP and Lightning lay it out, and never a model tensor (``model/layer.sum``, or a root
    buffer ``model/variance``)."""
    names = sorted(n for n, r in STATE_ROLES.items() if r == role and n not in _LEGACY_NAMES)
    return LEGACY_GLOBS.get(role, []) + [f"*/state/*/{n}" for n in names]


def optimizer_state_names(state: Any, optimizer_keys: tuple[str, ...]) -> set[str]:
    """The names of the tensors of per-parameter optimizer state in ``state`` (nested, or
    :class:`~tw_triton.tree.Flattened`): ``<key>/state/<param>/<name>`` for ``key`` in
    ``optimizer_keys``."""
    if isinstance(state, Flattened):
        names = set()
        for path in state.tensors:
            parts = path.split("/")
            if len(parts) >= 4 and parts[0] in optimizer_keys and parts[1] == "state":
                names.add(parts[3])
        return names
    names = set()
    if not isinstance(state, dict):
        return names
    for key in optimizer_keys:
        per_param = state.get(key, {}).get("state") if isinstance(state.get(key), dict) else None
        if not isinstance(per_param, dict):
            continue
        for entry in per_param.values():
            if isinstance(entry, dict):
                names.update(str(n) for n, v in entry.items() if _holds_tensor(v))
    return names


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    return False


def log_unknown(state: Any, optimizer_keys: tuple[str, ...]) -> list[str]:
    """Log, once per name and process, the optimizer state names of ``state`` that have no
    role (they stay exact); return the names logged now."""
    new = sorted(optimizer_state_names(state, optimizer_keys) - STATE_ROLES.keys() - _logged_unknown)
    for name in new:
        _logged_unknown.add(name)
        logger.warning(
            "optimizer state %r has no role in tw_triton.roles (no optimizer of torch.optim names "
            "it): stored exact",
            name,
        )
    return new
