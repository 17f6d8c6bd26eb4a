"""Ahead-of-time compilation of the codec kernels for real GPU targets, on a CPU-only machine.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` needs no GPU: it runs the
MLIR/LLVM pipeline to PTX and the bundled ``ptxas`` to a cubin. The signature and the
``tt.divisibility`` attributes below are what the JIT gives a launch whose pointers are
16-byte aligned (every fresh torch allocation) and whose length is a multiple of 16.

The test session runs with ``TRITON_INTERPRET=1`` (see conftest.py), under which triton's
own jit functions cannot be compiled, so compiling happens in child processes started as
``python tests/_ptx.py --shard I/N --out FILE`` with the variable removed. Each child writes
a JSON fact sheet per variant (opcode counts and how the program id is used), which the
tests read.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

BITS = (8, 4, 2)
BLOCKS = (32, 128, 4096)
DTYPES = ("fp32", "fp16", "bf16")
TARGETS = (80, 90)


@dataclass(frozen=True)
class Variant:
    """One specialization of one kernel: what the JIT would compile for one launch."""

    op: str  # "encode" or "decode"
    bits: int
    block: int
    dtype: str  # encode: input dtype; decode: output dtype
    ref_dtype: str | None
    masked: bool  # the tail launch (bounds masks) or the main one
    cc: int

    @property
    def label(self) -> str:
        ref = self.ref_dtype or "noref"
        part = "tail" if self.masked else "main"
        return f"{self.op}-b{self.bits}-B{self.block}-{self.dtype}-{ref}-{part}-sm{self.cc}"


def all_variants() -> list[Variant]:
    """bits x blocks x dtypes x {no reference, a reference} x {main, tail} x targets.

    The reference dtype rotates with the tensor dtype so that every (dtype, ref dtype)
    pair's conversion code (fp32 as is, fp16 cast, bf16 shift) is compiled somewhere.
    """
    rotate = {"fp32": "bf16", "fp16": "fp32", "bf16": "bf16"}
    out = []
    for op in ("encode", "decode"):
        for bits in BITS:
            for block in BLOCKS:
                for dtype in DTYPES:
                    for ref in (None, rotate[dtype]):
                        for masked in (False, True):
                            for cc in TARGETS:
                                out.append(Variant(op, bits, block, dtype, ref, masked, cc))
    return out


LOG2_BLOCKS = (128, 4096)


def log2_variants() -> list[Variant]:
    """The ``log2`` codec's kernels: bits x blocks x dtypes x {main, tail} x targets (no
    reference: the codec has none)."""
    return [
        Variant(op, bits, block, dtype, None, masked, cc)
        for op in ("log2-encode", "log2-decode")
        for bits in BITS
        for block in LOG2_BLOCKS
        for dtype in DTYPES
        for masked in (False, True)
        for cc in TARGETS
    ]


def grouped_variants() -> list[Variant]:
    """The grouped kernels: the encode over a table of tensors (bits x dtype pairs x
    {main, tail} x targets, block 128), the fingerprint (dtypes x targets), the copy, the
    decode and the ``log2-temporal`` encode and decode (float32 against float32, as the
    single temporal kernels: blocks x {main, tail} x targets), the ``log2`` decode and the
    ``blockwise-update`` decode (bits x output dtypes x {main, tail} x targets, block 128)."""
    rotate = {"fp32": "bf16", "fp16": "fp32", "bf16": "bf16"}
    encode = [
        Variant("grouped-encode", bits, 128, dtype, ref, masked, cc)
        for bits in BITS
        for dtype in DTYPES
        for ref in (None, rotate[dtype])
        for masked in (False, True)
        for cc in TARGETS
    ]
    log2 = [
        Variant("grouped-log2-encode", bits, 128, dtype, None, masked, cc)
        for bits in BITS
        for dtype in DTYPES
        for masked in (False, True)
        for cc in TARGETS
    ]
    fingerprint = [
        Variant("fingerprint", 32, 2048, dtype, None, False, cc) for dtype in DTYPES for cc in TARGETS
    ]
    copy = [
        Variant("grouped-copy", 8, 4096, "u8", None, masked, cc) for masked in (False, True) for cc in TARGETS
    ]
    decode = [
        Variant("grouped-decode", bits, 128, dtype, rotate[dtype], masked, cc)
        for bits in BITS
        for dtype in DTYPES
        for masked in (False, True)
        for cc in TARGETS
    ]
    temporal = [
        Variant(op, 4, block, "fp32", "fp32", masked, cc)
        for op in ("grouped-temporal-encode", "grouped-temporal-decode")
        for block in LOG2_BLOCKS
        for masked in (False, True)
        for cc in TARGETS
    ]
    # The blockwise-update encode (u = m / (sqrt(v_hat) + eps) in the tile): v_hat is fp32.
    update = [
        Variant("grouped-update-encode", bits, 128, dtype, "fp32", masked, cc)
        for bits in (8, 4, 2)
        for dtype in ("fp32", "bf16")
        for masked in (False, True)
        for cc in TARGETS
    ]
    # Its decode at load (u_hat * (sqrt(v_hat) + eps) in the tile): v_hat is fp32.
    update_decode = [
        Variant("grouped-update-decode", bits, 128, dtype, "fp32", masked, cc)
        for bits in BITS
        for dtype in DTYPES
        for masked in (False, True)
        for cc in TARGETS
    ]
    log2_decode = [
        Variant("grouped-log2-decode", bits, 128, dtype, None, masked, cc)
        for bits in BITS
        for dtype in DTYPES
        for masked in (False, True)
        for cc in TARGETS
    ]
    return encode + log2 + fingerprint + copy + decode + temporal + update + log2_decode + update_decode


BITMASK_OPS = ("bitmask-mask", "bitmask-scatter", "bitmask-popcount", "bitmask-gather")


def bitmask_variants() -> list[Variant]:
    """The sparse codec's four kernels: element widths (the launchers pass float tensors as
    the integer of their width) x {main, tail} x targets. The popcount reads the mask only."""
    return [
        Variant(op, 0, 4096, dtype, None, masked, cc)
        for op in BITMASK_OPS
        for dtype in (("u8",) if op == "bitmask-popcount" else ("i16", "i32"))
        for masked in (False, True)
        for cc in TARGETS
    ]


def temporal_variants() -> list[Variant]:
    """The ``log2-temporal`` codec's kernels: blocks x {main, tail} x targets, float32 with a
    float32 reference (the codec takes nothing else), 4 bits (``BITS`` only sets the
    constant ``N`` of the step)."""
    return [
        Variant(op, 4, block, "fp32", "fp32", masked, cc)
        for op in ("temporal-encode", "temporal-decode")
        for block in LOG2_BLOCKS
        for masked in (False, True)
        for cc in TARGETS
    ]


def check_variants() -> list[Variant]:
    """The ``log2-temporal`` code check (a load's, before its decode): blocks x {main, tail}
    x targets, 4 bits (``BITS`` only sets the largest absolute code)."""
    return [
        Variant(op, 4, block, "fp32", "fp32", masked, cc)
        for op in ("temporal-check", "grouped-temporal-check")
        for block in LOG2_BLOCKS
        for masked in (False, True)
        for cc in TARGETS
    ]


def sparsity_variants() -> list[Variant]:
    """The grouped sparsity count (a save's sparse candidates): element widths (the launcher
    passes float tensors as the integer of their width) x {main, tail} x targets."""
    return [
        Variant("sparsity-counts", 0, 4096, dtype, None, masked, cc)
        for dtype in ("i16", "i32")
        for masked in (False, True)
        for cc in TARGETS
    ]


STATISTICS_OPS = ("delta-statistics-max", "delta-statistics-sums")


def statistics_variants() -> list[Variant]:
    """The grouped weight-delta statistics (a save's ``max_error`` bits choice): its two
    passes (the maxima, then the sums) x dtypes x {no reference, a reference} x {main,
    tail} x targets, block 128 (the weights' block in the presets)."""
    rotate = {"fp32": "bf16", "fp16": "fp32", "bf16": "bf16"}
    return [
        Variant(op, 0, 128, dtype, ref, masked, cc)
        for op in STATISTICS_OPS
        for dtype in DTYPES
        for ref in (None, rotate[dtype])
        for masked in (False, True)
        for cc in TARGETS
    ]


SPARSE_GROUPED_OPS = ("sparse-mask-grouped", "sparse-scatter-grouped")


def sparse_grouped_variants() -> list[Variant]:
    """The grouped bitmask encode (a save's sparse tensors that pay): its two passes x
    element widths (the launcher passes float tensors as the integer of their width) x
    {main, tail} x targets."""
    return [
        Variant(op, 0, 4096, dtype, None, masked, cc)
        for op in SPARSE_GROUPED_OPS
        for dtype in ("i16", "i32")
        for masked in (False, True)
        for cc in TARGETS
    ]


def every_variant() -> list[Variant]:
    """Everything the children compile."""
    return (
        all_variants()
        + log2_variants()
        + grouped_variants()
        + bitmask_variants()
        + temporal_variants()
        + check_variants()
        + sparsity_variants()
        + statistics_variants()
        + sparse_grouped_variants()
    )


def _statistics_source(v: Variant):
    from triton.compiler import ASTSource

    from tw_triton.kernels.delta_statistics_grouped import delta_statistics_grouped_kernel
    from tw_triton.kernels.tiles import rows_per_program

    signature = {
        "table_ptr": "*i64",
        "out_ptr": "*i64",
        "x_type_ptr": f"*{v.dtype}",
        "ref_type_ptr": f"*{v.ref_dtype or v.dtype}",
        "T": "i32",
    }
    constexprs = {
        "LOG_T": 4,
        "MASKED": v.masked,
        "HAS_REF": v.ref_dtype is not None,
        "SUMS": v.op == "delta-statistics-sums",
        "BLOCK": v.block,
        "ROWS": rows_per_program(v.block),
    }
    signature.update({name: "constexpr" for name in constexprs})
    # The table, the statistics buffer and the carriers are 16-byte aligned; T is not specialized.
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    return ASTSource(
        fn=delta_statistics_grouped_kernel, signature=signature, constexprs=constexprs, attrs=attrs
    )


def _sparsity_source(v: Variant):
    from triton.compiler import ASTSource

    from tw_triton.kernels.sparsity_counts_grouped import sparsity_counts_grouped_kernel

    signature = {"table_ptr": "*i64", "out_ptr": "*i64", "x_type_ptr": f"*{v.dtype}", "T": "i32"}
    constexprs = {"LOG_T": 4, "MASKED": v.masked, "BLOCK": v.block, "ROWS": 1}
    signature.update({name: "constexpr" for name in constexprs})
    # The table, the scalars buffer and the type carrier (a tensor of the group) are 16-byte
    # aligned; T is not specialized.
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    return ASTSource(
        fn=sparsity_counts_grouped_kernel, signature=signature, constexprs=constexprs, attrs=attrs
    )


def _sparse_grouped_source(v: Variant):
    from triton.compiler import ASTSource

    from tw_triton.kernels import bitmask_grouped as k

    fn = {
        "sparse-mask-grouped": k.bitmask_mask_grouped_kernel,
        "sparse-scatter-grouped": k.bitmask_scatter_grouped_kernel,
    }[v.op]
    signature = {"table_ptr": "*i64", "counts_ptr": "*i64", "x_type_ptr": f"*{v.dtype}", "T": "i32"}
    if v.op == "sparse-scatter-grouped":
        signature = {"table_ptr": "*i64", "starts_ptr": "*i64", "x_type_ptr": f"*{v.dtype}", "T": "i32"}
    constexprs = {"LOG_T": 4, "MASKED": v.masked, "BLOCK": v.block, "ROWS": 1}
    signature.update({name: "constexpr" for name in constexprs})
    # The table, the counts (or their scan) and the type carrier (a tensor of the group)
    # are 16-byte aligned; T is not specialized.
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _grouped_source(v: Variant):
    from triton.compiler import ASTSource

    from tw_triton.kernels.copy_grouped import copy_grouped_kernel
    from tw_triton.kernels.dequantize_blockwise_grouped import dequantize_blockwise_grouped_kernel
    from tw_triton.kernels.dequantize_blockwise_update_grouped import (
        dequantize_blockwise_update_grouped_kernel,
    )
    from tw_triton.kernels.dequantize_log2_grouped import dequantize_log2_grouped_kernel
    from tw_triton.kernels.dequantize_log2_temporal_grouped import dequantize_log2_temporal_grouped_kernel
    from tw_triton.kernels.fingerprint import fingerprint_kernel
    from tw_triton.kernels.quantize_blockwise_grouped import quantize_blockwise_grouped_kernel
    from tw_triton.kernels.quantize_blockwise_update_grouped import quantize_blockwise_update_grouped_kernel
    from tw_triton.kernels.quantize_log2_grouped import quantize_log2_grouped_kernel
    from tw_triton.kernels.quantize_log2_temporal_grouped import quantize_log2_temporal_grouped_kernel
    from tw_triton.kernels.tiles import rows_per_program

    if v.op == "grouped-temporal-check":
        from tw_triton.kernels.log2_temporal_check import log2_temporal_check_grouped_kernel

        signature = {"table_ptr": "*i64", "flags_ptr": "*i64", "T": "i32"}
        constexprs = {"LOG_T": 4, "MASKED": v.masked, "BITS": v.bits}
        constexprs.update({"BLOCK": v.block, "ROWS": rows_per_program(v.block)})
        signature.update({name: "constexpr" for name in constexprs})
        # The table is 16-byte aligned; the flags are not specialized on; T is not.
        attrs = {(0,): [["tt.divisibility", 16]]}
        return ASTSource(
            fn=log2_temporal_check_grouped_kernel, signature=signature, constexprs=constexprs, attrs=attrs
        )
    if v.op in ("grouped-temporal-encode", "grouped-temporal-decode"):
        fn = {
            "grouped-temporal-encode": quantize_log2_temporal_grouped_kernel,
            "grouped-temporal-decode": dequantize_log2_temporal_grouped_kernel,
        }[v.op]
        signature = {"table_ptr": "*i64", "flags_ptr": "*i64", "T": "i32", "min_step": "i32"}
        constexprs = {"LOG_T": 4, "MASKED": v.masked, "BITS": v.bits}
        constexprs.update({"BLOCK": v.block, "ROWS": rows_per_program(v.block)})
        signature.update({name: "constexpr" for name in constexprs})
        # The table and the flags are 16-byte aligned, min_step (a power of two)
        # 16-divisible; T is not specialized.
        attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 3)}
        return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    if v.op == "fingerprint":
        signature = {
            "table_ptr": "*i64",
            "out_ptr": "*i64",
            "type_ptr": f"*{v.dtype}",
            "SAMPLES": "constexpr",
        }
        constexprs = {"SAMPLES": v.block}
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
        return ASTSource(fn=fingerprint_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    if v.op == "grouped-update-encode":
        signature = {
            "table_ptr": "*i64",
            "flags_ptr": "*i64",
            "m_type_ptr": f"*{v.dtype}",
            "v_type_ptr": "*fp32",
            "eps": "fp32",
            "qmax": "fp32",
            "T": "i32",
        }
        constexprs = {"LOG_T": 4, "MASKED": v.masked, "BITS": v.bits}
        constexprs.update({"BLOCK": v.block, "ROWS": rows_per_program(v.block)})
        signature.update({name: "constexpr" for name in constexprs})
        # The table, the flags and the carriers are 16-byte aligned; eps, qmax and T are not
        # specialized.
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
        return ASTSource(
            fn=quantize_blockwise_update_grouped_kernel,
            signature=signature,
            constexprs=constexprs,
            attrs=attrs,
        )
    if v.op == "grouped-update-decode":
        signature = {
            "table_ptr": "*i64",
            "flags_ptr": "*i64",
            "out_type_ptr": f"*{v.dtype}",
            "eps": "fp32",
            "T": "i32",
        }
        constexprs = {"LOG_T": 4, "MASKED": v.masked, "BITS": v.bits}
        constexprs.update({"BLOCK": v.block, "ROWS": rows_per_program(v.block)})
        signature.update({name: "constexpr" for name in constexprs})
        # The table, the flags and the carrier are 16-byte aligned; eps and T are not specialized.
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
        return ASTSource(
            fn=dequantize_blockwise_update_grouped_kernel,
            signature=signature,
            constexprs=constexprs,
            attrs=attrs,
        )
    if v.op == "grouped-copy":
        signature = {"table_ptr": "*i64", "flags_ptr": "*i64", "T": "i32"}
        constexprs = {"LOG_T": 4, "MASKED": v.masked, "BLOCK": v.block, "ROWS": 1}
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(2)}
        signature.update({name: "constexpr" for name in constexprs})
        return ASTSource(fn=copy_grouped_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    if v.op == "grouped-decode":
        fn = dequantize_blockwise_grouped_kernel
        signature = {
            "table_ptr": "*i64",
            "flags_ptr": "*i64",
            "ref_type_ptr": f"*{v.ref_dtype}",
            "out_type_ptr": f"*{v.dtype}",
            "T": "i32",
        }
        constexprs = {"LOG_T": 4, "MASKED": v.masked, "HAS_REF": True, "BITS": v.bits}
    elif v.op == "grouped-log2-decode":
        fn = dequantize_log2_grouped_kernel
        signature = {"table_ptr": "*i64", "flags_ptr": "*i64", "out_type_ptr": f"*{v.dtype}", "T": "i32"}
        constexprs = {"LOG_T": 4, "MASKED": v.masked, "BITS": v.bits}
    elif v.op == "grouped-log2-encode":
        fn = quantize_log2_grouped_kernel
        signature = {"table_ptr": "*i64", "flags_ptr": "*i64", "x_type_ptr": f"*{v.dtype}", "T": "i32"}
        constexprs = {"LOG_T": 4, "MASKED": v.masked, "BITS": v.bits}
    else:
        fn = quantize_blockwise_grouped_kernel
        signature = {
            "table_ptr": "*i64",
            "flags_ptr": "*i64",
            "x_type_ptr": f"*{v.dtype}",
            "ref_type_ptr": f"*{v.ref_dtype or v.dtype}",
            "T": "i32",
        }
        constexprs = {"LOG_T": 4, "MASKED": v.masked, "HAS_REF": v.ref_dtype is not None, "BITS": v.bits}
    constexprs.update({"BLOCK": v.block, "ROWS": rows_per_program(v.block)})
    # Pointers are 16-byte aligned (the tail launch's table slice starts 64 bytes per row
    # in, or 80 for the encode, whose rows hold each tensor's qmax; the carriers of the
    # element types are tensors of the group); T is not specialized.
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
    signature.update({name: "constexpr" for name in constexprs})
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _bitmask_source(v: Variant):
    from triton.compiler import ASTSource

    from tw_triton.kernels import bitmask as k

    elem = f"*{v.dtype}"
    fn, signature = {
        "bitmask-mask": (k.bitmask_mask_kernel, {"x_ptr": elem, "mask_ptr": "*u8", "counts_ptr": "*i64"}),
        "bitmask-scatter": (
            k.bitmask_scatter_kernel,
            {"x_ptr": elem, "starts_ptr": "*i64", "values_ptr": elem},
        ),
        "bitmask-popcount": (k.bitmask_popcount_kernel, {"mask_ptr": "*u8", "counts_ptr": "*i64"}),
        "bitmask-gather": (
            k.bitmask_gather_kernel,
            {"mask_ptr": "*u8", "starts_ptr": "*i64", "values_ptr": elem, "out_ptr": elem},
        ),
    }[v.op]
    pointers = len(signature)
    signature["n"] = "i32"
    if v.op in ("bitmask-scatter", "bitmask-gather"):
        signature["nnz"] = "i32"
    signature["tile0"] = "i32"
    constexprs = {"MASKED": v.masked, "TILE": v.block}
    signature.update({name: "constexpr" for name in constexprs})
    # The pointers and n are 16-divisible, as the JIT specializes them for fresh torch
    # allocations and a length that is a multiple of 16; nnz and tile0 are not specialized.
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(pointers + 1)}
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _temporal_source(v: Variant):
    from triton.compiler import ASTSource

    from tw_triton.kernels.dequantize_log2_temporal import dequantize_log2_temporal_kernel
    from tw_triton.kernels.quantize_log2_temporal import quantize_log2_temporal_kernel
    from tw_triton.kernels.tiles import rows_per_program

    if v.op == "temporal-check":
        from tw_triton.kernels.log2_temporal_check import log2_temporal_check_kernel

        names = ("codes_ptr", "lo_ptr", "hi_ptr", "ref_ptr", "flag_ptr")
        signature = dict(zip(names, ("*u8", "*i32", "*i32", "*fp32", "*i32")))
        signature.update({"n": "i32", "row0": "i32"})
        constexprs = {"MASKED": v.masked, "BITS": v.bits, "BLOCK": v.block, "ROWS": rows_per_program(v.block)}
        signature.update({name: "constexpr" for name in constexprs})
        # The five pointers and n are 16-divisible.
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
        return ASTSource(
            fn=log2_temporal_check_kernel, signature=signature, constexprs=constexprs, attrs=attrs
        )
    if v.op == "temporal-encode":
        fn = quantize_log2_temporal_kernel
        names = ("x_ptr", "ref_ptr", "codes_ptr", "lo_ptr", "hi_ptr")
        kinds = ("*fp32", "*fp32", "*u8", "*i32", "*i32")
    else:
        fn = dequantize_log2_temporal_kernel
        names = ("codes_ptr", "lo_ptr", "hi_ptr", "ref_ptr", "out_ptr")
        kinds = ("*u8", "*i32", "*i32", "*fp32", "*fp32")
    signature = dict(zip(names, kinds))
    signature.update({"n": "i32", "row0": "i32", "min_step": "i32"})
    constexprs = {"MASKED": v.masked, "BITS": v.bits, "BLOCK": v.block, "ROWS": rows_per_program(v.block)}
    signature.update({name: "constexpr" for name in constexprs})
    # The five pointers, n and min_step (a power of two) are 16-divisible.
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 7)}
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _log2_source(v: Variant):
    from triton.compiler import ASTSource

    from tw_triton.kernels.dequantize_log2 import dequantize_log2_kernel
    from tw_triton.kernels.quantize_log2 import quantize_log2_kernel
    from tw_triton.kernels.tiles import rows_per_program

    if v.op == "log2-encode":
        fn = quantize_log2_kernel
        signature = {"x_ptr": f"*{v.dtype}", "codes_ptr": "*u8", "lo_ptr": "*i32", "hi_ptr": "*i32"}
    else:
        fn = dequantize_log2_kernel
        signature = {"codes_ptr": "*u8", "lo_ptr": "*i32", "hi_ptr": "*i32", "out_ptr": f"*{v.dtype}"}
    signature.update({"n": "i32", "row0": "i32"})
    constexprs = {"MASKED": v.masked, "BITS": v.bits, "BLOCK": v.block, "ROWS": rows_per_program(v.block)}
    signature.update({name: "constexpr" for name in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def as_jit_specializes(source):
    """``source`` without the divisibility of the pointers its kernel is not specialized on
    for alignment (``do_not_specialize_on_alignment``): what the JIT compiles for them."""
    names = list(source.fn.arg_names)
    skip = {
        names.index(p) if isinstance(p, str) else p for p in source.fn.do_not_specialize_on_alignment or []
    }
    source.attrs = {k: a for k, a in source.attrs.items() if k[0] not in skip}
    return source


def compile_variant(v: Variant):
    """Compile ``v`` for ``sm_{v.cc}`` (PTX and cubin); returns triton's ``CompiledKernel``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    prefixes = ("log2-", "grouped-", "bitmask-", "temporal-", "sparsity-", "delta-statistics-", "sparse-")
    if v.op.startswith(prefixes) or v.op == "fingerprint":
        from tw_triton.kernels.tiles import NUM_WARPS

        if v.op.startswith("log2-"):
            source = _log2_source(v)
        elif v.op.startswith("bitmask-"):
            source = _bitmask_source(v)
        elif v.op.startswith("temporal-"):
            source = _temporal_source(v)
        elif v.op.startswith("sparsity-"):
            source = _sparsity_source(v)
        elif v.op.startswith("delta-statistics-"):
            source = _statistics_source(v)
        elif v.op.startswith("sparse-"):
            source = _sparse_grouped_source(v)
        else:
            source = _grouped_source(v)
        return triton.compile(
            as_jit_specializes(source),
            target=GPUTarget("cuda", v.cc, 32),
            options={"num_warps": NUM_WARPS, "enable_fp_fusion": False},
        )
    if v.op == "encode":
        from tw_triton.kernels.quantize_blockwise import (
            NUM_WARPS,
            rows_per_program,
        )
        from tw_triton.kernels.quantize_blockwise import (
            quantize_blockwise_kernel as fn,
        )
    else:
        from tw_triton.kernels.dequantize_blockwise import (
            NUM_WARPS,
            rows_per_program,
        )
        from tw_triton.kernels.dequantize_blockwise import (
            dequantize_blockwise_kernel as fn,
        )
    ref = v.ref_dtype or v.dtype  # without a reference the launcher passes a dummy pointer
    if v.op == "encode":
        signature = {
            "x_ptr": f"*{v.dtype}",
            "ref_ptr": f"*{ref}",
            "codes_ptr": "*u8",
            "scales_ptr": "*fp32",
            "n": "i32",
            "row0": "i32",
            "qmax": "fp32",  # a value: fewer levels in a container compile nothing new
        }
    else:
        signature = {
            "codes_ptr": "*u8",
            "scales_ptr": "*fp32",
            "ref_ptr": f"*{ref}",
            "out_ptr": f"*{v.dtype}",
            "n": "i32",
            "row0": "i32",
        }
    constexprs = {
        "MASKED": v.masked,
        "HAS_REF": v.ref_dtype is not None,
        "BITS": v.bits,
        "BLOCK": v.block,
        "ROWS": rows_per_program(v.block),
    }
    signature.update({name: "constexpr" for name in constexprs})
    # Arguments 0-4 (four pointers and n) are 16-divisible, as the JIT specializes them for
    # fresh torch allocations; row0 is declared do_not_specialize in the kernels (and an
    # fp32 qmax is not specialized on).
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        src,
        target=GPUTarget("cuda", v.cc, 32),
        options={"num_warps": NUM_WARPS, "enable_fp_fusion": False},
    )


_INSTR = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)\s*([^;]*);", re.MULTILINE)
_CTAID = re.compile(r"mov\.u32\s+(%r\d+),\s*%ctaid\.x;")


def opcode_counts(ptx: str) -> Counter:
    """Count PTX instructions by full opcode (``ld.global.v4.b32``, ``div.rn.f32``, ...)."""
    return Counter(m.group(1) for m in _INSTR.finditer(ptx))


def ctaid_uses(ptx: str) -> list[str]:
    """Opcodes of the instructions that read the register holding ``%ctaid.x``.

    With int64 offsets the program id is widened (``cvt.*64*`` or ``mul.wide``) before any
    arithmetic; a 32-bit ``mul``/``shl``/``mad`` on it would overflow past 2**31 elements.
    """
    regs = set(_CTAID.findall(ptx))
    uses = []
    for m in _INSTR.finditer(ptx):
        operands = [o.strip() for o in m.group(2).split(",")]
        # The first operand is the destination; a use is the register among the sources.
        if any(o in regs for o in operands[1:]):
            uses.append(m.group(1))
    return uses


_SASS_INSTR = re.compile(r"^\S+\t(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", re.MULTILINE)


def sass_checked(v: Variant) -> bool:
    """Variants whose cubin is also disassembled (nvdisasm costs ~0.5 s each): decode with
    a reference (both its multiply and its add), one block size, main launch.

    Encode is not among them: its SASS has FFMA by design, inside ptxas's expansion of the
    correctly rounded ``div.rn.f32`` (reciprocal, Newton steps, FCHK and a slow path).
    """
    return v.op == "decode" and v.block == 128 and v.ref_dtype is not None and not v.masked


def sass_opcode_counts(sass: str) -> Counter:
    """Count SASS instructions (``FMUL``, ``FFMA``, ``LDG.E.128``, ...) in nvdisasm output."""
    return Counter(_SASS_INSTR.findall(sass))


def facts(v: Variant) -> dict:
    """What the tests check about one compiled variant."""
    kernel = compile_variant(v)
    ptx = kernel.asm["ptx"]
    sass = dict(sass_opcode_counts(kernel.asm["sass"])) if sass_checked(v) else None
    return {
        "sass_opcodes": sass,
        "variant": asdict(v),
        "opcodes": dict(opcode_counts(ptx)),
        "ctaid_regs": len(_CTAID.findall(ptx)),
        "ctaid_uses": ctaid_uses(ptx),
        "cubin_bytes": len(kernel.asm["cubin"]),
        # Launch needs: global scratch asks triton.set_allocator for memory at each launch
        # (the library never sets one), shared memory beyond 48 KiB needs an opt-in.
        "global_scratch_bytes": getattr(kernel.metadata, "global_scratch_size", 0),
        "shared_bytes": kernel.metadata.shared,
        "target": f"sm_{v.cc}",
        "ptx_target": (re.search(r"^\.target\s+(\S+)", ptx, re.MULTILINE) or [None, None])[1],
    }


def compile_in_children(out_dir: Path, processes: int) -> dict[str, dict]:
    """Compile :func:`every_variant` in ``processes`` child processes; facts by label."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    children = []
    for i in range(processes):
        out = out_dir / f"ptx_facts_{i}.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--shard",
            f"{i}/{processes}",
            "--out",
            str(out),
        ]
        children.append(
            (subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out)
        )
    merged: dict[str, dict] = {}
    for proc, out in children:
        log, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"PTX compile child failed (rc {proc.returncode}):\n{log[-4000:]}")
        merged.update(json.loads(out.read_text()))
    return merged


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shard", default="0/1", help="I/N: compile every N-th variant from I")
    parser.add_argument("--out", required=True, help="JSON file to write the facts to")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: interpreted jit functions cannot be compiled")
    index, count = (int(p) for p in args.shard.split("/"))
    result = {v.label: facts(v) for v in every_variant()[index::count]}
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    _main()
