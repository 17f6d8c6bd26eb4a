"""The tables of docs/performance.md that come from result files, and how they are put there.

``make_results.py`` writes each between a pair of markers (:func:`replace_between`), so the
page's figures are the ones in ``results/`` and the prose around them stays hand-written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.common import fmt_table
from tw_triton import roles

# Goals the speed comparison is held to (docs/performance.md, "Where the goals stand").
BLOCK_GOAL = 0.25  # save() blocks at most this fraction of torch.save
LOAD_RSS_GOAL = 1.2  # load's peak extra RSS at most this multiple of the state
CODEC_GOAL = 0.5  # codec encode and decode at least this fraction of copy_


def marker(name: str) -> tuple[str, str]:
    """The start and end markers of the generated block ``name``."""
    return f"<!-- {name}:start (written by benchmarks/make_results.py) -->", f"<!-- {name}:end -->"


def replace_between(path: Path, name: str, text: str) -> bool:
    """Put ``text`` between block ``name``'s markers in ``path``; return whether it changed.

    Raises:
        ValueError: the markers are missing or out of order.
    """
    start_m, end_m = marker(name)
    page = path.read_text(encoding="utf-8")
    start, end = page.find(start_m), page.find(end_m)
    if start < 0 or end < start:
        raise ValueError(f"{path}: markers {start_m!r} ... {end_m!r} not found")
    new = page[: start + len(start_m)] + "\n" + text.strip("\n") + "\n" + page[end:]
    if new != page:
        path.write_text(new, encoding="utf-8")
    return new != page


def _x(v: float) -> str:
    return f"{v:.2f}x"


def _bold_if(v: float, goal: float) -> str:
    return f"**{_x(v)}**" if v <= goal else _x(v)


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}x"


def _rows(speed: dict[str, Any]) -> tuple[dict, dict, dict]:
    return (
        {r["method"]: r for r in speed["save_rows"]},
        {r["method"]: r for r in speed["load_rows"]},
        {r["method"]: r for r in speed.get("resume_rows", [])},
    )


def speed_headline(speed: dict[str, Any]) -> str:
    """The default Checkpointer against ``torch.save`` and ``torch.load``: one sentence of
    seconds and one table of ratios, from ``speed_compare.json``."""
    save, load, resume = _rows(speed)
    state = speed["state"]["state_bytes"]

    def rss(method: str) -> str:
        return _x(load[method]["load_peak_extra_bytes"] / state)

    def smaller(method: str) -> str:
        return f"{save[method]['size_vs_torch_save']:.3g}x smaller"

    def row(label: str, method: str, restored: str | None = None) -> list[str]:
        """A save's pause and total; with ``restored``, its load, resume and load memory."""
        cells = [label, _bold_if(save[method]["blocked_vs_torch_save"], BLOCK_GOAL)]
        cells.append(_x(save[method]["total_vs_torch_save"]))
        if restored is None:
            return cells + ["", "", ""]
        resumed = resume[f"tw restore default {restored}"]["resume_vs_torch"]
        return cells + [_x(load[method]["load_vs_torch_load"]), _x(resumed), rss(method)]

    kf, delta = "tw default keyframe", "tw default delta"
    rows = [
        row(f"keyframe, first save ({smaller(kf)})", kf, "keyframe"),
        row("the same after `prepare`", kf + " after prepare"),
        row(f"delta, first after its keyframe ({smaller(delta)})", delta, "delta"),
        row("the same after `prepare`", delta + " after prepare"),
        row(f"delta, 4th after its keyframe ({smaller(delta + ', steady state')})", delta + ", steady state"),
    ]
    head = [
        "default Checkpointer, MiniLM + AdamW",
        "blocks the loop",
        "total save",
        "load",
        "resume",
        "load peak extra RSS / state",
    ]
    seconds = (
        f"In this run `torch.save` took {save['torch.save']['blocked_s']:.2f} s and `torch.load` "
        f"{load['torch.load']['load_s']:.2f} s."
    )
    return seconds + "\n\n" + fmt_table(head, rows)


