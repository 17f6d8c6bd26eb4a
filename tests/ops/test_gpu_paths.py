"""Rules of the CUDA paths that can be checked without a GPU (docs/design.md, "Invariants").

* Kernel launches: no zero-size grid, the whole tiles unmasked plus at most one masked
  tail program, every row covered once, a 1-D grid far below CUDA's 2**31 - 1 limit even
  for tensors of 2**40 elements, and the launch made inside the tensors' device guard (a
  tensor on ``cuda:1`` while ``cuda:0`` is current).
* Host reads: a device value read on the host (``.item()``, ``bool(t)``, ``torch.equal``,
  which all sync with a GPU) never happens per tensor. The kernel wrappers read none, and
  the state API reads all its device flags with one transfer per checkpoint.

A device read is counted as a dispatch of ``aten._local_scalar_dense`` (what ``.item()``,
``bool``, ``int`` and ``float`` of a tensor run), ``aten.is_nonzero`` or ``aten.equal``. The
codecs' CPU torch path reads scalars per chunk (free on the CPU, and it never runs on a
GPU), so the state-level check pauses counting inside codec calls, which the kernel-wrapper
check covers.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tw_triton
import tw_triton.state.fingerprints as state_fingerprints
from tw_triton.codecs import codec_names, get_codec

# The modules (tw_triton.kernels re-exports functions of the same names).
tiles = importlib.import_module("tw_triton.kernels.tiles")
kq = importlib.import_module("tw_triton.kernels.quantize_blockwise")
kdeq = importlib.import_module("tw_triton.kernels.dequantize_blockwise")
kq_log2 = importlib.import_module("tw_triton.kernels.quantize_log2")
kdeq_log2 = importlib.import_module("tw_triton.kernels.dequantize_log2")

CUDA_GRID_X_MAX = 2**31 - 1
HOST_READS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.equal.default"}


class FakeKernel:
    """Stands in for a ``@triton.jit`` function: records ``kernel[grid](*args, **meta)``."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple[int, ...], tuple, dict[str, Any]]] = []

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(*args: Any, **meta: Any) -> None:
            self.launches.append((grid, args, meta))

        return launch


def covered_rows(kernel: FakeKernel, block: int) -> list[int]:
    rows = []
    for grid, args, meta in kernel.launches:
        n, row0 = args[-2], args[-1]
        for pid in range(grid[0]):
            first = row0 + pid * meta["ROWS"]
            rows += [r for r in range(first, first + meta["ROWS"]) if r * block < n]
    return rows


