"""Launches and host syncs per save: a fixed small number, whatever the number of tensors.

A GPU is not needed to count them. The state API encodes a device state in groups
(``tw_triton.state.grouped``); here that path is forced for CPU tensors
(``groups_launches`` patched), the grouped ops' Triton backend is registered for the CPU
(so its kernels run under ``TRITON_INTERPRET=1``, table building and all), and a spy counts:

* kernel launches: every launch of a Triton kernel, plus every torch op the save issues
  outside the kernels that computes something (allocations and views launch nothing);
* host syncs: every read of device values on the host, i.e. calls of
  ``fingerprints.to_host`` (the one copy + event) and any ``item``/``nonzero``-like op.

What this proves: the orchestration issues the same operations for ``FEW`` and for ``MANY`` coded
tensors. What it does not: on CUDA the table copies are pinned-memory copies and the
wait is a CUDA event (those lines run only on a GPU: benchmarks/gpu).
"""

from __future__ import annotations

import contextlib
import importlib
from collections import Counter
from concurrent.futures import Future

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tw_triton
from tw_triton import Checkpointer, deltas, ops, quantize_state_dict
from tw_triton.codecs import get_codec
from tw_triton.ops.backends import triton as triton_backend
from tw_triton.ops.reference import log2_temporal_code_errors_torch
from tw_triton.rules import resolve_rules, rules_as_specs
from tw_triton.state import decode as decode_module
from tw_triton.state import encode as encode_module
from tw_triton.state import fingerprints
from tw_triton.tree import flatten

# Host reads of tensor values: any of these is a sync on a device.
SYNC_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default"}
NOT_LAUNCHES = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.detach.default"}
# The two numbers of tensors each count is compared at: what the grouped path launches
# must not depend on it. Every kernel runs interpreted here, so they stay small.
FEW, MANY = 10, 24

BLOCKWISE = [("*", {"codec": "blockwise", "bits": 4, "block": 32})]
# Weights as blockwise deltas, second moments by the log2 codec (no reference).
# and counters exact.
MIXED = [("*exp_avg_sq", {"codec": "log2", "bits": 4, "block": 64}), ("*.step", "exact"), *BLOCKWISE]


class LaunchSpy(TorchDispatchMode):
    """Counts the torch ops issued while active, except inside spied kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.kernels: Counter = Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view and str(func) not in NOT_LAUNCHES:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def counted(self, name: str, fn):
        """``fn``, counted as one launch per call (its inner torch work is not)."""

        def run(*args, **kwargs):
            self.kernels[name] += 1
            self.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused = False

        return run

    def launches(self) -> int:
        torch_ops = sum(n for op, n in self.ops.items() if op not in SYNC_OPS and op != "to_host")
        return sum(self.kernels.values()) + torch_ops

    def syncs(self) -> int:
        return self.ops["to_host"] + sum(self.ops[op] for op in SYNC_OPS)


class SpiedKernel:
    """A Triton kernel whose launches count on ``spy`` (its inner torch work does not)."""

    def __init__(self, kernel, name: str, spy: LaunchSpy) -> None:
        self.kernel, self.name, self.spy = kernel, name, spy

    def __getitem__(self, grid):
        return self.spy.counted(self.name, self.kernel[grid])


@pytest.fixture
def spy(monkeypatch):
    """The grouped device path forced on CPU tensors, with its launches and syncs counted."""
    spy = LaunchSpy()
    monkeypatch.setattr(encode_module, "groups_launches", lambda device: True)
    monkeypatch.setattr(deltas, "groups_launches", lambda device: True)
    for module, name in [
        ("tw_triton.kernels.quantize_blockwise_grouped", "quantize_blockwise_grouped_kernel"),
        ("tw_triton.kernels.quantize_blockwise_update_grouped", "quantize_blockwise_update_grouped_kernel"),
        ("tw_triton.kernels.quantize_log2_grouped", "quantize_log2_grouped_kernel"),
        ("tw_triton.kernels.quantize_log2_temporal_grouped", "quantize_log2_temporal_grouped_kernel"),
        ("tw_triton.kernels.copy_grouped", "copy_grouped_kernel"),
        ("tw_triton.kernels.dequantize_blockwise_grouped", "dequantize_blockwise_grouped_kernel"),
        ("tw_triton.kernels.dequantize_log2_temporal_grouped", "dequantize_log2_temporal_grouped_kernel"),
        ("tw_triton.kernels.dequantize_log2_grouped", "dequantize_log2_grouped_kernel"),
        (
            "tw_triton.kernels.dequantize_blockwise_update_grouped",
            "dequantize_blockwise_update_grouped_kernel",
        ),
        ("tw_triton.kernels.fingerprint", "fingerprint_kernel"),
        ("tw_triton.kernels.sparsity_counts_grouped", "sparsity_counts_grouped_kernel"),
        ("tw_triton.kernels.delta_statistics_grouped", "delta_statistics_grouped_kernel"),
        ("tw_triton.kernels.bitmask_grouped", "bitmask_mask_grouped_kernel"),
        ("tw_triton.kernels.bitmask_grouped", "bitmask_scatter_grouped_kernel"),
        ("tw_triton.kernels.log2_temporal_check", "log2_temporal_check_grouped_kernel"),
    ]:
        mod = importlib.import_module(module)
        monkeypatch.setattr(mod, name, SpiedKernel(getattr(mod, name), name, spy))
    real_to_host = fingerprints.to_host

    def to_host(buf):
        spy.ops["to_host"] += 1
        return real_to_host(buf)

    monkeypatch.setattr(fingerprints, "to_host", to_host)
    grouped = {
        "quantize_blockwise_many": triton_backend.quantize_blockwise_many_cuda,
        "quantize_blockwise_update_many": triton_backend.quantize_blockwise_update_many_cuda,
        "quantize_log2_many": triton_backend.quantize_log2_many_cuda,
        "quantize_log2_temporal_many": triton_backend.quantize_log2_temporal_many_cuda,
        "fingerprints": triton_backend.fingerprints_cuda,
        "copy_many": triton_backend.copy_many_cuda,
        "dequantize_blockwise_many": triton_backend.dequantize_blockwise_many_cuda,
        "sparsity_counts_many": triton_backend.sparsity_counts_many_cuda,
        "dequantize_log2_temporal_many": triton_backend.dequantize_log2_temporal_many_cuda,
        "dequantize_log2_many": triton_backend.dequantize_log2_many_cuda,
        "dequantize_blockwise_update_many": triton_backend.dequantize_blockwise_update_many_cuda,
        "delta_statistics_many": triton_backend.delta_statistics_many_cuda,
        "bitmask_encode_many": triton_backend.bitmask_encode_many_cuda,
        "log2_temporal_code_flags_many": triton_backend.log2_temporal_code_flags_many_cuda,
    }
    with contextlib.ExitStack() as stack:
        for op, fn in grouped.items():
            stack.enter_context(ops.using(op, "cpu", fn))
        # The single-tensor ops count as a launch each: on the CPU they run in the
        # compiled codec, which the dispatch spy does not see.
        single = (
            "quantize_blockwise",
            "dequantize_blockwise",
            "quantize_log2",
            "dequantize_log2",
            "quantize_log2_temporal",
            "dequantize_log2_temporal",
        )
        for op in (*single, "sparsity_counts", "bitmask_encode", "delta_statistics"):
            stack.enter_context(ops.using(op, "cpu", spy.counted(op, ops.lookup(op, "cpu"))))
        yield spy


@contextlib.contextmanager
def per_tensor_path(monkeypatch):
    """The per-tensor path, on the CPU's own codec, for the saves and loads a test needs but
    does not count: their bytes are the grouped path's (the tests named ``..._gives_the_
    bytes_of_the_per_tensor_path``), without the interpreted kernels' minutes."""
    with monkeypatch.context() as m:
        for module in (encode_module, deltas, decode_module):
            m.setattr(module, "groups_launches", lambda device: False)
        yield


