"""What the file format costs: CRC-32 verification on load, read and write strategies,
the writer's extra memory, and the header's share of a realistic checkpoint.

Run:  python benchmarks/checksum_cost.py            (~150 MB state, 7 rounds)
      python benchmarks/checksum_cost.py --mb 200 --rounds 9 --dir /some/disk

Every timing is a median over rounds in which the compared variants run back to back,
interleaved, on the same file; the tables report ratios from that one run. The file is in
the page cache (it was just written), so the reads measure memory copies plus checksums:
the worst case for the checksum's share, since a read from disk would add only the disk's
time to both sides. Writes use ``fsync=False`` so that the disk does not dominate.
Results go to ``benchmarks/results/checksum_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_description, median, write_result  # noqa: E402

from tw_triton import format as fmt  # noqa: E402
from tw_triton.qstate import EncodedEntry, QuantizedState  # noqa: E402


def synthetic_state(total_mb: int, seed: int = 0) -> QuantizedState:
    """About ``total_mb`` MB of buffers shaped like a training checkpoint: a third as
    blockwise int8 weights (codes + fp32 scales), the rest as exact fp32 optimizer moments.
    Contents are random bytes: the format and the CRC do not look at values."""
    g = torch.Generator().manual_seed(seed)
    entries: dict[str, EncodedEntry] = {}
    numel = 1 << 22  # 4 Mi elements per tensor
    budget = total_mb * 1_000_000
    i = 0
    while budget > 0:
        if i % 3 == 0:
            codes = torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=g)
            scales = torch.rand(numel // 128, generator=g)
            entries[f"model/layers.{i}.weight"] = EncodedEntry(
                "blockwise",
                {"bits": 8, "block": 128, "packing": "lsb-first", "delta": True},
                (2048, 2048),
                torch.float32,
                {"codes": codes, "scales": scales},
            )
            budget -= codes.numel() + 4 * scales.numel()
        else:
            data = torch.randn(numel, generator=g)
            entries[f"optimizer/state/{i}/exp_avg"] = EncodedEntry(
                "exact", {}, (2048, 2048), torch.float32, {"data": data}
            )
            budget -= 4 * numel
        i += 1
    return QuantizedState(entries=entries, skeleton={"step": 1}, checkpoint_id="bench")


def flat_tensors(state: QuantizedState) -> dict[str, torch.Tensor]:
    return {fmt.tensor_key(p, n): t for p, e in state.entries.items() for n, t in e.buffers.items()}


def read_mmap_copy(path: str) -> dict[str, torch.Tensor]:
    """The mmap alternative to plain reads: map the file, copy each buffer out (a copy is
    needed anyway: a mapping dies with a truncated file, with SIGBUS, not an exception)."""
    out = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        (n,) = struct.unpack("<Q", m[:8])
        header = json.loads(m[8 : 8 + n])
        header.pop("__metadata__")
        arr = np.frombuffer(m, dtype=np.uint8)
        for key, info in header.items():
            s, e = info["data_offsets"]
            t = torch.empty(e - s, dtype=torch.uint8)
            t.numpy()[:] = arr[8 + n + s : 8 + n + e]
            out[key] = t
        del arr
    return out


def timed(fn, *args, **kwargs) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def peak_rss_of_write(writer: str, total_mb: int, directory: str) -> float:
    """Extra peak RSS (MB) of one write, measured in a fresh process."""
    code = (
        "import resource, sys; sys.path.insert(0, %r)\n"
        "import checksum_cost as b, safetensors.torch\n"
        "s = b.synthetic_state(%d)\n"
        "flat = b.flat_tensors(s)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "if %r == 'tw_triton': b.fmt.write_file(s, %r, fsync=False)\n"
        "else: safetensors.torch.save_file(flat, %r)\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print((after - before) / 1024)\n"
    ) % (
        str(Path(__file__).resolve().parent),
        total_mb,
        writer,
        os.path.join(directory, "rss.tw"),
        os.path.join(directory, "rss.st"),
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def header_overhead() -> dict[str, float]:
    """Header bytes of a realistic training state: a 4-layer transformer encoder with its
    AdamW state after one step, through the state API's default rules."""
    import tw_triton

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
    model = torch.nn.Sequential(
        torch.nn.Embedding(8000, 256), torch.nn.TransformerEncoder(layer, num_layers=4), torch.nn.Linear(256, 8000)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 8000, (2, 16))).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1, "rng": torch.get_rng_state()}
    q = tw_triton.quantize_state_dict(state)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt.safetensors")
        size = fmt.write_file(q, path, fsync=False)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
    return {
        "entries": len(q.entries),
        "file_bytes": size,
        "header_bytes": 8 + n,
        "header_fraction": (8 + n) / size,
        "header_bytes_per_entry": (8 + n) / len(q.entries),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=150, help="state size in MB (default 150)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--dir", default=None, help="directory for the files (default: a temp dir)")
    args = ap.parse_args()

    machine = machine_description()
    state = synthetic_state(args.mb)
    flat = flat_tensors(state)
    nbytes = state.nbytes
    print(f"machine: {machine}; load average at start {os.getloadavg()[0]:.1f}")
    print(f"state: {len(state.entries)} entries, {len(flat)} buffers, {nbytes / 1e6:.1f} MB")

    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        ours = os.path.join(d, "ckpt.tw.safetensors")
        theirs = os.path.join(d, "ckpt.st.safetensors")
        fmt.write_file(state, ours, fsync=False)
        safetensors.torch.save_file(flat, theirs)

        # Raw CRC-32 and Adler-32 throughput over the same bytes in memory.
        buf = memoryview(bytearray(os.urandom(1 << 20)) * 64)
        crc_s = median([timed(zlib.crc32, buf) for _ in range(args.rounds)])
        adler_s = median([timed(zlib.adler32, buf) for _ in range(args.rounds)])

        variants = {
            "read_file(verify=True)": lambda: fmt.read_file(ours),
            "read_file(verify=False)": lambda: fmt.read_file(ours, verify=False),
            "verify_file": lambda: fmt.verify_file(ours),
            "mmap + copy (no verify)": lambda: read_mmap_copy(ours),
            # load_file maps the file lazily; copying the tensors out makes it do the reading.
            "safetensors load_file + copy": lambda: {
                k: v.clone() for k, v in safetensors.torch.load_file(theirs).items()
            },
            "write_file(fsync=False)": lambda: fmt.write_file(state, ours, fsync=False),
            "safetensors.torch.save_file": lambda: safetensors.torch.save_file(flat, theirs),
        }
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                times[name].append(timed(fn))
        med = {k: median(v) for k, v in times.items()}

        rss = {w: peak_rss_of_write(w, args.mb, d) for w in ("tw_triton", "safetensors")}

    base = med["read_file(verify=False)"]
    print(f"\nCRC-32 in memory: {len(buf) / crc_s / 1e9:.2f} GB/s, Adler-32: {len(buf) / adler_s / 1e9:.2f} GB/s")
    print(f"\n{'variant':32} {'median s':>9} {'GB/s':>6} {'vs read_file(verify=False)':>27}")
    for k, v in med.items():
        print(f"{k:32} {v:9.4f} {nbytes / v / 1e9:6.2f} {v / base:26.2f}x")
    ratio = med["read_file(verify=True)"] / base
    print(f"\nchecksum cost on load: verify=True takes {ratio:.2f}x the time of verify=False")
    print(f"extra peak RSS of one write: tw_triton {rss['tw_triton']:.0f} MB, safetensors.save_file {rss['safetensors']:.0f} MB")
    hdr = header_overhead()
    print(
        f"header of a realistic state ({hdr['entries']} entries, {hdr['file_bytes'] / 1e6:.2f} MB file): "
        f"{hdr['header_bytes']} bytes = {100 * hdr['header_fraction']:.3f} % "
        f"({hdr['header_bytes_per_entry']:.0f} bytes per entry)"
    )
    path = write_result(
        "checksum_cost",
        {
            "command": "python benchmarks/checksum_cost.py " + " ".join(sys.argv[1:]),
            "state_bytes": nbytes,
            "buffers": len(flat),
            "rounds": args.rounds,
            "median_seconds": med,
            "all_seconds": times,
            "verify_ratio": ratio,
            "load_average_1min_at_end": os.getloadavg()[0],
            "crc32_gbps": len(buf) / crc_s / 1e9,
            "adler32_gbps": len(buf) / adler_s / 1e9,
            "write_extra_peak_rss_mb": rss,
            "header_overhead": hdr,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
