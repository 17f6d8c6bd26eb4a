"""The GPU validation script (benchmarks/gpu/) on the CPU: its dry run passes, and each of
its checks fails when what it checks is broken. Also the ``cuda`` marker's rules
(tests/conftest.py): skipped without a GPU, a skip with one is a failure."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import tw_triton.codecs as tw_codecs
import tw_triton.format
from tw_triton.codecs import ExactCodec, get_codec
from tw_triton.codecs.blockwise import BlockwiseCodec
from tw_triton.errors import CheckpointError

REPO = Path(__file__).resolve().parents[2]
GPU_DIR = REPO / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU_DIR))

import _end_to_end  # noqa: E402
import _identity  # noqa: E402


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    if torch.cuda.is_available():
        pytest.skip("the dry run is the no-GPU mode")
    out = tmp_path_factory.mktemp("validate") / "report"
    proc = subprocess.run(
        [sys.executable, str(GPU_DIR / "validate.py"), "--dry-run", "--out", str(out)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, out


def test_dry_run_passes_and_writes_its_report(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "VALIDATION PASSED" in proc.stdout
    result = json.loads((out / "results.json").read_text())
    assert result["dry_run"] is True and result["passed"] is True
    steps = result["steps"]
    assert list(steps) == ["identity", "concurrency", "pytest", "throughput", "end_to_end"]
    assert all(s["status"] == "PASS" for s in steps.values())
    ident = steps["identity"]["data"]
    assert set(ident["codecs"]) >= {"blockwise", "log2"} and "exact" in ident["codecs_without_kernel"]
    assert ident["cases_run"] == ident["cases_planned"] > 50
    assert steps["pytest"]["data"]["collected"] > 0
    assert steps["concurrency"]["data"]["runs"][1]["device_branch_forced"] is True
    summary = (out / "summary.md").read_text()
    assert "Dry run on the CPU" in summary and "| **PASS** |" in summary


def test_results_page_shows_gpu_runs_and_says_not_run_otherwise(dry_run, tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import make_results

    _, out = dry_run
    root = tmp_path / "gpu"
    shutil.copytree(out, root / "cpu-dry-run")
    assert "**Not run.**" in make_results.gpu_section(root), "a dry run is not a GPU result"
    # The same report as if a device had produced it (a fixture: no number here is real).
    data = json.loads((out / "results.json").read_text())
    data["dry_run"] = False
    data["device"]["device_name"] = "Test Device 1"
    for row in data["steps"]["throughput"]["data"]["rows"]:
        row["input_mib"] = 64.0
    (root / "test-device-1").mkdir()
    (root / "test-device-1" / "results.json").write_text(json.dumps(data))
    page = make_results.gpu_section(root)
    assert "Not run" not in page and "### Test Device 1" in page
    assert "(d) ~2.2 GB state" in page and "| blockwise | encode |" in page
    assert page.count("### ") == 1


class _NoisyCodec(BlockwiseCodec):
    """Flips one code bit on every other call: as if the device disagreed with the CPU."""

    name = "noisy-test"
    has_kernel = True
    calls = 0

    def encode(self, x, params, reference):
        enc = super().encode(x, params, reference)
        type(self).calls += 1
        if type(self).calls % 2:
            enc.entry.buffers["codes"][0] ^= 1
        return enc


def test_identity_check_reports_a_byte_difference(request):
    # Registered for this test only: the registry is process-wide.
    tw_codecs.register_codec("noisy-test", _NoisyCodec())
    request.addfinalizer(lambda: tw_codecs.unregister_codec("noisy-test"))
    case = _identity.Case("noisy-test", 8, 32, torch.float32, "finite", "offset", None)
    problems = _identity.run_case(get_codec("noisy-test"), case, torch.device("cpu"), seed=0)
    assert any("buffer 'codes'" in p for p in problems), problems
    report = _identity.run_identity(torch.device("cpu"), dry_run=True, budget_s=60, codecs=["noisy-test"])
    assert report.run == report.planned and len(report.failures) >= report.run


def test_identity_inputs_hit_the_edges():
    case = _identity.Case("blockwise", 4, 128, torch.bfloat16, "adversarial", "offset", torch.float16)
    x, ref = _identity.make_input(case, seed=3)
    assert x.numel() % 128 and x.numel() > 2 * _identity.TILE
    assert torch.isnan(x).any() and torch.isinf(x).any()
    assert ((x != 0) & (x.abs() < torch.finfo(torch.bfloat16).tiny)).any(), "no subnormal"
    assert (x.abs() > torch.finfo(torch.bfloat16).max / 2).any(), "no huge value"
    assert ref is not None and ref.dtype == torch.float16
    view = _identity.lay_out(x, "offset", torch.device("cpu"))
    assert view.data_ptr() % 16 and torch.equal(view.view(torch.int16), x.view(torch.int16))
    t = _identity.lay_out(x[: 3 * 1000], "transposed", torch.device("cpu"))
    assert not t.is_contiguous() and torch.equal(t.reshape(-1).view(torch.int16), x[:3000].view(torch.int16))
    assert (
        _identity.make_input(
            _identity.Case("log2", 2, 32, torch.float32, "nonneg", "contiguous", None), seed=1
        )[0].min()
        >= 0
    )


class _WriteAfterScramble:
    """Orders the concurrency run's threads: each file is written only once the state has
    been overwritten after its save(), and the loop goes on only once it is written.

    Which of the two comes first is otherwise a race between the writer thread and the
    training loop, and with a snapshot that aliases the state it decides what the files
    hold: written during the next save() they hold that save's values, which the next delta
    was coded against, and the aliasing shows only as a value difference; written earlier or
    later, the delta's reference fingerprint differs too, and while the state changes under
    the write, its checksum. Fixed this way, the run is the same on any machine.
    """

    def __init__(self, monkeypatch) -> None:
        self.scrambled = threading.Semaphore(0)
        self.written = threading.Semaphore(0)
        real_write_file = tw_triton.format.write_file
        real_scramble = _end_to_end._scramble

        def write_file_after_scramble(*args, **kwargs):
            self._take(self.scrambled, "the state was never overwritten after a save()")
            try:
                return real_write_file(*args, **kwargs)
            finally:
                self.written.release()

        def scramble_then_write(*args, **kwargs):
            real_scramble(*args, **kwargs)
            self.scrambled.release()
            self._take(self.written, "a save() was never written")

        monkeypatch.setattr(tw_triton.format, "write_file", write_file_after_scramble)
        monkeypatch.setattr(_end_to_end, "_scramble", scramble_then_write)

    @staticmethod
    def _take(sem: threading.Semaphore, what: str) -> None:
        # Only a guard against a hang if the harness changes; no outcome depends on it.
        if not sem.acquire(timeout=120):
            raise AssertionError(f"concurrency run out of step: {what}")


def _aliasing_encode(self, x, params, reference, *rest):
    """An exact codec that keeps the live tensor instead of a copy: the bug to catch."""
    return self.wrap(x.detach()) if x.is_contiguous() else ExactCodec.encode(self, x, params, reference)


def test_concurrency_check_catches_a_snapshot_that_aliases_the_state(tmp_path, monkeypatch):
    """With exact entries holding the live tensors instead of copies, overwriting the state
    after save() changes the files: the check must say so, and count what the library
    refuses to load (the deltas' references) instead of stopping at it."""
    _WriteAfterScramble(monkeypatch)
    ok = _end_to_end.run_concurrency(
        torch.device("cpu"), tmp_path / "ok", size="tiny", saves=3, force_device_branch=True
    )
    assert ok["problem_count"] == 0, ok["problems"]

    monkeypatch.setattr(ExactCodec, "encode_with", _aliasing_encode)
    monkeypatch.setattr(ExactCodec, "encode", _aliasing_encode)
    bad = _end_to_end.run_concurrency(
        torch.device("cpu"), tmp_path / "bad", size="tiny", saves=3, force_device_branch=True
    )
    steps = bad["problem_steps"]
    assert bad["problem_count"] == sum(v["count"] for v in steps.values()) > 0
    assert "step-00000000.tw.safetensors: exact entry" in steps[0]["first"], steps
    assert "differs from the value at save()" in steps[0]["first"], steps
    # The second delta's reference is the first delta, coded against the state at its
    # save(); decoding it starts from the keyframe, which holds the state overwritten after
    # the keyframe's save(): the fingerprint says it is not that reference.
    assert steps[2]["count"] == 1, steps
    assert "does not load (ReferenceMismatchError" in steps[2]["first"], steps


def test_concurrency_check_counts_a_file_that_does_not_load(tmp_path, monkeypatch):
    """A library error while checking a file is one more problem of that file, not the end
    of the run: the other files are still checked."""
    real_read_file = _end_to_end.read_file

    def read_file_failing_step_1(path, *args, **kwargs):
        if path.endswith("step-00000001.tw.safetensors"):
            raise CheckpointError(f"{path}: checksum mismatch (injected)")
        return real_read_file(path, *args, **kwargs)

    monkeypatch.setattr(_end_to_end, "read_file", read_file_failing_step_1)
    out = _end_to_end.run_concurrency(torch.device("cpu"), tmp_path, size="tiny", saves=3)
    assert out["problem_count"] == 1 and list(out["problem_steps"]) == [1], out["problems"]
    assert "step-00000001.tw.safetensors: does not load (CheckpointError" in out["problems"][0]
    assert "checksum mismatch (injected)" in out["problems"][0]


def _run_marker_suite(tmp_path: Path, assume_cuda: bool) -> subprocess.CompletedProcess:
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_marked.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.cuda\n"
        "def test_needs_gpu():\n"
        "    pytest.skip('pretend the device is missing')\n\n"
        "def test_plain():\n"
        "    assert True\n",
        encoding="utf-8",
    )
    env = _env()
    env.pop("TW_TRITON_TEST_ASSUME_CUDA", None)
    if assume_cuda:
        env["TW_TRITON_TEST_ASSUME_CUDA"] = "1"
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "cuda or not cuda",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU side of the marker")
def test_cuda_marker_skips_without_a_gpu_and_fails_a_skip_with_one(tmp_path):
    without = _run_marker_suite(tmp_path, assume_cuda=False)
    assert without.returncode == 0, without.stdout
    assert "1 passed, 1 skipped" in without.stdout
    with_gpu = _run_marker_suite(tmp_path, assume_cuda=True)
    assert with_gpu.returncode == 1, with_gpu.stdout
    assert "1 failed, 1 passed" in with_gpu.stdout
    assert "skipped although a CUDA device is present" in with_gpu.stdout
