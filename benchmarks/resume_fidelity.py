"""Resume fidelity: does a run restored from a quantized checkpoint train like the original?

A small byte-level GPT trains on a corpus built from Python standard-library source files
found on disk (2 CPU cores: about a second per 20 steps). The uninterrupted run goes for
``--steps`` steps. At ``--keyframe`` it writes an exact checkpoint (model, AdamW,
cosine scheduler, step), the reference of the delta settings. At ``--at`` it writes one
checkpoint per setting (exact, int8/int4/int2 delta, int8 without delta, moments quantized),
and each is restored into a fresh model, optimizer and scheduler and trained to the end on
the same batches (a batch is a function of the step, so the data order survives a resume).

Reported per setting: file size against ``torch.save`` of the same state, the largest
deviation of the per-step training loss from the uninterrupted run relative to the mean loss
(and relative to that step's loss), and the relative deviation of the final held-out loss. The exact setting must reproduce the
uninterrupted run bit for bit; the script fails if it does not.

Run: ``python benchmarks/resume_fidelity.py`` (a few minutes on 2 cores; ``--seeds`` for
more runs, reported as medians). Writes ``benchmarks/results/resume_fidelity.json``.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from _common import fmt_table, log, median, mib, write_result
from _twapi import Setting, load_setting, save_setting

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

SETTINGS = (
    Setting("exact", bits=None, delta=False),
    Setting("int8 delta", bits=8),
    Setting("int4 delta", bits=4),
    Setting("int2 delta", bits=2),
    Setting("int8 no delta", bits=8, delta=False),
    Setting("int8 delta + exp_avg int8", bits=8, moment_bits=8, moments=("exp_avg",)),
    Setting("int8 delta + moments int8", bits=8, moment_bits=8),
    # The library's own optimizer preset, as a Checkpointer delta save would use it.
    Setting('preset "int8-exp-avg"', bits=8, moment_bits=8, moments=("exp_avg",), preset="int8-exp-avg"),
    Setting("int8 delta + moments int8 without delta", bits=8, moment_bits=8, moment_delta=False),
    Setting("int8 no delta + moments int8", bits=8, delta=False, moment_bits=8, moment_delta=False),
)


@dataclass(frozen=True)
class Config:
    """Sizes of the model and of the run."""

    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    context: int = 64
    batch: int = 8
    lr: float = 2e-3
    steps: int = 300
    keyframe: int = 150
    at: int = 200
    eval_batches: int = 8


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


class Trainer:
    """Model, AdamW and cosine schedule; batches are a pure function of (seed, step)."""

    def __init__(self, cfg: Config, corpus: torch.Tensor, seed: int) -> None:
        self.cfg = cfg
        self.seed = seed
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
        x, y = self._batch(self.train_data, self.seed * 1_000_003 + self.step)
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

    def state(self) -> dict[str, Any]:
        """The training state a checkpoint holds."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "step": self.step,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Put a loaded checkpoint back (the inverse of :meth:`state`)."""
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.step = int(state["step"])


def max_dev_rel_mean(curve: list[float], base: list[float]) -> float:
    """Largest ``|loss - base|`` over the steps, relative to the mean of ``base``.

    Unlike :func:`max_rel_dev` this does not blow up on steps whose loss is near zero (a
    contrastive fine-tune has many); ``inf`` if the run diverged.
    """
    devs = [abs(a - b) if math.isfinite(a) else math.inf for a, b in zip(curve, base)]
    return max(devs) / (sum(base) / len(base))


def max_rel_dev(curve: list[float], base: list[float]) -> float:
    """Largest ``|loss - base| / base`` over the steps (``inf`` if the run diverged)."""
    devs = [abs(a - b) / b if math.isfinite(a) else math.inf for a, b in zip(curve, base)]
    return max(devs)


class Resumable(Protocol):
    """What the resume experiment needs from a training run."""

    step: int

    def train_step(self) -> float: ...

    def eval_loss(self) -> float: ...

    def state(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any]) -> None: ...


def run_seed(cfg: Config, corpus: torch.Tensor, seed: int, settings: tuple[Setting, ...]) -> dict[str, Any]:
    """The uninterrupted run and every resumed run for one seed of the GPT."""
    return run_schedule(
        lambda: Trainer(cfg, corpus, seed), seed, cfg.steps, cfg.keyframe, cfg.at, settings
    )


