"""Framework integrations: checkpoint folder size and the time a save blocks training.

For the Hugging Face ``Trainer`` (stock vs :class:`~tw_triton.integrations.transformers.TwTrainer`)
and Lightning (stock ``TorchCheckpointIO`` vs
:class:`~tw_triton.integrations.lightning.TwCheckpointIO`), the same model, data and seed
train the same steps and save every ``--save-every`` steps, side by side in one run
(stock, tw, stock, tw, ... for ``--repeats`` rounds). Reported:

- size: all bytes under the run's output folder after training (every checkpoint; no
  retention), and the ratio stock / tw;
- blocked: the median wall time of one save call on the training thread
  (``Trainer._save_checkpoint``; ``CheckpointIO.save_checkpoint``), and the ratio tw / stock.
  tw_triton writes (and fsyncs) on a background thread; the stock savers write inline and
  do not fsync.

Models: ``tiny`` is the BertConfig / LightningModule of the integration tests (~0.1 M
parameters), ``small`` the same shapes wider (BERT 4.3 M, MLP 0.4 M); AdamW in both. CPU only.

    python benchmarks/integrations.py                      # tiny and small, 3 rounds
    python benchmarks/integrations.py --models tiny --repeats 1

``--lightning-stall`` measures the pause of Lightning's ``save_checkpoint`` on a larger
state instead: a Lightning-shaped checkpoint dict (three fp32 matrices, AdamW's moments,
counters) saved ``--saves`` times per plugin, each plugin in a fresh subprocess, plugins
taking turns for ``--repeats`` rounds, the writer idle at each save. Plugins: ``stock``
(``TorchCheckpointIO``: inline ``torch.save``, no fsync), ``tw`` (``TwCheckpointIO()``),
``tw after prepare`` (``prepare`` called before the first save, as ``TwPrepareFirstSave``
does) and ``tw, no pool`` (``snapshot_pool_bytes=0``). Reported: the first save's pause
and the median of the later ones. Writes ``results/lightning_stall.{json,md}``
(not with ``--quick``)::

    python benchmarks/integrations.py --lightning-stall           # 3 x (2048 x 4096): 288 MiB with AdamW
    python benchmarks/integrations.py --lightning-stall --quick   # tiny, for the tests
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

MODELS = {
    # hidden, layers, intermediate, vocab (BERT); the Lightning MLP uses hidden x 2*hidden
    "tiny": (64, 2, 128, 128),
    "small": (256, 4, 1024, 4096),
}
SEQ = 16
HERE = Path(__file__).resolve().parent
STALL_METHODS = ("stock", "tw", "tw after prepare", "tw, no pool")


def folder_bytes(root: Path) -> int:
    """Bytes of every file under ``root``."""
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


# ------------------------------------------------------------------ Hugging Face


def hf_run(kind: str, size: str, out: Path, steps: int, save_every: int) -> tuple[int, list[float]]:
    import transformers

    from tw_triton.integrations.transformers import TwTrainer

    hidden, layers, inter, vocab = MODELS[size]
    config = transformers.BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=inter,
        max_position_embeddings=SEQ,
        num_labels=2,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (64, SEQ), generator=g)
    data = [{"input_ids": ids[i], "labels": (ids[i, 0] % 2).long()} for i in range(len(ids))]
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        save_steps=save_every,
        save_strategy="steps",
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        logging_strategy="no",
    )
    cls = transformers.Trainer if kind == "stock" else TwTrainer
    trainer = cls(model=model, args=args, train_dataset=data)
    times: list[float] = []
    inner = trainer._save_checkpoint

    def timed(*a, **kw):
        t0 = time.perf_counter()
        inner(*a, **kw)
        times.append(time.perf_counter() - t0)

    trainer._save_checkpoint = timed
    trainer.train()  # TwTrainer.train returns once every file is written
    return folder_bytes(out), times


# --------------------------------------------------------------------- Lightning


def pl_run(kind: str, size: str, out: Path, steps: int, save_every: int) -> tuple[int, list[float]]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    from torch.utils.data import DataLoader, TensorDataset

    from tw_triton.integrations.lightning import TwCheckpointIO

    hidden = MODELS[size][0] * 2
    width = MODELS[size][0]

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(width, hidden),
                torch.nn.Tanh(),
                torch.nn.Linear(hidden, hidden),
                torch.nn.Tanh(),
                torch.nn.Linear(hidden, 1),
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(16 * steps, width, generator=g)
    io = TorchCheckpointIO() if kind == "stock" else TwCheckpointIO()
    times: list[float] = []
    inner = io.save_checkpoint

    def timed(*a, **kw):
        t0 = time.perf_counter()
        inner(*a, **kw)
        times.append(time.perf_counter() - t0)

    io.save_checkpoint = timed
    trainer = pl.Trainer(
        max_steps=steps,
        plugins=[io],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        callbacks=[ModelCheckpoint(dirpath=str(out), every_n_train_steps=save_every, save_top_k=-1)],
    )
    trainer.fit(Module(), DataLoader(TensorDataset(x, x[:, :1]), batch_size=16))
    if hasattr(io, "flush"):
        io.flush()  # teardown already waited; this is a no-op kept for clarity
    return folder_bytes(out), times


# ------------------------------------------------------------ Lightning save stall


def checkpoint_dict(rows: int, cols: int, count: int) -> dict[str, Any]:
    """What Lightning hands ``save_checkpoint``: weights, AdamW state, counters."""
    g = torch.Generator().manual_seed(0)
    weights = OrderedDict((f"net.{i}.weight", torch.randn(rows, cols, generator=g)) for i in range(count))
    state = {
        i: {
            "step": torch.tensor(10.0),
            "exp_avg": torch.randn(rows, cols, generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(rows, cols, generator=g) * 1e-6,
        }
        for i in range(count)
    }
    groups = [
        {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "params": list(range(count))}
    ]
    return {
        "epoch": 0,
        "global_step": 10,
        "state_dict": weights,
        "optimizer_states": [{"state": state, "param_groups": groups}],
    }


def make_io(method: str) -> Any:
    """The checkpoint plugin that ``method`` names."""
    if method == "stock":
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        return TorchCheckpointIO()
    from tw_triton.integrations.lightning import TwCheckpointIO

    return TwCheckpointIO(
        snapshot_pool_bytes=0 if method == "tw, no pool" else None
    )  # "tw", "tw after prepare"


def stall_child(method: str, rows: int, cols: int, count: int, saves: int) -> dict[str, Any]:
    """Run one method's saves in this process; return its pauses in seconds."""
    ckpt = checkpoint_dict(rows, cols, count)
    io = make_io(method)
    if method == "tw after prepare":
        io.prepare(ckpt)
    pauses = []
    with tempfile.TemporaryDirectory() as out:
        for k in range(saves):
            ckpt["global_step"] = 10 + k
            t0 = time.perf_counter()
            io.save_checkpoint(ckpt, f"{out}/step={k}.ckpt")
            pauses.append(time.perf_counter() - t0)
            if hasattr(io, "flush"):
                io.flush()  # outside the timed region: the writer is idle at the next save
        if hasattr(io, "teardown"):
            io.teardown()
    nbytes = sum(t.nbytes for t in ckpt["state_dict"].values()) * 3
    return {"pauses_s": pauses, "state_bytes": nbytes}