def make_state(n: int, seed: int) -> dict[str, torch.Tensor]:
    """``n`` small tensors of two dtypes and many sizes: weights and second moments, each
    kind and dtype with whole tiles and a tail among the first eight (so that ``FEW`` and ``MANY``
    tensors hold the same kinds, and differ in number only)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        size = 5000 if i < 8 else 40 + 13 * i
        dtype = torch.bfloat16 if i % 2 else torch.float32
        name = f"layer{i}.exp_avg_sq" if i % 4 in (1, 2) else f"layer{i}.weight"
        out[name] = torch.randn(size, generator=gen).to(dtype)
        if name.endswith("exp_avg_sq"):
            out[name] = out[name].square()
        if i % 3 == 0:
            out[f"layer{i}.step"] = torch.tensor([i, 7], dtype=torch.int64)
    return out


def counted_save(spy: LaunchSpy, n: int):
    state = make_state(n, seed=n)
    ref = {k: v + 0.01 if v.is_floating_point() else v for k, v in state.items()}
    spy.ops.clear()
    spy.kernels.clear()
    with spy:
        q = quantize_state_dict({"model": state}, reference={"model": ref}, rules=MIXED)
    return q, (spy.launches(), spy.syncs(), dict(spy.kernels), dict(spy.ops))


def test_a_delta_save_launches_and_syncs_the_same_for_few_and_many_tensors(spy) -> None:
    _, small = counted_save(spy, FEW)
    _, large = counted_save(spy, MANY)
    assert small == large, f"{FEW} tensors: {small}\n{MANY} tensors: {large}"
    launches, syncs, kernels, torch_ops = large
    # Two dtype pairs (two dtypes for log2): at most two encode launches each; two
    # reference dtypes: one fingerprint launch each; one zero-fill of the flags and
    # fingerprints.
    assert kernels["quantize_blockwise_grouped_kernel"] <= 4
    assert kernels["quantize_log2_grouped_kernel"] <= 4
    assert kernels["copy_grouped_kernel"] == 1  # the counters: a tail each, no whole tile
    assert kernels["fingerprint_kernel"] == 2
    assert torch_ops == {"aten.zeros.default": 1, "to_host": 1}
    assert launches <= 12 and syncs == 1


def test_the_grouped_path_gives_the_bytes_of_the_per_tensor_path(spy, monkeypatch) -> None:
    state = make_state(30, seed=1)
    state["layer3.weight"][5] = float("nan")  # stored exact, as on the per-tensor path
    state["layer5.exp_avg_sq"][0] = -1.0  # likewise: log2 codes no negative value
    ref = {k: v + 0.01 if v.is_floating_point() else v for k, v in state.items()}
    grouped = quantize_state_dict({"model": state}, reference={"model": ref}, rules=MIXED)
    monkeypatch.setattr(encode_module, "groups_launches", lambda device: False)
    alone = quantize_state_dict({"model": state}, reference={"model": ref}, rules=MIXED)
    assert grouped.entries.keys() == alone.entries.keys()
    assert grouped.entries["model/layer3.weight"].codec == "exact"
    assert grouped.entries["model/layer5.exp_avg_sq"].codec == "exact"
    assert grouped.entries["model/layer9.exp_avg_sq"].codec == "log2"
    for path, entry in alone.entries.items():
        other = grouped.entries[path]
        assert (other.codec, other.params) == (entry.codec, entry.params), path
        for name, buf in entry.buffers.items():
            got, want = (b.reshape(-1).view(torch.uint8) for b in (other.buffers[name], buf))
            assert torch.equal(got, want), (path, name)
    assert grouped.reference_id == alone.reference_id


def test_an_open_loop_checkpointer_costs_the_same_for_few_and_many_tensors(spy, tmp_path) -> None:
    """Both kinds of save: the keyframe (every entry exact: grouped copies) and a delta."""
    counts = []
    for n in (FEW, MANY):
        state = make_state(n, seed=n)
        per_save = []
        with Checkpointer(
            tmp_path / str(n), async_write=False, fsync=False, delta="open", rules=MIXED
        ) as ckpt:
            for step in (0, 1):
                spy.ops.clear()
                spy.kernels.clear()
                with spy:
                    ckpt.save(step, model=state)
                per_save.append((spy.launches(), spy.syncs(), dict(spy.kernels)))
                for t in state.values():
                    if t.is_floating_point():
                        t.add_(0.01)
            loaded = ckpt.load(1)["model"]
        counts.append(per_save)
        # The weights' deltas decode close (the bytes are the per-tensor path's: above).
        for path, t in state.items():
            if path.endswith("weight"):
                assert torch.allclose(loaded[path].float(), t.float() - 0.01, atol=0.05), path
    assert counts[0] == counts[1], counts
    keyframe, delta = counts[1]
    # The keyframe stores the delta-coded entries exact (copies); log2 codes the moments.
    # Its weights of 5000 elements are sparse candidates: counted in one grouped op (two
    # widths), and copied after the host read (dense), in one grouped copy.
    assert keyframe[2] == {
        "copy_grouped_kernel": 4,
        "quantize_log2_grouped_kernel": 4,
        "sparsity_counts_grouped_kernel": 4,
    }
    assert keyframe[1] == 1
    assert delta[1] == 1


def closed_loop_saves(root, n: int, spy: LaunchSpy | None) -> tuple[list, dict[str, torch.Tensor]]:
    """A keyframe and two closed-loop deltas of ``make_state(n)``: the counts of each save
    (when spied) and what the last one loads to."""
    state = make_state(n, seed=n)
    per_save = []
    with Checkpointer(root, async_write=False, fsync=False, delta="closed", rules=MIXED) as ckpt:
        for step in (0, 1, 2):
            if spy is not None:
                spy.ops.clear()
                spy.kernels.clear()
                with spy:
                    ckpt.save(step, model=state)
                per_save.append((spy.launches(), spy.syncs(), dict(spy.kernels)))
            else:
                ckpt.save(step, model=state)
            for t in state.values():
                if t.is_floating_point():
                    t.add_(0.01)
        loaded = ckpt.load(2)["model"]
    return per_save, loaded


def test_a_closed_loop_delta_advances_its_reference_in_grouped_launches(spy, tmp_path, monkeypatch) -> None:
    small, _ = closed_loop_saves(tmp_path / "few", FEW, spy)
    large, loaded = closed_loop_saves(tmp_path / "many", MANY, spy)
    assert small == large, (small, large)
    for _, syncs, kernels in large[1:]:
        assert syncs == 1
        # The deltas decoded to advance the reference: two dtypes, at most two launches each.
        assert 1 <= kernels["dequantize_blockwise_grouped_kernel"] <= 4
    # The same files and reconstructions as the per-tensor path.
    monkeypatch.setattr(encode_module, "groups_launches", lambda device: False)
    monkeypatch.setattr(deltas, "groups_launches", lambda device: False)
    _, alone = closed_loop_saves(tmp_path / "alone", MANY, None)
    assert loaded.keys() == alone.keys()
    for path, t in alone.items():
        assert torch.equal(loaded[path].view(torch.uint8), t.view(torch.uint8)), path


# The default preset ("smallest"): 2-bit weight deltas whose bits follow their change
# (max_error), exp_avg int4, and between keyframes every float32 exp_avg_sq of at least
# 4096 elements as a log2-temporal change against its reference.
DEFAULT = "smallest"


def make_training_state(n: int, seed: int) -> dict:
    """A model of ``n`` weights (two dtypes) and its AdamW state: sizes with a whole tile
    only, whole tiles and a tail, among the first four, and the rest all different."""
    gen = torch.Generator().manual_seed(seed)
    model, state = {}, {}
    for i in range(n):
        size = (4096, 2 * 4096 + 100, 5000, 4200)[i] if i < 4 else 4096 + 16 * (i % 50) + 3
        model[f"layer{i}.weight"] = torch.randn(size, generator=gen).to(
            torch.bfloat16 if i % 2 else torch.float32
        )
        state[i] = {
            "step": torch.tensor(float(i + 1)),
            "exp_avg": 1e-3 * torch.randn(size, generator=gen),
            "exp_avg_sq": 1e-6 * torch.randn(size, generator=gen).square(),
        }
    return {
        "model": model,
        "optimizer": {"state": state, "param_groups": [{"params": list(range(n)), "lr": 1e-3}]},
    }


def moved(state):
    """``state`` some steps later: weights moved, second moments drifted."""
    if isinstance(state, dict):
        return {k: moved(v) for k, v in state.items()}
    if isinstance(state, list):
        return [moved(v) for v in state]
    if isinstance(state, torch.Tensor) and state.is_floating_point() and state.numel() > 1:
        return state * 1.001 if bool((state >= 0).all()) else state + 0.01
    return state


def count_bits_choice(spy: LaunchSpy, monkeypatch) -> None:
    """The weights' ``max_error`` bits choice (tw_triton.delta_bits.adapt) counts as one
    call: inside, each weight's statistics still cost a few operations (not counted here),
    read back with one transfer (counted: a sync)."""
    monkeypatch.setattr(
        encode_module, "adapt_delta_bits", spy.counted("bits choice", encode_module.adapt_delta_bits)
    )


def counted_default_save(spy: LaunchSpy, n: int):
    """A delta save of the default preset, counted as :func:`counted_save` does."""
    ref = make_training_state(n, seed=n)
    state = moved(ref)
    spy.ops.clear()
    spy.kernels.clear()
    with spy:
        q = quantize_state_dict(state, reference=ref, rules=DEFAULT)
    return q, (spy.launches(), spy.syncs(), dict(spy.kernels), dict(spy.ops))


def test_a_delta_save_of_the_default_preset_codes_its_moments_in_launches_independent_of_their_count(
    spy, monkeypatch
) -> None:
    count_bits_choice(spy, monkeypatch)
    q, small = counted_default_save(spy, FEW)
    assert sum(e.codec == "log2-temporal" for e in q.entries.values()) == FEW
    _, large = counted_default_save(spy, MANY)
    assert small == large, f"{FEW} tensors: {small}\n{MANY} tensors: {large}"
    _, syncs, kernels, torch_ops = large
    assert kernels["quantize_log2_temporal_grouped_kernel"] <= 2  # one dtype: whole tiles, tails
    assert kernels["quantize_blockwise_grouped_kernel"] <= 4  # the weights' deltas, 2 dtypes
    # exp_avg in the update's domain: its partners (the temporal deltas) decoded, then coded.
    assert kernels["dequantize_log2_temporal_grouped_kernel"] <= 2
    assert kernels["quantize_blockwise_update_grouped_kernel"] <= 2
    assert "quantize_log2_temporal" not in kernels and "quantize_blockwise" not in kernels
    assert kernels["fingerprint_kernel"] == 2  # the references of two dtypes
    assert kernels["bits choice"] == 1
    # The flags' zero-fill of each phase, the second's flags stacked and joined to the
    # first's for the one read; the bits choice's read and the save's one read.
    assert torch_ops == {
        "aten.zeros.default": 2,
        "aten.stack.default": 1,
        "aten.cat.default": 1,
        "to_host": 2,
    }
    assert syncs == 2


def test_the_default_presets_grouped_path_gives_the_bytes_of_the_per_tensor_path(spy, monkeypatch) -> None:
    ref = make_training_state(12, seed=3)
    state = moved(ref)
    moments = state["optimizer"]["state"]
    moments[1]["exp_avg_sq"][7] = float("nan")  # stored exact, as on the per-tensor path
    moments[2]["exp_avg_sq"][4095] = -1.0  # likewise: log2 codes no negative value
    ref["optimizer"]["state"][3]["exp_avg_sq"][100] = 0.0  # a zero turned positive: an absolute block
    del ref["optimizer"]["state"][4]["exp_avg_sq"]  # no reference: coded against zeros, alone
    ref["optimizer"]["state"][5]["exp_avg_sq"] = ref["optimizer"]["state"][5]["exp_avg_sq"][
        :-1
    ]  # another shape
    grouped = quantize_state_dict(state, reference=ref, rules=DEFAULT)
    assert spy.kernels["quantize_log2_temporal_grouped_kernel"] >= 1
    monkeypatch.setattr(encode_module, "groups_launches", lambda device: False)
    alone = quantize_state_dict(state, reference=ref, rules=DEFAULT)
    entries = grouped.entries
    assert entries.keys() == alone.entries.keys()
    assert entries["optimizer/state/1/exp_avg_sq"].codec == "exact"
    assert entries["optimizer/state/2/exp_avg_sq"].codec == "exact"
    absolute = entries["optimizer/state/3/exp_avg_sq"]
    assert absolute.codec == "log2-temporal" and absolute.buffers["codes"][:4].view(torch.int32).item() > 0
    assert entries["optimizer/state/4/exp_avg_sq"].params["delta"] is False
    assert entries["optimizer/state/5/exp_avg_sq"].params["delta"] is False
    assert entries["optimizer/state/6/exp_avg_sq"].params["delta"] is True
    for path, entry in alone.entries.items():
        other = entries[path]
        assert (other.codec, other.params) == (entry.codec, entry.params), path
        for name, buf in entry.buffers.items():
            got, want = (b.reshape(-1).view(torch.uint8) for b in (other.buffers[name], buf))
            assert torch.equal(got, want), (path, name)
    assert grouped.reference_id == alone.reference_id


def test_an_open_loop_checkpointer_of_the_default_preset_costs_the_same_for_few_and_many_tensors(
    spy, tmp_path, monkeypatch
) -> None:
    """Its keyframe (log2 moments, weights exact) and its first delta (log2-temporal
    moments): the same grouped kernels and syncs whatever the number of tensors, and the
    delta loads back to the per-tensor path's values."""
    count_bits_choice(spy, monkeypatch)
    counts = []
    for n in (FEW, MANY):
        state = make_training_state(n, seed=n)
        per_save = []
        with Checkpointer(tmp_path / str(n), async_write=False, fsync=False, delta="open") as ckpt:
            for step in (0, 1):
                spy.ops.clear()
                spy.kernels.clear()
                with spy:
                    ckpt.save(step, **state)
                kernels = dict(spy.kernels)
                # No moment decoded alone: the keyframe's log2 moments are decoded to the
                # reference the temporal deltas are coded against in grouped launches.
                assert "dequantize_log2" not in kernels
                per_save.append((spy.syncs(), kernels))
                state = moved(state)
            loaded = ckpt.load(1)
        counts.append(per_save)
    assert counts[0] == counts[1], counts
    keyframe, delta = counts[1]
    assert "quantize_log2_grouped_kernel" in keyframe[1]
    # float32 moments, whole tiles and tails: decoded as exp_avg's partners, then to the reference.
    assert 1 <= keyframe[1]["dequantize_log2_grouped_kernel"] <= 4
    assert delta[1]["quantize_log2_temporal_grouped_kernel"] <= 2
    assert "quantize_log2_temporal" not in delta[1]
    monkeypatch.setattr(encode_module, "groups_launches", lambda device: False)
    monkeypatch.setattr(deltas, "groups_launches", lambda device: False)
    state = make_training_state(MANY, seed=MANY)
    with Checkpointer(tmp_path / "alone", async_write=False, fsync=False, delta="open") as ckpt:
        ckpt.save(0, **state)
        ckpt.save(1, **moved(state))
        alone = ckpt.load(1)
    for i, moments in alone["optimizer"]["state"].items():
        got = loaded["optimizer"]["state"][i]["exp_avg_sq"]
        assert torch.equal(got.view(torch.int32), moments["exp_avg_sq"].view(torch.int32)), i


