"""Codec benchmark: throughput beside a plain copy, peak temporary memory, ratios, error stats.

    python benchmarks/codec.py             # full run (16M elements), writes results/codec_cpu.*
    python benchmarks/codec.py --quick     # small sizes, a few seconds (used by a smoke test)
    python benchmarks/codec.py --ratios    # only the table of stored sizes (for docs/codecs.md)

CPU: encode and decode throughput (GB/s of input read: x, plus the reference when there is
one) next to ``copy_`` of the same tensor into a buffer allocated once, all writing into
memory allocated once, timed in the same run, interleaved rep by rep, medians reported. The
ratios time(copy_)/time(encode) and time(copy_)/time(decode) are the figures of merit (goal
>= 0.5); the allocating calls are reported beside ``clone``. ``--threads 1`` shows what the
second core adds.
CUDA (when present): the Triton kernels under ``triton.testing.do_bench`` next to a
device-to-device copy ``torch.empty_like(x).copy_(x)`` (goal >= 0.85 of copy bandwidth).
Peak temporaries of the chunked CPU path are measured as the RSS high-water mark of a fresh
subprocess, minus the input and outputs, in units of one fp32 chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.codec_report import markdown_report, ratio_table_markdown  # noqa: E402
from harness.common import machine_description, write_result  # noqa: E402

import tw_triton  # noqa: E402
from tw_triton.codecs import blockwise as codec  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BITS = (8, 4, 2)


# ---------------------------------------------------------------------------- CPU timing


def _time_once(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _timed_row(
    codec_name: str,
    x: torch.Tensor,
    ref_dtype: torch.dtype | None,
    bits: int,
    read: int,
    ops: dict[str, Callable[[], object]],
    reps: int,
) -> dict:
    """Time ``ops`` (``enc``, ``dec``: the CPU path as callers get it, compiled where built;
    ``enc_torch``, ``dec_torch``: the torch reference; ``enc_alloc``, ``dec_alloc``) beside ``copy_`` and
    ``clone`` of ``x``, interleaved over ``reps``; one table row. ``read``: the bytes an
    encode reads (x, plus the reference when there is one)."""
    dst = torch.empty_like(x)
    timers = {"copy": lambda: dst.copy_(x), "clone": lambda: x.clone(), **ops}
    t: dict[str, list[float]] = {k: [] for k in timers}
    for _ in range(reps):
        for key, fn in timers.items():
            t[key].append(_time_once(fn))
    med = {k: statistics.median(v) for k, v in t.items()}
    xbytes = x.numel() * x.element_size()

    def over(base_key: str, key: str) -> float:
        return statistics.median(c / e for c, e in zip(t[base_key], t[key]))

    return dict(
        codec=codec_name,
        dtype=str(x.dtype).replace("torch.", ""),
        reference=None if ref_dtype is None else str(ref_dtype).replace("torch.", ""),
        bits=bits,
        block=128,
        numel=x.numel(),
        copy_gbps=xbytes / med["copy"] / 1e9,
        clone_gbps=xbytes / med["clone"] / 1e9,
        encode_gbps=read / med["enc"] / 1e9,
        decode_gbps=read / med["dec"] / 1e9,
        encode_alloc_gbps=read / med["enc_alloc"] / 1e9,
        decode_alloc_gbps=read / med["dec_alloc"] / 1e9,
        # Same tensor x: time(copy_ of x) / time(op). With a reference the codec also reads
        # it, so the figure is harsher on it than on copy_.
        encode_over_copy=over("copy", "enc"),
        decode_over_copy=over("copy", "dec"),
        # The plain-torch reference (the spec), which runs where the compiled codec is not built.
        torch_encode_over_copy=over("copy", "enc_torch"),
        torch_decode_over_copy=over("copy", "dec_torch"),
        encode_alloc_over_clone=over("clone", "enc_alloc"),
        decode_alloc_over_clone=over("clone", "dec_alloc"),
    )


def cpu_throughput(n: int, reps: int) -> list[dict]:
    """Rows of encode/decode throughput beside ``copy_`` and ``clone``, for fp32 and bf16,
    with and without a reference.

    Per rep, interleaved so that load from other processes hits them alike: ``copy_`` of x
    into a buffer allocated once; encode and decode into outputs allocated once (``out=``:
    the like-for-like comparison with ``copy_``); ``clone``, encode and decode that allocate
    their outputs (fresh pages: what a caller without reused memory pays). Ratios are
    time(copy_) / time(op) per rep, medians over reps (>= 0.5 is the goal).
    """
    rows = []
    g = torch.Generator().manual_seed(0)
    base = torch.randn(n, generator=g)
    cases = [
        (torch.float32, None),
        (torch.bfloat16, None),
        (torch.bfloat16, torch.bfloat16),
    ]
    for dtype, ref_dtype in cases:
        x = base.to(dtype)
        ref = None if ref_dtype is None else (base * 0.99).to(ref_dtype)
        read = x.numel() * x.element_size() + (0 if ref is None else ref.numel() * ref.element_size())
        for bits in BITS:
            codes, scales = codec.quantize_blockwise_torch(x, ref, bits, 128)  # warm-up
            q = tw_triton.quantize(x, bits=bits, block=128, reference=ref)
            tw_triton.dequantize(q, reference=ref)
            out_x = torch.empty(n, dtype=dtype)
            ops = {
                "enc": lambda: codec.quantize_blockwise_cpu(x, ref, bits, 128, out=(codes, scales)),
                "dec": lambda: codec.dequantize_blockwise_cpu(
                    codes, scales, n, bits, 128, ref, dtype, out=out_x
                ),
                "enc_torch": lambda: codec.quantize_blockwise_torch(x, ref, bits, 128, out=(codes, scales)),
                "dec_torch": lambda: codec.dequantize_blockwise_torch(
                    codes, scales, n, bits, 128, ref, dtype, out=out_x
                ),
                "enc_alloc": lambda: tw_triton.quantize(x, bits=bits, block=128, reference=ref),
                "dec_alloc": lambda: tw_triton.dequantize(q, reference=ref),
            }
            rows.append(_timed_row("blockwise", x, ref_dtype, bits, read, ops, reps))
            print(_row_text(rows[-1]), flush=True)
    rows += log2_throughput(base, reps)
    return rows


def log2_throughput(base: torch.Tensor, reps: int) -> list[dict]:
    """The same columns for the ``log2`` second-moment codec, on a second-moment-like input:
    squares of normal values (positive, spanning many octaves) with 2% of the blocks exact
    zeros, as the rows of embedding tokens a batch never saw. Blocks that mix zeros with
    positive values take the codec's masked path, several times slower (see its module)."""
    from tw_triton.codecs import log2

    rows = []
    v = base.square()
    v[: v.numel() // 128 * 128].view(-1, 128)[::50] = 0.0
    n = v.numel()
    for dtype in (torch.float32, torch.bfloat16):
        x = v.to(dtype)
        for bits in BITS:
            enc = log2.quantize_log2_torch(x, bits, 128)  # warm-up, and the outputs reused
            q = log2.quantize_log2(x, bits=bits, block=128)
            log2.dequantize_log2(q)
            out_x = torch.empty(n, dtype=dtype)
            ops = {
                "enc": lambda: log2.quantize_log2_cpu(x, bits, 128, out=enc),
                "dec": lambda: log2.dequantize_log2_cpu(*enc, n, bits, 128, dtype, out=out_x),
                "enc_torch": lambda: log2.quantize_log2_torch(x, bits, 128, out=enc),
                "dec_torch": lambda: log2.dequantize_log2_torch(*enc, n, bits, 128, dtype, out=out_x),
                "enc_alloc": lambda: log2.quantize_log2(x, bits=bits, block=128),
                "dec_alloc": lambda: log2.dequantize_log2(q),
            }
            rows.append(_timed_row("log2", x, None, bits, x.numel() * x.element_size(), ops, reps))
            print(_row_text(rows[-1]), flush=True)
    return rows


def _median_rows(runs: list[list[dict]]) -> list[dict]:
    """Cell by cell median of the numeric fields over several runs of the same table."""
    if len(runs) == 1:
        return runs[0]
    out = []
    for cells in zip(*runs):
        row = dict(cells[0])
        for key, value in row.items():
            if isinstance(value, float):
                row[key] = statistics.median(c[key] for c in cells)
        row["runs"] = len(cells)
        out.append(row)
    return out


def _row_text(r: dict) -> str:
    ref = f"+ref {r['reference']}" if r["reference"] else "no ref"
    return (
        f"{r.get('codec', 'blockwise'):>9} {r['dtype']:>8} {ref:>12} bits={r['bits']} n={r['numel']}: copy_ {r['copy_gbps']:6.2f} GB/s"
        f" | encode {r['encode_gbps']:6.2f} GB/s ({r['encode_over_copy']:.2f} of copy_)"
        f" | decode {r['decode_gbps']:6.2f} GB/s ({r['decode_over_copy']:.2f} of copy_)"
        f" | allocating: clone {r['clone_gbps']:5.2f}, encode {r['encode_alloc_gbps']:5.2f},"
        f" decode {r['decode_alloc_gbps']:5.2f} GB/s"
    )


# ---------------------------------------------------------------------------- peak memory

_MEMORY_PROBE = textwrap.dedent(
    """
    import json, sys, torch
    from tw_triton.codecs import blockwise as codec

    def status_kib(field):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))

    n, bits, dtype_name, with_ref = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
    transposed = sys.argv[5] == "1"
    dtype = getattr(torch, dtype_name)
    x = torch.randn(n, dtype=dtype)
    ref = torch.randn(n, dtype=dtype) if with_ref else None
    if transposed:  # a strided input: read chunk by chunk, never copied whole
        x = x.view(1024, -1).t()
        ref = None if ref is None else ref.view(1024, -1).t()
    small = torch.randn(3 * codec.CHUNK_ELEMENTS + 77, dtype=dtype)
    codec.quantize_blockwise_torch(small, None if ref is None else small, bits, 128)  # warm-up
    codec.release_scratch()  # the measured encode allocates its scratch: that is its cost
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark (VmHWM) to the current RSS
    before = status_kib("VmRSS") * 1024
    codes, scales = codec.quantize_blockwise_torch(x, ref, bits, 128)
    assert x.is_contiguous() != transposed
    after = status_kib("VmHWM") * 1024
    out = codes.numel() + 4 * scales.numel()
    print(json.dumps(dict(before=before, after=after, outputs=out)))
    """
)


def peak_temporaries(n: int, quick: bool = False) -> list[dict]:
    """RSS growth of one encode in a fresh process, less its outputs, in fp32 chunks.

    Linux only: the probe resets the process's RSS high-water mark through
    ``/proc/self/clear_refs`` just before the encode and reads ``VmHWM`` after it.
    """
    chunk_bytes = 4 * codec.CHUNK_ELEMENTS
    rows = []
    configs = (
        [("float32", False, 8, False)]
        if quick
        else [
            (name, ref, bits, False)
            for name, ref in (("float32", False), ("bfloat16", False), ("bfloat16", True))
            for bits in BITS
        ]
        + [("float32", False, 8, True), ("bfloat16", True, 4, True)]
    )
    for dtype_name, with_ref, bits, transposed in configs:
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                _MEMORY_PROBE,
                str(n),
                str(bits),
                dtype_name,
                str(int(with_ref)),
                str(int(transposed)),
            ],
            capture_output=True,
            text=True,
            check=True,
            # A fixed mmap threshold: big buffers are mapped and unmapped, never kept in
            # a heap that the warm-up grew and the measured encode would silently reuse.
            env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"},
        )
        m = json.loads(proc.stdout.strip().splitlines()[-1])
        temp = m["after"] - m["before"] - m["outputs"]  # RSS accounting: +-0.5 MiB
        rows.append(
            dict(
                dtype=dtype_name,
                reference=with_ref,
                transposed=transposed,
                bits=bits,
                numel=n,
                input_mib=n * (4 if dtype_name == "float32" else 2) / 2**20,
                outputs_mib=m["outputs"] / 2**20,
                temporaries_mib=temp / 2**20,
                chunks=temp / chunk_bytes,
            )
        )
        r = rows[-1]
        print(
            f"peak temporaries {dtype_name}{' +ref' if with_ref else ''}{' transposed' if transposed else ''} bits={bits}:"
            f" {r['temporaries_mib']:.1f} MiB = {r['chunks']:.2f} chunks of"
            f" {chunk_bytes / 2**20:.0f} MiB (input {r['input_mib']:.0f} MiB)",
            flush=True,
        )
    return rows