def run_schedule(
    make_trainer: Callable[[], Resumable],
    seed: int,
    steps: int,
    keyframe_step: int,
    at: int,
    settings: tuple[Setting, ...],
) -> dict[str, Any]:
    """Train ``steps`` steps; keyframe at ``keyframe_step``; checkpoint and resume at ``at``.

    ``make_trainer`` builds a fresh run in its initial state (same seed every call); the
    batches it trains on must depend only on the step, so that a resumed run sees the same
    data as the uninterrupted one.
    """
    t0 = time.perf_counter()
    base = make_trainer()
    base_losses: list[float] = []
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        keyframe = tmpdir / "keyframe.tw.safetensors"
        while base.step < steps:
            if base.step == keyframe_step:
                save_setting(base.state(), Setting("exact", bits=None), keyframe)
            if base.step == at:
                torch.save(base.state(), tmpdir / "state.pt")
                torch_bytes = (tmpdir / "state.pt").stat().st_size
                for s in settings:
                    path = tmpdir / f"setting{settings.index(s)}.tw.safetensors"
                    results[s.name] = {"file_bytes": save_setting(base.state(), s, path, keyframe)}
            base_losses.append(base.train_step())
        base_eval = base.eval_loss()
        log(f"seed {seed}: uninterrupted run {time.perf_counter() - t0:.0f} s, final eval {base_eval:.4f}")
        tail = base_losses[at:]
        for s in settings:
            path = tmpdir / f"setting{settings.index(s)}.tw.safetensors"
            resumed = make_trainer()
            loaded = load_setting(path, keyframe if s.uses_reference else None)
            # AdamW takes the square root of exp_avg_sq: a negative value there means NaN.
            negative = sum(
                int((st["exp_avg_sq"] < 0).sum()) for st in loaded["optimizer"]["state"].values()
            )
            resumed.restore(loaded)
            curve = [resumed.train_step() for _ in range(steps - at)]
            ev = resumed.eval_loss()
            r = results[s.name]
            r.update(
                {
                    "vs_torch_save": torch_bytes / r["file_bytes"],
                    "max_rel_loss_dev": max_rel_dev(curve, tail),
                    "max_dev_rel_mean": max_dev_rel_mean(curve, tail),
                    "final_eval_rel_dev": abs(ev - base_eval) / base_eval if math.isfinite(ev) else math.inf,
                    "negative_exp_avg_sq": negative,
                    "losses": curve,
                }
            )
            if s.name == "exact" and curve != tail:
                raise AssertionError("the exact checkpoint did not reproduce the uninterrupted run")
            log(
                f"seed {seed}: {s.name}: x{r['vs_torch_save']:.2f} smaller, max loss dev "
                f"{r['max_dev_rel_mean']:.2e} of the mean (per step {r['max_rel_loss_dev']:.2e}), "
                f"eval dev {r['final_eval_rel_dev']:.2e}"
            )
    return {
        "seed": seed,
        "torch_save_bytes": torch_bytes,
        "base_losses": base_losses,
        "base_eval": base_eval,
        "settings": results,
    }


def summarize(runs: list[dict[str, Any]], settings: tuple[Setting, ...]) -> list[dict[str, Any]]:
    """Per setting: medians over the seeds."""
    rows = []
    for s in settings:
        per = [r["settings"][s.name] for r in runs]
        rows.append(
            {
                "setting": s.name,
                "spec": asdict(s),
                "file_bytes": median([p["file_bytes"] for p in per]),
                "vs_torch_save": median([p["vs_torch_save"] for p in per]),
                "max_rel_loss_dev": median([p["max_rel_loss_dev"] for p in per]),
                "max_rel_loss_dev_worst_seed": max(p["max_rel_loss_dev"] for p in per),
                "max_dev_rel_mean": median([p["max_dev_rel_mean"] for p in per]),
                "max_dev_rel_mean_worst_seed": max(p["max_dev_rel_mean"] for p in per),
                "final_eval_rel_dev": median([p["final_eval_rel_dev"] for p in per]),
                "negative_exp_avg_sq_max": max(p["negative_exp_avg_sq"] for p in per),
            }
        )
    return rows


def table(result: dict[str, Any]) -> str:
    """Markdown table of the per-setting medians."""
    def pct(v: float) -> str:
        return "diverged" if not math.isfinite(v) else f"{100 * v:.3f} %"

    body = [
        [
            r["setting"],
            f"{mib(r['file_bytes']):.2f}",
            f"{r['vs_torch_save']:.2f}x",
            pct(r["max_dev_rel_mean"]),
            pct(r["max_dev_rel_mean_worst_seed"]),
            pct(r["max_rel_loss_dev_worst_seed"]),
            pct(r["final_eval_rel_dev"]),
            r["negative_exp_avg_sq_max"],
        ]
        for r in result["rows"]
    ]
    headers = [
        "setting",
        "file MiB",
        "smaller than torch.save",
        "max |loss - uninterrupted| / mean loss (median over seeds)",
        "worst seed",
        "max per-step relative deviation (worst seed)",
        "final held-out loss deviation (median)",
        "negative exp_avg_sq after load (worst seed)",
    ]
    return fmt_table(headers, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--keyframe", type=int, default=Config.keyframe)
    parser.add_argument("--at", type=int, default=Config.at)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads (1: steady timings on a shared 2-core machine)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not 0 <= args.keyframe <= args.at < args.steps:
        parser.error("need 0 <= --keyframe <= --at < --steps")
    cfg = Config(steps=args.steps, keyframe=args.keyframe, at=args.at)
    corpus = load_corpus()
    runs = [run_seed(cfg, corpus, seed, SETTINGS) for seed in args.seeds]
    n_params = sum(p.numel() for p in TinyGPT(cfg).parameters())
    result = {
        "task": "byte-level GPT on Python stdlib source",
        "corpus_files": list(CORPUS_FILES),
        "corpus_bytes": int(corpus.numel()),
        "params": n_params,
        "config": asdict(cfg),
        "rows": summarize(runs, SETTINGS),
        "runs": runs,
    }
    path = write_result("resume_fidelity", result)
    print(f"{n_params} parameters; checkpoint at step {cfg.at}, keyframe at {cfg.keyframe}, "
          f"resumed to {cfg.steps}; seeds {args.seeds}")
    print(table(result))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