def closed_loop_keyframe(root, n: int, spy: LaunchSpy | None) -> tuple:
    """The counts of a closed-loop keyframe of the default preset over
    ``make_training_state(n)`` (when spied) and the reference it leaves, by path."""
    state = make_training_state(n, seed=n)
    with Checkpointer(root, async_write=False, fsync=False, delta="closed") as ckpt:
        with spy if spy is not None else contextlib.nullcontext():
            ckpt.save(0, **state)
        counts = None if spy is None else (spy.launches(), spy.syncs(), dict(spy.kernels))
        reference, _ = flatten(ckpt._chain.reference.tree)
    return counts, reference


def test_a_closed_loop_keyframe_of_the_default_preset_decodes_its_moments_in_grouped_launches(
    spy, tmp_path, monkeypatch
) -> None:
    """The keyframe's log2 moments, decoded to the reference the next deltas are coded
    against (deltas.keyframe_values): the same launches and syncs for ``FEW`` and ``MANY`` tensors,
    no moment decoded alone, and the reference bit for bit the per-tensor path's."""
    count_bits_choice(spy, monkeypatch)
    counts, references = [], []
    for n in (FEW, MANY):
        spy.ops.clear()
        spy.kernels.clear()
        got, reference = closed_loop_keyframe(tmp_path / str(n), n, spy)
        counts.append(got)
        references.append(reference)
    assert counts[0] == counts[1], counts
    _, _, kernels = counts[1]
    assert "dequantize_log2" not in kernels
    # float32 moments, whole tiles and tails: decoded as exp_avg's partners, then to the reference.
    assert 1 <= kernels["dequantize_log2_grouped_kernel"] <= 4
    moments = [p for p in references[1] if p.endswith("exp_avg_sq")]
    assert len(moments) == MANY
    monkeypatch.setattr(encode_module, "groups_launches", lambda device: False)
    monkeypatch.setattr(deltas, "groups_launches", lambda device: False)
    _, alone = closed_loop_keyframe(tmp_path / "alone", MANY, None)
    assert alone.keys() == references[1].keys()
    for path, t in alone.items():
        assert torch.equal(references[1][path].view(torch.uint8), t.view(torch.uint8)), path


