"""How large a low-bit optimizer's checkpoint is: tw_triton against torch.save and plain DCP.

Trains a two-layer MLP (``--width``; 1024 gives 8.4 M parameters) a few steps with each
low-bit optimizer that is installed (torchao AdamW8bit / AdamW4bit / AdamWFp8,
bitsandbytes AdamW8bit), then stores ``{"model", "optimizer"}`` five ways: ``torch.save``,
plain DCP (``FileSystemWriter``), ``tw_triton.save`` with every tensor exact, and a
``Checkpointer`` (its defaults: preset ``smallest``, closed loop) keyframe and the delta one
step later. The optimizers' own quantized states are stored as they are in every tw_triton
file (docs/training-loop.md, "Low-bit optimizers").

Run: ``python benchmarks/lowbit_sizes.py`` (about 5 minutes on a shared 2-core VM;
``--quick``: a small MLP, printed only). Writes ``benchmarks/results/lowbit_sizes.json`` and ``lowbit_sizes.md``.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from harness.common import RESULTS_DIR, environment, fmt_table, log, write_result

import tw_triton

OPTIMIZERS = {
    "torchao AdamW8bit": ("torchao.optim", "AdamW8bit"),
    "torchao AdamW4bit": ("torchao.optim", "AdamW4bit"),
    "torchao AdamWFp8": ("torchao.optim", "AdamWFp8"),
    "bitsandbytes AdamW8bit": ("bitsandbytes.optim", "AdamW8bit"),
}
STEPS = 4


def optimizer_class(module: str, name: str) -> type | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return getattr(importlib.import_module(module), name)
    except ImportError:
        return None


def train(model: torch.nn.Module, opt: Any, steps: range, width: int) -> None:
    for step in steps:
        x = torch.randn(16, width, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(width: int) -> list[dict[str, Any]]:
    """Bytes of each way of storing each installed optimizer's state."""
    import torch.distributed.checkpoint as dcp

    rows = []
    for label, (module, name) in OPTIMIZERS.items():
        cls = optimizer_class(module, name)
        if cls is None:
            log(f"{label}: not installed, skipped")
            continue
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width))
        opt = cls(model.parameters(), lr=1e-3)
        train(model, opt, range(STEPS), width)
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        with tempfile.TemporaryDirectory() as tmp:
            tmpdir = Path(tmp)
            buf = io.BytesIO()
            torch.save(state, buf)
            dcp.save(state, checkpoint_id=os.fspath(tmpdir / "dcp"), no_dist=True)
            exact = tw_triton.save(tw_triton.quantize_state_dict(state, rules="exact"), tmpdir / "exact.tw")
            with tw_triton.Checkpointer(tmpdir / "run", keyframe_every=10, fsync=False) as ckpt:
                ckpt.save(0, model=model, optimizer=opt)
                train(model, opt, range(STEPS, STEPS + 1), width)
                ckpt.save(1, model=model, optimizer=opt)
            rows.append(
                {
                    "optimizer": label,
                    "params": sum(p.numel() for p in model.parameters()),
                    "torch_save": buf.tell(),
                    "plain_dcp": dir_bytes(tmpdir / "dcp"),
                    "tw_exact": exact,
                    "tw_keyframe": (tmpdir / "run" / "step-00000000.tw.safetensors").stat().st_size,
                    "tw_delta": (tmpdir / "run" / "step-00000001.tw.safetensors").stat().st_size,
                }
            )
        log(f"{label}: {rows[-1]}")
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: MiB of each way, and torch.save's size over it."""

    def cell(r: dict[str, Any], key: str) -> str:
        return f"{r[key] / 2**20:.2f} ({r['torch_save'] / r[key]:.2f}x)"

    keys = ["plain_dcp", "tw_exact", "tw_keyframe", "tw_delta"]
    body = [[r["optimizer"], f"{r['torch_save'] / 2**20:.2f}", *(cell(r, k) for k in keys)] for r in rows]
    headers = ["optimizer", "torch.save MiB", "plain DCP", "tw exact", "tw keyframe", "tw delta"]
    return fmt_table(headers, body)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="a small MLP (width 64), printed only")
    args = parser.parse_args(argv)
    width = 64 if args.quick else args.width
    rows = measure(width)
    text = "\n".join(
        [
            "# Low-bit optimizer checkpoints",
            "",
            f"Written by `python benchmarks/lowbit_sizes.py`. {environment()['machine']}; MLP of width "
            f"{width}, {STEPS} steps. MiB, and in parentheses how many times smaller than torch.save.",
            "",
            table(rows),
            "",
        ]
    )
    if not args.quick:
        write_result("lowbit_sizes", {"width": width, "steps": STEPS, "rows": rows})
        (RESULTS_DIR / "lowbit_sizes.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
