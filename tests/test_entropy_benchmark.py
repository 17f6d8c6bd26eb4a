"""The measuring helpers of benchmarks/entropy_stage.py measure what they claim."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))

import entropy_stage as es  # noqa: E402
from tw_triton.codecs import native  # noqa: E402


def test_code_symbols_unpack_lsb_first():
    # Element i of a byte sits at bits (i % k) * bits: 0x21 holds 1 then 2 at 4 bits.
    packed = torch.tensor([0x21, 0x43, 0x05], dtype=torch.uint8)
    assert es.code_symbols(packed, 4, 5).tolist() == [1, 2, 3, 4, 5]
    packed2 = torch.tensor([0b11100100], dtype=torch.uint8)
    assert es.code_symbols(packed2, 2, 4).tolist() == [0, 1, 2, 3]


def test_order0_entropy():
    assert es.order0_bits(np.arange(16).repeat(10)) == 4.0
    assert es.order0_bits(np.zeros(100, dtype=np.int64)) == 0.0
    p = np.array([0] * 3 + [1])
    assert math.isclose(es.order0_bits(p), -(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25)))
    # One plane constant, the other uniform over 256 values: 8 bits per element.
    t = torch.arange(256, dtype=torch.int16)
    assert es.plane_entropy_bits(t) == 8.0


def test_measure_kind_is_lossless_and_counts_bits():
    g = torch.Generator().manual_seed(0)
    bufs = []
    for n in (5000, 3000):
        t = torch.randn(n, generator=g) * 1e-3
        bufs.append({"tensor": t, "elements": n, "h0": es.plane_entropy_bits(t), "raw_bits": 32, "src": "x"})
    out = es.measure_kind(bufs)
    assert out["raw_bytes"] == 8000 * 4 and out["elements"] == 8000
    assert out["policy_stage"] == "zstd-bytegroup"
    # Both buffers are over 4 KiB and save well over 3 %: both staged.
    assert out["auto_stages"] == ["zstd-bytegroup"]
    level = es.entropy.DEFAULT_LEVEL
    assert out["auto_bytes"] == out["stored"][f"zstd-bytegroup/{level}"] < out["raw_bytes"]
    assert out["compress_mb_s"] > 0 and out["decompress_mb_s"] > 0


def test_plane_stages_compares_both_stages_on_the_same_buffers():
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(1 << 15, generator=g) * 0.02
    zeros = torch.zeros(1 << 14)
    bufs = [es._bytes(weights), es._bytes(zeros)]
    before = os.environ.get(native.ENV_NATIVE)
    out = es.plane_stages(bufs)
    assert out.pop("compiled_planes") is native.enabled()
    assert set(out) == {"zstd-bytegroup", "zstd-planes", "zstd-planes, numpy"}
    assert out["zstd-planes"]["bytes"] == out["zstd-planes, numpy"]["bytes"]
    assert os.environ.get(native.ENV_NATIVE) == before  # put back as it was
    # Weights: sign and exponent through zstd; zeros: all four planes.
    assert out["zstd-planes"]["coded_planes"] == 1 + 4 and out["zstd-planes"]["planes"] == 8
    for row in out.values():
        assert 0 < row["bytes"] < len(bufs[0]) + len(bufs[1])
        assert row["encode_s"] > 0 and row["decode_s"] > 0