# ---------------------------------------------------------------------------- error stats


def bound_stats(n: int) -> list[dict]:
    """How often |d - q*s| exceeds s/2 (the strict bound), how often it equals it, and how
    often the once-rounded quotient fl(d/s) is exactly a half-integer: the elements where
    rne(fl(d/s)) could pick the wrong side, whose side the encoder settles exactly.
    """
    rows = []
    g = torch.Generator().manual_seed(1)
    # Gaussian blocks: about a fifth of the elements have |d/s| >= qmax/2, where the
    # quotient's rounding step is largest.
    x = torch.randn(n, generator=g)
    for bits in BITS:
        q = tw_triton.quantize(x, bits=bits, block=128)
        qi = _codes_to_q(q.codes.numpy(), n, bits).astype(np.float64)
        s = np.repeat(q.scales.numpy().astype(np.float64), 128)[:n]
        d = x.numpy().astype(np.float64)
        # Exact in fp64: q (<= 8 bits) times s (24 bits) fits in 53, and d - q*s is a short
        # difference of nearby multiples of ulp(s)/2**8 (see tests/codecs/test_codec_properties.py).
        err = np.abs(d - qi * s)
        usable = s > 0
        over = int(np.count_nonzero(err[usable] > s[usable] / 2))
        at = int(np.count_nonzero(err[usable] == s[usable] / 2))
        v = (x.numpy() / np.where(usable, s, 1.0).astype(np.float32)).astype(np.float32)
        half = int(np.count_nonzero(np.abs(v - np.rint(v)) == 0.5))
        rows.append(
            dict(bits=bits, numel=n, over_half_scale=over, at_half_scale=at, quotient_on_half_integer=half)
        )
        print(
            f"bits={bits}: |d - q*s| > s/2 for {over} of {n} elements ({over / n:.2e}),"
            f" = s/2 for {at} ({at / n:.2e}); fl(d/s) on a half-integer: {half} ({half / n:.2e})",
            flush=True,
        )
    return rows


