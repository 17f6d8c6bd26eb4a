"""What preemption costs in bytes: the tiny GPT trained with a ``Checkpointer`` saving every
5 steps, once without stopping and once restored (fresh process state: model, optimizer,
schedule and Checkpointer rebuilt, ``restore()`` of the latest) after every 5th save, with
the data order surviving the restarts (``harness/tiny_gpt.py``). Prints the bytes each run
wrote, by kind of file, and their ratio.

Run: ``python benchmarks/restart_bytes.py`` (minutes on a 2-core VM; ``--steps`` shortens it).
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path

from harness.tiny_gpt import Config, Trainer, load_corpus

import tw_triton


def train(directory: Path, steps: int, save_every: int, restart_every: int | None) -> Counter:
    """Bytes written by kind of file (and ``"total"``)."""
    cfg, corpus = Config(steps=steps), load_corpus()
    trainer = Trainer(cfg, corpus, seed=0)
    ckpt = tw_triton.Checkpointer(directory, keep_last=None)
    saves = 0
    futures = []
    while trainer.step < steps:
        trainer.train_step()
        if trainer.step % save_every:
            continue
        futures.append(ckpt.save(trainer.step, **trainer.objects()))
        saves += 1
        if restart_every and saves % restart_every == 0 and trainer.step < steps:
            ckpt.close()
            trainer = Trainer(cfg, corpus, seed=0)
            ckpt = tw_triton.Checkpointer(directory, keep_last=None)
            trainer.step = ckpt.restore(**trainer.objects())["step"]
    ckpt.close()
    written: Counter = Counter()
    for info in tw_triton.Checkpointer(directory).infos():
        written[info.kind] += info.nbytes
        written["total"] += info.nbytes
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--restart-every", type=int, default=5, help="saves between restarts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plain = train(Path(tmp) / "plain", args.steps, args.save_every, None)
        preempted = train(Path(tmp) / "preempted", args.steps, args.save_every, args.restart_every)
    print(f"format version {tw_triton.format.FORMAT_VERSION}, tiny GPT, {args.steps} steps")
    for name, w in (("uninterrupted", plain), (f"restored every {args.restart_every} saves", preempted)):
        print(
            f"{name}: {w['total']} bytes ({', '.join(f'{k} {v}' for k, v in sorted(w.items()) if k != 'total')})"
        )
    print(f"ratio {preempted['total'] / plain['total']:.3f}")


if __name__ == "__main__":
    main()
