"""Acceptance 3: every kernel variant compiles ahead of time for sm_80 and sm_90, and its PTX
has the properties bit-exactness and bandwidth depend on.

Variants (the bitmask kernels are listed at their test below): encode and decode x bits 8/4/2 x blocks 32/128/4096 x fp32/fp16/bf16 (input dtype
for encode, output dtype for decode) x without/with a reference x main/tail launch x
sm_80/sm_90 (see ``_ptx.all_variants``). Compiling runs in two child processes, since this
session runs kernels under the interpreter (see ``_ptx``'s docstring).
"""

from __future__ import annotations

import re

import _ptx
import pytest

VARIANTS = _ptx.all_variants()

# An instruction reading the program id must produce a 64-bit value: a widening convert, a
# widening multiply(-add), or a 64-bit op.
_WIDE = re.compile(r"^(cvt\.[su]64\.[su]32|(mul|mad)\.wide\.[su]32|\w+\.([su]64|b64))$")


@pytest.fixture(scope="module")
def ptx_facts(tmp_path_factory) -> dict[str, dict]:
    return _ptx.compile_in_children(tmp_path_factory.mktemp("ptx"), processes=2)


def _ops(facts: dict, prefix: str) -> dict[str, int]:
    return {op: n for op, n in facts["opcodes"].items() if op.startswith(prefix)}


def test_no_kernel_needs_an_allocator_or_more_shared_memory_than_a_launch_gets(ptx_facts: dict) -> None:
    """What a launch on a GPU needs beyond the cubin: a kernel compiled with global scratch
    memory fails at launch ("no allocator was set": the library never calls
    ``triton.set_allocator``), and shared memory over 48 KiB needs an opt-in. Every variant
    needs neither (at most 32 KiB of shared memory, a bitmask scatter's, under triton 3.6 and 3.9)."""
    assert len(ptx_facts) == len(_ptx.every_variant())
    for label, facts in ptx_facts.items():
        assert facts["global_scratch_bytes"] == 0, label
        assert facts["shared_bytes"] <= 48 << 10, (label, facts["shared_bytes"])


# Packed 16-bit integer arithmetic (add.s16x2 and the like). LLVM forms it from int32
# arithmetic on byte codes; ptxas 12.8 (bundled with triton 3.6) compiled one such add with
# its immediate -1 dropped to 0 for one pair of lanes in eight, so the first H100 run decoded
# log2 bits=8 to bf16 wrong (docs/gpu-validation.md). Conversions (cvt.*x2) and abs.f16x2
# (a bit clear) are not integer arithmetic.
_PACKED_INT = re.compile(r"^(?!cvt\.)(?!abs\.f16x2$)\w+\.[a-z0-9.]*[su]16x2\b")


def test_no_kernel_does_packed_16_bit_integer_arithmetic(ptx_facts: dict) -> None:
    assert _PACKED_INT.match("add.s16x2") and _PACKED_INT.match("sub.u16x2")
    assert not _PACKED_INT.match("cvt.rn.f16x2.f32") and not _PACKED_INT.match("abs.f16x2")
    for label, facts in ptx_facts.items():
        packed = sorted(op for op in facts["opcodes"] if _PACKED_INT.match(op))
        assert packed == [], (label, packed)


