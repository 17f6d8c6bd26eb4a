"""The tiny GPT task of the restart experiment (``resume_fidelity.py --model gpt``).

A byte-level GPT trains from scratch with AdamW and a cosine schedule on a corpus built from
Python standard-library source files found on disk. Batches are a pure function of (data
seed, step), so the data order survives restarts. :func:`run` drives
:func:`harness.restarts.run_seed` for every seed and returns the JSON result.
"""

from __future__ import annotations

import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.restarts import Plan, run_seed, summarize
from harness.settings import ResumeSetting

# Standard-library modules present in every CPython 3.10+; their text is the corpus.
CORPUS_FILES = (
    "argparse.py",
    "textwrap.py",
    "difflib.py",
    "inspect.py",
    "typing.py",
    "functools.py",
    "shutil.py",
    "tarfile.py",
    "string.py",
    "dataclasses.py",
    "enum.py",
    "ast.py",
)


def load_corpus() -> torch.Tensor:
    """The corpus as a uint8 tensor (bytes of the files in :data:`CORPUS_FILES`)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in CORPUS_FILES:
        path = root / name
        if not path.is_file():
            raise FileNotFoundError(f"corpus file {path} is missing from this Python install")
        parts.append(path.read_bytes())
    data = b"\n".join(parts)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Byte-level GPT (256-symbol vocabulary, learned positions, untied head)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_heads) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, 256)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


@dataclass(frozen=True)
class Config:
    """Sizes of the model and of the run."""

    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    context: int = 64
    batch: int = 8
    lr: float = 2e-3
    steps: int = 480
    save_every: int = 5
    eval_every: int = 20
    eval_batches: int = 8

    restart_every: int | None = None

    def plan(self, min_restarts: int = 8) -> Plan:
        """When the runs save, evaluate and restart."""
        return Plan(self.steps, self.save_every, self.eval_every, min_restarts, self.restart_every)


QUICK = Config(
    d_model=32,
    n_layers=1,
    n_heads=2,
    context=16,
    batch=4,
    steps=24,
    save_every=1,
    eval_every=4,
    eval_batches=2,
)


class Trainer:
    """Model, AdamW and cosine schedule; batches are a pure function of (data seed, step).

    The initial weights come from ``seed``; ``data_seed`` (default ``seed``) orders the data.
    """

    def __init__(self, cfg: Config, corpus: torch.Tensor, seed: int, data_seed: int | None = None) -> None:
        self.cfg = cfg
        self.data_seed = seed if data_seed is None else data_seed
        split = int(len(corpus) * 0.9)
        self.train_data = corpus[:split].long()
        self.val_data = corpus[split:].long()
        torch.manual_seed(seed)
        self.model = TinyGPT(cfg)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=cfg.steps)
        self.step = 0

    def _batch(self, data: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(key)
        starts = torch.randint(0, len(data) - self.cfg.context - 1, (self.cfg.batch,), generator=gen)
        idx = starts.unsqueeze(1) + torch.arange(self.cfg.context + 1)
        window = data[idx]
        return window[:, :-1], window[:, 1:]

    def train_step(self) -> float:
        """One optimizer step on the batch of the current step; returns its loss."""
        x, y = self._batch(self.train_data, self.data_seed * 1_000_003 + self.step)
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.step += 1
        return float(loss.detach())

    @torch.no_grad()
    def eval_loss(self) -> float:
        """Mean loss over fixed held-out batches."""
        losses = []
        for i in range(self.cfg.eval_batches):
            x, y = self._batch(self.val_data, 7_777 + i)
            losses.append(float(F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())))
        return sum(losses) / len(losses)

    def objects(self) -> dict[str, Any]:
        """What a checkpoint holds, by name."""
        return {"model": self.model, "optimizer": self.opt, "scheduler": self.sched}


def run(
    cfg: Config,
    corpus: torch.Tensor,
    seeds: list[int],
    settings: tuple[ResumeSetting, ...],
    *,
    exact_check: bool = True,
    min_restarts: int = 8,
    baselines: dict[int, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Every seed's runs and the summary, as the JSON result (less the environment);
    ``baselines``: earlier runs by seed whose uninterrupted and noise runs are reused."""
    plan = cfg.plan(min_restarts)
    runs = [
        run_seed(
            lambda data_seed, s=seed: Trainer(cfg, corpus, s, data_seed),
            seed,
            plan,
            settings,
            exact_check=exact_check and i == 0,
            baselines=(baselines or {}).get(seed),
        )
        for i, seed in enumerate(seeds)
    ]
    params = sum(p.numel() for p in TinyGPT(cfg).parameters())
    return {
        "task": "byte-level GPT on Python stdlib source, repeated restarts",
        "corpus_files": list(CORPUS_FILES),
        "corpus_bytes": int(corpus.numel()),
        "params": params,
        "config": asdict(cfg),
        "restart_steps": {s.label: plan.restart_steps(s.keyframe_every) for s in settings},
        **summarize(runs, settings, params),
        "runs": runs,
    }