def default_delta_reference(n: int) -> tuple:
    """A delta of the default preset and the closed-loop reference it was coded against (a
    copy of the delta-coded tensors, owned by nothing else, as after the first advance).
    Encoded on the grouped path, as on a device: its temporal codes start on 16 bytes, which
    the per-tensor path's need not (the advance would copy them)."""
    ref_state = make_training_state(n, seed=n)
    q = quantize_state_dict(moved(ref_state), reference=ref_state, rules=DEFAULT)
    flat, _ = flatten(ref_state)
    coded = {p: flat[p].clone() for p, e in q.entries.items() if get_codec(e.codec).uses_reference(e.params)}
    done: Future = Future()
    done.set_result(None)
    reference = deltas.make_reference("k", coded, 0, done, closed=True)
    reference.owned = True
    return q, reference


def test_a_closed_loop_advance_of_the_default_preset_is_grouped_and_in_place(spy, monkeypatch) -> None:
    """The advance after a default-preset delta (weights' blockwise deltas, second moments'
    log2-temporal changes): the same grouped launches for ``FEW`` and ``MANY`` tensors, no host read
    at all (the temporal codes are the encoder's own: no per-tensor check), each reference
    tensor decoded over itself, to the bits of the per-tensor path."""
    # The corrupt-code check as CUDA runs it (the torch reference: its verdict is read back
    # to the host), not the CPU's compiled codec, which the spy does not see.
    counts, advanced = [], []
    with ops.using("log2_temporal_code_errors", "cpu", log2_temporal_code_errors_torch):
        for n in (FEW, MANY):
            q, reference = default_delta_reference(n)
            before, _ = flatten(reference.tree)
            assert sum(q.entries[p].codec == "log2-temporal" for p in before) == n
            spy.ops.clear()
            spy.kernels.clear()
            with spy:
                deltas.advance(reference, q)
            counts.append((spy.launches(), spy.syncs(), dict(spy.kernels)))
            after, _ = flatten(reference.tree)
            assert all(after[p].data_ptr() == t.data_ptr() for p, t in before.items()), "a second copy"
            advanced.append((q, after))
    assert counts[0] == counts[1], counts
    _, syncs, kernels = counts[1]
    assert syncs == 0
    assert kernels["dequantize_log2_temporal_grouped_kernel"] <= 2  # whole tiles, tails
    assert "dequantize_log2_temporal" not in kernels  # no moment decoded alone
    assert 1 <= kernels["dequantize_blockwise_grouped_kernel"]
    # The per-tensor path (host worker threads, the checked single decode) gives the same.
    monkeypatch.setattr(deltas, "groups_launches", lambda device: False)
    q, reference = default_delta_reference(MANY)
    deltas.advance(reference, q)
    alone, _ = flatten(reference.tree)
    assert alone.keys() == advanced[1][1].keys()
    for path, t in alone.items():
        assert torch.equal(advanced[1][1][path].view(torch.uint8), t.view(torch.uint8)), path