def test_variant_list_covers_the_acceptance_grid() -> None:
    seen = {(v.op, v.bits, v.block, v.dtype, v.ref_dtype is None, v.masked, v.cc) for v in VARIANTS}
    assert len(seen) == len(VARIANTS) == 2 * 3 * 3 * 3 * 2 * 2 * 2
    assert {v.ref_dtype for v in VARIANTS} == {None, "fp32", "bf16"}
    assert sum(_ptx.sass_checked(v) for v in VARIANTS) == 3 * 3 * 2


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.label)
def test_variant_compiles_to_exact_vectorized_ptx(ptx_facts: dict, variant: _ptx.Variant) -> None:
    facts = ptx_facts[variant.label]
    ops = facts["opcodes"]

    # Compiled all the way through ptxas for the requested architecture.
    assert facts["cubin_bytes"] > 0
    assert facts["ptx_target"].startswith(f"sm_{variant.cc}"), facts["ptx_target"]

    # Correctly rounded division only (div.full.f32 is up to 2 ulp off).
    assert not _ops(facts, "div.full") and not _ops(facts, "div.approx"), _ops(facts, "div")
    if variant.op == "encode":
        assert ops.get("div.rn.f32", 0) > 0

    # No fused multiply-add anywhere; float multiplies and adds carry an explicit .rn so
    # ptxas may not contract them either.
    assert not [op for op in ops if op.startswith("fma")], ops
    assert not [op for op in ops if re.match(r"mad\.(rn|rz|rm|rp|f)", op)], ops
    assert "mul.f32" not in ops and "add.f32" not in ops and "sub.f32" not in ops
    if variant.op == "decode":
        assert ops.get("mul.rn.f32", 0) > 0
        if variant.ref_dtype is not None:
            assert ops.get("add.rn.f32", 0) > 0

    # What actually runs: the decode's multiply and add stay two instructions in SASS.
    if _ptx.sass_checked(variant):
        sass = facts["sass_opcodes"]
        assert sass.get("FMUL", 0) > 0 and sass.get("FADD", 0) > 0, sass
        assert not [op for op in sass if "FMA" in op], sass

    # Subnormals are kept (torch on CPU keeps them): no flush-to-zero variants.
    assert not [op for op in ops if ".ftz" in op], ops

    # 64-bit address arithmetic: the program id is widened before it is multiplied.
    assert facts["ctaid_regs"] >= 1
    assert facts["ctaid_uses"], "program id register never read"
    narrow = [op for op in facts["ctaid_uses"] if not _WIDE.match(op)]
    assert not narrow, f"program id used in 32-bit arithmetic: {narrow}"

    if variant.masked:
        return  # the one tail program: bounds masks may split its accesses
    loads = _ops(facts, "ld.global")
    stores = _ops(facts, "st.global")
    if variant.op == "encode":
        # The input streams (x and ref) are read with 16-byte vector loads only.
        assert set(loads) == {"ld.global.v4.b32"}, loads
        # Packed codes leave as words of at least 4 bytes per thread, never byte stores.
        assert not [op for op in stores if op.endswith((".b8", ".b16"))], stores
        widest = {8: "st.global.v4.b32", 4: "st.global.v2.b32", 2: "st.global.b32"}[variant.bits]
        assert widest in stores, stores
    else:
        # Codes (the main input stream) come in words of at least 4 bytes per thread.
        assert not [op for op in loads if op.endswith((".b8", ".b16"))], loads
        widest = {8: "ld.global.v4.b32", 4: "ld.global.v2.b32", 2: "ld.global.b32"}[variant.bits]
        assert widest in loads, loads
        if variant.ref_dtype is not None:
            assert "ld.global.v4.b32" in loads, loads
        # The decoded tile is written with 16-byte vector stores only.
        assert set(stores) == {"st.global.v4.b32"}, stores


LOG2_VARIANTS = _ptx.log2_variants()


@pytest.mark.parametrize("variant", LOG2_VARIANTS, ids=lambda v: v.label)
def test_log2_variant_compiles_to_exact_vectorized_ptx(ptx_facts: dict, variant: _ptx.Variant) -> None:
    """The second-moment codec's kernels: the same rules as the blockwise ones."""
    facts = ptx_facts[variant.label]
    ops = facts["opcodes"]
    assert facts["cubin_bytes"] > 0
    assert facts["ptx_target"].startswith(f"sm_{variant.cc}"), facts["ptx_target"]
    assert not _ops(facts, "div.full") and not _ops(facts, "div.approx"), _ops(facts, "div")
    assert ops.get("div.rn.f32", 0) > 0  # step = (hi - lo) / N, and the encoder's quotient
    assert not [op for op in ops if op.startswith("fma")], ops
    assert not [op for op in ops if re.match(r"mad\.(rn|rz|rm|rp|f)", op)], ops
    assert "mul.f32" not in ops and "add.f32" not in ops and "sub.f32" not in ops
    assert not [op for op in ops if ".ftz" in op], ops
    # int32 -> fp32 conversions round to nearest, as torch's do on the CPU.
    assert ops.get("cvt.rn.f32.s32", 0) > 0, ops
    if variant.op == "log2-decode":
        assert ops.get("mul.rn.f32", 0) > 0 and ops.get("add.rn.f32", 0) > 0, ops
        # fp32 -> int32 truncates, as torch's .to(torch.int32) does.
        assert ops.get("cvt.rzi.s32.f32", 0) > 0, ops
    assert facts["ctaid_uses"], "program id register never read"
    narrow = [op for op in facts["ctaid_uses"] if not _WIDE.match(op)]
    assert not narrow, f"program id used in 32-bit arithmetic: {narrow}"
    if variant.masked:
        return
    loads = _ops(facts, "ld.global")
    stores = _ops(facts, "st.global")
    if variant.op == "log2-encode":
        assert "ld.global.v4.b32" in loads and not [op for op in loads if op.endswith((".b8", ".b16"))], loads
        assert not [op for op in stores if op.endswith((".b8", ".b16"))], stores
    else:
        assert not [op for op in loads if op.endswith((".b8", ".b16"))], loads
        assert set(stores) == {"st.global.v4.b32"}, stores