def stall_run(rows: int, cols: int, count: int, saves: int, repeats: int) -> dict[str, Any]:
    """Every method ``repeats`` times, each in a fresh subprocess, methods alternating."""
    per: dict[str, list[list[float]]] = {m: [] for m in STALL_METHODS}
    state_bytes = 0
    for _ in range(repeats):
        for method in STALL_METHODS:
            cmd = [
                sys.executable,
                __file__,
                "--lightning-stall",
                "--child",
                method,
                "--shape",
                f"{rows}x{cols}x{count}",
                "--saves",
                str(saves),
            ]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            got = json.loads(done.stdout.strip().splitlines()[-1])
            per[method].append(got["pauses_s"])
            state_bytes = got["state_bytes"]
    rows_out = []
    for method in STALL_METHODS:
        firsts = [p[0] for p in per[method]]
        later = [statistics.median(p[1:]) for p in per[method] if len(p) > 1]
        rows_out.append(
            {
                "method": method,
                "first_s": statistics.median(firsts),
                "later_s": statistics.median(later) if later else None,
            }
        )
    stock = rows_out[0]
    for r in rows_out:
        r["first_vs_stock"] = r["first_s"] / stock["first_s"]
        r["later_vs_stock"] = r["later_s"] / stock["later_s"] if r["later_s"] and stock["later_s"] else None
    return {
        "state_bytes": state_bytes,
        "shape": [rows, cols, count],
        "saves": saves,
        "repeats": repeats,
        "rows": rows_out,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
    }