def spread(state: dict, seed: int) -> dict:
    """``moved(state)`` with weight ``i`` moved by 0.1 %, 3 % or 30 % of its scale (by
    ``i % 3``): the ``max_error`` bits choice gives them 2, 4 and 8 bits."""
    gen = torch.Generator().manual_seed(seed)
    later = moved(state)
    for i, (name, w) in enumerate(state["model"].items()):
        step = (0.001, 0.03, 0.3)[i % 3] * torch.randn(w.shape, generator=gen)
        later["model"][name] = (w.float() + step).to(w.dtype)
    return later


def counted_closed_loop_delta(root, n: int, spy: LaunchSpy, monkeypatch) -> tuple:
    """The counts of the first closed-loop delta of the default preset over
    ``make_training_state(n)`` (its bits choice counted launch by launch), and its entries."""
    state = make_training_state(n, seed=n)
    with Checkpointer(root, async_write=False, fsync=False, delta="closed") as ckpt:
        with per_tensor_path(monkeypatch):
            ckpt.save(0, **state)
        later = spread(state, n)
        spy.ops.clear()
        spy.kernels.clear()
        with spy:
            ckpt.save(1, **later)
        counts = (spy.launches(), spy.syncs(), dict(spy.kernels), dict(spy.ops))
    return counts


def test_a_closed_loop_delta_of_the_default_preset_chooses_its_bits_in_grouped_launches(
    spy, tmp_path, monkeypatch
) -> None:
    """The weights' ``max_error`` statistics (ops.delta_statistics_many) are counted here
    launch by launch, not as one call: the same launches and syncs for ``FEW`` and ``MANY`` weights,
    the weights' encode included (one group per container and dtype pair, whatever the
    ``qmax`` chosen in it: a column of the kernel's table), two syncs in all (the bits
    choice's read, then the save's), no weight's statistics computed alone."""
    small = counted_closed_loop_delta(tmp_path / "few", FEW, spy, monkeypatch)
    large = counted_closed_loop_delta(tmp_path / "many", MANY, spy, monkeypatch)
    assert small == large, f"{FEW} tensors: {small}\n{MANY} tensors: {large}"
    _, syncs, kernels, torch_ops = large
    # Two dtype pairs (float32 and bfloat16 weights against references of their dtype):
    # the maxima, then the sums, each in whole tiles and tails.
    assert kernels["delta_statistics_grouped_kernel"] == 8
    assert "delta_statistics" not in kernels
    # Weights in the three containers (2, 4 and 8 bits, at several qmax each), two dtypes:
    # whole tiles and tails, two launches each.
    assert kernels["quantize_blockwise_grouped_kernel"] == 3 * 2 * 2
    # The statistics', the flags' and exp_avg's (in the update's domain) zero-fills, the
    # last flags stacked and joined to the others; the bits choice's read and the save's.
    assert torch_ops == {
        "aten.zeros.default": 3,
        "aten.stack.default": 1,
        "aten.cat.default": 1,
        "to_host": 2,
    }
    assert syncs == 2


