"""The host's half of a load to a GPU, measured on the CPU: what reading a keyframe through the
ring of pinned slots costs the host, with compressed buffers decoded piece by piece into the
slots (the library's path) against decoded whole into host memory first and then copied
through the slots (the path before it); and the library's path once more with its CRC-32
computed by zlib instead of ISA-L (the same values: what the ``isal`` dependency buys).

The state is a 12-layer MLP stack with a 32k-token embedding and its AdamW moments (about
330 MiB, saved as a keyframe with the defaults: weights exact, moments coded, every large
buffer compressed). A CPU destination stands in for the device, so each slot's copy is a
synchronous host copy where a GPU would run a DMA; everything before it is the code a GPU
load runs. Each load is timed in a fresh process after one untimed load there (so that its
peak memory is its own, not a thread pool's or a library's first use), the two paths in
turns, on the library's reading threads. Reported per path: median and best seconds over
``--repeats``, and the median peak resident memory above the level before the load minus
the decoded state itself (what the load holds on the host beyond its result: slots,
scratch, decoded copies, the mapped file's pages).

Run: ``python benchmarks/ring_load.py`` (about 90 s on 2 cores). Writes
``benchmarks/results/ring_load.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import torch
from harness.common import environment, fmt_table, log, median, mib, write_result
from harness.memory import peak_bytes, reset_peak, rss_bytes

import tw_triton
from tw_triton.format import buffer_io, reader, upload_ring
from tw_triton.format.buffer_io import decode_staged
from tw_triton.parallel import parallel_map


def build_state(layers: int, width: int = 768, vocab: int = 32000) -> dict[str, Any]:
    """Weights and AdamW moments after three steps (the moments populated)."""
    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width))
        for _ in range(layers)
    ]
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, width), *blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, vocab, (4, 64))
    for _ in range(3):
        model(tokens).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def decoded_first(ck: reader.MappedCheckpoint, spec: Any) -> torch.Tensor:
    """The path before: a compressed buffer decoded whole into host memory, then copied on
    through the slots."""
    if spec.stage is None:
        return ck.read_buffer(spec)
    host = decode_staged(ck.stored(spec), spec, ck.path, verify=True, pin=False)
    src = host.reshape(-1).view(torch.uint8)
    dest = torch.empty(spec.shape, dtype=spec.dtype, device=ck.device)
    return ck.ring.upload(dest, lambda view, at: view.copy_(src[at : at + view.numel()]))


def piece_by_piece(ck: reader.MappedCheckpoint, spec: Any) -> torch.Tensor:
    """The library's path."""
    return ck.read_buffer(spec)


# label: (how each buffer is read, the CRC-32 the reads compute: None for the library's).
PATHS = {
    "piece by piece into the slots": (piece_by_piece, None),
    "piece by piece, CRC-32 by zlib": (piece_by_piece, zlib.crc32),
    "decoded whole, then through the slots": (decoded_first, None),
}


def load_once(path: Path, read: Any, crc: Any = None) -> tuple[float, int]:
    """Seconds for one load through the ring, and its peak resident bytes beyond the result;
    ``crc``: the CRC-32 function the reads call instead of the library's (same values)."""
    gc.collect()
    saved = buffer_io.crc32, reader.crc32
    if crc is not None:
        buffer_io.crc32 = reader.crc32 = crc
    try:
        before = rss_bytes()
        reset_peak()
        t0 = time.perf_counter()
        with reader.MappedCheckpoint(
            str(path), verify=True, pin=False, entries=None, device=torch.device("cpu")
        ) as ck:
            specs = ck.layout.buffers
            out = parallel_map(
                lambda spec: read(ck, spec), specs, sizes=[s.raw_nbytes or s.nbytes for s in specs]
            )
        seconds = time.perf_counter() - t0
    finally:
        buffer_io.crc32, reader.crc32 = saved
    result = sum(t.nbytes for t in out)
    return seconds, peak_bytes() - before - result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--child", nargs=2, metavar=("PATH_LABEL", "FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        label, file = args.child
        load_once(Path(file), *PATHS[label])  # threads, libraries and lazy state start here
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # the freed heap leaves the resident size
        print(json.dumps(load_once(Path(file), *PATHS[label])))
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        ck = tw_triton.Checkpointer(tmp)
        ck.save(1, **build_state(args.layers))
        ck.close()
        (path,) = Path(tmp).glob("*.tw.safetensors")
        runs: dict[str, list[tuple[float, int]]] = {label: [] for label in PATHS}
        for _ in range(args.repeats):
            for label in PATHS:
                child = [sys.executable, __file__, "--child", label, str(path)]
                out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
                runs[label].append(tuple(json.loads(out.splitlines()[-1])))
        file_bytes = path.stat().st_size
    rows = {
        label: {
            "median_s": round(median([s for s, _ in r]), 4),
            "best_s": round(min(s for s, _ in r), 4),
            "held_mib": round(mib(median([m for _, m in r])), 1),
        }
        for label, r in runs.items()
    }
    payload = {
        "environment": environment(),
        "file_mib": round(mib(file_bytes), 1),
        "threads": tw_triton.parallel.cpu_threads(),
        "ring_slots": upload_ring.ring_slots(),
        "rows": rows,
    }
    table = fmt_table(
        ["path", "median s", "best s", "held on the host beyond the result (MiB)"],
        [[k, v["median_s"], v["best_s"], v["held_mib"]] for k, v in rows.items()],
    )
    log(
        f"keyframe of {payload['file_mib']} MiB, {payload['threads']} threads, {payload['ring_slots']} slots\n{table}"
    )
    if not args.no_write:
        write_result("ring_load", payload)
    return payload


if __name__ == "__main__":
    main()
