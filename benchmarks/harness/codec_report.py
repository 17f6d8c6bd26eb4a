"""The markdown of the codec benchmark (``codec.py``): its results page and the stored-size table.

:func:`ratio_table_markdown` is exact (sizes from real encodings, no timing);
:func:`markdown_report` renders the rows ``codec.py`` measured into ``results/codec_cpu.md``.
"""

from __future__ import annotations

import torch

import tw_triton
from tw_triton.codecs import blockwise as codec
from tw_triton.ops.backends import native

BITS = (8, 4, 2)
RATIO_BLOCKS = (32, 64, 128, 256, 1024, 4096)


def ratio_table_markdown() -> str:
    """Stored bytes per element and compression against fp32 and bf16, bits x block.

    Computed from actual encodings (``QuantizedTensor.nbytes`` of a tensor of 16 blocks),
    checked against the formula ``bits/8 + 4/block``.
    """
    lines = [
        "| bits | block | bytes/element | vs fp32 | vs bf16 |",
        "|---:|---:|---:|---:|---:|",
    ]
    for bits in BITS:
        for block in RATIO_BLOCKS:
            n = 16 * block
            q = tw_triton.quantize(torch.ones(n), bits=bits, block=block)
            per_elem = q.nbytes / n
            assert per_elem == codec.stored_bytes_per_element(bits, block)
            lines.append(f"| {bits} | {block} | {per_elem:.5g} | {4 / per_elem:.2f}x | {2 / per_elem:.2f}x |")
    return "\n".join(lines)


def markdown_report(
    machine: str, cpu: list[dict], mem: list[dict], stats: list[dict], cuda: list[dict], args
) -> str:
    """The results page for benchmarks/results/."""
    out = [
        "# Codec benchmark (CPU path)",
        "",
        f"Machine: {machine}; torch {torch.__version__}, {torch.get_num_threads()} threads.",
        f"Command: `python benchmarks/codec.py{' --quick' if args.quick else ''} --runs {args.runs}"
        f"{f' --threads {args.threads}' if args.threads else ''}` "
        f"(n = {args.n:,} elements, block 128, {args.reps} interleaved reps per cell, medians;"
        f" {args.runs} run(s) of the timing table, cell-wise median of the runs).",
        f"1-minute load average {args.load_before:.1f} before and {args.load_after:.1f} after the"
        " timing runs: other processes shared the cores, so single timings are noisy.",
        f"CPU chunk: {codec.CHUNK_ELEMENTS:,} elements ({4 * codec.CHUNK_ELEMENTS / 2**20:.0f} MiB of fp32).",
        "",
        f"Compiled CPU codec (tw_triton.ops.backends.native): {'on' if native.enabled() else 'OFF (not built, or TW_TRITON_NATIVE=0)'}."
        " `encode`/`decode` run the CPU path as callers get it (the compiled codec where it is on);"
        " `torch enc/copy_` and `torch dec/copy_` run the plain-torch reference, the spec, on the same"
        " tensors in the same reps.",
        "",
        "Throughput is GB/s of input read (x, plus the reference when there is one). `copy_`",
        "copies x into a buffer allocated once (the memory-bandwidth yardstick); `encode` and",
        "`decode` write into outputs allocated once too (`out=`), so the three compare like with",
        "like. `enc/copy_` and `dec/copy_` are medians over reps of time(copy_)/time(op) on the",
        "same x: the goal is >= 0.5. The `alloc` columns are `tw_triton.quantize`/`dequantize`,",
        "which allocate their outputs, beside `x.clone()`: fresh pages fault in on first touch,",
        "which on this VM costs more than the codec itself (see the note below the table).",
        "",
        "| codec | dtype | reference | bits | copy_ GB/s | encode GB/s | decode GB/s | enc/copy_ | dec/copy_ | torch enc/copy_ | torch dec/copy_ | clone GB/s | encode alloc GB/s | decode alloc GB/s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in cpu:
        out.append(
            f"| {r.get('codec', 'blockwise')} | {r['dtype']} | {r['reference'] or '-'} | {r['bits']} |"
            f" {r['copy_gbps']:.2f} |"
            f" {r['encode_gbps']:.2f} | {r['decode_gbps']:.2f} | {r['encode_over_copy']:.2f} |"
            f" {r['decode_over_copy']:.2f} | {r['torch_encode_over_copy']:.2f} | {r['torch_decode_over_copy']:.2f} |"
            f" {r['clone_gbps']:.2f} | {r['encode_alloc_gbps']:.2f} |"
            f" {r['decode_alloc_gbps']:.2f} |"
        )
    if mem:
        out += [
            "",
            "Peak temporaries of one encode (RSS high-water mark in a fresh process, less the",
            "input and the outputs), in units of one fp32 chunk:",
            "",
            "| input | bits | input MiB | outputs MiB | temporaries MiB | chunks |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in mem:
            name = (
                r["dtype"]
                + (" + ref" if r["reference"] else "")
                + (", transposed" if r["transposed"] else "")
            )
            out.append(
                f"| {name} | {r['bits']} | {r['input_mib']:.0f} | {r['outputs_mib']:.1f} |"
                f" {r['temporaries_mib']:.1f} | {r['chunks']:.2f} |"
            )
    if stats:
        out += [
            "",
            "How often the strict bound |d - q*s| <= s/2 fails (never: the encoder rounds the",
            "exact quotient), how often it is met with equality, and how often the once-rounded",
            "fp32 quotient fl(d/s) is exactly a half-integer, the elements whose side the encoder",
            "settles exactly (standard normal data):",
            "",
            "| bits | elements | > s/2 | = s/2 | fl(d/s) on a half-integer |",
            "|---:|---:|---:|---:|---:|",
        ]
        for r in stats:
            out.append(
                f"| {r['bits']} | {r['numel']:,} | {r['over_half_scale']} | {r['at_half_scale']} |"
                f" {r['quotient_on_half_integer']} |"
            )
    if cuda:
        out += [
            "",
            "CUDA (triton.testing.do_bench; GB/s of input read; `encode/copy` compares read",
            "bandwidths, `traffic` compares bytes read + written per second):",
            "",
            "| dtype | reference | bits | copy GB/s | encode GB/s | decode GB/s | encode/copy | traffic |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in cuda:
            out.append(
                f"| {r['dtype']} | {r['reference'] or '-'} | {r['bits']} | {r['copy_gbps']:.1f} |"
                f" {r['encode_gbps']:.1f} | {r['decode_gbps']:.1f} | {r['encode_over_copy']:.2f} |"
                f" {r['encode_traffic_over_copy']:.2f} |"
            )
    out += ["", "Stored size (exact, from encodings):", "", ratio_table_markdown(), ""]
    return "\n".join(out)