def test_the_grouped_bits_choice_gives_the_bytes_of_the_per_tensor_path(spy, monkeypatch) -> None:
    """The default preset's delta of weights that take 2, 4 and 8 bits, a NaN, values below
    ``delta_bits.TINY`` and an unchanged weight among them: the grouped statistics choose
    each weight's bits as the per-tensor statistics do, to the byte."""
    ref = make_training_state(14, seed=7)
    state = spread(ref, 7)
    weights = state["model"]
    weights["layer4.weight"][9] = float("nan")  # the widest bits, then stored exact
    weights["layer5.weight"] = torch.full_like(weights["layer5.weight"], 1e-39)  # the widest
    ref["model"]["layer5.weight"] = torch.zeros_like(weights["layer5.weight"])
    weights["layer6.weight"] = ref["model"]["layer6.weight"].clone()  # no change: the rule's bits
    grouped = quantize_state_dict(state, reference=ref, rules=DEFAULT)
    assert spy.kernels["delta_statistics_grouped_kernel"] >= 4
    monkeypatch.setattr(encode_module, "groups_launches", lambda device: False)
    alone = quantize_state_dict(state, reference=ref, rules=DEFAULT)
    entries = grouped.entries
    assert entries.keys() == alone.entries.keys()
    bits = {
        int(p.split("layer")[1].split(".")[0]): e.params.get("bits")
        for p, e in entries.items()
        if "model/" in p
    }
    assert {bits[i] for i in range(14)} == {2, 4, 8, None}  # None: the NaN weight, stored exact
    assert entries["model/layer4.weight"].codec == "exact"
    assert bits[5] == 8 and bits[6] == 2
    for path, entry in alone.entries.items():
        other = entries[path]
        assert (other.codec, other.params) == (entry.codec, entry.params), path
        for name, buf in entry.buffers.items():
            got, want = (b.reshape(-1).view(torch.uint8) for b in (other.buffers[name], buf))
            assert torch.equal(got, want), (path, name)
    assert grouped.reference_id == alone.reference_id


# A keyframe's rules: every float tensor exact but the second moments (log2).
KEYFRAME = [("*exp_avg_sq", {"codec": "log2", "bits": 4, "block": 64}), ("*", "exact")]


def keyframe_state(n: int, seed: int) -> dict[str, torch.Tensor]:
    """``n`` exact float tensors of at least 4096 elements (sparse candidates): among the
    first eight, sparse ones (half zeros, stored by bitmask) and dense ones of both widths,
    with a tail and without, beside a small exact tensor and a second moment each; the
    others dense and of whole tiles (so that ``FEW`` and ``MANY`` hold the same kinds and the same
    sparse tensors)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        if i < 8:
            out[f"layer{i}.bias"] = torch.randn(1100 + 3 * i, generator=gen)
            out[f"layer{i}.exp_avg_sq"] = torch.rand(5000, generator=gen)
        dtype = torch.bfloat16 if i % 2 else torch.float32
        x = torch.randn(4096 + (i % 3) * 37 if i < 8 else 4096, generator=gen)
        if i < 8 and i % 4 < 2:
            x[torch.rand(x.shape, generator=gen) < 0.5] = 0.0
        out[f"layer{i}.kernel"] = x.to(dtype)
    return out


@pytest.mark.parametrize("copy", [True, False])
def test_a_keyframe_counts_its_sparse_candidates_in_grouped_launches(spy, monkeypatch, copy) -> None:
    """Exact float tensors of >= 4096 elements are sparse candidates: their counts join the
    one host read through one grouped op, and the dense ones are copied (``copy``) in one
    grouped copy after it, whatever their number; the files are the per-tensor path's."""
    counts, saved = [], []
    for n in (FEW, MANY):
        state = keyframe_state(n, seed=n)
        spy.ops.clear()
        spy.kernels.clear()
        with spy:
            q = quantize_state_dict({"model": state}, rules=KEYFRAME, copy=copy)
        counts.append((spy.launches(), spy.syncs(), dict(spy.kernels)))
        saved.append((state, q))
    assert counts[0] == counts[1], counts
    launches, syncs, kernels = counts[1]
    assert syncs == 1
    # Two widths, each with whole tiles and tails: at most two launches each.
    assert kernels["sparsity_counts_grouped_kernel"] == 4
    # With copy: the small exact tensors before the host read, the dense candidates after
    # (without, both are stored as they are).
    assert kernels.get("copy_grouped_kernel", 0) == (4 if copy else 0), kernels
    state, grouped = saved[1]
    codecs = {p.removeprefix("model/"): e.codec for p, e in grouped.entries.items()}
    assert {p for p, c in codecs.items() if c == "bitmask"} == {f"layer{i}.kernel" for i in (0, 1, 4, 5)}
    monkeypatch.setattr(encode_module, "groups_launches", lambda device: False)
    alone = quantize_state_dict({"model": state}, rules=KEYFRAME, copy=copy)
    assert list(grouped.entries) == list(alone.entries)
    for path, entry in alone.entries.items():
        other = grouped.entries[path]
        assert (other.codec, other.params, other.shape) == (entry.codec, entry.params, entry.shape), path
        for name, buf in entry.buffers.items():
            got, want = (b.reshape(-1).view(torch.uint8) for b in (other.buffers[name], buf))
            assert torch.equal(got, want), (path, name)