TEMPORAL_VARIANTS = _ptx.temporal_variants()


@pytest.mark.parametrize("variant", TEMPORAL_VARIANTS, ids=lambda v: v.label)
def test_temporal_variant_compiles_to_exact_vectorized_ptx(ptx_facts: dict, variant: _ptx.Variant) -> None:
    """The temporal codec's kernels: the change's rounded quotient by an fp32 estimate and
    one exact correction in 32-bit integers (no division: a long software routine per
    element), the log2 rules for the absolute fallback, vectorized main launches."""
    facts = ptx_facts[variant.label]
    ops = facts["opcodes"]
    assert facts["cubin_bytes"] > 0
    assert facts["ptx_target"].startswith(f"sm_{variant.cc}"), facts["ptx_target"]
    assert not _ops(facts, "div.full") and not _ops(facts, "div.approx"), _ops(facts, "div")
    assert ops.get("div.rn.f32", 0) > 0  # the absolute fallback's step (and quotient)
    assert not [op for op in ops if op.startswith("fma")], ops
    assert not [op for op in ops if re.match(r"mad\.(rn|rz|rm|rp|f)", op)], ops
    assert "mul.f32" not in ops and "add.f32" not in ops and "sub.f32" not in ops
    assert not [op for op in ops if ".ftz" in op], ops
    assert ops.get("cvt.rn.f32.s32", 0) > 0, ops
    if variant.op == "temporal-encode":
        # The rounded change (|d| + S // 2) // S: estimated in fp32, corrected by m - q * S
        # modulo 2**32 (its true value fits an int32), never divided in integers, and no
        # 64-bit multiply left per element.
        assert not [op for op in ops if re.match(r"(div|rem)\.[su](32|64)", op)], ops
        assert ops.get("mul.lo.s32", 0) + ops.get("mul.lo.u32", 0) > 0 and ops.get("mul.rn.f32", 0) > 0, ops
        assert "mul.lo.s64" not in ops and "mad.lo.s64" not in ops, ops
    else:
        assert ops.get("cvt.rzi.s32.f32", 0) > 0, ops
        # r + q * S in 64 bits; the absolute level's multiply and add.
        assert ops.get("mad.lo.s64", 0) + ops.get("mul.lo.s64", 0) > 0, ops
        assert ops.get("mul.rn.f32", 0) > 0 and ops.get("add.rn.f32", 0) > 0, ops
    assert facts["ctaid_uses"], "program id register never read"
    narrow = [op for op in facts["ctaid_uses"] if not _WIDE.match(op)]
    assert not narrow, f"program id used in 32-bit arithmetic: {narrow}"
    if variant.masked:
        return
    loads, stores = _ops(facts, "ld.global"), _ops(facts, "st.global")
    assert not [op for op in loads if op.endswith((".b8", ".b16"))], loads
    assert not [op for op in stores if op.endswith((".b8", ".b16"))], stores
    if variant.op == "temporal-encode":
        assert loads.get("ld.global.v4.b32", 0) >= 2 and "st.global.v4.b32" in stores, (loads, stores)
    else:
        assert set(stores) == {"st.global.v4.b32"}, stores


