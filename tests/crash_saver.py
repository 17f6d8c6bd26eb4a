"""Helper of tests/checkpointing/test_faults.py: SIGKILL processes that are saving checkpoints.

Run as ``python tests/crash_saver.py BASE_DIR TRIALS SEED``. The process imports torch once
and then, per trial, forks a child that saves in a loop (async writer, fsync on, keyframes
and deltas, retention) and kills it with SIGKILL after a random delay. Forking from a
process that has done no torch work yet makes each trial start in milliseconds instead of
paying a fresh interpreter and torch import per trial.

Every odd trial reuses the previous trial's directory, so that child starts in a directory
left by a killed process: it resumes from ``latest()`` as a restarted job would.

One JSON line per trial goes to stdout: ``{"trial", "dir", "delay", "saved_before_kill"}``.
The parent test then checks every directory with a fresh Checkpointer.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import torch

from tw_triton.checkpointer import Checkpointer

WEIGHT_SHAPE = (256, 512)  # 128K fp32 weights: delta-coded
EXTRA_NUMEL = 1 << 18  # 1 MiB of fp32 stored exact; its value names the step
KEYFRAME_EVERY = 3
KEEP_LAST = 2


def expected_weight(step: int) -> torch.Tensor:
    """The model weight saved at ``step``: a fixed base plus a step-dependent drift."""
    base = torch.randn(WEIGHT_SHAPE, generator=torch.Generator().manual_seed(0))
    drift = torch.randn(WEIGHT_SHAPE, generator=torch.Generator().manual_seed(1))
    return base + (0.01 * step) * drift


def expected_extra(step: int) -> torch.Tensor:
    return torch.full((EXTRA_NUMEL,), float(step))


def _save_forever(directory: str, ready_fd: int) -> None:
    torch.set_num_threads(1)
    # int8 weight deltas (rules "small"), closed loop (the default): a kill must never leave a
    # chain that latest() picks but cannot load; the error check needs the int8 precision.
    ckpt = Checkpointer(directory, keyframe_every=KEYFRAME_EVERY, keep_last=KEEP_LAST, rules="small")
    last = ckpt.latest()
    model = torch.nn.Linear(WEIGHT_SHAPE[1], WEIGHT_SHAPE[0], bias=False)
    step = 0
    if last is not None:
        state = ckpt.restore(model=model)
        step = state["step"] + 1
    signalled = False
    while True:
        with torch.no_grad():
            model.weight.copy_(expected_weight(step))
        future = ckpt.save(step, model=model, extra=expected_extra(step))
        if not signalled:
            future.result()  # one complete checkpoint exists before the kill can come
            os.write(ready_fd, b"1")
            signalled = True
        step += 1


def main() -> None:
    base, trials, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    directory = ""
    for trial in range(trials):
        if trial % 2 == 0:
            directory = os.path.join(base, f"trial-{trial:03d}")
            os.makedirs(directory, exist_ok=True)
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            try:
                _save_forever(directory, write_fd)
            finally:
                os._exit(1)
        os.close(write_fd)
        ready = os.read(read_fd, 1)
        os.close(read_fd)
        delay = rng.uniform(0.0, 0.4)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        print(
            json.dumps(
                {
                    "trial": trial,
                    "dir": directory,
                    "delay": delay,
                    "saved_before_kill": ready == b"1",
                    "killed": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
