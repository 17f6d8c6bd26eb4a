"""The ``bitmask`` codec: lossless round trips through the codec and through a file, its
stored params and buffers checked on load."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _kernel_testing import FLOATS, bit_patterns, numels, same_bits, shapes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tw_triton
from tw_triton.codecs import get_codec
from tw_triton.codecs.bitmask import bitmask_nbytes, mask_popcount
from tw_triton.errors import CheckpointError, QuantizationError

CODEC = get_codec("bitmask")
PARAMS = CODEC.resolve_params({}, bits=8, block=128)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    numel=numels(),
    dtype=st.sampled_from(FLOATS),
    zeros=st.sampled_from((0.0, 0.3, 0.5, 0.99, 1.0)),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_codec_round_trip_is_bit_exact(numel, dtype, zeros, seed, data) -> None:
    x = bit_patterns(torch.Generator().manual_seed(seed), numel, dtype, zeros).view(data.draw(shapes(numel)))
    enc = CODEC.encode(x, PARAMS, None)
    entry = enc.entry
    assert enc.unusable is None and entry.params == {"packing": "lsb-first"}
    assert sorted(entry.buffers) == ["mask", "values"]
    nnz = entry.buffers["values"].numel()
    assert entry.nbytes == bitmask_nbytes(numel, nnz, x.element_size())
    assert same_bits(CODEC.decode(entry, None, None, "test"), x)
    # Into buffers a snapshot pool hands out: the same bytes.
    handed: list[torch.Tensor] = []

    def allocate(shape, dtype, device):
        handed.append(torch.empty(shape, dtype=dtype, device=device))
        return handed[-1]

    pooled = CODEC.encode_with(x, PARAMS, None, allocate).entry
    assert len(handed) == 2 and pooled.buffers["mask"].data_ptr() == handed[0].data_ptr()
    for name in ("mask", "values"):
        assert same_bits(pooled.buffers[name], entry.buffers[name])


def test_through_a_file_with_the_entropy_stage(tmp_path) -> None:
    gen = torch.Generator().manual_seed(0)
    state = {
        "w": bit_patterns(gen, 300 * 257, torch.bfloat16, 0.5).view(300, 257),
        "v": bit_patterns(gen, 5000, torch.float32, 0.9),
        "z": torch.zeros(4096),
    }
    rules = [("*", "bitmask")]
    path = tmp_path / "sparse.safetensors"
    tw_triton.save(tw_triton.quantize_state_dict(state, rules=rules), path, fsync=False)
    back = tw_triton.load(path)
    for key, x in state.items():
        assert same_bits(back[key], x), key
    assert tw_triton.format.read_manifest(path)["entries"]["w"]["codec"] == "bitmask"


def test_params_are_resolved_and_checked() -> None:
    assert CODEC.resolve_params({"packing": "lsb-first"}, bits=4, block=32) == {"packing": "lsb-first"}
    with pytest.raises(QuantizationError, match="no parameter"):
        CODEC.resolve_params({"bits": 8}, bits=8, block=128)
    with pytest.raises(QuantizationError, match="lsb-first"):
        CODEC.resolve_params({"packing": "msb-first"}, bits=8, block=128)
    assert not CODEC.accepts(torch.zeros(4, dtype=torch.int32)) and CODEC.accepts(torch.zeros(0))
    with pytest.raises(QuantizationError, match="float32"):
        CODEC.encode(torch.zeros(4, dtype=torch.int64), PARAMS, None)
    for params, match in [
        ({}, "lack \\['packing'\\]"),
        ({"packing": "msb-first"}, "param 'packing' is 'msb-first'"),
        ({"packing": 1}, "param 'packing' is 1"),
        ({"packing": "lsb-first", "bits": 8}, "has no param\\(s\\) \\['bits'\\]"),
        ([], "params are list"),
    ]:
        with pytest.raises(CheckpointError, match=match):
            CODEC.check_stored_params(params, "file f, entry 'w'")


def _entry(x: torch.Tensor):
    return CODEC.encode(x, PARAMS, None).entry


def test_corrupt_buffers_are_refused_naming_the_entry() -> None:
    x = torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0, 0.0, 0.0, 4.0, 5.0, 0.0, 6.0])
    good = _entry(x)
    ctx = "file f.safetensors, entry 'model/w'"

    def broken(**buffers):
        return dataclasses.replace(good, buffers={**good.buffers, **buffers})

    cases = [
        (broken(mask=good.buffers["mask"] | 1), "mask has 7 set bits, expected 6"),
        # Six set bits, one of them past the 11 elements.
        (broken(mask=torch.tensor([0x9A, 0x09], dtype=torch.uint8)), "5 set bits and padding bits set"),
        (broken(values=good.buffers["values"][:-1]), "mask has 6 set bits, expected 5"),
        (broken(values=good.buffers["values"].double()), "values are torch.float64"),
        (broken(mask=good.buffers["mask"][:1]), "mask is torch.uint8 x 1, expected uint8 x 2"),
        (broken(mask=good.buffers["mask"].to(torch.int16)), "mask is torch.int16"),
        (dataclasses.replace(good, buffers={"mask": good.buffers["mask"]}), "expects a buffer 'values'"),
        (dataclasses.replace(good, dtype=torch.int32), "dtype torch.int32"),
    ]
    assert good.buffers["mask"].tolist() == [0x9A, 0x05]
    for entry, match in cases:
        with pytest.raises(CheckpointError, match=match) as info:
            CODEC.decode(entry, None, None, ctx)
        assert ctx in str(info.value)


def test_mask_popcount() -> None:
    assert mask_popcount(torch.tensor([255, 1], dtype=torch.uint8), 9) == (9, False)
    assert mask_popcount(torch.tensor([255, 3], dtype=torch.uint8), 9) == (9, True)  # the padding bit apart
    assert mask_popcount(torch.tensor([255, 128], dtype=torch.uint8), 16) == (9, False)
    assert mask_popcount(torch.zeros(0, dtype=torch.uint8), 0) == (0, False)
