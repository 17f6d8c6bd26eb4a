"""The state API's automatic choice of the ``bitmask`` codec for sparse tensors it would
store exact (issue 32, item 3): where it is chosen, that it changes no bit, and that
keyframes of a pruned model serve the deltas after them."""

from __future__ import annotations

import pytest
import torch
from _kernel_testing import bit_patterns, same_bits

import tw_triton
from tw_triton.checkpointer import Checkpointer
from tw_triton.codecs.bitmask import SPARSE_MIN_NUMEL, sparse_pays, sparsity_counts
from tw_triton.ops.backends import native
from tw_triton.ops.reference import bitmask as reference_bitmask
from tw_triton.ops.reference import sparsity_counts_torch
from tw_triton.state import encode as state_encode


def pruned(gen: torch.Generator, shape: tuple[int, ...], fraction: float) -> torch.Tensor:
    """Normal weights with the ``fraction`` smallest magnitudes set to +0."""
    w = torch.randn(shape, generator=gen)
    k = int(fraction * w.numel())
    if k:
        w[w.abs() <= w.abs().view(-1).kthvalue(k).values] = 0.0
    return w


def two_of_four(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    w = torch.randn(shape, generator=gen)
    groups = w.view(-1, 4)
    drop = groups.abs().argsort(dim=1)[:, :2]
    return groups.scatter(1, drop, 0.0).view(shape)


def sample(gen: torch.Generator) -> dict[str, torch.Tensor]:
    special = pruned(gen, (64, 128), 0.5)
    special[0, :4] = torch.tensor([-0.0, float("nan"), float("inf"), 1e-45])
    return {
        "half": pruned(gen, (128, 96), 0.5),
        "two_four": two_of_four(gen, (96, 64)).to(torch.bfloat16),
        "fp16": pruned(gen, (4096,), 0.3).half(),
        "special": special,
        "zeros": torch.zeros(64, 64),  # a bit per element beats 32 (no value to cluster against)
        # Whole rows of zeros (runs of 96): as well stored exact.
        "rows": torch.where(
            torch.rand(128, 1, generator=gen) < 0.5, torch.randn(128, 96, generator=gen), 0.0
        ),
        "few": pruned(gen, (128, 96), 0.05),  # 5 % zeros: not worth a mask
        "dense": torch.randn(64, 96, generator=gen),
        "small": pruned(gen, (SPARSE_MIN_NUMEL - 1,), 0.9),
        "ints": torch.zeros(8192, dtype=torch.int32),
    }


SPARSE = {"half", "two_four", "fp16", "special", "zeros"}


def test_exact_tensors_that_are_sparse_enough_are_stored_by_bitmask(tmp_path) -> None:
    state = sample(torch.Generator().manual_seed(0))
    q = tw_triton.quantize_state_dict(state, rules="exact")
    assert {p for p, e in q.entries.items() if e.codec == "bitmask"} == SPARSE
    assert all(e.codec == "exact" for p, e in q.entries.items() if p not in SPARSE)
    for p in SPARSE:
        x = state[p]
        assert q.entries[p].nbytes < x.numel() * x.element_size() * 15 / 16, p
    path = tmp_path / "s.safetensors"
    tw_triton.save(q, path, fsync=False)
    back = tw_triton.load(path)
    for p, x in state.items():
        assert same_bits(back[p], x), p
    plain = tw_triton.quantize_state_dict(state, rules="exact", sparse=False)
    assert {e.codec for e in plain.entries.values()} == {"exact"}


def test_the_threshold() -> None:
    # fp32: the mask's bit per element against 32; 16-bit dtypes against 16.
    n = 1 << 16
    runs = n // 8  # short runs
    assert sparse_pays(n, n - n * 3 // 32, 4, runs) and not sparse_pays(n, n - n * 3 // 32 + 64, 4, runs)
    assert sparse_pays(n, n - n // 8, 2, runs) and not sparse_pays(n, n - n // 8 + 1, 2, runs)
    # Half zeros: at random their runs are 2 long on average; from 4 on, they cluster and are
    # stored exact (its entropy stage stores them about as well).
    assert sparse_pays(n, n // 2, 4, n // 8 + 1) and not sparse_pays(n, n // 2, 4, n // 8)
    # 90 % zeros: runs of 10 at random, so up to 20 still count as scattered.
    m = 65540
    assert sparse_pays(m, m // 10, 2, 2950) and not sparse_pays(m, m // 10, 2, 2949)  # 58986 zeros


def counts(x: torch.Tensor, fn=sparsity_counts) -> tuple[int, int]:
    return tuple(int(c) for c in fn(x))


@pytest.mark.parametrize("chunk", [1 << 22, 1, 2, 3])
def test_sparsity_counts(monkeypatch, chunk) -> None:
    """Non-zero elements and runs of zeros, in row-major order, across chunk boundaries
    (the torch spec's chunks; the compiled count's threads split at SPLIT_MIN_ELEMENTS)."""
    monkeypatch.setattr(reference_bitmask, "COUNT_CHUNK", chunk)
    z = torch.tensor
    assert counts(z([0.0, 0.0, 1.0, 0.0, 2.0, 0.0])) == (2, 3)
    assert counts(z([1.0, -0.0, 1.0])) == (3, 0)  # -0.0 is a value
    assert counts(z([[0.0, 1.0], [0.0, 0.0]]).t()) == (1, 2)  # the view's order: 0 0 1 0
    assert counts(torch.zeros(0)) == (0, 0) and counts(torch.zeros(5)) == (0, 1)
    x = bit_patterns(torch.Generator().manual_seed(chunk), 1000, torch.bfloat16, 0.5)
    zero = (x.view(torch.int16) == 0).tolist()
    runs = sum(1 for i, v in enumerate(zero) if v and (i == 0 or not zero[i - 1]))
    assert counts(x) == (1000 - sum(zero), runs)


def test_quantized_tensors_keep_their_codec() -> None:
    """Only what the rules store exact is looked at: a pruned weight under a quantizing
    rule stays blockwise (its zeros are codes of 0)."""
    s = sample(torch.Generator().manual_seed(1))
    state = {"model": {"half": s["half"]}, "optimizer": {"two_four": s["two_four"]}}
    q = tw_triton.quantize_state_dict(state)
    assert q.entries["model/half"].codec == "blockwise"
    assert q.entries["optimizer/two_four"].codec == "bitmask"


def test_decided_after_the_host_sync_gives_the_same_entries(monkeypatch) -> None:
    """A device state counts its candidates into the one batched host read and encodes
    them afterwards; forced onto this path on the CPU, it gives the same entries, in the
    state's order."""
    state = sample(torch.Generator().manual_seed(2))
    inline = tw_triton.quantize_state_dict(state, rules="exact")
    reads: list[int] = []
    real = state_encode.fingerprints.read_device_scalars

    def counted(scalars, buffers=()):
        reads.append(len(scalars))
        return real(scalars, buffers)

    monkeypatch.setattr(state_encode, "decided_after_sync", lambda on_host: True)
    monkeypatch.setattr(state_encode.fingerprints, "read_device_scalars", counted)
    later = tw_triton.quantize_state_dict(state, rules="exact")
    assert reads == [2 * sum(1 for p in state if p not in ("small", "ints"))]
    assert list(later.entries) == list(inline.entries)
    for p, e in inline.entries.items():
        f = later.entries[p]
        assert (f.codec, f.params, sorted(f.buffers)) == (e.codec, e.params, sorted(e.buffers)), p
        for name, buf in e.buffers.items():
            assert same_bits(f.buffers[name], buf), (p, name)


class Pruned(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.a = torch.nn.Parameter(pruned(gen, (128, 64), 0.5))
        self.b = torch.nn.Parameter(two_of_four(gen, (64, 128)))
        self.bias = torch.nn.Parameter(torch.zeros(64))

    def step(self, k: int) -> None:
        """Move the kept weights; the pruned ones stay zero (a pruning mask in force)."""
        with torch.no_grad():
            for p in (self.a, self.b):
                p.mul_(1.0 + 0.01 * k)


@pytest.mark.parametrize("async_write", [True, False])
@pytest.mark.parametrize("delta", ["open", "closed"])
def test_keyframes_of_a_pruned_model_store_bitmask_and_serve_deltas(tmp_path, async_write, delta) -> None:
    model = Pruned(0)
    with Checkpointer(
        tmp_path, keyframe_every=10, fsync=False, rules="safe", async_write=async_write, delta=delta
    ) as ckpt:
        for step in range(3):
            ckpt.save(step, model=model)
            model.step(step + 1)
        want = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ckpt.save(3, model=model)
    infos = {i.step: i for i in Checkpointer(tmp_path).infos()}
    assert infos[0].kind == "keyframe" and infos[3].kind == "delta"
    manifest = tw_triton.format.read_manifest(infos[0].path)
    assert {p: e["codec"] for p, e in manifest["entries"].items() if p.startswith("model/")} == {
        "model/a": "bitmask",
        "model/b": "bitmask",
        "model/bias": "exact",
    }
    got = Checkpointer(tmp_path).load(3)["model"]
    for k, v in want.items():
        # int8 deltas of moved weights; the zeros stay exact zeros.
        assert torch.allclose(got[k], v, atol=1e-2), k
        assert torch.equal(got[k] == 0, v == 0), k


@pytest.mark.skipif(not native.enabled(), reason="the compiled CPU codec is not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("split", [False, True])
def test_compiled_sparsity_counts_match_the_spec(monkeypatch, dtype, split) -> None:
    """The C count (split over threads at every thread boundary, a run of zeros crossing
    one included) gives the torch spec's counts."""
    if split:
        monkeypatch.setattr(native, "SPLIT_MIN_ELEMENTS", 1)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    gen = torch.Generator().manual_seed(3)
    for n, zeros in [(1, 0.0), (1, 1.0), (100, 0.5), (1001, 0.9), (4099, 0.1), (333, 1.0)]:
        if dtype == torch.float64:
            x = torch.randint(-(1 << 62), 1 << 62, (n,), generator=gen) * (
                torch.rand(n, generator=gen) >= zeros
            )
            x = x.view(torch.float64)
        else:
            x = bit_patterns(gen, n, dtype, zeros)
        got = native.count_sparsity(x)
        assert got is not None
        assert tuple(int(c) for c in got) == counts(x, sparsity_counts_torch), (n, zeros)
    x = torch.zeros(70, dtype=dtype)
    x[::10] = 1  # runs of nine zeros, some across the 7 threads' boundaries
    assert tuple(int(c) for c in native.count_sparsity(x)) == counts(x, sparsity_counts_torch) == (7, 7)
    assert native.count_sparsity(x[::2]) is None and native.count_sparsity(torch.zeros(0)) is None
