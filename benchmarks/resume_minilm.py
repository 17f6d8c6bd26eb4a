"""Resume fidelity under repeated restarts on a pretrained model: fine-tuning all-MiniLM-L6-v2.

The same experiment as ``resume_fidelity.py`` (see ``_resume.py``: uninterrupted run, noise
floor from another data order, per setting a run killed and restored from its own
Checkpointer at least 8 times), on the pretrained MiniLM with AdamW and dropout on. The task
is built from local files: match a Python standard-library function's docstring summary to
its signature (in-batch contrastive loss, as sentence-transformers' multiple-negatives
ranking loss), pairs extracted with ``ast`` from the same stdlib modules as the GPT corpus.
The Checkpointer stores model, AdamW and the RNG states (dropout masks come from torch's).

Defaults fit about 6 minutes on 2 quiet cores: 2 seeds, the Checkpointer's default preset
only, ``keyframe_every`` 4 (a step costs about half a second, a save as much), 76 steps with
a save every 2. ``--settings`` runs more (any preset by name). Run:
``python benchmarks/resume_minilm.py``. Writes ``benchmarks/results/resume_minilm.json``.
Needs the ``bench`` extra.
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
from _resume import Plan, run_seed, summarize, tables
from _twapi import ResumeSetting, parse_settings
from resume_fidelity import CORPUS_FILES
from tw_triton.checkpointer import DEFAULT_RULES


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

    def plan(self, min_restarts: int = 8) -> Plan:
        """When the runs save, evaluate and restart."""
        return Plan(self.steps, self.save_every, self.eval_every, min_restarts)


QUICK = Config(batch=4, steps=6, save_every=1, eval_every=3, eval_batches=1, max_length=16)
DEFAULT_KEYFRAME_EVERY = 4
DEFAULT_SETTINGS = DEFAULT_RULES if isinstance(DEFAULT_RULES, str) else "safe"


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
        self, cfg: Config, pairs: list[tuple[str, str]], seed: int, pretrained: tuple[torch.nn.Module, Any],
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
        losses = [float(self._loss(self._batch(self.val_pairs, 7_777 + i))) for i in range(self.cfg.eval_batches)]
        return sum(losses) / len(losses)

    def objects(self) -> dict[str, Any]:
        """What a checkpoint holds, by name (the Checkpointer adds the RNG states)."""
        return {"model": self.model, "optimizer": self.opt}


def run(cfg: Config, seeds: list[int], settings: tuple[ResumeSetting, ...], *, exact_check: bool = True,
        min_restarts: int = 8) -> dict[str, Any]:
    """Every seed's runs and the summary, as the JSON result (less the environment)."""
    plan = cfg.plan(min_restarts)
    pairs = docstring_pairs()
    log(f"{len(pairs)} docstring/signature pairs")
    pretrained = load_minilm()
    runs = [run_seed(lambda data_seed, s=seed: MiniLMTrainer(cfg, pairs, s, pretrained, data_seed), seed, plan,
                     settings, exact_check=exact_check and i == 0)
            for i, seed in enumerate(seeds)]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--settings", default=None,
                        help=f"comma-separated settings (default {DEFAULT_SETTINGS!r}; see _twapi.parse_setting)")
    parser.add_argument("--keyframe-every", type=int, default=DEFAULT_KEYFRAME_EVERY,
                        help="for settings that do not set k=")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--save-every", type=int, default=None)
    parser.add_argument("--quick", action="store_true",
                        help="a short run with 2 restarts: a smoke test (tens of seconds)")
    parser.add_argument("--exact-check", action="store_true",
                        help="also run the exact preset through the restarts on the first seed (must be bit exact)")
    parser.add_argument("--out", default=None,
                        help="result name under benchmarks/results/ (default resume_minilm; --quick: none)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = QUICK if args.quick else Config()
    overrides = {k: v for k, v in (("steps", args.steps), ("save_every", args.save_every)) if v is not None}
    cfg = Config(**{**asdict(cfg), **overrides})
    keyframe_every = 2 if args.quick and args.keyframe_every == DEFAULT_KEYFRAME_EVERY else args.keyframe_every
    try:
        settings = parse_settings(args.settings or DEFAULT_SETTINGS, keyframe_every=keyframe_every)
    except ValueError as e:
        parser.error(str(e))
    seeds = [0] if args.quick and args.seeds == [0, 1] else args.seeds
    result = run(cfg, seeds, settings, exact_check=args.exact_check or args.quick,
                 min_restarts=2 if args.quick else 8)
    print(f"MiniLM fine-tune, {result['pairs']} pairs; {cfg.steps} steps, a save every {cfg.save_every}; "
          f"seeds {seeds}")
    print(tables(result))
    name = args.out or (None if args.quick else "resume_minilm")
    if name:
        log(f"wrote {write_result(name, result)}")


if __name__ == "__main__":
    main()
