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
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

MODELS = {
    # hidden, layers, intermediate, vocab (BERT); the Lightning MLP uses hidden x 2*hidden
    "tiny": (64, 2, 128, 128),
    "small": (256, 4, 1024, 4096),
}
SEQ = 16


def folder_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


# ------------------------------------------------------------------ Hugging Face


def hf_run(kind: str, size: str, out: Path, steps: int, save_every: int) -> tuple[int, list[float]]:
    import transformers

    from tw_triton.integrations.transformers import TwTrainer

    hidden, layers, inter, vocab = MODELS[size]
    config = transformers.BertConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=inter, max_position_embeddings=SEQ, num_labels=2,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (64, SEQ), generator=g)
    data = [{"input_ids": ids[i], "labels": (ids[i, 0] % 2).long()} for i in range(len(ids))]
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, save_steps=save_every, save_strategy="steps",
        per_device_train_batch_size=8, learning_rate=1e-3, report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, logging_strategy="no",
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
                torch.nn.Linear(width, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden),
                torch.nn.Tanh(), torch.nn.Linear(hidden, 1),
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
        max_steps=steps, plugins=[io], logger=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", devices=1,
        callbacks=[ModelCheckpoint(dirpath=str(out), every_n_train_steps=save_every, save_top_k=-1)],
    )
    trainer.fit(Module(), DataLoader(TensorDataset(x, x[:, :1]), batch_size=16))
    if hasattr(io, "flush"):
        io.flush()  # teardown already waited; this is a no-op kept for clarity
    return folder_bytes(out), times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny", "small"], choices=list(MODELS))
    p.add_argument("--frameworks", nargs="+", default=["hf", "lightning"], choices=["hf", "lightning"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    runs = {"hf": hf_run, "lightning": pl_run}
    print(f"steps {args.steps}, a save every {args.save_every} (AdamW, CPU, torch {torch.__version__})\n")
    print("| framework | model | stock folder | tw folder | stock / tw | stock save blocks | tw save blocks | tw / stock |")
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
