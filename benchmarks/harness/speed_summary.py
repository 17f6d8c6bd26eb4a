"""Medians, best runs and ratios of the speed comparison, and its markdown tables.

:func:`summarize` turns the raw per-round measurements of ``speed_compare.py`` into the
``save_rows``, ``load_rows`` and ``resume_rows`` of its JSON result (ratios against
``torch.save`` / ``torch.load``); :func:`tables` renders them (the results page uses it too).
"""

from __future__ import annotations

from typing import Any

from harness.common import fmt_table, median, mib

Raw = dict[str, list[dict[str, Any]]]


def summarize(saves: Raw, loads: Raw, resumes: Raw) -> tuple[list[dict], list[dict], list[dict]]:
    """The rows of the result from the raw measurements, by method.

    Args:
        saves, loads, resumes: per method, one measurement dict per round (the children's JSON);
            ``saves`` must hold ``torch.save`` and ``loads`` ``torch.load``, the yardsticks.
    Returns:
        ``(save_rows, load_rows, resume_rows)``.
    """
    ref = "torch.save"
    rows = []
    for method in saves:
        s = saves[method]
        rows.append(
            {
                "method": method,
                "file_bytes": median([r["file_bytes"] for r in s]),
                "blocked_s": median([r["blocked_s"] for r in s]),
                "total_s": median([r["total_s"] for r in s]),
                # Disk time (fsync) on a shared machine varies several-fold between runs and
                # only ever adds: the best run is the steadier comparison of the work done.
                "total_best_s": min(r["total_s"] for r in s),
                "save_peak_extra_bytes": median([r["peak_extra_bytes"] for r in s]),
                "save_peak_device_bytes": (
                    max(r["peak_device_bytes"] for r in s)
                    if s[0].get("peak_device_bytes") is not None
                    else None
                ),
            }
        )
    load_rows = []
    for method in loads:
        s = loads[method]
        load_rows.append(
            {
                "method": method,
                "load_s": median([r["load_s"] for r in s]),
                "load_best_s": min(r["load_s"] for r in s),
                "load_peak_extra_bytes": median([r["peak_extra_bytes"] for r in s]),
            }
        )
    base = next(r for r in rows if r["method"] == ref)
    for r in rows:
        r["size_vs_torch_save"] = base["file_bytes"] / r["file_bytes"]
        r["blocked_vs_torch_save"] = r["blocked_s"] / base["blocked_s"]
        r["total_vs_torch_save"] = r["total_s"] / base["total_s"]
        r["total_best_vs_torch_save"] = r["total_best_s"] / base["total_best_s"]
    lbase = next(r for r in load_rows if r["method"] == "torch.load")
    for r in load_rows:
        r["load_vs_torch_load"] = r["load_s"] / lbase["load_s"]
        r["load_best_vs_torch_load"] = r["load_best_s"] / lbase["load_best_s"]
    resume_rows = [
        {
            "method": method,
            "resume_s": median([r["load_s"] for r in resumes[method]]),
            "resume_best_s": min(r["load_s"] for r in resumes[method]),
            "resume_peak_extra_bytes": median([r["peak_extra_bytes"] for r in resumes[method]]),
        }
        for method in resumes
        if resumes[method]
    ]
    rbase = resume_rows[0]
    for r in resume_rows:
        r["resume_vs_torch"] = r["resume_s"] / rbase["resume_s"]
        r["resume_best_vs_torch"] = r["resume_best_s"] / rbase["resume_best_s"]
    return rows, load_rows, resume_rows


def tables(result: dict[str, Any]) -> str:
    """Markdown tables for the save and load rows."""
    save = fmt_table(
        [
            "method",
            "file MiB",
            "smaller than torch.save",
            "blocks the loop (s)",
            "vs torch.save",
            "total save (s)",
            "vs torch.save",
            "best total (s)",
            "vs best",
            "peak extra RSS (MiB)",
        ],
        [
            [
                r["method"],
                f"{mib(r['file_bytes']):.1f}",
                f"{r['size_vs_torch_save']:.2f}x",
                f"{r['blocked_s']:.3f}",
                f"{r['blocked_vs_torch_save']:.2f}",
                f"{r['total_s']:.3f}",
                f"{r['total_vs_torch_save']:.2f}",
                *_best(r, "total_best_s", "total_best_vs_torch_save"),
                f"{mib(r['save_peak_extra_bytes']):.0f}",
            ]
            for r in result["save_rows"]
        ],
    )
    load = fmt_table(
        [
            "method",
            f"load to {result.get('device', 'cpu')} (s)",
            "vs torch.load",
            "best (s)",
            "vs best",
            "peak extra RSS (MiB)",
        ],
        [
            [
                r["method"],
                f"{r['load_s']:.3f}",
                f"{r['load_vs_torch_load']:.2f}",
                *_best(r, "load_best_s", "load_best_vs_torch_load"),
                f"{mib(r['load_peak_extra_bytes']):.0f}",
            ]
            for r in result["load_rows"]
        ],
    )
    resume = fmt_table(
        [
            "method",
            "resume (s)",
            "vs torch.load + load_state_dict",
            "best (s)",
            "vs best",
            "peak extra RSS (MiB)",
        ],
        [
            [
                r["method"],
                f"{r['resume_s']:.3f}",
                f"{r['resume_vs_torch']:.2f}",
                f"{r['resume_best_s']:.3f}",
                f"{r['resume_best_vs_torch']:.2f}",
                f"{mib(r['resume_peak_extra_bytes']):.0f}",
            ]
            for r in result.get("resume_rows", [])
        ],
    )
    return save + "\n\n" + load + ("\n\n" + resume if result.get("resume_rows") else "")


def _best(row: dict[str, Any], seconds: str, ratio: str) -> list[str]:
    """The best-run cells of a row ("-" in results written before they were recorded)."""
    return [f"{row[seconds]:.3f}", f"{row[ratio]:.2f}"] if seconds in row else ["-", "-"]
