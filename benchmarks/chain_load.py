"""What a closed-loop chain costs a load: the keyframe, the first delta and the ninth.

Builds the MiniLM + AdamW state of ``speed_compare.py``, saves a keyframe and 9 deltas with
a ``Checkpointer`` in closed loop (its defaults) and in open loop (``rules="small"``, the
open-loop preset), moving the state a little between saves, then times
``Checkpointer.load(step)`` of steps 0, 1 and 9 in this process (best of ``--repeats``,
warm page cache, 1 torch thread). Closed loop decodes every link up to the step; open loop
reads the keyframe and the one delta.

Run: ``python benchmarks/chain_load.py`` (about a minute). Writes
``benchmarks/results/chain_load.json`` and ``chain_load.md``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness.common import RESULTS_DIR, environment, fmt_table, log, write_result
from harness.fixture import build_fixture, perturb

import tw_triton

SETTINGS = {"closed (defaults)": {}, "open (small)": {"delta": "open", "rules": "small"}}
STEPS = (0, 1, 9)


def measure(repeats: int) -> dict[str, Any]:
    """Load times by setting and step, and the state's size."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        info = build_fixture(tmpdir / "fixture.pt")
        for label, options in SETTINGS.items():
            state = torch.load(tmpdir / "fixture.pt", weights_only=True)
            directory = tmpdir / label.split()[0]
            ck = tw_triton.Checkpointer(directory, keyframe_every=100, keep_last=None, fsync=False, **options)
            for step in range(max(STEPS) + 1):
                ck.save(step, model=state["model"], optimizer=state["optimizer"]).result()
                perturb(state)
            ck.close()
            reader = tw_triton.Checkpointer(directory)
            for step in STEPS:
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    reader.load(step)
                    times.append(time.perf_counter() - t0)
                rows.append(
                    {
                        "setting": label,
                        "step": step,
                        "load_s": min(times),
                        "file_bytes": Path(reader.path_for(step)).stat().st_size,
                    }
                )
                log(f"{label} step {step}: {min(times):.3f} s")
    return {"state": info, "repeats": repeats, "rows": rows}


def table(result: dict[str, Any]) -> str:
    """Markdown: load time per setting and step, and the step's time over the keyframe's."""
    base = {r["setting"]: r["load_s"] for r in result["rows"] if r["step"] == 0}
    body = [
        [
            r["setting"],
            r["step"],
            "keyframe" if r["step"] == 0 else f"delta, link {r['step']}",
            f"{r['load_s']:.3f}",
            f"{r['load_s'] / base[r['setting']]:.2f}x",
        ]
        for r in result["rows"]
    ]
    return fmt_table(["setting", "step", "file", "load (s)", "vs keyframe load"], body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure(args.repeats)
    write_result("chain_load", result)
    env = environment()
    text = "\n".join(
        [
            "# Loading along a closed-loop chain",
            "",
            f"Written by `python benchmarks/chain_load.py`. {env['machine']}; "
            f"{result['state']['params']} parameters + AdamW ({result['state']['state_bytes'] / 2**20:.1f} MiB), "
            f"best of {args.repeats} loads in one process, warm page cache, 1 torch thread.",
            "",
            table(result),
            "",
        ]
    )
    (RESULTS_DIR / "chain_load.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