def sparse_keyframe_state(n: int, seed: int) -> dict[str, torch.Tensor]:
    """``n`` sparse exact float tensors (about half their elements zero, scattered: each is
    stored by bitmask) of both widths, whole tiles only and with a tail among the first
    four, beside a dense candidate and a small exact tensor each among the first four."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        dtype = (torch.float32, torch.bfloat16, torch.float16)[i % 3]
        x = torch.randn(4096 + (i % 2) * 37 if i < 4 else 4096 + 16 * (i % 4), generator=gen)
        x[torch.rand(x.shape, generator=gen) < 0.5] = 0.0
        x[:2] = torch.tensor([-0.0, float("nan")])  # values, not zeros
        out[f"layer{i}.kernel"] = x.to(dtype)
        if i < 4:
            out[f"layer{i}.dense"] = torch.randn(4096 + 5 * i, generator=gen).to(dtype)
            out[f"layer{i}.bias"] = torch.randn(300 + i, generator=gen)
    return out


@pytest.mark.parametrize("copy", [True, False])
def test_a_keyframe_encodes_its_sparse_tensors_in_grouped_launches(spy, monkeypatch, copy) -> None:
    """The candidates that pay are encoded together after the one host read (mask pass,
    scan, scatter per element width): ``FEW`` and ``MANY`` sparse tensors cost the same launches and
    syncs, none is encoded alone, and the entries are the per-tensor path's bytes."""
    counts, saved = [], []
    for n in (FEW, MANY):
        state = sparse_keyframe_state(n, seed=n)
        spy.ops.clear()
        spy.kernels.clear()
        with spy:
            q = quantize_state_dict({"model": state}, rules=KEYFRAME, copy=copy)
        counts.append((spy.launches(), spy.syncs(), dict(spy.kernels), dict(spy.ops)))
        saved.append((state, q))
        assert sum(e.codec == "bitmask" for e in q.entries.values()) == n
    assert counts[0] == counts[1], counts
    _, syncs, kernels, _ = counts[1]
    assert syncs == 1
    assert "bitmask_encode" not in kernels, kernels  # no candidate encoded alone
    # Two widths, each with whole tiles and tails: at most two launches a pass each.
    assert kernels["bitmask_mask_grouped_kernel"] == 4
    assert kernels["bitmask_scatter_grouped_kernel"] == 4
    state, grouped = saved[1]
    monkeypatch.setattr(encode_module, "groups_launches", lambda device: False)
    alone = quantize_state_dict({"model": state}, rules=KEYFRAME, copy=copy)
    assert list(grouped.entries) == list(alone.entries)
    for path, entry in alone.entries.items():
        other = grouped.entries[path]
        assert (other.codec, other.params, other.shape) == (entry.codec, entry.params, entry.shape), path
        for name, buf in entry.buffers.items():
            got, want = (b.reshape(-1).view(torch.uint8) for b in (other.buffers[name], buf))
            assert torch.equal(got, want), (path, name)


def update_rules() -> list:
    """``smallest``'s rules with ``exp_avg`` coded in the update's domain at 3 bits."""
    z = torch.zeros(64, 64)
    template = {"model": {"w": z}, "optimizer": {"state": {0: {"exp_avg": z, "exp_avg_sq": z}}}}
    spec = {"codec": "blockwise-update", "bits": 3}
    return [("*exp_avg", spec), *rules_as_specs(resolve_rules(DEFAULT, template, bits=8, block=128))]


def counted_update_save(spy: LaunchSpy, n: int):
    ref = make_training_state(n, seed=n)
    state = moved(ref)
    rules = update_rules()
    spy.ops.clear()
    spy.kernels.clear()
    with spy:
        q = quantize_state_dict(state, reference=ref, rules=rules)
    return q, (spy.launches(), spy.syncs(), dict(spy.kernels), dict(spy.ops))


def test_a_delta_save_with_blockwise_update_codes_its_first_moments_in_grouped_launches(
    spy, monkeypatch
) -> None:
    count_bits_choice(spy, monkeypatch)
    q, small = counted_update_save(spy, FEW)
    assert sum(e.codec == "blockwise-update" for e in q.entries.values()) == FEW
    _, large = counted_update_save(spy, MANY)
    assert small == large, f"{FEW} tensors: {small}\n{MANY} tensors: {large}"
    _, syncs, kernels, torch_ops = large
    assert kernels["quantize_blockwise_update_grouped_kernel"] <= 2  # one dtype: whole tiles, tails
    assert kernels["dequantize_log2_temporal_grouped_kernel"] <= 2  # the partners' decode
    assert "dequantize_log2_temporal" not in kernels and "quantize_blockwise" not in kernels
    # The flags' zero-fill of each phase and the stack of phase two's flags, joined to the
    # first's; the bits choice's read and the save's one read (phase two's flags join it).
    assert torch_ops == {
        "aten.zeros.default": 2,
        "aten.stack.default": 1,
        "aten.cat.default": 1,
        "to_host": 2,
    }
    assert syncs == 2


def test_the_grouped_update_encode_gives_the_bytes_of_the_per_tensor_path(spy, monkeypatch) -> None:
    ref = make_training_state(12, seed=5)
    state = moved(ref)
    moments = state["optimizer"]["state"]
    moments[1]["exp_avg"][7] = float("nan")  # stored exact, as on the per-tensor path
    moments[2]["exp_avg_sq"][4095] = float("inf")  # its partner exact: u = 0, flagged, exact
    grouped = quantize_state_dict(state, reference=ref, rules=update_rules())
    assert spy.kernels["quantize_blockwise_update_grouped_kernel"] >= 1
    monkeypatch.setattr(encode_module, "groups_launches", lambda device: False)
    alone = quantize_state_dict(state, reference=ref, rules=update_rules())
    entries = grouped.entries
    assert entries.keys() == alone.entries.keys()
    assert entries["optimizer/state/1/exp_avg"].codec == "exact"
    assert entries["optimizer/state/2/exp_avg"].codec == "exact"
    assert entries["optimizer/state/3/exp_avg"].codec == "blockwise-update"
    for path, entry in alone.entries.items():
        other = entries[path]
        assert (other.codec, other.params) == (entry.codec, entry.params), path
        for name, buf in entry.buffers.items():
            got, want = (b.reshape(-1).view(torch.uint8) for b in (other.buffers[name], buf))
            assert torch.equal(got, want), (path, name)


def counted_update_load(n: int, path, phases: list, monkeypatch) -> tuple:
    """A file of the update rules' keyframe of ``make_training_state(n)``, loaded with the
    device decode forced: the counts of the phase that decodes its ``blockwise-update``
    entries (after their partners; recorded into ``phases``), and the loaded state."""
    with per_tensor_path(monkeypatch):
        q = quantize_state_dict(make_training_state(n, seed=n), rules=update_rules())
    assert sum(e.codec == "blockwise-update" for e in q.entries.values()) == n
    tw_triton.save(q, path, fsync=False)
    del phases[:]
    loaded = tw_triton.load(path)
    assert len(phases) == 1, phases
    return phases[0], loaded


