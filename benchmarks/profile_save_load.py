"""Where the time of a CPU save and load goes: a breakdown by stage, each as a share of the total.

    python benchmarks/profile_save_load.py            # ~250 MB state, 3 rounds (a few minutes)
    python benchmarks/profile_save_load.py --quick    # tiny state, one round (a smoke run)

The state: MiniLM + AdamW when the ``bench`` extra is installed; otherwise (and with
``--synthetic``) a MiniLM-shaped ``torch.nn.TransformerEncoder`` (6 layers, width 384,
12 heads, feed-forward 1536, a 30522 x 384 embedding: 22.7 M parameters) after one AdamW
step, so that both moments are populated: ~260 MiB of fp32.

Each round saves with a fresh :class:`~tw_triton.Checkpointer` at its default settings
(async writer, default rules, snapshot pool): a keyframe (step 0), then a delta (step 1,
after perturbing the state), and loads each file back to the CPU (the delta with its
keyframe as the reference). The library's own functions are wrapped with timers; each stage
counts its *own* time (a stage nested in another is subtracted from it), on whichever
thread it runs:

* snapshot copy: the exact codec copying tensors (the copy that unblocks the loop);
* encode: the other codecs' ``encode`` / ``encode_with``;
* checksum: ``zlib.crc32`` called by the file format (while planning a write, and verifying);
* write: ``tw_triton.format._write_buffers``; fsync: ``os.fsync``;
* zstd: the entropy stage, compressing (``encode_buffer``) and decompressing;
* read: the file reads of ``tw_triton.format`` (positional reads into the buffers);
* decode: every codec's ``decode`` and ``decode_over`` (the delta load includes decoding
  its keyframe);
* unflatten: ``tw_triton.state.unflatten``;
* other: the rest of the wall time (planning, manifest, Python).

Totals are wall time from the call to the durable file (``save(...).result()``) and from the
call to the loaded state. Shares are medians over rounds; the machine may be shared.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tw_triton  # noqa: E402
from tw_triton import format as fmt  # noqa: E402
from tw_triton.state import decode as state_mod  # noqa: E402
from tw_triton.codecs import codec_names, get_codec  # noqa: E402
from tw_triton.codecs.entropy import get_stage, stage_names  # noqa: E402
from tw_triton.parallel import cpu_threads  # noqa: E402
from _common import machine_description  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
STAGES = ("snapshot copy", "encode", "zstd", "checksum", "write", "fsync", "read", "decode", "unflatten")
SAVE_STAGES = ("snapshot copy", "encode", "zstd", "checksum", "write", "fsync")
LOAD_STAGES = ("read", "checksum", "zstd", "decode", "unflatten")


# ---------------------------------------------------------------------------- timers


class StageClock:
    """Exclusive wall time per stage, per thread, summed over threads."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()
        self._local = threading.local()

    def reset(self) -> dict[str, float]:
        with self._lock:
            out = dict(self.totals)
            self.totals.clear()
        return out

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(0.0)  # time of nested stages, to subtract
        t0 = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - t0
            nested = stack.pop()
            if stack:
                stack[-1] += elapsed
            with self._lock:
                self.totals[name] += elapsed - nested

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.stage(name):
                return fn(*args, **kwargs)

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed


class _TimedZlib:
    """Stands in for the ``zlib`` module inside ``tw_triton.format``: times ``crc32``."""

    def __init__(self, clock: StageClock, real: Any) -> None:
        self._real = real
        self.crc32 = clock.wrap("checksum", real.crc32)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def instrumented(clock: StageClock) -> Iterator[None]:
    """Wrap the library's stage functions with ``clock`` while inside the block."""
    patches: list[tuple[Any, str, Any]] = []
    missing = object()

    def patch(obj: Any, attr: str, value: Any) -> None:
        # A codec instance gets an instance attribute, removed again after (not re-set).
        own = vars(obj).get(attr, missing) if not isinstance(obj, type(os)) else getattr(obj, attr)
        patches.append((obj, attr, own))
        setattr(obj, attr, value)

    patch(fmt, "zlib", _TimedZlib(clock, fmt.zlib))
    patch(fmt, "_write_buffers", clock.wrap("write", fmt._write_buffers))
    patch(fmt, "_read_exact_into", clock.wrap("read", fmt._read_exact_into))
    patch(fmt, "encode_buffer", clock.wrap("zstd", fmt.encode_buffer))
    for name in stage_names():
        stage = get_stage(name)
        patch(stage, "decode", clock.wrap("zstd", stage.decode))
    patch(os, "fsync", clock.wrap("fsync", os.fsync))
    patch(state_mod, "unflatten", clock.wrap("unflatten", state_mod.unflatten))
    for name in codec_names():
        codec = get_codec(name)
        enc = "snapshot copy" if name == "exact" else f"encode:{name}"
        for method in ("encode", "encode_with"):
            patch(codec, method, clock.wrap(enc, getattr(codec, method)))
        for method in ("decode", "decode_over"):
            patch(codec, method, clock.wrap(f"decode:{name}", getattr(codec, method)))
    try:
        yield
    finally:
        for obj, attr, value in reversed(patches):
            if value is missing:
                delattr(obj, attr)
            else:
                setattr(obj, attr, value)


