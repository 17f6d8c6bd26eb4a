"""Every op of the "cuda" backend, launched through triton's JIT for sm_80 and sm_90 on
this CPU-only machine (see ``_jit_launch``): the launchers' keyword arguments are ones the
installed triton's JIT accepts, and what the JIT compiles for each launch is the PTX that
tests/ops/test_ptx.py checks (the same hash as ``_ptx``'s ahead-of-time compile of that
variant), so the PTX rules hold for the kernels a GPU run compiles. Docs:
docs/gpu-validation.md, "Triton 3.6, the GPU image's version".
"""

from __future__ import annotations

import _jit_launch
import _ptx
import pytest

CASES = [name for name, _, _ in _jit_launch.cases()]


@pytest.fixture(scope="module")
def jit_launches(tmp_path_factory) -> dict[int, dict[str, dict]]:
    return _jit_launch.launch_in_children(tmp_path_factory.mktemp("jit"))


@pytest.mark.parametrize("cc", _ptx.TARGETS)
@pytest.mark.parametrize("case", CASES)
def test_launches_compile_through_the_jit_to_the_checked_ptx(jit_launches: dict, case: str, cc: int) -> None:
    result = jit_launches[cc][case]
    launches, expected = result["launches"], result["expected"]
    assert [e["label"] for e in expected], "a case with no expected variant checks nothing"
    assert len(launches) == len(expected), (
        f"{case}: {len(launches)} launches ({[k['kernel'] for k in launches]}), "
        f"expected {[e['label'] for e in expected]}"
    )
    for got, want in zip(launches, expected):
        assert got["ftz"] == 0, f"{case}: {got['kernel']} has flush-to-zero instructions"
        assert got["ptx"] == want["ptx"], (
            f"{case}: the JIT compiled {got['kernel']} to other PTX than the checked variant {want['label']}"
        )


def test_every_backend_op_is_launched() -> None:
    """The cases call each op the "cuda" backend serves with a kernel (a new op needs a
    case); the ops it serves with torch's CUDA ops launch none."""
    import inspect

    from tw_triton.ops.backends.triton import BACKEND, TORCH_OPS

    source = inspect.getsource(_jit_launch.cases)
    missing = [
        op for op, fn in BACKEND.items() if op not in TORCH_OPS and f"backend.{fn.__name__}(" not in source
    ]
    assert not missing, missing
    assert TORCH_OPS <= BACKEND.keys()
    for op in TORCH_OPS:  # no kernel behind them
        assert "kernels()" not in inspect.getsource(BACKEND[op]), op
