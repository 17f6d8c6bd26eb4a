"""Resume fidelity under repeated restarts: a model killed and restored from its own checkpoints.

Per seed (see ``harness/restarts.py``): the uninterrupted run; the noise floor, the same run
with another data-order seed; and per setting the same run with a ``tw_triton.Checkpointer``
saving every few steps, killed and restored from its latest checkpoint at least 8 times. The
first seed can also run the ``exact`` preset through the same restarts, which must reproduce
the uninterrupted run bit for bit, or the script fails.

Models (``--model``):

* ``gpt``: a tiny byte-level GPT trained from scratch on stdlib source (``harness/tiny_gpt.py``),
  480 steps, 3 seeds, settings ``small,smallest``; writes ``results/resume_fidelity.json``.
* ``minilm``: all-MiniLM-L6-v2 fine-tuned on stdlib docstring/signature pairs
  (``harness/minilm_finetune.py``, needs the ``bench`` extra), 76 steps, 3 seeds, the
  Checkpointer's default preset, ``keyframe_every`` 4; writes ``results/resume_minilm.json``.

A setting is any preset of ``tw_triton.rules.PRESETS`` by name or a rule list of
``harness.settings.EXPLICIT_RULES``, with modifiers (``--settings small,smallest:k=4,w8-m4:delta=none``).
``--settings ablation`` runs the rule lists that take ``smallest`` apart (fewer bits for the
moments and the weight deltas) and writes ``results/moment_ablation_<model>.json``, which
``make_results.py`` turns into ``results/moment_ablation.md``.

Run: ``python benchmarks/resume_fidelity.py [--model minilm] [--settings ...]``; ``--quick`` is a
smoke run of seconds that writes nothing unless ``--out`` names a result.
"""

from __future__ import annotations

import argparse
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from typing import Any

import torch
from harness.common import RESULTS_DIR, environment, log, read_result, write_result
from harness.restarts import summarize, tables
from harness.settings import ResumeSetting, parse_settings

from tw_triton.checkpointer import DEFAULT_RULES

# Per model: default settings, seeds, keyframe_every, whether the exact check runs, result name.
MODELS: dict[str, dict[str, Any]] = {
    "gpt": {
        "settings": "small,smallest",
        "quick_settings": "small",
        "seeds": [0, 1, 2],
        "keyframe_every": 10,
        "exact_check": True,
        "out": "resume_fidelity",
    },
    "minilm": {
        "settings": DEFAULT_RULES if isinstance(DEFAULT_RULES, str) else "safe",
        "quick_settings": None,
        "seeds": [0, 1, 2],
        "keyframe_every": 4,
        "exact_check": False,
        "out": "resume_minilm",
    },
}
# ``wW-mM-vV``: weight deltas at W bits (closed loop), exp_avg at M bits (int3: seven levels
# in a 4-bit container), exp_avg_sq log2 at V bits; ``-wide``: blocks of 256 / 512 for the moments.
ABLATION = {
    "gpt": "w2-m4-v4,w2-m3-v4,w2-m4-v2-wide,w2-m3-v2-wide",
    "minilm": "w2-m4-v4,w2-m3-v4,w2-m4-v2-wide,w8-m3-v2-wide",
}


