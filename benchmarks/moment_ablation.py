"""How few bits can the AdamW moments and the weight deltas take? The restart benchmarks, ablated.

Runs ``resume_fidelity.py`` (the GPT trained from scratch, 3 seeds) and ``resume_minilm.py``
(the MiniLM fine-tune, 2 seeds) on rule lists of ``_twapi.EXPLICIT_RULES`` that take the
preset ``smallest`` apart (``wW-mM-vV``: weight deltas at W bits, closed loop; ``exp_avg``
at M bits, int3 = seven levels in a 4-bit container; ``exp_avg_sq`` log2 at V bits; ``-wide``:
blocks of 256 for ``exp_avg`` and 512 for ``exp_avg_sq``), and writes their tables to
``benchmarks/results/moment_ablation.md``. Each seed is judged against its own noise run.

Run: ``python benchmarks/moment_ablation.py`` (about 25 minutes on 2 cores);
``--no-run`` rebuilds the page from ``results/moment_ablation_*.json``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import RESULTS_DIR, log, read_result
from _resume import tables

HERE = Path(__file__).resolve().parent
GPT_SETTINGS = "w2-m4-v4,w2-m3-v4,w2-m4-v2-wide,w2-m3-v2-wide"
MINILM_SETTINGS = "w2-m4-v4,w2-m3-v4,w2-m4-v2-wide,w8-m3-v2-wide"
# Result name -> (script, settings); several names may hold one experiment's settings.
RUNS = {
    "moment_ablation_gpt": ("resume_fidelity.py", GPT_SETTINGS),
    "moment_ablation_minilm": ("resume_minilm.py", MINILM_SETTINGS),
}


def _with_own_floor(result: dict[str, Any]) -> dict[str, Any]:
    """Add each row's worst seed-against-its-own-floor ratios if the JSON predates them."""
    for row in result["rows"]:
        for m in ("final", "curve"):
            key = f"{m}_x_own_noise_worst"
            if key not in row:
                pairs = [(run["settings"][row["setting"]]["dev"][m], run["settings"][row["setting"]]["noise_dev"][m])
                         for run in result["runs"]]
                row[key] = max(d / n if n > 0 else float("inf") for d, n in pairs)
    return result


def page(names: list[str]) -> str:
    """The markdown page from the result JSON files ``names``."""
    parts = ["# Moment and weight-delta bits, ablated", "",
             "Written by `python benchmarks/moment_ablation.py` from its JSON files; see the "
             "script's docstring for the settings' names. Sizes in bytes per parameter "
             "(as in the results page), deviations as multiples of the noise floor.", ""]
    for name in names:
        result = _with_own_floor(read_result(name))
        env = result["environment"]
        parts += [f"## {result['task']}", "", f"`{name}.json`; {env['machine']}.", "", tables(result), ""]
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-run", action="store_true", help="rebuild the page from the JSON files only")
    args = parser.parse_args()
    if not args.no_run:
        for name, (script, settings) in RUNS.items():
            t0 = time.perf_counter()
            subprocess.run([sys.executable, str(HERE / script), "--settings", settings, "--out", name],
                           cwd=HERE, check=True)
            log(f"{script} took {time.perf_counter() - t0:.0f} s")
    names = sorted(p.stem for p in RESULTS_DIR.glob("moment_ablation_*.json"))
    out = RESULTS_DIR / "moment_ablation.md"
    out.write_text(page(names), encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