def stall_table(result: dict[str, Any]) -> str:
    """The markdown table of a :func:`stall_run` result."""
    lines = [
        "| plugin | first save blocks | vs stock | later saves block (median) | vs stock |",
        "|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        later = f"{1e3 * r['later_s']:.1f} ms" if r["later_s"] is not None else "-"
        ratio = f"{r['later_vs_stock']:.2f}" if r["later_vs_stock"] is not None else "-"
        lines.append(
            f"| {r['method']} | {1e3 * r['first_s']:.1f} ms | {r['first_vs_stock']:.2f} | {later} | {ratio} |"
        )
    return "\n".join(lines)


def stall_main(args: argparse.Namespace) -> int:
    """``--lightning-stall``: run (or, with ``--child``, be one child of) the stall measurement."""
    rows, cols, count = (int(v) for v in args.shape.split("x"))
    if args.child:
        print(json.dumps(stall_child(args.child, rows, cols, count, args.saves)))
        return 0
    if args.quick:
        rows, cols, count, args.saves, args.repeats = 256, 256, 2, 3, 1
    result = stall_run(rows, cols, count, args.saves, args.repeats)
    text = stall_table(result)
    print(text)
    if args.quick:
        return 0
    page = "\n".join(
        [
            "# Lightning: how long a save holds up training",
            "",
            f"Machine: {result['machine']}; torch {result['torch']}. State: {count} fp32 matrices of "
            f"{rows} x {cols} with AdamW's two moments, {result['state_bytes'] / 2**20:.0f} MiB. "
            f"{result['saves']} saves per process (the writer idle at each), each method in a fresh "
            f"process, methods alternating, {result['repeats']} rounds; medians.",
            "",
            "Command: `python benchmarks/integrations.py --lightning-stall`",
            "",
            text,
            "",
            "`stock` writes inline without fsync; the tw rows copy the state and write (with fsync) "
            "on a background thread. The first save of a process copies into fresh memory either "
            "way unless `prepare` reserved it; later ones reuse the pool's buffers unless `snapshot_pool_bytes=0`.",
            "",
        ]
    )
    (HERE / "results" / "lightning_stall.md").write_text(page, encoding="utf-8")
    (HERE / "results" / "lightning_stall.json").write_text(json.dumps(result, indent=1), encoding="utf-8")

    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny", "small"], choices=list(MODELS))
    p.add_argument("--frameworks", nargs="+", default=["hf", "lightning"], choices=["hf", "lightning"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--lightning-stall", action="store_true", help="time Lightning save pauses instead (see above)"
    )
    p.add_argument(
        "--quick", action="store_true", help="with --lightning-stall: tiny state, 1 round, nothing written"
    )
    p.add_argument("--saves", type=int, default=6, help="with --lightning-stall: saves per process")
    p.add_argument("--shape", default="2048x4096x3", help="with --lightning-stall: rows x cols x matrices")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.lightning_stall:
        return stall_main(args)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    runs = {"hf": hf_run, "lightning": pl_run}
    print(f"steps {args.steps}, a save every {args.save_every} (AdamW, CPU, torch {torch.__version__})\n")
    print(
        "| framework | model | stock folder | tw folder | stock / tw | stock save blocks | tw save blocks | tw / stock |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for fw in args.frameworks:
        for size in args.models:
            sizes: dict[str, int] = {}
            times: dict[str, list[float]] = {"stock": [], "tw": []}
            for _ in range(args.repeats):
                for kind in ("stock", "tw"):
                    out = Path(tempfile.mkdtemp(prefix=f"twbench-{fw}-{kind}-"))
                    try:
                        with contextlib.redirect_stdout(io.StringIO()):  # Trainer prints its metrics
                            nbytes, t = runs[fw](kind, size, out, args.steps, args.save_every)
                    finally:
                        shutil.rmtree(out, ignore_errors=True)
                    sizes[kind] = nbytes
                    times[kind] += t
            med = {k: statistics.median(v) for k, v in times.items()}
            print(
                f"| {fw} | {size} | {sizes['stock'] / 2**20:.2f} MiB | {sizes['tw'] / 2**20:.2f} MiB | "
                f"{sizes['stock'] / sizes['tw']:.2f}x | {med['stock'] * 1e3:.1f} ms | {med['tw'] * 1e3:.1f} ms | "
                f"{med['tw'] / med['stock']:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