@pytest.mark.parametrize("variant", _ptx.check_variants(), ids=lambda v: v.label)
def test_temporal_check_variant_compiles_to_integer_ptx(ptx_facts: dict, variant: _ptx.Variant) -> None:
    """The temporal code check before a load's decode: integer comparisons only (no float
    arithmetic, so no rounding to agree on), 64-bit offsets, one predicated store of the
    flag; the single kernel's main loads vectorized (the grouped one assumes no alignment
    of a file's codes, which follow their bounds, and stores an int64 flag per tensor)."""
    facts = ptx_facts[variant.label]
    ops = facts["opcodes"]
    assert facts["cubin_bytes"] > 0
    assert facts["ptx_target"].startswith(f"sm_{variant.cc}"), facts["ptx_target"]
    assert not [op for op in ops if re.match(r"(add|sub|mul|div|fma|mad|cvt)\.\w*f(16|32|64)\b", op)], ops
    assert facts["ctaid_uses"], "program id register never read"
    narrow = [op for op in facts["ctaid_uses"] if not _WIDE.match(op)]
    assert not narrow, f"program id used in 32-bit arithmetic: {narrow}"
    stores = _ops(facts, "st.global")
    grouped = variant.op.startswith("grouped-")
    assert set(stores) == {"st.global.b64" if grouped else "st.global.b32"}, stores
    assert sum(stores.values()) == 1, stores
    if not variant.masked and not grouped:
        loads = _ops(facts, "ld.global")
        assert loads.get("ld.global.v4.b32", 0) >= 1, loads


GROUPED_VARIANTS = _ptx.grouped_variants()


@pytest.mark.parametrize("variant", GROUPED_VARIANTS, ids=lambda v: v.label)
def test_grouped_variant_compiles_to_exact_vectorized_ptx(ptx_facts: dict, variant: _ptx.Variant) -> None:
    """The kernels a save of many tensors launches (issue 29, item 6): the grouped encode
    keeps the single-tensor encode's rules (its tensors' addresses come from the table,
    declared 16-byte aligned, so whole tiles still load 16-byte vectors); the fingerprint
    is integer work on sampled elements."""
    facts = ptx_facts[variant.label]
    ops = facts["opcodes"]
    assert facts["cubin_bytes"] > 0
    assert facts["ptx_target"].startswith(f"sm_{variant.cc}"), facts["ptx_target"]
    assert not [op for op in ops if ".ftz" in op], ops
    assert not [op for op in ops if op.startswith("fma")], ops
    assert not _ops(facts, "div.full") and not _ops(facts, "div.approx"), _ops(facts, "div")
    assert facts["ctaid_uses"], "program id register never read"
    narrow = [op for op in facts["ctaid_uses"] if not _WIDE.match(op)]
    assert not narrow, f"program id used in 32-bit arithmetic: {narrow}"
    if variant.op == "fingerprint":
        assert "st.global.b64" in _ops(facts, "st.global"), ops
        return
    if variant.op == "grouped-copy":
        if not variant.masked:  # bytes move as 16-byte vectors both ways
            assert set(_ops(facts, "ld.global")) == {"ld.global.b64", "ld.global.v4.b32"}, ops
            assert set(_ops(facts, "st.global")) == {"st.global.v4.b32"}, ops
        return
    assert "mul.f32" not in ops and "add.f32" not in ops and "sub.f32" not in ops
    if variant.op == "grouped-decode":
        # A multiply then an add, each rounded; codes in words, the output in vectors.
        assert ops.get("mul.rn.f32", 0) > 0 and ops.get("add.rn.f32", 0) > 0, ops
        if not variant.masked:
            loads, stores = _ops(facts, "ld.global"), _ops(facts, "st.global")
            assert not [op for op in loads if op.endswith((".b8", ".b16"))], loads
            assert "ld.global.v4.b32" in loads, loads
            assert set(stores) == {"st.global.v4.b32"}, stores
        return
    if variant.op == "grouped-update-decode":
        check_grouped_update_decode(ptx_facts, variant)
        return
    assert ops.get("div.rn.f32", 0) > 0
    if variant.op == "grouped-log2-decode":
        check_grouped_log2_decode(ptx_facts, variant)
        return
    if variant.op == "grouped-temporal-decode":
        check_grouped_temporal_decode(ptx_facts, variant)
        return
    if variant.op in ("grouped-log2-encode", "grouped-temporal-encode"):
        assert ops.get("cvt.rn.f32.s32", 0) > 0, ops
    if variant.op == "grouped-update-encode":
        # u = m / (sqrt(v_hat) + eps): a correctly rounded root, add and division, as torch.
        assert ops.get("sqrt.rn.f32", 0) > 0 and ops.get("add.rn.f32", 0) > 0, ops
        assert not [op for op in ops if op.startswith("sqrt.") and op != "sqrt.rn.f32"], ops
    if variant.op == "grouped-temporal-encode":
        # As the single temporal kernel: the rounded change estimated in fp32 and corrected
        # in 32-bit integers, never divided in integers.
        assert not [op for op in ops if re.match(r"(div|rem)\.[su](32|64)", op)], ops
        assert ops.get("mul.lo.s32", 0) + ops.get("mul.lo.u32", 0) > 0 and ops.get("mul.rn.f32", 0) > 0, ops
        assert "mul.lo.s64" not in ops and "mad.lo.s64" not in ops, ops
    # The flag: one atomic max per program, on 64-bit integers.
    assert [op for op in ops if op.startswith("atom.") and op.endswith("max.s64")], ops
    if variant.masked:
        return
    loads = _ops(facts, "ld.global")
    stores = _ops(facts, "st.global")
    # Table reads are scalar 64-bit loads; the input streams are 16-byte vectors only.
    assert set(loads) == {"ld.global.b64", "ld.global.v4.b32"}, loads
    assert not [op for op in stores if op.endswith((".b8", ".b16"))], stores
    if variant.op == "grouped-encode":
        widest = {8: "st.global.v4.b32", 4: "st.global.v2.b32", 2: "st.global.b32"}[variant.bits]
        assert widest in stores, stores
    if variant.op == "grouped-temporal-encode":  # a byte per element, in 16-byte vectors
        assert "st.global.v4.b32" in stores, stores


