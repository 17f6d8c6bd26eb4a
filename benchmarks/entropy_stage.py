"""The lossless entropy stage on a real training state: bits per element, and speed.

Trains the tiny byte-level GPT of ``resume_fidelity.py`` with AdamW (``--steps``, default
300), writes an exact keyframe at ``--keyframe`` (default 150), and encodes the final state
against it the way the library does: weight deltas at 8, 4 and 2 bits (default rules), and
the moments by the ``"small"`` preset (``exp_avg`` int4 blockwise, ``exp_avg_sq`` log2 4-bit)
and by the ``"smallest"`` preset (``exp_avg`` int3 in 4-bit containers, ``exp_avg_sq`` log2
2-bit, wider blocks).
Every buffer of the encoded states is sorted into a kind, and each kind goes through both
stages (``zstd``, ``zstd-bytegroup``) buffer by buffer, as the file writer does.

Reported per kind:

* bits per element: raw (as the codec stores it), after each stage, and after the stage the
  policy picks (``auto``: buffers under 4 KiB, or saving under 3 %, stay raw);
* the order-0 empirical entropy: of the code symbols for code buffers (what an ideal
  order-0 coder of the codes would reach), of each byte plane summed over the planes for
  float buffers (what an order-0 coder after byte grouping would reach);
* compress and decompress throughput of the policy's stage in MB/s of raw bytes (best of 3
  runs of each kind, one process, a shared machine: noisy);
* zstd levels 1, 3 and 9 on the policy's stage, each with the level's own match finder and
  with ``PLANE_MATCH`` (``min_match`` 7, ``hash_log`` 6: what the policy gives
  ``zstd-bytegroup`` on buffers of ``PLANE_MATCH_MIN_BYTES`` and more), for the level and match choice;
* whole files: each checkpoint written with ``entropy=None`` and ``"auto"``;
* the match settings on large buffers: the exact fp32 weights and AdamW moments of
  all-MiniLM-L6-v2 after one step (the ``speed_compare.py`` state; buffers of
  ``PLANE_MATCH_MIN_BYTES`` and more, where the policy uses ``PLANE_MATCH``), through ``zstd-bytegroup`` at level 1 with
  the level's own match finder and with ``PLANE_MATCH``: stored fraction and seconds (best
  of 3, one thread). Skipped, with a note, without the ``bench`` extra.

Run: ``python benchmarks/entropy_stage.py`` (about a minute on 2 cores). Writes
``benchmarks/results/entropy_stage.json`` and ``benchmarks/results/entropy_stage.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
import time
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

import tw_triton
from _common import RESULTS_DIR, environment, fmt_table, log, write_result
from resume_fidelity import Config, Trainer, load_corpus
from tw_triton import format as fmt
from tw_triton.codecs import entropy, native
from tw_triton.qstate import QuantizedState

STAGES = ("zstd", "zstd-bytegroup")
LEVELS = (1, 3, 9)
# Match settings compared at each level: the level's own, and PLANE_MATCH (what the policy
# gives zstd-bytegroup).
MATCHES = {"own": (0, 0), "planes": entropy.PLANE_MATCH}


def _size(nbytes: int) -> str:
    """``1 MiB``, ``512 KiB``: a power-of-two size as the pages write it."""
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _settings(level: int, stage: str, nbytes: int, match: str | None = None) -> entropy.ZstdSettings:
    """zstd settings at ``level``: the policy's for ``stage`` on ``nbytes``, or the
    ``match`` variant."""
    min_match, hash_log = entropy.get_stage(stage).match_for(nbytes) if match is None else MATCHES[match]
    return entropy.ZstdSettings(level=level, min_match=min_match, hash_log=hash_log)
REPEATS = 3


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")


def code_symbols(codes: torch.Tensor, bits: int, count: int) -> np.ndarray:
    """Unpack LSB-first packed codes into one symbol per element."""
    packed = codes.reshape(-1).numpy()
    per_byte = 8 // bits
    fields = [(packed >> (i * bits)) & ((1 << bits) - 1) for i in range(per_byte)]
    return np.stack(fields, axis=1).reshape(-1)[:count]


def order0_bits(symbols: np.ndarray) -> float:
    """Empirical order-0 entropy, bits per symbol."""
    if symbols.size == 0:
        return 0.0
    counts = np.bincount(symbols.astype(np.int64))
    p = counts[counts > 0] / symbols.size
    return float(-(p * np.log2(p)).sum())


def plane_entropy_bits(t: torch.Tensor) -> float:
    """Sum over byte planes of each plane's order-0 entropy: bits per element."""
    planes = t.contiguous().reshape(-1).view(torch.uint8).numpy().reshape(-1, t.element_size())
    return sum(order0_bits(planes[:, k]) for k in range(planes.shape[1]))


