"""The restart experiment of ``resume_fidelity.py`` (both its models: tiny GPT and MiniLM).

Per seed, three kinds of run train the same model from the same initial state:

* the **uninterrupted** run: ``steps`` steps, no checkpoint;
* the **noise floor**: the same, with another data-order seed (same initial weights). How far
  its held-out loss lands from the uninterrupted run's is what an innocent change of the run
  does; a checkpoint setting is judged as a multiple of it;
* per setting, the **restarted** run, as a preemptible job lives: a
  :class:`tw_triton.Checkpointer` saves every ``save_every`` steps; at each restart point the
  process "dies" (model, optimizer, scheduler and Checkpointer are dropped), a fresh one is
  built in the initial state, a new Checkpointer on the same directory restores the latest
  checkpoint (a keyframe or a delta) into it, and training goes on. A batch is a function of
  (data-order seed, step), so the data order survives restarts.

Restart points alternate between ``keyframe_every`` and ``keyframe_every + 1`` saves after
the previous one (``restart_every`` and one more where the run sets it; after every save
where that is 1). A restarted Checkpointer used to write a keyframe first, so that the first
kind of restart loaded the delta farthest from its keyframe (the worst case for open-loop
deltas) and the second a keyframe. Since a restored chain continues (docs/training-loop.md,
"Restarts": keyframes stay every ``keyframe_every`` saves, counted across restarts), where a
restart lands in the chain follows from that count instead.

Measured: the held-out loss every ``eval_every`` steps and at the end (same fixed batches in
every run), the training loss of every step, and every file the Checkpointer wrote (bytes
per part from its manifest). The ``exact`` preset must reproduce the uninterrupted run bit
for bit through all its restarts, or :func:`check_exact` raises.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from harness import update_domain
from harness.common import fmt_table, log, median
from harness.settings import DEFAULT_KEYFRAME_EVERY, PARTS, ResumeSetting, stored_split
from tw_triton.checkpointer import capture_rng_state


class Run(Protocol):
    """A training run the experiment can drive, kill and restore."""

    step: int

    def train_step(self) -> float:
        """One optimizer step on the batch of ``self.step``; returns its loss."""

    def eval_loss(self) -> float:
        """Loss on fixed held-out batches; must not touch the RNG that training uses."""

    def objects(self) -> dict[str, Any]:
        """What a checkpoint holds, by name (``model`` first): objects with ``state_dict()``."""


# make_run(data_seed) -> a fresh run in its initial state (the initial weights do not depend
# on data_seed).
MakeRun = Callable[[int], Run]


@dataclass(frozen=True)
class Plan:
    """Length of the runs and when they save, evaluate and restart."""

    steps: int
    save_every: int
    eval_every: int
    min_restarts: int = 8
    # Saves between restarts (alternately n and n + 1; 1: after every save); None: the
    # setting's keyframe_every. Long save intervals restart every few saves so that 8
    # restarts fit in a run of thousands of steps rather than tens of thousands.
    restart_every: int | None = None

    def restart_steps(self, keyframe_every: int) -> list[int]:
        """Steps after which the run is killed and restored (see the module doc)."""
        n = self.restart_every or keyframe_every
        out, step, i = [], 0, 0
        while True:
            step += (n + (i % 2 if n > 1 else 0)) * self.save_every
            if step >= self.steps:
                return out
            out.append(step)
            i += 1

    def eval_steps(self) -> list[int]:
        """Steps after which the held-out loss is measured (always the last one)."""
        return sorted({*range(self.eval_every, self.steps + 1, self.eval_every), self.steps})


def uninterrupted(make_run: MakeRun, data_seed: int, plan: Plan) -> dict[str, Any]:
    """Train ``plan.steps`` steps without a checkpoint; the per-step and held-out losses."""
    run = make_run(data_seed)
    evals_at = set(plan.eval_steps())
    losses, evals = [], {}
    while run.step < plan.steps:
        losses.append(run.train_step())
        if run.step in evals_at:
            evals[run.step] = run.eval_loss()
    return {"data_seed": data_seed, "losses": losses, "evals": evals}


# Steps of a reused uninterrupted run that are trained again and must match bit for bit.
REUSE_CHECK_STEPS = 20


def reused(make_run: MakeRun, stored: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """An uninterrupted run read back from an earlier result (``stored``), once its first
    :data:`REUSE_CHECK_STEPS` training losses are reproduced bit for bit; held-out steps as ints.

    Raises:
        ValueError: the run does not reproduce (other code, data or machine), or does not
            cover ``plan``.
    """
    evals = {int(k): v for k, v in stored["evals"].items()}
    if len(stored["losses"]) != plan.steps or set(evals) != set(plan.eval_steps()):
        raise ValueError(f"the stored run of data seed {stored['data_seed']} does not cover this plan")
    run = make_run(stored["data_seed"])
    n = min(REUSE_CHECK_STEPS, plan.steps)
    again = [run.train_step() for _ in range(n)]
    if again != stored["losses"][:n]:
        raise ValueError(
            f"the stored run of data seed {stored['data_seed']} does not reproduce here "
            f"(first {n} losses differ): run it again without --reuse-baselines"
        )
    return {"data_seed": stored["data_seed"], "losses": list(stored["losses"]), "evals": evals}


def _moment_damage(run: Run) -> dict[str, int]:
    """Negative and non-finite ``exp_avg_sq`` values in a just-restored optimizer."""
    neg = nonfinite = 0
    opt = run.objects().get("optimizer")
    for st in getattr(opt, "state", {}).values():
        v = st.get("exp_avg_sq") if isinstance(st, dict) else None
        if isinstance(v, torch.Tensor):
            neg += int((v < 0).sum())
            nonfinite += int((~torch.isfinite(v)).sum())
    return {"negative_exp_avg_sq": neg, "nonfinite_exp_avg_sq": nonfinite}


def _torch_save_bytes(run: Run, step: int, path: Path) -> int:
    """Size of ``torch.save`` of what the Checkpointer stores (step, objects, RNG states)."""
    tree = {"step": step, **{k: o.state_dict() for k, o in run.objects().items()}, "rng": capture_rng_state()}
    torch.save(tree, path)
    size = path.stat().st_size
    path.unlink()
    return size


def restarted(
    make_run: MakeRun, data_seed: int, setting: ResumeSetting, plan: Plan, workdir: Path
) -> dict[str, Any]:
    """Train with ``setting``'s Checkpointer, killed and restored at every restart point."""
    directory = workdir / "ckpt"
    restarts_at = set(plan.restart_steps(setting.keyframe_every))
    evals_at = set(plan.eval_steps())
    run = make_run(data_seed)
    ckpt = setting.checkpointer(directory)
    losses, evals, files, restarts = [], {}, [], []
    torch_bytes = None
    damage = {"negative_exp_avg_sq": 0, "nonfinite_exp_avg_sq": 0}
    try:
        while run.step < plan.steps:
            losses.append(run.train_step())
            step = run.step
            if step in evals_at:
                evals[step] = run.eval_loss()
            if step % plan.save_every:
                continue
            ckpt.save(step, **run.objects())
            path = Path(ckpt.path_for(step))
            split = stored_split(path)
            if setting.exp_avg_domain:
                split = update_domain.file_split(
                    split, path, ckpt.load(step), setting.exp_avg_domain, workdir
                )
            files.append(split)
            if torch_bytes is None:
                torch_bytes = _torch_save_bytes(run, step, workdir / "state.pt")
            if step not in restarts_at:
                continue
            # The process dies here; a new one rebuilds everything and restores.
            ckpt.close()
            del run, ckpt
            run = make_run(data_seed)
            ckpt = setting.checkpointer(directory)
            newest = ckpt.infos()[-1]
            state = ckpt.restore(**run.objects())
            if state["step"] != step or newest.step != step:
                raise AssertionError(
                    f"{setting.label}: restored step {state['step']} (newest file "
                    f"{newest.step}) at the restart after step {step}"
                )
            run.step = step
            if setting.exp_avg_domain:
                update_domain.apply_on_restore(run.objects()["optimizer"], setting.exp_avg_domain, workdir)
            found = _moment_damage(run)
            damage = {k: max(damage[k], found[k]) for k in damage}
            restarts.append({"step": step, "kind": newest.kind})
    finally:
        ckpt.close()
    return {
        "losses": losses,
        "evals": evals,
        "files": files_by_kind(files),
        "restarts": restarts,
        "torch_save_bytes": torch_bytes,
        **damage,
    }


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if math.isfinite(a) else math.inf


