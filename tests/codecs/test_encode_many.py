"""Small tensors encoded in one call (``Codec.encode_many``, ``tw_triton.batching``): the
bytes must be exactly what each tensor gets alone, and errors still name their entry."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tw_triton
import tw_triton.codecs as codecs_mod
import tw_triton.state.encode as state_encode
from tw_triton import QuantizationError, quantize_state_dict
from tw_triton.batching import BATCH_ELEMENTS, group_batches
from tw_triton.codecs import get_codec
from tw_triton.codecs.blockwise import BlockwiseCodec
from tw_triton.codecs.log2 import Log2Codec
from tw_triton.snapshot_pool import SnapshotPool


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.reshape(-1)


def _same_entry(a, b) -> None:
    assert (a.codec, a.params, tuple(a.shape), a.dtype) == (b.codec, b.params, tuple(b.shape), b.dtype)
    assert a.buffers.keys() == b.buffers.keys()
    for name in a.buffers:
        assert a.buffers[name].dtype == b.buffers[name].dtype, name
        assert torch.equal(_raw(a.buffers[name]), _raw(b.buffers[name])), name


# ------------------------------------------------------------------ group_batches


def test_group_batches_keeps_unbatchable_and_large_items_alone():
    keys = ["a", None, "a", "b", "a", "a"]
    numels = [10, 10, 10, 10, 100, 10]
    assert group_batches(keys, numels, cap=50) == [[0, 2, 5], [1], [3], [4]]


def test_group_batches_closes_a_group_before_it_passes_the_cap():
    # The first group is full at 40 (a third 20 would pass 45); the second takes the 5.
    assert group_batches(["k"] * 5, [20, 20, 20, 20, 5], cap=45) == [[0, 1], [2, 3, 4]]


def test_group_batches_with_cap_zero_puts_every_item_alone():
    assert group_batches(["k", "k", None], [1, 2, 3], cap=0) == [[0], [1], [2]]


@settings(max_examples=60, deadline=None)
@given(
    items=st.lists(st.tuples(st.sampled_from(["a", "b", None]), st.integers(1, 40)), max_size=30),
    cap=st.integers(1, 60),
)
def test_group_batches_is_a_partition_within_the_cap(items, cap):
    keys = [k for k, _ in items]
    numels = [n for _, n in items]
    work = group_batches(keys, numels, cap=cap)
    flat = sorted(i for item in work for i in item)
    assert flat == list(range(len(items)))
    assert [item[0] for item in work] == sorted(item[0] for item in work)
    for item in work:
        assert item == sorted(item)
        if len(item) > 1:
            assert len({keys[i] for i in item}) == 1 and keys[item[0]] is not None
            assert sum(numels[i] for i in item) <= cap


# ------------------------------------------------------------------ encode_many


@settings(max_examples=40, deadline=None)
@given(
    blocks=st.lists(st.integers(1, 6), min_size=2, max_size=5),
    bits=st.sampled_from((8, 4, 2)),
    block=st.sampled_from((32, 64)),
    dtype=st.sampled_from((torch.float32, torch.bfloat16, torch.float16)),
    with_ref=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_blockwise_encode_many_equals_each_alone(blocks, bits, block, dtype, with_ref, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [(torch.randn(k * block, generator=g) * 3).to(dtype) for k in blocks]
    refs = (
        [(x.float() + torch.randn(x.numel(), generator=g) * 0.1).to(dtype) for x in xs] if with_ref else None
    )
    codec = BlockwiseCodec()
    params = codec.resolve_params({}, bits=bits, block=block)
    got = codec.encode_many(xs, params, refs, None)
    for i, x in enumerate(xs):
        alone = codec.encode(x, params, None if refs is None else refs[i])
        _same_entry(got[i].entry, alone.entry)
        assert got[i].unusable is None or not bool(got[i].unusable)


@settings(max_examples=30, deadline=None)
@given(
    blocks=st.lists(st.integers(1, 6), min_size=2, max_size=5),
    bits=st.sampled_from((8, 4, 2)),
    dtype=st.sampled_from((torch.float32, torch.bfloat16)),
    zero_rows=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_log2_encode_many_equals_each_alone(blocks, bits, dtype, zero_rows, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [(torch.rand(k * 32, generator=g) ** 4).to(dtype) for k in blocks]
    if zero_rows:
        xs[0][:32] = 0.0  # an all-zero block and a mixed one
        xs[-1][5] = 0.0
    codec = Log2Codec()
    params = codec.resolve_params({}, bits=bits, block=32)
    got = codec.encode_many(xs, params, None, None)
    for x, enc in zip(xs, got):
        _same_entry(enc.entry, codec.encode(x, params, None).entry)


@pytest.mark.parametrize("codec", [BlockwiseCodec(), Log2Codec()], ids=["blockwise", "log2"])
def test_encode_many_flags_only_the_tensor_that_cannot_be_coded(codec):
    xs = [torch.rand(128) + 0.1 for _ in range(3)]
    xs[1][7] = float("nan")
    params = codec.resolve_params({}, bits=8, block=64)
    got = codec.encode_many(xs, params, None, None)
    flags = [enc.unusable is not None and bool(enc.unusable) for enc in got]
    assert flags == [False, True, False]
    for x, enc in zip(xs, got):
        _same_entry(enc.entry, codec.encode(x, params, None).entry)


def test_encode_many_writes_into_memory_from_the_allocator():
    pool = SnapshotPool(cap_bytes=1 << 22, min_bytes=0)
    lease = pool.lease()
    codec = BlockwiseCodec()
    params = codec.resolve_params({}, bits=4, block=32)
    xs = [torch.randn(64), torch.randn(96)]
    got = codec.encode_many(xs, params, None, lease)
    # One allocation per buffer of the batch; the entries are views of it.
    assert lease.nbytes > 0
    assert got[0].entry.buffers["codes"].untyped_storage().data_ptr() == (
        got[1].entry.buffers["codes"].untyped_storage().data_ptr()
    )
    for x, enc in zip(xs, got):
        _same_entry(enc.entry, codec.encode(x, params, None).entry)
    lease.release()


def test_batch_key_refuses_what_a_concatenation_cannot_code():
    codec = BlockwiseCodec()
    params = codec.resolve_params({}, bits=8, block=64)
    assert codec.batch_key(torch.randn(128), params, None) is not None
    assert codec.batch_key(torch.randn(100), params, None) is None  # not whole blocks
    assert codec.batch_key(torch.randn(64, 4).t(), params, None) is None  # strided
    assert codec.batch_key(torch.randn(128), params, torch.randn(256)[::2]) is None  # strided reference
    assert codec.batch_key(torch.randn(0), params, None) is None
    # A reference of another dtype is another key: its delta is computed differently.
    assert codec.batch_key(torch.randn(128), params, torch.randn(128)) != codec.batch_key(
        torch.randn(128), params, torch.randn(128).bfloat16()
    )


# ------------------------------------------------------------------ quantize_state_dict


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = {f"layer{i}.weight": torch.randn(64, 64 + 32 * (i % 3), generator=g) for i in range(8)}
    model["odd.weight"] = torch.randn(4099, generator=g)  # not whole blocks: alone
    model["big.weight"] = torch.randn(BATCH_ELEMENTS + 128, generator=g)  # large: alone
    model["bias"] = torch.randn(64, generator=g)  # exact
    opt = {
        str(i): {"exp_avg": torch.randn_like(t) * 1e-3, "exp_avg_sq": torch.rand_like(t) * 1e-6}
        for i, t in enumerate(model.values())
    }
    return {"model": model, "optimizer": {"state": opt}}


@pytest.mark.parametrize("rules", ["smallest", "safe", "small", "int8-exp-avg"])
def test_quantize_state_dict_is_the_same_batched_or_not(monkeypatch, rules):
    state = _state()
    ref = {"model": {k: v + 0.01 for k, v in state["model"].items()}, "optimizer": state["optimizer"]}
    batched = quantize_state_dict(state, reference=ref, rules=rules, checkpoint_id="c")
    monkeypatch.setattr(
        state_encode, "group_batches", lambda keys, numels: group_batches(keys, numels, cap=0)
    )
    alone = quantize_state_dict(state, reference=ref, rules=rules, checkpoint_id="c")
    assert batched.entries.keys() == alone.entries.keys()
    for path in batched.entries:
        _same_entry(batched.entries[path], alone.entries[path])
    assert batched.reference_id == alone.reference_id


def test_a_batched_entry_with_nan_is_stored_exact_and_logged(caplog):
    state = _state()
    state["model"]["layer3.weight"][0, 0] = float("nan")
    with caplog.at_level(logging.WARNING, logger="tw_triton.state"):
        q = quantize_state_dict(state, rules="int8-exp-avg")
    assert q.entries["model/layer3.weight"].codec == "exact"
    assert q.entries["model/layer2.weight"].codec != "exact"
    assert "model/layer3.weight" in caplog.text


def test_progress_counts_every_entry_of_a_batch():
    seen = []
    state = _state()
    quantize_state_dict(state, rules="int8-exp-avg", progress=lambda done, total: seen.append((done, total)))
    total = seen[-1][1]
    assert [d for d, _ in seen] == list(range(1, total + 1))


class _PickyCodec(BlockwiseCodec):
    """Encodes alone, but fails on a tensor whose first element is 7 and on any batch."""

    name = "picky-test"

    def encode(self, x, params, reference):
        if x.reshape(-1)[0].item() == 7.0:
            raise QuantizationError("refuses a 7")
        return super().encode(x, params, reference)

    def encode_many(self, xs, params, references, allocate):
        raise QuantizationError("the batch failed")


def test_a_failing_batch_is_retried_alone_so_the_error_names_the_entry(request):
    codecs_mod.register_codec("picky-test", _PickyCodec())
    request.addfinalizer(lambda: codecs_mod.unregister_codec("picky-test"))
    assert get_codec("picky-test") is not None
    state = {f"w{i}": torch.ones(128) * (7.0 if i == 2 else 1.0) for i in range(4)}
    with pytest.raises(QuantizationError, match=r"entry 'w2' \(codec 'picky-test'\): refuses a 7"):
        quantize_state_dict(state, rules=[("*", {"codec": "picky-test"})])
    del state["w2"]
    q = quantize_state_dict(state, rules=[("*", {"codec": "picky-test"})])
    assert {e.codec for e in q.entries.values()} == {"picky-test"}


def test_files_are_byte_identical_batched_or_not(tmp_path, monkeypatch):
    state = _state(1)
    ref = {"model": {k: v + 0.01 for k, v in state["model"].items()}, "optimizer": state["optimizer"]}

    def write(name: str) -> bytes:
        q = quantize_state_dict(state, reference=ref, rules="smallest", checkpoint_id="c", reference_id="r")
        tw_triton.save(q, tmp_path / name, fsync=False)
        return (tmp_path / name).read_bytes()

    batched = write("a.tw")
    monkeypatch.setattr(
        state_encode, "group_batches", lambda keys, numels: group_batches(keys, numels, cap=0)
    )
    assert write("b.tw") == batched


def test_encode_many_of_tensors_that_do_not_share_a_key_encodes_each_alone():
    codec = BlockwiseCodec()
    params = codec.resolve_params({}, bits=4, block=64)
    xs = [torch.randn(128), torch.randn(100), torch.randn(64).bfloat16()]  # whole blocks; not; other dtype
    got = codec.encode_many(xs, params, None, None)
    for x, enc in zip(xs, got):
        _same_entry(enc.entry, codec.encode(x, params, None).entry)
