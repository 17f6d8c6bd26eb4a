"""prepare() runs ahead the kernel variants the first keyframe and delta launch.

Without a GPU the kernels' device type is set to the CPU's. Where launches are not grouped
(the CPU as it is) the codec ops are spied on: each call is reduced to what Triton
specializes a launch on (op, dtypes, bits, block, and per launch of the row tiles whether
it is masked and which integer arguments are multiples of 16 or 1; not the largest code,
``qmax``, a runtime value of the encode kernels), and
prepare must make exactly the calls the saves make. Where they are grouped (a device; here
forced for CPU tensors, as tests/checkpointing/test_launches_per_save.py does) every
kernel launch is recorded as Triton specializes it, and the saves must launch nothing
prepare did not."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tw_triton import Checkpointer, kernel_variants, ops
from tw_triton.kernel_variants import TILE_ELEMENTS, representative_numel, save_variants
from tw_triton.state import encode as state_encode


def _launches(n, block):
    """The row-tile launches of an ``n``-element op (kernels/tiles.py), as specialized."""
    rows = max(1, TILE_ELEMENTS // block)
    full = n // (rows * block)
    out = []
    if full:
        out.append(("full", n % 16 == 0, n == 1))
    if full * rows * block < n:
        row0 = full * rows
        out.append(("tail", n % 16 == 0, n == 1, row0 % 16 == 0, row0 == 1))
    return tuple(out)


def _dt(t):
    return None if t is None else t.dtype


@pytest.fixture
def launches(monkeypatch):
    """Every codec op call, reduced to its specialization."""
    seen: set = set()
    real = {
        name: getattr(ops, name)
        for name in ("quantize_blockwise", "dequantize_blockwise", "quantize_log2", "dequantize_log2")
    }

    def qb(x, reference, bits, block, *, out=None, qmax=None):
        seen.add(("qb", x.dtype, _dt(reference), bits, block, _launches(x.numel(), block)))
        return real["quantize_blockwise"](x, reference, bits, block, out=out, qmax=qmax)

    def db(codes, scales, numel, bits, block, reference, dtype, *, out=None):
        seen.add(("db", _dt(reference), dtype, bits, block, _launches(numel, block)))
        return real["dequantize_blockwise"](codes, scales, numel, bits, block, reference, dtype, out=out)

    def ql(x, bits, block, *, out=None):
        seen.add(("ql", x.dtype, bits, block, _launches(x.numel(), block)))
        return real["quantize_log2"](x, bits, block, out=out)

    def dl(codes, lo, hi, numel, bits, block, dtype, *, out=None):
        seen.add(("dl", dtype, bits, block, _launches(numel, block)))
        return real["dequantize_log2"](codes, lo, hi, numel, bits, block, dtype, out=out)

    for name, fn in (
        ("quantize_blockwise", qb),
        ("dequantize_blockwise", db),
        ("quantize_log2", ql),
        ("dequantize_log2", dl),
    ):
        monkeypatch.setattr(ops, name, fn)
    # A GPU codes each tensor alone; the CPU would code small ones of a kind together.
    monkeypatch.setattr(state_encode, "batch_key", lambda *a: None)
    return seen


def _adamw_state(model, m_dtype=torch.float32, v_dtype=torch.float32):
    """An AdamW-like optimizer state dict for ``model``'s tensors."""
    moments = {
        k: {"exp_avg": v.to(m_dtype).clone(), "exp_avg_sq": v.float().square().to(v_dtype)}
        for k, v in model.items()
    }
    state = dict(enumerate(moments.values()))
    return {"state": state, "param_groups": [{"params": list(state), "lr": 1e-3}]}