def deviations(curve: dict[str, Any], base: dict[str, Any], first_restart: int) -> dict[str, float]:
    """How far a run lands from the uninterrupted one, after ``first_restart``.

    ``final``: relative deviation of the last held-out loss. ``curve``: the largest relative
    deviation of the held-out loss at the evaluation steps after the first restart.
    ``train``: the largest ``|loss - base|`` of a training step after the first restart,
    relative to the mean base loss of those steps (per-step losses of a run with another data
    order are on other batches, so this one has no noise floor).
    """
    steps = sorted(base["evals"])
    last = steps[-1]
    after = [s for s in steps if s > first_restart] or [last]
    out = {
        "final": _rel(curve["evals"][last], base["evals"][last]),
        "curve": max(_rel(curve["evals"][s], base["evals"][s]) for s in after),
    }
    tail = base["losses"][first_restart:]
    if len(curve["losses"]) == len(base["losses"]) and tail:
        diffs = [
            abs(a - b) if math.isfinite(a) else math.inf
            for a, b in zip(curve["losses"][first_restart:], tail)
        ]
        out["train"] = max(diffs) / (sum(tail) / len(tail))
    return out


def check_exact(base: dict[str, Any], run: dict[str, Any]) -> None:
    """Raise unless a run restored from exact checkpoints is the uninterrupted run, bit for bit."""
    if run["losses"] != base["losses"] or run["evals"] != base["evals"]:
        first = next((i for i, (a, b) in enumerate(zip(run["losses"], base["losses"])) if a != b), None)
        raise AssertionError(
            f"the exact restarts did not reproduce the uninterrupted run (first differing step: {first})"
        )