# ---------------------------------------------------------------------------- the state


def minilm_shaped_state(quick: bool = False) -> tuple[dict[str, Any], str]:
    """A model + AdamW state after one step: MiniLM when available, else a look-alike."""
    torch.manual_seed(0)
    vocab, width, layers, ff = (1000, 64, 2, 256) if quick else (30522, 384, 6, 1536)
    loaded = None
    if not quick:  # the real model when the bench extra is there
        from _minilm import SENTENCES, BenchExtraMissing, contrastive_step, load_minilm

        try:
            loaded = load_minilm()
        except BenchExtraMissing:
            pass
    if loaded is not None:
        model, tokenizer = loaded
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # Neighbouring sentences are paraphrases: (0, 1), (2, 3), ... are the positive pairs.
        contrastive_step(model, tokenizer, opt, list(SENTENCES[0::2]), list(SENTENCES[1::2]))
        return {"model": model.state_dict(), "optimizer": opt.state_dict()}, (
            "MiniLM (all-MiniLM-L6-v2) + AdamW after one contrastive step")
    layer = torch.nn.TransformerEncoderLayer(width, 12 if width % 12 == 0 else 4, ff, batch_first=True)
    model = torch.nn.ModuleDict(
        {
            "embeddings": torch.nn.Embedding(vocab, width),
            "position": torch.nn.Embedding(512, width),
            "encoder": torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
            "pooler": torch.nn.Linear(width, width),
        }
    )
    what = (f"MiniLM-shaped torch.nn.TransformerEncoder ({layers} layers, width {width}, "
            f"ff {ff}, vocab {vocab}) + AdamW after one step")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, vocab, (8, 64))
    h = model["embeddings"](tokens) + model["position"](torch.arange(64))
    model["pooler"](model["encoder"](h)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}, what


def _perturb(state: dict[str, Any]) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in state["model"].values():
            if t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=g) * 1e-3)


def _state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    return 0


# ---------------------------------------------------------------------------- rounds


def _with_sums(times: dict[str, float]) -> dict[str, float]:
    """Adds ``encode`` and ``decode``, the sums of the per-codec ``encode:*`` / ``decode:*``."""
    out = dict(times)
    for stage in ("encode", "decode"):
        out[stage] = sum(v for k, v in times.items() if k.startswith(stage + ":"))
    return out


def one_round(state: dict[str, Any], clock: StageClock, directory: Path) -> dict[str, dict[str, float]]:
    """Keyframe save, first and fifth delta saves, the loads of the keyframe and the first
    delta; stage times and wall totals of each."""
    out: dict[str, dict[str, float]] = {}
    ckpt = tw_triton.Checkpointer(directory, keep_last=None)
    names = {0: "save keyframe", 1: "save delta", 5: "save 5th delta"}
    try:
        for step in range(max(names) + 1):
            if step:
                _perturb(state)
            clock.reset()
            t0 = time.perf_counter()
            ckpt.save(step, model=state["model"], optimizer=state["optimizer"]).result()
            total = time.perf_counter() - t0
            if step in names:
                out[names[step]] = {**_with_sums(clock.reset()), "total": total}
    finally:
        ckpt.close()
    files = sorted(directory.glob("*.tw.safetensors"))
    for name, path, ref in (("load keyframe", files[0], None), ("load delta", files[1], files[0])):
        clock.reset()
        t0 = time.perf_counter()
        tw_triton.load(path, device="cpu", reference=None if ref is None else str(ref))
        total = time.perf_counter() - t0
        out[name] = {**_with_sums(clock.reset()), "total": total}
    for f in files:
        f.unlink()
    return out