@pytest.mark.parametrize("block", [32, 128, 4096])
@pytest.mark.parametrize("n_tiles, extra", [(0, 0), (0, 1), (0, 4095), (1, 0), (1, 1), (3, 0), (3, 77)])
def test_launches_cover_every_row_once_without_empty_grids(block, n_tiles, extra):
    n = n_tiles * tiles.TILE_ELEMENTS + extra
    kernel = FakeKernel()
    tiles.launch_row_tiles(kernel, ("x",), n, 0, block, torch.device("cpu"))
    grids = [g for g, _, _ in kernel.launches]
    assert all(len(g) == 1 and g[0] >= 1 for g in grids), grids
    masked = [m["MASKED"] for _, _, m in kernel.launches]
    assert masked.count(True) <= 1 and masked.count(False) <= 1
    if n == 0:
        assert kernel.launches == []
    # Whole tiles unmasked (vector accesses), one masked program for the rest.
    assert masked.count(False) == (1 if n_tiles else 0)
    assert masked.count(True) == (1 if extra else 0)
    for grid, _, meta in kernel.launches:
        if meta["MASKED"]:
            assert grid == (1,)
        assert meta["enable_fp_fusion"] is False
    rows = covered_rows(kernel, block)
    assert sorted(rows) == list(range(-(-n // block))), "a row missed or launched twice"


@pytest.mark.parametrize("block", [32, 4096])
def test_grid_stays_below_the_cuda_limit_for_huge_tensors(block):
    kernel = FakeKernel()
    n = 2**40 + 5  # not allocated: the helper only computes the grid
    tiles.launch_row_tiles(kernel, ("x",), n, 0, block, torch.device("cpu"))
    (main, _, meta), (tail, _, tmeta) = kernel.launches
    assert not meta["MASKED"] and tmeta["MASKED"]
    assert main[0] * meta["ROWS"] * block + block >= n - block
    # 2**40 elements (2 TiB of bf16, past any single GPU) leave ~8x of headroom: the grid
    # is tiles of 4096 elements whatever the block.
    assert 4 * main[0] <= CUDA_GRID_X_MAX, f"grid {main} is within 4x of CUDA's limit"


def test_launch_runs_inside_the_tensors_device_guard(monkeypatch):
    """A tensor on cuda:1 while cuda:0 is current: Triton launches on the current device,
    so the helper must make the tensors' device current around the launch."""
    current: list[torch.device | None] = [None]
    seen: list[torch.device | None] = []

    @contextlib.contextmanager
    def fake_guard(device):
        previous, current[0] = current[0], torch.device(device)
        try:
            yield
        finally:
            current[0] = previous

    class RecordingKernel(FakeKernel):
        def __getitem__(self, grid):
            seen.append(current[0])
            return super().__getitem__(grid)

    monkeypatch.setattr(torch.cuda, "device", fake_guard)
    kernel = RecordingKernel()
    tiles.launch_row_tiles(kernel, ("x",), 3 * tiles.TILE_ELEMENTS + 1, 0, 128, torch.device("cuda", 1))
    assert seen == [torch.device("cuda", 1)] * 2
    assert current[0] is None  # the guard is left afterwards


class HostReads(TorchDispatchMode):
    """Counts device-to-host reads of tensor values, except while paused."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.where: list[str] = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and str(func) in HOST_READS:
            self.count += 1
            import traceback

            self.where.append("".join(traceback.format_stack(limit=6)[:-1]))
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def _paused(reads: HostReads, fn):
    def wrapper(*args, **kwargs):
        with reads.pause():
            return fn(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("numel", [0, 1, 4096 * 3 + 5])
def test_kernel_wrappers_read_nothing_back_and_skip_empty_launches(monkeypatch, numel):
    reads = HostReads()
    launches = []
    real = tiles.launch_row_tiles

    def counted(*args, **kwargs):
        launches.append(args[2])
        with reads.pause():  # the interpreter itself is no part of the GPU path
            return real(*args, **kwargs)

    for mod in (kq, kdeq, kq_log2, kdeq_log2):
        monkeypatch.setattr(mod, "launch_row_tiles", counted)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=gen).to(torch.bfloat16)
    with reads:
        codes, scales = kq.quantize_blockwise(x, x, 4, 128)
        out = kdeq.dequantize_blockwise(codes, scales, numel, 4, 128, x, torch.bfloat16)
        lcodes, lo, hi = kq_log2.quantize_log2(x.abs(), 8, 64)
        lout = kdeq_log2.dequantize_log2(lcodes, lo, hi, numel, 8, 64, torch.bfloat16)
    assert reads.count == 0, reads.where
    assert launches == ([] if numel == 0 else [numel] * 4)
    assert out.shape == lout.shape == (numel,)
    if numel:
        want_c, want_s = tw_triton.codecs.blockwise.quantize_blockwise_torch(x, x, 4, 128)
        assert torch.equal(codes, want_c) and torch.equal(scales, want_s)


def _training_state(n_layers: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    model = {f"layer{i}.weight": torch.randn(64, 96, generator=gen) for i in range(n_layers)}
    model |= {f"layer{i}.bias": torch.randn(96, generator=gen) for i in range(n_layers)}
    opt_state = {
        i: {
            "step": torch.tensor(3.0),
            "exp_avg": torch.randn(64, 96, generator=gen) * 1e-3,
            "exp_avg_sq": torch.rand(64, 96, generator=gen) * 1e-6,
        }
        for i in range(n_layers)
    }
    opt = {"state": opt_state, "param_groups": [{"lr": 1e-3, "params": list(range(n_layers))}]}
    return {"model": model, "optimizer": opt, "step": 7}


def test_state_api_reads_device_flags_once_per_checkpoint_not_per_tensor(monkeypatch):
    """Quantize (keyframe and delta) and decode a 12-layer state: no per-tensor host read,
    and one batched read of every flag and fingerprint per checkpoint."""
    reads = HostReads()
    batched: list[int] = []
    real_read = state_fingerprints.read_device_scalars

    def counted_read(scalars, *buffers):
        batched.append(len(scalars))
        with reads.pause():  # its one copy per device is the intended sync
            return real_read(scalars, *buffers)

    monkeypatch.setattr(state_fingerprints, "read_device_scalars", counted_read)
    # Patch the classes, not the registered instances: undoing a patch of a method on an
    # instance leaves the bound method behind as an instance attribute, which would hide
    # later class-level patches (other tests') from the registry's codecs.
    for cls in {type(get_codec(name)) for name in codec_names()}:
        for meth in ("encode", "encode_with", "decode"):
            monkeypatch.setattr(cls, meth, _paused(reads, getattr(cls, meth)))
    kf_state = _training_state(12)
    state = _training_state(12)
    rules = [
        ("optimizer/state/*/exp_avg", "int8"),
        ("optimizer/state/*/exp_avg_sq", {"codec": "log2", "bits": 8, "min_numel": 0}),
    ]
    with reads:
        kf = tw_triton.quantize_state_dict(kf_state, rules=rules, bits=8, block=64)
        ref = tw_triton.dequantize_state_dict(kf)
        q = tw_triton.quantize_state_dict(state, reference=ref, rules=rules, bits=8, block=64)
        back = tw_triton.dequantize_state_dict(q, reference=ref)
    assert reads.count == 0, reads.where[:3]
    coded = [e for e in q.entries.values() if e.codec != "exact"]
    assert len(coded) >= 36, "the state should hold many coded tensors"
    # One batched read per quantize (flags + fingerprints) and one per delta decode
    # (fingerprints); none for the keyframe decode, which has no flag to read.
    assert len(batched) == 3, batched
    assert batched[1] >= 2 * len(coded) - 12  # flags of every coded tensor + delta fingerprints
    assert back["step"] == 7


# Issue 29, item 11: a restore to CUDA leaves AdamW's 0-dim ``step`` tensors on the CPU, as
# torch.optim's own load_state_dict does (capturable=False), so that later steps do not read
# each one back from the GPU. "meta" stands in for the GPU: decoding to it is a real device
# move on a machine without one.


def _adamw_state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def test_optimizer_steps_decode_on_the_host_and_everything_else_on_the_device():
    model, opt = _adamw_state()
    q = tw_triton.quantize_state_dict({"model": model.state_dict(), "optim": opt.state_dict(), "step": 7})
    steps = {f"optim/state/{i}/step" for i in range(4)}
    from tw_triton.state.decode import host_leaf_paths

    assert host_leaf_paths(q) == steps
    back = tw_triton.dequantize_state_dict(q, device="meta")
    for i, s in back["optim"]["state"].items():
        assert s["step"].device.type == "cpu" and s["step"].dim() == 0, i
        assert float(s["step"]) == float(opt.state_dict()["state"][i]["step"])
        assert s["exp_avg"].device.type == "meta" and s["exp_avg_sq"].device.type == "meta", i
    assert all(t.device.type == "meta" for t in back["model"].values())


def test_only_optimizer_steps_stay_on_the_host(monkeypatch):
    """A ``step`` outside an optimizer's ``state``, or not 0-dim, goes to the device; the
    spy on ``Tensor.to`` sees every decoded tensor but the optimizer's steps moved."""
    model, opt = _adamw_state()
    sd = opt.state_dict()
    sd["state"][0]["step"] = torch.tensor([1.0, 2.0])  # not 0-dim: not a torch.optim step
    state = {"optim": sd, "other": {"state": {0: {"step": torch.tensor(3.0)}}}, "step": torch.tensor(4.0)}
    q = tw_triton.quantize_state_dict(state)
    moved: list[tuple[torch.Size, str]] = []
    real_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if out.device.type == "meta":
            moved.append((tuple(self.shape), str(out.dtype)))
        return out

    monkeypatch.setattr(torch.Tensor, "to", spy)
    back = tw_triton.dequantize_state_dict(q, device="meta")
    assert back["optim"]["state"][0]["step"].device.type == "meta"
    assert [back["optim"]["state"][i]["step"].device.type for i in (1, 2, 3)] == ["cpu"] * 3
    assert back["other"]["state"][0]["step"].device.type == "meta"  # no param_groups beside it
    assert back["step"].device.type == "meta"
    assert ((), "torch.float32") in moved and (2,) in [s for s, _ in moved]


def test_torch_optim_keeps_a_cpu_step_where_it_is_unless_capturable():
    """The rule mirrored: load_state_dict moves exp_avg to the parameter's device but leaves
    a non-capturable group's step as given; a capturable group's step it moves itself."""
    for capturable, want in ((False, "cpu"), (True, "meta")):
        model, opt = _adamw_state()  # a capturable AdamW cannot step on the CPU
        sd = opt.state_dict()
        sd["param_groups"][0]["capturable"] = capturable
        for s in sd["state"].values():
            s["step"] = s["step"].cpu()
        model = model.to("meta")
        fresh = torch.optim.AdamW(model.parameters(), capturable=capturable)
        fresh.load_state_dict(sd)
        for p in model.parameters():
            assert fresh.state[p]["exp_avg"].device.type == "meta"
            assert fresh.state[p]["step"].device.type == want, capturable


def test_malformed_skeletons_place_nothing_on_the_host():
    from tw_triton.qstate import QuantizedState
    from tw_triton.state.decode import host_leaf_paths

    for skeleton in (
        None,
        {"dict": "x"},
        {"dict": [("param_groups", 1), ("state", {"dict": [(0, {"dict": [("step", 5)]}), 3]})]},
        {
            "list": [
                {
                    "dict": [
                        ("param_groups", []),
                        ("state", {"dict": [(0, {"dict": [("step", {"tensor": 1})]})]}),
                    ]
                }
            ]
        },
    ):
        q = QuantizedState(entries={}, skeleton=skeleton, checkpoint_id="c")
        assert host_leaf_paths(q) == set(), skeleton


# Issue 29, item 4: on a GPU the int64-offset check (tests/_offsets64.py) uses real
# allocations, since Triton's launcher rejects the shifted pointers the interpreter takes.
# Its planner, its index math and its placement run here; the kernels at those offsets on
# a GPU are checked by the kernel tests there (test_int64_offsets_past_2_31_and_2_32_elements).


def _offsets64():
    return importlib.import_module("_offsets64")


def test_offset_windows_cross_the_32_bit_limits():
    o64 = _offsets64()
    for w in o64.windows():
        assert w.elem0 % w.block == 0 and w.row0 >= 0
        assert w.elem0 + 2 * w.tile <= w.start < w.n, w  # two whole tiles, then the tail
        assert w.n - w.elem0 == w.m and w.m % w.tile != 0
        elem = torch.empty(0, dtype=w.dtype).element_size()
        assert w.elem0 < 2**31 * (w.start // 2**31) < w.n or w.first_byte >= 2**31, w
        assert (w.n - 1) * elem >= 2**32  # the last element's byte offset needs 33 bits
    crossings = sorted({w.start for w in o64.windows()})
    assert crossings == [2**31, 2**32, 2**33 + 2**31, 2**37]
    [blockwise] = [w for w in o64.windows() if w.start == 2**37]
    assert blockwise.row0 >= 2**31  # the block index itself past int32
    [codes] = [w for w in o64.windows() if w.start == 2**33 + 2**31]
    assert codes.bits == 2 and codes.first_byte >= 2**31


def test_device_windows_are_those_an_80_gb_gpu_can_allocate():
    o64 = _offsets64()
    device = o64.device_windows()
    # Every window but the block-index one, with the parameters of a GPU grid variant.
    kept = [w for w in o64.windows() if w.start != 2**37]
    assert [(w.bits, w.dtype, w.start) for w in device] == [(w.bits, w.dtype, w.start) for w in kept]
    h100_free = 78 * o64.GIB
    for op in ("encode", "decode"):
        run, reasons = o64.plan(op, device, h100_free)
        assert run == device and reasons == []
        assert max(o64.bytes_needed(op, w) for w in device) < 44 * o64.GIB
        big = [w for w in o64.windows() if w.start == 2**37][0]
        assert o64.bytes_needed(op, big) > 128 * o64.GIB


def test_offset_plan_names_the_windows_that_do_not_fit():
    o64 = _offsets64()
    run, reasons = o64.plan("encode", o64.device_windows(), 20 * o64.GIB)
    assert [(w.bits, w.start) for w in run] == [(8, 2**31), (4, 2**31), (2, 2**31), (2, 2**32)]
    assert len(reasons) == 3 and all(r.startswith("not run: window (bits ") for r in reasons)
    assert "GiB free" in reasons[0] and "20.0 GiB free" in reasons[-1]
    run, reasons = o64.plan("decode", o64.device_windows(), o64.GIB)
    assert run == [] and len(reasons) == len(o64.device_windows())


@pytest.mark.parametrize("op", ["encode", "decode"])
def test_real_placement_allocates_what_the_planner_counts_and_detects_a_misplaced_read(op, monkeypatch):
    """The ``real`` placement on small windows, as on a GPU: every buffer a full-size
    allocation, the planner's bytes exactly what it allocates, each window like the torch
    path's; and a launch that reads one block off (what a wrapped offset does) differs."""
    o64 = _offsets64()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    allocated: list[int] = []
    real_place = o64.place

    def counting(data, offset, total, dev, placement):
        out = real_place(data, offset, total, dev, placement)
        allocated.append(out[0].numel() * out[0].element_size())
        assert out[0].numel() == total and torch.equal(out[1].cpu(), data)
        return out

    monkeypatch.setattr(o64, "place", counting)
    gen = torch.Generator().manual_seed(0)
    for w in o64.small_windows():
        allocated.clear()
        assert o64.check_window(op, w, device, "real", gen), w
        assert sum(allocated) == o64.bytes_needed(op, w), w

    name = "launch_quantize" if op == "encode" else "launch_dequantize"
    real_launch = getattr(o64, name)

    def off_by_one_block(*args):
        first = args[0]
        return real_launch(first[args[6] :], *args[1:])  # the first buffer read one block off

    monkeypatch.setattr(o64, name, off_by_one_block)
    assert not o64.check_window(op, o64.small_windows()[0], device, "real", gen)


kbitmask = importlib.import_module("tw_triton.kernels.bitmask")


@pytest.mark.parametrize("numel", [0, 1, 4096 * 3 + 5])
def test_bitmask_kernel_wrappers_read_nothing_back_given_the_count(monkeypatch, numel):
    """With the count of non-zero elements given (the state API reads it in its one batched
    read), the encode sizes ``values`` without a host read; the decode needs none."""
    reads = HostReads()
    launches = []
    real = kbitmask.launch_tiles

    def counted(kernel, pointers, n, *scalars, device):
        launches.append(n)
        with reads.pause():  # the interpreter itself is no part of the GPU path
            return real(kernel, pointers, n, *scalars, device=device)

    monkeypatch.setattr(kbitmask, "launch_tiles", counted)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x[1::3] = 0
    nnz = int(torch.count_nonzero(x))
    with reads:
        mask, values = kbitmask.bitmask_encode(x, nnz)
        out = kbitmask.bitmask_decode(mask, values, numel)
    assert reads.count == 0, reads.where
    assert launches == ([] if numel == 0 else [numel] * 4)
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))


kbitmask_grouped = importlib.import_module("tw_triton.kernels.bitmask_grouped")


def test_the_grouped_bitmask_encode_reads_nothing_back(monkeypatch):
    """The counts the save read back size the outputs: the grouped encode's launcher (two
    grouped launches and the scan between them) reads nothing back."""
    reads = HostReads()
    launches = []
    real = kbitmask_grouped.launch_grouped

    def counted(kernel, *args, **kwargs):
        launches.append(kernel)
        with reads.pause():  # the interpreter itself is no part of the GPU path
            return real(kernel, *args, **kwargs)

    monkeypatch.setattr(kbitmask_grouped, "launch_grouped", counted)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=gen).to(torch.bfloat16) for n in (0, 1, 4096 * 3 + 5, 4096)]
    for x in xs:
        x[1::3] = 0
    nnzs = [int(torch.count_nonzero(x)) for x in xs]
    with reads:
        got = kbitmask_grouped.bitmask_encode_grouped(xs, nnzs)
    assert reads.count == 0, reads.where
    assert len(launches) == 2
    for x, (_, values) in zip(xs, got):
        assert torch.equal(values.view(torch.int16), x[x != 0].view(torch.int16))


