"""The launchers through triton's own JIT, for a real GPU target, on a CPU-only machine.

Under the interpreter (the kernel tests' mode without a GPU) a launch never meets the JIT:
not its binder (which rejects a keyword argument it does not know, such as a misspelt
compile option), not its specialization of the arguments (dtypes, 16-byte alignment), not
its compile. On a GPU all of that runs at the first launch. Here a child process started
as ``python tests/_jit_launch.py --cc 90 --out FILE`` (``TRITON_INTERPRET`` removed) makes
triton believe a device of that compute capability is current (a stand-in driver: device 0,
stream 0, the target) and turns every launch into ``warmup``: the JIT binds, specializes
and compiles to a cubin exactly as a GPU launch would, then returns before launching.

Every op of the "cuda" backend (``tw_triton.ops.backends.triton.BACKEND``) is called once
on CPU tensors whose sizes give a whole-tile launch and a tail launch; the outputs are
never written (nothing launches) and nothing is read from them. For each launch the child
records the kernel and a hash of its PTX, and the hash of the PTX that ``tests/_ptx.py``
compiles ahead of time for the variant the launch should be: the two must be equal, so the
PTX rules of tests/ops/test_ptx.py hold for what the launchers really compile.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from pathlib import Path

N = 2 * 4096 + 16  # two whole 4096-element tiles and a tail; a multiple of 16 (like _ptx's n)
GROUP = 9  # tensors per group: 9 table rows, so LOG_T is 4 (as _ptx compiles the grouped kernels)
MIN_STEP = 1 << 19


def install_stand_in_driver(cc: int) -> list:
    """Make ``cc`` the current target and every launch a warmup; returns the list that
    collects ``(kernel name, CompiledKernel)`` per launch."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class StandInDriver:
        target = GPUTarget("cuda", cc, 32)

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self):
            return self.target

    driver.set_active(StandInDriver())
    launches: list = []
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        launches.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = compile_only
    return launches