def _codes_to_q(codes: np.ndarray, n: int, bits: int) -> np.ndarray:
    k = 8 // bits
    u = (codes.astype(np.int64)[:, None] >> (np.arange(k) * bits)) & ((1 << bits) - 1)
    return u.reshape(-1)[:n] - (1 << (bits - 1))


# ---------------------------------------------------------------------------- CUDA


def cuda_throughput(n: int) -> list[dict]:
    """Triton encode/decode next to a device-to-device copy, with triton.testing.do_bench."""
    from triton.testing import do_bench

    rows = []
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    base = torch.randn(n, device=dev, generator=g)
    for dtype, ref_dtype in ((torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.bfloat16)):
        x = base.to(dtype)
        ref = None if ref_dtype is None else (base * 0.99).to(ref_dtype)
        read = x.numel() * x.element_size() + (0 if ref is None else ref.numel() * ref.element_size())
        copy_ms = do_bench(lambda: torch.empty_like(x).copy_(x))
        for bits in BITS:
            q = tw_triton.quantize(x, bits=bits, block=128, reference=ref)
            enc_ms = do_bench(lambda: tw_triton.quantize(x, bits=bits, block=128, reference=ref))
            dec_ms = do_bench(lambda: tw_triton.dequantize(q, reference=ref))
            xbytes = x.numel() * x.element_size()
            rows.append(
                dict(
                    dtype=str(dtype).replace("torch.", ""),
                    reference=None if ref_dtype is None else str(ref_dtype).replace("torch.", ""),
                    bits=bits,
                    block=128,
                    numel=n,
                    # A copy reads and writes x: report what it reads, like the codec.
                    copy_gbps=xbytes / copy_ms / 1e6,
                    encode_gbps=read / enc_ms / 1e6,
                    decode_gbps=read / dec_ms / 1e6,
                    encode_over_copy=(read / enc_ms) / (xbytes / copy_ms),
                    # Bytes moved (read + written) per ms against the copy's 2 * x bytes:
                    # the roofline view, where encode writes only ~bits/8 of what it reads.
                    encode_traffic_over_copy=((read + q.nbytes) / enc_ms) / (2 * xbytes / copy_ms),
                )
            )
            r = rows[-1]
            print(
                f"cuda {r['dtype']:>8} ref={r['reference']} bits={bits}: copy {r['copy_gbps']:7.1f} GB/s"
                f" | encode {r['encode_gbps']:7.1f} GB/s ({r['encode_over_copy']:.2f} of copy)"
                f" | decode {r['decode_gbps']:7.1f} GB/s",
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    p.add_argument("--ratios", action="store_true", help="print the stored-size table only")
    p.add_argument("--n", type=int, default=None, help="elements per tensor (default 16M, quick 256K)")
    p.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 7, quick 2)")
    p.add_argument("--runs", type=int, default=1, help="repeat the CPU timing table, keep medians")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", type=Path, default=None, help="markdown report (default results/codec_cpu.md)")
    args = p.parse_args(argv)
    if args.ratios:
        print(ratio_table_markdown())
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    args.n = args.n or ((1 << 16) if args.quick else (1 << 24))
    args.reps = args.reps or (1 if args.quick else 7)
    machine = machine_description()
    print(f"# {machine}; chunk {codec.CHUNK_ELEMENTS} elements", flush=True)
    args.load_before = os.getloadavg()[0]
    runs = [cpu_throughput(args.n, args.reps) for _ in range(args.runs)]
    args.load_after = os.getloadavg()[0]
    cpu = _median_rows(runs)
    mem = peak_temporaries(args.n if args.quick else 4 * args.n, quick=args.quick)
    stats = bound_stats(args.n)
    cuda = cuda_throughput(args.n) if torch.cuda.is_available() else []
    report = markdown_report(machine, cpu, mem, stats, cuda, args)
    out = args.out or RESULTS / "codec_cpu.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report, encoding="utf-8")
    if args.out is None:
        write_result(
            "codec_cpu",
            dict(
                n=args.n,
                reps=args.reps,
                chunk_elements=codec.CHUNK_ELEMENTS,
                cpu=cpu,
                memory=mem,
                bound_stats=stats,
                cuda=cuda,
            ),
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