def test_a_load_decodes_its_blockwise_update_entries_in_grouped_launches(spy, monkeypatch, tmp_path) -> None:
    """Loading to a device a file with N ``blockwise-update`` entries: after their
    partners, the same launches for ``FEW`` and ``MANY`` entries (one grouped decode, none alone),
    no host read, and the per-tensor path's values bit for bit."""
    real = decode_module.decode_grouped_with_partners
    phases: list = []

    def counted(*args, **kwargs):  # the phase of the entries coded with a partner
        spy.ops.clear()
        spy.kernels.clear()
        with spy:
            result = real(*args, **kwargs)
        phases.append((spy.launches(), spy.syncs(), dict(spy.kernels), dict(spy.ops)))
        return result

    monkeypatch.setattr(decode_module, "decode_grouped_with_partners", counted)
    monkeypatch.setattr(decode_module, "groups_launches", lambda device: True)
    small, _ = counted_update_load(FEW, tmp_path / "few.tw", phases, monkeypatch)
    large, loaded = counted_update_load(MANY, tmp_path / "many.tw", phases, monkeypatch)
    assert small == large, f"{FEW} entries: {small}\n{MANY} entries: {large}"
    launches, syncs, kernels, _ = large
    assert syncs == 0
    assert kernels == {"dequantize_blockwise_update_grouped_kernel": 2}  # float32: tiles, tails
    monkeypatch.setattr(decode_module, "groups_launches", lambda device: False)
    alone = tw_triton.load(tmp_path / "many.tw")
    assert not phases[1:], "the per-tensor path decoded in groups"
    for i, moments in alone["optimizer"]["state"].items():
        got = loaded["optimizer"]["state"][i]["exp_avg"]
        assert torch.equal(got.view(torch.int32), moments["exp_avg"].view(torch.int32)), i


def chain_load(spy: LaunchSpy, monkeypatch, root, n: int, links: int) -> tuple:
    """Saves of the default preset's training state of ``n`` weights, a keyframe then
    ``links`` closed-loop deltas; the counts of loading the newest (the whole chain)."""
    state = make_training_state(n, seed=n)
    with Checkpointer(root, async_write=False, fsync=False) as ckpt:
        with per_tensor_path(monkeypatch):
            for step in range(links + 1):
                ckpt.save(step, model=state["model"], optimizer=state["optimizer"])
                state = moved(state)
        spy.ops.clear()
        spy.kernels.clear()
        with spy:
            loaded = ckpt.load(links)
    # The one operation per tensor left: a copy of the temporal codes that do not start on
    # 16 bytes (after two int32 bounds per block: an odd count of blocks), for the kernel.
    copies = spy.ops["aten.clone.default"]
    return (spy.launches() - copies, spy.syncs(), dict(spy.kernels)), loaded


def test_a_chain_load_on_a_device_decodes_each_link_in_grouped_launches(spy, monkeypatch, tmp_path) -> None:
    """Loading a delta two links past its keyframe to a device: the same launches and host
    reads for ``FEW`` and ``MANY`` weights (each link: one read of the references' fingerprints, one of
    the flags of its second moments' code check), but for a copy of the temporal codes that
    do not start on 16 bytes, and the values of the per-tensor path bit for bit."""
    monkeypatch.setattr(decode_module, "groups_launches", lambda device: True)
    small, _ = chain_load(spy, monkeypatch, tmp_path / "few", FEW, links=2)
    large, loaded = chain_load(spy, monkeypatch, tmp_path / "many", MANY, links=2)
    assert small == large, f"{FEW} weights: {small}\n{MANY} weights: {large}"
    _, syncs, kernels = large
    assert syncs == 2 * 2
    assert kernels["log2_temporal_check_grouped_kernel"] == 2 * 2  # per link: tiles, tails
    assert "dequantize_log2_temporal" not in kernels and "dequantize_blockwise" not in kernels
    assert kernels["dequantize_log2_temporal_grouped_kernel"] == 2 * 2  # per link: tiles, tails
    assert kernels["dequantize_blockwise_grouped_kernel"] <= 2 * 4  # per link: two dtypes
    assert kernels["fingerprint_kernel"] == 2 * 2  # per link: the weights' two dtypes
    monkeypatch.setattr(decode_module, "groups_launches", lambda device: False)
    with Checkpointer(tmp_path / "many", async_write=False, fsync=False) as ckpt:
        alone = flatten(ckpt.load(2))[0]
    for path, t in flatten(loaded)[0].items():
        assert torch.equal(t.reshape(-1).view(torch.uint8), alone[path].reshape(-1).view(torch.uint8)), path


def test_a_corrupt_second_moment_in_a_grouped_load_is_named(spy, monkeypatch, tmp_path) -> None:
    """A temporal code that no encoder writes, in one tensor of a grouped load: refused
    before anything is decoded, naming the entry, as on the per-tensor path."""
    state = make_training_state(6, seed=4)
    with Checkpointer(tmp_path, async_write=False, fsync=False) as ckpt:
        for step in range(2):
            ckpt.save(step, model=state["model"], optimizer=state["optimizer"])
            state = moved(state)
    rq = tw_triton.format.read_file(tmp_path / "step-00000001.tw.safetensors")
    keyframe = tmp_path / "step-00000000.tw.safetensors"
    path = "optimizer/state/3/exp_avg_sq"
    assert rq.entries[path].codec == "log2-temporal"
    codes = rq.entries[path].buffers["codes"]
    codes.view(-1)[:4].copy_(torch.tensor([5, 0, 0, 0], dtype=torch.uint8))  # block 0: lo=5, hi=0
    errors = []
    for grouped in (True, False):
        monkeypatch.setattr(decode_module, "groups_launches", lambda device, g=grouped: g)
        with pytest.raises(tw_triton.CheckpointError, match="corrupt log2-temporal codes") as info:
            tw_triton.dequantize_state_dict(rq, reference=str(keyframe), device="cpu")
        errors.append(str(info.value))
    assert errors[0] == errors[1] and repr(path) in errors[0], errors