def cases():
    """``(name, call, expected variants in launch order)``; a call runs one backend op."""
    import torch
    from _ptx import SPARSE_GROUPED_OPS, Variant

    from tw_triton.ops.backends import triton as backend

    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    names = {f32: "fp32", f16: "fp16", bf16: "bf16"}

    def pair(op, bits, block, dtype, ref, cc):
        ref_name = None if ref is None else names[ref]
        return [Variant(op, bits, block, names[dtype], ref_name, m, cc) for m in (False, True)]

    def blockwise(bits, block, dtype, ref):
        def call():
            x = torch.zeros(N, dtype=dtype)
            r = None if ref is None else torch.zeros(N, dtype=ref)
            codes, scales = backend.quantize_blockwise_cuda(x, r, bits, block)
            backend.dequantize_blockwise_cuda(codes, scales, N, bits, block, r, dtype)

        return (
            call,
            lambda cc: (
                pair("encode", bits, block, dtype, ref, cc) + pair("decode", bits, block, dtype, ref, cc)
            ),
        )

    def log2(bits, block, dtype):
        def call():
            codes, lo, hi = backend.quantize_log2_cuda(torch.zeros(N, dtype=dtype), bits, block)
            backend.dequantize_log2_cuda(codes, lo, hi, N, bits, block, dtype)

        return (
            call,
            lambda cc: (
                pair("log2-encode", bits, block, dtype, None, cc)
                + pair("log2-decode", bits, block, dtype, None, cc)
            ),
        )

    def temporal():
        x, r = torch.zeros(N), torch.zeros(N)
        codes, lo, hi = backend.quantize_log2_temporal_cuda(x, r, 4, 128, MIN_STEP)
        backend.dequantize_log2_temporal_cuda(codes, lo, hi, r, N, 4, 128, MIN_STEP)
        backend.log2_temporal_code_errors_cuda(codes, lo, hi, r, 4, 128)  # JIT only: the flag stays 0

    def group(dtype):  # every tensor one whole tile (block 128) and a tail
        return [torch.zeros(4096 + 16, dtype=dtype) for _ in range(GROUP)]

    def grouped(bits):
        xs, refs = group(f32), group(bf16)
        flags = torch.zeros(GROUP, dtype=torch.int64)
        pairs = backend.quantize_blockwise_many_cuda(xs, refs, bits, 128, flags=flags)
        codes, scales = [p[0] for p in pairs], [p[1] for p in pairs]
        backend.dequantize_blockwise_many_cuda(codes, scales, [x.numel() for x in xs], bits, 128, refs, f32)
        backend.quantize_log2_many_cuda(group(bf16), bits, 128, flags=flags)
        pairs = backend.quantize_blockwise_update_many_cuda(
            group(bf16), group(f32), 1e-8, bits, 128, flags=flags
        )
        codes, scales = [p[0] for p in pairs], [p[1] for p in pairs]
        backend.dequantize_blockwise_update_many_cuda(
            codes, scales, [4096 + 16] * GROUP, group(f32), 1e-8, bits, 128, bf16
        )

    def grouped_expected(bits, cc):
        return (
            pair("grouped-encode", bits, 128, f32, bf16, cc)
            + pair("grouped-decode", bits, 128, f32, bf16, cc)
            + pair("grouped-log2-encode", bits, 128, bf16, None, cc)
            + pair("grouped-update-encode", bits, 128, bf16, f32, cc)
            + pair("grouped-update-decode", bits, 128, bf16, f32, cc)
        )

    def grouped_temporal():  # written in place into the codec's stored buffers, and back
        from tw_triton.codecs.log2_temporal import group_stored, split_stored

        stored = group_stored([4096 + 16] * GROUP, 128, torch.device("cpu"))
        out = [split_stored(s, 4096 + 16, 128) for s in stored]
        flags = torch.zeros(GROUP, dtype=torch.int64)
        refs = group(f32)
        backend.quantize_log2_temporal_many_cuda(group(f32), refs, 4, 128, MIN_STEP, flags=flags, out=out)
        # The closed-loop advance: decoded from the stored buffers over the references.
        codes, lo, hi = ([o[k] for o in out] for k in range(3))
        backend.dequantize_log2_temporal_many_cuda(codes, lo, hi, refs, 4, 128, MIN_STEP, out=refs)
        # A load's check of the codes before that decode.
        backend.log2_temporal_code_flags_many_cuda(codes, lo, hi, refs, 4, 128)

    def grouped_log2_decode():  # a keyframe's moments, decoded into its reference tensors
        n, nb = 4096 + 16, -(-(4096 + 16) // 128)
        codes = [torch.zeros(n // 2, dtype=torch.uint8) for _ in range(GROUP)]
        bounds = [torch.zeros(nb, dtype=torch.int32) for _ in range(2 * GROUP)]
        backend.dequantize_log2_many_cuda(
            codes, bounds[:GROUP], bounds[GROUP:], [n] * GROUP, 4, 128, f32, out=group(f32)
        )

    def copy_and_fingerprints():
        backend.copy_many_cuda([torch.zeros(1028) for _ in range(GROUP)])  # 4112 bytes each
        backend.fingerprints_cuda(group(f16), out=torch.zeros(GROUP, dtype=torch.int64))

    def bitmask():
        mask, values = backend.bitmask_encode_cuda(torch.zeros(N), nnz=N)
        backend.bitmask_decode_cuda(mask, torch.zeros(N, dtype=f16), N)
        backend.mask_popcount_cuda(mask, N)  # the decode's popcount kernel, before it

    def bitmask_expected(cc):
        ops = (("bitmask-mask", "i32"), ("bitmask-scatter", "i32"), ("bitmask-popcount", "u8"))
        ops += (("bitmask-gather", "i16"), ("bitmask-popcount", "u8"))
        return [Variant(op, 0, 4096, dtype, None, m, cc) for op, dtype in ops for m in (False, True)]

    def sparsity_counts():  # a group of each width, each tensor a whole tile and a tail
        backend.sparsity_counts_many_cuda(
            [torch.zeros(4096 + 16, dtype=d) for d in [f32] * GROUP + [bf16] * GROUP],
            out=torch.zeros(4 * GROUP, dtype=torch.int64),
        )

    def sparsity_expected(cc):
        return [
            Variant("sparsity-counts", 0, 4096, dtype, None, m, cc)
            for dtype in ("i32", "i16")
            for m in (False, True)
        ]

    def delta_statistics():  # the maxima, then the sums, each in whole tiles and tails
        out = torch.zeros(4 * GROUP, dtype=torch.int64)
        backend.delta_statistics_many_cuda(group(f32), group(bf16), 128, out=out)

    def statistics_expected(cc):
        return [
            Variant(op, 0, 128, "fp32", "bf16", m, cc)
            for op in ("delta-statistics-max", "delta-statistics-sums")
            for m in (False, True)
        ]

    def bitmask_grouped():  # a group of each width, each tensor a whole tile and a tail
        xs = [torch.ones(4096 + 16, dtype=d) for d in [f32] * GROUP + [bf16] * GROUP]
        backend.bitmask_encode_many_cuda(xs, [4096 + 16] * len(xs))

    def bitmask_grouped_expected(cc):
        return [
            Variant(op, 0, 4096, dtype, None, m, cc)
            for dtype in ("i32", "i16")
            for op in SPARSE_GROUPED_OPS
            for m in (False, True)
        ]

    return [
        ("blockwise-b4-B128-fp32-bf16", *blockwise(4, 128, f32, bf16)),
        ("blockwise-b8-B32-fp16-fp32", *blockwise(8, 32, f16, f32)),
        ("blockwise-b2-B4096-bf16-noref", *blockwise(2, 4096, bf16, None)),
        ("log2-b4-B128-bf16", *log2(4, 128, bf16)),
        ("log2-b8-B4096-fp32", *log2(8, 4096, f32)),
        (
            "log2-temporal-b4-B128",
            temporal,
            lambda cc: (
                pair("temporal-encode", 4, 128, f32, f32, cc)
                + pair("temporal-decode", 4, 128, f32, f32, cc)
                + pair("temporal-check", 4, 128, f32, f32, cc)
            ),
        ),
        ("grouped-b4", lambda: grouped(4), lambda cc: grouped_expected(4, cc)),
        ("grouped-b2", lambda: grouped(2), lambda cc: grouped_expected(2, cc)),
        (
            "grouped-log2-temporal",
            grouped_temporal,
            lambda cc: (
                pair("grouped-temporal-encode", 4, 128, f32, f32, cc)
                + pair("grouped-temporal-decode", 4, 128, f32, f32, cc)
                + pair("grouped-temporal-check", 4, 128, f32, f32, cc)
            ),
        ),
        (
            "grouped-log2-decode",
            grouped_log2_decode,
            lambda cc: pair("grouped-log2-decode", 4, 128, f32, None, cc),
        ),
        (
            "copy-and-fingerprints",
            copy_and_fingerprints,
            lambda cc: (
                [Variant("grouped-copy", 8, 4096, "u8", None, m, cc) for m in (False, True)]
                + [Variant("fingerprint", 32, 2048, "fp16", None, False, cc)]
            ),
        ),
        ("bitmask", bitmask, bitmask_expected),
        ("sparsity-counts", sparsity_counts, sparsity_expected),
        ("delta-statistics", delta_statistics, statistics_expected),
        ("bitmask-grouped", bitmask_grouped, bitmask_grouped_expected),
    ]


def _sha(ptx: str) -> str:
    """A hash of the PTX's code: without its debug information (source paths and lines),
    which triton's cache key leaves out, so a cached compile from another checkout of the
    same source differs there and only there."""
    code = re.split(r"^\s*\.section\s+\.debug", ptx, maxsplit=1, flags=re.M)[0]
    lines = [line for line in code.splitlines() if not line.lstrip().startswith((".file", ".loc"))]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def run_cases(cc: int) -> dict[str, dict]:
    """Each case's launches (kernel, PTX hash, ftz count) and the hashes ``_ptx`` gives
    its expected variants."""
    import _ptx

    launches = install_stand_in_driver(cc)
    out = {}
    for name, call, expected in cases():
        del launches[:]
        call()
        variants = expected(cc)
        out[name] = {
            "launches": [
                {"kernel": kname, "ptx": _sha(k.asm["ptx"]), "ftz": k.asm["ptx"].count(".ftz")}
                for kname, k in launches
            ],
            "expected": [
                {"label": v.label, "ptx": _sha(_ptx.compile_variant(v).asm["ptx"])} for v in variants
            ],
        }
    return out


def launch_in_children(out_dir: Path) -> dict[int, dict[str, dict]]:
    """:func:`run_cases` for each of ``_ptx.TARGETS``, one child process each; by target."""
    import subprocess

    from _ptx import TARGETS

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    children = {}
    for cc in TARGETS:
        out = out_dir / f"jit_launch_sm{cc}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--cc", str(cc), "--out", str(out)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        children[cc] = (proc, out)
    result = {}
    for cc, (proc, out) in children.items():
        log, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"JIT launch child for sm_{cc} failed (rc {proc.returncode}):\n{log[-4000:]}")
        result[cc] = json.loads(out.read_text())
    return result


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cc", type=int, required=True, help="compute capability: 80 or 90")
    parser.add_argument("--out", required=True, help="JSON file to write the launches to")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: interpreted jit functions cannot be compiled")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    Path(args.out).write_text(json.dumps(run_cases(args.cc)))


if __name__ == "__main__":
    _main()
