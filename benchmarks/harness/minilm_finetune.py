"""The MiniLM fine-tuning task of the restart experiment (``resume_fidelity.py --model minilm``).

The pretrained all-MiniLM-L6-v2 is fine-tuned with AdamW and dropout on to match a Python
standard-library function's docstring summary to its signature (in-batch contrastive loss,
as sentence-transformers' multiple-negatives ranking loss), pairs extracted with ``ast``
from the same stdlib modules as the GPT corpus. The Checkpointer stores model, AdamW and
the RNG states (dropout masks come from torch's). Needs the ``bench`` extra.
"""

from __future__ import annotations

import ast
import copy
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from harness.common import log
from harness.minilm import embed, load_minilm
from harness.restarts import Plan, run_seed, summarize
from harness.settings import ResumeSetting
from harness.tiny_gpt import CORPUS_FILES


@dataclass(frozen=True)
class Config:
    """Sizes of the fine-tuning run."""

    batch: int = 8
    lr: float = 5e-5
    steps: int = 76
    save_every: int = 2
    eval_every: int = 8
    eval_batches: int = 4
    max_length: int = 48

    restart_every: int | None = None

    def plan(self, min_restarts: int = 8) -> Plan:
        """When the runs save, evaluate and restart."""
        return Plan(self.steps, self.save_every, self.eval_every, min_restarts, self.restart_every)


QUICK = Config(batch=4, steps=6, save_every=1, eval_every=3, eval_batches=1, max_length=16)


def docstring_pairs() -> list[tuple[str, str]]:
    """(docstring summary line, ``def name(args)``) for documented stdlib functions."""
    root = Path(sysconfig.get_paths()["stdlib"])
    pairs = []
    for name in CORPUS_FILES:
        tree = ast.parse((root / name).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc or node.name.startswith("_"):
                continue
            summary = doc.strip().splitlines()[0].strip()
            if len(summary) < 12:
                continue
            pairs.append((summary, f"def {node.name}({ast.unparse(node.args)})"))
    # De-duplicate summaries: two positives for one anchor would make the loss ill-posed.
    seen: set[str] = set()
    unique = []
    for s, d in pairs:
        if s not in seen:
            seen.add(s)
            unique.append((s, d))
    return unique


class MiniLMTrainer:
    """Contrastive fine-tuning of MiniLM; batches are a pure function of (data seed, step)."""

    def __init__(
        self,
        cfg: Config,
        pairs: list[tuple[str, str]],
        seed: int,
        pretrained: tuple[torch.nn.Module, Any],
        data_seed: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.data_seed = seed if data_seed is None else data_seed
        split = int(len(pairs) * 0.9)
        self.train_pairs = pairs[:split]
        self.val_pairs = pairs[split:]
        torch.manual_seed(seed)  # dropout masks (the restored runs get the saved RNG state)
        # A private copy of the pretrained model (reading it from the package every time
        # would cost seconds per restart); the tokenizer holds no training state.
        self.model = copy.deepcopy(pretrained[0])
        self.tokenizer = pretrained[1]
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.01)
        self.step = 0

    def _loss(self, batch: list[tuple[str, str]]) -> torch.Tensor:
        a = embed(self.model, self.tokenizer, [p[0] for p in batch], self.cfg.max_length)
        b = embed(self.model, self.tokenizer, [p[1] for p in batch], self.cfg.max_length)
        return F.cross_entropy(a @ b.T * 20.0, torch.arange(len(batch)))

    def _batch(self, pairs: list[tuple[str, str]], key: int) -> list[tuple[str, str]]:
        gen = torch.Generator().manual_seed(key)
        idx = torch.randperm(len(pairs), generator=gen)[: self.cfg.batch]
        return [pairs[i] for i in idx.tolist()]

    def train_step(self) -> float:
        """One AdamW step (dropout on) on the batch of the current step; returns its loss."""
        self.model.train()
        loss = self._loss(self._batch(self.train_pairs, self.data_seed * 1_000_003 + self.step))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.step += 1
        return float(loss.detach())

    @torch.no_grad()
    def eval_loss(self) -> float:
        """Mean loss over fixed held-out batches (dropout off: no RNG drawn)."""
        self.model.eval()
        losses = [
            float(self._loss(self._batch(self.val_pairs, 7_777 + i))) for i in range(self.cfg.eval_batches)
        ]
        return sum(losses) / len(losses)

    def objects(self) -> dict[str, Any]:
        """What a checkpoint holds, by name (the Checkpointer adds the RNG states)."""
        return {"model": self.model, "optimizer": self.opt}


def run(
    cfg: Config,
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
    pairs = docstring_pairs()
    log(f"{len(pairs)} docstring/signature pairs")
    pretrained = load_minilm()
    runs = [
        run_seed(
            lambda data_seed, s=seed: MiniLMTrainer(cfg, pairs, s, pretrained, data_seed),
            seed,
            plan,
            settings,
            exact_check=exact_check and i == 0,
            baselines=(baselines or {}).get(seed),
        )
        for i, seed in enumerate(seeds)
    ]
    params = sum(p.numel() for p in pretrained[0].parameters())
    return {
        "task": "fine-tune all-MiniLM-L6-v2: stdlib docstring summary -> function signature, repeated restarts",
        "pairs": len(pairs),
        "params": params,
        "config": asdict(cfg),
        "restart_steps": {s.label: plan.restart_steps(s.keyframe_every) for s in settings},
        **summarize(runs, settings, params),
        "runs": runs,
    }