def check_grouped_update_decode(ptx_facts: dict, variant: _ptx.Variant) -> None:
    """A load's blockwise-update decode over a table: the blockwise decode's multiply,
    then ``sqrt(v_hat) + eps`` and the product, each correctly rounded (``sqrt.rn``, no
    other root, no division), no flag, and 16-byte vectors for whole tiles."""
    ops = ptx_facts[variant.label]["opcodes"]
    assert ops.get("sqrt.rn.f32", 0) > 0 and ops.get("add.rn.f32", 0) > 0, ops
    assert ops.get("mul.rn.f32", 0) >= 2 * ops["sqrt.rn.f32"], ops  # u = q * scale, then u * den
    assert not [op for op in ops if op.startswith("sqrt.") and op != "sqrt.rn.f32"], ops
    assert not [op for op in ops if op.startswith(("div.", "atom."))], ops
    if variant.masked:
        return
    loads, stores = _ops(ptx_facts[variant.label], "ld.global"), _ops(ptx_facts[variant.label], "st.global")
    assert not [op for op in loads if op.endswith((".b8", ".b16"))], loads
    assert "ld.global.v4.b32" in loads, loads
    assert set(stores) == {"st.global.v4.b32"}, stores


# The arithmetic of the log2 decode: the step's conversion and rounded quotient, the
# level's multiply and add, the truncation back to a bit pattern.
LOG2_DECODE_ARITHMETIC = ("cvt.rn.f32.s32", "div.rn.f32", "mul.rn.f32", "add.rn.f32", "cvt.rzi.s32.f32")


def check_grouped_log2_decode(ptx_facts: dict, variant: _ptx.Variant) -> None:
    """A keyframe's second-moment decode over a table: the single log2 decode's
    arithmetic, instruction for instruction, no flag, and 16-byte vector stores for whole
    tiles."""
    ops = ptx_facts[variant.label]["opcodes"]
    assert ops.get("mul.rn.f32", 0) > 0 and ops.get("add.rn.f32", 0) > 0, ops
    assert ops.get("cvt.rzi.s32.f32", 0) > 0 and ops.get("cvt.rn.f32.s32", 0) > 0, ops
    assert not [op for op in ops if op.startswith("atom.")], ops
    if variant.masked:
        return
    single = _ptx.Variant("log2-decode", variant.bits, variant.block, variant.dtype, None, False, variant.cc)
    single_ops = ptx_facts[single.label]["opcodes"]
    arithmetic = {op: ops.get(op, 0) for op in LOG2_DECODE_ARITHMETIC}
    assert arithmetic == {op: single_ops.get(op, 0) for op in LOG2_DECODE_ARITHMETIC}
    loads, stores = _ops(ptx_facts[variant.label], "ld.global"), _ops(ptx_facts[variant.label], "st.global")
    assert not [op for op in loads if op.endswith((".b8", ".b16"))], loads
    assert set(stores) == {"st.global.v4.b32"}, stores