def run(
    model: str,
    cfg: Any,
    seeds: list[int],
    settings: tuple[ResumeSetting, ...],
    *,
    exact_check: bool,
    min_restarts: int = 8,
    baselines: dict[int, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Run the restart experiment of ``model`` and return its JSON result (less the environment).

    Args:
        model: ``"gpt"`` or ``"minilm"``.
        cfg: that model's ``Config`` (``harness.tiny_gpt.Config`` or ``harness.minilm_finetune.Config``).
        seeds: initial-weight seeds; the first also runs the exact check if ``exact_check``.
        settings: what the restarted runs save with.
        exact_check: run the ``exact`` preset through the restarts (must be bit exact).
        min_restarts: fewest restarts of every setting.
        baselines: an earlier result's runs by seed, whose uninterrupted and noise-floor
            runs are reused once they reproduce (``harness.restarts.reused``).
    Returns:
        The result dict (``rows``, ``runs``, ``config``, ...) that ``make_results.py`` reads.
    """
    if model == "gpt":
        from harness import tiny_gpt

        return tiny_gpt.run(
            cfg,
            tiny_gpt.load_corpus(),
            seeds,
            settings,
            exact_check=exact_check,
            min_restarts=min_restarts,
            baselines=baselines,
        )
    from harness import minilm_finetune

    return minilm_finetune.run(
        cfg, seeds, settings, exact_check=exact_check, min_restarts=min_restarts, baselines=baselines
    )


def _one_seed(model: str, cfg: Any, seed: int, settings: tuple[ResumeSetting, ...], threads: int, **kw: Any):
    """One seed's result in a worker process (spawned: it sets its own thread count)."""
    torch.set_num_threads(threads)
    return run(model, cfg, [seed], settings, **kw)


def run_in_parallel(
    model: str,
    cfg: Any,
    seeds: list[int],
    settings: tuple[ResumeSetting, ...],
    *,
    jobs: int,
    threads: int,
    exact_check: bool,
    min_restarts: int = 8,
    baselines: dict[int, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """:func:`run` with the seeds in up to ``jobs`` processes; the same result as one process.

    Each seed's runs depend only on the seed, the config and the thread count, so they are
    run apart and the summary is taken over all of them, as :func:`run` does.
    """
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = [
            pool.submit(
                _one_seed,
                model,
                cfg,
                seed,
                settings,
                threads,
                exact_check=exact_check and i == 0,
                min_restarts=min_restarts,
                baselines=None if baselines is None else {seed: baselines[seed]},
            )
            for i, seed in enumerate(seeds)
        ]
        parts = [f.result() for f in futures]
    runs = [run for part in parts for run in part["runs"]]
    return {**parts[0], **summarize(runs, settings, parts[0]["params"]), "runs": runs}


def _stored(option: str, name: str | None, config: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """Result ``name`` for ``option``, once it exists and matches ``config`` and this
    environment; ``problems`` are the caller's own mismatches so far (a list it may extend)."""
    if not name or not (RESULTS_DIR / f"{name}.json").exists():
        raise ValueError(f"{option}: no result {name!r}")
    old = read_result(name)
    env, here = old.get("environment", {}), environment()
    problems += [k for k in ("torch", "torch_threads") if env.get(k) != here[k]]
    if old.get("config") != config:
        problems.append("config")
    return old


def _refuse(option: str, name: str | None, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"{option}: result {name!r} differs in {', '.join(problems)}")


def earlier_baselines(
    name: str | None, config: dict[str, Any], seeds: list[int]
) -> dict[int, dict[str, Any]]:
    """The runs by seed of result ``name``, for ``--reuse-baselines``.

    Raises:
        ValueError: no such result, or one of another config, seeds, torch or thread count.
    """
    problems: list[str] = []
    old = _stored("--reuse-baselines", name, config, problems)
    by_seed = {r["seed"]: r for r in old.get("runs", [])}
    if not set(seeds) <= set(by_seed):
        problems.append("seeds")
    _refuse("--reuse-baselines", name, problems)
    return {s: by_seed[s] for s in seeds}


def other_seeds(
    name: str | None, config: dict[str, Any], settings: tuple[ResumeSetting, ...], seeds: list[int]
) -> list[dict[str, Any]]:
    """The runs of result ``name`` whose seeds are not in ``seeds``, for ``--add-seeds``.

    Raises:
        ValueError: no such result, or one of another config, settings, torch or thread count.
    """
    problems: list[str] = []
    old = _stored("--add-seeds", name, config, problems)
    if [r["spec"] for r in old.get("rows", [])] != [s.to_json() for s in settings]:
        problems.append("settings")
    _refuse("--add-seeds", name, problems)
    return [r for r in old["runs"] if r["seed"] not in seeds]


def task_config(model: str, quick: bool, **overrides: int | None) -> Any:
    """The model's run configuration (its ``QUICK`` one with ``quick``), with ``overrides`` applied."""
    if model == "gpt":
        from harness.tiny_gpt import QUICK, Config
    else:
        from harness.minilm_finetune import QUICK, Config
    cfg = QUICK if quick else Config()
    return Config(**{**asdict(cfg), **{k: v for k, v in overrides.items() if v is not None}})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt")
    parser.add_argument(
        "--settings",
        default=None,
        help="comma-separated settings, or 'ablation' (default: the model's; see "
        "harness.settings.parse_setting)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--keyframe-every", type=int, default=None, help="for settings that do not set k=")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--save-every", type=int, default=None)
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument(
        "--restart-every",
        type=int,
        default=None,
        help="saves between restarts, alternately N and N+1 (default: each setting's keyframe_every)",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny run: a smoke test of seconds")
    check = parser.add_mutually_exclusive_group()
    check.add_argument(
        "--exact-check",
        dest="exact_check",
        action="store_true",
        default=None,
        help="run the exact preset through the restarts on the first seed (gpt: on)",
    )
    check.add_argument("--no-exact-check", dest="exact_check", action="store_false")
    parser.add_argument(
        "--out",
        default=None,
        help="result name under benchmarks/results/ (default: the model's; --quick: none)",
    )
    parser.add_argument(
        "--reuse-baselines",
        action="store_true",
        help="reuse the uninterrupted and noise-floor runs of the result --out names (same "
        "config and environment), checked by training their first steps again",
    )
    parser.add_argument(
        "--baselines-from",
        default=None,
        metavar="NAME",
        help="as --reuse-baselines, from result NAME (a control run of other settings)",
    )
    parser.add_argument(
        "--add-seeds",
        action="store_true",
        help="keep the runs of other seeds in the result --out names (same config and "
        "settings) and summarize them with this run's",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="run the seeds in this many processes (each with --threads threads); same result",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: steady timings on a shared 2-core machine)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = MODELS[args.model]
    cfg = task_config(
        args.model,
        args.quick,
        steps=args.steps,
        save_every=args.save_every,
        eval_every=args.eval_every,
        restart_every=args.restart_every,
    )
    out = spec["out"]
    settings_spec = args.settings or (args.quick and spec["quick_settings"]) or spec["settings"]
    if settings_spec == "ablation":
        settings_spec, out = ABLATION[args.model], f"moment_ablation_{args.model}"
    keyframe_every = args.keyframe_every or (2 if args.quick else spec["keyframe_every"])
    try:
        settings = parse_settings(settings_spec, keyframe_every=keyframe_every)
    except ValueError as e:
        parser.error(str(e))
    seeds = args.seeds or ([0] if args.quick else spec["seeds"])
    exact = args.exact_check if args.exact_check is not None else (spec["exact_check"] or args.quick)
    name = args.out or (None if args.quick else out)
    baselines = None
    if args.reuse_baselines or args.baselines_from:
        try:
            baselines = earlier_baselines(args.baselines_from or name, asdict(cfg), seeds)
        except ValueError as e:
            parser.error(str(e))
    earlier_runs = []
    if args.add_seeds:
        try:
            earlier_runs = other_seeds(name, asdict(cfg), settings, seeds)
        except ValueError as e:
            parser.error(str(e))
    kw = {
        "exact_check": exact,
        "min_restarts": 2 if args.quick and args.model == "minilm" else 8,
        "baselines": baselines,
    }
    if args.jobs > 1 and len(seeds) > 1:
        result = run_in_parallel(args.model, cfg, seeds, settings, jobs=args.jobs, threads=args.threads, **kw)
    else:
        result = run(args.model, cfg, seeds, settings, **kw)
    if earlier_runs:
        runs = sorted([*earlier_runs, *result["runs"]], key=lambda r: r["seed"])
        result = {**result, **summarize(runs, settings, result["params"]), "runs": runs}
        seeds = [r["seed"] for r in runs]
    print(
        f"{result['task']}: {result['params']} parameters; {cfg.steps} steps, a save every "
        f"{cfg.save_every}, a restart every {cfg.restart_every or 'keyframe_every'} saves; seeds {seeds}"
    )
    print(tables(result))
    if name:
        log(f"wrote {write_result(name, result)}")


if __name__ == "__main__":
    main()