def _verdict(failing: list[str]) -> str:
    return "yes" if not failing else "not for " + " or ".join(failing)


def goals_table(speed: dict[str, Any], codec: dict[str, Any]) -> str:
    """Where the speed goals stand, from ``speed_compare.json`` and ``codec_cpu.json``."""
    save, load, resume = _rows(speed)
    state = speed["state"]["state_bytes"]
    kf, delta = "tw default keyframe", "tw default delta"
    deltas = [delta, delta + " after prepare", delta + ", steady state"]
    keyframes = [kf, kf + " after prepare"]

    fast = [save[m]["blocked_vs_torch_save"] for m in [*deltas, kf + " after prepare"]]
    first = save[kf]["blocked_vs_torch_save"]
    block_fail = [] if first <= BLOCK_GOAL else ["a first keyframe without `prepare`"]
    if max(fast) > BLOCK_GOAL:
        block_fail.insert(0, "the deltas or a keyframe after `prepare`")

    total_d = [save[m]["total_vs_torch_save"] for m in deltas]
    total_k = [save[m]["total_vs_torch_save"] for m in keyframes]
    total_fail = [n for n, v in (("deltas", total_d), ("keyframes", total_k)) if max(v) > 1.0]

    loads = {"keyframe": load[kf]["load_vs_torch_load"], "delta": load[delta]["load_vs_torch_load"]}
    resumes = {
        "keyframe": resume["tw restore default keyframe"]["resume_vs_torch"],
        "delta": resume["tw restore default delta"]["resume_vs_torch"],
    }
    load_all = {f"a {k}'s load": v for k, v in loads.items()}
    load_all.update({f"a {k}'s resume": v for k, v in resumes.items()})
    load_fail = [n for n, v in load_all.items() if v > 1.0]
    load_pass = [n for n, v in load_all.items() if v <= 1.0]

    by_dtype: dict[str, list[float]] = {}
    for r in codec["cpu"]:
        by_dtype.setdefault(r["dtype"], []).extend([r["encode_over_copy"], r["decode_over_copy"]])
    names = {"float32": "fp32", "bfloat16": "bf16 input", "float16": "fp16 input"}
    codec_fail = [names.get(d, d) for d, v in by_dtype.items() if min(v) < CODEC_GOAL]

    rss = {k: load[m]["load_peak_extra_bytes"] / state for k, m in (("keyframe", kf), ("delta", delta))}
    rss_fail = [f"a {k}" for k, v in rss.items() if v > LOAD_RSS_GOAL]

    rows = [
        [
            f"`save()` blocks at most {BLOCK_GOAL}x of `torch.save`",
            f"{_span(fast)} (deltas, keyframe after `prepare`); {_x(first)} (first keyframe, no `prepare`)",
            _verdict(block_fail),
        ],
        [
            "total save at or below `torch.save` + fsync",
            f"{_span(total_d)} (deltas), {_span(total_k)} (keyframes)",
            _verdict(total_fail) if len(total_fail) < 2 else "no",
        ],
        [
            "load at or below `torch.load`",
            f"keyframe {_x(loads['keyframe'])}, delta {_x(loads['delta'])}; resume: keyframe "
            f"{_x(resumes['keyframe'])}, delta {_x(resumes['delta'])}",
            "only for " + " and ".join(load_pass)
            if 0 < len(load_pass) < len(load_fail)
            else _verdict(load_fail)
            if load_pass
            else "no",
        ],
        [
            f"codec at least {CODEC_GOAL}x of `copy_`",
            "; ".join(f"{names.get(d, d)} {_span(v)}" for d, v in by_dtype.items()),
            "no" if len(codec_fail) == len(by_dtype) else _verdict(codec_fail),
        ],
        [
            f"load peak extra RSS at most {LOAD_RSS_GOAL}x the state",
            f"{_x(rss['keyframe'])} (keyframe), {_x(rss['delta'])} (delta with its keyframe)",
            _verdict(rss_fail),
        ],
    ]
    return fmt_table(["goal", "now", "met?"], rows)


