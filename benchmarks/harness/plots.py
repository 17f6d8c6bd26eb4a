"""The PNG plots of the results page (``make_results.py``), each drawn from one result JSON.

Needs matplotlib (the ``bench`` extra); drawn headless (Agg).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from harness.common import mib


def plot_fidelity(fid: dict[str, Any], path: Path) -> None:
    """Error, embedding cosine and size against block size, one line per bit width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    colors = {8: "tab:blue", 4: "tab:orange", 2: "tab:green"}
    for bits in sorted({r["bits"] for r in fid["rows"]}, reverse=True):
        rows = sorted((r for r in fid["rows"] if r["bits"] == bits), key=lambda r: r["block"])
        blocks = [r["block"] for r in rows]
        c = colors.get(bits)
        axes[0].plot(blocks, [r["rel_err_median"] for r in rows], "o-", color=c, label=f"int{bits} median")
        axes[0].plot(blocks, [r["rel_err_max"] for r in rows], "x--", color=c, label=f"int{bits} max")
        axes[1].plot(blocks, [1 - r["cos_mean"] for r in rows], "o-", color=c, label=f"int{bits} mean")
        axes[1].plot(
            blocks, [1 - r["cos_min"] for r in rows], "x--", color=c, label=f"int{bits} worst sentence"
        )
        axes[2].plot(blocks, [r["vs_safetensors"] for r in rows], "o-", color=c, label=f"int{bits}")
    titles = (
        "per-tensor relative error",
        "1 - cosine similarity of embeddings",
        "times smaller than fp32 safetensors",
    )
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block (elements per scale)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    fig.suptitle("all-MiniLM-L6-v2 stored by tw_triton (no reference)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_resume(res: dict[str, Any], path: Path, ylabel: str) -> None:
    """First seed: held-out loss of every run, and each restarted run's per-step deviation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = res["runs"][0]
    base, noise = run["base"], run["noise"]

    def curve(evals: dict[str, float]) -> tuple[list[int], list[float]]:
        steps = sorted(int(k) for k in evals)
        return steps, [evals[str(k)] if str(k) in evals else evals[k] for k in steps]

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    axes[0].plot(*curve(base["evals"]), color="black", lw=1.4, label="uninterrupted")
    axes[0].plot(*curve(noise["evals"]), color="grey", lw=1.2, ls="--", label="noise floor: other data order")
    colors = plt.get_cmap("tab10")
    tail_mean = sum(base["losses"]) / len(base["losses"])
    for i, (name, r) in enumerate(run["settings"].items()):
        axes[0].plot(
            *curve(r["evals"]), lw=0.9, color=colors(i % 10), label=f"{name} ({len(r['restarts'])} restarts)"
        )
        diff = [
            abs(a - b) / tail_mean if math.isfinite(a) else float("nan")
            for a, b in zip(r["losses"], base["losses"])
        ]
        # Steps where the curves agree exactly (before the first restart) are drawn at 1e-9.
        axes[1].plot(
            range(1, len(diff) + 1), [max(d, 1e-9) for d in diff], lw=0.7, color=colors(i % 10), label=name
        )
    first = next(iter(run["settings"].values()), None)
    for x in first["restarts"] if first else []:
        for ax in axes:
            ax.axvline(x["step"], color="grey", ls=":" if x["kind"] == "keyframe" else "-", lw=0.6, alpha=0.6)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel(f"held-out {ylabel}")
    axes[0].set_title(
        f"seed {run['seed']}: restarts at the vertical lines (solid: from a delta, dotted: keyframe)"
    )
    axes[0].legend(fontsize=7)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("step")
    axes[1].set_title("|training loss - uninterrupted| / mean loss, per step")
    axes[1].legend(fontsize=7)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speed(speed: dict[str, Any], path: Path) -> None:
    """Save (blocking and total) and load times per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    rows = speed["save_rows"]
    names = [r["method"] for r in rows]
    y = list(range(len(rows)))
    axes[0].barh([i + 0.2 for i in y], [r["total_s"] for r in rows], height=0.4, label="total save (durable)")
    axes[0].barh([i - 0.2 for i in y], [r["blocked_s"] for r in rows], height=0.4, label="blocks the loop")
    axes[0].set_yticks(y, names, fontsize=8)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("seconds (median)")
    axes[0].set_title("save")
    axes[0].legend(fontsize=8)
    lrows = speed["load_rows"]
    axes[1].barh(range(len(lrows)), [r["load_s"] for r in lrows], height=0.5)
    axes[1].set_yticks(range(len(lrows)), [r["method"] for r in lrows], fontsize=8)
    axes[1].invert_yaxis()
    axes[1].set_xlabel("seconds (median)")
    axes[1].set_title("load to CPU (every tensor read once)")
    for ax in axes:
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(f"MiniLM + AdamW state ({mib(speed['state']['state_bytes']):.0f} MiB of tensors)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