# The arithmetic of the temporal decode: the change r + q * S in 64-bit integers, the
# absolute level's conversions, rounded quotient, multiply and add.
TEMPORAL_DECODE_ARITHMETIC = (
    "mad.lo.s64",
    "mul.lo.s64",
    "cvt.rn.f32.s32",
    "div.rn.f32",
    "mul.rn.f32",
    "add.rn.f32",
    "cvt.rzi.s32.f32",
)


def check_grouped_temporal_decode(ptx_facts: dict, variant: _ptx.Variant) -> None:
    """The closed-loop advance's temporal decode over a table: the single temporal decode's
    arithmetic, instruction for instruction (the change in integers only, the absolute
    level correctly rounded), no flag, and 16-byte vectors for whole tiles."""
    ops = variant_ops = ptx_facts[variant.label]["opcodes"]
    assert ops.get("mad.lo.s64", 0) + ops.get("mul.lo.s64", 0) > 0, ops
    assert ops.get("cvt.rzi.s32.f32", 0) > 0 and ops.get("cvt.rn.f32.s32", 0) > 0, ops
    assert not [op for op in ops if op.startswith("atom.")], ops
    if variant.masked:
        return
    single = _ptx.Variant("temporal-decode", 4, variant.block, "fp32", "fp32", False, variant.cc)
    single_ops = ptx_facts[single.label]["opcodes"]
    arithmetic = {op: variant_ops.get(op, 0) for op in TEMPORAL_DECODE_ARITHMETIC}
    assert arithmetic == {op: single_ops.get(op, 0) for op in TEMPORAL_DECODE_ARITHMETIC}
    loads, stores = _ops(ptx_facts[variant.label], "ld.global"), _ops(ptx_facts[variant.label], "st.global")
    # The table in 64-bit scalars, a row's bounds in 32-bit ones, codes and reference in
    # 16-byte vectors; the output in 16-byte vectors only.
    assert set(loads) == {"ld.global.b64", "ld.global.b32", "ld.global.v4.b32"}, loads
    assert set(stores) == {"st.global.v4.b32"}, stores


# Item 5 of issue 29: bit-exactness on subnormals is proven for triton >= 3.6 only (older
# versions lowered ``tl.div_rn`` to ``div.rn.ftz.f32``). The PTX rules above check the
# installed triton; the guard below refuses the older ones at the first CUDA tensor coded.


@pytest.mark.parametrize("version", ["3.5.1", "3.2.0", "2.3.0", "3.5.0+git1234", "nightly"])
def test_triton_guard_refuses_versions_before_3_6(version: str) -> None:
    from tw_triton.errors import CheckpointError
    from tw_triton.ops.backends.triton import check_triton_version

    with pytest.raises(CheckpointError, match=re.escape(f"triton {version} is installed")) as info:
        check_triton_version(version)
    assert "triton>=3.6" in str(info.value)


@pytest.mark.parametrize("version", ["3.6.0", "3.6.0+git5a4c1f2", "3.9.0", "3.10.1", "4.0.0"])
def test_triton_guard_accepts_3_6_and_later(version: str) -> None:
    from tw_triton.ops.backends.triton import check_triton_version

    check_triton_version(version)


def test_triton_guard_runs_before_the_kernels_are_returned(monkeypatch) -> None:
    import triton

    from tw_triton.errors import CheckpointError
    from tw_triton.ops.backends import triton_launch as backend

    monkeypatch.setattr(backend, "_version_checked", [])
    monkeypatch.setattr(triton, "__version__", "3.5.0")
    with pytest.raises(CheckpointError, match="triton 3.5.0 is installed"):
        backend.kernels()
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert backend.kernels().__name__.endswith("kernels")
    assert backend._version_checked == [True]


def test_the_installed_triton_is_the_one_the_ptx_rules_prove() -> None:
    """The PTX checks (no ``.ftz`` anywhere, ``div.rn.f32``) ran with this triton, which
    the guard accepts."""
    import triton

    from tw_triton.ops.backends.triton import check_triton_version

    check_triton_version(triton.__version__)


BITMASK_VARIANTS = _ptx.bitmask_variants()


def test_bitmask_variant_list_covers_every_kernel() -> None:
    assert {v.op for v in BITMASK_VARIANTS} == set(_ptx.BITMASK_OPS)
    assert len(BITMASK_VARIANTS) == (3 * 2 + 1) * 2 * 2


