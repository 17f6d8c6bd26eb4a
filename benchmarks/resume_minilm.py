"""Resume fidelity on a pretrained model: fine-tune all-MiniLM-L6-v2, checkpoint, resume.

The same experiment as ``resume_fidelity.py`` (keyframe, one checkpoint per setting,
resume on the same batches, compare loss curves), on the pretrained MiniLM with AdamW and
dropout on. The task is built from local files: match a Python standard-library function's
docstring summary to its signature (in-batch contrastive loss, as sentence-transformers'
multiple-negatives ranking loss), pairs extracted with ``ast`` from the same stdlib modules
as the GPT corpus. The checkpoint holds model, AdamW and the torch RNG state (dropout).

Run: ``python benchmarks/resume_minilm.py`` (a few minutes on 2 cores). Writes
``benchmarks/results/resume_minilm.json``. Needs the ``bench`` extra.
"""

from __future__ import annotations

import argparse
import ast
import copy
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from _common import log, write_result
from _minilm import embed, load_minilm
from resume_fidelity import CORPUS_FILES, SETTINGS, run_schedule, summarize, table


@dataclass(frozen=True)
class Config:
    """Sizes of the fine-tuning run."""

    batch: int = 8
    lr: float = 5e-5
    steps: int = 55
    keyframe: int = 30
    at: int = 40
    eval_batches: int = 4
    max_length: int = 48


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
    """Contrastive fine-tuning of MiniLM; batches are a pure function of (seed, step)."""

    def __init__(
        self, cfg: Config, pairs: list[tuple[str, str]], seed: int, pretrained: tuple[torch.nn.Module, Any]
    ) -> None:
        self.cfg = cfg
        self.seed = seed
        split = int(len(pairs) * 0.9)
        self.train_pairs = pairs[:split]
        self.val_pairs = pairs[split:]
        torch.manual_seed(seed)
        # A private copy of the pretrained model (reading it from the package every time
        # would cost seconds per resume); the tokenizer holds no training state.
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
        loss = self._loss(self._batch(self.train_pairs, self.seed * 1_000_003 + self.step))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.step += 1
        return float(loss.detach())

    @torch.no_grad()
    def eval_loss(self) -> float:
        """Mean loss over fixed held-out batches (dropout off)."""
        self.model.eval()
        losses = [float(self._loss(self._batch(self.val_pairs, 7_777 + i))) for i in range(self.cfg.eval_batches)]
        return sum(losses) / len(losses)

    def state(self) -> dict[str, Any]:
        """Model, AdamW, step and the torch RNG state (dropout masks come from it)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "step": self.step,
            "rng": torch.get_rng_state(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Put a loaded checkpoint back."""
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        torch.set_rng_state(state["rng"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--keyframe", type=int, default=Config.keyframe)
    parser.add_argument("--at", type=int, default=Config.at)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    if not 0 <= args.keyframe <= args.at < args.steps:
        parser.error("need 0 <= --keyframe <= --at < --steps")
    torch.set_num_threads(args.threads)
    cfg = Config(steps=args.steps, keyframe=args.keyframe, at=args.at)
    pairs = docstring_pairs()
    log(f"{len(pairs)} docstring/signature pairs")
    pretrained = load_minilm()
    runs = []
    for seed in args.seeds:
        runs.append(run_schedule(lambda: MiniLMTrainer(cfg, pairs, seed, pretrained), seed, cfg.steps,
                                 cfg.keyframe, cfg.at, SETTINGS))
    result = {
        "task": "fine-tune all-MiniLM-L6-v2: stdlib docstring summary -> function signature",
        "pairs": len(pairs),
        "params": sum(p.numel() for p in pretrained[0].parameters()),
        "config": asdict(cfg),
        "rows": summarize(runs, SETTINGS),
        "runs": runs,
    }
    path = write_result("resume_minilm", result)
    print(f"MiniLM fine-tune, {len(pairs)} pairs; keyframe at {cfg.keyframe}, checkpoint at {cfg.at}, "
          f"resumed to {cfg.steps}; seeds {args.seeds}")
    print(table(result))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