def _state(dtype, m_dtype=torch.float32, v_dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    model = {
        "embed": torch.randn(3 * 4096 + 80, generator=g).to(dtype),  # a masked tail, n % 16 == 0
        "w": torch.randn(40, 4096, generator=g).to(dtype),  # whole tiles only, many of them
        "odd": torch.randn(4099, generator=g).to(dtype),  # n % 16 != 0
        "b": torch.randn(64, generator=g).to(dtype),  # exact: no kernel
    }
    return model, _adamw_state(model, m_dtype, v_dtype)


@pytest.mark.parametrize(
    ("rules", "delta", "dtype", "moments"),
    [
        ("smallest", "closed", torch.float32, (torch.float32, torch.float32)),
        ("small", "open", torch.bfloat16, (torch.float32, torch.float32)),
        ("smallest", "none", torch.float16, (torch.float32, torch.float32)),
        # exp_avg in bfloat16: its u is float32 all the same
        ("smallest", "closed", torch.bfloat16, (torch.bfloat16, torch.float32)),
        # exp_avg_sq in bfloat16 is no partner: exp_avg gets the fallback's blockwise codes
        ("smallest", "closed", torch.bfloat16, (torch.bfloat16, torch.bfloat16)),
    ],
)
def test_prepare_launches_exactly_what_the_first_keyframe_and_delta_launch(
    tmp_path, monkeypatch, launches, rules, delta, dtype, moments
):
    monkeypatch.setattr(kernel_variants, "KERNEL_DEVICE_TYPE", "cpu")
    compiled = []
    real = kernel_variants.compile_variant
    monkeypatch.setattr(kernel_variants, "compile_variant", lambda v, d: compiled.append(v) or real(v, d))
    model, opt = _state(dtype, *moments)
    with Checkpointer(
        tmp_path, keyframe_every=5, rules=rules, delta=delta, async_write=False, fsync=False
    ) as ck:
        ck.prepare(model=model, optimizer=opt)
        ahead = set(launches)
        launches.clear()
        ck.save(0, model=model, optimizer=opt)
        ck.save(1, model={k: v * 1.001 for k, v in model.items()}, optimizer=opt)
    assert compiled and len(compiled) == len(set(compiled))
    if rules == "smallest":
        # Its weight deltas choose their bits from the values (max_error): prepare compiles
        # every candidate, the saves launch some of them.
        assert launches <= ahead and {v[3] for v in ahead} - {v[3] for v in launches}
    else:
        assert ahead == launches


def test_save_variants_count_only_the_kernels_device():
    model, opt = _state(torch.float32)
    state = {"step": 0, "model": model, "optimizer": opt}
    assert save_variants(state, "smallest", bits=8, block=128, delta_mode="closed") == []
    cpu = save_variants(state, "smallest", bits=8, block=128, delta_mode="closed", device_type="cpu")
    # A closed loop decodes every delta; without a reference only the keyframe's lossy
    # entries (log2-temporal's keyframe codes) of delta-coded tensors are decoded.
    assert {v.has_ref for v in cpu} == {False, True} and all(v.decode for v in cpu if v.has_ref)
    assert {v.codec for v in cpu if v.decode and not v.has_ref} <= {"log2"}


@pytest.mark.parametrize("block", [32, 128, 4096])
def test_a_representative_length_launches_as_the_tensor(block):
    for n in [1, 15, 16, 4096, 4097, 4096 * 31 + 5, 4096 * 32, 4096 * 33 + 48, 4096 * 1000 + 7, 10**7 + 3]:
        r = representative_numel(n, block)
        assert r <= 32 * max(block, TILE_ELEMENTS) and _launches(r, block) == _launches(n, block), n


@pytest.mark.cuda
@pytest.mark.parametrize("delta", ["closed", "open"])
def test_after_prepare_the_first_saves_compile_nothing(tmp_path, monkeypatch, delta):
    """On a GPU (where a save's launches are grouped): every kernel the first keyframe and
    deltas launch is already in the process's cache after prepare (Triton calls its cache
    hook on every miss)."""
    import triton

    model, opt = _state(torch.bfloat16)
    model = {k: v.cuda() for k, v in model.items()}
    opt["state"] = {i: {k: v.cuda() for k, v in s.items()} for i, s in opt["state"].items()}
    misses = []
    with Checkpointer(tmp_path, keyframe_every=5, delta=delta, fsync=False) as ck:
        ck.prepare(model=model, optimizer=opt)  # the grouped path's kernels on a GPU
        monkeypatch.setattr(
            triton.knobs.runtime, "jit_cache_hook", lambda *a, **kw: misses.append(kw) and False
        )
        for step in range(3):
            ck.save(step, model={k: v * (1 + step / 1000) for k, v in model.items()}, optimizer=opt)
        ck.flush()
    assert misses == []


# Every Triton kernel of the package: the grouped ones a device save launches, and the
# single-tensor ones of the entries it encodes alone.
KERNELS = [
    ("quantize_blockwise_grouped", "quantize_blockwise_grouped_kernel"),
    ("quantize_blockwise_update_grouped", "quantize_blockwise_update_grouped_kernel"),
    ("quantize_log2_grouped", "quantize_log2_grouped_kernel"),
    ("quantize_log2_temporal_grouped", "quantize_log2_temporal_grouped_kernel"),
    ("copy_grouped", "copy_grouped_kernel"),
    ("dequantize_blockwise_grouped", "dequantize_blockwise_grouped_kernel"),
    ("dequantize_log2_temporal_grouped", "dequantize_log2_temporal_grouped_kernel"),
    ("dequantize_log2_grouped", "dequantize_log2_grouped_kernel"),
    ("dequantize_blockwise_update_grouped", "dequantize_blockwise_update_grouped_kernel"),  # loads only
    ("fingerprint", "fingerprint_kernel"),
    ("quantize_blockwise", "quantize_blockwise_kernel"),
    ("dequantize_blockwise", "dequantize_blockwise_kernel"),
    ("quantize_log2", "quantize_log2_kernel"),
    ("dequantize_log2", "dequantize_log2_kernel"),
    ("quantize_log2_temporal", "quantize_log2_temporal_kernel"),
    ("dequantize_log2_temporal", "dequantize_log2_temporal_kernel"),
    ("bitmask", "bitmask_mask_kernel"),
    ("bitmask", "bitmask_scatter_kernel"),
    ("bitmask", "bitmask_popcount_kernel"),
    ("bitmask", "bitmask_gather_kernel"),
    ("sparsity_counts_grouped", "sparsity_counts_grouped_kernel"),
    ("delta_statistics_grouped", "delta_statistics_grouped_kernel"),
    ("bitmask_grouped", "bitmask_mask_grouped_kernel"),
    ("bitmask_grouped", "bitmask_scatter_grouped_kernel"),
]


def _specialization(value):
    """What Triton specializes a positional argument on: a tensor's dtype and 16-byte
    alignment, an int's being 1 or a multiple of 16; a float (``eps``, the encode's
    ``qmax``) only on being one."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, int) and not isinstance(value, bool):
        return ("int", value == 1, value % 16 == 0)
    if isinstance(value, float):
        return "fp32"
    return value


class _RecordedKernel:
    def __init__(self, kernel, name, seen):
        self.kernel, self.name, self.seen = kernel, name, seen
        # The pointers a kernel does not specialize on alignment (as the JIT, interpreted or not).
        options = getattr(kernel, "kwargs", None) or {}
        unaligned = options.get(
            "do_not_specialize_on_alignment", getattr(kernel, "do_not_specialize_on_alignment", [])
        )
        self.arg_names = list(kernel.arg_names)
        self.unaligned = {self.arg_names[i] if isinstance(i, int) else i for i in unaligned or []}

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            key = tuple(
                (a.dtype, None)
                if name in self.unaligned and isinstance(a, torch.Tensor)
                else _specialization(a)
                for name, a in zip(self.arg_names, args)
            )
            # Keyword arguments are constexprs (and launch options): specialized by value
            # (a grouped kernel's LOG_T, a table bucket, included).
            self.seen.add((self.name, key, tuple(sorted(kwargs.items()))))
            return launch(*args, **kwargs)

        return run


@pytest.fixture
def kernel_launches(monkeypatch):
    """A device save forced on CPU tensors (grouped launches, every op on its Triton
    backend, run by the interpreter), with each kernel launch recorded as specialized."""
    import importlib

    from tw_triton import deltas
    from tw_triton.ops.backends import triton as triton_backend

    seen: set = set()
    monkeypatch.setattr(kernel_variants, "KERNEL_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(state_encode, "groups_launches", lambda device: True)
    monkeypatch.setattr(deltas, "groups_launches", lambda device: True)
    for module, name in KERNELS:
        mod = importlib.import_module(f"tw_triton.kernels.{module}")
        monkeypatch.setattr(mod, name, _RecordedKernel(getattr(mod, name), name, seen))
    with contextlib.ExitStack() as stack:
        for op, fn in triton_backend.BACKEND.items():
            stack.enter_context(ops.using(op, "cpu", fn))
        yield seen


def _small_state(dtype):
    g = torch.Generator().manual_seed(1)
    model = {
        "embed": torch.randn(2 * 4096 + 80, generator=g).to(dtype),  # whole tiles and a tail
        "w": torch.randn(5, 4096, generator=g).to(dtype),  # whole tiles only
        "odd": torch.randn(4099, generator=g).to(dtype),
        "b": torch.randn(64, generator=g).to(dtype),  # exact
        # Mostly zeros: the keyframe, which stores it exact, stores it by the bitmask codec.
        "sparse": torch.zeros(4096 + 48, dtype=dtype).index_fill_(0, torch.tensor([3, 4000]), 1.0),
    }
    opt = _adamw_state(model)
    # Stored exact, not 16-byte aligned: the grouped count leaves it out, the single op
    # counts it.
    opt["state"][0]["view"] = torch.randn(3 * 4096 + 9, generator=g).to(dtype)[1:]
    # Sparse and not 16-byte aligned: counted and encoded alone, beside the grouped ones.
    opt["state"][0]["sparse_view"] = torch.zeros(4096 + 9, dtype=dtype).index_fill_(
        0, torch.tensor([5, 70, 900]), 2.0
    )[1:]
    return model, opt


@pytest.mark.parametrize(
    ("rules", "delta", "dtype"),
    [
        ("small", "closed", torch.bfloat16),
        ("smallest", "closed", torch.float32),
        ("small", "open", torch.float16),
        ("smallest", "none", torch.bfloat16),
    ],
)
def test_prepare_launches_the_grouped_kernels_the_first_device_saves_launch(
    tmp_path, kernel_launches, rules, delta, dtype
):
    model, opt = _small_state(dtype)
    with Checkpointer(
        tmp_path, keyframe_every=5, rules=rules, delta=delta, async_write=False, fsync=False
    ) as ck:
        ck.prepare(model=model, optimizer=opt)
        ahead = set(kernel_launches)
        kernel_launches.clear()
        ck.save(0, model=model, optimizer=opt)
        ck.save(1, model={k: v * 1.001 for k, v in model.items()}, optimizer=opt)
    assert kernel_launches, "the saves launched no kernel: the grouped path was not forced"
    names = {key[0] for key in kernel_launches}
    assert "fingerprint_kernel" in names or delta == "none"
    assert names & {"quantize_blockwise_grouped_kernel", "quantize_log2_grouped_kernel"}
    assert "bitmask_mask_kernel" in names and "sparsity_counts_grouped_kernel" in names
    if rules == "smallest":  # the weights' max_error statistics, grouped
        assert "delta_statistics_grouped_kernel" in names
    # The sparse tensor, counted and encoded grouped (the encode's two passes).
    assert {"sparsity_counts_grouped_kernel", "bitmask_mask_grouped_kernel"} <= names
    assert "bitmask_scatter_grouped_kernel" in names
    assert "bitmask_mask_kernel" in names  # the sparse view, encoded alone
    if delta != "none":  # the float32 second moments' deltas, grouped (log2-temporal)
        assert "quantize_log2_temporal_grouped_kernel" in names
    if delta != "none":  # the keyframe's log2 moments decoded to the deltas' reference, grouped
        assert "dequantize_log2_grouped_kernel" in names
        assert "dequantize_log2_kernel" not in names
    if (rules, delta) == ("smallest", "closed"):  # and decoded over the reference, grouped
        assert "dequantize_log2_temporal_grouped_kernel" in names
        assert "dequantize_log2_temporal_kernel" not in names
    missing = kernel_launches - ahead
    assert not missing, f"the saves launched kernels prepare did not: {sorted(missing, key=str)}"


@pytest.mark.parametrize("delta", ["closed", "open"])
def test_prepare_launches_the_grouped_update_encode_the_first_device_saves_launch(
    tmp_path, kernel_launches, delta
):
    from tw_triton.rules import resolve_rules, rules_as_specs

    model, opt = _small_state(torch.float32)
    specs = rules_as_specs(resolve_rules("smallest", {"model": model, "optimizer": opt}, bits=8, block=128))
    rules = [("*exp_avg", {"codec": "blockwise-update", "bits": 3}), *specs]
    with Checkpointer(
        tmp_path, keyframe_every=5, rules=rules, delta=delta, async_write=False, fsync=False
    ) as ck:
        ck.prepare(model=model, optimizer=opt)
        ahead = set(kernel_launches)
        kernel_launches.clear()
        ck.save(0, model=model, optimizer=opt)
        ck.save(1, model={k: v * 1.001 for k, v in model.items()}, optimizer=opt)
    names = {key[0] for key in kernel_launches}
    assert "quantize_blockwise_update_grouped_kernel" in names
    assert "dequantize_log2_temporal_grouped_kernel" in names  # the delta's partners, grouped
    # Phase two's kernels: the update encode and the partners' decode. (With partners, prepare
    # runs phase one with the partnered entries under their fallback rule, which does not give
    # every table size the save gives: not checked here.)
    phase_two = {"quantize_blockwise_update_grouped_kernel", "dequantize_log2_temporal_grouped_kernel"}
    missing = {k for k in kernel_launches - ahead if k[0] in phase_two}
    assert not missing, f"the saves launched kernels prepare did not: {sorted(missing, key=str)}"


@pytest.mark.parametrize("delta", ["closed"])  # (open: as the grouped test above)
def test_prepare_launches_what_the_default_presets_first_saves_launch(tmp_path, kernel_launches, delta):
    """The CUDA test above, forced on the CPU: the default rules, three saves of a state
    whose weights move. The H100 run found the first saves compiling again the grouped
    kernels prepare had compiled: their flag and output slots are int64 slices of a save's
    scalars, 16-byte aligned or not, and Triton specialized on it."""
    model, opt = _state(torch.bfloat16)
    # Synchronous: the interpreter runs one kernel at a time (the writer thread decodes too).
    with Checkpointer(tmp_path, keyframe_every=5, delta=delta, async_write=False, fsync=False) as ck:
        ck.prepare(model=model, optimizer=opt)
        ahead = set(kernel_launches)
        kernel_launches.clear()
        for step in range(3):
            ck.save(step, model={k: v * (1 + step / 1000) for k, v in model.items()}, optimizer=opt)
        ck.flush()
    assert kernel_launches
    missing = kernel_launches - ahead
    assert not missing, f"the saves launched kernels prepare did not: {sorted(missing, key=str)}"