@pytest.mark.parametrize("variant", BITMASK_VARIANTS, ids=lambda v: v.label)
def test_bitmask_variant_compiles_to_integer_vectorized_ptx(ptx_facts: dict, variant: _ptx.Variant) -> None:
    """The sparse codec's kernels move bit patterns: no float instruction at all (so no
    rounding, no NaN canonicalization), int64 addressing, 16-byte vectors on the dense
    streams (the input of the encode, the output of the decode)."""
    facts = ptx_facts[variant.label]
    ops = facts["opcodes"]
    assert facts["cubin_bytes"] > 0
    assert facts["ptx_target"].startswith(f"sm_{variant.cc}"), facts["ptx_target"]
    floats = [op for op in ops if re.search(r"\.(f16|bf16|f32|f64)(x2)?(\.|$)", op)]
    assert not floats, floats
    assert not [op for op in ops if ".ftz" in op], ops
    assert facts["ctaid_uses"], "program id register never read"
    narrow = [op for op in facts["ctaid_uses"] if not _WIDE.match(op)]
    assert not narrow, f"program id used in 32-bit arithmetic: {narrow}"
    # The tile's start in ``values`` and its count are int64.
    if variant.op in ("bitmask-scatter", "bitmask-gather"):
        assert "ld.global.b64" in ops, ops
    else:
        assert "st.global.b64" in ops, ops
    if variant.masked:
        return
    loads, stores = _ops(facts, "ld.global"), _ops(facts, "st.global")
    if variant.op in ("bitmask-mask", "bitmask-scatter"):
        assert "ld.global.v4.b32" in loads, loads
        assert not [op for op in loads if op.endswith((".b8", ".b16"))], loads
    if variant.op == "bitmask-mask":
        assert not [op for op in stores if op.endswith(".b8")], stores
    if variant.op == "bitmask-gather":
        assert "st.global.v4.b32" in stores and "st.global.b64" not in stores, stores
        assert not [op for op in stores if op.endswith((".b8", ".b16", ".b32")) and ".v" not in op], stores


SPARSITY_VARIANTS = _ptx.sparsity_variants()


@pytest.mark.parametrize("variant", SPARSITY_VARIANTS, ids=lambda v: v.label)
def test_sparsity_count_variant_compiles_to_integer_ptx(ptx_facts: dict, variant: _ptx.Variant) -> None:
    """The grouped count of a save's sparse candidates compares bit patterns: no float
    instruction at all (``-0.0`` and NaN are values), int64 addressing, the counts added
    with 64-bit atomics, the tile read as 16-byte vectors in the main launch."""
    facts = ptx_facts[variant.label]
    ops = facts["opcodes"]
    assert facts["cubin_bytes"] > 0
    assert facts["ptx_target"].startswith(f"sm_{variant.cc}"), facts["ptx_target"]
    floats = [op for op in ops if re.search(r"\.(f16|bf16|f32|f64)(x2)?(\.|$)", op)]
    assert not floats, floats
    assert facts["ctaid_uses"], "program id register never read"
    narrow = [op for op in facts["ctaid_uses"] if not _WIDE.match(op)]
    assert not narrow, f"program id used in 32-bit arithmetic: {narrow}"
    atomics = [op for op in ops if op.startswith(("atom.", "red.")) and op.endswith(("add.u64", "add.s64"))]
    assert atomics, ops
    assert "ld.global.b64" in ops, ops  # the table
    if not variant.masked:
        # The tile in vectors, then one element per thread (the one before its word of 16
        # elements): the tile is not read a second time.
        loads = _ops(facts, "ld.global")
        assert "ld.global.v4.b32" in loads, loads
        assert loads.get("ld.global.b16", 0) + loads.get("ld.global.b32", 0) == 1, loads


STATISTICS_VARIANTS = _ptx.statistics_variants()