def test_sparse_choice_on_a_device_state_reads_counts_with_the_flags(monkeypatch):
    """A device state's sparse candidates are counted into the one batched read (forced
    onto that path here, on the CPU): no read per tensor."""
    from tw_triton.state import encode as state_encode

    reads = HostReads()
    batched: list[int] = []
    real_read = state_fingerprints.read_device_scalars

    def counted_read(scalars, *buffers):
        batched.append(len(scalars))
        with reads.pause():
            return real_read(scalars, *buffers)

    monkeypatch.setattr(state_fingerprints, "read_device_scalars", counted_read)
    monkeypatch.setattr(state_encode, "decided_after_sync", lambda on_host: True)
    for cls in {type(get_codec(name)) for name in codec_names()}:
        for meth in ("encode", "encode_with", "encode_counted", "encode_counted_many", "decode"):
            if hasattr(cls, meth):
                monkeypatch.setattr(cls, meth, _paused(reads, getattr(cls, meth)))
    gen = torch.Generator().manual_seed(4)
    state = {
        f"w{i}": torch.randn(64, 96, generator=gen) * (torch.rand(64, 96, generator=gen) < 0.5)
        for i in range(6)
    }
    with reads:
        q = tw_triton.quantize_state_dict(state, rules="exact")
    assert reads.count == 0, reads.where[:3]
    assert batched == [12]  # two counts per tensor
    assert {e.codec for e in q.entries.values()} == {"bitmask"}