def classify(path: str, codec: str, params: dict[str, Any], name: str, t: torch.Tensor) -> str | None:
    """The kind of one buffer, or None for what the table leaves out (tiny exact tensors)."""
    weight = path.startswith("model/")
    moment = path.rsplit("/", 1)[-1]
    if codec == "blockwise" and name == "codes":
        what = "weight-delta" if weight else moment
        if params.get("qmax") is not None:  # fewer levels than the container: int3 in 4 bits
            return f"{what} codes int{params['qmax'].bit_length() + 1} (in {params['bits']} bits)"
        return f"{what} codes int{params['bits']}"
    if codec == "log2" and name == "codes":
        return f"{moment} log2 codes {params['bits']}-bit"
    if codec in ("blockwise", "log2"):
        return f"per-block {name} ({t.dtype})".replace("torch.", "")
    if codec == "exact" and t.dtype.is_floating_point and t.numel() >= 4096:
        return f"exact {'weights' if weight else moment} {str(t.dtype).replace('torch.', '')}"
    return None


def collect(states: dict[str, QuantizedState]) -> dict[str, list[dict[str, Any]]]:
    """Buffers by kind, each with what the entropy columns need."""
    kinds: dict[str, list[dict[str, Any]]] = defaultdict(list)
    # Several states hold the same buffer (the final moments are exact in every delta; the
    # int8 weight deltas are in two states): each distinct buffer counts once.
    seen: set[tuple[str, str, int, int]] = set()
    for label, q in states.items():
        for path, e in q.entries.items():
            for name, t in e.buffers.items():
                kind = classify(path, e.codec, e.params, name, t)
                if kind is None:
                    continue
                t = t.contiguous()
                key = (kind, path, t.numel(), zlib.crc32(_bytes(t)))
                if key in seen:
                    continue
                seen.add(key)
                if name == "codes":
                    elements = math.prod(e.shape)
                    symbols = code_symbols(t, e.params["bits"], elements)
                    h0 = order0_bits(symbols)
                    raw_bits = e.params["bits"]
                else:
                    elements = t.numel()
                    h0 = plane_entropy_bits(t)
                    raw_bits = 8 * t.element_size()
                kinds[kind].append({"tensor": t, "elements": elements, "h0": h0, "raw_bits": raw_bits, "src": label})
    return dict(kinds)