def _median_rounds(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for op in rounds[0]:
        keys = set().union(*(r[op] for r in rounds))
        out[op] = {k: statistics.median(r[op].get(k, 0.0) for r in rounds) for k in keys}
    return out


def markdown(result: dict[str, Any]) -> str:
    """The results page."""
    lines = [
        "# Where the time of a CPU save and load goes",
        "",
        f"Machine: {result['machine']}; torch {torch.__version__}, {torch.get_num_threads()} threads;"
        f" tw_triton worker threads: {cpu_threads()} (`TW_TRITON_THREADS` to change).",
        f"State: {result['state']}, {result['state_mib']:.0f} MiB of tensors.",
        f"Command: `{result['command']}` ({result['rounds']} rounds in one process; medians over"
        f" rounds, the first included). Load average {result['load_before']:.1f} before and"
        f" {result['load_after']:.1f} after: the machine was shared, single timings are noisy.",
        "",
        "Checkpointer defaults (async writer, default rules, snapshot pool, fsync); a keyframe at",
        "step 0, deltas at steps 1 to 5 (the fifth: a save in the steady state of a closed-loop",
        "chain, whose reference is advanced in place); the keyframe and the first delta loaded",
        "to the CPU (the delta with its keyframe).",
        "Each stage counts its own time (nested stages subtracted) on every thread, so a stage's",
        "share is thread-seconds over wall seconds: with tw_triton's worker threads the stages",
        "overlap and the shares can add up to more than 100% (the `busy` column: their sum).",
        "`other` is the wall time no stage covers (0 when they overlap beyond the total).",
        "",
        "| operation | total s | " + " | ".join(STAGES) + " | other | busy |",
        "|---|---:|" + "---:|" * (len(STAGES) + 2),
    ]
    for op, row in result["median"].items():
        total = row["total"]
        staged = sum(row.get(s, 0.0) for s in STAGES)
        cells = [f"{row.get(s, 0.0) / total:.0%}" if row.get(s, 0.0) else "-" for s in STAGES]
        lines.append(f"| {op} | {total:.3f} | " + " | ".join(cells)
                     + f" | {max(0.0, total - staged) / total:.0%} | {staged / total:.0%} |")
    lines += ["", "Seconds per stage (medians):", "",
              "| operation | " + " | ".join(STAGES) + " |", "|---|" + "---:|" * len(STAGES)]
    for op, row in result["median"].items():
        lines.append(f"| {op} | " + " | ".join(f"{row.get(s, 0.0):.3f}" for s in STAGES) + " |")
    per_codec = sorted({k for row in result["median"].values() for k in row if ":" in k})
    lines += ["", "Encode and decode seconds by codec (medians):", "",
              "| operation | " + " | ".join(per_codec) + " |", "|---|" + "---:|" * len(per_codec)]
    for op, row in result["median"].items():
        lines.append(f"| {op} | " + " | ".join(f"{row.get(k, 0.0):.3f}" for k in per_codec) + " |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny state, one round")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3, quick 1)")
    p.add_argument("--out", type=Path, default=None, help="markdown page (default results/profile_cpu.md)")
    args = p.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    state, what = minilm_shaped_state(quick=args.quick)
    clock = StageClock()
    load_before = os.getloadavg()[0]
    results = []
    with instrumented(clock), tempfile.TemporaryDirectory(prefix="tw-profile-") as tmp:
        for r in range(rounds):
            results.append(one_round(state, clock, Path(tmp) / f"round{r}"))
            print(f"round {r}: " + ", ".join(f"{op} {v['total']:.3f}s" for op, v in results[-1].items()),
                  flush=True)
    result = {
        "machine": machine_description(),
        "state": what,
        "state_mib": _state_bytes(state) / 2**20,
        "rounds": rounds,
        "command": "python benchmarks/profile_save_load.py" + (" --quick" if args.quick else "")
        + (f" --rounds {args.rounds}" if args.rounds else ""),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "median": _median_rounds(results),
        "rounds_raw": results,
    }
    page = markdown(result)
    print(page)
    out = args.out or (None if args.quick else RESULTS / "profile_cpu.md")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page, encoding="utf-8")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
