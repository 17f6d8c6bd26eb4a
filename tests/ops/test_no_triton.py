"""Without triton installed, everything but the CUDA kernels works.

triton ships wheels for Linux x86_64 and aarch64 only, so pyproject installs it there alone,
and :mod:`tw_triton.ops.backends.triton` imports it on the first CUDA tensor coded. A
subprocess in which ``import triton`` fails (a meta-path finder refusing it, as on a machine
without the package) imports the library, codes CPU tensors with both packed codecs, saves
and loads a checkpoint, and gets a clear :class:`~tw_triton.errors.CheckpointError` from the
CUDA backend.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import sys

    class NoTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTriton())
    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        del sys.modules[name]

    import os, tempfile
    import torch
    import tw_triton
    from tw_triton import ops
    from tw_triton.errors import CheckpointError

    assert "triton" not in sys.modules, "import tw_triton imported triton"
    x = torch.randn(4, 1000)
    q = tw_triton.quantize(x, bits=4, block=64)
    assert tw_triton.dequantize(q).shape == x.shape
    v = torch.rand(3000)
    assert ops.dequantize_log2(*ops.quantize_log2(v, 4, 128), 3000, 4, 128, torch.float32).shape == v.shape
    state = {"w": x, "v": v, "step": torch.tensor(3)}
    qs = tw_triton.quantize_state_dict(state, rules=[("v", {"codec": "log2"})])
    path = os.path.join(tempfile.mkdtemp(), "ck.safetensors")
    tw_triton.save(qs, path)
    back = tw_triton.load(path)
    assert sorted(back) == ["step", "v", "w"] and torch.equal(back["step"], state["step"])
    assert (back["w"] - x).abs().max() < 0.5
    assert "triton" not in sys.modules, "a CPU save/load imported triton"
    try:
        ops.lookup("quantize_blockwise", "cuda")(x, None, 8, 64)
    except CheckpointError as exc:
        assert "triton" in str(exc), exc
        print("ok:", exc)
    else:
        raise AssertionError("the CUDA backend ran without triton")
    """
)


def test_import_and_cpu_checkpoints_work_without_triton():
    run = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ok: coding a CUDA tensor needs triton" in run.stdout