def _best(fn, repeats: int = REPEATS) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_kind(bufs: list[dict[str, Any]]) -> dict[str, Any]:
    """Stored bytes per stage and level, the policy's choice, and the policy stage's speed."""
    elements = sum(b["elements"] for b in bufs)
    raw = sum(len(_bytes(b["tensor"])) for b in bufs)
    out: dict[str, Any] = {
        "buffers": len(bufs),
        "elements": elements,
        "raw_bytes": raw,
        "raw_bits": bufs[0]["raw_bits"],
        "h0_bits": sum(b["h0"] * b["elements"] for b in bufs) / elements,
        "stored": {},
    }
    for name in STAGES:
        stage = entropy.get_stage(name)
        for level in LEVELS:
            for match in (None, *MATCHES):
                total = 0
                for b in bufs:
                    data = _bytes(b["tensor"])
                    total += len(stage.encode(data, b["tensor"].element_size(),
                                              _settings(level, name, len(data), match))[0])
                out["stored"][f"{name}/{level}" + (f"/{match}" if match else "")] = total
    # What the writer's default policy stores, buffer by buffer.
    auto_total = 0
    chosen = set()
    encoded = []
    for b in bufs:
        t = b["tensor"]
        staged = entropy.encode_buffer(t, _bytes(t), entropy.AUTO)
        auto_total += len(_bytes(t)) if staged is None else len(staged.data)
        if staged is not None:
            chosen.add(staged.record["name"])
            encoded.append((staged, t))
    out["auto_bytes"] = auto_total
    out["auto_stages"] = sorted(chosen)
    # The policy's stage for this kind: its first candidate, or for integers (which try
    # both) the one that stored this kind smaller.
    candidates = entropy.candidate_stages(bufs[0]["tensor"].dtype, entropy.MIN_STAGE_BYTES, entropy.AUTO)
    level = entropy.DEFAULT_LEVEL
    policy_stage = min(candidates, key=lambda n: out["stored"][f"{n}/{level}"])
    out["policy_stage"] = policy_stage
    stage = entropy.get_stage(policy_stage)
    def policy_encode(b: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        data = _bytes(b["tensor"])
        return stage.encode(data, b["tensor"].element_size(), _settings(level, policy_stage, len(data)))

    frames = [(policy_encode(b), b["tensor"]) for b in bufs]

    def compress() -> None:
        for b in bufs:
            policy_encode(b)

    dests = [bytearray(len(_bytes(t))) for _, t in frames]

    def decompress() -> None:
        for ((stored, params), t), dest in zip(frames, dests):
            view = memoryview(stored)
            stage.check(view, params, len(dest), "bench")
            stage.decode(view, params, memoryview(dest), "bench")

    decompress()
    assert all(bytes(d) == bytes(_bytes(t)) for d, (_, t) in zip(dests, frames)), "stage is not lossless"
    out["compress_mb_s"] = raw / _best(compress) / 1e6
    out["decompress_mb_s"] = raw / _best(decompress) / 1e6
    out["level_speed_mb_s"] = {}
    for level in LEVELS:
        for match in MATCHES:
            def comp(zstd: entropy.ZstdSettings = _settings(level, policy_stage, 0, match)) -> None:
                for b in bufs:
                    stage.encode(_bytes(b["tensor"]), b["tensor"].element_size(), zstd)

            out["level_speed_mb_s"][f"{level}/{match}"] = raw / _best(comp) / 1e6
    return out


def file_sizes(states: dict[str, QuantizedState], tmp: Path) -> list[dict[str, Any]]:
    rows = []
    for label, q in states.items():
        row: dict[str, Any] = {"checkpoint": label}
        for mode in (None, "auto"):
            path = tmp / f"{label}-{mode}.tw"
            t_write = _best(lambda: fmt.write_file(q, path, fsync=False, entropy=mode), 2)
            t_read = _best(lambda: fmt.read_file(path), 2)
            key = "auto" if mode else "none"
            row[f"{key}_bytes"] = path.stat().st_size
            row[f"{key}_write_s"] = t_write
            row[f"{key}_read_s"] = t_read
        row["raw_tensor_bytes"] = fmt.read_manifest(tmp / f"{label}-auto.tw")["stats"]["raw_bytes"]
        rows.append(row)
    return rows


def large_buffer_threads(nbytes: int = 64 << 20) -> dict[str, Any]:
    """One synthetic 64 MiB fp32 buffer (Gaussian, exp_avg-like scale) through
    zstd-bytegroup with 1 and with 2 zstd threads."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(nbytes // 4, generator=g) * 1e-3
    stage = entropy.get_stage("zstd-bytegroup")
    out: dict[str, Any] = {"nbytes": nbytes, "default_threads": entropy.default_threads(nbytes)}
    for threads in (0, 2):
        zstd = entropy.ZstdSettings(threads=threads)
        seconds = _best(lambda: stage.encode(_bytes(t), 4, zstd), 2)
        stored, params = stage.encode(_bytes(t), 4, zstd)
        dest = bytearray(nbytes)
        d_seconds = _best(lambda: stage.decode(memoryview(stored), params, memoryview(dest), "bench"), 2)
        assert bytes(dest) == bytes(_bytes(t))
        out[str(threads)] = {"compress_mb_s": nbytes / seconds / 1e6, "decompress_mb_s": nbytes / d_seconds / 1e6,
                             "bits": 8 * len(stored) / t.numel()}
    return out


def minilm_planes() -> dict[str, Any] | None:
    """``zstd-bytegroup`` at level 1, the level's own match finder against ``PLANE_MATCH``,
    on the MiniLM + AdamW exact tensors of ``PLANE_MATCH_MIN_BYTES`` and more, by kind; ``None`` without the
    model package."""
    try:
        from speed_compare import build_fixture
    except ImportError:
        return None
    stage = entropy.get_stage("zstd-bytegroup")
    with tempfile.TemporaryDirectory() as tmp:
        fixture = Path(tmp) / "minilm.pt"
        try:
            build_fixture(fixture)
        except ImportError:
            return None
        state = torch.load(fixture, weights_only=True)
    moments = list(state["optimizer"]["state"].values())
    kinds = {
        "weights": list(state["model"].values()),
        "exp_avg": [m["exp_avg"] for m in moments],
        "exp_avg_sq": [m["exp_avg_sq"] for m in moments],
    }
    out: dict[str, Any] = {}
    with _one_torch_thread():
        for kind, tensors in kinds.items():
            bufs = [_bytes(t) for t in tensors
                    if t.dtype == torch.float32 and t.numel() * 4 >= entropy.PLANE_MATCH_MIN_BYTES]
            row: dict[str, Any] = {"buffers": len(bufs), "raw_bytes": sum(len(b) for b in bufs)}
            for match, (min_match, hash_log) in MATCHES.items():
                zstd = entropy.ZstdSettings(min_match=min_match, hash_log=hash_log)
                row[f"{match}_bytes"] = sum(len(stage.encode(b, 4, zstd)[0]) for b in bufs)
                row[f"{match}_s"] = _best(lambda zstd=zstd: [stage.encode(b, 4, zstd) for b in bufs])
            row["stages"] = plane_stages(bufs)
            out[kind] = row
    return out


# The variants of plane_stages: (label, stage, compiled plane merge on).
PLANE_VARIANTS = (("zstd-bytegroup", "zstd-bytegroup", True), ("zstd-planes", "zstd-planes", True),
                  ("zstd-planes, numpy", "zstd-planes", False))


def plane_stages(bufs: list[memoryview]) -> dict[str, dict[str, Any]]:
    """``zstd-bytegroup`` against ``zstd-planes`` (level 1, ``PLANE_MATCH``) on the same
    buffers, and ``zstd-planes`` again with its numpy plane merge (``TW_TRITON_NATIVE=0``)
    instead of the compiled one: stored bytes, encode and decode
    seconds (best of 3, the variants by turns), and for zstd-planes how many planes went
    through zstd."""
    zstd = entropy.ZstdSettings(min_match=entropy.PLANE_MATCH[0], hash_log=entropy.PLANE_MATCH[1])
    out: dict[str, dict[str, Any]] = {}
    encoded = {}
    for label, name, compiled in PLANE_VARIANTS:
        with _compiled(compiled):
            encoded[label] = [entropy.get_stage(name).encode(b, 4, zstd) for b in bufs]
        out[label] = {"bytes": sum(len(e[0]) for e in encoded[label]), "encode_s": [], "decode_s": []}
    assert [e[0] for e in encoded["zstd-planes"]] == [e[0] for e in encoded["zstd-planes, numpy"]]
    out["zstd-planes"]["coded_planes"] = sum(sum(1 for n in e[1]["frames"] if n) for e in encoded["zstd-planes"])
    out["zstd-planes"]["planes"] = 4 * len(bufs)
    dests = [memoryview(bytearray(len(b))) for b in bufs]  # written once before timing: no first-touch faults
    for _ in range(REPEATS):
        for label, name, compiled in PLANE_VARIANTS:
            stage = entropy.get_stage(name)
            with _compiled(compiled):
                t0 = time.perf_counter()
                for b in bufs:
                    stage.encode(b, 4, zstd)
                out[label]["encode_s"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for (stored, params), dest in zip(encoded[label], dests):
                    stage.decode(memoryview(stored), params, dest, "bench")
                out[label]["decode_s"].append(time.perf_counter() - t0)
            for b, dest in zip(bufs, dests):
                assert bytes(dest) == bytes(b), label
    for row in out.values():
        row["encode_s"], row["decode_s"] = min(row["encode_s"]), min(row["decode_s"])
    out["compiled_planes"] = native.enabled()
    return out


@contextlib.contextmanager
def _compiled(on: bool) -> Any:
    """The compiled library on (as installed) or off (``TW_TRITON_NATIVE=0``) inside."""
    old = os.environ.get(native.ENV_NATIVE)
    os.environ[native.ENV_NATIVE] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[native.ENV_NATIVE]
        else:
            os.environ[native.ENV_NATIVE] = old


@contextlib.contextmanager
def _one_torch_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _training_state(trainer: Trainer) -> dict[str, Any]:
    """Model and AdamW state of the GPT (what the restart benchmarks' checkpoints hold)."""
    return {"model": trainer.model.state_dict(), "optimizer": trainer.opt.state_dict()}


def train_states(cfg: Config, keyframe: int, seed: int, tmp: Path) -> dict[str, QuantizedState]:
    corpus = load_corpus()
    trainer = Trainer(cfg, corpus, seed)
    keyframe_path = tmp / "keyframe.tw"
    states: dict[str, QuantizedState] = {}
    t0 = time.perf_counter()
    while trainer.step < cfg.steps:
        if trainer.step == keyframe:
            states["keyframe (exact)"] = tw_triton.quantize_state_dict(_training_state(trainer), rules="exact")
            tw_triton.save(states["keyframe (exact)"], keyframe_path, fsync=False, entropy=None)
        trainer.train_step()
    log(f"trained {cfg.steps} steps in {time.perf_counter() - t0:.1f} s")
    final = _training_state(trainer)
    for bits in (8, 4, 2):
        states[f"delta int{bits}"] = tw_triton.quantize_state_dict(final, reference=keyframe_path, bits=bits)
    states['delta int8, preset "small"'] = tw_triton.quantize_state_dict(final, reference=keyframe_path, rules="small")
    # "smallest": its moments (int3 exp_avg, 2-bit log2 exp_avg_sq, wider blocks). Its 2-bit
    # weight deltas are coded against the keyframe here (the Checkpointer's closed loop codes
    # them against the previous save, which this single state cannot show).
    states['delta int2, preset "smallest"'] = tw_triton.quantize_state_dict(final, reference=keyframe_path,
                                                                           rules="smallest")
    return states


def _bits(nbytes: float, elements: int) -> str:
    return f"{8 * nbytes / elements:.3f}"


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    cfg = result["config"]
    lines = [
        "# Entropy stage on a training state",
        "",
        f"Machine: {env['machine']}; Python {env['python']}, torch {env['torch']}, zstandard "
        f"{result['zstandard']}, {env['torch_threads']} torch thread(s). One run, on a machine "
        "shared with other jobs: timings are noisy (best of 3 per kind); sizes are exact.",
        "",
        f"State: the tiny GPT of `resume_fidelity.py` (d_model {cfg['d_model']}, {cfg['n_layers']} layers, "
        f"{result['parameters']:,} parameters) trained {cfg['steps']} AdamW steps; keyframe (exact) at step "
        f"{cfg['keyframe']}, deltas of the final state against it (default rules at 8/4/2 bits; "
        "the `small` preset codes the moments).",
        "",
        "Bits per element: raw = as the codec stores it; zstd / bytegroup = after that stage at "
        f"level {entropy.DEFAULT_LEVEL} with the policy's match settings (bytegroup on buffers of "
        f"{_size(entropy.PLANE_MATCH_MIN_BYTES)} and more: min_match {entropy.PLANE_MATCH[0]}, hash_log "
        f"{entropy.PLANE_MATCH[1]}; else the level's own); auto = what the writer's default policy stores (buffers "
        f"under {entropy.MIN_STAGE_BYTES} B or saving under {entropy.MIN_SAVING:.0%} stay raw); "
        "H0 = order-0 empirical entropy (code symbols for codes; sum over byte planes for "
        "floats). Throughput: the policy's stage, MB/s of raw bytes, one thread below 8 MiB.",
        "",
        f"Command: `python benchmarks/entropy_stage.py`",
        "",
    ]
    headers = ["kind", "buffers", "elements", "raw", "zstd", "bytegroup", "auto", "H0", "auto saves",
               "compress MB/s", "decompress MB/s"]
    rows = []
    for kind, k in result["kinds"].items():
        n = k["elements"]
        rows.append([
            kind, k["buffers"], f"{n:,}", f"{k['raw_bits']}",
            _bits(k["stored"][f"zstd/{entropy.DEFAULT_LEVEL}"], n),
            _bits(k["stored"][f"zstd-bytegroup/{entropy.DEFAULT_LEVEL}"], n),
            _bits(k["auto_bytes"], n), f"{k['h0_bits']:.3f}",
            f"{1 - k['auto_bytes'] / k['raw_bytes']:.1%}",
            f"{k['compress_mb_s']:.0f}", f"{k['decompress_mb_s']:.0f}",
        ])
    lines += ["## Bits per element, by buffer kind", "", fmt_table(headers, rows), ""]
    variants = [f"{lv}/{m}" for lv in LEVELS for m in MATCHES]
    headers = (["kind", "stage"] + [f"level {v} bits" for v in variants] + [f"level {v} MB/s" for v in variants])
    rows = []
    for kind, k in result["kinds"].items():
        n = k["elements"]
        s = k["policy_stage"]
        rows.append([kind, s] + [_bits(k["stored"][f"{s}/{v}"], n) for v in variants]
                    + [f"{k['level_speed_mb_s'][v]:.0f}" for v in variants])
    lines += [
        "## zstd level and match settings (the policy's stage)",
        "",
        f"`level N/own`: the level's own match finder; `level N/planes`: min_match "
        f"{entropy.PLANE_MATCH[0]}, hash_log {entropy.PLANE_MATCH[1]} (what the policy gives zstd-bytegroup from {_size(entropy.PLANE_MATCH_MIN_BYTES)} up).",
        "",
        fmt_table(headers, rows),
        "",
    ]
    headers = ["checkpoint", "tensors raw", "file, entropy=None", "file, auto", "auto smaller by",
               "write none / auto s", "read none / auto s"]
    rows = []
    for r in result["files"]:
        rows.append([
            r["checkpoint"], f"{r['raw_tensor_bytes'] / 2**20:.2f} MiB", f"{r['none_bytes'] / 2**20:.2f} MiB",
            f"{r['auto_bytes'] / 2**20:.2f} MiB", f"{r['none_bytes'] / r['auto_bytes']:.2f}x",
            f"{r['none_write_s']:.3f} / {r['auto_write_s']:.3f}", f"{r['none_read_s']:.3f} / {r['auto_read_s']:.3f}",
        ])
    lines += ["## Whole files (write_file without fsync, page cache)", "", fmt_table(headers, rows), ""]
    big = result["large_buffer"]
    rows = [[label, f"{big[k]['bits']:.3f}", f"{big[k]['compress_mb_s']:.0f}", f"{big[k]['decompress_mb_s']:.0f}"]
            for k, label in (("0", "1 thread"), ("2", "2 zstd threads"))]
    lines += [
        f"## One large buffer: {big['nbytes'] >> 20} MiB of synthetic Gaussian fp32 (zstd-bytegroup)",
        "",
        f"The writer's default here: {big['default_threads'] or 1} thread(s) (zstd threads are used from "
        f"{entropy.MT_MIN_BYTES >> 20} MiB up, with half the cores, and only where that makes 2 or "
        "more; decoding is one thread either way).",
        "",
        fmt_table(["compress", "bits/elem", "compress MB/s", "decompress MB/s"], rows),
        "",
    ]
    planes = result.get("minilm_planes")
    lines += ["## Match settings on large buffers: MiniLM + AdamW (zstd-bytegroup, level 1)", ""]
    if planes is None:
        lines += ["Not measured: the `bench` extra (all-MiniLM-L6-v2) is not installed.", ""]
    else:
        rows = [[kind, r["buffers"], f"{r['raw_bytes'] / 2**20:.1f} MiB",
                 f"{r['own_bytes'] / r['raw_bytes']:.4f}", f"{r['planes_bytes'] / r['raw_bytes']:.4f}",
                 f"{r['own_s']:.3f}", f"{r['planes_s']:.3f}", f"{r['planes_s'] / r['own_s']:.2f}x"]
                for kind, r in planes.items()]
        lines += [
            f"The exact fp32 tensors of {_size(entropy.PLANE_MATCH_MIN_BYTES)} and more (where the policy uses min_match "
            f"{entropy.PLANE_MATCH[0]}, hash_log {entropy.PLANE_MATCH[1]}); stored fraction of the raw "
            "bytes, and seconds to encode them all (best of 3, one thread, one process).",
            "",
            fmt_table(["kind", "buffers", "raw", "stored, level's own", "stored, PLANE_MATCH",
                       "s, level's own", "s, PLANE_MATCH", "time ratio"], rows),
            "",
        ]
        rows = []
        for kind, r in planes.items():
            g, p = r["stages"]["zstd-bytegroup"], r["stages"]["zstd-planes"]
            n = r["stages"].get("zstd-planes, numpy")
            numpy_cells = [f"{n['decode_s']:.3f}"] if n else ["-"]
            rows.append([kind, f"{r['raw_bytes'] / 2**20:.1f} MiB", f"{g['bytes'] / r['raw_bytes']:.4f}",
                         f"{p['bytes'] / r['raw_bytes']:.4f}", f"{p['coded_planes']} of {p['planes']}",
                         f"{g['encode_s']:.3f} / {p['encode_s']:.3f}", f"{g['decode_s']:.3f} / {p['decode_s']:.3f}",
                         *numpy_cells])
        compiled = next(iter(planes.values()))["stages"].get("compiled_planes")
        lines += [
            "## zstd-bytegroup against zstd-planes: MiniLM + AdamW (level 1, PLANE_MATCH)",
            "",
            "The same tensors: one frame over all byte planes against a frame per plane where the "
            f"plane's sampled order-0 entropy promises {entropy.PLANE_MIN_SAVING:.0%} or more (the rest "
            "stored raw). Stored fraction of the raw bytes, and seconds to encode and to decode them "
            "all into memory written before (best of 3, the variants by turns, one thread). The last "
            "column: zstd-planes decoded again with its numpy plane merge (`TW_TRITON_NATIVE=0`), "
            "same bytes; the other columns ran with the compiled library "
            f"{'on' if compiled else 'off (not built)'}.",
            "",
            fmt_table(["kind", "raw", "stored, bytegroup", "stored, planes", "planes through zstd",
                       "encode s, bytegroup / planes", "decode s, bytegroup / planes",
                       "decode s, planes numpy"], rows),
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--keyframe", type=int, default=150)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print only; leave results/ alone")
    args = parser.parse_args()
    cfg = Config(d_model=args.d_model, n_layers=args.layers, steps=args.steps)
    import zstandard

    with tempfile.TemporaryDirectory() as tmp:
        states = train_states(cfg, args.keyframe, args.seed, Path(tmp))
        kinds = collect(states)
        measured = {kind: measure_kind(bufs) for kind, bufs in sorted(kinds.items())}
        files = file_sizes(states, Path(tmp))
    large = large_buffer_threads()
    planes = minilm_planes()
    params = sum(e.raw_nbytes // e.dtype.itemsize for p, e in states["keyframe (exact)"].entries.items()
                 if p.startswith("model/"))
    result = {
        "config": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "steps": cfg.steps, "keyframe": args.keyframe,
                   "seed": args.seed},
        "parameters": params,
        "zstandard": zstandard.__version__,
        "kinds": measured,
        "files": files,
        "large_buffer": large,
        "minilm_planes": planes,
    }
    if args.no_write:
        print(markdown({"environment": environment(), **result}))
        return
    path = write_result("entropy_stage", result)
    md = markdown({"environment": environment(), **result})
    (RESULTS_DIR / "entropy_stage.md").write_text(md + "\n", encoding="utf-8")
    print(md)
    log(f"wrote {path} and {RESULTS_DIR / 'entropy_stage.md'}")


if __name__ == "__main__":
    main()