def check_restarts(plan: Plan, setting: ResumeSetting) -> list[int]:
    """``setting``'s restart steps under ``plan``; raise if they are fewer than ``plan.min_restarts``."""
    restarts = plan.restart_steps(setting.keyframe_every)
    if len(restarts) < plan.min_restarts:
        raise ValueError(
            f"{setting.label}: {len(restarts)} restarts in {plan.steps} steps "
            f"(save every {plan.save_every}, a restart every "
            f"{plan.restart_every or setting.keyframe_every} or one more saves); "
            f"need {plan.min_restarts}: more steps or a shorter cycle"
        )
    return restarts


def run_seed(
    make_run: MakeRun,
    seed: int,
    plan: Plan,
    settings: tuple[ResumeSetting, ...],
    *,
    noise_seed_offset: int = 1000,
    exact_check: bool = False,
    exact_keyframe_every: int | None = None,
    baselines: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The uninterrupted run, its noise floor and every setting's restarted run, for one seed.

    With ``exact_check`` the ``exact`` preset runs first through the restarts of
    ``exact_keyframe_every`` (default: the first setting's) and must reproduce the run.
    ``baselines``: this seed's entry of an earlier result's ``runs``, whose uninterrupted
    and noise-floor runs are reused (:func:`reused`) instead of trained again.
    """
    for setting in settings:  # before any training: a plan with too few restarts fails at once
        check_restarts(plan, setting)
    t0 = time.perf_counter()
    if baselines is not None:
        base = reused(make_run, baselines["base"], plan)
        noise = reused(make_run, baselines["noise"], plan)
    else:
        base = uninterrupted(make_run, seed, plan)
        noise = uninterrupted(make_run, seed + noise_seed_offset, plan)
    log(
        f"seed {seed}: uninterrupted + noise-floor runs {'reused, ' if baselines else ''}"
        f"{time.perf_counter() - t0:.0f} s, "
        f"final held-out loss {base['evals'][plan.steps]:.4f} / {noise['evals'][plan.steps]:.4f}"
    )
    out: dict[str, Any] = {"seed": seed, "base": base, "noise": noise, "settings": {}}
    todo = list(settings)
    if exact_check:
        k = exact_keyframe_every or (settings[0].keyframe_every if settings else DEFAULT_KEYFRAME_EVERY)
        todo.insert(0, ResumeSetting("exact (check)", "exact", keyframe_every=k))
    for setting in todo:
        t0 = time.perf_counter()
        restarts = check_restarts(plan, setting)
        with tempfile.TemporaryDirectory(prefix="tw-resume-") as tmp:
            r = restarted(make_run, seed, setting, plan, Path(tmp))
        if setting.label == "exact (check)":
            check_exact(base, r)
            out["exact_check"] = {"restarts": r["restarts"], "files": r["files"]}
            log(
                f"seed {seed}: exact restarts x{len(restarts)} reproduce the run bit for bit "
                f"({time.perf_counter() - t0:.0f} s)"
            )
            continue
        r["dev"] = deviations(r, base, restarts[0])
        r["noise_dev"] = deviations(noise, base, restarts[0])
        out["settings"][setting.label] = r
        log(
            f"seed {seed}: {setting.label}: {len(restarts)} restarts, final held-out loss "
            f"deviation {100 * r['dev']['final']:.3f} % (noise run {100 * r['noise_dev']['final']:.3f} %), "
            f"{time.perf_counter() - t0:.0f} s"
        )
    return out


# ------------------------------------------------------------------------------ summary


def files_by_kind(files: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind of file (keyframe, delta, standalone): count, mean bytes per part, size range."""
    out = {}
    for kind in sorted({f["kind"] for f in files}):
        chosen = [f for f in files if f["kind"] == kind]
        out[kind] = {
            "count": len(chosen),
            "mean": {p: sum(f[p] for f in chosen) / len(chosen) for p in (*PARTS, "total")},
            "min_total": min(f["total"] for f in chosen),
            "max_total": max(f["total"] for f in chosen),
        }
    return out


def _bytes_of(files: dict[str, dict[str, Any]], kind: str) -> dict[str, float] | None:
    return files[kind]["mean"] if kind in files else None


def size_summary(
    files: dict[str, dict[str, Any]], torch_bytes: int, params: int, keyframe_every: int
) -> dict[str, Any]:
    """Bytes per parameter by part for keyframes and deltas, the cycle averages and ratios.

    The cycle average is one keyframe and ``k - 1`` deltas (their mean sizes), at the
    setting's ``keyframe_every`` and at the Checkpointer default; the ratios divide
    ``torch.save`` of the same state by each.
    """
    kf, delta = _bytes_of(files, "keyframe"), _bytes_of(files, "delta")
    if delta is None:  # delta=False: the saves between keyframes stand alone
        delta = _bytes_of(files, "standalone")
    if kf is None:
        raise ValueError("no keyframe among the files")
    between = delta or kf

    def cycle(k: int) -> float:
        return (kf["total"] + (k - 1) * between["total"]) / k

    per = {
        "keyframe": {p: v / params for p, v in kf.items()},
        "delta": {p: v / params for p, v in delta.items()} if delta else None,
        "cycle": cycle(keyframe_every) / params,
        "cycle_default_k": cycle(DEFAULT_KEYFRAME_EVERY) / params,
        "torch_save": torch_bytes / params,
    }
    per["x_keyframe"] = torch_bytes / kf["total"]
    per["x_delta"] = torch_bytes / delta["total"] if delta else None
    per["x_cycle"] = torch_bytes / cycle(keyframe_every)
    per["x_cycle_default_k"] = torch_bytes / cycle(DEFAULT_KEYFRAME_EVERY)
    return per


def _x(v: float, floor: float) -> float:
    return v / floor if floor > 0 else math.inf


def summarize(runs: list[dict[str, Any]], settings: tuple[ResumeSetting, ...], params: int) -> dict[str, Any]:
    """One row per setting: deviations (median and worst seed) and noise multiples, sizes.

    The noise floor of a metric is the median over the seeds of the noise run's deviation,
    over the same window as the setting's (after its first restart; settings with another
    ``keyframe_every`` restart elsewhere). The final deviation's floor is the same for all.
    """
    rows = []
    for s in settings:
        per = [r["settings"][s.label] for r in runs]
        row: dict[str, Any] = {
            "setting": s.label,
            "spec": s.to_json(),
            "seeds": [r["seed"] for r in runs],
            "restarts": len(per[0]["restarts"]),
            "restored": {
                k: sum(x["kind"] == k for x in per[0]["restarts"])
                for k in ("keyframe", "delta", "standalone")
            },
        }
        for m in ("final", "curve", "train"):
            vals = [p["dev"].get(m, math.inf) for p in per]
            row[f"{m}_dev"] = median(vals)
            row[f"{m}_dev_worst"] = max(vals)
            if m != "train":
                noise = [p["noise_dev"][m] for p in per]
                row[f"{m}_noise_floor"] = median(noise)
                row[f"{m}_noise_per_seed"] = noise
                row[f"{m}_x_noise"] = _x(median(vals), median(noise))
                row[f"{m}_x_noise_worst"] = _x(max(vals), median(noise))
                # The most stringent reading: the worst seed against the smallest floor seen.
                row[f"{m}_x_min_noise_worst"] = _x(max(vals), min(noise))
                # Each seed against its own noise run (same initial weights), the worst seed.
                row[f"{m}_x_own_noise_worst"] = max(_x(v, n) for v, n in zip(vals, noise))
        row["negative_exp_avg_sq"] = max(p["negative_exp_avg_sq"] for p in per)
        row["nonfinite_exp_avg_sq"] = max(p["nonfinite_exp_avg_sq"] for p in per)
        sizes = [size_summary(p["files"], p["torch_save_bytes"], params, s.keyframe_every) for p in per]
        row["bytes_per_param"] = sizes[0]  # the first seed's files (sizes barely move with the seed)
        row["x_cycle_per_seed"] = [z["x_cycle"] for z in sizes]
        rows.append(row)
    first = rows[0] if rows else {}
    floor = {
        m: {"median": first.get(f"{m}_noise_floor"), "per_seed": first.get(f"{m}_noise_per_seed")}
        for m in ("final", "curve")
    }
    return {"noise_floor": floor, "rows": rows}


# ------------------------------------------------------------------------------ tables


def _pct(v: float) -> str:
    return "diverged" if not math.isfinite(v) else f"{100 * v:.3f} %"


def _times(v: float) -> str:
    return "inf" if not math.isfinite(v) else f"{v:.2f}x"


def _floor(row: dict[str, Any], metric: str) -> str:
    seeds = row[f"{metric}_noise_per_seed"]
    return (
        f"floor {_pct(row[f'{metric}_noise_floor'])}, per seed {_pct(min(seeds))}..{_pct(max(seeds))}; "
        f"each seed vs its own floor, worst {_times(row[f'{metric}_x_own_noise_worst'])}; "
        f"worst vs smallest floor {_times(row[f'{metric}_x_min_noise_worst'])}"
    )


def fidelity_table(result: dict[str, Any]) -> str:
    """Markdown: each setting's deviation from the uninterrupted run, and as noise multiples."""
    body = [
        [
            r["setting"],
            r["restarts"],
            f"{r['restored']['delta'] + r['restored']['standalone']}/{r['restored']['keyframe']}",
            f"{_pct(r['final_dev'])} / {_pct(r['final_dev_worst'])}",
            f"{_times(r['final_x_noise'])} / **{_times(r['final_x_noise_worst'])}** ({_floor(r, 'final')})",
            f"{_times(r['curve_x_noise'])} / {_times(r['curve_x_noise_worst'])} ({_floor(r, 'curve')})",
            _pct(r["train_dev_worst"]),
            r["negative_exp_avg_sq"],
        ]
        for r in result["rows"]
    ]
    headers = [
        "setting",
        "restarts",
        "restored from delta/keyframe",
        "final held-out loss deviation (median / worst seed)",
        "final deviation / noise floor (median / worst seed)",
        "held-out curve max deviation / noise floor (median / worst seed)",
        "max per-step training-loss deviation / mean loss (worst seed)",
        "negative exp_avg_sq after restore",
    ]
    return fmt_table(headers, body)


def size_table(result: dict[str, Any]) -> str:
    """Markdown: bytes per parameter by part (keyframe, delta), cycle average, ratios."""

    def split(d: dict[str, float] | None) -> str:
        if d is None:
            return "-"
        return " / ".join(f"{d[p]:.2f}" for p in PARTS) + f" = **{d['total']:.2f}**"

    body = []
    for r in result["rows"]:
        b = r["bytes_per_param"]
        body.append(
            [
                r["setting"],
                r["spec"]["keyframe_every"],
                split(b["keyframe"]),
                split(b["delta"]),
                f"{b['cycle']:.2f}",
                f"{b['torch_save']:.2f}",
                f"{b['x_keyframe']:.2f}x / {b['x_delta']:.2f}x"
                if b["x_delta"]
                else f"{b['x_keyframe']:.2f}x / -",
                f"**{b['x_cycle']:.2f}x**"
                + (
                    ""
                    if r["spec"]["keyframe_every"] == DEFAULT_KEYFRAME_EVERY
                    else f" ({b['x_cycle_default_k']:.2f}x at k={DEFAULT_KEYFRAME_EVERY})"
                ),
            ]
        )
    headers = [
        "setting",
        "keyframe_every",
        "keyframe B/param (weights / exp_avg / exp_avg_sq / rest = total)",
        "delta B/param (same split)",
        "cycle average B/param",
        "torch.save B/param",
        "x smaller than torch.save: keyframe / delta",
        "cycle average x smaller",
    ]
    return fmt_table(headers, body)


def tables(result: dict[str, Any]) -> str:
    """Both tables, as the scripts print them."""
    return size_table(result) + "\n\n" + fidelity_table(result)