@pytest.mark.parametrize("variant", STATISTICS_VARIANTS, ids=lambda v: v.label)
def test_delta_statistics_variant_compiles_to_exact_ptx(ptx_facts: dict, variant: _ptx.Variant) -> None:
    """The grouped statistics of a save's ``max_error`` bits choice: only correctly rounded
    float operations (the difference, the reciprocal, the products, ``floor``), no
    flush-to-zero, int64 addressing; the maxima raised with 64-bit atomic maxima of bit
    patterns, the sums added with 64-bit atomic adds; the tile read as 16-byte vectors in
    the main launch."""
    facts = ptx_facts[variant.label]
    ops = facts["opcodes"]
    assert facts["cubin_bytes"] > 0
    assert facts["ptx_target"].startswith(f"sm_{variant.cc}"), facts["ptx_target"]
    assert not [op for op in ops if ".ftz" in op], ops
    assert not [op for op in ops if op.startswith("fma") or re.match(r"mad\.(rn|rz|rm|rp|f)", op)], ops
    assert "mul.f32" not in ops and "add.f32" not in ops and "sub.f32" not in ops, ops
    assert not _ops(facts, "div.full") and not _ops(facts, "div.approx"), _ops(facts, "div")
    assert facts["ctaid_uses"], "program id register never read"
    narrow = [op for op in facts["ctaid_uses"] if not _WIDE.match(op)]
    assert not narrow, f"program id used in 32-bit arithmetic: {narrow}"
    if variant.ref_dtype is not None:
        assert ops.get("sub.rn.f32", 0) > 0, ops
    atomics = [op for op in ops if op.startswith(("atom.", "red."))]
    if variant.op == "delta-statistics-sums":
        # 1 / max(top, FLT_MIN) correctly rounded, times the scale, times each value; the
        # non-negative level truncated to an integer (its floor), not floored as a float.
        assert ops.get("div.rn.f32", 0) > 0 and ops.get("mul.rn.f32", 0) > 0, ops
        assert ops.get("cvt.rzi.s32.f32", 0) > 0 and not _ops(facts, "cvt.rmi"), ops
        assert atomics and all(op.endswith(("add.u64", "add.s64")) for op in atomics), atomics
    else:
        assert not _ops(facts, "div."), ops  # no float division: maxima of bit patterns
        assert atomics and all(op.endswith("max.s64") for op in atomics), atomics
    if not variant.masked:
        loads = _ops(facts, "ld.global")
        assert "ld.global.v4.b32" in loads, loads
        assert not [op for op in loads if op.endswith((".b8", ".b16"))], loads


SPARSE_GROUPED_VARIANTS = _ptx.sparse_grouped_variants()


def test_sparse_grouped_variant_list_covers_both_passes() -> None:
    assert {v.op for v in SPARSE_GROUPED_VARIANTS} == set(_ptx.SPARSE_GROUPED_OPS)
    assert len(SPARSE_GROUPED_VARIANTS) == 2 * 2 * 2 * 2


@pytest.mark.parametrize("variant", SPARSE_GROUPED_VARIANTS, ids=lambda v: v.label)
def test_sparse_grouped_variant_compiles_to_integer_vectorized_ptx(
    ptx_facts: dict, variant: _ptx.Variant
) -> None:
    """The grouped bitmask encode moves bit patterns: no float instruction at all (``-0.0``
    and NaN are values), int64 addressing, the table and the counts (or their scan) as
    64-bit words, the tile read as 16-byte vectors in the main launch; the mask pass
    stores its mask bytes wider than one byte at a time."""
    facts = ptx_facts[variant.label]
    ops = facts["opcodes"]
    assert facts["cubin_bytes"] > 0
    assert facts["ptx_target"].startswith(f"sm_{variant.cc}"), facts["ptx_target"]
    floats = [op for op in ops if re.search(r"\.(f16|bf16|f32|f64)(x2)?(\.|$)", op)]
    assert not floats, floats
    assert not [op for op in ops if ".ftz" in op], ops
    assert facts["ctaid_uses"], "program id register never read"
    narrow = [op for op in facts["ctaid_uses"] if not _WIDE.match(op)]
    assert not narrow, f"program id used in 32-bit arithmetic: {narrow}"
    assert "ld.global.b64" in ops, ops  # the table (and the scan)
    if variant.op == "sparse-mask-grouped":
        assert "st.global.b64" in ops, ops  # the tile's count
    if variant.masked:
        return
    loads, stores = _ops(facts, "ld.global"), _ops(facts, "st.global")
    assert "ld.global.v4.b32" in loads, loads
    assert not [op for op in loads if op.endswith((".b8", ".b16"))], loads
    if variant.op == "sparse-mask-grouped":
        assert not [op for op in stores if op.endswith(".b8")], stores