def codec_table(codec: dict[str, Any]) -> str:
    """Compiled codec and torch reference against ``copy_``, ranges over the bit widths."""
    groups: dict[tuple[str, str, str | None], list[dict[str, Any]]] = {}
    for r in codec["cpu"]:
        groups.setdefault((r["codec"], r["dtype"], r["reference"]), []).append(r)
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    rows = []
    for (name, dtype, ref), rs in groups.items():
        what = (
            f"{short.get(dtype, dtype)} second moment" if name.startswith("log2") else short.get(dtype, dtype)
        )
        if ref:
            what += f" with a {short.get(ref, ref)} reference"
        rows.append(
            [
                f"{name}, {what}",
                f"{_span([r['encode_over_copy'] for r in rs])} ({_span([r['torch_encode_over_copy'] for r in rs])})",
                f"{_span([r['decode_over_copy'] for r in rs])} ({_span([r['torch_decode_over_copy'] for r in rs])})",
            ]
        )
    head = ["codec, input", "encode / `copy_`: compiled (torch)", "decode / `copy_`: compiled (torch)"]
    return fmt_table(head, rows)


# Goals of the every-optimizer run (docs/performance.md, "Every optimizer").
WEIGHT_ERROR_GOAL = 0.01  # restored weights within 1 % (relative norm)
OPT_DELTA_GOAL = 8.0  # a delta at least 8x smaller than torch.save, optimizers with a moment
OPT_KEYFRAME_GOAL = 1.7  # a keyframe at least 1.7x smaller


def results_table(markdown: str) -> str:
    """The first markdown table of a results page (its header, rule and rows)."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])


def has_moment(optimizer: str) -> bool:
    """Whether ``optimizer`` (a ``torch.optim`` class name) keeps a running average."""
    return any(role != roles.EXACT for role in roles.OPTIMIZER_STATES.get(optimizer, {}).values())


def optimizer_goals(result: dict[str, Any]) -> str:
    """Where the every-optimizer goals stand, from ``optimizers.json``."""
    rows = result["rows"]
    moment = [r for r in rows if has_moment(r["optimizer"])]
    worst = max(rows, key=lambda r: r["restored_weight_error"])

    def split(key: str, goal: float, pool: list[dict[str, Any]]) -> tuple[str, bool]:
        ok = [r[key] for r in pool if r[key] is not None and r[key] >= goal]
        short = [r for r in pool if r[key] is None or r[key] < goal]
        text = f"{min(ok):.1f}-{max(ok):.1f}x for {len(ok)} of {len(pool)}" if ok else f"none of {len(pool)}"
        if short:
            text += "; " + ", ".join(
                f"{r['optimizer']} {r[key]:.2f}x" if r[key] is not None else f"{r['optimizer']} -"
                for r in short
            )
        return text, not short

    delta, delta_met = split("delta_ratio", OPT_DELTA_GOAL, moment)
    keyframe, keyframe_met = split("keyframe_ratio", OPT_KEYFRAME_GOAL, moment)
    resumed = [r for r in rows if r["losses"].get("resumed") is not None]
    table = [
        [
            "every optimizer saved, restored into fresh objects and trained on",
            f"{len(resumed)} of {len(rows)} (`tests/checkpointing/test_optimizers.py` too)",
            "yes" if len(resumed) == len(rows) else "no",
        ],
        [
            f"restored weights within {100 * WEIGHT_ERROR_GOAL:.0f} % (relative norm)",
            f"{100 * worst['restored_weight_error']:.2f} % at worst ({worst['optimizer']})",
            "yes" if worst["restored_weight_error"] <= WEIGHT_ERROR_GOAL else "no",
        ],
        [
            f"delta at least {OPT_DELTA_GOAL:.0f}x smaller than `torch.save`, optimizers with a moment",
            delta,
            "yes" if delta_met else "no",
        ],
        [
            f"keyframe at least {OPT_KEYFRAME_GOAL}x, optimizers with a moment",
            keyframe,
            "yes" if keyframe_met else "no",
        ],
    ]
    return fmt_table(["goal", "now", "met?"], table)
